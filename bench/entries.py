#!/usr/bin/env python3
"""Throughput and latency of get_entry and create_entry against the stack's ceiling.

One run starts, on a fresh database of the local PostgreSQL server:
  * `registry serve` (one process, then a second one on the same database), and
  * a bare Quart-Trio app on Hypercorn (trio worker, in-process `hypercorn.trio.serve`, the same
    Hypercorn settings as the service) that returns a fixed 2 KB JSON document: the ceiling of
    this stack, one process per core;
and drives them over loopback with wrk (Debian's `wrk`, a Lua script in bench/lua/entries.lua
that replays pre-signed create bodies, each with its own Idempotency-Key). It prints requests/s,
p50/p99 latency, errors, the CPU the servers and PostgreSQL spent per request, and the ratios
get_entry/bare and create_entry/bare against the targets (≥ 0.80 and ≥ 0.40, one process).

Cores (2 on the reference machine): one process: server pinned to core 0, wrk pinned to core 1;
two processes: servers pinned to core 0 and core 1, one wrk run with two threads (one per
server, half the connections each) left unpinned. PostgreSQL is never pinned.

    .venv/bin/python bench/entries.py                 # ~2 minutes
    .venv/bin/python bench/entries.py --duration 5 --single-only
    .venv/bin/python bench/entries.py --profile /tmp/prof   # py-spy during the one-process runs

Exit status: 0 when every measured run was clean (only 2xx, no socket errors, no replayed
create), 1 otherwise, 2 when a prerequisite is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LUA = HERE / "lua" / "entries.lua"
VENV_BIN = Path(sys.executable).parent
TARGETS = {"get_entry": 0.80, "create_entry": 0.40}
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

SERVICE_ENV = {
    "REGISTRY_LIMITS__READ_PER_MINUTE": "100000000",
    "REGISTRY_LIMITS__WRITE_PER_MINUTE": "100000000",
    "REGISTRY_LIMITS__WRITE_PER_MINUTE_PER_ADDRESS": "100000000",
    "REGISTRY_LIMITS__QUERY_PER_MINUTE": "100000000",
    "REGISTRY_LIMITS__QUERY_PER_MINUTE_PER_ADDRESS": "100000000",
    "REGISTRY_LIMITS__BODY_BYTES_PER_MINUTE_PER_ADDRESS": "100000000000",
    "REGISTRY_LIMITS__QUERY_DB_MS_PER_MINUTE_PER_ADDRESS": "100000000000",
    "REGISTRY_LIMITS__QUERY_CONCURRENCY_PER_ADDRESS": "1000",
    "REGISTRY_LOGGING__LEVEL": "WARNING",
    # Every bench client comes from 127.0.0.1: the per-address caps would be the bench's wall.
    "REGISTRY_SERVER__MAX_CONNECTIONS_PER_CLIENT": "1000000",
    "REGISTRY_SERVER__CONNECTIONS_PER_MINUTE_PER_CLIENT": "100000000",
    "REGISTRY_EVENTS__MAX_CONNECTIONS_PER_CLIENT": "1000000",
    "REGISTRY_EVENTS__REPLAYS_PER_MINUTE": "100000000",
    "REGISTRY_METRICS__OPEN": "true",  # bench/scale.py reads the writers' batch counts
}


# --- the bare app (run as `entries.py --bare-server PORT` in its own process) -----------------


def bare_document() -> bytes:
    """A fixed JSON document of exactly 2048 bytes, shaped like a served entry."""
    doc: dict[str, Any] = {
        "entryDid": "did:web:bench.example.com:bare",
        "entryType": "AgentDefinition",
        "itemData": {"instructions": "", "model": "m-1", "temperature": 0.5},
        "name": "Bare ceiling document",
        "sequence": 1,
        "tags": ["bench", "bare"],
    }
    base = len(json.dumps(doc, separators=(",", ":")).encode())
    doc["itemData"]["instructions"] = "x" * (2048 - base)
    body = json.dumps(doc, separators=(",", ":")).encode()
    assert len(body) == 2048, len(body)
    return body


def run_bare_server(port: int) -> None:
    import logging

    import hypercorn.trio
    import trio
    from hypercorn.config import Config as HyperConfig
    from quart import Response
    from quart_trio import QuartTrio

    logging.basicConfig(level=logging.WARNING)
    if os.environ.get("BENCH_BARE_HOOKED") == "1":
        # The registry's connection hook (ws/transport.py: one write per answer) around the
        # bare app's connections too, without its limits: what is left between the rows is
        # the application's work.
        from ws.transport import install_in_hypercorn

        assert install_in_hypercorn()
    body = bare_document()
    app = QuartTrio("bare")

    @app.get("/bare")
    async def bare() -> Response:
        return Response(body, status=200, content_type="application/json")

    # The settings of service.serve._hypercorn_config, so that only the application differs.
    config = HyperConfig()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_timeout = 75
    config.include_server_header = False

    async def main() -> None:
        stop = trio.Event()

        async def watch_signals() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    stop.set()
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_signals)
            await hypercorn.trio.serve(app, config, shutdown_trigger=stop.wait)
            nursery.cancel_scope.cancel()

    trio.run(main)


# --- signed create bodies --------------------------------------------------------------------


def entry_for(did: str) -> dict[str, Any]:
    """A realistic entry (tests/helpers.py entry_template, fleshed out): ~1.9 KB signed."""
    return {
        "entryDid": did,
        "entryType": "AgentDefinition",
        "itemData": {
            "model": "m-1",
            "instructions": "Be helpful, precise and brief. " * 12,
            "temperature": 0.5,
            "tools": [
                {"name": f"tool-{i}", "description": f"Looks up things of kind {i} in a catalogue."}
                for i in range(6)
            ],
        },
        "itemSchemaUri": "https://schemas.example.com/agent/v1",
        "registryVersion": "1.0",
        "name": "Helpful agent",
        "description": "An agent definition published by the registry benchmark. " * 4,
        "publishedAt": "2026-11-01T12:00:00Z",
        "version": "1.0.0",
        "lifecycleStatus": "active",
        "tags": ["demo", "helpful", "bench"],
    }


def make_pool_chunk(seed: bytes, prefix: str, start: int, count: int) -> list[str]:
    """Lines "<Idempotency-Key> <signed JSON body>" (runs in a worker process)."""
    from registry.entries import sign_entry
    from registry.keys import SigningKey

    key = SigningKey(seed)
    lines = []
    for i in range(start, start + count):
        body = json.dumps(
            sign_entry(entry_for(f"{prefix}{i}"), key), separators=(",", ":"), ensure_ascii=False
        )
        lines.append(f"{uuid.uuid4()} {body}")
    return lines


def write_pool(path: Path, seed: bytes, prefix: str, count: int, workers: int) -> float:
    """Sign `count` distinct entries into `path`; returns the seconds it took."""
    began = time.perf_counter()
    chunk = max(1, math.ceil(count / (workers * 4)))
    starts = list(range(0, count, chunk))
    with ProcessPoolExecutor(max_workers=workers) as pool, path.open("w") as out:
        futures = [
            pool.submit(make_pool_chunk, seed, prefix, s, min(chunk, count - s)) for s in starts
        ]
        for future in futures:
            for line in future.result():
                out.write(line)
                out.write("\n")
    return time.perf_counter() - began


# --- processes -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned(core: int | str | None, cmd: list[str]) -> list[str]:
    """`cmd` under taskset: `core` is one core or a taskset list ("12-15"); None: unpinned."""
    if core is None or shutil.which("taskset") is None:
        return cmd
    return ["taskset", "-c", str(core), *cmd]


@dataclass
class Server:
    name: str
    port: int
    core: int | None
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid  # taskset execs the command: same pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start_server(
    name: str, cmd: list[str], port: int, core: int | None, logdir: Path, env: dict[str, str]
) -> Server:
    log = logdir / f"{name}.log"
    with log.open("wb") as handle:
        popen = subprocess.Popen(
            pinned(core, cmd),
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=ROOT,
        )
    return Server(name, port, core, popen, log)


def wait_ready(server: Server, path: str, deadline_s: float, want: Any = None) -> None:
    """Poll `path` until 200 (and, for the registry, `status: ok`: the head cache is on)."""
    url = f"http://127.0.0.1:{server.port}{path}"
    deadline = time.monotonic() + deadline_s
    last = "no answer"
    while time.monotonic() < deadline:
        if server.popen.poll() is not None:
            raise RuntimeError(
                f"{server.name} exited with {server.popen.returncode}:\n{server.log_tail()}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                body = response.read()
                if response.status == 200 and (want is None or want(json.loads(body))):
                    return
                last = f"{response.status} {body[:200]!r}"
        except urllib.error.HTTPError as exc:
            last = f"{exc.code} {exc.read()[:200]!r}"
        except (OSError, ValueError) as exc:
            last = repr(exc)
        time.sleep(0.1)
    raise RuntimeError(
        f"{server.name} not ready after {deadline_s:.0f}s ({last}):\n{server.log_tail()}"
    )


def stop_server(server: Server, timeout: float = 20.0) -> None:
    if server.popen.poll() is not None:
        return
    server.popen.send_signal(signal.SIGTERM)
    try:
        server.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        print(f"  {server.name} ignored SIGTERM for {timeout:.0f}s; killing it", file=sys.stderr)
        server.popen.kill()
        server.popen.wait(10)


# --- the database --------------------------------------------------------------------------


def db_admin(server_url: str, *statements: str) -> None:
    db_admin_url(f"{server_url}/postgres", *statements)


def db_admin_url(url: str, *statements: str) -> None:
    """Run `statements` on the database at `url` (a full DSN, e.g. a Unix socket's)."""
    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(run())


# --- CPU accounting ------------------------------------------------------------------------


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of one process (0 if it is gone). A negative pid stands for
    the reaped children of process -pid: their CPU, which the kernel adds to the parent's when
    they exit (how the CPU of backends that ended during a row is still counted)."""
    try:
        text = Path(f"/proc/{abs(pid)}/stat").read_text()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2 :].split()
    if pid < 0:
        return (int(fields[13]) + int(fields[14])) / CLK_TCK
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def count_entries(server_url: str, db: str) -> int:
    import asyncpg

    async def run() -> int:
        conn = await asyncpg.connect(f"{server_url}/{db}", timeout=10)
        try:
            return int(await conn.fetchval("SELECT count(*) FROM entries"))
        finally:
            await conn.close()

    return asyncio.run(run())


def postgres_pids(server_url: str, db: str) -> set[int]:
    """The PostgreSQL processes that work for the bench: the backends connected to its database
    and the server's background processes (WAL writer, checkpointer, ...), plus (as a negative
    pid, see `proc_cpu`) the postmaster's reaped children: backends that exited meanwhile,
    such as connections a server closed after a cancelled query. Other databases' live
    backends on the shared server are left out; their exits would count, so keep it quiet."""
    import asyncpg

    async def run() -> set[int]:
        conn = await asyncpg.connect(f"{server_url}/postgres", timeout=10)
        try:
            rows = await conn.fetch(
                "SELECT pid FROM pg_stat_activity"
                " WHERE datname = $1 OR backend_type <> 'client backend'",
                db,
            )
        finally:
            await conn.close()
        return {int(r["pid"]) for r in rows}

    try:
        pids = asyncio.run(run())
    except Exception:  # accounting only: never fail a run over it
        return set()
    # The postmaster (the parent of every backend), for the CPU of backends that exited.
    for pid in sorted(pids):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        pids.add(-int(stat[stat.rindex(")") + 2 :].split()[1]))
        break
    return pids


def all_processes() -> dict[int, tuple[str, float]]:
    """pid → (name, CPU seconds) of every process (for naming what else ran meanwhile)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                name = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:60]
                name = name.strip() or (entry / "comm").read_text().strip()
            except OSError:
                continue
            out[int(entry.name)] = (name, proc_cpu(int(entry.name)))
    return out


