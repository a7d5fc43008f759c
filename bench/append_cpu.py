"""PostgreSQL backend CPU per call of the append path (`append_changes`), one change a call.

    .venv/bin/python bench/append_cpu.py [--appends 3000] [--runs 2] [--writers 1]
                                         [--minimal] [--postgres URL]

Creates a fresh database per run on the server (default `postgresql://postgres@127.0.0.1:5432`,
or `BENCH_POSTGRES`), migrates it, appends `--appends` entry creations one statement each (the
first 200 warm the sessions up and are not counted) and prints the CPU time of the backend
processes (from /proc, so the server must run on this machine) and the wall time per append.
Each append commits on its own (with the server's fsync settings), as an idle service's do.

Each creation is what `POST /v1/entries` appends: bench/entries.py's ~1.9 KB document, its
anchor intent (anchoring is on by default). `--minimal`: a document of two members and no
intent (the figures of the first A/B, the dynamic `EXECUTE` against static calls).

`--writers K`: K connections append at once (K processes' writers under load), each its share
of the appends; appends/s is then the figure, and it is bounded by the part of each append
that holds the log head (the critical section) once the cores are not the limit.
Used for issue 21 (A/B in bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncpg

from bench.entries import entry_for
from registry.changes import IDEMPOTENCY_WINDOW_MS
from registry.store.migrate import _migrate, load_migrations
from registry.store.pg import SESSION_SETTINGS, append_payload
from registry.usecases.entries import entry_change

WARMUP = 200
SQL = "SELECT * FROM append_changes($1::jsonb, $2)"


async def backend_cpu_seconds(conn: asyncpg.Connection) -> float:
    pid = await conn.fetchval("SELECT pg_backend_pid()")
    with open(f"/proc/{pid}/stat") as stat:  # noqa: ASYNC230 (a few hundred bytes of /proc)
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def payload(i: int, tag: str, minimal: bool) -> str:
    did = f"did:web:bench.example:{tag}:{i}"
    if minimal:
        prefix, suffix, anchor = f'{{"entryDid":"{did}","sequence":', "}", None
    else:
        doc = json.dumps(entry_for(did), separators=(",", ":"), ensure_ascii=False)
        prefix, suffix, anchor = doc[:-1] + ',"sequence":', "}", secrets.token_hex(32)
    change = entry_change(
        "entry.created",
        did=did,
        expected_head=None,
        publisher="did:key:zBench",
        entry_type="AgentDefinition",
        lifecycle="active",
        prefix=prefix,
        suffix=suffix,
        item_data_hash=anchor,
    )
    return append_payload([(change, None)])


async def run(
    server: str,
    appends: int,
    writers: int,
    minimal: bool,
    extra_settings: dict[str, str],
    fresh: bool,
) -> tuple[float, float]:
    name = f"registry_bench_append_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(server + "/postgres")
    await admin.execute(f"CREATE DATABASE {name}")
    try:
        url = f"{server}/{name}"
        await _migrate(url, load_migrations())
        settings = {**SESSION_SETTINGS, **extra_settings}
        conns = [await asyncpg.connect(url, server_settings=settings) for _ in range(writers)]
        try:
            tag = secrets.token_hex(3)
            payloads = [payload(i, tag, minimal) for i in range(appends)]
            for p in payloads[:WARMUP]:
                await conns[0].fetch(SQL, p, IDEMPOTENCY_WINDOW_MS)
            # Statistics as a running registry has them (autovacuum's ANALYZE), and sessions
            # that plan with them: a plan made on the empty tables would scan them.
            if not fresh:
                await conns[0].execute("ANALYZE")
            for c in conns:
                await c.close()
            conns = [await asyncpg.connect(url, server_settings=settings) for _ in range(writers)]
            for c in conns:
                for p in payloads[:10]:  # replays of the warm-up: plans made, nothing written
                    await c.fetch(SQL, p, IDEMPOTENCY_WINDOW_MS)
            measured = payloads[WARMUP:]
            shares = [measured[k::writers] for k in range(writers)]
            cpu0 = [await backend_cpu_seconds(c) for c in conns]
            wall0 = time.perf_counter()

            async def write(conn: asyncpg.Connection, share: list[str]) -> None:
                for p in share:
                    await conn.fetch(SQL, p, IDEMPOTENCY_WINDOW_MS)

            await asyncio.gather(*(write(c, s) for c, s in zip(conns, shares, strict=True)))
            wall = time.perf_counter() - wall0
            cpu = sum([await backend_cpu_seconds(c) for c in conns]) - sum(cpu0)
        finally:
            for c in conns:
                await c.close()
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()
    counted = appends - WARMUP
    return cpu / counted * 1e6, counted / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--appends", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--writers", type=int, default=1)
    parser.add_argument("--minimal", action="store_true")
    parser.add_argument("--fresh", action="store_true", help="no ANALYZE after the warm-up")
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="a session setting"
    )
    parser.add_argument(
        "--postgres",
        default=os.environ.get("BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432"),
    )
    args = parser.parse_args()
    for n in range(1, args.runs + 1):
        cpu, rate = asyncio.run(
            run(
                args.postgres.rstrip("/"),
                args.appends,
                args.writers,
                args.minimal,
                dict(item.split("=", 1) for item in args.set),
                args.fresh,
            )
        )
        print(
            f"run {n}: backend CPU {cpu:6.1f} us/append, {rate:7.1f} appends/s"
            f" ({args.writers} writer{'s' if args.writers > 1 else ''})"
        )


if __name__ == "__main__":
    main()
