"""The rate-limiter actor over virtual time: one task owns every bucket, callers hold a handle."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from actors import ratelimiter
from actors.ratelimiter import (
    RateLimiter,
    RateLimiterState,
    open_rate_limiter_channel,
    run_rate_limiter,
)
from registry.ratelimit import Decision, Rate

RATES = {"read": Rate(60), "write": Rate(15), "query": Rate(120)}  # 1/s, 1 per 4 s, 2/s


def new_state() -> RateLimiterState:
    return RateLimiterState(dict(RATES))


@asynccontextmanager
async def running_limiter(
    state: RateLimiterState | None = None,
) -> AsyncIterator[tuple[RateLimiter, RateLimiterState]]:
    """The actor in a nursery; leaving the block closes the handle, which must end the actor."""
    state = state or new_state()
    limiter, inbox = open_rate_limiter_channel()
    with trio.fail_after(3600):  # virtual: a hang fails fast instead of blocking forever
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_rate_limiter, inbox, state)
            yield limiter, state
            await limiter.aclose()


async def test_bucket_allows_per_minute_requests_at_once_then_refuses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_limiter() as (limiter, _):
        start = trio.current_time()
        decisions = [await limiter.acquire("read", "alice") for _ in range(61)]
        assert trio.current_time() == start  # answering takes no virtual time
    assert all(d.allowed for d in decisions[:60])
    assert decisions[59].remaining == 0
    assert decisions[60] == Decision(
        allowed=False, limit=60, remaining=0, retry_after=1.0, reset_after=60.0
    )


async def test_bucket_refills_at_the_exact_rate_in_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_limiter() as (limiter, _):
        start = trio.current_time()
        for _ in range(15):
            assert (await limiter.acquire("write", "alice")).allowed
        refused = await limiter.acquire("write", "alice")
        assert (refused.allowed, refused.retry_after) == (False, 4.0)  # 15/min: one per 4 s

        await trio.sleep(3.5)
        early = await limiter.acquire("write", "alice")
        assert (early.allowed, early.retry_after) == (False, 0.5)

        await trio.sleep(early.retry_after)
        assert trio.current_time() == start + 4.0
        assert (await limiter.acquire("write", "alice")).allowed
        assert not (await limiter.acquire("write", "alice")).allowed

        await trio.sleep(12.0)  # three more tokens, no more
        results = [(await limiter.acquire("write", "alice")).allowed for _ in range(4)]
        assert results == [True, True, True, False]


async def test_clients_and_classes_have_separate_buckets(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_limiter() as (limiter, state):
        for _ in range(15):
            await limiter.acquire("write", "alice")
        assert not (await limiter.acquire("write", "alice")).allowed
        assert (await limiter.acquire("write", "bob")).remaining == 14
        assert (await limiter.acquire("read", "alice")).remaining == 59
        assert (await limiter.acquire("query", "alice")).remaining == 119
        assert set(state.buckets) == {
            ("write", "alice"),
            ("write", "bob"),
            ("read", "alice"),
            ("query", "alice"),
        }


async def test_actor_answers_many_concurrent_callers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    allowed: dict[str, int] = {"alice": 0, "bob": 0}
    refused: dict[str, int] = {"alice": 0, "bob": 0}

    async def caller(limiter: RateLimiter, client: str) -> None:
        try:
            decision = await limiter.acquire("read", client)
        finally:
            await limiter.aclose()
        (allowed if decision.allowed else refused)[client] += 1

    async with running_limiter() as (limiter, state):
        start = trio.current_time()
        async with trio.open_nursery() as callers:
            for index in range(1000):  # more than the channel buffer holds
                callers.start_soon(caller, limiter.clone(), "alice" if index % 2 else "bob")
        assert trio.current_time() == start
        assert state.statistics() == {"buckets": 2, "handled": 1000, "refused": 880}
    assert allowed == {"alice": 60, "bob": 60}
    assert refused == {"alice": 440, "bob": 440}


async def test_closing_the_handle_ends_the_actor(autojump_clock: trio.testing.MockClock) -> None:
    limiter, inbox = open_rate_limiter_channel()
    ended_at: list[float] = []

    async def actor() -> None:
        await run_rate_limiter(inbox, new_state())
        ended_at.append(trio.current_time())

    start = trio.current_time()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(actor)
            await limiter.acquire("read", "alice")
            await trio.sleep(5)
            await trio.testing.wait_all_tasks_blocked()
            assert ended_at == []  # an open handle keeps it serving
            await limiter.aclose()
    assert ended_at == [start + 5.0]


async def test_actor_serves_until_every_clone_is_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter, inbox = open_rate_limiter_channel()
    clone = limiter.clone()
    finished = trio.Event()

    async def actor() -> None:
        await run_rate_limiter(inbox, new_state())
        finished.set()

    with trio.fail_after(1):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(actor)
            await limiter.aclose()
            await trio.testing.wait_all_tasks_blocked()
            assert not finished.is_set()
            assert (await clone.acquire("read", "bob")).allowed
            await clone.aclose()
            await finished.wait()


async def test_a_closed_handle_cannot_send(autojump_clock: trio.testing.MockClock) -> None:
    limiter, _ = open_rate_limiter_channel()
    await limiter.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await limiter.acquire("read", "alice")


async def test_idle_buckets_are_swept(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ratelimiter, "SWEEP_EVERY", 4)
    async with running_limiter() as (limiter, state):
        await limiter.acquire("read", "alice")  # 1: alice needs 1 s to be full again
        await limiter.acquire("write", "carol")  # 2: carol needs 4 s
        await trio.sleep(1.0)
        await limiter.acquire("read", "bob")  # 3
        await limiter.acquire("read", "bob")  # 4: sweep at t=1: alice is full, carol is not
        assert set(state.buckets) == {("read", "bob"), ("write", "carol")}

        await trio.sleep(3.0)
        for _ in range(4):  # 5..8: sweep at t=4: carol full; bob took 2 at t=1 → full at t=3
            await limiter.acquire("query", "dave")
        assert set(state.buckets) == {("query", "dave")}
        assert state.statistics() == {"buckets": 1, "handled": 8, "refused": 0}


async def test_a_swept_client_starts_again_with_a_full_bucket(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ratelimiter, "SWEEP_EVERY", 2)
    async with running_limiter() as (limiter, state):
        for _ in range(15):
            await limiter.acquire("write", "alice")
        await trio.sleep(60.0)
        await limiter.acquire("read", "bob")
        await limiter.acquire("read", "bob")
        assert ("write", "alice") not in state.buckets
        decisions = [await limiter.acquire("write", "alice") for _ in range(16)]
        assert [d.allowed for d in decisions] == [True] * 15 + [False]
