"""Cache coherence: the one owner of what a change makes stale in this process's caches.

Theory of operation. The caches (entry heads, sessions, discovery pages; `registry/caches.py`)
may serve only while every change committed in any process reaches them, so every rule of what
a change drops is here, and it is applied from three places, all of them through `Caches`:

* `observe(records)`: the log actor calls it with every batch it reads, before any subscriber
  (an event stream, the cache keeper) gets it. An entry change, an attestation or an anchor
  state change drops that entry's head; `session.revoked` drops that session. Synchronous, so
  no client can learn of a change and then be served what it replaced.
* `follow(records, store)`: the cache keeper (actors/caches.py) calls it with every batch of the
  log it follows. It drops the discovery pages an entry change can move: the database says which
  cached full-text texts the change's versions match, for up to `CHANGES_CHECKED_AT_ONCE`
  changes read together; a larger backlog clears every page.
* `entry_written(...)` and `wrote(did)`: the use-case that wrote calls them before it answers
  (read your writes), so its own client never sees the state before its write, even while the
  log record is on its way. A local entry version drops its head and its pages at once and
  says so (`ResultCache.dropped_for`), so the keeper does not do the same work again when the
  log record reaches it.

The keeper enables the caches only while its subscription is live (`set_live`): when it is not
(the log actor lost its connection, or the keeper lagged), they are disabled and cleared, and
nothing is served from a cache that might have missed a change. Each cache knows how far the log
has been applied to it (`followed`, moved by `observe`): a GET whose `Registry-Min-Sequence` is
further is a miss, read from the database, since the log record that would drop what the
client's write replaced may not have been read here yet.

All of it runs in the one Trio thread, with no `await` between a check and its use.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Protocol

from registry.caches import FollowedCache, ResultCache, Served
from registry.changes import LogRecord
from registry.matching import facts_of
from registry.store import SessionRecord

log = logging.getLogger(__name__)

CHANGES_CHECKED_AT_ONCE = 64  # a larger batch of changes clears the discovery cache
ITEM_OVERHEAD = 512  # bytes a cached item costs beyond its text (objects, the LRU's node)


class ChangeVersions(Protocol):
    """What coherence reads from the store: which texts each change's versions match."""

    async def change_versions(
        self, changes: list[tuple[int, str]], texts: list[str]
    ) -> dict[int, list[tuple[str, list[str]]]]: ...


def _entry_weight(served: Served) -> int:
    """What a cached entry holds: its version and attestations and, where it shows any, the
    text served with them (`Served.at` keeps it: about as much again)."""
    parts = len(served.doc) + sum(len(a) for _, a in served.attestations)
    return ITEM_OVERHEAD + (2 * parts if served.attestations else parts)


class Caches:
    """The process's caches, kept true by the rules of this module; the use-cases read them."""

    def __init__(self, *, discover_capacity: int = 50_000, max_bytes: int | None = None) -> None:
        # Entries and discovery pages are bounded by bytes too (`limits.cache_mib` each): an
        # entry may be up to 1 MiB, so a count alone bounds nothing (the soak: 50,000 heads).
        self.entries: FollowedCache[str, Served] = FollowedCache(
            max_bytes=max_bytes,
            weigh=_entry_weight,
        )
        self.sessions: FollowedCache[bytes, SessionRecord] = FollowedCache()
        self.results = ResultCache(max(1, discover_capacity), max_bytes=max_bytes)

    def all(self) -> list[FollowedCache[object, object]]:
        return [self.entries, self.sessions, self.results]  # type: ignore[list-item]

    def set_live(self, live: bool) -> None:
        for cache in self.all():
            cache.clear()
            cache.enabled = live

    @property
    def enabled(self) -> bool:
        return self.entries.enabled

    # --- from the log -----------------------------------------------------------------------

    def follows_from(self, head: int) -> None:
        """The log actor starts reading after `head`: nothing cached can predate it."""
        for cache in self.all():
            cache.followed = max(cache.followed, head)

    def observe(self, records: Sequence[LogRecord]) -> None:
        """Drop what `records` changed from the entry and session caches, at once."""
        if records and records[0].seq <= self.entries.followed + 1:  # the log read without a gap
            for cache in self.all():
                cache.followed = max(cache.followed, records[-1].seq)
        for record in records:
            if record.kind == "session.revoked":
                token_hash = record.data.get("tokenHash")
                if isinstance(token_hash, str):  # always, as logout writes it; never fatal here
                    with contextlib.suppress(ValueError):
                        self.sessions.invalidate(bytes.fromhex(token_hash))
            elif record.entry_did is not None and _changes_what_the_entry_serves(record.kind):
                self.entries.invalidate(record.entry_did)

    async def follow(self, records: Sequence[LogRecord], store: ChangeVersions) -> None:
        """Drop the discovery pages the entry changes among `records` can move.

        The entry and session caches dropped these records' changes already (`observe` saw them
        first); records the keeper replays from the store predate its live state, and the caches
        are cleared when they go live."""
        changes = [
            (record.seq, record.entry_did)
            for record in records
            if record.kind.startswith("entry.") and record.entry_did is not None
        ]
        if changes:
            await drop_moved_pages(store, self.results, changes)

    # --- from this process's own writes (read your writes) ----------------------------------

    def wrote(self, did: str) -> None:
        """A change to what entry `did` serves (an attestation, its anchor state) committed."""
        self.entries.invalidate(did)

    async def entry_written(
        self, seq: int, did: str, versions: Sequence[str], store: ChangeVersions
    ) -> None:
        """Entry version `seq` of `did` committed; `versions` are the documents it replaced and
        wrote (the previous head, if any, then the new one)."""
        self.entries.invalidate(did)
        texts = sorted(self.results.match_texts())
        decided = False
        # Said before the await below: the finally drops the pages whatever happens, so the
        # keeper, which may meet this change's log record meanwhile, need not drop them too.
        self.results.dropped_for(seq)
        try:
            if texts:
                # Cached full-text pages: the database says which texts the versions match.
                self.results.touch()
                found = await store.change_versions([(seq, did)], texts)
                decided = self.results.entry_changed_as_told(found.get(seq), texts)
        except Exception:  # the write has committed: answer it whatever this check meets
            log.warning("full-text check of a change failed; its pages are dropped", exc_info=True)
        finally:
            if not decided:  # also when cancelled: no await here
                if len(self.results):
                    self.results.entry_changed([facts_of(v) for v in versions])
                else:  # no page to match the versions against; fills in flight are stale
                    self.results.touch()


def _changes_what_the_entry_serves(kind: str) -> bool:
    """A new version, an attestation added or revoked, an anchor state reached."""
    return kind.startswith(("entry.", "attestation.")) or kind == "anchor.updated"


async def drop_moved_pages(
    store: ChangeVersions, results: ResultCache, changes: list[tuple[int, str]]
) -> None:
    """Drop the pages of `results` that the entry changes `changes` ((seq, did), in log order)
    can move; a change this process wrote (and dropped the pages of) is skipped."""
    results.followed_to(changes[0][0] - 1)
    changes = [(seq, did) for seq, did in changes if not results.already_dropped(seq)]
    if not changes:  # this process wrote them all and dropped their pages then
        return
    results.touch()  # pages being computed now may predate these changes: not cached
    if not len(results):
        return
    if len(changes) > CHANGES_CHECKED_AT_ONCE:
        results.clear()
        return
    texts = sorted(results.match_texts())
    versions = await store.change_versions(changes, texts)
    for seq, _ in changes:
        if not results.entry_changed_as_told(versions.get(seq), texts):
            results.entry_changed([None])  # unreadable (cannot be, after its commit): maybe all
