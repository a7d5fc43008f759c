"""PostgreSQL adapter of the storage port: asyncpg, driven from Trio through trio-asyncio.

Each public method is one asyncio coroutine run with `aio_as_trio`, so a use-case crosses the
Trio/asyncio seam once per store call, and every write is a single statement (a plpgsql function)
that commits on its own: one round trip, one transaction, nothing half-applied.

Every change goes through `append_changes` (migration 0008), the one append path: the kind's
handler function is named by `HANDLERS`, and a refusal comes back as data, never as an SQL
error. Driver failures are translated here: a lost connection or a query past its deadline
becomes `Unavailable`.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, ParamSpec, TypeVar

import asyncpg
import trio
import trio_asyncio

from registry.anchoring import Member
from registry.changes import (
    CHANGE_KINDS,
    IDEMPOTENCY_WINDOW_MS,
    Change,
    IdemKey,
    LogRecord,
    Outcome,
    Refusal,
    standing_outcome,
)
from registry.errors import Invalid, Unavailable
from registry.merkle import NODE_BYTES
from registry.metering import timed_statement
from registry.outage import ConditionLog
from registry.query import RegistryQuery
from registry.store import (
    INLINE_ATTESTATIONS,
    AnchoringOverview,
    EntryHead,
    IntentRow,
    LogWakeups,
    OpenBatch,
    PeerRow,
    Quarantined,
    Receipt,
    RecentBatch,
    RecordRow,
    ReplicaVersion,
    SessionRecord,
    WitnessRow,
)
from registry.store.discover import Plan, bytes_before, compile_discover
from registry.store.pool import LeanPool
from registry.store.routing import (
    ON_PRIMARY,
    PRIMARY_HEAD_SECONDS,
    READ_FLOOR,
    REPLICA_DEADLINE_SECONDS,
    RETRY_SECONDS,
    ReplicaState,
)
from registry.transparency import Fork, StoredCheckpoint, TileKey, Witnessed

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

QUERY_TIMEOUT_SECONDS = 30.0

# Settings of every pooled connection (tests and benchmarks plan with the same ones).
SESSION_SETTINGS: dict[str, str] = {
    "application_name": "registry",
    # Discovery statements are prepared once and reused with other values; a generic plan
    # misestimates array containment (serviceType) and ran 5-8x slower.
    "plan_cache_mode": "force_custom_plan",
    # The working set is in memory (shared buffers or the OS cache), where a random page costs
    # about what a sequential one does; with the default 4.0 the planner preferred sequential
    # scans that stop after the capped count's 1,001 matches over the filters' GIN indexes.
    "random_page_cost": "1.1",
    "TimeZone": "UTC",
    # A call gives up after QUERY_TIMEOUT_SECONDS and its connection is closed, but PostgreSQL
    # notices a closed socket only when it next writes to it: a statement whose caller gave up
    # (an expensive discovery query, say) would run on. The server ends it a little later.
    "statement_timeout": f"{int(QUERY_TIMEOUT_SECONDS * 1000) + 5000}ms",
}
# Settings of PostgreSQL 14 on, set where the server has them (LeanPool `settings_since`).
SESSION_SETTINGS_SINCE: dict[int, dict[str, str]] = {
    14: {
        # A statement whose caller went away (a client that disconnected, a call that timed
        # out: the pool closes the connection) stops within this interval, not at
        # statement_timeout: its address paid for its database time only until then.
        "client_connection_check_interval": "100ms",
    },
}


def _within_page_bytes(seq: str, budget: str) -> str:
    """SQL: a version's document, newest first, or NULL once the newer documents of the page
    hold `budget` bytes (never read then). The first row always comes."""
    return f"CASE WHEN {bytes_before('doc', f'{seq} DESC')} < {budget} THEN doc END"


# The records after $1 (at most $2) with the hash of the entry version each wrote. The versions'
# range is given too: without it the planner merge-joined from the first version, reading every
# version below $1 (37 ms at 15,000 of 20,000; linear in the position asked). With a budget $3
# (bytes), a record whose predecessors' versions hold it is `past` and its version is not read
# (hashing 100 versions of 1 MiB took ~180 ms).
_VERSION_BYTES_BEFORE = bytes_before("v.doc", "l.seq")
LOG_RECORDS_SQL = (
    "SELECT l.seq, l.kind, l.entry_did, l.at, l.data,"
    f"      $3::bigint IS NOT NULL AND {_VERSION_BYTES_BEFORE} >= $3 AS past,"
    f"      CASE WHEN $3::bigint IS NULL OR {_VERSION_BYTES_BEFORE} < $3"
    "        THEN encode(sha256(convert_to(v.doc, 'UTF8')), 'hex') END AS document_hash"
    "  FROM log l LEFT JOIN entry_versions v ON v.seq = l.seq AND v.seq > $1"
    " WHERE l.seq > $1 ORDER BY l.seq LIMIT $2"
)


# Database faults, by SQLSTATE (PostgreSQL, Appendix A): exact codes first, then classes. Each
# is a condition the database is in, not a fault of the request: 503 with a code that names it,
# and the actors back off and retry. What is not here (syntax, undefined objects, constraint
# violations the SQL does not expect) is a bug and propagates.
CONDITIONS: dict[str, tuple[str, str]] = {
    "25006": ("database_read_only", "the database refuses writes (it is read-only)"),
    "53100": ("database_full", "the database's disk is full"),
    "53200": ("database_out_of_memory", "the database is out of memory"),
    "53300": ("database_busy", "the database has too many connections"),
    "57014": ("database_timeout", "the database cancelled the statement (a timeout)"),
    "08": ("database_unavailable", "the database connection failed"),
    # Refused at connect: pg_hba or a rotated password (28), the database dropped or renamed
    # (3D), the role's rights taken (42501). The operator's doing, fixed without a restart.
    "28": ("database_unavailable", "the database refuses this role's connections"),
    "3D": ("database_unavailable", "the database named in the URL does not exist"),
    "42501": ("database_unavailable", "the database refuses this role the rights it needs"),
    "40": ("database_busy", "the database rolled the transaction back (conflict or deadlock)"),
    "53": ("database_unavailable", "the database lacks a resource"),
    "55": ("database_busy", "a database object is in use"),
    "57": ("database_unavailable", "the database is shutting down or starting"),
    "58": ("database_unavailable", "the database had a system error"),
    "XX": ("database_unavailable", "the database had an internal error"),
}
_DISK_FULL = ("No space left on device", "could not write", "could not extend file")


def condition_of(exc: BaseException) -> tuple[str, str] | None:
    """(code, what) of a database fault that is a condition of the database, else None."""
    state = getattr(exc, "sqlstate", None)
    if isinstance(exc, asyncpg.PostgresError) and isinstance(state, str):
        if state.startswith("XX") and any(text in str(exc) for text in _DISK_FULL):
            return CONDITIONS["53100"]  # e.g. `could not write init file` on a full disk
        return CONDITIONS.get(state) or CONDITIONS.get(state[:2])
    if isinstance(
        exc,
        asyncpg.exceptions.ConnectionDoesNotExistError
        | asyncpg.exceptions.InternalClientError
        | ConnectionError
        | OSError,
    ):
        return CONDITIONS["08"]
    if isinstance(exc, asyncpg.InterfaceError) and "connection is closed" in str(exc):
        # The connection went away under a call that was not reading from it (a transaction's
        # exit, a call on a connection already lost): asyncpg says so in this one class, whose
        # other members are misuse (a bug).
        return CONDITIONS["08"]
    return None


def _translate(exc: BaseException) -> BaseException:
    # Class 22, or 54000: a value it refuses, or one beyond a limit (an index row's size).
    state = getattr(exc, "sqlstate", None)
    if isinstance(exc, asyncpg.exceptions.DataError) or state == "54000":
        return Invalid(
            "the database cannot store a value of this request",
            code="value_not_storable",
            details={"sqlstate": state},
        )
    condition = condition_of(exc)
    if condition is None:
        return exc
    code, what = condition
    return Unavailable(what, code=code, details={"retryAfterSeconds": 1})


def _count_error(args: tuple[Any, ...], code: str) -> None:
    """Count a database error in the store whose method met it (`PgStore.errors`)."""
    errors = getattr(args[0], "errors", None) if args else None
    if isinstance(errors, Counter):
        errors[code] += 1


def _seam(fn: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Run an asyncio coroutine method from Trio, translating driver errors."""
    bridged = trio_asyncio.aio_as_trio(fn)

    async def call(*args: P.args, **kwargs: P.kwargs) -> T:
        # One Trio deadline per call: asyncpg's own command_timeout would arm a Trio deadline
        # for every asyncio callback inside trio-asyncio (measured: ~60 µs a query).
        try:
            with trio.fail_after(QUERY_TIMEOUT_SECONDS):
                return await bridged(*args, **kwargs)  # type: ignore[no-any-return]
        except trio.TooSlowError:
            _count_error(args, "database_timeout")
            raise Unavailable(
                "the database did not answer in time", code="database_timeout"
            ) from None
        except (
            asyncpg.PostgresError,
            OSError,
            asyncpg.InterfaceError,
            asyncpg.exceptions.InternalClientError,
        ) as exc:
            translated = _translate(exc)
            _count_error(args, getattr(translated, "code", None) or type(exc).__name__)
            if translated is exc:
                raise
            raise translated from None

    call.__name__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call


