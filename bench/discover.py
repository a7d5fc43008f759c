#!/usr/bin/env python3
"""Latency and throughput of discovery (POST /v1/discover and /v1/discover/registryql).

One run, on a fresh database `registry_bench_disc_<hex>` of the local PostgreSQL server:
  * migrates it (`registry migrate`), seeds 100,000 realistic entries with bench/seed.py (tags,
    text, service types, publishers, teams, relationships, dates) and VACUUM ANALYZEs them;
  * starts one `registry serve` (rate limits raised) pinned to core 0;
  * checks that every query variant answers 200 with a non-empty result;
  * drives it with wrk pinned to core 1 (-t1, 16 connections, bench/lua/discover.lua):
      - get_entry (GET /v1/entries/<did of a seeded entry>), before and after the discovery rows;
      - the mix of every query shape below, shuffled;
      - the zipf mix: 10,000 distinct queries with Zipf popularity while entries are written,
        with the result cache's hit rate (X-Cache);
      - each query shape on its own (a short run each, so its percentiles are its own);
  * prints req/s, p50/p99, non-2xx, the CPU of the server and of PostgreSQL per request, the CPU
    used by other processes meanwhile, and the targets of the issue:
      p99 < 50 ms for every indexed-filter and text-search shape,
      mix throughput ≥ 0.40 × get_entry throughput (same run);
  * times each variant's two statements (page and totalCount, from compile_discover) alone on one
    connection, and for each shape that misses its p99 target prints EXPLAIN (ANALYZE, BUFFERS)
    of its slowest variant (the server idle).
The helpers for processes, wrk output, CPU accounting and cleanup are bench/entries.py's.

    .venv/bin/python bench/discover.py                  # ~3-4 minutes
    .venv/bin/python bench/discover.py --shape-duration 3 --only text,tags
    .venv/bin/python bench/discover.py --explain all    # plans of every shape, not only misses

Exit status: 0 when every measured run was clean (only 2xx, no socket errors, every variant
answered with results), 1 otherwise, 2 when a prerequisite is missing. Missing a target does not
change the exit status (as in bench/entries.py); the table says MET / NOT MET.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(ROOT))

from bench.entries import (  # noqa: E402
    SERVICE_ENV,
    VENV_BIN,
    Measurement,
    Server,
    WrkResult,
    all_processes,
    cpu_delta,
    cpu_snapshot,
    db_admin,
    fmt,
    free_port,
    git_revision,
    idle_check,
    log,
    machine_busy,
    parse_wrk_output,
    pinned,
    postgres_pids,
    proc_cpu,
    start_server,
    stop_server,
    wait_ready,
    wrk_version,
)

LUA = HERE / "lua" / "discover.lua"
P99_TARGET_MS = 50.0
MIX_TARGET = 0.40  # mix req/s ≥ 0.40 × get_entry req/s
SERVER_CORE, WRK_CORE = 0, 1

# --- the query shapes ----------------------------------------------------------------------
# Values come from bench/seed.py's vocabulary so that every variant has results: names
# "<Word> <word> agent <i>", tags {word0, word3, tag-<i % 200>}, publishers
# did:key:z6MkPublisher<i % 1000>, service type SERVICE_TYPES[i % 8], team-<i % 50>, tier i % 3,
# relationships dependsOn did:web:base:<i % 100> on every 20th entry, ToolDefinition every 10th,
# publishedAt within the year before 2026-11-01.


@dataclass(frozen=True)
class Shape:
    name: str
    kind: str  # "discover" (POST /v1/discover), "registryql", "get"
    variants: tuple[Any, ...]  # request bodies (dicts) or RegistryQL texts
    target: bool  # the p99 target applies (indexed filter or text search)
    weight: int = 1  # lines per variant in the mix
    what: str = ""

    def lines(self) -> list[str]:
        out = []
        for v in self.variants:
            if self.kind == "discover":
                out.append("POST /v1/discover " + json.dumps(v, separators=(",", ":")))
            elif self.kind == "registryql":
                out.append(
                    "POST /v1/discover/registryql "
                    + json.dumps({"query": v}, separators=(",", ":"))
                )
            else:
                out.append(f"GET {v}")
        return out


def pub(n: int) -> str:
    return f"did:key:z6MkPublisher{n:04d}"


SHAPES: list[Shape] = [
    Shape("all", "discover", ({},), False, what="{} (everything, newest first)"),
    Shape(
        "text",
        "discover",
        (
            {"text": "summarize invoice"},
            {"text": "translate legal contract"},
            {"text": "security audit"},
            {"text": "medical research"},
            {"text": "schedule travel"},
            {"text": "classify email"},
        ),
        True,
        weight=2,
        what="text: 2-3 words, by relevance",
    ),
    Shape(
        "text-1word",
        "discover",
        ({"text": "invoice"}, {"text": "weather"}, {"text": "compliance"}, {"text": "robot"}),
        True,
        what="text: one word (~8% of entries match)",
    ),
    Shape(
        "tags",
        "discover",
        (
            {"tags": ["tag-17", "legal"]},
            {"tags": ["finance", "tag-42"]},
            {"tags": ["security", "audit"]},
            {"tags": ["tag-108", "code"]},
        ),
        True,
        what="tags all-of",
    ),
    Shape(
        "anyTags",
        "discover",
        (
            {"anyTags": ["tag-3", "tag-4"]},
            {"anyTags": ["ocr", "invoice"]},
            {"anyTags": ["tag-150", "tag-151", "tag-152"]},
        ),
        True,
        what="anyTags",
    ),
    Shape(
        "publisher",
        "discover",
        tuple({"publisherDid": pub(n)} for n in (42, 7, 512, 999)),
        True,
        what="publisherDid",
    ),
    Shape(
        "service+type",
        "discover",
        (
            {"entryType": "ToolDefinition", "serviceType": "A2A"},
            {"entryType": "AgentDefinition", "serviceType": "MCP"},
            {"entryType": "ToolDefinition", "serviceType": "REST"},
            {"entryType": "AgentDefinition", "serviceType": "gRPC"},
        ),
        True,
        what="serviceType + entryType",
    ),
    Shape(
        "metadata",
        "discover",
        tuple({"metadata": {"team": f"team-{n}"}} for n in (7, 21, 33, 48)),
        True,
        what="metadata team",
    ),
    Shape(
        "relationship",
        "discover",
        (
            {"relationship": {"targetDid": "did:web:base:40"}},
            {"relationship": {"targetDid": "did:web:base:80", "relationshipType": "dependsOn"}},
            {"relationship": {"targetDid": "did:web:base:0"}},
        ),
        True,
        what="relationship targetDid",
    ),
    Shape(
        "published",
        "discover",
        (
            {"publishedAfter": "2026-10-25T00:00:00Z"},
            {"publishedAfter": "2026-10-31T00:00:00Z"},
            {"publishedAfter": "2026-03-01T00:00:00Z", "publishedBefore": "2026-03-08T00:00:00Z"},
        ),
        True,
        what="publishedAfter range (1-7 days)",
    ),
    Shape(
        "orderBy-name",
        "discover",
        ({"orderBy": "name"}, {"orderBy": "name", "order": "desc"}),
        False,
        what="everything by name",
    ),
    Shape(
        "rql-match",
        "registryql",
        (
            "DISCOVER AgentDefinition WHERE MATCH 'summarize invoice'"
            " ORDER BY relevance DESC, publishedAt DESC LIMIT 20",
            "DISCOVER * WITH SERVICE 'A2A' WHERE MATCH 'security audit'"
            " AND lifecycleStatus = 'active' ORDER BY relevance DESC LIMIT 20",
            "DISCOVER * WHERE MATCH 'translate -legal' LIMIT 20",
        ),
        True,
        weight=2,
        what="MATCH + type/service/lifecycle",
    ),
    Shape(
        "rql-name",
        "registryql",
        (
            "DISCOVER * WHERE name CONTAINS 'invoice agent 12'",
            "DISCOVER * WHERE name CONTAINS 'sql agent 4'",
            "DISCOVER * WHERE name CONTAINS 'contract agent 77'",
        ),
        True,
        what="name CONTAINS (trigram)",
    ),
    Shape(
        "rql-or",
        "registryql",
        (
            "DISCOVER AgentDefinition WHERE tags CONTAINS 'tag-9'"
            " OR customMetadata.team = 'team-3'",
            "DISCOVER * WHERE publisherDid = 'did:key:z6MkPublisher0100'"
            " OR relationships.targetDid = 'did:web:base:60'",
            "DISCOVER * WHERE tags IN ('weather', 'travel') OR serviceType = 'SSE'"
            " ORDER BY publishedAt DESC LIMIT 20",
        ),
        True,
        what="OR of indexed conditions",
    ),
    Shape(
        "rql-not",
        "registryql",
        (
            "DISCOVER * WHERE tags IN ('legal', 'contract') AND NOT serviceType IN ('MCP', 'SSE')",
            "DISCOVER * WHERE customMetadata.team = 'team-12'"
            " AND NOT (tags CONTAINS 'chat' OR lifecycleStatus = 'draft')",
            "DISCOVER ToolDefinition WHERE MATCH 'code' AND NOT customMetadata.tier = 2",
        ),
        True,
        what="indexed AND NOT …",
    ),
    Shape(
        "rql-recent",
        "registryql",
        (
            "DISCOVER * WHERE tags CONTAINS 'security' ORDER BY publishedAt DESC LIMIT 20",
            "DISCOVER AgentDefinition WHERE customMetadata.team = 'team-5'"
            " ORDER BY publishedAt DESC LIMIT 20",
            "DISCOVER * WHERE publishedAt >= '2026-10-01T00:00:00Z' AND tags CONTAINS 'tag-77'"
            " ORDER BY publishedAt DESC LIMIT 20",
        ),
        True,
        what="filter ORDER BY publishedAt DESC LIMIT 20",
    ),
    Shape(
        "rql-browse",
        "registryql",
        ("DISCOVER * ORDER BY publishedAt DESC LIMIT 20", "DISCOVER ToolDefinition LIMIT 20"),
        False,
        what="no filter, ORDER BY publishedAt / by type",
    ),
]


# --- a realistic query population (the "zipf" row) ----------------------------------------

ZIPF_TYPES = ("AgentDefinition", "ToolDefinition")


def zipf_population(size: int, seed: int = 5) -> list[str]:
    """`size` distinct request lines, drawn from every query shape above with values from
    bench/seed.py's vocabulary (so most have results): what many different users would ask."""
    from bench.seed import SERVICE_TYPES, TEAMS, WORDS

    rng = random.Random(seed)
    tags = [*WORDS, *(f"tag-{i}" for i in range(200))]

    def body() -> tuple[str, Any]:
        shape = rng.randrange(12)
        order: dict[str, Any] = {}
        if rng.random() < 0.25:
            order = {"orderBy": rng.choice(["publishedAt", "updatedAt", "name"])}
        if shape == 0:
            return "discover", {"text": rng.choice(WORDS)}
        if shape in (1, 2):
            return "discover", {"text": " ".join(rng.sample(WORDS, rng.choice((2, 3))))}
        if shape == 3:
            return "discover", {"tags": rng.sample(tags, rng.choice((1, 2))), **order}
        if shape == 4:
            return "discover", {"anyTags": rng.sample(tags, rng.choice((2, 3))), **order}
        if shape == 5:
            return "discover", {"publisherDid": pub(rng.randrange(1000)), **order}
        if shape == 6:
            extra = {"entryType": rng.choice(ZIPF_TYPES)} if rng.random() < 0.5 else {}
            return "discover", {"metadata": {"team": rng.choice(TEAMS)}, **extra, **order}
        if shape == 7:
            return "discover", {
                "entryType": rng.choice(ZIPF_TYPES),
                "serviceType": rng.choice(SERVICE_TYPES),
                **order,
            }
        if shape == 8:
            day = rng.randrange(1, 365)
            return "discover", {"publishedAfter": f"{_day(day)}T00:00:00Z", **order}
        if shape == 9:
            return "discover", {"relationship": {"targetDid": f"did:web:base:{rng.randrange(100)}"}}
        if shape == 10:
            words = " ".join(rng.sample(WORDS, rng.choice((1, 2))))
            kind = rng.choice(("*", *ZIPF_TYPES))
            return "registryql", f"DISCOVER {kind} WHERE MATCH '{words}' LIMIT 20"
        tag = rng.choice(tags)
        return "registryql", (
            f"DISCOVER * WHERE tags CONTAINS '{tag}' ORDER BY publishedAt DESC LIMIT 20"
        )

    lines: dict[str, None] = {}
    while len(lines) < size:
        kind, value = body()
        lines[Shape("zipf", kind, (value,), True).lines()[0]] = None
    population = list(lines)
    rng.shuffle(population)  # popularity does not follow the shape
    return population


