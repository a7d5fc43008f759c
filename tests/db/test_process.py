"""The service as a user runs it: a real `registry serve` process.

- On the embedded default (no database URL): start, sign in with the client, publish, read back,
  SIGTERM → clean exit and the private PostgreSQL is stopped.
- kill -9 during a burst of writes: after a restart every acknowledged write is there, nothing is
  half-applied, and the sequence has no gap.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import asyncpg
import httpx
import pytest
import trio

from cli.client import RegistryClient
from registry.keys import SigningKey
from tests.db.proc import run_server
from tests.helpers import entry_template, signed_entry


def test_embedded_default_serve_publish_read_sigterm(tmp_path: Path) -> None:
    key = SigningKey.generate()
    data_dir = tmp_path / "data"
    with run_server(data_dir) as server:
        with RegistryClient(server.url) as client:
            session = client.sign_in(key)
            assert session["rootDid"] == key.did
            created = client.publish(entry_template(), key)
            assert created["publisherDid"] == key.did
            assert client.get(created["entryDid"]) == created
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0, server.output()
    output = server.output()
    assert "embedded PostgreSQL" in output
    assert "Traceback" not in output
    # The registry key was created on first start, with mode 0600.
    assert (data_dir / "registry.key").stat().st_mode & 0o777 == 0o600
    # The private cluster is stopped: its postmaster.pid is gone.
    location = data_dir / "postgres.location"
    cluster = Path(location.read_text().strip()) if location.exists() else data_dir / "postgres"
    assert not (cluster / "postmaster.pid").exists()
    if location.exists():  # the root fallback lives outside tmp_path: remove it
        shutil.rmtree(cluster, ignore_errors=True)


async def _burst(
    url: str, key: SigningKey, token: str, acked: dict[str, int], enough: trio.Event
) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:

        async def writer() -> None:
            while True:
                entry = signed_entry(key)
                try:
                    r = await http.post(
                        "/v1/entries",
                        json=entry,
                        headers={
                            "Authorization": f"Bearer {token}",
                            "Idempotency-Key": entry["entryDid"],
                        },
                    )
                except httpx.HTTPError:
                    return  # the server died under us: unacknowledged, so nothing is promised
                if r.status_code == 201:
                    acked[entry["entryDid"]] = r.json()["sequence"]
                    if len(acked) >= 150:
                        enough.set()

        async with trio.open_nursery() as nursery:
            for _ in range(12):
                nursery.start_soon(writer)


# Killing the server mid-request makes httpx abandon its request-body async generator; Trio then
# reports its finalisation. That is the client's cleanup after a dead peer, not a registry fault.
@pytest.mark.filterwarnings("ignore:Async generator 'httpx:ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_kill_9_during_writes_loses_no_acknowledged_write(
    tmp_path: Path, database_url: str
) -> None:
    key = SigningKey.generate()
    acked: dict[str, int] = {}
    with run_server(tmp_path, database_url=database_url) as server:
        with RegistryClient(server.url) as client:
            token = client.sign_in(key)["sessionToken"]

        async def burst_then_kill() -> None:
            enough = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_burst, server.url, key, token, acked, enough)
                with trio.fail_after(60):
                    await enough.wait()
                server.proc.send_signal(signal.SIGKILL)  # mid-burst: requests are in flight
                # The writers end when their connections fail.

        trio.run(burst_then_kill)
        server.proc.wait(timeout=10)
        assert server.proc.returncode == -signal.SIGKILL

    with (
        run_server(tmp_path, database_url=database_url) as server,
        RegistryClient(server.url) as client,
    ):
        for did, sequence in acked.items():
            assert client.get(did)["sequence"] == sequence

    async def check_log() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            head = await conn.fetchval("SELECT seq FROM log_head")
            count, top = await conn.fetchrow("SELECT count(*), coalesce(max(seq), 0) FROM log")
            assert count == top == head, "the log has a gap"
            orphans = await conn.fetchval(
                "SELECT count(*) FROM log l LEFT JOIN entry_versions v USING (seq)"
                " WHERE l.kind LIKE 'entry.%' AND v.seq IS NULL"
            )
            assert orphans == 0, "a log record without its version"
            heads = await conn.fetchval(
                "SELECT count(*) FROM entries e LEFT JOIN entry_versions v ON v.seq = e.head_seq"
                " WHERE v.seq IS NULL OR v.entry_did <> e.entry_did"
            )
            assert heads == 0, "an entry head without its version"
        finally:
            await conn.close()

    asyncio.run(check_log())


def test_cli_keygen_writes_key_and_prints_did(tmp_path: Path) -> None:
    out = tmp_path / "me.key"
    result = subprocess.run(
        [sys.executable, "-m", "cli", "keygen", "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    did = result.stdout.strip()
    assert did.startswith("did:key:z6Mk")
    assert out.stat().st_mode & 0o777 == 0o600
    again = subprocess.run(
        [sys.executable, "-m", "cli", "keygen", "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert again.returncode == 1


def test_early_answer_before_the_body_keeps_the_connection_usable(
    tmp_path: Path, database_url: str
) -> None:
    """A 401 decided before the body is read must not leave the keep-alive connection hanging:
    the server reads (and discards) the late body, then answers the next request."""
    import socket

    with run_server(tmp_path, database_url=database_url) as server:
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/entries HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 2\r\nIdempotency-Key: k\r\n\r\n"
            )
            sock.sendall(b"{}")  # the body arrives after the headers
            first = b""
            while b"session_missing" not in first:
                first += sock.recv(4096)
            assert first.startswith(b"HTTP/1.1 401")
            sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
            second = b""
            while b'"status"' not in second:
                second += sock.recv(4096)
            assert second.startswith(b"HTTP/1.1 200")


def test_second_serve_on_the_same_embedded_data_dir_refuses(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with run_server(data_dir) as server:
        second = subprocess.run(
            [sys.executable, "-m", "cli", "serve", "--port", "0", "--data-dir", str(data_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert second.returncode == 1
        assert "in use by a running registry" in second.stderr
        assert httpx.get(f"{server.url}/v1/health", timeout=5).status_code == 200
    location = data_dir / "postgres.location"
    if location.exists():
        shutil.rmtree(Path(location.read_text().strip()), ignore_errors=True)