# The SQL handler of each kind of change (a function of migrations/): `CHANGE_KINDS`.
HANDLERS: dict[str, str] = {
    kind: spec.handler for kind, spec in CHANGE_KINDS.items() if spec.handler is not None
}


def _change_json(change: Change, idem: IdemKey | None) -> dict[str, Any]:
    item: dict[str, Any] = {
        "kind": change.kind,
        "handler": HANDLERS[change.kind],
        "subject": change.subject,
        "rows": change.rows,
        "event": change.event,
    }
    if change.also:
        item["also"] = [
            {"kind": a.kind, "subject": a.subject, "event": a.event} for a in change.also
        ]
    if idem is not None:
        item["idem"] = {
            "scope": idem.scope,
            "operation": idem.operation,
            "key": idem.key,
            "fingerprint": idem.fingerprint.hex(),
        }
    return item


def append_payload(items: list[tuple[Change, IdemKey | None]]) -> str:
    """The first argument of `append_changes` (migrations/functions/) for `items`, as JSON."""
    return json.dumps(
        [_change_json(change, idem) for change, idem in items],
        ensure_ascii=False,
        separators=(",", ":"),
    )


def _outcome(row: Any, idem: IdemKey | None) -> Outcome:
    """A row of `append_changes` or `record_refusal` as an outcome; a `replayed` row is the
    outcome standing under `idem`'s key, recorded for the request of the row's fingerprint."""
    refusal = row["refusal"]
    outcome = Outcome(
        row["seq"],
        row["result"],
        None if refusal is None else Refusal.from_json(json.loads(refusal)),
    )
    if row["replayed"]:
        assert idem is not None
        return standing_outcome(idem, bytes(row["fingerprint"]), outcome)
    return outcome


_RECORD_FIELDS = (
    "kind, id, entry_did, owner_did, status, version,"
    " (extract(epoch FROM expires_at) * 1000)::bigint AS expires_ms, created_seq, updated_seq"
)
_RECORD_COLUMNS = _RECORD_FIELDS + ", doc"


def _record(row: Any) -> RecordRow:
    return RecordRow(
        row["kind"],
        row["id"],
        row["entry_did"],
        row["owner_did"],
        row["status"],
        row["version"],
        row["expires_ms"],
        row["created_seq"],
        row["updated_seq"],
        row["doc"],
    )


# `_RECORD_COLUMNS`, with the document NULL (never read) once the page's earlier documents hold
# $6 bytes: the first record always comes.
_RECORD_COLUMNS_WITHIN_BUDGET = (
    f"{_RECORD_FIELDS}, CASE WHEN {bytes_before('doc', 'created_seq')} < $6 THEN doc END AS doc"
)
# The records a list asks for: of kind $1 (of entry $2, in status $3, created after $4), the
# first $5 by creation position.
_RECORDS_LISTED = (
    "FROM records WHERE kind = $1"
    " AND ($2::text IS NULL OR entry_did = $2) AND ($3::text IS NULL OR status = $3)"
    " AND ($4::bigint IS NULL OR created_seq > $4) ORDER BY created_seq LIMIT $5"
)

_INTENT_COLUMNS = (
    "i.intent_id, i.entry_did, i.sequence, i.operation, i.item_data_hash, i.state, i.attempts,"
    " epoch_ms(i.available_at) AS available_ms, epoch_ms(i.created_at) AS created_ms,"
    " epoch_ms(i.updated_at) AS updated_ms"
)
LEADERSHIP_POLL_SECONDS = 2.0
_MEMBERS_PAGE = 5_000  # batch members read per round trip


def _peer(row: Any) -> PeerRow:
    return PeerRow(row["peer_did"], row["cursor"], json.loads(row["status"]), row["quarantines"])


def _intent(row: Any, receipts: tuple[Receipt, ...]) -> IntentRow:
    return IntentRow(
        row["intent_id"],
        row["entry_did"],
        row["sequence"],
        row["operation"],
        row["item_data_hash"],
        row["state"],
        row["attempts"],
        row["available_ms"],
        row["created_ms"],
        row["updated_ms"],
        receipts,
    )


