"""In-memory fake of the storage port: the semantics of `PgStore` and its SQL, in plain Python.

What it models, as migration 0008 does: a gap-free log (position n is `log[n - 1]`); `append`
applying a batch in order, each change either answered from its idempotency record (a replay, or
`idempotency_conflict` when the fingerprint differs), refused by its kind's handler (nothing
written, no position taken), or applied (its rows written, the next position taken, a
`LogRecord` appended with `at_ms` from the injected clock), its outcome recorded under its key;
a batch that raises (a bug: an unknown kind, rows that are not JSON, a malformed document) writes
nothing, as a rolled-back transaction. Entries and their versions, challenges, sessions and
expiry follow the SQL, with "now" read once per call from `clock_ms`.

What it does not model: `discover` (plans are SQL; it raises `Unavailable`, code
`not_supported`), the full-text matches of `change_versions` (always empty), the projection
columns of `entries`, and other processes (one process: batches are serialised trivially).

Test knobs: `latency` (virtual seconds each call takes; otherwise a call is one checkpoint),
`fail_reads` / `fail_writes` (calls made while set raise `Unavailable` and do nothing, as with
the database down; a listener cannot be opened while reads fail; a call already under way
completes), `drop_wakeups` (appends notify nobody, as a lost NOTIFY),
`break_listeners()` (open listeners fail with `Unavailable`, as a lost LISTEN connection).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from registry.anchoring import Member
from registry.changes import (
    CHANGE_KINDS,
    IDEMPOTENCY_WINDOW_MS,
    RETRY,
    Change,
    IdemKey,
    LogRecord,
    Outcome,
    Refusal,
    standing_outcome,
)
from registry.errors import Unavailable
from registry.merkle import NODE_BYTES
from registry.store import (
    INLINE_ATTESTATIONS,
    AnchoringOverview,
    EntryHead,
    IntentRow,
    OpenBatch,
    PeerRow,
    Quarantined,
    Receipt,
    RecentBatch,
    RecordRow,
    ReplicaVersion,
    SessionRecord,
    Store,
    WitnessRow,
)
from registry.transparency import Fork, StoredCheckpoint, TileKey, Witnessed

if TYPE_CHECKING:
    from registry.query import RegistryQuery

__all__ = ["HANDLERS", "MemoryStore", "MemoryWakeups"]

K = TypeVar("K")
V = TypeVar("V")

MODELLED_SCHEMA = 14  # the migration whose semantics this fake follows
SESSION_GRACE_MS = 24 * 3600 * 1000  # expired sessions are purged a day later
CHALLENGE_GRACE_MS = 3600 * 1000  # put_challenge collects challenges expired an hour ago

_IdemId = tuple[str, str, str]


def _wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


def _json_copy(value: Any) -> Any:
    """`value` as it comes back from a jsonb column (raises TypeError if it is not JSON)."""
    return json.loads(json.dumps(value, ensure_ascii=False))


# --- tables -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    head_seq: int
    created_seq: int
    publisher_did: str
    entry_type: str
    lifecycle: str


@dataclass(frozen=True)
class _Version:
    seq: int
    entry_did: str
    publisher_did: str
    lifecycle: str
    doc: str


@dataclass(frozen=True)
class _IdemRecord:
    fingerprint: bytes
    sequence: int | None
    result: str | None
    refusal: Refusal | None
    created_ms: int

    @property
    def outcome(self) -> Outcome:
        return Outcome(self.sequence, self.result, self.refusal)


@dataclass(frozen=True)
class _Intent:
    intent_id: str
    entry_did: str
    sequence: int
    operation: str
    item_data_hash: str
    state: str
    attempts: int
    available_ms: int
    created_ms: int
    updated_ms: int
    batch_id: int | None = None
    leaf_index: int | None = None


@dataclass(frozen=True)
class _Batch:
    batch_id: int
    state: str
    created_ms: int
    members: tuple[str, ...]  # intent ids in leaf order
    root: str | None = None
    transaction_id: str | None = None
    block_height: int | None = None
    block_hash: str | None = None
    anchor_time_ms: int | None = None
    observed_ms: int | None = None
    levels: bytes = b""  # the stored tree (MerkleTree.packed_levels), once submitted


@dataclass(frozen=True)
class _Record:
    row: RecordRow
    uniq: str | None


@dataclass(frozen=True)
class _Replica:
    entry_did: str
    lifecycle: str
    doc: str
    synced_seq: int


@dataclass(frozen=True)
class _Session:
    record: SessionRecord
    revoked_ms: int | None = None


@dataclass(frozen=True)
class _Challenge:
    text: str  # the challenge as JSON text
    expires_ms: int


class _Tables:
    def __init__(self) -> None:
        self.log: list[LogRecord] = []
        self.entries: dict[str, _Entry] = {}
        self.versions: dict[int, _Version] = {}  # by sequence
        self.versions_of: dict[str, list[int]] = {}  # entry DID → its version sequences, in order
        self.tiles: dict[TileKey, bytes] = {}
        self.checkpoints: dict[int, StoredCheckpoint] = {}
        self.witnessed: dict[str, WitnessRow] = {}
        self.cosignatures: dict[int, dict[str, str]] = {}
        self.idempotency: dict[_IdemId, _IdemRecord] = {}
        self.challenges: dict[str, _Challenge] = {}
        self.sessions: dict[bytes, _Session] = {}
        self.records: dict[tuple[str, str], _Record] = {}  # (kind, id) → record
        self.intents: dict[str, _Intent] = {}
        self.intent_of_seq: dict[int, str] = {}
        self.batches: dict[int, _Batch] = {}
        self.receipts: dict[str, list[int]] = {}  # intent id → its batch ids
        self.nonces: dict[tuple[str, str], int] = {}  # (sender, nonce) → expiry ms
        self.peers: dict[str, PeerRow] = {}
        self.replicas: dict[tuple[str, int], _Replica] = {}  # (origin, origin seq)
        self.quarantine: dict[tuple[str, int], Mapping[str, Any]] = {}


class _Tx:
    """One append's transaction: the tables, the statement's `now_ms`, and an undo log, so a
    batch that raises leaves nothing behind."""

    def __init__(self, tables: _Tables, now_ms: int) -> None:
        self.tables = tables
        self.now_ms = now_ms
        self._undo: list[Callable[[], None]] = []

    def put(self, table: dict[K, V], key: K, value: V) -> None:
        if key in table:
            old = table[key]
            self._undo.append(lambda: table.__setitem__(key, old))
        else:
            self._undo.append(lambda: table.__delitem__(key))
        table[key] = value

    def add_version(self, version: _Version) -> None:
        self.put(self.tables.versions, version.seq, version)
        seqs = self.tables.versions_of.setdefault(version.entry_did, [])
        seqs.append(version.seq)
        self._undo.append(lambda: seqs.remove(version.seq))

    def add_log(self, record: LogRecord) -> None:
        assert record.seq == len(self.tables.log) + 1
        self.tables.log.append(record)
        self._undo.append(lambda: self.tables.log.remove(record))

    def rollback(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


# --- handlers: one per kind of change (the SQL's apply_* functions) -------------------------

Handler = Callable[[_Tx, int, str | None, Mapping[str, Any]], tuple[str | None, Refusal | None]]


def _text(rows: Mapping[str, Any], name: str) -> str:
    """`rows ->> name` for a NOT NULL column: absent or null fails, as the INSERT would."""
    value = rows.get(name)
    if value is None:
        raise ValueError(f"rows.{name} is required")
    return value if isinstance(value, str) else json.dumps(value)


def _apply_entry_version(
    tx: _Tx, seq: int, did: str | None, rows: Mapping[str, Any]
) -> tuple[str | None, Refusal | None]:
    """`apply_entry_version`: create (expectedHead null: the DID must be new), update, transfer
    or delete one entry; the document is prefix ‖ sequence ‖ suffix."""
    if did is None:
        raise ValueError("an entry change needs its entry DID as subject")
    raw_expected = rows.get("expectedHead")
    expected = None if raw_expected is None else int(raw_expected)
    entry = tx.tables.entries.get(did)
    if expected is None and entry is not None:
        return None, Refusal(
            "Conflict",
            "entry_exists",
            "an entry with this DID exists or existed",
            {"entryDid": did},
        )
    if expected is None and entry is None:
        held = [
            (r.synced_seq, seq, o)
            for (o, seq), r in tx.tables.replicas.items()
            if r.entry_did == did
        ]
        if held:
            return None, Refusal(
                "Conflict",
                "entry_is_replica",
                "this DID is another registry's entry (a replica here); write it at its origin",
                {"entryDid": did, "origin": max(held)[2]},
            )
    if expected is not None and entry is None:
        return None, Refusal("NotFound", "entry_not_found", "entry not found", {"entryDid": did})
    if entry is not None and entry.head_seq != expected:
        if _text(rows, "lifecycle") == "deleted":  # a delete has no precondition: decide again
            return None, Refusal(
                RETRY, "entry_changed", "the entry changed meanwhile", {"entryDid": did}
            )
        return None, Refusal(
            "Conflict",
            "sequence_conflict",
            "the entry changed since the version this request is based on",
            {"latestSequence": entry.head_seq},
        )
    publisher = _text(rows, "publisherDid")
    lifecycle = _text(rows, "lifecycle")
    doc = _text(rows, "prefix") + str(seq) + _text(rows, "suffix")
    if lifecycle == "deleted":
        if entry is not None:  # (the SQL's UPDATE of a missing entry changes nothing)
            tx.put(tx.tables.entries, did, replace(entry, head_seq=seq, lifecycle=lifecycle))
    else:
        json.loads(doc)  # entry_projection(doc) casts it to jsonb: a malformed one fails
        entry_type = _text(rows, "entryType")
        if entry is None:
            new = _Entry(seq, seq, publisher, entry_type, lifecycle)
        else:
            new = replace(
                entry,
                head_seq=seq,
                publisher_did=publisher,
                entry_type=entry_type,
                lifecycle=lifecycle,
            )
        tx.put(tx.tables.entries, did, new)
    tx.add_version(_Version(seq, did, publisher, lifecycle, doc))
    anchor = rows.get("anchor")
    if anchor is not None:
        intent = _Intent(
            f"ai_{seq}",
            did,
            seq,
            _text(anchor, "operation"),
            _text(anchor, "itemDataHash"),
            "pending",
            0,
            tx.now_ms,
            tx.now_ms,
            tx.now_ms,
        )
        tx.put(tx.tables.intents, intent.intent_id, intent)
        tx.put(tx.tables.intent_of_seq, seq, intent.intent_id)
    return doc, None


def _apply_session_revoked(
    tx: _Tx, seq: int, subject: str | None, rows: Mapping[str, Any]
) -> tuple[str | None, Refusal | None]:
    """`apply_session_revoked`: revoke one session (rows: {tokenHash} in hex)."""
    token_hex = rows.get("tokenHash")
    token_hash = None if token_hex is None else bytes.fromhex(token_hex)
    session = None if token_hash is None else tx.tables.sessions.get(token_hash)
    if token_hash is None or session is None or session.revoked_ms is not None:
        return None, Refusal(
            "Unauthorized", "session_invalid", "session missing, expired or unknown", {}
        )
    tx.put(tx.tables.sessions, token_hash, replace(session, revoked_ms=tx.now_ms))
    return '{"loggedOut":true}', None


def _apply_records(
    tx: _Tx, seq: int, subject: str | None, rows: Mapping[str, Any]
) -> tuple[str | None, Refusal | None]:
    """`apply_records` (migration 0009): write versioned records (compare-and-set on their
    version, `uniq` claims), after an optional entry version; every check comes first."""
    records = tx.tables.records
    required = rows.get("requireEntry")
    if required is not None:
        entry = tx.tables.entries.get(required)
        if entry is None or entry.lifecycle == "deleted":
            return None, Refusal(
                "NotFound", "entry_not_found", "entry not found", {"entryDid": required}
            )
        head = rows.get("requireHead")  # the head the decision read: moved since, decide again
        if head is not None and entry.head_seq != int(head):
            return None, Refusal(
                RETRY, "entry_changed", "the entry changed meanwhile", {"entryDid": required}
            )
    puts: list[Mapping[str, Any]] = list(rows.get("puts") or [])
    ids = {(p["kind"], p["id"]) for p in puts}
    for p in puts:
        found = records.get((p["kind"], p["id"]))
        expected = p.get("expectedVersion")
        if expected is None:
            if found is not None:
                return None, Refusal.from_json(p["exists"])
        elif found is None or found.row.version != int(expected):
            return None, Refusal(
                RETRY,
                "record_changed",
                "the record changed meanwhile",
                {"kind": p["kind"], "id": p["id"]},
            )
        uniq = p.get("uniq")
        if uniq is not None and any(
            r.uniq == uniq and key[0] == p["kind"] and key not in ids for key, r in records.items()
        ):
            return None, Refusal.from_json(p["duplicate"])
    result: str | None = rows.get("result")
    if "entry" in rows:
        doc, refusal = _apply_entry_version(tx, seq, subject, rows["entry"])
        if refusal is not None and refusal.code == "sequence_conflict":
            # The version's base moved since it was decided: decided again.
            return None, Refusal(
                RETRY, "entry_changed", "the entry changed meanwhile", {"entryDid": subject}
            )
        if refusal is not None:
            return None, refusal
        result = result if result is not None else doc
    for p in puts:
        key = (p["kind"], p["id"])
        found = records.get(key)
        expires = p.get("expiresAtMs")
        row = RecordRow(
            kind=p["kind"],
            id=p["id"],
            entry_did=_text(p, "entryDid") if found is None else found.row.entry_did,
            owner_did=p.get("ownerDid") if found is None else found.row.owner_did,
            status=_text(p, "status"),
            version=1 if found is None else found.row.version + 1,
            expires_ms=None if expires is None else int(expires),
            created_seq=seq if found is None else found.row.created_seq,
            updated_seq=seq,
            doc=_text(p, "doc"),
        )
        tx.put(records, key, _Record(row, p.get("uniq")))
    return result, None


def _apply_anchor_claim(
    tx: _Tx, seq: int, subject: str | None, rows: Mapping[str, Any]
) -> tuple[str | None, Refusal | None]:
    """`apply_anchor_claim`: the oldest available pending intents become batch `seq`."""
    intents = tx.tables.intents
    ready = sorted(
        (
            i
            for i in intents.values()
            if i.state == "pending" and i.available_ms <= int(rows["availableAtMs"])
        ),
        key=lambda i: i.sequence,
    )[: int(rows["batchSize"])]
    if not ready:
        return None, Refusal("NotFound", "nothing_pending", "no anchor intent is pending", {})
    members = []
    for index, intent in enumerate(ready):
        claimed = replace(
            intent,
            state="submitted",
            attempts=intent.attempts + 1,
            batch_id=seq,
            leaf_index=index,
            updated_ms=tx.now_ms,
        )
        tx.put(intents, intent.intent_id, claimed)
        batches = [*tx.tables.receipts.get(intent.intent_id, []), seq]
        tx.put(tx.tables.receipts, intent.intent_id, batches)
        members.append(
            [
                claimed.intent_id,
                claimed.entry_did,
                claimed.sequence,
                claimed.item_data_hash,
                claimed.attempts,
            ]
        )
    batch = _Batch(seq, "claimed", tx.now_ms, tuple(i.intent_id for i in ready))
    tx.put(tx.tables.batches, seq, batch)
    return json.dumps(members), None


def _apply_anchor_settle(
    tx: _Tx, seq: int, subject: str | None, rows: Mapping[str, Any]
) -> tuple[str | None, Refusal | None]:
    """`apply_anchor_settle`: a batch's submitted intents confirmed, or requeued / failed."""
    intents = tx.tables.intents
    batch_id = int(rows["batchId"])
    submitted = {
        i.intent_id for i in intents.values() if i.batch_id == batch_id and i.state == "submitted"
    }
    if submitted != set(rows["intents"]):
        return None, Refusal(
            RETRY, "intents_changed", "the batch's intents changed meanwhile", {"batchId": batch_id}
        )
    batch = tx.tables.batches[batch_id]
    if rows["outcome"] == "confirmed":
        tx.put(
            tx.tables.batches,
            batch_id,
            replace(
                batch,
                state="confirmed",
                block_height=int(rows["blockHeight"]),
                block_hash=rows.get("blockHash"),
                anchor_time_ms=rows.get("anchorTimeMs"),
                observed_ms=tx.now_ms,
            ),
        )
        for intent_id in submitted:
            tx.put(
                intents,
                intent_id,
                replace(intents[intent_id], state="confirmed", updated_ms=tx.now_ms),
            )
    else:
        tx.put(tx.tables.batches, batch_id, replace(batch, state="dropped", observed_ms=tx.now_ms))
        for intent_id in rows.get("pending", []):
            tx.put(
                intents,
                intent_id,
                replace(
                    intents[intent_id],
                    state="pending",
                    available_ms=int(rows["availableAtMs"]),
                    updated_ms=tx.now_ms,
                ),
            )
        for intent_id in rows.get("failed", []):
            tx.put(
                intents,
                intent_id,
                replace(intents[intent_id], state="failed", updated_ms=tx.now_ms),
            )
    return "{}", None


