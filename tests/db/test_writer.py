"""Group commit: one batch applies many entry changes in order, each with its own outcome, and
only successful changes take sequence numbers (the log stays gap-free)."""

from __future__ import annotations

import secrets

import pytest
import trio
import trio_asyncio

from actors.writer import EntryWriter
from registry.errors import Conflict
from registry.store import EntryWrite, IdemKey
from registry.store.pg import open_pg_store


def _write(did: str, expected: int | None = None, note: str = "") -> EntryWrite:
    return EntryWrite(
        kind="entry.created" if expected is None else "entry.updated",
        entry_did=did,
        expected_head=expected,
        publisher_did="did:key:zBatch",
        entry_type="AgentDefinition",
        lifecycle="draft",
        prefix='{"entryDid":"' + did + '","name":"' + note + '","sequence":',
        suffix="}",
        status=201 if expected is None else 200,
    )


async def test_one_batch_mixed_outcomes_gap_free(database_url: str) -> None:
    a, b = (f"did:web:batch.test:{secrets.token_hex(6)}" for _ in range(2))
    key = IdemKey("did:key:zBatch", "create_entry", secrets.token_hex(8), b"fp-1")
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        head = await store.log_head()
        outcomes = await store.write_entries(
            [
                (_write(a), None),  # written: head + 1
                (_write(a), None),  # entry_exists
                (_write(b), key),  # written: head + 2
                (_write(b), key),  # replay of the previous item
                (_write(f"{b}x"), IdemKey(key.scope, key.operation, key.key, b"fp-2")),  # conflict
                (_write(a, expected=head + 7), None),  # sequence_conflict
                (_write(a, expected=head + 1, note="v2"), None),  # written: head + 3
                (_write(f"{a}-missing", expected=5), None),  # entry_not_found
            ]
        )
        assert [o.error for o in outcomes] == [
            None,
            "entry_exists",
            None,
            None,
            "idempotency_conflict",
            "sequence_conflict",
            None,
            "entry_not_found",
        ]
        assert [o.seq for o in outcomes] == [
            head + 1,
            None,
            head + 2,
            None,
            None,
            None,
            head + 3,
            None,
        ]
        assert outcomes[3].replay_status == 201
        assert outcomes[3].doc == outcomes[2].doc
        assert await store.log_head() == head + 3
        records = await store.log_after(head, 10)
        assert [r.seq for r in records] == [head + 1, head + 2, head + 3]
        assert (await store.get_entry_head(a)).doc.endswith(f'"name":"v2","sequence":{head + 3}}}')  # type: ignore[union-attr]


async def test_concurrent_writers_share_batches_and_keep_their_outcomes(database_url: str) -> None:
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        writer = EntryWriter(store)
        dids = [f"did:web:batch.test:{secrets.token_hex(6)}" for _ in range(60)]
        results: dict[str, int] = {}
        refused: list[str] = []

        async def create(did: str) -> None:
            seq, _, _ = await writer.write(_write(did), None)
            assert seq is not None
            results[did] = seq

        async def duplicate(did: str) -> None:
            with pytest.raises(Conflict):
                await writer.write(_write(did), None)
            refused.append(did)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer.run)
                async with trio.open_nursery() as clients:
                    for did in dids:
                        clients.start_soon(create, did)
                async with trio.open_nursery() as clients:
                    for did in dids[:10]:
                        clients.start_soon(duplicate, did)
                nursery.cancel_scope.cancel()
        assert len(results) == 60
        assert len(refused) == 10
        sequences = sorted(results.values())
        assert sequences == list(range(sequences[0], sequences[0] + 60))
        stats = writer.statistics()
        assert stats["writes"] == 70
