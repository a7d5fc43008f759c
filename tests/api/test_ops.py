"""Operations endpoints: health, deep health (admin) and the OpenAPI document."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import trio
import trio.lowlevel
import trio_asyncio

from registry.keys import SigningKey
from tests.api.api_support import anon_client, error_of, with_harness
from tests.conftest import Harness, make_config
from tests.helpers import bearer, sign_in

OPERATION_IDS = {
    "create_entry",
    "update_entry",
    "delete_entry",
    "get_entry",
    "get_entry_lineage",
    "list_entry_versions",
    "get_entry_version",
    "siws_challenge",
    "siws_verify",
    "session",
    "logout",
    "health",
    "deep_health",
}


async def _with_log_follower(h: Harness, nursery: trio.Nursery) -> None:
    """The harness runs the cache keeper as the server does: its caches follow the log."""
    assert h.service.caches.enabled


async def test_health_is_ok(harness: Harness) -> None:
    async with trio.open_nursery() as nursery:
        await _with_log_follower(harness, nursery)
        r = await anon_client(harness).get("/v1/health")
        assert r.status_code == 200, await r.get_data()
        assert r.headers.get("X-Request-Id")
        body = await r.get_json()
        assert body["status"] == "ok", body
        assert body["checks"]["database"] == "ok"
        assert body["checks"]["migrations"] == "ok"
        assert all(isinstance(v, str) for v in body["checks"].values())
        nursery.cancel_scope.cancel()


async def test_health_reads_the_shipped_migrations_once(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Health compares the schema with the migrations this code ships with, counted once (a
    scan of the migration files took ~1.4 ms, on every anonymous call)."""
    from api import ops

    read: list[int] = []
    real = ops.load_migrations

    def counting() -> object:
        read.append(1)
        return real()

    ops._expected_migrations.cache_clear()
    monkeypatch.setattr(ops, "load_migrations", counting)
    for _ in range(3):
        r = await anon_client(harness).get("/v1/health")
        assert (await r.get_json())["checks"]["migrations"] == "ok"
    assert len(read) == 1


async def test_health_needs_no_session_and_answers_200(harness: Harness) -> None:
    r = await anon_client(harness).get("/v1/health")
    assert r.status_code == 200
    body = await r.get_json()
    assert body["status"] in ("ok", "degraded")
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["migrations"] == "ok"


async def test_openapi_document(harness: Harness) -> None:
    r = await anon_client(harness).get("/v1/openapi.json")
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("application/json")
    doc = await r.get_json()
    assert doc["openapi"].startswith("3.1")
    assert doc["info"]["title"]
    ids = [
        op["operationId"]
        for item in doc["paths"].values()
        for method, op in item.items()
        if method in ("get", "post", "put", "delete", "patch")
    ]
    assert len(ids) == len(set(ids)), ids
    assert set(ids) >= OPERATION_IDS
    # Every operation is under /v1, but /metrics, where Prometheus looks for it, and the console.
    assert all(
        path.startswith(("/v1/", "/console/")) or path == "/metrics" for path in doc["paths"]
    )
    schemas = doc["components"]["schemas"]
    assert "RegistryEntry" in schemas
    assert "ErrorResponse" in schemas
    # Every reference names a component (the models of api/schemas.py may name components
    # pydantic does not generate, such as ServedEntry).
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(doc)))
    assert refs - set(schemas) == set()


def test_the_envelope_schema_has_the_members_every_envelope_has() -> None:
    from api.schemas import Envelope
    from registry.envelope import MEMBERS

    assert set(Envelope.model_fields) == set(MEMBERS)


def test_an_operation_without_its_documentation_is_refused() -> None:
    """The document is generated from the route table: a route that does not say what it
    answers cannot be served undocumented."""
    from api.app import route_table
    from api.http import endpoint
    from api.openapi import openapi_document

    app = route_table()

    @app.get("/v1/undocumented")
    @endpoint("read")
    async def undocumented() -> None: ...

    with pytest.raises(ValueError, match="/v1/undocumented is not @endpoint and @documented"):
        openapi_document(app)


async def test_openapi_marks_idempotency_and_auth(harness: Harness) -> None:
    r = await anon_client(harness).get("/v1/openapi.json")
    doc = await r.get_json()
    operations = {
        op["operationId"]: op
        for item in doc["paths"].values()
        for method, op in item.items()
        if method in ("get", "post", "put", "delete")
    }
    for op_id in ("create_entry", "update_entry", "delete_entry", "logout"):
        params = operations[op_id].get("parameters", [])
        header = [p for p in params if p["in"] == "header" and p["name"] == "Idempotency-Key"]
        assert header, op_id
        assert header[0]["required"] is True
        assert operations[op_id].get("security"), op_id
    for op_id in ("get_entry", "get_entry_lineage", "list_entry_versions", "health"):
        assert not operations[op_id].get("security"), op_id


