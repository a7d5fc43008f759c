"""The byte budget of an address's bodies is spent before a body that declares its length is
read (docs/limits.md): a client cannot have many large bodies held in memory at once by sending
all of them but their last byte."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

from tests.db.proc import run_server
from tests.hostile.conftest import SETTINGS
from tests.hostile.raw import DEADLINE, connect, read_until_closed, rss_kib


def _post(length: int, body: bytes) -> bytes:
    head = (
        "POST /v1/discover HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    )
    return head.encode() + body


def test_a_body_past_the_budget_is_refused_before_it_is_read(
    database_url: str, tmp_path: Path
) -> None:
    env = {**SETTINGS, "REGISTRY_LIMITS__BODY_BYTES_PER_MINUTE_PER_ADDRESS": "4096"}
    with run_server(tmp_path / "srv", database_url=database_url, extra_env=env) as server:
        body = b'{"text": "agent"}'.ljust(3000)
        with connect(server.url, "127.0.6.1") as sock:
            sock.sendall(_post(len(body), body))
            data = sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
        with connect(server.url, "127.0.6.1") as sock:
            sock.sendall(_post(3000, body[:10]))  # 2,990 bytes never come
            data, closed = read_until_closed(sock)
        assert data.startswith(b"HTTP/1.1 429"), data[:200]
        assert b"body_bytes_per_minute_per_address" in data
        assert closed  # the unread body ends the connection
        with connect(server.url, "127.0.6.2") as sock:  # another address: its own budget
            sock.sendall(_post(len(body), body))
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")


def _server_read_all(port: int) -> bool:
    """Whether every connection to the server on `port` has nothing left in its queues: the
    client's bytes all sent, and the server's receive queue read (/proc/net/tcp)."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    for row in rows:
        local, remote, queues = row[1], row[2], row[4]
        tx, rx = (int(part, 16) for part in queues.split(":"))
        if int(local.split(":")[1], 16) == port and rx:  # the server has not read it all
            return False
        if int(remote.split(":")[1], 16) == port and tx:  # the client has not sent it all
            return False
    return True


def test_a_body_refused_before_it_is_paid_is_not_held_while_it_is_drained(
    database_url: str, tmp_path: Path
) -> None:
    """A request refused before its body is paid for (here 415, its Content-Type; also a 401
    or a 429 for its count) has its body read so that the connection stays usable, but never
    held: 20 federation bodies of 4 MiB, each one byte short, grew the process by ~80 MiB that
    no budget paid for."""
    size = 4 * 1024 * 1024
    head = (
        "POST /v1/federation/sync HTTP/1.1\r\nHost: r\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {size}\r\n\r\n"
    ).encode()
    with run_server(tmp_path / "srv", database_url=database_url, extra_env=SETTINGS) as server:
        port = int(server.url.rsplit(":", 1)[1])
        baseline = rss_kib(server.proc.pid)
        with ExitStack() as stack:
            socks = [stack.enter_context(connect(server.url, "127.0.6.3")) for _ in range(20)]
            for sock in socks:
                sock.sendall(head + bytes(size - 1))  # the last byte never comes
            deadline = time.monotonic() + DEADLINE
            while not _server_read_all(port):
                assert time.monotonic() < deadline, "the server did not read the bodies"
                time.sleep(0.01)
            grown = rss_kib(server.proc.pid) - baseline
            assert grown < 20 * 1024, f"resident memory grew by {grown} KiB"
            socks[0].sendall(b"x")  # whole now: answered, on a connection still usable
            data = socks[0].recv(65536)
        assert data.startswith(b"HTTP/1.1 415"), data[:200]
        assert b"connection: close" not in data.lower()


def _chunked(*pieces: bytes, end: bool = True) -> bytes:
    head = (
        "POST /v1/discover HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    return head.encode() + body + (b"0\r\n\r\n" if end else b"")


def test_a_chunked_body_pays_each_piece_before_it_is_held(
    database_url: str, tmp_path: Path
) -> None:
    """A body that declares no length pays as it is read, piece by piece: one past the budget
    is refused at the piece that passes it, not held until it ends (paid once read, 120
    chunked 4 MiB bodies from 5 addresses, each a piece short, held ~415 MiB). A chunked body
    larger than the budget still passes on a full one, as a declared one does."""
    env = {**SETTINGS, "REGISTRY_LIMITS__BODY_BYTES_PER_MINUTE_PER_ADDRESS": "4096"}
    with run_server(tmp_path / "srv", database_url=database_url, extra_env=env) as server:
        body = b'{"text": "agent"}'.ljust(3000)
        with connect(server.url, "127.0.6.4") as sock:
            sock.sendall(_chunked(body))
            data = sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
        with connect(server.url, "127.0.6.4") as sock:
            sock.sendall(_chunked(b" " * 3000, end=False))  # the rest never comes
            data, closed = read_until_closed(sock)
        assert data.startswith(b"HTTP/1.1 429"), data[:200]
        assert b"body_bytes_per_minute_per_address" in data
        assert closed
        with connect(server.url, "127.0.6.5") as sock:  # a full budget: 9,000 bytes pass
            sock.sendall(_chunked(body, b" " * 3000, b" " * 3000))
            data = sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