def _apply_anchor_control(
    tx: _Tx, seq: int, subject: str | None, rows: Mapping[str, Any]
) -> tuple[str | None, Refusal | None]:
    """`apply_anchor_control`: admin retry / abandon, compare-and-set on the state read."""
    intents = tx.tables.intents
    intent = intents.get(rows["intentId"])
    if intent is None or intent.state != rows["from"]:
        return None, Refusal(
            RETRY, "intent_changed", "the intent changed meanwhile", {"intentId": rows["intentId"]}
        )
    to = rows["to"]
    if to == "pending":
        changed = replace(
            intent, state=to, attempts=0, available_ms=tx.now_ms, updated_ms=tx.now_ms
        )
    else:
        changed = replace(intent, state=to, updated_ms=tx.now_ms)
    tx.put(intents, intent.intent_id, changed)
    return json.dumps({"intentId": intent.intent_id, "state": to}, separators=(",", ":")), None


def _apply_peer_sync(
    tx: _Tx, seq: int, subject: str | None, rows: Mapping[str, Any]
) -> tuple[str | None, Refusal | None]:
    """`apply_peer_sync` (migration 0011): a peer's pull, compare-and-set on its cursor."""
    peer = _text(rows, "peerDid")
    found = tx.tables.peers.get(peer)
    cursor = 0 if found is None else found.cursor
    if cursor != int(rows["expectedCursor"]):
        return None, Refusal(
            "Conflict",
            "peer_cursor_moved",
            "the peer's cursor moved meanwhile",
            {"peerDid": peer, "cursor": cursor},
        )
    added = 0
    # One origin per entry (migration 0014): a DID another peer brought is quarantined.
    foreign = {r.entry_did for (origin, _), r in tx.tables.replicas.items() if origin != peer}
    for r in rows.get("replicas") or []:
        key = (peer, int(r["seq"]))
        if r["entryDid"] in foreign:
            if key not in tx.tables.quarantine:
                tx.put(
                    tx.tables.quarantine,
                    key,
                    {
                        "seq": r["seq"],
                        "entryDid": r["entryDid"],
                        "code": "entry_from_other_origin",
                        "reason": "another peer already replicates this entry here:"
                        " one origin per entry",
                        "doc": r["doc"],
                    },
                )
                added += 1
        elif key not in tx.tables.replicas:
            replica = _Replica(_text(r, "entryDid"), _text(r, "lifecycle"), _text(r, "doc"), seq)
            tx.put(tx.tables.replicas, key, replica)
    for q in rows.get("quarantined") or []:
        key = (peer, int(q["seq"]))
        if key not in tx.tables.quarantine:
            tx.put(tx.tables.quarantine, key, dict(q))
            added += 1
    status = dict(rows["status"])
    total = added + (0 if found is None else found.quarantines)
    tx.put(tx.tables.peers, peer, PeerRow(peer, int(rows["cursor"]), status, total))
    return json.dumps({**status, "quarantines": total}), None


