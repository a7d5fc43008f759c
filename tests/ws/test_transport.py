"""The fan-out's fast path at the socket (ws/transport.py): frames as an independent decoder
(wsproto) reads them, `FrameStream` ordering over a real socket pair with small buffers, the cut-off
of a client that reads nothing, and the hook that wraps Hypercorn's connections."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import hypercorn.trio
import pytest
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import run as hypercorn_worker
from quart import Response, websocket
from quart_trio import QuartTrio
from trio_websocket import open_websocket_url
from wsproto.frame_protocol import FrameProtocol, Opcode

from ws import transport
from ws.transport import (
    CURRENT_STREAM,
    GUARD_ATTRIBUTE,
    PLAIN_ATTRIBUTE,
    FrameStream,
    hook_unfit,
    install_in_hypercorn,
    text_frame,
)

DEADLINE = 10
BUFFER = 4096  # the socket pair's buffers: a few KB, so a client that reads nothing is seen


def decode(data: bytes) -> list[tuple[Opcode, str]]:
    """Frames as a WebSocket client decodes them (wsproto refuses masked server frames)."""
    protocol = FrameProtocol(client=True, extensions=[])
    protocol.receive_bytes(data)
    out = []
    for frame in protocol.received_frames():
        assert frame.frame_finished
        assert frame.message_finished
        out.append((frame.opcode, frame.payload))
    return out


@pytest.mark.parametrize("size", [0, 1, 125, 126, 127, 65_535, 65_536, 200_000])
def test_a_text_frame_is_what_a_client_decodes(size: int) -> None:
    text = ("é" * size)[:size] if size < 100 else "x" * size
    assert decode(text_frame(text.encode())) == [(Opcode.TEXT, text)]


def test_frames_concatenate_into_one_write() -> None:
    texts = ["a", "b" * 300, "c" * 70_000, "☃"]
    assert decode(b"".join(text_frame(t.encode()) for t in texts)) == [
        (Opcode.TEXT, t) for t in texts
    ]


@asynccontextmanager
async def socket_pair() -> AsyncIterator[tuple[FrameStream, trio.SocketStream]]:
    """A FrameStream (the server's end) and the client's end, with small buffers."""
    server, client = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
    stream, peer = FrameStream(trio.SocketStream(server)), trio.SocketStream(client)
    async with stream, peer:
        yield stream, peer


async def read_exactly(peer: trio.SocketStream, size: int) -> bytes:
    data = bytearray()
    with trio.fail_after(DEADLINE):
        while len(data) < size:
            chunk = await peer.receive_some()
            assert chunk, "the connection ended early"
            data += chunk
    return bytes(data)


async def test_an_offer_the_socket_takes_is_written_at_once() -> None:
    async with socket_pair() as (stream, peer):
        assert stream.offer(b"hello") is True
        assert stream.pending_bytes == 0
        assert await read_exactly(peer, 5) == b"hello"


async def test_what_the_socket_does_not_take_stays_pending_and_goes_first() -> None:
    big = bytes(range(256)) * 1024  # 256 KB: far more than the buffers hold
    async with socket_pair() as (stream, peer):
        assert stream.offer(big) is False
        assert 0 < stream.pending_bytes < len(big)
        assert stream.offer(b"after") is False  # queued behind, never written before it
        received: list[bytes] = []
        async with trio.open_nursery() as nursery:

            async def read_all() -> None:
                received.append(await read_exactly(peer, len(big) + len(b"after") + 4))

            nursery.start_soon(read_all)
            await stream.send_all(b"last")  # Hypercorn's own write: after everything offered
        assert stream.pending_bytes == 0
        assert received == [big + b"after" + b"last"]


async def test_flush_waits_until_everything_offered_is_with_the_kernel() -> None:
    big = b"z" * 100_000
    async with socket_pair() as (stream, peer):
        stream.offer(big)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_exactly, peer, len(big))
            await stream.flush()
            assert stream.pending_bytes == 0
        assert stream.offer(b"!") is True  # nothing pending: straight to the socket again


async def test_a_write_the_socket_takes_in_part_keeps_its_rest_ahead_of_later_offers() -> None:
    # Nothing pending: send_all writes straight to the socket; what the socket does not take
    # is queued first, and an offer made while the write waits goes after it.
    big = bytes(range(256)) * 1024
    async with socket_pair() as (stream, peer):
        received: list[bytes] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.send_all, big)
            await trio.testing.wait_all_tasks_blocked()
            assert 0 < stream.pending_bytes < len(big)  # written in part, the rest waits
            assert stream.offer(b"after") is False
            received.append(await read_exactly(peer, len(big) + len(b"after")))
        assert received == [big + b"after"]
        assert stream.pending_bytes == 0


async def test_an_offer_made_while_a_partial_write_takes_the_lock_goes_after_its_rest() -> None:
    # The window a review found: the socket took part of a frame, and the writer is taking the
    # lock (a checkpoint: other tasks run). An offer then must not land inside the frame.
    # Which task runs first is trio's random choice, so the race is run many times.
    big = bytes(range(256)) * 1024
    for _ in range(20):
        async with socket_pair() as (stream, peer):

            async def offer_once_the_lock_is_taken(stream: FrameStream = stream) -> None:
                for _ in range(100):
                    if stream._lock.locked():
                        break
                    await trio.lowlevel.cancel_shielded_checkpoint()
                stream.offer(b"EVENT")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.send_all, big)
                nursery.start_soon(offer_once_the_lock_is_taken)
                received = await read_exactly(peer, len(big) + len(b"EVENT"))
            assert received == big + b"EVENT"


def nothing_to_read(peer: trio.SocketStream) -> bool:
    """Whether the client's end has no byte waiting (its socket is non-blocking)."""
    try:
        os.read(peer.socket.fileno(), 1)
    except BlockingIOError:
        return True
    return False


def counting_writes(stream: FrameStream) -> list[bytes]:
    """Every chunk `stream` hands the kernel from now on, one item per system call."""
    writes: list[bytes] = []
    write = stream._write

    def counted(data: bytes | bytearray | memoryview) -> int:
        writes.append(bytes(data))
        return write(data)

    stream._write = counted  # type: ignore[method-assign]
    return writes


# A WebSocket handshake for /ws (RFC 6455's sample key).
WS_UPGRADE = (
    b"GET /ws HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)
HEAD = b"HTTP/1.1 200 \r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"


async def test_an_answers_head_goes_out_with_its_body_in_one_write() -> None:
    # Hypercorn sends a head, a body and an end (b"" when the length is declared) in three
    # calls: one system call and one segment for the lot.
    async with socket_pair() as (stream, peer):
        writes = counting_writes(stream)
        await stream.send_all(HEAD)
        assert nothing_to_read(peer)  # held for its body
        await stream.send_all(b"{}")
        await stream.send_all(b"")
        assert writes == [HEAD + b"{}"]
        assert await read_exactly(peer, len(HEAD) + 2) == HEAD + b"{}"
        # The next answer on the connection is held and sent the same way.
        await stream.send_all(HEAD)
        await stream.send_all(b"[]")
        assert writes == [HEAD + b"{}", HEAD + b"[]"]
        assert await read_exactly(peer, len(HEAD) + 2) == HEAD + b"[]"


async def test_an_answer_without_a_body_goes_out_at_its_end() -> None:
    head = b'HTTP/1.1 304 \r\netag: "7"\r\n\r\n'
    async with socket_pair() as (stream, peer):
        writes = counting_writes(stream)
        await stream.send_all(head)
        assert nothing_to_read(peer)
        await stream.send_all(b"")  # h11's end of a message without a body
        assert writes == [head]
        assert await read_exactly(peer, len(head)) == head


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 100 \r\n\r\n",  # the client waits for it before it sends the body
        b"HTTP/1.1 101 \r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
        b"HTTP/1.1 200 \r\nx-big: " + b"a" * transport.HELD_HEAD_BYTES + b"\r\n\r\n",
    ],
    ids=["100-continue", "101-upgrade", "head-over-the-held-size"],
)
async def test_heads_that_are_not_held_go_out_at_once(head: bytes) -> None:
    async with socket_pair() as (stream, peer), trio.open_nursery() as nursery:
        nursery.start_soon(stream.send_all, head)
        assert await read_exactly(peer, len(head)) == head