def _day(days_ago: int) -> str:
    from datetime import date, timedelta

    return (date(2026, 11, 1) - timedelta(days=days_ago)).isoformat()


def zipf_requests(population: list[str], exponent: float, count: int, seed: int) -> list[str]:
    """`count` requests, the k-th most popular query drawn with weight 1/k^exponent."""
    weights = [1.0 / (k**exponent) for k in range(1, len(population) + 1)]
    return random.Random(seed).choices(population, weights=weights, k=count)


class BackgroundWriter:
    """Commits `rate` entry changes a second into the bench database while it runs, through the
    service's one append path (append_changes), so every process's log actor hears each change
    and its cache keeper drops the discovery pages it moves, as in a registry in use.
    New unsigned entries: discovery neither needs nor checks signatures on stored entries."""

    def __init__(self, url: str, rate: float) -> None:
        self.url = url
        self.rate = rate
        self.written = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._error: BaseException | None = None

    def __enter__(self) -> BackgroundWriter:
        if self.rate > 0:
            self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if self._error is not None:
            raise RuntimeError(f"background writer failed: {self._error!r}")

    def _run(self) -> None:
        try:
            asyncio.run(self._write())
        except BaseException as exc:  # reported by __exit__
            self._error = exc

    async def _write(self) -> None:
        import asyncpg

        from registry.changes import IDEMPOTENCY_WINDOW_MS
        from registry.store.pg import append_payload
        from registry.usecases.entries import entry_change

        conn = await asyncpg.connect(self.url, timeout=10)
        try:
            period = 1.0 / self.rate
            next_at = time.monotonic()
            while not self._stop.is_set():
                n = self.written
                did = f"did:web:agents.example.com:bench-write:{secrets.token_hex(6)}"
                doc = {
                    "entryDid": did,
                    "entryType": "AgentDefinition",
                    "name": f"Written agent {n}",
                    "description": "An agent published while the benchmark runs.",
                    "tags": ["bench-write", f"tag-{n % 200}"],
                    "publisherDid": pub(n % 1000),
                    "lifecycleStatus": "active",
                    "publishedAt": "2026-11-01T00:00:00Z",
                    "updatedAt": "2026-11-01T00:00:00Z",
                }
                text = json.dumps(doc, separators=(",", ":"))
                change = entry_change(
                    "entry.created",
                    did=did,
                    expected_head=None,
                    publisher=doc["publisherDid"],
                    entry_type=doc["entryType"],
                    lifecycle="active",
                    prefix=text[:-1] + ',"sequence":',
                    suffix="}",
                )
                await conn.fetch(
                    "SELECT * FROM append_changes($1::jsonb, $2)",
                    append_payload([(change, None)]),
                    IDEMPOTENCY_WINDOW_MS,
                )
                self.written += 1
                next_at += period
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        finally:
            await conn.close()


