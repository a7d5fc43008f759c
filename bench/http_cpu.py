#!/usr/bin/env python3
"""What a server process executes per request over HTTP: bare, get_entry and create_entry,
each server under `valgrind --tool=callgrind`, driven over loopback by a client outside it.

bench/app_cpu.py counts the application alone (its ASGI callable, in-process). This one counts
everything one server process executes for a request, as `registry serve` runs: Hypercorn, h11,
the connection hook (ws/transport.py), the app, the writer, asyncpg and the actors' background
work. Instruction counts do not move with the machine's load, so two commits can be told apart
by a few percent where the network benches (entries.py, scale.py) move by ±25 %.

Each row starts its own server process under callgrind with collection off, waits until it is
ready, signs in and publishes one entry (registry rows), sends 300 unmeasured requests, then
counts the instructions of --requests more, sent over --connections keep-alive connections by
threads of this process (not under valgrind). The registry runs with bench/entries.py's
settings (budgets out of the way, anchoring and the checkpointer on, as by default) on a fresh
database of --postgres; the bare app is bench/entries.py's.

    apt-get install -y valgrind
    .venv/bin/python bench/http_cpu.py                     # ~2 minutes
    .venv/bin/python bench/http_cpu.py --rows create_entry --requests 2000

What to keep in mind: under valgrind the server runs ~50 times slower, so work on a timer (the
checkpointer each second, the anchoring block interval) comes ~50 times less often per request
than at full speed: its fixed cost per tick weighs more per request, its cost per record the
same. Writer batches are larger than at full speed (more requests wait while one is applied).
PostgreSQL's CPU is not counted (scale.py and append_cpu.py measure it).
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
import uuid
from collections.abc import Callable
from pathlib import Path

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


def measure(row: str, args: argparse.Namespace, workdir: Path) -> float:
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
            drive(port, warm, args.connections)
            toggle = ["callgrind_control", "-i"]
            subprocess.run([*toggle, "on", str(server.pid)], check=True, capture_output=True)
            drive(port, measured, args.connections)
            subprocess.run([*toggle, "off", str(server.pid)], check=True, capture_output=True)
        finally:
            be.stop_server(server, timeout=600)  # callgrind writes its counts at exit
    finally:
        if database is not None:
            be.db_admin(args.postgres, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    totals = [line for line in out.read_text().splitlines() if line.startswith("totals:")]
    requests: int = args.requests
    return sum(int(line.split()[1]) for line in totals) / requests


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
    costs: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="registry-http-cpu-") as tmp:
        for row in rows:
            costs[row] = measure(row, args, Path(tmp))
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(Path(tmp) / f"callgrind.{row}", args.keep / f"callgrind.{row}")
            bare = costs.get("bare")
            ratio = f"{bare / costs[row]:.3f}" if bare else "-"
            print(f"{row:14} {costs[row]:>14,.0f} instructions/req   vs bare {ratio}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
