"""The WebSocket event stream, `GET /v1/events` (design §10, docs/events.md).

Theory of operation: each connection runs in its own nursery. One task reads the client's messages
(subscribe, unsubscribe, auth, ping); at most one forwarder task at a time follows a log
subscription. The forwarder asks the log actor to attach the subscription's `EventSink` at its
position (the actor takes it at once when its ring holds every record after it); where the actor
answers "behind", it replays the log from the store page by page and asks again. Once attached, the
actor hands the sink every batch it reads, synchronously. The sink filters the batch and hands the
admitted events to its writer without waiting: on a plain TCP connection the frames go to the
socket in one non-blocking write (`FrameWriter`, ws/transport.py), otherwise into a bounded queue
the forwarder sends from (`TextWriter`). The forwarder meanwhile flushes what the socket did not
take at once and sends a heartbeat after `heartbeat_seconds` of quiet. The connection tracks
`position`: every record up to it was either handed to the socket or filtered out, so it is the
exact point to resume from, and it is what every close reports (a close frame always follows the
events before it).

How it ends, always with a close code and a reason, never with a traceback:
- a message that is not a JSON object of a known type, a binary frame, or an oversized one
  that reached the app (the transport refuses those from their header first, with 1009): 4400;
- no subscription for `idle_seconds`: 4408;
- the subscriber fell `queue_size` events behind live (the log actor dropped it) on a plain
  TCP connection: 4429, the reason `{"code":"slow_consumer","lastSequence":N}`; resume with
  `fromSequence: N` (on the ordinary path it is not closed: it sends what waits and replays
  from there, as after a disconnection of the log actor); also 4429,
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
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, Protocol

import trio
from quart import websocket
from quart_trio import QuartTrio

from actors.log import PAGE, Batch, Delivery, LogHandle
from actors.ratelimiter import RateLimiter, SessionLookups
from registry.canonical import parse_strict
from registry.changes import LogRecord
from registry.config import EventsConfig
from registry.errors import Invalid, RateLimited, RegistryError, Unauthorized
from registry.events import ADMIN_KINDS, AuthMessage, Filter, SubscribeRequest
from registry.metering import DB_TIME_CLASS, db_meter
from registry.models import validate_model
from registry.outage import ConditionLog
from registry.ratelimit import Bucket, Rate, client_of, joined_lines, take
from registry.usecases.common import Principal, now_ms
from registry.usecases.sessions import Sessions
from ws.transport import CURRENT_STREAM, FrameStream, text_frame

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
    limiter: RateLimiter | None = None  # its "replay" class: replays per client address
    trusted_proxies: int = 0  # X-Forwarded-For hops trusted for the client address
    per_client: dict[str, int] = field(default_factory=dict)  # open sockets per address
    replaying: trio.CapacityLimiter | None = None  # replay pages read at once (the process)
    outage: ConditionLog = field(default_factory=lambda: ConditionLog("event subscriptions"))
    # The log actor's successful reads when a subscription last failed to read the log: an
    # attach is taken as the recovery only once the actor has read since.
    reads_at_failure: int = 0
    # For /metrics: event messages handed to sockets, and sockets closed, by close code.
    messages_sent: int = 0
    closes: Counter[int] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.replaying is None:
            self.replaying = trio.CapacityLimiter(self.config.replay_concurrency)

    def session_lookups(self, client: str) -> SessionLookups | None:
        """A session token's lookup from `client`, within its address's budget of failed
        lookups, shared with HTTP (docs/limits.md, "Session tokens"); a refusal's code is a
        read's (the event stream is read)."""
        if self.limiter is None:
            return None
        return SessionLookups(self.limiter, client, "read_rate_limited")


class _Closed(Exception):
    """The connection has been closed by us; its tasks end."""