def cpu_snapshot(pids: set[int]) -> dict[int, float]:
    return {pid: proc_cpu(pid) for pid in pids}


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two snapshots by the processes alive at the end (a process
    that appeared in between counts from zero; one that exited is lost)."""
    return sum(max(0.0, cpu - before.get(pid, 0.0)) for pid, cpu in after.items())


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores from /proc/stat."""
    parts = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + parts[4]
    total = sum(parts[:8])
    return total - idle, total


def idle_check(seconds: float = 1.0) -> float:
    """How busy the machine is before we start (fraction of all cores)."""
    busy0, total0 = machine_busy()
    time.sleep(seconds)
    busy1, total1 = machine_busy()
    return (busy1 - busy0) / max(1, total1 - total0)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- wrk -----------------------------------------------------------------------------------


@dataclass
class WrkResult:
    requests: int = 0
    duration_s: float = 0.0
    socket_errors: dict[str, int] = field(default_factory=dict)
    statuses: Counter[int] = field(default_factory=Counter)
    by_port: Counter[str] = field(default_factory=Counter)
    overrun: int = 0
    replayed: int = 0
    pool: int = 0
    cache_hits: int = 0  # discovery answers with X-Cache: hit (bench/lua/discover.lua)
    cache_misses: int = 0
    latency_us: dict[str, int] = field(default_factory=dict)  # p50, p99, mean, max, ...
    stdout: str = ""

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    @property
    def non_2xx(self) -> int:
        return sum(n for status, n in self.statuses.items() if not 200 <= status < 300)

    def percentile_ms(self, p: float) -> float:
        value = self.latency_us.get(f"p{p:g}")
        return float("nan") if value is None else value / 1000.0

    def problems(self) -> list[str]:
        out = []
        if self.non_2xx:
            bad = {s: n for s, n in sorted(self.statuses.items()) if not 200 <= s < 300}
            out.append(f"non-2xx responses {bad}")
        errors = {k: v for k, v in self.socket_errors.items() if v}
        if errors:
            out.append(f"socket errors {errors}")
        if self.overrun:
            out.append(f"create pool exhausted: {self.overrun} requests were replays")
        elif self.replayed:
            out.append(f"{self.replayed} idempotent replays")
        if not self.requests:
            out.append("no request completed")
        return out