# The twin of each SQL handler function `registry.changes.CHANGE_KINDS` names.
_FUNCTIONS: dict[str, Handler] = {
    "apply_entry_version": _apply_entry_version,
    "apply_session_revoked": _apply_session_revoked,
    "apply_anchor_claim": _apply_anchor_claim,
    "apply_anchor_settle": _apply_anchor_settle,
    "apply_anchor_control": _apply_anchor_control,
    "apply_peer_sync": _apply_peer_sync,
    "apply_records": _apply_records,
}
# The handler of each kind of change.
HANDLERS: dict[str, Handler] = {
    kind: _FUNCTIONS[spec.handler]
    for kind, spec in CHANGE_KINDS.items()
    if spec.handler is not None
}


# --- wake-ups -------------------------------------------------------------------------------


class MemoryWakeups:
    """The `LogWakeups` of one listener: set by every append that took a position."""

    def __init__(self) -> None:
        self._wake = trio.Event()
        self._broken = False

    def notify(self) -> None:
        self._wake.set()

    def break_(self) -> None:
        self._broken = True
        self._wake.set()

    async def wait(self) -> None:
        """Return when the log grew since the last `wait`; raise `Unavailable` once broken."""
        await self._wake.wait()
        if self._broken:
            raise Unavailable("the notification connection was lost", code="database_unavailable")
        self._wake = trio.Event()


