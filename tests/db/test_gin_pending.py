"""Every GIN index of discovery (on `entry_search` since migration 0021) keeps a small pending
list (migrations 0015, 0021).

A GIN index with fastupdate queues new keys in a pending list that every search scans
linearly; left at PostgreSQL's 4 MB default it grew with the table between autovacuums and
discovery's p99 with it (bench/README.md, soak). A new discovery index must bound it too.
"""

from __future__ import annotations

import asyncio

import asyncpg

MOST_KB = 64


async def _gin_indexes(url: str) -> dict[str, list[str]]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT c.relname, coalesce(c.reloptions, '{}') AS options"
            " FROM pg_index AS x JOIN pg_class AS c ON c.oid = x.indexrelid"
            " JOIN pg_am AS am ON am.oid = c.relam"
            " WHERE x.indrelid IN ('entries'::regclass, 'entry_search'::regclass)"
            " AND am.amname = 'gin'"
        )
    finally:
        await conn.close()
    return {r["relname"]: list(r["options"]) for r in rows}


def _bounded(options: list[str]) -> bool:
    settings = dict(option.split("=", 1) for option in options)
    if settings.get("fastupdate") == "off":
        return True
    return int(settings.get("gin_pending_list_limit", 4096)) <= MOST_KB


def test_every_gin_index_of_discovery_has_a_small_pending_list(database_url: str) -> None:
    indexes = asyncio.run(_gin_indexes(database_url))
    assert {"entry_search_search", "entry_search_tags"} <= set(indexes)
    assert {name: options for name, options in indexes.items() if not _bounded(options)} == {}


def test_the_check_refuses_the_default() -> None:
    assert not _bounded([])
    assert not _bounded(["gin_pending_list_limit=256"])
    assert _bounded(["fastupdate=off"])
    assert _bounded(["gin_pending_list_limit=64"])
