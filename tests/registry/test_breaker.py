"""The per-peer circuit breaker (design §9): every transition at explicit times, and Hypothesis."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from registry.breaker import DEFAULT_POLICY, Breaker, BreakerPolicy, Latency
from registry.ratelimit import Backoff

T0 = 1_767_225_600_000
SECOND = 1000
MINUTE = 60 * SECOND


def failed(breaker: Breaker, times: int, now_ms: int, draw: float = 0.0) -> Breaker:
    for _ in range(times):
        breaker = breaker.on_failure(now_ms, draw)
    return breaker


def opened(now_ms: int = T0) -> Breaker:
    return failed(Breaker(), 5, now_ms)


# --- closed ------------------------------------------------------------------------------------


def test_a_new_breaker_is_closed_and_allows_calls() -> None:
    breaker = Breaker()
    assert (breaker.state, breaker.consecutive_failures, breaker.next_attempt_at_ms) == (
        "closed",
        0,
        0,
    )
    assert breaker.allows(T0)
    assert breaker.state_at(T0) == "closed"
    assert breaker.on_attempt(T0) is breaker


def test_failures_below_the_threshold_stay_closed_and_schedule_a_jittered_retry() -> None:
    breaker = Breaker()
    expected_delays = [1000, 2000, 4000, 8000]  # draw 1.0 (clamped): the full delay
    for n, delay in enumerate(expected_delays, start=1):
        breaker = breaker.on_failure(T0, draw=1.0)
        assert breaker.state == "closed"
        assert breaker.consecutive_failures == n
        assert breaker.next_attempt_at_ms == T0 + delay
        assert breaker.allows(T0)  # closed: the schedule is advisory, calls may still flow


@pytest.mark.parametrize(
    ("failures", "draw", "delay_ms"),
    [
        (1, 0.0, 500),
        (1, 0.5, 750),
        (1, 0.999, 999),
        (2, 0.0, 1000),
        (3, 0.25, 2500),
        (6, 0.0, 15_000),  # 1 s × 2^5 = 32 s, capped at 30 s
        (50, 0.999, 29_985),
        (50, -3.0, 15_000),  # a draw outside [0, 1) is clamped
        (50, 7.0, 30_000),
    ],
)
def test_retry_delay_is_equal_jitter_over_the_backoff(
    failures: int, draw: float, delay_ms: int
) -> None:
    assert Breaker().retry_delay_ms(failures, draw) == delay_ms


@given(failures=st.integers(1, 200), draw=st.floats(0.0, 1.0, exclude_max=True))
def test_retry_delay_jitter_bounds(failures: int, draw: float) -> None:
    base_ms = DEFAULT_POLICY.retry.delay(failures) * 1000
    delay = Breaker().retry_delay_ms(failures, draw)
    assert base_ms / 2 <= delay <= base_ms  # `<` in exact arithmetic; float may round up
    assert delay <= 30_000


def test_the_retry_backoff_comes_from_the_policy() -> None:
    policy = BreakerPolicy(retry=Backoff(initial=0.1, factor=3.0, maximum=1.0))
    breaker = failed(Breaker(policy=policy), 2, T0, draw=0.0)
    assert breaker.next_attempt_at_ms == T0 + 150  # 0.3 s / 2


def test_a_success_while_closed_resets_the_failure_count() -> None:
    breaker = failed(Breaker(), 4, T0).on_success(T0 + 5, latency_ms=12)
    assert (breaker.state, breaker.consecutive_failures) == ("closed", 0)
    assert breaker.next_attempt_at_ms == T0 + 5
    assert breaker.last_success_at_ms == T0 + 5
    assert failed(breaker, 4, T0 + 6).state == "closed"  # counting starts over


# --- open --------------------------------------------------------------------------------------


def test_the_fifth_consecutive_failure_opens_for_30_seconds() -> None:
    breaker = failed(Breaker(), 4, T0)
    assert breaker.state == "closed"
    breaker = breaker.on_failure(T0 + 7, draw=0.5)
    assert breaker.state == "open"
    assert breaker.consecutive_failures == 5
    assert breaker.cooldown_ms == 30 * SECOND
    assert breaker.next_attempt_at_ms == T0 + 7 + 30 * SECOND  # not jittered


def test_open_refuses_until_the_cooldown_has_passed_then_reports_half_open() -> None:
    breaker = opened()
    for now in (T0, T0 + 1, T0 + 30 * SECOND - 1):
        assert not breaker.allows(now)
        assert breaker.state_at(now) == "open"
        with pytest.raises(ValueError, match="open until"):
            breaker.on_attempt(now)
    assert breaker.allows(T0 + 30 * SECOND)
    assert breaker.state_at(T0 + 30 * SECOND) == "half_open"
    assert breaker.state == "open"  # nothing moves until the caller says a call starts


def test_a_late_failure_while_open_counts_but_does_not_move_the_next_attempt() -> None:
    breaker = opened().on_failure(T0 + 10 * SECOND, draw=0.9)
    assert breaker.state == "open"
    assert breaker.consecutive_failures == 6
    assert breaker.next_attempt_at_ms == T0 + 30 * SECOND
    assert breaker.cooldown_ms == 30 * SECOND


def test_a_late_success_while_open_closes() -> None:
    breaker = opened().on_success(T0 + SECOND, latency_ms=40)
    assert (breaker.state, breaker.consecutive_failures, breaker.cooldown_ms) == ("closed", 0, 0)
    assert breaker.allows(T0 + SECOND)


# --- half-open ---------------------------------------------------------------------------------


def test_half_open_allows_a_single_trial_at_a_time() -> None:
    at = T0 + 30 * SECOND
    trial = opened().on_attempt(at)
    assert trial.state == "half_open"
    assert trial.next_attempt_at_ms == at + DEFAULT_POLICY.trial_timeout_ms
    assert not trial.allows(at)
    assert not trial.allows(at + 59_999)
    with pytest.raises(ValueError, match="half_open until"):
        trial.on_attempt(at + 1)


def test_a_lost_trial_frees_the_slot_after_the_trial_timeout() -> None:
    at = T0 + 30 * SECOND
    trial = opened().on_attempt(at)
    assert trial.allows(at + 60 * SECOND)
    second = trial.on_attempt(at + 60 * SECOND)
    assert second.state == "half_open"
    assert second.cooldown_ms == 30 * SECOND  # a timed-out trial is not a failure by itself
    assert not second.allows(at + 60 * SECOND)


def test_a_successful_trial_closes_and_resets_the_cooldown() -> None:
    at = T0 + 30 * SECOND
    closed = opened().on_attempt(at).on_success(at + 250, latency_ms=250)
    assert closed.state == "closed"
    assert (closed.consecutive_failures, closed.cooldown_ms) == (0, 0)
    assert closed.allows(at + 250)
    reopened = failed(closed, 5, at + SECOND)
    assert reopened.cooldown_ms == 30 * SECOND  # starts over, not doubled


def test_a_failed_trial_reopens_with_the_cooldown_doubled() -> None:
    at = T0 + 30 * SECOND
    breaker = opened().on_attempt(at).on_failure(at + 100, draw=0.3)
    assert breaker.state == "open"
    assert breaker.consecutive_failures == 6
    assert breaker.cooldown_ms == 60 * SECOND
    assert breaker.next_attempt_at_ms == at + 100 + 60 * SECOND
    assert not breaker.allows(at + 100 + 60 * SECOND - 1)
    assert breaker.allows(at + 100 + 60 * SECOND)


def test_the_cooldown_doubles_on_each_reopen_up_to_ten_minutes() -> None:
    breaker, now = opened(), T0
    cooldowns = [breaker.cooldown_ms]
    for _ in range(7):
        now = breaker.next_attempt_at_ms
        breaker = breaker.on_attempt(now).on_failure(now + 1, draw=0.0)
        now += 1
        assert breaker.next_attempt_at_ms == now + breaker.cooldown_ms
        cooldowns.append(breaker.cooldown_ms)
    assert [c // SECOND for c in cooldowns] == [30, 60, 120, 240, 480, 600, 600, 600]
    assert breaker.consecutive_failures == 12


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="failure_threshold"):
        BreakerPolicy(failure_threshold=0)
    with pytest.raises(ValueError, match="cooldown"):
        BreakerPolicy(initial_cooldown_ms=10, max_cooldown_ms=5)
    with pytest.raises(ValueError, match="cooldown"):
        BreakerPolicy(initial_cooldown_ms=0)
    with pytest.raises(ValueError, match="trial_timeout_ms"):
        BreakerPolicy(trial_timeout_ms=0)


def test_a_threshold_of_one_opens_on_the_first_failure() -> None:
    breaker = Breaker(policy=BreakerPolicy(failure_threshold=1)).on_failure(T0, 0.0)
    assert breaker.state == "open"


# --- latency -----------------------------------------------------------------------------------


def test_ewma_latency_values() -> None:
    latency = Latency()
    assert latency.value_ms is None
    latency = latency.observe(100)
    assert latency.value_ms == 100.0  # the first sample is taken as is
    latency = latency.observe(200)
    assert latency.value_ms == pytest.approx(120.0)  # 0.2 × 200 + 0.8 × 100
    latency = latency.observe(0)
    assert latency.value_ms == pytest.approx(96.0)
    assert Latency(alpha=1.0).observe(5).observe(9).value_ms == 9.0
    assert Latency(alpha=0.5).observe(10).observe(20).observe(40).value_ms == pytest.approx(27.5)


def test_latency_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="alpha"):
        Latency(alpha=0.0)
    with pytest.raises(ValueError, match="alpha"):
        Latency(alpha=1.5)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="latency"):
            Latency().observe(bad)


def test_the_breaker_tracks_latency_of_successes_only() -> None:
    breaker = Breaker().on_success(T0, 100).on_failure(T0 + 1, 0.0).on_success(T0 + 2, 200)
    assert breaker.latency.value_ms == pytest.approx(120.0)


# --- durability --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "breaker",
    [
        Breaker(),
        failed(Breaker(), 3, T0, draw=0.4),
        opened(),
        opened().on_attempt(T0 + 30 * SECOND),
        opened().on_attempt(T0 + 30 * SECOND).on_failure(T0 + 31 * SECOND, 0.0),
        Breaker().on_success(T0, 12.5).on_success(T0 + 1, 3),
        Breaker(latency=Latency(alpha=0.5)),
    ],
)
def test_to_json_from_json_round_trip(breaker: Breaker) -> None:
    data = breaker.to_json()
    assert Breaker.from_json(json.loads(json.dumps(data))) == breaker


def test_to_json_is_pinned() -> None:
    breaker = opened().on_success(T0, 40).on_failure(T0 + 1, 0.0)
    assert breaker.to_json() == {
        "state": "closed",
        "consecutiveFailures": 1,
        "nextAttemptAtMs": T0 + 1 + 500,
        "cooldownMs": 0,
        "lastSuccessAtMs": T0,
        "latencyMs": 40.0,
        "latencyAlpha": 0.2,
    }


def test_from_json_takes_the_policy_from_configuration() -> None:
    policy = BreakerPolicy(failure_threshold=2)
    restored = Breaker.from_json(failed(Breaker(), 1, T0).to_json(), policy)
    assert restored.policy == policy
    assert restored.on_failure(T0, 0.0).state == "open"


@pytest.mark.parametrize(
    "change",
    [
        {"state": "ajar"},
        {"consecutiveFailures": -1},
        {"consecutiveFailures": True},
        {"consecutiveFailures": 1.0},
        {"nextAttemptAtMs": "0"},
        {"cooldownMs": None},
        {"lastSuccessAtMs": 1.5},
        {"latencyMs": "fast"},
        {"latencyMs": -1},
        {"latencyMs": False},
        {"latencyAlpha": None},
        {"latencyAlpha": 0},
        {"extra": 1},
    ],
)
def test_from_json_refuses_anything_else(change: dict[str, object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own message
        Breaker.from_json({**Breaker().to_json(), **change})


@pytest.mark.parametrize("data", [None, [], "closed", {}])
def test_from_json_refuses_non_breakers(data: object) -> None:
    with pytest.raises(ValueError, match="exactly"):
        Breaker.from_json(data)


# --- property: a caller that honours allows() never calls an open peer early ----------------

events = st.lists(
    st.tuples(
        st.integers(0, 5 * MINUTE),  # time advance
        st.sampled_from(["call_ok", "call_fail", "late_ok", "late_fail", "peek"]),
        st.floats(0.0, 1.0, exclude_max=True),  # jitter draw
    ),
    max_size=80,
)


@given(events=events)
def test_never_allows_a_call_while_open_before_next_attempt(
    events: list[tuple[int, str, float]],
) -> None:
    breaker, now = Breaker(), T0
    blocked_until: int | None = None  # set while open, cleared by a success
    in_flight_trial_until: int | None = None
    for advance, event, draw in events:
        now += advance
        if blocked_until is not None and now < blocked_until:
            assert not breaker.allows(now)
            assert breaker.state_at(now) == breaker.state != "closed"
        if breaker.state == "open":
            assert breaker.allows(now) == (now >= breaker.next_attempt_at_ms)
            assert breaker.next_attempt_at_ms - now <= DEFAULT_POLICY.max_cooldown_ms
        if in_flight_trial_until is not None and now < in_flight_trial_until:
            assert not breaker.allows(now)  # one trial at a time

        if event in ("call_ok", "call_fail"):
            if not breaker.allows(now):
                with pytest.raises(ValueError, match="until"):
                    breaker.on_attempt(now)
                continue
            was_closed = breaker.state == "closed"
            breaker = breaker.on_attempt(now)
            if not was_closed:
                assert breaker.state == "half_open"
                in_flight_trial_until = breaker.next_attempt_at_ms
        if event in ("call_ok", "late_ok"):
            breaker = breaker.on_success(now, latency_ms=draw * 100)
            blocked_until = in_flight_trial_until = None
            assert (breaker.state, breaker.consecutive_failures) == ("closed", 0)
        elif event in ("call_fail", "late_fail"):
            before = breaker
            breaker = breaker.on_failure(now, draw)
            in_flight_trial_until = None
            assert breaker.consecutive_failures == before.consecutive_failures + 1
            if breaker.state == "open":
                if before.state == "open":  # a late failure neither shortens nor extends
                    assert breaker.next_attempt_at_ms == before.next_attempt_at_ms
                else:
                    assert breaker.next_attempt_at_ms == now + breaker.cooldown_ms
                blocked_until = breaker.next_attempt_at_ms
                assert (
                    DEFAULT_POLICY.initial_cooldown_ms
                    <= breaker.cooldown_ms
                    <= DEFAULT_POLICY.max_cooldown_ms
                )
            else:
                assert breaker.consecutive_failures < DEFAULT_POLICY.failure_threshold
        assert Breaker.from_json(breaker.to_json()) == breaker


def test_replace_keeps_the_value_semantics() -> None:
    breaker = opened()
    assert replace(breaker) == breaker
    assert hash(breaker) == hash(replace(breaker))
