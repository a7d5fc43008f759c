"""Supervision, in one place: run an actor, restart it after a known failure, with backoff.

Theory of operation: `supervise` runs `body()` until it returns. A clean return ends supervision
(the actor's channel was closed: shutdown). A *known* failure (by default the service's own
`Unavailable`, e.g. the database went away, and connection errors) is logged and the actor is
restarted after `Backoff.jittered(consecutive failures)`, or, for a failure of the database
(`of_the_database`), as soon as `ready()` says it works again (asked every second: `back_off`)
(a group of known failures raised through the body's nurseries is known too). Any other known
failure (a stored tree found altered, a stale leader) waits out its backoff: the database
answering says nothing about it. A run that lasted longer than
`stable_after` seconds resets the count. Anything else is a bug: it propagates and stops the
service loudly rather than being retried forever. The log says a failure once, then the same
failure again at most once a minute with a count (`registry/outage.py`), so an outage of
any length is a few lines. Cancellation (shutdown) passes straight through.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from registry.errors import RegistryError, Unavailable
from registry.outage import ConditionLog
from registry.ratelimit import Backoff
from registry.store import HealthStore, Leadership

log = logging.getLogger(__name__)

KNOWN_FAILURES: tuple[type[Exception], ...] = (Unavailable, ConnectionError)
READY_EVERY = 1.0  # seconds between two readiness checks during a backoff


async def while_leading(leadership: Leadership, body: Callable[[], Awaitable[None]]) -> None:
    """Run `body` while `leadership` holds: losing it (its connection) ends the run with
    `Unavailable`, for the supervisor to restart and compete again."""
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            await leadership.lost()  # raises Unavailable: the run ends

        nursery.start_soon(watch)
        await body()
        nursery.cancel_scope.cancel()


def describe(exc: BaseException) -> str:
    """`Type: message` of a failure, through the groups of one that nurseries wrap it in."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


def of_the_database(exc: BaseException) -> bool:
    """A failure of the database, whose end `ready` can see: a lost connection, or one of its
    conditions (registry/store/pg.py `CONDITIONS`: the `database_*` codes), in a group too."""
    if isinstance(exc, BaseExceptionGroup):
        return any(of_the_database(inner) for inner in exc.exceptions)
    if isinstance(exc, Unavailable):
        return exc.code.startswith("database_")
    return isinstance(exc, ConnectionError)


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
    ready: Callable[[], Awaitable[bool]] | None = None,
) -> None:
    backoff = backoff or Backoff()
    stats = stats or SupervisorStats()
    outage = ConditionLog(f"actor {name}")  # the same failure again: a line a minute at most
    while True:
        started = trio.current_time()
        try:
            await body()
        except Exception as exc:
            if not is_known(exc, known):
                raise
            now = trio.current_time()
            if now - started >= stable_after:
                stats.consecutive_failures = 0
                outage.succeeded(now)  # a run that held: a new failure is news again
            stats.consecutive_failures += 1
            stats.restarts += 1
            stats.last_error = describe(exc)
            delay = backoff.jittered(stats.consecutive_failures, draw())
            if outage.failed(stats.last_error, now) is not None:  # news, or a minute of it
                if outage.failures == 1:
                    log.warning(
                        "actor %s failed (%s); restarting in %.1fs", name, stats.last_error, delay
                    )
                else:
                    log.warning(
                        "actor %s still failing (%s): %d restarts so far; next in %.1fs",
                        name,
                        stats.last_error,
                        outage.failures,
                        delay,
                    )
            await back_off(delay, ready if of_the_database(exc) else None)
        else:
            log.info("actor %s stopped", name)
            return


async def back_off(delay: float, ready: Callable[[], Awaitable[bool]] | None) -> None:
    """Wait `delay` seconds, or less: with `ready`, ask it every second whether what failed
    works again (the database answers and takes writes), and stop waiting when it does. A
    backoff of up to 30 s then never keeps a recovered service degraded for more than about a
    second, while a service that stays down is still retried no faster than the backoff."""
    if ready is None:
        await trio.sleep(delay)
        return
    deadline = trio.current_time() + delay
    while (left := deadline - trio.current_time()) > 0:
        await trio.sleep(min(READY_EVERY, left))
        if trio.current_time() < deadline and await ready():
            return


def database_ready(store: HealthStore, *, writes: bool) -> Callable[[], Awaitable[bool]]:
    """A `ready` for actors of the database: it answers (and, with `writes`, takes writes)."""

    async def ready() -> bool:
        with trio.move_on_after(READY_EVERY):
            try:
                if writes:
                    return await store.write_condition() is None
                await store.ping()
                return True
            except RegistryError:
                return False
        return False

    return ready
