#!/usr/bin/env python3
"""Federation sync: N entries pulled from one node to another over loopback.

The issue's target (issue 11, performance): sync 100,000 entries from one node to another at
≥ 3,000 entries/s, with memory of the pulling process that does not grow with the backlog.

One run, on fresh databases of the local PostgreSQL server (`registry_bench_fed_<hex>_origin`,
`_puller`, `_inproc`; created, migrated, dropped at the end):

1. seeds the origin's database with `--entries` (100,000) signed entry versions, as the append
   path leaves them: worker processes sign ~1.9 KB entries (bench/entries.py's `entry_for`, each
   with its own name, description, tags and version; `--publishers` (100) keys) and build their
   stored form and `entry.created` change exactly as the create use-case does (`stored_form`,
   `entry_change`; anchoring off: anchorState `unanchored`, no anchor intent); this process
   writes them 1,000 per statement: by default one set-based INSERT of the versions, log records
   (the change's event) and entries rows (`entry_projection`) and the log head (SEED_SQL: the
   same rows as `append_changes`, only `created_at` differs), or with `--seed-via append` through
   `append_changes` itself (slower);
2. starts the origin (`registry serve`, pinned to core 0) with the puller as its peer, then the
   puller (`registry serve`, pinned to core 1) with the origin as its peer: its PeerActor pulls
   POST /v1/federation/sync pages (`--page-size`, 1,000) and stores them as replicas, one
   `peer.status` change per page;
3. from the puller's start, every `--interval` (0.1 s) reads its cursor (federation_peers) and
   its VmRSS / VmHWM (/proc/PID/status) until the cursor reaches the last seeded sequence
   (`--deadline` 900 s), then checks that the puller holds exactly N replica versions and no
   quarantine, and reads the admin view (GET /v1/admin/federation/peers: cursor, lag);
4. prints entries/s (from the puller's start, and from its first stored page to its last), RSS
   at 10/25/50/75/100% of the backlog and the peak (VmHWM), the CPU the puller, the origin and
   PostgreSQL used, and the page cadence from the puller's `peer.status` log records (time
   between page commits, the pull latency the breaker recorded, the SQL time of
   apply_peer_sync from pg_stat_user_functions);
5. unless `--breakdown-entries 0`: pulls `--breakdown-entries` (20,000) again from the same
   origin with the PeerActor (actors/federation.run_peer) in this process, pinned to core 1,
   into a third database, with each piece of a page timed: the signed request, HTTP (origin
   included), JSON parse, verify_envelope, read_sync_response, sort_entries (check_replica of
   every entry), the append (payload encoding, SQL); and times the origin's sync_page query
   alone. With `--profile DIR` that run is under cProfile (figures inflated) and the top
   functions are printed.

    .venv/bin/python bench/federation.py                        # ~2 minutes
    .venv/bin/python bench/federation.py --entries 20000 --breakdown-entries 5000
    .venv/bin/python bench/federation.py --profile /tmp/fed     # cProfile of the in-process pull

Missing the target does not change the exit status; a run that does not end with exactly N
replicas and no quarantine (or does not finish by the deadline) exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import itertools
import json
import math
import os
import pstats
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if __name__ == "__main__" and str(ROOT) not in sys.path:  # run as a script: import `bench`
    sys.path.insert(0, str(ROOT))

import asyncpg  # noqa: E402

from bench.entries import (  # noqa: E402
    SERVICE_ENV,
    VENV_BIN,
    Server,
    cpu_delta,
    cpu_snapshot,
    db_admin,
    entry_for,
    free_port,
    git_revision,
    idle_check,
    log,
    machine_busy,
    start_server,
    stop_server,
    wait_ready,
)
from bench.events import run_queue_wait  # noqa: E402
from bench.seed import WORDS  # noqa: E402
from registry.keys import SigningKey, write_key_file  # noqa: E402

TARGET = 3000.0  # entries/s
CHUNK = 1000  # entries per append_changes call when seeding
MILESTONES = (0.10, 0.25, 0.50, 0.75, 1.00)


# --- seeding the origin ----------------------------------------------------------------------

# entry.created as the append path leaves it (apply_entry_version + append_changes, migration
# 0008/0010 with anchoring off): the version, the log record (the change's event) and the
# entries row from entry_projection of the served document, at the sequences given.
SEED_SQL = """
WITH docs AS (
    SELECT u.seq, u.did, u.publisher, u.entry_type, u.lifecycle, u.doc, u.name, u.version
      FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
                  $7::text[], $8::text[])
           AS u(seq, did, publisher, entry_type, lifecycle, doc, name, version)
),
versions AS (
    INSERT INTO entry_versions (seq, entry_did, publisher_did, lifecycle, doc)
    SELECT seq, did, publisher, lifecycle, doc FROM docs
),
records AS (
    INSERT INTO log (seq, kind, entry_did, data)
    SELECT seq, 'entry.created', did,
           jsonb_build_object('entryType', entry_type, 'publisherDid', publisher,
                              'lifecycleStatus', lifecycle, 'name', name, 'version', version)
      FROM docs
),
searchable AS (
    INSERT INTO entry_search (entry_did, head_seq, publisher_did, entry_type, lifecycle, name,
                              description, version, tags, service_types, relationships,
                              custom_metadata, published_at, updated_at, search)
    SELECT d.did, d.seq, d.publisher, d.entry_type, d.lifecycle, p.name, p.description,
           p.version, p.tags, p.service_types, p.relationships, p.custom_metadata,
           p.published_at, p.updated_at, p.search
      FROM docs AS d, LATERAL entry_projection(d.doc) AS p
)
INSERT INTO entries (entry_did, head_seq, created_seq, publisher_did, entry_type, lifecycle)
SELECT d.did, d.seq, d.seq, d.publisher, d.entry_type, d.lifecycle FROM docs AS d
"""


def origin_entry(did: str, i: int) -> dict[str, Any]:
    """bench/entries.py's ~1.9 KB entry, with its own name, description, tags and version (as
    published entries differ: identical documents would pile every row onto the same keys of
    the search indexes), words from bench/seed.py's vocabulary."""
    entry = entry_for(did)
    w = [WORDS[(i * k + k) % len(WORDS)] for k in (1, 3, 7, 11)]
    entry["name"] = f"{w[0].title()} {w[1]} agent {i}"
    entry["description"] = (
        f"An agent that can {w[0]}, {w[1]} and {w[2]} for {w[3]}, published by the registry"
        f" benchmark as entry {i}. "
    ) * 2
    entry["tags"] = sorted({w[0], w[3], f"tag-{i % 200}"})
    entry["version"] = f"1.{i % 10}.{i % 7}"
    return entry


