"""ConditionLog: the lines an outage is worth, with time as an input."""

from __future__ import annotations

from registry.outage import ConditionLog


def test_a_condition_is_one_line_then_a_summary_a_minute_then_its_end() -> None:
    logs = ConditionLog("event subscriptions", every=60)
    lines = [logs.failed("database_unavailable", t / 10) for t in range(0, 1200)]  # 10 a second
    said = [line for line in lines if line]
    assert said == [
        "event subscriptions: database_unavailable",
        "event subscriptions: still database_unavailable for 60s"
        " (600 more failures since the last line)",
    ]
    assert logs.succeeded(120.0) == (
        "event subscriptions: back after 120.0s of database_unavailable (1200 failures)"
    )
    assert logs.succeeded(121.0) is None  # nothing was wrong


def test_another_condition_is_said_at_once() -> None:
    logs = ConditionLog("writer")
    assert logs.failed("database_unavailable", 0.0) == "writer: database_unavailable"
    assert logs.failed("database_unavailable", 1.0) is None
    assert logs.failed("database_read_only", 2.0) == "writer: database_read_only"
    assert logs.succeeded(5.0) == "writer: back after 3.0s of database_read_only (1 failures)"