@dataclass
class Connection:
    """One client's socket: its reader, its forwarder, and its position in the log."""

    sock: Socket
    deps: EventDeps
    stream: FrameStream | None = None  # the fast path's socket (ws/transport.py), if any
    principal: Principal | None = None
    revoked: bool = False  # the principal's session was revoked since it authenticated
    position: int | None = None  # every record up to here was sent or filtered out
    _send_lock: trio.Lock = field(default_factory=trio.Lock)
    _forwarder: trio.CancelScope | None = None
    _forwarder_done: trio.Event | None = None
    _nursery: trio.Nursery | None = None
    _closed: bool = False
    _send_since: float | None = None  # when the send in progress began
    # Messages handed over by the sink on the ordinary path (`TextWriter`), each with the
    # position it completes (None: a position only, for records filtered out behind queued
    # events) and the events it carries (more than one in batch mode): sent before any other
    # message, `position` moving as each goes out.
    outbox: deque[tuple[str | None, int | None, int]] = field(default_factory=deque)
    waiting: int = 0  # events in the outbox not yet being sent (what the queue bound counts)
    _budget: Bucket | None = None  # the client's messages (`messages_per_minute`)
    client: str = ""  # the client's address, for its per-address budgets

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._read_client)
                nursery.start_soon(self._close_when_stopping)
                nursery.start_soon(self._drop_when_stuck)
        except* _Closed:
            pass
        finally:
            self._closed = True  # the log actor drops the sink at its next batch
            stream = self.stream
            if stream is not None and (stream.pending_bytes or stream.stalled_since is not None):
                # Ended (a disconnect, the server's deadline) while the client was taking no
                # data: nobody is left to cut it off, and Hypercorn would wait for it forever.
                stream.abort()

    async def _close_when_stopping(self) -> None:
        await self.deps.stopping.wait()
        await self.close(CLOSE_GOING_AWAY, self._resume("server_stopping"))

    # --- sending ----------------------------------------------------------------------

    async def send(self, data: str | Callable[[], str] | None) -> None:
        """Send `data` after the events the sink has handed over (`outbox`); None: only those.
        A callable is rendered once they are out (a message that reports `position`)."""
        async with self._send_lock:
            if self._closed:
                raise _Closed
            # No cancel scope per send (it cost a fifth of the fan-out's CPU): the watchdog
            # `_drop_when_stuck` ends a send that takes too long.
            self._send_since = trio.current_time()
            try:
                await self._send_outbox()
                if data is not None:
                    self._send_since = trio.current_time()
                    await self.sock.send(data if isinstance(data, str) else data())
            finally:
                self._send_since = None

    async def _send_outbox(self) -> None:
        outbox = self.outbox
        while outbox:
            text, upto, events = outbox[0]  # taken off once sent: a cancelled send keeps it
            if text is not None:
                self.waiting -= events  # on their way: no longer counted against the bound
                # The watchdog times each message, not all that waits: a client that reads
                # slowly but steadily takes a burst (or a page of a catch-up) at its own pace.
                self._send_since = trio.current_time()
                try:
                    await self.sock.send(text)
                except BaseException:
                    self.waiting += events
                    raise
                # (Counted in `messages_sent` when the sink handed them over, as on the fast path.)
            outbox.popleft()
            if upto is not None:
                self.position = upto

    async def _drop_when_stuck(self) -> None:
        """Drop a client that accepts no data for `send_timeout_seconds` (checked every
        quarter of it, so it goes between 1 and 1.25 times the timeout)."""
        timeout = self.deps.config.send_timeout_seconds
        while True:
            await trio.sleep(timeout / 4)
            # On the fast path the stream knows how long the client has taken nothing,
            # whoever is writing (Hypercorn included); otherwise, the message being sent.
            since = self.stream.stalled_since if self.stream is not None else self._send_since
            if since is not None and trio.current_time() - since >= timeout:
                self._closed = True
                log.info("event subscriber took no data for %gs; dropped", timeout)
                if self.stream is not None:
                    self.stream.cut_for = "send"  # (registry_connections_cut_total)
                    self.stream.abort()  # ends a write waiting for it, Hypercorn's included
                raise _Closed

    async def send_json(self, message: dict[str, Any]) -> None:
        await self.send(_json(message))

    async def close(self, code: int, reason: str | Callable[[], str]) -> NoReturn:
        """Close with `code` and `reason` (at most 123 bytes of UTF-8), then end the tasks. A
        callable reason is rendered once no event can follow (it reports `position`)."""
        async with self._send_lock:
            if not self._closed:
                self._closed = True  # from here the sink hands nothing more over
                self._send_since = trio.current_time()  # the watchdog cuts off a stuck client
                try:
                    self.deps.closes[code] += 1
                    with trio.move_on_after(self.deps.config.send_timeout_seconds):
                        await self._send_outbox()  # the events before the resume point first
                        text = reason if isinstance(reason, str) else reason()
                        await self.sock.close(code, text.encode()[:123].decode(errors="ignore"))
                finally:
                    self._send_since = None
        raise _Closed

    def _resume(self, code: str) -> Callable[[], str]:
        """A close reason with the resume point as it will be when the close frame goes."""
        return lambda: _json({"code": code, "lastSequence": self.position})

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
            await self.close(CLOSE_SLOW, self._resume("too_many_messages"))
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
                await self.send(
                    lambda: _json({"type": "unsubscribed", "lastSequence": self.position})
                )
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
        self.principal = await self.deps.sessions.authenticate(
            message.token, lookups=self.deps.session_lookups(self.client)
        )
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
        after = request.from_sequence
        if (
            after is not None
            and self.deps.limiter is not None
            and after < self.deps.logs.statistics().head
        ):
            # A replay reads the store: each client address has a budget of them. (Behind
            # what this process's log actor has read: no query to decide, so a flood of
            # refused replays costs the database nothing.) Checked before the current
            # subscription is replaced: a refused one leaves it running.
            decision = self.deps.limiter.acquire("replay", self.client)
            if not decision.allowed:
                raise RateLimited(
                    "too many replays from this address; subscribe without fromSequence, or later",
                    retry_after=decision.retry_after,
                    limit=decision.limit,
                    code="replay_rate_limited",
                )
        await self._stop_forwarder()  # a new subscription replaces the current one
        if after is None:
            after = await self.deps.logs.head()
        assert self._nursery is not None
        # From here the position is the new subscription's (what an unsubscribe or a close
        # reports, even before its forwarder runs). The events the old one handed over and not
        # yet sent still go out first, but no longer move it.
        for i, (text, _, events) in enumerate(self.outbox):
            self.outbox[i] = (text, None, events)
        self.position = after
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
                await self._stream(admits, after, batch)
        finally:
            done.set()

    async def _stream(self, admits: Filter, after: int, batch: bool) -> None:
        """Replay from the store, then live from the log actor, until the subscription ends."""
        sink = EventSink(self, admits, batch, self._writer())
        try:
            await self.send_json({"type": "subscribed", "fromSequence": after})
            while True:
                await self._replay(sink)
                ended = await self._follow(sink)
                if ended == "slow" and self.stream is None:
                    # The ordinary path: no kernel buffer took the burst, so a prompt reader
                    # overflows as a slow one does when the log is read back to back. Neither
                    # is closed: what waits goes out first, then the subscription reads on from
                    # the log (the actor's memory, else the store, paid from the address's
                    # database time) and is live again.
                    await self._flush(sink.writer)
                    sink.ended = None
                    continue
                if ended == "slow":
                    await self.close(CLOSE_SLOW, self._resume("slow_consumer"))
                if ended == "lapsed":
                    await self._close_lapsed()
                if ended == "gone":  # the connection broke under a write
                    self._closed = True
                    raise _Closed
                # disconnected: the log actor restarts; replay from here and attach again
        except (RegistryError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            # The log cannot be read, or the log actor has stopped (shutdown): a condition of
            # the database or the process, logged once per condition (registry/outage.py).
            condition = exc.code if isinstance(exc, RegistryError) else "log actor stopped"
            self.deps.reads_at_failure = self.deps.logs.reads
            line = self.deps.outage.failed(condition, trio.current_time())
            if line is not None:
                log.warning(line)
            await self.close(CLOSE_INTERNAL, self._resume("unavailable"))
        finally:
            sink.end()

    def _writer(self) -> Writer:
        if self.stream is not None:
            return FrameWriter(self, self.stream, self.deps.logs.queue_size)
        return TextWriter(self, self.deps.logs.queue_size)

    async def _replay(self, sink: EventSink) -> None:
        """Make the sink live. Where the log actor still holds every record after the position
        (its ring, within the sink's capacity: a subscription from the head, or a resume just
        behind it) it takes the sink at once and delivers them itself: no read of the store.
        Otherwise read the log after the position page by page, sending each (flow-controlled:
        the next page is read once this one is with the kernel), until the actor takes it.

        Attaching first keeps a burst of subscriptions off the store: read first, a thousand
        sockets subscribing at once each read the log through `replay_concurrency` slots, and
        those still waiting when writes resume read every record on their own, rendering it
        once per socket, instead of once per batch for all (bench/README.md, events.py)."""
        logs = self.deps.logs
        assert self.position is not None
        if logs.connected and await logs.attach(self.position, sink):
            self._note_recovery()
            return
        while True:
            assert self.deps.replaying is not None
            await self._wait_while_in_debt()
            with db_meter() as meter:
                async with self.deps.replaying:  # a few pages at once: the pool serves others
                    records = await logs.read(self.position)
            if self.deps.limiter is not None:
                self.deps.limiter.charge(DB_TIME_CLASS, self.client, meter.seconds * 1000)
            self._log_recovery()
            if records:
                sink.replay(Batch(records, trio.current_time()))
                await self._flush(sink.writer)
                if sink.ended is not None:
                    return
            if len(records) < PAGE and await logs.attach(self.position, sink):
                return

    def _note_recovery(self) -> None:
        """A subscription the actor serves tells of a recovery only once the actor has read
        the log since the last failure (taking a sink needs no database)."""
        if self.deps.logs.reads > self.deps.reads_at_failure:
            self._log_recovery()

    def _log_recovery(self) -> None:
        line = self.deps.outage.succeeded(trio.current_time())
        if line is not None:
            log.info(line)

    async def _wait_while_in_debt(self) -> None:
        """A replay's pages are paid from its client address's database time, as its queries
        are (docs/limits.md, "Database time"): while the address is in debt, the replay waits
        until it is paid (a replay that asks much reads at the budget's pace)."""
        limiter = self.deps.limiter
        while limiter is not None:
            owed = limiter.acquire(DB_TIME_CLASS, self.client, cost=0)
            if owed.allowed:
                return
            await trio.sleep(owed.retry_after)

    async def _follow(self, sink: EventSink) -> str:
        """While the actor delivers: flush what the socket did not take at once, send a
        heartbeat after `heartbeat_seconds` of quiet. Returns why the sink ended."""
        heartbeat = self.deps.config.heartbeat_seconds
        writer = sink.writer
        while sink.ended is None:
            if writer.busy():
                await self._flush(writer)
                continue
            deadline = writer.last_sent + heartbeat
            if trio.current_time() >= deadline:
                await writer.heartbeat(self)
                self._note_recovery()  # so the line comes even if no subscription follows
                continue
            with trio.move_on_at(deadline):
                await sink.wait()
        ended = sink.ended
        if ended == "disconnected":
            # What the actor handed over goes out first: the replay starts after it.
            await self._flush(writer)
            sink.ended = None
        return ended

    async def _flush(self, writer: Writer) -> None:
        try:
            await writer.flush(self)  # the watchdog sees a client that takes nothing
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._closed = True  # the client has gone (or was cut off): nothing more to send
            raise _Closed from None

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
        await self.close(CLOSE_UNAUTHORIZED, self._resume("session_invalid"))


MAX_BATCH = 256  # records in one batched frame


class Writer(Protocol):
    """How a subscription's events reach its socket."""

    last_sent: float  # trio.current_time() of the last event handed to the socket

    def render(self, texts: list[str]) -> Any:
        """The form `put` takes of these messages (shared by every subscriber of a batch
        with the same filter)."""
        ...

    def put(self, rendered: Any, count: int, at: float, upto: int, *, bounded: bool) -> Delivery:
        """Hand `count` events over without waiting, completing the connection's position
        `upto` (every record up to it handed over or filtered out): "ok", "slow" (more than
        the queue bound not yet with the kernel, when `bounded`: nothing handed over), or
        "gone" (the connection broke)."""
        ...

    def busy(self) -> bool:
        """Whether something handed over waits for `flush`."""
        ...

    async def flush(self, connection: Connection) -> None: ...

    async def heartbeat(self, connection: Connection) -> None:
        """A heartbeat after everything handed over, reporting the position it follows."""
        ...


class FrameWriter:
    """The fast path (plain TCP served by Hypercorn, ws/transport.py): the frames of a batch
    are written with one non-blocking call, from the log actor's task."""

    def __init__(self, connection: Connection, stream: FrameStream, limit: int) -> None:
        self.connection = connection
        self.stream = stream
        self.limit = limit
        self.backlog = 0  # events handed over and not yet with the kernel (at most)
        self.last_sent = trio.current_time()

    def render(self, texts: list[str]) -> bytes:
        return b"".join([text_frame(text.encode()) for text in texts])

    def put(self, rendered: bytes, count: int, at: float, upto: int, *, bounded: bool) -> Delivery:
        if count:
            if not self.stream.pending_bytes:
                self.backlog = 0
            elif bounded and self.backlog + count > self.limit:
                return "slow"  # nothing of it handed over
            try:
                if self.stream.offer(rendered):
                    self.backlog = 0
                else:
                    self.backlog += count
            except trio.BrokenResourceError:
                return "gone"
            self.last_sent = at
        # The bytes are with the kernel or first in the stream's queue: whatever the socket
        # sends next comes after them.
        self.connection.position = upto
        return "ok"

    def busy(self) -> bool:
        return self.stream.pending_bytes > 0

    async def flush(self, connection: Connection) -> None:
        await self.stream.flush()
        self.backlog = 0

    async def heartbeat(self, connection: Connection) -> None:
        # Rendered and handed over at once: no event can come between the two.
        message = _json({"type": "heartbeat", "lastSequence": connection.position})
        try:
            self.stream.offer(text_frame(message.encode()))
        except trio.BrokenResourceError:
            connection._closed = True
            raise _Closed from None
        self.last_sent = trio.current_time()


class TextWriter:
    """The ordinary path (TLS, HTTP/2, tests): one WebSocket message per event, sent by the
    subscription's task from the connection's bounded outbox."""

    def __init__(self, connection: Connection, limit: int) -> None:
        self.connection = connection
        self.limit = limit
        self.queue = connection.outbox
        self.last_sent = trio.current_time()

    def render(self, texts: list[str]) -> list[str]:
        return texts

    def put(
        self, rendered: list[str], count: int, at: float, upto: int, *, bounded: bool
    ) -> Delivery:
        queue, connection = self.queue, self.connection
        # The bound counts events, as the fast path's does, not messages: in batch mode a
        # message carries up to MAX_BATCH of them.
        if bounded and connection.waiting + count > self.limit:
            return "slow"  # nothing of it handed over
        if not count and not queue:
            connection.position = upto  # nothing waits: filtered out, done
            return "ok"
        connection.waiting += count
        # One event a message, or (batch mode, `EventSink._frames`) full frames of MAX_BATCH
        # and then the rest. The batch's last entry completes `upto`; the ones before it move
        # nothing (no message reports a position while events wait in the outbox).
        size = 1 if len(rendered) == count else MAX_BATCH
        queue.extend((text, None, size) for text in rendered[:-1])
        if count:
            queue.append((rendered[-1], upto, count - size * (len(rendered) - 1)))
        else:
            queue.append((None, upto, 0))
        return "ok"

    def busy(self) -> bool:
        return bool(self.queue)

    async def flush(self, connection: Connection) -> None:
        await connection.send(None)
        self.last_sent = trio.current_time()

    async def heartbeat(self, connection: Connection) -> None:
        await connection.send(
            lambda: _json({"type": "heartbeat", "lastSequence": connection.position})
        )
        self.last_sent = trio.current_time()


class EventSink:
    """A subscription as the log actor sees it (actors/log.py `Sink`): filters each batch and
    hands the events to the writer, synchronously. Subscribers with the same filter share the
    work through the batch's memo: the frames of a batch are built once for all of them."""

    def __init__(self, connection: Connection, admits: Filter, batch: bool, writer: Writer):
        self.connection = connection
        self.admits = admits
        self.batched = batch
        self.writer = writer
        self.capacity = connection.deps.logs.queue_size
        self.key = (type(writer), admits.key, batch)
        self.ended: Literal["slow", "gone", "lapsed", "disconnected"] | None = None
        self._wake = trio.Event()
        self._closed = False

    # --- called by the log actor (and by the replay) ----------------------------------------

    def deliver(self, batch: Batch) -> Delivery:
        if self.gone():
            return "gone"
        outcome = self._take(batch, bounded=True)
        if outcome != "ok" or self.writer.busy():
            self._wake.set()
        if outcome == "slow" and self.ended is None:
            self.ended = "slow"
        return outcome

    def replay(self, batch: Batch) -> None:
        """A page the subscription read itself: no queue bound (it waits for the socket)."""
        if self.connection._closed:
            raise _Closed
        if self._take(batch, bounded=False) == "gone" and self.ended is None:
            self.ended = "gone"

    def disconnected(self) -> None:
        self.ended = "disconnected"
        self._wake.set()

    def end(self) -> None:
        """The subscription is over: the actor drops the sink at its next batch, its next
        quiet read of the log or an attach (`gone`), whichever comes first."""
        self._closed = True

    def gone(self) -> bool:
        return self._closed or self.ended is not None or self.connection._closed

    async def wait(self) -> None:
        """Until the actor has something for the subscription's task."""
        self._wake = trio.Event()
        await self._wake.wait()

    # --- filtering ---------------------------------------------------------------------------

    def _take(self, batch: Batch, *, bounded: bool) -> Delivery:
        connection = self.connection
        records = batch.records
        if connection.principal is not None:  # admin-only kinds re-check the session
            return self._take_checked(batch, bounded=bounded)
        rendered = batch.memo.get(self.key)
        if rendered is None:
            texts = [r.event_json for r in records if r.public and self.admits.admits(r)]
            rendered = batch.memo[self.key] = (self.writer.render(self._frames(texts)), len(texts))
        outcome = self.writer.put(
            rendered[0], rendered[1], batch.at, records[-1].seq, bounded=bounded
        )
        if outcome == "ok":
            connection.deps.messages_sent += rendered[1]
        if outcome == "gone":
            self.ended = "gone"
        return outcome

    def _take_checked(self, batch: Batch, *, bounded: bool) -> Delivery:
        connection = self.connection
        texts: list[str] = []
        lapsed = False
        upto: int | None = None
        revoked = connection.revoked  # as it was: a batch refused is read again, logout too
        for record in batch.records:
            connection._note_revocation(record)
            if record.public and self.admits.admits(record):
                if record.kind in ADMIN_KINDS and not connection._still_admin():
                    lapsed = True
                    break
                texts.append(record.event_json)
            upto = record.seq
        if upto is not None:
            put = self.writer.put(
                self.writer.render(self._frames(texts)), len(texts), batch.at, upto, bounded=bounded
            )
            if put != "ok":
                if put == "gone":
                    self.ended = "gone"
                connection.revoked = revoked  # nothing of the batch was handed over
                return put
            connection.deps.messages_sent += len(texts)
        if lapsed:
            self.ended = "lapsed"
            return "gone"
        return "ok"

    def _frames(self, texts: list[str]) -> list[str]:
        if not self.batched or not texts:
            return texts
        return [
            '{"type":"events","events":[' + ",".join(texts[i : i + MAX_BATCH]) + "]}"
            for i in range(0, len(texts), MAX_BATCH)
        ]


def _json(message: dict[str, Any]) -> str:
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"))


def _client_address(trusted_proxies: int) -> str:
    """The client's address, as `api.http.client_address` reads it for HTTP requests."""
    forwarded = joined_lines(websocket.scope["headers"], b"x-forwarded-for")
    return client_of(forwarded, websocket.remote_addr, trusted_proxies)


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
        try:
            await websocket.accept()
        except Exception as exc:  # the handshake broke under us (frames sent before the 101
            # made h11 refuse it, say): this connection ends, quietly; the transport drops it
            log.debug("event socket handshake failed: %s: %s", type(exc).__name__, exc)
            return
        sock = _QuartSocket()
        connection = Connection(sock, deps)
        if websocket.http_version in ("1.0", "1.1"):  # not a stream of HTTP/2
            connection.stream = CURRENT_STREAM.get()
            if connection.stream is not None:
                connection.stream.websocket = True  # upgraded: its writes are frames now
        if deps.connections >= deps.config.max_connections:
            deps.closes[CLOSE_TRY_LATER] += 1
            await sock.close(CLOSE_TRY_LATER, "too many event subscribers; try again later")
            return
        client = connection.client = _client_address(deps.trusted_proxies)
        if deps.per_client.get(client, 0) >= deps.config.max_connections_per_client:
            deps.closes[CLOSE_TRY_LATER] += 1
            await sock.close(CLOSE_TRY_LATER, "too many event sockets from this address")
            return
        deps.connections += 1
        deps.per_client[client] = deps.per_client.get(client, 0) + 1
        try:
            token = _token(websocket.headers, websocket.cookies)
            if token is not None:
                try:
                    connection.principal = await deps.sessions.authenticate(
                        token, lookups=deps.session_lookups(client)
                    )
                except RateLimited:
                    deps.closes[CLOSE_TRY_LATER] += 1
                    await sock.close(
                        CLOSE_TRY_LATER, "too many failed session lookups from this address"
                    )
                    return
                except RegistryError:
                    deps.closes[CLOSE_UNAUTHORIZED] += 1
                    await sock.close(CLOSE_UNAUTHORIZED, "session missing, expired or unknown")
                    return
            await connection.run()
        finally:
            deps.connections -= 1
            left = deps.per_client[client] - 1
            if left:
                deps.per_client[client] = left
            else:
                del deps.per_client[client]
