"""The cache keeper: one subscriber of the log that keeps this process's caches true.

Theory of operation: what each change makes stale is decided in one place,
`registry/coherence.py` (`Caches`); this actor only keeps it fed. It subscribes to the log from
its head at start and hands every batch it receives to `Caches.follow` (the discovery pages; the
entry heads and sessions were dropped already by `Caches.observe`, which the log actor calls
before any subscriber gets a batch). It turns the caches on only while the subscription is live
and off (cleared) when it is not, and resubscribes after a lag or an outage.
"""

from __future__ import annotations

import logging
import random
from typing import Protocol

import trio

from actors.log import Lagged, LogHandle, Subscription
from actors.supervisor import back_off, database_ready
from registry.coherence import CHANGES_CHECKED_AT_ONCE, Caches
from registry.errors import Unavailable
from registry.outage import ConditionLog
from registry.ratelimit import Backoff
from registry.store import EntryStore, HealthStore

log = logging.getLogger(__name__)

BACKOFF = Backoff()
# The keeper's own queue: it must not lag behind a burst of changes (each record is small; a
# lag clears every cache, which is correct but costly).
KEEPER_QUEUE = 100_000


class KeeperStore(EntryStore, HealthStore, Protocol):
    """What the keeper reads: what each change wrote, and whether the database is back."""


async def run_cache_keeper(
    logs: LogHandle,
    store: KeeperStore,
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


async def _apply(subscription: Subscription, store: KeeperStore, caches: Caches) -> None:
    while True:
        batch = [await subscription.receive()]
        # Records already queued are handled together (one database check for the batch),
        # taken without a checkpoint each.
        while len(batch) < CHANGES_CHECKED_AT_ONCE + 1:
            try:
                batch.append(subscription.receive_nowait())
            except trio.WouldBlock:
                break
        await caches.follow(batch, store)
