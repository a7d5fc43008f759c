"""The one append path against PostgreSQL: a batch applies many changes in order, each with its
own outcome; only applied changes take log positions (gap-free); idempotency keys are answered
from their records; the group-commit writer shares batches between concurrent callers."""

from __future__ import annotations

import secrets

import asyncpg
import pytest
import trio
import trio_asyncio

from actors.writer import run_writer
from registry.changes import Change, IdemKey, Refusal
from registry.errors import Conflict, Invalid
from registry.store.pg import open_pg_store
from registry.usecases.entries import entry_change


def _change(did: str, expected: int | None = None, note: str = "") -> Change:
    return entry_change(
        "entry.created" if expected is None else "entry.updated",
        did=did,
        expected_head=expected,
        publisher="did:key:zBatch",
        entry_type="AgentDefinition",
        lifecycle="draft",
        prefix='{"entryDid":"' + did + '","name":"' + note + '","sequence":',
        suffix="}",
    )


def _refusal_code(outcome: object) -> str | None:
    refusal = getattr(outcome, "refusal", None)
    return None if refusal is None else str(refusal.code)


async def test_one_batch_mixed_outcomes_gap_free(database_url: str) -> None:
    a, b = (f"did:web:batch.test:{secrets.token_hex(6)}" for _ in range(2))
    key = IdemKey("did:key:zBatch", "create_entry", secrets.token_hex(8), b"fp-1")
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        head = await store.log_head()
        outcomes = await store.append(
            [
                (_change(a), None),  # applied: head + 1
                (_change(a), None),  # entry_exists
                (_change(b), key),  # applied: head + 2
                (_change(b), key),  # replay of the previous item
                (_change(f"{b}x"), IdemKey(key.scope, key.operation, key.key, b"fp-2")),
                (_change(a, expected=head + 7), None),  # sequence_conflict
                (_change(a, expected=head + 1, note="v2"), None),  # applied: head + 3
                (_change(f"{a}-missing", expected=5), None),  # entry_not_found
            ]
        )
        assert [_refusal_code(o) for o in outcomes] == [
            None,
            "entry_exists",
            None,
            None,
            "idempotency_conflict",
            "sequence_conflict",
            None,
            "entry_not_found",
        ]
        assert [o.sequence for o in outcomes] == [
            head + 1,
            None,
            head + 2,
            head + 2,  # the replay answers the recorded position
            None,
            None,
            head + 3,
            None,
        ]
        assert [o.replayed for o in outcomes] == [False, False, False, True] + [False] * 4
        assert outcomes[3].result == outcomes[2].result
        assert outcomes[5].refusal is not None
        assert outcomes[5].refusal.details == {"latestSequence": head + 1}
        assert await store.log_head() == head + 3
        records = await store.log_after(head, 10)
        assert [(r.seq, r.kind, r.entry_did) for r in records] == [
            (head + 1, "entry.created", a),
            (head + 2, "entry.created", b),
            (head + 3, "entry.updated", a),
        ]
        assert records[0].data == {
            "entryType": "AgentDefinition",
            "publisherDid": "did:key:zBatch",
            "lifecycleStatus": "draft",
        }
        head_a = await store.get_entry_head(a)
        assert head_a is not None
        assert head_a.doc.endswith(f'"name":"v2","sequence":{head + 3}}}')


async def test_a_refused_change_is_recorded_under_its_key_and_replayed(database_url: str) -> None:
    did = f"did:web:batch.test:{secrets.token_hex(6)}"
    key = IdemKey("did:key:zBatch", "update_entry", secrets.token_hex(8), b"fp")
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        (created,) = await store.append([(_change(did), None)])
        (refused,) = await store.append([(_change(did, expected=1), key)])
        assert _refusal_code(refused) == "sequence_conflict"
        assert not refused.replayed
        # The same request again: the recorded refusal, even though it would now apply.
        assert created.sequence is not None
        (again,) = await store.append([(_change(did, expected=created.sequence), key)])
        assert again.replayed
        assert again.refusal == refused.refusal
        with pytest.raises(Conflict):
            again.unwrap()


