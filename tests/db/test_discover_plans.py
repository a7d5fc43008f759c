"""At 100,000 entries, every indexed filter is answered without a sequential scan of entries (nor
of entry_search, which holds their searchable columns since migration 0021).

The plans are PostgreSQL's own (`EXPLAIN`) for the exact statements the compiler produces, on a
database seeded with realistic variety and analysed.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from bench.seed import seed
from registry.config import Config
from registry.discovery import parse_discover_request
from registry.query import RegistryQuery
from registry.store.discover import compile_discover
from registry.store.migrate import _migrate, load_migrations
from registry.store.pg import SESSION_SETTINGS
from registry.usecases.discovery import Discovery
from tests.conftest import LOCAL_ADMIN, make_config

ROWS = 100_000


@pytest.fixture(scope="module")
def seeded_url(database_url: str) -> Iterator[str]:
    """A database of its own with 100k entries (separate from the shared test database)."""
    name = f"registry_plans_{secrets.token_hex(4)}"
    admin_url = LOCAL_ADMIN if "127.0.0.1:5432" in database_url else database_url
    url = admin_url.rsplit("/", 1)[0] + "/" + name

    async def setup() -> None:
        admin = await asyncpg.connect(admin_url)
        try:
            await admin.execute(f"CREATE DATABASE {name}")
        finally:
            await admin.close()
        await _migrate(url, load_migrations())
        conn = await asyncpg.connect(url)
        try:
            await seed(conn, ROWS)
        finally:
            await conn.close()

    async def teardown() -> None:
        admin = await asyncpg.connect(admin_url)
        try:
            await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        finally:
            await admin.close()

    asyncio.run(setup())
    try:
        yield url
    finally:
        asyncio.run(teardown())


@asynccontextmanager
async def open_discovery(config: Config) -> AsyncIterator[Discovery]:
    """Discovery as `registry serve` wires it, over the database of `config`."""
    import trio_asyncio

    from registry.identity import DidKeyIdentity
    from registry.keys import SigningKey
    from registry.store.pg import open_pg_store
    from service.wiring import open_service

    async with (
        trio_asyncio.open_loop(),
        open_pg_store(config.database.url) as store,
        open_service(
            config, store, key=SigningKey.generate(), identity=DidKeyIdentity()
        ) as service,
    ):
        yield service.deps.discovery


def _scans(plan: dict[str, Any]) -> Iterator[tuple[str, str]]:
    yield plan["Node Type"], plan.get("Relation Name", "")
    for child in plan.get("Plans", ()):
        yield from _scans(child)


async def _explain(url: str, sql: str, params: list[Any]) -> list[tuple[str, str]]:
    conn = await asyncpg.connect(url, server_settings=SESSION_SETTINGS)
    try:
        raw = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *params)
    finally:
        await conn.close()
    return list(_scans(json.loads(raw)[0]["Plan"]))


SHAPES: dict[str, dict[str, Any]] = {
    "text": {"text": "summarize invoices"},
    "tags-all-of": {"tags": ["tag-17", "legal"]},
    "tags-any-of": {"anyTags": ["tag-3", "tag-4"]},
    "publisher": {"publisherDid": "did:key:z6MkPublisher0042"},
    "service-type": {"entryType": "ToolDefinition", "serviceType": "MCP"},
    "relationship": {"relationship": {"targetDid": "did:web:base:40"}},
    "metadata": {"metadata": {"team": "team-7"}},
    "published-range": {"publishedAfter": "2026-10-31T00:00:00Z"},
    "lifecycle": {"lifecycleStatus": ["deprecated"], "tags": ["tag-5"]},
}
REGISTRYQL: dict[str, str] = {
    "name-contains": "DISCOVER * WHERE name CONTAINS 'graph agent 12'",
    "entry-did-in": (
        "DISCOVER * WHERE entryDid IN ('did:web:agents.example.com:seed:0000042',"
        " 'did:web:agents.example.com:seed:0000043')"
    ),
    "tags-or-metadata": (
        "DISCOVER AgentDefinition WHERE tags CONTAINS 'tag-9' OR customMetadata.team = 'team-3'"
    ),
}


def _queries() -> dict[str, RegistryQuery]:
    from registry.registryql import parse_registryql

    queries = {name: parse_discover_request(body) for name, body in SHAPES.items()}
    queries.update({name: parse_registryql(text) for name, text in REGISTRYQL.items()})
    return queries


# Discovery reads entries joined with entry_search (migration 0021): neither may be scanned whole.
_SEQ_SCANS = {("Seq Scan", "entries"), ("Seq Scan", "entry_search")}


@pytest.mark.parametrize("shape", [*SHAPES, *REGISTRYQL])
def test_indexed_filter_uses_no_sequential_scan(seeded_url: str, shape: str) -> None:
    plan = compile_discover(_queries()[shape], limit=20, after=None)
    for sql, params in ((plan.sql, plan.params), (plan.count_sql, plan.count_params)):
        scans = asyncio.run(_explain(seeded_url, sql, params))
        assert not _SEQ_SCANS & set(scans), f"{shape}: {scans}\n{sql}"


@pytest.mark.parametrize("order", ["sequence", "publishedAt", "updatedAt", "name"])
def test_first_page_of_everything_reads_an_index_in_order(seeded_url: str, order: str) -> None:
    query = parse_discover_request({"orderBy": order})
    plan = compile_discover(query, limit=20, after=None)
    scans = asyncio.run(_explain(seeded_url, plan.page_sql, plan.page_params))
    assert not _SEQ_SCANS & set(scans), f"{order}: {scans}"


async def test_total_count_is_exact_up_to_the_cap_then_flagged(
    seeded_url: str, tmp_path: Path
) -> None:
    from registry.store.discover import COUNT_CAP

    async with open_discovery(make_config(seeded_url, tmp_path)) as discovery:
        broad = json.loads(await discovery.discover(parse_discover_request({})))
        assert broad["totalCount"] == COUNT_CAP
        assert broad["totalCountExact"] is False
        assert broad["hasMore"] is True
        narrow = json.loads(
            await discovery.discover(
                parse_discover_request({"publisherDid": "did:key:z6MkPublisher0042"})
            )
        )
        assert 0 < narrow["totalCount"] < COUNT_CAP
        assert "totalCountExact" not in narrow


BROAD: dict[str, dict[str, Any]] = {
    "newest": {},
    "published-asc": {"orderBy": "publishedAt", "order": "asc"},
    "updated-desc": {"orderBy": "updatedAt"},
    "name": {"orderBy": "name"},
    "name-desc-filtered": {"orderBy": "name", "order": "desc", "entryType": "ToolDefinition"},
    "relevance": {"text": "invoice"},
    "tags-any-by-published": {"anyTags": ["tag-3", "tag-4", "legal"], "orderBy": "publishedAt"},
}


@pytest.mark.parametrize("shape", BROAD)
async def test_paging_a_broad_result_matches_one_big_page(
    seeded_url: str, tmp_path: Path, shape: str
) -> None:
    """Above COUNT_CAP matches the page is found by walking the ordering (or ranking every
    match), not out of the counted candidates: cursors chained over four pages of 25 give
    exactly the first page of 100, and OFFSET 50 gives its second half."""
    import dataclasses

    config = make_config(seeded_url, tmp_path, limits={"discover_cache_entries": 0})
    query = parse_discover_request(BROAD[shape])
    async with open_discovery(config) as discovery:

        async def page(**changes: Any) -> dict[str, Any]:
            body = await discovery.discover(dataclasses.replace(query, **changes))
            result: dict[str, Any] = json.loads(body)
            return result

        whole = await page(limit=100)
        assert whole["totalCountExact"] is False  # the broad branch
        expected = [e["entryDid"] for e in whole["entries"]]
        assert len(expected) == 100 == len(set(expected))
        chained: list[str] = []
        cursor = None
        for _ in range(4):
            result = await page(limit=25, cursor=cursor)
            chained += [e["entryDid"] for e in result["entries"]]
            cursor = result["cursor"]
        assert chained == expected
        second_half = await page(limit=50, offset=50)
        assert [e["entryDid"] for e in second_half["entries"]] == expected[50:]


@pytest.mark.parametrize("order", ["name", "publishedAt", "sequence"])
def test_the_page_statement_alone_explains_with_a_cursor(seeded_url: str, order: str) -> None:
    """`page_sql` with `page_params` (what EXPLAIN tooling runs) is complete after a cursor too."""
    query = parse_discover_request({"orderBy": order, "tags": ["legal"]})
    after: list[Any] = {
        "name": ["M", "did:web:x"],
        "publishedAt": ["2026-06-01T00:00:00+00:00", "did:web:x"],
        "sequence": [50_000],
    }[order]
    plan = compile_discover(query, limit=20, after=after)
    scans = asyncio.run(_explain(seeded_url, plan.page_sql, plan.page_params))
    assert not _SEQ_SCANS & set(scans), f"{order}: {scans}"


def _rows_read(plan: dict[str, Any], relation: str) -> int:
    own = plan.get("Actual Rows", 0) * plan.get("Actual Loops", 1)
    read = own if plan.get("Relation Name") == relation else 0
    return read + sum(_rows_read(child, relation) for child in plan.get("Plans", ()))


@pytest.mark.parametrize("after", [10, 50_000, 99_000])
def test_a_page_of_log_records_reads_only_the_versions_of_its_page(
    seeded_url: str, after: int
) -> None:
    """GET /v1/log/records?from=N joins each record with the version it wrote: that read must
    not grow with N (the planner merge-joined from the first version: every one below N)."""
    from registry.store.pg import LOG_RECORDS_SQL

    async def explain() -> dict[str, Any]:
        conn = await asyncpg.connect(seeded_url, server_settings=SESSION_SETTINGS)
        try:
            raw = await conn.fetchval(
                f"EXPLAIN (ANALYZE, FORMAT JSON) {LOG_RECORDS_SQL}", after, 101, 4 << 20
            )
        finally:
            await conn.close()
        return dict(json.loads(raw)[0]["Plan"])

    plan = asyncio.run(explain())
    assert _rows_read(plan, "log") <= 101
    assert _rows_read(plan, "entry_versions") <= 102, plan
