#!/usr/bin/env python3
"""The verifiable log at scale (issue 20): checkpointing throughput, tree storage, proof latency.

One run, on a fresh database `registry_bench_tlog_<hex>` of the local PostgreSQL server
(created, migrated, dropped):

  * seeds `--records` log records (default 1,000,000) in one INSERT ... SELECT generate_series:
    public `attestation.created` records with a little data each, and moves the log head past
    them, as if they had been written (the tree is empty: nothing was checkpointed yet);
  * starts one `registry serve` on it (`transparency.checkpoint_seconds` 1) and follows its
    newest checkpoint until it covers the whole log: records/s of the catch-up (the checkpointer
    reads, hashes and stores at most 200,000 records per checkpoint), and the server's resident
    memory before, at its peak and after (sampled every 100 ms);
  * the tree's storage: pg_total_relation_size of `log_tiles` (heap, TOAST and index) per record;
  * then, against that server, over one keep-alive HTTP connection: `--proofs` inclusion proofs
    of random sequences in random tree sizes, and as many consistency proofs between random
    sizes; p50 / p99 / max latency as the client sees it (and of a request refused with 400
    before any database work, on the same connection: the floor of any request on this
    machine), and as the server measured them (its access log's `ms`, from the request's
    arrival to its answer); then 50 inclusion proofs verified from
    the served records, and consistency proofs from stored checkpoints of the catch-up to the
    newest (registry/transparency.py's RFC 9162 verification);
  * a live rate: `--live-seconds` of appends straight into the log (SQL, `--live-rate` records/s
    in batches of 1,000) while the server checkpoints: how far its checkpoints fall behind.

Targets (the issue): proofs < 5 ms p99 at 1,000,000 records on one process; checkpoints keep up
with >= 20,000 new records/s without growing memory; <= 100 bytes of tree per record. Missing a
target does not change the exit status; a proof that does not verify exits 1.

    .venv/bin/python bench/transparency.py                     # ~2 minutes
    .venv/bin/python bench/transparency.py --records 100000 --proofs 200
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import asyncpg  # noqa: E402
import httpx  # noqa: E402

from bench.entries import (  # noqa: E402
    SERVICE_ENV,
    Server,
    db_admin,
    free_port,
    start_server,
    stop_server,
    wait_ready,
)
from registry.did import public_key_from_did_key  # noqa: E402
from registry.store.migrate import _migrate, load_migrations  # noqa: E402
from registry.transparency import (  # noqa: E402
    open_checkpoint,
    verify_consistency,
    verify_inclusion,
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def seed(url: str, records: int) -> float:
    started = time.monotonic()
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            "INSERT INTO log (seq, kind, entry_did, at, data)"
            " SELECT n, 'attestation.created', 'did:web:bench.example:' || (n % 5000),"
            "        now(), jsonb_build_object('attestationId', 'att_' || n,"
            "                                  'issuerDid', 'did:key:z6Mkbench')"
            "   FROM generate_series(1, $1) AS n",
            records,
        )
        await conn.execute("UPDATE log_head SET seq = $1", records)
        await conn.execute("ANALYZE log")
    finally:
        await conn.close()
    return time.monotonic() - started


async def append(url: str, start: int, count: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            await conn.execute("SELECT seq FROM log_head FOR UPDATE")
            await conn.execute(
                "INSERT INTO log (seq, kind, entry_did, data)"
                " SELECT n, 'attestation.created', 'did:web:live.example', '{}'::jsonb"
                "   FROM generate_series($1::bigint, $2::bigint) AS n",
                start,
                start + count - 1,
            )
            await conn.execute("UPDATE log_head SET seq = $1", start + count - 1)
    finally:
        await conn.close()


async def tiles_bytes(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval("SELECT pg_total_relation_size('log_tiles')"))
    finally:
        await conn.close()


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def checkpoint_size(http: httpx.Client) -> tuple[int, str]:
    note = http.get("/v1/log/checkpoint").text
    return int(note.split("\n")[1]), note


def follow(http: httpx.Client, server: Server, target: int, deadline_s: float) -> dict[str, float]:
    """Wait until a checkpoint covers `target` records; the catch-up's rate and memory."""
    base = rss_kb(server.pid)
    peak = base
    started = time.monotonic()
    first_size, _ = checkpoint_size(http)
    while True:
        size, _ = checkpoint_size(http)
        peak = max(peak, rss_kb(server.pid))
        if size >= target:
            break
        if time.monotonic() - started > deadline_s:
            raise RuntimeError(f"checkpoints reached {size} of {target} in {deadline_s:.0f}s")
        time.sleep(0.1)
    took = time.monotonic() - started
    return {
        "records": target - first_size,
        "seconds": took,
        "rate": (target - first_size) / took,
        "rss_base_mib": base / 1024,
        "rss_peak_mib": peak / 1024,
        "rss_after_mib": rss_kb(server.pid) / 1024,
    }


