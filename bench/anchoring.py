#!/usr/bin/env python3
"""Anchoring throughput: 100,000 pending intents → confirmed, at several batch sizes.

For each batch size (default 100,000, 10,000 and 1,000), on a fresh database
`registry_bench_anc_<hex>` of the local PostgreSQL server (created, migrated, dropped):

  * inserts `--intents` pending anchor intents in one INSERT ... SELECT generate_series
    (`ai_<n>`, a did:web entry DID, sequence n, operation `create`, a 64-hex item_data_hash =
    SHA-256 of a distinct text), and moves the log head past them as if they had been written;
  * runs what `registry serve` runs for anchoring, in this process: the writer actor
    (actors/writer.run_writer) for the append path, the anchoring supervisor
    (actors/anchoring.run_anchoring over PgStore, leadership included), and a LocalChainClient
    over an in-memory LocalChain with instant blocks (`block_interval_seconds = 0`: every chain
    call seals a block) and `finality_depth` 3, until every intent is confirmed;
  * checks in the database that every intent is confirmed with exactly one confirmed receipt;
  * measures the proofs at that batch size: path length and bytes of the JSON proof (as served),
    and the time to verify one proof and every proof of one batch the way a client does
    (MerkleProof.from_json of the served JSON, leaf_hash recomputed from (entryDid, sequence,
    itemDataHash), verify_proof);
  * measures what a proof of an entry in that batch costs `GET /v1/anchors/{did}` (the intent
    read, and its proof sliced out of the batch's stored tree: `Anchors._stored_proofs`, one
    round trip), and what rebuilding the tree costs instead (`Anchors._tree`: the members read,
    the leaf hashes and the tree; what a batch submitted before migration 0025 still costs), and
    the longest the event loop could not run meanwhile (a 5 ms ticker).

It prints one row per batch size: intents/s (wall clock, from the supervisor's start to the last
confirmation), and where the time went:

  claim    the `anchor.claimed` change (append path: payload, SQL apply_anchor_claim, the result
           of the batch's members as JSON), decoding it into members
  reread   `open_anchor_batches`: the open batch read back from the database (each poll of a
           batch that is not final yet reads it again)
  tree     Merkle trees built by the supervisor (leaf hashes + the tree), one per advance
  submit   chain.submit + record_anchor_submission
  status   chain.status polls
  settle   the `anchor.settled` change (append path: building and encoding the change with one
           `anchor.updated` record per intent, SQL apply_anchor_settle, the log records)
  other    the rest of the wall time (the supervisor's own Python, the pending check, the
           writer, scheduling)

and, from pg_stat_user_functions (track_functions = 'pl' on the bench database), the time
PostgreSQL spent in apply_anchor_claim, in apply_anchor_settle, and in the rest of
append_changes (parsing the changes, writing the log records).

The issue's target is ≥ 20,000 intents/s. Missing it does not change the exit status; a run
that does not confirm every intent exactly once exits 1. PostgreSQL is shared and this runs in
one process: on a 2-core machine, other load moves the figures by 2x (the run waits up to
`--wait-idle` seconds for a quiet machine and prints how busy it was).

    .venv/bin/python bench/anchoring.py                       # ~3 minutes
    .venv/bin/python bench/anchoring.py --batch-sizes 1000 --intents 20000
    .venv/bin/python bench/anchoring.py --profile /tmp/anc    # cProfile of each row into DIR
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import secrets
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if __name__ == "__main__" and str(ROOT) not in sys.path:  # run as a script: import `bench`
    sys.path.insert(0, str(ROOT))

import asyncpg  # noqa: E402
import trio  # noqa: E402
import trio_asyncio  # noqa: E402

import actors.anchoring as anchoring_actor  # noqa: E402
import registry.anchoring  # noqa: E402
from actors.anchoring import AnchoringHandle, run_anchoring  # noqa: E402
from actors.chain import LocalChainClient  # noqa: E402
from actors.writer import Writer, run_writer  # noqa: E402
from bench.entries import db_admin, git_revision, idle_check, log  # noqa: E402
from registry.anchoring import ChainStatus, Member  # noqa: E402
from registry.chain import LocalChain  # noqa: E402
from registry.changes import Change, IdemKey, Outcome  # noqa: E402
from registry.config import AnchoringConfig  # noqa: E402
from registry.merkle import MerkleProof, MerkleTree, leaf_hash, verify_proof  # noqa: E402
from registry.store import OpenBatch  # noqa: E402
from registry.store.migrate import _migrate, load_migrations  # noqa: E402
from registry.store.pg import PgStore, open_pg_store  # noqa: E402
from registry.usecases.anchors import Anchors  # noqa: E402
from registry.usecases.common import now_ms  # noqa: E402

TARGET = 20_000.0  # intents/s
PHASES = ("claim", "reread", "tree", "submit", "status", "settle")


# --- timing the supervisor's phases ----------------------------------------------------------


@dataclass
class Phases:
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start
            self.calls[phase] += 1


class TimedStore:
    """PgStore with the supervisor's reads and bookkeeping timed (everything else delegated)."""

    def __init__(self, store: PgStore, phases: Phases) -> None:
        self._store = store
        self._phases = phases

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def open_anchor_batches(self) -> list[OpenBatch]:
        with self._phases.timed("reread"):
            return await self._store.open_anchor_batches()

    async def record_anchor_submission(
        self, batch_id: int, root: str, transaction_id: str, levels: bytes, leaves: int
    ) -> None:
        with self._phases.timed("submit"):
            await self._store.record_anchor_submission(
                batch_id, root, transaction_id, levels, leaves
            )


