"""Anchoring, pure: the intent lifecycle and the supervisor's decisions (design §8, spec 2.2-2.3).

An anchor intent moves

    pending ──claim──▶ submitted ──final and proven──▶ confirmed   (the entry is `anchored`)
       ▲                   │
       └──dropped/re-org───┤ (back to pending after a backoff, while attempts < max_attempts)
                           └──dropped/re-org, attempts exhausted──▶ failed
    admin retry:   failed | abandoned → pending (attempts start again)
    admin abandon: pending | submitted | failed → abandoned

The supervisor (actors/anchoring.py) performs the I/O; this module decides: which batch to build
(`leaves_of`), when a submitted batch is settled and how (`settle`), what an admin may do
(`control`), and what an entry shows (`entry_state`, `with_anchor_state`). Time comes in as
milliseconds, randomness as a number in [0, 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from registry.canonical import canonicalize, sha256_hex
from registry.errors import Conflict
from registry.merkle import MerkleProof, MerkleTree, leaf_hash, verify_proof
from registry.ratelimit import Backoff

STATES = ("pending", "submitted", "confirmed", "failed", "abandoned")

# What an entry's `anchorState` says for the state of its head version's intent.
ENTRY_STATES = {
    "pending": "pending",
    "submitted": "pending",
    "confirmed": "anchored",
    "failed": "failed",
    "abandoned": "abandoned",
}

# Admin control (design §8, §12): action → (states it is allowed from, the state it leads to).
CONTROLS: dict[str, tuple[frozenset[str], str]] = {
    "retry": (frozenset({"failed", "abandoned"}), "pending"),
    "abandon": (frozenset({"pending", "submitted", "failed"}), "abandoned"),
}

PAST = {"retry": "retried", "abandon": "abandoned"}
REQUEUE_BACKOFF = Backoff(initial=1.0, maximum=300.0)


def entry_state(intent_state: str | None) -> str:
    return "unanchored" if intent_state is None else ENTRY_STATES[intent_state]


def with_anchor_state(doc: str, intent_state: str | None) -> str:
    """The served entry `doc` with `anchorState` for its intent's state (the stored version
    says `pending` when it recorded an intent, `unanchored` when it did not)."""
    shown = entry_state(intent_state)
    if intent_state is None or shown == "pending":
        return doc
    entry = json.loads(doc)
    entry["anchorState"] = shown
    return canonicalize(entry).decode("utf-8")


def control(intent_id: str, state: str, action: str) -> str:
    """The state an admin `action` ("retry" | "abandon") moves an intent in `state` to."""
    allowed, to = CONTROLS[action]
    if state not in allowed:
        raise Conflict(
            f"an intent in state {state} cannot be {PAST[action]}",
            code="intent_state_conflict",
            details={"intentId": intent_id, "state": state, "allowedFrom": sorted(allowed)},
        )
    return to


@dataclass(frozen=True)
class Member:
    """An intent in a batch, in leaf order."""

    intent_id: str
    entry_did: str
    sequence: int
    item_data_hash: str
    attempts: int

    @property
    def leaf(self) -> str:
        return leaf_hash(self.entry_did, self.sequence, self.item_data_hash)


def tree_of(members: list[Member]) -> MerkleTree:
    return MerkleTree([m.leaf for m in members])


@dataclass(frozen=True)
class ChainStatus:
    """What the chain says about a batch's transaction."""

    state: Literal["pending", "included", "dropped"]
    block_height: int | None = None
    block_hash: str | None = None
    confirmations: int = 0
    block_root: str | None = None  # the root this transaction put in its block
    block_time_ms: int | None = None


def chain_answer_problem(status: object) -> str | None:
    """What is wrong with a chain's answer to `status`, or None when it is one the port allows
    (registry/chain.py): `pending`, `dropped`, or `included` with its block's height, hash and
    time, its confirmations and the root the transaction carries. Anything else is an answer
    nothing can be decided on (the supervisor takes it as `ChainUnavailable`): taken at its word,
    an `included` without its block would confirm an anchor that names no block, and an unknown
    state would read as dropped and anchor the batch again."""
    if not isinstance(status, ChainStatus):
        return f"a status that is a {type(status).__name__}, not a ChainStatus"
    if status.state in ("pending", "dropped"):
        return None
    if status.state != "included":
        return f"an unknown transaction state {status.state!r}"
    fields = {
        "block_height": status.block_height,
        "confirmations": status.confirmations,
        "block_time_ms": status.block_time_ms,
    }
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"an included transaction whose {name} is {value!r}"
    for name, text in (("block_hash", status.block_hash), ("block_root", status.block_root)):
        if not isinstance(text, str) or not text:
            return f"an included transaction whose {name} is {text!r}"
    return None


