"""Federation rules (design §9), sans-IO: a peer's sync state, the sync cursor, and what a pull
imports. The PeerActor (`actors/federation.py`) only drives these with I/O and the clock.

Theory of operation. A `PeerState` is an immutable value per peer: the durable `cursor` (the
peer's log position imported up to, inclusive), the peer's `head` at the last answer, the
`Breaker` (registry/breaker.py) and the quarantine count. One pull:

1. `sync_request(state)` is the payload to send: `{fromSequence: cursor, maxEntries}`
   (`fromSequence` is exclusive, as the events' `fromSequence`).
2. `read_sync_response(payload, from_sequence)` checks the signed answer's payload: entries in
   strictly ascending `sequence`, all after the cursor and at most `nextSequence`, which may
   not go back. A malformed answer is a failed call (the breaker counts it), not an import.
3. `sort_entries` verifies every entry (`check_replica`: the hash of `itemData` and the
   publisher's signature, or the shape of an origin's tombstone) and sorts it into replicas
   and quarantined ones with the reason. One bad entry never stops the rest.
4. The actor writes replicas, quarantines, the new cursor and status as one change
   (`peer.status`), compare-and-set on the cursor, then `PeerState.after_pull`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, TypeGuard

from registry.breaker import Breaker, BreakerPolicy
from registry.canonical import canonical_members, canonicalize, join_members
from registry.changes import rfc3339_ms
from registry.did import is_did
from registry.entries import verify_publisher
from registry.errors import Invalid, RegistryError
from registry.models import parse_datetime
from registry.query import OrderKey

SYNC_PAGE: Final = 500  # maxEntries a PeerActor asks for
MAX_SYNC_SEQUENCE: Final = 2**63 - 1


class SyncAnswerInvalid(Exception):
    """A peer's sync answer that is signed but not a valid sync response: a failed call."""


@dataclass(frozen=True)
class PeerState:
    """What the registry knows of one peer's sync (durable in the store, see `to_stored`)."""

    peer_did: str
    cursor: int = 0
    head: int | None = None
    breaker: Breaker = field(default_factory=Breaker)
    quarantines: int = 0
    # The cursor as last stored. A pull that only moves the cursor over log positions without
    # entry versions (the peer's own bookkeeping) is not stored: it goes with the next change.
    stored_cursor: int = 0
    # The peer's log as witnessed (docs/transparency.md): the tree size last accepted (kept
    # in memory; the store keeps the checkpoint itself), and, once its log contradicted an
    # accepted checkpoint, why (stored with the status: the peer stays quarantined).
    witnessed_size: int | None = None
    log_fork: str | None = None

    @property
    def lag(self) -> int:
        """How far behind the peer's last known head the cursor is (0 when unknown)."""
        return 0 if self.head is None else max(0, self.head - self.cursor)

    def to_stored(self) -> dict[str, Any]:
        """The `status` document of the store (the cursor and quarantines are columns)."""
        stored: dict[str, Any] = {"breaker": self.breaker.to_json(), "head": self.head}
        if self.log_fork is not None:
            stored["logFork"] = self.log_fork
        return stored

    @classmethod
    def from_stored(
        cls,
        peer_did: str,
        *,
        cursor: int,
        status: dict[str, Any],
        quarantines: int,
        policy: BreakerPolicy,
    ) -> PeerState:
        """The state of a stored row. A status another release wrote (a breaker with other
        members, none, not an object) is read as far as it holds: an unreadable breaker is a
        new one (closed, no failures), replaced by this release's at the next stored change."""
        if not isinstance(status, dict):
            status = {}
        head = status.get("head")
        fork = status.get("logFork")
        try:
            breaker = Breaker.from_json(status.get("breaker"), policy)
        except ValueError:
            breaker = Breaker(policy=policy)
        return cls(
            peer_did=peer_did,
            cursor=cursor,
            stored_cursor=cursor,
            head=head if isinstance(head, int) and not isinstance(head, bool) else None,
            breaker=breaker,
            quarantines=quarantines,
            log_fork=fork if isinstance(fork, str) else None,
        )

    def status_json(self, now_ms: int) -> dict[str, Any]:
        """The FederationPeerStatus of spec 2.8 (the operator view); members without a value
        yet (no latency, no success, no attempt scheduled) are omitted, as spec §2 says."""
        b = self.breaker
        state = b.state_at(now_ms)
        status: dict[str, Any] = {
            "peerDid": self.peer_did,
            "breakerState": state,
            "consecutiveFailures": b.consecutive_failures,
            "cursor": self.cursor,
            "lag": self.lag,
            "quarantines": self.quarantines,
        }
        if b.latency.value_ms is not None:
            status["latencyMs"] = round(b.latency.value_ms)
        if b.last_success_at_ms is not None:
            status["lastSuccessAt"] = rfc3339_ms(b.last_success_at_ms)
        if state != "closed" or b.consecutive_failures:
            status["nextAttemptAt"] = rfc3339_ms(b.next_attempt_at_ms)
        if self.log_fork is not None:
            status["log"] = {
                "state": "inconsistent",
                "reason": "log_inconsistent",
                "detail": self.log_fork,
            }
        elif self.witnessed_size is not None:
            status["log"] = {"state": "consistent", "treeSize": self.witnessed_size}
        return status


