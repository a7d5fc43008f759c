"""The janitor: deletes what has expired (idempotency records after 24 h, sessions, challenges).

Theory of operation: one pass every `every_seconds`; a pass is one store call. A failing pass
(database down) is a known failure: the supervisor restarts the janitor with backoff.
"""

from __future__ import annotations

import logging

import trio

from registry.store import HealthStore

log = logging.getLogger(__name__)


async def run_janitor(store: HealthStore, *, every_seconds: float = 3600.0) -> None:
    while True:
        removed = await store.purge_expired()
        if removed:
            log.info("janitor removed %s", removed)
        await trio.sleep(every_seconds)
