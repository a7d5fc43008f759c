"""Which database answers a read (registry/store/routing.py): the replica only for a read that
may lag, once it has replayed everything the process wrote or saw and the request's floor."""

from __future__ import annotations

import pytest

from registry.config import Config
from registry.store.routing import MAX_FLOOR, STALL_SECONDS, ReplicaState, parse_floor


def test_a_read_that_must_not_lag_never_goes_to_the_replica() -> None:
    state = ReplicaState(replayed=100, seen=50)
    assert not state.serves(None, now=0.0)
    assert state.serves(0, now=0.0)


def test_the_replica_serves_once_it_has_replayed_what_the_process_saw_and_the_floor() -> None:
    state = ReplicaState(replayed=-1)
    assert not state.serves(0, now=0.0)  # not asked yet
    state.replayed = 10
    state.saw(12)  # this process wrote 12
    assert not state.serves(0, now=0.0)
    assert state.lag == 2
    state.replayed = 12
    assert state.serves(0, now=0.0)
    assert state.serves(12, now=0.0)
    assert not state.serves(13, now=0.0)  # a client that wrote 13 through another process
    state.saw(5)  # what was seen never goes back
    assert state.seen == 12


def test_an_unreachable_replica_is_left_alone_until_its_retry_time() -> None:
    state = ReplicaState(replayed=10, seen=10, down_until=5.0)
    assert not state.serves(0, now=4.9)
    assert state.serves(0, now=5.0)


def test_the_lag_counts_what_the_primary_holds_too() -> None:
    """A process that only reads learns of the log from the primary's head (read every
    PRIMARY_HEAD_SECONDS): the replica's lag shows though this process saw nothing."""
    state = ReplicaState()
    assert state.replayed_to(0, now=0.0)
    state.primary = 20
    assert state.lag == 20
    state.saw(25)
    assert state.lag == 25


def test_a_replica_that_stopped_replaying_is_told_after_the_stall_window() -> None:
    state = ReplicaState()
    state.primary = 5
    assert state.replayed_to(3, now=0.0)  # behind, but it just moved
    assert state.replayed_to(3, now=STALL_SECONDS - 0.1)
    assert not state.replayed_to(3, now=STALL_SECONDS)  # stopped: treated as down
    state.replayed = -1  # what the store does when it is down
    assert not state.replayed_to(3, now=STALL_SECONDS + 5)  # back, still stopped: at once
    assert state.replayed_to(4, now=STALL_SECONDS + 10)  # it moves again
    state.primary = 4
    assert state.replayed_to(4, now=3 * STALL_SECONDS)  # caught up: an idle log is no stall
    assert state.replayed_to(4, now=10 * STALL_SECONDS)


@pytest.mark.parametrize("value", ["0", "7", str(MAX_FLOOR)])
def test_a_floor_is_a_decimal_sequence(value: str) -> None:
    assert parse_floor(value) == int(value)


@pytest.mark.parametrize(
    "value", ["", "-1", "+1", "1.0", "1e3", " 1", "０", "٣", str(MAX_FLOOR + 1), "9" * 30]
)
def test_anything_else_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="Registry-Min-Sequence"):
        parse_floor(value)


def test_a_replica_needs_a_primary_url() -> None:
    with pytest.raises(ValueError, match="read_url needs url"):
        Config.model_validate({"database": {"read_url": "postgresql://replica/registry"}})
    config = Config.model_validate(
        {"database": {"url": "postgresql://p/r", "read_url": "postgresql://replica/r"}}
    )
    assert config.database.read_url == "postgresql://replica/r"
    with pytest.raises(ValueError, match="postgresql://"):
        Config.model_validate({"database": {"url": "postgresql://p/r", "read_url": "mysql://x"}})
