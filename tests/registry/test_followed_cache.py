"""The in-process caches: bounded LRU, off unless followed, and never filled with a value read
before a change that happened meanwhile."""

from __future__ import annotations

from registry.caches import FollowedCache, ResultCache


def _cache(capacity: int = 3) -> FollowedCache[str, int]:
    cache: FollowedCache[str, int] = FollowedCache(capacity)
    cache.enabled = True
    return cache


def test_the_least_recently_used_item_goes_when_full() -> None:
    cache = _cache()
    for n, key in enumerate("abc"):
        cache.put(key, n, cache.epoch)
    assert cache.get("a") == 0  # now the most recently used
    cache.put("d", 3, cache.epoch)
    assert cache.get("b") is None
    assert [cache.get(k) for k in "acd"] == [0, 2, 3]
    assert len(cache) == 3


def test_a_fill_that_started_before_a_change_is_dropped() -> None:
    cache = _cache()
    epoch = cache.epoch
    cache.touch()  # a change committed while the value was being read
    cache.put("a", 1, epoch)
    assert cache.get("a") is None
    cache.put("a", 2, cache.epoch)
    assert cache.get("a") == 2


def test_off_while_not_followed() -> None:
    cache: FollowedCache[str, int] = FollowedCache(3)
    cache.put("a", 1, cache.epoch)
    assert cache.get("a") is None
    cache.enabled = True
    cache.put("a", 1, cache.epoch)
    cache.enabled = False
    assert cache.get("a") is None


def test_invalidate_where_drops_only_what_it_names() -> None:
    cache = _cache()
    for n, key in enumerate("abc"):
        cache.put(key, n, cache.epoch)
    before = cache.epoch
    cache.invalidate_where(lambda _key, value: value % 2 == 0)
    assert [cache.get(k) for k in "abc"] == [None, 1, None]
    assert cache.epoch > before


def _results() -> ResultCache:
    results = ResultCache(10)
    results.enabled = True
    return results


def test_a_change_whose_pages_this_process_dropped_is_not_dropped_again() -> None:
    """The local write drops its pages before answering; the same change reaching the keeper
    later must not drop the pages read since (they already show it)."""
    results = _results()
    results.dropped_for(7)
    assert results.already_dropped(7)
    assert not results.already_dropped(7)  # once
    assert not results.already_dropped(8)


def test_local_drops_are_forgotten_once_followed_past_or_cleared() -> None:
    results = _results()
    for seq in (3, 5, 9):
        results.dropped_for(seq)
    results.followed_to(5)
    assert not results.already_dropped(3)
    assert not results.already_dropped(5)
    assert results.already_dropped(9)
    results.dropped_for(11)
    results.clear()  # the keeper lost the log: nothing is known any more
    assert not results.already_dropped(11)
    results.enabled = False
    results.dropped_for(12)  # not caching: nothing to remember
    results.enabled = True
    assert not results.already_dropped(12)


def test_a_discovery_page_weighs_its_query_as_well_as_its_answer() -> None:
    """A client writes the query (up to the body limit), and the page keeps it: a large query
    that matches nothing must not pass for a small page under `cache_mib`."""
    from registry.query import Compare, RegistryQuery

    results = ResultCache(1_000, max_bytes=100_000)
    results.enabled = True
    query = RegistryQuery(where=Compare("name", "=", "x" * 30_000))
    results.put(repr(query), (query, "[]"), results.epoch)
    assert results.bytes >= 3 * 30_000
    for i in range(10):  # the byte bound holds: older pages go
        query = RegistryQuery(where=Compare("name", "=", f"{i}" * 30_000))
        results.put(repr(query), (query, "[]"), results.epoch)
    assert results.bytes <= 100_000
