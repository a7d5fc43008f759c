#!/usr/bin/env python3
"""Scaling with processes: N `registry serve` on one database, and reads from a replica.

One run measures, for each N in --procs (1, 2, 4, 8 where the cores allow: N <= cores), on a
fresh database of the PostgreSQL server at --postgres:
  * bare: N bare Quart-Trio processes (bench/entries.py's ceiling app), the stack's ceiling;
  * get_entry and create_entry across N `registry serve` processes (one database);
with bench/entries.py's machinery (wrk + bench/lua/entries.lua, pre-signed creates with their
own Idempotency-Keys, CPU from /proc). Servers are pinned to cores 0..N-1 (taskset); wrk to the
last four cores the servers leave (on 2 cores, the one left), or unpinned when the servers take
them all. PostgreSQL is never pinned.

Then the replica rows (unless --no-replica): the test's own primary and a hot standby copied
from it (`EmbeddedPostgres.start(replica_of=...)`, Unix sockets, fsync on), the largest N
processes measured twice on them: reading the primary, then with `database.read_url` at the
standby. The PostgreSQL CPU of those rows is split: primary, replica.

    .venv/bin/python bench/scale.py                       # ~3 minutes on 2 cores
    .venv/bin/python bench/scale.py --procs 1,2,4,8 --duration 10 --no-replica
    .venv/bin/python bench/scale.py --waits     # + what the appending backends wait on

Columns: req/s; p50/p99 (wrk); vs bare (req/s over the same N's bare row); vs 1 proc (req/s
over the 1-process row of the same endpoint); srv µs/req (CPU of the N servers per request);
pg µs/req (the database: the bench database's backends and the server's background work);
replica µs/req. Under the table, the batches the writers committed per second during each
setup's create rows (warm-up included; `registry_writer_batches_total` from each server's
/metrics): each sends every process a notification, and every process reads the log after it
(bench/follow.py measures what that costs a process). With --waits, also what the backends in
`append_changes` waited on during each setup's create rows (`pg_stat_activity` every 20 ms:
`Lock:tuple` and `Lock:transactionid` are batches queued for the log head; CPU is running).
Exit status 0 when every row was clean, 1 otherwise, 2 when wrk is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench import entries as be  # noqa: E402  (the machinery: servers, wrk, CPU accounting)
from registry.store.embedded import EmbeddedPostgres  # noqa: E402


@dataclass
class Row:
    setup: str
    procs: int
    m: be.Measurement


def cluster_pids(cluster: Path) -> set[int]:
    """Every process of the cluster in `cluster` (its postmaster and the postmaster's children),
    plus the postmaster's reaped children (a negative pid: `bench.entries.proc_cpu`)."""
    try:
        postmaster = int((cluster / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return set()
    pids = {postmaster, -postmaster}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == postmaster:
                pids.add(int(entry.name))
    return pids


def committed_batches(servers: list[be.Server]) -> float:
    """The batches the servers' writers committed so far (`registry_writer_batches_total`)."""
    total = 0.0
    for server in servers:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("registry_writer_batches_total "):
                    total += float(line.split()[1])
    return total


class WaitSampler:
    """What the backends appending to the log wait on (`--waits`): every 20 ms, in a thread of
    its own, the wait event of each backend of the database that runs `append_changes`
    (`pg_stat_activity`; no wait event: on a CPU). With N processes writing, time spent waiting
    for `Lock: tuple` and `Lock: transactionid` is time queued for the log head's row lock."""

    INTERVAL = 0.02

    def __init__(self, dsn: str, db: str) -> None:
        self.dsn, self.db = dsn, db
        self.counts: Counter[str] = Counter()
        self.samples = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WaitSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import asyncpg  # as bench/entries.py does: only where a database is used

        async def sample() -> None:
            conn = await asyncpg.connect(self.dsn, timeout=10)
            try:
                while not self._stop.is_set():
                    rows = await conn.fetch(
                        "SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') AS w"
                        " FROM pg_stat_activity WHERE datname = $1 AND state = 'active'"
                        " AND query LIKE '%append_changes(%' AND pid <> pg_backend_pid()",
                        self.db,
                    )
                    self.samples += 1
                    self.counts.update(r["w"] for r in rows)
                    await asyncio.sleep(self.INTERVAL)
            finally:
                await conn.close()

        try:
            asyncio.run(sample())
        except Exception as exc:  # said in the summary: the row itself stands
            self.error = f"{type(exc).__name__}: {exc}"

    def summary(self) -> str:
        if self.error is not None:
            return f"the sampler failed ({self.error}) after {self.samples} samples"
        total = sum(self.counts.values())
        if not total:
            return "no backend seen in append_changes"
        shares = ", ".join(f"{w} {n / total:.0%}" for w, n in self.counts.most_common(6))
        return f"{total / max(self.samples, 1):.1f} backends in append_changes on average: {shares}"


class Run:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.cores = os.cpu_count() or 1
        self.rows: list[Row] = []
        self.env = {**os.environ, **be.SERVICE_ENV}
        self.bench = be.Bench(args, workdir, db="")
        self.servers: list[be.Server] = []
        # Batches committed per second during each setup's create rows (warm-up included):
        # each is a notification to every process, which reads the log after it.
        self.batch_rates: dict[str, float] = {}
        self.waits: dict[str, str] = {}  # --waits: per setup, what the appending backends wait on
        self.waits_at: tuple[str, str] = ("", "")  # the server's DSN, the database's name

    def log(self, message: str) -> None:
        be.log(message)

    def wrk_core(self, n: int) -> int | str | None:
        """wrk's cores: on a machine with cores to spare, the last four (at most) of those the
        servers leave free, the rest staying to PostgreSQL; on 2 cores the one left; None
        (unpinned) when the servers take them all."""
        if n >= self.cores:
            return None
        first = max(n, self.cores - 4) if self.cores - n > 2 else n
        return str(first) if first == self.cores - 1 else f"{first}-{self.cores - 1}"

    @contextmanager
    def processes(
        self, name: str, n: int, start: Callable[[str, int], be.Server]
    ) -> Iterator[list[be.Server]]:
        started: list[be.Server] = []
        try:
            for i in range(n):
                started.append(start(f"{name}-{i}", i))
            yield started
        finally:
            for server in reversed(started):
                be.stop_server(server)

    def bare(self, name: str, core: int) -> be.Server:
        port = be.free_port()
        cmd = [sys.executable, str(HERE / "entries.py"), "--bare-server", str(port)]
        server = be.start_server(name, cmd, port, core, self.workdir, dict(os.environ))
        be.wait_ready(server, "/bare", 30)
        return server

    def registry(self, url: str, read_url: str = "") -> Callable[[str, int | None], be.Server]:
        def start(name: str, core: int | None) -> be.Server:  # core None: unpinned
            port = be.free_port()
            cmd = [
                str(be.VENV_BIN / "registry"), "serve", "--host", "127.0.0.1",
                "--port", str(port), "--data-dir", str(self.workdir / "data"),
                "--database-url", url,
            ]  # fmt: skip
            env = {**self.env, **({"REGISTRY_DATABASE__READ_URL": read_url} if read_url else {})}
            server = be.start_server(name, cmd, port, core, self.workdir, env)
            be.wait_ready(server, "/v1/health", 60, want=lambda b: b.get("status") == "ok")
            return server

        return start

    def sign_in_and_publish(self, server: be.Server) -> tuple[str, str]:
        """A session token and the DID of the entry get_entry reads (published now)."""
        from cli.client import RegistryClient
        from registry.keys import SigningKey

        key = SigningKey(self.bench.seed)
        did = f"did:web:bench.example.com:{self.bench.run_tag}:read:{secrets.token_hex(3)}"
        with RegistryClient(f"http://127.0.0.1:{server.port}") as client:
            client.sign_in(key)
            client.publish(be.entry_for(did), key)
            assert client.token
            return client.token, did

    def measure_rows(
        self, setup: str, n: int, servers: list[be.Server], ceiling: float
    ) -> list[be.Measurement]:
        bench, conns = self.bench, self.args.connections * n
        token, did = self.sign_in_and_publish(servers[0])
        load = be.Load([s.port for s in servers], n, conns, self.wrk_core(n))
        get = bench.measure(setup, "get_entry", servers, load, path=f"/v1/entries/{did}")
        batches, began = committed_batches(servers), time.monotonic()
        with contextlib.ExitStack() as stack:
            if self.args.waits:
                sampler = stack.enter_context(WaitSampler(*self.waits_at))
            create = bench.measure_create(setup, servers, load, token, ceiling)
        if self.args.waits:
            self.waits[setup] = sampler.summary()
        self.batch_rates[setup] = (committed_batches(servers) - batches) / (
            time.monotonic() - began
        )
        return [get, create]

    def scaling(self) -> None:
        args, bench = self.args, self.bench
        db = f"registry_scale_{secrets.token_hex(4)}"
        be.db_admin(args.postgres, f'CREATE DATABASE "{db}"')
        bench.db = db
        self.waits_at = (f"{args.postgres}/postgres", db)
        try:
            for n in self.procs:
                setup = f"{n} proc" + ("s" if n > 1 else "")
                with self.processes("bare", n, self.bare) as bares:
                    ports = [s.port for s in bares]
                    load = be.Load(ports, n, args.connections * n, self.wrk_core(n))
                    ceiling = bench.measure(setup, "bare", bares, load, path="/bare")
                self.rows.append(Row(setup, n, ceiling))
                url = f"{args.postgres}/{db}"
                with self.processes("registry", n, self.registry(url)) as servers:
                    for m in self.measure_rows(setup, n, servers, ceiling.result.rps):
                        self.rows.append(Row(setup, n, m))
        finally:
            if not args.keep_db:
                be.db_admin(args.postgres, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')

    def replica(self) -> None:
        n = max(self.procs)
        root = self.workdir / "clusters"
        primary = EmbeddedPostgres(root / "primary")
        standby = EmbeddedPostgres(root / "standby")
        url = primary.start()
        try:
            read_url = standby.start(replica_of=url)
            try:
                self.replica_rows(n, url, read_url, primary, standby)
            finally:
                standby.stop()
        finally:
            primary.stop()

    def replica_rows(
        self,
        n: int,
        url: str,
        read_url: str,
        primary: EmbeddedPostgres,
        standby: EmbeddedPostgres,
    ) -> None:
        bench = self.bench
        ceiling = next(r.m for r in self.rows if r.procs == n and r.m.endpoint == "bare")
        bench.pg_pids = lambda: cluster_pids(primary.cluster_dir)
        bench.replica_pids = lambda: cluster_pids(standby.cluster_dir)
        for setup, replica in ((f"{n}p embedded", False), (f"{n}p +replica", True)):
            # A fresh database on the pair for each setup, as for the rows above: the first
            # setup's creates leave the anchoring and the checkpointer work the next would do.
            db = f"scale_{secrets.token_hex(4)}"
            be.db_admin_url(url, f'CREATE DATABASE "{db}"')
            on = url.replace("/registry?", f"/{db}?")
            self.waits_at = (on, db)
            reads = read_url.replace("/registry?", f"/{db}?") if replica else ""
            with self.processes("registry", n, self.registry(on, reads)) as servers:
                for m in self.measure_rows(setup, n, servers, ceiling.result.rps):
                    self.rows.append(Row(setup, n, m))

    @property
    def procs(self) -> list[int]:
        wanted = [int(x) for x in self.args.procs.split(",") if x.strip()]
        return [n for n in wanted if n <= self.cores] or [1]


def report(run: Run) -> bool:
    rows = run.rows
    bare = {r.procs: r.m.result.rps for r in rows if r.m.endpoint == "bare"}
    one = {r.m.endpoint: r.m.result.rps for r in rows if r.setup == "1 proc"}
    width = 122
    print()
    print("=" * width)
    print(f"service: commit {be.git_revision()}; {run.cores} cores; {be.wrk_version()}")
    print(
        f"{run.args.connections} connections per process; {run.args.warmup:.0f}s warm-up +"
        f" {run.args.duration:.0f}s measured per row; database: {run.args.postgres} (fresh),"
        " the replica rows on their own embedded primary + hot standby"
    )
    print("-" * width)
    print(
        f"{'setup':<13} {'endpoint':<13} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>8} {'non-2xx':>7}"
        f" {'vs bare':>7} {'vs 1 proc':>9} {'srv core':>8} {'srv µs/req':>10}"
        f" {'pg µs/req':>9} {'replica µs/req':>14}"
    )
    print("-" * width)
    clean = True
    for row in rows:
        m, r = row.m, row.m.result
        ceiling = bare.get(row.procs) if m.endpoint != "bare" else None
        ratio = r.rps / ceiling if ceiling else math.nan
        scale = r.rps / one[m.endpoint] if one.get(m.endpoint) else math.nan
        replica = m.us_per_request(m.replica_cpu_s)
        print(
            f"{row.setup:<13} {m.endpoint:<13} {r.rps:>8,.0f}"
            f" {be.fmt(r.percentile_ms(50), '.1f'):>7} {be.fmt(r.percentile_ms(99), '.1f'):>8}"
            f" {r.non_2xx:>7} {be.fmt(ratio, '.2f'):>7} {be.fmt(scale, '.2f'):>9}"
            f" {m.server_core_share:>7.0%} "
            f" {be.fmt(m.us_per_request(m.server_cpu_s), ',.0f'):>10}"
            f" {be.fmt(m.us_per_request(m.postgres_cpu_s), ',.0f'):>9}"
            f" {be.fmt(replica, ',.0f'):>14}"
        )
        if r.problems() or m.notes:
            clean = False
            print(f"    ERRORS/NOTES: {'; '.join(r.problems() + m.notes)}")
    print("-" * width)
    print(
        "vs bare: over the bare row of the same N. vs 1 proc: over the 1-process row of the same"
        " endpoint. srv core: share of one\ncore per server. pg µs/req: the database's CPU per"
        " request (for the replica rows, the primary's);\nreplica µs/req: the standby's CPU over"
        " the row, per request (the standby replays every write, and answers the reads)."
    )
    rates = ", ".join(f"{setup}: {rate:,.0f}/s" for setup, rate in run.batch_rates.items())
    print(f"batches committed during the create rows (each notifies every process): {rates}")
    for setup, waits in run.waits.items():
        print(f"waits during the create rows, {setup}: {waits}")
    if not clean:
        print("\nTHIS RUN HAD ERRORS: the figures of the rows marked above are not valid.")
    print("=" * width)
    return clean


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--procs", default="1,2,4,8", help="process counts (those <= cores)")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per row")
    parser.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per row")
    parser.add_argument(
        "--connections", type=int, default=48, help="concurrent connections per process (48)"
    )
    parser.add_argument(
        "--postgres",
        default=os.environ.get("BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432"),
        help="PostgreSQL server URL without a database (a fresh database is created and dropped)",
    )
    parser.add_argument("--no-replica", action="store_true", help="skip the replica rows")
    parser.add_argument(
        "--waits",
        action="store_true",
        help="sample what the backends in append_changes wait on during the create rows",
    )
    parser.add_argument("--sign-workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--keep-db", action="store_true")
    parser.add_argument("--keep-workdir", action="store_true")
    args = parser.parse_args()
    # What bench/entries.py's Bench reads from its arguments.
    args.profile, args.profile_format, args.verbose = None, "raw", False
    if shutil.which("wrk") is None:
        print("bench/scale.py needs wrk: apt-get install -y wrk", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="registry-scale-"))
    run = Run(args, workdir)
    try:
        run.log(f"procs {run.procs} on {run.cores} cores; work dir {workdir}")
        run.scaling()
        if not args.no_replica:
            run.replica()
        clean = report(run)
        print(json.dumps({"rows": len(run.rows), "clean": clean}))
        return 0 if clean else 1
    finally:
        if args.keep_workdir:
            print(f"work dir kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