class TimedChain:
    def __init__(self, client: LocalChainClient, phases: Phases) -> None:
        self._client = client
        self._phases = phases

    async def submit(self, root: str, *, key: str) -> str:
        with self._phases.timed("submit"):
            return await self._client.submit(root, key=key)

    async def status(self, tx_id: str) -> ChainStatus:
        with self._phases.timed("status"):
            return await self._client.status(tx_id)


class TimedAppend:
    """The writer's append with the claims and settles timed, and an event once `intents`
    intents were confirmed (counted from the settle changes that were applied)."""

    NAMES: ClassVar[dict[str, str]] = {"anchor.claimed": "claim", "anchor.settled": "settle"}

    def __init__(self, writer: Writer, phases: Phases, intents: int) -> None:
        self._writer = writer
        self._phases = phases
        self._left = intents
        self.all_confirmed = trio.Event()

    async def __call__(self, change: Change, idem: IdemKey | None) -> Outcome:
        with self._phases.timed(self.NAMES.get(change.kind, change.kind)):
            outcome = await self._writer.append(change, idem)
        rows = change.rows
        settled = change.kind == "anchor.settled" and outcome.refusal is None
        if settled and rows["outcome"] == "confirmed":
            self._left -= len(rows["intents"])
            if self._left <= 0:
                self.all_confirmed.set()
        return outcome


@contextmanager
def timed_trees(phases: Phases) -> Iterator[None]:
    """Time the supervisor's `tree_of` (a global of its module) while inside."""
    module = vars(anchoring_actor)
    original = registry.anchoring.tree_of

    def tree_of(members: list[Member]) -> MerkleTree:
        with phases.timed("tree"):
            return original(members)

    module["tree_of"] = tree_of
    try:
        yield
    finally:
        module["tree_of"] = original


# --- one row ---------------------------------------------------------------------------------


@dataclass
class Row:
    batch_size: int
    intents: int
    wall_s: float
    batches: int
    phases: Phases
    sql_ms: dict[str, float]
    path_len: int
    max_path_len: int
    proof_bytes: int
    verify_one_us: float
    verify_batch_s: float
    batch_members: int
    proof_s: float
    read_s: float
    stall_s: float
    checked: bool
    problems: list[str]

    @property
    def rate(self) -> float:
        return self.intents / self.wall_s if self.wall_s else 0.0


# The intents and their queue rows, as apply_entry_version writes them (migration 0020).
SEED_SQL = """
WITH intents AS (
    INSERT INTO anchor_intents (intent_id, entry_did, sequence, operation, item_data_hash)
    SELECT 'ai_' || g, 'did:web:agents.example.com:bench:' || lpad(g::text, 7, '0'), g,
           'create', encode(sha256(convert_to('bench item data ' || g, 'UTF8')), 'hex')
      FROM generate_series(1, $1::bigint) AS g
    RETURNING sequence, intent_id, available_at
)
INSERT INTO anchor_queue (sequence, intent_id, available_at)
SELECT sequence, intent_id, available_at FROM intents;
"""


async def seed(url: str, intents: int) -> float:
    conn = await asyncpg.connect(url)
    try:
        start = time.perf_counter()
        async with conn.transaction():
            await conn.execute(SEED_SQL, intents)
            # As if the intents' versions had been written: the log head is past them.
            await conn.execute("UPDATE log_head SET seq = $1 WHERE id = 1", intents)
        await conn.execute("VACUUM ANALYZE anchor_intents")
        return time.perf_counter() - start
    finally:
        await conn.close()


