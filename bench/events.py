#!/usr/bin/env python3
"""The event stream under load: N WebSocket subscribers on one process while entries are written.

The issue's target: 1,000 concurrent subscribers on one process while writers create 200 entries
per second: p99 commit-to-receipt < 100 ms, writer throughput within 10 % of the same run with no
subscribers, memory per idle subscriber reported.

One run, on a fresh database `registry_bench_ev_<hex>` of the local PostgreSQL server:
  * starts one `registry serve` (rate limits raised, `events.max_connections` ≥ N) pinned to
    core 0, and signs the entries it will create beforehand (a process pool);
  * warm-up, then phase A: an open-loop writer (its own process, raw HTTP/1.1 on keep-alive
    connections) schedules `--rate` POST /v1/entries a second for `--seconds`, no subscribers;
  * reads the server's VmRSS, opens N WebSocket connections to /v1/events from `--workers`
    client processes (asyncio, a minimal RFC 6455 client: one timestamp per read, the sequence
    taken from the event's fixed prefix, so that the clients are not the bottleneck), each sends
    `{"type":"subscribe"}` and waits for `subscribed`; a few seconds later VmRSS again:
    (after − before) / N is the memory per idle subscriber;
  * phase B: the same writer again with the N subscribers connected, then waits (up to
    `--drain` seconds) until every subscriber has received the log up to its head;
  * checks every subscriber's stream against the log table (every public record after its
    `fromSequence`, once, in order), and prints the table: writer throughput and latency of both
    phases and their ratio, commit-to-receipt percentiles, events per subscriber, closes, RSS,
    and where the CPU went (server, PostgreSQL, the clients, other processes).

Commit-to-receipt, for each subscriber and each entry.created event of phase B:
  * receipt − 201: the time the subscriber read the event minus the time the writer read the 201
    of that entry. The server answers after its transaction commits, so this is a lower bound
    (it can be negative: the event may arrive before the answer);
  * receipt − at: minus the log record's `at` (now() of the writing transaction, read from the
    log table at µs precision; the event's `at` is the same, truncated to ms): an upper bound.
All processes run on this machine, so time.time() is one clock. Traffic goes to 127.0.0.1 only.

    .venv/bin/python bench/events.py                 # ~3 minutes
    .venv/bin/python bench/events.py --quick         # smoke run: 100 subscribers, 5 s
    REGISTRY_EVENTS__QUEUE_SIZE=4096 .venv/bin/python bench/events.py   # the server inherits env

Exit status: 0 when the run was clean (every create answered 201, every subscriber connected
and received every event it should have, in order), 1 otherwise, 2 when a prerequisite is
missing. Missing a target does not change the exit status; the table says MET / NOT MET.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import contextlib
import hashlib
import itertools
import json
import math
import os
import pickle
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if __name__ == "__main__" and str(ROOT) not in sys.path:  # run as a script: import `bench`
    sys.path.insert(0, str(ROOT))

from bench.entries import (  # noqa: E402
    SERVICE_ENV,
    VENV_BIN,
    Server,
    cpu_delta,
    cpu_snapshot,
    db_admin,
    fmt,
    free_port,
    git_revision,
    idle_check,
    log,
    pinned,
    postgres_pids,
    proc_cpu,
    start_server,
    stop_server,
    wait_ready,
    write_pool,
)

P99_TARGET_MS = 100.0
THROUGHPUT_TARGET = 0.90  # phase B writes/s ≥ 0.90 × phase A's
SERVER_CORE = 0
DEFAULTS = {"subscribers": 1000, "seconds": 20.0, "warmup": 3.0, "drain": 30.0}
QUICK = {"subscribers": 100, "seconds": 5.0, "warmup": 1.0, "drain": 15.0}  # --quick
EVENT_PREFIX = b'{"type":"event","sequence":'
# --batch: subscribers ask for batched frames (docs/events.md); inherited by the worker processes
BATCH = os.environ.get("BENCH_EVENTS_BATCH") == "1"
WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
PARSE_SLICE = 0.002  # seconds of parsing between two looks at the sockets (worker processes)
RESUME_CODES = {4429, 1011}  # slow_consumer, log unavailable: resume after lastSequence


# --- a minimal WebSocket client (runs in the subscriber worker processes) ------------------


def ws_frame(opcode: int, payload: bytes) -> bytes:
    """One final, masked client frame."""
    key = os.urandom(4)
    masked = bytes(b ^ key[i & 3] for i, b in enumerate(payload))
    n = len(payload)
    if n < 126:
        head = bytes([0x80 | opcode, 0x80 | n])
    elif n < 65536:
        head = bytes([0x80 | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x80 | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
    return head + key + masked


class Subscriber:
    """One subscriber: its connection to /v1/events (a new one after each resume) and every
    event it read, as (sequence, receipt time) in two arrays."""

    def __init__(self, worker: SubscriberWorker, index: int) -> None:
        self.worker = worker
        self.index = index
        self.seqs: array[int] = array("q")
        self.times: array[float] = array("d")
        self.from_seq: int | None = None  # fromSequence of the first subscription
        self.last: int | None = None  # the last sequence read (or the subscription's start)
        self.closes: list[tuple[int, str, float]] = []
        self.heartbeats = 0
        self.resumes = 0
        self.other: list[str] = []  # unexpected messages (errors)
        self.gone = False  # closed for good
        self.after: int | None = None  # where the current connection subscribes from
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.state = "closed"  # handshake | open | closing | closed
        self.key = b""
        self.fragments: list[bytes] = []
        self.subscribed: asyncio.Future[int] | None = None

    # connecting ------------------------------------------------------------------------

    async def connect(self, after: int | None) -> int:
        loop = asyncio.get_running_loop()
        self.buf.clear()
        self.fragments.clear()
        self.subscribed = loop.create_future()
        self.key = base64.b64encode(os.urandom(16))
        self.state = "handshake"
        self.after = after
        port = self.worker.port
        request = (
            f"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {self.key.decode()}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
        transport, _ = await loop.create_connection(
            lambda: _WsProtocol(self, request), "127.0.0.1", port
        )
        self.transport = transport  # type: ignore[assignment]
        return await self.subscribed

    def _fail(self, reason: str) -> None:
        if self.subscribed is not None and not self.subscribed.done():
            self.subscribed.set_exception(ConnectionError(reason))

    def send_json(self, message: dict[str, Any]) -> None:
        if self.transport is not None and self.state == "open":
            self.transport.write(ws_frame(0x1, json.dumps(message).encode()))

    # reading ---------------------------------------------------------------------------

    def feed(self, data: bytes, now: float) -> None:
        buf = self.buf
        buf += data
        if self.state == "handshake":
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).decode("latin-1")
            del buf[: end + 4]
            accept = base64.b64encode(hashlib.sha1(self.key + WS_GUID).digest()).decode()
            lines = head.split("\r\n")
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)
            }
            if " 101 " not in lines[0] + " " or headers.get("sec-websocket-accept") != accept:
                self._fail(f"handshake refused: {lines[0]!r}")
                self.state = "closed"
                assert self.transport is not None
                self.transport.close()
                return
            self.state = "open"
            subscribe: dict[str, Any] = {"type": "subscribe"}
            if BATCH:
                subscribe["batch"] = True
            if self.after is not None:
                subscribe["fromSequence"] = self.after
            self.send_json(subscribe)
        pos, n = 0, len(buf)
        # Events are most of what arrives (1,000 subscribers × 250 a second on one core): read
        # their sequence in place, without copying the payload; anything else takes the long way.
        seqs, events = self.seqs, 0
        prefix, skip = EVENT_PREFIX, len(EVENT_PREFIX)
        while n - pos >= 2:
            b0, b1 = buf[pos], buf[pos + 1]
            length, header = b1 & 0x7F, 2
            if length == 126:
                if n - pos < 4:
                    break
                length, header = int.from_bytes(buf[pos + 2 : pos + 4], "big"), 4
            elif length == 127:
                if n - pos < 10:
                    break
                length, header = int.from_bytes(buf[pos + 2 : pos + 10], "big"), 10
            if b1 & 0x80:
                header += 4  # a masked server frame is a protocol error; read it anyway
                self.other.append("masked frame from the server")
            start = pos + header
            end = start + length
            if end > n:
                break
            if b0 == 0x81 and buf.startswith(prefix, start):  # {"type":"event","sequence":N,
                seqs.append(int(buf[start + skip : buf.find(b",", start + skip, end)]))
                events += 1
                pos = end
                continue
            if events:
                self._read_events(events, now)
                events = 0
            payload = bytes(buf[start:end])
            pos = end
            opcode = b0 & 0x0F
            if opcode == 0x1 and b0 & 0x80:
                self._message(payload, now)
            elif opcode in (0x0, 0x1):  # fragmented text
                self.fragments.append(payload)
                if b0 & 0x80:
                    self._message(b"".join(self.fragments), now)
                    self.fragments.clear()
            elif opcode == 0x8:
                self._closed_by_server(payload, now)
                break
            elif opcode == 0x9 and self.transport is not None:
                self.transport.write(ws_frame(0xA, payload))
            elif opcode == 0x2:
                self.other.append("binary frame")
        if events:
            self._read_events(events, now)
        if pos:
            del buf[:pos]

    def _read_events(self, count: int, now: float) -> None:
        """The last `count` sequences appended to `seqs` were read at `now`."""
        self.times.fromlist([now] * count)
        self.last = self.seqs[-1]

    def _message(self, payload: bytes, now: float) -> None:
        if payload.startswith(EVENT_PREFIX):  # the fast path: {"type":"event","sequence":N,...
            comma = payload.find(b",", len(EVENT_PREFIX))
            seq = int(payload[len(EVENT_PREFIX) : comma])
            self.seqs.append(seq)
            self.times.append(now)
            self.last = seq
            return
        message = json.loads(payload)
        kind = message.get("type")
        if kind == "event":
            self.seqs.append(int(message["sequence"]))
            self.times.append(now)
            self.last = int(message["sequence"])
        elif kind == "events":  # batch mode: several events in one frame
            for event in message["events"]:
                self.seqs.append(int(event["sequence"]))
                self.times.append(now)
                self.last = int(event["sequence"])
        elif kind == "subscribed":
            start = int(message["fromSequence"])
            if self.from_seq is None:
                self.from_seq = start
            if self.last is None:
                self.last = start
            if self.subscribed is not None and not self.subscribed.done():
                self.subscribed.set_result(start)
        elif kind == "heartbeat":
            self.heartbeats += 1
        else:
            self.other.append(payload[:300].decode(errors="replace"))

    def _closed_by_server(self, payload: bytes, now: float) -> None:
        code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1005
        reason = payload[2:].decode(errors="replace")
        self.closes.append((code, reason, now))
        if self.transport is not None:
            self.transport.write(ws_frame(0x8, payload[:2]))
            self.transport.close()
        self.state = "closed"
        self._fail(f"closed {code} {reason}")
        self._after_close(code)

    def lost(self) -> None:
        """The TCP connection ended."""
        if self.state in ("open", "handshake") and not self.worker.stopping:  # no close frame
            self.closes.append((1006, "connection lost", time.time()))
            self.state = "closed"
            self._fail("connection lost")
            self._after_close(1006)
        self.state = "closed"
        self.transport = None

    def _after_close(self, code: int) -> None:
        if self.worker.stopping:
            return
        if self.worker.resume and self.from_seq is not None and code in RESUME_CODES | {1006}:
            self.resumes += 1
            asyncio.get_running_loop().create_task(self._resume())
        else:
            self.gone = True

    async def _resume(self) -> None:
        await asyncio.sleep(0.05)
        try:
            await asyncio.wait_for(self.connect(self.last), 30)
        except (TimeoutError, OSError, ConnectionError) as exc:
            self.other.append(f"resume failed: {exc!r}")
            self.gone = True


class _WsProtocol(asyncio.Protocol):
    def __init__(self, subscriber: Subscriber, request: bytes) -> None:
        self.subscriber = subscriber
        self.request = request

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.subscriber.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.subscriber.worker.received(self.subscriber, data, time.time())

    def connection_lost(self, exc: Exception | None) -> None:
        self.subscriber.worker.received(self.subscriber, None, time.time())


class SubscriberWorker:
    """A client process: holds its share of the subscribers, answers the orchestrator's
    commands (one JSON line each on stdin, one JSON line back on stdout)."""

    def __init__(self, port: int, resume: bool) -> None:
        self.port = port
        self.resume = resume
        self.stopping = False
        self.subscribers: list[Subscriber] = []
        # What the sockets delivered and is not parsed yet: (subscriber, bytes or None for a
        # lost connection, when it was read). A receipt is the time its bytes were read from
        # the socket; parsing goes in slices between reads, so that a burst (an anchoring
        # batch: 256 events for each of 500 subscribers) parsed for some sockets does not
        # leave the others' bytes waiting in the kernel, timed late.
        self.unparsed: deque[tuple[Subscriber, bytes | None, float]] = deque()
        self.parsing = False

    def received(self, subscriber: Subscriber, data: bytes | None, now: float) -> None:
        self.unparsed.append((subscriber, data, now))
        if not self.parsing:
            self.parsing = True
            asyncio.get_running_loop().call_soon(self._parse_some)

    def _parse_some(self) -> None:
        deadline = time.perf_counter() + PARSE_SLICE
        unparsed = self.unparsed
        while unparsed and time.perf_counter() < deadline:
            subscriber, data, now = unparsed.popleft()
            if data is None:
                subscriber.lost()
            else:
                subscriber.feed(data, now)
        if unparsed:
            asyncio.get_running_loop().call_soon(self._parse_some)  # after the reads ready now
        else:
            self.parsing = False

    async def open(self, first: int, count: int, concurrency: int) -> dict[str, Any]:
        began = time.time()
        gate = asyncio.Semaphore(concurrency)
        errors: Counter[str] = Counter()
        fresh = [Subscriber(self, first + i) for i in range(count)]
        self.subscribers.extend(fresh)

        async def one(sub: Subscriber) -> None:
            async with gate:
                try:
                    await asyncio.wait_for(sub.connect(None), 60)
                except (TimeoutError, OSError, ConnectionError) as exc:
                    errors[f"{type(exc).__name__}: {exc}"[:120]] += 1
                    sub.gone = True
                    if sub.transport is not None:
                        sub.transport.abort()

        await asyncio.gather(*(one(s) for s in fresh))
        return {
            "subscribed": sum(1 for s in fresh if s.from_seq is not None),
            "errors": dict(errors),
            "seconds": time.time() - began,
        }

    def status(self) -> dict[str, Any]:
        live = [s for s in self.subscribers if not s.gone]
        lasts = [s.last for s in live if s.last is not None]
        return {
            "live": len(live),
            "open": sum(1 for s in live if s.state == "open"),
            "events": sum(len(s.seqs) for s in self.subscribers),
            "min_last": min(lasts) if lasts else None,
            "closes": dict(Counter(str(c[0]) for s in self.subscribers for c in s.closes)),
            "cpu": time.process_time(),
        }

    def results(self) -> list[dict[str, Any]]:
        return [
            {
                "index": s.index,
                "from": s.from_seq,
                "seqs": s.seqs,
                "times": s.times,
                "closes": s.closes,
                "heartbeats": s.heartbeats,
                "resumes": s.resumes,
                "other": s.other[:20],
            }
            for s in self.subscribers
        ]

    def stop(self) -> None:
        self.stopping = True
        for s in self.subscribers:
            if s.transport is not None:
                s.transport.abort()


async def _worker_main(port: int, resume: bool) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    worker = SubscriberWorker(port, resume)

    def reply(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    while line := await reader.readline():
        command = json.loads(line)
        name = command["cmd"]
        if name == "open":
            reply(await worker.open(command["first"], command["count"], command["concurrency"]))
        elif name == "status":
            reply(worker.status())
        elif name == "finish":
            worker.stop()
            await asyncio.sleep(0.1)
            _dump(Path(command["out"]), worker.results())
            reply({"cpu": time.process_time()})
            return
    worker.stop()


def client_loop() -> str:
    """The subscriber workers' event loop: uvloop when it is installed (`pip install -e
    '.[bench]'`: the client processes then used 0.64 of their core instead of 0.95 in the same
    run), else asyncio's own."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def _fast_event_loop() -> None:
    if client_loop() == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _dump(path: Path, data: Any) -> None:
    with path.open("wb") as out:
        pickle.dump(data, out, protocol=pickle.HIGHEST_PROTOCOL)


def _load(path: Path) -> Any:
    with path.open("rb") as handle:
        return pickle.load(handle)


# --- the open-loop writer (its own process) ------------------------------------------------


async def _writer_main(args: argparse.Namespace) -> None:
    """POST the pool's lines [offset, offset + count) at `rate` a second, each on schedule
    whatever the previous ones do (open loop), over up to `connections` keep-alive
    connections; a request waits for a free connection (that wait counts in its latency)."""
    port, token = args.port, os.environ["BENCH_TOKEN"]
    items = []
    for line in _read_lines(Path(args.pool), args.offset, args.count):
        key, body = line.split(" ", 1)
        raw = body.encode()
        head = (
            f"POST /v1/entries HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {token}\r\nIdempotency-Key: {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
        ).encode()
        items.append((json.loads(body)["entryDid"], head + raw))
    conns: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
    for _ in range(args.connections):
        conns.put_nowait(await asyncio.open_connection("127.0.0.1", port))
    results: list[tuple[str, int, float, float, float, str]] = []

    async def one(did: str, request: bytes, scheduled: float) -> None:
        reader, writer = await conns.get()
        sent = time.time()
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for header in head.split(b"\r\n")[1:]:
                name, _, value = header.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
                elif name.strip().lower() == b"transfer-encoding":
                    raise RuntimeError("chunked answer: not handled by this client")
            body = await reader.readexactly(length)
            done = time.time()
            conns.put_nowait((reader, writer))
        except (OSError, RuntimeError, asyncio.IncompleteReadError, ValueError) as exc:
            writer.close()
            results.append((did, -1, scheduled, sent, math.nan, repr(exc)[:200]))
            with contextlib.suppress(OSError):
                conns.put_nowait(await asyncio.open_connection("127.0.0.1", port))
            return
        note = "" if status == 201 else body[:200].decode(errors="replace")
        results.append((did, status, scheduled, sent, done, note))

    loop = asyncio.get_running_loop()
    start_mono = loop.time() + 0.05
    start_wall = time.time() + 0.05
    print(f"started {start_wall}", flush=True)
    tasks = []
    for i, (did, request) in enumerate(items):
        delay = start_mono + i / args.rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(did, request, start_wall + i / args.rate)))
    _, pending = await asyncio.wait(tasks, timeout=args.grace) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    answered = {r[0] for r in results}
    for i, (did, _) in enumerate(items):
        if did not in answered:
            results.append((did, 0, start_wall + i / args.rate, math.nan, math.nan, "no answer"))
    print(f"done {time.time()}", flush=True)
    _dump(Path(args.out), results)


def _read_lines(path: Path, offset: int, count: int) -> list[str]:
    return path.read_text().splitlines()[offset : offset + count]


# --- the orchestrator ----------------------------------------------------------------------


def _read_line(popen: subprocess.Popen[bytes], timeout: float, what: str) -> str:
    """One line of a child's stdout, within `timeout` seconds (the child writes whole lines)."""
    assert popen.stdout is not None
    fd = popen.stdout.fileno()
    data = b""
    deadline = time.monotonic() + timeout
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise RuntimeError(f"{what}: no answer within {timeout:.0f}s")
        chunk = os.read(fd, 65536)
        if not chunk:
            raise RuntimeError(f"{what} exited ({popen.poll()})")
        data += chunk
    return data.decode().strip()


@dataclass
class Worker:
    popen: subprocess.Popen[bytes]
    first: int
    count: int

    def ask(self, command: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        assert self.popen.stdin is not None
        self.popen.stdin.write((json.dumps(command) + "\n").encode())
        self.popen.stdin.flush()
        answer: dict[str, Any] = json.loads(_read_line(self.popen, timeout, "subscriber worker"))
        return answer


@dataclass
class WriterRun:
    name: str
    results: list[tuple[str, int, float, float, float, str]]
    started: float
    finished: float
    cpu: dict[str, float]  # server, postgres, clients, others: CPU seconds in the window
    per_second: list[float] = field(default_factory=list)  # the server's CPU share

    @property
    def ok(self) -> list[tuple[str, int, float, float, float, str]]:
        return [r for r in self.results if r[1] == 201]

    @property
    def throughput(self) -> float:
        """201s a second, from the first scheduled request to the last 201."""
        ok = self.ok
        if not ok:
            return 0.0
        first = min(r[2] for r in self.results)
        return len(ok) / max(1e-9, max(r[4] for r in ok) - first)

    def latency_ms(self, p: float, *, from_sent: bool = False) -> float:
        col = 3 if from_sent else 2
        return percentile(sorted((r[4] - r[col]) * 1000 for r in self.ok), p)

    def failures(self) -> Counter[str]:
        return Counter(f"{r[1]} {r[5][:80]}".strip() for r in self.results if r[1] != 201)

    def share(self, key: str) -> float:
        return self.cpu.get(key, 0.0) / max(1e-9, self.finished - self.started)


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of sorted `values`; NaN if there are none."""
    if not values:
        return math.nan
    rank = max(1, math.ceil(p / 100 * len(values)))
    return values[min(rank, len(values)) - 1]


def per_second(shares: list[float]) -> str:
    if not shares:
        return "-"
    ordered = sorted(shares)
    return f"{ordered[len(ordered) // 2]:.0%} / {ordered[-1]:.0%}"


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def run_queue_wait(pid: int) -> float:
    """Seconds the threads of `pid` have spent runnable but waiting for a core (schedstat)."""
    total = 0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def all_cpu() -> dict[int, float]:
    """pid → CPU seconds of every process."""
    return {int(e.name): proc_cpu(int(e.name)) for e in Path("/proc").iterdir() if e.name.isdigit()}


def pg_pids(bench: Bench) -> set[int]:
    """The bench database's backends and PostgreSQL's background processes. Not the CPU of
    backends that exited (`postgres_pids`' negative pid): the server's pool keeps its
    connections, and on a shared machine that figure is mostly other databases' tests."""
    return {p for p in postgres_pids(bench.args.postgres, bench.db) if p > 0}


class CpuWindow:
    """CPU seconds spent in a window by the server, PostgreSQL (the bench database's backends,
    the background processes and the backends that exited meanwhile), our client processes
    (writer and subscriber workers), this process, and everything else ("others")."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.began = time.time()
        self.groups = self._groups(pg_pids(bench))
        self.before_all = all_cpu()
        self.before = cpu_snapshot(set().union(*self.groups.values()))
        self.waited = run_queue_wait(bench.server.pid) if bench.server else 0.0

    def _groups(self, pg: set[int]) -> dict[str, set[int]]:
        b = self.bench
        return {
            "server": {b.server.pid} if b.server else set(),
            "postgres": pg,
            "clients": {w.popen.pid for w in b.workers} | b.writer_pids,
            "bench": {os.getpid()},
        }

    def close(self) -> tuple[float, dict[str, float]]:
        pg = self.groups["postgres"] | pg_pids(self.bench)
        groups = self._groups(pg)
        after_all = all_cpu()
        ended = time.time()
        out = {k: cpu_delta(self.before, cpu_snapshot(pids)) for k, pids in groups.items()}
        known = {abs(p) for pids in groups.values() for p in pids if p > 0}
        others = {p: c for p, c in after_all.items() if p not in known}
        out["others"] = cpu_delta(self.before_all, others)
        if self.bench.server:
            out["server_waiting"] = run_queue_wait(self.bench.server.pid) - self.waited
        return ended, out


class Sampler:
    """The server's CPU share, second by second, in a thread (`with Sampler(pid) as s`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.shares: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        cpu, at = proc_cpu(self.pid), time.monotonic()
        while not self._stop.wait(1.0):
            cpu2, at2 = proc_cpu(self.pid), time.monotonic()
            self.shares.append((cpu2 - cpu) / (at2 - at))
            cpu, at = cpu2, at2

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path, db: str) -> None:
        self.args = args
        self.workdir = workdir
        self.db = db
        self.server: Server | None = None
        self.workers: list[Worker] = []
        self.writer_pids: set[int] = set()
        self.children: list[subprocess.Popen[bytes]] = []
        self.cores = os.cpu_count() or 1

    def client_core(self, i: int) -> int | None:
        """Clients run on the cores the server does not (with one core: unpinned)."""
        if self.cores < 2:
            return None
        return 1 + i % (self.cores - 1)

    def spawn(
        self, argv: list[str], core: int | None, env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        cmd = pinned(core, [sys.executable, str(Path(__file__).resolve()), *argv])
        popen = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=ROOT, bufsize=0
        )
        self.children.append(popen)
        return popen

    def write(
        self, name: str, port: int, pool: Path, token: str, offset: int, count: int
    ) -> WriterRun:
        args = self.args
        out = self.workdir / f"writer-{name}.pickle"
        grace = args.writer_grace
        argv = [
            "--writer-worker", "--port", str(port), "--pool", str(pool),
            "--offset", str(offset), "--count", str(count), "--rate", str(args.rate),
            "--connections", str(args.writer_connections), "--grace", str(grace),
            "--out", str(out),
        ]  # fmt: skip
        env = {**os.environ, "BENCH_TOKEN": token}
        popen = self.spawn(argv, self.client_core(len(self.workers)), env)
        self.writer_pids.add(popen.pid)
        try:
            started = _read_line(popen, 120, "writer")
            window = CpuWindow(self)
            seconds = count / args.rate
            assert self.server is not None
            with Sampler(self.server.pid) as sampler:
                done = _read_line(popen, seconds + grace + 60, "writer")
            finished, cpu = window.close()
            popen.wait(60)
        finally:
            if popen.poll() is None:
                popen.kill()
                popen.wait(10)
        if popen.returncode != 0:
            raise RuntimeError(f"writer exited with {popen.returncode}")
        assert started.startswith("started"), started
        assert done.startswith("done"), done
        run = WriterRun(name, _load(out), float(started.split()[1]), finished, cpu)
        run.per_second = sampler.shares
        return run

    def status(self) -> list[dict[str, Any]]:
        return [w.ask({"cmd": "status"}) for w in self.workers]


# --- analysis ------------------------------------------------------------------------------


@dataclass
class Delivery:
    subscribers: int = 0
    expected: list[int] = field(default_factory=list)  # per subscriber
    received: list[int] = field(default_factory=list)
    complete: int = 0
    missing: int = 0
    missing_subscribers: int = 0
    duplicates: int = 0
    out_of_order: int = 0
    never_subscribed: int = 0
    closes: Counter[str] = field(default_factory=Counter)
    resumes: int = 0
    heartbeats: int = 0
    other: Counter[str] = field(default_factory=Counter)
    lat_resp: list[float] = field(default_factory=list)  # ms, sorted
    lat_at: list[float] = field(default_factory=list)
    # per entry: its first receipt among all subscribers − 201 (what the server alone adds;
    # when it is far below the receipts' own, the subscribers' processes are the bottleneck)
    lat_first: list[float] = field(default_factory=list)
    late_entries: int = 0  # entry events without a 201 (answered late or not at all)
    kinds: Counter[str] = field(default_factory=Counter)


def analyse(
    subs: list[dict[str, Any]],
    log_rows: list[tuple[int, str, str | None, float]],
    commits: dict[str, float],
) -> Delivery:
    from registry.changes import INTERNAL_KINDS

    d = Delivery(subscribers=len(subs))
    public = [row for row in log_rows if row[1] not in INTERNAL_KINDS]
    public_seqs = [row[0] for row in public]
    resp_of: dict[int, float] = {}
    at_of: dict[int, float] = {}
    for seq, kind, did, at in public:
        at_of[seq] = at
        if kind == "entry.created" and did in commits:
            resp_of[seq] = commits[did]
    lat_resp: list[float] = []
    lat_at: list[float] = []
    first: dict[int, float] = {}
    for sub in subs:
        d.closes.update(f"{c[0]} {c[1][:60]}".strip() for c in sub["closes"])
        d.resumes += sub["resumes"]
        d.heartbeats += sub["heartbeats"]
        d.other.update(sub["other"])
        if sub["from"] is None:
            d.never_subscribed += 1
            continue
        expected = public_seqs[bisect.bisect_right(public_seqs, sub["from"]) :]
        seqs: array[int] = sub["seqs"]
        d.expected.append(len(expected))
        d.received.append(len(seqs))
        got = set(seqs)
        d.duplicates += len(seqs) - len(got)
        d.out_of_order += sum(1 for a, b in itertools.pairwise(seqs) if b <= a)
        missing = len(set(expected) - got)
        d.missing += missing
        d.missing_subscribers += missing > 0
        d.complete += missing == 0
        seen: set[int] = set()
        for seq, t in zip(seqs, sub["times"], strict=True):
            if seq in seen:
                continue
            seen.add(seq)
            commit = resp_of.get(seq)
            if commit is not None:
                lat_resp.append((t - commit) * 1000)
                lat_at.append((t - at_of[seq]) * 1000)
                if t < first.get(seq, math.inf):
                    first[seq] = t
    d.kinds = Counter(row[1] for row in public)
    d.late_entries = sum(1 for row in public if row[1] == "entry.created") - len(resp_of)
    lat_resp.sort()
    lat_at.sort()
    d.lat_resp, d.lat_at = lat_resp, lat_at
    d.lat_first = sorted((t - resp_of[seq]) * 1000 for seq, t in first.items())
    return d


def read_log(url: str, after: int, upto: int) -> list[tuple[int, str, str | None, float]]:
    """The log records in (after, upto]: sequence, kind, entry DID, `at` (epoch seconds)."""
    import asyncpg

    async def run() -> list[tuple[int, str, str | None, float]]:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            rows = await conn.fetch(
                "SELECT seq, kind, entry_did, extract(epoch FROM at)::float8 AS at"
                " FROM log WHERE seq > $1 AND seq <= $2 ORDER BY seq",
                after,
                upto,
            )
        finally:
            await conn.close()
        return [(int(r["seq"]), r["kind"], r["entry_did"], float(r["at"])) for r in rows]

    return asyncio.run(run())


def log_head(url: str) -> int:
    import asyncpg

    async def run() -> int:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            return int(await conn.fetchval("SELECT seq FROM log_head WHERE id = 1"))
        finally:
            await conn.close()

    return asyncio.run(run())


# --- the report ----------------------------------------------------------------------------


def report(
    header: list[str],
    a: WriterRun,
    b: WriterRun,
    d: Delivery,
    memory: dict[str, float],
    drain: dict[str, Any],
    n: int,
) -> bool:
    width = 100
    print()
    print("=" * width)
    for line in header:
        print(line)
    print("-" * width)
    print(
        f"{'writer (POST /v1/entries, open loop)':<44} {'no subscribers':>16} {n:>6,} subscribers"
    )

    def both(value: Any) -> tuple[str, str]:
        return value(a), value(b)

    def p50_99(run: WriterRun, sent: bool) -> str:
        return " / ".join(fmt(run.latency_ms(p, from_sent=sent), ".1f") for p in (50, 99))

    rows = [
        ("scheduled", *both(lambda r: f"{len(r.results):,}")),
        ("answered 201", *both(lambda r: f"{len(r.ok):,}")),
        ("other answers / no answer", *both(lambda r: f"{len(r.results) - len(r.ok):,}")),
        ("achieved writes/s", *both(lambda r: f"{r.throughput:,.1f}")),
        ("latency from schedule p50 / p99 ms", *both(lambda r: p50_99(r, False))),
        ("latency from send p50 / p99 ms", *both(lambda r: p50_99(r, True))),
        ("server CPU (share of one core)", *both(lambda r: f"{r.share('server'):.0%}")),
        ("  each second: median / max", *both(lambda r: per_second(r.per_second))),
        ("  runnable, waiting for a core", *both(lambda r: f"{r.share('server_waiting'):.0%}")),
        ("  per 201 (ms)", *both(lambda r: fmt(r.cpu.get("server", 0) / len(r.ok) * 1e3, ".2f"))),
        ("PostgreSQL CPU (cores)", *both(lambda r: f"{r.share('postgres'):.2f}")),
        ("clients CPU (cores: writer + subscribers)", *both(lambda r: f"{r.share('clients'):.2f}")),
        ("others CPU (cores, outside the bench)", *both(lambda r: f"{r.share('others'):.2f}")),
    ]
    for label, x, y in rows:
        print(f"  {label:<42} {x:>16} {y:>18}")
    ratio = b.throughput / a.throughput if a.throughput else math.nan
    verdict = "MET" if ratio >= THROUGHPUT_TARGET else "NOT MET"
    print(
        f"  writer throughput ratio (with / without subscribers): {fmt(ratio, '.3f')}"
        f"  (target ≥ {THROUGHPUT_TARGET:.2f}): {verdict}"
    )
    print("-" * width)
    print(f"subscribers ({n:,} WebSocket connections, no filter, live from the head)")
    print(
        f"  subscribed {n - d.never_subscribed:,}/{n:,} in {memory['open_s']:.1f}s;"
        f" server VmRSS {memory['before_kb'] / 1024:,.1f} MB before,"
        f" {memory['after_kb'] / 1024:,.1f} MB with them idle"
    )
    print(
        f"  memory per idle subscriber: {memory['per_sub_kb']:,.1f} KB"
        f" ((after − before) / {n:,}; VmRSS of the server process)"
    )
    kinds = ", ".join(f"{v:,} {k}" for k, v in sorted(d.kinds.items()))
    exp = sorted(d.expected)
    rec = sorted(d.received)
    print(f"  log records in phase B: {kinds or 'none'}")
    if exp:
        print(
            f"  events expected per subscriber: {exp[0]:,}..{exp[-1]:,};"
            f" received min / median / max: {rec[0]:,} / {rec[len(rec) // 2]:,} / {rec[-1]:,}"
        )
    print(
        f"  received every event: {d.complete:,}/{n:,}; missing: {d.missing:,} events at"
        f" {d.missing_subscribers:,} subscribers; duplicates {d.duplicates:,};"
        f" out of order {d.out_of_order:,}"
    )
    closes = ", ".join(f"{v:,}× {k}" for k, v in d.closes.most_common(5)) or "none"
    print(f"  closes by the server: {closes}; resumed (fromSequence): {d.resumes:,}")
    if d.other:
        print(f"  other messages: {dict(d.other.most_common(5))}")
    print(
        f"  drain after the last write: {drain['seconds']:.1f}s"
        f" ({'all caught up' if drain['caught_up'] else 'NOT caught up by --drain'});"
        f" server CPU during the drain {drain['server_share']:.0%}"
        f" (each second: median / max {drain['server_seconds']}; waiting for a core"
        f" {drain['server_waiting']:.0%})"
    )
    print("-" * width)
    print(
        f"commit-to-receipt, ms (every subscriber × every entry.created of phase B):"
        f" {len(d.lat_resp):,} receipts"
    )
    print(f"  {'':<32} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}")
    for label, values in (
        ("receipt − 201 (lower bound)", d.lat_resp),
        ("receipt − at (upper bound)", d.lat_at),
        ("first receipt − 201 (per entry)", d.lat_first),
    ):
        print(
            f"  {label:<32}"
            + "".join(f" {fmt(percentile(values, p), ',.1f'):>9}" for p in (50, 90, 99))
            + f" {fmt(values[-1] if values else math.nan, ',.1f'):>9}"
        )  # fmt: skip
    p99 = percentile(d.lat_resp, 99)
    print(
        f"  target p99 < {P99_TARGET_MS:.0f} ms: {'MET' if p99 < P99_TARGET_MS else 'NOT MET'}"
        f" (lower bound {fmt(p99, ',.1f')} ms;"
        f" upper bound {fmt(percentile(d.lat_at, 99), ',.1f')} ms)"
    )
    if d.missing:
        print(
            f"  (percentiles over the receipts only: the {d.missing:,} events not read by the end"
            " of the drain would all come later)"
        )
    if d.late_entries:
        print(f"  ({d.late_entries:,} entry.created records had no 201 to time them by)")
    delivered = sum(d.received)
    extra = (
        b.cpu.get("server", 0.0)
        + drain["server_cpu"]
        - a.cpu.get("server", 0.0) * (len(b.ok) / max(1, len(a.ok)))
    )
    if delivered:
        us = extra / delivered * 1e6
        print(
            f"  server CPU per delivered event ≈ {us:,.1f} µs (phase B + drain minus phase A's"
            f" CPU per write): one core delivers ≈ {1e6 / us:,.0f} events/s,"
            f" ≈ {1e6 / us / n:,.1f} writes/s to {n:,} subscribers"
        )
    print("-" * width)
    clean = (
        len(a.ok) == len(a.results)
        and len(b.ok) == len(b.results)
        and d.missing == 0
        and d.never_subscribed == 0
        and d.duplicates == 0
        and d.out_of_order == 0
    )
    problems = []
    for run in (a, b):
        if run.failures():
            problems.append(f"writer {run.name}: {dict(run.failures().most_common(5))}")
    if d.never_subscribed:
        problems.append(f"{d.never_subscribed} subscribers never subscribed")
    if d.missing:
        problems.append(
            f"{d.missing:,} events not received by {d.missing_subscribers:,} subscribers"
        )
    for p in problems:
        print(f"ERRORS: {p}")
    if not clean:
        print("THIS RUN HAD ERRORS (see above)")
    print("=" * width)
    return clean


# --- the run -------------------------------------------------------------------------------


def _sigterm(_signo: int, _frame: Any) -> None:
    raise KeyboardInterrupt  # run the cleanup in `finally`, as Ctrl-C does


def main_bench(args: argparse.Namespace) -> int:
    registry_bin = VENV_BIN / "registry"
    if not registry_bin.exists():
        print(f"no {registry_bin}: run this with the project's venv python", file=sys.stderr)
        return 2
    n = args.subscribers
    workers = max(1, min(args.workers, n))
    cores = os.cpu_count() or 1
    if shutil.which("taskset") is None or cores < 2:
        print("warning: no taskset or one core: processes are not pinned", file=sys.stderr)
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = n + 256
    if soft < need:  # the server and the workers inherit it
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))
    signal.signal(signal.SIGTERM, _sigterm)

    busy_before = idle_check()
    waited_until = time.monotonic() + args.wait_idle
    while busy_before > 0.1 and time.monotonic() < waited_until:
        log(f"machine {busy_before:.0%} busy (other processes); waiting for it to go idle")
        busy_before = idle_check(2.0)
    log(
        f"machine {busy_before:.0%} busy before start"
        + ("  WARNING: not idle, figures may be off" if busy_before > 0.1 else "")
    )
    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="registry-bench-ev-"))
    db = f"registry_bench_ev_{secrets.token_hex(4)}"
    bench = Bench(args, workdir, db)
    db_created = False
    clean = False
    url = f"{args.postgres}/{db}"
    try:
        revision = git_revision()
        log(f"service at commit {revision}; database {db}, work dir {workdir}")
        db_admin(args.postgres, f'CREATE DATABASE "{db}"')
        db_created = True
        env = {
            **os.environ,
            **SERVICE_ENV,
            "REGISTRY_EVENTS__MAX_CONNECTIONS": str(max(n + 100, 10_000)),
        }
        events_env = {k: v for k, v in env.items() if k.startswith("REGISTRY_EVENTS__")}
        port = free_port()
        cmd = [
            str(registry_bin), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--data-dir", str(workdir / "data"), "--database-url", url,
        ]  # fmt: skip
        core = SERVER_CORE if cores >= 2 else None
        bench.server = start_server("registry", cmd, port, core, workdir, env)
        wait_ready(bench.server, "/v1/health", 60, want=lambda b: b.get("status") == "ok")
        log(f"registry serve on :{port}, pid {bench.server.pid}, core {core}")

        from cli.client import RegistryClient
        from registry.keys import SigningKey

        seed = secrets.token_bytes(32)
        key = SigningKey(seed)
        with RegistryClient(f"http://127.0.0.1:{port}") as client:
            client.sign_in(key)
            token = client.token
        assert token
        per_phase = round(args.rate * args.seconds)
        warm = round(args.rate * args.warmup)
        pool = workdir / "pool.txt"
        total = warm + 2 * per_phase
        prefix = f"did:web:bench.example.com:ev{secrets.token_hex(3)}:"
        took = write_pool(pool, seed, prefix, total, cores)
        log(f"signed {total:,} entries in {took:.1f}s")

        if warm:
            log(f"warm-up: {warm} writes at {args.rate:g}/s")
            bench.write("warm-up", port, pool, token, 0, warm)
        log(f"phase A: {per_phase:,} writes at {args.rate:g}/s, no subscribers")
        a = bench.write("A", port, pool, token, warm, per_phase)
        log(
            f"phase A: {len(a.ok):,}/{len(a.results):,} 201, {a.throughput:,.1f}/s,"
            f" p99 {a.latency_ms(99):.1f} ms, server CPU {a.share('server'):.0%}"
        )

        time.sleep(1.0)
        rss_before = rss_kb(bench.server.pid)
        head_before = log_head(url)
        log(
            f"server VmRSS {rss_before / 1024:.1f} MB;"
            f" opening {n:,} subscribers ({workers} workers)"
        )
        t_open = time.monotonic()
        share = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
        first = 0
        for i, count in enumerate(share):
            argv = ["--subscriber-worker", "--port", str(port)]
            if not args.resume:
                argv.append("--no-resume")
            popen = bench.spawn(argv, bench.client_core(i), dict(os.environ))
            bench.workers.append(Worker(popen, first, count))
            first += count
        concurrency = max(1, args.open_concurrency // workers)
        for w in bench.workers:  # all workers open at once
            assert w.popen.stdin is not None
            message = {
                "cmd": "open",
                "first": w.first,
                "count": w.count,
                "concurrency": concurrency,
            }
            w.popen.stdin.write((json.dumps(message) + "\n").encode())
            w.popen.stdin.flush()
        opened = [json.loads(_read_line(w.popen, 180, "subscriber worker")) for w in bench.workers]
        open_s = time.monotonic() - t_open
        subscribed = sum(o["subscribed"] for o in opened)
        errors: Counter[str] = Counter()
        for o in opened:
            errors.update(o["errors"])
        log(
            f"{subscribed:,}/{n:,} subscribed in {open_s:.1f}s"
            + (f"; errors {dict(errors)}" if errors else "")
        )
        time.sleep(args.settle)
        rss_after = rss_kb(bench.server.pid)
        memory = {
            "before_kb": rss_before,
            "after_kb": rss_after,
            "per_sub_kb": (rss_after - rss_before) / max(1, subscribed),
            "open_s": open_s,
        }
        log(
            f"server VmRSS {rss_after / 1024:.1f} MB with {subscribed:,} idle subscribers:"
            f" {memory['per_sub_kb']:.1f} KB each"
        )

        log(f"phase B: {per_phase:,} writes at {args.rate:g}/s, {subscribed:,} subscribers")
        b = bench.write("B", port, pool, token, warm + per_phase, per_phase)
        log(
            f"phase B: {len(b.ok):,}/{len(b.results):,} 201, {b.throughput:,.1f}/s,"
            f" p99 {b.latency_ms(99):.1f} ms, server CPU {b.share('server'):.0%}"
        )
        head = log_head(url)
        window = CpuWindow(bench)
        drain_sampler = Sampler(bench.server.pid).__enter__()
        t_drain = time.monotonic()
        caught_up = False
        last_note = 0.0
        while True:
            status = bench.status()
            lasts = [s["min_last"] for s in status if s["live"] and s["min_last"] is not None]
            live = sum(s["live"] for s in status)
            behind = min(lasts) if lasts else head
            if behind >= head or not live:
                caught_up = behind >= head
                break
            elapsed = time.monotonic() - t_drain
            if elapsed > args.drain:
                break
            if elapsed - last_note >= 5:
                events = sum(s["events"] for s in status)
                log(
                    f"draining: slowest subscriber at {behind:,} of {head:,};"
                    f" {events:,} events received in all"
                )
                last_note = elapsed
            time.sleep(0.25)
        drain_sampler.__exit__()
        drain_end, drain_cpu = window.close()
        drain = {
            "seconds": time.monotonic() - t_drain,
            "caught_up": caught_up,
            "server_cpu": drain_cpu["server"],
            "server_share": drain_cpu["server"] / max(1e-9, drain_end - window.began),
            "server_seconds": per_second(drain_sampler.shares),
            "server_waiting": drain_cpu.get("server_waiting", 0.0)
            / max(1e-9, drain_end - window.began),
        }
        log(f"drain: {drain['seconds']:.1f}s, caught up: {caught_up}")

        subs: list[dict[str, Any]] = []
        for i, w in enumerate(bench.workers):
            out = workdir / f"subscribers-{i}.pickle"
            w.ask({"cmd": "finish", "out": str(out)}, timeout=120)
            subs.extend(_load(out))
            w.popen.wait(30)
        log(f"collected {sum(len(s['seqs']) for s in subs):,} receipts; checking against the log")
        rows = read_log(url, head_before, head)  # what the drain waited for
        commits = {r[0]: r[4] for r in b.ok}
        delivery = analyse(subs, rows, commits)

        events_cfg = ", ".join(f"{k}={v}" for k, v in sorted(events_env.items()))
        header = [
            f"bench/events.py: {n:,} subscribers; writer {args.rate:g} entries/s for"
            f" {args.seconds:g}s, once without and once with the subscribers",
            f"service: commit {revision}; one `registry serve` pinned to core {core};"
            f" {events_cfg or 'events config: defaults'}; rate limits raised",
            f"clients: {workers} subscriber processes ({client_loop()}, minimal WebSocket client)"
            " and one"
            f" writer process ({args.writer_connections} keep-alive connections, raw HTTP/1.1),"
            f" on core(s) {sorted({bench.client_core(i) for i in range(workers + 1)}, key=str)}",
            f"machine: {cores} cores, {busy_before:.0%} busy before start; PostgreSQL"
            " 127.0.0.1:5432 (shared, never pinned), a fresh database; run took"
            f" {time.monotonic() - began:.0f}s",
        ]
        clean = report(header, a, b, delivery, memory, drain, n)
        return 0 if clean else 1
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for popen in bench.children:
            if popen.poll() is None:
                popen.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(10)
        if bench.server is not None:
            try:
                stop_server(bench.server)
            except Exception as exc:  # keep cleaning up
                print(f"stopping the server: {exc!r}", file=sys.stderr)
            if bench.server.popen.returncode not in (0, -signal.SIGTERM) or not clean:
                tail = bench.server.log_tail(15)
                if tail.strip():
                    print(
                        f"--- server log (exit {bench.server.popen.returncode}) ---\n{tail}",
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
    parser.add_argument("--subscribers", type=int, help="WebSocket subscribers (1000)")
    parser.add_argument("--rate", type=float, default=200.0, help="entries created a second (200)")
    parser.add_argument("--seconds", type=float, help="seconds of each phase (20)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 100 subscribers, 5 s phases, 1 s warm-up"
    )
    parser.add_argument("--workers", type=int, default=2, help="subscriber client processes (2)")
    parser.add_argument("--warmup", type=float, help="seconds of writes first (3)")
    parser.add_argument(
        "--settle", type=float, default=3.0, help="seconds idle before the second VmRSS (3)"
    )
    parser.add_argument(
        "--drain",
        type=float,
        help="seconds to wait after phase B for the subscribers to catch up (30)",
    )
    parser.add_argument(
        "--writer-connections", type=int, default=64, help="writer keep-alive connections (64)"
    )
    parser.add_argument(
        "--writer-grace",
        type=float,
        default=30.0,
        help="seconds the writer waits for answers after its last request (30)",
    )
    parser.add_argument(
        "--open-concurrency", type=int, default=100, help="handshakes in flight, in all (100)"
    )
    parser.add_argument(
        "--no-resume",
        dest="resume",
        action="store_false",
        help="do not resume (fromSequence) after a 4429/1011 close or a lost connection",
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
    parser.add_argument(
        "--batch",
        action="store_true",
        help="subscribe with batch: true (several queued events per frame)",
    )
    parser.add_argument("--keep-db", action="store_true", help="do not drop the bench database")
    parser.add_argument("--keep-workdir", action="store_true", help="keep logs and raw results")
    # The child processes (the same file, other roles).
    parser.add_argument("--subscriber-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--writer-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--pool", help=argparse.SUPPRESS)
    parser.add_argument("--offset", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--connections", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--grace", type=float, default=30.0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch:  # before the worker processes are spawned: they inherit the environment
        os.environ["BENCH_EVENTS_BATCH"] = "1"
        global BATCH
        BATCH = True
    if args.subscriber_worker:
        _fast_event_loop()
        asyncio.run(_worker_main(args.port, args.resume))
        return 0
    if args.writer_worker:
        asyncio.run(_writer_main(args))
        return 0
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:  # options given on the command line win over --quick
            setattr(args, name, value)
    return main_bench(args)


if __name__ == "__main__":
    sys.exit(main())