def sync_request(state: PeerState, max_entries: int = SYNC_PAGE) -> dict[str, Any]:
    return {"fromSequence": state.cursor, "maxEntries": max_entries}


@dataclass(frozen=True)
class SyncAnswer:
    """A sync response payload that passed `read_sync_response`."""

    entries: tuple[dict[str, Any], ...]
    has_more: bool
    next_sequence: int
    head: int | None


def _whole(value: Any) -> TypeGuard[int]:
    return (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SYNC_SEQUENCE
    )


def read_sync_response(payload: dict[str, Any], from_sequence: int) -> SyncAnswer:
    """Check a sync response payload against the request's `from_sequence`."""
    entries = payload.get("entries")
    has_more = payload.get("hasMore")
    next_sequence = payload.get("nextSequence")
    head = payload.get("headSequence")
    if not isinstance(entries, list) or not isinstance(has_more, bool):
        raise SyncAnswerInvalid("entries must be an array and hasMore a boolean")
    if not _whole(next_sequence) or next_sequence < from_sequence:
        raise SyncAnswerInvalid("nextSequence must be a whole number not below fromSequence")
    if has_more and next_sequence <= from_sequence:
        raise SyncAnswerInvalid("hasMore without progress: nextSequence must pass fromSequence")
    if head is not None and (not _whole(head) or head < next_sequence):
        raise SyncAnswerInvalid("headSequence must be a whole number not below nextSequence")
    previous: int = from_sequence
    for item in entries:
        seq: Any = item.get("sequence") if isinstance(item, dict) else None
        if not _whole(seq) or seq <= previous or seq > next_sequence:
            raise SyncAnswerInvalid(
                "entries must be objects in ascending sequence after fromSequence, "
                "up to nextSequence"
            )
        previous = seq
    if entries and not has_more and head is not None and head < previous:
        raise SyncAnswerInvalid("headSequence is below an entry's sequence")
    return SyncAnswer(tuple(entries), has_more, next_sequence, head)


# --- verifying what a peer serves ---------------------------------------------------------------

TOMBSTONE_MEMBERS: Final = frozenset({"deletedAt", "entryDid", "lifecycleStatus", "sequence"})
LIFECYCLES: Final = frozenset({"draft", "active", "deprecated", "revoked"})


@dataclass(frozen=True)
class Replica:
    seq: int
    entry_did: str
    lifecycle: str
    doc: str  # JCS of the entry as served by the origin

    def row(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "entryDid": self.entry_did,
            "lifecycle": self.lifecycle,
            "doc": self.doc,
        }


@dataclass(frozen=True)
class Quarantined:
    seq: int
    entry_did: str | None
    code: str
    reason: str
    doc: str

    def row(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "entryDid": self.entry_did,
            "code": self.code,
            "reason": self.reason,
            "doc": self.doc,
        }


