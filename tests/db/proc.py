"""Running `registry serve` as a real subprocess, for the end-to-end and crash tests, and the
databases of several registries on the test server."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx

from registry.store.migrate import _ADVISORY_KEY, _migrate, load_migrations


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def wait_healthy(server: Server, deadline_s: float) -> None:
    """Poll /v1/health until 200, the process dies, or the deadline passes."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"server exited {server.proc.returncode}:\n{server.output()}")
        try:
            if httpx.get(f"{server.url}/v1/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"server not healthy in {deadline_s}s:\n{server.output()}")


@contextmanager
def run_server(
    data_dir: Path,
    *,
    database_url: str = "",
    extra_env: dict[str, str] | None = None,
    ready_s: float = 60,
    port: int | None = None,
    config: Path | None = None,
    healthy: bool = True,
) -> Iterator[Server]:
    """`registry serve` in a subprocess, stopped with SIGTERM at the end; yielded once healthy
    (`healthy`), or at once."""
    port = port or free_port()
    log = data_dir / f"server-{port}.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
    env.update(
        {
            "REGISTRY_LIMITS__WRITE_PER_MINUTE": "100000",
            "REGISTRY_LIMITS__WRITE_PER_MINUTE_PER_ADDRESS": "100000",
            "REGISTRY_SERVER__CONNECTIONS_PER_MINUTE_PER_CLIENT": "100000",
            "REGISTRY_LIMITS__READ_PER_MINUTE": "100000",
            "REGISTRY_LIMITS__BODY_BYTES_PER_MINUTE_PER_ADDRESS": "10000000000",
            "REGISTRY_LIMITS__QUERY_DB_MS_PER_MINUTE_PER_ADDRESS": "100000000",
            "REGISTRY_LIMITS__QUERY_CONCURRENCY_PER_ADDRESS": "1000",
            # Anchoring only where a test asks for it: a supervisor would take the database's
            # anchoring lock and add anchor.* records to the log other tests read.
            "REGISTRY_ANCHORING__ENABLED": "false",
            **(extra_env or {}),
        }
    )
    args = [
        sys.executable,
        "-m",
        "cli",
        "serve",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
    ]
    if database_url:
        args += ["--database-url", database_url]
    if config is not None:
        args += ["--config", str(config)]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        if healthy:
            wait_healthy(server, ready_s)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def query(url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(url)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    return asyncio.run(run())


@contextmanager
def migrations_held(database_url: str) -> Iterator[threading.Event]:
    """Hold the migration runner's advisory lock (a `serve` or `migrate` starting meanwhile
    waits in its migrations) until the event is set or the block ends."""
    release, held = threading.Event(), threading.Event()

    async def hold() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute("SELECT pg_advisory_lock($1)", _ADVISORY_KEY)
            held.set()
            await asyncio.get_running_loop().run_in_executor(None, release.wait)
        finally:
            await conn.close()

    thread = threading.Thread(target=asyncio.run, args=(hold(),))
    thread.start()
    try:
        assert held.wait(60)
        yield release
    finally:
        release.set()
        thread.join(60)


def migration_waiters(url: str) -> list[int]:
    """The backends of `url`'s database that wait for an advisory lock (the migrations')."""
    rows = query(
        url,
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    return [int(row["pid"]) for row in rows]


@contextmanager
def databases(database_url: str) -> Iterator[Callable[[], str]]:
    """Fresh, migrated databases on the server of `database_url` (one per node), created the
    way conftest creates the session's database, dropped at the end."""
    parts = urlsplit(database_url)
    admin_url = urlunsplit(parts._replace(path="/postgres"))
    created: list[str] = []

    def create() -> str:
        name = f"registry_test_{secrets.token_hex(4)}"
        query(admin_url, f"CREATE DATABASE {name}")
        created.append(name)
        url = urlunsplit(parts._replace(path=f"/{name}"))
        asyncio.run(_migrate(url, load_migrations()))
        return url

    try:
        yield create
    finally:
        for name in created:
            query(admin_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