def proofs(http: httpx.Client, size: int, count: int, rng: random.Random) -> dict[str, list[float]]:
    """Inclusion and consistency proofs in the tree of `size` (verified in `verify_sample`)."""
    times: dict[str, list[float]] = {"inclusion": [], "consistency": [], "floor (a 400)": []}
    for _ in range(count):
        started = time.perf_counter()
        http.get("/v1/log/records", params={"from": 0})  # refused before any database work
        times["floor (a 400)"].append(time.perf_counter() - started)
        sequence = rng.randint(1, size)
        started = time.perf_counter()
        answer = http.get(
            "/v1/log/proof/inclusion", params={"sequence": sequence, "treeSize": size}
        )
        times["inclusion"].append(time.perf_counter() - started)
        if answer.status_code != 200 or len(answer.json()["proof"]) > 64:
            raise RuntimeError(f"inclusion proof of {sequence}: {answer.status_code} {answer.text}")
        first = rng.randint(1, size)
        started = time.perf_counter()
        answer = http.get("/v1/log/proof/consistency", params={"from": first, "to": size})
        times["consistency"].append(time.perf_counter() - started)
        if answer.status_code != 200:
            raise RuntimeError(f"consistency proof {first}..{size}: {answer.text}")
    return times


def verify_sample(
    http: httpx.Client, size: int, root: bytes, rng: random.Random, count: int
) -> None:
    """A sample of the proofs verified end to end: the leaf re-hashed from the served record."""
    from registry.transparency import record_leaf

    for _ in range(count):
        sequence = rng.randint(1, size)
        (record,) = http.get("/v1/log/records", params={"from": sequence, "limit": 1}).json()[
            "records"
        ]
        proof = http.get(
            "/v1/log/proof/inclusion", params={"sequence": sequence, "treeSize": size}
        ).json()
        path = [base64.b64decode(p) for p in proof["proof"]]
        if not verify_inclusion(sequence - 1, size, record_leaf(record), path, root):
            raise RuntimeError(f"the inclusion proof of {sequence} does not verify")