async def test_a_body_that_looks_like_a_head_is_still_the_held_heads_body() -> None:
    body = b"HTTP/1.1 200 OK, said the body"
    async with socket_pair() as (stream, peer):
        writes = counting_writes(stream)
        await stream.send_all(HEAD)
        await stream.send_all(body)
        await stream.send_all(b"")
        assert writes == [HEAD + body]
        assert await read_exactly(peer, len(HEAD) + len(body)) == HEAD + body


async def test_a_large_body_goes_out_after_its_head_without_being_copied_behind_it() -> None:
    body = b"b" * (transport.MERGED_BODY_BYTES + 1)
    async with socket_pair() as (stream, peer):
        writes = counting_writes(stream)
        async with trio.open_nursery() as nursery:

            async def answer() -> None:
                await stream.send_all(HEAD)
                await stream.send_all(body)

            nursery.start_soon(answer)
            assert await read_exactly(peer, len(HEAD) + len(body)) == HEAD + body
        assert writes[0] == HEAD


async def test_a_held_head_whose_body_never_comes_goes_out_when_the_connection_ends() -> None:
    # The app failed after its answer's start, or its task was cancelled: Hypercorn ends the
    # connection with `send_eof`, and the client gets the head it would have got before.
    async with socket_pair() as (stream, peer):
        await stream.send_all(HEAD)
        await stream.send_eof()
        with trio.fail_after(DEADLINE):
            received = b""
            while chunk := await peer.receive_some():
                received += chunk
        assert received == HEAD


