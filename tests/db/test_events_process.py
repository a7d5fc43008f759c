"""The event stream across real processes: two `registry serve` on one database, a WebSocket
client (trio-websocket) on one of them, writes through the other; a slow consumer closed with
its resume point over a real socket, and the resume losing nothing."""

from __future__ import annotations

import json
import math
import secrets
import socket
from pathlib import Path
from typing import Any

import pytest
import trio
import trio_asyncio
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    open_websocket_url,
    wrap_client_stream,
)

from cli.client import RegistryClient
from registry.keys import SigningKey
from registry.store.pg import open_pg_store
from registry.usecases.entries import entry_change
from tests.db.proc import run_server
from tests.helpers import entry_template

DEADLINE = 20
SEND_BUFFER_MOST = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])


def ws_url(http_url: str) -> str:
    return http_url.replace("http://", "ws://") + "/v1/events"


async def receive(ws: WebSocketConnection) -> dict[str, Any]:
    with trio.fail_after(DEADLINE):
        return dict(json.loads(await ws.get_message()))


async def next_event(ws: WebSocketConnection) -> dict[str, Any]:
    while True:
        message = await receive(ws)
        if message["type"] == "event":
            return message


async def open_small_buffer_websocket(nursery: trio.Nursery, http_url: str) -> WebSocketConnection:
    """A WebSocket client whose socket receive buffer is 4 KB (set before connecting)."""
    host, port = http_url.removeprefix("http://").rsplit(":", 1)
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((host, int(port)))
    return await wrap_client_stream(nursery, trio.SocketStream(sock), host, "/v1/events")


async def read_events_until_closed(ws: WebSocketConnection, into: list[int]) -> None:
    while True:
        message = json.loads(await ws.get_message())
        if message["type"] == "event":
            into.append(message["sequence"])


async def test_an_entry_written_through_one_process_reaches_a_subscriber_of_another(
    database_url: str, tmp_path: Path
) -> None:
    key = SigningKey.generate()
    did = f"did:web:two.process.test:{secrets.token_hex(6)}"
    with (
        run_server(tmp_path / "a", database_url=database_url) as a,
        run_server(tmp_path / "b", database_url=database_url) as b,
    ):
        async with open_websocket_url(ws_url(b.url)) as ws:
            await ws.send_message(json.dumps({"type": "subscribe", "entryDids": [did]}))
            assert (await receive(ws))["type"] == "subscribed"

            def publish() -> dict[str, Any]:
                with RegistryClient(a.url) as client:
                    client.sign_in(key)
                    return client.publish(entry_template(did), key)

            published = await trio.to_thread.run_sync(publish)
            event = await next_event(ws)
            await ws.aclose()
    assert event["kind"] == "entry.created"
    assert event["entryDid"] == did
    assert event["sequence"] == published["sequence"]
    assert "Traceback" not in a.output() + b.output()


async def test_with_the_connection_hook_off_events_still_arrive_through_the_asgi_path(
    database_url: str, tmp_path: Path
) -> None:
    """The fallback `serve` takes where the Hypercorn hook does not fit (or is turned off):
    said at start, and every operation, events included, still works."""
    key = SigningKey.generate()
    did = f"did:web:plain.test:{secrets.token_hex(6)}"
    env = {"REGISTRY_SERVER__CONNECTION_HOOK": "false"}
    with run_server(tmp_path, database_url=database_url, extra_env=env) as server:
        async with open_websocket_url(ws_url(server.url)) as ws:
            await ws.send_message(json.dumps({"type": "subscribe", "entryDids": [did]}))
            assert (await receive(ws))["type"] == "subscribed"

            def publish() -> dict[str, Any]:
                with RegistryClient(server.url) as client:
                    client.sign_in(key)
                    return client.publish(entry_template(did), key)

            published = await trio.to_thread.run_sync(publish)
            event = await next_event(ws)
            await ws.aclose()
        output = server.output()
    assert (event["entryDid"], event["sequence"]) == (did, published["sequence"])
    assert "server.connection_hook is off" in output
    assert "Traceback" not in output


async def test_a_slow_consumer_is_closed_with_its_resume_point_and_resumes_without_loss(
    database_url: str, tmp_path: Path
) -> None:
    # More events than the kernel holds for a client that stops reading (its receive buffer
    # is 4 KB; the server's send buffer grows to at most tcp_wmem's maximum): the server's own
    # queue of 4 then overflows and it closes the socket with 4429.
    per_transaction, pad = 500, "x" * 4_000
    most = SEND_BUFFER_MOST
    burst = per_transaction * math.ceil(2 * most / len(pad) / per_transaction)
    prefix = f"did:web:slow.test:{secrets.token_hex(4)}"
    env = {"REGISTRY_EVENTS__QUEUE_SIZE": "4"}
    with run_server(tmp_path, database_url=database_url, extra_env=env) as server:
        received: list[int] = []
        async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
            start = await store.log_head()
            async with trio.open_nursery() as nursery:
                ws = await open_small_buffer_websocket(nursery, server.url)
                await ws.send_message(json.dumps({"type": "subscribe", "fromSequence": start}))
                assert (await receive(ws))["type"] == "subscribed"
                # The client's reader stops once a message waits unread: nothing is read
                # while the changes are written.
                for first in range(0, burst, per_transaction):
                    changes = [
                        entry_change(
                            "entry.created",
                            did=f"{prefix}:{n}",
                            expected_head=None,
                            publisher="did:key:zSlow",
                            entry_type="AgentDefinition",
                            lifecycle="draft",
                            prefix='{"entryDid":"' + f"{prefix}:{n}" + '","sequence":',
                            suffix="}",
                            event={"pad": pad},
                        )
                        for n in range(first, first + per_transaction)
                    ]
                    outcomes = await store.append([(c, None) for c in changes])
                    assert all(o.refusal is None for o in outcomes)
                with trio.fail_after(DEADLINE), pytest.raises(ConnectionClosed) as closed:
                    await read_events_until_closed(ws, received)
                assert closed.value.reason.code == 4429
                reason = json.loads(closed.value.reason.reason or "{}")
                await ws._stream.aclose()  # trio-websocket leaks its stream on a server close
            assert reason["code"] == "slow_consumer"
            resume = reason["lastSequence"]
            assert received == list(range(start + 1, resume + 1))  # exactly up to the point
            assert resume < start + burst
            async with open_websocket_url(ws_url(server.url)) as ws:
                await ws.send_message(json.dumps({"type": "subscribe", "fromSequence": resume}))
                assert (await receive(ws))["type"] == "subscribed"
                while len(received) < burst:
                    received.append((await next_event(ws))["sequence"])
                await ws.aclose()
    assert received == list(range(start + 1, start + burst + 1))
    assert "Traceback" not in server.output()