def check_replica(entry: dict[str, Any]) -> Replica:
    """A served entry version, verified: `Invalid` says why not.

    What the issue asks of every synced entry, the hash of `itemData` and the publisher's
    signature (`registry.entries.verify_publisher`, as for a publisher's own write), with the
    members those checks and serving need, typed. The rest of the document is the origin's word,
    signed by the publisher: it is not validated field by field again (that is ~40 µs of the
    ~200 µs an entry costs). An origin's tombstone (`{deletedAt, entryDid, lifecycleStatus:
    "deleted", sequence}`) carries no publisher signature; it is taken on the origin's signed
    word (the envelope)."""
    seq = entry["sequence"]
    if entry.get("lifecycleStatus") == "deleted" and set(entry) == TOMBSTONE_MEMBERS:
        doc = canonicalize(entry).decode("utf-8")
        did = entry.get("entryDid")
        if (
            not isinstance(did, str)
            or not is_did(did)
            or not isinstance(entry.get("deletedAt"), str)
        ):
            raise Invalid("a tombstone needs entryDid and deletedAt", code="tombstone_invalid")
        return Replica(seq, did, "deleted", doc)
    did, publisher = entry.get("entryDid"), entry.get("publisherDid")
    signature, item_hash = entry.get("signature"), entry.get("itemDataHash")
    lifecycle = entry.get("lifecycleStatus", "draft")
    if (
        not isinstance(did, str)
        or not is_did(did)
        or not isinstance(publisher, str)
        or not isinstance(item_hash, str)
        or "itemData" not in entry
        or not isinstance(signature, dict)
        or not isinstance(signature.get("keyId"), str)
        or not isinstance(signature.get("value"), str)
        or lifecycle not in LIFECYCLES
    ):
        raise Invalid(
            "a served entry needs entryDid, publisherDid, itemData, itemDataHash, a signature"
            " {keyId, value} and a known lifecycleStatus",
            code="entry_invalid",
        )
    members = canonical_members(entry)
    verify_publisher(
        members,
        publisher_did=publisher,
        item_data_hash=item_hash,
        key_id=signature["keyId"],
        signature_value=signature["value"],
        # Entries published before key ids had to carry their fragment still verify: the
        # bare did:key names the same key (what an origin accepted, a replica takes).
        bare_key_id=True,
    )
    doc = join_members(members)
    try:  # members outside the signature too: text PostgreSQL (and a client) can take
        doc.encode("utf-8")
    except UnicodeEncodeError:
        raise Invalid(
            "the entry holds a lone surrogate (it has no UTF-8 form)", code="entry_invalid"
        ) from None
    if "\x00" in doc:
        raise Invalid("the entry holds U+0000", code="entry_invalid")
    return Replica(seq, did, lifecycle, doc)


def _storable(entry: dict[str, Any]) -> str:
    """A quarantined entry as text PostgreSQL can store: JCS when it has one, else escaped JSON
    (no NUL or lone surrogate survives `ensure_ascii`), else a note (nested too deep)."""
    try:
        return canonicalize(entry).decode("utf-8")
    except Exception:  # not representable as JCS: keep it as Python sees it
        try:
            return json.dumps(entry, ensure_ascii=True, default=str)
        except (ValueError, RecursionError):
            return json.dumps({"sequence": entry.get("sequence"), "unrepresentable": True})


def sort_entries(
    entries: Sequence[dict[str, Any]],
) -> tuple[list[Replica], list[Quarantined]]:
    """Every served entry, verified: replicas to store and quarantined ones with the reason."""
    replicas: list[Replica] = []
    quarantined: list[Quarantined] = []
    for entry in entries:
        try:
            replicas.append(check_replica(entry))
        except (RegistryError, ValueError, TypeError, KeyError, RecursionError) as exc:
            did = entry.get("entryDid")
            code = exc.code if isinstance(exc, RegistryError) else "entry_invalid"
            message = exc.message if isinstance(exc, RegistryError) else type(exc).__name__
            quarantined.append(
                Quarantined(
                    entry["sequence"],
                    did if isinstance(did, str) and is_did(did) else None,
                    code,
                    message,
                    _storable(entry),
                )
            )
    return replicas, quarantined


