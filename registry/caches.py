"""In-process caches kept true by the durable log (the cache keeper subscribes to it).

All access is from the one Trio thread, with no `await` between a check and its use, so the
caches need no lock. What a change makes stale, and when it is dropped, is decided in one place:
`registry/coherence.py` (`Caches`).
"""

from __future__ import annotations

import functools
import json
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from registry.canonical import canonicalize, with_member
from registry.matching import (
    Facts,
    anchor_may_hold,
    anchor_of,
    facts_of,
    match_texts_in,
    may_match,
)
from registry.query import Expr, RegistryQuery
from registry.store.routing import READ_FLOOR


@dataclass(frozen=True)
class Served:
    """A served entry version: its sequence and exact JSON text, and the entry's unrevoked
    attestations (expiry in ms or None, record JSON), shown while unexpired."""

    sequence: int
    doc: str
    attestations: tuple[tuple[int | None, str], ...] = ()
    origin: str | None = None  # a replica: the DID of the peer registry it was synced from
    stored: bool = True  # `doc` is the version's stored text (not a later anchorState in it)

    @functools.cached_property
    def lineage(self) -> Any:
        """The version's `lineageReference` (None without one), parsed once per served version:
        GET /lineage would otherwise parse the whole document (up to 1 MiB) on every read."""
        return json.loads(self.doc).get("lineageReference")

    @functools.cached_property
    def tagged(self) -> list[Any]:
        """The last text served (`at`) that an entity tag was made for, and that tag: a tag is
        a digest of up to 1 MiB, made once per text rather than on every GET."""
        return [None, None]

    @functools.cached_property
    def _rendered(self) -> list[Any]:
        return [None, None]  # the last shown attestations, and the text served with them

    def at(self, now_ms: int) -> str:
        """The entry as served at `now_ms`: with `verifiableAttestations` listing the
        attestations unexpired then (the stored version holds none: the field is
        registry-managed and never signed). The stored texts are JCS, so the list is spliced
        into the version's text, not parsed and canonicalised again (hostile review: 50
        credentials of 64 KiB of floats took 0.84 s of CPU a GET); the text is kept for the
        next read while the same attestations are shown."""
        shown = tuple(
            doc for expires, doc in self.attestations if expires is None or expires > now_ms
        )
        if not shown:
            return self.doc
        memo = self._rendered
        if memo[0] == shown:
            return str(memo[1])
        listed = "[" + ",".join(shown) + "]"
        try:
            text = with_member(self.doc, "verifiableAttestations", listed)
        except ValueError:  # not JCS as stored (never expected): canonicalised whole
            entry = json.loads(self.doc)
            entry["verifiableAttestations"] = [json.loads(doc) for doc in shown]
            text = canonicalize(entry).decode("utf-8")
        memo[0], memo[1] = shown, text
        return text


K = TypeVar("K")
V = TypeVar("V")


