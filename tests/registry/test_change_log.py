"""`ChangeLog.submit_seen`: what the appended decision saw comes back with its outcome; the
log's time format."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from registry.changes import (
    RETRY,
    Change,
    ChangeLog,
    Decided,
    IdemKey,
    Outcome,
    Refusal,
    rfc3339_ms,
)
from registry.errors import Invalid


class Appends:
    """An append that answers Retry to the first `retries` changes, then appends."""

    def __init__(self, retries: int) -> None:
        self.retries = retries
        self.appended: list[Change] = []

    async def __call__(self, change: Change, idem: IdemKey | None) -> Outcome:
        if self.retries:
            self.retries -= 1
            return Outcome(None, None, Refusal(RETRY, "moved", "the record moved", {}))
        self.appended.append(change)
        return Outcome(len(self.appended), "{}", None)


class Recorder:
    def __init__(self) -> None:
        self.refusals: list[Refusal] = []

    async def record_refusal(self, idem: IdemKey, refusal: Refusal) -> Outcome:
        self.refusals.append(refusal)
        return Outcome(None, None, refusal)


async def test_after_retries_the_seen_value_is_the_last_decisions() -> None:
    appends = Appends(retries=2)
    log = ChangeLog(appends, Recorder())
    decisions: list[int] = []

    async def decide() -> Decided[str]:
        decisions.append(len(decisions))
        return Decided(Change("entry.updated", "did:x", {}), f"head {len(decisions)}")

    outcome, seen = await log.submit_seen(None, decide)
    assert (outcome.sequence, seen, decisions) == (1, "head 3", [0, 1, 2])


async def test_a_refused_decision_sees_nothing() -> None:
    recorder = Recorder()
    log = ChangeLog(Appends(retries=0), recorder)

    async def decide() -> Decided[str]:
        raise Invalid("no", code="entry_invalid")

    idem = IdemKey("scope", "op", "key", b"fp")
    outcome, seen = await log.submit_seen(idem, decide)
    assert seen is None
    assert outcome.refusal is not None
    assert [r.code for r in recorder.refusals] == ["entry_invalid"]


def _rfc3339_exactly(ms: int) -> str:
    """The reference, in integer arithmetic (a float of seconds drifts by a millisecond from
    about the year 2400: what `datetime.fromtimestamp(ms / 1000)` wrote)."""
    moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# Years 1-9999 (what a datetime holds): the cached-prefix path covers 1000-9999.
_MS = st.integers(-62_135_596_800_000, 253_402_300_799_999)


@given(_MS)
def test_a_time_is_written_as_rfc_3339_with_milliseconds(ms: int) -> None:
    assert rfc3339_ms(ms) == _rfc3339_exactly(ms)


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "1970-01-01T00:00:00.000Z"),
        (-1, "1969-12-31T23:59:59.999Z"),
        (1_764_403_156_123, "2025-11-29T07:59:16.123Z"),
        (253_402_300_799_999, "9999-12-31T23:59:59.999Z"),
        (-30_610_224_000_000, "1000-01-01T00:00:00.000Z"),
        (-30_610_224_000_001, "0999-12-31T23:59:59.999Z"),
    ],
)
def test_times_at_the_edges_of_the_fast_path(ms: int, text: str) -> None:
    assert rfc3339_ms(ms) == text