def seed_chunk(
    seeds: list[bytes], prefix: str, start: int, count: int, at: str, first_seq: int, mode: str
) -> Any:
    """`count` signed `entry.created` changes built as the create use-case builds them with
    anchoring off (runs in a worker process): for `mode` "append" the `append_changes`
    payload; for "sql" the columns of SEED_SQL, the i-th entry at sequence first_seq + i."""
    from registry import canonical
    from registry.changes import Change, IdemKey
    from registry.entries import MANAGED_FIELDS, lifecycle_of, sign_entry, stored_form
    from registry.store.pg import append_payload
    from registry.usecases.entries import entry_change

    keys = [SigningKey(s) for s in seeds]
    items: list[tuple[Change, IdemKey | None]] = []
    columns: list[list[Any]] = [[] for _ in range(8)]
    for i in range(start, start + count):
        key = keys[i % len(keys)]
        signed = sign_entry(origin_entry(f"{prefix}{i:07d}", i), key)
        # What check_entry hands the use-case: the members as received, the doc minus the
        # registry-managed fields (then Entries.version_change: stored_form, entry_change).
        members = canonical.canonical_members(signed)
        doc = {k: v for k, v in signed.items() if k not in MANAGED_FIELDS}
        form = stored_form(
            doc, updated_at=at, signature_created=at, members=members, anchor_state="unanchored"
        )
        change = entry_change(
            "entry.created",
            did=signed["entryDid"],
            expected_head=None,
            publisher=key.did,
            entry_type=signed["entryType"],
            lifecycle=lifecycle_of(doc),
            prefix=form.prefix,
            suffix=form.suffix,
            event={"name": signed["name"], "version": signed["version"]},
        )
        if mode == "append":
            items.append((change, None))
            continue
        rows, event = change.rows, change.event
        seq = first_seq + i
        for column, value in zip(
            columns,
            (
                seq,
                change.subject,
                rows["publisherDid"],
                rows["entryType"],
                rows["lifecycle"],
                form.render(seq),
                event["name"],
                event["version"],
            ),
            strict=True,
        ):
            column.append(value)
    return append_payload(items) if mode == "append" else columns


@dataclass
class Seeded:
    first_seq: int
    last_seq: int
    seconds: float
    sql_seconds: float
    doc_bytes: int  # mean stored document size
    publishers: int
    mode: str


async def seed_origin(url: str, args: argparse.Namespace, prefix: str) -> Seeded:
    from registry.changes import IDEMPOTENCY_WINDOW_MS
    from registry.entries import check_entry
    from registry.usecases.common import now_ms, rfc3339

    count, workers, mode = args.entries, args.sign_workers, args.seed_via
    seeds = [SigningKey.generate().seed for _ in range(args.publishers)]
    at = rfc3339(now_ms())
    started = time.perf_counter()
    conn = await asyncpg.connect(url)
    sql_s = 0.0
    seqs: list[int] = []
    try:
        head = int(await conn.fetchval("SELECT seq FROM log_head WHERE id = 1"))
        starts = list(range(0, count, CHUNK))
        loop = asyncio.get_running_loop()
        window = max(2, 2 * workers)  # bounded: a chunk is ~2.5 MB of text
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures: list[asyncio.Future[Any] | None] = []

            def submit(n: int) -> None:
                s = starts[n]
                job = pool.submit(
                    seed_chunk, seeds, prefix, s, min(CHUNK, count - s), at, head + 1, mode
                )
                futures.append(asyncio.wrap_future(job, loop=loop))

            for n in range(min(window, len(starts))):
                submit(n)
            for n in range(len(starts)):
                future = futures[n]
                assert future is not None
                chunk = await future
                futures[n] = None
                if len(futures) < len(starts):
                    submit(len(futures))
                size = min(CHUNK, count - starts[n])
                t = time.perf_counter()
                if mode == "append":
                    rows = await conn.fetch(
                        "SELECT seq, refusal::text AS refusal FROM append_changes($1::jsonb, $2)",
                        chunk,
                        IDEMPOTENCY_WINDOW_MS,
                    )
                    refused = [r["refusal"] for r in rows if r["refusal"] is not None]
                    if refused or len(rows) != size:
                        raise RuntimeError(f"seeding refused: {refused[:3]}")
                    seqs.extend(int(r["seq"]) for r in rows)
                else:
                    async with conn.transaction():
                        await conn.execute(SEED_SQL, *chunk)
                        await conn.execute(
                            "UPDATE log_head SET seq = $1 WHERE id = 1", chunk[0][-1]
                        )
                    seqs.extend(chunk[0])
                sql_s += time.perf_counter() - t
                if n % 20 == 19:
                    log(f"  seeded {len(seqs):,}/{count:,}")
        if seqs != list(range(head + 1, head + count + 1)):
            raise RuntimeError("seeded sequences are not contiguous")
        # One stored document, checked as the puller will (hash and signature).
        doc = await conn.fetchval("SELECT doc FROM entry_versions WHERE seq = $1", head + 1)
        check_entry(json.loads(doc))
        size = await conn.fetchval("SELECT avg(octet_length(doc))::bigint FROM entry_versions")
        for table in ("entries", "entry_versions", "log"):
            await conn.execute(f"VACUUM ANALYZE {table}")
    finally:
        await conn.close()
    return Seeded(
        head + 1,
        head + count,
        time.perf_counter() - started,
        sql_s,
        int(size),
        len(seeds),
        mode,
    )