@_seam
async def _try_lock(conn: Any, name: str) -> bool:
    return bool(await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", name))


class PgLeadership:
    def __init__(self, lost: trio.Event) -> None:
        self._lost = lost

    async def lost(self) -> None:
        await self._lost.wait()
        raise Unavailable("the leadership connection was lost", code="database_unavailable")


def _checkpoint(row: Any) -> StoredCheckpoint:
    return StoredCheckpoint(
        row["tree_size"], bytes(row["root"]), row["note"], _ms(row["created_at"])
    )


def _ms(value: Any) -> int:
    return int(value.timestamp() * 1000)


# An entry's head: its served version, its first $2 unrevoked attestations unexpired now (read
# from the partial index of active attestations not lapsed, migration 0024, so the walk skips
# what the janitor has marked expired) and the anchor state of its head.
ENTRY_HEAD_SQL = (
    "SELECT e.head_seq, e.publisher_did, e.lifecycle, v.doc, a.expiries, a.attestations,"
    " (SELECT i.state FROM anchor_intents i WHERE i.sequence = e.head_seq) AS anchor_state"
    " FROM entries AS e"
    " JOIN entry_versions AS v ON v.seq = e.head_seq"
    " CROSS JOIN LATERAL ("
    "   SELECT coalesce(array_agg(t.expiry ORDER BY t.created_seq), '{}') AS expiries,"
    "          coalesce(array_agg(t.doc ORDER BY t.created_seq), '{}') AS attestations"
    "     FROM (SELECT r.created_seq, r.doc,"
    "                  (extract(epoch FROM r.expires_at) * 1000)::bigint AS expiry"
    "             FROM records r"
    "            WHERE r.kind = 'attestation' AND r.entry_did = $1 AND r.status = 'active'"
    "              AND NOT r.lapsed AND (r.expires_at IS NULL OR r.expires_at > now())"
    "            ORDER BY r.created_seq LIMIT $2) AS t) AS a"
    " WHERE e.entry_did = $1"
)

# The janitor's pass over attestations whose expiry has passed: each batch marks them lapsed
# (ENTRY_HEAD_SQL no longer walks them), skipping rows a writer holds; by row address, so the
# update is a TID scan whatever the planner thinks of the table.
LAPSE_BATCH = 500
LAPSE_ATTESTATIONS_SQL = (
    "UPDATE records SET lapsed = true WHERE ctid = ANY (ARRAY("
    " SELECT ctid FROM records"
    "  WHERE kind = 'attestation' AND status = 'active' AND NOT lapsed"
    "    AND expires_at IS NOT NULL AND expires_at <= now()"
    "  ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED))"
)


class PgStore:
    """The registry's PostgreSQL store. Open with `open_pg_store` inside a trio-asyncio loop."""

    def __init__(self, pool: LeanPool) -> None:
        self._pool = pool
        # Database errors met through this store, by the code they were translated to.
        self.errors: Counter[str] = Counter()

    # --- health ---------------------------------------------------------------------------

    def pool_statistics(self) -> dict[str, int]:
        return self._pool.statistics()

    def error_statistics(self) -> dict[str, int]:
        return dict(self.errors)

    @_seam
    async def live_processes(self) -> int:
        return int(
            await self._pool.fetchval(
                "SELECT count(DISTINCT application_name) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name LIKE 'registry %'"
            )
        )

    @_seam
    async def ping(self) -> None:
        await self._pool.fetchval("SELECT 1")

    @_seam
    async def write_condition(self) -> str | None:
        # A read-only primary (default_transaction_read_only, as a failover may leave one) or
        # a standby: transactions begin read-only. (A full disk shows only when a write fails.)
        read_only = await self._pool.fetchval(
            "SELECT current_setting('transaction_read_only') = 'on' OR pg_is_in_recovery()"
        )
        return "database_read_only" if read_only else None

    @_seam
    async def schema_version(self) -> int:
        value = await self._pool.fetchval("SELECT coalesce(max(version), 0) FROM schema_migrations")
        return int(value)

    # --- the one append path -------------------------------------------------------------

    @_seam
    async def append(self, items: list[tuple[Change, IdemKey | None]]) -> list[Outcome]:
        """Apply `items` in order in one statement and transaction (group commit); each
        outcome is the change's result and log position, its recorded replay, or its refusal
        (which wrote nothing and took no position)."""
        payload = append_payload(items)
        rows = await self._pool.fetch(
            "SELECT idx, seq, result, refusal::text AS refusal, replayed, fingerprint"
            " FROM append_changes($1::jsonb, $2)",
            payload,
            IDEMPOTENCY_WINDOW_MS,
        )
        outcomes: list[Outcome | None] = [None] * len(items)
        for row in rows:
            outcomes[row["idx"] - 1] = _outcome(row, items[row["idx"] - 1][1])
        assert all(o is not None for o in outcomes), "append_changes skipped an item"
        return outcomes  # type: ignore[return-value]

    @_seam
    async def record_refusal(self, idem: IdemKey, refusal: Refusal) -> Outcome:
        """Record `refusal` under `idem` unless the key has an outcome; return the one that
        stands (a different request's outcome is an idempotency conflict)."""
        row = await self._pool.fetchrow(
            "SELECT fingerprint, seq, result, refusal::text AS refusal, replayed"
            " FROM record_refusal($1, $2, $3, $4, $5::jsonb, $6)",
            idem.scope,
            idem.operation,
            idem.key,
            idem.fingerprint,
            json.dumps(refusal.to_json(), ensure_ascii=False),
            IDEMPOTENCY_WINDOW_MS,
        )
        assert row is not None
        return _outcome(row, idem)

    # --- entries --------------------------------------------------------------------------

    @_seam
    async def get_entry_head(
        self, entry_did: str, *, attestations: int = INLINE_ATTESTATIONS
    ) -> EntryHead | None:
        row = await self._pool.fetchrow(ENTRY_HEAD_SQL, entry_did, attestations)
        if row is None:
            return None
        return EntryHead(
            entry_did,
            row["head_seq"],
            row["publisher_did"],
            row["lifecycle"],
            row["doc"],
            tuple(zip(row["expiries"], row["attestations"], strict=True)),
            row["anchor_state"],
        )

    # --- anchoring ----------------------------------------------------------------------------

    @_seam
    async def anchor_intents_of(
        self, entry_did: str, *, after: tuple[int, int, str] | None, limit: int
    ) -> list[IntentRow]:
        seq, created, intent = after if after is not None else (None, None, None)
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                f"SELECT {_INTENT_COLUMNS} FROM anchor_intents i WHERE i.entry_did = $1"
                " AND ($2::bigint IS NULL OR (i.sequence, epoch_ms(i.created_at), i.intent_id)"
                "      > ($2, $3::bigint, $4::text))"
                " ORDER BY i.sequence, i.created_at, i.intent_id LIMIT $5",
                entry_did,
                seq,
                created,
                intent,
                limit,
            )
            receipts = await self._receipts(conn, [r["intent_id"] for r in rows])
        return [_intent(r, receipts.get(r["intent_id"], ())) for r in rows]

    @_seam
    async def get_anchor_intent(self, intent_id: str) -> IntentRow | None:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(
                f"SELECT {_INTENT_COLUMNS} FROM anchor_intents i WHERE i.intent_id = $1",
                intent_id,
            )
            if row is None:
                return None
            receipts = await self._receipts(conn, [intent_id])
        return _intent(row, receipts.get(intent_id, ()))

    @staticmethod
    async def _receipts(conn: Any, intent_ids: list[str]) -> dict[str, tuple[Receipt, ...]]:
        rows = await conn.fetch(
            "SELECT r.intent_id, r.batch_id, r.leaf_index, b.state, b.root, b.transaction_id,"
            " b.block_height, b.block_hash, epoch_ms(b.anchor_time) AS anchor_ms,"
            " epoch_ms(b.observed_at) AS observed_ms, epoch_ms(b.created_at) AS created_ms,"
            " t.leaves"
            " FROM anchor_receipts r JOIN anchor_batches b USING (batch_id)"
            " LEFT JOIN anchor_trees t USING (batch_id)"
            " WHERE r.intent_id = ANY($1::text[]) ORDER BY r.intent_id, r.batch_id",
            intent_ids,
        )
        out: dict[str, list[Receipt]] = {}
        for r in rows:
            out.setdefault(r["intent_id"], []).append(
                Receipt(
                    r["batch_id"],
                    r["leaf_index"],
                    r["state"],
                    r["root"],
                    r["transaction_id"],
                    r["block_height"],
                    r["block_hash"],
                    r["anchor_ms"],
                    r["observed_ms"],
                    r["created_ms"],
                    r["leaves"],
                )
            )
        return {k: tuple(v) for k, v in out.items()}

    @_seam
    async def anchor_batch_members(self, batch_id: int) -> list[Member]:
        # In pages along the receipts' (batch_id, leaf_index) index (leaf indexes are 0..n-1):
        # a batch holds up to 100,000 members, and decoding them in one go held the event loop
        # for ~0.5 s; between pages it serves everyone else.
        members: list[Member] = []
        while True:
            rows = await self._pool.fetch(
                "SELECT i.intent_id, i.entry_did, i.sequence, i.item_data_hash, i.attempts"
                " FROM anchor_receipts r JOIN anchor_intents i USING (intent_id)"
                " WHERE r.batch_id = $1 AND r.leaf_index >= $2 ORDER BY r.leaf_index LIMIT $3",
                batch_id,
                len(members),
                _MEMBERS_PAGE,
            )
            members.extend(Member(*r) for r in rows)
            if len(rows) < _MEMBERS_PAGE:
                return members

    @_seam
    async def open_anchor_batches(self) -> list[OpenBatch]:
        async with self._pool.acquire() as conn:
            batches = await conn.fetch(
                "SELECT batch_id, root, transaction_id FROM anchor_batches"
                " WHERE state IN ('claimed', 'submitted') ORDER BY batch_id"
            )
            out = []
            for b in batches:
                rows = await conn.fetch(
                    "SELECT i.intent_id, i.entry_did, i.sequence, i.item_data_hash, i.attempts,"
                    " CASE WHEN i.batch_id = r.batch_id THEN i.state ELSE 'moved' END AS state"
                    " FROM anchor_receipts r JOIN anchor_intents i USING (intent_id)"
                    " WHERE r.batch_id = $1 ORDER BY r.leaf_index",
                    b["batch_id"],
                )
                members = tuple((Member(*r[:5]), r["state"]) for r in rows)
                out.append(OpenBatch(b["batch_id"], b["root"], b["transaction_id"], members))
        return out

    @_seam
    async def anchoring_overview(self, recent: int) -> AnchoringOverview:
        async with self._pool.acquire() as conn:
            pending = await conn.fetchval("SELECT count(*) FROM anchor_queue")
            oldest = await conn.fetchval(
                "SELECT epoch_ms(i.created_at) FROM anchor_queue q"
                " JOIN anchor_intents i USING (intent_id) ORDER BY q.sequence LIMIT 1"
            )
            in_flight = await conn.fetchval(
                "SELECT count(*) FROM anchor_batches WHERE state IN ('claimed', 'submitted')"
            )
            rows = await conn.fetch(
                "SELECT b.batch_id, b.state, b.transaction_id, b.block_height,"
                " epoch_ms(b.anchor_time) AS anchor_ms,"
                " (SELECT count(*) FROM anchor_receipts r WHERE r.batch_id = b.batch_id) AS n"
                " FROM anchor_batches b ORDER BY b.batch_id DESC LIMIT $1",
                recent,
            )
        return AnchoringOverview(
            pending,
            oldest,
            in_flight,
            tuple(
                RecentBatch(
                    r["batch_id"],
                    r["state"],
                    r["transaction_id"],
                    r["block_height"],
                    r["anchor_ms"],
                    r["n"],
                )
                for r in rows
            ),
        )

    @_seam
    async def anchor_pending(self, available_at_ms: int) -> bool:
        return bool(
            await self._pool.fetchval(
                "SELECT EXISTS (SELECT 1 FROM anchor_queue"
                " WHERE available_at <= to_timestamp($1 / 1000.0))",
                available_at_ms,
            )
        )

    @_seam
    async def record_anchor_submission(
        self, batch_id: int, root: str, transaction_id: str, levels: bytes, leaves: int
    ) -> None:
        async with self._pool.acquire() as conn, conn.transaction():
            status = await conn.execute(
                "UPDATE anchor_batches SET root = $2, transaction_id = $3, state = 'submitted'"
                " WHERE batch_id = $1 AND state IN ('claimed', 'submitted')",
                batch_id,
                root,
                transaction_id,
            )
            if status.endswith(" 0"):
                return
            await conn.execute(
                "INSERT INTO anchor_trees (batch_id, leaves, levels) VALUES ($1, $2, $3)"
                " ON CONFLICT (batch_id) DO UPDATE"
                " SET leaves = EXCLUDED.leaves, levels = EXCLUDED.levels",
                batch_id,
                leaves,
                levels,
            )

    @_seam
    async def batches_without_tree(self, after: int, limit: int) -> list[tuple[int, str]]:
        rows = await self._pool.fetch(
            "SELECT b.batch_id, b.root FROM anchor_batches b"
            " WHERE b.batch_id > $1 AND b.root IS NOT NULL"
            "   AND NOT EXISTS (SELECT 1 FROM anchor_trees t WHERE t.batch_id = b.batch_id)"
            " ORDER BY b.batch_id LIMIT $2",
            after,
            limit,
        )
        return [(r["batch_id"], r["root"]) for r in rows]

    @_seam
    async def store_anchor_tree(self, batch_id: int, levels: bytes, leaves: int) -> None:
        await self._pool.execute(
            "INSERT INTO anchor_trees (batch_id, leaves, levels) VALUES ($1, $2, $3)"
            " ON CONFLICT (batch_id) DO NOTHING",
            batch_id,
            leaves,
            levels,
        )

    @_seam
    async def anchor_tree_slices(self, wanted: Sequence[tuple[int, int]]) -> list[bytes]:
        rows = await self._pool.fetch(
            "SELECT coalesce(substring(t.levels FROM x.off + 1 FOR $3::integer), '') AS node"
            " FROM unnest($1::bigint[], $2::integer[]) WITH ORDINALITY AS x(batch_id, off, n)"
            " LEFT JOIN anchor_trees t USING (batch_id) ORDER BY x.n",
            [batch for batch, _ in wanted],
            [offset for _, offset in wanted],
            NODE_BYTES,
        )
        return [bytes(r["node"]) for r in rows]

    @asynccontextmanager
    async def leadership(self, name: str) -> AsyncIterator[PgLeadership]:
        """Hold `pg_advisory_lock` of `name` on a connection of its own while inside (one
        holder per database); waits, polling, until it is free."""
        conn = await _listening_connection(self._pool, (), Notifications())
        lost = trio.Event()

        def terminated(_conn: Any) -> None:
            lost.set()

        conn.add_termination_listener(terminated)
        try:
            while not await _try_lock(conn, name):  # noqa: ASYNC110 (an advisory lock: poll)
                await trio.sleep(LEADERSHIP_POLL_SECONDS)
            yield PgLeadership(lost)
        finally:
            conn.remove_termination_listener(terminated)
            self._pool.discard(conn)  # closing the session releases the lock

    # --- trust and ownership records ------------------------------------------------------

    @_seam
    async def get_record(self, kind: str, record_id: str) -> RecordRow | None:
        row = await self._pool.fetchrow(
            f"SELECT {_RECORD_COLUMNS} FROM records WHERE kind = $1 AND id = $2", kind, record_id
        )
        return None if row is None else _record(row)

    @_seam
    async def list_records(
        self,
        kind: str,
        *,
        entry_did: str | None = None,
        status: str | None = None,
        after_seq: int | None = None,
        limit: int = 100,
    ) -> list[RecordRow]:
        rows = await self._pool.fetch(
            f"SELECT {_RECORD_COLUMNS} {_RECORDS_LISTED}",
            kind,
            entry_did,
            status,
            after_seq,
            limit,
        )
        return [_record(r) for r in rows]

    @_seam
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
        # The window over the page's rows only: over the whole filter, the reports of every
        # status would all be sorted (no index orders one kind alone), documents and all.
        rows = await self._pool.fetch(
            f"SELECT {_RECORD_COLUMNS_WITHIN_BUDGET}"
            f" FROM (SELECT * {_RECORDS_LISTED}) AS page ORDER BY created_seq",
            kind,
            entry_did,
            status,
            after_seq,
            limit,
            page_bytes,
        )
        page: list[RecordRow] = []
        for row in rows:
            if row["doc"] is None:  # past the budget: not read
                return page, True
            page.append(_record(row))
        return page, False

    @_seam
    async def change_versions(
        self, changes: list[tuple[int, str]], texts: list[str]
    ) -> dict[int, list[tuple[str, list[str]]]]:
        """For each change (sequence, entry DID): the entry's stored documents just before and
        at that version (one for a new entry), oldest first, each with those of the full-text
        `texts` it matches (by the projection discovery searches). One round trip."""
        rows = await self._pool.fetch(
            # Each text parsed once, not once per document (parsing is most of the cost).
            "WITH q AS MATERIALIZED (SELECT t, websearch_to_tsquery('english', t) AS q"
            "  FROM unnest($3::text[]) AS t)"
            " SELECT c.seq AS change, v.doc,"
            " ARRAY(SELECT q.t FROM q WHERE p.search @@ q.q) AS matched"
            " FROM unnest($1::bigint[], $2::text[]) AS c(seq, did),"
            " LATERAL (SELECT x.seq, x.doc FROM entry_versions AS x"
            "          WHERE x.entry_did = c.did AND x.seq <= c.seq"
            "          ORDER BY x.seq DESC LIMIT 2) AS v,"
            " LATERAL entry_projection(v.doc) AS p"
            " ORDER BY c.seq, v.seq",
            [seq for seq, _ in changes],
            [did for _, did in changes],
            texts,
        )
        out: dict[int, list[tuple[str, list[str]]]] = {}
        for r in rows:
            out.setdefault(r["change"], []).append((r["doc"], list(r["matched"])))
        return out

    @_seam
    async def list_versions(
        self, entry_did: str, before_seq: int | None, limit: int, page_bytes: int
    ) -> tuple[list[str | None], int]:
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                f"SELECT {_within_page_bytes('seq', '$4')} AS doc"
                " FROM entry_versions WHERE entry_did = $1 AND lifecycle <> 'deleted'"
                " AND ($2::bigint IS NULL OR seq < $2) ORDER BY seq DESC LIMIT $3",
                entry_did,
                before_seq,
                limit,
                page_bytes,
            )
            total = await conn.fetchval(
                "SELECT count(*) FROM entry_versions"
                " WHERE entry_did = $1 AND lifecycle <> 'deleted'",
                entry_did,
            )
        return [r["doc"] for r in rows], int(total)

    @_seam
    async def anchor_states(self, entry_did: str, sequences: list[int]) -> dict[int, str]:
        rows = await self._pool.fetch(
            "SELECT sequence, state FROM anchor_intents"
            " WHERE entry_did = $1 AND sequence = ANY($2::bigint[])",
            entry_did,
            sequences,
        )
        return {int(r["sequence"]): str(r["state"]) for r in rows}

    @_seam
    async def version_labelled(self, entry_did: str, version: str) -> tuple[int, str] | None:
        # The label column (migration 0023); versions written before it are parsed.
        row = await self._pool.fetchrow(
            "SELECT seq, doc FROM entry_versions WHERE entry_did = $1 AND lifecycle <> 'deleted'"
            " AND (version = $2 OR version IS NULL AND doc::jsonb ->> 'version' = $2)"
            " ORDER BY seq LIMIT 1",
            entry_did,
            version,
        )
        return None if row is None else (int(row["seq"]), str(row["doc"]))

    @_seam
    async def get_version(self, entry_did: str, seq: int) -> str | None:
        value = await self._pool.fetchval(
            "SELECT doc FROM entry_versions WHERE entry_did = $1 AND seq = $2"
            " AND lifecycle <> 'deleted'",
            entry_did,
            seq,
        )
        return None if value is None else str(value)

    # --- discovery ------------------------------------------------------------------------

    async def discover(
        self,
        query: RegistryQuery,
        *,
        limit: int,
        after: list[Any] | None,
        page_bytes: int | None = None,
    ) -> tuple[list[tuple[str | None, list[Any]]], int]:
        """One page (doc, sort values) and the (capped) count: one statement, one snapshot."""
        plan = compile_discover(query, limit=limit, after=after, page_bytes=page_bytes)
        return await self.run_plan(plan)

    @_seam
    async def run_plan(self, plan: Plan) -> tuple[list[tuple[str | None, list[Any]]], int]:
        """Run a compiled discovery plan (registry.store.discover); its time once it holds a
        connection goes to the request's meter (registry.metering)."""
        async with self._pool.acquire() as conn:
            with timed_statement():
                rows = await conn.fetch(plan.sql, *plan.params)
        keys = [n for n in rows[0].keys() if n.startswith("k")]  # noqa: SIM118 (a Record iterates values)
        # No entry_did: no match at all (the count's row alone).
        page = [(r["doc"], [r[k] for k in keys]) for r in rows if r["entry_did"] is not None]
        return page, int(rows[0]["total"])

    # --- sign-in --------------------------------------------------------------------------

    @_seam
    async def put_challenge(self, nonce: str, challenge: dict[str, Any], expires_ms: int) -> None:
        await self._pool.execute(
            "WITH gc AS (DELETE FROM challenges WHERE expires_at < now() - interval '1 hour')"
            " INSERT INTO challenges (nonce, challenge, expires_at)"
            " VALUES ($1, $2::jsonb, to_timestamp($3 / 1000.0))",
            nonce,
            json.dumps(challenge),
            expires_ms,
        )

    @_seam
    async def get_challenge(self, nonce: str) -> dict[str, Any] | None:
        value = await self._pool.fetchval(
            "SELECT challenge FROM challenges WHERE nonce = $1", nonce
        )
        return None if value is None else dict(json.loads(value))

    @_seam
    async def open_session(self, nonce: str, token_hash: bytes, session: SessionRecord) -> bool:
        """Burn the challenge and open the session atomically; False if it was already used."""
        async with self._pool.acquire() as conn, conn.transaction():
            burnt = await conn.fetchval(
                "DELETE FROM challenges WHERE nonce = $1 RETURNING 1", nonce
            )
            if burnt is None:
                return False
            await conn.execute(
                "INSERT INTO sessions (token_hash, principal, hmr_did, root_did, root_kind,"
                " capabilities, expires_at) VALUES ($1,$2,$3,$4,$5,$6, to_timestamp($7 / 1000.0))",
                token_hash,
                session.principal,
                session.hmr_did,
                session.root_did,
                session.root_kind,
                list(session.capabilities),
                session.expires_at_ms,
            )
        return True

    @_seam
    async def get_session(self, token_hash: bytes) -> SessionRecord | None:
        row = await self._pool.fetchrow(
            "SELECT principal, hmr_did, root_did, root_kind, capabilities, expires_at"
            " FROM sessions WHERE token_hash = $1 AND revoked_at IS NULL AND expires_at > now()",
            token_hash,
        )
        if row is None:
            return None
        return SessionRecord(
            row["principal"],
            row["hmr_did"],
            row["root_did"],
            row["root_kind"],
            tuple(row["capabilities"]),
            _ms(row["expires_at"]),
        )

    @_seam
    async def purge_expired(self) -> dict[str, int]:
        """Delete expired idempotency records, sessions, challenges and nonces."""
        counts: dict[str, int] = {}
        statements = {
            "idempotency": "DELETE FROM idempotency"
            f" WHERE created_at < now() - {IDEMPOTENCY_WINDOW_MS} * interval '1 millisecond'",
            "sessions": "DELETE FROM sessions WHERE expires_at < now() - interval '1 day'",
            "challenges": "DELETE FROM challenges WHERE expires_at < now()",
            "nonces": "DELETE FROM federation_nonces WHERE expires_ms <= epoch_ms(now())",
        }
        async with self._pool.acquire() as conn:
            for name, sql in statements.items():
                status = await conn.execute(sql)
                counts[name] = int(status.rsplit(" ", 1)[-1])
        return {k: v for k, v in counts.items() if v}

    @_seam
    async def lapse_attestations(self) -> int:
        lapsed = 0
        async with self._pool.acquire() as conn:
            while True:  # in small batches: a writer may wait for a row the batch holds
                status = await conn.execute(LAPSE_ATTESTATIONS_SQL, LAPSE_BATCH)
                marked = int(status.rsplit(" ", 1)[-1])
                lapsed += marked
                if marked < LAPSE_BATCH:
                    return lapsed

    @_seam
    async def vacuum_records(self) -> None:
        async with self._pool.acquire() as conn:
            try:  # INDEX_CLEANUP ON: PostgreSQL 14+ may skip the indexes when few rows are dead
                await conn.execute("VACUUM (ANALYZE, INDEX_CLEANUP ON) records")
            except asyncpg.PostgresSyntaxError:  # before PostgreSQL 12
                await conn.execute("VACUUM ANALYZE records")

    # --- federation -----------------------------------------------------------------------

    @_seam
    async def sync_page(
        self, after_seq: int, limit: int, max_bytes: int
    ) -> tuple[list[tuple[int, str]], int, bool]:
        rows = await self._pool.fetch(
            "SELECT h.seq AS head, t.seq, t.doc, t.n FROM log_head AS h LEFT JOIN LATERAL ("
            "  SELECT s.seq, s.doc, s.n FROM ("
            "    SELECT v.seq, v.doc, sum(octet_length(v.doc)) OVER w AS run,"
            "           row_number() OVER w AS rn, count(*) OVER () AS n"
            "      FROM (SELECT seq, doc FROM entry_versions"
            "             WHERE seq > $1 AND seq <= h.seq ORDER BY seq LIMIT $2 + 1) AS v"
            "    WINDOW w AS (ORDER BY v.seq)) AS s"
            "   WHERE s.rn <= $2 AND s.run - octet_length(s.doc) < $3 ORDER BY s.seq) AS t ON true"
            " WHERE h.id = 1",
            after_seq,
            limit,
            max_bytes,
        )
        head = int(rows[0]["head"]) if rows else 0
        page = [(r["seq"], r["doc"]) for r in rows if r["seq"] is not None]
        more = bool(page) and int(rows[0]["n"]) > len(page)
        return page, head, more

    @_seam
    async def burn_nonce(self, sender_did: str, nonce: str, expires_ms: int) -> bool:
        status = await self._pool.execute(
            "INSERT INTO federation_nonces (sender_did, nonce, expires_ms) VALUES ($1, $2, $3)"
            " ON CONFLICT (sender_did, nonce) DO UPDATE SET expires_ms = EXCLUDED.expires_ms"
            " WHERE federation_nonces.expires_ms <= epoch_ms(now())",
            sender_did,
            nonce,
            expires_ms,
        )
        return bool(status.endswith(" 1"))

    @_seam
    async def get_peer(self, peer_did: str) -> PeerRow | None:
        row = await self._pool.fetchrow(
            "SELECT peer_did, cursor, status::text AS status, quarantines FROM federation_peers"
            " WHERE peer_did = $1",
            peer_did,
        )
        return None if row is None else _peer(row)

    @_seam
    async def list_peers(self) -> list[PeerRow]:
        rows = await self._pool.fetch(
            "SELECT peer_did, cursor, status::text AS status, quarantines FROM federation_peers"
            " ORDER BY peer_did"
        )
        return [_peer(r) for r in rows]

    @_seam
    async def quarantined(self, peer_did: str, limit: int) -> list[Quarantined]:
        rows = await self._pool.fetch(
            "SELECT origin_seq, entry_did, code, reason FROM replica_quarantine"
            " WHERE origin_did = $1 ORDER BY origin_seq DESC LIMIT $2",
            peer_did,
            limit,
        )
        return [Quarantined(*r) for r in rows]

    @_seam
    async def replica_head(self, entry_did: str) -> ReplicaVersion | None:
        row = await self._pool.fetchrow(
            "SELECT origin_did, origin_seq, lifecycle, doc FROM replica_versions"
            " WHERE entry_did = $1 ORDER BY synced_seq DESC, origin_seq DESC LIMIT 1",
            entry_did,
        )
        if row is None:
            return None
        return ReplicaVersion(row["origin_did"], row["origin_seq"], row["lifecycle"], row["doc"])

    @_seam
    async def replica_versions(
        self, entry_did: str, origin_did: str, before_seq: int | None, limit: int, page_bytes: int
    ) -> tuple[list[str | None], int]:
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                f"SELECT {_within_page_bytes('origin_seq', '$5')} AS doc"
                " FROM replica_versions WHERE entry_did = $1 AND origin_did = $2"
                " AND lifecycle <> 'deleted' AND ($3::bigint IS NULL OR origin_seq < $3)"
                " ORDER BY origin_seq DESC LIMIT $4",
                entry_did,
                origin_did,
                before_seq,
                limit,
                page_bytes,
            )
            total = await conn.fetchval(
                "SELECT count(*) FROM replica_versions WHERE entry_did = $1 AND origin_did = $2"
                " AND lifecycle <> 'deleted'",
                entry_did,
                origin_did,
            )
        return [r["doc"] for r in rows], int(total)

    @_seam
    async def replica_version(self, entry_did: str, origin_did: str, seq: int) -> str | None:
        value = await self._pool.fetchval(
            "SELECT doc FROM replica_versions WHERE origin_did = $1 AND origin_seq = $2"
            " AND entry_did = $3 AND lifecycle <> 'deleted'",
            origin_did,
            seq,
            entry_did,
        )
        return None if value is None else str(value)

    # --- the log --------------------------------------------------------------------------

    @_seam
    async def log_after(self, after_seq: int, limit: int) -> list[LogRecord]:
        """Log records after `after_seq`; a replay's page is paid from its client address's
        database time (registry.metering)."""
        async with self._pool.acquire() as conn:
            with timed_statement():
                rows = await conn.fetch(
                    "SELECT seq, kind, entry_did, at, data FROM log WHERE seq > $1"
                    " ORDER BY seq LIMIT $2",
                    after_seq,
                    limit,
                )
        return [
            LogRecord(r["seq"], r["kind"], r["entry_did"], _ms(r["at"]), json.loads(r["data"]))
            for r in rows
        ]

    @_seam
    async def log_head(self) -> int:
        return int(await self._pool.fetchval("SELECT seq FROM log_head WHERE id = 1"))

    # --- the verifiable log (migration 0017) -----------------------------------------------

    async def log_records(self, after_seq: int, limit: int) -> list[tuple[LogRecord, str | None]]:
        records, _ = await self.log_records_within(after_seq, limit, None)
        return records

    @_seam
    async def log_records_within(
        self, after_seq: int, limit: int, page_bytes: int | None
    ) -> tuple[list[tuple[LogRecord, str | None]], bool]:
        rows = await self._pool.fetch(LOG_RECORDS_SQL, after_seq, limit, page_bytes)
        records: list[tuple[LogRecord, str | None]] = []
        for r in rows:
            if r["past"]:
                return records, True
            record = LogRecord(
                r["seq"], r["kind"], r["entry_did"], _ms(r["at"]), json.loads(r["data"])
            )
            records.append((record, r["document_hash"]))
        return records, False

    @_seam
    async def tree_tiles(self, keys: Collection[TileKey]) -> dict[TileKey, bytes]:
        if not keys:
            return {}
        levels, indexes = zip(*keys, strict=True)
        rows = await self._pool.fetch(
            "SELECT t.level, t.idx, t.hashes FROM log_tiles t"
            " JOIN unnest($1::smallint[], $2::bigint[]) AS k(level, idx)"
            "   ON t.level = k.level AND t.idx = k.idx",
            list(levels),
            list(indexes),
        )
        return {(r["level"], r["idx"]): bytes(r["hashes"]) for r in rows}

    @_seam
    async def latest_checkpoint(self) -> StoredCheckpoint | None:
        row = await self._pool.fetchrow(
            "SELECT tree_size, root, note, created_at FROM log_checkpoints"
            " ORDER BY tree_size DESC LIMIT 1"
        )
        return None if row is None else _checkpoint(row)

    @_seam
    async def checkpoint_of_size(self, size: int) -> StoredCheckpoint | None:
        row = await self._pool.fetchrow(
            "SELECT tree_size, root, note, created_at FROM log_checkpoints WHERE tree_size = $1",
            size,
        )
        return None if row is None else _checkpoint(row)

    @_seam
    async def store_checkpoint(
        self, tiles: Mapping[TileKey, bytes], checkpoint: StoredCheckpoint
    ) -> bool:
        async with self._pool.acquire() as conn, conn.transaction():
            # One writer at a time, whoever holds the leadership: a stale leader finds the
            # newer checkpoint and writes nothing (tiles are a function of the log anyway).
            await conn.execute("LOCK TABLE log_checkpoints IN SHARE ROW EXCLUSIVE MODE")
            newest = await conn.fetchval("SELECT max(tree_size) FROM log_checkpoints")
            if newest is not None and newest >= checkpoint.size:
                return False
            if tiles:
                levels, indexes = zip(*tiles, strict=True)
                await conn.execute(
                    "INSERT INTO log_tiles (level, idx, hashes)"
                    " SELECT * FROM unnest($1::smallint[], $2::bigint[], $3::bytea[])"
                    " ON CONFLICT (level, idx) DO UPDATE SET hashes = EXCLUDED.hashes"
                    " WHERE octet_length(EXCLUDED.hashes) > octet_length(log_tiles.hashes)",
                    list(levels),
                    list(indexes),
                    list(tiles.values()),
                )
            await conn.execute(
                "INSERT INTO log_checkpoints (tree_size, root, note) VALUES ($1, $2, $3)",
                checkpoint.size,
                checkpoint.root,
                checkpoint.note,
            )
        return True

    # --- witnessing (migration 0018) --------------------------------------------------------

    @_seam
    async def peer_checkpoints(self) -> dict[str, WitnessRow]:
        rows = await self._pool.fetch(
            "SELECT peer_did, origin, tree_size, root, note, fork FROM peer_checkpoints"
        )
        return {
            r["peer_did"]: WitnessRow(
                Witnessed(r["origin"], r["tree_size"], bytes(r["root"]), r["note"]),
                None if r["fork"] is None else json.loads(r["fork"]),
            )
            for r in rows
        }

    @_seam
    async def accept_peer_checkpoint(self, peer_did: str, accepted: Witnessed) -> None:
        await self._pool.execute(
            "INSERT INTO peer_checkpoints (peer_did, origin, tree_size, root, note)"
            " VALUES ($1, $2, $3, $4, $5)"
            " ON CONFLICT (peer_did) DO UPDATE SET origin = EXCLUDED.origin,"
            "   tree_size = EXCLUDED.tree_size, root = EXCLUDED.root, note = EXCLUDED.note,"
            "   updated_at = now()"
            " WHERE peer_checkpoints.tree_size <= EXCLUDED.tree_size",
            peer_did,
            accepted.origin,
            accepted.size,
            accepted.root,
            accepted.note,
        )

    @_seam
    async def record_fork(self, peer_did: str, fork: Fork) -> None:
        evidence = {"reason": fork.reason, "detail": fork.detail, **fork.evidence}
        await self._pool.execute(
            "UPDATE peer_checkpoints SET fork = $2::jsonb, updated_at = now()"
            " WHERE peer_did = $1 AND fork IS NULL",
            peer_did,
            json.dumps(evidence),
        )

    @_seam
    async def add_cosignature(self, tree_size: int, witness: str, line: str) -> bool:
        status = await self._pool.execute(
            "INSERT INTO log_cosignatures (tree_size, witness, line)"
            " SELECT $1, $2, $3 WHERE EXISTS"
            "   (SELECT 1 FROM log_checkpoints WHERE tree_size = $1)"
            " ON CONFLICT (tree_size, witness) DO UPDATE SET line = EXCLUDED.line",
            tree_size,
            witness,
            line,
        )
        return status != "INSERT 0 0"

    @_seam
    async def cosignatures(self, tree_size: int) -> list[str]:
        rows = await self._pool.fetch(
            "SELECT line FROM log_cosignatures WHERE tree_size = $1 ORDER BY witness", tree_size
        )
        return [r["line"] for r in rows]

    # --- notifications --------------------------------------------------------------------

    @asynccontextmanager
    async def listen_log(self) -> AsyncIterator[LogWakeups]:
        """Wake-ups whenever a batch of changes commits (in any process on this database);
        between two waits the connection is not read (`Notifications`, `hold`)."""
        async with self.listen("registry_log", hold=True) as notes:
            yield notes

    @asynccontextmanager
    async def listen(self, *channels: str, hold: bool = False) -> AsyncIterator[Notifications]:
        """Receive NOTIFY payloads of `channels` on a dedicated connection while inside."""
        notes = Notifications(hold=hold)
        conn = await _listening_connection(self._pool, channels, notes)
        try:
            yield notes
        finally:
            # Closed rather than given back: a LISTEN (or its cancellation) may still be in
            # flight, and a session left listening must not serve requests.
            conn.remove_termination_listener(notes.terminated)
            self._pool.discard(conn)