class FollowedCache(Generic[K, V]):
    """An in-process cache kept true by the cache keeper (the log of every process).

    Readers fill it only if no invalidation happened while they read (`epoch`), so a change that
    commits during a lookup can never be overwritten by the older value. It is on only while the
    keeper follows the log live, and it answers a request whose floor (`Registry-Min-Sequence`,
    `READ_FLOOR`) is past `followed`, the log as this process has read it, with a miss: what it
    holds may predate the change the client names. All access is from the one Trio thread, with
    no `await` between a check and its use. Bounded by a count and, with `weigh`, by bytes: the
    least recently used item goes when either is reached.
    """

    def __init__(
        self,
        capacity: int = 50_000,
        *,
        max_bytes: int | None = None,
        weigh: Callable[[V], int] | None = None,
    ) -> None:
        self._items: OrderedDict[K, V] = OrderedDict()
        self._capacity = capacity
        self._max_bytes = max_bytes  # with `weigh`: the bound of the values' summed weights
        self._weigh = weigh
        self._weights: dict[K, int] = {}
        self.bytes = 0
        self.epoch = 0
        self.enabled = False
        self.followed = 0  # every change up to this sequence has been applied to the cache
        self.hits = 0
        self.misses = 0

    def get(self, key: K) -> V | None:
        if not self.enabled:
            return None
        floor = READ_FLOOR.get()
        if floor is not None and floor > self.followed:
            self.misses += 1
            return None
        value = self._items.get(key)
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V, epoch: int) -> None:
        if not self.enabled or epoch != self.epoch:
            return
        self._drop(key)
        self._items[key] = value
        self._added(key, value)
        if self._weigh is not None:
            weight = self._weigh(value)
            self._weights[key] = weight
            self.bytes += weight
        while len(self._items) > self._capacity or (
            self._max_bytes is not None and self.bytes > self._max_bytes and self._items
        ):
            self._drop(next(iter(self._items)))  # the least recently used

    def _drop(self, key: K) -> None:
        if self._items.pop(key, None) is not None:
            self.bytes -= self._weights.pop(key, 0)
            self._removed(key)

    def _added(self, key: K, value: V) -> None:
        """A subclass's hook: `key` is now cached (its indexes follow)."""

    def _removed(self, key: K) -> None:
        """A subclass's hook: `key` is no longer cached."""

    def invalidate(self, key: K) -> None:
        self.epoch += 1
        self._drop(key)

    def touch(self) -> None:
        """A change committed: reads in flight may predate it, so their fills are dropped."""
        self.epoch += 1

    def invalidate_where(self, stale: Callable[[K, V], bool]) -> None:
        self.epoch += 1
        for key in [k for k, v in self._items.items() if stale(k, v)]:
            self._drop(key)

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self.epoch += 1
        for key in list(self._items):
            self._drop(key)

    def statistics(self) -> dict[str, int]:
        return {
            "size": len(self._items),
            "bytes": self.bytes,
            "epoch": self.epoch,
            "enabled": int(self.enabled),
            "hits": self.hits,
            "misses": self.misses,
        }


# What an entry change asks the database about the MATCH texts of the cached pages, at most
# (`ResultCache.match_texts`): PostgreSQL parses ~10 MB of query text a second (2,000 texts of
# ~500 characters: ~100 ms), and every write waits for the answer.
MATCH_TEXTS_ASKED = 256
MATCH_TEXT_CHARS_ASKED = 16 * 1024
MATCH_PAGES_SCANNED = 1024  # pages looked at for them, the most recently used first


def _page_weight(item: tuple[RegistryQuery, str]) -> int:
    """What a cached page holds: its body, and its query three times over (the key, its repr,
    and the parsed query: ~2.5x its text, measured with tracemalloc), plus ~1 KB of the rest.
    A client writes the query, up to the body limit: it is weighed as well as the answer."""
    return 1024 + len(item[1]) + 3 * len(repr(item[0]))


