#!/usr/bin/env python3
"""Hostile clients against one `registry serve`, with a bystander watching (docs/limits.md).

The issue's targets: under each attack, a concurrent legitimate client's `GET /v1/health` p99 <
100 ms and no error; the server's resident memory never more than 100 MiB above its baseline; 0
5xx; 0 tracebacks in the server log.

One run, on a fresh database `registry_bench_hostile_<hex>` of the local PostgreSQL server:
  * starts one `registry serve` with the default limits (rate limits raised, so the bystander
    is never rate-limited: the attacks here are about connections, frames and replays);
  * a baseline: the bystander (its own client address, 127.0.0.2, one keep-alive connection)
    calls `GET /v1/health` every 20 ms for `--seconds`;
  * each attack, from its own client addresses in 127.0.0.0/8, while the bystander does the same:
      close-flood   1,500 x `GET /nope` with `Connection: close`, never closing the socket
      slow-body     1,100 sockets each sending a chunked `POST /v1/discover` head, one chunk
      slow-head     500 sockets sending a request head one byte a second
      partial-ws    60 WebSocket clients each announcing a 16,000,000-byte message, sending 64 KB
      ping-flood    20 WebSocket clients sending pings as fast as they can and never reading
      replays       300 WebSocket sockets (10 addresses) re-subscribing from sequence 0 every 2 s
      big-ints      500 `POST /v1/discover` bodies with a 5,000-digit integer
  * prints, per attack: the bystander's p50 / p99 / max latency and errors, the server's open
    files and resident memory (peak, above baseline), the server's 5xx answers seen by the
    attack, and how the attack's connections ended.

    .venv/bin/python bench/hostile.py                 # ~2 minutes
    .venv/bin/python bench/hostile.py --seconds 3     # shorter phases

All traffic goes to 127.0.0.1 (sources 127.0.0.x); every loop is bounded in count and time.
Exit status: 0 when every target was met, 1 otherwise, 2 when a prerequisite is missing.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import multiprocessing
import os
import secrets
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.entries import (  # noqa: E402
    SERVICE_ENV,
    db_admin,
    free_port,
    start_server,
    stop_server,
    wait_ready,
)

BYSTANDER = "127.0.0.2"
READ_TIMEOUT = 10.0  # the default server.read_timeout_seconds
REQUEST_TIMEOUT = 10.0  # server.request_timeout_seconds for the run (default 30: a shorter run)
P99_TARGET_MS = 100.0
RSS_TARGET_MIB = 100.0


# --- probes of the server process ---------------------------------------------------------------


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# --- the bystander --------------------------------------------------------------------------------


@dataclass
class Watch:
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    rss_peak: float = 0.0
    files_peak: int = 0


def bystander(port: int, pid: int, stop: threading.Event, watch: Watch) -> None:
    """`GET /v1/health` every 20 ms on one keep-alive connection from its own address (a new
    connection after any failure); also samples the server's memory and open files."""
    conn: http.client.HTTPConnection | None = None
    while not stop.is_set():
        started = time.perf_counter()
        try:
            if conn is None:
                conn = http.client.HTTPConnection(
                    "127.0.0.1", port, timeout=5, source_address=(BYSTANDER, 0)
                )
            conn.request("GET", "/v1/health")
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                watch.errors.append(f"HTTP {response.status}")
            watch.latencies_ms.append((time.perf_counter() - started) * 1000)
        except (OSError, http.client.HTTPException) as exc:
            watch.errors.append(type(exc).__name__)
            if conn is not None:
                conn.close()
            conn = None
        with contextlib.suppress(OSError):
            watch.rss_peak = max(watch.rss_peak, rss_mib(pid))
            watch.files_peak = max(watch.files_peak, open_files(pid))
        stop.wait(0.02)
    if conn is not None:
        conn.close()


# --- raw clients ----------------------------------------------------------------------------------


