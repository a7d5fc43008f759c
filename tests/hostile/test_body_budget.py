"""The byte budget of an address's bodies is spent before a body that declares its length is
read (docs/limits.md): a client cannot have many large bodies held in memory at once by sending
all of them but their last byte."""

from __future__ import annotations

from pathlib import Path

from tests.db.proc import run_server
from tests.hostile.conftest import SETTINGS
from tests.hostile.raw import connect, read_until_closed


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