async def test_a_held_head_the_socket_takes_in_part_at_the_end_resets_the_connection() -> None:
    """`send_eof` cannot wait for a client that is not reading: rather than half a head and a
    clean end (which a client could take for a whole, bodiless answer), the connection is reset."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with listeners[0] as listener:
        port = listener.socket.getsockname()[1]
        client_sock = trio.socket.socket()
        client_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
        await client_sock.connect(("127.0.0.1", port))
        server = await listener.accept()
        server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
        stream, peer = FrameStream(server), trio.SocketStream(client_sock)
        head = b"HTTP/1.1 200 \r\nx-pad: " + b"p" * 12_000 + b"\r\ncontent-length: 5\r\n\r\n"
        async with stream, peer:
            stream.offer(b"x" * 200_000)  # what the client has not read fills the socket
            await stream.send_all(head)  # held (12 KiB <= HELD_HEAD_BYTES)
            with pytest.raises(trio.BrokenResourceError):
                await stream.send_eof()  # the app failed before its body
            received = bytearray()

            async def drain() -> None:
                while chunk := await peer.receive_some():
                    received.extend(chunk)

            with trio.fail_after(DEADLINE), pytest.raises(trio.BrokenResourceError):
                await drain()
        assert not received.endswith(head)


async def test_a_body_write_cancelled_before_it_starts_leaves_the_head_held() -> None:
    async with socket_pair() as (stream, peer):
        await stream.send_all(HEAD)
        with trio.CancelScope() as scope:
            scope.cancel()
            await stream.send_all(b"{}")
        assert scope.cancelled_caught
        assert nothing_to_read(peer)
        await stream.send_all(b"[]")
        assert await read_exactly(peer, len(HEAD) + 2) == HEAD + b"[]"


async def test_a_write_cancelled_before_it_starts_sends_nothing() -> None:
    async with socket_pair() as (stream, peer):
        with trio.CancelScope() as scope:
            scope.cancel()
            await stream.send_all(b"never")
        assert scope.cancelled_caught
        await stream.send_all(b"sent")
        assert await read_exactly(peer, 4) == b"sent"


async def test_abort_ends_a_write_that_waits_for_a_client_that_reads_nothing() -> None:
    async with socket_pair() as (stream, _peer):
        stream.offer(b"y" * 100_000)
        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                failed = trio.Event()

                async def write() -> None:
                    with pytest.raises((trio.ClosedResourceError, trio.BrokenResourceError)):
                        await stream.send_all(b"close frame")
                    failed.set()

                nursery.start_soon(write)
                await trio.testing.wait_all_tasks_blocked()
                assert not failed.is_set()  # stuck behind the pending bytes
                stream.abort()
        assert failed.is_set()
        with pytest.raises(trio.BrokenResourceError):
            stream.offer(b"more")


async def test_an_offer_to_a_client_that_has_gone_is_refused() -> None:
    async with socket_pair() as (stream, peer):
        await peer.aclose()
        with pytest.raises(trio.BrokenResourceError):
            stream.offer(b"x" * 1000)  # the peer's end is closed: EPIPE at once


@pytest.fixture
def hypercorn_with_frame_streams() -> Iterator[None]:
    """The hook installed for one test (`serve` installs it for good in its process)."""
    original = hypercorn_worker.TCPServer  # type: ignore[attr-defined]
    install_in_hypercorn()
    install_in_hypercorn()  # idempotent
    yield
    hypercorn_worker.TCPServer = original  # type: ignore[attr-defined]


@asynccontextmanager
async def serving(app: QuartTrio, config: HyperConfig) -> AsyncIterator[str]:
    """Hypercorn serving `app` with `config` on a free port of 127.0.0.1: its http:// URL."""
    config.bind = ["127.0.0.1:0"]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds: Any = await nursery.start(
            lambda task_status: hypercorn.trio.serve(
                app, config, shutdown_trigger=stop.wait, task_status=task_status
            )
        )
        try:
            yield binds[0]
        finally:
            stop.set()


async def open_to(url: str) -> trio.SocketStream:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


