"""RegistryQL over HTTP (`POST /v1/discover/registryql`, body `{query, cursor?}`): the same
results as the equivalent structured requests, paging, and `invalid_registryql` errors with
positions."""

from __future__ import annotations

import json
from typing import Any

from tests.api.api_support import JSON, anon_client, error_of
from tests.api.test_discover import (
    dids,
    discover,
    flat_dids,
    page_all,
    post,
    publish_many,
    publisher,
    scope,
    sorted_dids,
)
from tests.conftest import Harness

QL = "/v1/discover/registryql"


async def _corpus(h: Harness) -> tuple[str, Any, dict[str, dict]]:
    pub = await publisher(h)
    tag = scope()
    mcp = [{"id": "e", "type": "MCP", "url": "https://x.example/a"}]
    entries = {
        "invoice": await pub.publish(
            tags=[tag, "ocr"],
            name="Invoice summarizer",
            description="Summarizes invoices",
            lifecycleStatus="active",
            serviceEndpoints=mcp,
            customMetadata={"team": "finance", "gpu": True, "tokens": 8192},
            publishedAt="2026-03-01T00:00:00Z",
        ),
        "translator": await pub.publish(
            tags=[tag, "pdf"],
            name="Translator",
            relationships=[{"relationshipType": "dependsOn", "targetDid": "did:web:m.example"}],
            publishedAt="2026-01-01T00:00:00Z",
        ),
        "tool": await pub.publish(
            tags=[tag],
            entryType="Tool",
            name="alpha tool",
            serviceEndpoints=mcp,
            customMetadata={"team": "legal"},
            publishedAt="2026-03-01T00:00:00Z",
        ),
        "revoked": await pub.update(
            await pub.publish(tags=[tag, "ocr"], name="Old OCR", lifecycleStatus="active"),
            lifecycleStatus="revoked",
        ),
    }
    return tag, pub, entries


async def test_registryql_gives_the_same_results_as_structured_requests(harness: Harness) -> None:
    tag, pub, entries = await _corpus(harness)
    t = f"tags CONTAINS '{tag}'"
    pairs: list[tuple[str, dict[str, Any]]] = [
        (f"DISCOVER * WHERE {t}", {"tags": [tag]}),
        (f"discover * where {t}", {"tags": [tag]}),
        (f"DISCOVER Tool WHERE {t}", {"entryType": "Tool", "tags": [tag]}),
        (
            f"DISCOVER * WITH SERVICE 'MCP' WHERE {t} ORDER BY name ASC",
            {"serviceType": "MCP", "tags": [tag], "orderBy": "name"},
        ),
        (
            f"DISCOVER * WHERE {t} AND MATCH 'summarize'",
            {"tags": [tag], "text": "summarize"},
        ),
        (
            f"DISCOVER * WHERE {t} AND tags IN ('ocr', 'pdf')",
            {"tags": [tag], "anyTags": ["ocr", "pdf"]},
        ),
        (
            f"DISCOVER * WHERE {t} AND publisherDid = '{pub.did}' ORDER BY publishedAt DESC",
            {"tags": [tag], "publisherDid": pub.did, "orderBy": "publishedAt"},
        ),
        (
            f"DISCOVER * WHERE {t} AND lifecycleStatus IN ('active', 'revoked')",
            {"tags": [tag], "lifecycleStatus": ["active", "revoked"]},
        ),
        (
            f"DISCOVER * WHERE {t} AND customMetadata.team = 'finance' "
            "AND customMetadata.gpu = TRUE AND customMetadata.tokens = 8192",
            {"tags": [tag], "metadata": {"team": "finance", "gpu": True, "tokens": 8192}},
        ),
        (
            f"DISCOVER * WHERE {t} AND relationships.targetDid = 'did:web:m.example'",
            {"tags": [tag], "relationship": {"targetDid": "did:web:m.example"}},
        ),
        (
            f"DISCOVER * WHERE {t} AND publishedAt > '2026-02-01T00:00:00Z' "
            "AND publishedAt < '2026-04-01T00:00:00Z' ORDER BY publishedAt ASC",
            {
                "tags": [tag],
                "publishedAfter": "2026-02-01T00:00:00Z",
                "publishedBefore": "2026-04-01T00:00:00Z",
                "orderBy": "publishedAt",
                "order": "asc",
            },
        ),
        (
            f"DISCOVER * WHERE {t} ORDER BY sequence ASC LIMIT 2 OFFSET 1",
            {"tags": [tag], "orderBy": "sequence", "order": "asc", "limit": 2, "offset": 1},
        ),
        (
            f"DISCOVER * WHERE {t} ORDER BY updatedAt DESC LIMIT 1",
            {"tags": [tag], "orderBy": "updatedAt", "limit": 1},
        ),
    ]
    for text, structured in pairs:
        ql = await discover(harness, {"query": text}, QL)
        st = await discover(harness, structured)
        assert ql["entries"] == st["entries"], text
        assert ql["totalCount"] == st["totalCount"], text
        assert ql["hasMore"] == st["hasMore"], text
        assert ql["entries"], text  # a comparison of two empty lists would prove nothing
    assert [
        e["entryDid"] for e in (await discover(harness, {"query": pairs[0][0]}, QL))["entries"]
    ] == [e["entryDid"] for e in (entries["tool"], entries["translator"], entries["invoice"])]