def access_times(path: Path) -> dict[str, list[float]]:
    """The server's own latency of each proof request (its access log's `ms=`)."""
    out: dict[str, list[float]] = {"/v1/log/proof/inclusion": [], "/v1/log/proof/consistency": []}
    for line in path.read_text(errors="replace").splitlines():
        if "registry.access" not in line or " status=200 " not in line:
            continue
        fields = dict(p.split("=", 1) for p in line.split() if "=" in p)
        if fields.get("route") in out:
            out[fields["route"]].append(float(fields["ms"]))
    return {route: ms for route, ms in out.items() if ms}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432")
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--proofs", type=int, default=2000)
    parser.add_argument("--live-seconds", type=float, default=30.0)
    parser.add_argument("--live-rate", type=int, default=20_000)
    parser.add_argument("--keep", action="store_true", help="keep the database")
    args = parser.parse_args()
    rng = random.Random(7)
    db = f"registry_bench_tlog_{secrets.token_hex(4)}"
    url = f"{args.postgres}/{db}"
    db_admin(args.postgres, f'CREATE DATABASE "{db}"')
    failed = False
    try:
        asyncio.run(_migrate(url, load_migrations()))
        seeded = asyncio.run(seed(url, args.records))
        log(f"{args.records:,} log records seeded in {seeded:.1f}s")
        port = free_port()
        env = {
            **os.environ,
            **SERVICE_ENV,
            "REGISTRY_DATABASE__URL": url,
            "REGISTRY_ANCHORING__ENABLED": "false",
            "REGISTRY_TRANSPARENCY__CHECKPOINT_SECONDS": "1",
            "REGISTRY_LOGGING__LEVEL": "INFO",  # the access log: the server's own latencies
        }
        with tempfile.TemporaryDirectory(prefix="registry-bench-tlog-") as tmp:
            cmd = [sys.executable, "-m", "cli", "serve", "--port", str(port), "--data-dir", tmp]
            server = start_server("registry", cmd, port, None, Path(tmp), env)
            try:
                wait_ready(server, "/v1/health", 60)
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                    catchup = follow(http, server, args.records, 600)
                    log(f"caught up {catchup['records']:,.0f} records in {catchup['seconds']:.1f}s")
                    size, note = checkpoint_size(http)
                    signer = note.split("\n", 1)[0]
                    checkpoint = open_checkpoint(note, public_key_from_did_key(signer))
                    stored = asyncio.run(tiles_bytes(url))
                    times = proofs(http, size, args.proofs, rng)
                    verify_sample(http, size, checkpoint.root, rng, 50)
                    # consistency proofs verified against the stored checkpoints of the catch-up
                    for older_size in sorted({size // 5, size // 2, size - 1}):
                        answer = http.get("/v1/log/checkpoint", params={"treeSize": older_size})
                        if answer.status_code != 200:
                            continue
                        older = open_checkpoint(answer.text, public_key_from_did_key(signer))
                        proof = http.get(
                            "/v1/log/proof/consistency", params={"from": older.size, "to": size}
                        ).json()
                        path = [base64.b64decode(p) for p in proof["proof"]]
                        if not verify_consistency(
                            older.size, size, path, older.root, checkpoint.root
                        ):
                            raise RuntimeError(f"consistency {older.size}..{size} fails")
                    # live: appends at --live-rate while the server checkpoints
                    lags: list[int] = []
                    head = size
                    started = time.monotonic()
                    base_rss = rss_kb(server.pid)
                    peak_rss = base_rss
                    samples: list[float] = []
                    while time.monotonic() - started < args.live_seconds:
                        tick = time.monotonic()
                        batch = max(1, args.live_rate // 10)
                        asyncio.run(append(url, head + 1, batch))
                        head += batch
                        lags.append(head - checkpoint_size(http)[0])
                        peak_rss = max(peak_rss, rss_kb(server.pid))
                        samples.append(rss_kb(server.pid) / 1024)
                        time.sleep(max(0.0, 0.1 - (time.monotonic() - tick)))
                    live_rate = (head - size) / (time.monotonic() - started)
                    caught = follow(http, server, head, 60)
                served = access_times(server.log)
            finally:
                stop_server(server)
        print(f"records            {args.records:,}")
        print(
            f"catch-up           {catchup['rate']:,.0f} records/s"
            f" ({catchup['records']:,.0f} in {catchup['seconds']:.1f} s);"
            f" server RSS {catchup['rss_base_mib']:.0f} -> peak {catchup['rss_peak_mib']:.0f}"
            f" -> {catchup['rss_after_mib']:.0f} MiB"
        )
        print(
            f"tree storage       {stored / args.records:.1f} bytes/record"
            f" ({stored / 2**20:.1f} MiB)"
        )
        for kind, values in times.items():
            ms = [v * 1000 for v in values]
            print(
                f"{kind:<18} p50 {statistics.median(ms):.2f} ms  p99 {percentile(ms, 0.99):.2f} ms"
                f"  max {max(ms):.2f} ms  ({len(ms)} requests over HTTP, one connection)"
            )
        for route, ms in served.items():
            print(
                f"  server-side {route:<22} p50 {statistics.median(ms):.2f} ms"
                f"  p99 {percentile(ms, 0.99):.2f} ms  max {max(ms):.2f} ms"
            )
        print(
            f"live               {live_rate:,.0f} records/s appended for {args.live_seconds:.0f} s:"
            f" checkpoint lag max {max(lags):,} records, last {lags[-1]:,};"
            f" caught up {caught['seconds']:.1f} s after; server RSS {base_rss / 1024:.0f} ->"
            f" peak {peak_rss / 1024:.0f} MiB"
        )
        thirds = [samples[len(samples) * k // 3 - 1] for k in (1, 2, 3)]
        print(
            f"  server RSS at each third of the live phase: {thirds[0]:.0f}, {thirds[1]:.0f},"
            f" {thirds[2]:.0f} MiB"
        )
    except RuntimeError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        failed = True
    finally:
        if not args.keep:
            db_admin(args.postgres, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