async def test_record_refusal_keeps_the_first_outcome(database_url: str) -> None:
    did = f"did:web:batch.test:{secrets.token_hex(6)}"
    key = IdemKey("did:key:zBatch", "create_entry", secrets.token_hex(8), b"fp")
    late = Refusal("NotFound", "entry_not_found", "entry not found", {"entryDid": did})
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        (created,) = await store.append([(_change(did), key)])
        # A later check refuses the same request: the recorded success stands.
        answered = await store.record_refusal(key, late)
        assert answered.replayed
        assert answered.refusal is None
        assert answered.result == created.result
        assert answered.sequence == created.sequence
        # A different request under the key is an idempotency conflict.
        other = IdemKey(key.scope, key.operation, key.key, b"other")
        conflict = await store.record_refusal(other, late)
        assert _refusal_code(conflict) == "idempotency_conflict"
        # A fresh key records the refusal and answers it as new.
        fresh = IdemKey(key.scope, key.operation, secrets.token_hex(8), b"fp")
        recorded = await store.record_refusal(fresh, late)
        assert not recorded.replayed
        assert recorded.refusal == late
        assert (await store.record_refusal(fresh, late)).replayed


async def test_an_unknown_session_revocation_is_refused_and_takes_no_position(
    database_url: str,
) -> None:
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        head = await store.log_head()
        revoke = Change("session.revoked", None, {"tokenHash": secrets.token_hex(32)})
        (outcome,) = await store.append([(revoke, None)])
        assert _refusal_code(outcome) == "session_invalid"
        assert outcome.sequence is None
        assert await store.log_head() == head


async def test_concurrent_writers_share_batches_and_keep_their_outcomes(database_url: str) -> None:
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        dids = [f"did:web:batch.test:{secrets.token_hex(6)}" for _ in range(60)]
        results: dict[str, int] = {}
        refused: list[str] = []
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                writer = await nursery.start(run_writer, store)

                async def create(did: str) -> None:
                    outcome = await writer.append(_change(did), None)
                    assert outcome.sequence is not None
                    results[did] = outcome.sequence

                async def duplicate(did: str) -> None:
                    outcome = await writer.append(_change(did), None)
                    with pytest.raises(Conflict):
                        outcome.unwrap()
                    refused.append(did)

                async with trio.open_nursery() as clients:
                    for did in dids:
                        clients.start_soon(create, did)
                async with trio.open_nursery() as clients:
                    for did in dids[:10]:
                        clients.start_soon(duplicate, did)
                stats = writer.statistics()
                nursery.cancel_scope.cancel()
        assert len(results) == 60
        assert len(refused) == 10
        sequences = sorted(results.values())
        assert sequences == list(range(sequences[0], sequences[0] + 60))
        assert stats["changes"] == 70
        assert stats["batches"] < 70  # concurrent callers shared batches


async def test_a_change_the_database_refuses_fails_only_its_own_caller(database_url: str) -> None:
    """A value PostgreSQL cannot store (U+0000 in jsonb) reaching the store, past the edge's
    checks: its caller gets 400 value_not_storable; the changes batched with it are applied and
    the writer goes on."""
    good = [f"did:web:batch.test:{secrets.token_hex(6)}" for _ in range(3)]
    bad = f"did:web:batch.test:{secrets.token_hex(6)}"
    poisoned = entry_change(
        "entry.created",
        did=bad,
        expected_head=None,
        publisher="did:key:zBatch",
        entry_type="Agent\x00Definition",
        lifecycle="draft",
        prefix='{"entryDid":"' + bad + '","sequence":',
        suffix="}",
    )
    results: dict[str, object] = {}
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                writer = await nursery.start(run_writer, store)

                async def append(did: str, change: Change) -> None:
                    try:
                        results[did] = await writer.append(change, None)
                    except Invalid as exc:
                        results[did] = exc

                async with trio.open_nursery() as clients:
                    clients.start_soon(append, bad, poisoned)
                    for did in good:
                        clients.start_soon(append, did, _change(did))
                later = f"did:web:batch.test:{secrets.token_hex(6)}"
                after = await writer.append(_change(later), None)
                nursery.cancel_scope.cancel()
        refused = results[bad]
        assert isinstance(refused, Invalid)
        assert refused.code == "value_not_storable"
        assert all(getattr(results[did], "refusal", "x") is None for did in good)
        assert after.refusal is None
        assert await store.get_entry_head(bad) is None


