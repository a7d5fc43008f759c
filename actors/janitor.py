"""The janitor: deletes what has expired (idempotency records after 24 h, sessions, challenges,
nonces) and marks expired attestations lapsed, so that reading an entry never walks them.

Theory of operation: one pass every `every_seconds` (a minute: how many attestations an entry's
read may walk is how many expired since the last pass); a pass is one store call, every
statement of it indexed. A failing pass
(database down) is a known failure: the supervisor restarts the janitor with backoff.
"""

from __future__ import annotations

import logging

import trio

from registry.store import HealthStore

log = logging.getLogger(__name__)


async def run_janitor(store: HealthStore, *, every_seconds: float = 60.0) -> None:
    while True:
        removed = await store.purge_expired()
        if removed:
            log.info("janitor removed %s", removed)
        await trio.sleep(every_seconds)
