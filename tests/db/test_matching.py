"""`registry.matching` against PostgreSQL: never "no" where the SQL compiler says "yes".

The result cache keeps a page across a change only when `may_match` says the changed entry
matches the page's query neither before nor after; a wrong "no" would serve a stale page. Here
every query of a generated set is run as SQL over 2,000 seeded entries (plus a few odd ones) and
compared, entry by entry, with `may_match` on the stored documents: a SQL match must be a "maybe";
and for the filters Python decides exactly (all but MATCH and text order comparisons other than
on name) the two must agree on every entry, so the cache gains what it can.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from bench.seed import SERVICE_TYPES, TEAMS, WORDS, seed
from registry.discovery import parse_discover_request
from registry.matching import facts_of, match_texts_in, may_match
from registry.query import RegistryQuery
from registry.registryql import parse_registryql
from registry.store.discover import SOURCE, compile_discover
from registry.store.migrate import _migrate, load_migrations
from tests.conftest import LOCAL_ADMIN

ROWS = 2000
TAGS = [*WORDS[:12], "tag-3", "tag-17", "tag-150"]


def _queries() -> list[tuple[str, RegistryQuery, bool]]:
    """(label, query, whether Python decides it exactly, given the database's MATCH answers)."""
    rng = random.Random(42)
    out: list[tuple[str, RegistryQuery, bool]] = []

    def rql(text: str, exact: bool = True) -> None:
        out.append((text, parse_registryql(text), exact))

    def body(value: dict[str, Any], exact: bool = True) -> None:
        out.append((json.dumps(value), parse_discover_request(value), exact))

    body({})
    body({"lifecycleStatus": ["revoked", "draft"]})
    body({"entryType": "ToolDefinition", "serviceType": "MCP"})
    body({"relationship": {"targetDid": "did:web:base:40", "relationshipType": "dependsOn"}})
    body({"relationship": {"relationshipType": "dependsOn"}})
    body({"metadata": {"team": "team-7", "tier": 1}})
    body({"publishedAfter": "2026-10-01T00:00:00Z", "publishedBefore": "2026-10-20T00:00:00Z"})
    body({"updatedAfter": "2026-06-01T00:00:00Z"})
    body({"text": "invoice"})
    body({"text": "summarize -legal", "anyTags": ["tag-3", "finance"]})
    rql("DISCOVER * WHERE name CONTAINS 'invoice agent 1'")
    rql("DISCOVER * WHERE description CONTAINS 'for legal'")
    rql("DISCOVER * WHERE name CONTAINS 'INVOICE' OR description CONTAINS 'an AGENT that can'")
    rql("DISCOVER * WHERE name < 'M' AND name >= 'Co'")
    rql("DISCOVER * WHERE entryDid < 'did:web:agents.example.com:seed:0000900'", exact=False)
    rql("DISCOVER * WHERE entryDid = 'did:web:agents.example.com:seed:0000042'")
    rql("DISCOVER * WHERE version IN ('1.3.0', '1.7.0') AND NOT lifecycleStatus = 'active'")
    rql("DISCOVER * WHERE sequence > 1500 OR sequence <= 20")
    rql("DISCOVER * WHERE customMetadata.tier != 2 AND customMetadata.team != 'team-4'")
    rql("DISCOVER * WHERE customMetadata.tier = '1'")  # a string never equals the integer 1
    rql("DISCOVER * WHERE customMetadata.missing = 'x' OR customMetadata.tier = true")
    rql("DISCOVER * WHERE relationships.targetDid IN ('did:web:base:0', 'did:web:base:60')")
    rql("DISCOVER * WHERE publisherDid = 'did:key:z6MkPublisher0042'")
    rql("DISCOVER * WHERE publishedAt > '2026-09-01T00:00:00+02:00'")
    rql("DISCOVER * WHERE MATCH 'legal' AND tags CONTAINS 'tag-3'")
    rql("DISCOVER * WHERE NOT MATCH 'legal' OR serviceType = 'SSE'")
    rql("DISCOVER * WHERE MATCH '\"invoice agent\" or audits' OR MATCH 'tutoring'")
    for _ in range(60):
        a, b, c = rng.sample(TAGS, 3)
        kind = rng.choice(["*", "AgentDefinition", "ToolDefinition"])
        service = rng.choice(SERVICE_TYPES)
        team = rng.choice(TEAMS)
        shape = rng.randrange(4)
        if shape == 0:
            rql(f"DISCOVER {kind} WHERE tags CONTAINS '{a}' AND NOT tags IN ('{b}', '{c}')")
        elif shape == 1:
            rql(
                f"DISCOVER {kind} WITH SERVICE '{service}' WHERE customMetadata.team = '{team}'"
                f" OR (tags CONTAINS '{a}' AND lifecycleStatus IN ('draft', 'revoked'))"
            )
        elif shape == 2:
            body({"entryType": kind, "anyTags": [a, b, c]} if kind != "*" else {"tags": [a]})
        else:
            rql(
                f"DISCOVER * WHERE NOT (serviceType IN ('{service}', 'REST')"
                f" OR customMetadata.team = '{team}') AND tags CONTAINS '{a}'"
            )
    return out


@pytest.fixture(scope="module")
def seeded(database_url: str) -> Iterator[tuple[str, dict[str, str]]]:
    """A database of its own: 2,000 seeded entries and some odd documents; (url, did → doc)."""
    name = f"registry_matching_{secrets.token_hex(4)}"
    admin_url = LOCAL_ADMIN if "127.0.0.1:5432" in database_url else database_url
    url = admin_url.rsplit("/", 1)[0] + "/" + name

    async def setup() -> dict[str, str]:
        admin = await asyncpg.connect(admin_url)
        try:
            await admin.execute(f"CREATE DATABASE {name}")
        finally:
            await admin.close()
        await _migrate(url, load_migrations())
        conn = await asyncpg.connect(url)
        try:
            await seed(conn, ROWS)
            rows = await conn.fetch(
                "SELECT e.entry_did, v.doc FROM entries AS e"
                " JOIN entry_versions AS v ON v.seq = e.head_seq"
            )
        finally:
            await conn.close()
        return {r["entry_did"]: r["doc"] for r in rows}

    async def teardown() -> None:
        admin = await asyncpg.connect(admin_url)
        try:
            await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        finally:
            await admin.close()

    docs = asyncio.run(setup())
    try:
        yield url, docs
    finally:
        asyncio.run(teardown())


async def _sql_matches(url: str, query: RegistryQuery) -> set[str]:
    """The DIDs the compiler's filter selects: its count statement, uncapped, listing DIDs."""
    plan = compile_discover(query, limit=20, after=None)
    prefix = f"SELECT count(*) AS total FROM (SELECT 1 FROM {SOURCE}"
    assert plan.count_sql.startswith(prefix)
    sql = f"SELECT entry_did FROM (SELECT entry_did FROM {SOURCE}" + plan.count_sql[len(prefix) :]
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(sql, *plan.count_params[:-1], 10**9)
    finally:
        await conn.close()
    return {r["entry_did"] for r in rows}


async def _full_text(url: str, texts: list[str]) -> dict[str, list[str]]:
    """For each entry, which of `texts` its stored document matches, as the cache keeper asks
    (PgStore.change_versions): by the projection discovery searches."""
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT e.entry_did, ARRAY(SELECT t FROM unnest($1::text[]) AS t"
            "  WHERE p.search @@ websearch_to_tsquery('english', t)) AS matched"
            " FROM entries AS e JOIN entry_versions AS v ON v.seq = e.head_seq,"
            " LATERAL entry_projection(v.doc) AS p",
            texts,
        )
    finally:
        await conn.close()
    return {r["entry_did"]: list(r["matched"]) for r in rows}


QUERIES = _queries()


@pytest.mark.parametrize("index", range(len(QUERIES)), ids=[q[0][:60] for q in QUERIES])
def test_may_match_never_denies_a_sql_match(seeded: tuple[str, dict[str, str]], index: int) -> None:
    url, docs = seeded
    label, query, exact = QUERIES[index]
    matches = asyncio.run(_sql_matches(url, query))
    texts = sorted(match_texts_in(query.where))
    answers = asyncio.run(_full_text(url, texts)) if texts else {}
    told = {
        did: facts_of(doc, asked=texts, matched=answers.get(did, ())) for did, doc in docs.items()
    }
    untold = {did: facts_of(doc) for did, doc in docs.items()}
    for facts in (told, untold):
        denied = [did for did in matches if not may_match(query, facts[did])]
        assert not denied, f"{label}: may_match says no to SQL matches {denied[:3]}"
    if exact:
        extra = [did for did in docs if did not in matches and may_match(query, told[did])]
        assert not extra, f"{label}: may_match says maybe to non-matches {extra[:3]}"


def test_the_generated_queries_have_matches_and_non_matches(
    seeded: tuple[str, dict[str, str]],
) -> None:
    """The comparison above is only worth something if most queries split the entries."""
    url, docs = seeded
    split = 0
    for _label, query, _exact in QUERIES:
        matches = asyncio.run(_sql_matches(url, query))
        split += 0 < len(matches) < len(docs)
    assert split >= len(QUERIES) * 0.75


def test_odd_documents_are_maybe_not_no() -> None:
    """What Python cannot judge as PostgreSQL would is "maybe"."""
    query = parse_registryql("DISCOVER * WHERE customMetadata.k = 1 AND name CONTAINS 'é'")
    doc = {
        "entryDid": "did:web:x",
        "entryType": "AgentDefinition",
        "lifecycleStatus": "active",
        "customMetadata": {"k": 1.0},
        "name": "CAFÉ",
    }
    assert may_match(query, facts_of(json.dumps(doc)))
    assert may_match(query, facts_of("not json"))
    tombstone = {"entryDid": "did:web:x", "lifecycleStatus": "deleted", "sequence": 3}
    assert not may_match(parse_registryql("DISCOVER *"), facts_of(json.dumps(tombstone)))


def test_dates_round_to_microseconds_as_postgresql_does(database_url: str) -> None:
    """`parse_datetime` (used for query values and by `may_match`) must give the instant the
    database stores for the same text, sub-microsecond digits and ties included."""
    from registry.models import parse_datetime

    rng = random.Random(9)
    texts = [
        "2024-01-01T00:00:00.9999995Z",
        "2024-01-01T00:00:00.0000005Z",
        "2024-01-01T00:00:00.0000015Z",
        "2024-01-01T00:00:00.0000025Z",
        "2024-12-31T23:59:59.99999951+02:00",
        "2024-01-01t00:00:00.5z",
        "2024-01-01T00:00:00Z",
    ]
    for _ in range(300):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 9)))
        texts.append(f"2025-06-{rng.randint(1, 28):02d}T12:34:56.{digits}-05:30")

    async def stored() -> list[Any]:
        conn = await asyncpg.connect(database_url)
        try:
            rows = await conn.fetch(
                "SELECT t::timestamptz AS at FROM unnest($1::text[]) AS t", texts
            )
        finally:
            await conn.close()
        return [r["at"] for r in rows]

    for text, at in zip(texts, asyncio.run(stored()), strict=True):
        assert parse_datetime(text) == at, text


def test_an_entry_whose_date_rounds_up_into_the_range_may_match() -> None:
    query = parse_discover_request({"publishedAfter": "2024-01-01T00:00:00.999999Z"})
    doc = {
        "entryDid": "did:web:x",
        "entryType": "AgentDefinition",
        "lifecycleStatus": "active",
        "publishedAt": "2024-01-01T00:00:00.9999995Z",  # stored as 00:00:01
    }
    assert may_match(query, facts_of(json.dumps(doc)))
