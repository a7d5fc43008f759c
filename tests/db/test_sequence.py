"""The registry sequence is gap-free and commit-ordered (design §2).

Many writers commit concurrently through the real store while readers poll "everything after my
cursor". If sequence N+1 ever became visible before N, a reader would advance past N and never
see it; so every reader must observe every sequence exactly once, in order.
"""

from __future__ import annotations

import secrets

import pytest
import trio
import trio.lowlevel
import trio_asyncio

from registry.changes import Change
from registry.errors import Conflict
from registry.store.pg import PgStore, open_pg_store
from registry.usecases.entries import entry_change

WRITERS = 12
WRITES_EACH = 30
READERS = 4


def _write(did: str, n: int) -> Change:
    return entry_change(
        "entry.created",
        did=did,
        expected_head=None,
        publisher="did:key:zTest",
        entry_type="AgentDefinition",
        lifecycle="draft",
        prefix='{"entryDid":"' + did + '","n":' + str(n) + ',"sequence":',
        suffix="}",
    )


async def _append(store: PgStore, change: Change) -> int:
    (outcome,) = await store.append([(change, None)])
    outcome.unwrap()
    assert outcome.sequence is not None
    return outcome.sequence


async def test_concurrent_writers_readers_see_every_sequence_once_in_order(
    database_url: str,
) -> None:
    async with trio_asyncio.open_loop(), open_pg_store(database_url, max_size=WRITERS + 2) as store:
        start = await store.log_head()
        total = WRITERS * WRITES_EACH
        acknowledged: list[int] = []
        seen: list[list[int]] = [[] for _ in range(READERS)]
        writers_done = trio.Event()

        async def writer(w: int) -> None:
            for i in range(WRITES_EACH):
                seq = await _append(store, _write(f"did:web:seq.test:{secrets.token_hex(6)}", i))
                acknowledged.append(seq)

        async def reader(r: int, reader_store: PgStore) -> None:
            cursor = start
            while True:
                done = writers_done.is_set()
                for record in await reader_store.log_after(cursor, 50):
                    seen[r].append(record.seq)
                    cursor = record.seq
                if done and cursor >= start + total:
                    return
                await trio.lowlevel.checkpoint()  # polling is the behaviour under test

        with trio.fail_after(60):
            async with trio.open_nursery() as readers:
                for r in range(READERS):
                    readers.start_soon(reader, r, store)
                async with trio.open_nursery() as writers:
                    for w in range(WRITERS):
                        writers.start_soon(writer, w)
                writers_done.set()

        expected = list(range(start + 1, start + total + 1))
        assert sorted(acknowledged) == expected
        for r in range(READERS):
            assert seen[r] == expected, f"reader {r} saw a gap or a duplicate"


async def test_failed_write_leaves_no_gap(database_url: str) -> None:
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        did = f"did:web:seq.test:{secrets.token_hex(6)}"
        first = await _append(store, _write(did, 0))
        with pytest.raises(Conflict) as raised:  # the DID exists: refused, nothing written
            await _append(store, _write(did, 1))
        assert raised.value.code == "entry_exists"
        second = await _append(store, _write(f"{did}x", 2))
        assert second == first + 1
