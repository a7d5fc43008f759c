"""PostgreSQL backend CPU per change of the append path (`append_changes`).

    .venv/bin/python bench/append_cpu.py [--appends 3000] [--runs 2] [--writers 1]
                                         [--batch 1] [--sql STATEMENT] [--minimal]
                                         [--statements N] [--postgres URL]

Creates a fresh database per run on the server (default `postgresql://postgres@127.0.0.1:5432`,
or `BENCH_POSTGRES`), migrates it, appends `--appends` entry creations (the first 200 one a
call, to warm the sessions up, not counted; the others `--batch` to a call) and prints the CPU
time of the backend processes (from /proc, so the server must run on this machine) per change
and the changes per second. Each call commits on its own (with the server's fsync settings):
one call is one of the writer's batches.

Each creation is what `POST /v1/entries` appends for bench/entries.py's signed ~1.9 KB entry:
the stored form the use-case builds, its event, its anchor intent (anchoring is on by default),
under its own Idempotency-Key. `--minimal`: a document of two members, no intent and no key
(the figures of the first A/B, the dynamic `EXECUTE` against static calls).

`--writers K`: K connections append at once (K processes' writers under load), each its share
of the calls; changes/s is then the figure, and it is bounded by the part of each append
that holds the log head (the critical section) once the cores are not the limit.
`--sql STATEMENT` (repeatable) runs after the migrations: an experiment (an index dropped, a
column's storage changed). Used for issue 21 (A/B in bench/README.md).
`--statements N`: the N costliest statements of the measured calls, nested ones included (the
server needs pg_stat_statements with `pg_stat_statements.track = all`), in us per change: what
runs under the log head and what before it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncpg

from bench.entries import entry_for
from registry.changes import IDEMPOTENCY_WINDOW_MS, Change, IdemKey
from registry.entries import check_entry, sign_entry
from registry.keys import SigningKey
from registry.store.migrate import _migrate, load_migrations
from registry.store.pg import SESSION_SETTINGS, append_payload
from registry.usecases.entries import entry_change, version_change

WARMUP = 200
KEY = SigningKey(bytes(32))
AT = "2026-11-28T10:00:00.000Z"
SQL = "SELECT * FROM append_changes($1::jsonb, $2)"


async def backend_cpu_seconds(conn: asyncpg.Connection) -> float:
    pid = await conn.fetchval("SELECT pg_backend_pid()")
    with open(f"/proc/{pid}/stat") as stat:  # noqa: ASYNC230 (a few hundred bytes of /proc)
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def print_statements(conn: asyncpg.Connection, top: int, changes: int) -> None:
    """The `top` statements (nested ones too: the server needs pg_stat_statements with
    `pg_stat_statements.track = all`) by execution time, in us per change."""
    rows = await conn.fetch(
        "SELECT total_exec_time + total_plan_time AS total_exec_time, calls, plans, query"
        " FROM pg_stat_statements"
        " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " ORDER BY total_exec_time DESC LIMIT $1",
        top,
    )
    for r in rows:
        query = " ".join(r["query"].split())[:110]
        us = r["total_exec_time"] * 1000 / changes
        print(f"  {us:8.1f} us {r['calls']:7d} calls {r['plans']:5d} plans  {query}")


def did_of(i: int, tag: str) -> str:
    return f"did:web:bench.example:{tag}:{i}"


def change_of(i: int, tag: str, minimal: bool) -> tuple[Change, IdemKey | None]:
    did = did_of(i, tag)
    if minimal:
        minimal_change = entry_change(
            "entry.created",
            did=did,
            expected_head=None,
            publisher="did:key:zBench",
            entry_type="AgentDefinition",
            lifecycle="active",
            prefix=f'{{"entryDid":"{did}","sequence":',
            suffix="}",
        )
        return minimal_change, None
    # What the use-case appends for POST /v1/entries of bench/entries.py's signed entry, each
    # create under its own Idempotency-Key.
    entry = check_entry(sign_entry(entry_for(did), KEY, created=AT))
    change = version_change("entry.created", entry, expected_head=None, at=AT, anchoring=True)
    key = f"bench-{tag}-{i}"
    return change, IdemKey("did:key:zBench", "create_entry", key, secrets.token_bytes(32))


def update_of(i: int, tag: str, head: int) -> tuple[Change, IdemKey | None]:
    """A new version of `change_of(i, tag)`'s entry (another name and description), written
    over its head `head`: what `PUT /v1/entries/<did>` appends."""
    did = did_of(i, tag)
    doc = entry_for(did)
    doc["name"] = f"{doc['name']} v2"
    doc["description"] = f"{doc['description']} (updated)"
    entry = check_entry(sign_entry(doc, KEY, created=AT))
    change = version_change("entry.updated", entry, expected_head=head, at=AT, anchoring=True)
    key = f"bench-{tag}-{i}-v2"
    return change, IdemKey("did:key:zBench", "update_entry", key, secrets.token_bytes(32))


def payloads_of(changes: list[tuple[Change, IdemKey | None]], batch: int) -> list[str]:
    """The changes, `batch` to a call (the writer's group commit under load)."""
    return [append_payload(changes[k : k + batch]) for k in range(0, len(changes), batch)]


async def run(
    server: str,
    appends: int,
    writers: int,
    minimal: bool,
    extra_settings: dict[str, str],
    fresh: bool,
    batch: int,
    sql: list[str],
    statements: int = 0,
    updates: bool = False,
) -> tuple[float, float]:
    name = f"registry_bench_append_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(server + "/postgres")
    await admin.execute(f"CREATE DATABASE {name}")
    try:
        url = f"{server}/{name}"
        await _migrate(url, load_migrations())
        if sql:
            setup = await asyncpg.connect(url)
            for statement in sql:
                await setup.execute(statement)
            await setup.close()
        settings = {**SESSION_SETTINGS, **extra_settings}
        conns = [await asyncpg.connect(url, server_settings=settings) for _ in range(writers)]
        try:
            tag = secrets.token_hex(3)
            warmup = [change_of(i, tag, minimal) for i in range(WARMUP)]
            warm = payloads_of(warmup, 1)
            # The warm-up's creates again under fresh keys: refused (entry_exists), so each
            # new session plans the handler's path too; only their refusals are recorded.
            again = payloads_of(
                [(c, None if k is None else replace(k, key=k.key + "-again")) for c, k in warmup],
                1,
            )
            measured = [change_of(i, tag, minimal) for i in range(WARMUP, appends)]
            if updates:
                # The entries first (not measured), then a new version of each.
                for p in payloads_of(measured, 64):
                    await conns[0].fetch(SQL, p, IDEMPOTENCY_WINDOW_MS)
                heads = {
                    r["entry_did"]: r["head_seq"]
                    for r in await conns[0].fetch("SELECT entry_did, head_seq FROM entries")
                }
                measured = [
                    update_of(i, tag, heads[did_of(i, tag)]) for i in range(WARMUP, appends)
                ]
            payloads = payloads_of(measured, batch)
            for p in warm:
                await conns[0].fetch(SQL, p, IDEMPOTENCY_WINDOW_MS)
            # Statistics as a running registry has them (autovacuum's ANALYZE), and sessions
            # that plan with them: a plan made on the empty tables would scan them.
            if not fresh:
                await conns[0].execute("ANALYZE")
            for c in conns:
                await c.close()
            conns = [await asyncpg.connect(url, server_settings=settings) for _ in range(writers)]
            for c in conns:
                for p in again[:10]:
                    await c.fetch(SQL, p, IDEMPOTENCY_WINDOW_MS)
            shares = [payloads[k::writers] for k in range(writers)]
            if statements:
                await conns[0].execute("SELECT pg_stat_statements_reset()")
            cpu0 = [await backend_cpu_seconds(c) for c in conns]
            wall0 = time.perf_counter()

            async def write(conn: asyncpg.Connection, share: list[str]) -> None:
                for p in share:
                    await conn.fetch(SQL, p, IDEMPOTENCY_WINDOW_MS)

            await asyncio.gather(*(write(c, s) for c, s in zip(conns, shares, strict=True)))
            wall = time.perf_counter() - wall0
            cpu = sum([await backend_cpu_seconds(c) for c in conns]) - sum(cpu0)
            if statements:
                await print_statements(conns[0], statements, appends - WARMUP)
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
        "--batch", type=int, default=1, help="changes per call (the writer batches under load)"
    )
    parser.add_argument(
        "--sql",
        action="append",
        default=[],
        metavar="STATEMENT",
        help="run after the migrations (an experiment: an index dropped, a storage changed)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="a session setting"
    )
    parser.add_argument(
        "--updates",
        action="store_true",
        help="measure a new version of each entry (created first, not measured) instead",
    )
    parser.add_argument(
        "--statements",
        type=int,
        default=0,
        metavar="N",
        help="print the N costliest statements (pg_stat_statements, track = all, on the server)",
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
                args.batch,
                args.sql,
                args.statements,
                args.updates,
            )
        )
        print(
            f"run {n}: backend CPU {cpu:6.1f} us/change, {rate:7.1f} changes/s"
            f" ({args.writers} writer{'s' if args.writers > 1 else ''})"
        )


if __name__ == "__main__":
    main()
