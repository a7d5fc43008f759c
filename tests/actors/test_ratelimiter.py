"""The rate-limiter actor over virtual time: buckets per (class, client), exact refill, and the
actor task's periodic sweep of idle buckets."""

from __future__ import annotations

from functools import partial

import pytest
import trio
import trio.testing

from actors import ratelimiter
from actors.ratelimiter import RateLimiter, run_rate_limiter
from registry.errors import Unavailable
from registry.ratelimit import Decision, Rate

RATES = {"read": Rate(60), "write": Rate(15), "query": Rate(120)}  # 1/s, 1 per 4 s, 2/s


async def test_bucket_allows_per_minute_requests_at_once_then_refuses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = RateLimiter(RATES)
    decisions = [limiter.acquire("read", "alice") for _ in range(61)]
    assert all(d.allowed for d in decisions[:60])
    assert decisions[59].remaining == 0
    assert decisions[60] == Decision(
        allowed=False, limit=60, remaining=0, retry_after=1.0, reset_after=60.0
    )


async def test_refund_gives_tokens_back_up_to_a_full_bucket(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = RateLimiter(RATES)
    for _ in range(15):
        assert limiter.acquire("write", "bob").allowed
    assert not limiter.acquire("write", "bob").allowed
    limiter.refund("write", "bob")
    assert limiter.acquire("write", "bob").allowed  # the token given back
    assert not limiter.acquire("write", "bob").allowed
    for _ in range(100):
        limiter.refund("write", "bob")
    decisions = [limiter.acquire("write", "bob") for _ in range(16)]
    assert [d.allowed for d in decisions] == [True] * 15 + [False]  # never above full


async def test_bucket_refills_at_the_exact_rate_in_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = RateLimiter(RATES)
    for _ in range(15):
        assert limiter.acquire("write", "bob").allowed
    refused = limiter.acquire("write", "bob")
    assert not refused.allowed
    assert refused.retry_after == pytest.approx(4.0)
    await trio.sleep(3.999)
    assert not limiter.acquire("write", "bob").allowed
    await trio.sleep(4.0)  # 1 token per 4 s; the refused attempt above took none
    assert limiter.acquire("write", "bob").allowed
    assert not limiter.acquire("write", "bob").allowed


async def test_clients_and_classes_have_separate_buckets(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = RateLimiter(RATES)
    for _ in range(15):
        limiter.acquire("write", "carol")
    assert not limiter.acquire("write", "carol").allowed
    assert limiter.acquire("write", "dave").allowed
    assert limiter.acquire("read", "carol").allowed
    assert limiter.acquire("query", "carol").allowed


async def test_unknown_class_is_a_programming_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = RateLimiter(RATES)
    with pytest.raises(ValueError, match="unknown rate-limit class"):
        limiter.acquire("delete", "x")
    with pytest.raises(ValueError, match="rates for at least"):
        RateLimiter({"read": Rate(1)})


async def test_actor_task_sweeps_idle_buckets_every_period(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        limiter = await nursery.start(partial(run_rate_limiter, RATES, sweep_every=60.0))
        limiter.acquire("read", "idle")
        await trio.sleep(59.5)
        limiter.acquire("write", "busy")  # refills one token in 4 s: still partial at t=60
        await trio.testing.wait_all_tasks_blocked()
        assert limiter.statistics()["buckets"] == 2  # no sweep yet
        await trio.sleep(1.0)  # the sweep at t=60 forgets only the refilled "read" bucket
        await trio.testing.wait_all_tasks_blocked()
        stats = limiter.statistics()
        assert stats["sweeps"] == 1
        assert stats["buckets"] == 1
        nursery.cancel_scope.cancel()


async def test_a_swept_client_starts_again_with_a_full_bucket(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        limiter = await nursery.start(partial(run_rate_limiter, RATES, sweep_every=120.0))
        for _ in range(60):
            limiter.acquire("read", "eve")
        await trio.sleep(121)
        await trio.testing.wait_all_tasks_blocked()
        assert limiter.statistics()["buckets"] == 0
        assert limiter.acquire("read", "eve").remaining == 59
        nursery.cancel_scope.cancel()


@pytest.fixture
def small_limiter(monkeypatch: pytest.MonkeyPatch) -> RateLimiter:
    """A limiter that sweeps early past 10 buckets."""
    monkeypatch.setattr(ratelimiter, "MAX_BUCKETS", 10)
    return RateLimiter(RATES)


async def test_too_many_clients_trigger_an_early_sweep(
    autojump_clock: trio.testing.MockClock, small_limiter: RateLimiter
) -> None:
    limiter = small_limiter
    for n in range(10):
        limiter.acquire("read", f"client-{n}")
    await trio.sleep(1.0)  # every read bucket has refilled
    limiter.acquire("read", "client-10")
    limiter.acquire("read", "client-11")
    assert limiter.statistics()["sweeps"] == 1
    assert limiter.statistics()["buckets"] <= 2


async def test_clients_active_at_once_past_the_bound_do_not_make_every_request_sweep(
    autojump_clock: trio.testing.MockClock, small_limiter: RateLimiter
) -> None:
    # Every bucket stays in use: a sweep frees nothing. Sweeping again on each request would
    # walk them all each time; the next sweep waits until their number has doubled.
    limiter = small_limiter
    for n in range(1000):
        limiter.acquire("write", f"client-{n}")  # a write bucket stays short of full: not idle
    stats = limiter.statistics()
    assert stats["buckets"] == 1000
    assert stats["sweeps"] <= 8  # at 11, 23, 47, ... buckets: log2(1000 / 10) of them
    await trio.sleep(3600.0)  # every bucket refilled: the next early sweep forgets them
    for n in range(1000, 2025):
        limiter.acquire("write", f"client-{n}")
    assert limiter.statistics()["buckets"] < 1025 + 1


async def test_statistics_count_handled_and_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = RateLimiter(RATES)
    for _ in range(17):
        limiter.acquire("write", "frank")
    stats = limiter.statistics()
    assert stats["handled"] == 17
    assert stats["refused"] == 2


class Processes:
    """A store that says how many processes serve from the database; it may be away."""

    def __init__(self) -> None:
        self.count = 1
        self.away = False

    async def live_processes(self) -> int:
        if self.away:
            raise Unavailable("the database is away", code="database_unavailable")
        return self.count


async def test_limits_are_shared_by_the_live_processes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = RateLimiter(RATES)
    store = Processes()
    store.count = 3
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(ratelimiter.share_limits, limiter, store, every=10.0))
        # Counted before the service serves: a third of 60 reads a minute each.
        decisions = [limiter.acquire("read", "alice") for _ in range(21)]
        assert [d.allowed for d in decisions] == [True] * 20 + [False]
        assert decisions[0].limit == 20
        # A process leaves: the next count gives this one half; the database away keeps it.
        store.count = 2
        await trio.sleep(10.5)
        assert limiter.processes == 2
        assert limiter.acquire("write", "bob").limit == 7  # 15 // 2
        store.away = True
        await trio.sleep(10)
        assert limiter.processes == 2
        store.away, store.count = False, 1
        await trio.sleep(10)
        assert limiter.acquire("query", "carol").limit == 120
        nursery.cancel_scope.cancel()


async def test_every_class_is_shared_event_replays_too() -> None:
    """docs/configuration.md (`limits.shared`) and docs/events.md: the event replays' budget
    (`events.replays_per_minute`, the limiter's "replay" class) is divided like the [limits]
    ones, though it is configured in [events]."""
    limiter = RateLimiter({**RATES, "replay": Rate(30)})
    limiter.share(3)
    assert limiter.acquire("replay", "1.2.3.4").limit == 10


def test_a_share_never_falls_below_one_a_minute() -> None:
    limiter = RateLimiter(RATES)
    limiter.share(1000)
    assert limiter._rates["write"] == Rate(1)


def test_a_client_runs_at_most_so_many_at_once_and_each_end_frees_a_place() -> None:
    limiter = RateLimiter(RATES)
    assert limiter.enter("query", "alice", 2)
    assert limiter.enter("query", "alice", 2)
    assert not limiter.enter("query", "alice", 2)  # two running
    assert limiter.enter("query", "bob", 2)  # another client's count is its own
    limiter.leave("query", "alice")
    assert limiter.enter("query", "alice", 2)
    for client in ("alice", "alice", "bob"):
        limiter.leave("query", client)
    assert limiter._in_flight == {}  # nothing kept for clients with nothing running


async def test_a_charge_after_the_fact_refuses_until_the_debt_is_paid(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = RateLimiter(RATES)
    limiter.charge("query", "alice", 150)  # 2/s: 30 tokens short
    decision = limiter.acquire("query", "alice", cost=0)
    assert not decision.allowed
    assert decision.retry_after == pytest.approx(15.0)
    await trio.sleep(15)
    assert limiter.acquire("query", "alice", cost=0).allowed
