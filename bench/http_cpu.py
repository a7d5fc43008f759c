#!/usr/bin/env python3
"""What a server process executes per request over HTTP: bare, get_entry and create_entry,
each server under `valgrind --tool=callgrind`, driven over loopback by a client outside it.

bench/app_cpu.py counts the application alone (its ASGI callable, in-process). This one counts
everything one server process executes for a request, as `registry serve` runs: Hypercorn, h11,
the connection hook (ws/transport.py), the app, the writer, asyncpg and the actors' background
work. Instruction counts do not move with the machine's load, so two commits can be told apart
by a few percent where the network benches (entries.py, scale.py) move by ±25 %.

Each row starts its own server process under callgrind with collection off, waits until it is
ready, signs in and publishes one entry (registry rows), counts --idle seconds with no request
(the timer work: the checkpointer's tick, the anchoring leader's polls, leases), sends 300
unmeasured requests, then counts the instructions of --requests more, sent over --connections
keep-alive connections by threads of this process (not under valgrind). The registry runs with
bench/entries.py's settings (budgets out of the way, anchoring and the checkpointer on, as by
default) on a fresh database of --postgres; the bare app is bench/entries.py's.

    apt-get install -y valgrind
    .venv/bin/python bench/http_cpu.py                     # ~5 minutes
    .venv/bin/python bench/http_cpu.py --rows create_entry --requests 2000

Columns: instr/req, as counted; timer/s, the idle window's instructions per second; seconds, how
long the measured requests took under valgrind; net/req, instr/req less timer/s × seconds per
request; vs bare and raw vs bare, bare's net (raw) over the row's.

Why net: under valgrind the server runs ~50 times slower, so the work on a wall-clock timer comes
~50 times as often per request as at full speed. An idle registry runs ~5-7 million instructions
a second of it (bare: ~0.2 million), which at valgrind's pace adds ~200,000 to a GET and ~450,000
to a create, and at full speed a few thousand. Net assumes that work goes on at the idle rate
while requests are served; what requests leave behind (anchoring their versions, hashing them
into checkpoints) stays in both figures. Writer batches are also larger than at full speed (more
requests wait while one is applied). PostgreSQL's CPU is not counted (scale.py and
append_cpu.py measure it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bench import entries as be  # noqa: E402

ROWS = ("bare", "get_entry", "create_entry")
WARMUP = 300

Request = tuple[str, str, bytes | None, dict[str, str]]


def drive(port: int, requests: list[Request], connections: int) -> None:
    """Send `requests` over `connections` keep-alive connections; every answer must be 2xx."""
    todo = iter(requests)
    lock = threading.Lock()
    refused: list[int] = []

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            while True:
                with lock:
                    request = next(todo, None)
                if request is None:
                    return
                method, path, body, headers = request
                conn.request(method, path, body=body, headers=headers)
                response = conn.getresponse()
                response.read()
                if not 200 <= response.status < 300:
                    refused.append(response.status)
        finally:
            conn.close()

    threads = [threading.Thread(target=client) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if refused:
        raise SystemExit(f"{len(refused)} requests were refused: {refused[:5]}")


def _status_ok(health: dict[str, object]) -> bool:
    return health.get("status") == "ok"


def bare_requests(n: int) -> list[Request]:
    return [("GET", "/bare", None, {})] * n


def _anchored(anchors: dict[str, Any]) -> bool:
    records = anchors.get("records", [])
    return bool(records) and all(r.get("state") == "confirmed" for r in records)


def registry_requests(port: int, row: str) -> Callable[[int], list[Request]]:
    """Sign in, publish the entry get_entry reads; what makes `n` requests of `row`."""
    from cli.client import RegistryClient
    from registry.entries import sign_entry
    from registry.keys import SigningKey

    key = SigningKey.generate()
    tag = secrets.token_hex(3)
    read_did = f"did:web:bench.example.com:http-cpu-{tag}:read"
    with RegistryClient(f"http://127.0.0.1:{port}") as client:
        client.sign_in(key)
        token = client.token
        client.publish(be.entry_for(read_did), key)
        # Its anchoring (a claim, a submission, block polls until final) is over before the
        # idle window, which counts the timer work alone.
        deadline = time.monotonic() + 600
        while not _anchored(client.anchors(read_did)):
            if time.monotonic() > deadline:
                raise SystemExit(f"{read_did} was not anchored within 600 s")
            time.sleep(0.5)
    if row == "get_entry":
        return lambda n: [("GET", f"/v1/entries/{read_did}", None, {})] * n
    numbers = iter(range(10**9))

    def creates(n: int) -> list[Request]:
        out: list[Request] = []
        for i in (next(numbers) for _ in range(n)):
            signed = sign_entry(be.entry_for(f"did:web:bench.example.com:http-cpu-{tag}:{i}"), key)
            body = json.dumps(signed, separators=(",", ":"), ensure_ascii=False).encode()
            headers = {
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/json",
                "Idempotency-Key": str(uuid.uuid4()),
            }
            out.append(("POST", "/v1/entries", body, headers))
        return out

    return creates


def measure(row: str, args: argparse.Namespace, workdir: Path) -> Cost:
    """Instructions per request of `row`, from its own server under callgrind."""
    port = be.free_port()
    out = workdir / f"callgrind.{row}"
    env = dict(os.environ)
    database = None
    if row == "bare":
        command = [sys.executable, str(HERE / "entries.py"), "--bare-server", str(port)]
        ready = "/bare"
    else:
        database = f"registry_http_cpu_{secrets.token_hex(4)}"
        be.db_admin(args.postgres, f'CREATE DATABASE "{database}"')
        env.update(be.SERVICE_ENV)
        command = [
            str(Path(sys.executable).parent / "registry"), "serve", "--host", "127.0.0.1",
            "--port", str(port), "--data-dir", str(workdir / f"data-{row}"),
            "--database-url", f"{args.postgres}/{database}",
        ]  # fmt: skip
        ready = "/v1/health"
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                f"--callgrind-out-file={out}"]  # fmt: skip
    try:
        server = be.start_server(row, valgrind + command, port, None, workdir, env)
        try:
            # Imports under valgrind take a while; the registry is ready once its caches are.
            be.wait_ready(server, ready, 600, want=None if row == "bare" else _status_ok)
            make = bare_requests if row == "bare" else registry_requests(port, row)
            warm, measured = make(WARMUP), make(args.requests)
            pid = str(server.pid)

            def control(*options: str) -> None:
                subprocess.run(["callgrind_control", *options, pid], check=True,
                               capture_output=True)  # fmt: skip

            # Before any warm-up request: once requests have come, the work they leave behind
            # (anchoring their versions, hashing them into checkpoints) would be counted as
            # timer work. The registry row has published one entry (its anchoring is part of
            # the timer work then: a claim, a submit and a few block polls).
            control("-i", "on")
            time.sleep(args.idle)  # no requests: the work on timers alone
            control("-d")  # the idle window's counts, in a file of their own; counters zeroed
            control("-i", "off")
            drive(port, warm, args.connections)
            control("-i", "on")
            started = time.monotonic()
            drive(port, measured, args.connections)
            seconds = time.monotonic() - started
            control("-i", "off")
        finally:
            be.stop_server(server, timeout=600)  # callgrind writes its counts at exit
    finally:
        if database is not None:
            be.db_admin(args.postgres, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    idle, busy = (_totals(path) for path in _dumps(out))
    return Cost(busy / args.requests, idle / args.idle, seconds, args.requests)


def _dumps(out: Path) -> tuple[Path, Path]:
    """The idle dump (`callgrind_control -d`) and the one written at exit, in that order."""
    files = sorted(out.parent.glob(out.name + ".*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
    if out.exists():
        files.append(out)
    if len(files) != 2:
        raise SystemExit(f"expected two callgrind dumps, found {[f.name for f in files]}")
    return files[0], files[1]


def _totals(path: Path) -> int:
    lines = path.read_text().splitlines()
    return sum(int(line.split()[1]) for line in lines if line.startswith("totals:"))


@dataclass(frozen=True)
class Cost:
    raw: float  # instructions per request, as counted
    timer_per_s: float  # instructions per second with no requests (the idle window)
    seconds: float  # how long the measured requests took under valgrind
    requests: int

    @property
    def net(self) -> float:
        """Per request, less the timer work of the measured window: what a request costs at
        full speed, where that work is spread over ~50 times as many requests."""
        return self.raw - self.timer_per_s * self.seconds / self.requests


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000, help="measured requests per row")
    parser.add_argument("--connections", type=int, default=16, help="keep-alive connections")
    parser.add_argument("--rows", default=",".join(ROWS), help="of " + ", ".join(ROWS))
    parser.add_argument(
        "--postgres",
        default=os.environ.get("BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432"),
    )
    parser.add_argument(
        "--idle", type=float, default=10.0,
        help="seconds counted with no requests first: the timer work per second",
    )  # fmt: skip
    parser.add_argument(
        "--keep", type=Path, help="copy each row's callgrind file here (for callgrind_annotate)"
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("needs valgrind: apt-get install -y valgrind", file=sys.stderr)
        return 2
    rows = [r for r in args.rows.split(",") if r]
    unknown = set(rows) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows: {', '.join(sorted(unknown))}")
    print(f"service: commit {be.git_revision()}; {args.requests:,} requests per row over"
          f" {args.connections} connections; server instructions/req (callgrind)")  # fmt: skip
    print(f"{'row':14} {'instr/req':>12} {'timer/s':>12} {'seconds':>8} {'net/req':>12}"
          f" {'vs bare':>8} {'raw vs bare':>11}")  # fmt: skip
    costs: dict[str, Cost] = {}
    with tempfile.TemporaryDirectory(prefix="registry-http-cpu-") as tmp:
        for row in rows:
            cost = costs[row] = measure(row, args, Path(tmp))
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                for dump in _dumps(Path(tmp) / f"callgrind.{row}"):
                    shutil.copy(dump, args.keep / dump.name)
            bare = costs.get("bare")
            net = f"{bare.net / cost.net:.3f}" if bare else "-"
            raw = f"{bare.raw / cost.raw:.3f}" if bare else "-"
            print(f"{row:14} {cost.raw:>12,.0f} {cost.timer_per_s:>12,.0f} {cost.seconds:>8.1f}"
                  f" {cost.net:>12,.0f} {net:>8} {raw:>11}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
