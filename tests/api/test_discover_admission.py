"""Admission of discovery requests: 400 for invalid requests, 413 over the 64 KiB body limit
(checked before parsing, on both discovery endpoints), and the `query` rate class (429)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from tests.api.api_support import JSON, anon_client, error_of, with_harness
from tests.api.test_discover import discover, post, publisher, scope
from tests.conftest import Harness, make_config
from tests.helpers import bearer, new_did

KIB = 1024
LIMIT = 64 * KIB
ENDPOINTS = ("/v1/discover", "/v1/discover/registryql")


def padded(body: dict, size: int) -> bytes:
    """`body` as JSON text of exactly `size` bytes (whitespace after the object is still JSON)."""
    text = json.dumps(body, separators=(",", ":")).encode()
    assert len(text) <= size
    return text + b" " * (size - len(text))


def valid_body(path: str, tag: str) -> dict:
    if path == "/v1/discover":
        return {"tags": [tag]}
    return {"query": f"DISCOVER * WHERE tags CONTAINS '{tag}'"}


# --- 400 -------------------------------------------------------------------------------------


async def test_unknown_field_is_400_naming_it(harness: Harness) -> None:
    for body, field in (
        ({"foo": 1}, "foo"),
        ({"tags": ["a"], "sort": "name"}, "sort"),
        ({"entry_type": "*"}, "entry_type"),  # wire names are camelCase only
        ({"orderby": "name"}, "orderby"),
        ({"query": "DISCOVER *"}, "query"),  # RegistryQL belongs to its own endpoint
        ({"relationship": {"kind": "dependsOn"}}, "relationship.kind"),
    ):
        error = await error_of(await post(harness, body), 400, "invalid_query")
        assert field in error["message"], error
        assert error["details"]["errors"][0]["field"] == field
        assert error["details"]["errors"][0]["reason"] == "unknown field"


async def test_wrong_types_are_400(harness: Harness) -> None:
    cases: list[dict[str, Any]] = [
        {"entryType": 5},
        {"entryType": ""},
        {"entryType": "1agent"},
        {"entryType": "a b"},
        {"entryType": ["*"]},
        {"text": 5},
        {"text": ""},
        {"text": "x" * 513},
        {"tags": "ocr"},
        {"tags": [1]},
        {"tags": [""]},
        {"tags": ["x"] * 101},
        {"anyTags": "ocr"},
        {"anyTags": []},
        {"publisherDid": "not a did"},
        {"publisherDid": 7},
        {"lifecycleStatus": "active"},
        {"lifecycleStatus": []},
        {"lifecycleStatus": ["deleted"]},
        {"lifecycleStatus": ["Active"]},
        {"serviceType": ["MCP"]},
        {"serviceType": "not a token"},
        {"relationship": "dependsOn"},
        {"relationship": {"targetDid": "nope"}},
        {"relationship": {"relationshipType": 1}},
        {"metadata": ["team"]},
        {"metadata": {"team": ["a"]}},
        {"metadata": {"team": {"a": 1}}},
        {"metadata": {"bad key": "x"}},
        {"metadata": {f"k{i}": i for i in range(33)}},
        {"publishedAfter": "yesterday"},
        {"publishedBefore": "2026-01-01"},
        {"updatedAfter": 1700000000},
        {"updatedBefore": "2026-01-01T00:00:00"},  # no offset
        {"orderBy": "popularity"},
        {"orderBy": "Name"},
        {"order": "up"},
        {"order": "ASC", "orderBy": "name"},
        {"limit": "5"},
        {"limit": 5.5},
        {"limit": True},
        {"offset": "1"},
        {"cursor": 1},
    ]
    for body in cases:
        r = await post(harness, body)
        raw = await r.get_data()
        assert r.status_code == 400, (body, raw)
        error = json.loads(raw)["error"]
        assert error["code"] == "invalid_query", (body, error)
        field = next(iter(body))
        assert field in error["message"], (body, error)


async def test_limit_below_1_is_400(harness: Harness) -> None:
    for limit in (0, -1):
        error = await error_of(await post(harness, {"limit": limit}), 400, "invalid_limit")
        assert "limit" in error["message"]


async def test_ordering_rules_are_400(harness: Harness) -> None:
    # relevance ranks by text: without text there is nothing to rank by.
    await error_of(await post(harness, {"orderBy": "relevance"}), 400, "invalid_order")
    # A direction alone does not say what to order by.
    await error_of(await post(harness, {"order": "asc"}), 400, "invalid_order")


async def test_body_must_be_a_json_object(harness: Harness) -> None:
    client = anon_client(harness)
    for body in (b"[]", b"null", b'"x"', b"1", b"true"):
        r = await client.post("/v1/discover", data=body, headers=JSON)
        await error_of(r, 400, "invalid_query")
    for body in (b"{", b"", b'{"limit": 1, "limit": 2}', b'{"limit": 9007199254740993}'):
        r = await client.post("/v1/discover", data=body, headers=JSON)
        await error_of(r, 400, "invalid_json")
    r = await client.post("/v1/discover", data=b"{}", headers={"Content-Type": "text/plain"})
    await error_of(r, 415, "unsupported_media_type")
    # No Content-Type at all is tolerated (the body must still be JSON).
    r = await client.post("/v1/discover", data=b"{}")
    assert r.status_code == 200


async def test_null_members_mean_absent(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    await pub.publish(tags=[tag])
    nulls = {
        "entryType": None,  # all types, as when absent (it was 400: "should be a valid string")
        "text": None,
        "anyTags": None,
        "publisherDid": None,
        "lifecycleStatus": None,
        "serviceType": None,
        "relationship": None,
        "metadata": None,
        "orderBy": None,
        "order": None,
        "limit": None,
        "cursor": None,
        "offset": None,
        "publishedAfter": None,
        "publishedBefore": None,
        "updatedAfter": None,
        "updatedBefore": None,
    }
    assert (await discover(harness, {"tags": [tag], **nulls}))["totalCount"] == 1
    assert (await discover(harness, {"tags": None, "entryType": None}))["totalCount"] >= 1
    # Federated discovery requires entryType: null names no type, as absent does.
    for body in ({}, {"entryType": None}):
        r = await pub.h.client.post("/v1/discover/federated", json=body, headers=bearer(pub.token))
        error = await error_of(r, 400, "invalid_query")
        assert error["details"] == {"field": "entryType"}


# --- 413 -------------------------------------------------------------------------------------


async def test_body_over_64_kib_is_413_with_content_length(harness: Harness) -> None:
    client = anon_client(harness)
    for path in ENDPOINTS:
        body = padded(valid_body(path, scope()), LIMIT + 1)
        r = await client.post(path, data=body, headers={**JSON, "Content-Length": str(len(body))})
        error = await error_of(r, 413, "body_too_large")
        assert error["details"]["limitBytes"] == LIMIT


async def test_body_over_64_kib_is_413_without_content_length(harness: Harness) -> None:
    client = anon_client(harness)
    for path in ENDPOINTS:
        body = padded(valid_body(path, scope()), LIMIT + 1)
        r = await client.post(path, data=body, headers=JSON)
        error = await error_of(r, 413, "body_too_large")
        assert error["details"]["limitBytes"] == LIMIT


async def test_body_over_64_kib_declared_small_is_413(harness: Harness) -> None:
    client = anon_client(harness)
    for path in ENDPOINTS:
        body = padded(valid_body(path, scope()), 2 * LIMIT)
        r = await client.post(path, data=body, headers={**JSON, "Content-Length": "100"})
        await error_of(r, 413, "body_too_large")


async def test_413_is_decided_before_parsing(harness: Harness) -> None:
    """Oversized garbage is 413, not 400: the body is never parsed."""
    client = anon_client(harness)
    garbage = b"{" + b"x" * LIMIT
    for path in ENDPOINTS:
        for headers in ({**JSON, "Content-Length": str(len(garbage))}, JSON):
            r = await client.post(path, data=garbage, headers=headers)
            await error_of(r, 413, "body_too_large")
        # Just under the limit, the same garbage is parsed and refused as JSON.
        r = await client.post(path, data=garbage[:LIMIT], headers=JSON)
        await error_of(r, 400, "invalid_json")


async def test_body_of_exactly_64_kib_is_accepted(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    entry = await pub.publish(tags=[tag])
    client = anon_client(harness)
    for path in ENDPOINTS:
        body = padded(valid_body(path, tag), LIMIT)
        r = await client.post(path, data=body, headers={**JSON, "Content-Length": str(LIMIT)})
        assert r.status_code == 200, (await r.get_data())[:300]
        assert [e["entryDid"] for e in (await r.get_json())["entries"]] == [entry["entryDid"]]
        r = await client.post(path, data=body, headers=JSON)
        assert r.status_code == 200


# --- 429 -------------------------------------------------------------------------------------


async def test_query_rate_limit_is_429_with_retry_after(database_url: str, tmp_path: Path) -> None:
    config = make_config(database_url, tmp_path, limits={"query_per_minute": 2})

    async def body(h: Harness) -> None:
        with trio.fail_after(30):
            client = anon_client(h)
            # A 413 on a declared length is refused before the limiter: it takes no token.
            big = padded({}, LIMIT + 1)
            r = await client.post(
                "/v1/discover", data=big, headers={**JSON, "Content-Length": str(len(big))}
            )
            await error_of(r, 413, "body_too_large")
            r = await client.post("/v1/discover", json={"tags": [scope()]})
            assert r.status_code == 200, await r.get_data()
            assert r.headers["RateLimit-Limit"] == "2"
            assert r.headers["RateLimit-Remaining"] == "1"
            r = await client.post("/v1/discover/registryql", json={"query": "DISCOVER *"})
            assert r.status_code == 200, await r.get_data()
            assert r.headers["RateLimit-Remaining"] == "0"
            # Both discovery endpoints draw on the one query bucket.
            for path, request in (
                ("/v1/discover", {}),
                ("/v1/discover/registryql", {"query": "DISCOVER *"}),
            ):
                r = await client.post(path, json=request)
                error = await error_of(r, 429, "query_rate_limited")
                retry_after = int(r.headers["Retry-After"])
                assert 1 <= retry_after <= 60
                assert r.headers["RateLimit-Limit"] == "2"
                assert r.headers["RateLimit-Remaining"] == "0"
                assert error["details"]["retryAfterSeconds"] > 0
            # An invalid query is still refused by the limiter first: 429, not 400.
            r = await client.post("/v1/discover", json={"limit": 0})
            await error_of(r, 429, "query_rate_limited")
            # Reads and writes are other classes.
            r = await client.get(f"/v1/entries/{new_did()}")
            await error_of(r, 404, "entry_not_found")
            r = await client.post("/v1/auth/siws/challenge", json={"audience": "a"})
            assert r.status_code == 200

    await with_harness(config, body)
