"""The storage port: what the use-cases need from persistence, and nothing about how.

`registry.store.pg.PgStore` is the PostgreSQL adapter (asyncpg through trio-asyncio); the
protocol keeps the driver swappable and lets pure code be tested without a database.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from registry.anchoring import Member
from registry.changes import Change, IdemKey, LogRecord, Outcome, Refusal
from registry.transparency import Fork, StoredCheckpoint, TileKey, Witnessed

if TYPE_CHECKING:
    from registry.query import RegistryQuery

__all__ = [
    "INLINE_ATTESTATIONS",
    "AnchorStore",
    "Change",
    "DiscoveryStore",
    "EntryHead",
    "EntryStore",
    "FederationStore",
    "HealthStore",
    "IdemKey",
    "IntentRow",
    "LeaderStore",
    "Leadership",
    "LogRecord",
    "LogStore",
    "OpenBatch",
    "Outcome",
    "PeerRow",
    "Receipt",
    "RecordRow",
    "ReplicaVersion",
    "SessionRecord",
    "SessionStore",
    "Store",
    "TransparencyStore",
    "TrustStore",
    "WitnessRow",
]


# The most attestations an entry serves in `verifiableAttestations`: anyone with `attest` may
# attest any entry, and every GET of it serves them (all are listed, paged, at
# /v1/entries/{did}/attestations). The oldest first, so new ones never displace those served.
INLINE_ATTESTATIONS = 50


@dataclass(frozen=True)
class EntryHead:
    entry_did: str
    head_seq: int
    publisher_did: str
    lifecycle: str
    doc: str
    # The entry's first INLINE_ATTESTATIONS unrevoked attestations unexpired when it was read,
    # oldest first: (expiry in ms or None, attestation record JSON).
    attestations: tuple[tuple[int | None, str], ...] = ()
    # The state of the head version's anchor intent (None: it has none).
    anchor_state: str | None = None


@dataclass(frozen=True)
class Receipt:
    """One batch an anchor intent was part of."""

    batch_id: int
    leaf_index: int
    state: str  # claimed | submitted | confirmed | dropped
    root: str | None
    transaction_id: str | None
    block_height: int | None
    block_hash: str | None
    anchor_time_ms: int | None
    observed_ms: int | None
    created_ms: int
    leaves: int | None = None  # of the batch's stored tree; None: none stored (before 0025)


@dataclass(frozen=True)
class IntentRow:
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
    receipts: tuple[Receipt, ...] = ()


@dataclass(frozen=True)
class OpenBatch:
    """A batch the supervisor has not settled: its members (with their current states)."""

    batch_id: int
    root: str | None
    transaction_id: str | None
    members: tuple[tuple[Member, str], ...]  # (member, its intent's state), leaf order


@dataclass(frozen=True)
class RecentBatch:
    batch_id: int
    state: str  # claimed | submitted | confirmed | dropped
    transaction_id: str | None
    block_height: int | None
    anchor_time_ms: int | None
    intents: int  # its members


@dataclass(frozen=True)
class AnchoringOverview:
    """The anchoring backlog at a glance (the operator's overview)."""

    pending: int  # intents waiting for a batch
    oldest_pending_ms: int | None  # when the oldest of them was created
    in_flight: int  # batches claimed or submitted, not yet settled
    recent: tuple[RecentBatch, ...]  # the latest batches, newest first


@dataclass(frozen=True)
class Quarantined:
    """An entry a peer served that failed verification (never imported)."""

    origin_seq: int
    entry_did: str | None
    code: str
    reason: str


@dataclass(frozen=True)
class RecordRow:
    """A trust or ownership record (attestation, report, bond, offer): a versioned document."""

    kind: str
    id: str
    entry_did: str
    owner_did: str | None
    status: str
    version: int
    expires_ms: int | None
    created_seq: int
    updated_seq: int
    doc: str


@dataclass(frozen=True)
class PeerRow:
    """A peer's durable sync state (migration 0011): see `registry.federation.PeerState`."""

    peer_did: str
    cursor: int
    status: dict[str, Any]
    quarantines: int


@dataclass(frozen=True)
class ReplicaVersion:
    """A version of an entry synced from its origin registry (a peer)."""

    origin_did: str
    origin_seq: int
    lifecycle: str
    doc: str


@dataclass(frozen=True)
class SessionRecord:
    principal: str
    hmr_did: str
    root_did: str
    root_kind: str
    capabilities: tuple[str, ...]
    expires_at_ms: int


class LogWakeups(Protocol):
    """Wake-ups of a log reader: the log may have grown (in this or any other process)."""

    async def wait(self) -> None:
        """Return when the log may have grown; raise `Unavailable` once the listening
        connection is lost (whatever was appended since must be read from the log)."""
        ...


class Leadership(Protocol):
    async def lost(self) -> None:
        """Return (or raise `Unavailable`) once the leadership is lost (its connection)."""
        ...


# --- the ports: one per feature -----------------------------------------------------------
# Each use-case and actor depends on the narrowest port that has what it calls, so a test fake
# implements only what its test drives. `Store` is all of them: the PostgreSQL adapter and the
# in-memory fake implement it whole.


class HealthStore(Protocol):
    """Operations: is the database there, at which schema, does it take writes; housekeeping."""

    async def ping(self) -> None: ...
    async def schema_version(self) -> int: ...
    async def write_condition(self) -> str | None:
        """Why the database refuses writes right now (`database_read_only`), or None."""
        ...

    async def purge_expired(self) -> dict[str, int]: ...
    async def lapse_attestations(self) -> int:
        """Mark active attestations whose expiry has passed lapsed (an entry's read no longer
        walks them); how many."""
        ...

    async def vacuum_records(self) -> None:
        """Reclaim the old versions of lapsed records, their index entries included."""
        ...

    def pool_statistics(self) -> dict[str, int]:
        """Connections `open`, `in_use`, callers `waiting` for one, and those `held_back`
        (lacking while PostgreSQL refuses more) (empty: no pool)."""
        ...

    def error_statistics(self) -> dict[str, int]:
        """Database errors this process met, by the error code they were answered with."""
        ...

    async def live_processes(self) -> int:
        """How many registry processes serve from this database now (at least this one)."""
        ...


class LogStore(Protocol):
    """The one write path (registry.changes) and the log it appends to."""

    async def append(self, items: list[tuple[Change, IdemKey | None]]) -> list[Outcome]:
        """Apply changes in order, in one transaction."""
        ...

    async def record_refusal(self, idem: IdemKey, refusal: Refusal) -> Outcome: ...
    async def log_after(self, after_seq: int, limit: int) -> list[LogRecord]: ...
    async def log_head(self) -> int: ...
    def listen_log(self) -> AbstractAsyncContextManager[LogWakeups]: ...


class EntryStore(Protocol):
    """Reads of entries: heads, versions (local and replicated), and what a change wrote."""

    async def get_entry_head(
        self, entry_did: str, *, attestations: int = INLINE_ATTESTATIONS
    ) -> EntryHead | None:
        """The entry's head with its first `attestations` shown attestations (0: none read,
        for a check that the entry is there)."""
        ...

    async def list_versions(
        self, entry_did: str, before_seq: int | None, limit: int, page_bytes: int
    ) -> tuple[list[str | None], int]:
        """Live versions, newest first, and their count; a version whose newer ones on the page
        hold `page_bytes` comes as None (its document is not read)."""
        ...

    async def get_version(self, entry_did: str, seq: int) -> str | None: ...
    async def anchor_states(self, entry_did: str, sequences: list[int]) -> dict[int, str]:
        """The state of the anchor intent of each entry version in `sequences` that has one."""
        ...

    async def version_labelled(self, entry_did: str, version: str) -> tuple[int, str] | None:
        """The earliest live version whose `version` member is `version`: (seq, doc)."""
        ...

    async def change_versions(
        self, changes: list[tuple[int, str]], texts: list[str]
    ) -> dict[int, list[tuple[str, list[str]]]]:
        """For each entry change (seq, did): the versions it replaced and wrote, each with the
        full-text `texts` it matches (what the caches need to know which pages it moves)."""
        ...

    async def replica_head(self, entry_did: str) -> ReplicaVersion | None:
        """The newest replica version of `entry_did` (of the origin synced last)."""
        ...

    async def replica_versions(
        self, entry_did: str, origin_did: str, before_seq: int | None, limit: int, page_bytes: int
    ) -> tuple[list[str | None], int]:
        """Live (not tombstone) replica versions of one origin, newest first, and their count;
        None past `page_bytes`, as `list_versions`."""
        ...

    async def replica_version(self, entry_did: str, origin_did: str, seq: int) -> str | None: ...


class DiscoveryStore(Protocol):
    async def discover(
        self,
        query: RegistryQuery,
        *,
        limit: int,
        after: list[Any] | None,
        page_bytes: int | None = None,
    ) -> tuple[list[tuple[str | None, list[Any]]], int]:
        """Up to `limit` + 1 matches of `query` after the keyset position `after` (each served
        document with its sort values), and the count of all matches (capped). With
        `page_bytes`, a match whose documents before it already hold that many bytes comes
        without its document (None): the page ends before it."""
        ...


class TrustStore(Protocol):
    """Trust and ownership records (written by the append path's `apply_records`)."""

    async def get_record(self, kind: str, record_id: str) -> RecordRow | None: ...
    async def list_records(
        self,
        kind: str,
        *,
        entry_did: str | None = None,
        status: str | None = None,
        after_seq: int | None = None,
        limit: int = 100,
    ) -> list[RecordRow]:
        """Records of `kind` (of one entry, in one status), ascending by creation position,
        after the record created at `after_seq`."""
        ...

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
        """`list_records`, ending before the first record whose predecessors' documents hold
        `page_bytes` bytes (its document is never read; the first record always comes): the
        records, and whether the page ended so."""
        ...


class SessionStore(Protocol):
    """Sign-in: challenges and sessions."""

    async def put_challenge(
        self, nonce: str, challenge: dict[str, Any], expires_ms: int
    ) -> None: ...
    async def get_challenge(self, nonce: str) -> dict[str, Any] | None: ...
    async def open_session(self, nonce: str, token_hash: bytes, session: SessionRecord) -> bool: ...
    async def get_session(self, token_hash: bytes) -> SessionRecord | None: ...


class LeaderStore(Protocol):
    def leadership(self, name: str) -> AbstractAsyncContextManager[Leadership]:
        """Hold the named leadership (one holder per database) while inside; waits for it."""
        ...


class AnchorStore(LeaderStore, Protocol):
    """Anchoring (migration 0010): reads, the batch bookkeeping, and the leader's election."""

    async def anchor_intents_of(
        self, entry_did: str, *, after: tuple[int, int, str] | None, limit: int
    ) -> list[IntentRow]:
        """The entry's intents ascending by (sequence, createdAt ms, intentId), after `after`."""
        ...

    async def get_anchor_intent(self, intent_id: str) -> IntentRow | None: ...
    async def anchor_batch_members(self, batch_id: int) -> list[Member]: ...
    async def open_anchor_batches(self) -> list[OpenBatch]: ...
    async def anchor_pending(self, available_at_ms: int) -> bool:
        """Whether any pending intent is available by then (a read: no log lock)."""
        ...

    async def record_anchor_submission(
        self, batch_id: int, root: str, transaction_id: str, levels: bytes, leaves: int
    ) -> None:
        """The batch's root and transaction, and its tree (`MerkleTree.packed_levels` of
        `leaves` leaves), in one transaction."""
        ...

    async def batches_without_tree(self, after: int, limit: int) -> list[tuple[int, str]]:
        """(batch id, root) of submitted batches past `after` whose tree is not stored, oldest
        first (those submitted before migration 0025)."""
        ...

    async def store_anchor_tree(self, batch_id: int, levels: bytes, leaves: int) -> None: ...

    async def anchor_tree_slices(self, wanted: Sequence[tuple[int, int]]) -> list[bytes]:
        """For each (batch id, byte offset), the NODE_BYTES at that offset of the batch's stored
        tree (registry/merkle.py `proof_offsets`), in order; fewer bytes (none) past its end or
        where the batch has no stored tree."""
        ...

    async def anchoring_overview(self, recent: int) -> AnchoringOverview:
        """The backlog, the batches in flight and the `recent` latest batches."""
        ...


class FederationStore(LeaderStore, Protocol):
    """Federation (migration 0011): what sync serves, nonces, peers' state."""

    # Witnessing (migration 0018).
    async def peer_checkpoints(self) -> dict[str, WitnessRow]:
        """The newest checkpoint accepted from each peer, and its fork if one was found."""
        ...

    async def accept_peer_checkpoint(self, peer_did: str, accepted: Witnessed) -> None:
        """Keep `accepted` as the checkpoint the peer's next one must extend (never a smaller
        one than stored)."""
        ...

    async def record_fork(self, peer_did: str, fork: Fork) -> None: ...
    async def add_cosignature(self, tree_size: int, witness: str, line: str) -> bool:
        """Keep a peer's cosignature of this registry's checkpoint of `tree_size`; False when
        no such checkpoint is stored."""
        ...

    async def cosignatures(self, tree_size: int) -> list[str]:
        """The cosignature lines of this registry's checkpoint of `tree_size`, by witness."""
        ...

    async def sync_page(
        self, after_seq: int, limit: int, max_bytes: int
    ) -> tuple[list[tuple[int, str]], int, bool]:
        """Local entry versions after `after_seq` in sequence order (at most `limit`, and
        within `max_bytes` of documents but at least one), the log head, and whether more
        versions follow the page, all in one snapshot."""
        ...

    async def burn_nonce(self, sender_did: str, nonce: str, expires_ms: int) -> bool:
        """Record a received envelope's nonce; False if that sender already used it."""
        ...

    async def get_peer(self, peer_did: str) -> PeerRow | None: ...
    async def list_peers(self) -> list[PeerRow]: ...
    async def quarantined(self, peer_did: str, limit: int) -> list[Quarantined]:
        """The peer's latest quarantined entries (by their sequence at the peer, newest first)."""
        ...


@dataclass(frozen=True)
class WitnessRow:
    accepted: Witnessed
    fork: dict[str, Any] | None  # the evidence, once the peer's log contradicted `accepted`


class TransparencyStore(LeaderStore, Protocol):
    """The verifiable log (issue 20): the records the tree commits to, its tiles, checkpoints."""

    async def log_records(self, after_seq: int, limit: int) -> list[tuple[LogRecord, str | None]]:
        """Log records after `after_seq` in order, each with the lowercase hex SHA-256 of the
        entry version written at its sequence (None where none was)."""
        ...

    async def log_records_within(
        self, after_seq: int, limit: int, page_bytes: int | None
    ) -> tuple[list[tuple[LogRecord, str | None]], bool]:
        """`log_records`, ending before the first record whose predecessors' entry versions
        hold `page_bytes` (their versions are hashed): the records, and whether it ended so."""
        ...

    async def log_head(self) -> int: ...
    async def tree_tiles(self, keys: Collection[TileKey]) -> dict[TileKey, bytes]:
        """The stored tiles among `keys`."""
        ...

    async def latest_checkpoint(self) -> StoredCheckpoint | None: ...
    async def checkpoint_of_size(self, size: int) -> StoredCheckpoint | None: ...
    async def store_checkpoint(
        self, tiles: Mapping[TileKey, bytes], checkpoint: StoredCheckpoint
    ) -> bool:
        """Write the tiles and the checkpoint in one transaction; False (nothing written) if a
        checkpoint of that size or a larger one is already stored."""
        ...


class Store(
    HealthStore,
    TransparencyStore,
    LogStore,
    EntryStore,
    DiscoveryStore,
    TrustStore,
    SessionStore,
    AnchorStore,
    FederationStore,
    Protocol,
):
    """Everything the service needs from persistence: every port (the PostgreSQL adapter and
    the in-memory fake of the tests both implement all of it)."""
