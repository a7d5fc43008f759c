"""A database that refuses the service's connections (pg_hba, a rotated password, the database
dropped) is a condition like a lost connection: 503 database_unavailable, and the process lives
(docs/faults.md). Both ended it at the first actor's reconnect (SQLSTATE 28000, 3D000)."""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from tests.db.proc import Server, databases, query, run_server
from tests.faults.conftest import Cluster

pytestmark = pytest.mark.faults


def watch(server: Server, seconds: float) -> list[str]:
    """Health answers for `seconds` (the actors reconnect within a second or two and meet the
    refusal there); stops early if the process ends. No event says that a process did not end:
    it is watched for a window."""
    seen = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and server.proc.poll() is None:
        try:
            r = httpx.get(f"{server.url}/v1/health", timeout=3)
            seen.append(f"{r.status_code} {r.text[:120]}")
        except httpx.HTTPError as exc:
            seen.append(f"error {exc!r}")
        time.sleep(0.25)
    return seen


def test_a_database_that_refuses_connections_does_not_end_the_process(
    cluster: Cluster, tmp_path: Path
) -> None:
    """docs/faults.md: class 08 ... "a lost connection, a refused connect" is
    `database_unavailable`; "once serving, no database fault ends the process". Here the
    server's pg_hba.conf starts refusing the registry's database (an operator locking it
    during maintenance, a credentials rotation: SQLSTATE 28000 at connect) and its open
    connections are ended: the process exits at its first reconnect."""
    cluster.sql("CREATE DATABASE app")
    hba = cluster.embedded.cluster_dir / "pg_hba.conf"
    before = hba.read_text()
    parts = urlsplit(cluster.dsn)
    app = urlunsplit(parts._replace(path="/app"))
    try:
        with run_server(tmp_path / "srv", database_url=app) as server:
            hba.write_text("local app all reject\n" + before)
            cluster.sql("SELECT pg_reload_conf()")
            cluster.sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = 'app'"
            )
            seen = watch(server, 5)
            hba.write_text(before)
            cluster.sql("SELECT pg_reload_conf()")
            alive = server.proc.poll() is None
            output = server.output()
            assert alive, f"the process ended:\n{seen[-3:]}\n{output[-1500:]}"
            assert any(s.startswith("503") for s in seen), seen
    finally:
        hba.write_text(before)
        cluster.sql("SELECT pg_reload_conf()")
        cluster.sql("DROP DATABASE IF EXISTS app WITH (FORCE)")


def test_a_dropped_database_does_not_end_the_process(database_url: str, tmp_path: Path) -> None:
    """docs/faults.md: "once serving, no database fault ends the process"; a fault the table
    does not name is "a 500 for the request", not the end of the process. The database is
    dropped under a running server (its connections ended, then every connect refused with
    3D000): the process exits within a second."""
    admin = urlunsplit(urlsplit(database_url)._replace(path="/postgres"))
    with databases(database_url) as new_database:
        url = new_database()
        with run_server(tmp_path / "srv", database_url=url) as server:
            query(admin, f"DROP DATABASE {urlsplit(url).path.lstrip('/')} WITH (FORCE)")
            seen = watch(server, 5)
            assert server.proc.poll() is None, (
                f"the process ended:\n{seen[-3:]}\n{server.output()[-800:]}"
            )
            assert any(s.startswith("503") for s in seen), seen
