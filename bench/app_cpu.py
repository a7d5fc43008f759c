#!/usr/bin/env python3
"""What the application costs per request, without the network: get_entry and create_entry
against the bare Quart-Trio app, in one process each, through the ASGI callable.

bench/entries.py and bench/scale.py measure whole servers with wrk; on a small shared machine
their rows move by ±25 % from one run to the next (another tenant, the load generator on the
same cores), which hides a change of a few percent in the app. This bench leaves out what the
registry shares with the bare app below the application (Hypercorn, the socket, the kernel) and
drives each app's ASGI callable in-process, one request after another (get_entry, bare) or 48
at a time (create_entry: the writer batches them as it does under load), with the registry
wired as `registry serve` wires it (service/wiring.py) over a fresh database of --postgres.

It counts, per request:
  * with --callgrind (the default where valgrind is installed): the instructions the process
    executed, under `valgrind --tool=callgrind` with collection on only around the measured
    requests. Repeatable to ~1 % on a busy machine (get_entry: three runs within 1.3 %), so a
    change of 2 % shows; create_entry moves by ~2 % (the batches the writer forms vary).
  * without it (--cpu): the process's CPU time (`time.process_time`), as noisy as the machine.

    .venv/bin/python bench/app_cpu.py                 # ~1 minute: instructions per request
    .venv/bin/python bench/app_cpu.py --cpu --requests 10000

What the figure leaves out: Hypercorn and the socket (~60 % of a bare request over loopback),
PostgreSQL's own CPU (bench/append_cpu.py), and background work not done per request. The
ratio "vs bare" is bare's cost over the row's: the share of one process's throughput that the
registry keeps at the application layer.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench import entries as be  # noqa: E402

ROWS = ("bare", "get_entry", "create_entry")
CONCURRENT_CREATES = 48

ASGI = Callable[[Any, Any, Any], Awaitable[None]]


def _scope(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1:8000"), (b"user-agent", b"app_cpu"), *headers],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "extensions": {},
    }


async def _call(app: ASGI, scope: dict[str, Any], body: bytes = b"") -> int:
    """One request through `app`; its status. The request's body comes in one message; the
    client never disconnects (Quart-Trio ends the exchange once the response is sent)."""
    import trio

    given = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal given
        if given:
            await trio.sleep_forever()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


class Meter:
    """Around the measured requests: callgrind's collection, or the process's CPU time."""

    def __init__(self, callgrind: bool) -> None:
        self.callgrind = callgrind
        self.cpu_s = 0.0

    def __enter__(self) -> Meter:
        if self.callgrind:
            subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True,
                           capture_output=True)  # fmt: skip
        self.cpu_s = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu_s = time.process_time() - self.cpu_s
        if self.callgrind:
            subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], check=True,
                           capture_output=True)  # fmt: skip


def _settle_collector() -> None:
    """The collector as `registry serve` leaves it after start (service/serve.py)."""
    import gc

    from service.serve import GC_THRESHOLD

    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


async def run_bare(requests: int, callgrind: bool) -> float:
    from quart import Response
    from quart_trio import QuartTrio

    body = be.bare_document()
    app = QuartTrio("bare")

    @app.get("/bare")
    async def bare() -> Response:
        return Response(body, status=200, content_type="application/json")

    async with app.test_app():
        _settle_collector()
        return await _gets(app, _scope("GET", "/bare", []), requests, callgrind)


async def _gets(app: ASGI, scope: dict[str, Any], requests: int, callgrind: bool) -> float:
    """`requests` GETs of `scope` one after another, after 500 unmeasured: their CPU seconds."""
    for _ in range(500):
        assert await _call(app, dict(scope)) == 200
    with Meter(callgrind) as meter:
        for _ in range(requests):
            await _call(app, dict(scope))
    return meter.cpu_s


async def run_registry(row: str, url: str, requests: int, callgrind: bool) -> float:
    import trio
    import trio_asyncio

    from registry.config import load_config
    from registry.entries import sign_entry
    from registry.identity import DidKeyIdentity
    from registry.keys import SigningKey
    from registry.store.pg import open_pg_store
    from service.wiring import open_service
    from tests.helpers import sign_in

    workdir = Path(tempfile.mkdtemp(prefix="registry-app-cpu-"))
    config = load_config(
        None,
        environ={},
        overrides={
            "server": {"data_dir": str(workdir), "public_origin": "http://bench.test"},
            "database": {"url": url},
            "anchoring": {"enabled": False},
            # The bench is one client: its budgets must not be what is measured.
            "limits": {
                "read_per_minute": 10_000_000,
                "write_per_minute": 10_000_000,
                "write_per_minute_per_address": 10_000_000,
                "body_bytes_per_minute_per_address": 100_000_000_000,
            },
        },
    )
    key = SigningKey.generate()
    prefix = f"did:web:bench.example.com:app-cpu-{secrets.token_hex(3)}:"

    def body(i: int) -> bytes:
        signed = sign_entry(be.entry_for(f"{prefix}{i}"), key)
        return json.dumps(signed, separators=(",", ":"), ensure_ascii=False).encode()

    try:
        async with (
            trio_asyncio.open_loop(),
            open_pg_store(url) as store,
            open_service(config, store, key=SigningKey.generate(), identity=DidKeyIdentity())
            as service,
            service.app.test_app() as test_app,
        ):  # fmt: skip
            app = service.app
            token = await sign_in(test_app.test_client(), key)
            auth = [(b"authorization", f"Bearer {token}".encode())]

            def post(payload: bytes) -> tuple[dict[str, Any], bytes]:
                headers = [
                    *auth,
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"idempotency-key", secrets.token_hex(12).encode()),
                ]
                return _scope("POST", "/v1/entries", headers), payload

            first = post(body(-1))
            assert await _call(app, *first) == 201
            _settle_collector()
            if row == "get_entry":
                scope = _scope("GET", f"/v1/entries/{prefix}-1", [])
                return await _gets(app, scope, requests, callgrind)

            async def creates(posts: list[tuple[dict[str, Any], bytes]]) -> None:
                todo = iter(posts)
                refused: list[int] = []

                async def client() -> None:
                    for scope, payload in todo:
                        status = await _call(app, scope, payload)
                        if status != 201:
                            refused.append(status)

                async with trio.open_nursery() as nursery:
                    for _ in range(CONCURRENT_CREATES):
                        nursery.start_soon(client)
                if refused:
                    raise SystemExit(f"create_entry answered {refused[:5]}")

            warm = [post(body(i)) for i in range(300)]
            measured = [post(body(i)) for i in range(300, 300 + requests)]
            await creates(warm)
            with Meter(callgrind) as meter:
                await creates(measured)
            return meter.cpu_s
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def one_row(row: str, args: argparse.Namespace) -> float:
    """Run `row` in this process; the CPU seconds of its measured requests."""
    import asyncio

    import trio

    if row == "bare":
        return float(trio.run(run_bare, args.requests, args.callgrind))
    from registry.store.migrate import _migrate, load_migrations

    db = f"registry_app_cpu_{secrets.token_hex(4)}"
    be.db_admin(args.postgres, f'CREATE DATABASE "{db}"')
    url = f"{args.postgres}/{db}"
    try:
        asyncio.run(_migrate(url, load_migrations()))
        return float(trio.run(run_registry, row, url, args.requests, args.callgrind))
    finally:
        be.db_admin(args.postgres, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def measure(row: str, args: argparse.Namespace) -> float:
    """Instructions (callgrind) or CPU µs per request of `row`, from a child process."""
    with tempfile.TemporaryDirectory(prefix="registry-app-cpu-") as tmp:
        out = Path(tmp) / "callgrind.out"
        command = [sys.executable, __file__, "--row", row, "--requests", str(args.requests),
                   "--postgres", args.postgres]  # fmt: skip
        if args.callgrind:
            command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                       f"--callgrind-out-file={out}", *command, "--callgrind"]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{row} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        requests: int = args.requests
        if args.callgrind:
            totals = [line for line in out.read_text().splitlines() if line.startswith("totals:")]
            return int(totals[-1].split()[1]) / requests
        return float(done.stdout.strip().splitlines()[-1]) * 1e6 / requests


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, help="measured requests per row (callgrind:"
                        " 300, else 5,000)")  # fmt: skip
    parser.add_argument("--rows", default=",".join(ROWS), help="of " + ", ".join(ROWS))
    unit = parser.add_mutually_exclusive_group()
    unit.add_argument("--callgrind", action="store_true", default=None,
                      help="instructions per request (default where valgrind is)")  # fmt: skip
    unit.add_argument("--cpu", dest="callgrind", action="store_false",
                      help="CPU time per request")  # fmt: skip
    parser.add_argument(
        "--postgres",
        default=os.environ.get("BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432"),
    )
    parser.add_argument("--row", help=argparse.SUPPRESS)  # the child process's one row
    args = parser.parse_args()
    if args.row:
        print(one_row(args.row, args))
        return 0
    if args.callgrind is None:
        args.callgrind = shutil.which("valgrind") is not None
    if args.callgrind and shutil.which("valgrind") is None:
        print("--callgrind needs valgrind: apt-get install -y valgrind", file=sys.stderr)
        return 2
    if args.requests is None:
        args.requests = 300 if args.callgrind else 5_000
    rows = [r for r in args.rows.split(",") if r]
    unknown = set(rows) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows: {', '.join(sorted(unknown))}")
    unit_name = "instructions/req" if args.callgrind else "CPU µs/req"
    print(f"service: commit {be.git_revision()}; {args.requests:,} requests per row;"
          f" {unit_name} in-process (no network)")  # fmt: skip
    costs: dict[str, float] = {}
    for row in rows:
        costs[row] = measure(row, args)
        bare = costs.get("bare")
        ratio = f"{bare / costs[row]:.3f}" if bare else "-"
        shown = f"{costs[row]:,.0f}" if args.callgrind else f"{costs[row]:,.1f}"
        print(f"{row:14} {shown:>14} {unit_name}   vs bare {ratio}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
