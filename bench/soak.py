#!/usr/bin/env python3
"""A soak: steady mixed load on one `registry serve` for a long while, watching what grows.

Issue 17's targets, for 30 minutes: RSS after the first 5 minutes grows < 5 %, and the p99 of
each operation stays within 1.5x of the first minute's.

One run, on a fresh database `registry_bench_soak_<hex>` of the local PostgreSQL server:
  * starts one `registry serve` (rate limits raised, anchoring on with its local chain);
  * a load process (threads, raw HTTP/1.1 on keep-alive connections) that, open-loop, creates
    `--writes` entries a second, updates one of them `--updates` a second, reads `--reads`
    entries a second and runs `--discovers` discovery queries a second, and holds
    `--subscribers` WebSocket subscribers reading every event;
  * every `--every` seconds (10): the server's RSS, open files, CPU per request, and the p50 /
    p99 of each operation over the interval, printed as a row and kept;
  * at the end: a table by minute, the targets, and a plot (PNG, needs matplotlib:
    `pip install -e '.[bench]'`) of RSS, open files and the p99s over time.

    .venv/bin/python bench/soak.py --minutes 30          # the issue's run
    .venv/bin/python bench/soak.py --minutes 3 --plot /tmp/soak.png

All traffic goes to 127.0.0.1; the load is bounded by the run's length.
Exit status: 0 when the targets were met, 1 otherwise, 2 when a prerequisite is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
import random
import secrets
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.entries import (  # noqa: E402
    SERVICE_ENV,
    db_admin,
    free_port,
    proc_cpu,
    start_server,
    stop_server,
    wait_ready,
)
from bench.hostile import frame, open_files, rss_mib, ws_open  # noqa: E402

OPS = ("create", "update", "get", "discover")


# --- the load (its own process) -------------------------------------------------------------------


@dataclass
class Recorder:
    lock: threading.Lock = field(default_factory=threading.Lock)
    latencies: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    errors: dict[str, int] = field(default_factory=dict)
    events: int = 0

    def took(self, op: str, started: float, status: int, ok: int) -> None:
        elapsed = (time.perf_counter() - started) * 1000
        with self.lock:
            if status == ok:
                self.latencies[op].append(elapsed)
            else:
                key = f"{op} {status}"
                self.errors[key] = self.errors.get(key, 0) + 1

    def drain(self) -> dict[str, Any]:
        with self.lock:
            out = {
                "latencies": self.latencies,
                "errors": self.errors,
                "events": self.events,
            }
            self.latencies = {op: [] for op in OPS}
            self.errors = {}
            self.events = 0
        return out


def entry_doc(key: Any, did: str, version: str, n: int) -> dict[str, Any]:
    from registry.entries import sign_entry

    return sign_entry(
        {
            "entryDid": did,
            "entryType": "AgentDefinition",
            "itemData": {"model": "m", "instructions": f"revision {n}"},
            "itemSchemaUri": "https://schemas.example.com/agent/v1",
            "registryVersion": "1.0",
            "name": f"soak agent {n % 50}",
            "publishedAt": "2026-11-26T00:00:00Z",
            "version": version,
            "tags": ["soak", f"t{n % 20}"],
        },
        key,
    )


def paced(rate: float, stop: threading.Event, action: Any) -> None:
    """`action()` `rate` times a second (open loop: a late call does not shift the next)."""
    if rate <= 0:
        return
    interval, due = 1.0 / rate, time.monotonic()
    while not stop.is_set():
        due += interval
        action()
        delay = due - time.monotonic()
        if delay > 0:
            stop.wait(delay)
        elif delay < -1:  # far behind: do not try to catch up in a burst
            due = time.monotonic()


def run_load(port: int, args: argparse.Namespace, out: Any, stop_at: float) -> None:
    from cli.client import RegistryClient
    from registry.keys import SigningKey

    key = SigningKey.generate()
    with RegistryClient(f"http://127.0.0.1:{port}") as client:
        client.sign_in(key)
        token = client.token
    auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    rec = Recorder()
    stop = threading.Event()
    dids: list[tuple[str, int, int]] = []  # (did, sequence, revision)
    dids_lock = threading.Lock()
    counter = iter(range(1, 1 << 40))

    def conn() -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    local = threading.local()

    def request(method: str, path: str, body: Any = None, headers: Any = None) -> tuple[int, Any]:
        if getattr(local, "conn", None) is None:
            local.conn = conn()
        try:
            local.conn.request(
                method, path, body=json.dumps(body) if body is not None else None,
                headers=headers or {},
            )  # fmt: skip
            response = local.conn.getresponse()
            data = response.read()
            return response.status, data
        except (OSError, http.client.HTTPException):
            local.conn.close()
            local.conn = None
            return 599, b""

    def create() -> None:
        n = next(counter)
        did = f"did:web:soak.example:{secrets.token_hex(6)}"
        started = time.perf_counter()
        status, data = request(
            "POST", "/v1/entries", entry_doc(key, did, "1.0.0", n),
            {**auth, "Idempotency-Key": secrets.token_hex(8)},
        )  # fmt: skip
        rec.took("create", started, status, 201)
        if status == 201:
            with dids_lock:
                dids.append((did, json.loads(data)["sequence"], 0))

    def update() -> None:
        with dids_lock:
            if not dids:
                return
            index = random.randrange(len(dids))
            did, seq, revision = dids[index]
        doc = entry_doc(key, did, f"1.{revision + 1}.0", next(counter))
        doc = {**doc, "sequence": seq}
        from registry.entries import sign_entry

        doc = sign_entry({k: v for k, v in doc.items() if k != "signature"}, key)
        started = time.perf_counter()
        status, data = request(
            "PUT", f"/v1/entries/{did}", doc, {**auth, "Idempotency-Key": secrets.token_hex(8)}
        )
        rec.took("update", started, status, 200)
        if status == 200:
            with dids_lock:
                dids[index] = (did, json.loads(data)["sequence"], revision + 1)

    def get() -> None:
        with dids_lock:
            if not dids:
                return
            did = random.choice(dids)[0]
        started = time.perf_counter()
        status, _ = request("GET", f"/v1/entries/{did}")
        rec.took("get", started, status, 200)

    def discover() -> None:
        query = {"text": f"soak agent {random.randrange(50)}", "tags": [f"t{random.randrange(20)}"]}
        started = time.perf_counter()
        status, _ = request("POST", "/v1/discover", query, {"Content-Type": "application/json"})
        rec.took("discover", started, status, 200)

    def subscribers() -> None:
        import selectors

        sel = selectors.DefaultSelector()
        socks = []
        for i in range(args.subscribers):
            with contextlib.suppress(OSError):
                sock = ws_open(port, f"127.0.6.{i % 200 + 1}")
                sock.sendall(frame(b'{"type":"subscribe"}'))
                sock.setblocking(False)
                sel.register(sock, selectors.EVENT_READ)
                socks.append(sock)
        while not stop.is_set():
            for key_, _ in sel.select(timeout=0.5):
                sock = key_.fileobj
                with contextlib.suppress(BlockingIOError):
                    data = sock.recv(1 << 20)  # type: ignore[union-attr]
                    count = data.count(b'"type":"event"')
                    with rec.lock:
                        rec.events += count
        for sock in socks:
            sock.close()

    workers = [
        threading.Thread(target=paced, args=(args.writes, stop, create)),
        threading.Thread(target=paced, args=(args.updates, stop, update)),
        threading.Thread(target=paced, args=(args.reads / 2, stop, get)),
        threading.Thread(target=paced, args=(args.reads / 2, stop, get)),
        threading.Thread(target=paced, args=(args.discovers, stop, discover)),
        threading.Thread(target=subscribers),
    ]
    for worker in workers:
        worker.start()
    while time.monotonic() < stop_at:
        time.sleep(min(args.every, max(0.0, stop_at - time.monotonic())))
        out.put(rec.drain())
    stop.set()
    for worker in workers:
        worker.join(30)
    out.put(None)


# --- the run --------------------------------------------------------------------------------------


def peer_replicas(server_url: str, dbs: list[str]) -> str:
    """How much of the soaked registry's entries the peer holds as replicas, a few seconds
    after the load stopped (its PeerActor pulls every second)."""
    import asyncio

    import asyncpg

    async def count(db: str, sql: str) -> int:
        conn = await asyncpg.connect(f"{server_url}/{db}", timeout=10)
        try:
            return int(await conn.fetchval(sql))
        finally:
            await conn.close()

    time.sleep(5)
    local = asyncio.run(count(dbs[0], "SELECT count(*) FROM entries"))
    held = asyncio.run(count(dbs[1], "SELECT count(DISTINCT entry_did) FROM replica_versions"))
    quarantined = asyncio.run(count(dbs[1], "SELECT count(*) FROM replica_quarantine"))
    return f"{held} of {local} entries replicated, {quarantined} quarantined"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--writes", type=float, default=20.0, help="creates a second")
    parser.add_argument("--updates", type=float, default=5.0, help="updates a second")
    parser.add_argument("--reads", type=float, default=80.0, help="entry reads a second")
    parser.add_argument("--discovers", type=float, default=10.0, help="queries a second")
    parser.add_argument("--subscribers", type=int, default=100)
    parser.add_argument(
        "--no-peer", dest="peer", action="store_false", help="no peer registry syncing from it"
    )
    parser.add_argument(
        "--wrap",
        default="",
        help="a Python script to run the soaked server through, with the"
        " CLI's arguments (a diagnostic: e.g. one that starts tracemalloc first)",
    )
    parser.add_argument("--plot", default="", help="PNG to draw (default: in the work dir)")
    parser.add_argument("--json", default="", help="write the samples to this file")
    args = parser.parse_args()
    registry_bin = Path(sys.executable).parent / "registry"
    if not registry_bin.exists():
        print("registry is not installed in this environment", file=sys.stderr)
        return 2

    from registry.keys import SigningKey, write_key_file

    workdir = Path(tempfile.mkdtemp(prefix="registry-bench-soak-"))
    tag = secrets.token_hex(4)
    dbs = [f"registry_bench_soak_{tag}", f"registry_bench_soak_peer_{tag}"]
    for db in dbs:
        db_admin(args.postgres, f'CREATE DATABASE "{db}"')
    port, peer_port = free_port(), free_port()
    keys = {"registry": SigningKey.generate(), "peer": SigningKey.generate()}
    for name, key in keys.items():
        write_key_file(workdir / f"{name}.key", key)

    def node_env(name: str, other: str, other_port: int, poll: float) -> dict[str, str]:
        # The soaked registry lists the peer so that it answers its sync requests; the peer
        # pulls from it every `poll` seconds (the soaked one never pulls: hourly).
        return {
            **os.environ,
            **SERVICE_ENV,
            "REGISTRY_ANCHORING__ENABLED": "true" if name == "registry" else "false",
            "REGISTRY_SERVER__KEY_FILE": str(workdir / f"{name}.key"),
            "REGISTRY_FEDERATION__PEERS": json.dumps(
                [
                    {
                        "peer_did": keys[other].did,
                        "endpoint": f"http://127.0.0.1:{other_port}",
                        "kinds": ["sync"],
                    }
                ]
                if args.peer
                else []
            ),
            "REGISTRY_FEDERATION__POLL_SECONDS": str(poll),
        }

    def serve_node(name: str, node_port: int, db: str, env: dict[str, str]) -> Any:
        serve_args = [
            "serve", "--host", "127.0.0.1", "--port", str(node_port),
            "--data-dir", str(workdir / f"data-{name}"), "--database-url", f"{args.postgres}/{db}",
        ]  # fmt: skip
        cmd = [str(registry_bin), *serve_args]
        if args.wrap and name == "registry":
            cmd = [sys.executable, args.wrap, *serve_args]
        return start_server(name, cmd, node_port, None, workdir, env)

    server = serve_node("registry", port, dbs[0], node_env("registry", "peer", peer_port, 3600))
    peer = None
    samples: list[dict[str, Any]] = []
    try:
        wait_ready(server, "/v1/health", 60)
        if args.peer:
            peer = serve_node("peer", peer_port, dbs[1], node_env("peer", "registry", port, 1))
            wait_ready(peer, "/v1/health", 60)
        pid = server.pid
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        started = time.monotonic()
        stop_at = started + args.minutes * 60
        load = context.Process(target=run_load, args=(port, args, queue, stop_at))
        load.start()
        cpu_before = proc_cpu(pid)
        print(
            f"{'t s':>6} {'RSS MiB':>8} {'files':>6} {'chain KB':>9} {'req/s':>6}"
            f" {'CPU ms/req':>10} "
            + " ".join(f"{op + ' p50/p99':>18}" for op in OPS)
            + f" {'events/s':>9} errors",
            flush=True,
        )
        while (got := queue.get(timeout=args.every * 6 + 60)) is not None:
            now = time.monotonic() - started
            cpu = proc_cpu(pid)
            requests = sum(len(v) for v in got["latencies"].values())
            chain = workdir / "data-registry" / "chain.jsonl"
            sample = {
                "t": now,
                "rss": rss_mib(pid),
                "files": open_files(pid),
                "chain_kb": chain.stat().st_size / 1024 if chain.exists() else 0.0,
                "rps": requests / args.every,
                "cpu_ms": (cpu - cpu_before) * 1000 / max(1, requests),
                "p50": {op: pct(v, 0.5) for op, v in got["latencies"].items()},
                "p99": {op: pct(v, 0.99) for op, v in got["latencies"].items()},
                "events": got["events"] / args.every,
                "errors": got["errors"],
            }
            cpu_before = cpu
            samples.append(sample)
            print(
                f"{now:6.0f} {sample['rss']:8.1f} {sample['files']:6d} {sample['chain_kb']:9.1f}"
                f" {sample['rps']:6.1f} {sample['cpu_ms']:10.2f} "
                + " ".join(
                    f"{sample['p50'][op]:8.1f}/{sample['p99'][op]:8.1f} ms"[:18].rjust(18)
                    for op in OPS
                )
                + f" {sample['events']:9.0f} {json.dumps(got['errors']) if got['errors'] else ''}",
                flush=True,
            )
        load.join(60)
        if peer is not None:
            replicated = peer_replicas(args.postgres, dbs)
            print(f"peer: {replicated}", flush=True)
    finally:
        for node in (server, peer):
            if node is not None:
                stop_server(node)
        for db in dbs:
            with contextlib.suppress(Exception):
                db_admin(args.postgres, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    if args.json:
        Path(args.json).write_text(json.dumps(samples))
    return report(samples, args, workdir)


def report(samples: list[dict[str, Any]], args: argparse.Namespace, workdir: Path) -> int:
    if len(samples) < 3:
        print("too few samples")
        return 1
    per_minute = max(1, int(60 / args.every))
    first = samples[:per_minute]
    settled = [s for s in samples if s["t"] >= 300] or samples[len(samples) // 2 :]
    rss_start, rss_end = settled[0]["rss"], samples[-1]["rss"]
    growth = (rss_end - rss_start) / rss_start * 100
    met = growth < 5
    print(f"\nRSS {samples[0]['rss']:.1f} MiB at {samples[0]['t']:.0f} s, {rss_start:.1f} at"
          f" {settled[0]['t']:.0f} s, {rss_end:.1f} at the end: {growth:+.1f} % after the start"
          f" (target < 5 %)")  # fmt: skip
    for op in OPS:
        base = statistics.median([s["p99"][op] for s in first])
        last = statistics.median([s["p99"][op] for s in samples[-per_minute:]])
        ratio = last / base if base == base and base > 0 else float("nan")
        ok = ratio <= 1.5
        met &= ok
        print(f"{op:9} p99 first minute {base:7.1f} ms, last minute {last:7.1f} ms:"
              f" {ratio:.2f}x (target <= 1.5x)")  # fmt: skip
    print(f"open files {samples[0]['files']} -> {samples[-1]['files']};"
          f" chain journal {samples[-1]['chain_kb']:.1f} KB")  # fmt: skip
    errors: dict[str, int] = {}
    for sample in samples:
        for k, v in sample["errors"].items():
            errors[k] = errors.get(k, 0) + v
    print(f"errors: {errors or 'none'}")
    print(f"targets: {'MET' if met else 'NOT MET'}")
    plot = Path(args.plot) if args.plot else workdir / "soak.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return 0 if met else 1
    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    axes[0].plot(t, [s["rss"] for s in samples])
    axes[0].set_ylabel("RSS MiB")
    axes[1].plot(t, [s["files"] for s in samples], label="open files")
    axes[1].plot(t, [s["cpu_ms"] * 10 for s in samples], label="CPU ms/request x10")
    axes[1].legend()
    for op in OPS:
        axes[2].plot(t, [s["p99"][op] for s in samples], label=f"{op} p99")
    axes[2].set_ylabel("ms")
    axes[2].set_xlabel("minutes")
    axes[2].legend()
    fig.suptitle(f"registry soak: {args.minutes:g} min, {args.writes:g} creates/s,"
                 f" {args.reads:g} reads/s, {args.subscribers} subscribers")  # fmt: skip
    fig.savefig(plot, dpi=90)
    print(f"plot: {plot}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
