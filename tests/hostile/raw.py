"""Raw-socket clients: HTTP/1.1 and WebSocket bytes exactly as an attacker writes them."""

from __future__ import annotations

import base64
import os
import socket
import time
from urllib.parse import urlsplit

import httpx

PER_CLIENT = 24  # the server's max_connections_per_client in these tests
DEADLINE = 10.0


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    return parts.hostname, parts.port


def connect(url: str, source: str = "127.0.0.1", timeout: float = DEADLINE) -> socket.socket:
    """A TCP connection from `source` (any 127.0.0.0/8 address: each is another client)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.bind((source, 0))
    sock.connect(address(url))
    return sock


def read_until_closed(sock: socket.socket, limit: float = DEADLINE) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or `limit` seconds pass (False)."""
    sock.settimeout(0.2)
    data = b""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def websocket(url: str, source: str = "127.0.0.1", path: str = "/v1/events") -> socket.socket:
    """A WebSocket connection after its handshake (the 101 read, nothing more)."""
    sock = connect(url, source)
    key = base64.b64encode(os.urandom(16))
    sock.sendall(
        b"GET " + path.encode() + b" HTTP/1.1\r\nHost: registry\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: " + key + b"\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n"
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        assert chunk, f"closed during the handshake: {head!r}"
        head += chunk
    assert head.startswith(b"HTTP/1.1 101 "), head
    return sock


def client_frame(payload: bytes, opcode: int = 0x1, *, declared: int | None = None) -> bytes:
    """A masked client frame; `declared` claims another payload length than the bytes sent."""
    size = len(payload) if declared is None else declared
    if size < 126:
        head = bytes((0x80 | opcode, 0x80 | size))
    elif size < 1 << 16:
        head = bytes((0x80 | opcode, 0x80 | 126)) + size.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + size.to_bytes(8, "big")
    mask = os.urandom(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def close_code(data: bytes) -> int | None:
    """The code of the first close frame among the server's (unmasked) frames, if any."""
    i = 0
    while i + 2 <= len(data):
        opcode, size = data[i] & 0x0F, data[i + 1] & 0x7F
        i += 2
        if size == 126:
            size, i = int.from_bytes(data[i : i + 2], "big"), i + 2
        elif size == 127:
            size, i = int.from_bytes(data[i : i + 8], "big"), i + 8
        if opcode == 0x8:
            return int.from_bytes(data[i : i + 2], "big") if size >= 2 else 1005
        i += size
    return None


def health_from(url: str, source: str) -> httpx.Response:
    """`GET /v1/health` from another client address, as a bystander during an attack."""
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=DEADLINE) as client:
        return client.get(f"{url}/v1/health")


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")
