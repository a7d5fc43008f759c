"""The sans-IO token bucket and backoff: (state, now) in, (decision, state) out."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from registry.ratelimit import (
    Backoff,
    Bucket,
    Decision,
    Rate,
    charge,
    client_of,
    is_idle,
    refill,
    take,
)


def drain(rate: Rate, now: float, count: int) -> tuple[list[Decision], Bucket | None]:
    bucket: Bucket | None = None
    decisions = []
    for _ in range(count):
        decision, bucket = take(bucket, rate, now)
        decisions.append(decision)
    return decisions, bucket


def test_rate_capacity_and_refill_speed() -> None:
    assert Rate(120).capacity == 120.0
    assert Rate(120).per_second == 2.0


def test_a_new_client_starts_with_a_full_bucket() -> None:
    decision, bucket = take(None, Rate(60), now=100.0)
    assert decision == Decision(
        allowed=True, limit=60, remaining=59, retry_after=0.0, reset_after=1.0
    )
    assert bucket == Bucket(tokens=59.0, updated=100.0)


def test_per_minute_requests_at_once_then_refused_with_exact_retry_after() -> None:
    decisions, bucket = drain(Rate(60), now=0.0, count=61)
    assert all(d.allowed for d in decisions[:60])
    assert [d.remaining for d in decisions[:3]] == [59, 58, 57]
    assert decisions[59].remaining == 0
    refused = decisions[60]
    assert refused == Decision(
        allowed=False, limit=60, remaining=0, retry_after=1.0, reset_after=60.0
    )
    assert bucket == Bucket(tokens=0.0, updated=0.0)


def test_refused_request_takes_no_token() -> None:
    _, bucket = drain(Rate(60), now=0.0, count=60)
    for _ in range(5):
        decision, bucket = take(bucket, Rate(60), now=0.0)
        assert not decision.allowed
        assert decision.retry_after == 1.0
    assert bucket == Bucket(tokens=0.0, updated=0.0)


def test_retry_after_shrinks_as_the_bucket_refills() -> None:
    rate = Rate(120)  # 2 tokens a second
    _, bucket = drain(rate, now=0.0, count=120)
    decision, bucket = take(bucket, rate, now=0.25)
    assert (decision.allowed, decision.retry_after) == (False, 0.25)
    decision, bucket = take(bucket, rate, now=0.5)
    assert (decision.allowed, decision.retry_after, decision.remaining) == (True, 0.0, 0)


def test_refill_is_linear_and_capped_at_capacity() -> None:
    rate = Rate(60)
    empty = Bucket(tokens=0.0, updated=10.0)
    assert refill(empty, rate, 10.0) == 0.0
    assert refill(empty, rate, 10.5) == 0.5
    assert refill(empty, rate, 40.0) == 30.0
    assert refill(empty, rate, 70.0) == 60.0
    assert refill(empty, rate, 10_000.0) == 60.0
    assert refill(None, rate, 0.0) == 60.0


def test_a_clock_going_backwards_refills_nothing() -> None:
    assert refill(Bucket(tokens=3.0, updated=10.0), Rate(60), 5.0) == 3.0


def test_after_a_full_minute_idle_the_bucket_is_full_again() -> None:
    rate = Rate(60)
    _, bucket = drain(rate, now=0.0, count=60)
    assert bucket is not None
    assert not is_idle(bucket, rate, 59.0)
    assert is_idle(bucket, rate, 60.0)
    decisions = []
    for _ in range(61):
        decision, bucket = take(bucket, rate, 60.0)
        decisions.append(decision.allowed)
    assert decisions == [True] * 60 + [False]


def test_reset_after_is_the_time_to_a_full_bucket() -> None:
    rate = Rate(30)  # one token every 2 s
    decisions, _ = drain(rate, now=0.0, count=10)
    assert decisions[-1].reset_after == 20.0


@given(
    st.integers(1, 600),
    st.lists(st.floats(0.0, 5.0, allow_nan=False), min_size=1, max_size=300),
)
def test_never_more_than_capacity_plus_refill_over_any_window(
    per_minute: int, gaps: list[float]
) -> None:
    rate = Rate(per_minute)
    bucket: Bucket | None = None
    now = 0.0
    allowed_at: list[float] = []
    for gap in gaps:
        now += gap
        decision, bucket = take(bucket, rate, now)
        assert 0.0 <= bucket.tokens <= rate.capacity
        assert decision.remaining == int(bucket.tokens)
        if decision.allowed:
            assert decision.retry_after == 0.0
            allowed_at.append(now)
        else:
            assert 0.0 < decision.retry_after <= 1.0 / rate.per_second
            # Coming back exactly when told is enough.
            assert take(bucket, rate, now + decision.retry_after + 1e-9)[0].allowed
    for start_index, start in enumerate(allowed_at):
        for end_index in range(start_index, len(allowed_at)):
            window = allowed_at[end_index] - start
            served = end_index - start_index + 1
            assert served <= rate.capacity + window * rate.per_second + 1e-6


@given(st.integers(1, 600), st.floats(0.0, 120.0), st.floats(0.0, 600.0))
def test_an_idle_bucket_decides_exactly_like_a_forgotten_one(
    per_minute: int, tokens_fraction: float, later: float
) -> None:
    rate = Rate(per_minute)
    bucket = Bucket(tokens=min(rate.capacity, tokens_fraction), updated=0.0)
    if is_idle(bucket, rate, later):
        assert take(bucket, rate, later) == take(None, rate, later)


# --- backoff ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failures", "delay"),
    [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0), (6, 16.0), (7, 30.0), (50, 30.0)],
)
def test_default_backoff_doubles_from_half_a_second_up_to_30(failures: int, delay: float) -> None:
    assert Backoff().delay(failures) == delay


def test_backoff_with_custom_parameters() -> None:
    backoff = Backoff(initial=1.0, factor=3.0, maximum=10.0)
    assert [backoff.delay(n) for n in range(1, 5)] == [1.0, 3.0, 9.0, 10.0]


def test_backoff_before_any_failure_is_the_initial_delay() -> None:
    assert Backoff().delay(0) == 0.5


@pytest.mark.parametrize("failures", [1024, 1025, 10_000])
def test_backoff_stays_at_the_ceiling_after_very_many_failures(failures: int) -> None:
    # At the 30 s ceiling, 1025 consecutive failures take about eight and a half hours.
    assert Backoff().delay(failures) == 30.0


@pytest.mark.parametrize(
    ("header", "peer", "hops", "client"),
    [
        ("", "10.0.0.9", 0, "10.0.0.9"),
        ("1.2.3.4", "10.0.0.9", 0, "10.0.0.9"),  # no proxy trusted: the header is anyone's
        ("1.2.3.4", "10.0.0.9", 1, "1.2.3.4"),
        ("6.6.6.6, 1.2.3.4", "10.0.0.9", 1, "1.2.3.4"),  # the client cannot choose its address
        ("6.6.6.6, 1.2.3.4, 10.0.0.8", "10.0.0.9", 2, "1.2.3.4"),
        ("1.2.3.4", "10.0.0.9", 2, "10.0.0.9"),  # fewer hops than trusted: the peer
        (" , ", None, 1, "unknown"),
        ("", "2001:db8::1", 0, "2001:db8::/64"),  # an IPv6 client by its /64
        ("2001:db8:0:0:ffff::9", "10.0.0.9", 1, "2001:db8::/64"),
        # An element that is not an address was not written by a trusted proxy: the peer.
        ("x0 principal=did:key:zAdmin", "10.0.0.9", 1, "10.0.0.9"),
        ("1.2.3.4, " + "9" * 5000, "10.0.0.9", 1, "10.0.0.9"),
        ("6.6.6.6, 1.2.3.4:5678", "10.0.0.9", 1, "1.2.3.4"),  # some proxies add the port
        ("[2001:db8::1]:443", "10.0.0.9", 1, "2001:db8::/64"),
        ("[2001:db8::1]", "10.0.0.9", 1, "2001:db8::/64"),
        ("1.2.3.4:x:y", "10.0.0.9", 1, "10.0.0.9"),
    ],
)
def test_the_client_of_a_request(header: str, peer: str | None, hops: int, client: str) -> None:
    assert client_of(header, peer, hops) == client


def test_a_cost_takes_that_many_tokens_and_a_cost_above_the_capacity_a_full_bucket() -> None:
    rate = Rate(600)  # 10 a second
    decision, bucket = take(None, rate, 0.0, cost=500)
    assert decision.allowed
    assert decision.remaining == 100
    decision, bucket = take(bucket, rate, 0.0, cost=101)
    assert not decision.allowed
    assert decision.retry_after == pytest.approx(0.1)
    decision, bucket = take(bucket, rate, 0.1, cost=101)
    assert decision.allowed
    decision, _ = take(None, rate, 0.0, cost=10_000)  # more than a full bucket: all of it
    assert decision.allowed
    assert decision.remaining == 0


def test_a_charge_after_the_fact_runs_into_debt_and_refuses_until_repaid() -> None:
    """Work measured once done (a query's database time): the bucket may go below zero, and a
    zero-cost take (the admission check) refuses until it is back at zero."""
    rate = Rate(600)  # 10 a second
    decision, bucket = take(None, rate, 0.0, cost=0)
    assert decision.allowed  # a full bucket admits
    bucket = charge(bucket, rate, 0.0, cost=650)  # the query took more than the whole budget
    assert bucket.tokens == pytest.approx(-50)
    decision, bucket = take(bucket, rate, 1.0, cost=0)  # 10 refilled: still 40 in debt
    assert not decision.allowed
    assert decision.retry_after == pytest.approx(4.0)
    decision, _ = take(bucket, rate, 5.0, cost=0)
    assert decision.allowed


def test_a_debt_is_what_the_work_cost_and_a_negative_charge_takes_nothing() -> None:
    rate = Rate(60)  # 1 a second
    bucket = charge(None, rate, 0.0, cost=150)  # a statement that ran 2.5 budgets long
    assert bucket.tokens == -90
    decision, _ = take(bucket, rate, 0.0, cost=0)
    assert decision.retry_after == pytest.approx(90.0)  # refused until it has been paid
    assert charge(None, rate, 0.0, cost=-5).tokens == 60
    assert not is_idle(charge(None, rate, 0.0, cost=0.5), rate, 0.0)  # a debt is remembered