async def check(
    url: str, intents: int
) -> tuple[bool, list[str], dict[str, float], int, list[Member]]:
    """Every intent confirmed with exactly one confirmed receipt; the SQL functions' time;
    the first batch's id and members (leaf order)."""
    conn = await asyncpg.connect(url)
    problems: list[str] = []
    try:
        by_state = dict(
            await conn.fetch("SELECT state, count(*) FROM anchor_intents GROUP BY state")
        )
        if by_state != {"confirmed": intents}:
            problems.append(f"intent states {by_state}")
        bad = await conn.fetchval(
            "SELECT count(*) FROM (SELECT r.intent_id FROM anchor_receipts r"
            " JOIN anchor_batches b USING (batch_id) GROUP BY r.intent_id"
            " HAVING count(*) FILTER (WHERE b.state = 'confirmed') <> 1) AS x"
        )
        if bad:
            problems.append(f"{bad} intents without exactly one confirmed receipt")
        events = await conn.fetchval(
            "SELECT count(*) FROM log"
            " WHERE kind = 'anchor.updated' AND data ->> 'state' = 'confirmed'"
        )
        if events != intents:
            problems.append(f"{events} anchor.updated confirmed records for {intents} intents")
        sql_ms = {
            r["funcname"]: float(r["total_time"])
            for r in await conn.fetch(
                "SELECT funcname, total_time FROM pg_stat_user_functions"
                " WHERE funcname IN ('apply_anchor_claim', 'apply_anchor_settle', 'append_changes')"
            )
        }
        batch_id = int(await conn.fetchval("SELECT min(batch_id) FROM anchor_batches"))
        first = await conn.fetch(
            "SELECT i.intent_id, i.entry_did, i.sequence, i.item_data_hash, i.attempts"
            " FROM anchor_receipts r JOIN anchor_intents i USING (intent_id)"
            " WHERE r.batch_id = $1 ORDER BY r.leaf_index",
            batch_id,
        )
        return not problems, problems, sql_ms, batch_id, [Member(*m) for m in first]
    finally:
        await conn.close()


async def anchor_all(
    url: str, config: AnchoringConfig, intents: int, phases: Phases
) -> tuple[float, int]:
    """Run the writer and the supervisor until every intent is confirmed: (wall seconds,
    batches)."""
    chain = LocalChain()
    client = TimedChain(LocalChainClient(chain, instant=True, clock_ms=now_ms), phases)
    handle = AnchoringHandle()
    async with (
        trio_asyncio.open_loop(),
        open_pg_store(url) as store,
        trio.open_nursery() as nursery,
    ):
        writer: Writer = await nursery.start(partial(run_writer, store))
        append = TimedAppend(writer, phases, intents)
        start = time.perf_counter()
        with timed_trees(phases):
            nursery.start_soon(
                partial(
                    run_anchoring,
                    TimedStore(store, phases),
                    append,
                    client,
                    config,
                    handle=handle,
                    clock_ms=now_ms,
                )
            )
            await append.all_confirmed.wait()
            wall = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    return wall, handle.stats.batches


async def read_miss(url: str, batch_id: int, intent_id: str) -> tuple[float, float, float]:
    """What a proof of `intent_id` (a member of the batch) costs `GET /v1/anchors/{did}`: the
    intent read and its proof sliced out of the stored tree; what rebuilding the tree costs
    instead (`Anchors._tree`: the members read, leaf hashes, the tree), and the longest the event
    loop went without running meanwhile (a ticker every 5 ms)."""
    async with trio_asyncio.open_loop(), open_pg_store(url) as store:
        # Only the tree cache is used: the other collaborators are not needed.
        anchors = Anchors(
            store=store,
            changes=None,  # type: ignore[arg-type]
            entries=None,  # type: ignore[arg-type]
            config=None,  # type: ignore[arg-type]
            secret=b"bench",
        )
        stall = 0.0
        done = trio.Event()

        async def ticker() -> None:
            nonlocal stall
            last = time.perf_counter()
            while not done.is_set():
                await trio.sleep(0.005)
                now = time.perf_counter()
                stall = max(stall, now - last - 0.005)
                last = now

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0.02)
            for _ in range(2):  # the second: the statements prepared, as on a serving process
                start = time.perf_counter()
                row = await store.get_anchor_intent(intent_id)
                assert row is not None
                proofs = await anchors._stored_proofs([row])
                sliced = time.perf_counter() - start
            assert len(proofs) == 1, "the intent's confirmed receipt has its stored proof"
            start = time.perf_counter()
            await anchors._tree(batch_id)
            elapsed = time.perf_counter() - start
            done.set()
    return sliced, elapsed, stall


