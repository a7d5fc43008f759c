"""One event connection on the fast path (`FrameWriter`: the log actor writes frames straight to
a real socket) over the in-memory store: replay then live in order, heartbeats after the frames
before them, a slow consumer closed with a resume point that loses nothing, and a client that
reads nothing cut off. Real sockets, so real time, every wait under a deadline."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing
from wsproto.frame_protocol import CloseReason, FrameProtocol, Opcode

from actors.log import LogHandle, run_log
from registry.config import EventsConfig
from registry.store.memory import MemoryStore
from tests.actors.test_events_socket import StubSessions, fill
from ws.events import Connection, EventDeps
from ws.transport import FrameStream, text_frame

DEADLINE = 10
BUFFER = 4096


class StreamSocket:
    """Quart's side of the socket, reduced to what a connection uses: messages and the close
    frame go through the same FrameStream the log actor writes to (as Hypercorn's do)."""

    def __init__(self, stream: FrameStream) -> None:
        self.stream = stream
        self.to_server, self._inbox = trio.open_memory_channel[str](16)

    async def receive(self) -> str:
        return await self._inbox.receive()

    async def send(self, data: str) -> None:
        await self.stream.send_all(text_frame(data.encode()))

    async def close(self, code: int, reason: str = "") -> None:
        payload = code.to_bytes(2, "big") + reason.encode()
        await self.stream.send_all(bytes((0x88, len(payload))) + payload)


class Peer:
    """The client's end: reads frames as a WebSocket client decodes them."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.protocol = FrameProtocol(client=True, extensions=[])
        self.messages: list[dict[str, Any]] = []
        self.close: tuple[int, dict[str, Any]] | None = None
        self.heartbeats: list[int] = []
        self._text = ""

    async def read(self, count: int) -> list[dict[str, Any]]:
        """The next `count` messages (or fewer, if the server closes first)."""
        with trio.fail_after(DEADLINE):
            while len(self.messages) < count and self.close is None:
                data = await self.stream.receive_some()
                if not data:
                    break
                self.protocol.receive_bytes(data)
                for frame in self.protocol.received_frames():
                    if frame.opcode in (Opcode.TEXT, Opcode.CONTINUATION):
                        self._text += frame.payload  # a frame comes in parts as it arrives
                        if frame.message_finished:
                            self.messages.append(json.loads(self._text))
                            self._text = ""
                    elif frame.opcode is Opcode.CLOSE:
                        code, reason = frame.payload
                        assert isinstance(code, CloseReason | int)
                        self.close = (int(code), json.loads(reason) if reason else {})
        out, self.messages = self.messages[:count], self.messages[count:]
        return out

    async def events(self, count: int) -> list[int]:
        """The sequences of the next `count` events. Heartbeats between them are checked: each
        reports the last event before it as the resume point."""
        out: list[int] = []
        while len(out) < count:
            messages = await self.read(1)
            if not messages:
                break  # closed
            message = messages[0]
            if message["type"] == "heartbeat":
                self.heartbeats.append(message["lastSequence"])
                assert not out or message["lastSequence"] == out[-1], (message, out[-1])
                continue
            assert message["type"] == "event", message
            out.append(message["sequence"])
        return out


@dataclass
class Served:
    connection: Connection
    sock: StreamSocket
    peer: Peer
    ended: trio.Event
    scope: trio.CancelScope  # cancelling it is Quart cancelling the handler (a disconnect)

    async def put(self, message: dict[str, Any]) -> None:
        await self.sock.to_server.send(json.dumps(message))


@asynccontextmanager
async def open_fast(
    queue_size: int = 1024, **config: Any
) -> AsyncIterator[tuple[MemoryStore, Any]]:
    store = MemoryStore()
    async with trio.open_nursery() as nursery:
        logs: LogHandle = await nursery.start(partial(run_log, store, queue_size=queue_size))
        deps = EventDeps(logs=logs, sessions=StubSessions(), config=EventsConfig(**config))  # type: ignore[arg-type]

        @asynccontextmanager
        async def connect() -> AsyncIterator[Served]:
            server, client = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
            stream = FrameStream(trio.SocketStream(server))
            sock = StreamSocket(stream)
            connection = Connection(sock, deps, stream=stream)  # type: ignore[arg-type]
            ended, scope = trio.Event(), trio.CancelScope()

            async def run() -> None:
                with scope:
                    await connection.run()
                ended.set()

            async with stream, trio.SocketStream(client) as peer_stream:
                nursery.start_soon(run)
                yield Served(connection, sock, Peer(peer_stream), ended, scope)

        yield store, connect
        nursery.cancel_scope.cancel()


async def test_replay_then_live_arrive_as_frames_in_order_with_heartbeats_after_them() -> None:
    async with open_fast(heartbeat_seconds=0.2) as (store, connect), connect() as served:
        await fill(store, 3)
        await served.put({"type": "subscribe", "fromSequence": 0})
        assert (await served.peer.read(1))[0] == {"type": "subscribed", "fromSequence": 0}
        assert await served.peer.events(3) == [1, 2, 3]
        await fill(store, 600)  # more than a page of the log, live
        assert await served.peer.events(600) == list(range(4, 604))
        heartbeat = (await served.peer.read(1))[0]  # the quiet after the last event
        assert heartbeat == {"type": "heartbeat", "lastSequence": 603}
        assert served.connection.stream is not None
        assert served.connection.stream.pending_bytes == 0


async def test_a_slow_consumer_is_closed_after_the_events_before_its_resume_point(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with open_fast(queue_size=8) as (store, connect):
        async with connect() as served:
            await served.put({"type": "subscribe", "fromSequence": 0})
            await served.peer.read(1)
            # The client reads nothing while the log grows far beyond what the socket holds.
            logs = served.connection.deps.logs
            while logs.statistics().dropped_slow == 0:
                with trio.fail_after(DEADLINE):
                    await fill(store, 50)
                    await trio.testing.wait_all_tasks_blocked()
            head = await store.log_head()
            got = await served.peer.events(head)  # whatever was sent before the close
            assert served.peer.close is not None
            code, reason = served.peer.close
            assert code == 4429
            assert reason == {"code": "slow_consumer", "lastSequence": got[-1]}
            assert got == list(range(1, got[-1] + 1))
            assert got[-1] < head
        async with connect() as again:  # resuming from the point loses nothing
            await again.put({"type": "subscribe", "fromSequence": reason["lastSequence"]})
            await again.peer.read(1)
            assert await again.peer.events(head - got[-1]) == list(range(got[-1] + 1, head + 1))
    # Clients that close or go away are no incident: nothing is logged above INFO.
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_client_that_reads_nothing_is_cut_off() -> None:
    async with open_fast(send_timeout_seconds=0.4) as (store, connect), connect() as served:
        await served.put({"type": "subscribe", "fromSequence": 0})
        await served.peer.read(1)
        await fill(store, 2000)  # far more than the socket holds; the client reads none of it
        with trio.fail_after(DEADLINE):
            await served.ended.wait()
        assert served.connection.stream is not None
        assert served.connection.stream.broken
        # What registry_connections_cut_total counts it under (a client that took nothing).
        assert served.connection.stream.cut_for == "send"


async def test_a_disconnect_while_the_client_takes_nothing_ends_the_connection_at_once() -> None:
    # Quart cancels the handler when the client goes (FIN) or the server's graceful deadline
    # passes; a write waiting for a client that reads nothing must not keep it alive.
    async with open_fast(send_timeout_seconds=3600) as (store, connect), connect() as served:
        await served.put({"type": "subscribe", "fromSequence": 0})
        await served.peer.read(1)
        await fill(store, 2000)  # far more than the socket holds
        await trio.testing.wait_all_tasks_blocked()
        stream = served.connection.stream
        assert stream is not None
        assert stream.pending_bytes > 0
        served.scope.cancel()
        with trio.fail_after(DEADLINE):
            await served.ended.wait()
        assert stream.broken  # cut off: Hypercorn will not wait for it either


async def test_no_event_follows_a_close_frame_written_by_hypercorn() -> None:
    # A client's close is answered by Hypercorn itself, through the same stream: from then on
    # the fan-out finds the stream sealed, and the subscription ends without another frame.
    async with open_fast() as (store, connect), connect() as served:
        stream = served.connection.stream
        assert stream is not None
        stream.websocket = True
        await served.put({"type": "subscribe", "fromSequence": 0})
        await served.peer.read(1)
        await fill(store, 2)
        assert await served.peer.events(2) == [1, 2]
        await stream.send_all(bytes((0x88, 2)) + (1000).to_bytes(2, "big"))  # Hypercorn's reply
        await fill(store, 3)
        with trio.fail_after(DEADLINE):
            await served.ended.wait()
        assert await served.peer.events(1) == []
        assert served.peer.close is not None
        assert served.peer.close[0] == 1000