async def test_deep_health_requires_a_session(harness: Harness) -> None:
    r = await anon_client(harness).get("/v1/health/deep")
    await error_of(r, 401, "session_missing")


async def test_deep_health_is_403_for_a_normal_session(harness: Harness) -> None:
    token = await sign_in(harness.client, SigningKey.generate())
    r = await anon_client(harness).get("/v1/health/deep", headers=bearer(token))
    error = await error_of(r, 403, "capability_missing")
    assert error.get("details", {}).get("capability", "admin") == "admin"


async def test_deep_health_for_an_admin(database_url: str, tmp_path: Path) -> None:
    admin = SigningKey.generate()
    config = make_config(database_url, tmp_path, auth={"admin_dids": [admin.did]})

    async def body(h: Harness) -> None:
        async with trio.open_nursery() as nursery:
            await _with_log_follower(h, nursery)
            token = await sign_in(anon_client(h), admin)
            r = await anon_client(h).get("/v1/health/deep", headers=bearer(token))
            assert r.status_code == 200, await r.get_data()
            body = await r.get_json()
            assert body["status"] == "ok", body
            assert body["checks"]["database"] == "ok"
            assert body["checks"]["migrations"] == "ok"
            assert all(isinstance(v, str) for v in body["checks"].values())
            # A non-admin in the same deployment is still refused.
            token = await sign_in(anon_client(h), SigningKey.generate())
            r = await anon_client(h).get("/v1/health/deep", headers=bearer(token))
            await error_of(r, 403, "capability_missing")
            nursery.cancel_scope.cancel()

    await with_harness(config, body)


async def test_a_backlog_of_changes_clears_the_discovery_cache_without_reading_them() -> None:
    """Over CHANGES_CHECKED_AT_ONCE changes in one batch the follower clears every page rather
    than read and check them all; up to it, it reads every change's versions in one query."""
    from registry.caches import ResultCache
    from registry.coherence import CHANGES_CHECKED_AT_ONCE, drop_moved_pages
    from registry.registryql import parse_registryql

    class Versions:
        def __init__(self) -> None:
            self.read: list[tuple[str, int]] = []

        async def change_versions(
            self, changes: list[tuple[int, str]], texts: list[str]
        ) -> dict[int, list[tuple[str, list[str]]]]:
            self.read.extend(changes)
            tombstone = '{"entryDid": "did:web:x", "lifecycleStatus": "deleted"}'
            return {seq: [(tombstone, [])] for seq, _ in changes}

    results = ResultCache(10)
    results.enabled = True
    query = parse_registryql("DISCOVER *")
    results.put("q", (query, "{}"), results.epoch)
    store = Versions()
    few = [(n, f"did:web:{n}") for n in range(CHANGES_CHECKED_AT_ONCE)]
    await drop_moved_pages(store, results, few)  # type: ignore[arg-type]
    assert len(store.read) == len(few)
    assert results.get("q") is not None  # a tombstone matches nothing: the page stays
    many = [(n, f"did:web:{n}") for n in range(CHANGES_CHECKED_AT_ONCE + 1)]
    await drop_moved_pages(store, results, many)  # type: ignore[arg-type]
    assert len(store.read) == len(few)  # nothing more was read
    assert results.get("q") is None


async def test_every_http_route_is_in_the_openapi_document(harness: Harness) -> None:
    """The document lists every route the app serves, with its method (the WebSocket and
    this check's own helpers aside), so a new operation cannot be left out of it."""
    doc = await (await anon_client(harness).get("/v1/openapi.json")).get_json()
    listed = {(path, method) for path, item in doc["paths"].items() for method in item}
    served = set()
    for rule in harness.service.app.url_map.iter_rules():
        if rule.websocket or rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule.rule)
        for method in rule.methods or ():
            if method not in ("HEAD", "OPTIONS"):
                served.add((path, method.lower()))
    assert ("/v1/transfers/offers/{offer_id}/accept", "post") in served  # the check sees routes
    assert served - listed == set()


async def test_health_reports_a_full_disk_until_a_write_succeeds_and_nothing_older(
    harness: Harness,
) -> None:
    """The writer's last refusal shows in `writes` only where nothing else can tell that it
    is over (a full disk); a lost connection that is back is not reported as a write fault."""
    deps = harness.service.app.deps  # type: ignore[attr-defined]
    refusal: list[str | None] = ["database_full"]
    deps.write_condition = lambda: refusal[0]
    r = await anon_client(harness).get("/v1/health")
    body = await r.get_json()
    assert r.status_code == 200
    assert body["status"] == "degraded"
    assert body["checks"]["writes"] == "failing: database_full"
    for passed in ("database_unavailable", "database_read_only", None):
        refusal[0] = passed
        body = await (await anon_client(harness).get("/v1/health")).get_json()
        assert body["checks"]["writes"] == "ok", passed
        assert body["status"] == "ok"