# --- wrk -----------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    kind: str  # "get", "mix", "shape"
    m: Measurement
    shape: Shape | None = None
    errbodies: list[str] = field(default_factory=list)
    label: str = ""
    note: str = ""

    @property
    def result(self) -> WrkResult:
        return self.m.result


def run_wrk(
    workdir: Path, tag: str, port: int, requests: Path, seconds: float, connections: int
) -> tuple[WrkResult, list[str]]:
    out = workdir / f"{tag}.wrk"
    env = {**os.environ, "BENCH_REQUESTS": str(requests), "BENCH_OUT": str(out)}
    env["BENCH_THREADS"] = "1"
    cmd = [
        "wrk", "-t1", "-c", str(connections), "-d", f"{max(1, round(seconds))}s",
        "--timeout", "5s", "-s", str(LUA), f"http://127.0.0.1:{port}/",
    ]  # fmt: skip
    done = subprocess.run(
        pinned(WRK_CORE, cmd),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=seconds + 120,
        check=False,
    )
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"wrk failed ({done.returncode}):\n{done.stdout.decode(errors='replace')}"
        )
    result = parse_wrk_output(out)
    result.stdout = done.stdout.decode(errors="replace")
    errbodies = [
        line.split(" ", 2)[2]
        for line in out.read_text().splitlines()
        if line.startswith("errbody ") and len(line.split(" ", 2)) == 3
    ]
    return result, errbodies


