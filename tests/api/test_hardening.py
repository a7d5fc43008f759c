"""Attacker-minded checks found in review: session-scoped logout keys, header encoding,
throttled token guessing, no line injection into the signed sign-in message, expiry cleanup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
import trio_asyncio
from quart.testing import QuartClient

from registry.config import ConfigError
from registry.keys import SigningKey
from registry.signin import hash_token
from registry.store.pg import open_pg_store
from tests.api.api_support import count_session_lookups, error_of, with_harness
from tests.conftest import Harness, make_config, open_harness
from tests.helpers import bearer, idem, sign_in, signed_entry

JSON_TYPE = {"Content-Type": "application/json"}


def _fresh_client(h: Harness) -> QuartClient:
    client = h.client.app.test_client()
    client.cookie_jar = None
    return client


async def test_logout_key_reused_by_another_session_still_logs_that_session_out(
    harness: Harness,
) -> None:
    key = SigningKey.generate()
    first = await sign_in(harness.client, key)
    second = await sign_in(harness.client, key)
    client = _fresh_client(harness)
    shared_key = {"Idempotency-Key": "logout-1"}
    r = await client.post("/v1/auth/logout", headers=bearer(first, **shared_key))
    assert r.status_code == 200
    r = await client.post("/v1/auth/logout", headers=bearer(second, **shared_key))
    assert r.status_code == 200
    assert "Idempotent-Replayed" not in r.headers
    r = await client.get("/v1/auth/session", headers=bearer(second))
    assert r.status_code == 401


async def test_location_header_is_percent_encoded(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    did = "did:example:a%20b"
    r = await harness.client.post(
        "/v1/entries", json=signed_entry(key, did), headers=bearer(token, **idem())
    )
    assert r.status_code == 201
    location = r.headers["Location"]
    assert location == "/v1/entries/did:example:a%2520b"
    r = await harness.client.get(location)
    assert r.status_code == 200
    assert (await r.get_json())["entryDid"] == did


async def test_guessing_tokens_is_rate_limited(database_url: str, tmp_path: Path) -> None:
    config = make_config(database_url, tmp_path, limits={"read_per_minute": 3})
    async for h in open_harness(config):
        client = _fresh_client(h)
        statuses = [
            (await client.get("/v1/auth/session", headers=bearer(f"guess-{n}"))).status_code
            for n in range(5)
        ]
        assert statuses[:3] == [401, 401, 401]
        assert statuses[3:] == [429, 429]


async def test_guessed_tokens_stop_reaching_the_database_once_the_budget_is_spent(
    database_url: str, tmp_path: Path
) -> None:
    """An unknown token costs a session lookup. Once failed attempts have spent the address's
    budget, the next unknown token is refused before it is looked up, while a session the
    process knows still passes (its principal's own budget)."""
    config = make_config(database_url, tmp_path, limits={"read_per_minute": 3})

    async def body(h: Harness) -> None:
        token = await sign_in(h.client, SigningKey.generate())
        client = _fresh_client(h)
        assert (await client.get("/v1/auth/session", headers=bearer(token))).status_code == 200
        looked_up = count_session_lookups(h)
        statuses = [
            (await client.get("/v1/auth/session", headers=bearer(f"guess-{n}"))).status_code
            for n in range(6)
        ]
        assert statuses == [401, 401, 401, 429, 429, 429]
        assert len(looked_up) == 3
        # A write route's refusal: its class's code, the failed lookups' Retry-After.
        r = await client.post(
            "/v1/entries", json={}, headers=bearer("guess-w", **idem(), **JSON_TYPE)
        )
        await error_of(r, 429, "write_rate_limited")
        assert 1 <= int(r.headers["Retry-After"]) <= 20  # the read rate: 3 a minute
        assert len(looked_up) == 3
        refused = h.service.deps.metrics.registry.get_sample_value(
            "registry_rate_limited_total", {"bucket": "session_lookups"}
        )
        assert refused == 4
        r = await client.get("/v1/auth/session", headers=bearer(token))
        assert r.status_code == 200, await r.get_data()
        assert len(looked_up) == 3
        # Signing in spends the address's write budget, not its failures' bucket, and the
        # process keeps the session it opened: its first use needs no lookup.
        fresh = await sign_in(h.client, SigningKey.generate())
        r = await client.get("/v1/auth/session", headers=bearer(fresh))
        assert r.status_code == 200, await r.get_data()
        assert len(looked_up) == 3
        # A session the process does not hold (signed in on another process, or dropped from
        # its cache) waits for the failed-lookups bucket like a guess from there.
        other = await sign_in(h.client, SigningKey.generate())
        h.service.deps.sessions.sessions.invalidate(hash_token(other))
        r = await client.get("/v1/auth/session", headers=bearer(other))
        await error_of(r, 429, "read_rate_limited")
        assert int(r.headers["Retry-After"]) >= 1
        assert len(looked_up) == 3

    await with_harness(config, body)


async def test_guesses_sent_at_once_cannot_all_reach_the_database(
    database_url: str, tmp_path: Path
) -> None:
    """A lookup takes its token of the failed-lookups bucket before it is made: thirty guesses
    at once, while the first lookups wait on the database, make three lookups, not thirty."""
    config = make_config(database_url, tmp_path, limits={"read_per_minute": 3})

    async def body(h: Harness) -> None:
        client = _fresh_client(h)
        answered = trio.Event()
        real = h.service.deps.sessions.store.get_session

        async def slow(token_hash: bytes) -> Any:
            await answered.wait()  # the database is slow to answer
            return await real(token_hash)

        looked_up = count_session_lookups(h, slow)
        statuses: list[int] = []

        async def guess(n: int) -> None:
            r = await client.get("/v1/auth/session", headers=bearer(f"guess-{n}"))
            statuses.append(r.status_code)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for n in range(30):
                    nursery.start_soon(guess, n)
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                assert len(looked_up) == 3
                assert statuses == [429] * 27
                answered.set()
        assert sorted(statuses) == [401] * 3 + [429] * 27
        assert len(looked_up) == 3

    await with_harness(config, body)


async def test_guesses_that_hang_up_during_their_lookup_still_spend_it(
    database_url: str, tmp_path: Path
) -> None:
    """A client that hangs up while its token is looked up has had the lookup made: it is not
    given back, or guesses that hang up at once would never run out."""
    config = make_config(database_url, tmp_path, limits={"read_per_minute": 3})

    async def body(h: Harness) -> None:
        client = _fresh_client(h)
        hanging_up: list[trio.CancelScope] = []

        async def hung_up_during(token_hash: bytes) -> Any:
            hanging_up[-1].cancel()  # the client goes away while the query runs
            await trio.sleep_forever()

        looked_up = count_session_lookups(h, hung_up_during)
        statuses: list[int] = []
        with trio.fail_after(30):
            for n in range(6):
                with trio.CancelScope() as request:
                    hanging_up.append(request)
                    r = await client.get("/v1/auth/session", headers=bearer(f"guess-{n}"))
                    statuses.append(r.status_code)
        assert len(looked_up) == 3
        assert statuses == [429, 429, 429]

    await with_harness(config, body)


@pytest.mark.parametrize(
    ("audience", "code"),
    [
        ("a\nNonce: forged", "invalid_challenge_request"),
        ("tab\there", "invalid_challenge_request"),
        # Lines some readers break on: a C1 control (NEL), the line and paragraph separators.
        ("app\x85Root: did:key:zforged", "invalid_challenge_request"),
        ("app\u2028Root: x", "invalid_challenge_request"),
        ("app\u2029x", "invalid_challenge_request"),
        ("a\x9bb", "invalid_challenge_request"),
        ("nul\x00", "invalid_json"),  # no body may hold U+0000 (the store cannot keep it)
        ("", "invalid_challenge_request"),
    ],
)
async def test_audience_must_be_one_printable_line(
    harness: Harness, audience: str, code: str
) -> None:
    r = await harness.client.post("/v1/auth/siws/challenge", json={"audience": audience})
    assert r.status_code == 400
    assert (await r.get_json())["error"]["code"] == code


async def test_an_audience_of_other_scripts_and_symbols_is_one_line() -> None:
    from registry.models import ChallengeRequest

    for audience in ("app.example — ünïcødé ✓", "日本語", "emoji 🙂"):
        assert ChallengeRequest.model_validate({"audience": audience}).audience == audience


@pytest.mark.parametrize(
    "path",
    [
        "/v1/entries/did:example:a%00b",
        "/v1/entries/did:example:a%00b/versions",
        "/v1/anchors/did:example:a%00b",
        "/v1/transfers/offers/off_%00",
        "/v1/attestations/att_%00",
        "/v1/bonds/bond%00",
    ],
)
async def test_a_nul_in_a_path_names_nothing_404(harness: Harness, path: str) -> None:
    """No stored DID or id can hold U+0000: the path matches no route, as a `%2F` in a DID
    does, rather than reaching the database with a value it refuses (which answered 400
    value_not_storable)."""
    r = await harness.client.get(path)
    await error_of(r, 404, "route_not_found")


@pytest.mark.parametrize(
    ("path", "location"),
    [("/console", "/console/"), ("/v1//health?deep=0", "/v1/health?deep=0")],
)
async def test_a_redirect_to_a_paths_canonical_form_is_an_answer_of_ours(
    harness: Harness, path: str, location: str
) -> None:
    """`GET /console` (what an operator types) and a doubled slash are redirected to the path
    the route has, like every answer with `X-Request-Id`, with no body and a Location that is
    a path (werkzeug's redirect had an HTML body, no request id, and an absolute URL built
    from the client's `Host` header)."""
    r = await _fresh_client(harness).get(path, headers={"Host": "attacker.example"})
    assert r.status_code == 308
    assert r.headers["Location"] == location
    assert r.headers["X-Request-Id"]
    assert await r.get_data() == b""


async def test_janitor_purges_only_what_expired(database_url: str) -> None:
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        execute = trio_asyncio.aio_as_trio(store._pool.execute)
        await execute(
            "INSERT INTO idempotency (scope, operation, key, fingerprint, result, created_at)"
            " VALUES ('janitor', 'op', 'old', '\\x00', '{}', now() - interval '25 hours'),"
            " ('janitor', 'op', 'new', '\\x00', '{}', now())"
        )
        removed = await store.purge_expired()
        assert removed.get("idempotency", 0) >= 1
        keys = await trio_asyncio.aio_as_trio(store._pool.fetch)(
            "SELECT key FROM idempotency WHERE scope = 'janitor'"
        )
        assert [r["key"] for r in keys] == ["new"]


def test_default_page_size_above_max_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="default_page_size"):
        make_config("", Path("."), limits={"default_page_size": 200, "max_page_size": 100})


