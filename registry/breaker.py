"""A circuit breaker per federation peer (design §9), sans-IO: (state, event, now) in, state out.

Theory of operation. A `Breaker` is an immutable value; every event returns the next value, and
nothing here reads a clock, sleeps or draws random numbers (the caller passes `now_ms` and a
uniform `draw` in [0, 1)). The peer actor owns one, persists it with `to_json`, and asks
`allows(now_ms)` before each call:

* `closed`: calls flow. A failure counts; below the threshold the next sync is scheduled after
  a jittered exponential backoff (`next_attempt_at_ms`, advisory: a user's federated query may
  still call a closed peer at once). The 5th consecutive failure opens the breaker.
* `open`: no call until `next_attempt_at_ms` (now + cooldown). The cooldown starts at 30 s and
  doubles on each re-open, capped at 10 min; a success resets it.
* `half_open`: once the cooldown has passed (`state_at` reports `half_open`), one trial call may
  go: `on_attempt` records it and blocks other calls until `trial_timeout_ms` has passed (a lost
  trial must not wedge the breaker). The trial's success closes the breaker; its failure reopens
  it with the doubled cooldown.

A success in any state closes the breaker (the peer answered); a failure reported while open
(a call that started before the breaker opened) counts but does not move `next_attempt_at_ms`.
The EWMA `Latency` of successful calls rides along for the peer status.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal, cast

from registry.ratelimit import Backoff

BreakerState = Literal["closed", "open", "half_open"]
STATES: Final[frozenset[str]] = frozenset({"closed", "open", "half_open"})


RETRY_BACKOFF: Final = Backoff(initial=1.0, factor=2.0, maximum=30.0)  # seconds, while closed


@dataclass(frozen=True)
class BreakerPolicy:
    """Configuration (not persisted with the breaker's state)."""

    failure_threshold: int = 5
    initial_cooldown_ms: int = 30_000
    max_cooldown_ms: int = 600_000
    trial_timeout_ms: int = 60_000
    retry: Backoff = RETRY_BACKOFF

    @property
    def longest_wait_ms(self) -> int:
        """The longest any wait of this policy lasts: the longest cooldown, a trial's timeout,
        the longest backoff while closed."""
        return max(self.max_cooldown_ms, self.trial_timeout_ms, int(self.retry.maximum * 1000))

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        if not 0 < self.initial_cooldown_ms <= self.max_cooldown_ms:
            raise ValueError("need 0 < initial_cooldown_ms <= max_cooldown_ms")
        if self.trial_timeout_ms < 1:
            raise ValueError("trial_timeout_ms must be positive")


DEFAULT_POLICY: Final = BreakerPolicy()


@dataclass(frozen=True)
class Latency:
    """Exponentially weighted moving average of latencies; the first sample is taken as is."""

    alpha: float = 0.2
    value_ms: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")

    def observe(self, ms: float) -> Latency:
        if not math.isfinite(ms) or ms < 0:
            raise ValueError("a latency is a finite, non-negative number of milliseconds")
        if self.value_ms is None:
            return replace(self, value_ms=float(ms))
        return replace(self, value_ms=self.alpha * ms + (1.0 - self.alpha) * self.value_ms)


@dataclass(frozen=True)
class Breaker:
    state: BreakerState = "closed"
    consecutive_failures: int = 0
    next_attempt_at_ms: int = 0
    cooldown_ms: int = 0  # of the current or last open period; 0 since the last success
    last_success_at_ms: int | None = None
    latency: Latency = field(default_factory=Latency)
    policy: BreakerPolicy = DEFAULT_POLICY

    # --- queries --------------------------------------------------------------------------

    def state_at(self, now_ms: int) -> BreakerState:
        """The state an operator sees: an open breaker whose cooldown has passed is half-open."""
        if self.state == "open" and self.due(now_ms):
            return "half_open"
        return self.state

    def allows(self, now_ms: int) -> bool:
        """May a call start now? Closed: yes. Open: once the cooldown has passed (then the call
        is the half-open trial). Half-open: only when no trial is in flight (or it timed out)."""
        return self.state == "closed" or self.due(now_ms)

    def due(self, now_ms: int) -> bool:
        """Whether `next_attempt_at_ms` has come, or lies further away than any wait of this
        policy: set by a clock ahead of ours (another leader's, or ours before it was set
        back), it is due now, so that a clock's error never stops the calls."""
        wait_ms = self.next_attempt_at_ms - now_ms
        return wait_ms <= 0 or wait_ms > self.policy.longest_wait_ms

    def retry_delay_ms(self, failures: int, draw: float) -> int:
        """The jittered backoff before the next attempt after `failures` failures while closed:
        `Backoff.jittered` in whole ms, in [delay/2, delay] (the top only through float rounding
        of a draw just below 1)."""
        return int(self.policy.retry.jittered(failures, draw) * 1000)

    # --- events ---------------------------------------------------------------------------

    def on_attempt(self, now_ms: int) -> Breaker:
        """A call starts. Outside `closed` this is the single trial: others wait for its result
        (or for `trial_timeout_ms`). `ValueError` if `allows(now_ms)` is false: a caller bug."""
        if self.state == "closed":
            return self
        if not self.allows(now_ms):
            raise ValueError(f"the breaker is {self.state} until {self.next_attempt_at_ms}")
        return replace(
            self, state="half_open", next_attempt_at_ms=now_ms + self.policy.trial_timeout_ms
        )

    def on_success(self, now_ms: int, latency_ms: float) -> Breaker:
        """The peer answered: close, forget failures and cooldown, record the latency."""
        return replace(
            self,
            state="closed",
            consecutive_failures=0,
            next_attempt_at_ms=now_ms,
            cooldown_ms=0,
            last_success_at_ms=now_ms,
            latency=self.latency.observe(latency_ms),
        )

    def on_failure(self, now_ms: int, draw: float) -> Breaker:
        """A call failed; `draw` in [0, 1) jitters the retry while closed."""
        failures = self.consecutive_failures + 1
        if self.state == "open":  # a late result: count it, keep the cooldown as it is
            return replace(self, consecutive_failures=failures)
        if self.state == "half_open":
            cooldown = min(self.cooldown_ms * 2, self.policy.max_cooldown_ms)
            return self._open(now_ms, failures, max(cooldown, self.policy.initial_cooldown_ms))
        if failures >= self.policy.failure_threshold:
            return self._open(now_ms, failures, self.policy.initial_cooldown_ms)
        return replace(
            self,
            consecutive_failures=failures,
            next_attempt_at_ms=now_ms + self.retry_delay_ms(failures, draw),
        )

    def _open(self, now_ms: int, failures: int, cooldown_ms: int) -> Breaker:
        return replace(
            self,
            state="open",
            consecutive_failures=failures,
            cooldown_ms=cooldown_ms,
            next_attempt_at_ms=now_ms + cooldown_ms,
        )

    # --- durability -----------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "consecutiveFailures": self.consecutive_failures,
            "nextAttemptAtMs": self.next_attempt_at_ms,
            "cooldownMs": self.cooldown_ms,
            "lastSuccessAtMs": self.last_success_at_ms,
            "latencyMs": self.latency.value_ms,
            "latencyAlpha": self.latency.alpha,
        }

    @classmethod
    def from_json(cls, data: Any, policy: BreakerPolicy = DEFAULT_POLICY) -> Breaker:
        """The breaker `to_json` wrote; `ValueError` on anything else."""
        if not isinstance(data, dict) or set(data) != _JSON_MEMBERS:
            raise ValueError(f"a breaker is an object with exactly {sorted(_JSON_MEMBERS)}")
        state = data["state"]
        if state not in STATES:
            raise ValueError(f"unknown breaker state {state!r}")
        latency_ms = data["latencyMs"]
        if latency_ms is not None and (_is_bool(latency_ms) or not _is_number(latency_ms)):
            raise ValueError("latencyMs must be a number or null")
        alpha = data["latencyAlpha"]
        if _is_bool(alpha) or not _is_number(alpha):
            raise ValueError("latencyAlpha must be a number")
        last_success = data["lastSuccessAtMs"]
        return cls(
            state=cast(BreakerState, state),
            consecutive_failures=_natural(data, "consecutiveFailures"),
            next_attempt_at_ms=_integer(data, "nextAttemptAtMs"),
            cooldown_ms=_natural(data, "cooldownMs"),
            last_success_at_ms=None if last_success is None else _integer(data, "lastSuccessAtMs"),
            latency=Latency(
                alpha=float(alpha), value_ms=None if latency_ms is None else float(latency_ms)
            ),
            policy=policy,
        )


_JSON_MEMBERS: Final = frozenset(Breaker().to_json())


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value >= 0


def _integer(data: dict[str, Any], name: str) -> int:
    value = data[name]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer")
    return value


def _natural(data: dict[str, Any], name: str) -> int:
    value = _integer(data, name)
    if value < 0:
        raise ValueError(f"{name} must not be negative")
    return value
