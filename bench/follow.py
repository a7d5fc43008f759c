#!/usr/bin/env python3
"""What following the log costs a process that did not write: the CPU of `registry serve`
processes that serve no request while others write (issue 21: with N processes, every commit
anywhere costs every process its share of reading the log).

    .venv/bin/python bench/follow.py [--followers 2] [--duration 8] [--notify-rates 100,300]

Two measurements, each on a fresh database of the server at --postgres (default
`postgresql://postgres@127.0.0.1:5432`, or `BENCH_POSTGRES`):

* creates: one `registry serve` (pinned to core 0) takes bench/entries.py's create load (wrk on
  core 1, pre-signed creates); --followers more processes on the same database take nothing.
  Printed: creates/s and the writer's CPU per create (the measured run), and each follower's
  CPU per create over the warm-up and the measured run together (it follows both).
* notify flood: --followers processes on an empty database while a client sends
  `NOTIFY registry_log` at each rate in --notify-rates (what N processes' commits send every
  process, one notification per committed batch). Printed: each follower's share of a core.
  The log is empty, so this is the cost of the notifications and of the reads they trigger,
  without records to decode.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import asyncpg  # noqa: E402

from bench import entries as be  # noqa: E402
from bench import scale  # noqa: E402


def cpu(servers: list[be.Server]) -> list[float]:
    return [be.proc_cpu(s.pid) for s in servers]


def creates(run: scale.Run, url: str, followers: int) -> None:
    start = run.registry(url)
    # The writer on core 0 (wrk takes core 1); the followers unpinned.
    place = lambda name, i: start(name, 0 if i == 0 else None)  # noqa: E731
    with run.processes("registry", 1 + followers, place) as servers:
        token, _ = run.sign_in_and_publish(servers[0])
        load = be.Load([servers[0].port], 1, run.args.connections, 1 if run.cores > 1 else None)
        # The followers follow every create of the window: the warm-up's (and a re-run's) too.
        before, created = cpu(servers[1:]), run.bench.created
        m = run.bench.measure_create("1 proc", servers[:1], load, token, 2_000)
        after, done = cpu(servers[1:]), run.bench.created - created
        each = ", ".join(
            f"{(b - a) * 1e6 / max(done, 1):,.0f}" for a, b in zip(before, after, strict=True)
        )
        print(
            f"creates      {m.result.rps:8,.0f}/s  writer {m.us_per_request(m.server_cpu_s):6,.0f}"
            f" µs/create  followers {each} µs/create{'  ERRORS' if m.result.problems() else ''}"
        )


async def notify(url: str, rate: float, seconds: float) -> int:
    conn = await asyncpg.connect(url)
    try:
        sent, start = 0, time.monotonic()
        while (now := time.monotonic()) < start + seconds:
            due = start + sent / rate
            if due > now:
                await asyncio.sleep(due - now)
            await conn.execute("NOTIFY registry_log, '0'")
            sent += 1
        return sent
    finally:
        await conn.close()


def flood(run: scale.Run, url: str, followers: int, rates: list[float]) -> None:
    start = run.registry(url)
    place = lambda name, i: start(name, None)  # noqa: E731
    with run.processes("follower", followers, place) as servers:
        time.sleep(2)
        for rate in rates:
            before, t0 = cpu(servers), time.monotonic()
            sent = asyncio.run(notify(url, rate, run.args.duration))
            after, elapsed = cpu(servers), time.monotonic() - t0
            shares = ", ".join(
                f"{(b - a) / elapsed:.1%}" for a, b in zip(before, after, strict=True)
            )
            print(f"notify flood {sent / elapsed:8,.0f}/s  followers {shares} of a core")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--followers", type=int, default=2)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--connections", type=int, default=48)
    parser.add_argument("--notify-rates", default="100,300")
    parser.add_argument(
        "--postgres",
        default=os.environ.get("BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432"),
    )
    parser.add_argument("--sign-workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    args.procs, args.no_replica, args.keep_db, args.keep_workdir = "1", True, False, False
    args.profile, args.profile_format, args.verbose = None, "raw", False
    if shutil.which("wrk") is None:
        print("bench/follow.py needs wrk: apt-get install -y wrk", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="registry-follow-"))
    run = scale.Run(args, workdir)
    print(f"service: commit {be.git_revision()}; {run.cores} cores; {args.followers} followers")
    try:
        for name, measure in (
            ("creates", lambda url: creates(run, url, args.followers)),
            ("flood", lambda url: flood(
                run, url, args.followers, [float(r) for r in args.notify_rates.split(",")]
            )),
        ):  # fmt: skip
            db = f"registry_follow_{name}_{secrets.token_hex(4)}"
            be.db_admin(args.postgres, f'CREATE DATABASE "{db}"')
            run.bench.db = db
            try:
                measure(f"{args.postgres}/{db}")
            finally:
                be.db_admin(args.postgres, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