@pytest.mark.usefixtures("hypercorn_with_frame_streams")
async def test_hypercorn_serves_each_plain_connection_through_a_frame_stream() -> None:
    app = QuartTrio(__name__)

    @app.websocket("/ws")
    async def ws() -> None:
        await websocket.accept()
        stream = CURRENT_STREAM.get()
        assert isinstance(stream, FrameStream)
        await websocket.send(json.dumps({"type": "hello"}))
        # Frames offered straight to the socket, then a message through Quart: in this order.
        stream.offer(text_frame(b'{"n":1}') + text_frame(b'{"n":2}'))
        await websocket.send(json.dumps({"n": 3}))
        await websocket.receive()

    async with serving(app, HyperConfig()) as base:
        url = base.replace("http://", "ws://") + "/ws"
        with trio.fail_after(DEADLINE):
            async with open_websocket_url(url) as client:
                got = [json.loads(await client.get_message()) for _ in range(4)]
                await client.send_message("bye")
    assert got == [{"type": "hello"}, {"n": 1}, {"n": 2}, {"n": 3}]


@pytest.mark.usefixtures("hypercorn_with_frame_streams")
async def test_a_handler_slower_than_the_read_timeout_still_answers() -> None:
    """The read deadline runs while the client owes bytes, not while the app works on a request
    it has read whole (api/framing.py tells the connection)."""
    from api.framing import with_framing_checks
    from ws.transport import GUARD_ATTRIBUTE, ConnectionGuard, ConnectionLimits

    app = QuartTrio(__name__)

    @app.route("/slow", methods=["POST"])
    async def slow() -> str:
        await trio.sleep(1.5)  # three read timeouts
        return "done"

    app.asgi_app = with_framing_checks(app.asgi_app, lambda: "rid")  # type: ignore[method-assign]
    config = HyperConfig()
    setattr(config, GUARD_ATTRIBUTE, ConnectionGuard(ConnectionLimits(read_timeout=0.5)))
    async with serving(app, config) as url:
        with trio.fail_after(DEADLINE):
            stream = await open_to(url)
            await stream.send_all(b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}")
            answer = b""
            while b"done" not in answer:
                chunk = await stream.receive_some()
                assert chunk, f"cut before the answer: {answer!r}"
                answer += chunk
            await stream.aclose()
    assert answer.startswith(b"HTTP/1.1 200")


async def h2_get(stream: trio.SocketStream, conn: Any, path: str, events: list[Any]) -> bytes:
    """GET `path` on an HTTP/2 connection (`h2`'s client `conn`, events already received in
    `events`): the body of its answer."""
    import h2.events

    stream_id = conn.get_next_available_stream_id()
    if path:
        headers = [(":method", "GET"), (":path", path), (":scheme", "http"), (":authority", "t")]
        conn.send_headers(stream_id, headers, end_stream=True)
    else:  # the request of an h2c upgrade: stream 1, answered over HTTP/2
        stream_id = 1
    body = b""
    with trio.fail_after(DEADLINE):
        while True:
            for event in events:
                if isinstance(event, h2.events.DataReceived) and event.stream_id == stream_id:
                    body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, stream_id)
                if isinstance(event, h2.events.StreamEnded) and event.stream_id == stream_id:
                    if out := conn.data_to_send():
                        await stream.send_all(out)
                    return body
            if out := conn.data_to_send():
                await stream.send_all(out)
            chunk = await stream.receive_some()
            assert chunk, f"the connection was cut; the body so far: {body!r}"
            events = conn.receive_data(chunk)


def h2_app() -> QuartTrio:
    app = QuartTrio(__name__)

    @app.route("/t")
    async def text() -> str:
        return "hello"

    return app


def bounded(**limits: float) -> HyperConfig:
    from ws.transport import GUARD_ATTRIBUTE, ConnectionGuard, ConnectionLimits

    config = HyperConfig()
    setattr(config, GUARD_ATTRIBUTE, ConnectionGuard(ConnectionLimits(**limits)))  # type: ignore[arg-type]
    return config


@pytest.mark.usefixtures("hypercorn_with_frame_streams")
async def test_an_h2c_upgrade_is_served_over_http2_not_read_as_websocket_frames() -> None:
    """`Upgrade: h2c` (curl --http2 on an http:// URL): Hypercorn answers 101 and HTTP/2 follows;
    the connection used to take any 101 for a WebSocket upgrade and cut the HTTP/2 preface as
    a frame with reserved bits (1002)."""
    import h2.config
    import h2.connection

    async with serving(h2_app(), bounded()) as url, await open_to(url) as stream:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        settings = conn.initiate_upgrade_connection()
        await stream.send_all(
            b"GET /t HTTP/1.1\r\nHost: t\r\nUpgrade: h2c\r\n"
            b"Connection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: " + settings + b"\r\n\r\n"
        )
        raw = b""
        with trio.fail_after(DEADLINE):
            while b"\r\n\r\n" not in raw:
                raw += await stream.receive_some()
        assert raw.startswith(b"HTTP/1.1 101"), raw
        events = conn.receive_data(raw.split(b"\r\n\r\n", 1)[1])
        assert await h2_get(stream, conn, "", events) == b"hello"
        assert await h2_get(stream, conn, "/t", []) == b"hello"