async def _sql(url: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await trio_asyncio.aio_as_trio(asyncpg.connect)(url)
    try:
        return list(await trio_asyncio.aio_as_trio(conn.fetch)(query, *args))
    finally:
        await trio_asyncio.aio_as_trio(conn.close)()


async def test_an_entry_versions_record_names_its_document_and_replays_it(
    database_url: str,
) -> None:
    """Migration 0022: an applied entry version's idempotency record holds its sequence, not
    a copy of the document; a replay in a later batch answers the document byte for byte,
    and a record written before (with its result) still replays as it was."""
    did = f"did:web:batch.test:{secrets.token_hex(6)}"
    key = IdemKey("did:key:zBatch", "create_entry", secrets.token_hex(8), b"fp")
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        (created,) = await store.append([(_change(did, note="n" * 3000), key)])
        assert created.sequence is not None
        assert created.result is not None
        (row,) = await _sql(
            database_url,
            "SELECT sequence, result, refusal FROM idempotency"
            " WHERE scope = $1 AND operation = $2 AND key = $3",
            key.scope,
            key.operation,
            key.key,
        )
        assert (row["sequence"], row["result"], row["refusal"]) == (created.sequence, None, None)
        (again,) = await store.append([(_change(did, note="n" * 3000), key)])
        assert again.replayed
        assert (again.sequence, again.result) == (created.sequence, created.result)

        older = IdemKey(key.scope, key.operation, secrets.token_hex(8), b"fp")
        await _sql(
            database_url,
            "INSERT INTO idempotency (scope, operation, key, fingerprint, sequence, result)"
            " VALUES ($1, $2, $3, $4, $5, 'as recorded')",
            older.scope,
            older.operation,
            older.key,
            older.fingerprint,
            created.sequence,
        )
        (replayed,) = await store.append([(_change(did), older)])
        assert replayed.replayed
        assert replayed.result == "as recorded"
        answered = await store.record_refusal(
            older, Refusal("NotFound", "entry_not_found", "entry not found", {})
        )
        assert answered.replayed
        assert answered.result == "as recorded"

        with pytest.raises(asyncpg.CheckViolationError):
            await _sql(
                database_url,
                "INSERT INTO idempotency (scope, operation, key, fingerprint)"
                " VALUES ('s', 'o', $1, 'fp')",
                secrets.token_hex(8),
            )


async def test_documents_are_compressed_with_lz4_where_the_server_has_it(
    database_url: str,
) -> None:
    """Migration 0022: a document past the TOAST threshold is compressed with lz4 (~3x cheaper
    to write than pglz) on a server built with it, and with pglz on one without."""
    did = f"did:web:batch.test:{secrets.token_hex(6)}"
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        try:
            await _sql(database_url, "SET default_toast_compression = lz4")
            expected = "lz4"
        except asyncpg.InvalidParameterValueError:
            expected = "pglz"
        (created,) = await store.append([(_change(did, note="compressible " * 300), None)])
        (row,) = await _sql(
            database_url,
            "SELECT pg_column_compression(doc) AS method FROM entry_versions WHERE seq = $1",
            created.sequence,
        )
    assert row["method"] == expected
