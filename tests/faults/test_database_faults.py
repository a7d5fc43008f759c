"""Database faults under load (issue 17): a private PostgreSQL that the test makes read-only,
restarts, stops, fills and whose connections it kills, while writers, a reader and a subscriber
use one `registry serve`. After each: the process is alive, no acknowledged write is lost or
duplicated, the log is gap-free, the subscriber got every event once, and health is back to
`ok` soon after the database is (within a second by design: the actors' backoff asks every
second whether the database is back; asserted here with room for a loaded machine)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.db.proc import Server
from tests.faults.conftest import Cluster, small_tmpfs
from tests.faults.load import Load, wait_health
from tests.helpers import signed_entry

pytestmark = pytest.mark.faults

RECOVERY = 5.0  # seconds: health back to ok after the database (1 s by design)
DOWN_SECONDS = float(os.environ.get("REGISTRY_FAULTS_DOWN_SECONDS", "10"))


def healthy(body: dict) -> bool:  # type: ignore[type-arg]
    return body.get("status") == "ok"


def recovered(server: Server, what: str) -> float:
    """Seconds from the database's return until health says ok (shown with `pytest -s`)."""
    _, took = wait_health(server.url, healthy)
    print(f"\n{what}: health ok {took:.2f}s after the database")
    return took


def verify(server: Server, cluster: Cluster, load: Load) -> None:
    """After the fault (inside the load's block: the subscriber is still reading)."""
    load.finish()
    assert server.proc.poll() is None, "the registry process ended"
    assert not load.unexpected, load.unexpected[:5]
    assert load.acked, "no write was acknowledged"
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for did, sequence in load.acked.items():
            r = http.get(f"/v1/entries/{did}")
            assert r.status_code == 200, (did, r.text)
            assert r.json()["sequence"] == sequence  # the acknowledged version, once
    [[row]] = cluster.sql("SELECT count(*) AS n, min(seq) AS lo, max(seq) AS hi FROM log")
    assert (row["lo"], row["n"]) == (1, row["hi"]), "the log has a gap"
    got = load.wait_received()
    assert len(got) == len(set(got)), "the subscriber got an event twice"
    assert got == sorted(got), "the subscriber got events out of order"


def test_a_read_only_database_is_503_and_degraded_then_ok(
    server: Server, cluster: Cluster, tmp_path: Path
) -> None:
    with Load(server.url, tmp_path) as load:
        time.sleep(1)
        cluster.sql(
            "ALTER SYSTEM SET default_transaction_read_only = on", "SELECT pg_reload_conf()"
        )
        try:
            load.wait_for_code("database_read_only")
            body, _ = wait_health(
                server.url, lambda b: b.get("checks", {}).get("writes", "").endswith("read_only")
            )
            assert body["status"] == "degraded"  # reads go on
            assert body["checks"]["writes"] == "failing: database_read_only"
            time.sleep(1)
        finally:
            cluster.sql(
                "ALTER SYSTEM RESET default_transaction_read_only", "SELECT pg_reload_conf()"
            )
        assert recovered(server, "read-only off") < RECOVERY
        time.sleep(1)
        verify(server, cluster, load)
    # Operators saw it in the metrics: the refusals counted by their code, writes ok again.
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert re.search(r'^registry_db_errors_total\{code="database_read_only"\} [1-9]', metrics, re.M)
    assert re.search(r"^registry_writer_failing 0\.0$", metrics, re.M)


def test_killed_connections_are_replaced(server: Server, cluster: Cluster, tmp_path: Path) -> None:
    with Load(server.url, tmp_path) as load:
        for _ in range(4):
            time.sleep(0.5)
            cluster.sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = 'registry' AND pid <> pg_backend_pid()"
            )
        assert recovered(server, "connections killed") < RECOVERY
        time.sleep(1)
        verify(server, cluster, load)


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_restart_loses_nothing(
    server: Server, cluster: Cluster, tmp_path: Path, mode: str
) -> None:
    with Load(server.url, tmp_path) as load:
        time.sleep(1)
        cluster.restart(mode)
        # (includes the database's own recovery after `immediate`)
        assert recovered(server, f"restart -m {mode}") < RECOVERY + 5
        time.sleep(1)
        verify(server, cluster, load)


