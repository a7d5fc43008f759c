"""Supervision, in one place: run an actor, restart it after a crash with backoff.

Theory of operation: `supervise` runs `body()` forever. A clean return ends supervision (the
actor's channel was closed: shutdown). An `Exception` is logged with its traceback and the actor
is restarted after `Backoff.delay(consecutive failures)`; a run that lasted longer than
`stable_after` seconds resets the failure count. Cancellation (shutdown) passes straight through,
and so do `BaseException`s that are not `Exception`s (a bug in the supervisor itself).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from registry.ratelimit import Backoff

log = logging.getLogger(__name__)


@dataclass
class SupervisorStats:
    restarts: int = 0
    consecutive_failures: int = 0
    last_error: str | None = None


async def supervise(
    name: str,
    body: Callable[[], Awaitable[None]],
    *,
    backoff: Backoff | None = None,
    stable_after: float = 60.0,
    stats: SupervisorStats | None = None,
) -> None:
    backoff = backoff or Backoff()
    stats = stats or SupervisorStats()
    while True:
        started = trio.current_time()
        try:
            await body()
        except Exception as exc:
            if trio.current_time() - started >= stable_after:
                stats.consecutive_failures = 0
            stats.consecutive_failures += 1
            stats.restarts += 1
            stats.last_error = f"{type(exc).__name__}: {exc}"
            delay = backoff.delay(stats.consecutive_failures)
            log.exception("actor %s crashed; restarting in %.1fs", name, delay)
            await trio.sleep(delay)
        else:
            log.info("actor %s stopped", name)
            return
