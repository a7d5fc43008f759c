"""A batch of entry versions is applied in bulk under the log head (migrations/functions/
apply_entry_versions_in_bulk.sql, docs/architecture.md "The critical section"): one statement
writes the rows the handler writes one version at a time. These tests hold the two paths to the
same rows and outcomes (creates, updates, tombstones), and check that a batch the bulk path must
not take (a DID that exists, a head that moved, a key that completed, a DID or a key named
twice) is applied change by change with each one's outcome.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from registry.changes import IDEMPOTENCY_WINDOW_MS, Change, IdemKey
from registry.store.pg import SESSION_SETTINGS, append_payload
from registry.usecases.entries import entry_change
from tests.db.proc import databases

APPEND = "SELECT * FROM append_changes($1::jsonb, $2) ORDER BY idx"

# Every row a create writes, by table, without the columns that hold the time of the write.
ROWS = {
    "entries": "SELECT entry_did, head_seq, created_seq, publisher_did, entry_type, lifecycle"
    " FROM entries ORDER BY entry_did",
    "entry_versions": "SELECT seq, entry_did, publisher_did, lifecycle, doc, version"
    " FROM entry_versions ORDER BY seq",
    "entry_search": "SELECT * FROM entry_search ORDER BY entry_did",
    "log": "SELECT seq, kind, entry_did, data FROM log ORDER BY seq",
    "anchor_intents": "SELECT intent_id, entry_did, sequence, operation, item_data_hash, state,"
    " attempts, batch_id FROM anchor_intents ORDER BY intent_id",
    "anchor_queue": "SELECT sequence, intent_id FROM anchor_queue ORDER BY sequence",
    "idempotency": "SELECT scope, operation, key, fingerprint, sequence, result, refusal"
    " FROM idempotency ORDER BY key",
    "log_head": "SELECT seq FROM log_head",
}


def _create(did: str, n: int, *, anchored: bool = True) -> Change:
    return entry_change(
        "entry.created",
        did=did,
        expected_head=None,
        publisher=f"did:key:zBulk{n % 2}",
        entry_type="AgentDefinition",
        lifecycle="active",
        prefix='{"entryDid":"' + did + f'","name":"bulk {n}","tags":["t{n}","all"],'
        '"description":"a bulk create, \\u00e9t\\u00e9","publishedAt":"2026-11-28T10:00:00Z",'
        '"sequence":',
        suffix=',"updatedAt":"2026-11-28T10:00:00Z"}',
        item_data_hash=secrets.token_hex(32) if anchored else None,
    )


def _version(did: str, n: int, head: int, *, tombstone: bool = False) -> Change:
    return entry_change(
        "entry.deleted" if tombstone else "entry.updated",
        did=did,
        expected_head=head,
        publisher=f"did:key:zBulk{(n + 1) % 2}",
        entry_type="ToolDefinition",
        lifecycle="deleted" if tombstone else "deprecated",
        prefix='{"entryDid":"' + did + f'","name":"bulk {n} v2","tags":["u{n}"],'
        '"description":"a new version","publishedAt":"2026-11-28T10:00:00Z","sequence":',
        suffix=',"updatedAt":"2026-11-28T11:00:00Z","version":"2.0.0"}',
        item_data_hash=secrets.token_hex(32),
    )


def _key(n: int) -> IdemKey:
    return IdemKey("did:key:zBulk0", "create_entry", f"bulk-key-{n}", bytes([n]) * 32)


@pytest.fixture
def two_databases(database_url: str) -> Iterator[tuple[str, str]]:
    with databases(database_url) as new_database:
        yield new_database(), new_database()


async def _append(
    url: str, items: list[tuple[Change, IdemKey | None]]
) -> tuple[list[dict[str, Any]], int]:
    """The rows `append_changes` answers for `items` in one call, and how many times that call
    ran the bulk path (the function statistics of its own transaction)."""
    conn = await asyncpg.connect(url, server_settings=SESSION_SETTINGS)
    try:
        async with conn.transaction():
            await conn.execute("SET LOCAL track_functions = 'pl'")
            rows = await conn.fetch(APPEND, append_payload(items), IDEMPOTENCY_WINDOW_MS)
            bulk = await conn.fetchval(
                "SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions"
                " WHERE funcname = 'apply_entry_versions_in_bulk'"
            )
        return [dict(r) for r in rows], int(bulk)
    finally:
        await conn.close()


async def _rows(url: str) -> dict[str, list[dict[str, Any]]]:
    conn = await asyncpg.connect(url)
    try:
        return {table: [dict(r) for r in await conn.fetch(sql)] for table, sql in ROWS.items()}
    finally:
        await conn.close()


def test_a_batch_of_creates_in_bulk_writes_the_rows_and_outcomes_of_the_handler(
    two_databases: tuple[str, str],
) -> None:
    bulk_db, loop_db = two_databases
    dids = [f"did:web:bulk.test:{secrets.token_hex(4)}:{n}" for n in range(6)]
    # Creates with and without a key, with and without an anchor intent.
    items = [
        (_create(did, n, anchored=n != 2), None if n == 4 else _key(n))
        for n, did in enumerate(dids)
    ]

    async def scenario() -> None:
        bulk_outcomes, bulk_calls = await _append(bulk_db, items)
        # The same creates and one more of the first DID (refused: it exists now): a DID named
        # twice takes the batch change by change.
        loop_outcomes, loop_calls = await _append(loop_db, [*items, (items[0][0], None)])
        assert (bulk_calls, loop_calls) == (1, 0)
        assert loop_outcomes[-1]["seq"] is None
        assert '"entry_exists"' in loop_outcomes[-1]["refusal"]
        assert bulk_outcomes == loop_outcomes[:-1]
        assert [o["seq"] for o in bulk_outcomes] == list(range(1, len(dids) + 1))
        for o, did in zip(bulk_outcomes, dids, strict=True):
            assert o["result"].startswith('{"entryDid":"' + did)
            assert f'"sequence":{o["seq"]},' in o["result"]
        bulk_rows, loop_rows = await _rows(bulk_db), await _rows(loop_db)
        assert bulk_rows == loop_rows
        assert len(bulk_rows["entries"]) == len(dids)
        assert len(bulk_rows["anchor_intents"]) == len(dids) - 1
        assert len(bulk_rows["idempotency"]) == len(dids) - 1
        assert bulk_rows["log_head"] == [{"seq": len(dids)}]
        # New versions of four of them (two updates, two tombstones) and a fifth create.
        more = f"did:web:bulk.test:{secrets.token_hex(4)}:more"
        versions = [
            (_version(dids[0], 0, 1), IdemKey("did:key:zBulk0", "update_entry", "u0", b"u" * 32)),
            (_version(dids[1], 1, 2, tombstone=True), None),
            (_create(more, 9), _key(9)),
            (_version(dids[3], 3, 4), None),
            (_version(dids[5], 5, 6, tombstone=True), _key(55)),
        ]
        bulk_outcomes, bulk_calls = await _append(bulk_db, versions)
        # The same, and a version of the first over a head it no longer has (refused).
        loop_outcomes, loop_calls = await _append(
            loop_db, [*versions, (_version(dids[2], 2, 1), None)]
        )
        assert (bulk_calls, loop_calls) == (1, 0)
        assert '"sequence_conflict"' in loop_outcomes[-1]["refusal"]
        assert bulk_outcomes == loop_outcomes[:-1]
        assert [o["seq"] for o in bulk_outcomes] == list(range(7, 12))
        bulk_rows, loop_rows = await _rows(bulk_db), await _rows(loop_db)
        assert bulk_rows == loop_rows
        by_did = {r["entry_did"]: r for r in bulk_rows["entry_search"]}
        assert by_did[dids[0]]["name"] == "bulk 0 v2"
        assert by_did[dids[0]]["entry_type"] == "ToolDefinition"
        assert by_did[dids[1]]["name"] == "bulk 1"  # a tombstone keeps its projection
        assert by_did[dids[1]]["lifecycle"] == "deleted"
        assert by_did[dids[1]]["head_seq"] == 8
        heads = {r["entry_did"]: r for r in bulk_rows["entries"]}
        assert heads[dids[1]]["entry_type"] == "AgentDefinition"  # and its type
        assert heads[dids[3]]["publisher_did"] == "did:key:zBulk0"

    asyncio.run(scenario())


def test_a_batch_the_bulk_path_must_not_take_is_applied_change_by_change(
    two_databases: tuple[str, str],
) -> None:
    url = two_databases[0]
    did = [f"did:web:bulk.test:{secrets.token_hex(4)}:{n}" for n in range(9)]

    async def scenario() -> None:
        # One change alone is applied on its own.
        first, calls = await _append(url, [(_create(did[0], 0), _key(0))])
        assert calls == 0
        assert first[0]["seq"] == 1
        # An existing DID among new ones: it is refused, the others take 2 and 3.
        outcomes, calls = await _append(
            url,
            [(_create(did[1], 1), None), (_create(did[0], 9), None), (_create(did[2], 2), None)],
        )
        assert calls == 0
        assert [o["seq"] for o in outcomes] == [2, None, 3]
        assert '"entry_exists"' in outcomes[1]["refusal"]
        # A key that completed: its request is replayed (no new position), the other applied.
        outcomes, calls = await _append(
            url, [(_create(did[0], 0), _key(0)), (_create(did[3], 3), _key(3))]
        )
        assert calls == 0
        assert [(o["seq"], o["replayed"]) for o in outcomes] == [(1, True), (4, False)]
        # An update over a head that moved: refused, the create after it applied.
        outcomes, calls = await _append(
            url, [(_version(did[1], 1, 1), None), (_create(did[7], 7), None)]
        )
        assert calls == 0
        assert [o["seq"] for o in outcomes] == [None, 5]
        assert '"sequence_conflict"' in outcomes[0]["refusal"]
        # Of an entry that does not exist: refused.
        outcomes, calls = await _append(url, [(_version(did[6], 6, 3), None)])
        assert calls == 0
        assert '"entry_not_found"' in outcomes[0]["refusal"]
        # One key named twice in a batch: the second is its replay.
        outcomes, calls = await _append(
            url, [(_create(did[4], 4), _key(4)), (_create(did[4], 4), _key(4))]
        )
        assert calls == 0
        assert [(o["seq"], o["replayed"]) for o in outcomes] == [(6, False), (6, True)]
        # A DID that is another registry's replica here is refused.
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(
                "INSERT INTO replica_versions (origin_did, entry_did, origin_seq, synced_seq,"
                " doc, lifecycle) VALUES ('did:web:origin.test', $1, 1, 0, '{}', 'active')",
                did[5],
            )
        finally:
            await conn.close()
        outcomes, calls = await _append(
            url, [(_create(did[5], 5), None), (_create(did[6], 6), None)]
        )
        assert calls == 0
        assert [o["seq"] for o in outcomes] == [None, 7]
        assert '"entry_is_replica"' in outcomes[0]["refusal"]
        # The refused creates left no searchable row; the log has no gap.
        rows = await _rows(url)
        assert [r["seq"] for r in rows["log"]] == list(range(1, 8))
        assert {r["entry_did"] for r in rows["entry_search"]} == {
            did[n] for n in (0, 1, 2, 3, 4, 6, 7)
        }
        # Back to a batch of new DIDs and keys: in bulk again, after the last position.
        outcomes, calls = await _append(
            url, [(_create(did[8], 8), _key(8)), (_version(did[7], 7, 5), None)]
        )
        assert calls == 1
        assert [o["seq"] for o in outcomes] == [8, 9]

    asyncio.run(scenario())


def test_an_expired_key_is_taken_again_in_bulk(two_databases: tuple[str, str]) -> None:
    url = two_databases[0]
    a, b = (f"did:web:bulk.test:{secrets.token_hex(4)}:{n}" for n in range(2))

    async def scenario() -> None:
        await _append(url, [(_create(a, 0), _key(0)), (_create(f"{a}x", 9), None)])
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(
                "UPDATE idempotency SET created_at = now() - $1 * interval '1 millisecond'"
                " - interval '1 second'",
                IDEMPOTENCY_WINDOW_MS,
            )
        finally:
            await conn.close()
        outcomes, calls = await _append(
            url, [(_create(b, 1), _key(0)), (_create(f"{b}x", 8), None)]
        )
        assert calls == 1
        assert outcomes[0]["seq"] == 3
        assert not outcomes[0]["replayed"]
        rows = await _rows(url)
        assert [(r["key"], r["sequence"]) for r in rows["idempotency"]] == [("bulk-key-0", 3)]

    asyncio.run(scenario())
