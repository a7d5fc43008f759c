"""Queries through the pool leave nothing behind: memory is flat over many requests.

(Regression: asyncpg's per-release inactivity timer, cancelled on the next acquire, stayed in
trio-asyncio's timer heap with the request's context for 300 s: ~10 kB per query.)
"""

from __future__ import annotations

import gc

import trio_asyncio

from registry.store.pg import open_pg_store


async def test_many_queries_leave_no_objects_behind(database_url: str) -> None:
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        for _ in range(200):  # warm-up: caches, prepared statements, pool connections
            await store.get_entry_head("did:web:memory.test:none")
        gc.collect()
        before = len(gc.get_objects())
        for _ in range(2000):
            await store.get_entry_head("did:web:memory.test:none")
        gc.collect()
        grown = len(gc.get_objects()) - before
        assert grown < 500, f"{grown} objects left behind by 2000 queries"
