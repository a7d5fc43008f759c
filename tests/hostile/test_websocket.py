"""Hostile WebSocket clients on real sockets (docs/events.md, "How a socket ends"; docs/limits.md):
oversized and partial frames, ping floods, clients that never read, too many sockets and too
many replays from one address, frames RFC 6455 does not allow."""

from __future__ import annotations

import json
import socket
import time
from contextlib import ExitStack

import pytest

from cli.client import RegistryClient
from registry.keys import SigningKey
from tests.db.proc import Server
from tests.helpers import entry_template
from tests.hostile.raw import (
    client_frame,
    close_code,
    connect,
    health_from,
    read_until_closed,
    rss_kib,
    websocket,
)


def test_a_message_over_the_limit_is_refused_from_its_header(server: Server) -> None:
    sock = websocket(server.url)
    # 16,000,000 bytes announced, 1,000 sent: the server must not wait for (or buffer) the rest.
    sock.sendall(client_frame(b"x" * 1000, declared=16_000_000)[: 14 + 1000])
    data, closed = read_until_closed(sock, limit=8)
    sock.close()
    assert closed
    assert close_code(data) == 1009


def test_fragments_adding_up_past_the_limit_are_refused(server: Server) -> None:
    sock = websocket(server.url)
    first = client_frame(b"{" * 10_000, opcode=0x1)
    first = bytes((first[0] & 0x7F,)) + first[1:]  # not final: a fragment
    sock.sendall(first + client_frame(b"}" * 10_000, opcode=0x0))
    data, closed = read_until_closed(sock, limit=8)
    sock.close()
    assert closed
    assert close_code(data) == 1009


def test_sixty_partial_frames_cost_little_memory_and_health_stays_up(server: Server) -> None:
    baseline = rss_kib(server.proc.pid)
    with ExitStack() as stack:
        socks = []
        for i in range(60):
            sock = stack.enter_context(websocket(server.url, f"127.0.1.{i + 1}"))
            # A message just under the limit, without its last byte, and one far over it.
            if i % 2:
                sock.sendall(client_frame(b"y" * 16_000)[:-1])
            else:
                sock.sendall(client_frame(b"y" * 65_536, declared=16_000_000)[:65_000])
            socks.append(sock)
        assert health_from(server.url, "127.0.2.1").status_code == 200
        grown = rss_kib(server.proc.pid) - baseline
        assert grown < 100 * 1024, f"resident memory grew by {grown} KiB"
        for i, sock in enumerate(socks):
            if i % 2 == 0:  # the oversized ones were refused
                _data, closed = read_until_closed(sock, limit=8)
                assert closed
    assert health_from(server.url, "127.0.2.1").status_code == 200


def test_a_ping_flood_that_never_reads_is_cut(server: Server) -> None:
    sock = websocket(server.url)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    started = time.monotonic()
    cut = False
    while time.monotonic() - started < 20:
        try:
            sock.sendall(client_frame(b"ping", opcode=0x9) * 50)
        except OSError:
            cut = True
            break
        time.sleep(0.005)
    if not cut:
        _, cut = read_until_closed(sock, limit=5)
    sock.close()
    assert cut, "a client flooding pings and reading nothing was still connected after 20 s"


def test_a_client_that_never_reads_its_answers_is_cut(server: Server) -> None:
    """Pipelined requests whose answers are never read: the writes stall, and the connection is
    cut after send_timeout (2 s here) rather than held forever."""
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    request = b"GET /v1/openapi.json HTTP/1.1\r\nHost: r\r\n\r\n"
    sock.settimeout(1)
    try:
        for _ in range(200):
            sock.sendall(request)
    except OSError:
        pass
    time.sleep(6)  # nothing read meanwhile: the server's writes stall past send_timeout
    data, closed = read_until_closed(sock, limit=10)
    sock.close()
    assert closed
    assert data.count(b"HTTP/1.1 200") < 200


