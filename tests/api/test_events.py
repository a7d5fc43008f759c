"""The event stream `GET /v1/events` over real PostgreSQL, through the app as served.

Subscribe, replay then live, filters, resume without gap or duplicate, admin-only kinds,
malformed messages, unknown WebSocket paths; writes go through the HTTP API.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from quart.testing.connections import WebsocketDisconnectError, WebsocketResponseError

from registry.keys import SigningKey
from tests.api.api_support import (
    anon_client,
    count_session_lookups,
    create,
    updated,
    with_harness,
)
from tests.conftest import Harness, make_config
from tests.helpers import bearer, idem, sign_in, signed_entry

DEADLINE = 10


async def receive(ws: Any) -> dict[str, Any]:
    with trio.fail_after(DEADLINE):
        return dict(json.loads(await ws.receive()))


async def events(ws: Any, count: int) -> list[dict[str, Any]]:
    """The next `count` event messages (heartbeats are skipped)."""
    out: list[dict[str, Any]] = []
    while len(out) < count:
        message = await receive(ws)
        if message["type"] == "event":
            out.append(message)
        else:
            assert message["type"] == "heartbeat", message
    return out


async def subscribe(ws: Any, **fields: Any) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "subscribe", **fields}))
    answer = await receive(ws)
    assert answer["type"] == "subscribed", answer
    return answer


async def closed_with(ws: Any) -> int:
    """The close code the server ends the socket with (whatever it sent before)."""
    with trio.fail_after(DEADLINE):
        while True:
            try:
                await ws.receive()
            except WebsocketDisconnectError as closed:
                return int(closed.args[0])


async def head(h: Harness) -> int:
    return await h.store.log_head()


async def test_live_events_of_entry_changes(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    async with harness.client.websocket("/v1/events") as ws:
        start = await subscribe(ws)
        assert start["fromSequence"] == await head(harness)
        entry = await create(harness, key, token)
        v2 = await updated(harness, key, token, entry["entryDid"], entry["sequence"], version="2")
        r = await harness.client.delete(
            f"/v1/entries/{entry['entryDid']}", headers=bearer(token, **idem())
        )
        assert r.status_code == 200
        deleted = (await r.get_json())["sequence"]
        got = await events(ws, 3)
    assert [(e["kind"], e["sequence"], e["entryDid"]) for e in got] == [
        ("entry.created", entry["sequence"], entry["entryDid"]),
        ("entry.updated", v2["sequence"], entry["entryDid"]),
        ("entry.deleted", deleted, entry["entryDid"]),
    ]
    assert got[0]["data"] == {
        "entryType": "AgentDefinition",
        "publisherDid": key.did,
        "lifecycleStatus": "draft",
        "name": entry["name"],
        "version": entry["version"],
    }
    assert got[2]["data"]["lifecycleStatus"] == "deleted"
    assert all(e["at"].endswith("Z") for e in got)


async def test_replay_from_a_sequence_then_live_without_gap_or_duplicate(
    harness: Harness,
) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    before = await head(harness)
    first = [await create(harness, key, token) for _ in range(3)]
    async with harness.client.websocket("/v1/events") as ws:
        await subscribe(ws, fromSequence=before, entryDids=[e["entryDid"] for e in first])
        replayed = await events(ws, 3)
        later = await updated(
            harness, key, token, first[1]["entryDid"], first[1]["sequence"], version="2"
        )
        live = await events(ws, 1)
    assert [e["sequence"] for e in replayed] == [e["sequence"] for e in first]
    assert live[0]["sequence"] == later["sequence"]


async def test_filters_by_kind_entry_type_and_did(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    before = await head(harness)
    a = await create(harness, key, token)
    b = await create(harness, key, token)
    a2 = await updated(harness, key, token, a["entryDid"], a["sequence"], version="2")
    await updated(harness, key, token, b["entryDid"], b["sequence"], version="2")
    async with harness.client.websocket("/v1/events") as ws:
        await subscribe(ws, fromSequence=before, kinds=["entry.updated"], entryDids=[a["entryDid"]])
        (only,) = await events(ws, 1)
        assert only["sequence"] == a2["sequence"]
        await subscribe(ws, fromSequence=before, entryTypes=["NoSuchType"], kinds=["entry.created"])
        await ws.send(json.dumps({"type": "ping"}))
        assert (await receive(ws)) == {"type": "pong"}  # nothing matched before the pong


async def test_unsubscribe_reports_the_resume_point_and_resubscribing_loses_nothing(
    harness: Harness,
) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    before = await head(harness)
    made = [await create(harness, key, token) for _ in range(4)]
    dids = [e["entryDid"] for e in made]
    async with harness.client.websocket("/v1/events") as ws:
        await subscribe(ws, fromSequence=before, entryDids=dids)
        two = await events(ws, 2)
        await ws.send(json.dumps({"type": "unsubscribe"}))
        answer = await receive(ws)
        while answer["type"] == "event":  # events already on their way before the unsubscribe
            two.append(answer)
            answer = await receive(ws)
        assert answer["type"] == "unsubscribed"
        resume = answer["lastSequence"]
        assert resume >= two[-1]["sequence"]
        await subscribe(ws, fromSequence=resume, entryDids=dids)
        rest = await events(ws, len([e for e in made if e["sequence"] > resume]))
    assert [e["sequence"] for e in two + rest] == [e["sequence"] for e in made]


async def test_an_idempotent_replay_emits_no_event(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry, marker = signed_entry(key), signed_entry(key)
    headers = bearer(token, **idem())
    async with harness.client.websocket("/v1/events") as ws:
        await subscribe(ws, entryDids=[entry["entryDid"], marker["entryDid"]])
        r1 = await harness.client.post("/v1/entries", json=entry, headers=headers)
        r2 = await harness.client.post("/v1/entries", json=entry, headers=headers)
        assert r1.status_code == r2.status_code == 201
        assert r2.headers.get("Idempotent-Replayed") == "true"
        # A later event bounds the wait: had the replay emitted one, it would come first.
        r3 = await harness.client.post("/v1/entries", json=marker, headers=bearer(token, **idem()))
        assert r3.status_code == 201
        got = await events(ws, 2)
    assert [e["entryDid"] for e in got] == [entry["entryDid"], marker["entryDid"]]


async def test_logout_is_logged_but_never_published(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    before = await head(harness)
    r = await harness.client.post("/v1/auth/logout", headers=bearer(token, **idem()))
    assert r.status_code == 200, await r.get_data()
    assert await head(harness) == before + 1  # it took a log position
    key2 = SigningKey.generate()
    token2 = await sign_in(harness.client, key2)
    marker = await create(harness, key2, token2)
    async with harness.client.websocket("/v1/events") as ws:
        await subscribe(ws, fromSequence=before)
        (first,) = await events(ws, 1)
    assert first["sequence"] == marker["sequence"]  # the logout at before + 1 was skipped


async def test_admin_only_kinds_need_an_admin_session(database_url: str, tmp_path: Path) -> None:
    admin = SigningKey.generate()
    config = make_config(database_url, tmp_path, auth={"admin_dids": [admin.did]})

    async def body(h: Harness) -> None:
        user_token = await sign_in(h.client, SigningKey.generate())
        admin_token = await sign_in(h.client, admin)
        async with anon_client(h).websocket("/v1/events") as ws:
            await ws.send(json.dumps({"type": "subscribe", "kinds": ["peer.status"]}))
            refused = await receive(ws)
            assert refused["type"] == "error"
            assert refused["error"]["code"] == "capability_missing"
            await ws.send(json.dumps({"type": "auth", "token": user_token}))
            assert (await receive(ws))["admin"] is False
            await ws.send(json.dumps({"type": "subscribe", "kinds": ["peer.status"]}))
            assert (await receive(ws))["error"]["code"] == "capability_missing"
            await ws.send(json.dumps({"type": "auth", "token": "not-a-token"}))
            assert (await receive(ws))["error"]["code"] == "session_invalid"
            await ws.send(json.dumps({"type": "auth", "token": admin_token}))
            authenticated = await receive(ws)
            assert authenticated == {
                "type": "authenticated",
                "principal": admin.did,
                "admin": True,
            }
            await subscribe(ws, kinds=["peer.status", "entry.created"])
        # The handshake's own session counts too: bearer header or cookie.
        async with h.client.websocket(
            "/v1/events", headers={"Authorization": f"Bearer {admin_token}"}
        ) as ws:
            await subscribe(ws, kinds=["peer.status"])
        async with h.client.websocket("/v1/events") as ws:  # the admin's session cookie
            await subscribe(ws, kinds=["peer.status"])
        async with anon_client(h).websocket(
            "/v1/events", headers={"Authorization": "Bearer forged"}
        ) as ws:
            assert await closed_with(ws) == 4401

    await with_harness(config, body)


async def test_socket_logins_share_the_addresss_budget_of_failed_lookups(
    database_url: str, tmp_path: Path
) -> None:
    """docs/limits.md, "Session tokens": once failed lookups from an address (here over HTTP)
    have spent its bucket, an unknown token in an `auth` message is refused `read_rate_limited`
    and one in the handshake closes 1013, neither looked up; a session the process knows still
    authenticates."""
    config = make_config(database_url, tmp_path, limits={"read_per_minute": 3})

    async def body(h: Harness) -> None:
        key = SigningKey.generate()
        token = await sign_in(h.client, key)
        client = anon_client(h)
        assert (await client.get("/v1/auth/session", headers=bearer(token))).status_code == 200
        looked_up = count_session_lookups(h)
        for n in range(3):
            r = await client.get("/v1/auth/session", headers=bearer(f"guess-{n}"))
            assert r.status_code == 401
        assert len(looked_up) == 3
        async with client.websocket("/v1/events") as ws:
            for n in range(5):
                await ws.send(json.dumps({"type": "auth", "token": f"ws-guess-{n}"}))
                refused = await receive(ws)
                assert refused["type"] == "error", refused
                assert refused["error"]["code"] == "read_rate_limited"
            await ws.send(json.dumps({"type": "auth", "token": token}))
            assert (await receive(ws))["principal"] == key.did
        async with client.websocket(
            "/v1/events", headers={"Authorization": "Bearer ws-guess"}
        ) as ws:
            assert await closed_with(ws) == 1013
        assert len(looked_up) == 3

    await with_harness(config, body)


@pytest.mark.parametrize(
    "message",
    [
        "not json",
        "[1, 2]",
        '{"type": "dance"}',
        '{"no": "type"}',
        b"\x00binary",
        '{"type": "subscribe", "fromSequence": 9223372036854775808}',
        "[" * 10_000,
    ],
    ids=["not-json", "array", "unknown-type", "no-type", "binary", "not-i-json", "too-deep"],
)
async def test_a_malformed_message_closes_with_4400(
    harness: Harness, message: str | bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with harness.client.websocket("/v1/events") as ws:
        await ws.send(message)
        assert await closed_with(ws) == 4400
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize(
    "fields",
    [
        {"kinds": ["entry.exploded"]},
        {"kinds": []},
        {"fromSequence": -1},
        {"fromSequence": 1.5},
        {"fromSequence": "5"},
        {"entryDids": "did:web:x"},
        {"surprise": True},
    ],
    ids=["unknown-kind", "no-kinds", "negative", "fraction", "string", "not-a-list", "extra"],
)
async def test_an_invalid_subscription_is_refused_and_the_socket_stays_open(
    harness: Harness, fields: dict[str, Any]
) -> None:
    async with harness.client.websocket("/v1/events") as ws:
        await ws.send(json.dumps({"type": "subscribe", **fields}))
        answer = await receive(ws)
        assert answer["type"] == "error"
        assert answer["error"]["code"] == "invalid_message"
        await subscribe(ws)  # still usable


async def test_filter_lists_given_as_null_are_absent(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A `null` filter list admits everything, as an absent one does (`kinds: null` raised a
    TypeError in its validator: a traceback, and the socket closed with 1000)."""
    caplog.set_level(logging.WARNING)
    async with harness.client.websocket("/v1/events") as ws:
        await subscribe(ws, kinds=None, entryTypes=None, entryDids=None)
        await ws.send(json.dumps({"type": "ping"}))
        assert (await receive(ws))["type"] == "pong"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize(
    "path", ["/v1/nowhere", "/v1/health", "/console/", "/console", "/v1/openapi.json"]
)
async def test_a_websocket_handshake_on_any_other_path_is_a_clean_404(
    harness: Harness, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    """docs/events.md: any path but `/v1/events` answers the handshake with 404
    `route_not_found`, a path that HTTP serves too (it was 400 `bad_request` there)."""
    caplog.set_level(logging.WARNING)
    with pytest.RaisesGroup(
        WebsocketResponseError, allow_unwrapped=True, flatten_subgroups=True
    ) as refused:
        async with harness.client.websocket(path) as ws:
            await ws.receive()
    (error,) = (
        refused.value.exceptions
        if isinstance(refused.value, BaseExceptionGroup)
        else (refused.value,)
    )
    assert isinstance(error, WebsocketResponseError)
    response = error.response
    assert response.status_code == 404
    body = json.loads(await response.get_data())
    assert body["error"]["code"] == "route_not_found"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def until(condition: Callable[[], bool]) -> bool:
    """Whether `condition` held within the deadline (checked every 10 ms: the state it reads
    belongs to the service's actors, which signal nothing the test could wait on)."""
    with trio.move_on_after(DEADLINE):
        while True:
            if condition():
                return True
            await trio.sleep(0.01)
    return False


async def test_subscriptions_that_end_on_a_quiet_log_leave_no_trace(
    database_url: str, tmp_path: Path
) -> None:
    """Each subscription holds its socket's state in the log actor until it is dropped. With
    nothing written, no batch comes to drop the ended ones: re-subscribing and closing sockets
    must not pile them up."""
    config = make_config(database_url, tmp_path, events={"poll_seconds": 0.2})

    async def body(h: Harness) -> None:
        logs = h.service.logs
        client = anon_client(h)
        before = logs.statistics().subscribers  # the process's own followers (the caches)
        start = await head(h)  # the database may hold other tests' entries
        for _ in range(3):
            async with client.websocket("/v1/events") as ws:
                for _ in range(30):  # each subscribe ends the one before it
                    attached = logs.statistics().attached
                    await subscribe(ws, fromSequence=start, kinds=["entry.created"])
                    # live: the actor holds its sink
                    assert await until(lambda n=attached: logs.statistics().attached > n)
        assert await until(lambda: logs.statistics().subscribers == before), logs.statistics()
        assert await head(h) == start  # nothing was written: the quiet log dropped them

    await with_harness(config, body)


async def test_a_replay_waits_while_its_address_owes_database_time(
    database_url: str, tmp_path: Path
) -> None:
    """A replay's pages are paid from its client address's database time, as its queries are
    (docs/limits.md): while the address is in debt the replay waits, then reads, and pays.
    (A resume the log actor can serve from its recent records reads no page: two records
    behind with a queue of one, this one reads from the store.)"""
    from registry.metering import DB_TIME_CLASS

    config = make_config(
        database_url,
        tmp_path,
        server={"trusted_proxies": 1},
        limits={"query_db_ms_per_minute_per_address": 60_000},  # a debt of 1 s takes 1 s
        events={"queue_size": 1},
    )
    address = "203.0.113.20"

    async def body(h: Harness) -> None:
        key = SigningKey.generate()
        token = await sign_in(h.client, key)
        before = await head(h)
        made = await create(h, key, token)
        last = await create(h, key, token)
        logs = h.service.logs  # it has read both: the subscription is not live at once
        assert await until(lambda: logs.statistics().head >= last["sequence"])
        limiter = h.deps.limiter
        limiter.charge(DB_TIME_CLASS, address, 60_000 + 1_500)  # 1.5 s in debt
        with trio.fail_after(30):
            async with h.client.websocket("/v1/events", headers={"X-Forwarded-For": address}) as ws:
                started = trio.current_time()
                await subscribe(ws, fromSequence=before, entryDids=[made["entryDid"]])
                (event,) = await events(ws, 1)
                waited = trio.current_time() - started
        assert event["sequence"] == made["sequence"]
        assert waited >= 1.0  # the page was read once the debt was paid, not before

    await with_harness(config, body)


async def test_a_refused_replay_leaves_the_current_subscription_running(
    database_url: str, tmp_path: Path
) -> None:
    """The replay budget was checked after the current subscription had been stopped: the
    refusal (an `error`; the socket stays open) silently ended the live stream, with no
    `unsubscribed`, and the idle timer then closed the socket."""
    config = make_config(database_url, tmp_path, events={"replays_per_minute": 1})

    async def body(h: Harness) -> None:
        key = SigningKey.generate()
        token = await sign_in(h.client, key)
        async with h.client.websocket("/v1/events") as ws:
            await subscribe(ws)
            first = await create(h, key, token)
            # Delivered live: this process's log has read it, so fromSequence 0 is a replay.
            assert (await events(ws, 1))[0]["entryDid"] == first["entryDid"]
            await subscribe(ws, fromSequence=0)  # the address's one replay
            await ws.send(json.dumps({"type": "subscribe", "fromSequence": 0}))
            while (message := await receive(ws))["type"] != "error":
                assert message["type"] in ("event", "heartbeat"), message
            assert message["error"]["code"] == "replay_rate_limited", message
            entry = await create(h, key, token)
            while True:  # the first subscription still delivers live events
                message = await receive(ws)
                assert message["type"] in ("event", "heartbeat"), message
                if message["type"] == "event" and message["entryDid"] == entry["entryDid"]:
                    break

    await with_harness(config, body)
