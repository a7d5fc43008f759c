"""The fault-injection suite's PostgreSQL (a private embedded cluster the tests start, stop,
make read-only and fill) and one `registry serve` on it (module scope)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from registry.store.embedded import FALLBACK_ROOT, EmbeddedPostgres
from tests.db.proc import Server, run_server


class Cluster:
    """The test's own PostgreSQL: SQL as its superuser, pg_ctl as its user."""

    def __init__(self, embedded: EmbeddedPostgres, dsn: str) -> None:
        self.embedded = embedded
        self.dsn = dsn

    def sql(self, *statements: str) -> list[Any]:
        async def run() -> list[Any]:
            conn = await asyncpg.connect(self.dsn, timeout=10)
            try:
                return [await conn.fetch(statement) for statement in statements]
            finally:
                await conn.close()

        return asyncio.run(run())

    def restart(self, mode: str) -> None:
        # `-l`: the server's output to its log, not to our pipe (which would never close)
        log = self.embedded.cluster_dir / "server.log"
        self.embedded.control("restart", "-m", mode, "-w", "-t", "60", "-l", str(log))

    def stop(self) -> None:
        self.embedded.control("stop", "-m", "fast", "-w", "-t", "60")

    def start(self) -> None:
        log = self.embedded.cluster_dir / "server.log"
        self.embedded.control("start", "-w", "-t", "60", "-l", str(log))


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    embedded = EmbeddedPostgres(tmp_path_factory.mktemp("faults-pg"))
    dsn = embedded.start()
    try:
        yield Cluster(embedded, dsn)
    finally:
        with contextlib.suppress(Exception):
            embedded.stop()
        if embedded.cluster_dir.is_relative_to(FALLBACK_ROOT):  # kept outside tmp: ours to drop
            shutil.rmtree(embedded.cluster_dir, ignore_errors=True)


@pytest.fixture(scope="package")
def server(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(
        tmp_path_factory.mktemp("faults-server"),
        database_url=cluster.dsn,
        # Anchoring on: its supervisor and the local chain live through every fault too.
        extra_env={
            "REGISTRY_LOGGING__LEVEL": "INFO",
            "REGISTRY_ANCHORING__ENABLED": "true",
            "REGISTRY_ANCHORING__BLOCK_INTERVAL_SECONDS": "0.2",
            "REGISTRY_METRICS__OPEN": "true",  # the tests read what the faults counted
        },
    ) as server:
        yield server
        assert server.proc.poll() is None, f"the server exited:\n{server.output()[-3000:]}"
        log = server.output()
    assert "Traceback" not in log, log[-5000:]


@contextlib.contextmanager
def small_tmpfs(path: Path, size_mb: int, owner: tuple[int, int]) -> Iterator[bool]:
    """A tmpfs of `size_mb` at `path` owned by `owner`; yields False where none can be mounted
    (no privilege): the caller skips what needs it, saying why."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(path)],
            capture_output=True,
        ).returncode
        == 0
    )
    if mounted:
        os.chown(path, *owner)
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
