"""`registry watch`: follow the event stream and print each event as one JSON line.

Theory of operation: connect to `/v1/events`, subscribe, print every event exactly as the
server sent it, and remember `position`: the last sequence the server says is delivered or
filtered out (events, heartbeats and close reasons all carry it). After a disconnect (server
restart, network loss, a slow-consumer close) reconnect with backoff and jitter and subscribe
`fromSequence: position`, so nothing is printed twice and nothing is skipped. Only the server's
refusal of the request itself (a malformed subscription, a bad session) ends the watch.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
    open_websocket_url,
)

from registry.ratelimit import Backoff

# Close codes that mean "this request will never work": stop instead of retrying.
FINAL_CLOSES = {4400: "the server refused a message", 4401: "session missing or invalid"}


class WatchError(Exception):
    """The server refused the subscription, or is no registry's event stream; retrying would
    not help."""


def _not_events(url: str, what: str) -> WatchError:
    return WatchError(f"{url} {what}, which is not a registry's event stream; check --url")


@dataclass
class WatchOptions:
    url: str  # the registry's base URL (http://, https://, ws:// or wss://)
    from_sequence: int | None = None  # exclusive; None: from now on
    kinds: list[str] | None = None
    entry_types: list[str] | None = None
    entry_dids: list[str] | None = None
    token: str | None = None  # a session token, for admin-only kinds
    max_events: int | None = None  # stop after this many (scripts, tests)
    backoff: Backoff = field(default_factory=lambda: Backoff(initial=0.5, maximum=30.0))


def events_url(base: str) -> str:
    base = base.rstrip("/")
    for plain, secure in (("http://", "ws://"), ("https://", "wss://")):
        if base.startswith(plain):
            base = secure + base[len(plain) :]
    return base + "/v1/events"


class Watcher:
    """One watch: `run()` returns after `max_events`, or raises `WatchError`."""

    def __init__(
        self,
        options: WatchOptions,
        out: Callable[[str], None],
        *,
        note: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.options = options
        self.out = out
        self.note = note
        self.draw = draw
        self.position = options.from_sequence
        self.printed = 0
        self.connections = 0
        self.subscribed = trio.Event()  # set once the first subscription is confirmed

    def _subscription(self) -> str:
        message: dict[str, Any] = {"type": "subscribe"}
        if self.position is not None:
            message["fromSequence"] = self.position
        for name, value in (
            ("kinds", self.options.kinds),
            ("entryTypes", self.options.entry_types),
            ("entryDids", self.options.entry_dids),
        ):
            if value:
                message[name] = value
        return json.dumps(message)

    async def run(self) -> None:
        url = events_url(self.options.url)
        headers: list[tuple[bytes, bytes]] = []
        if self.options.token:
            headers.append((b"Authorization", f"Bearer {self.options.token}".encode()))
        failures = 0
        while True:
            try:
                async with open_websocket_url(url, extra_headers=headers) as ws:
                    self.connections += 1
                    try:
                        if await self._follow(ws):
                            return
                    finally:
                        # trio-websocket leaks its stream when the server closes first.
                        await ws._stream.aclose()
            except ConnectionRejected as rejected:  # an HTTP answer instead of the upgrade
                status = rejected.status_code
                if status != 429 and status < 500:  # not a passing overload: it will not change
                    raise _not_events(url, f"answered HTTP {status} to the upgrade") from None
                failures += 1
                what = f"refused the connection (HTTP {status})"
            except ConnectionClosed as closed:
                code = closed.reason.code if closed.reason else 1006
                reason = (closed.reason.reason if closed.reason else None) or ""
                if code in FINAL_CLOSES:
                    raise WatchError(f"{FINAL_CLOSES[code]}: {reason}") from None
                self._resume_from_reason(reason)
                failures = 1 if self.printed else failures + 1
                what = f"closed ({code} {reason})".strip()
            except (OSError, HandshakeError, trio.BrokenResourceError) as exc:
                failures += 1
                what = f"cannot connect ({type(exc).__name__}: {exc})"
            delay = self.options.backoff.jittered(failures, self.draw())
            resume = "now" if self.position is None else f"after sequence {self.position}"
            self.note(f"registry watch: {url} {what}; resuming {resume} in {delay:.1f}s")
            await trio.sleep(delay)

    async def _follow(self, ws: WebSocketConnection) -> bool:
        """Subscribe and print events; True once `max_events` were printed."""
        await ws.send_message(self._subscription())
        url = events_url(self.options.url)
        while True:
            text = await ws.get_message()
            try:
                message = json.loads(text)
            except ValueError:  # also bytes that are not UTF-8
                raise _not_events(url, "sent a message that is not JSON") from None
            if not isinstance(message, dict):
                raise _not_events(url, "sent a message that is not a JSON object")
            kind = message.get("type")
            if kind == "event":
                sequence = message.get("sequence")
                if not _is_sequence(sequence):
                    raise _not_events(url, "sent an event without a sequence")
                self.out(text if isinstance(text, str) else text.decode())
                self.position = sequence
                self.printed += 1
                if self.options.max_events is not None and self.printed >= self.options.max_events:
                    await ws.aclose()
                    return True
            elif kind == "subscribed":
                position = message.get("fromSequence")
                if not _is_sequence(position):
                    raise _not_events(url, "confirmed a subscription without a sequence")
                self.position = position
                self.subscribed.set()
            elif kind == "heartbeat" and _is_sequence(message.get("lastSequence")):
                self.position = max(self.position or 0, message["lastSequence"])
            elif kind == "error":
                error = message.get("error")
                error = error if isinstance(error, dict) else {}
                raise WatchError(f"{error.get('code')}: {error.get('message')}")

    def _resume_from_reason(self, reason: str) -> None:
        try:
            last = json.loads(reason).get("lastSequence")
        except (ValueError, AttributeError):
            return
        if isinstance(last, int) and last >= (self.position or 0):
            self.position = last


def _is_sequence(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