@_seam
async def _listening_connection(
    pool: LeanPool, channels: tuple[str, ...], notes: Notifications
) -> asyncpg.Connection:
    """A connection of its own listening on `channels`; through the seam, so a refused or slow
    (re)connect is `Unavailable` within the deadline, like any other store call."""
    conn = await pool.take(lasting=True)
    try:
        conn.add_termination_listener(notes.terminated)
        for channel in channels:
            await conn.add_listener(channel, notes.push)
        notes.read_through(conn)
    except BaseException:
        conn.remove_termination_listener(notes.terminated)
        pool.discard(conn)
        raise
    return conn


class Notifications:
    """A bounded buffer of NOTIFY payloads; overflow is reported, never silently dropped.

    With `hold`, the listening connection is not read from a notification until a `receive()`
    finds nothing at hand (asyncio's flow control: its transport's `pause_reading`): what
    PostgreSQL sends meanwhile waits in the socket, and is taken in one read. Every batch
    that commits anywhere sends every listening process a notification, and each one read
    on its own cost a process 150–370 µs of CPU (the trio-asyncio hops of a socket read;
    bench/README.md, "Following the log"); a reader that waits at most once per interval
    (the log actor) pays that once per interval, however many processes write. Over TLS (a
    remote server with ssl on) asyncio's TLS transport holds only the decrypted data and
    keeps reading the socket, so there the holding saves asyncpg's work, not the reads."""

    LIMIT = 10_000

    def __init__(self, *, hold: bool = False) -> None:
        self._pending: list[tuple[str, str]] = []
        self._lost = False
        self._closed = False
        self._wake = trio.Event()
        self._hold = hold
        self._transport: Any = None  # the listening connection's, once `read_through` found it
        self.held = False  # reading is paused until a receive() finds nothing at hand

    def read_through(self, conn: Any) -> None:
        """Hold reads of `conn` between receives (when asked to, and where its transport has
        asyncio's flow control; asyncpg keeps it in `_transport`)."""
        transport = getattr(conn, "_transport", None)
        if self._hold and hasattr(transport, "pause_reading"):
            self._transport = transport

    def terminated(self, _conn: object) -> None:
        """The listening connection is gone: whatever was sent since is lost."""
        self._closed = True
        self._wake.set()

    def push(self, _conn: object, _pid: int, channel: str, payload: str) -> None:
        if len(self._pending) >= self.LIMIT:
            self._lost = True
            self._pending.clear()
        else:
            self._pending.append((channel, payload))
        self._wake.set()
        if self._transport is not None and not self.held:
            self.held = True
            self._transport.pause_reading()

    async def wait(self) -> None:
        """Return when something was notified (lost notifications included: the log is read
        anyway); raise `Unavailable` once the listening connection has terminated."""
        await self.receive()

    async def receive(self) -> list[tuple[str, str]] | None:
        """The next batch of (channel, payload), or None when some were lost (start over).

        Raises `Unavailable` once the listening connection has terminated."""
        if self.held and not self._wake.is_set():
            # Nothing at hand: read what came meanwhile, now, and wait for more.
            self.held = False
            self._transport.resume_reading()
        await self._wake.wait()
        if self._closed:
            raise Unavailable("the notification connection was lost", code="database_unavailable")
        self._wake = trio.Event()
        batch, self._pending = self._pending, []
        if self._lost:
            self._lost = False
            return None
        return batch


