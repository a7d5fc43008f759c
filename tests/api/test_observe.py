"""What operators watch: `GET /metrics` and the access log, after a scripted workload."""

from __future__ import annotations

import base64
import json
import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.main import JsonFormatter
from registry.breaker import Breaker
from registry.federation import PeerState
from registry.keys import SigningKey
from tests.api.api_support import anon_client, error_of, with_harness
from tests.api.test_events import closed_with, events, subscribe
from tests.conftest import Harness, make_config
from tests.helpers import bearer, sign_in, signed_entry


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition, by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class Captured(logging.Handler):
    """Every record of the access logger, formatted as `registry serve --log-format json` does."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def access_log() -> Any:
    handler = Captured()
    logger = logging.getLogger("registry.access")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


async def test_metrics_need_an_admin_session_unless_open(database_url: str, tmp_path: Path) -> None:
    admin = SigningKey.generate()
    config = make_config(database_url, tmp_path, auth={"admin_dids": [admin.did]})

    async def body(h: Harness) -> None:
        client = anon_client(h)
        await error_of(await client.get("/metrics"), 401, "session_missing")
        token = await sign_in(h.client, SigningKey.generate())
        await error_of(
            await client.get("/metrics", headers=bearer(token)), 403, "capability_missing"
        )
        token = await sign_in(h.client, admin)
        r = await client.get("/metrics", headers=bearer(token))
        assert r.status_code == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        assert ("registry_log_head", ()) in samples((await r.get_data()).decode())

    await with_harness(config, body)
    config = make_config(database_url, tmp_path, metrics={"open": True})

    async def open_body(h: Harness) -> None:
        assert (await anon_client(h).get("/metrics")).status_code == 200

    await with_harness(config, open_body)


async def test_a_workload_shows_in_the_metrics_and_the_access_log(
    database_url: str, tmp_path: Path, access_log: Captured
) -> None:
    """A create, its replay, a 429 and an unknown path: the series and the log lines say so,
    and no secret of any request reaches the log."""
    admin = SigningKey.generate()
    config = make_config(
        database_url,
        tmp_path,
        auth={"admin_dids": [admin.did]},
        limits={"query_per_minute": 1},
    )

    async def body(h: Harness) -> None:
        client = anon_client(h)
        key = SigningKey.generate()
        token = await sign_in(h.client, key)
        marker = f"secret-body-{uuid.uuid4()}"
        entry = signed_entry(key, description=marker)
        headers = bearer(token, **{"Idempotency-Key": f"k-{uuid.uuid4()}"})
        headers["Cookie"] = f"registry_session={token}"
        answered: list[str] = []  # the X-Request-Id of each answer, in order
        for _ in range(2):  # the second is a replay
            r = await client.post("/v1/entries", json=entry, headers=headers)
            assert r.status_code == 201
            answered.append(r.headers["X-Request-Id"])
        for status in (200, 429):
            r = await client.post("/v1/discover", json={})
            assert r.status_code == status
            answered.append(r.headers["X-Request-Id"])
        r = await client.get("/v1/nowhere/" + marker)
        assert r.status_code == 404
        answered.append(r.headers["X-Request-Id"])
        async with client.websocket("/v1/events") as ws:  # one event reaches a subscriber
            await subscribe(ws, fromSequence=0, kinds=["entry.created"])
            await events(ws, 1)
        bad = {"Authorization": "Bearer forged"}
        async with client.websocket("/v1/events", headers=bad) as ws:
            assert await closed_with(ws) == 4401
        admin_token = await sign_in(h.client, admin)
        r = await client.get("/metrics", headers=bearer(admin_token))
        got = samples((await r.get_data()).decode())

        def value(name: str, **labels: str) -> float:
            return got[(name, tuple(sorted(labels.items())))]

        created = {"route": "/v1/entries", "method": "POST", "status": "2xx"}
        assert value("registry_http_request_duration_seconds_count", **created) == 2
        assert value("registry_idempotent_replays_total", route="/v1/entries") == 1
        assert value("registry_rate_limited_total", bucket="query") == 1
        unrouted = {"route": "unrouted", "method": "GET", "status": "4xx"}
        assert value("registry_http_request_duration_seconds_count", **unrouted) == 1
        assert value("registry_writer_batches_total") >= 1
        assert value("registry_writer_changes_total") >= 1
        batches = value("registry_writer_batch_size_count")
        assert batches == value("registry_writer_batches_total")
        assert value("registry_writer_batch_size_bucket", le="+Inf") == batches
        assert 1 <= value("registry_writer_batch_size_bucket", le="1.0") <= batches
        assert value("registry_log_head") >= 1
        assert value("registry_cache_live") == 1
        assert ("registry_cache_hits_total", (("cache", "sessions"),)) in got
        assert value("registry_db_connections_open") >= 1
        assert value("registry_db_connections_held_back") == 0  # a server with room
        assert value("process_resident_memory_bytes") > 0
        assert value("registry_anchoring_leader") in (0, 1)
        assert value("registry_event_socket_closes_total", code="4401") == 1
        assert value("registry_event_messages_sent_total") >= 1  # the event, at least
        assert value("registry_event_sockets") == 0

        lines = [json.loads(line) for line in access_log.lines]
        assert all(line["logger"] == "registry.access" for line in lines)
        posts = [line for line in lines if line["route"] == "/v1/entries"]
        assert [(p["status"], p.get("replayed", False)) for p in posts] == [
            (201, False),
            (201, True),
        ]
        assert all(p["principal"] == key.did for p in posts)
        assert all(p["method"] == "POST" and p["ms"] >= 0 and p["bytes"] > 0 for p in posts)
        assert all(len(p["requestId"]) == 16 for p in posts)
        assert {line["status"] for line in lines if line["route"] == "/v1/discover"} == {200, 429}
        assert any(line["route"] == "unrouted" and line["status"] == 404 for line in lines)
        assert len(lines) == len({line["requestId"] for line in lines})  # one line a request
        logged_ids = [line["requestId"] for line in lines]  # the sign-in's come first
        start = logged_ids.index(answered[0])
        assert logged_ids[start : start + len(answered)] == answered
        logged = "\n".join(access_log.lines)
        seed = base64.urlsafe_b64encode(key.seed).decode().rstrip("=")
        secrets = [token, admin_token, marker, entry["signature"]["value"], key.seed.hex(), seed]
        assert [s for s in secrets if s in logged] == []

    await with_harness(config, body)


async def test_a_client_cannot_grow_the_series_with_methods_of_its_own(
    database_url: str, tmp_path: Path
) -> None:
    """Any token is a method to HTTP; each would be a series kept for the life of the process.
    Methods outside the standard ones are all counted as "other"."""
    config = make_config(database_url, tmp_path, metrics={"open": True})

    async def body(h: Harness) -> None:
        client = anon_client(h)
        for i in range(20):
            assert (await client.open("/v1/entries", method=f"X{i}")).status_code == 405
        assert (await client.open("/nowhere", method="PROPFIND")).status_code == 404
        assert (await client.open("/v1/entries", method="DELETE")).status_code == 405
        got = samples((await (await client.get("/metrics")).get_data()).decode())
        counts = {
            labels: value
            for (name, labels), value in got.items()
            if name == "registry_http_request_duration_seconds_count"
        }
        assert counts[(("method", "other"), ("route", "unrouted"), ("status", "4xx"))] == 21
        assert counts[(("method", "DELETE"), ("route", "unrouted"), ("status", "4xx"))] == 1
        assert {dict(labels)["method"] for labels in counts} <= {"other", "DELETE", "GET"}

    await with_harness(config, body)


async def test_the_anchoring_leader_reports_its_backlog_and_time_to_finality(
    database_url: str, tmp_path: Path
) -> None:
    from tests.api.test_anchors import anchor_update, publish, wait_for

    admin = SigningKey.generate()
    config = make_config(
        database_url,
        tmp_path,
        auth={"admin_dids": [admin.did]},
        anchoring={"enabled": True, "block_interval_seconds": 0, "finality_depth": 1},
    )

    async def body(h: Harness) -> None:
        publisher = SigningKey.generate()
        head = await h.store.log_head()
        [version] = await publish(h.client, publisher, await sign_in(h.client, publisher))
        await wait_for(h, head, anchor_update(version["entryDid"], "confirmed"))
        token = await sign_in(h.client, admin)
        r = await anon_client(h).get("/metrics", headers=bearer(token))
        got = samples((await r.get_data()).decode())
        assert got[("registry_anchoring_leader", ())] == 1
        assert got[("registry_anchor_confirmed_total", ())] >= 1
        assert got[("registry_anchor_finality_seconds_count", ())] >= 1
        assert ("registry_anchor_pending", ()) in got
        assert ("registry_anchor_batches_in_flight", ()) in got

    await with_harness(config, body)


async def test_the_access_line_names_a_method_of_the_clients_own_as_other(
    database_url: str, tmp_path: Path, access_log: Any
) -> None:
    """HTTP/2 lets a client send any method but CR, LF and NUL: spaces and ANSI escapes went
    into the text line as they came (forged `key=value` pairs, a cleared terminal)."""
    config = make_config(database_url, tmp_path)
    forged = "GET CLIENT=203.0.113.7 \x1b[2J" + "X" * 1000

    async def body(h: Harness) -> None:
        client = anon_client(h)
        assert (await client.open("/v1/health", method=forged)).status_code == 405
        assert (await client.open("/v1/health", method="GET")).status_code == 200

    await with_harness(config, body)
    lines = [json.loads(line) for line in access_log.lines]
    assert [(line["method"], line["status"]) for line in lines][-2:] == [
        ("other", 405),
        ("GET", 200),
    ]
    assert all("\x1b" not in line["msg"] and len(line["msg"]) < 300 for line in lines)


async def test_the_access_line_of_a_head_request_counts_no_body_bytes(
    database_url: str, tmp_path: Path, access_log: Any
) -> None:
    """A HEAD answer carries the length of the GET's body and no body (RFC 9110 §9.3.2): the
    line said the GET's bytes, as if they had been sent."""
    config = make_config(database_url, tmp_path)

    async def body(h: Harness) -> None:
        client = anon_client(h)
        assert (await client.get("/v1/health")).status_code == 200
        assert (await client.head("/v1/health")).status_code == 200

    await with_harness(config, body)
    lines = [json.loads(line) for line in access_log.lines]
    get, head = lines[-2:]
    assert (get["method"], head["method"]) == ("GET", "HEAD")
    assert get["bytes"] > 0
    assert head["bytes"] == 0