@dataclass(frozen=True)
class Settlement:
    outcome: Literal["confirmed", "dropped"]
    pending: tuple[str, ...] = ()  # back to pending (dropped)
    failed: tuple[str, ...] = ()  # attempts exhausted (dropped)
    available_at_ms: int = 0
    block_height: int | None = None
    block_hash: str | None = None
    anchor_time_ms: int | None = None


def settle(
    members: list[Member],
    root: str,
    status: ChainStatus,
    *,
    finality_depth: int,
    max_attempts: int,
    now_ms: int,
    rand: float,
) -> Settlement | None:
    """How a submitted batch ends, or None while it is not settled yet.

    Confirmed only when the block is final (confirmations ≥ depth) and holds this batch's root
    (every member's proof is a path of the tree whose root that is, so each verifies against
    the block); a transaction the chain dropped, re-orged away, or that carries another root,
    sends the members back to pending after a backoff, or to failed once they used
    `max_attempts`."""
    if status.state == "pending":
        return None
    if status.state == "included" and status.block_root == root:
        if status.confirmations < max(1, finality_depth):
            return None
        return Settlement(
            "confirmed",
            block_height=status.block_height,
            block_hash=status.block_hash,
            anchor_time_ms=status.block_time_ms,
        )
    attempts = max((m.attempts for m in members), default=1)
    delay = REQUEUE_BACKOFF.jittered(attempts, rand)
    pending = tuple(m.intent_id for m in members if m.attempts < max_attempts)
    failed = tuple(m.intent_id for m in members if m.attempts >= max_attempts)
    return Settlement(
        "dropped", pending=pending, failed=failed, available_at_ms=now_ms + int(delay * 1000)
    )


@dataclass(frozen=True)
class AnchorCheck:
    """The verdict of `verify_anchor`: each check by name (True: passed), and the problems."""

    checks: dict[str, bool]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_anchor(
    version: dict[str, Any], anchor: dict[str, Any], block_roots: list[str] | None
) -> AnchorCheck:
    """Re-check an `AnchorRecord` (spec 2.2) without taking the server's word for anything but
    the documents: `version` is the entry version it anchors (as served), `block_roots` the roots
    the chain holds in block `anchor.blockHeight` (None: not checked against a chain).

    Checks: the version's `itemDataHash` is SHA-256 of JCS(itemData); the record names that
    hash; the proof's leaf is the leaf of (entryDid, sequence, itemDataHash); the proof's path
    leads from the leaf to its root; and that root is in the block."""
    checks: dict[str, bool] = {}
    problems: list[str] = []

    def check(name: str, passed: bool, problem: str) -> None:
        checks[name] = passed
        if not passed:
            problems.append(problem)

    computed = sha256_hex(canonicalize(version.get("itemData")))
    check(
        "itemDataHash",
        computed == version.get("itemDataHash") == anchor.get("itemDataHash"),
        "itemDataHash is not SHA-256 of JCS(itemData) of the anchored version",
    )
    try:
        proof = MerkleProof.from_json(anchor.get("proof"))
    except (ValueError, TypeError) as exc:
        check("proof", False, f"the proof is malformed: {exc}")
        return AnchorCheck(checks, tuple(problems))
    try:
        leaf = leaf_hash(str(version.get("entryDid")), int(version["sequence"]), computed)
    except (KeyError, ValueError, TypeError):
        leaf = ""
    check("leaf", leaf == proof.leaf_hash, "the proof's leaf is not this version's leaf")
    check("path", verify_proof(proof, leaf), "the proof's path does not lead to its root")
    if block_roots is not None:
        check(
            "chain",
            proof.root in block_roots,
            f"block {anchor.get('blockHeight')} of the chain does not hold the root",
        )
    return AnchorCheck(checks, tuple(problems))