@pytest.mark.usefixtures("hypercorn_with_frame_streams")
async def test_http2_with_prior_knowledge_gets_one_requests_time_as_a_whole() -> None:
    """The preface first (`PRI * HTTP/2.0`): streams interleave, so the read deadline between
    two requests (here 0.3 s) does not cut it; the connection as a whole is cut one request's
    time (1 s) after it switched."""
    import h2.config
    import h2.connection

    config = bounded(request_timeout=1.0, read_timeout=0.3)
    async with serving(h2_app(), config) as url, await open_to(url) as stream:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        preface = conn.data_to_send()
        assert preface.startswith(transport.H2_PREFACE)
        await stream.send_all(preface[:5])  # the preface in parts
        await stream.send_all(preface[5:])
        opened = trio.current_time()
        assert await h2_get(stream, conn, "/t", []) == b"hello"
        await trio.sleep(0.5)  # longer than the read timeout: the time is what is tested
        assert await h2_get(stream, conn, "/t", []) == b"hello"
        with trio.fail_after(DEADLINE):
            while await stream.receive_some():
                pass
        assert trio.current_time() - opened == pytest.approx(1.0, abs=0.3)


@pytest.mark.usefixtures("hypercorn_with_frame_streams")
async def test_an_http2_request_whose_body_never_comes_is_cut() -> None:
    """Hypercorn's keep-alive holds only while no stream is open, and streams have no read
    deadline of their own: a POST whose body never came held its task (and the connection)
    for good, up to 100 such streams per connection."""
    import h2.config
    import h2.connection
    from quart import request

    app = QuartTrio(__name__)
    waiting = trio.Event()

    @app.route("/upload", methods=["POST"])
    async def upload() -> str:
        waiting.set()
        await request.get_data()
        return "stored"

    config = bounded(request_timeout=0.3, read_timeout=0.3, keep_alive_timeout=0.3)
    gone = released(getattr(config, GUARD_ATTRIBUTE))
    async with serving(app, config) as url:
        stream = await open_to(url)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        headers = [(":method", "POST"), (":path", "/upload"), (":scheme", "http"),
                   (":authority", "t"), ("content-length", "100")]  # fmt: skip
        conn.send_headers(1, headers, end_stream=False)
        await stream.send_all(conn.data_to_send())
        with trio.fail_after(DEADLINE):
            await waiting.wait()
            await gone.wait()
        await stream.aclose()


def released(guard: Any) -> trio.Event:
    """Set when `guard` lets a connection go (its `release`)."""
    event = trio.Event()
    release = guard.release

    def noting(key: Any) -> None:
        release(key)
        event.set()

    guard.release = noting
    return event


async def half_closed_answer(app: QuartTrio, request: bytes) -> bytes:
    """What a client gets that sends `request` to `app` (behind the service's framing checks)
    and then ends its side of the connection."""
    from api.framing import with_framing_checks

    app.asgi_app = with_framing_checks(app.asgi_app, lambda: "rid")  # type: ignore[method-assign]
    async with serving(app, bounded()) as url:
        with trio.fail_after(DEADLINE):
            stream = await open_to(url)
            await stream.send_all(request)
            await stream.send_eof()
            answer = await read_to_end(stream)
            await stream.aclose()
    return answer


async def read_to_end(stream: trio.SocketStream) -> bytes:
    answer = b""
    while chunk := await stream.receive_some():
        answer += chunk
    return answer


