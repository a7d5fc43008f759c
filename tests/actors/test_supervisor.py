"""Supervision over virtual time: restart with backoff, reset after a stable run, clean stop,
and cancellation passing straight through."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from actors.supervisor import SupervisorStats
from actors.supervisor import supervise as supervise_known
from registry.errors import Unavailable
from registry.ratelimit import Backoff


async def supervise(name: str, body: Callable[[], Awaitable[None]], **options: object) -> None:
    """Supervision treating every `Exception` as a known failure, with the jitter's draw at
    its top (the delay is then exactly the backoff's)."""
    options.setdefault("known", (Exception,))
    options.setdefault("draw", lambda: 1.0)
    await supervise_known(name, body, **options)  # type: ignore[arg-type]


class Recorder:
    """A body whose n-th run (1-based) does what `script(n)` says; records when each run began."""

    def __init__(self, script: Callable[[int], Awaitable[None]]) -> None:
        self.script = script
        self.starts: list[float] = []

    async def __call__(self) -> None:
        self.starts.append(trio.current_time())
        await self.script(len(self.starts))

    def offsets(self, origin: float) -> list[float]:
        return [start - origin for start in self.starts]


def crash_first(count: int) -> Callable[[int], Awaitable[None]]:
    async def script(run: int) -> None:
        if run <= count:
            raise RuntimeError(f"crash {run}")

    return script


async def test_crashing_body_is_restarted_after_half_one_two_four_seconds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    body = Recorder(crash_first(5))
    stats = SupervisorStats()
    origin = trio.current_time()
    await supervise("worker", body, stats=stats)
    assert body.offsets(origin) == [0.0, 0.5, 1.5, 3.5, 7.5, 15.5]
    assert trio.current_time() == origin + 15.5
    assert stats == SupervisorStats(
        restarts=5, consecutive_failures=5, last_error="RuntimeError: crash 5"
    )


async def test_backoff_is_capped_at_its_maximum(autojump_clock: trio.testing.MockClock) -> None:
    body = Recorder(crash_first(9))
    origin = trio.current_time()
    await supervise("worker", body)
    gaps = [b - a for a, b in zip(body.offsets(origin), body.offsets(origin)[1:], strict=False)]
    assert gaps == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


async def test_custom_backoff_is_used(autojump_clock: trio.testing.MockClock) -> None:
    body = Recorder(crash_first(3))
    origin = trio.current_time()
    await supervise("worker", body, backoff=Backoff(initial=2.0, factor=3.0, maximum=10.0))
    assert body.offsets(origin) == [0.0, 2.0, 8.0, 18.0]


@pytest.mark.parametrize(
    ("run_length", "delays_after"),
    [(59.5, (4.0, 8.0)), (60.0, (0.5, 1.0)), (600.0, (0.5, 1.0))],
    ids=["shorter-than-stable-keeps-growing", "exactly-stable-resets", "long-stable-resets"],
)
async def test_a_stable_run_resets_the_backoff(
    autojump_clock: trio.testing.MockClock, run_length: float, delays_after: tuple[float, float]
) -> None:
    async def script(run: int) -> None:
        if run <= 3:
            raise RuntimeError("early crash")
        if run == 4:
            await trio.sleep(run_length)
            raise RuntimeError("late crash")
        if run == 5:
            raise RuntimeError("crash right after the late one")

    body = Recorder(script)
    stats = SupervisorStats()
    origin = trio.current_time()
    await supervise("worker", body, stable_after=60.0, stats=stats)
    late_crash = 3.5 + run_length
    first, second = delays_after
    assert body.offsets(origin) == [
        0.0,
        0.5,
        1.5,
        3.5,
        late_crash + first,
        late_crash + first + second,
    ]
    assert stats.restarts == 5


async def test_a_clean_return_ends_supervision_without_restart(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def script(run: int) -> None:
        await trio.sleep(7.0)

    body = Recorder(script)
    stats = SupervisorStats()
    origin = trio.current_time()
    await supervise("worker", body, stats=stats)
    assert body.offsets(origin) == [0.0]
    assert trio.current_time() == origin + 7.0
    assert stats == SupervisorStats()


async def test_an_exception_group_from_the_bodys_nursery_is_a_crash(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def script(run: int) -> None:
        if run == 1:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
                raise ValueError("child failed")

    body = Recorder(script)
    stats = SupervisorStats()
    origin = trio.current_time()
    await supervise("worker", body, stats=stats)
    assert body.offsets(origin) == [0.0, 0.5]
    assert stats.last_error is not None
    assert stats.last_error == "ValueError: child failed"  # the one failure, not its group


async def test_cancellation_while_the_body_runs_is_not_a_crash(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def script(run: int) -> None:
        await trio.sleep_forever()

    body = Recorder(script)
    stats = SupervisorStats()
    origin = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: supervise("worker", body, stats=stats))
        await trio.sleep(10.0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert body.offsets(origin) == [0.0]
    assert trio.current_time() == origin + 10.0
    assert stats == SupervisorStats()


async def test_cancellation_during_the_backoff_sleep_prevents_the_restart(
    autojump_clock: trio.testing.MockClock,
) -> None:
    body = Recorder(crash_first(100))
    stats = SupervisorStats()
    origin = trio.current_time()
    with trio.move_on_after(1.0) as scope:  # crashes at 0 and 0.5; the next restart is due at 1.5
        await supervise("worker", body, stats=stats)
    assert scope.cancelled_caught
    assert body.offsets(origin) == [0.0, 0.5]
    assert stats.restarts == 2
    await trio.sleep(100.0)
    assert len(body.starts) == 2


async def test_cancelled_raised_inside_a_bodys_nursery_propagates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def script(run: int) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(trio.sleep_forever)

    body = Recorder(script)
    with trio.move_on_after(3.0) as scope:
        await supervise("worker", body)
    assert scope.cancelled_caught
    assert len(body.starts) == 1


class SupervisorBug(BaseException):
    """Not an `Exception`: the supervisor must not treat it as an actor crash."""


async def test_base_exceptions_that_are_not_exceptions_propagate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def script(run: int) -> None:
        raise SupervisorBug

    body = Recorder(script)
    with pytest.raises(SupervisorBug):
        await supervise("worker", body)
    assert len(body.starts) == 1


async def test_each_known_failure_is_logged_with_name_reason_and_delay(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="actors.supervisor")
    await supervise("peer:alpha", Recorder(crash_first(2)))
    crashes = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in crashes] == [
        "actor peer:alpha failed (RuntimeError: crash 1); restarting in 0.5s",
        "actor peer:alpha failed (RuntimeError: crash 2); restarting in 1.0s",
    ]
    assert caplog.records[-1].getMessage() == "actor peer:alpha stopped"


async def test_an_unknown_failure_is_a_bug_and_propagates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    body = Recorder(crash_first(1))
    with pytest.raises(RuntimeError, match="crash 1"):
        await supervise_known("worker", body)  # RuntimeError is not a known failure
    assert len(body.starts) == 1


async def test_a_lost_database_is_known_and_retried_with_jitter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from registry.errors import Unavailable

    async def script(run: int) -> None:
        if run <= 3:
            raise Unavailable("the database is unavailable", code="database_unavailable")

    body = Recorder(script)
    draws = iter([0.0, 0.5, 0.999])
    origin = trio.current_time()
    await supervise_known("log", body, draw=lambda: next(draws))
    gaps = [b - a for a, b in zip(body.offsets(origin), body.offsets(origin)[1:], strict=False)]
    # equal jitter: half the backoff, plus the draw's share of the other half
    assert gaps == pytest.approx([0.25, 0.75, 2.0 * (0.5 + 0.5 * 0.999)])


async def test_a_body_that_never_stops_crashing_is_restarted_indefinitely(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Several hours of a crash loop at the 30 s ceiling: the supervisor keeps going and never
    # lets its own arithmetic take the process down.
    crashes = 1_200
    stats = SupervisorStats()
    with trio.CancelScope() as scope:

        async def script(run: int) -> None:
            if run > crashes:
                scope.cancel()
                await trio.sleep_forever()
            raise RuntimeError("still broken")

        body = Recorder(script)
        origin = trio.current_time()
        await supervise("worker", body, stats=stats)
    assert stats.restarts == crashes
    offsets = body.offsets(origin)
    assert offsets[-1] - offsets[-2] == 30.0
    assert offsets[-1] == 31.5 + 30.0 * (crashes - 6)


async def test_a_group_of_known_failures_from_a_nursery_is_known(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from registry.errors import Unavailable

    async def lost() -> None:
        raise Unavailable("the notification connection was lost", code="database_unavailable")

    async def script(run: int) -> None:
        if run == 1:
            async with trio.open_nursery() as nursery:  # raises ExceptionGroup[Unavailable]
                nursery.start_soon(lost)

    body = Recorder(script)
    stats = SupervisorStats()
    await supervise_known("log", body, stats=stats, draw=lambda: 1.0)
    assert len(body.starts) == 2
    assert stats.restarts == 1


async def test_a_group_with_an_unknown_failure_propagates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from registry.errors import Unavailable

    async def lost() -> None:
        raise Unavailable("lost", code="database_unavailable")

    async def bug() -> None:
        raise KeyError("bug")

    async def script(run: int) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lost)
            nursery.start_soon(bug)

    body = Recorder(script)
    with pytest.RaisesGroup(Unavailable, KeyError):
        await supervise_known("log", body)
    assert len(body.starts) == 1


async def test_an_outage_of_any_length_is_a_few_lines(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The database down for ten minutes: the same failure on every restart is said once, then
    once a minute with a count (registry/outage.py), not once per restart."""
    caplog.set_level(logging.INFO, logger="actors.supervisor")

    async def script(run: int) -> None:
        if trio.current_time() < 600:
            raise Unavailable("the database connection failed", code="database_unavailable")

    await supervise("log", Recorder(script), draw=lambda: 0.5)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said[0].startswith("actor log failed (Unavailable: the database connection failed)")
    assert all("still failing" in line for line in said[1:])
    assert 9 <= len(said) <= 12  # one, then about one a minute for ten minutes


async def test_a_backoff_ends_within_a_second_of_recovery(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`ready` is asked every second during a backoff: the restart follows the recovery, not
    the backoff's end (here 30 s)."""
    back_at = 40.0
    origin = trio.current_time()

    async def script(run: int) -> None:
        if trio.current_time() - origin < back_at:
            raise Unavailable("down", code="database_unavailable")

    async def ready() -> bool:
        return trio.current_time() - origin >= back_at

    body = Recorder(script)
    await supervise("log", body, draw=lambda: 0.5, ready=ready, backoff=Backoff(maximum=30.0))
    assert body.starts[-1] - origin - back_at < 1.0 + 1e-9
    assert all(b - a <= 30.0 + 1e-9 for a, b in itertools.pairwise(body.starts))
