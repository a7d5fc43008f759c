"""The storage port: what the use-cases need from persistence, and nothing about how.

`registry.store.pg.PgStore` is the PostgreSQL adapter (asyncpg through trio-asyncio); the
protocol keeps the driver swappable and lets pure code be tested without a database.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from registry.errors import Conflict, NotFound, RegistryError, Unavailable

if TYPE_CHECKING:
    from registry.store.discover import Plan


@dataclass(frozen=True)
class IdemKey:
    """Where an idempotency record lives and what request it stands for."""

    scope: str  # principal DID, peer DID, or "anonymous"
    operation: str
    key: str
    fingerprint: bytes


@dataclass(frozen=True)
class IdemState:
    outcome: str  # "claimed" | "done" | "running"
    fingerprint: bytes
    status: int | None
    response: str | None


@dataclass(frozen=True)
class EntryHead:
    entry_did: str
    head_seq: int
    publisher_did: str
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


@dataclass(frozen=True)
class LogRecord:
    seq: int
    kind: str
    entry_did: str | None
    at_ms: int
    data: dict[str, Any]


@dataclass(frozen=True)
class EntryWrite:
    """One accepted change to an entry; the store assigns its sequence."""

    kind: str  # entry.created | entry.updated | entry.deleted
    entry_did: str
    expected_head: int | None  # None: create (the DID must be new)
    publisher_did: str
    entry_type: str
    lifecycle: str
    prefix: str  # served JSON = prefix ‖ sequence ‖ suffix
    suffix: str
    status: int  # HTTP status recorded for an idempotent replay


_REFUSALS: dict[str, tuple[type[RegistryError], str]] = {
    "entry_exists": (Conflict, "an entry with this DID exists or existed"),
    "entry_not_found": (NotFound, "entry not found"),
    "sequence_conflict": (Conflict, "the entry changed since the version this request is based on"),
    "idempotency_conflict": (Conflict, "this Idempotency-Key was already used for another request"),
}


@dataclass(frozen=True)
class WriteOutcome:
    """What became of one item of a write batch: written, replayed, or refused (`error`)."""

    seq: int | None
    doc: str
    replay_status: int | None
    error: str | None

    def result(self) -> tuple[int | None, str, int | None]:
        """(seq, doc, None) when written, (None, response, status) when replayed; a refusal
        raises its domain error."""
        if self.error is not None:
            kind, message = _REFUSALS.get(self.error, (Unavailable, "the write was refused"))
            raise kind(message, code=self.error)
        return self.seq, self.doc, self.replay_status


class Store(Protocol):
    async def ping(self) -> None: ...
    async def schema_version(self) -> int: ...

    async def idem_begin(self, key: IdemKey, lease_seconds: float) -> IdemState: ...
    async def idem_finish(self, key: IdemKey, status: int | None, response: str | None) -> None: ...

    async def write_entry(
        self, write: EntryWrite, idem: IdemKey | None
    ) -> tuple[int | None, str, int | None]: ...
    async def idem_lookup(self, key: IdemKey) -> IdemState | None: ...
    async def write_entries(
        self, items: list[tuple[EntryWrite, IdemKey | None]]
    ) -> list[WriteOutcome]: ...
    async def get_entry_head(self, entry_did: str) -> EntryHead | None: ...
    async def list_versions(
        self, entry_did: str, before_seq: int | None, limit: int
    ) -> tuple[list[str], int]: ...
    async def get_version(self, entry_did: str, seq: int) -> str | None: ...

    async def discover(self, plan: Plan) -> tuple[list[tuple[str, list[Any]]], int]: ...
    async def change_versions(
        self, changes: list[tuple[int, str]], texts: list[str]
    ) -> dict[int, list[tuple[str, list[str]]]]: ...

    async def put_challenge(
        self, nonce: str, challenge: dict[str, Any], expires_ms: int
    ) -> None: ...
    async def get_challenge(self, nonce: str) -> dict[str, Any] | None: ...
    async def open_session(self, nonce: str, token_hash: bytes, session: SessionRecord) -> bool: ...
    async def get_session(self, token_hash: bytes) -> SessionRecord | None: ...
    async def revoke_session(self, token_hash: bytes) -> bool: ...

    async def log_after(self, after_seq: int, limit: int) -> list[LogRecord]: ...
    async def log_head(self) -> int: ...
