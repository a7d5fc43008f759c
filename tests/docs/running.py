"""Running things as the documented examples were run: fresh databases, `registry serve`
processes, command lines in a sandbox (transcripts), HTTP exchanges written as the pages show
them. Nothing here sleeps: every wait is on a process, a pipe or a socket, with a deadline."""

from __future__ import annotations

import asyncio
import http.server
import os
import queue
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx

from tests.db.proc import free_port

T = TypeVar("T")

DEADLINE = 60.0  # seconds for any one command, server start or wait

# Response headers left out of a documented exchange: they restate the body or the clock.
TRANSPORT_HEADERS = frozenset({"date", "content-length"})


# --- databases -----------------------------------------------------------------------------------


class Databases:
    """Fresh, empty databases on the test database's server: each story's registry starts with
    an empty log, as the documented runs did, so sequences are the documented ones."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self._url = url
        self._admin = urlunsplit(parts._replace(path="/postgres"))

    def _execute(self, sql: str) -> None:
        async def run() -> None:
            conn = await asyncpg.connect(self._admin)
            try:
                await conn.execute(sql)
            finally:
                await conn.close()

        asyncio.run(run())

    @contextmanager
    def fresh(self, story: str) -> Iterator[str]:
        name = f"docs_{story.replace('-', '_')}_{secrets.token_hex(4)}"
        self._execute(f"CREATE DATABASE {name}")
        try:
            yield urlunsplit(urlsplit(self._url)._replace(path=f"/{name}"))
        finally:
            self._execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@dataclass
class Serving:
    """A running `registry serve`: its URL and its log (stdout and stderr), line by line."""

    url: str
    log: Lines


@contextmanager
def serving(args: Sequence[str], env: dict[str, str], cwd: Path) -> Iterator[Serving]:
    """`registry serve ARGS` until the block ends (then SIGTERM, and its exit is waited for);
    ready once it logs `serving on <url>` (read from its log as it comes: no polling)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log = Lines(proc)
        log.until(lambda got: any(" serving on " in line for line in got))
        ready = [line for line in log.lines if " serving on " in line]
        assert ready, f"`registry serve` exited {proc.wait()}:\n{''.join(log.lines)}"
        yield Serving(ready[0].rstrip().rsplit(" ", 1)[-1], log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=DEADLINE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def server_environ(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment without REGISTRY_* variables, anchoring off (unless `env` turns it on:
    its background changes take log positions), and `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
    return {**base, "REGISTRY_ANCHORING__ENABLED": "false", **(env or {})}


@contextmanager
def registry(
    databases: Databases, story: str, data_dir: Path, env: dict[str, str] | None = None
) -> Iterator[Serving]:
    """`registry serve` on a fresh database, default configuration but `env`."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with databases.fresh(story) as url:
        args = ["--port", str(free_port()), "--data-dir", str(data_dir), "--database-url", url]
        with serving(args, server_environ(env), data_dir) as server:
            yield server


@contextmanager
def together(*managers: AbstractContextManager[T]) -> Iterator[list[T]]:
    """Enter the context managers at once, each on a thread of its own (registries that are
    each other's peers start side by side), and leave them at once."""
    with ThreadPoolExecutor(len(managers)) as pool:
        futures = [pool.submit(manager.__enter__) for manager in managers]
    entered = [m for m, f in zip(managers, futures, strict=True) if f.exception() is None]
    try:
        yield [future.result() for future in futures]
    finally:
        if entered:
            with ThreadPoolExecutor(len(entered)) as pool:
                for done in [pool.submit(m.__exit__, None, None, None) for m in entered]:
                    done.result()


# --- HTTP ----------------------------------------------------------------------------------------


def exchange(response: httpx.Response, *, request: Sequence[str] = (), body: str = "") -> str:
    """An exchange as the pages write it: `> ` request lines (the method and path, the headers
    the client set, a stand-in for the body), then `< ` the status, the response headers in the
    order they came (but TRANSPORT_HEADERS) and the body."""
    lines = [f"> {line}" for line in request]
    if body:
        lines.append(f"> {body}")
    lines.append(f"< {response.status_code}")
    lines += [
        f"< {name}: {value}"
        for name, value in response.headers.multi_items()
        if name not in TRANSPORT_HEADERS
    ]
    lines.append(f"< {response.text}")
    return "\n".join(lines)


def request_lines(method: str, path: str, headers: dict[str, str]) -> list[str]:
    return [f"{method} {path}", *(f"{name.lower()}: {value}" for name, value in headers.items())]


# --- command lines -------------------------------------------------------------------------------


@dataclass
class Sandbox:
    """A directory to run command lines in as a user would: `registry` and `python` on PATH,
    HOME = the directory, no REGISTRY_* variables but `env`, output unbuffered (so stdout and
    stderr interleave as on a terminal)."""

    home: Path
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.bin = self.home.parent / f"{self.home.name}-bin"
        self.bin.mkdir(exist_ok=True)
        for name, command in (
            ("registry", f"exec {shlex.quote(sys.executable)} -m cli"),
            ("python", f"exec {shlex.quote(sys.executable)}"),
        ):
            shim = self.bin / name
            shim.write_text(f'#!/bin/sh\n{command} "$@"\n')
            shim.chmod(0o755)

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
        env.update(
            PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}",
            HOME=str(self.home),
            PYTHONUNBUFFERED="1",
            **self.env,
        )
        return env

    def run(self, command: str) -> tuple[int, str]:
        """Run a command line with bash; its status and its output (stdout and stderr)."""
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=self.home,
            env=self.environ(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=DEADLINE,
            check=False,
        )
        return done.returncode, done.stdout

    def ok(self, command: str) -> str:
        status, output = self.run(command)
        assert status == 0, (command, output)
        return output

    def first_lines(self, command: str, count: int) -> str:
        """A command that runs until it is stopped (`registry watch`): its first `count` lines
        of output; then it is interrupted (Ctrl-C)."""
        proc = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=self.home,
            env=self.environ(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            lines = Lines(proc).until(lambda got: len(got) >= count)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=DEADLINE)
        return "".join(lines[:count])


class Lines:
    """The output of a running process, line by line, waited for with a deadline (a thread
    reads the pipe and hands the lines over)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        stream = proc.stdout
        self._queue: queue.Queue[str | None] = queue.Queue()
        self.lines: list[str] = []
        self.ended = False

        def pump() -> None:
            with stream:
                for line in stream:
                    self._queue.put(line)
            self._queue.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def until(self, done: Callable[[list[str]], bool], deadline: float = DEADLINE) -> list[str]:
        """Every line so far, once `done(lines)` holds or the output has ended."""
        end = time.monotonic() + deadline
        while not self.ended and not done(self.lines):
            try:
                line = self._queue.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no more output in {deadline} s: {self.lines}") from None
            if line is None:
                self.ended = True
            else:
                self.lines.append(line)
        return self.lines


# --- transcripts ---------------------------------------------------------------------------------

PROMPT = "$ "


def commands(transcript: str) -> list[str]:
    """The command lines of a documented transcript (the lines after `$ `)."""
    return [line[len(PROMPT) :] for line in transcript.split("\n") if line.startswith(PROMPT)]


@dataclass
class Aliases:
    """The test run's URLs, ports and directories, and the documented ones they stand for."""

    pairs: list[tuple[str, str]] = field(default_factory=list)  # (real, documented)

    def add(self, real: str, documented: str) -> None:
        self.pairs.append((real, documented))
        self.pairs.sort(key=lambda pair: -len(pair[0]))

    def documented(self, text: str) -> str:
        for real, documented in self.pairs:
            text = text.replace(real, documented)
        return text

    def real(self, text: str) -> str:
        for real, documented in sorted(self.pairs, key=lambda pair: -len(pair[1])):
            text = text.replace(documented, real)
        return text


@dataclass
class Transcript:
    """Runs the commands of documented transcripts, in order, in one sandbox, and writes what
    they print as the pages do: `$ command`, its output, `[exit N]` when N is not 0."""

    sandbox: Sandbox
    aliases: Aliases
    # Commands run (unshown) before a documented command, e.g. a third version made between
    # two shown commands. Keyed by the documented command line.
    hidden: dict[str, list[str]] = field(default_factory=dict)
    # Commands that run until stopped: how many lines of their output are shown.
    lines: dict[str, int] = field(default_factory=dict)
    # Called after a documented command has run (e.g. to keep a file it wrote).
    after: dict[str, Callable[[], None]] = field(default_factory=dict)

    def run(self, documented: str) -> str:
        out: list[str] = []
        for command in commands(documented):
            for hidden in self.hidden.get(command, []):
                self.sandbox.ok(self.aliases.real(hidden))
            real = self.aliases.real(command)
            out.append(PROMPT + command)
            if command in self.lines:
                out.append(self.sandbox.first_lines(real, self.lines[command]).rstrip("\n"))
            else:
                status, output = self.sandbox.run(real)
                if output:
                    out.append(output.rstrip("\n"))
                if status:
                    out.append(f"[exit {status}]")
            if command in self.after:
                self.after[command]()
        return self.aliases.documented("\n".join(out))


# --- relays --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Relayed:
    """One request a relay passed on, and the answer it passed back."""

    path: str
    body: bytes
    status: int
    answer: bytes


class Relay:
    """An HTTP relay on loopback that passes requests on to `target` (set once the target
    serves) and records each POST exchange. It holds requests until `open` is called, so that a
    registry configured with the relay as its peer's endpoint can start before its peer."""

    def __init__(self) -> None:
        self.target = ""
        self.exchanges: list[Relayed] = []
        self._opened = threading.Event()
        self._changed = threading.Condition()
        relay = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if not relay._opened.wait(DEADLINE) or not relay.target:
                    self.send_error(503)
                    return
                headers = {"Content-Type": self.headers.get("Content-Type", "")}
                try:
                    answer = httpx.post(
                        relay.target + self.path, content=body, headers=headers, timeout=DEADLINE
                    )
                except httpx.HTTPError:
                    self.send_error(502)
                    return
                with relay._changed:
                    relay.exchanges.append(
                        Relayed(self.path, body, answer.status_code, answer.content)
                    )
                    relay._changed.notify_all()
                self.send_response(answer.status_code)
                for name in ("Content-Type", "Retry-After"):
                    if name in answer.headers:
                        self.send_header(name, answer.headers[name])
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def do_GET(self) -> None:
                """A peer's public reads (its log's checkpoint and proofs, which a witness
                fetches): passed on, not recorded."""
                if not relay._opened.wait(DEADLINE) or not relay.target:
                    self.send_error(503)
                    return
                try:
                    answer = httpx.get(relay.target + self.path, timeout=DEADLINE)
                except httpx.HTTPError:
                    self.send_error(502)
                    return
                self.send_response(answer.status_code)
                if "Content-Type" in answer.headers:
                    self.send_header("Content-Type", answer.headers["Content-Type"])
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def open(self, target: str) -> None:
        self.target = target
        self._opened.set()

    def until(self, found: Callable[[Relayed], bool]) -> Relayed:
        """The first exchange recorded for which `found` holds (waited for)."""
        end = time.monotonic() + DEADLINE
        with self._changed:
            while True:
                for relayed in self.exchanges:
                    if found(relayed):
                        return relayed
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no such exchange in {DEADLINE} s: {self.exchanges}")
                self._changed.wait(left)

    @contextmanager
    def running(self) -> Iterator[Relay]:
        thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._opened.set()  # held requests fail fast rather than keep the shutdown waiting
            self._server.shutdown()
            self._server.server_close()


# --- sockets -------------------------------------------------------------------------------------


@contextmanager
def port_in_use(host: str, port: int, *, listen: bool = True) -> Iterator[None]:
    """Hold `host:port` for the duration (listening, or only bound: connections are refused). If
    another program holds it already, that does the same."""
    sock = socket.socket()
    try:
        try:
            sock.bind((host, port))
            if listen:
                sock.listen()
        except OSError:
            pass
        yield
    finally:
        sock.close()
