"""The one write path: every accepted change is a `Change` appended to the durable log.

A use-case decides a change (checks, signatures, the rows to write) and submits it with the
request's idempotency key. The store's append path then, in one transaction, answers a key that
already completed from its record, or lets the kind's handler check its preconditions and write
its rows, takes the next gap-free log position, appends the log record (the event), and records
the outcome under the key. A new kind of change adds a handler in each store adapter, not a path.

Outcomes are domain data: a result (the JSON text the use-case answers with) and the log position
it took, or a `Refusal` (an error kind, code, message and details). HTTP statuses and response
bodies are the edge's business.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import cached_property, lru_cache
from typing import Any, Generic, Literal, Protocol, TypeVar

import trio

from registry.errors import (
    Conflict,
    Forbidden,
    Invalid,
    NotFound,
    RegistryError,
    TooLarge,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

# Errors a request can be refused with and that a retry under the same key must see again.
# Anything else (unavailable, rate limited, internal) is not recorded: the client may retry.
RECORDED_REFUSALS: dict[str, type[RegistryError]] = {
    cls.__name__: cls
    for cls in (
        Invalid,
        Unauthorized,
        Forbidden,
        NotFound,
        Conflict,
        TooLarge,
        UnsupportedMediaType,
    )
}

# A handler's answer when the state a decision was made on moved before the change could be
# applied (a record's version): nothing is written or recorded, and the use-case decides again.
RETRY = "Retry"
MAX_DECISIONS = 8


@dataclass(frozen=True)
class Kind:
    """A kind of change: who sees its log record, and how a store applies it.

    `handler` names the SQL function of migrations/ that checks and writes a change of this
    kind (the in-memory store has a Python function for each such name); None for a kind only
    appended after another change (`Also`). `audience`: `public` records are events for every
    subscriber, `admin` ones for admin sessions only, `internal` ones take a log position and
    are never published."""

    handler: str | None
    audience: Literal["public", "admin", "internal"]


# Every kind of change, the one table (a new kind adds a row, a handler in migrations/ and its
# in-memory twin).
CHANGE_KINDS: Mapping[str, Kind] = {
    "entry.created": Kind("apply_entry_version", "public"),
    "entry.updated": Kind("apply_entry_version", "public"),
    "entry.deleted": Kind("apply_entry_version", "public"),
    "session.revoked": Kind("apply_session_revoked", "internal"),
    # Anchoring (migration 0010).
    "anchor.claimed": Kind("apply_anchor_claim", "internal"),
    "anchor.settled": Kind("apply_anchor_settle", "internal"),
    "anchor.updated": Kind("apply_anchor_control", "public"),
    # Federation (migration 0011): a peer's pull (replicas, quarantines, cursor, status), and
    # a peer's self-registration.
    "peer.status": Kind("apply_peer_sync", "admin"),
    "peer.updated": Kind("apply_records", "admin"),
    # Trust and ownership records (migration 0009): versioned documents, compare-and-set.
    **{
        kind: Kind("apply_records", "public")
        for kind in (
            "attestation.created",
            "attestation.revoked",
            "report.created",
            "report.resolved",
            "bond.provisioned",
            "bond.slashed",
            "bond.released",
            "transfer.offered",
            "transfer.declined",
            "transfer.cancelled",
            "entry.transferred",
        )
    },
    "transfer.accepted": Kind(None, "public"),  # after entry.transferred, in its transaction
}

# Kinds that take a log position but are never published to event subscribers.
INTERNAL_KINDS = frozenset(k for k, kind in CHANGE_KINDS.items() if kind.audience == "internal")


@dataclass(frozen=True)
class IdemKey:
    """Where an idempotency record lives and what request it stands for."""

    scope: str  # principal DID, session, peer DID, or "anonymous"
    operation: str
    key: str
    fingerprint: bytes


@dataclass(frozen=True)
class Refusal:
    """Why a change was not applied, as recorded data: `error()` raises it again."""

    kind: str  # a name in RECORDED_REFUSALS
    code: str
    message: str
    details: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, exc: RegistryError) -> Refusal:
        return cls(type(exc).__name__, exc.code, exc.message, dict(exc.details))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Refusal:
        return cls(data["kind"], data["code"], data["message"], dict(data.get("details") or {}))

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "code": self.code,
            "message": self.message,
            "details": dict(self.details),
        }

    def error(self) -> RegistryError:
        return RECORDED_REFUSALS.get(self.kind, Conflict)(
            self.message, code=self.code, details=dict(self.details)
        )


@dataclass(frozen=True)
class Also:
    """A further log record a change appends right after its own, in the same transaction
    (its own position, its own kind): e.g. transfer.accepted after entry.transferred."""

    kind: str
    subject: str | None
    event: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decided(Generic[T_co]):
    """A decided change, with what the decision saw that the use-case needs afterwards
    (`ChangeLog.submit_seen`)."""

    change: Change
    seen: T_co


@dataclass(frozen=True)
class Change:
    """One change to append: its log `kind`, the `subject` it is about (an entry DID, or None),
    the `rows` its kind's handler writes (JSON-safe, documented per kind), the `event`
    payload its log record carries to subscribers, and any records it `also` appends."""

    kind: str
    subject: str | None
    rows: Mapping[str, Any]
    event: Mapping[str, Any] = field(default_factory=dict)
    also: tuple[Also, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """What became of a submitted change.

    `replayed`: the idempotency key had already completed, and this is its recorded outcome
    (nothing was written now, no event was emitted)."""

    sequence: int | None
    result: str | None
    refusal: Refusal | None
    replayed: bool = False

    def unwrap(self) -> str:
        """The result text, or the refusal raised as its domain error."""
        if self.refusal is not None:
            raise self.refusal.error()
        assert self.result is not None
        return self.result


IDEMPOTENCY_CONFLICT = Refusal(
    "Conflict",
    "idempotency_conflict",
    "this Idempotency-Key was already used for a different request",
)

# How long a completed request answers for its Idempotency-Key (design §6): the store keeps its
# outcome that long (its append path and `record_refusal` take this window), the janitor then
# deletes it, and the key may be used again.
IDEMPOTENCY_WINDOW_MS = 24 * 3600 * 1000


def standing_outcome(idem: IdemKey, recorded_for: bytes, outcome: Outcome) -> Outcome:
    """The answer to `idem` when its key already holds `outcome`, recorded for the request whose
    fingerprint is `recorded_for`: that outcome again (a replay), or `idempotency_conflict`
    when this is a different request."""
    if recorded_for != idem.fingerprint:
        return Outcome(None, None, IDEMPOTENCY_CONFLICT)
    return replace(outcome, replayed=True)


@dataclass(frozen=True)
class LogRecord:
    """One record of the durable log: the change at `seq`, as subscribers see it."""

    seq: int
    kind: str
    entry_did: str | None
    at_ms: int
    data: Mapping[str, Any]

    @property
    def public(self) -> bool:
        return self.kind not in INTERNAL_KINDS

    @cached_property
    def event_json(self) -> str:
        """The event message of design §10, rendered once for every subscriber."""
        event: dict[str, Any] = {
            "type": "event",
            "sequence": self.seq,
            "kind": self.kind,
            "entryDid": self.entry_did,
            "at": rfc3339_ms(self.at_ms),
            "data": self.data,
        }
        if self.entry_did is None:
            del event["entryDid"]
        return json.dumps(event, ensure_ascii=False, separators=(",", ":"))


# The seconds of years 1000-9999, where strftime's %Y has four digits as RFC 3339's year does.
_FOUR_DIGIT_YEARS = (-30_610_224_000, 253_402_300_800)


@lru_cache(maxsize=256)
def _second(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(seconds))


def rfc3339_ms(ms: int) -> str:
    """`2026-11-29T08:59:16.123Z`. Every write and every checkpointed record formats one, and
    many share a second: a cached prefix, then the milliseconds."""
    seconds, millis = divmod(ms, 1000)
    low, high = _FOUR_DIGIT_YEARS
    if type(ms) is int and low <= seconds < high:
        return f"{_second(seconds)}{millis:03d}Z"
    # Exact: a float of seconds (`datetime.fromtimestamp(ms / 1000)`) drifts by a millisecond
    # from about the year 2400.
    moment = _EPOCH + timedelta(milliseconds=ms)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


Append = Callable[[Change, IdemKey | None], Awaitable[Outcome]]


class RefusalRecorder(Protocol):
    async def record_refusal(self, idem: IdemKey, refusal: Refusal) -> Outcome: ...


class ChangeLog:
    """The one way use-cases change state: decide a change, append it, idempotently.

    `append` is the group-commit writer's (or the store's own) append. A refusal decided before
    the append (validation, authorization, a stale precondition) is recorded under the key too,
    unless the key already has an outcome: then that outcome is answered, so a retry of a
    request that succeeded is answered with its success even where a check would now refuse it.
    """

    def __init__(self, append: Append, recorder: RefusalRecorder) -> None:
        self._append = append
        self._recorder = recorder
        # Held by a request deciding again after a `Retry`: the requests of this process that
        # lost a race decide one at a time, so each of them finds the state the previous one
        # left (twelve concurrent slashes of one bond all lost to one another and four of them
        # ran out of decisions, 503 write_contended). A first decision never waits for it.
        self._retrying = trio.Lock()

    async def submit(
        self, idem: IdemKey | None, decide: Callable[[], Awaitable[Change]]
    ) -> Outcome:
        """Decide and append; when the handler answers `Retry` (what the decision read has
        moved), decide again on the new state, up to `MAX_DECISIONS` times."""

        async def deciding() -> Decided[None]:
            return Decided(await decide(), None)

        outcome, _ = await self.submit_seen(idem, deciding)
        return outcome

    async def submit_seen(
        self, idem: IdemKey | None, decide: Callable[[], Awaitable[Decided[T]]]
    ) -> tuple[Outcome, T | None]:
        """`submit` for a use-case that needs, once the change is appended, something its
        decision saw (the entry it was about, the version it replaced): the `seen` of the
        decision whose change was appended — the last one, when a `Retry` made it decide
        again — or None when none was (the decision refused)."""
        outcome, seen, moved = await self._decide_and_append(idem, decide)
        if not moved:
            return outcome, seen
        async with self._retrying:
            for _ in range(MAX_DECISIONS - 1):
                outcome, seen, moved = await self._decide_and_append(idem, decide)
                if not moved:
                    return outcome, seen
        raise Unavailable(
            "the record kept changing while this request was decided; retry it",
            code="write_contended",
        )

    async def _decide_and_append(
        self, idem: IdemKey | None, decide: Callable[[], Awaitable[Decided[T]]]
    ) -> tuple[Outcome, T | None, bool]:
        """One decision and its append: the outcome, what the decision saw (None when it
        refused), and whether the handler answered `Retry`."""
        try:
            decided = await decide()
        except RegistryError as exc:
            if idem is None or type(exc).__name__ not in RECORDED_REFUSALS:
                raise
            return await self._recorder.record_refusal(idem, Refusal.of(exc)), None, False
        outcome = await self._append(decided.change, idem)
        moved = outcome.refusal is not None and outcome.refusal.kind == RETRY
        return outcome, decided.seen, moved

    async def submit_all(self, changes: Sequence[tuple[Change, IdemKey | None]]) -> list[Outcome]:
        return [await self._append(change, idem) for change, idem in changes]