async def test_concurrent_duplicates_create_once_and_the_other_replays(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    headers = bearer(token, **idem())
    responses = []

    async def post() -> None:
        responses.append(await harness.client.post("/v1/entries", json=entry, headers=headers))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(post)
    assert [r.status_code for r in responses] == [201] * 4
    bodies = [await r.get_json() for r in responses]
    assert all(b == bodies[0] for b in bodies)
    assert sum("Idempotent-Replayed" not in r.headers for r in responses) == 1
    r = await harness.client.get(f"/v1/entries/{entry['entryDid']}/versions")
    assert (await r.get_json())["totalCount"] == 1


async def test_openapi_lists_discovery_operations_with_their_schemas(harness: Harness) -> None:
    document = await (await harness.client.get("/v1/openapi.json")).get_json()
    operations = {op["operationId"] for path in document["paths"].values() for op in path.values()}
    assert {"discover", "discover_registryql"} <= operations
    schemas = document["components"]["schemas"]
    assert "entryType" in schemas["DiscoverRequest"]["properties"]
    assert schemas["DiscoverRequest"]["additionalProperties"] is False
    assert "query" in schemas["RegistryQLRequest"]["properties"]


@pytest.mark.parametrize(
    ("path", "fields", "pointer"),
    [
        ("/v1/entries", {"version": "1\x00"}, "/version"),
        ("/v1/entries", {"itemData": {"tools": ["a", "b\x00"]}}, "/itemData/tools/1"),
        ("/v1/discover", {"text": "a\x00b"}, "/text"),
        ("/v1/discover/registryql", {"query": "DISCOVER *\x00"}, "/query"),
    ],
    ids=["entry-version", "entry-item-data", "discover", "registryql"],
)
async def test_a_nul_character_anywhere_is_a_400_naming_where(
    harness: Harness, path: str, fields: dict[str, Any], pointer: str
) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    body = signed_entry(key, **fields) if path == "/v1/entries" else fields
    r = await harness.client.post(path, json=body, headers=bearer(token, **idem()))
    error = await error_of(r, 400, "invalid_json")
    assert error["details"] == {"rule": "nul_character", "pointer": pointer}
    created = await harness.client.post(
        "/v1/entries", json=signed_entry(key), headers=bearer(token, **idem())
    )
    assert created.status_code == 201  # the service goes on serving