async def test_a_did_taken_out_of_admin_dids_loses_admin_in_its_open_sessions(
    database_url: str, tmp_path: Path
) -> None:
    """Sessions live in the database: one opened while the DID was listed kept `admin` across a
    restart with the DID removed, for its whole life (12 h). A reload (SIGHUP) sets the same
    list the restart reads."""
    admin = SigningKey.generate()
    tokens: list[str] = []

    async def listed(h: Harness) -> None:
        tokens.append(await sign_in(h.client, admin))
        r = await anon_client(h).get("/v1/health/deep", headers=bearer(tokens[0]))
        assert r.status_code == 200, await r.get_data()

    await with_harness(
        make_config(database_url, tmp_path, auth={"admin_dids": [admin.did]}), listed
    )

    async def removed(h: Harness) -> None:  # the restarted process: admin_dids now empty
        client = anon_client(h)
        for path in ("/v1/health/deep", "/v1/admin/overview", "/metrics"):
            r = await client.get(path, headers=bearer(tokens[0]))
            assert r.status_code == 403, (path, await r.get_data())
        r = await client.get("/v1/auth/session", headers=bearer(tokens[0]))
        assert r.status_code == 200, await r.get_data()
        assert "admin" not in (await r.get_json())["capabilities"]
        # Listed again (a reload), the session has it again: it was granted at sign-in.
        h.deps.sessions.admin_dids = (admin.did,)
        r = await client.get("/v1/health/deep", headers=bearer(tokens[0]))
        assert r.status_code == 200, await r.get_data()

    await with_harness(make_config(database_url, tmp_path), removed)


async def test_health_is_degraded_not_failing_while_every_pooled_connection_is_busy(
    database_url: str, tmp_path: Path
) -> None:
    # A load balancer drops a node whose health is 503. Every process of a deployment shares
    # the database: under a load that keeps each process's pool busy past the probe's 2 s,
    # they would all be dropped at once. Busy is degraded (200); a database that does not
    # answer is still failing.
    config = make_config(database_url, tmp_path)

    async def body(h: Harness) -> None:
        pool = h.store._pool  # the test holds every connection of the pool itself
        held = []
        # Every connection but those taken for good (LISTEN, leases): an actor's that comes
        # back meanwhile is taken too, so none is free for the probe.
        while len(held) < pool.statistics()["max"] - pool.statistics()["lasting"]:
            held.append(await trio_asyncio.aio_as_trio(pool.take)())
        r = await anon_client(h).get("/v1/health")
        health = await r.get_json()
        assert r.status_code == 200, health
        assert health["status"] == "degraded"
        assert health["checks"]["database"].startswith("busy:")
        for conn in held:
            pool.give_back(conn)
        r = await anon_client(h).get("/v1/health")
        assert (r.status_code, (await r.get_json())["status"]) == (200, "ok")

    await with_harness(config, body)


async def test_deep_health_is_200_and_says_busy_while_every_pooled_connection_is(
    database_url: str, tmp_path: Path
) -> None:
    """Deep health always answers 200 (the spec: inspect `status`). With every pooled
    connection at work its checks said `busy` after 2 s, and then it read the log head through
    the pool all the same: 30 s later, a 503 `database_timeout` instead of its answer."""
    admin = SigningKey.generate()
    config = make_config(database_url, tmp_path, auth={"admin_dids": [admin.did]})

    async def body(h: Harness) -> None:
        token = await sign_in(anon_client(h), admin)
        r = await anon_client(h).get("/v1/health/deep", headers=bearer(token))
        assert r.status_code == 200, await r.get_data()  # (the session is now cached)
        head = (await r.get_json())["logHead"]
        pool = h.store._pool
        held = []
        while len(held) < pool.statistics()["max"] - pool.statistics()["lasting"]:
            held.append(await trio_asyncio.aio_as_trio(pool.take)())
        try:
            with trio.fail_after(10):
                r = await anon_client(h).get("/v1/health/deep", headers=bearer(token))
            health = await r.get_json()
            assert r.status_code == 200, health
            assert health["status"] == "degraded"
            assert health["checks"]["database"].startswith("busy:")
            assert health["logHead"] == head  # as this process last read it
        finally:
            for conn in held:
                pool.give_back(conn)

    await with_harness(config, body)
