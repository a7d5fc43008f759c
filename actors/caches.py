"""The cache keeper: one subscriber of the log that keeps this process's caches true.

Theory of operation: the caches (entry heads, sessions, discovery pages) may serve only while
every change committed in any process reaches them. The keeper subscribes to the log from its
head at start and, record by record: an entry change drops that entry's head (synchronously, in
the log actor's task, through `Caches.observe`, before any event goes out) and the discovery
pages it can move (the database says which full-text pages, for up to
`CHANGES_CHECKED_AT_ONCE` changes read together; a larger backlog clears the pages); a
`session.revoked` drops that session. The caches are enabled only while the subscription is
live; when it is not (the log actor lost its connection, or the keeper lagged), they are
disabled and cleared, and enabled again once it is live: nothing is served from a cache that
might have missed a change.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Sequence

import trio

from actors.log import Lagged, LogHandle, Subscription
from actors.supervisor import back_off, database_ready
from registry.caches import FollowedCache, ResultCache, Served
from registry.changes import LogRecord
from registry.errors import Unavailable
from registry.outage import ConditionLog
from registry.ratelimit import Backoff
from registry.store import SessionRecord, Store

log = logging.getLogger(__name__)

BACKOFF = Backoff()
# The keeper's own queue: it must not lag behind a burst of changes (each record is small; a
# lag clears every cache, which is correct but costly).
KEEPER_QUEUE = 100_000
CHANGES_CHECKED_AT_ONCE = 64  # a larger batch of changes clears the discovery cache


ITEM_OVERHEAD = 512  # bytes a cached item costs beyond its text (objects, the LRU's node)


class Caches:
    """The process's caches, which the keeper keeps and the use-cases read."""

    def __init__(self, *, discover_capacity: int, max_bytes: int | None = None) -> None:
        # Entries and discovery pages are bounded by bytes too (`limits.cache_mib` each): an
        # entry may be up to 1 MiB, so a count alone bounds nothing (the soak: 50,000 heads).
        self.entries: FollowedCache[str, Served] = FollowedCache(
            max_bytes=max_bytes,
            weigh=lambda served: (
                ITEM_OVERHEAD + len(served.doc) + sum(len(a) for _, a in served.attestations)
            ),
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

    def observe(self, records: Sequence[LogRecord]) -> None:
        """Drop what `records` changed from the entry and session caches, at once (the log
        actor calls this before it hands the records to any subscriber)."""
        for record in records:
            _drop_changed(record, self)


async def run_cache_keeper(
    logs: LogHandle,
    store: Store,
    caches: Caches,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep `caches` true until cancelled; reports started once it follows the log live."""
    started = False
    failures = 0
    outage = ConditionLog("cache keeper")
    ready = database_ready(store, writes=False)
    try:
        while True:
            lagged = unavailable = False
            try:
                after = await logs.head()
                async with (
                    logs.subscribe(after, queue_size=KEEPER_QUEUE) as subscription,
                    trio.open_nursery() as nursery,
                ):
                    nursery.start_soon(_track_live, subscription, caches)
                    nursery.start_soon(_apply, subscription, store, caches)
                    await _wait_live(subscription)
                    failures = 0
                    line = outage.succeeded(trio.current_time())
                    if line is not None:
                        log.info(line)
                    if not started:
                        task_status.started()
                        started = True
            except* Lagged:
                lagged = True
            except* Unavailable:  # the log cannot be read now: no caching meanwhile
                unavailable = True
            caches.set_live(False)
            if lagged:
                log.warning("cache keeper fell behind the log; caches cleared")
            if unavailable:
                failures += 1
                delay = BACKOFF.jittered(failures, random.random())
                line = outage.failed("cannot read the log", trio.current_time())
                if line is not None:
                    log.warning("%s; retry in %.1fs", line, delay)
                await back_off(delay, ready)
    finally:
        caches.set_live(False)


async def _wait_live(subscription: Subscription) -> None:
    while not subscription.live:
        await subscription.live_changed.wait()


async def _track_live(subscription: Subscription, caches: Caches) -> None:
    while True:
        if subscription.live != caches.enabled:
            caches.set_live(subscription.live)
        await subscription.live_changed.wait()


async def _apply(subscription: Subscription, store: Store, caches: Caches) -> None:
    while True:
        batch = [await subscription.receive()]
        # Records already queued are handled together (one database check for the batch).
        while len(batch) < CHANGES_CHECKED_AT_ONCE + 1 and subscription.ready():
            batch.append(await subscription.receive())
        await _changed(batch, store, caches)


async def _changed(records: list[LogRecord], store: Store, caches: Caches) -> None:
    # The entry and session caches dropped these records' changes already: the log actor calls
    # `Caches.observe` with every batch it reads, before any subscriber (this one included)
    # gets it; records this keeper replays from the store predate its live state, and caches
    # are cleared when they go live. What is left is the discovery pages.
    changes = [
        (record.seq, record.entry_did)
        for record in records
        if record.kind.startswith("entry.") and record.entry_did is not None
    ]
    if changes:
        await _drop_moved_pages(store, caches.results, changes)


def _drop_changed(record: LogRecord, caches: Caches) -> None:
    if record.kind == "session.revoked":
        token_hash = record.data.get("tokenHash")
        if isinstance(token_hash, str):  # always, as logout writes it; never fatal here
            with contextlib.suppress(ValueError):
                caches.sessions.invalidate(bytes.fromhex(token_hash))
    elif record.entry_did is not None and (
        record.kind.startswith(("entry.", "attestation.")) or record.kind == "anchor.updated"
    ):
        caches.entries.invalidate(record.entry_did)  # what the entry serves changed


async def _drop_moved_pages(
    store: Store, results: ResultCache, changes: list[tuple[int, str]]
) -> None:
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