def parse_wrk_output(path: Path) -> WrkResult:
    result = WrkResult()
    for line in path.read_text().splitlines():
        parts = line.split()
        if not parts:
            continue
        tag = parts[0]
        if tag == "requests":
            result.requests = int(parts[1])
        elif tag == "duration_us":
            result.duration_s = int(parts[1]) / 1e6
        elif tag == "errors":
            names = ("connect", "read", "write", "status", "timeout")
            result.socket_errors = {n: int(v) for n, v in zip(names, parts[1:], strict=True)}
            result.socket_errors.pop("status")  # wrk's >399 count; we count every status
        elif tag == "status":
            _, _tid, port, status, count = parts
            result.statuses[int(status)] += int(count)
            result.by_port[port] += int(count)
        elif tag == "overrun":
            result.overrun += int(parts[2])
        elif tag == "replayed":
            result.replayed += int(parts[2])
        elif tag == "pool":
            result.pool += int(parts[2])
        elif tag == "cache":
            result.cache_hits += int(parts[2])
            result.cache_misses += int(parts[3])
        elif tag == "latency_us":
            result.latency_us[parts[1]] = int(parts[2])
    return result


@dataclass
class Load:
    ports: list[int]
    threads: int
    connections: int
    core: int | str | None  # wrk's core or cores ("12-15"), None: unpinned


