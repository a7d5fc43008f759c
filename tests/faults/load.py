"""Mixed load for the fault-injection tests: writers that retry each create with its own
`Idempotency-Key` until it is acknowledged, a reader, and a `registry watch` subscriber."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from registry.keys import SigningKey
from registry.signin import build_response
from tests.helpers import new_did, signed_entry

DEADLINE = 120.0  # the longest a write may take to be acknowledged, outage included


class Load:
    def __init__(self, url: str, workdir: Path, writers: int = 2) -> None:
        self.url = url
        self.key = SigningKey.generate()
        self.token = self._sign_in()
        self.acked: dict[str, int] = {}  # entry DID → the sequence its 201 carried
        self.codes: dict[str, int] = {}  # the error codes seen (503 conditions, ...)
        self.unexpected: list[str] = []  # answers no outage explains (500s, odd statuses)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._write) for _ in range(writers)]
        self._threads.append(threading.Thread(target=self._read))
        self.events = workdir / f"watch-{uuid.uuid4().hex[:8]}.jsonl"
        self._watch_out = self.events.open("w")
        self._watch = subprocess.Popen(
            [sys.executable, "-m", "cli", "watch", "--url", url, "--from", "0",
             "--kind", "entry.created"],
            stdout=self._watch_out,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def _sign_in(self) -> str:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            challenge = http.post("/v1/auth/siws/challenge", json={"audience": "faults"})
            issued = challenge.json()["challenge"]
            body = {
                "audience": "faults",
                "challenge": issued,
                "response": build_response(issued, self.key),
            }
            return str(http.post("/v1/auth/siws/verify", json=body).json()["sessionToken"])

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def finish(self) -> None:
        """Stop writing: each writer ends once its write in flight is acknowledged."""
        self._stop.set()
        for thread in self._threads:
            thread.join(DEADLINE + 10)

    def __exit__(self, *exc: object) -> None:
        self.finish()
        self._watch.terminate()
        self._watch.wait(10)
        self._watch_out.close()

    def note(self, response: httpx.Response) -> None:
        code = "?"
        with contextlib.suppress(ValueError, KeyError, TypeError):
            code = response.json()["error"]["code"]
        self.codes[code] = self.codes.get(code, 0) + 1
        if response.status_code != 503:
            self.unexpected.append(f"{response.status_code} {response.text[:200]}")

    def _write(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        with httpx.Client(base_url=self.url, timeout=10) as http:
            while not self._stop.is_set():
                did = new_did()
                entry = signed_entry(self.key, did)
                idem = {**headers, "Idempotency-Key": uuid.uuid4().hex}
                give_up = time.monotonic() + DEADLINE
                while time.monotonic() < give_up:  # the same request until acknowledged
                    try:
                        r = http.post("/v1/entries", json=entry, headers=idem)
                    except httpx.HTTPError:
                        time.sleep(0.05)
                        continue
                    if r.status_code == 201:
                        self.acked[did] = int(r.json()["sequence"])
                        break
                    self.note(r)
                    if r.status_code != 503:
                        break
                    time.sleep(0.05)
                else:
                    self.unexpected.append(f"{did} never acknowledged in {DEADLINE:.0f}s")

    def _read(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            while not self._stop.is_set():
                for path in ("/v1/health", *[f"/v1/entries/{d}" for d in list(self.acked)[-3:]]):
                    with contextlib.suppress(httpx.HTTPError):
                        r = http.get(path)
                        if r.status_code >= 500 and r.status_code != 503:
                            self.unexpected.append(f"GET {path}: {r.status_code} {r.text[:200]}")
                time.sleep(0.05)

    def wait_for_code(self, code: str, deadline: float = 30.0) -> None:
        end = time.monotonic() + deadline
        while self.codes.get(code, 0) == 0:
            assert time.monotonic() < end, f"no write answered {code} (seen: {self.codes})"
            time.sleep(0.05)

    def received(self) -> list[int]:
        """The sequences of the entry.created events the subscriber printed, in order."""
        out = []
        for line in self.events.read_text().splitlines():
            with contextlib.suppress(ValueError):
                event: dict[str, Any] = json.loads(line)
                out.append(int(event["sequence"]))
        return out

    def wait_received(self, deadline: float = 90.0) -> list[int]:
        end = time.monotonic() + deadline
        wanted = set(self.acked.values())
        while not wanted <= set(got := self.received()):
            assert time.monotonic() < end, f"{len(wanted - set(got))} events never arrived"
            time.sleep(0.1)
        return got


def health(url: str) -> dict[str, Any]:
    try:
        r = httpx.get(f"{url}/v1/health", timeout=5)
        return dict(r.json())
    except (httpx.HTTPError, ValueError):
        return {"status": "no answer"}


def wait_health(url: str, want: Any, deadline: float = 30.0) -> tuple[dict[str, Any], float]:
    """Poll health until `want(body)`; the body and how long it took."""
    started = time.monotonic()
    while not want(body := health(url)):
        assert time.monotonic() - started < deadline, f"health never came to that: {body}"
        time.sleep(0.05)
    return body, time.monotonic() - started
