"""The discovery cache's index: a change drops exactly the pages a scan of every cached page
with `may_match` would drop, while looking at far fewer of them."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime

import pytest

from bench.seed import make_doc
from registry.caches import ResultCache
from registry.matching import Facts, anchor_of, facts_of, may_match
from registry.query import RegistryQuery
from registry.registryql import parse_registryql
from tests.db.test_matching import QUERIES, TAGS

# Anchors that are equal in Python but not in jsonb: each must keep its own bucket.
TRICKY = [
    "DISCOVER * WHERE customMetadata.tier = true",  # before 1: its bucket must not take 1's
    "DISCOVER * WHERE customMetadata.tier = 1",
    "DISCOVER * WHERE customMetadata.tier = '1'",
    "DISCOVER * WHERE customMetadata.tier = false",
    "DISCOVER * WHERE customMetadata.tier = 0",
    "DISCOVER * WHERE customMetadata.tier = 1 AND MATCH 'legal'",
    "DISCOVER ToolDefinition",
    "DISCOVER * WITH SERVICE 'MCP'",
    "DISCOVER *",
]


def _pages() -> list[tuple[str, RegistryQuery]]:
    pages = [(label, query) for label, query, _exact in QUERIES]
    pages += [(text, parse_registryql(text)) for text in TRICKY]
    return pages


def _docs(count: int) -> list[str]:
    rng = random.Random(9)
    now = datetime(2026, 11, 26, tzinfo=UTC)
    return [json.dumps(make_doc(i, rng, now)) for i in range(count)]


def _cache(pages: list[tuple[str, RegistryQuery]]) -> ResultCache:
    cache = ResultCache(10_000)
    cache.enabled = True
    for key, query in pages:
        cache.put(key, (query, "[]"), cache.epoch)
    return cache


def _told(doc: str, texts: list[str], rng: random.Random) -> Facts | None:
    """Facts as the keeper gets them: the database's MATCH answers (random here: the index
    must agree with `may_match` whatever they are), or none asked."""
    if rng.random() < 0.3:
        return facts_of(doc)
    return facts_of(doc, asked=texts, matched=[t for t in texts if rng.random() < 0.3])


@pytest.mark.parametrize("pair", [False, True], ids=["new entry", "before and after"])
def test_a_change_drops_exactly_what_a_scan_would(pair: bool) -> None:
    pages = _pages()
    texts = sorted(_cache(pages).match_texts())
    rng = random.Random(3)
    docs = _docs(300)
    moved = 0
    for n in range(200):
        versions = [_told(docs[n], texts, rng)]
        if pair:
            versions.insert(0, _told(docs[n + 100], texts, rng))
        expected = {key for key, query in pages if any(may_match(query, f) for f in versions)}
        cache = _cache(pages)
        cache.entry_changed(versions)
        kept = {key for key, _ in pages if cache.get(key) is not None}
        assert kept == {key for key, _ in pages} - expected, docs[n]
        moved += len(expected)
    assert 0 < moved < 200 * len(pages) / 2  # the changes split the pages


def test_unreadable_facts_drop_every_page() -> None:
    pages = _pages()
    cache = _cache(pages)
    cache.entry_changed([None])
    assert len(cache) == 0


def test_the_index_follows_pages_as_they_come_and_go() -> None:
    pages = _pages()
    cache = _cache(pages)
    texts = cache.match_texts()
    assert {"legal", "invoice"} <= texts
    for key, _query in pages:
        cache.invalidate(key)
    assert cache.match_texts() == set()
    assert (cache._by_anchor, cache._anchors) == ({}, {})
    for key, query in pages:
        cache.put(key, (query, "[]"), cache.epoch)
    assert cache.match_texts() == texts
    cache.clear()
    assert (cache.match_texts(), cache._by_anchor) == (set(), {})


def test_most_queries_have_an_anchor_and_it_is_selective() -> None:
    """Anchors are what make a change cheap: a tag or MATCH query has one, and a random
    document satisfies few of them."""
    anchors = [anchor_of(query) for _, query in _pages()]
    assert sum(a is not None for a in anchors) >= len(anchors) * 0.9
    tag_query = parse_registryql(f"DISCOVER * WHERE tags CONTAINS '{TAGS[0]}' AND sequence > 3")
    assert anchor_of(tag_query) == tag_query.where.exprs[0]  # type: ignore[union-attr]


def test_a_change_asks_about_a_bounded_set_of_texts_the_most_recently_used_first() -> None:
    """Parsing the asked texts is every write's cost: past MATCH_TEXTS_ASKED texts (or
    MATCH_TEXT_CHARS_ASKED characters) the least recently used are not asked about, and an
    entry change drops their pages ("maybe"), while a page asked about and not matched stays."""
    from registry.caches import MATCH_TEXT_CHARS_ASKED, MATCH_TEXTS_ASKED

    cache = ResultCache(10_000)
    cache.enabled = True
    count = MATCH_TEXTS_ASKED + 50
    for i in range(count):
        query = parse_registryql(f"DISCOVER * WHERE MATCH 'word{i}'")
        cache.put(f"page{i}", (query, "[]"), cache.epoch)
    assert cache.get("page0") is not None  # now the most recently used
    asked = cache.match_texts()
    assert len(asked) == MATCH_TEXTS_ASKED
    assert "word0" in asked
    assert f"word{count - 1}" in asked
    assert "word1" not in asked  # the least recently used
    doc = _docs(1)[0]
    cache.entry_changed([facts_of(doc, asked=asked, matched=[])])
    kept = {f"word{i}" for i in range(count) if cache.get(f"page{i}") is not None}
    assert kept == asked

    long = ResultCache(10_000)
    long.enabled = True
    text = "x" * 500
    for i in range(MATCH_TEXT_CHARS_ASKED // 500 + 5):
        query = parse_registryql(f"DISCOVER * WHERE MATCH '{text}{i}'")
        long.put(f"page{i}", (query, "[]"), long.epoch)
    asked = long.match_texts()
    assert sum(map(len, asked)) <= MATCH_TEXT_CHARS_ASKED < sum(map(len, asked)) + 600


def test_a_page_is_asked_about_whole_and_a_smaller_one_further_on_still_fits() -> None:
    from registry.caches import MATCH_TEXT_CHARS_ASKED

    def words(tag: str, count: int) -> list[str]:
        return [f"{tag}{i}" + "y" * 490 for i in range(count)]

    cache = ResultCache(10_000)
    cache.enabled = True
    # In the order they are put: "a" is the most recently used, "c" the least.
    pages = {"c": words("c", 1), "d": words("d", 15), "b": words("b", 15), "a": words("a", 15)}
    for key, texts in pages.items():
        where = " AND ".join(f"MATCH '{t}'" for t in texts)
        cache.put(key, (parse_registryql(f"DISCOVER * WHERE {where}"), "[]"), cache.epoch)
    assert sum(map(len, pages["a"] + pages["b"])) <= MATCH_TEXT_CHARS_ASKED
    assert sum(map(len, pages["a"] + pages["b"] + pages["d"])) > MATCH_TEXT_CHARS_ASKED
    assert cache.match_texts() == set(pages["a"] + pages["b"] + pages["c"])  # d: none of its