async def migrate(url: str) -> None:
    from registry.store.migrate import _migrate, load_migrations

    await _migrate(url, load_migrations())


# --- watching the puller ------------------------------------------------------------------------


def vm_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in kB of a process (0, 0 once it is gone)."""
    rss = hwm = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    except OSError:
        pass
    return rss, hwm


@dataclass
class Sample:
    t: float  # seconds since the puller was started
    done: int  # entries stored (from the cursor: the seeded sequences are contiguous)
    rss_kb: int
    hwm_kb: int


@dataclass
class Watch:
    samples: list[Sample] = field(default_factory=list)
    first_page_s: float | None = None
    done_s: float | None = None
    at_first: Snap | None = None  # when the first page was stored
    at_done: Snap | None = None  # when the last was


@dataclass
class Snap:
    cpu: dict[int, float]  # pid → CPU seconds (the servers and PostgreSQL's processes)
    busy: tuple[float, float]  # the machine's (busy, total) jiffies, all cores
    puller_wait: float  # seconds the puller's threads were runnable, waiting for a core
    origin_wait: float  # the same of the origin


async def watch_puller(
    server: Server,
    url: str,
    origin_did: str,
    seeded: Seeded,
    started: float,
    args: argparse.Namespace,
    origin_pid: int,
    pids: set[int],
    dbs: list[str],
) -> Watch:
    """Sample the puller's cursor and memory until it has every seeded entry. `pids` (the
    servers') gets the PostgreSQL processes that work for the bench added: both databases'
    backends and the server's background processes (as bench/events.py: not the CPU of exited
    backends, on a shared server mostly other databases' work)."""
    total = seeded.last_seq - seeded.first_seq + 1
    watch = Watch()
    conn = await asyncpg.connect(url)
    last_log = 0.0

    async def snap() -> Snap:
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
            " AND (datname = ANY($1::text[]) OR backend_type <> 'client backend')",
            dbs,
        )
        pids.update(int(r["pid"]) for r in rows)
        return Snap(
            cpu_snapshot(pids),
            machine_busy(),
            run_queue_wait(server.pid),
            run_queue_wait(origin_pid),
        )

    try:
        while True:
            now = time.perf_counter() - started
            if server.popen.poll() is not None:
                raise RuntimeError(
                    f"the puller exited with {server.popen.returncode}:\n{server.log_tail()}"
                )
            if now > args.deadline:
                raise RuntimeError(f"the puller did not finish within {args.deadline:.0f}s")
            cursor = await conn.fetchval(
                "SELECT cursor FROM federation_peers WHERE peer_did = $1", origin_did
            )
            done = max(0, min(total, int(cursor or 0) - seeded.first_seq + 1))
            rss, hwm = vm_kb(server.pid)
            watch.samples.append(Sample(now, done, rss, hwm))
            if done and watch.first_page_s is None:
                watch.first_page_s = now
                watch.at_first = await snap()
            if done >= total:
                watch.done_s = now
                watch.at_done = await snap()
                return watch
            if now - last_log >= 10:
                last_log = now
                log(f"  puller: {done:,}/{total:,} entries, RSS {rss / 1024:.0f} MB")
            await asyncio.sleep(args.interval)
    finally:
        await conn.close()


@dataclass
class PullerFacts:
    replicas: int
    quarantined: int
    cursor: int
    page_gaps_ms: list[float]
    latency_ms: list[float]
    pages: int
    sql_ms: dict[str, float]
    origin_head: int  # the origin's log head (its own peer.status records follow the entries)


async def puller_facts(url: str, origin_url: str, origin_did: str) -> PullerFacts:
    conn = await asyncpg.connect(origin_url)
    try:
        origin_head = int(await conn.fetchval("SELECT seq FROM log_head WHERE id = 1"))
    finally:
        await conn.close()
    conn = await asyncpg.connect(url)
    try:
        replicas = int(
            await conn.fetchval(
                "SELECT count(*) FROM replica_versions WHERE origin_did = $1", origin_did
            )
        )
        quarantined = int(await conn.fetchval("SELECT count(*) FROM replica_quarantine"))
        cursor = int(
            await conn.fetchval(
                "SELECT coalesce(max(cursor), 0) FROM federation_peers WHERE peer_did = $1",
                origin_did,
            )
        )
        rows = await conn.fetch(
            "SELECT extract(epoch FROM at) AS at, data ->> 'latencyMs' AS latency FROM log"
            " WHERE kind = 'peer.status' AND data ->> 'peerDid' = $1 ORDER BY seq",
            origin_did,
        )
        ats = [float(r["at"]) for r in rows]
        gaps = [(b - a) * 1000 for a, b in itertools.pairwise(ats)]
        latency = [float(r["latency"]) for r in rows if r["latency"] is not None]
        sql_ms = {
            r["funcname"]: float(r["total_time"])
            for r in await conn.fetch(
                "SELECT funcname, total_time FROM pg_stat_user_functions"
                " WHERE funcname IN ('apply_peer_sync', 'append_changes')"
            )
        }
        return PullerFacts(
            replicas, quarantined, cursor, gaps, latency, len(rows), sql_ms, origin_head
        )
    finally:
        await conn.close()