def run_wrk(
    workdir: Path,
    name: str,
    load: Load,
    seconds: float,
    *,
    path: str | None = None,
    pool: Path | None = None,
    token: str | None = None,
) -> WrkResult:
    out = workdir / f"{name}.wrk"
    env = {
        **os.environ,
        "BENCH_MODE": "create" if pool else "static",
        "BENCH_PATH": path or "/",
        "BENCH_POOL": str(pool or ""),
        "BENCH_TOKEN": token or "",
        "BENCH_PORTS": ",".join(str(p) for p in load.ports),
        "BENCH_THREADS": str(load.threads),
        "BENCH_OUT": str(out),
    }
    cmd = [
        "wrk",
        "-t", str(load.threads),
        "-c", str(load.connections),
        "-d", f"{max(1, round(seconds))}s",
        "--timeout", "5s",
        "-s", str(LUA),
        f"http://127.0.0.1:{load.ports[0]}{path or '/v1/entries'}",
    ]  # fmt: skip
    done = subprocess.run(
        pinned(load.core, cmd),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=seconds + 180,
        check=False,
    )
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"wrk failed ({done.returncode}):\n{done.stdout.decode(errors='replace')}"
        )
    result = parse_wrk_output(out)
    result.stdout = done.stdout.decode(errors="replace")
    return result


# --- measurements --------------------------------------------------------------------------