@pytest.mark.usefixtures("hypercorn_with_frame_streams")
async def test_pipelined_requests_then_a_half_close_get_every_answer() -> None:
    """The second request comes in the first's read: no read tells the stream it began
    (Hypercorn's `Updated(idle=False)` does), and its answer was cancelled by the end."""

    app = QuartTrio(__name__)

    @app.route("/a")
    async def a() -> str:
        return "first"

    @app.route("/b")
    async def b() -> str:
        await trio.sleep(0.3)  # the client's end arrives meanwhile
        return "second"

    answer = await half_closed_answer(
        app,
        b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n"
        b"GET /b HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    )
    assert b"first" in answer, answer
    assert answer.endswith(b"second"), answer


@pytest.mark.usefixtures("hypercorn_with_frame_streams")
async def test_a_half_close_after_the_head_of_a_streamed_answer_still_gets_all_of_it() -> None:
    app = QuartTrio(__name__)

    @app.route("/stream")
    async def streamed() -> Response:
        async def body() -> Any:
            yield b"part1;"
            await trio.sleep(0.5)  # the client's end arrives meanwhile
            yield b"part2"

        return Response(body(), content_type="text/plain")

    async with serving(app, bounded()) as url:
        with trio.fail_after(DEADLINE):
            stream = await open_to(url)
            await stream.send_all(b"GET /stream HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            first = await stream.receive_some()  # the head and the first chunk
            await stream.send_eof()
            answer = first + await read_to_end(stream)
            await stream.aclose()
    assert b"part1;" in answer, answer
    assert b"part2" in answer, answer


@pytest.mark.usefixtures("hypercorn_with_frame_streams")
async def test_a_websocket_handshake_whose_client_has_closed_is_not_kept_open() -> None:
    """The end read during the handshake was held for an answer that never ends (the 101): the
    app's receive never returned and the connection outlived its client."""
    app = QuartTrio(__name__)
    ended = trio.Event()

    @app.websocket("/ws")
    async def ws() -> None:
        await trio.sleep(0.3)  # the client's end is read (and held) before the 101
        await websocket.accept()
        try:
            await websocket.receive()
        finally:
            ended.set()

    config = bounded(read_timeout=0.5, request_timeout=1, keep_alive_timeout=1)
    gone = released(getattr(config, GUARD_ATTRIBUTE))
    async with serving(app, config) as url:
        stream = await open_to(url)
        await stream.send_all(WS_UPGRADE)
        await stream.send_eof()
        with trio.fail_after(DEADLINE):
            await ended.wait()
            await gone.wait()
        await stream.aclose()


@pytest.mark.usefixtures("hypercorn_with_frame_streams")
async def test_a_held_end_whose_answer_fails_to_write_does_not_keep_the_connection() -> None:
    """Half-closed, then reset: the answer's write fails, the app is cancelled before its end,
    and the held end waited for the keep-alive timeout (75 s)."""
    from api.framing import with_framing_checks

    app = QuartTrio(__name__)
    reset_done = trio.Event()

    @app.route("/stream")
    async def streamed() -> Response:
        await reset_done.wait()

        async def body() -> Any:
            for _ in range(20):
                yield b"x" * 1000
                await trio.sleep(0.05)

        return Response(body(), content_type="text/plain")

    app.asgi_app = with_framing_checks(app.asgi_app, lambda: "rid")  # type: ignore[method-assign]
    config = bounded()  # the defaults: keep_alive_timeout 75 s
    gone = released(getattr(config, GUARD_ATTRIBUTE))
    async with serving(app, config) as url:
        stream = await open_to(url)
        await stream.send_all(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
        await stream.send_eof()
        await trio.sleep(0.3)  # the server reads the end and holds it
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()  # a reset
        reset_done.set()
        with trio.fail_after(DEADLINE):
            await gone.wait()


async def read_answers(url: str, request: bytes) -> bytes:
    """What the server sends on one connection for `request` until it closes it."""
    with trio.fail_after(DEADLINE):
        async with await open_to(url) as stream:
            await stream.send_all(request)
            received = b""
            while chunk := await stream.receive_some():
                received += chunk
    return received


def parse_answers(data: bytes, methods: list[str]) -> list[tuple[int, bytes]]:
    """The status and body of each answer in `data`, to requests of `methods` in order, as
    h11 (an independent HTTP/1.1 parser) reads them."""
    import h11

    client = h11.Connection(h11.CLIENT)
    client.receive_data(data)
    answers: list[tuple[int, bytes]] = []
    for method in methods:
        client.send(h11.Request(method=method, target="/", headers=[("Host", "t")]))
        client.send(h11.EndOfMessage())
        status, body = 0, b""
        while True:
            event = client.next_event()
            assert event is not h11.NEED_DATA, f"answer {len(answers)} cut short"
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
        answers.append((status, body))
        if client.our_state is h11.DONE and client.their_state is h11.DONE:
            client.start_next_cycle()
    return answers


@pytest.mark.usefixtures("hypercorn_with_frame_streams")
async def test_answers_through_hypercorn_come_whole_whatever_their_shape() -> None:
    """Held heads end to end: a body, no body (HEAD, 304), a body that reads like a head, a
    large body, several answers on one connection, and an app that fails after its start."""
    from quart import Response

    app = QuartTrio(__name__)
    big = "x" * 200_000

    @app.route("/text")
    async def text() -> Response:
        return Response("HTTP/1.1 200 OK", content_type="text/plain")

    @app.route("/big")
    async def large() -> Response:
        return Response(big, content_type="text/plain")

    @app.route("/same")
    async def same() -> Response:
        return Response(b"", status=304)

    served = app.asgi_app

    async def failing(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/fails":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"5")]})  # fmt: skip
            raise RuntimeError("the app failed after its answer's start")
        await served(scope, receive, send)

    app.asgi_app = failing  # type: ignore[method-assign, assignment]
    async with serving(app, HyperConfig()) as url:
        pipelined = b"".join(
            f"{method} {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode()
            for method, path in [("GET", "/text"), ("HEAD", "/text"), ("GET", "/same")]
        )
        close = b"GET /big HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        answers = parse_answers(
            await read_answers(url, pipelined + close),
            ["GET", "HEAD", "GET", "GET"],
        )
        assert [(status, len(body)) for status, body in answers] == [
            (200, 15),
            (200, 0),
            (304, 0),
            (200, len(big)),
        ]
        assert answers[0][1] == b"HTTP/1.1 200 OK"
        assert answers[3][1] == big.encode()
        failed = await read_answers(url, b"GET /fails HTTP/1.1\r\nHost: t\r\n\r\n")
        assert failed.startswith(b"HTTP/1.1 200")
        assert b"content-length: 5" in failed


# --- the hook's check and its fallback -------------------------------------------------------


def test_the_installed_hypercorn_fits_the_hook() -> None:
    """The pinned release and its TCPServer are what the hook expects (a new release that
    changed either would make `serve` fall back, loudly: below)."""
    assert hook_unfit() is None


@pytest.mark.parametrize(
    ("version", "server", "reason"),
    [
        ("0.16.0", None, "outside the tested releases"),
        ("0.19.0", None, "outside the tested releases"),
        ("1.0.0", None, "outside the tested releases"),
        ("main", None, "not a release"),
        ("0.18.0", object(), "no TCPServer class"),
        ("0.18.0", type("S", (), {"__init__": lambda self, app, config, stream: None}), "takes"),
        (
            "0.18.0",
            type("S", (), {"__init__": lambda self, app, config, context, state, stream: None}),
            "no coroutine run()",
        ),
    ],
)
def test_a_hypercorn_that_does_not_fit_is_named_with_the_reason(
    version: str, server: Any, reason: str
) -> None:
    found = hook_unfit(version, server)
    assert found is not None
    assert reason in found


def test_an_unfit_hypercorn_is_left_as_it_is_and_said_at_error_level(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    original = hypercorn_worker.TCPServer  # type: ignore[attr-defined]
    monkeypatch.setattr(transport, "TESTED_HYPERCORN", ((0, 1), (0, 2)))
    with caplog.at_level(logging.ERROR, logger="ws.transport"):
        assert install_in_hypercorn() is False
    assert hypercorn_worker.TCPServer is original  # type: ignore[attr-defined]
    assert "outside the tested releases" in caplog.text
    assert "serving without the connection hook" in caplog.text


@pytest.mark.usefixtures("hypercorn_with_frame_streams")
async def test_a_config_marked_plain_keeps_hypercorns_own_connections() -> None:
    """`server.connection_hook = false` once the hook is installed in the process: that
    server's connections are not wrapped, and its events take the ASGI path."""
    app = QuartTrio(__name__)
    seen: list[object] = []

    @app.route("/")
    async def index() -> str:
        seen.append(CURRENT_STREAM.get())
        return "ok"

    config = HyperConfig()
    setattr(config, PLAIN_ATTRIBUTE, True)
    async with serving(app, config) as url:
        with trio.fail_after(DEADLINE):
            async with await open_to(url) as stream:
                await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answer = b""
                while not answer.endswith(b"\r\n\r\nok"):  # (Hypercorn alone may not close)
                    answer += await stream.receive_some()
    assert answer.startswith(b"HTTP/1.1 200")
    assert seen == [None]


@pytest.mark.usefixtures("hypercorn_with_frame_streams")
@pytest.mark.parametrize("version", [b"1.0", b"1.1"])
async def test_a_client_that_half_closes_after_its_request_still_gets_the_answer(
    version: bytes,
) -> None:
    """`printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc host port`: the client ends its side once the
    request is sent and reads the answer. Its end of stream must not cancel the answer."""

    app = QuartTrio(__name__)

    @app.route("/slow")
    async def slow() -> str:
        await trio.sleep(0.3)  # the client's end arrives meanwhile
        return "done"

    answer = await half_closed_answer(app, b"GET /slow HTTP/" + version + b"\r\nHost: t\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert answer.endswith(b"done")


@pytest.mark.usefixtures("hypercorn_with_frame_streams")
async def test_a_client_that_half_closes_in_the_middle_of_its_body_is_cut_by_the_read_timeout() -> (
    None
):
    """Its request can never be whole: the read deadline cuts it, without an answer (the app,
    waiting for the rest of the body, is cancelled with the connection)."""
    from api.framing import with_framing_checks

    app = QuartTrio(__name__)
    reached = trio.Event()

    @app.route("/upload", methods=["POST"])
    async def upload() -> str:
        reached.set()
        await app_request_body()
        return "stored"

    async def app_request_body() -> bytes:
        from quart import request

        return await request.get_data()

    app.asgi_app = with_framing_checks(app.asgi_app, lambda: "rid")  # type: ignore[method-assign]
    async with serving(app, bounded(read_timeout=0.3)) as url:
        with trio.fail_after(DEADLINE):
            stream = await open_to(url)
            await stream.send_all(
                b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n"
            )
            await stream.send_all(b"x" * 10)
            await stream.send_eof()
            answer = b""
            with contextlib.suppress(trio.BrokenResourceError):
                while chunk := await stream.receive_some():
                    answer += chunk
            await stream.aclose()
    assert reached.is_set()
    assert answer == b""


@pytest.mark.usefixtures("hypercorn_with_frame_streams")
async def test_a_websocket_client_that_goes_after_its_handshake_frees_the_connection() -> None:
    """The handshake's first byte marks an answer owed; the 101 settles it. A first version of
    the end hold kept it owed, held the client's later end for good (no deadline after the
    upgrade), and a client's connections piled up to its cap (1013)."""
    app = QuartTrio(__name__)

    @app.websocket("/ws")
    async def ws() -> None:
        await websocket.accept()
        await websocket.receive()

    config = bounded()
    gone = released(getattr(config, GUARD_ATTRIBUTE))
    async with serving(app, config) as url:
        stream = await open_to(url)
        await stream.send_all(WS_UPGRADE)
        with trio.fail_after(DEADLINE):
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive_some()
            assert head.startswith(b"HTTP/1.1 101 "), head
            await stream.send_eof()  # the client goes, without a close frame
            await gone.wait()
        await stream.aclose()


async def test_empty_lines_between_requests_begin_no_request() -> None:
    """h11 drops empty lines before a request line (RFC 9112 §2.2, `bound_request_heads`): a
    CRLF that comes alone after an answer (a client's after its POST's body) is no request. Read
    as one's first byte, it put the idle connection under the read deadlines: cut (and counted)
    `read_timeout` after it, not `keep_alive_timeout`, and waited for at shutdown."""
    server, client = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    stream = FrameStream(trio.SocketStream(server), transport.ConnectionLimits())
    peer = trio.SocketStream(client)
    async with stream, peer:
        with trio.fail_after(DEADLINE):
            await peer.send_all(b"\r\n")
            assert await stream.receive_some() == b"\r\n"
            assert not stream.request_under_way
            await peer.send_all(b"\r\nGET / HTTP/1.1\r\n")
            await stream.receive_some()
            assert stream.request_under_way


class _OneStreamConnection:
    """What Hypercorn's HTTP/1.1 protocol does for one WebSocket stream's events, in memory:
    the stream's `StreamClosed` closes the stream (`_maybe_recycle`), and is counted."""

    def __init__(self) -> None:
        self.to_app: list[dict[str, Any]] = []
        self.stream_closed = 0
        self.stream: Any = None

    async def spawn_app(self, *args: Any) -> Any:
        async def put(message: dict[str, Any]) -> None:
            self.to_app.append(message)

        return put

    async def send(self, event: Any) -> None:
        from hypercorn.protocol.events import StreamClosed

        if isinstance(event, StreamClosed):
            self.stream_closed += 1
            await self.stream.handle(StreamClosed(stream_id=1))


async def test_a_client_closing_an_accepted_websocket_is_disconnected_once() -> None:
    """`end_refused_handshakes` ends a stream that Hypercorn's refusal closed; a client's close
    frame closes an accepted one too (Hypercorn's own `StreamClosed`), and was taken for a
    refusal: the app was told of the disconnect twice, and the stream closed twice."""
    from hypercorn.protocol.events import Data, Request
    from hypercorn.protocol.ws_stream import WSStream
    from wsproto.frame_protocol import CloseReason

    transport.end_refused_handshakes()
    connection = _OneStreamConnection()
    stream = WSStream(
        None,  # type: ignore[arg-type]
        HyperConfig(),
        None,  # type: ignore[arg-type]
        connection,  # type: ignore[arg-type]
        False,
        None,
        None,
        connection.send,
        1,
    )
    connection.stream = stream
    headers = [
        (b"host", b"t"),
        (b"upgrade", b"websocket"),
        (b"connection", b"upgrade"),
        (b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ=="),
        (b"sec-websocket-version", b"13"),
    ]
    await stream.handle(
        Request(
            stream_id=1, headers=headers, http_version="1.1", method="GET", raw_path=b"/", state={}
        )
    )
    await stream.app_send({"type": "websocket.accept"})
    client = FrameProtocol(client=True, extensions=[])
    await stream.handle(Data(stream_id=1, data=client.close(CloseReason.NORMAL_CLOSURE)))
    disconnects = [m for m in connection.to_app if m["type"] == "websocket.disconnect"]
    assert len(disconnects) == 1, connection.to_app
    assert connection.stream_closed == 1