def test_a_database_down_for_a_while(server: Server, cluster: Cluster, tmp_path: Path) -> None:
    with Load(server.url, tmp_path) as load:
        time.sleep(1)
        cluster.stop()
        try:
            load.wait_for_code("database_unavailable")
            body, _ = wait_health(server.url, lambda b: b.get("status") == "failing")
            assert body["checks"]["database"].startswith("failing: database_")
            time.sleep(DOWN_SECONDS)
        finally:
            cluster.start()
        assert recovered(server, f"down {DOWN_SECONDS:g}s") < RECOVERY
        time.sleep(1)
        verify(server, cluster, load)


def test_a_full_disk_is_503_database_full_then_ok(
    server: Server, cluster: Cluster, tmp_path: Path
) -> None:
    # Where the cluster's user can reach it (a pytest directory under /root may not be).
    space = Path(tempfile.mkdtemp(prefix="registry-faults-", dir="/tmp")) / "small"
    space.parent.chmod(0o755)
    with small_tmpfs(space, 16, cluster.embedded.owner) as mounted:
        if not mounted:
            pytest.skip("a tmpfs cannot be mounted here (needs root): the full-disk case")
        tables = ("log", "entries", "entry_versions", "idempotency")
        cluster.sql(f"CREATE TABLESPACE small LOCATION '{space}'")
        try:
            cluster.sql(*[f"ALTER TABLE {t} SET TABLESPACE small" for t in tables])
            filler = space / "filler"
            with Load(server.url, tmp_path) as load:
                time.sleep(1)
                subprocess.run(
                    ["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True
                )  # until the tmpfs is full
                try:
                    load.wait_for_code("database_full")
                    body, _ = wait_health(
                        server.url,
                        lambda b: b.get("checks", {}).get("writes") == "failing: database_full",
                    )
                    assert body["status"] == "degraded"
                    time.sleep(1)
                finally:
                    filler.unlink()
                assert recovered(server, "disk freed") < RECOVERY
                time.sleep(1)
                verify(server, cluster, load)
        finally:
            cluster.sql(*[f"ALTER TABLE {t} SET TABLESPACE pg_default" for t in tables])
            cluster.sql("DROP TABLESPACE small")


def test_writes_behind_a_held_lock_are_503_database_timeout_within_the_deadline(
    server: Server, cluster: Cluster, tmp_path: Path
) -> None:
    """A transaction holds the log head (an operator's, a stuck migration): the writer's batch
    waits for it until the 30 s deadline. The writes queued behind that batch each waited out
    their own batch's 30 s in turn (a minute, two, ... while the lock lasted); every write is
    answered `503 database_timeout` within about the one deadline, and writes go through again
    once the lock is gone."""
    key = Load(server.url, tmp_path, writers=0)
    with key:
        release = threading.Event()
        locked = threading.Event()

        def hold() -> None:
            async def run() -> None:
                conn = await asyncpg.connect(cluster.dsn, timeout=10)
                try:
                    async with conn.transaction():
                        await conn.execute("SELECT seq FROM log_head WHERE id = 1 FOR UPDATE")
                        locked.set()
                        await asyncio.get_running_loop().run_in_executor(None, release.wait, 90)
                finally:
                    await conn.close()

            asyncio.run(run())

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert locked.wait(10)
            headers = {"Authorization": f"Bearer {key.token}"}

            def write(_: int) -> tuple[int, str, float]:
                with httpx.Client(base_url=server.url, timeout=120) as http:
                    started = time.monotonic()
                    r = http.post(
                        "/v1/entries",
                        json=signed_entry(key.key),
                        headers={**headers, "Idempotency-Key": uuid.uuid4().hex},
                    )
                    took = time.monotonic() - started
                    code = r.json()["error"]["code"] if r.status_code != 201 else ""
                    return r.status_code, code, took

            with ThreadPoolExecutor(100) as pool:
                futures = [pool.submit(write, n) for n in range(100)]
                answers = [f.result() for f in as_completed(futures, timeout=120)]
        finally:
            release.set()
            holder.join(30)
        assert {(status, code) for status, code, _ in answers} == {(503, "database_timeout")}
        assert max(took for _, _, took in answers) < 45  # the one deadline (30 s), not two
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post(
                "/v1/entries",
                json=signed_entry(key.key),
                headers={**headers, "Idempotency-Key": uuid.uuid4().hex},
            )
            assert r.status_code == 201, r.text
        assert server.proc.poll() is None