class ResultCache(FollowedCache[str, tuple[RegistryQuery, str]]):
    """Discovery pages by query. An entry change drops only the pages whose query the entry may
    match before or after it (`registry.matching`): any other page is provably unchanged.

    Every write asks this of the cached pages, so the pages are indexed by their query's anchor
    (`anchor_of`, e.g. its MATCH text or a tag it requires): a change tests each distinct anchor
    once and looks only at the pages of those its entry may satisfy, and the MATCH texts of the
    cached queries are counted as pages come and go. The cost of a change is then the number of
    distinct anchors plus the pages it may move, not the size of the cache.

    A change this process wrote has its pages dropped before it is answered (`dropped_for`);
    when its log record then reaches the keeper, every page still cached either survived that
    drop or was read after the commit, so the keeper leaves them (`already_dropped`).
    """

    def __init__(self, capacity: int = 50_000, *, max_bytes: int | None = None) -> None:
        super().__init__(capacity, max_bytes=max_bytes, weigh=_page_weight)
        self._dropped: set[int] = set()
        # Pages by their query's anchor, keyed by its repr: equal expressions may differ in a
        # value's type (1, 1.0 and True are equal in Python, not in jsonb).
        self._anchors: dict[str, str] = {}  # page key → its anchor's repr
        self._by_anchor: dict[str, tuple[Expr | None, set[str]]] = {}
        self._texts: dict[str, tuple[str, ...]] = {}  # page key → its query's MATCH texts
        self._text_pages: Counter[str] = Counter()
        self._text_chars = 0  # of the distinct texts in _text_pages

    def _added(self, key: str, value: tuple[RegistryQuery, str]) -> None:
        query = value[0]
        anchor = anchor_of(query)
        name = repr(anchor)
        self._anchors[key] = name
        self._by_anchor.setdefault(name, (anchor, set()))[1].add(key)
        texts = tuple(match_texts_in(query.where))
        if texts:
            self._texts[key] = texts
            for text in texts:
                if not self._text_pages[text]:
                    self._text_chars += len(text)
                self._text_pages[text] += 1

    def _removed(self, key: str) -> None:
        name = self._anchors.pop(key)
        pages = self._by_anchor[name][1]
        pages.discard(key)
        if not pages:
            del self._by_anchor[name]
        for text in self._texts.pop(key, ()):
            self._text_pages[text] -= 1
            if not self._text_pages[text]:
                del self._text_pages[text]
                self._text_chars -= len(text)

    def dropped_for(self, seq: int) -> None:
        """The pages change `seq` can move are gone, or will be before anything awaits (the
        local write path says so as it starts dropping them)."""
        if self.enabled:
            self._dropped.add(seq)

    def already_dropped(self, seq: int) -> bool:
        """True (once) if `dropped_for(seq)` was said since the cache was last cleared."""
        if seq in self._dropped:
            self._dropped.discard(seq)
            return True
        return False

    def followed_to(self, seq: int) -> None:
        """The keeper has handled every change up to `seq`: forget the older local drops."""
        if self._dropped:
            self._dropped = {s for s in self._dropped if s > seq}

    def clear(self) -> None:
        super().clear()
        self._dropped.clear()

    def entry_changed(self, versions: Sequence[Facts | None]) -> None:
        """`versions`: the facts of the entry's stored documents just before and after the
        change (a new entry has only the latter)."""
        self.epoch += 1
        stale = [
            key
            for anchor, keys in self._by_anchor.values()
            if anchor is None or any(anchor_may_hold(anchor, f) for f in versions)
            for key in keys
            if any(may_match(self._items[key][0], f) for f in versions)
        ]
        for key in stale:
            self._drop(key)

    def entry_changed_as_told(
        self, versions: list[tuple[str, list[str]]] | None, texts: list[str]
    ) -> bool:
        """`entry_changed` for `versions` as `Store.change_versions` reads them (each document
        with those of the asked MATCH `texts` it matches); False, dropping nothing, if there
        are none."""
        if not versions:
            return False
        self.entry_changed([facts_of(doc, asked=texts, matched=m) for doc, m in versions])
        return True

    def match_texts(self) -> set[str]:
        """The MATCH texts the database is asked about for each entry change: those of the
        cached queries, up to MATCH_TEXTS_ASKED texts of MATCH_TEXT_CHARS_ASKED characters in
        all, the most recently used pages' first. Parsing them is the check's cost, and it is
        every write's; a page whose text is not asked about is dropped by every entry change
        (`registry.matching`: "maybe")."""
        if (
            len(self._text_pages) <= MATCH_TEXTS_ASKED
            and self._text_chars <= MATCH_TEXT_CHARS_ASKED
        ):
            return set(self._text_pages)
        asked: set[str] = set()
        chars = 0
        for scanned, key in enumerate(reversed(self._items)):  # most recently used first
            if scanned == MATCH_PAGES_SCANNED:  # every write pays for this loop too
                break
            # A page's texts all or none: a page with one text not asked is dropped anyway.
            new = [text for text in self._texts.get(key, ()) if text not in asked]
            size = sum(map(len, new))
            if len(asked) + len(new) > MATCH_TEXTS_ASKED or chars + size > MATCH_TEXT_CHARS_ASKED:
                continue  # a smaller page further on may still fit
            asked.update(new)
            chars += size
        return asked
