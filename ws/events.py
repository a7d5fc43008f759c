"""The WebSocket event stream, `GET /v1/events` (design §10, docs/events.md).

Theory of operation: each connection runs in its own nursery. One task reads the client's
messages (subscribe, unsubscribe, auth, ping); at most one forwarder task at a time follows a
log subscription (replay, then live, from the log actor) and sends the events its filter admits,
plus a heartbeat after `heartbeat_seconds` of quiet. Sends are serialised by a lock. The
connection tracks `position`: every record up to it was either sent or filtered out, so it is
the exact point to resume from, and it is what every close reports.

How it ends, always with a close code and a reason, never with a traceback:
- a message that is not a JSON object of a known type, or a binary or oversized frame: 4400;
- no subscription for `idle_seconds`: 4408;
- the subscriber fell `queue_size` records behind live (the log actor dropped it): 4429, the
  reason `{"code":"slow_consumer","lastSequence":N}`; resume with `fromSequence: N`; also 4429,
  `{"code":"too_many_messages",...}`, for a client sending more than `messages_per_minute`;
- the log cannot be read (database down): 1011 with the same kind of reason;
- the server is full (`max_connections`): 1013;
- the server stops: 1001, the reason `{"code":"server_stopping","lastSequence":N}`.
A client that accepts no data for `send_timeout_seconds` (up to a quarter more) is dropped
without a close frame.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import trio
from quart import websocket
from quart_trio import QuartTrio

from actors.log import Lagged, LogHandle, Subscription
from registry.canonical import parse_strict
from registry.changes import LogRecord
from registry.config import EventsConfig
from registry.errors import Invalid, RegistryError, Unauthorized
from registry.events import ADMIN_KINDS, AuthMessage, Filter, SubscribeRequest
from registry.models import validate_model
from registry.ratelimit import Bucket, Rate, take
from registry.usecases.common import Principal, now_ms
from registry.usecases.sessions import Sessions

log = logging.getLogger(__name__)

SESSION_COOKIE = "registry_session"

CLOSE_GOING_AWAY = 1001
CLOSE_INTERNAL = 1011
CLOSE_TRY_LATER = 1013
CLOSE_MALFORMED = 4400
CLOSE_UNAUTHORIZED = 4401
CLOSE_IDLE = 4408
CLOSE_SLOW = 4429


class Socket(Protocol):
    """What a connection needs of a WebSocket (Quart's in the service, a fake in tests)."""

    async def receive(self) -> str | bytes: ...
    async def send(self, data: str) -> None: ...
    async def close(self, code: int, reason: str = "") -> None: ...


@dataclass
class EventDeps:
    logs: LogHandle
    sessions: Sessions
    config: EventsConfig
    stopping: trio.Event = field(default_factory=trio.Event)  # set when the server stops
    connections: int = 0
    clock_ms: Callable[[], int] = now_ms  # wall time, against which sessions expire


class _Closed(Exception):
    """The connection has been closed by us; its tasks end."""


@dataclass
class Connection:
    """One client's socket: its reader, its forwarder, and its position in the log."""

    sock: Socket
    deps: EventDeps
    principal: Principal | None = None
    revoked: bool = False  # the principal's session was revoked since it authenticated
    position: int | None = None  # every record up to here was sent or filtered out
    _send_lock: trio.Lock = field(default_factory=trio.Lock)
    _forwarder: trio.CancelScope | None = None
    _forwarder_done: trio.Event | None = None
    _nursery: trio.Nursery | None = None
    _closed: bool = False
    _send_since: float | None = None  # when the send in progress began
    _budget: Bucket | None = None  # the client's messages (`messages_per_minute`)

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._read_client)
                nursery.start_soon(self._close_when_stopping)
                nursery.start_soon(self._drop_when_stuck)
        except* _Closed:
            pass

    async def _close_when_stopping(self) -> None:
        await self.deps.stopping.wait()
        await self.close(CLOSE_GOING_AWAY, self._resume_reason("server_stopping"))

    # --- sending ----------------------------------------------------------------------

    async def send(self, data: str) -> None:
        async with self._send_lock:
            if self._closed:
                raise _Closed
            # No cancel scope per send (it cost a fifth of the fan-out's CPU): the watchdog
            # `_drop_when_stuck` ends a send that takes too long.
            self._send_since = trio.current_time()
            try:
                await self.sock.send(data)
            finally:
                self._send_since = None

    async def _drop_when_stuck(self) -> None:
        """Drop a client that accepts no data for `send_timeout_seconds` (checked every
        quarter of it, so it goes between 1 and 1.25 times the timeout)."""
        timeout = self.deps.config.send_timeout_seconds
        while True:
            await trio.sleep(timeout / 4)
            since = self._send_since
            if since is not None and trio.current_time() - since >= timeout:
                self._closed = True
                log.info("event subscriber took no data for %gs; dropped", timeout)
                raise _Closed

    async def send_json(self, message: dict[str, Any]) -> None:
        await self.send(json.dumps(message, ensure_ascii=False, separators=(",", ":")))

    async def close(self, code: int, reason: str) -> NoReturn:
        """Close with `code` and `reason` (at most 123 bytes of UTF-8), then end the tasks."""
        async with self._send_lock:
            if not self._closed:
                self._closed = True
                with trio.move_on_after(self.deps.config.send_timeout_seconds):
                    await self.sock.close(code, reason.encode()[:123].decode(errors="ignore"))
        raise _Closed

    def _resume_reason(self, code: str) -> str:
        return json.dumps({"code": code, "lastSequence": self.position}, separators=(",", ":"))

    # --- the client's messages ----------------------------------------------------------

    async def _read_client(self) -> None:
        config = self.deps.config
        while True:
            idle = config.idle_seconds if self._forwarder is None else math.inf
            with trio.move_on_after(idle) as timer:
                message = await self.sock.receive()
            if timer.cancelled_caught:
                await self.close(CLOSE_IDLE, f"idle: no subscription for {config.idle_seconds:g}s")
            await self._handle(message)

    async def _handle(self, message: str | bytes) -> None:
        decision, self._budget = take(
            self._budget, Rate(self.deps.config.messages_per_minute), trio.current_time()
        )
        if not decision.allowed:  # each message may cost a query: a flood is refused
            await self.close(
                CLOSE_SLOW,
                json.dumps(
                    {"code": "too_many_messages", "lastSequence": self.position},
                    separators=(",", ":"),
                ),
            )
        if isinstance(message, bytes):
            await self.close(CLOSE_MALFORMED, "binary frames are not accepted; send JSON text")
        assert isinstance(message, str)
        if len(message.encode()) > self.deps.config.max_message_bytes:
            await self.close(CLOSE_MALFORMED, "message too large")
        try:
            data = parse_strict(message)  # I-JSON, bounded nesting: never a RecursionError
        except Invalid as exc:
            await self.close(CLOSE_MALFORMED, f"message is not JSON: {exc.message}")
        kind = data.get("type") if isinstance(data, dict) else None
        try:
            if kind == "subscribe":
                await self._subscribe(
                    validate_model(SubscribeRequest, data, code="invalid_message")
                )
            elif kind == "unsubscribe":
                await self._stop_forwarder()
                await self.send_json({"type": "unsubscribed", "lastSequence": self.position})
            elif kind == "auth":
                await self._authenticate(validate_model(AuthMessage, data, code="invalid_message"))
            elif kind == "ping":
                await self.send_json({"type": "pong"})
            else:
                await self.close(
                    CLOSE_MALFORMED,
                    "expected a JSON object with type subscribe, unsubscribe, auth or ping",
                )
        except RegistryError as exc:  # a well-formed request refused: the socket stays open
            error: dict[str, Any] = {"code": exc.code, "message": exc.message}
            if exc.details:
                error["details"] = exc.details
            await self.send_json({"type": "error", "error": error})

    async def _authenticate(self, message: AuthMessage) -> None:
        self.principal = await self.deps.sessions.authenticate(message.token)
        self.revoked = False
        await self.send_json(
            {"type": "authenticated", "principal": self.principal.did, "admin": self.admin}
        )

    @property
    def admin(self) -> bool:
        return self.principal is not None and self.principal.admin

    async def _subscribe(self, request: SubscribeRequest) -> None:
        if self.principal is not None:  # the session may have ended since it authenticated
            try:
                self.principal = await self.deps.sessions.recheck(self.principal)
                self.revoked = False
            except Unauthorized:
                self.principal, self.revoked = None, False
        forbidden = Filter.forbidden_kinds(request, admin=self.admin)
        if forbidden:
            raise Invalid(
                f"kinds {forbidden} are for admins: authenticate first",
                code="capability_missing",
                details={"kinds": forbidden},
            )
        await self._stop_forwarder()  # a new subscription replaces the current one
        after = request.from_sequence
        if after is None:
            after = await self.deps.logs.head()
        assert self._nursery is not None
        self._forwarder = trio.CancelScope()
        self._forwarder_done = trio.Event()
        self._nursery.start_soon(
            self._forward,
            Filter(request, admin=self.admin),
            after,
            self._forwarder,
            request.batch,
        )

    async def _stop_forwarder(self) -> None:
        if self._forwarder is not None and self._forwarder_done is not None:
            self._forwarder.cancel()
            await self._forwarder_done.wait()
        self._forwarder = self._forwarder_done = None

    # --- the subscription -------------------------------------------------------------

    async def _forward(
        self, admits: Filter, after: int, scope: trio.CancelScope, batch: bool
    ) -> None:
        done = self._forwarder_done
        assert done is not None
        try:
            with scope:
                self.position = after
                await self._stream(admits, after, batch)
        finally:
            done.set()

    async def _stream(self, admits: Filter, after: int, batch: bool) -> None:
        heartbeat = self.deps.config.heartbeat_seconds
        try:
            async with self.deps.logs.subscribe(after) as subscription:
                await self.send_json({"type": "subscribed", "fromSequence": after})
                while True:
                    if subscription.ready():  # no timer while records are queued
                        record = await subscription.receive()
                    else:
                        with trio.move_on_after(heartbeat) as quiet:
                            record = await subscription.receive()
                        if quiet.cancelled_caught:
                            await self.send_json(
                                {"type": "heartbeat", "lastSequence": self.position}
                            )
                            continue
                    if batch:
                        await self._send_batch(subscription, admits, record)
                        continue
                    self._note_revocation(record)
                    if record.public and admits.admits(record):
                        if record.kind in ADMIN_KINDS and not self._still_admin():
                            await self._close_lapsed()
                        await self.send(record.event_json)
                    self.position = record.seq
        except Lagged:
            await self.close(CLOSE_SLOW, self._resume_reason("slow_consumer"))
        except (RegistryError, trio.BrokenResourceError, trio.ClosedResourceError):
            # the log cannot be read, or the log actor has stopped (shutdown)
            log.warning("event subscription cannot follow the log", exc_info=True)
            await self.close(CLOSE_INTERNAL, self._resume_reason("unavailable"))

    # --- admin-only kinds follow the session that allowed them ----------------------------

    def _note_revocation(self, record: LogRecord) -> None:
        """The log carries every logout (`session.revoked`, internal): this socket's own ends
        its admin-only events, in every process, in log order."""
        if (
            record.kind == "session.revoked"
            and self.principal is not None
            and record.data.get("tokenHash") == self.principal.token_hash.hex()
        ):
            self.revoked = True

    def _still_admin(self) -> bool:
        principal = self.principal
        return (
            principal is not None
            and principal.admin
            and not self.revoked
            and principal.session.expires_at_ms > self.deps.clock_ms()
        )

    async def _close_lapsed(self) -> NoReturn:
        """An admin-only event is next, but the session that allowed it has expired or been
        revoked: close with 4401 and the resume point (sign in again, resume from there)."""
        await self.close(CLOSE_UNAUTHORIZED, self._resume_reason("session_invalid"))

    async def _send_batch(
        self, subscription: Subscription, admits: Filter, first: LogRecord
    ) -> None:
        """`first` and every record already queued behind it (up to MAX_BATCH), as one frame."""
        records = [first]
        while len(records) < MAX_BATCH and subscription.ready():
            records.append(await subscription.receive())
        events: list[str] = []
        for r in records:
            self._note_revocation(r)
            if r.public and admits.admits(r):
                if r.kind in ADMIN_KINDS and not self._still_admin():
                    if events:
                        await self.send('{"type":"events","events":[' + ",".join(events) + "]}")
                    await self._close_lapsed()
                events.append(r.event_json)
            self.position = r.seq
        if events:
            await self.send('{"type":"events","events":[' + ",".join(events) + "]}")


MAX_BATCH = 256  # records in one batched frame


def _token(headers: Any, cookies: Any) -> str | None:
    header = headers.get("Authorization")
    if header:
        scheme, _, token = header.partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else ""
    return cookies.get(SESSION_COOKIE) or None


class _QuartSocket:
    async def receive(self) -> str | bytes:
        return await websocket.receive()

    async def send(self, data: str) -> None:
        await websocket.send(data)

    async def close(self, code: int, reason: str = "") -> None:
        await websocket.close(code, reason)


def register_events(app: QuartTrio, deps: EventDeps) -> None:
    @app.websocket("/v1/events")
    async def events() -> None:
        await websocket.accept()
        sock = _QuartSocket()
        connection = Connection(sock, deps)
        if deps.connections >= deps.config.max_connections:
            await sock.close(CLOSE_TRY_LATER, "too many event subscribers; try again later")
            return
        deps.connections += 1
        try:
            token = _token(websocket.headers, websocket.cookies)
            if token is not None:
                try:
                    connection.principal = await deps.sessions.authenticate(token)
                except RegistryError:
                    await sock.close(CLOSE_UNAUTHORIZED, "session missing, expired or unknown")
                    return
            await connection.run()
        finally:
            deps.connections -= 1