# --- reads from a streaming replica (registry/store/routing.py) -------------------------------


def _from_replica(
    method: Callable[P, Coroutine[Any, Any, T]],
) -> Callable[P, Coroutine[Any, Any, T]]:
    """`PgStore.method`, answered by the replica when `routing` allows it: in a task that set
    `READ_FLOOR` (a GET)."""

    async def call(*args: P.args, **kwargs: P.kwargs) -> T:
        store = args[0]
        assert isinstance(store, RoutedPgStore)
        return await store.read(method, READ_FLOOR.get(), args, kwargs)

    call.__name__ = method.__name__
    call.__doc__ = method.__doc__
    return call


class RoutedPgStore(PgStore):
    """The store of a process with a read replica: writes, decisions and everything written
    outside the append path on the primary; reads that may lag on the replica while it has
    replayed all this process has written or seen (registry/store/routing.py)."""

    def __init__(self, pool: LeanPool, replica: PgStore, *, poll_seconds: float) -> None:
        super().__init__(pool)
        self._replica = replica
        self._poll_seconds = poll_seconds
        self.replica_state = ReplicaState()
        # One WARNING when the replica fails, then one a minute while it lasts, and the recovery.
        self._replica_outage = ConditionLog("the read replica", every=60.0)

    def replica_pool_statistics(self) -> dict[str, int]:
        return self._replica.pool_statistics()

    async def read(
        self,
        method: Callable[..., Coroutine[Any, Any, T]],
        floor: int | None,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
    ) -> T:
        state = self.replica_state
        if not ON_PRIMARY.get() and state.serves(floor, trio.current_time()):
            try:
                with trio.fail_after(REPLICA_DEADLINE_SECONDS):
                    result = await method(self._replica, *args[1:], **kwargs)
            except (Unavailable, asyncpg.PostgresError, trio.TooSlowError) as exc:
                # A lost connection, a replica that hangs, a statement its recovery cancelled,
                # a migration it has not replayed: the primary answers, and a replica that
                # cannot be reached, read or that does not answer in time is left alone a while.
                state.failures += 1
                if not isinstance(exc, Unavailable) or exc.code != "database_busy":
                    self._replica_down(exc)
            else:
                state.reads["replica"] += 1
                return result
        # The rest of this request reads the primary too, whether the replica failed or had
        # not replayed enough (a poll may find it caught up before the next read): a newer
        # state, then an older one (an entry's head, then none of its versions) would not fit
        # together. (Its floor stays: the caches answer it only once the log reaches it. A
        # task with no floor is no GET: an actor's `log_after` tries the replica each time.)
        if READ_FLOOR.get() is not None:
            ON_PRIMARY.set(True)
        state.reads["primary"] += 1
        return await method(self, *args[1:], **kwargs)

    def _replica_down(self, exc: BaseException | str) -> None:
        state = self.replica_state
        now = trio.current_time()
        condition = exc if isinstance(exc, str) else "cannot be reached"
        line = self._replica_outage.failed(condition, now)
        if line is not None:
            if self._replica_outage.failures == 1:
                what = "" if isinstance(exc, str) else f" ({exc})"
                log.warning(
                    "the read replica %s%s; reads go to the primary, retried in %.0f s",
                    condition,
                    what,
                    RETRY_SECONDS,
                )
            else:
                log.warning("%s", line)
        state.down_until = now + RETRY_SECONDS
        state.replayed = -1

    async def refresh_replica(self) -> None:
        """Read how far the replica has replayed the log (its `log_head` row), and every
        PRIMARY_HEAD_SECONDS how far the primary has."""
        state = self.replica_state
        now = trio.current_time()
        if now - state.primary_read_at >= PRIMARY_HEAD_SECONDS:
            try:
                state.primary = await PgStore.log_head(self)
                state.primary_read_at = now
            except Unavailable:
                pass  # the primary's own faults show elsewhere (health, the actors)
        if now < state.down_until:
            return
        try:
            with trio.fail_after(REPLICA_DEADLINE_SECONDS):
                replayed = await PgStore.log_head(self._replica)
        except (Unavailable, asyncpg.PostgresError, trio.TooSlowError) as exc:
            self._replica_down(exc)
            return
        known = state.replayed >= 0
        if not state.replayed_to(replayed, now):
            self._replica_down("has stopped replaying the log")
            return
        if not known:
            log.info("the read replica has replayed the log to %d", replayed)
            line = self._replica_outage.succeeded(now)
            if line is not None:
                log.info("%s", line)

    # What this process wrote, a replica must have before it answers; and where the log
    # actor starts (its caches are dropped from there on), too.
    async def append(self, items: list[tuple[Change, IdemKey | None]]) -> list[Outcome]:
        outcomes = await super().append(items)
        self.replica_state.saw(max((o.sequence or 0 for o in outcomes), default=0))
        return outcomes

    async def record_refusal(self, idem: IdemKey, refusal: Refusal) -> Outcome:
        outcome = await super().record_refusal(idem, refusal)
        self.replica_state.saw(outcome.sequence or 0)  # a replayed success has its position
        return outcome

    async def log_head(self) -> int:
        head = await super().log_head()
        self.replica_state.saw(head)
        return head

    # Reads of what only the append path writes (every row carries its log position).
    get_entry_head = _from_replica(PgStore.get_entry_head)
    list_versions = _from_replica(PgStore.list_versions)
    get_version = _from_replica(PgStore.get_version)
    anchor_states = _from_replica(PgStore.anchor_states)
    version_labelled = _from_replica(PgStore.version_labelled)
    run_plan = _from_replica(PgStore.run_plan)
    get_record = _from_replica(PgStore.get_record)
    list_records = _from_replica(PgStore.list_records)
    list_records_page = _from_replica(PgStore.list_records_page)
    replica_head = _from_replica(PgStore.replica_head)
    replica_versions = _from_replica(PgStore.replica_versions)
    replica_version = _from_replica(PgStore.replica_version)

    async def log_after(self, after_seq: int, limit: int) -> list[LogRecord]:
        # The log may always lag (events follow the replica), in any task.
        floor = READ_FLOOR.get()
        records = await self.read(
            PgStore.log_after, 0 if floor is None else floor, (self, after_seq, limit), {}
        )
        if records:
            self.replica_state.saw(records[-1].seq)
        return records

    @asynccontextmanager
    async def listen_log(self) -> AsyncIterator[LogWakeups]:
        """Wake-ups every `poll_seconds`, once the replica's replayed head is read again: a
        replica refuses LISTEN, so the log is followed by polling."""
        yield ReplicaPoll(self, self._poll_seconds)