def connect(port: int, source: str, timeout: float = 5) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def ws_open(port: int, source: str) -> socket.socket:
    sock = connect(port, source)
    key = base64.b64encode(os.urandom(16))
    sock.sendall(
        b"GET /v1/events HTTP/1.1\r\nHost: r\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("closed during the handshake")
        head += chunk
    if not head.startswith(b"HTTP/1.1 101 "):
        raise ConnectionError(head.split(b"\r\n", 1)[0].decode(errors="replace"))
    return sock


def frame(payload: bytes, opcode: int = 0x1, declared: int | None = None) -> bytes:
    size = len(payload) if declared is None else declared
    if size < 126:
        head = bytes((0x80 | opcode, 0x80 | size))
    elif size < 1 << 16:
        head = bytes((0x80 | opcode, 0xFE)) + size.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0xFF)) + size.to_bytes(8, "big")
    mask = os.urandom(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


@dataclass
class Outcome:
    """How the attack's connections fared, as counts by kind."""

    counts: dict[str, int] = field(default_factory=dict)
    status_5xx: int = 0

    def note(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def status_of(self, data: bytes) -> None:
        for line in data.split(b"\r\n"):
            if line.startswith(b"HTTP/1.1 5"):
                self.status_5xx += 1
                if not line.startswith(b"HTTP/1.1 503 Service Unavailable"):
                    self.note("5xx other than the connection refusal")


def ended(sock: socket.socket, wait: float) -> tuple[bytes, str]:
    """Read until the server closes or `wait` passes: (what came, how it ended)."""
    sock.settimeout(0.2)
    data = b""
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return data, "reset"
        if not chunk:
            return data, "closed"
        data += chunk
    return data, "still open"


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def attack_close_flood(port: int, seconds: float, out: Outcome) -> None:
    socks = []
    deadline = time.monotonic() + seconds
    for _ in range(1500):
        if time.monotonic() > deadline:
            break
        try:
            sock = connect(port, "127.0.0.10")
            sock.sendall(b"GET /nope HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n")
            socks.append(sock)
        except OSError:
            out.note("connect failed")
    for sock in socks:
        data, how = ended(sock, 2)
        out.status_of(data)
        out.note(how)
    close_all(socks)


def attack_slow_body(port: int, seconds: float, out: Outcome) -> None:
    socks = []
    for _ in range(1100):
        try:
            sock = connect(port, "127.0.0.11")
            sock.sendall(
                b"POST /v1/discover HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
            )
            socks.append(sock)
        except OSError:
            out.note("connect failed")
    time.sleep(max(seconds, READ_TIMEOUT + 2))  # past the read timeout: every one is cut
    for sock in socks:
        data, how = ended(sock, 0.05)
        out.status_of(data)
        out.note(how)
    close_all(socks)


def attack_slow_head(port: int, seconds: float, out: Outcome) -> None:
    socks = []
    for i in range(500):
        try:
            socks.append(connect(port, f"127.0.1.{i % 100 + 1}"))
        except OSError:
            out.note("connect failed")
    request = b"GET /v1/health HTTP/1.1\r\nHost: r\r\nX-Slow: " + b"a" * 1000
    alive = list(socks)
    for n in range(int(max(seconds, REQUEST_TIMEOUT + 2))):  # past the request timeout
        still = []
        for sock in alive:
            try:
                sock.send(request[n : n + 1])
                still.append(sock)
            except OSError:
                pass
        alive = still
        time.sleep(1)
    for sock in socks:
        data, how = ended(sock, 0.05)
        out.status_of(data)
        out.note(how)
    close_all(socks)


def attack_partial_ws(port: int, seconds: float, out: Outcome) -> None:
    socks = []
    for i in range(60):
        try:
            sock = ws_open(port, f"127.0.2.{i + 1}")
            sock.sendall(frame(b"y" * 65_536, declared=16_000_000)[:65_000])
            socks.append(sock)
        except OSError as exc:
            out.note(f"refused: {exc}"[:60])
    time.sleep(seconds)
    for sock in socks:
        data, how = ended(sock, 3)
        code = int.from_bytes(data[2:4], "big") if data[:1] == b"\x88" else None
        out.note(f"{how}, close {code}")
    close_all(socks)


def attack_ping_flood(port: int, seconds: float, out: Outcome) -> None:
    def flood(source: str) -> None:
        try:
            sock = ws_open(port, source)
        except OSError:
            out.note("refused")
            return
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        pings = frame(b"ping", opcode=0x9) * 100
        started = time.monotonic()
        try:
            while time.monotonic() - started < seconds + 40:
                sock.sendall(pings)
        except OSError:
            out.note(f"cut after {time.monotonic() - started:.0f} s")
        else:
            out.note("still connected")
        sock.close()

    threads = [threading.Thread(target=flood, args=(f"127.0.3.{i + 1}",)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def attack_replays(port: int, seconds: float, out: Outcome) -> None:
    socks = []
    for i in range(300):
        try:
            socks.append(ws_open(port, f"127.0.4.{i % 10 + 1}"))
        except OSError:
            out.note("socket refused")
    subscribe = frame(json.dumps({"type": "subscribe", "fromSequence": 0}).encode())
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.sendall(subscribe)
        for sock in socks:  # read what came, without waiting
            sock.settimeout(0.001)
            with contextlib.suppress(OSError):
                while data := sock.recv(65536):
                    if b"replay_rate_limited" in data:
                        out.note("replay refused")
                    if b'"subscribed"' in data:
                        out.note("replayed")
                    if data[:1] == b"\x88":
                        out.note(f"closed {int.from_bytes(data[2:4], 'big')}")
        time.sleep(2)
    close_all(socks)


def attack_big_ints(port: int, seconds: float, out: Outcome) -> None:
    body = b'{"limit": ' + b"9" * 5000 + b"}"
    deadline = time.monotonic() + seconds
    for i in range(500):
        if time.monotonic() > deadline:
            break
        try:
            sock = connect(port, f"127.0.5.{i % 50 + 1}")
            sock.sendall(
                b"POST /v1/discover HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            data, _ = ended(sock, 5)
            sock.close()
            out.status_of(data)
            out.note(data.split(b"\r\n", 1)[0].decode(errors="replace") or "no answer")
        except OSError:
            out.note("connect failed")


ATTACKS: dict[str, Callable[[int, float, Outcome], None]] = {
    "close-flood": attack_close_flood,
    "slow-body": attack_slow_body,
    "slow-head": attack_slow_head,
    "partial-ws": attack_partial_ws,
    "ping-flood": attack_ping_flood,
    "replays": attack_replays,
    "big-ints": attack_big_ints,
}


# --- the run --------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _run_attack(
    attack: Callable[[int, float, Outcome], None],
    port: int,
    seconds: float,
    results: multiprocessing.Queue[Outcome],
) -> None:
    out = Outcome()
    try:
        attack(port, seconds, out)
    finally:
        results.put(out)


def phase(
    port: int, pid: int, seconds: float, attack: Callable[[int, float, Outcome], None] | None
) -> tuple[Watch, Outcome]:
    """The bystander in this process, the attack in its own (so that neither waits for the
    other's share of the interpreter)."""
    watch = Watch()
    stop = threading.Event()
    thread = threading.Thread(target=bystander, args=(port, pid, stop, watch))
    thread.start()
    out = Outcome()
    try:
        if attack is None:
            time.sleep(seconds)
        else:
            context = multiprocessing.get_context("fork")
            results: multiprocessing.Queue[Outcome] = context.Queue()
            process = context.Process(target=_run_attack, args=(attack, port, seconds, results))
            process.start()
            out = results.get(timeout=seconds + 120)
            process.join(30)
    finally:
        stop.set()
        thread.join()
    return watch, out


def publish_one(port: int) -> None:
    """One entry, so that a replay from sequence 0 has something to read."""
    from cli.client import RegistryClient
    from registry.keys import SigningKey

    key = SigningKey.generate()
    with RegistryClient(f"http://127.0.0.1:{port}") as client:
        client.sign_in(key)
        client.publish(
            {
                "entryDid": f"did:web:bench.example:{secrets.token_hex(6)}",
                "entryType": "AgentDefinition",
                "itemData": {"model": "m"},
                "itemSchemaUri": "https://schemas.example.com/agent/v1",
                "registryVersion": "1.0",
                "name": "bench",
                "publishedAt": "2026-11-26T00:00:00Z",
                "version": "1.0.0",
            },
            key,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each phase")
    parser.add_argument("--only", action="append", choices=sorted(ATTACKS), help="attack(s)")
    args = parser.parse_args()
    registry_bin = Path(sys.executable).parent / "registry"
    if not registry_bin.exists():
        print("registry is not installed in this environment", file=sys.stderr)
        return 2

    workdir = Path(tempfile.mkdtemp(prefix="registry-bench-hostile-"))
    db = f"registry_bench_hostile_{secrets.token_hex(4)}"
    db_admin(args.postgres, f'CREATE DATABASE "{db}"')
    port = free_port()
    env = {
        **os.environ,
        **{k: v for k, v in SERVICE_ENV.items() if "LIMITS" in k or "LOGGING" in k},
        "REGISTRY_ANCHORING__ENABLED": "false",
        "REGISTRY_SERVER__REQUEST_TIMEOUT_SECONDS": str(REQUEST_TIMEOUT),
    }
    cmd = [
        str(registry_bin), "serve", "--host", "127.0.0.1", "--port", str(port),
        "--data-dir", str(workdir / "data"), "--database-url", f"{args.postgres}/{db}",
    ]  # fmt: skip
    server = start_server("registry", cmd, port, None, workdir, env)
    met = True
    try:
        wait_ready(server, "/v1/health", 60)
        publish_one(port)
        pid = server.pid
        time.sleep(1)
        base_rss = rss_mib(pid)
        rows = []
        watch, out = phase(port, pid, args.seconds, None)
        rows.append(("baseline", watch, out))
        for name in args.only or list(ATTACKS):
            watch, out = phase(port, pid, args.seconds, ATTACKS[name])
            rows.append((name, watch, out))
            time.sleep(1)
        tracebacks = server.log.read_text(errors="replace").count("Traceback")
        print()
        print(f"server baseline RSS {base_rss:.1f} MiB; health every 20 ms from {BYSTANDER}")
        header = f"{'attack':<12} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'n':>5} {'err':>4}"
        header += f" {'RSS+ MiB':>9} {'files':>6} {'5xx':>4}  connections"
        print(header)
        for name, watch, out in rows:
            lat = watch.latencies_ms
            grown = watch.rss_peak - base_rss
            p99 = percentile(lat, 0.99)
            bad_5xx = out.counts.get("5xx other than the connection refusal", 0)
            ok = not watch.errors and p99 < P99_TARGET_MS and grown < RSS_TARGET_MIB
            met &= ok and bad_5xx == 0
            print(
                f"{name:<12} {statistics.median(lat) if lat else float('nan'):7.1f} {p99:7.1f}"
                f" {max(lat, default=float('nan')):7.1f} {len(lat):5d} {len(watch.errors):4d}"
                f" {grown:9.1f} {watch.files_peak:6d} {out.status_5xx:4d}"
                f"  {json.dumps(out.counts)}"
            )
        print(f"tracebacks in the server log: {tracebacks}")
        met &= tracebacks == 0
        print(
            f"targets (bystander p99 < {P99_TARGET_MS:.0f} ms, no error, RSS <"
            f" +{RSS_TARGET_MIB:.0f} MiB, no 5xx but refusals, no traceback):"
            f" {'MET' if met else 'NOT MET'}"
        )
    finally:
        stop_server(server)
        with contextlib.suppress(Exception):
            db_admin(args.postgres, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