def test_sockets_beyond_the_per_address_cap_get_1013(server: Server) -> None:
    with ExitStack() as stack:
        held = [stack.enter_context(websocket(server.url, "127.0.3.1")) for _ in range(8)]
        for sock in held:  # each is counted once it has answered
            sock.sendall(client_frame(b'{"type":"ping"}'))
            assert b"pong" in sock.recv(100)
        extra = stack.enter_context(websocket(server.url, "127.0.3.1"))
        data, closed = read_until_closed(extra, limit=8)
        assert closed
        assert close_code(data) == 1013
        other = stack.enter_context(websocket(server.url, "127.0.3.2"))
        other.sendall(client_frame(b'{"type":"ping"}'))
        assert b"pong" in other.recv(100)


def test_replays_from_one_address_are_admitted_by_a_budget(server: Server) -> None:
    # A live subscriber from another address sees the new entry: the log actor has read it,
    # so a subscription from sequence 0 is a replay.
    watcher = websocket(server.url, "127.0.4.2")
    watcher.sendall(client_frame(b'{"type":"subscribe"}'))
    assert b'"subscribed"' in watcher.recv(65536)
    key = SigningKey.generate()
    with RegistryClient(server.url) as client:
        client.sign_in(key)
        did = client.publish(entry_template(), key)["entryDid"]
    seen = b""
    deadline = time.monotonic() + 10
    while did.encode() not in seen and time.monotonic() < deadline:
        seen += watcher.recv(65536)
    watcher.close()
    assert did.encode() in seen
    sock = websocket(server.url, "127.0.4.1")
    subscribe = client_frame(json.dumps({"type": "subscribe", "fromSequence": 0}).encode())
    answers: list[str] = []
    for _ in range(8):
        sock.sendall(subscribe)
        deadline = time.monotonic() + 10
        buffer = b""
        while time.monotonic() < deadline:
            buffer += sock.recv(65536)
            if b'"subscribed"' in buffer or b"replay_rate_limited" in buffer:
                break
        answers.append("limited" if b"replay_rate_limited" in buffer else "replayed")
    sock.close()
    assert answers == ["replayed"] * 6 + ["limited"] * 2  # replays_per_minute = 6 here


def test_an_integer_of_thousands_of_digits_in_a_message_is_a_4400(server: Server) -> None:
    sock = websocket(server.url, "127.0.4.3")
    sock.sendall(client_frame(b'{"type":"subscribe","fromSequence":' + b"9" * 5000 + b"}"))
    data, closed = read_until_closed(sock, limit=8)
    sock.close()
    assert closed
    assert close_code(data) == 4400
    assert b"outside" in data  # the reason names the rule: an integer outside +-(2^53-1)


def test_frames_sent_before_the_upgrade_is_answered_end_only_that_connection(
    server: Server,
) -> None:
    """A client that sends frames with its handshake, in one packet (RFC 6455 says it must
    wait): Hypercorn fails on it; that connection is dropped, the server goes on."""
    import base64
    import os

    from tests.hostile.raw import connect

    for _ in range(5):
        sock = connect(server.url, "127.0.4.4")
        key = base64.b64encode(os.urandom(16))
        sock.sendall(
            b"GET /v1/events HTTP/1.1\r\nHost: r\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: "
            + key
            + b"\r\nSec-WebSocket-Version: 13\r\n\r\n"
            + client_frame(b"ping", opcode=0x9)
        )
        read_until_closed(sock, limit=3)
        sock.close()
    assert health_from(server.url, "127.0.4.5").status_code == 200
    assert server.proc.poll() is None


def test_a_message_of_endless_empty_fragments_is_refused(server: Server) -> None:
    sock = websocket(server.url, "127.0.4.6")
    first = client_frame(b"{")
    sock.sendall(bytes((first[0] & 0x7F,)) + first[1:])  # not final
    empty = client_frame(b"", opcode=0x0)
    empty = bytes((empty[0] & 0x7F,)) + empty[1:]  # empty, not final: forever
    try:
        for _ in range(200):
            sock.sendall(empty * 10)
    except OSError:
        pass
    data, closed = read_until_closed(sock, limit=8)
    sock.close()
    assert closed
    assert close_code(data) in (1008, None)  # the close frame may be lost to a reset


