"""`metrics.listen`: a second listener where /metrics is open and nothing else is served."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx

from tests.db.proc import free_port, run_server


def test_metrics_are_open_on_their_own_listener_and_nowhere_else(
    database_url: str, tmp_path: Path
) -> None:
    port = free_port()
    env = {"REGISTRY_METRICS__LISTEN": f"127.0.0.1:{port}"}
    with run_server(tmp_path, database_url=database_url, extra_env=env) as server:
        listener = f"http://127.0.0.1:{port}"
        r = httpx.get(listener + "/metrics", timeout=10)
        assert r.status_code == 200
        assert "registry_http_request_duration_seconds" in r.text
        r = httpx.get(listener + "/v1/health", timeout=10)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "route_not_found")
        r = httpx.get(server.url + "/metrics", timeout=10)  # the API's port: admins only
        assert (r.status_code, r.json()["error"]["code"]) == (401, "session_missing")
        assert httpx.get(server.url + "/v1/health", timeout=10).status_code == 200
        assert f"serving on {server.url}, {listener}" in server.output()
        # Nor the event stream (Quart runs no before_request hook for a WebSocket: it was
        # served there, 101); on the API's port it is.
        assert handshake_status(port, "/v1/events") == 404
        assert handshake_status(int(server.url.rsplit(":", 1)[1]), "/v1/events") == 101


def handshake_status(port: int, path: str) -> int:
    """The status a WebSocket handshake for `path` gets on 127.0.0.1:`port`."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            (
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n" not in head:
            chunk = sock.recv(4096)
            assert chunk, "closed before a status line"
            head += chunk
    return int(head.split(b" ", 2)[1])