async def test_registryql_only_features(harness: Harness) -> None:
    tag, _, entries = await _corpus(harness)
    t = f"tags CONTAINS '{tag}'"
    # OR, NOT, CONTAINS on names, and != (which structured requests cannot say).
    found = await dids(
        harness,
        {"query": f"DISCOVER * WHERE {t} AND (name CONTAINS 'TOOL' OR NOT tags CONTAINS 'ocr')"},
        QL,
    )
    assert set(found) == {entries["tool"]["entryDid"], entries["translator"]["entryDid"]}
    found = await dids(
        harness, {"query": f"DISCOVER * WHERE {t} AND customMetadata.team != 'finance'"}, QL
    )
    assert set(found) == {entries["tool"]["entryDid"], entries["translator"]["entryDid"]}
    # NOT lifecycleStatus mentions the field: the default (hide revoked) is dropped.
    found = await dids(
        harness, {"query": f"DISCOVER * WHERE {t} AND NOT lifecycleStatus = 'draft'"}, QL
    )
    assert set(found) == {entries["invoice"]["entryDid"], entries["revoked"]["entryDid"]}


async def test_registryql_multi_key_ordering_pages_consistently(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    entries = []
    for i in range(9):
        entries.append(
            await pub.publish(
                tags=[tag],
                name=f"n{i % 3}",
                publishedAt=f"2026-01-0{1 + i % 2}T00:00:00Z",
            )
        )
    # publishedAt ASC, then name DESC, then entryDid in the direction of the last key (DESC).
    by_did = sorted(entries, key=lambda e: e["entryDid"], reverse=True)
    by_name = sorted(by_did, key=lambda e: e["name"], reverse=True)
    expected = [e["entryDid"] for e in sorted(by_name, key=lambda e: e["publishedAt"])]
    query = f"DISCOVER * WHERE tags CONTAINS '{tag}' ORDER BY publishedAt ASC, name DESC"
    assert await dids(harness, {"query": query}, QL) == expected
    for limit in (1, 2, 4):
        pages = await page_all(harness, {"query": f"{query} LIMIT {limit}"}, QL)
        assert flat_dids(pages) == expected, limit
        assert all(len(p) == limit for p in pages[:-1])


async def test_registryql_paging_with_cursor(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    entries = await publish_many(pub, 11, tags=[tag])
    expected = sorted_dids(entries, lambda e: e["name"], descending=False)
    query = f"DISCOVER * WHERE tags CONTAINS '{tag}' ORDER BY name LIMIT 4"
    first = await discover(harness, {"query": query}, QL)
    assert first["totalCount"] == 11
    assert first["hasMore"] is True
    pages = await page_all(harness, {"query": query}, QL)
    assert [len(p) for p in pages] == [4, 4, 3]
    assert flat_dids(pages) == expected
    # The page size is the query's LIMIT; it may change between pages.
    wider = await discover(
        harness, {"query": query.replace("LIMIT 4", "LIMIT 50"), "cursor": first["cursor"]}, QL
    )
    assert [e["entryDid"] for e in wider["entries"]] == expected[4:]
    # LIMIT is clamped to 100; no LIMIT means 20.
    many = await publish_many(pub, 101, tags=[tag, "many"])
    base = f"DISCOVER * WHERE tags CONTAINS '{tag}' AND tags CONTAINS 'many'"
    assert len((await discover(harness, {"query": base}, QL))["entries"]) == 20
    clamped = await discover(harness, {"query": f"{base} LIMIT 100000"}, QL)
    assert len(clamped["entries"]) == 100
    assert clamped["totalCount"] == len(many)


async def test_registryql_cursor_errors(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    await publish_many(pub, 3, tags=[tag])
    query = f"DISCOVER * WHERE tags CONTAINS '{tag}' LIMIT 1"
    cursor = (await discover(harness, {"query": query}, QL))["cursor"]
    for other in (
        f"DISCOVER * WHERE tags CONTAINS '{scope()}' LIMIT 1",
        f"DISCOVER * WHERE tags CONTAINS '{tag}' ORDER BY name LIMIT 1",
        f"DISCOVER AgentDefinition WHERE tags CONTAINS '{tag}' LIMIT 1",
        "DISCOVER * LIMIT 1",
    ):
        r = await post(harness, {"query": other, "cursor": cursor}, QL)
        await error_of(r, 400, "invalid_cursor")
    r = await post(harness, {"query": query, "cursor": cursor[:-3] + "AAA"}, QL)
    await error_of(r, 400, "invalid_cursor")
    r = await post(harness, {"query": query + " OFFSET 1", "cursor": cursor}, QL)
    await error_of(r, 400, "invalid_cursor")
    # OFFSET alone pages by position.
    all_three = await dids(harness, {"query": query.replace("LIMIT 1", "")}, QL)
    assert await dids(harness, {"query": query + " OFFSET 2"}, QL) == all_three[2:]
    r = await post(harness, {"query": query + " OFFSET 10001"}, QL)
    await error_of(r, 400, "invalid_registryql")


async def test_registryql_syntax_error_is_400_with_line_and_column(harness: Harness) -> None:
    r = await post(harness, {"query": "DISCOVER agent WHERE name = 'x' FROM"}, QL)
    error = await error_of(r, 400, "invalid_registryql")
    assert error["details"]["line"] == 1
    assert error["details"]["column"] == 33
    assert error["details"]["found"] == "'FROM'"
    assert "end of query" in error["details"]["expected"]
    assert error["message"].startswith("line 1, column 33:")

    r = await post(harness, {"query": "DISCOVER *\nWHERE name = 'x'\n  AND AND"}, QL)
    error = await error_of(r, 400, "invalid_registryql")
    assert (error["details"]["line"], error["details"]["column"]) == (3, 7)

    r = await post(harness, {"query": "DISCOVER agent WHERE name = 'x"}, QL)
    error = await error_of(r, 400, "invalid_registryql")
    assert (error["details"]["line"], error["details"]["column"]) == (1, 29)

    for text in ("", "   ", "FIND *", "DISCOVER", "DISCOVER * LIMIT 0", "DISCOVER * ORDER BY x"):
        r = await post(harness, {"query": text}, QL)
        error = await error_of(r, 400, "invalid_registryql")
        assert {"line", "column", "expected"} <= set(error["details"]), text


async def test_registryql_unknown_field_is_400_at_its_position(harness: Harness) -> None:
    r = await post(harness, {"query": "DISCOVER agent WHERE nme = 'x'"}, QL)
    error = await error_of(r, 400, "invalid_registryql")
    assert (error["details"]["line"], error["details"]["column"]) == (1, 22)
    assert "unknown field 'nme'" in error["message"]
    r = await post(harness, {"query": "DISCOVER agent WHERE tags = 'x'"}, QL)
    error = await error_of(r, 400, "invalid_registryql")
    assert "operator = does not apply to tags" in error["message"]
    r = await post(harness, {"query": "DISCOVER agent ORDER BY relevance"}, QL)
    error = await error_of(r, 400, "invalid_registryql")
    assert "relevance" in error["message"]


async def test_registryql_request_body_errors(harness: Harness) -> None:
    for body in (
        {},
        {"query": 5},
        {"query": None},
        {"query": "DISCOVER *", "limit": 5},
        {"query": "DISCOVER *", "cursor": ""},
        {"query": "DISCOVER *", "cursor": 5},
        {"text": "x"},
    ):
        r = await post(harness, body, QL)
        raw = await r.get_data()
        assert r.status_code == 400, (body, raw)
        assert json.loads(raw)["error"]["code"] == "invalid_registryql", (body, raw)
    r = await post(harness, {"query": "DISCOVER *", "limit": 5}, QL)
    error = await error_of(r, 400, "invalid_registryql")
    assert "limit" in error["message"]
    client = anon_client(harness)
    for raw_body in (b"[]", b'"DISCOVER *"', b"null"):
        r = await client.post(QL, data=raw_body, headers=JSON)
        await error_of(r, 400, "invalid_registryql")
    r = await client.post(QL, data=b"{", headers=JSON)
    await error_of(r, 400, "invalid_json")
    # Over the 8 KiB query text limit (the body is still far below 64 KiB).
    long_text = "DISCOVER * WHERE " + " OR ".join(["name = 'x'"] * 800)
    r = await post(harness, {"query": long_text}, QL)
    await error_of(r, 400, "invalid_registryql")


async def test_registryql_relevance_with_a_second_key_pages_consistently(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    for i in range(10):
        await pub.publish(
            tags=[tag],
            name=f"n{i % 4}",
            description="invoice " * (1 + i % 3),
            publishedAt=f"2026-01-0{1 + i % 2}T00:00:00Z",
        )
    query = (
        f"DISCOVER * WHERE tags CONTAINS '{tag}' AND MATCH 'invoice' "
        "ORDER BY relevance DESC, publishedAt ASC, name DESC"
    )
    whole = await dids(harness, {"query": query + " LIMIT 100"}, QL)
    assert len(whole) == 10
    for limit in (1, 3):
        pages = await page_all(harness, {"query": f"{query} LIMIT {limit}"}, QL)
        assert flat_dids(pages) == whole, limit


async def test_a_query_of_more_than_sixteen_text_filters_is_400(
    harness: Harness,
) -> None:
    # Each CONTAINS or MATCH tests text on every candidate row, and a short CONTAINS uses no
    # index: sixteen are answered, a seventeenth is refused before the database is asked.
    terms = [f"description CONTAINS 'q{i}'" for i in range(8)]
    terms += [f"MATCH 'w{i}'" for i in range(8)]
    r = await post(harness, {"query": "DISCOVER * WHERE " + " OR ".join(terms)}, QL)
    assert r.status_code == 200, await r.get_data()
    more = [*terms, "NOT name CONTAINS 'x'"]
    r = await post(harness, {"query": "DISCOVER * WHERE " + " OR ".join(more)}, QL)
    error = await error_of(r, 400, "invalid_registryql")
    assert "more than 16 text filters" in error["message"]
    # Tags and service types are tests of arrays, on their indexes: not text filters.
    tags = " AND ".join(f"tags CONTAINS 't{i}'" for i in range(20))
    r = await post(harness, {"query": f"DISCOVER * WHERE {tags}"}, QL)
    assert r.status_code == 200, await r.get_data()
    r = await post(harness, {"entryType": "AgentDefinition", "tags": [f"t{i}" for i in range(20)]})
    assert r.status_code == 200, await r.get_data()


async def test_a_query_of_more_than_256_parentheses_is_400_at_the_one_too_many(
    harness: Harness,
) -> None:
    # Parsing costs about the query's tokens; 256 nodes never need more groups than that.
    nested = "(" * 256 + "name = 'x'" + ")" * 256
    r = await post(harness, {"query": f"DISCOVER * WHERE {nested}"}, QL)
    assert r.status_code == 200, await r.get_data()
    text = "DISCOVER * WHERE name = '((''(' AND\n" + "(" * 257 + "name = 'x'" + ")" * 257
    error = await error_of(await post(harness, {"query": text}, QL), 400, "invalid_registryql")
    assert (error["details"]["line"], error["details"]["column"]) == (2, 257)
    assert "more than 256 parentheses" in error["message"]


async def test_contains_matches_an_entrys_own_text_in_any_script(harness: Harness) -> None:
    """The pattern was lowered by Python and the column by PostgreSQL, which disagree (`İ`,
    a final `Σ`; under a C ctype PostgreSQL lowers ASCII only): an entry did not match its own
    name. Both are lowered by the database now."""
    pub = await publisher(harness)
    tag = scope()
    names = ["İstanbul guide", "ΟΔΟΣ helper", "École helper", "Straße 5"]
    made = {name: (await pub.publish(tags=[tag], name=name))["entryDid"] for name in names}
    for name, did in made.items():
        words = name.split()[0]
        q = f"DISCOVER * WHERE tags CONTAINS '{tag}' AND name CONTAINS '{words}'"
        assert await dids(harness, {"query": q}, QL) == [did], name
    q = f"DISCOVER * WHERE tags CONTAINS '{tag}' AND name CONTAINS 'HELPER'"  # ASCII: any case
    assert sorted(await dids(harness, {"query": q}, QL)) == sorted(
        [made["ΟΔΟΣ helper"], made["École helper"]]
    )
