"""Running `registry serve` as a real subprocess, for the end-to-end and crash tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


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
) -> Iterator[Server]:
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
