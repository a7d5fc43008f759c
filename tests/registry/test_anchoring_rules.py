"""The anchoring rules, pure: admin control over every state, what an entry shows, and how a
submitted batch settles (pending, not final yet, confirmed, dropped / re-orged, exhausted)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from registry.anchoring import (
    REQUEUE_BACKOFF,
    STATES,
    ChainStatus,
    Member,
    Settlement,
    chain_answer_problem,
    control,
    entry_state,
    settle,
    tree_of,
    with_anchor_state,
)
from registry.canonical import canonicalize
from registry.errors import Conflict
from registry.merkle import leaf_hash, verify_proof

HASH = "ab" * 32
ALLOWED = {
    ("retry", "failed"): "pending",
    ("retry", "abandoned"): "pending",
    ("abandon", "pending"): "abandoned",
    ("abandon", "submitted"): "abandoned",
    ("abandon", "failed"): "abandoned",
}


# --- control -------------------------------------------------------------------------------


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("action", ["retry", "abandon"])
def test_control_every_state_and_action(state: str, action: str) -> None:
    expected = ALLOWED.get((action, state))
    if expected is not None:
        assert control("ai_7", state, action) == expected
        return
    with pytest.raises(Conflict) as caught:
        control("ai_7", state, action)
    error = caught.value
    assert error.status == 409
    assert error.code == "intent_state_conflict"
    assert error.details["intentId"] == "ai_7"
    assert error.details["state"] == state
    assert error.details["allowedFrom"] == sorted(
        s for (a, s) in ALLOWED if a == action
    )  # what the client may do instead
    assert state in error.message


def test_confirmed_is_terminal_for_admins() -> None:
    for action in ("retry", "abandon"):
        with pytest.raises(Conflict):
            control("ai_1", "confirmed", action)


# --- entry_state and with_anchor_state --------------------------------------------------------


@pytest.mark.parametrize(
    ("intent", "shown"),
    [
        (None, "unanchored"),
        ("pending", "pending"),
        ("submitted", "pending"),
        ("confirmed", "anchored"),
        ("failed", "failed"),
        ("abandoned", "abandoned"),
    ],
)
def test_entry_state(intent: str | None, shown: str) -> None:
    assert entry_state(intent) == shown


def test_every_intent_state_has_an_entry_state() -> None:
    assert {entry_state(s) for s in STATES} == {"pending", "anchored", "failed", "abandoned"}


def _stored(anchor_state: str) -> str:
    """A stored version as the store holds it: JCS text, with awkward members (unicode,
    escapes, floats, nesting) that a re-serialisation could change."""
    entry = {
        "entryDid": "did:web:agents.example:x",
        "anchorState": anchor_state,
        "sequence": 42,
        "name": 'Agent \u00e9\u00e8 \U0001f600 "quoted" \\ back\nline',
        "itemData": {"temperature": 0.5, "big": 1e21, "tiny": 1e-7, "n": -3, "z": 0},
        "tags": ["b", "a", "\u20ac"],
        "customMetadata": {"\u00e9": [1, {"y": None, "x": True}], "a": False},
    }
    return canonicalize(entry).decode("utf-8")


@pytest.mark.parametrize("intent", [None, "pending", "submitted"])
def test_with_anchor_state_leaves_the_doc_alone(intent: str | None) -> None:
    doc = _stored("pending" if intent else "unanchored")
    assert with_anchor_state(doc, intent) is doc


@pytest.mark.parametrize(
    ("intent", "shown"),
    [("confirmed", "anchored"), ("failed", "failed"), ("abandoned", "abandoned")],
)
def test_with_anchor_state_replaces_only_anchor_state(intent: str, shown: str) -> None:
    doc = _stored("pending")
    served = with_anchor_state(doc, intent)
    parsed = json.loads(served)
    assert parsed["anchorState"] == shown
    # Still JCS, and identical to the stored bytes apart from that one member.
    assert canonicalize(parsed).decode("utf-8") == served
    assert served == doc.replace('"anchorState":"pending"', f'"anchorState":"{shown}"')
    original = json.loads(doc)
    del parsed["anchorState"], original["anchorState"]
    assert canonicalize(parsed) == canonicalize(original)


def test_with_anchor_state_adds_the_member_when_the_doc_lacks_it() -> None:
    doc = canonicalize({"b": 1, "entryDid": "did:web:x"}).decode("utf-8")
    assert with_anchor_state(doc, "confirmed") == (
        '{"anchorState":"anchored","b":1,"entryDid":"did:web:x"}'
    )


# --- settle ------------------------------------------------------------------------------------


def member(n: int, attempts: int = 1) -> Member:
    return Member(f"ai_{n}", f"did:web:agents.example:{n}", n, f"{n:064x}", attempts)


MEMBERS = [member(1), member(2), member(3)]
ROOT = tree_of(MEMBERS).root
NOW = 1_000_000


def included(confirmations: int, root: str = ROOT) -> ChainStatus:
    return ChainStatus(
        "included",
        block_height=10,
        block_hash="cd" * 32,
        confirmations=confirmations,
        block_root=root,
        block_time_ms=777,
    )


def decide(
    status: ChainStatus,
    members: list[Member] = MEMBERS,
    *,
    depth: int = 3,
    max_attempts: int = 5,
    rand: float = 0.5,
) -> Settlement | None:
    return settle(
        members,
        ROOT,
        status,
        finality_depth=depth,
        max_attempts=max_attempts,
        now_ms=NOW,
        rand=rand,
    )


def test_a_pending_transaction_is_not_settled() -> None:
    assert decide(ChainStatus("pending")) is None


@pytest.mark.parametrize("confirmations", [1, 2])
def test_included_but_not_final_is_not_settled(confirmations: int) -> None:
    assert decide(included(confirmations), depth=3) is None


@pytest.mark.parametrize(("depth", "confirmations"), [(3, 3), (3, 4), (1, 1), (0, 1)])
def test_final_with_our_root_is_confirmed_with_the_block(depth: int, confirmations: int) -> None:
    assert decide(included(confirmations), depth=depth) == Settlement(
        "confirmed", block_height=10, block_hash="cd" * 32, anchor_time_ms=777
    )


def test_every_member_proof_verifies_against_the_confirmed_root() -> None:
    tree = tree_of(MEMBERS)
    for index, m in enumerate(MEMBERS):
        proof = tree.proof(index)
        assert proof.root == ROOT
        assert verify_proof(proof, leaf_hash(m.entry_did, m.sequence, m.item_data_hash))


@pytest.mark.parametrize("confirmations", [1, 3, 10])
def test_included_with_another_root_is_dropped(confirmations: int) -> None:
    decision = decide(included(confirmations, root="ee" * 32))
    assert decision is not None
    assert decision.outcome == "dropped"
    assert decision.pending == ("ai_1", "ai_2", "ai_3")
    assert decision.block_height is None


def test_dropped_members_with_attempts_left_go_back_to_pending() -> None:
    decision = decide(ChainStatus("dropped"), rand=0.0)
    assert decision == Settlement(
        "dropped",
        pending=("ai_1", "ai_2", "ai_3"),
        failed=(),
        available_at_ms=NOW + 500,  # attempt 1: 1 s, jittered to half at rand 0
    )


def test_dropped_members_at_max_attempts_fail() -> None:
    members = [member(1, attempts=5), member(2, attempts=2), member(3, attempts=6)]
    decision = decide(ChainStatus("dropped"), members, max_attempts=5)
    assert decision is not None
    assert decision.outcome == "dropped"
    assert decision.pending == ("ai_2",)
    assert decision.failed == ("ai_1", "ai_3")


def test_a_dropped_empty_batch_settles_with_nothing_to_move() -> None:
    decision = decide(ChainStatus("dropped"), [])
    assert decision is not None
    assert (decision.outcome, decision.pending, decision.failed) == ("dropped", (), ())


@given(
    attempts=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=8),
    rand=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
    max_attempts=st.integers(min_value=1, max_value=40),
)
def test_requeue_backoff_is_jittered_within_bounds(
    attempts: list[int], rand: float, max_attempts: int
) -> None:
    members = [member(i + 1, a) for i, a in enumerate(attempts)]
    decision = decide(ChainStatus("dropped"), members, max_attempts=max_attempts, rand=rand)
    assert decision is not None
    base = REQUEUE_BACKOFF.delay(max(attempts))  # the most-tried member sets the pace
    assert NOW + int(base * 500) <= decision.available_at_ms <= NOW + int(base * 1000)
    assert decision.available_at_ms - NOW <= REQUEUE_BACKOFF.maximum * 1000
    assert set(decision.pending) | set(decision.failed) == {m.intent_id for m in members}
    assert not set(decision.pending) & set(decision.failed)
    assert all(m.attempts < max_attempts for m in members if m.intent_id in decision.pending)


def test_backoff_grows_with_attempts_up_to_the_ceiling() -> None:
    delays = []
    for attempts in (1, 2, 3, 20):
        decision = decide(ChainStatus("dropped"), [member(1, attempts)], max_attempts=99, rand=0)
        assert decision is not None
        delays.append(decision.available_at_ms - NOW)
    assert delays == [500, 1000, 2000, 150_000]


@pytest.mark.parametrize(
    "status",
    [ChainStatus("pending"), ChainStatus("dropped"), included(0), included(5)],
)
def test_the_ports_answers_are_well_formed(status: ChainStatus) -> None:
    assert chain_answer_problem(status) is None


@pytest.mark.parametrize(
    ("status", "problem"),
    [
        (None, "a status that is a NoneType, not a ChainStatus"),
        ({"state": "included"}, "a status that is a dict, not a ChainStatus"),
        (ChainStatus("confirmed"), "an unknown transaction state 'confirmed'"),  # type: ignore[arg-type]
        (ChainStatus("included"), "an included transaction whose block_height is None"),
        (replace(included(3), block_height=True), "whose block_height is True"),
        (replace(included(3), confirmations=-1), "whose confirmations is -1"),
        (replace(included(3), block_time_ms=None), "whose block_time_ms is None"),
        (replace(included(3), block_hash=""), "whose block_hash is ''"),
        (replace(included(3), block_root=None), "whose block_root is None"),
    ],
)
def test_answers_outside_the_port_are_named(status: object, problem: str) -> None:
    found = chain_answer_problem(status)
    assert found is not None
    assert found.endswith(problem)