PROTOCOL_ERRORS = {
    "invalid UTF-8 in a text frame": (client_frame(b'{"type":"ping","x":"\xff\xfe"}'), 1007),
    "invalid UTF-8 across fragments": (
        bytes((0x01,))
        + client_frame(b'{"type":"ping","x":"\xc3')[1:]  # not final
        + client_frame(b'\x28"}', opcode=0x0),
        1007,
    ),
    "a close frame with an invalid code": (client_frame(b"\x00\x01", opcode=0x8), 1002),
    "a reserved opcode": (client_frame(b"{}", opcode=0x3), 1002),
    # Its whole header is two bytes: it was looked at only once more bytes came, and
    # Hypercorn's parser had dropped the connection by then.
    "an empty unmasked frame, alone": (bytes((0x81, 0x00)), 1002),
}


@pytest.mark.parametrize(("frames", "code"), PROTOCOL_ERRORS.values(), ids=PROTOCOL_ERRORS.keys())
def test_a_protocol_error_ends_the_socket_with_a_close_code(
    server: Server, frames: bytes, code: int
) -> None:
    """docs/events.md, "How a socket ends": always with a close code and a reason; RFC 6455
    §7.4.1: 1007 for text that is not UTF-8, 1002 for a protocol error. (Hypercorn's parser
    refuses these too, and closes the TCP connection with no close frame at all.)"""
    sock = websocket(server.url, "127.0.4.7")
    sock.sendall(frames)
    data, closed = read_until_closed(sock, limit=5)
    sock.close()
    assert closed
    assert close_code(data) == code, f"no close frame {code}: {data!r}"
    assert health_from(server.url, "127.0.4.5").status_code == 200


def _deflate_bomb(size: int) -> bytes:
    """A client frame with RSV1 set whose payload inflates (permessage-deflate) to `size` bytes."""
    import zlib

    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    payload = packer.compress(b"a" * size) + packer.flush(zlib.Z_SYNC_FLUSH)
    frame = client_frame(payload[:-4])  # the extension drops the sync flush's 00 00 ff ff
    return bytes((frame[0] | 0x40,)) + frame[1:]


def test_no_compression_is_negotiated_and_a_deflate_bomb_is_refused_unread(
    server: Server,
) -> None:
    """A client that offers permessage-deflate is agreed no extension, and a compressed frame
    (a 15 KB one inflates to 16 MB) is refused with 1002 before anything inflates it (hostile
    review: 30 of them on one socket grew the process by 516 MB)."""
    import base64
    import os

    from tests.hostile.raw import connect

    baseline = rss_kib(server.proc.pid)
    bomb = _deflate_bomb(16_000_000)
    assert len(bomb) < 20_000
    with ExitStack() as stack:
        for i in range(20):
            sock = stack.enter_context(connect(server.url, f"127.0.3.{i + 1}"))
            key = base64.b64encode(os.urandom(16))
            sock.sendall(
                b"GET /v1/events HTTP/1.1\r\nHost: registry\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Key: " + key + b"\r\n"
                b"Sec-WebSocket-Version: 13\r\n"
                b"Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits\r\n\r\n"
            )
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(1)
                assert chunk, head
                head += chunk
            assert head.startswith(b"HTTP/1.1 101 "), head
            assert b"sec-websocket-extensions" not in head.lower(), head
            sock.sendall(bomb * 3)
            data, closed = read_until_closed(sock, limit=8)
            assert closed
            assert close_code(data) == 1002
        assert health_from(server.url, "127.0.4.1").status_code == 200
    grown = rss_kib(server.proc.pid) - baseline
    assert grown < 64 * 1024, f"the process grew by {grown} KiB"


@pytest.mark.parametrize(
    "head",
    [b"Sec-WebSocket-Version: 8\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n", b""],
    ids=["version-8", "no-key"],
)
def test_a_handshake_hypercorn_refuses_ends_its_connection(server: Server, head: bytes) -> None:
    """Hypercorn's 400 to a handshake it cannot take says `connection: close`; the connection
    stayed open until the keep-alive timeout (5 s here, 75 s by default), and held a stopping
    server until its graceful timeout."""
    sock = connect(server.url, "127.0.4.8")
    sock.sendall(
        b"GET /v1/events HTTP/1.1\r\nHost: r\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        + head
        + b"\r\n"
    )
    data, closed = read_until_closed(sock, limit=2)
    sock.close()
    assert data.startswith(b"HTTP/1.1 400 "), data
    assert closed, "still open 2 s after a connection: close answer"
