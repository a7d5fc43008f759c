"""`ChangeLog.submit_seen`: what the appended decision saw comes back with its outcome."""

from __future__ import annotations

from registry.changes import RETRY, Change, ChangeLog, Decided, IdemKey, Outcome, Refusal
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
