"""Admission limits (413), rate limits (429 and RateLimit-* headers), unknown routes and methods,
and the absence of stack traces in error bodies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from werkzeug.datastructures import Headers

from registry.keys import SigningKey
from tests.api.api_support import JSON, anon_client, create, error_of, with_harness
from tests.conftest import Harness, make_config
from tests.helpers import bearer, idem, new_did, sign_in, signed_entry

MIB = 1024 * 1024


def _entry_body_of_size(key: SigningKey, size: int) -> bytes:
    """A valid signed entry whose compact JSON text is exactly `size` bytes."""
    did = new_did()

    def body(pad: int) -> bytes:
        entry = signed_entry(key, did, itemData={"blob": "x" * pad})
        return json.dumps(entry, separators=(",", ":")).encode()

    base = len(body(0))
    out = body(size - base)
    assert len(out) == size
    return out


# --- 413 ------------------------------------------------------------------------------------


async def test_entry_body_over_1_mib_with_content_length_is_413(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    body = _entry_body_of_size(key, MIB + 1)
    headers = bearer(token, **idem(**JSON, **{"Content-Length": str(len(body))}))
    r = await harness.client.post("/v1/entries", data=body, headers=headers)
    error = await error_of(r, 413, "body_too_large")
    assert error.get("details", {}).get("limitBytes", MIB) == MIB
    did = json.loads(body)["entryDid"]
    r = await harness.client.get(f"/v1/entries/{did}")
    assert r.status_code == 404


async def test_entry_body_over_limit_declared_small_is_413(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    body = _entry_body_of_size(key, 2 * MIB)
    headers = bearer(token, **idem(**JSON, **{"Content-Length": "100"}))
    r = await harness.client.post("/v1/entries", data=body, headers=headers)
    await error_of(r, 413, "body_too_large")


async def test_entry_body_over_limit_without_content_length_is_413(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    body = _entry_body_of_size(key, MIB + 1)
    r = await harness.client.post("/v1/entries", data=body, headers=bearer(token, **idem(**JSON)))
    await error_of(r, 413, "body_too_large")


async def test_oversized_body_is_refused_before_authentication(harness: Harness) -> None:
    body = b'{"a":"' + b"x" * (2 * MIB) + b'"}'
    r = await anon_client(harness).post(
        "/v1/entries", data=body, headers={**JSON, **idem(), "Content-Length": str(len(body))}
    )
    await error_of(r, 413, "body_too_large")


async def test_entry_body_of_exactly_1_mib_is_accepted(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    body = _entry_body_of_size(key, MIB)
    headers = bearer(token, **idem(**JSON, **{"Content-Length": str(len(body))}))
    r = await harness.client.post("/v1/entries", data=body, headers=headers)
    assert r.status_code == 201, (await r.get_data())[:300]


async def test_oversized_update_is_413(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    body = b'{"a":"' + b"x" * (MIB + 10) + b'"}'
    r = await harness.client.put(
        f"/v1/entries/{first['entryDid']}",
        data=body,
        headers=bearer(token, **idem(**JSON, **{"Content-Length": str(len(body))})),
    )
    await error_of(r, 413, "body_too_large")


async def test_oversized_challenge_request_is_413(harness: Harness) -> None:
    body = json.dumps({"audience": "x" * (128 * 1024)}).encode()
    r = await anon_client(harness).post(
        "/v1/auth/siws/challenge", data=body, headers={**JSON, "Content-Length": str(len(body))}
    )
    await error_of(r, 413, "body_too_large")


# --- 429 and RateLimit-* --------------------------------------------------------------------


def _assert_rate_headers(response: Any, limit: int, remaining: int | None = None) -> None:
    for name in ("RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset", "X-Request-Id"):
        assert len(response.headers.getlist(name)) == 1, name
    assert response.headers.get("RateLimit-Limit") == str(limit)
    assert response.headers.get("RateLimit-Remaining") is not None
    assert int(response.headers["RateLimit-Remaining"]) >= 0
    if remaining is not None:
        assert int(response.headers["RateLimit-Remaining"]) == remaining
    assert response.headers.get("RateLimit-Reset") is not None
    assert int(response.headers["RateLimit-Reset"]) >= 0


async def test_successful_responses_carry_rate_limit_headers(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    assert r.status_code == 201
    _assert_rate_headers(r, 100_000)
    r = await harness.client.get(f"/v1/entries/{entry['entryDid']}")
    assert r.status_code == 200
    _assert_rate_headers(r, 100_000)
    r = await harness.client.get(f"/v1/entries/{entry['entryDid']}/versions")
    _assert_rate_headers(r, 100_000)
    r = await harness.client.get("/v1/health")
    _assert_rate_headers(r, 100_000)


async def test_write_rate_limit_is_429_with_headers(database_url: str, tmp_path: Path) -> None:
    config = make_config(database_url, tmp_path, limits={"write_per_minute": 4})

    async def body(h: Harness) -> None:
        with trio.fail_after(30):
            # Two sign-ins: 4 anonymous writes (challenge + verify each), the client's bucket.
            key = SigningKey.generate()
            token = await sign_in(anon_client(h), key)
            other = SigningKey.generate()
            other_token = await sign_in(anon_client(h), other)
            r = await anon_client(h).post("/v1/auth/siws/challenge", json={"audience": "a"})
            await error_of(r, 429, "write_rate_limited")
            remaining = []
            for _ in range(4):
                r = await h.client.post(
                    "/v1/entries", json=signed_entry(key), headers=bearer(token, **idem())
                )
                assert r.status_code == 201, await r.get_data()
                _assert_rate_headers(r, 4)
                remaining.append(int(r.headers["RateLimit-Remaining"]))
            assert remaining == [3, 2, 1, 0]
            refused = signed_entry(key)
            r = await h.client.post("/v1/entries", json=refused, headers=bearer(token, **idem()))
            error = await error_of(r, 429, "write_rate_limited")
            retry_after = int(r.headers["Retry-After"])
            assert 1 <= retry_after <= 60
            _assert_rate_headers(r, 4, remaining=0)
            assert int(r.headers["RateLimit-Reset"]) >= 1
            assert error["details"]["retryAfterSeconds"] > 0
            r = await h.client.get(f"/v1/entries/{refused['entryDid']}")
            assert r.status_code == 404  # nothing was written
            # Other write operations share the class; reads do not.
            r = await h.client.post("/v1/auth/logout", headers=bearer(token, **idem()))
            await error_of(r, 429, "write_rate_limited")
            r = await h.client.get("/v1/auth/session", headers=bearer(token))
            assert r.status_code == 200
            # Buckets are per principal: another publisher still has its own.
            r = await h.client.post(
                "/v1/entries", json=signed_entry(other), headers=bearer(other_token, **idem())
            )
            assert r.status_code == 201, await r.get_data()

    await with_harness(config, body)


async def test_anonymous_write_rate_limit(database_url: str, tmp_path: Path) -> None:
    config = make_config(database_url, tmp_path, limits={"write_per_minute": 2})

    async def body(h: Harness) -> None:
        with trio.fail_after(30):
            client = anon_client(h)
            for _ in range(2):
                r = await client.post("/v1/auth/siws/challenge", json={"audience": "a"})
                assert r.status_code == 200
            r = await client.post("/v1/auth/siws/challenge", json={"audience": "a"})
            await error_of(r, 429, "write_rate_limited")
            assert int(r.headers["Retry-After"]) >= 1

    await with_harness(config, body)


async def test_read_rate_limit_is_429_with_headers(database_url: str, tmp_path: Path) -> None:
    config = make_config(database_url, tmp_path, limits={"read_per_minute": 3})

    async def body(h: Harness) -> None:
        with trio.fail_after(30):
            key = SigningKey.generate()
            token = await sign_in(anon_client(h), key)
            entry = await create(h, key, token)  # writes do not use read tokens
            client = anon_client(h)
            path = f"/v1/entries/{entry['entryDid']}"
            for expected in (2, 1, 0):
                r = await client.get(path)
                assert r.status_code == 200
                _assert_rate_headers(r, 3, remaining=expected)
            r = await client.get(path)
            await error_of(r, 429, "read_rate_limited")
            assert 1 <= int(r.headers["Retry-After"]) <= 60
            _assert_rate_headers(r, 3, remaining=0)
            # The whole read class shares the bucket.
            for other in (f"{path}/versions", f"{path}/lineage", "/v1/health"):
                r = await client.get(other)
                await error_of(r, 429, "read_rate_limited")
            # Writes are a separate class.
            r = await h.client.post(
                "/v1/entries", json=signed_entry(key), headers=bearer(token, **idem())
            )
            assert r.status_code == 201, await r.get_data()
            # An authenticated reader has a bucket of its own.
            r = await client.get("/v1/auth/session", headers=bearer(token))
            assert r.status_code == 200

    await with_harness(config, body)


async def test_requests_no_route_takes_spend_the_address_read_budget(
    database_url: str, tmp_path: Path
) -> None:
    """A 404, 405 or 308 spent no budget: an address could send them without end (each a head
    parsed, a request context, an answer and an access line). They spend the address's read
    budget as a read does."""
    config = make_config(database_url, tmp_path, limits={"read_per_minute": 4})

    async def body(h: Harness) -> None:
        with trio.fail_after(30):
            client = anon_client(h)
            await error_of(await client.get("/nope"), 404, "route_not_found")
            await error_of(await client.post("/v1/health"), 405, "method_not_allowed")
            await error_of(await client.get("/v1/%2F"), 404, "route_not_found")
            r = await client.get("/console")  # a 308 to the canonical path spends too
            assert r.status_code == 308, await r.get_data()
            r = await client.get("/nope")
            await error_of(r, 429, "read_rate_limited")
            assert 1 <= int(r.headers["Retry-After"]) <= 60
            # The same bucket as the routes' reads.
            await error_of(await client.get("/v1/health"), 429, "read_rate_limited")

    await with_harness(config, body)


async def test_a_request_refused_before_any_route_spends_the_address_read_budget(
    database_url: str, tmp_path: Path
) -> None:
    """docs/limits.md: another 4xx answered before any route spends the read budget too. A
    Registry-Min-Sequence that is no sequence (400 before the route) spent nothing, on any path:
    free to send without end, as a 404 was."""
    config = make_config(database_url, tmp_path, limits={"read_per_minute": 3})

    async def body(h: Harness) -> None:
        with trio.fail_after(30):
            client = anon_client(h)
            bad = {"Registry-Min-Sequence": "x"}
            for path in ("/v1/health", "/nope", "/v1/health"):
                await error_of(await client.get(path, headers=bad), 400, "invalid_min_sequence")
            await error_of(await client.get("/v1/health", headers=bad), 429, "read_rate_limited")
            await error_of(await client.get("/v1/health"), 429, "read_rate_limited")

    await with_harness(config, body)


async def test_behind_a_proxy_the_budget_is_the_address_the_proxy_wrote(
    database_url: str, tmp_path: Path
) -> None:
    """With one trusted proxy, the budget is the last element of X-Forwarded-For, over every
    line of the header in order (a proxy may add a line of its own after the client's): the
    client cannot pick its budget with a line or an element of its own, and an element that is
    not an address counts the request under the TCP peer."""
    config = make_config(
        database_url, tmp_path, server={"trusted_proxies": 1}, limits={"read_per_minute": 2}
    )

    def via_proxy(*lines: str) -> Headers:
        return Headers([("X-Forwarded-For", line) for line in lines])

    async def body(h: Harness) -> None:
        client = anon_client(h)
        with trio.fail_after(30):
            for i in range(2):  # the client's own line differs each time; the proxy's does not
                r = await client.get("/v1/health", headers=via_proxy(f"x{i} a=b", "203.0.113.7"))
                assert r.status_code == 200
            r = await client.get("/v1/health", headers=via_proxy("x9, 198.51.100.1", "203.0.113.7"))
            await error_of(r, 429, "read_rate_limited")
            r = await client.get("/v1/health", headers=via_proxy("203.0.113.8"))
            assert r.status_code == 200  # another client's budget
            for i in range(2):  # not an address: the peer's budget, whatever the text
                r = await client.get("/v1/health", headers=via_proxy(f"203.0.113.7, bogus-{i}"))
                assert r.status_code == 200
            r = await client.get("/v1/health", headers=via_proxy("bogus-9"))
            await error_of(r, 429, "read_rate_limited")
            # 203.0.113.7, 203.0.113.8 and the peer: no text of a client became a key
            assert h.deps.limiter.statistics()["buckets"] == 3

    await with_harness(config, body)


# --- routes and methods -----------------------------------------------------------------------


async def test_unknown_route_is_404_error_response(harness: Harness) -> None:
    client = anon_client(harness)
    for path in ("/v1/nope", "/nope", "/v2/entries", "/v1/entries/a/b/c/d"):
        r = await client.get(path)
        await error_of(r, 404, "route_not_found")
    r = await client.post("/v1/nope", json={})
    await error_of(r, 404, "route_not_found")


async def test_wrong_method_is_405_error_response(harness: Harness) -> None:
    client = anon_client(harness)
    did = new_did()
    for method, path in (
        ("PATCH", f"/v1/entries/{did}"),
        ("DELETE", "/v1/entries"),
        ("GET", "/v1/auth/logout"),
        ("PUT", "/v1/health"),
        ("POST", f"/v1/entries/{did}/versions"),
    ):
        r = await client.open(path, method=method)
        await error_of(r, 405, "method_not_allowed")


async def test_405_lists_the_allowed_methods(harness: Harness) -> None:
    """RFC 9110 §15.5.6: a 405 response MUST carry an Allow header."""
    r = await anon_client(harness).open("/v1/entries", method="DELETE")
    assert r.status_code == 405
    allow = {m.strip().upper() for m in r.headers.get("Allow", "").split(",") if m.strip()}
    assert "POST" in allow


async def test_client_request_id_is_echoed(harness: Harness) -> None:
    client = anon_client(harness)
    r = await client.get("/v1/health", headers={"X-Request-Id": "trace-123"})
    assert r.headers["X-Request-Id"] == "trace-123"
    r = await client.get(f"/v1/entries/{new_did()}", headers={"X-Request-Id": "trace-456"})
    error = await error_of(r, 404, "entry_not_found")
    assert error["requestId"] == "trace-456"
    # An unusable id is replaced, not echoed.
    r = await client.get("/v1/health", headers={"X-Request-Id": "bad id\twith spaces"})
    assert r.headers["X-Request-Id"] != "bad id\twith spaces"
    assert r.headers["X-Request-Id"]


async def test_error_bodies_never_contain_tracebacks(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = await create(harness, key, token)
    did = entry["entryDid"]
    client = anon_client(harness)
    auth = bearer(token, **idem(**JSON))
    requests: list[tuple[str, str, Any, dict[str, str]]] = [
        ("POST", "/v1/entries", b"{", auth),
        ("POST", "/v1/entries", b'{"entryDid": []}', auth),
        ("POST", "/v1/entries", b"[1, 2, {}]", auth),
        ("POST", "/v1/entries", b'{"a": ' * 200 + b"1" + b"}" * 200, auth),
        ("POST", "/v1/entries", b'"\\udc00"', auth),
        ("POST", "/v1/entries", b"\x00\x01\x02", auth),
        ("PUT", f"/v1/entries/{did}", b"null", auth),
        ("PUT", f"/v1/entries/{did}", b'{"sequence": "x"}', auth),
        ("PUT", f"/v1/entries/{did}", json.dumps({**entry, "sequence": -1}).encode(), auth),
        ("POST", "/v1/auth/siws/challenge", b'{"audience": {"$gt": ""}}', JSON),
        ("POST", "/v1/auth/siws/verify", b"{}", JSON),
        ("POST", "/v1/auth/siws/verify", b'{"audience":"a","challenge":1,"response":2}', JSON),
        (
            "POST",
            "/v1/auth/siws/verify",
            json.dumps({"audience": "a", "challenge": {}, "response": {}}).encode(),
            JSON,
        ),
        ("POST", "/v1/auth/logout", b"{", auth),
        ("GET", f"/v1/entries/{did}/versions?limit=99999999999999999999", b"", {}),
        ("GET", f"/v1/entries/{did}/versions?cursor=a%00b", b"", {}),
        ("GET", "/v1/entries/%ff%fe", b"", {}),
        ("GET", "/v1/auth/session", b"", {"Authorization": "Bearer \u00e9"}),
    ]
    for method, path, body, headers in requests:
        r = await client.open(path, method=method, data=body, headers=headers)
        raw = (await r.get_data()).decode("utf-8", "replace")
        assert r.headers.get("X-Request-Id"), (method, path)
        assert "Traceback" not in raw, (method, path, raw)
        assert 'File "' not in raw, (method, path, raw)
        assert r.status_code < 500, (method, path, r.status_code, raw)
        if r.status_code >= 400:
            parsed = json.loads(raw)
            assert set(parsed) == {"error"}
            assert {"code", "message", "requestId"} <= set(parsed["error"])


async def test_new_keys_never_buy_an_address_more_writes(database_url: str, tmp_path: Path) -> None:
    """Each principal has its own write bucket, but every write from one address also spends
    the address's (`write_per_minute_per_address`): keys are free to make."""
    config = make_config(
        database_url, tmp_path, limits={"write_per_minute": 100, "write_per_minute_per_address": 6}
    )

    async def body(h: Harness) -> None:
        with trio.fail_after(30):
            first, second = SigningKey.generate(), SigningKey.generate()
            first_token = await sign_in(anon_client(h), first)  # 2 of the address's 6
            second_token = await sign_in(anon_client(h), second)  # 4 of 6
            for key, token in ((first, first_token), (second, second_token)):
                r = await h.client.post(
                    "/v1/entries", json=signed_entry(key), headers=bearer(token, **idem())
                )
                assert r.status_code == 201, await r.get_data()
            refused = signed_entry(second)
            r = await h.client.post(
                "/v1/entries", json=refused, headers=bearer(second_token, **idem())
            )
            error = await error_of(r, 429, "write_rate_limited")
            assert error["details"]["retryAfterSeconds"] > 0
            assert int(r.headers["Retry-After"]) >= 1
            r = await h.client.get(f"/v1/entries/{refused['entryDid']}")
            assert r.status_code == 404  # nothing was written
            r = await anon_client(h).post("/v1/auth/siws/challenge", json={"audience": "a"})
            await error_of(r, 429, "write_rate_limited")  # nor can it sign in a new key

    await with_harness(config, body)


async def test_new_keys_never_buy_an_address_more_queries(
    database_url: str, tmp_path: Path
) -> None:
    """Federated discovery is keyed by its principal, and each one costs every peer a query:
    every query from an address also spends the address's `query_per_minute_per_address`."""
    config = make_config(
        database_url, tmp_path, limits={"query_per_minute": 100, "query_per_minute_per_address": 3}
    )
    query = {"entryType": "AgentDefinition"}

    async def body(h: Harness) -> None:
        with trio.fail_after(30):
            tokens = [await sign_in(anon_client(h), SigningKey.generate()) for _ in range(2)]
            for token in (tokens[0], tokens[0], tokens[1]):
                r = await h.client.post("/v1/discover/federated", json=query, headers=bearer(token))
                assert r.status_code == 200, await r.get_data()
            r = await h.client.post("/v1/discover/federated", json=query, headers=bearer(tokens[1]))
            error = await error_of(r, 429, "query_rate_limited")
            assert error["details"]["retryAfterSeconds"] > 0
            r = await anon_client(h).post("/v1/discover", json=query)
            await error_of(r, 429, "query_rate_limited")  # the address's budget is spent

    await with_harness(config, body)


async def test_an_address_has_a_budget_of_body_bytes(database_url: str, tmp_path: Path) -> None:
    """What a body costs to parse and verify grows with its bytes: an address's bodies share
    `body_bytes_per_minute_per_address`, spent before that work; a body larger than the whole
    budget passes on a full one (and empties it)."""
    config = make_config(
        database_url,
        tmp_path,
        server={"trusted_proxies": 1},
        limits={"body_bytes_per_minute_per_address": 4096},
    )

    async def body(h: Harness) -> None:
        key = SigningKey.generate()
        token = await sign_in(h.client, key)  # from the TCP peer: its own budget

        async def post(size: int, address: str) -> Any:
            data = _entry_body_of_size(key, size)
            headers = bearer(token, **idem(**JSON, **{"X-Forwarded-For": address}))
            return await h.client.post("/v1/entries", data=data, headers=headers), data

        with trio.fail_after(30):
            r, _ = await post(3000, "203.0.113.1")
            assert r.status_code == 201, await r.get_data()
            r, data = await post(3000, "203.0.113.1")
            await error_of(r, 429, "write_rate_limited")
            _assert_rate_headers(r, 4096, remaining=0)  # the budget that refused it, once
            assert int(r.headers["RateLimit-Reset"]) >= int(r.headers["Retry-After"]) >= 1
            did = json.loads(data)["entryDid"]
            assert (await h.client.get(f"/v1/entries/{did}")).status_code == 404
            r, _ = await post(6000, "203.0.113.2")  # more than the budget, on a full one
            assert r.status_code == 201, await r.get_data()
            r, _ = await post(1500, "203.0.113.2")
            await error_of(r, 429, "write_rate_limited")

    await with_harness(config, body)


async def test_an_address_pays_for_its_queries_database_time(
    database_url: str, tmp_path: Path
) -> None:
    """A query's database time is paid after it ran, from its client address's
    `query_db_ms_per_minute_per_address`: once in debt, the address is refused (any query
    route, even a page the result cache holds) until the budget refills; another address is
    not."""
    config = make_config(
        database_url,
        tmp_path,
        server={"trusted_proxies": 1},
        limits={"query_db_ms_per_minute_per_address": 1},  # 1 ms a minute
    )

    def at(address: str) -> dict[str, str]:
        return {"X-Forwarded-For": address}

    async def body(h: Harness) -> None:
        key = SigningKey.generate()
        await create(h, key, await sign_in(h.client, key))
        with trio.fail_after(30):
            served = 0
            for i in range(200):  # distinct texts: each a statement, none from the cache
                r = await h.client.post(
                    "/v1/discover", json={"text": f"agent{i}"}, headers=at("203.0.113.7")
                )
                if r.status_code != 200:
                    break
                served += 1
            else:
                raise AssertionError("200 statements never spent 1 ms of database time")
            assert served >= 1  # the first one always runs: the budget is paid after the fact
            error = await error_of(r, 429, "query_rate_limited")
            assert "database time" in error["message"]
            assert r.headers["RateLimit-Limit"] == "1"  # the budget that refused it, in ms
            assert int(r.headers["Retry-After"]) >= 1
            r = await h.client.post(
                "/v1/discover/registryql",
                json={"query": "DISCOVER *"},
                headers=at("203.0.113.7"),
            )
            await error_of(r, 429, "query_rate_limited")
            r = await h.client.post(
                "/v1/discover", json={"text": "agent0"}, headers=at("203.0.113.8")
            )
            assert r.status_code == 200, await r.get_data()

    await with_harness(config, body)


async def test_an_address_runs_a_few_queries_at_once(database_url: str, tmp_path: Path) -> None:
    """What a running query costs is known only when it ends: an address runs at most
    `query_concurrency_per_address` at once, so a burst cannot outrun its database time."""
    config = make_config(
        database_url,
        tmp_path,
        server={"trusted_proxies": 1},
        limits={"query_concurrency_per_address": 2},
    )

    async def body(h: Harness) -> None:
        store = h.deps.discovery.store
        original = store.discover
        release, both_running = trio.Event(), trio.Event()
        running = 0

        async def held(*args: Any, **kwargs: Any) -> Any:
            nonlocal running
            running += 1
            if running == 2:
                both_running.set()
            await release.wait()
            return await original(*args, **kwargs)

        store.discover = held  # type: ignore[method-assign]
        answers: list[int] = []

        async def query(text: str, address: str) -> None:
            r = await h.client.post(
                "/v1/discover", json={"text": text}, headers={"X-Forwarded-For": address}
            )
            answers.append(r.status_code)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(query, "one", "203.0.113.9")
                nursery.start_soon(query, "two", "203.0.113.9")
                await both_running.wait()
                r = await h.client.post(
                    "/v1/discover",
                    json={"text": "three"},
                    headers={"X-Forwarded-For": "203.0.113.9"},
                )
                error = await error_of(r, 429, "query_rate_limited")
                assert "running" in error["message"]
                assert r.headers["RateLimit-Limit"] == "2"
                nursery.start_soon(query, "four", "203.0.113.10")  # another address: its own
                release.set()
            assert answers == [200, 200, 200]
            r = await h.client.post(
                "/v1/discover", json={"text": "five"}, headers={"X-Forwarded-For": "203.0.113.9"}
            )
            assert r.status_code == 200, await r.get_data()

    await with_harness(config, body)


async def test_an_answer_that_fails_after_its_route_carries_only_the_error_answers_headers(
    database_url: str, tmp_path: Path
) -> None:
    """A route's own headers go to the ASGI entry apart from its response (api/headers.py): when
    something fails after the route answered (a hook), the 500 that replaces the answer carries
    its own request id once, not the route's headers too; and a route header value with a line
    break is refused as werkzeug refused it, with a JSON 500."""
    from quart import Response

    from api.http import Ctx, endpoint

    async def body(h: Harness) -> None:
        app = h.service.app

        @app.after_request
        async def fail_when_asked(response: Response) -> Response:
            if response.status_code == 200 and "x-fail-after" in {
                k.lower() for k in app_request_headers()
            }:
                raise RuntimeError("a hook after the route failed")
            return response

        @app.get("/v1/test-broken-header")
        @endpoint("read")
        async def broken(ctx: Ctx) -> Response:
            ctx.extra_headers["ETag"] = '"s1"\r\nSet-Cookie: x=1'
            return Response("{}", content_type="application/json")

        client = anon_client(h)
        r = await client.get("/v1/health", headers={"X-Fail-After": "1"})
        error = await error_of(r, 500, "internal_error")
        assert r.headers.getlist("X-Request-Id") == [error["requestId"]]
        assert r.headers.get("RateLimit-Limit") is None
        r = await client.get("/v1/test-broken-header")
        error = await error_of(r, 500, "internal_error")
        assert r.headers.getlist("X-Request-Id") == [error["requestId"]]
        assert r.headers.get("Set-Cookie") is None
        assert (await client.get("/v1/health")).status_code == 200  # the rest is unharmed

    def app_request_headers() -> list[str]:
        from quart import request

        return list(request.headers.keys())

    await with_harness(make_config(database_url, tmp_path), body)


def test_a_request_id_with_a_trailing_line_break_is_replaced_not_echoed() -> None:
    """h11 splits header lines on LF, but another server in front (or HTTP/2) may hand over a
    value ending in one: a `$` anchor would have accepted "trace-1\\n" and echoed it."""
    from api.headers import REQUEST_SCOPE
    from api.http import new_request_id

    for supplied, echoed in ((b"trace-1", True), (b"trace-1\n", False), (b"trace 1", False)):
        published = REQUEST_SCOPE.set({"headers": [(b"x-request-id", supplied)]})
        try:
            assert (new_request_id() == supplied.decode()) is echoed, supplied
        finally:
            REQUEST_SCOPE.reset(published)
