"""PostgreSQL backend CPU per call of the append path (`append_changes`), one change a call.

    .venv/bin/python bench/append_cpu.py [--appends 3000] [--runs 2] [--postgres URL]

Creates a fresh database per run on the server (default `postgresql://postgres@127.0.0.1:5432`,
or `BENCH_POSTGRES`), migrates it, appends `--appends` entry creations one statement each (the
first 200 warm the session up and are not counted) and prints the CPU time of the backend
process (from /proc, so the server must run on this machine) and the wall time per append.
Each append commits on its own (with the server's fsync settings), as an idle service's do.
Used for issue 21: the dynamic `EXECUTE` of the handler cost about 85 us of the 520 (A/B in
bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncpg

from registry.changes import IDEMPOTENCY_WINDOW_MS
from registry.store.migrate import _migrate, load_migrations
from registry.store.pg import append_payload
from registry.usecases.entries import entry_change

WARMUP = 200


async def backend_cpu_seconds(conn: asyncpg.Connection) -> float:
    pid = await conn.fetchval("SELECT pg_backend_pid()")
    with open(f"/proc/{pid}/stat") as stat:  # noqa: ASYNC230 (a few hundred bytes of /proc)
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(server: str, appends: int) -> tuple[float, float]:
    name = f"registry_bench_append_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(server + "/postgres")
    await admin.execute(f"CREATE DATABASE {name}")
    try:
        url = f"{server}/{name}"
        await _migrate(url, load_migrations())
        conn = await asyncpg.connect(url)
        try:
            payloads = []
            for i in range(appends):
                did = f"did:web:bench.example:{i}"
                change = entry_change(
                    "entry.created",
                    did=did,
                    expected_head=None,
                    publisher="did:key:zBench",
                    entry_type="AgentDefinition",
                    lifecycle="active",
                    prefix=f'{{"entryDid":"{did}","sequence":',
                    suffix="}",
                )
                payloads.append(append_payload([(change, None)]))
            sql = "SELECT * FROM append_changes($1::jsonb, $2)"
            for payload in payloads[:WARMUP]:
                await conn.fetch(sql, payload, IDEMPOTENCY_WINDOW_MS)
            cpu0, wall0 = await backend_cpu_seconds(conn), time.perf_counter()
            for payload in payloads[WARMUP:]:
                await conn.fetch(sql, payload, IDEMPOTENCY_WINDOW_MS)
            wall = time.perf_counter() - wall0
            cpu = await backend_cpu_seconds(conn) - cpu0
        finally:
            await conn.close()
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()
    counted = appends - WARMUP
    return cpu / counted * 1e6, wall / counted * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--appends", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--postgres",
        default=os.environ.get("BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432"),
    )
    args = parser.parse_args()
    for n in range(1, args.runs + 1):
        cpu, wall = asyncio.run(run(args.postgres.rstrip("/"), args.appends))
        print(f"run {n}: backend CPU {cpu:6.1f} us/append, wall {wall:6.1f} us/append")


if __name__ == "__main__":
    main()
