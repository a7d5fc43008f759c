"""Supervision, in one place: run an actor, restart it after a known failure, with backoff.

Theory of operation: `supervise` runs `body()` until it returns. A clean return ends supervision
(the actor's channel was closed: shutdown). A *known* failure (by default the service's own
`Unavailable`, e.g. the database went away, and connection errors) is logged and the actor is
restarted after `Backoff.jittered(consecutive failures)` (a group of known failures raised
through the body's nurseries is known too); a run that lasted longer than
`stable_after` seconds resets the count. Anything else is a bug: it propagates and stops the
service loudly rather than being retried forever. Cancellation (shutdown) passes straight through.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from registry.errors import Unavailable
from registry.ratelimit import Backoff

log = logging.getLogger(__name__)

KNOWN_FAILURES: tuple[type[Exception], ...] = (Unavailable, ConnectionError)


def is_known(exc: BaseException, known: tuple[type[Exception], ...]) -> bool:
    """A known failure, or a group (from the body's nurseries) made only of known failures."""
    if isinstance(exc, BaseExceptionGroup):
        return all(is_known(inner, known) for inner in exc.exceptions)
    return isinstance(exc, known)


@dataclass
class SupervisorStats:
    restarts: int = 0
    consecutive_failures: int = 0
    last_error: str | None = None


async def supervise(
    name: str,
    body: Callable[[], Awaitable[None]],
    *,
    known: tuple[type[Exception], ...] = KNOWN_FAILURES,
    backoff: Backoff | None = None,
    stable_after: float = 60.0,
    stats: SupervisorStats | None = None,
    draw: Callable[[], float] = random.random,
) -> None:
    backoff = backoff or Backoff()
    stats = stats or SupervisorStats()
    while True:
        started = trio.current_time()
        try:
            await body()
        except Exception as exc:
            if not is_known(exc, known):
                raise
            if trio.current_time() - started >= stable_after:
                stats.consecutive_failures = 0
            stats.consecutive_failures += 1
            stats.restarts += 1
            stats.last_error = f"{type(exc).__name__}: {exc}"
            delay = backoff.jittered(stats.consecutive_failures, draw())
            log.warning("actor %s failed (%s); restarting in %.1fs", name, stats.last_error, delay)
            await trio.sleep(delay)
        else:
            log.info("actor %s stopped", name)
            return