def admin_view(port: int, admin: SigningKey) -> list[dict[str, Any]]:
    from cli.client import RegistryClient

    with RegistryClient(f"http://127.0.0.1:{port}") as client:
        client.sign_in(admin)
        return client.peer_status()


# --- the in-process pull, each piece timed --------------------------------------------------------

PIECES = (
    "request",  # build_request: the signed sync_request envelope
    "http",  # transport.post: the origin's answer over loopback (its work included)
    "parse",  # the rest of _pull: json.loads of the answer (and dumping the request)
    "verify_envelope",
    "read_sync_response",
    "sort_entries",  # check_replica of every entry (canonicalize, check_entry)
    "append_encode",  # append_payload: the change as JSON for append_changes
    "append_sql",  # store.append minus the encoding: the statement and its commit
    "append_wait",  # writer.append minus store.append: the writer actor's queueing
)


@dataclass
class Pieces:
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @contextmanager
    def timed(self, piece: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[piece] += time.perf_counter() - start
            self.calls[piece] += 1


@dataclass
class Breakdown:
    entries: int
    pages: int
    wall_s: float
    pieces: Pieces
    sync_page_ms: float  # the origin's sync_page query alone, mean of a few pages
    response_bytes: int  # mean
    profiled: bool
    check_whole_us: float = 0.0  # check_replica per entry, on one page of served entries
    check_steps_us: dict[str, float] = field(default_factory=dict)
    top: str = ""


async def _time_sync_page(origin_url: str, first_seq: int, page: int, budget: int) -> float:
    """The origin's page query alone (PgStore.sync_page), ms per page, over 5 pages."""
    from registry.store.pg import open_pg_store

    async with open_pg_store(origin_url) as store:
        await store.sync_page(first_seq - 1, page, budget)  # warm
        start = time.perf_counter()
        after = first_seq - 1
        for _ in range(5):
            rows, _head, _more = await store.sync_page(after, page, budget)
            after = rows[-1][0] if rows else after
        return (time.perf_counter() - start) / 5 * 1000


def pull_in_process(
    url: str,
    origin_url: str,
    origin_db: str,
    origin_did: str,
    puller: SigningKey,
    target_seq: int,
    first_seq: int,
    args: argparse.Namespace,
) -> Breakdown:
    import httpx
    import trio
    import trio_asyncio

    import actors.federation as fed
    import registry.store.pg as pg
    from actors.federation import FederationHandle, HttpTransport, PeerDeps, run_peer
    from actors.writer import run_writer
    from registry.config import FederationConfig, LimitsConfig, PeerConfig
    from registry.store.pg import open_pg_store
    from registry.usecases.common import now_ms

    pieces = Pieces()
    sizes: list[int] = []
    module = vars(fed)
    originals = {
        name: module[name]
        for name in ("build_request", "verify_envelope", "read_sync_response", "sort_entries")
    }
    original_payload = pg.append_payload

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            with pieces.timed(name):
                return fn(*a, **kw)

        return wrapper

    class TimedTransport:
        def __init__(self, inner: HttpTransport) -> None:
            self.inner = inner

        async def post(self, url: str, body: bytes) -> Any:
            with pieces.timed("http"):
                answer = await self.inner.post(url, body)
            sizes.append(len(answer.body))
            return answer

        async def get(self, url: str) -> Any:  # the peer's checkpoint (witnessing, issue 20)
            with pieces.timed("http"):
                return await self.inner.get(url)

    class TimedStore:
        def __init__(self, store: Any) -> None:
            self._store = store

        def __getattr__(self, name: str) -> Any:
            return getattr(self._store, name)

        async def append(self, items: Any) -> Any:
            with pieces.timed("append_store"):
                return await self._store.append(items)

    pull_time = {"s": 0.0}
    original_pull = fed._pull

    async def timed_pull(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return await original_pull(*a, **kw)
        finally:
            pull_time["s"] += time.perf_counter() - start

    limits = LimitsConfig()
    peer = PeerConfig(peer_did=origin_did, endpoint=origin_url.rstrip("/"), kinds=["sync"])
    config = FederationConfig(peers=[peer], poll_seconds=60, page_size=args.page_size)

    async def endpoint_of(_did: str) -> str:
        return peer.endpoint

    async def run() -> float:
        finished = trio.Event()
        end: dict[str, Any] = {}
        async with (
            trio_asyncio.open_loop(),
            open_pg_store(url) as store,
            httpx.AsyncClient(timeout=config.request_timeout_seconds) as client,
            trio.open_nursery() as nursery,
        ):
            writer = await nursery.start(run_writer, TimedStore(store))

            async def append(change: Any, idem: Any) -> Any:
                with pieces.timed("append"):
                    outcome = await writer.append(change, idem)
                if change.rows.get("cursor", 0) >= target_seq and not finished.is_set():
                    # The last page is stored: what was timed so far is the run (the actor
                    # goes on with the next request until it is cancelled).
                    end["t"] = time.perf_counter()
                    end["seconds"] = dict(pieces.seconds)
                    end["calls"] = dict(pieces.calls)
                    end["pull"] = pull_time["s"]
                    finished.set()
                return outcome

            handle = FederationHandle()
            deps = PeerDeps(
                store=store,
                append=append,
                key=puller,
                transport=TimedTransport(
                    HttpTransport(
                        client, max_bytes=limits.federation_body_bytes + 2 * limits.entry_body_bytes
                    )
                ),
                config=config,
                endpoint_of=endpoint_of,
                handle=handle,
                clock_ms=now_ms,
            )
            start = time.perf_counter()
            nursery.start_soon(run_peer, deps, peer)
            while not finished.is_set():
                state = handle.states.get(origin_did)
                if state is not None and state.breaker.consecutive_failures:
                    raise RuntimeError(f"in-process pull failed: {state.status_json(now_ms())}")
                with trio.move_on_after(0.05):
                    await finished.wait()
            nursery.cancel_scope.cancel()
        pieces.seconds = defaultdict(float, end["seconds"])
        pieces.calls = defaultdict(int, end["calls"])
        pull_time["s"] = end["pull"]
        return float(end["t"] - start)

    for name, fn in originals.items():
        module[name] = timed(
            {
                "build_request": "request",
                "verify_envelope": "verify_envelope",
                "read_sync_response": "read_sync_response",
                "sort_entries": "sort_entries",
            }[name],
            fn,
        )
    pg.append_payload = timed("append_encode", original_payload)
    module["_pull"] = timed_pull
    profiler = cProfile.Profile() if args.profile else None
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    docs = asyncio.run(_page_docs(origin_db, first_seq, args.page_size))
    try:
        if affinity is not None and (os.cpu_count() or 1) >= 2:
            os.sched_setaffinity(0, {1})  # where the puller process ran
        if profiler is not None:
            profiler.enable()
        try:
            wall = trio.run(run)
        finally:
            if profiler is not None:
                profiler.disable()
            for name, fn in originals.items():
                module[name] = fn
            module["_pull"] = original_pull
            pg.append_payload = original_payload
        whole_us, steps_us = split_check_replica(docs)
    finally:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)

    s = pieces.seconds
    # _pull = endpoint + request dump + post + json.loads + verify_envelope + read_sync_response
    s["parse"] = pull_time["s"] - s["http"] - s["verify_envelope"] - s["read_sync_response"]
    s["append_sql"] = s["append_store"] - s["append_encode"]
    s["append_wait"] = s["append"] - s["append_store"]
    budget = max(1024, limits.federation_body_bytes - 64 * 1024)
    sync_ms = trio_asyncio_run(_time_sync_page, origin_db, first_seq, args.page_size, budget)
    top = ""
    if profiler is not None:
        out = Path(args.profile) / "federation-pull.prof"
        profiler.dump_stats(out)
        log(f"profile: {out}")
        import io

        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        top = text.getvalue()
    return Breakdown(
        entries=target_seq - first_seq + 1,
        pages=pieces.calls["append"],
        wall_s=wall,
        pieces=pieces,
        sync_page_ms=sync_ms,
        response_bytes=int(statistics.mean(sizes)) if sizes else 0,
        profiled=profiler is not None,
        check_whole_us=whole_us,
        check_steps_us=steps_us,
        top=top,
    )


CHECK_STEPS = (
    "canonicalize entry",  # check_replica: JCS of the served entry (the replica's doc)
    "validate_model",  # check_entry: the pydantic RegistryEntry model (strict)
    "canonical_members",  # JCS of each member value
    "itemDataHash",  # SHA-256 of JCS(itemData)
    "key id → key",  # controller_of + public_key_from_key_id (did:key decoding)
    "signed payload",  # b64url_decode of the signature + join_members of the signed members
    "Ed25519 verify",  # nacl VerifyKey(...).verify
    "doc copy",  # the doc minus managed fields, CheckedEntry, lifecycle_of
)


def split_check_replica(docs: list[str]) -> tuple[float, dict[str, float]]:
    """check_replica of `docs` (served entries), then the same steps re-timed one by one: µs
    per entry of the whole and of each step (mirrors registry.entries.check_entry)."""
    from registry import canonical
    from registry.did import controller_of, public_key_from_key_id
    from registry.entries import MANAGED_FIELDS, UNSIGNED_FIELDS, CheckedEntry, lifecycle_of
    from registry.federation import check_replica
    from registry.keys import b64url_decode, verify
    from registry.models import RegistryEntry, validate_model

    entries = [json.loads(d) for d in docs]
    n = len(entries)
    start = time.perf_counter()
    for e in entries:
        check_replica(e)
    whole = (time.perf_counter() - start) / n * 1e6
    t = dict.fromkeys(CHECK_STEPS, 0.0)
    clock = time.perf_counter
    for e in entries:
        a = clock()
        canonical.canonicalize(e)
        b = clock()
        model = validate_model(RegistryEntry, e, code="entry_invalid")
        c = clock()
        members = canonical.canonical_members(e)
        d = clock()
        assert canonical.sha256_hex(members["itemData"].encode("utf-8")) == model.item_data_hash
        f = clock()
        key_id = model.signature.key_id
        assert controller_of(key_id) == model.publisher_did
        public_key = public_key_from_key_id(key_id)
        g = clock()
        signature = b64url_decode(model.signature.value)
        payload = canonical.join_members(
            {k: v for k, v in members.items() if k not in UNSIGNED_FIELDS}
        ).encode("utf-8")
        h = clock()
        assert verify(public_key, payload, signature)
        i = clock()
        doc = {k: v for k, v in e.items() if k not in MANAGED_FIELDS}
        CheckedEntry(doc=doc, members=members, model=model, based_on=model.sequence)
        lifecycle_of(doc)
        j = clock()
        for step, (x, y) in zip(
            CHECK_STEPS,
            [(a, b), (b, c), (c, d), (d, f), (f, g), (g, h), (h, i), (i, j)],
            strict=True,
        ):
            t[step] += y - x
    return whole, {k: v / n * 1e6 for k, v in t.items()}


async def _page_docs(origin_db: str, first_seq: int, count: int) -> list[str]:
    conn = await asyncpg.connect(origin_db)
    try:
        rows = await conn.fetch(
            "SELECT doc FROM entry_versions WHERE seq >= $1 ORDER BY seq LIMIT $2",
            first_seq,
            count,
        )
        return [r["doc"] for r in rows]
    finally:
        await conn.close()


def trio_asyncio_run(fn: Any, *args: Any) -> Any:
    import trio
    import trio_asyncio

    async def run() -> Any:
        async with trio_asyncio.open_loop():
            return await fn(*args)

    return trio.run(run)


# --- the report -------------------------------------------------------------------------------


def at_fraction(samples: list[Sample], total: int, fraction: float) -> Sample | None:
    for s in samples:
        if s.done >= math.ceil(total * fraction):
            return s
    return None


def report(
    args: argparse.Namespace,
    busy: float,
    seeded: Seeded,
    watch: Watch,
    facts: PullerFacts,
    cpu: dict[str, float],
    admin: list[dict[str, Any]] | None,
    breakdown: Breakdown | None,
) -> bool:
    width = 100
    total = seeded.last_seq - seeded.first_seq + 1
    assert watch.done_s is not None
    assert watch.first_page_s is not None
    rate = total / watch.done_s
    steady_s = watch.done_s - watch.first_page_s
    first_done = next(s.done for s in watch.samples if s.done)
    steady = (total - first_done) / steady_s if steady_s > 0 else float("nan")
    print()
    print("=" * width)
    print(f"federation sync: {total:,} entries, origin → puller over loopback; {git_revision()}")
    print(
        f"two `registry serve` (origin pinned to core 0, puller to core 1; PostgreSQL"
        f" {args.postgres}, shared, unpinned),\nanchoring off on both, puller page size"
        f" {args.page_size}; machine {busy:.0%} busy before start"
    )
    print(
        f"seeded {total:,} signed entry versions ({seeded.doc_bytes:,} bytes each as stored) in"
        f" {seeded.seconds:.1f}s ({seeded.publishers} publishers; SQL {seeded.sql_seconds:.1f}s,"
        f" {'append_changes' if seeded.mode == 'append' else 'set-based INSERT'})"
    )
    print("-" * width)
    ok = (
        facts.replicas == total
        and facts.quarantined == 0
        and seeded.last_seq <= facts.cursor <= facts.origin_head
    )
    mark = "MET" if rate >= TARGET else "NOT MET"
    print(
        f"entries/s from the puller's start      {rate:>8,.0f}   ({total:,} in {watch.done_s:.1f}s;"
        f" target ≥ {TARGET:,.0f}: {mark})"
    )
    print(
        f"entries/s first page → last page       {steady:>8,.0f}   (first page stored"
        f" {watch.first_page_s:.2f}s after the start)"
    )
    print(
        f"check: {facts.replicas:,} replica versions, {facts.quarantined} quarantined, cursor"
        f" {facts.cursor:,} (origin: last entry {seeded.last_seq:,}, log head"
        f" {facts.origin_head:,}): {'OK' if ok else 'MISMATCH'}"
    )
    if admin is not None:
        for p in admin:
            print(
                f"admin view: cursor {p.get('cursor')}, lag {p.get('lag')}, breaker"
                f" {p.get('breakerState')}, latencyMs {p.get('latencyMs')},"
                f" quarantines {p.get('quarantines')}"
            )
    print("-" * width)
    base = next((s for s in reversed(watch.samples) if s.done == 0), watch.samples[0])
    print("puller memory (VmRSS, MB) by share of the backlog stored:")
    cells = [f"start {base.rss_kb / 1024:.0f}"]
    marks: dict[float, Sample] = {}
    for f in MILESTONES:
        s = at_fraction(watch.samples, total, f)
        if s is not None:
            marks[f] = s
            cells.append(f"{f:.0%} {s.rss_kb / 1024:.0f}")
    peak = max(s.hwm_kb for s in watch.samples)
    max_rss = max(s.rss_kb for s in watch.samples)
    print(
        "  "
        + "   ".join(cells)
        + f"   peak (VmHWM) {peak / 1024:.0f}, max sampled {max_rss / 1024:.0f}"
    )
    later = [s for s in watch.samples if s.done >= 0.10 * total]
    first_half = [s.rss_kb for s in later if s.done < 0.55 * total]
    second_half = [s.rss_kb for s in later if s.done >= 0.55 * total]
    if len(later) >= 3 and first_half and second_half:
        # Least-squares slope of RSS over entries stored, from 10% on.
        mx = statistics.mean(s.done for s in later)
        my = statistics.mean(s.rss_kb for s in later)
        sxx = sum((s.done - mx) ** 2 for s in later)
        slope = sum((s.done - mx) * (s.rss_kb - my) for s in later) / sxx if sxx else 0.0
        grew = max(second_half) - max(first_half)
        flat = grew <= max(8 * 1024, 0.10 * max(first_half))
        print(
            f"  RSS over entries stored (10% → 100%, least squares): {slope * 1000:+.0f} KB per"
            f" 1,000 entries; highest RSS of 55–100% − of 10–55%: {grew / 1024:+.1f} MB:"
            f"\n  {'does not grow with the backlog' if flat else 'GROWS with the backlog'}"
            " (flat: that difference ≤ max(8 MB, 10%))"
        )
    print("-" * width)
    print(
        "CPU from the first page stored to the last, in cores:\n  "
        + ", ".join(f"{k} {v:.0%}" for k, v in cpu.items())
    )
    print("-" * width)
    gaps = sorted(facts.page_gaps_ms)
    if gaps:
        q = statistics.quantiles(gaps, n=10) if len(gaps) >= 2 else [gaps[0]] * 9
        print(
            f"pages: {facts.pages} peer.status changes; between page commits ms: median"
            f" {statistics.median(gaps):.0f}, p10 {q[0]:.0f}, p90 {q[-1]:.0f}, max {gaps[-1]:.0f}"
        )
    if facts.latency_ms:
        print(
            "  pull latency the breaker recorded (EWMA of request sent → answer parsed and its"
            " envelope verified), ms: median"
            f" {statistics.median(facts.latency_ms):.0f}, last {facts.latency_ms[-1]:.0f}"
        )
    if facts.sql_ms and facts.pages:
        sync = facts.sql_ms.get("apply_peer_sync", 0.0)
        print(
            f"  SQL apply_peer_sync {sync / facts.pages:.1f} ms/page, append_changes in all"
            f" {facts.sql_ms.get('append_changes', 0.0) / facts.pages:.1f} ms/page"
            " (pg_stat_user_functions)"
        )
    if breakdown is not None:
        b = breakdown
        print("-" * width)
        flag = "  (PROFILED: inflated)" if b.profiled else ""
        print(
            f"in process (actors.federation.run_peer, pinned to core 1): {b.entries:,} entries"
            f" in {b.pages} pages, {b.wall_s:.1f}s = {b.entries / b.wall_s:,.0f} entries/s{flag}"
        )
        print(f"  answer {b.response_bytes / 1e6:.2f} MB per page; per page, and per entry:")
        print(f"  {'piece':<20} {'ms/page':>9} {'µs/entry':>9} {'share':>6}")
        accounted = 0.0
        for piece in PIECES:
            sec = b.pieces.seconds.get(piece, 0.0)
            accounted += sec
            print(
                f"  {piece:<20} {sec / b.pages * 1000:>9.1f} {sec / b.entries * 1e6:>9.1f}"
                f" {sec / b.wall_s:>6.0%}"
            )
        rest = b.wall_s - accounted
        print(
            f"  {'other':<20} {rest / b.pages * 1000:>9.1f} {rest / b.entries * 1e6:>9.1f}"
            f" {rest / b.wall_s:>6.0%}"
        )
        print(
            f"  (origin: its sync_page query alone {b.sync_page_ms:.1f} ms/page; the rest of"
            " `http` is the origin's handler, signing and the transfer)"
        )
        if b.check_steps_us:
            print(
                f"  sort_entries re-timed on one page: check_replica {b.check_whole_us:.0f}"
                " µs/entry; its steps one by one, µs/entry:"
            )
            print(
                "    "
                + ", ".join(f"{k} {v:.1f}" for k, v in b.check_steps_us.items())
                + f" (sum {sum(b.check_steps_us.values()):.0f})"
            )
        if b.top:
            print("-" * width)
            print("cProfile of the in-process pull (tottime):")
            print(b.top)
    if not ok:
        print("\nTHIS RUN HAD ERRORS: the puller does not hold exactly the seeded entries.")
    print("=" * width)
    return ok


# --- the run ----------------------------------------------------------------------------------


def main_bench(args: argparse.Namespace) -> int:
    registry_bin = VENV_BIN / "registry"
    if not registry_bin.exists():
        print(f"no {registry_bin}: run this with the project's venv python", file=sys.stderr)
        return 2
    busy = idle_check()
    waited_until = time.monotonic() + args.wait_idle
    while busy > 0.1 and time.monotonic() < waited_until:
        log(f"machine {busy:.0%} busy (other processes); waiting for it to go idle")
        busy = idle_check(2.0)
    log(f"machine {busy:.0%} busy before start{'  WARNING: not idle' if busy > 0.1 else ''}")

    tag = secrets.token_hex(4)
    dbs = {name: f"registry_bench_fed_{tag}_{name}" for name in ("origin", "puller", "inproc")}
    urls = {name: f"{args.postgres}/{db}" for name, db in dbs.items()}
    workdir = Path(tempfile.mkdtemp(prefix="registry-bench-fed-"))
    created: list[str] = []
    servers: list[Server] = []
    ok = False
    try:
        for name, db in dbs.items():
            if name == "inproc" and not args.breakdown_entries:
                continue
            db_admin(args.postgres, f'CREATE DATABASE "{db}"')
            created.append(db)
            asyncio.run(migrate(urls[name]))
        db_admin(args.postgres, f"ALTER DATABASE \"{dbs['puller']}\" SET track_functions = 'pl'")

        log(f"seeding {args.entries:,} signed entries into {dbs['origin']}")
        seeded = asyncio.run(
            seed_origin(urls["origin"], args, f"did:web:origin.bench.example.com:{tag}:")
        )
        log(f"seeded in {seeded.seconds:.1f}s (SQL {seeded.sql_seconds:.1f}s)")

        origin_key, puller_key, admin_key = (SigningKey.generate() for _ in range(3))
        for name, key in (("origin", origin_key), ("puller", puller_key)):
            write_key_file(workdir / f"{name}.key", key)
        ports = {"origin": free_port(), "puller": free_port()}
        while ports["puller"] == ports["origin"]:
            ports["puller"] = free_port()

        def node_env(name: str, peer: SigningKey, peer_port: int, poll: float) -> dict[str, str]:
            return {
                **os.environ,
                **SERVICE_ENV,
                "REGISTRY_SERVER__KEY_FILE": str(workdir / f"{name}.key"),
                "REGISTRY_ANCHORING__ENABLED": "false",
                "REGISTRY_AUTH__ADMIN_DIDS": json.dumps([admin_key.did]),
                "REGISTRY_FEDERATION__PEERS": json.dumps(
                    [
                        {
                            "peer_did": peer.did,
                            "endpoint": f"http://127.0.0.1:{peer_port}",
                            "kinds": ["sync"],
                        }
                    ]
                ),
                "REGISTRY_FEDERATION__POLL_SECONDS": str(poll),
                "REGISTRY_FEDERATION__PAGE_SIZE": str(args.page_size),
            }

        def serve(name: str, core: int | None, env: dict[str, str]) -> Server:
            cmd = [
                str(registry_bin), "serve", "--host", "127.0.0.1", "--port", str(ports[name]),
                "--data-dir", str(workdir / f"data-{name}"), "--database-url", urls[name],
            ]  # fmt: skip
            server = start_server(name, cmd, ports[name], core, workdir, env)
            servers.append(server)
            return server

        two = (os.cpu_count() or 1) >= 2
        # The origin pulls from the puller too (it must list it as a sync peer to answer it):
        # once, at its start, then hourly; the puller has no local entries to serve.
        origin = serve(
            "origin", 0 if two else None, node_env("origin", puller_key, ports["puller"], 3600)
        )
        wait_ready(origin, "/v1/health", 60, want=lambda b: b.get("status") == "ok")
        log(f"origin up on :{origin.port} (pid {origin.pid}), {origin_key.did[:32]}…")

        started = time.perf_counter()
        puller = serve(
            "puller", 1 if two else None, node_env("puller", origin_key, ports["origin"], 1)
        )
        log(f"puller started (pid {puller.pid}); pulling {args.entries:,} entries")
        pids = {origin.pid, puller.pid}
        watch = asyncio.run(
            watch_puller(
                puller,
                urls["puller"],
                origin_key.did,
                seeded,
                started,
                args,
                origin.pid,
                pids,
                [dbs["origin"], dbs["puller"]],
            )
        )
        pg_pids = pids - {origin.pid, puller.pid}
        assert watch.done_s is not None
        assert watch.first_page_s is not None
        log(f"puller has every entry after {watch.done_s:.1f}s")
        wait_ready(puller, "/v1/health", 30, want=lambda b: b.get("status") == "ok")
        admin: list[dict[str, Any]] | None
        try:
            admin = admin_view(puller.port, admin_key)
        except Exception as exc:  # the view is a cross-check only
            log(f"admin view failed: {exc!r}")
            admin = None
        facts = asyncio.run(puller_facts(urls["puller"], urls["origin"], origin_key.did))

        span = watch.done_s - watch.first_page_s
        first, last = watch.at_first, watch.at_done
        assert first is not None
        assert last is not None
        span = max(span, 1e-9)
        pg_cpu = cpu_delta(
            {p: v for p, v in first.cpu.items() if p in pg_pids},
            {p: v for p, v in last.cpu.items() if p in pg_pids},
        )
        puller_cpu = last.cpu.get(puller.pid, 0) - first.cpu.get(puller.pid, 0)
        origin_cpu = last.cpu.get(origin.pid, 0) - first.cpu.get(origin.pid, 0)
        cores = os.cpu_count() or 1
        machine = (last.busy[0] - first.busy[0]) / max(1, last.busy[1] - first.busy[1]) * cores
        cpu = {
            "puller": puller_cpu / span,
            "puller runnable, waiting for a core": (last.puller_wait - first.puller_wait) / span,
            "origin": origin_cpu / span,
            "origin runnable, waiting": (last.origin_wait - first.origin_wait) / span,
            "PostgreSQL": pg_cpu / span,
            "others (outside the bench)": max(
                0.0, machine - (puller_cpu + origin_cpu + pg_cpu) / span
            ),
        }
        stop_server(puller)

        breakdown = None
        if args.breakdown_entries:
            n = min(args.breakdown_entries, args.entries)
            log(f"in-process pull of {n:,} entries, each piece timed")
            breakdown = pull_in_process(
                urls["inproc"],
                f"http://127.0.0.1:{origin.port}",
                urls["origin"],
                origin_key.did,
                puller_key,
                seeded.first_seq + n - 1,
                seeded.first_seq,
                args,
            )
        ok = report(args, busy, seeded, watch, facts, cpu, admin, breakdown)
        return 0 if ok else 1
    finally:
        for server in reversed(servers):
            try:
                stop_server(server)
            except Exception as exc:  # keep cleaning up
                print(f"stopping {server.name}: {exc!r}", file=sys.stderr)
            if not ok:
                tail = server.log_tail(15)
                if tail.strip():
                    print(f"--- {server.name} log ---\n{tail}", file=sys.stderr)
        for db in created:
            if args.keep_db:
                log(f"database kept: {db}")
                continue
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
    parser.add_argument("--entries", type=int, default=100_000, help="entries to sync (100000)")
    parser.add_argument(
        "--page-size", type=int, default=1000, help="the puller's federation.page_size (1000)"
    )
    parser.add_argument(
        "--interval", type=float, default=0.1, help="seconds between samples of the puller (0.1)"
    )
    parser.add_argument(
        "--deadline", type=float, default=900.0, help="give up after S seconds of pulling (900)"
    )
    parser.add_argument(
        "--breakdown-entries",
        type=int,
        default=20_000,
        help="entries of the in-process timed pull (20000; 0: skip it)",
    )
    parser.add_argument("--profile", metavar="DIR", help="cProfile the in-process pull into DIR")
    parser.add_argument("--sign-workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--publishers", type=int, default=100, help="publisher keys signing the entries (100)"
    )
    parser.add_argument(
        "--seed-via",
        choices=("sql", "append"),
        default="sql",
        help="seed with one set-based INSERT per 1,000 entries (sql, the default) or through"
        " append_changes, the append path itself (append: ~3x slower)",
    )
    parser.add_argument(
        "--postgres",
        default=os.environ.get("BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432"),
        help="PostgreSQL server URL without a database (fresh databases are created and dropped)",
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=30.0,
        metavar="S",
        help="wait up to S seconds for the machine to be <10%% busy before starting (30)",
    )
    parser.add_argument("--keep-db", action="store_true", help="do not drop the bench databases")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the logs and keys")
    args = parser.parse_args()
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)

    def stop(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # the cleanup in main_bench runs (servers, databases, workdir)

    signal.signal(signal.SIGTERM, stop)
    return main_bench(args)


if __name__ == "__main__":
    sys.exit(main())