def within_checkpoint(answer: SyncAnswer, tree_size: int, cursor: int) -> SyncAnswer:
    """The part of a sync answer that the peer's witnessed checkpoint of `tree_size` records
    covers: only versions in a tree this registry accepted are imported (docs/transparency.md).
    Past it, the cursor stops at the tree size (never going back from `cursor`, where the pull
    started) and the next pull waits for a newer checkpoint."""
    if answer.next_sequence <= tree_size:
        return answer
    kept = tuple(e for e in answer.entries if int(e.get("sequence", 0)) <= tree_size)
    return replace(answer, entries=kept, next_sequence=max(tree_size, cursor), has_more=False)


def after_pull(state: PeerState, answer: SyncAnswer, quarantined: int) -> PeerState:
    """The state once a pull's change is stored (the breaker is the caller's)."""
    head = (
        answer.head
        if answer.head is not None
        else (None if answer.has_more else answer.next_sequence)
    )
    return replace(
        state,
        cursor=answer.next_sequence,
        head=head if head is None else max(head, answer.next_sequence),
        quarantines=state.quarantines + quarantined,
    )


# --- federated discovery ----------------------------------------------------------------------

RANKED_FIELDS: Final = frozenset({"relevance", "sequence"})  # not comparable across registries


@dataclass(frozen=True)
class SourcePage:
    """One source's answer to a federated query: its entries (served JSON texts) in its own
    order, after the `offset` it was asked from; `origin` is the registry's DID."""

    origin: str
    entries: tuple[str, ...]
    has_more: bool
    total: int
    offset: int


def _time_key(value: Any) -> float:
    """A time as PostgreSQL orders it in discovery: a missing one (NULL) after every time."""
    if not isinstance(value, str):
        return float("inf")
    try:
        return parse_datetime(value).timestamp()
    except ValueError:
        return float("inf")


def merge_key(order: OrderKey, doc: dict[str, Any], rank: int, origin: str) -> tuple[Any, ...]:
    """The deterministic merge order of design §9: the query's ordering, then entryDid, then
    origin. Relevance and sequence are per registry: their entries interleave by rank."""
    did = str(doc.get("entryDid", ""))
    if order.field in RANKED_FIELDS:
        return (rank, did, origin)
    if order.field == "name":  # byte order (COLLATE "C"); a missing name (NULL) last
        name = doc.get("name")
        return ((0, name) if isinstance(name, str) else (1, ""), did, origin)
    return (_time_key(doc.get(order.field)), did, origin)


def in_merge_order(order: OrderKey, page: SourcePage) -> bool:
    """Whether a source's page is in the merge order (a peer that sorts otherwise would make
    the prefix rule of `merge_pages` show nothing of it, page after page)."""
    keys = [
        merge_key(order, json.loads(text), page.offset + rank, page.origin)
        for rank, text in enumerate(page.entries)
    ]
    descending = order.descending and order.field not in RANKED_FIELDS
    return all((b <= a) if descending else (a <= b) for a, b in itertools.pairwise(keys))


def merge_pages(
    order: OrderKey, pages: Sequence[SourcePage], limit: int
) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Up to `limit` entries of the merged order, as (doc, origin), and how many entries of
    each source the page consumed. Each source's consumed entries are a prefix of its page, so
    the next page continues every source exactly after what was shown (no skip, no repeat)."""
    items: list[tuple[tuple[Any, ...], str, str, int]] = []
    for page in pages:
        for rank, text in enumerate(page.entries):
            doc = json.loads(text)
            key = merge_key(order, doc, page.offset + rank, page.origin)
            items.append((key, text, page.origin, rank))
    descending = order.descending and order.field not in RANKED_FIELDS
    items.sort(key=lambda item: item[0], reverse=descending)
    chosen = items[:limit]
    taken: dict[str, set[int]] = {}
    for _, _, origin, rank in chosen:
        taken.setdefault(origin, set()).add(rank)
    consumed: dict[str, int] = {}
    for page in pages:
        ranks = taken.get(page.origin, set())
        n = 0
        while n in ranks:
            n += 1
        consumed[page.origin] = n
    shown = [(text, origin) for _, text, origin, rank in chosen if rank < consumed[origin]]
    return shown, consumed