class Runner:
    def __init__(self, args: argparse.Namespace, workdir: Path, db: str, server: Server) -> None:
        self.args = args
        self.workdir = workdir
        self.db = db
        self.server = server
        self.rows: list[Row] = []

    def measure(
        self, name: str, kind: str, requests: Path, seconds: float, shape: Shape | None = None
    ) -> Row:
        args = self.args
        everyone0 = all_processes() if args.verbose else {}
        server0 = proc_cpu(self.server.pid)
        pg_before = postgres_pids(args.postgres, self.db)
        pg0 = cpu_snapshot(pg_before)
        busy0, _ = machine_busy()
        children0 = os.times()
        tag = f"{kind}-{name}-{len(self.rows)}".replace("+", "_")
        result, errbodies = run_wrk(
            self.workdir, tag, self.server.port, requests, seconds, args.connections
        )
        children1 = os.times()
        busy1, _ = machine_busy()
        pg1 = cpu_snapshot(pg_before | postgres_pids(args.postgres, self.db))
        server1 = proc_cpu(self.server.pid)
        m = Measurement(
            setup="1 proc",
            endpoint=name,
            result=result,
            warmup=WrkResult(requests=1),
            server_cpu_s=server1 - server0,
            postgres_cpu_s=cpu_delta(pg0, pg1),
            wrk_cpu_s=(children1.children_user + children1.children_system)
            - (children0.children_user + children0.children_system),
            machine_busy=0.0,
            machine_busy_s=(busy1 - busy0) / os.sysconf("SC_CLK_TCK"),
            servers=1,
        )
        row = Row(name, kind, m, shape, errbodies)
        problems = result.problems()
        log(
            f"{name}: {result.rps:,.0f} req/s, p50 {result.percentile_ms(50):.1f} ms,"
            f" p99 {result.percentile_ms(99):.1f} ms, others {m.others_core_share:.0%}"
            + ("" if not problems else "  ERRORS: " + "; ".join(problems))
            + (f" (first: {errbodies[0][:120]})" if errbodies else "")
        )
        if args.verbose:
            log(
                f"  CPU s: server {m.server_cpu_s:.1f}, postgres {m.postgres_cpu_s:.1f},"
                f" wrk {m.wrk_cpu_s:.1f}, machine {m.machine_busy_s:.1f}"
            )
            everyone1 = all_processes()
            ours = {self.server.pid} | pg1.keys()
            others = sorted(
                (
                    (cpu - everyone0.get(pid, (pname, 0.0))[1], pid, pname)
                    for pid, (pname, cpu) in everyone1.items()
                    if pid not in ours
                ),
                reverse=True,
            )
            for cpu, pid, pname in others[:3]:
                if cpu >= 0.2:
                    log(f"  other process {pid} used {cpu:.1f} CPU s: {pname}")
        return row

    def warm(self, name: str, requests: Path, seconds: float) -> None:
        if seconds <= 0:
            return
        log(f"warm-up {name} {seconds:.0f}s")
        result, errbodies = run_wrk(
            self.workdir, f"warmup-{name}", self.server.port, requests, seconds,
            self.args.connections,
        )  # fmt: skip
        if result.problems():
            log(f"  warm-up {name}: " + "; ".join(result.problems()) + f" {errbodies[:1]}")


# --- the database --------------------------------------------------------------------------


async def seed_database(url: str, count: int) -> tuple[str, dict[str, Any]]:
    """Seed, VACUUM ANALYZE; returns the DID get_entry reads and some facts about the table."""
    import asyncpg

    from bench.seed import seed

    conn = await asyncpg.connect(url, timeout=10)
    try:
        await seed(conn, count)
        # autovacuum may be off (it is on the reference machine) and would otherwise run in the
        # middle of a measurement: vacuum now, as a table in service would have been.
        await conn.execute("VACUUM (ANALYZE) entries, entry_search, entry_versions")
        did = await conn.fetchval(
            "SELECT entry_did FROM entries WHERE lifecycle = 'active'"
            " ORDER BY head_seq OFFSET $1 LIMIT 1",
            count // 2,
        )
        facts = dict(
            await conn.fetchrow(
                "SELECT count(*) AS entries,"
                " count(*) FILTER (WHERE lifecycle NOT IN ('revoked', 'deleted')) AS listed,"
                " pg_size_pretty(pg_total_relation_size('entries')) AS size,"
                " pg_size_pretty(pg_total_relation_size('entry_versions')) AS versions_size,"
                " (SELECT setting FROM pg_settings WHERE name = 'jit') AS jit,"
                " (SELECT setting FROM pg_settings WHERE name = 'autovacuum') AS autovacuum,"
                " (SELECT current_setting('shared_buffers')) AS shared_buffers,"
                " (SELECT current_setting('work_mem')) AS work_mem,"
                " (SELECT current_setting('server_version')) AS version"
                " FROM entries"
            )
        )
    finally:
        await conn.close()
    return str(did), facts


