"""The janitor: deletes what has expired (idempotency records after 24 h, sessions, challenges,
nonces), and marks expired attestations lapsed so that reading an entry does not walk them.

Theory of operation: two loops. Every `every_seconds` (an hour) one purge, one store call of
indexed deletes. Every `lapse_seconds` (5 s) one lapse pass (`lapse_attestations`): an index
probe when nothing expired, so an entry's read walks at most the attestations that expired in
the last few seconds; once `VACUUM_AFTER` rows have lapsed it vacuums `records`, since until
then the index still holds their old versions (a standby walks them on every read). A
failing pass (database down) is a known failure: the supervisor restarts the janitor with
backoff.
"""

from __future__ import annotations

import logging

import trio

from registry.store import HealthStore

log = logging.getLogger(__name__)

VACUUM_AFTER = 1000  # attestations lapsed since the last vacuum of `records` (this process)


async def run_janitor(
    store: HealthStore, *, every_seconds: float = 3600.0, lapse_seconds: float = 5.0
) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_purge, store, every_seconds)
        nursery.start_soon(_lapse, store, lapse_seconds)


async def _purge(store: HealthStore, every_seconds: float) -> None:
    while True:
        removed = await store.purge_expired()
        if removed:
            log.info("janitor removed %s", removed)
        await trio.sleep(every_seconds)


async def _lapse(store: HealthStore, every_seconds: float) -> None:
    unvacuumed = 0
    while True:
        lapsed = await store.lapse_attestations()
        if lapsed:
            log.info("janitor marked %d expired attestations lapsed", lapsed)
        unvacuumed += lapsed
        if unvacuumed >= VACUUM_AFTER:
            await store.vacuum_records()
            unvacuumed = 0
        await trio.sleep(every_seconds)