def measure_proofs(members: list[Member]) -> tuple[int, int, int, float, float]:
    """(path length of the first leaf's proof, the longest path, bytes of its JSON proof,
    µs to verify one proof, s to verify every proof of the batch), verified as a client does."""
    tree = MerkleTree([m.leaf for m in members])
    proofs = tree.proofs()
    served = [json.dumps(p.to_json(), separators=(",", ":")) for p in proofs]
    first = proofs[0]

    def verify(member: Member, text: str) -> bool:
        proof = MerkleProof.from_json(json.loads(text))
        leaf = leaf_hash(member.entry_did, member.sequence, member.item_data_hash)
        return verify_proof(proof, leaf)

    runs = []
    for _ in range(5):
        reps = 2000
        start = time.perf_counter()
        for _ in range(reps):
            assert verify(members[0], served[0])
        runs.append((time.perf_counter() - start) / reps * 1e6)
    start = time.perf_counter()
    assert all(verify(m, s) for m, s in zip(members, served, strict=True))
    batch_s = time.perf_counter() - start
    return (
        len(first.path),
        max(len(p.path) for p in proofs),
        len(served[0].encode()),
        statistics.median(runs),
        batch_s,
    )


def run_row(args: argparse.Namespace, batch_size: int) -> Row:
    db = f"registry_bench_anc_{secrets.token_hex(4)}"
    url = f"{args.postgres}/{db}"
    db_admin(args.postgres, f'CREATE DATABASE "{db}"')
    try:
        import asyncio

        db_admin(args.postgres, f"ALTER DATABASE \"{db}\" SET track_functions = 'pl'")
        asyncio.run(_migrate(url, load_migrations()))
        seeded = asyncio.run(seed(url, args.intents))
        log(f"batch size {batch_size:,}: {args.intents:,} pending intents seeded in {seeded:.1f}s")
        config = AnchoringConfig(
            enabled=True,
            batch_size=batch_size,
            block_interval_seconds=0,
            finality_depth=args.finality,
            max_attempts=5,
        )
        phases = Phases()
        profiler = cProfile.Profile() if args.profile else None
        if profiler is not None:
            profiler.enable()
        wall, batches = trio.run(anchor_all, url, config, args.intents, phases)
        if profiler is not None:
            profiler.disable()
            out = Path(args.profile) / f"anchoring-{batch_size}.prof"
            profiler.dump_stats(out)
            log(f"profile: {out}")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
        log(f"batch size {batch_size:,}: confirmed in {wall:.2f}s ({args.intents / wall:,.0f}/s)")
        ok, problems, sql_ms, batch_id, first = asyncio.run(check(url, args.intents))
        proof_s, read_s, stall_s = trio.run(read_miss, url, batch_id, first[-1].intent_id)
        path_len, max_len, proof_bytes, one_us, batch_s = measure_proofs(first)
        return Row(
            batch_size,
            args.intents,
            wall,
            batches,
            phases,
            sql_ms,
            path_len,
            max_len,
            proof_bytes,
            one_us,
            batch_s,
            len(first),
            proof_s,
            read_s,
            stall_s,
            ok,
            problems,
        )
    finally:
        if args.keep_db:
            log(f"database kept: {db}")
        else:
            db_admin(args.postgres, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


# --- the report ------------------------------------------------------------------------------


def report(rows: list[Row], args: argparse.Namespace, busy: float) -> bool:
    width = 124
    print()
    print("=" * width)
    print(f"anchoring: {args.intents:,} pending intents → confirmed; service at {git_revision()}")
    print(
        "writer actor + supervisor (run_anchoring over PgStore) + LocalChainClient, instant"
        f" blocks, finality_depth {args.finality};\nPostgreSQL {args.postgres} (shared, a fresh"
        f" database per row); one process, wall clock; machine {busy:.0%} busy before start"
    )
    print("-" * width)
    print(
        f"{'batch size':>10} {'batches':>7} {'wall s':>7} {'intents/s':>10} {'target':>7}"
        f" {'path':>5} {'proof B':>7} {'verify 1 µs':>11} {'verify batch s':>14}"
        f" {'(batch of)':>10} {'proof read ms':>13} {'tree build s':>12} {'loop stall ms':>13}"
    )
    clean = True
    for r in rows:
        mark = "✓" if r.rate >= TARGET else "✗"
        path = f"{r.path_len}" if r.path_len == r.max_path_len else f"{r.path_len}-{r.max_path_len}"
        print(
            f"{r.batch_size:>10,} {r.batches:>7,} {r.wall_s:>7.2f} {r.rate:>10,.0f}"
            f" {'≥20k' + mark:>7} {path:>5} {r.proof_bytes:>7,} {r.verify_one_us:>11.1f}"
            f" {r.verify_batch_s:>14.2f} {r.batch_members:>10,} {r.proof_s * 1000:>13.2f}"
            f" {r.read_s:>12.2f}"
            f" {r.stall_s * 1000:>13.0f}"
        )
        clean = clean and r.checked
    print("-" * width)
    print(
        "where the wall time went (s, calls in parentheses; the phases are disjoint), and"
        " PostgreSQL's time (pg_stat_user_functions, s)\nin apply_anchor_claim, in"
        " apply_anchor_settle, and in the rest of append_changes (parsing, the log records):"
    )
    header = " ".join(f"{p:>13}" for p in (*PHASES, "other"))
    print(f"{'batch size':>10} {header} {'sql claim':>9} {'sql settle':>10} {'sql rest':>8}")
    for r in rows:
        cells = [f"{r.phases.seconds[p]:>6.2f} ({r.phases.calls[p]:>4,})" for p in PHASES]
        other = r.wall_s - sum(r.phases.seconds[p] for p in PHASES)
        cells.append(f"{other:>13.2f}")
        claim_s = r.sql_ms.get("apply_anchor_claim", 0) / 1000
        settle_s = r.sql_ms.get("apply_anchor_settle", 0) / 1000
        # append_changes' own work around the handlers: parsing the changes, one log record
        # per change and per `also` record (an anchor.updated per confirmed intent).
        rest_s = r.sql_ms.get("append_changes", 0) / 1000 - claim_s - settle_s
        print(
            f"{r.batch_size:>10,} {' '.join(cells)}"
            f" {claim_s:>9.2f} {settle_s:>10.2f} {rest_s:>8.2f}"
        )
    print("-" * width)
    print(
        "path: proof path length of the first batch's first leaf (and the longest); proof B:"
        " bytes of its JSON proof as served.\nverify: MerkleProof.from_json + leaf_hash"
        " recomputed + verify_proof: one proof (median µs), every proof of the first batch (s;"
        "\nits size in `batch of`). proof read: what GET /v1/anchors pays for the proof of an entry"
        " in that batch (the intent read, its proof\nsliced out of the stored tree); tree build:"
        " rebuilding the tree instead (Anchors._tree: members read, leaf hashes, tree;\nbatches"
        " submitted before migration 0025); loop stall: the longest the event loop could not run"
        " during the two."
    )
    for r in rows:
        if r.problems:
            print(f"PROBLEMS batch size {r.batch_size:,}: " + "; ".join(r.problems))
    if not clean:
        print("\nTHIS RUN HAD ERRORS: not every intent was confirmed exactly once.")
    print("=" * width)
    return clean


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--intents", type=int, default=100_000, help="pending intents (100000)")
    parser.add_argument(
        "--batch-sizes",
        default="100000,10000,1000",
        help="comma-separated batch sizes, one row each (100000,10000,1000)",
    )
    parser.add_argument("--finality", type=int, default=3, help="finality depth (3)")
    parser.add_argument(
        "--postgres",
        default=os.environ.get("BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432"),
        help="PostgreSQL server URL without a database (a fresh database per row)",
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=30.0,
        metavar="S",
        help="wait up to S seconds for the machine to be <10%% busy before starting (30)",
    )
    parser.add_argument("--profile", metavar="DIR", help="cProfile each row into DIR")
    parser.add_argument("--keep-db", action="store_true", help="do not drop the bench databases")
    args = parser.parse_args()
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    busy = idle_check()
    waited_until = time.monotonic() + args.wait_idle
    while busy > 0.1 and time.monotonic() < waited_until:
        log(f"machine {busy:.0%} busy (other processes); waiting for it to go idle")
        busy = idle_check(2.0)
    warning = "  WARNING: not idle, figures may be low" if busy > 0.1 else ""
    log(f"machine {busy:.0%} busy before start{warning}")
    rows = [run_row(args, size) for size in sizes]
    return 0 if report(rows, args, busy) else 1


if __name__ == "__main__":
    sys.exit(main())