def compile_variant(variant: Any, kind: str) -> Any:
    """The statements the server runs for one variant (first page, default page size)."""
    from registry.config import LimitsConfig
    from registry.discovery import parse_discover_request
    from registry.registryql import parse_registryql
    from registry.store.discover import compile_discover

    query = parse_discover_request(variant) if kind == "discover" else parse_registryql(variant)
    limits = LimitsConfig()
    size = limits.default_page_size
    if query.limit is not None:
        size = min(query.limit, limits.max_page_size)
    return compile_discover(query, limit=size, after=None)


def server_statements(plan: Any) -> list[tuple[str, str, list[Any]]]:
    """(label, SQL, params) of what the server runs for one page: the single statement that
    answers page and count together when the compiler has one (`Plan.sql`), else its page and
    count statements one after the other."""
    if hasattr(plan, "sql") and hasattr(plan, "params"):
        return [("page+count (one statement)", plan.sql, list(plan.params))]
    return [
        ("page", plan.page_sql, plan.page_params),
        ("count", plan.count_sql, plan.count_params),
    ]


async def sql_costs(url: str, shapes: list[Shape]) -> dict[str, list[float]]:
    """Milliseconds of each variant's statements (as the server runs them, summed), the best of
    3, one connection, nothing else running: the database's own cost, without the server and
    without contention. Prepared and cached by asyncpg as in the server, so after a few
    executions PostgreSQL may use its generic plan, as it does under load."""
    import asyncpg

    from registry.store.pg import SESSION_SETTINGS

    out: dict[str, list[float]] = {}
    conn = await asyncpg.connect(url, timeout=10, server_settings=SESSION_SETTINGS)
    try:
        for shape in shapes:
            costs = []
            for variant in shape.variants:
                total = 0.0
                for _, sql, params in server_statements(compile_variant(variant, shape.kind)):
                    times = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        await conn.fetch(sql, *params)
                        times.append((time.perf_counter() - t0) * 1000)
                    total += min(times)
                costs.append(total)
            out[shape.name] = costs
    finally:
        await conn.close()
    return out


