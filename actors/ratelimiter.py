"""The rate-limiter actor: owns every token bucket.

Theory of operation: a decision is a synchronous method call on the actor (`acquire`), made from
request handlers on the one Trio thread. It contains no `await`, so it is atomic: no other task
can observe or touch the buckets midway, which is the property a message round trip would buy.
We measured that round trip (channel send, actor wake-up, reply wait) at two scheduler hops and
~170 µs a request (a fifth of a cached GET), so the hot path is a call, not a message.

The actor's task (`run_rate_limiter`, started with `nursery.start`, which reports the handle)
owns the housekeeping: every `sweep_every` seconds it forgets buckets that have refilled
completely (a full bucket is the same as none), so memory is bounded by the clients active within
the last minute. Nothing else mutates the buckets.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from registry.errors import RateLimited, Unavailable
from registry.ratelimit import Bucket, Decision, Rate, charge, is_idle, refund, take

log = logging.getLogger(__name__)

CLASSES = ("read", "write", "query")  # every limiter has these; more may be added
# Sweep early when this many clients were seen within a minute. When a sweep leaves more than
# half of that (clients active at once), the next early sweep waits until their number has
# doubled: a sweep walks every bucket, and once per request would make each request cost them all.
MAX_BUCKETS = 200_000


# An address's failed session lookups: one bucket per address, at the read rate, whatever the
# route (docs/limits.md, "Session tokens"). The client-key prefix is one no DID or address has.
FAILED_SESSIONS_CLASS = "read"
FAILED_SESSIONS = "failed-sessions "


class SessionLookups:
    """A request's budget for looking session tokens up in the database (a token the process's
    cache does not hold): each lookup takes a token of its address's failed-lookups bucket
    *before* it is made, so guesses sent at once cannot all pass while the first are looked
    up; a lookup that finds a live session gives it back. Once the bucket is empty, `take`
    refuses with `RateLimited(code)`, and no lookup is made (`Sessions.authenticate`). The
    refusal's `Retry-After` and limit are this bucket's; its code is the caller's (the route's
    class over HTTP), and `refused` says that it came from here."""

    def __init__(self, limiter: RateLimiter, address: str, code: str) -> None:
        self._limiter = limiter
        self._key = FAILED_SESSIONS + address
        self._code = code
        self.refused = False  # `take` refused (a 429 of this budget, not of the route's)

    def take(self) -> None:
        decision = self._limiter.acquire(FAILED_SESSIONS_CLASS, self._key)
        if not decision.allowed:
            self.refused = True
            raise RateLimited(
                "too many failed session lookups from this address",
                retry_after=decision.retry_after,
                limit=decision.limit,
                code=self._code,
            )

    def give_back(self) -> None:
        self._limiter.refund(FAILED_SESSIONS_CLASS, self._key)


class RateLimiter:
    """The handle: token buckets per (class, client), `acquire("read", client)` → `Decision`."""

    def __init__(self, rates: dict[str, Rate]) -> None:
        if not set(CLASSES) <= set(rates):
            raise ValueError(f"rates for at least {CLASSES} are required")
        self._configured = dict(rates)
        self._rates = dict(rates)
        self.processes = 1  # the configured rates are divided among this many processes
        self._buckets: dict[tuple[str, str], Bucket] = {}
        self._in_flight: dict[tuple[str, str], int] = {}  # (class, client) -> running now
        self._handled = 0
        self._refused = 0
        self._sweeps = 0
        self._sweep_above = MAX_BUCKETS  # buckets past which the next early sweep runs

    def acquire(self, klass: str, client: str, cost: float = 1.0) -> Decision:
        """Take `cost` tokens (one request, by default) of `klass` for `client` now, or say when
        they will be available."""
        rate = self._rates.get(klass)
        if rate is None:
            raise ValueError(f"unknown rate-limit class {klass!r}")
        now = trio.current_time()
        decision, bucket = take(self._buckets.get((klass, client)), rate, now, cost)
        self._buckets[(klass, client)] = bucket
        self._handled += 1
        self._refused += not decision.allowed
        if len(self._buckets) > self._sweep_above:
            self._sweep(now)
        return decision

    def refund(self, klass: str, client: str, cost: float = 1.0) -> None:
        """Give back `cost` tokens `acquire` took for work that turned out not to count."""
        rate = self._rates.get(klass)
        if rate is None:
            raise ValueError(f"unknown rate-limit class {klass!r}")
        key = (klass, client)
        self._buckets[key] = refund(self._buckets.get(key), rate, trio.current_time(), cost)

    def charge(self, klass: str, client: str, cost: float) -> None:
        """Take `cost` tokens of `klass` from `client` after the fact (`ratelimit.charge`): a
        bucket in debt refuses `acquire(klass, client, cost=0)` until it has refilled."""
        rate = self._rates.get(klass)
        if rate is None:
            raise ValueError(f"unknown rate-limit class {klass!r}")
        key = (klass, client)
        self._buckets[key] = charge(self._buckets.get(key), rate, trio.current_time(), cost)
        if len(self._buckets) > self._sweep_above:
            self._sweep(trio.current_time())

    def enter(self, klass: str, client: str, most: int) -> bool:
        """Count one more request of `klass` running for `client`, unless `most` already are
        (then False). Each True must be matched by one `leave`."""
        key = (klass, client)
        running = self._in_flight.get(key, 0)
        if running >= most:
            return False
        self._in_flight[key] = running + 1
        return True

    def leave(self, klass: str, client: str) -> None:
        key = (klass, client)
        running = self._in_flight[key] - 1
        if running:
            self._in_flight[key] = running
        else:
            del self._in_flight[key]

    def share(self, processes: int) -> None:
        """Admit `1/processes` of each configured rate (at least 1 a minute), so that N
        processes behind a load balancer admit the configured rate together. Buckets keep
        their tokens, clamped to the new capacity at their next use."""
        self.processes = max(1, processes)
        self._rates = {
            klass: Rate(max(1, rate.per_minute // self.processes))
            for klass, rate in self._configured.items()
        }

    def _sweep(self, now: float) -> None:
        idle = [k for k, b in self._buckets.items() if is_idle(b, self._rates[k[0]], now)]
        for key in idle:
            del self._buckets[key]
        self._sweeps += 1
        self._sweep_above = max(MAX_BUCKETS, 2 * len(self._buckets))

    def statistics(self) -> dict[str, int]:
        return {
            "buckets": len(self._buckets),
            "handled": self._handled,
            "refused": self._refused,
            "sweeps": self._sweeps,
        }


class ProcessCount(Protocol):
    async def live_processes(self) -> int: ...


async def share_limits(
    limiter: RateLimiter,
    store: ProcessCount,
    *,
    every: float,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep `limiter` admitting its share of the configured rates: the processes serving from
    the database are counted now (before the service serves) and every `every` seconds. A count
    that fails (the database is away) keeps the last share."""
    started = False
    while True:
        try:
            processes = await store.live_processes()
        except Unavailable:
            processes = limiter.processes
        if processes != limiter.processes:
            log.info("rate limits shared by %d process(es)", processes)
            limiter.share(processes)
        if not started:
            task_status.started()
            started = True
        await trio.sleep(every)


async def run_rate_limiter(
    rates: dict[str, Rate],
    *,
    sweep_every: float = 60.0,
    task_status: trio.TaskStatus[RateLimiter] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The actor's task: report the handle, then sweep idle buckets every `sweep_every` s."""
    limiter = RateLimiter(rates)
    task_status.started(limiter)
    while True:
        await trio.sleep(sweep_every)
        limiter._sweep(trio.current_time())