@dataclass
class Measurement:
    setup: str  # "1 proc" | "2 procs"
    endpoint: str
    result: WrkResult
    warmup: WrkResult
    server_cpu_s: float
    postgres_cpu_s: float
    wrk_cpu_s: float
    machine_busy: float  # fraction of all cores busy during the measured run
    machine_busy_s: float  # the same in CPU seconds
    servers: int
    notes: list[str] = field(default_factory=list)
    label: str = ""  # shown instead of `endpoint` ("bare again")
    replica_cpu_s: float = math.nan  # a read replica's CPU (bench/scale.py)

    def us_per_request(self, cpu_s: float) -> float:
        return cpu_s / self.result.requests * 1e6 if self.result.requests else float("nan")

    @property
    def others_core_share(self) -> float:
        """CPU used by processes outside the bench (other work on the machine, the kernel's
        softirq time charged to nobody), as a share of one core."""
        ours = self.server_cpu_s + self.postgres_cpu_s + self.wrk_cpu_s
        return max(0.0, self.machine_busy_s - ours) / self.result.duration_s

    @property
    def server_core_share(self) -> float:
        """Average share of one core used by each server process."""
        return self.server_cpu_s / self.result.duration_s / self.servers


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path, db: str) -> None:
        self.args = args
        self.db = db
        self.workdir = workdir
        self.measurements: list[Measurement] = []
        self.pool_counter = 0
        self.created = 0  # 201 answers to create_entry (not replays), warm-ups included
        self.create_runs = 0
        self.seed = secrets.token_bytes(32)
        self.run_tag = secrets.token_hex(4)
        # The PostgreSQL processes whose CPU a row counts (bench/scale.py points it elsewhere).
        self.pg_pids: Callable[[], set[int]] = lambda: postgres_pids(args.postgres, self.db)
        # A read replica's processes, counted apart (bench/scale.py's replica rows).
        self.replica_pids: Callable[[], set[int]] | None = None

    def log(self, message: str) -> None:
        log(message)

    def profile_start(self, name: str, server: Server) -> subprocess.Popen[bytes] | None:
        if not self.args.profile:
            return None
        spy = shutil.which("py-spy") or str(VENV_BIN / "py-spy")
        out = (
            Path(self.args.profile)
            / f"{name}.{'txt' if self.args.profile_format == 'raw' else 'json'}"
        )
        cmd = [
            spy, "record", "--pid", str(server.pid), "--rate", "200",
            "--duration", str(round(self.args.duration)),
            "--format", self.args.profile_format, "-o", str(out),
        ]  # fmt: skip
        return subprocess.Popen(pinned(1, cmd), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def measure(
        self,
        setup: str,
        endpoint: str,
        servers: list[Server],
        load: Load,
        *,
        path: str | None = None,
        pool: Path | None = None,
        token: str | None = None,
        warmed: WrkResult | None = None,
        label: str = "",
    ) -> Measurement:
        args = self.args
        tag = f"{setup.replace(' ', '')}-{(label or endpoint).replace(' ', '-')}"
        warmup = warmed
        if warmup is None:
            self.log(f"{setup}: {endpoint}: warm-up {args.warmup:.0f}s")
            warmup = run_wrk(self.workdir, f"{tag}-warmup", load, args.warmup, path=path)
        self.log(f"{setup}: {endpoint}: measuring {args.duration:.0f}s")
        spy = self.profile_start(tag, servers[0]) if len(servers) == 1 else None
        everyone0 = all_processes() if args.verbose else {}
        server0 = sum(proc_cpu(s.pid) for s in servers)
        pg_before = self.pg_pids()
        pg0 = cpu_snapshot(pg_before)
        replica0 = cpu_snapshot(self.replica_pids()) if self.replica_pids else {}
        busy0, total0 = machine_busy()
        children0 = os.times()
        result = run_wrk(self.workdir, tag, load, args.duration, path=path, pool=pool, token=token)
        if pool is not None:
            self.created += result.statuses.get(201, 0) - result.replayed
            self.create_runs += 1
        children1 = os.times()
        busy1, total1 = machine_busy()
        pg1 = cpu_snapshot(pg_before | self.pg_pids())
        replica_cpu_s = math.nan
        if self.replica_pids:
            replica_cpu_s = cpu_delta(replica0, cpu_snapshot(set(replica0) | self.replica_pids()))
        server1 = sum(proc_cpu(s.pid) for s in servers)
        everyone1 = all_processes() if args.verbose else {}
        if spy is not None:
            spy.wait(60)
        m = Measurement(
            setup=setup,
            endpoint=endpoint,
            result=result,
            warmup=warmup,
            server_cpu_s=server1 - server0,
            postgres_cpu_s=cpu_delta(pg0, pg1),
            wrk_cpu_s=(children1.children_user + children1.children_system)
            - (children0.children_user + children0.children_system),
            machine_busy=(busy1 - busy0) / max(1, total1 - total0),
            machine_busy_s=(busy1 - busy0) / CLK_TCK,
            servers=len(servers),
            label=label,
            replica_cpu_s=replica_cpu_s,
        )
        if warmup.problems():
            m.notes.append("warm-up: " + "; ".join(warmup.problems()))
        self.measurements.append(m)
        if args.verbose:
            self.log(
                f"  CPU s: servers {m.server_cpu_s:.1f}, postgres {m.postgres_cpu_s:.1f},"
                f" wrk {m.wrk_cpu_s:.1f}, machine {m.machine_busy_s:.1f}"
                f" over {result.duration_s:.1f}s"
            )
            ours = {s.pid for s in servers} | pg1.keys()
            others = sorted(
                (
                    (cpu - everyone0.get(pid, (name, 0.0))[1], pid, name)
                    for pid, (name, cpu) in everyone1.items()
                    if pid not in ours
                ),
                reverse=True,
            )
            for cpu, pid, name in others[:3]:
                if cpu >= 0.2:
                    self.log(f"  other process {pid} used {cpu:.1f} CPU s: {name}")
        split = ""
        if len(result.by_port) > 1:
            split = " (" + ", ".join(f":{p} {n}" for p, n in sorted(result.by_port.items())) + ")"
        self.log(
            f"{setup}: {label or endpoint}: {result.rps:,.0f} req/s,"
            f" p50 {result.percentile_ms(50):.1f} ms,"
            f" p99 {result.percentile_ms(99):.1f} ms{split}"
            + ("" if not result.problems() else "  ERRORS: " + "; ".join(result.problems()))
        )
        return m

    def new_pool(self, name: str, count: int) -> Path:
        path = self.workdir / f"pool-{name}.txt"
        self.pool_counter += 1
        prefix = f"did:web:bench.example.com:{self.run_tag}:{self.pool_counter}:"
        seconds = write_pool(path, self.seed, prefix, count, workers=self.args.sign_workers)
        self.log(f"signed {count:,} create bodies for {name} in {seconds:.1f}s")
        return path

    def measure_create(
        self, setup: str, servers: list[Server], load: Load, token: str, ceiling_rps: float
    ) -> Measurement:
        """The warm-up doubles as the sizing run: its pool is sized from the bare ceiling
        (creates cannot beat it), the measured pool at 1.5x the warm-up rate; if a wrk thread
        still runs out, the row is measured once more with a bigger pool."""
        args = self.args
        slack = load.connections * 4
        tag = setup.replace(" ", "")
        warm_n = math.ceil(max(ceiling_rps, 500) * args.warmup * 1.3) + slack
        warm_pool = self.new_pool(f"{tag}-warmup", warm_n)
        self.log(f"{setup}: create_entry: warm-up {args.warmup:.0f}s (sizes the measured pool)")
        warmup = run_wrk(
            self.workdir, f"{tag}-create-warmup", load, args.warmup, pool=warm_pool, token=token
        )
        self.created += warmup.statuses.get(201, 0) - warmup.replayed
        self.create_runs += 1
        rate = max(warmup.rps, 50.0)
        factor = 1.5
        for attempt in range(2):
            pool = self.new_pool(
                f"{tag}-measured-{attempt}", math.ceil(rate * args.duration * factor) + slack
            )
            m = self.measure(
                setup, "create_entry", servers, load, pool=pool, token=token, warmed=warmup
            )
            if not m.result.overrun:
                return m
            self.measurements.pop()
            rate = max(rate, m.result.rps)
            factor = 2.5
            self.log("create pool ran out; signing a bigger one and measuring again")
        m.notes.append("create pool ran out twice: figure is not valid")
        self.measurements.append(m)
        return m


# --- reporting -----------------------------------------------------------------------------


def fmt(value: float, spec: str) -> str:
    return "-" if value != value else format(value, spec)  # NaN → "-"


@dataclass
class Ceiling:
    """The bare rows of one setup (measured before and after the registry rows)."""

    rows: list[Measurement]

    @property
    def rps(self) -> float:
        return sum(m.result.rps for m in self.rows) / len(self.rows)

    @property
    def us_per_request(self) -> float:
        requests = sum(m.result.requests for m in self.rows)
        return sum(m.server_cpu_s for m in self.rows) / requests * 1e6 if requests else math.nan

    @property
    def spread(self) -> float:
        """(max − min) / mean of the bare req/s."""
        values = [m.result.rps for m in self.rows]
        return (max(values) - min(values)) / self.rps if self.rps else 0.0


def report(bench: Bench, header: list[str], stored: int) -> bool:
    ms = bench.measurements
    ceilings: dict[str, Ceiling] = {}
    for m in ms:
        if m.endpoint == "bare":
            ceilings.setdefault(m.setup, Ceiling([])).rows.append(m)
    print()
    print("=" * 118)
    for line in header:
        print(line)
    print("-" * 118)
    cols = (
        f"{'setup':<8} {'endpoint':<13} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'requests':>9}"
        f" {'non-2xx':>7} {'sock err':>8} {'vs bare':>7} {'target':>7} {'srv core':>8}"
        f" {'srv µs/req':>10} {'pg µs/req':>9} {'others':>6}"
    )
    print(cols)
    print("-" * 118)
    clean = True
    for m in ms:
        r = m.result
        ceiling = ceilings.get(m.setup)
        ratio = math.nan
        if ceiling and ceiling.rps and m.endpoint != "bare":
            ratio = r.rps / ceiling.rps
        target = TARGETS.get(m.endpoint) if m.setup == "1 proc" else None
        mark = ""
        if target is not None and ratio == ratio:
            mark = f"≥{target:.2f}{'✓' if ratio >= target else '✗'}"
        sock = sum(r.socket_errors.values())
        print(
            f"{m.setup:<8} {m.label or m.endpoint:<13} {r.rps:>8,.0f}"
            f" {fmt(r.percentile_ms(50), '.1f'):>7}"
            f" {fmt(r.percentile_ms(99), '.1f'):>7} {r.requests:>9,} {r.non_2xx:>7} {sock:>8}"
            f" {fmt(ratio, '.2f'):>7} {mark:>7} {m.server_core_share:>7.0%} "
            f" {fmt(m.us_per_request(m.server_cpu_s), ',.0f'):>10}"
            f" {fmt(m.us_per_request(m.postgres_cpu_s), ',.0f'):>9} {m.others_core_share:>6.0%}"
        )
        if r.problems():
            clean = False
    print("-" * 118)
    print(
        "vs bare: req/s over the mean of the two bare rows of the same setup. srv core: share of"
        " one core used by\neach server process. srv µs/req, pg µs/req: CPU time per request of"
        " the server process(es) and of\nPostgreSQL (the bench database's backends + background"
        " processes). others: CPU used meanwhile by\nprocesses outside the bench, in cores"
        " (noise: anything above ~5% makes the row suspect)."
    )
    for setup, ceiling in ceilings.items():
        if len(ceiling.rows) > 1 and ceiling.spread > 0.15:
            print(
                f"WARNING: the two {setup} bare rows differ by {ceiling.spread:.0%}: the machine"
                " was not steady, the ratios are uncertain by as much"
            )
    one = ceilings.get("1 proc")
    if one:
        for endpoint, target in TARGETS.items():
            row = next((x for x in ms if x.setup == "1 proc" and x.endpoint == endpoint), None)
            if row is None or not one.rps:
                continue
            ratio = row.result.rps / one.rps
            verdict = "MET" if ratio >= target else "NOT MET"
            row_cpu = row.us_per_request(row.server_cpu_s)
            print(
                f"target (1 proc) {endpoint}/bare = {row.result.rps:,.0f}/{one.rps:,.0f}"
                f" = {ratio:.2f} (target ≥ {target:.2f}): {verdict};"
                f" by server CPU per request {one.us_per_request:,.0f}/{row_cpu:,.0f} µs"
                f" = {one.us_per_request / row_cpu:.2f}"
            )
    two = ceilings.get("2 procs")
    if two:
        for endpoint in TARGETS:
            row = next((x for x in ms if x.setup == "2 procs" and x.endpoint == endpoint), None)
            if row is None or not two.rps:
                continue
            single = next((x for x in ms if x.setup == "1 proc" and x.endpoint == endpoint), None)
            scale = (
                f", {row.result.rps / single.result.rps:.2f}x one process"
                if single and single.result.rps
                else ""
            )
            print(
                f"2 procs         {endpoint}/bare = {row.result.rps:,.0f}/{two.rps:,.0f}"
                f" = {row.result.rps / two.rps:.2f}{scale}"
            )
    # Every 201 is a stored entry; requests still in flight when a wrk run stops are stored
    # without an answer being counted (at most one per connection per create run).
    low = bench.created + 1  # + the entry that get_entry reads
    high = low + bench.create_runs * bench.args.connections
    ok = low <= stored <= high
    print(
        f"database check: {stored:,} entries stored; {low:,} answered 201 (+1 for get_entry),"
        f" ≤ {high - low} more may have been in flight when wrk stopped:"
        f" {'OK' if ok else 'MISMATCH'}"
    )
    clean = clean and ok
    problems = [(m, m.result.problems() + m.notes) for m in ms if m.result.problems() or m.notes]
    if problems:
        print()
        for m, items in problems:
            print(f"ERRORS/NOTES {m.setup} {m.endpoint}: " + "; ".join(items))
    if not clean:
        print("\nTHIS RUN HAD ERRORS: the figures of the runs listed above are not valid.")
    print("=" * 118)
    return clean


# --- the run -------------------------------------------------------------------------------


def git_revision() -> str:
    """The commit measured, and whether service files had uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(ROOT),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                "api",
                "registry",
                "actors",
                "ws",
                "migrations",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return head + (" + uncommitted changes to service files" if dirty else "")


def wrk_version() -> str:
    done = subprocess.run(["wrk", "--version"], capture_output=True, text=True, check=False)
    return (
        (done.stdout or done.stderr).splitlines()[0].split(" [")[0]
        if (done.stdout or done.stderr)
        else "wrk"
    )


def main_bench(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print(
            "bench/entries.py needs wrk (the load generator). Install it with:\n"
            "    apt-get update && apt-get install -y wrk",
            file=sys.stderr,
        )
        return 2
    registry_bin = VENV_BIN / "registry"
    if not registry_bin.exists():
        print(f"no {registry_bin}: run this with the project's venv python", file=sys.stderr)
        return 2
    cores = os.cpu_count() or 1
    if shutil.which("taskset") is None:
        print("warning: no taskset; processes are not pinned", file=sys.stderr)

    busy_before = idle_check()
    waited_until = time.monotonic() + args.wait_idle
    while busy_before > 0.1 and time.monotonic() < waited_until:
        log(f"machine {busy_before:.0%} busy (other processes); waiting for it to go idle")
        busy_before = idle_check(2.0)
    warning = "  WARNING: not idle, figures may be low" if busy_before > 0.1 else ""
    log(f"machine {busy_before:.0%} busy before start{warning}")

    workdir = Path(tempfile.mkdtemp(prefix="registry-bench-"))
    db = f"registry_bench_{secrets.token_hex(4)}"
    servers: list[Server] = []
    db_created = False
    clean = False
    try:
        bench = Bench(args, workdir, db)
        revision = git_revision()
        bench.log(f"service at commit {revision}; database {db}, work dir {workdir}")
        db_admin(args.postgres, f'CREATE DATABASE "{db}"')
        db_created = True
        env = {**os.environ, **SERVICE_ENV}
        data_dir = workdir / "data"
        url = f"{args.postgres}/{db}"

        def registry(name: str, core: int | None) -> Server:
            port = free_port()
            cmd = [
                str(registry_bin), "serve", "--host", "127.0.0.1", "--port", str(port),
                "--data-dir", str(data_dir), "--database-url", url,
            ]  # fmt: skip
            server = start_server(name, cmd, port, core, workdir, env)
            servers.append(server)
            wait_ready(server, "/v1/health", 60, want=lambda b: b.get("status") == "ok")
            return server

        def bare(name: str, core: int | None) -> Server:
            port = free_port()
            cmd = [sys.executable, str(Path(__file__).resolve()), "--bare-server", str(port)]
            server = start_server(name, cmd, port, core, workdir, dict(os.environ))
            servers.append(server)
            wait_ready(server, "/bare", 30)
            return server

        two = cores >= 2 and not args.single_only
        bench.log("starting the bare app and registry serve")
        bare_a = bare("bare-a", 0)
        reg_a = registry("registry-a", 0)
        bare_b = bare("bare-b", 1) if two else None
        reg_b = registry("registry-b", 1) if two else None

        from cli.client import RegistryClient
        from registry.keys import SigningKey

        key = SigningKey(bench.seed)
        with RegistryClient(f"http://127.0.0.1:{reg_a.port}") as client:
            client.sign_in(key)
            token = client.token
            read_did = f"did:web:bench.example.com:{bench.run_tag}:read"
            client.publish(entry_for(read_did), key)
            doc = client.get(read_did)
        assert token
        size = len(json.dumps(doc, separators=(",", ":")).encode())
        bench.log(f"signed in as {key.did[:32]}…; the get_entry document is {size} bytes")

        conns = args.connections
        single = Load([bare_a.port], 1, conns, 1 if cores >= 2 else None)
        bench.measure("1 proc", "bare", [bare_a], single, path="/bare")
        ceiling = bench.measurements[-1].result.rps
        single = Load([reg_a.port], 1, conns, 1 if cores >= 2 else None)
        bench.measure("1 proc", "get_entry", [reg_a], single, path=f"/v1/entries/{read_did}")
        bench.measure_create("1 proc", [reg_a], single, token, ceiling)
        # The ceiling once more: on this small shared machine one 10 s window can be off by 20%.
        single = Load([bare_a.port], 1, conns, 1 if cores >= 2 else None)
        bench.measure("1 proc", "bare", [bare_a], single, path="/bare", label="bare again")

        if two:
            assert bare_b is not None
            assert reg_b is not None
            dual = Load([bare_a.port, bare_b.port], 2, conns, None)
            bench.measure("2 procs", "bare", [bare_a, bare_b], dual, path="/bare")
            ceiling = bench.measurements[-1].result.rps
            dual = Load([reg_a.port, reg_b.port], 2, conns, None)
            bench.measure(
                "2 procs", "get_entry", [reg_a, reg_b], dual, path=f"/v1/entries/{read_did}"
            )
            bench.measure_create("2 procs", [reg_a, reg_b], dual, token, ceiling)
            dual = Load([bare_a.port, bare_b.port], 2, conns, None)
            bench.measure(
                "2 procs", "bare", [bare_a, bare_b], dual, path="/bare", label="bare again"
            )

        header = [
            f"service: commit {revision}",
            f"load generator: {wrk_version()} with bench/lua/entries.lua; {conns} connections;"
            f" {args.warmup:.0f}s warm-up + {args.duration:.0f}s measured per row",
            f"machine: {cores} cores, {busy_before:.0%} busy before start; PostgreSQL"
            " 127.0.0.1:5432 (shared, never pinned), a fresh database",
            "1 proc : the server (bare app or one `registry serve`) pinned to core 0 (taskset),"
            " wrk -t1 pinned to core 1",
            "2 procs: two servers on one database pinned to cores 0 and 1, one wrk -t2 unpinned"
            f" ({conns // 2} connections per server); req/s summed",
            "bare   : Quart-Trio on Hypercorn (trio worker, in-process hypercorn.trio.serve,"
            " the service's Hypercorn settings), fixed 2048-byte JSON",
            "get_entry   : GET /v1/entries/<did>, one published entry, no If-None-Match"
            " (a full 200 each time)",
            "create_entry: POST /v1/entries, a distinct pre-signed ~1.9 KB entry and"
            " Idempotency-Key per request, Bearer session",
            "p50/p99: wrk's latency distribution over every response (one histogram over both"
            " servers for 2 procs)",
        ]
        if args.profile:
            header.append(
                f"PROFILED with py-spy (200 Hz) into {args.profile}:"
                " the 1-proc figures are perturbed"
            )
        clean = report(bench, header, count_entries(args.postgres, db))
        return 0 if clean else 1
    finally:
        for server in reversed(servers):
            try:
                stop_server(server)
            except Exception as exc:  # keep cleaning up
                print(f"stopping {server.name}: {exc!r}", file=sys.stderr)
            if server.popen.returncode not in (0, -signal.SIGTERM) or not clean:
                tail = server.log_tail(15)
                if tail.strip():
                    print(
                        f"--- {server.name} log (exit {server.popen.returncode}) ---\n{tail}",
                        file=sys.stderr,
                    )
        if db_created and not args.keep_db:
            try:
                db_admin(args.postgres, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
            except Exception as exc:
                print(f"could not drop database {db}: {exc!r}", file=sys.stderr)
        if args.keep_workdir:
            print(f"work dir kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bare-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument(
        "--duration", type=float, default=10.0, help="measured seconds per row (10)"
    )
    parser.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per row (3)")
    parser.add_argument("--connections", type=int, default=64, help="concurrent connections (64)")
    parser.add_argument("--single-only", action="store_true", help="skip the two-process rows")
    parser.add_argument(
        "--postgres",
        default=os.environ.get("BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432"),
        help="PostgreSQL server URL without a database (a fresh database is created and dropped)",
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=30.0,
        metavar="S",
        help="wait up to S seconds for the machine to be <10%% busy before starting (30)",
    )
    parser.add_argument("--sign-workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--profile", metavar="DIR", help="py-spy record the one-process runs into DIR"
    )
    parser.add_argument(
        "--profile-format", choices=("raw", "speedscope", "flamegraph"), default="speedscope"
    )
    parser.add_argument("--verbose", action="store_true", help="log CPU accounting per row")
    parser.add_argument("--keep-db", action="store_true", help="do not drop the bench database")
    parser.add_argument(
        "--keep-workdir", action="store_true", help="keep logs, pools and wrk output"
    )
    args = parser.parse_args()
    if args.bare_server is not None:
        run_bare_server(args.bare_server)
        return 0
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    return main_bench(args)


if __name__ == "__main__":
    sys.exit(main())