async def explain(url: str, variant: Any, kind: str) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of what the server runs for one variant (custom plan)."""
    import asyncpg

    from registry.store.pg import SESSION_SETTINGS

    out = []
    conn = await asyncpg.connect(url, timeout=10, server_settings=SESSION_SETTINGS)
    try:
        for label, sql, params in server_statements(compile_variant(variant, kind)):
            await conn.fetch(sql, *params)  # a warm cache, as under load
            rows = await conn.fetch(f"EXPLAIN (ANALYZE, BUFFERS) {sql}", *params)
            shown = ", ".join(
                repr(v if not isinstance(v, list) or len(v) < 6 else [*v[:5], "…"]) for v in params
            )
            out.append(f"-- {label}: {sql}\n-- params: {shown}")
            out.extend(r[0] for r in rows)
    finally:
        await conn.close()
    return "\n".join(out)


def check_variants(port: int, shapes: list[Shape]) -> dict[str, tuple[list[int], list[str]]]:
    """Send every variant once: (totalCount of each, problems) by shape."""
    out: dict[str, tuple[list[int], list[str]]] = {}
    for shape in shapes:
        totals: list[int] = []
        problems: list[str] = []
        for variant, line in zip(shape.variants, shape.lines(), strict=True):
            _method, path, body = line.split(" ", 2)
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}{path}",
                data=body.encode(),
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    data = json.loads(response.read())
                totals.append(int(data["totalCount"]))
                if not data["entries"]:
                    problems.append(f"no results for {variant!r}")
            except urllib.error.HTTPError as exc:
                problems.append(f"{exc.code} for {variant!r}: {exc.read()[:300]!r}")
            except (OSError, ValueError, KeyError) as exc:
                problems.append(f"{exc!r} for {variant!r}")
        out[shape.name] = (totals, problems)
    return out


# --- reporting -----------------------------------------------------------------------------

WIDTH = 136


def report(
    runner: Runner,
    header: list[str],
    checks: dict[str, tuple[list[int], list[str]]],
    costs: dict[str, list[float]],
    plans: dict[str, str],
) -> bool:
    rows = runner.rows
    gets = [r for r in rows if r.kind == "get"]
    get_rps = sum(r.result.rps for r in gets) / len(gets) if gets else float("nan")
    get_us = (
        sum(r.m.server_cpu_s for r in gets) / sum(r.result.requests for r in gets) * 1e6
        if gets and sum(r.result.requests for r in gets)
        else float("nan")
    )
    print()
    print("=" * WIDTH)
    for line in header:
        print(line)
    print("-" * WIDTH)
    print(
        f"{'shape':<13} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'requests':>8} {'non-2xx':>7}"
        f" {'sock err':>8} {'results':>13} {'sql ms':>11} {'target':>12} {'srv core':>8}"
        f" {'srv µs/req':>10} {'pg µs/req':>9} {'others':>6}"
    )
    print("-" * WIDTH)
    clean = True
    missed: list[str] = []
    mix_row = next((r for r in rows if r.kind == "mix"), None)
    for r in rows:
        res, m = r.result, r.m
        target = ""
        if r.kind in ("mix", "zipf") and get_rps == get_rps and get_rps:
            ratio = res.rps / get_rps
            target = f"{ratio:.2f}×get {'✓' if ratio >= MIX_TARGET else '✗'}"
        elif r.shape is not None and r.shape.target:
            ok = res.percentile_ms(99) < P99_TARGET_MS
            target = f"p99<{P99_TARGET_MS:.0f} {'✓' if ok else '✗'}"
            if not ok:
                missed.append(r.name)
        elif r.shape is not None:
            target = "(browse)"
        results = ""
        if r.shape is not None and r.shape.name in checks:
            totals = checks[r.shape.name][0]
            if totals:
                lo, hi = min(totals), max(totals)
                results = f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"
        sql = ""
        if r.shape is not None and costs.get(r.shape.name):
            sql = f"{max(costs[r.shape.name]):.1f}"
        sock = sum(res.socket_errors.values())
        print(
            f"{r.label or r.name:<13} {res.rps:>7,.0f} {fmt(res.percentile_ms(50), '.1f'):>7}"
            f" {fmt(res.percentile_ms(99), '.1f'):>7} {res.requests:>8,} {res.non_2xx:>7}"
            f" {sock:>8} {results:>13} {sql:>11} {target:>12} {m.server_core_share:>8.0%}"
            f" {fmt(m.us_per_request(m.server_cpu_s), ',.0f'):>10}"
            f" {fmt(m.us_per_request(m.postgres_cpu_s), ',.0f'):>9} {m.others_core_share:>6.0%}"
        )
        if res.problems():
            clean = False
    print("-" * WIDTH)
    print(
        "results: totalCount of the shape's variants (checked once before the runs). sql ms: the"
        " SQL of the shape's slowest variant\n(page and count) run alone on one connection"
        " after the runs (best of 3). srv core: share of one core used by the server.\n"
        "srv µs/req, pg µs/req: CPU time per request of the server and of PostgreSQL (the bench"
        " database's backends + background processes).\n"
        "others: CPU used meanwhile by processes outside the bench, in cores (above ~5% the row"
        " is suspect). (browse): no filter, the p99 target does not apply."
    )
    noisy = [r.label or r.name for r in rows if r.m.others_core_share > 0.05]
    if noisy:
        print(f"NOISE: other processes used > 5% of a core during: {', '.join(noisy)}")
    # Targets.
    targeted = [r for r in rows if r.shape is not None and r.shape.target]
    if targeted:
        verdict = "MET" if not missed else f"NOT MET ({', '.join(missed)})"
        worst = max(targeted, key=lambda r: r.result.percentile_ms(99))
        print(
            f"target p99 < {P99_TARGET_MS:.0f} ms for {len(targeted)} indexed/text shapes:"
            f" {verdict}; worst {worst.name} {worst.result.percentile_ms(99):.1f} ms"
        )
    if mix_row is not None and gets:
        ratio = mix_row.result.rps / get_rps if get_rps else float("nan")
        mix_us = mix_row.m.us_per_request(mix_row.m.server_cpu_s)
        mix_pg = mix_row.m.us_per_request(mix_row.m.postgres_cpu_s)
        get_rows = ", ".join(f"{r.result.rps:,.0f}" for r in gets)
        print(
            f"target mix ≥ {MIX_TARGET:.2f} × get_entry: {mix_row.result.rps:,.0f} / {get_rps:,.0f}"
            f" (mean of {get_rows}) = {ratio:.2f}: {'MET' if ratio >= MIX_TARGET else 'NOT MET'};"
            f" by server CPU per request {get_us:,.0f}/{mix_us:,.0f} µs = {get_us / mix_us:.2f}"
            f" (+ {mix_pg:,.0f} µs of PostgreSQL CPU per mix request)"
        )
        if len(gets) > 1:
            values = [r.result.rps for r in gets]
            spread = (max(values) - min(values)) / get_rps
            if spread > 0.15:
                print(
                    f"WARNING: the get_entry rows differ by {spread:.0%}: the machine was not"
                    " steady, the ratio is uncertain by as much"
                )
    for r in rows:
        if r.kind != "zipf":
            continue
        res = r.result
        answered = res.cache_hits + res.cache_misses
        hit_rate = res.cache_hits / answered if answered else float("nan")
        ratio = res.rps / get_rps if get_rps else float("nan")
        p99 = res.percentile_ms(99)
        print(
            f"zipf mix: {r.note}.\n  cache hit rate {hit_rate:.1%} (X-Cache of {answered:,}"
            f" answers); {res.rps:,.0f} req/s = {ratio:.2f} × get_entry"
            f" ({'MET' if ratio >= MIX_TARGET else 'NOT MET'});"
            f" p99 {p99:.1f} ms ({'MET' if p99 < P99_TARGET_MS else 'NOT MET'})"
        )
    problems = [(r, r.result.problems()) for r in rows if r.result.problems()]
    bad_checks = [(name, p) for name, (_, p) in checks.items() if p]
    if problems or bad_checks:
        print()
        for r, items in problems:
            first = f" first: {r.errbodies[0]}" if r.errbodies else ""
            print(f"ERRORS {r.label or r.name}: " + "; ".join(items) + first)
        for name, items in bad_checks:
            print(f"ERRORS {name} (variant check): " + "; ".join(items))
        clean = False
    if not clean:
        print("\nTHIS RUN HAD ERRORS: the figures of the rows listed above are not valid.")
    print("=" * WIDTH)
    for name, text in plans.items():
        print(f"\n### EXPLAIN (ANALYZE, BUFFERS) {name}\n{text}")
    return clean


# --- the run -------------------------------------------------------------------------------


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _sigterm(_signo: int, _frame: Any) -> None:
    raise KeyboardInterrupt  # run the cleanup in `finally`, as Ctrl-C does


def main_bench(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print(
            "bench/discover.py needs wrk (the load generator). Install it with:\n"
            "    apt-get update && apt-get install -y wrk",
            file=sys.stderr,
        )
        return 2
    registry_bin = VENV_BIN / "registry"
    if not registry_bin.exists():
        print(f"no {registry_bin}: run this with the project's venv python", file=sys.stderr)
        return 2
    if shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        print("warning: no taskset or one core: server and wrk are not pinned", file=sys.stderr)
    shapes = SHAPES
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {s.name for s in SHAPES}
        if unknown:
            print(f"unknown shapes {sorted(unknown)}; known: {[s.name for s in SHAPES]}")
            return 2
        shapes = [s for s in SHAPES if s.name in wanted]
    signal.signal(signal.SIGTERM, _sigterm)

    busy_before = idle_check()
    waited_until = time.monotonic() + args.wait_idle
    while busy_before > 0.1 and time.monotonic() < waited_until:
        log(f"machine {busy_before:.0%} busy (other processes); waiting for it to go idle")
        busy_before = idle_check(2.0)
    log(
        f"machine {busy_before:.0%} busy before start"
        + ("  WARNING: not idle, figures may be low" if busy_before > 0.1 else "")
    )

    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="registry-bench-disc-"))
    db = f"registry_bench_disc_{secrets.token_hex(4)}"
    server: Server | None = None
    db_created = False
    clean = False
    url = f"{args.postgres}/{db}"
    try:
        revision = git_revision()
        log(f"service at commit {revision}; database {db}, work dir {workdir}")
        db_admin(args.postgres, f'CREATE DATABASE "{db}"')
        db_created = True
        env = {**os.environ, **SERVICE_ENV}
        data_dir = workdir / "data"
        done = subprocess.run(
            [str(registry_bin), "migrate", "--data-dir", str(data_dir), "--database-url", url],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"registry migrate failed:\n{done.stdout}{done.stderr}")
        t0 = time.monotonic()
        read_did, facts = asyncio.run(seed_database(url, args.entries))
        log(
            f"seeded {facts['entries']:,} entries ({facts['listed']:,} listed, {facts['size']})"
            f" and VACUUM ANALYZEd in {time.monotonic() - t0:.0f}s"
        )

        port = free_port()
        cmd = [
            str(registry_bin), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--data-dir", str(data_dir), "--database-url", url,
        ]  # fmt: skip
        server = start_server("registry", cmd, port, SERVER_CORE, workdir, env)
        wait_ready(server, "/v1/health", 60, want=lambda b: b.get("status") == "ok")
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}/v1/entries/{read_did}", timeout=10
        ) as response:
            size = len(response.read())
        log(f"registry serve on :{port} (core {SERVER_CORE}); get_entry {read_did} ({size} B)")

        checks = check_variants(port, shapes)
        for name, (_, problems) in checks.items():
            if problems:
                log(f"variant check {name}: " + "; ".join(problems))
        runner = Runner(args, workdir, db, server)

        get_file = write_lines(workdir / "get.txt", [f"GET /v1/entries/{read_did}"])
        mix_lines = [line for s in shapes for line in s.lines() for _ in range(s.weight)]
        random.Random(11).shuffle(mix_lines)
        mix_file = write_lines(workdir / "mix.txt", mix_lines)
        runner.warm("mix", mix_file, args.warmup)
        runner.warm("get_entry", get_file, min(args.warmup, 3))

        runner.rows.append(runner.measure("get_entry", "get", get_file, args.duration))
        mix = runner.measure("mix", "mix", mix_file, args.duration)
        mix.label = f"mix ({len(shapes)})"
        runner.rows.append(mix)
        if args.zipf_queries > 0:
            population = zipf_population(args.zipf_queries)
            draws = {"warm": 1, "run": 2}
            files = {
                name: write_lines(
                    workdir / f"zipf-{name}.txt",
                    zipf_requests(population, args.zipf_s, 50_000, seed=draw),
                )
                for name, draw in draws.items()
            }
            runner.warm("zipf", files["warm"], args.zipf_warmup)
            with BackgroundWriter(url, args.zipf_writes) as writer:
                zipf = runner.measure("zipf", "zipf", files["run"], args.duration)
            zipf.label = "zipf mix"
            zipf.note = (
                f"{len(population):,} distinct queries (every shape, values from the seed's"
                f" vocabulary), popularity Zipf s={args.zipf_s:g},"
                f" warmed {args.zipf_warmup:.0f}s by another draw;"
                f" {writer.written} entries written meanwhile"
                f" ({args.zipf_writes:g}/s, each dropping the cached pages it can move)"
            )
            runner.rows.append(zipf)
        for shape in shapes:
            requests = write_lines(workdir / f"shape-{shape.name}.txt", shape.lines())
            runner.warm(shape.name, requests, args.shape_warmup)
            runner.rows.append(
                runner.measure(shape.name, "shape", requests, args.shape_duration, shape)
            )
        again = runner.measure("get_entry", "get", get_file, args.duration)
        again.label = "get again"
        runner.rows.append(again)

        # The database's own cost of each variant, and the plans of the shapes that missed
        # (or all), the server idle.
        log("timing each variant's statements alone")
        costs = asyncio.run(sql_costs(url, shapes))
        plans: dict[str, str] = {}
        for r in runner.rows:
            s = r.shape
            if s is None or args.explain == "none":
                continue
            missed = s.target and not r.result.percentile_ms(99) < P99_TARGET_MS
            if args.explain == "all" or missed:
                i = max(range(len(s.variants)), key=lambda j: costs[s.name][j])
                timings = ", ".join(f"v{j} {ms:.1f}" for j, ms in enumerate(costs[s.name]))
                plans[f"{s.name}: slowest variant v{i} {s.variants[i]!r}"] = (
                    f"-- SQL ms of each variant alone: {timings}\n"
                    + asyncio.run(explain(url, s.variants[i], s.kind))
                )
        header = [
            f"service: commit {revision}; {facts['entries']:,} seeded entries"
            f" ({facts['listed']:,} not revoked, {facts['size']}), VACUUM ANALYZEd;"
            f" PostgreSQL {facts['version']} 127.0.0.1:5432 (shared, never pinned),"
            f" jit={facts['jit']}, autovacuum={facts['autovacuum']},"
            f" shared_buffers={facts['shared_buffers']}, work_mem={facts['work_mem']}",
            f"load: {wrk_version()} -t1 -c{args.connections} with bench/lua/discover.lua,"
            f" pinned to core {WRK_CORE}; one `registry serve` pinned to core {SERVER_CORE}",
            f"runs: warm-up {args.warmup:.0f}s (mix) + 3s (get); get_entry, mix:"
            f" {args.duration:.0f}s each; each shape {args.shape_duration:.0f}s"
            " (its variants round-robin); get again at the end",
            "get_entry: GET /v1/entries/<did of a seeded entry>; mix: every shape's variants"
            " shuffled (text shapes twice); page size 20 (the default), with totalCount",
            f"machine: {os.cpu_count()} cores, {busy_before:.0%} busy before start;"
            f" run took {time.monotonic() - began:.0f}s",
        ]
        clean = report(runner, header, checks, costs, plans)
        return 0 if clean else 1
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if server is not None:
            try:
                stop_server(server)
            except Exception as exc:  # keep cleaning up
                print(f"stopping {server.name}: {exc!r}", file=sys.stderr)
            if server.popen.returncode not in (0, -signal.SIGTERM) or not clean:
                tail = server.log_tail(15)
                if tail.strip():
                    print(
                        f"--- {server.name} log (exit {server.popen.returncode}) ---\n{tail}",
                        file=sys.stderr,
                    )
        if db_created and not args.keep_db:
            try:
                db_admin(args.postgres, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
            except Exception as exc:
                print(f"could not drop database {db}: {exc!r}", file=sys.stderr)
        elif db_created:
            print(f"database kept: {url}", file=sys.stderr)
        if args.keep_workdir:
            print(f"work dir kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--entries", type=int, default=100_000, help="entries to seed (100000)")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections (16)")
    parser.add_argument(
        "--duration", type=float, default=10.0, help="seconds of the get_entry and mix rows (10)"
    )
    parser.add_argument(
        "--shape-duration", type=float, default=5.0, help="seconds of each shape's row (5)"
    )
    parser.add_argument("--warmup", type=float, default=5.0, help="warm-up of the mix (5)")
    parser.add_argument(
        "--shape-warmup", type=float, default=0.0, help="warm-up before each shape (0)"
    )
    parser.add_argument("--only", metavar="A,B", help="only these shapes (names in the table)")
    parser.add_argument(
        "--zipf-queries",
        type=int,
        default=10_000,
        help="distinct queries of the zipf mix row (10000; 0 skips the row)",
    )
    parser.add_argument(
        "--zipf-s", type=float, default=1.0, help="Zipf exponent of their popularity (1.0)"
    )
    parser.add_argument(
        "--zipf-warmup",
        type=float,
        default=30.0,
        help="seconds of zipf requests before its row, to fill the cache as in service (30)",
    )
    parser.add_argument(
        "--zipf-writes",
        type=float,
        default=2.0,
        help="entry changes committed per second during the zipf row (2)",
    )
    parser.add_argument(
        "--explain",
        choices=("missed", "all", "none"),
        default="missed",
        help="print EXPLAIN (ANALYZE, BUFFERS) of the shapes that missed the p99 target (default),"
        " of all shapes, or of none",
    )
    parser.add_argument(
        "--postgres",
        default=os.environ.get("BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432"),
        help="PostgreSQL server URL without a database (a fresh database is created and dropped)",
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=30.0,
        metavar="S",
        help="wait up to S seconds for the machine to be <10%% busy before starting (30)",
    )
    parser.add_argument("--verbose", action="store_true", help="log CPU accounting per row")
    parser.add_argument("--keep-db", action="store_true", help="do not drop the bench database")
    parser.add_argument(
        "--keep-workdir", action="store_true", help="keep the server log and wrk output"
    )
    return main_bench(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