async def test_the_access_line_names_an_ipv6_client_by_its_address(
    database_url: str, tmp_path: Path, access_log: Any
) -> None:
    """The budgets count an IPv6 client by its /64; the line named that prefix, so an operator
    could not tell which host of it sent the request."""
    config = make_config(database_url, tmp_path, server={"trusted_proxies": 1})

    async def body(h: Harness) -> None:
        client = anon_client(h)
        for forwarded in ("2001:db8:1:2::5", "[2001:db8:1:2::7]:443", "::ffff:192.0.2.9"):
            r = await client.get("/v1/health", headers={"X-Forwarded-For": forwarded})
            assert r.status_code == 200

    await with_harness(config, body)
    lines = [json.loads(line) for line in access_log.lines]
    assert [line["client"] for line in lines[-3:]] == [
        "2001:db8:1:2::5",
        "2001:db8:1:2::7",
        "192.0.2.9",
    ]


async def test_a_peer_breaker_past_its_cooldown_is_half_open_in_the_metrics_as_in_the_admin_view(
    database_url: str, tmp_path: Path
) -> None:
    # docs/operations.md: the peer series show each peer as GET /v1/admin/federation/peers
    # does. The actor stores `open` until its trial; once the cooldown has passed, both say
    # half_open (the metric said open, the view half_open).
    peer = SigningKey.generate()
    config = make_config(
        database_url,
        tmp_path,
        metrics={"open": True},
        # discover only: no PeerActor writes the state this test sets
        federation={
            "peers": [
                {"peer_did": peer.did, "endpoint": "http://127.0.0.1:9", "kinds": ["discover"]}
            ]
        },
    )

    async def body(h: Harness) -> None:
        handle = h.service.federation
        handle.leader = True
        now = h.deps.federation.clock_ms()
        for due, shown in ((now + 60_000, "open"), (now - 1, "half_open")):
            opened = Breaker(state="open", consecutive_failures=5, next_attempt_at_ms=due)
            handle.states[peer.did] = PeerState(peer.did, breaker=opened)
            got = samples((await (await anon_client(h).get("/metrics")).get_data()).decode())
            states = {
                dict(labels)["state"]: value
                for (name, labels), value in got.items()
                if name == "registry_peer_breaker_state" and dict(labels)["peer"] == peer.did
            }
            assert states == {s: float(s == shown) for s in ("closed", "open", "half_open")}

    await with_harness(config, body)