class MemoryLeadership:
    def __init__(self) -> None:
        self._lost = trio.Event()

    def lose(self) -> None:
        self._lost.set()

    async def lost(self) -> None:
        await self._lost.wait()
        raise Unavailable("the leadership was lost", code="database_unavailable")


LEADERSHIP_POLL_SECONDS = 2.0


# --- the store ------------------------------------------------------------------------------


class MemoryStore:
    """The storage port in memory (see the module docstring for what it does not model)."""

    def __init__(
        self,
        *,
        clock_ms: Callable[[], int] = _wall_clock_ms,
        latency: float = 0.0,
        schema_version: int = MODELLED_SCHEMA,
    ) -> None:
        self.clock_ms = clock_ms
        self.latency = latency
        self.fail_reads = False
        self.fail_writes = False
        self.write_refusal: str | None = None  # what `write_condition` reports (tests)
        self.drop_wakeups = False
        self.batch_sizes: list[int] = []  # the size of every append that committed
        self._schema_version = schema_version
        self._tables = _Tables()
        self._listeners: set[MemoryWakeups] = set()
        self._leaders: dict[str, MemoryLeadership] = {}

    # --- test knobs -----------------------------------------------------------------------

    def break_listeners(self) -> int:
        """Fail every open listener, as if its connection were lost; return how many."""
        broken = len(self._listeners)
        for listener in self._listeners:
            listener.break_()
        self._listeners.clear()
        return broken

    @property
    def listeners(self) -> int:
        """How many listeners are open (and not broken)."""
        return len(self._listeners)

    async def _call(self, *, write: bool) -> None:
        """One round trip: the failure the test asked for (decided when the call is made),
        else `latency` seconds (at least a checkpoint)."""
        if self.fail_writes if write else self.fail_reads:
            await trio.lowlevel.checkpoint()
            raise Unavailable("the database is unavailable", code="database_unavailable")
        if self.latency > 0:
            await trio.sleep(self.latency)
        else:
            await trio.lowlevel.checkpoint()

    # --- health ---------------------------------------------------------------------------

    def pool_statistics(self) -> dict[str, int]:
        return {}  # no connections

    def error_statistics(self) -> dict[str, int]:
        return {}

    async def live_processes(self) -> int:
        return 1

    async def ping(self) -> None:
        await self._call(write=False)

    async def write_condition(self) -> str | None:
        await self._call(write=False)
        return self.write_refusal

    async def schema_version(self) -> int:
        await self._call(write=False)
        return self._schema_version

    # --- the one append path -------------------------------------------------------------

    async def append(self, items: list[tuple[Change, IdemKey | None]]) -> list[Outcome]:
        """Apply `items` in order, all or nothing (see the module docstring)."""
        # As PgStore renders the batch before its round trip: an unknown kind or rows that
        # are not JSON fail here, before anything is written.
        prepared = [
            (change, idem, HANDLERS[change.kind], _json_copy(change.rows), _json_copy(change.event))
            for change, idem in items
        ]
        await self._call(write=True)
        tx = _Tx(self._tables, self.clock_ms())
        start = len(self._tables.log)
        try:
            outcomes = [self._append_one(tx, *item) for item in prepared]
        except BaseException:
            tx.rollback()
            raise
        self.batch_sizes.append(len(items))
        if len(self._tables.log) > start and not self.drop_wakeups:
            for listener in self._listeners:
                listener.notify()
        return outcomes

    def _append_one(
        self,
        tx: _Tx,
        change: Change,
        idem: IdemKey | None,
        handler: Handler,
        rows: Mapping[str, Any],
        event: Mapping[str, Any],
    ) -> Outcome:
        key = None if idem is None else (idem.scope, idem.operation, idem.key)
        if key is not None:
            assert idem is not None
            found = self._tables.idempotency.get(key)
            if found is not None and found.created_ms > tx.now_ms - IDEMPOTENCY_WINDOW_MS:
                return standing_outcome(idem, found.fingerprint, found.outcome)
        seq = len(self._tables.log) + 1
        result, refusal = handler(tx, seq, change.subject, rows)
        taken = seq if refusal is None else None
        if taken is not None:
            tx.add_log(LogRecord(seq, change.kind, change.subject, tx.now_ms, event))
            for also in change.also:
                tx.add_log(
                    LogRecord(
                        len(self._tables.log) + 1,
                        also.kind,
                        also.subject,
                        tx.now_ms,
                        _json_copy(also.event),
                    )
                )
        if key is not None and (refusal is None or refusal.kind != RETRY):
            assert idem is not None
            record = _IdemRecord(idem.fingerprint, taken, result, refusal, tx.now_ms)
            tx.put(self._tables.idempotency, key, record)
        return Outcome(taken, result, refusal)

    async def record_refusal(self, idem: IdemKey, refusal: Refusal) -> Outcome:
        """Record `refusal` under `idem` unless the key has a live outcome; return the one that
        stands (a different request's outcome is an idempotency conflict)."""
        stored = Refusal.from_json(_json_copy(refusal.to_json()))
        await self._call(write=True)
        now = self.clock_ms()
        key = (idem.scope, idem.operation, idem.key)
        found = self._tables.idempotency.get(key)
        if found is None or found.created_ms <= now - IDEMPOTENCY_WINDOW_MS:
            self._tables.idempotency[key] = _IdemRecord(idem.fingerprint, None, None, stored, now)
            return Outcome(None, None, stored)
        return standing_outcome(idem, found.fingerprint, found.outcome)

    # --- entries --------------------------------------------------------------------------

    async def get_entry_head(
        self, entry_did: str, *, attestations: int = INLINE_ATTESTATIONS
    ) -> EntryHead | None:
        await self._call(write=False)
        entry = self._tables.entries.get(entry_did)
        if entry is None:
            return None
        doc = self._tables.versions[entry.head_seq].doc
        now = self.clock_ms()
        attested = sorted(
            (
                r.row
                for r in self._tables.records.values()
                if r.row.kind == "attestation"
                and r.row.entry_did == entry_did
                and r.row.status == "active"
                and (r.row.expires_ms is None or r.row.expires_ms > now)
            ),
            key=lambda row: row.created_seq,
        )[:attestations]
        return EntryHead(
            entry_did,
            entry.head_seq,
            entry.publisher_did,
            entry.lifecycle,
            doc,
            tuple((row.expires_ms, row.doc) for row in attested),
            self._intent_state(entry.head_seq),
        )

    def _intent_state(self, seq: int) -> str | None:
        intent_id = self._tables.intent_of_seq.get(seq)
        return None if intent_id is None else self._tables.intents[intent_id].state

    # --- anchoring --------------------------------------------------------------------------

    def _intent_row(self, intent: _Intent) -> IntentRow:
        receipts = []
        for batch_id in self._tables.receipts.get(intent.intent_id, []):
            b = self._tables.batches[batch_id]
            leaf = b.members.index(intent.intent_id)
            receipts.append(
                Receipt(
                    b.batch_id,
                    leaf,
                    b.state,
                    b.root,
                    b.transaction_id,
                    b.block_height,
                    b.block_hash,
                    b.anchor_time_ms,
                    b.observed_ms,
                    b.created_ms,
                    len(b.members) if b.levels else None,
                )
            )
        return IntentRow(
            intent.intent_id,
            intent.entry_did,
            intent.sequence,
            intent.operation,
            intent.item_data_hash,
            intent.state,
            intent.attempts,
            intent.available_ms,
            intent.created_ms,
            intent.updated_ms,
            tuple(receipts),
        )

    async def anchor_intents_of(
        self, entry_did: str, *, after: tuple[int, int, str] | None, limit: int
    ) -> list[IntentRow]:
        await self._call(write=False)
        found = sorted(
            (i for i in self._tables.intents.values() if i.entry_did == entry_did),
            key=lambda i: (i.sequence, i.created_ms, i.intent_id),
        )
        if after is not None:
            found = [i for i in found if (i.sequence, i.created_ms, i.intent_id) > after]
        return [self._intent_row(i) for i in found[:limit]]

    async def get_anchor_intent(self, intent_id: str) -> IntentRow | None:
        await self._call(write=False)
        intent = self._tables.intents.get(intent_id)
        return None if intent is None else self._intent_row(intent)

    def _members(self, batch: _Batch) -> list[Member]:
        out = []
        for intent_id in batch.members:
            i = self._tables.intents[intent_id]
            out.append(Member(i.intent_id, i.entry_did, i.sequence, i.item_data_hash, i.attempts))
        return out

    async def anchor_batch_members(self, batch_id: int) -> list[Member]:
        await self._call(write=False)
        batch = self._tables.batches.get(batch_id)
        return [] if batch is None else self._members(batch)

    async def open_anchor_batches(self) -> list[OpenBatch]:
        await self._call(write=False)
        out = []
        for batch in sorted(self._tables.batches.values(), key=lambda b: b.batch_id):
            if batch.state not in ("claimed", "submitted"):
                continue
            members = tuple(
                (
                    m,
                    self._tables.intents[m.intent_id].state
                    if self._tables.intents[m.intent_id].batch_id == batch.batch_id
                    else "moved",
                )
                for m in self._members(batch)
            )
            out.append(OpenBatch(batch.batch_id, batch.root, batch.transaction_id, members))
        return out

    async def anchoring_overview(self, recent: int) -> AnchoringOverview:
        await self._call(write=False)
        pending = [i for i in self._tables.intents.values() if i.state == "pending"]
        batches = sorted(self._tables.batches.values(), key=lambda b: -b.batch_id)
        return AnchoringOverview(
            len(pending),
            min((i.created_ms for i in pending), default=None),
            sum(b.state in ("claimed", "submitted") for b in batches),
            tuple(
                RecentBatch(
                    b.batch_id,
                    b.state,
                    b.transaction_id,
                    b.block_height,
                    b.anchor_time_ms,
                    len(b.members),
                )
                for b in batches[:recent]
            ),
        )

    async def anchor_pending(self, available_at_ms: int) -> bool:
        await self._call(write=False)
        return any(
            i.state == "pending" and i.available_ms <= available_at_ms
            for i in self._tables.intents.values()
        )

    async def record_anchor_submission(
        self, batch_id: int, root: str, transaction_id: str, levels: bytes, leaves: int
    ) -> None:
        await self._call(write=True)
        batch = self._tables.batches.get(batch_id)
        if batch is not None and batch.state in ("claimed", "submitted"):
            self._tables.batches[batch_id] = replace(
                batch, root=root, transaction_id=transaction_id, state="submitted", levels=levels
            )

    async def batches_without_tree(self, after: int, limit: int) -> list[tuple[int, str]]:
        await self._call(write=False)
        found = sorted(
            (b.batch_id, b.root)
            for b in self._tables.batches.values()
            if b.batch_id > after and b.root is not None and not b.levels
        )
        return found[:limit]

    async def store_anchor_tree(self, batch_id: int, levels: bytes, leaves: int) -> None:
        await self._call(write=True)
        batch = self._tables.batches[batch_id]
        if not batch.levels:
            self._tables.batches[batch_id] = replace(batch, levels=levels)

    async def anchor_tree_slices(self, wanted: Sequence[tuple[int, int]]) -> list[bytes]:
        await self._call(write=False)
        out = []
        for batch_id, offset in wanted:
            batch = self._tables.batches.get(batch_id)
            out.append(b"" if batch is None else batch.levels[offset : offset + NODE_BYTES])
        return out

    @asynccontextmanager
    async def leadership(self, name: str) -> AsyncIterator[MemoryLeadership]:
        """One holder of `name` per store; waits (polling, like the SQL adapter) for it."""
        while name in self._leaders:  # noqa: ASYNC110 (the SQL adapter can only poll too)
            await trio.sleep(LEADERSHIP_POLL_SECONDS)
        held = MemoryLeadership()
        self._leaders[name] = held
        try:
            yield held
        finally:
            if self._leaders.get(name) is held:
                del self._leaders[name]

    def break_leadership(self, name: str) -> None:
        """Test knob: the holder of `name` loses it (as with its connection lost)."""
        held = self._leaders.pop(name, None)
        if held is not None:
            held.lose()

    # --- trust and ownership records ------------------------------------------------------

    async def get_record(self, kind: str, record_id: str) -> RecordRow | None:
        await self._call(write=False)
        found = self._tables.records.get((kind, record_id))
        return None if found is None else found.row

    async def list_records(
        self,
        kind: str,
        *,
        entry_did: str | None = None,
        status: str | None = None,
        after_seq: int | None = None,
        limit: int = 100,
    ) -> list[RecordRow]:
        await self._call(write=False)
        rows = sorted(
            (
                r.row
                for r in self._tables.records.values()
                if r.row.kind == kind
                and (entry_did is None or r.row.entry_did == entry_did)
                and (status is None or r.row.status == status)
                and (after_seq is None or r.row.created_seq > after_seq)
            ),
            key=lambda row: row.created_seq,
        )
        return rows[:limit]

    async def list_records_page(
        self,
        kind: str,
        *,
        entry_did: str | None = None,
        status: str | None = None,
        after_seq: int | None = None,
        limit: int,
        page_bytes: int,
    ) -> tuple[list[RecordRow], bool]:
        rows = await self.list_records(
            kind, entry_did=entry_did, status=status, after_seq=after_seq, limit=limit
        )
        held = 0
        for i, row in enumerate(rows):
            if held >= page_bytes:  # (the first always comes)
                return rows[:i], True
            held += len(row.doc.encode("utf-8"))
        return rows, False

    def _live_versions(self, entry_did: str) -> list[_Version]:
        """The entry's versions but its tombstone, newest first."""
        seqs = self._tables.versions_of.get(entry_did, [])
        versions = (self._tables.versions[seq] for seq in reversed(seqs))
        return [v for v in versions if v.lifecycle != "deleted"]

    async def list_versions(
        self, entry_did: str, before_seq: int | None, limit: int, page_bytes: int
    ) -> tuple[list[str | None], int]:
        await self._call(write=False)
        live = self._live_versions(entry_did)
        page = [v.doc for v in live if before_seq is None or v.seq < before_seq]
        return _within(page[:limit], page_bytes), len(live)

    async def anchor_states(self, entry_did: str, sequences: list[int]) -> dict[int, str]:
        await self._call(write=False)
        wanted = set(sequences)
        return {
            i.sequence: i.state
            for i in self._tables.intents.values()
            if i.sequence in wanted and i.entry_did == entry_did
        }

    async def version_labelled(self, entry_did: str, version: str) -> tuple[int, str] | None:
        await self._call(write=False)
        for v in reversed(self._live_versions(entry_did)):  # oldest first
            if json.loads(v.doc).get("version") == version:
                return v.seq, v.doc
        return None

    async def get_version(self, entry_did: str, seq: int) -> str | None:
        await self._call(write=False)
        version = self._tables.versions.get(seq)
        if version is None or version.entry_did != entry_did or version.lifecycle == "deleted":
            return None
        return version.doc

    # --- discovery ------------------------------------------------------------------------

    async def discover(
        self,
        query: RegistryQuery,
        *,
        limit: int,
        after: list[Any] | None,
        page_bytes: int | None = None,
    ) -> tuple[list[tuple[str | None, list[Any]]], int]:
        """Not modelled: discovery is SQL over PostgreSQL's indexes and full-text search.

        Raises `Unavailable` with code `not_supported`; test discovery against PostgreSQL."""
        await self._call(write=False)
        raise Unavailable("discovery needs PostgreSQL", code="not_supported")

    async def change_versions(
        self, changes: list[tuple[int, str]], texts: list[str]
    ) -> dict[int, list[tuple[str, list[str]]]]:
        """For each change (sequence, entry DID): the entry's documents just before and at that
        version, oldest first. Full-text matching is not modelled: each matched list is empty."""
        await self._call(write=False)
        out: dict[int, list[tuple[str, list[str]]]] = {}
        for seq, did in sorted(changes, key=lambda change: change[0]):
            seqs = [s for s in self._tables.versions_of.get(did, []) if s <= seq][-2:]
            for s in seqs:
                out.setdefault(seq, []).append((self._tables.versions[s].doc, []))
        return out

    # --- sign-in --------------------------------------------------------------------------

    async def put_challenge(self, nonce: str, challenge: dict[str, Any], expires_ms: int) -> None:
        text = json.dumps(challenge)
        await self._call(write=True)
        now = self.clock_ms()
        challenges = self._tables.challenges
        for old in [n for n, c in challenges.items() if c.expires_ms < now - CHALLENGE_GRACE_MS]:
            del challenges[old]
        if nonce in challenges:  # PostgreSQL's unique violation: a bug, not a domain error
            raise ValueError(f"challenge {nonce!r} exists")
        challenges[nonce] = _Challenge(text, expires_ms)

    async def get_challenge(self, nonce: str) -> dict[str, Any] | None:
        await self._call(write=False)
        challenge = self._tables.challenges.get(nonce)
        return None if challenge is None else dict(json.loads(challenge.text))

    async def open_session(self, nonce: str, token_hash: bytes, session: SessionRecord) -> bool:
        """Burn the challenge and open the session atomically; False if it was already used."""
        await self._call(write=True)
        if nonce not in self._tables.challenges:
            return False
        if token_hash in self._tables.sessions:  # a unique violation rolls the burn back
            raise ValueError("a session with this token hash exists")
        del self._tables.challenges[nonce]
        self._tables.sessions[token_hash] = _Session(
            replace(session, capabilities=tuple(session.capabilities))
        )
        return True

    async def get_session(self, token_hash: bytes) -> SessionRecord | None:
        await self._call(write=False)
        session = self._tables.sessions.get(token_hash)
        if session is None or session.revoked_ms is not None:
            return None
        return session.record if session.record.expires_at_ms > self.clock_ms() else None

    async def lapse_attestations(self) -> int:
        """Nothing to mark: this store filters expired attestations as it reads them."""
        await self._call(write=True)
        return 0

    async def vacuum_records(self) -> None:
        await self._call(write=True)

    async def purge_expired(self) -> dict[str, int]:
        """Delete expired idempotency records, sessions and challenges."""
        await self._call(write=True)
        now = self.clock_ms()
        tables = self._tables
        expired: dict[str, list[Any]] = {
            "idempotency": [
                k
                for k, r in tables.idempotency.items()
                if r.created_ms < now - IDEMPOTENCY_WINDOW_MS
            ],
            "sessions": [
                k
                for k, s in tables.sessions.items()
                if s.record.expires_at_ms < now - SESSION_GRACE_MS
            ],
            "challenges": [k for k, c in tables.challenges.items() if c.expires_ms < now],
            "nonces": [k for k, expires in tables.nonces.items() if expires <= now],
        }
        for key in expired["idempotency"]:
            del tables.idempotency[key]
        for key in expired["sessions"]:
            del tables.sessions[key]
        for key in expired["challenges"]:
            del tables.challenges[key]
        for key in expired["nonces"]:
            del tables.nonces[key]
        return {name: len(keys) for name, keys in expired.items() if keys}

    # --- federation -----------------------------------------------------------------------

    async def sync_page(
        self, after_seq: int, limit: int, max_bytes: int
    ) -> tuple[list[tuple[int, str]], int, bool]:
        await self._call(write=False)
        head = len(self._tables.log)
        seqs = sorted(s for s in self._tables.versions if after_seq < s <= head)[: limit + 1]
        page: list[tuple[int, str]] = []
        size = 0
        for seq in seqs[:limit]:
            doc = self._tables.versions[seq].doc
            if page and size >= max_bytes:
                break
            page.append((seq, doc))
            size += len(doc.encode("utf-8"))
        return page, head, len(seqs) > len(page)

    async def burn_nonce(self, sender_did: str, nonce: str, expires_ms: int) -> bool:
        await self._call(write=True)
        key = (sender_did, nonce)
        found = self._tables.nonces.get(key)
        if found is not None and found > self.clock_ms():
            return False
        self._tables.nonces[key] = expires_ms
        return True

    async def get_peer(self, peer_did: str) -> PeerRow | None:
        await self._call(write=False)
        return self._tables.peers.get(peer_did)

    async def quarantined(self, peer_did: str, limit: int) -> list[Quarantined]:
        await self._call(write=False)
        mine = sorted(
            (
                (seq, q)
                for (origin, seq), q in self._tables.quarantine.items()
                if origin == peer_did
            ),
            key=lambda item: -item[0],
        )
        return [
            Quarantined(seq, q.get("entryDid"), str(q["code"]), str(q["reason"]))
            for seq, q in mine[:limit]
        ]

    async def list_peers(self) -> list[PeerRow]:
        await self._call(write=False)
        return [self._tables.peers[d] for d in sorted(self._tables.peers)]

    def _replicas_of(self, entry_did: str) -> list[tuple[tuple[str, int], _Replica]]:
        return [(k, r) for k, r in self._tables.replicas.items() if r.entry_did == entry_did]

    async def replica_head(self, entry_did: str) -> ReplicaVersion | None:
        await self._call(write=False)
        found = self._replicas_of(entry_did)
        if not found:
            return None
        (origin, seq), r = max(found, key=lambda kr: (kr[1].synced_seq, kr[0][1]))
        return ReplicaVersion(origin, seq, r.lifecycle, r.doc)

    async def replica_versions(
        self, entry_did: str, origin_did: str, before_seq: int | None, limit: int, page_bytes: int
    ) -> tuple[list[str | None], int]:
        await self._call(write=False)
        live = sorted(
            (
                (k[1], r.doc)
                for k, r in self._replicas_of(entry_did)
                if k[0] == origin_did and r.lifecycle != "deleted"
            ),
            reverse=True,
        )
        page = [doc for seq, doc in live if before_seq is None or seq < before_seq]
        return _within(page[:limit], page_bytes), len(live)

    async def replica_version(self, entry_did: str, origin_did: str, seq: int) -> str | None:
        await self._call(write=False)
        r = self._tables.replicas.get((origin_did, seq))
        if r is None or r.entry_did != entry_did or r.lifecycle == "deleted":
            return None
        return r.doc

    # --- the log --------------------------------------------------------------------------

    async def log_after(self, after_seq: int, limit: int) -> list[LogRecord]:
        await self._call(write=False)
        start = max(after_seq, 0)
        return self._tables.log[start : start + max(limit, 0)]

    async def log_head(self) -> int:
        await self._call(write=False)
        return len(self._tables.log)

    # --- witnessing ---------------------------------------------------------------------------

    async def peer_checkpoints(self) -> dict[str, WitnessRow]:
        await self._call(write=False)
        return dict(self._tables.witnessed)

    async def accept_peer_checkpoint(self, peer_did: str, accepted: Witnessed) -> None:
        await self._call(write=True)
        row = self._tables.witnessed.get(peer_did)
        if row is None or row.accepted.size <= accepted.size:
            self._tables.witnessed[peer_did] = WitnessRow(
                accepted, None if row is None else row.fork
            )

    async def record_fork(self, peer_did: str, fork: Fork) -> None:
        await self._call(write=True)
        row = self._tables.witnessed.get(peer_did)
        if row is not None and row.fork is None:
            evidence = {"reason": fork.reason, "detail": fork.detail, **fork.evidence}
            self._tables.witnessed[peer_did] = WitnessRow(row.accepted, evidence)

    async def add_cosignature(self, tree_size: int, witness: str, line: str) -> bool:
        await self._call(write=True)
        if tree_size not in self._tables.checkpoints:
            return False
        self._tables.cosignatures.setdefault(tree_size, {})[witness] = line
        return True

    async def cosignatures(self, tree_size: int) -> list[str]:
        await self._call(write=False)
        lines = self._tables.cosignatures.get(tree_size, {})
        return [lines[w] for w in sorted(lines)]

    # --- the verifiable log ----------------------------------------------------------------

    async def log_records(self, after_seq: int, limit: int) -> list[tuple[LogRecord, str | None]]:
        records, _ = await self.log_records_within(after_seq, limit, None)
        return records

    async def log_records_within(
        self, after_seq: int, limit: int, page_bytes: int | None
    ) -> tuple[list[tuple[LogRecord, str | None]], bool]:
        await self._call(write=False)
        start = max(after_seq, 0)
        out: list[tuple[LogRecord, str | None]] = []
        held = 0
        for record in self._tables.log[start : start + max(limit, 0)]:
            if page_bytes is not None and held >= page_bytes:
                return out, True
            version = self._tables.versions.get(record.seq)
            digest = None if version is None else hashlib.sha256(version.doc.encode()).hexdigest()
            held += 0 if version is None else len(version.doc.encode())
            out.append((record, digest))
        return out, False

    async def tree_tiles(self, keys: Collection[TileKey]) -> dict[TileKey, bytes]:
        await self._call(write=False)
        return {key: self._tables.tiles[key] for key in keys if key in self._tables.tiles}

    async def latest_checkpoint(self) -> StoredCheckpoint | None:
        await self._call(write=False)
        checkpoints = self._tables.checkpoints
        return checkpoints[max(checkpoints)] if checkpoints else None

    async def checkpoint_of_size(self, size: int) -> StoredCheckpoint | None:
        await self._call(write=False)
        return self._tables.checkpoints.get(size)

    async def store_checkpoint(
        self, tiles: Mapping[TileKey, bytes], checkpoint: StoredCheckpoint
    ) -> bool:
        await self._call(write=True)
        checkpoints = self._tables.checkpoints
        if checkpoints and max(checkpoints) >= checkpoint.size:
            return False
        for key, hashes in tiles.items():
            if len(hashes) > len(self._tables.tiles.get(key, b"")):
                self._tables.tiles[key] = hashes
        checkpoints[checkpoint.size] = checkpoint
        return True

    @asynccontextmanager
    async def listen_log(self) -> AsyncIterator[MemoryWakeups]:
        """Wake-ups whenever an append takes a position (unless `drop_wakeups`). Opening one
        fails with `Unavailable` while reads fail; `break_listeners()` fails open ones."""
        await self._call(write=False)
        wakeups = MemoryWakeups()
        self._listeners.add(wakeups)
        try:
            yield wakeups
        finally:
            self._listeners.discard(wakeups)


if TYPE_CHECKING:
    _conforms: Store = MemoryStore()  # mypy checks the fake against the whole port


def _within(docs: list[str], page_bytes: int) -> list[str | None]:
    """`docs`, None for each whose predecessors hold `page_bytes` (as the SQL of PgStore)."""
    out: list[str | None] = []
    held = 0
    for doc in docs:
        out.append(doc if held < page_bytes else None)
        held += len(doc.encode())
    return out