class ReplicaPoll:
    """The log actor's wake-ups on a process with a read replica (no LISTEN)."""

    def __init__(self, store: RoutedPgStore, seconds: float) -> None:
        self._store = store
        self._seconds = seconds

    async def wait(self) -> None:
        # Refreshed first: a poll that is cancelled while it sleeps (the log actor's own
        # `events.poll_seconds`) has still read the replica's head.
        await self._store.refresh_replica()
        await trio.sleep(self._seconds)


def _lean_pool(dsn: str, *, min_size: int, max_size: int, name: str) -> LeanPool:
    return LeanPool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        server_settings={**SESSION_SETTINGS, "application_name": name},
        settings_since=SESSION_SETTINGS_SINCE,
    )


@asynccontextmanager
async def open_pg_store(
    dsn: str,
    *,
    min_size: int = 2,
    max_size: int = 10,
    read_dsn: str = "",
    read_poll_seconds: float = 0.05,
) -> AsyncIterator[PgStore]:
    """A connection pool for the duration of the block. Needs a running trio-asyncio loop.

    Its connections carry `application_name` `registry <token>`, one token per process: the
    processes serving from one database count each other by it (`live_processes`). The replica
    pool's carry the same one, so a `read_dsn` that reaches the primary too (a promoted replica
    named by both URLs) does not count the process twice.
    With `read_dsn` (a streaming replica of `dsn`) a `RoutedPgStore`: its pool connects on
    demand, so a replica that is down at start only sends the reads to the primary."""

    name = f"registry {secrets.token_hex(6)}"
    pool = _lean_pool(dsn, min_size=min_size, max_size=max_size, name=name)
    try:
        with trio.fail_after(QUERY_TIMEOUT_SECONDS):
            await trio_asyncio.aio_as_trio(pool.open)()
    except (OSError, asyncpg.PostgresError, trio.TooSlowError) as exc:
        raise Unavailable(
            f"cannot connect to the database: {exc!r}", code="database_unavailable"
        ) from exc
    replica_pool = (
        _lean_pool(read_dsn, min_size=0, max_size=max_size, name=name) if read_dsn else None
    )
    try:
        if replica_pool is None:
            yield PgStore(pool)
        else:
            store = RoutedPgStore(pool, PgStore(replica_pool), poll_seconds=read_poll_seconds)
            await store.log_head()  # what the replica must have replayed before it answers
            await store.refresh_replica()
            yield store
    finally:
        with trio.CancelScope(shield=True):
            if replica_pool is not None:
                await trio_asyncio.aio_as_trio(replica_pool.close)()
            await trio_asyncio.aio_as_trio(pool.close)()
