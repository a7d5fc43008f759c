"""The in-process caches: bounded LRU, off unless followed, and never filled with a value read
before a change that happened meanwhile."""

from __future__ import annotations

from registry.service import FollowedCache


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
