"""The rate-limiter actor: owns every token bucket; callers hold a `RateLimiter` handle.

Theory of operation: one task reads `Acquire` messages from its channel, feeds the pure
`registry.ratelimit.take` with the Trio clock, and answers each on its one-shot reply. Buckets
that have refilled completely are forgotten during a sweep, so memory stays bounded by the number
of clients active in the last minute. Closing every handle's send side ends the actor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from registry.errors import Unavailable
from registry.ratelimit import Bucket, Decision, Rate, is_idle, take

log = logging.getLogger(__name__)

CLASSES = ("read", "write", "query")
# Requests arrive from many handlers at once; a buffer lets them enqueue without a rendezvous.
BUFFER = 256
SWEEP_EVERY = 10_000
MAX_BUCKETS = 200_000  # sweep early when this many clients were seen within a minute


@dataclass
class _Reply:
    event: trio.Event = field(default_factory=trio.Event)
    decision: Decision | None = None


@dataclass(frozen=True)
class Acquire:
    klass: str
    client: str
    reply: _Reply


class RateLimiter:
    """Handle: `await limiter.acquire("read", client)` → `Decision`."""

    def __init__(self, send: trio.MemorySendChannel[Acquire]) -> None:
        self._send = send

    async def acquire(self, klass: str, client: str) -> Decision:
        if klass not in CLASSES:
            raise ValueError(f"unknown rate-limit class {klass!r}")
        reply = _Reply()
        await self._send.send(Acquire(klass, client, reply))
        await reply.event.wait()
        if reply.decision is None:
            raise Unavailable("the rate limiter failed; try again", code="rate_limiter_failed")
        return reply.decision

    def clone(self) -> RateLimiter:
        return RateLimiter(self._send.clone())

    async def aclose(self) -> None:
        await self._send.aclose()


class RateLimiterState:
    """The actor's private state (exposed for `statistics()` and tests)."""

    def __init__(self, rates: dict[str, Rate]) -> None:
        self.rates = rates
        self.buckets: dict[tuple[str, str], Bucket] = {}
        self.handled = 0
        self.refused = 0

    def decide(self, klass: str, client: str, now: float) -> Decision:
        rate = self.rates[klass]
        decision, bucket = take(self.buckets.get((klass, client)), rate, now)
        self.buckets[(klass, client)] = bucket
        self.handled += 1
        self.refused += not decision.allowed
        if self.handled % SWEEP_EVERY == 0 or len(self.buckets) > MAX_BUCKETS:
            self.sweep(now)
        return decision

    def sweep(self, now: float) -> None:
        idle = [k for k, b in self.buckets.items() if is_idle(b, self.rates[k[0]], now)]
        for key in idle:
            del self.buckets[key]

    def statistics(self) -> dict[str, int]:
        return {"buckets": len(self.buckets), "handled": self.handled, "refused": self.refused}


def open_rate_limiter_channel() -> tuple[RateLimiter, trio.MemoryReceiveChannel[Acquire]]:
    send, receive = trio.open_memory_channel[Acquire](BUFFER)
    return RateLimiter(send), receive


async def run_rate_limiter(
    receive: trio.MemoryReceiveChannel[Acquire], state: RateLimiterState
) -> None:
    """Serve `Acquire` messages until every handle is closed. Does not close `receive` itself:
    the supervisor owns the channel so that a restarted actor keeps serving the same handles."""
    async for message in receive:
        try:
            message.reply.decision = state.decide(
                message.klass, message.client, trio.current_time()
            )
        finally:  # a caller is never left waiting, even if deciding crashed the actor
            message.reply.event.set()
