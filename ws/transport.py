"""Event frames straight to the socket: the fan-out's fast path (docs/events.md, "Delivery").

Theory of operation. Server-to-client WebSocket frames are not masked, so the frame of an event
is the same bytes for every subscriber that receives it. The log actor renders it once and, for
each subscriber, writes the frames of one read of the log with one non-blocking system call,
from its own task: no task switch, no per-message trip through the ASGI layers. That is what
makes 1,000 subscribers affordable on one core (bench/events.py).

`FrameStream` wraps the plain TCP connection Hypercorn serves, and stays the only writer of it:
Hypercorn's own writes (handshakes, replies, pings, close frames) go through `send_all`, which
first sends whatever was offered before, so the bytes on the wire keep the order in which they
were produced and a frame is never cut by another. `offer` writes now what the kernel takes and
keeps the rest pending; the subscriber's own task flushes it (`flush`), and a client that takes
nothing is cut off by `abort`, which also ends a write that is waiting for it.

The same wrapper is where a connection is bounded (docs/limits.md, "Connections"), because it is
the one place that sees every byte of it, whatever Hypercorn or the app does:
- `ConnectionGuard` admits a connection only under the process's total cap and its client
  address's cap (IPv6 by /64); one refused gets a canned 503 and is closed at once.
- Reading: the head and body of a request must arrive within `request_timeout` of its first
  byte, with no gap longer than `read_timeout` (a slow body is cut, not only a slow head); a
  request lasts until its final answer (a `100 Continue` does not end it); between requests
  (and before the first) `keep_alive_timeout` applies, counted from the last answer. After
  the upgrade, the client's WebSocket frame headers are parsed as they arrive: a message whose
  declared size passes `max_ws_message`, a message of more than `max_fragments` frames, or a
  flood of control frames, is refused with a close frame (1009, 1008)
  before any of its payload is buffered. A frame RFC 6455 does not allow (1002), or a text
  message or close reason that is not UTF-8 (1007), is refused with a close frame too, where
  Hypercorn would drop the connection without one; for that, the payload of text messages and
  close frames is unmasked and decoded as it passes (nothing of it is kept).
- Writing: a write the client takes nothing of for `send_timeout` cuts the connection, whoever
  writes (a response to a client that never reads, the pongs of a ping flood).
- Closing never waits: Hypercorn closes a `Connection: close` connection from the app's task,
  which Quart-Trio cancels right after the response, so a close that waited at a checkpoint
  would leave the socket open until the client let go.

`install_in_hypercorn` makes Hypercorn's trio worker wrap every plain TCP connection this way
and publish the wrapper in `CURRENT_STREAM` for the tasks that serve it. Hypercorn has no public
hook for this: it replaces the worker's `TCPServer` with a subclass. So the hook is checked
before it is installed (`hook_unfit`: the release within the tested range that pyproject.toml
pins, the class and its constructor as the subclass expects them); where it does not fit, or
where the operator turns it off (`server.connection_hook = false`), the registry serves
anyway, says so in an error line at start, and every connection takes Hypercorn's ordinary
path: events one ASGI message each, and only Hypercorn's own limits (keep-alive timeout,
incomplete-request size). Connections over TLS are never wrapped; their subscribers take the
ordinary path too. A plain connection that switches to HTTP/2 (its preface first, or an h2c
upgrade) stays wrapped but is passed through (`http2`): the caps and the write timeout hold,
and the connection as a whole lasts at most one request's time.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import math
import os
import re
import socket as stdlib_socket
import struct
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import trio

from registry.ratelimit import Bucket, Rate, client_key, is_idle, take

log = logging.getLogger(__name__)

MAX_BUCKETS = 100_000  # addresses with a new-connection bucket before the full ones are swept

# A final answer's head up to this size waits for its body, to go out with it (`send_all`).
HELD_HEAD_BYTES = 16 * 1024
# A body up to this size is copied behind its held head, to go out in one write; a larger one
# is written after the head.
MERGED_BODY_BYTES = 64 * 1024

# What a client speaking HTTP/2 with prior knowledge sends first (RFC 9113 §3.4).
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

CURRENT_STREAM: ContextVar[FrameStream | None] = ContextVar("registry_frame_stream", default=None)


def text_frame(payload: bytes) -> bytes:
    """One final, unmasked text frame (RFC 6455 §5.2) carrying `payload` (UTF-8)."""
    size = len(payload)
    if size < 126:
        return bytes((0x81, size)) + payload
    if size < 1 << 16:
        return bytes((0x81, 126)) + size.to_bytes(2, "big") + payload
    return bytes((0x81, 127)) + size.to_bytes(8, "big") + payload


@dataclass(frozen=True)
class ConnectionLimits:
    """How far one connection may go (`[server]` and `[events]` configuration)."""

    max_connections: int = 4096  # open connections per process
    max_per_client: int = 128  # open connections per client address (IPv6: per /64)
    connections_per_minute_per_client: int = 600  # new connections per address (burst as many)
    request_timeout: float = 30.0  # head and body of one request, from its first byte
    read_timeout: float = 10.0  # within a request, the longest wait for the next byte
    send_timeout: float = 30.0  # a write the client takes nothing of, this long, cuts it
    keep_alive_timeout: float = 75.0  # between requests (and before the first)
    max_ws_message: int = 16 * 1024  # a client's WebSocket message (all its fragments)
    ws_control_per_minute: int = 120  # client pings and pongs (a token bucket)
    max_fragments: int = 64  # frames of one client message
    linger_seconds: float = 2.0  # after a refusal, read and drop what the client still sends


class ConnectionGuard:
    """Counts the process's open connections, in all and per client address; owned by the
    Hypercorn worker's tasks (one Trio thread: each call is atomic, no await inside)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._open: dict[str, int] = {}
        self.total = 0
        self.refused = 0
        self.failed = 0
        self.cut: dict[str, int] = {"request": 0, "send": 0}  # by `FrameStream.cut_for`
        self._rate = Rate(limits.connections_per_minute_per_client)
        self._opened: dict[str, Bucket] = {}  # new connections per address (a token bucket)
        self._sweep_above = MAX_BUCKETS  # buckets past which the next sweep runs
        self._last_warning = -math.inf

    def admit(self, key: str) -> str | None:
        """Count a new connection of `key`, or say why it is refused (and count nothing)."""
        if self.total >= self.limits.max_connections:
            return self._refuse(key, "the server has too many open connections")
        if self._open.get(key, 0) >= self.limits.max_per_client:
            return self._refuse(key, "too many open connections from this address")
        now = trio.current_time()
        decision, bucket = take(self._opened.get(key), self._rate, now)
        self._opened[key] = bucket
        if len(self._opened) > self._sweep_above:  # forget the full ones (a full bucket is none)
            self._opened = {
                k: b for k, b in self._opened.items() if not is_idle(b, self._rate, now)
            }
            # Where a sweep frees little (addresses all seen within the minute), the next waits
            # until their number has doubled: sweeping at each admission walked them all for
            # every new connection (~1 ms at 100,000, growing with them).
            self._sweep_above = max(MAX_BUCKETS, 2 * len(self._opened))
        if not decision.allowed:  # a flood of short connections costs a refusal, not a request
            return self._refuse(key, "too many new connections from this address")
        self._open[key] = self._open.get(key, 0) + 1
        self.total += 1
        return None

    def release(self, key: str) -> None:
        left = self._open[key] - 1
        if left:
            self._open[key] = left
        else:
            del self._open[key]
        self.total -= 1

    def _refuse(self, key: str, reason: str) -> str:
        self.refused += 1
        now = trio.current_time()
        if now - self._last_warning >= 10:  # a flood must not become a flood of log lines
            self._last_warning = now
            log.warning(
                "refusing connections: %s (%s; %d refused so far)", reason, key, self.refused
            )
        return reason

    def connection_failed(self, exc: Exception) -> int:
        """Count a connection that failed inside Hypercorn (a protocol error it did not
        handle); returns how many so far."""
        self.failed += 1
        return self.failed

    def connection_cut(self, reason: str) -> None:
        """Count a connection cut for a deadline (`FrameStream.cut_for`)."""
        self.cut[reason] += 1

    def statistics(self) -> dict[str, int]:
        return {
            "open": self.total,
            "clients": len(self._open),
            "refused": self.refused,
            "failed": self.failed,
        }


def _refusal(reason: str) -> bytes:
    body = (
        '{"error":{"code":"too_many_connections","message":"' + reason + '","requestId":"-"}}'
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def close_frame(code: int, reason: str) -> bytes:
    """A server close frame (RFC 6455 §5.5.1): the code, then at most 123 bytes of reason."""
    payload = code.to_bytes(2, "big") + reason.encode()[:123]
    return bytes((0x88, len(payload))) + payload


class _FrameRefused(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class ClientFrames:
    """The client's side of a WebSocket connection, read as it arrives (sans-IO): frame
    headers parsed, payload counted, and looked at only where RFC 6455 puts a rule on it.
    `feed` raises `_FrameRefused` for a message whose declared size passes the limit (before
    its payload is read), a control-frame flood, a frame RFC 6455 does not allow (1002), or a
    text message or close reason that is not UTF-8 (1007). Hypercorn's WebSocket parser
    (wsproto) refuses the same frames, but Hypercorn then closes the connection without a
    close frame: refused here first, the client gets one, with the reason."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self._limits = limits
        self._head = bytearray()  # a frame header received in part
        self._left = 0  # payload bytes of the current frame still to come
        self._message = 0  # payload bytes of the current data message so far
        self._fragments = 0  # frames of the current data message so far
        self._opcode = 0  # the data message under way (0x1 text, 0x2 binary; 0: none)
        self._control: Bucket | None = None
        # The current frame, where its payload is looked at (`_payload`): text (0x1) or close
        # (0x8; 0: not looked at), final or not, its size and its masking key.
        self._inspect = 0
        self._final = False
        self._size = 0
        self._mask = b""
        self._decoder: codecs.IncrementalDecoder | None = None  # a text message in pieces
        self._close = bytearray()  # a close frame's payload so far (at most 125 bytes)

    def feed(self, data: bytes | bytearray, now: float) -> None:
        i, n = 0, len(data)
        while i < n:
            if self._left:
                taken = min(self._left, n - i)
                self._left -= taken
                i += taken
                if self._inspect:
                    self._payload(data[i - taken : i])
                continue
            head = self._head
            need = _header_size(head)
            if len(head) < need:
                taken = min(need - len(head), n - i)
                head += data[i : i + taken]
                i += taken
                # (Its first two bytes tell the header's full length: an unmasked frame with
                # a short payload has no more, and is looked at now, not with the next read.)
                if len(head) < _header_size(head):
                    continue
            self._frame(bytes(head), now)
            head.clear()

    def _frame(self, head: bytes, now: float) -> None:
        code = head[1] & 0x7F
        if code == 126:
            size = int.from_bytes(head[2:4], "big")
        elif code == 127:
            size = int.from_bytes(head[2:10], "big")
        else:
            size = code
        opcode, final = head[0] & 0x0F, head[0] & 0x80
        if head[0] & 0x70:  # RSV1-3: no extension is ever agreed (refuse_websocket_extensions)
            raise _FrameRefused(1002, "reserved bits set: no extension was negotiated")
        # RFC 6455 §5.1-5.5, as wsproto checks them: a frame Hypercorn would end the
        # connection for, without a close frame.
        if opcode not in (0x0, 0x1, 0x2, 0x8, 0x9, 0xA):
            raise _FrameRefused(1002, f"reserved opcode {opcode:#x}")
        if not head[1] & 0x80:
            raise _FrameRefused(1002, "a client frame must be masked")
        if (code == 126 and size < 126) or (code == 127 and not 1 << 16 <= size < 1 << 63):
            raise _FrameRefused(1002, "payload length not in its shortest form")
        self._inspect = 0
        if opcode & 0x08:  # close, ping, pong
            if not final:
                raise _FrameRefused(1002, "a control frame may not be fragmented")
            if size > 125:
                raise _FrameRefused(1002, "a control frame over 125 bytes")
            if opcode in (0x9, 0xA):
                decision, self._control = take(
                    self._control, Rate(self._limits.ws_control_per_minute), now
                )
                if not decision.allowed:
                    raise _FrameRefused(1008, "too many control frames")
            else:
                self._inspect = 0x8
                self._close.clear()
        else:
            if opcode == 0x0:
                if not self._opcode:
                    raise _FrameRefused(1002, "a continuation frame with no message to continue")
            elif self._opcode:
                raise _FrameRefused(1002, "a new message before the last one ended")
            else:  # a new text or binary message
                self._opcode = opcode
                self._message = self._fragments = 0
            self._message += size
            self._fragments += 1
            if self._message > self._limits.max_ws_message:
                raise _FrameRefused(1009, f"message over {self._limits.max_ws_message} bytes")
            if self._fragments > self._limits.max_fragments:  # (empty ones cost work too)
                raise _FrameRefused(1008, f"message in over {self._limits.max_fragments} frames")
            if self._opcode == 0x1:
                self._inspect = 0x1
            if final:
                self._opcode = self._message = self._fragments = 0
        self._left = size
        if self._inspect:
            self._final, self._size, self._mask = bool(final), size, head[-4:]
            if not size:
                self._payload(b"")  # (an empty final piece still ends its message)

    def _payload(self, chunk: bytes | bytearray) -> None:
        """A piece of a text message's frame or of a close frame, as received (masked): text
        must be UTF-8 (RFC 6455 §8.1), a close frame a code a client may send (§7.4)."""
        n = len(chunk)
        at = (self._size - self._left - n) & 3  # where the piece starts in the masking key
        key = (self._mask[at:] + self._mask[:at]) * (n // 4 + 1)
        plain = (int.from_bytes(chunk, "little") ^ int.from_bytes(key[:n], "little")).to_bytes(
            n, "little"
        )
        ended = not self._left
        if self._inspect == 0x8:
            self._close += plain
            if ended:
                _check_close(bytes(self._close))
            return
        last = ended and self._final
        try:
            if self._decoder is None and last and n == self._size:
                plain.decode()  # a whole message in one piece (most are)
            else:  # fragments, or a frame split across reads: keep the partial character
                if self._decoder is None:
                    self._decoder = codecs.getincrementaldecoder("utf-8")()
                self._decoder.decode(plain, last)
        except UnicodeDecodeError:
            raise _FrameRefused(1007, "a text message that is not UTF-8") from None
        if last:
            self._decoder = None


def _header_size(head: bytes | bytearray) -> int:
    """The size of a frame header (RFC 6455 §5.2) whose first bytes are `head` (2 until its
    first two bytes tell more)."""
    if len(head) < 2:
        return 2
    code = head[1] & 0x7F
    return 2 + (2 if code == 126 else 8 if code == 127 else 0) + (4 if head[1] & 0x80 else 0)


def _check_close(payload: bytes) -> None:
    """A client's close frame: empty, or a code a client may send and a UTF-8 reason (the
    codes wsproto accepts: RFC 6455's defined ones that are not local-only, and 3000-4999)."""
    if not payload:
        return
    if len(payload) == 1:
        raise _FrameRefused(1002, "a close frame with a 1-byte payload")
    code = int.from_bytes(payload[:2], "big")
    if not (1000 <= code <= 1003 or 1007 <= code <= 1013 or 3000 <= code <= 4999):
        raise _FrameRefused(1002, f"close code {code} is not one a client may send")
    try:
        payload[2:].decode()
    except UnicodeDecodeError:
        raise _FrameRefused(1007, "a close reason that is not UTF-8") from None


class FrameStream(trio.abc.HalfCloseableStream):
    """A TCP connection that can also take bytes without waiting (`offer`).

    Every write, awaited or not, goes through one queue of pending chunks written with
    non-blocking system calls, so a cancelled wait never leaves part of a frame behind: the
    rest stays first in the queue. `stalled_since` is when the socket last refused more
    bytes while some were waiting (None while it takes them): how long a client has taken
    no data, whoever is writing."""

    def __init__(self, inner: trio.SocketStream, limits: ConnectionLimits | None = None) -> None:
        self._inner = inner
        self.limits = limits  # None: unbounded (tests of the fast path alone)
        self._request_since: float | None = None  # the first byte of the request being read
        self._client_frames: ClientFrames | None = None
        self._read_scope: trio.CancelScope | None = None
        self._answered = trio.current_time()  # the last final answer (or the connection's start)
        self._awaiting_answer = False  # the app has the whole request (`request_read`)
        # Set when the answer owed for a whole request has gone out whole (or the connection
        # is gone): a client's end of stream read meanwhile waits for it (`receive_some`).
        self._answer_out: trio.Event | None = None
        # A request has begun (its first byte, or Hypercorn began it) and its answer's end has
        # not been written: set whenever `_request_since` is, kept past the answer's head.
        self._owed = False
        self.serving: trio.CancelScope | None = None  # Hypercorn's task for this connection
        self._fd = inner.socket.fileno()
        self._pending: deque[bytes | memoryview] = deque()
        self.pending_bytes = 0
        self._held_head: bytes | None = None  # an answer's head, held for its body (`send_all`)
        self._lock = trio.Lock()  # held by whoever awaits a write
        self._closed = False
        self.broken = False
        self.websocket = False  # upgraded: every write is now one WebSocket frame
        # HTTP/2 in clear text (prior knowledge, or an h2c upgrade): Hypercorn's own framing,
        # passed through with the connection caps and the write timeout only (`_start_http2`).
        self.http2 = False
        self._http2_since = 0.0  # when it switched (its deadline: `_read_deadline`)
        # A request's first bytes, until they tell whether it is HTTP/2's preface (None: not).
        self._opening: bytes | None = b""
        self.sealed = False  # a close frame went out: nothing may follow it
        self.stalled_since: float | None = None
        # Why a deadline cut the connection: "request" (its head or body did not come in
        # time), "send" (the client took nothing); None otherwise (an idle one is closed).
        self.cut_for: str | None = None

    @property
    def socket(self) -> trio.socket.SocketType:
        return self._inner.socket

    @property
    def request_under_way(self) -> bool:
        """A byte of a request has come and its final answer has not gone out."""
        return self._request_since is not None and not self.websocket and not self.http2

    def offer(self, data: bytes) -> bool:
        """Send `data` after everything sent or offered before it, without waiting. Returns
        whether all of it is with the kernel; what is not stays pending until `flush`.
        Raises `trio.BrokenResourceError` if the connection is gone or has sent its close
        frame."""
        if self._closed or self.broken or self.sealed:
            raise trio.BrokenResourceError("the connection is closed")
        if self._pending or self._lock.locked():  # an awaited write is under way: queue behind
            self._queue(data)
            return False
        sent = self._write(data)
        if sent == len(data):
            return True
        self._queue(memoryview(data)[sent:])
        return False

    def _write(self, data: bytes | bytearray | memoryview) -> int:
        """As much of `data` as the kernel takes now (0 when it takes nothing)."""
        try:
            sent = os.write(self._fd, data)
        except BlockingIOError:
            if self.stalled_since is None:
                self.stalled_since = trio.current_time()
            return 0
        except OSError as exc:  # reset, broken pipe: the client is gone
            self.broken = True
            self._release_end()
            raise trio.BrokenResourceError(str(exc)) from exc
        self.stalled_since = None
        return sent

    def _queue(self, data: bytes | memoryview) -> None:
        self._pending.append(data)
        self.pending_bytes += len(data)

    async def flush(self) -> None:
        """Wait until everything offered is with the kernel."""
        async with self._lock:
            await self._flush_locked()

    async def _flush_locked(self, send_timeout: float | None = None) -> None:
        """Write everything pending; with `send_timeout`, cut the connection once the client
        has taken nothing for that long."""
        pending = self._pending
        while pending:
            if self._closed or self.broken:
                raise trio.ClosedResourceError("the connection is closed")
            chunk = pending[0]
            sent = self._write(chunk)
            self.pending_bytes -= sent
            if sent == len(chunk):
                pending.popleft()
                continue
            if sent:
                pending[0] = memoryview(chunk)[sent:]
            if self.stalled_since is None:  # the kernel took part: it is full now
                self.stalled_since = trio.current_time()
            # Cancellable: what is not written stays first in the queue, whole or in part.
            if send_timeout is None:
                await trio.lowlevel.wait_writable(self._inner.socket)
                continue
            with trio.move_on_at(self.stalled_since + send_timeout) as waiting:
                await trio.lowlevel.wait_writable(self._inner.socket)
            if waiting.cancelled_caught:
                self.cut_for = "send"
                self.cut()
                raise trio.BrokenResourceError(f"the client took no data for {send_timeout:g}s")
        await trio.lowlevel.checkpoint()

    def request_started(self) -> None:
        """Hypercorn began a request (its `Updated(idle=False)`): also one pipelined behind
        the last, whose bytes came with it."""
        if not self.websocket and not self.http2:
            self._owed = True
            if self._request_since is None:
                self._request_since = trio.current_time()
                self._renew_read_deadline()

    def _release_end(self) -> None:
        if self._answer_out is not None:
            self._answer_out.set()
            self._answer_out = None

    def abort(self) -> None:
        """Drop the connection now: a write waiting for the client fails, and nothing more is
        sent (no close frame: a client that reads nothing would not read that either)."""
        self._release_end()
        self.broken = True
        self._pending.clear()
        self.pending_bytes = 0
        self._held_head = None
        self._inner.socket.close()  # wakes a task waiting to write, with ClosedResourceError

    def reset(self) -> None:
        """`abort` with a TCP reset (no clean end): for an answer that could not be sent whole."""
        with contextlib.suppress(OSError):
            self._inner.socket.setsockopt(
                stdlib_socket.SOL_SOCKET, stdlib_socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        self.abort()

    def cut(self) -> None:
        """`abort`, and end Hypercorn's task for this connection with it: on its own, Hypercorn
        would wait for its keep-alive timer before letting the connection go."""
        self.abort()
        if self.serving is not None:
            self.serving.cancel()

    # --- trio.abc.HalfCloseableStream, as Hypercorn uses it ------------------------------

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.sealed and data:
            raise trio.ClosedResourceError("a close frame was sent")
        if self._owed and self._request_since is None and (not data or data == b"0\r\n\r\n"):
            # The end of an answer (h11 ends a declared length with nothing, chunks with the
            # last chunk), after the owed answer's head: once written, a held end of stream
            # may go to Hypercorn.
            try:
                await self._send_all(data)
            finally:
                self._owed = False
                self._release_end()
            return
        await self._send_all(data)
        if self._owed and (self.websocket or self.http2):
            self._owed = False  # the 101 is out: an end is the new protocol's to see
            self._release_end()

    async def _send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._held_head is not None:
            # What follows a held head is its body, or the end of its answer: Hypercorn sends
            # the parts of an answer one after another under one lock, so nothing comes
            # between them, and no byte of a body is taken for a head. A call cancelled here
            # leaves the head held.
            await trio.lowlevel.checkpoint_if_cancelled()
            head, self._held_head = self._held_head, None
            if len(data) <= MERGED_BODY_BYTES:
                data = head + bytes(data)
            else:  # not copied to save a segment: the head goes first, on its own
                self._queue(head)
        elif self.http2:
            pass
        elif not self.websocket:
            head = bytes(data[:13])
            if head == b"HTTP/1.1 101 ":  # an upgrade: HTTP/2 (h2c), or WebSocket frames
                if b"\nupgrade: h2c\r" in bytes(data).lower():
                    self._start_http2()
                else:
                    self.websocket = True
                    self._renew_read_deadline()
            elif head.startswith(b"HTTP/1.") and head[9:10] != b"1":
                # A final answer (not `100 Continue`): the request is over, and the next byte
                # from the client starts another; meanwhile the keep-alive timeout applies.
                self._request_since = None
                self._awaiting_answer = False
                self._opening = b""
                self._answered = trio.current_time()
                self._renew_read_deadline()
                if len(data) <= HELD_HEAD_BYTES:
                    # Hypercorn writes an answer's head, its body and its end (b"" when the
                    # length is declared) one call each: holding the head until the next
                    # call sends the answer with one system call and one TCP segment, not
                    # three calls and two segments. The body (or the end, for an answer
                    # without one) follows at once; an answer that ends the connection
                    # before either still gets its head (`send_eof`).
                    await trio.lowlevel.checkpoint_if_cancelled()
                    self._held_head = bytes(data)
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return
        elif data[:1] == b"\x88":  # a close frame, Hypercorn's or ours:
            self.sealed = True  # the event fan-out stops before it, not after
        queued = False
        if not self._pending and not self._lock.locked() and not self._closed and not self.broken:
            # Nothing queued and no write under way: straight to the socket, as the locked path
            # below would write it, without the lock's cost (most answers go out this way).
            await trio.lowlevel.checkpoint_if_cancelled()
            if not data:  # the end of an answer whose length was declared: nothing to write
                await trio.lowlevel.cancel_shielded_checkpoint()
                return
            sent = self._write(data)
            if sent == len(data):
                await trio.lowlevel.cancel_shielded_checkpoint()
                return
            # The rest is queued before anything can run (taking the lock lets other tasks
            # run): an offer made meanwhile goes after it, never into the middle of a frame.
            self._queue(bytes(data[sent:]))
            queued = True
        async with self._lock:
            if not queued:
                self._queue(bytes(data))
            await self._flush_locked(self.limits.send_timeout if self.limits else None)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        # Hypercorn ends a connection this way once its last message (a close frame, which
        # went out after every offered byte) is sent; bytes offered since have no reader.
        # No checkpoint: this runs from a task that may be cancelled right now (module doc).
        head, self._held_head = self._held_head, None
        self._pending.clear()
        self.pending_bytes = 0
        if self._lock.locked():
            raise trio.BusyResourceError("a write is under way")
        if head is not None and not self._closed and not self.broken:
            # An answer whose body never came (the app failed after its start, or its task
            # was cancelled): its head goes out, as it would have without the hold. Closing
            # does not wait: where the socket takes only part of it, the connection is reset,
            # so that the client never sees half a head and then a clean end.
            try:
                sent = self._write(head)
            except trio.BrokenResourceError:
                sent = len(head)  # gone already: nothing to end
            if sent < len(head):
                self.reset()
                raise trio.BrokenResourceError("the answer's head did not fit the socket")
        try:
            self._inner.socket.shutdown(stdlib_socket.SHUT_WR)
        except OSError as exc:
            raise trio.BrokenResourceError(str(exc)) from exc

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        limits = self.limits
        if limits is None:
            return await self._inner.receive_some(max_bytes)
        with trio.CancelScope(deadline=self._read_deadline(limits)) as scope:
            self._read_scope = scope  # the upgrade lifts its deadline (`send_all`)
            try:
                data = await self._inner.receive_some(max_bytes)
            finally:
                self._read_scope = None
        if scope.cancelled_caught:
            if self._request_since is not None or self.http2:  # (else: idle, kept alive)
                self.cut_for = "request"
            self.cut()
            raise trio.TooSlowError
        if not data and self._owed and not (self.websocket or self.http2):
            # The client ended its side after its request (`printf … | nc`, an HTTP/1.0
            # script): it still reads. Hypercorn would take the end for a disconnect, and the
            # app's answer would be cancelled: it gets the end once the answer is out. Until
            # the app has read the whole request, the read deadlines still run (a request cut
            # short never gets whole: it is cut, as a client that stops sending is).
            self._answer_out = self._answer_out or trio.Event()
            with trio.CancelScope(deadline=self._read_deadline(limits)) as scope:
                self._read_scope = scope
                try:
                    await self._answer_out.wait()
                finally:
                    self._read_scope = None
            if scope.cancelled_caught:
                self.cut_for = "request"
                self.cut()
                raise trio.TooSlowError
            return data
        if self.http2:
            return data
        begun = data
        if self._request_since is None and begun[:1] in (b"\r", b"\n") and not self.websocket:
            # Empty lines before a request line are no request: h11 drops them
            # (`bound_request_heads`), so a lone CRLF after an answer leaves the connection idle.
            begun = bytes(begun).lstrip(b"\r\n")
        # (Hypercorn switches to HTTP/2 on any request's preface.)
        if self._opening is not None and begun and not self.websocket:
            self._opening += begun[: len(H2_PREFACE) - len(self._opening)]
            if self._opening == H2_PREFACE[: len(self._opening)]:
                if len(self._opening) == len(H2_PREFACE):
                    self._start_http2()
                    return data
            else:
                self._opening = None
        if self.websocket:
            if self._client_frames is None:
                self._client_frames = ClientFrames(limits)
            try:
                self._client_frames.feed(data, trio.current_time())
            except _FrameRefused as refused:
                await self._refuse_frames(refused, limits)
        elif self._request_since is None and begun:
            self._request_since = trio.current_time()  # the first byte of a request
            self._owed = True
        return data

    def _read_deadline(self, limits: ConnectionLimits) -> float:
        if self.websocket:  # the event stream's own idle and send rules apply
            return math.inf
        if self.http2:
            # Streams interleave: no deadline of one request can follow them, and Hypercorn's
            # keep-alive holds only while none is open (a stream whose body never came held
            # its task for good). The connection as a whole gets one request's time.
            return self._http2_since + limits.request_timeout
        since = self._request_since
        if since is None:  # between requests (or before the first): the keep-alive timeout
            return self._answered + limits.keep_alive_timeout
        if self._awaiting_answer:  # the app has it all: the client owes nothing until then
            return math.inf
        return min(since + limits.request_timeout, trio.current_time() + limits.read_timeout)

    def _start_http2(self) -> None:
        """The connection speaks HTTP/2 from here on: its streams interleave, so the read
        deadlines of one HTTP/1.1 request at a time cannot follow them; the connection as a
        whole is given one request's time (`request_timeout`, from the switch), the caps and
        the write timeout stay, and no frame or head of it is looked at."""
        self.http2 = True
        self._http2_since = self._request_since or trio.current_time()
        self._owed = False
        self._release_end()
        self._opening = None
        self._request_since = None
        self._awaiting_answer = False
        self._renew_read_deadline()

    def request_read(self) -> None:
        """The app has read the whole request (head and body): until its answer the client owes
        no byte, so no read deadline runs (a slow handler is not the client's fault)."""
        if not self.websocket and not self.http2 and self._request_since is not None:
            self._awaiting_answer = True
            self._renew_read_deadline()

    def _renew_read_deadline(self) -> None:
        """The read in flight (Hypercorn reads while the app answers) takes the deadline of
        what the connection now is: upgraded, or between two requests."""
        if self._read_scope is not None and self.limits is not None:
            self._read_scope.deadline = self._read_deadline(self.limits)

    async def _refuse_frames(self, refused: _FrameRefused, limits: ConnectionLimits) -> None:
        """Send the close frame, read and drop what the client still sends for a moment (so
        that closing does not reset the connection before it reads the close), then end."""
        log.info("WebSocket client refused (%d): %s", refused.code, refused.reason)
        self.sealed = True
        frame = close_frame(refused.code, refused.reason)
        if self._pending or self._lock.locked():
            self._queue(frame)  # after the whole frames queued before it, by whoever flushes
            with (
                trio.move_on_after(min(1.0, limits.linger_seconds)),
                contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
            ):
                await self.flush()  # (a writer stuck on a client that reads nothing: cut)
        else:
            with contextlib.suppress(trio.BrokenResourceError, OSError):
                self._write(frame)
                self._inner.socket.shutdown(stdlib_socket.SHUT_WR)
        with trio.move_on_after(limits.linger_seconds):
            dropped = 0
            while dropped < 1 << 20:
                chunk = await self._inner.receive_some()
                if not chunk:
                    break
                dropped += len(chunk)
        self.cut()
        raise trio.BrokenResourceError(refused.reason)

    async def aclose(self) -> None:
        self._release_end()
        self._closed = True
        self._pending.clear()
        self.pending_bytes = 0
        self._held_head = None
        self._inner.socket.close()  # at once: the checkpoint below may be a cancelled one
        await self._inner.aclose()

    def refuse(self, reason: str) -> None:
        """Answer 503 without reading the request, and close (the connection was not admitted)."""
        with contextlib.suppress(trio.BrokenResourceError):
            self._write(_refusal(reason))
        self.abort()


GUARD_ATTRIBUTE = "registry_guard"  # set on Hypercorn's Config by `serve`
PLAIN_ATTRIBUTE = "registry_plain"  # set (True) on a Config whose connections stay unwrapped

# The Hypercorn releases the hook is tested with (pyproject.toml pins the same range): their
# trio worker builds each connection's `TCPServer(app, config, context, state, stream)` through
# the module-level name `hypercorn.trio.run.TCPServer`, keeps the stream in `self.stream`, and
# writes each WebSocket frame with one `send_all`.
TESTED_HYPERCORN = ((0, 17), (0, 19))  # from, up to (not included)
_SERVER_PARAMETERS = ["self", "app", "config", "context", "state", "stream"]


def hook_unfit(version: str | None = None, server: Any = None) -> str | None:
    """Why `install_in_hypercorn` cannot hook this Hypercorn (`version`, and the `TCPServer`
    class its trio worker uses; the installed ones by default); None when it can."""
    import inspect
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    if version is None:
        try:
            version = installed("hypercorn")
        except PackageNotFoundError:
            return "hypercorn's version is unknown"
    try:
        release = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return f"hypercorn {version} is not a release it was tested with"
    low, high = TESTED_HYPERCORN
    if not low <= release < high:
        tested = f"{'.'.join(map(str, low))} to before {'.'.join(map(str, high))}"
        return f"hypercorn {version} is outside the tested releases ({tested})"
    if server is None:
        from hypercorn.trio import run as worker

        server = getattr(worker, "TCPServer", None)
    if not isinstance(server, type):
        return "hypercorn's trio worker has no TCPServer class"
    constructor: Any = getattr(server, "__init__", None)
    try:
        parameters = list(inspect.signature(constructor).parameters)
    except (TypeError, ValueError):
        return "hypercorn's TCPServer has no readable constructor"
    if getattr(server, "registry_frame_stream", False):
        return None  # installed already
    if parameters != _SERVER_PARAMETERS:
        taken = ", ".join(parameters[1:])
        return f"hypercorn's TCPServer takes ({taken}), not (app, config, context, state, stream)"
    if not inspect.iscoroutinefunction(getattr(server, "run", None)):
        return "hypercorn's TCPServer has no coroutine run()"
    if not inspect.iscoroutinefunction(getattr(server, "_initiate_server_close", None)):
        return "hypercorn's TCPServer has no coroutine _initiate_server_close()"
    return None


def refuse_websocket_extensions() -> None:
    """Make Hypercorn agree to no WebSocket extension (once; every connection, hooked or not).

    Hypercorn accepts `permessage-deflate` whenever a client offers it, and wsproto then inflates
    each message in full before Hypercorn's size check sees it: a 15 KB frame is a 16 MB message
    in memory, and the buffer that refuses it (1009) keeps taking the next ones (hostile review:
    30 such frames on one socket, 466 KB sent, grew the process by 516 MB). The events are small
    JSON messages; the registry negotiates no compression, so a client compresses nothing, and
    a frame with a reserved bit set is refused (`ClientFrames`; wsproto refuses it too)."""
    from hypercorn.protocol import ws_stream

    handshake = ws_stream.Handshake
    if getattr(handshake, "registry_no_extensions", False):
        return
    parse = handshake.__init__

    def init(self: Any, headers: list[tuple[bytes, bytes]], http_version: str) -> None:
        parse(self, headers, http_version)
        self.extensions = None  # as if none were offered: none is agreed

    handshake.__init__ = init  # type: ignore[method-assign]
    handshake.registry_no_extensions = True  # type: ignore[attr-defined]
    offered = handshake([(b"sec-websocket-extensions", b"permessage-deflate")], "1.1")
    if offered.extensions is not None:  # a Hypercorn whose handshake reads them elsewhere
        raise RuntimeError("Hypercorn's WebSocket handshake would still agree to an extension")


def end_refused_handshakes() -> None:
    """Make Hypercorn end a connection whose WebSocket handshake it refused itself (once; every
    connection, hooked or not).

    Hypercorn answers a handshake it cannot take (a `Sec-WebSocket-Version` other than 13, no
    key, HTTP/1.0, bytes sent before its answer) with a 400 that says `connection: close`, then
    leaves the connection as it is: nothing ends its stream, so the connection stayed open until
    the keep-alive timeout (75 s), and a stopping server, which closes idle connections at once,
    waited for it until the graceful timeout. Here the refusal also tells the app, if it was
    started, that the client is gone, and ends the stream, as a finished answer does; Hypercorn
    then closes the connection."""
    from hypercorn.protocol import ws_stream
    from hypercorn.protocol.events import Body, Data, Request, StreamClosed

    stream = ws_stream.WSStream
    if getattr(stream, "registry_ends_refusals", False):
        return
    handle = stream.handle

    async def handled(self: Any, event: Any) -> None:
        # Hypercorn refuses a handshake's request, or bytes before its answer; a client's close
        # frame (`Data` once accepted) closes the stream too, through Hypercorn's own
        # `StreamClosed`, which has told the app already.
        refusing = not self.closed and (
            isinstance(event, Request)
            or (isinstance(event, Body | Data) and not self.handshake.accepted)
        )
        await handle(self, event)
        if refusing and self.closed:
            if self.app_put is not None:
                await self.app_put({"type": "websocket.disconnect", "code": 1006})
            await self.send(StreamClosed(stream_id=self.stream_id))

    stream.handle = handled  # type: ignore[method-assign]
    stream.registry_ends_refusals = True  # type: ignore[attr-defined]


def bound_request_heads(most_bytes: int, most_fields: int) -> None:
    """Make h11 refuse a request head of more than `most_bytes` (up to its blank line) or more
    than `most_fields` header lines, with `431` and the connection closed, before it parses it
    (once; every connection, hooked or not).

    h11's `max_incomplete_event_size` (Hypercorn's `h11_max_incomplete_size`) bounds only a
    head that has not yet arrived whole: one sent in a single write of up to 64 KiB (Hypercorn's
    read size), or pipelined behind a small request, was parsed whatever its size. A head of
    12,000 short lines cost ~40 ms of CPU (h11's parse, then Hypercorn's, Quart's and the app's
    header lists) even on a path with no route, which spends no budget (hostile review: four
    such connections took another client's health answer from 29 to 357 ms). Here the reader of
    a request head looks at most `most_bytes` into h11's buffer for the blank line, and counts
    the lines before it, before h11's own reader runs. It also drops empty lines before a
    request line, as RFC 9112 §2.2 asks of a server (h11 answered them 400)."""
    import h11
    from h11 import _readers
    from h11._receivebuffer import ReceiveBuffer

    key = (h11.CLIENT, h11.IDLE)
    read: Any = _readers.READERS[key]
    if getattr(read, "registry_bounded", False):
        return
    if not isinstance(getattr(ReceiveBuffer(), "_data", None), bytearray) or not hasattr(
        ReceiveBuffer, "_extract"
    ):
        raise RuntimeError("h11's receive buffer keeps no bytearray: request heads are unbounded")
    blank_line = re.compile(rb"\n\r?\n")  # h11's end of a head

    def bounded(buf: Any) -> Any:
        data = buf._data
        if data[:1] in (b"\r", b"\n"):
            # Empty lines before a request line are ignored (RFC 9112 §2.2: a client may send
            # one after a POST's body); h11 refused them (400), and a pipelined request after
            # one was lost. `_extract` also resets h11's search offsets.
            buf._extract(len(data) - len(data.lstrip(b"\r\n")))
            if not data:
                return None
        end = blank_line.search(data, 0, most_bytes + 2)
        if end is None and len(data) > most_bytes:
            raise h11.LocalProtocolError(
                f"request head over {most_bytes} bytes", error_status_hint=431
            )
        # The request line, each field, the blank line: a newline each.
        if data.count(b"\n", 0, len(data) if end is None else end.end()) > most_fields + 2:
            raise h11.LocalProtocolError(
                f"request head of more than {most_fields} fields", error_status_hint=431
            )
        return read(buf)

    bounded.registry_bounded = True  # type: ignore[attr-defined]
    _readers.READERS[key] = bounded


def bound_http2_heads() -> None:
    """Make Hypercorn's `h2_max_header_list_size` hold from an HTTP/2 connection's first frame
    (once; every connection, hooked or not).

    h2 applies the size it advertises only once the client has acknowledged its SETTINGS: until
    then its decoder takes a header list of 64 KiB (~2,000 fields), whatever Hypercorn's config
    says, and a client that never acknowledges keeps that. A header list over the bound ends
    the connection (GOAWAY, h2's `DenialOfServiceError`)."""
    from hypercorn.protocol import h2 as h2_protocol

    protocol = h2_protocol.H2Protocol
    if getattr(protocol, "registry_bounded_heads", False):
        return
    init = protocol.__init__

    def bounded_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.connection.decoder.max_header_list_size = self.config.h2_max_header_list_size

    protocol.__init__ = bounded_init  # type: ignore[method-assign]
    protocol.registry_bounded_heads = True  # type: ignore[attr-defined]


class IdleAtShutdown:
    """Closes a connection at shutdown once it is idle, for a connection whose `FrameStream`
    enforces the keep-alive timeout. Idle: Hypercorn has answered its last request (its idle
    task's `restart`) and no byte of another has come (`FrameStream.request_under_way`), so a
    request that has begun to arrive, its head whole or not, is answered before the connection
    is closed. Hypercorn's own idle task waits for the shutdown too, but in Hypercorn 0.18 it is
    cancelled with the app's task right after each answer, so an idle keep-alive connection
    stayed open through the shutdown until the graceful timeout
    (`tests/hostile/test_connections.py`). Hypercorn's `restart` and `stop` of that task still
    run (`follow`): replacing the task by a flag made a GET cost ~20 % more CPU under
    bench/entries.py's load, so it stays."""

    def __init__(self, stream: FrameStream) -> None:
        self._stream = stream
        self.idle = False
        self._next_answer = trio.Event()  # set by the next restart (an answer is out)

    def follow(self, task: Any) -> None:
        """Wrap Hypercorn's idle task `task` so that its restarts and stops are seen here (the
        flags are set before Hypercorn's own, which may be cancelled)."""
        restart, stop = task.restart, task.stop

        async def restarted(task_group: Any, action: Any) -> None:
            self.idle = True
            answered, self._next_answer = self._next_answer, trio.Event()
            answered.set()
            await restart(task_group, action)

        async def stopped() -> None:
            self.idle = False
            await stop()

        task.restart, task.stop = restarted, stopped

    async def close_idle_at_shutdown(self, server: Any) -> None:
        await server.context.terminated.wait()
        while not self.idle or self._stream.request_under_way:
            await self._next_answer.wait()
        with trio.CancelScope(shield=True):
            await server._initiate_server_close()


def install_in_hypercorn() -> bool:
    """Wrap every plain TCP connection of Hypercorn's trio worker in a `FrameStream` (once);
    False, changing nothing, when this Hypercorn does not fit the hook (`hook_unfit`).
    Where Hypercorn's config carries a `ConnectionGuard` (attribute `registry_guard`), each
    connection is admitted by it and bounded by its limits; a config marked `registry_plain`
    keeps its connections as Hypercorn serves them."""
    reason = hook_unfit()
    if reason is not None:
        log.error(
            "%s: serving without the connection hook: the per-connection limits (server.*"
            " connection caps and read deadlines) are off and events take the slower ASGI path"
            " (docs/limits.md)",
            reason,
        )
        return False
    from hypercorn.config import Config
    from hypercorn.events import Updated
    from hypercorn.trio import run as worker
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import TrioSingleTask, WorkerContext
    from hypercorn.typing import AppWrapper, LifespanState

    if getattr(worker.TCPServer, "registry_frame_stream", False):  # type: ignore[attr-defined]
        return True

    class FrameTCPServer(TCPServer):
        registry_frame_stream = True

        def __init__(
            self,
            app: AppWrapper,
            config: Config,
            context: WorkerContext,
            state: LifespanState,
            stream: Any,
        ) -> None:
            self.guard: ConnectionGuard | None = getattr(config, GUARD_ATTRIBUTE, None)
            self.plain = bool(getattr(config, PLAIN_ATTRIBUTE, False))
            if isinstance(stream, trio.SocketStream) and not self.plain:
                stream = FrameStream(stream, self.guard.limits if self.guard else None)
            super().__init__(app, config, context, state, stream)
            self.idle_at_shutdown: IdleAtShutdown | None = None
            if (
                isinstance(stream, FrameStream)
                and stream.limits is not None
                and isinstance(getattr(self, "idle_task", None), TrioSingleTask)
            ):
                self.idle_at_shutdown = IdleAtShutdown(stream)
                self.idle_at_shutdown.follow(self.idle_task)

        async def protocol_send(self, event: Any) -> None:
            # Hypercorn begins each request with `Updated(idle=False)`, one pipelined behind
            # the last too (its bytes came with it: no read tells the stream).
            if type(event) is Updated and not event.idle and isinstance(self.stream, FrameStream):
                self.stream.request_started()
            await super().protocol_send(event)

        async def run(self) -> None:
            if self.plain:
                CURRENT_STREAM.set(None)
                await super().run()
                return
            # The tasks serving this connection (the app's included) start from this one and
            # inherit its context.
            stream: Any = self.stream
            frames = stream if isinstance(stream, FrameStream) else None
            CURRENT_STREAM.set(frames)
            guard = self.guard
            if guard is None:
                await self._serve(frames)
                return
            try:
                key = client_key(_peer_host(stream))
            except OSError:  # gone before it was served
                await self.stream.aclose()
                return
            refusal = guard.admit(key)
            if refusal is not None:
                if frames is not None:
                    frames.refuse(refusal)
                await self.stream.aclose()
                return
            try:
                await self._serve(frames)
            finally:
                guard.release(key)
                if frames is not None and frames.cut_for is not None:
                    guard.connection_cut(frames.cut_for)

        async def _serve(self, frames: FrameStream | None) -> None:
            """Hypercorn's connection, in a scope the stream can end (`FrameStream.cut`). A
            failure inside it ends this connection only: e.g. h11's `LocalProtocolError` when
            a client sends frames before the upgrade is answered, which would otherwise end
            Hypercorn's accept loop and the process with it."""
            try:
                with trio.CancelScope() as serving:
                    if frames is not None:
                        frames.serving = serving
                    idle = self.idle_at_shutdown
                    if idle is None:
                        await super().run()
                    else:
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(idle.close_idle_at_shutdown, self)
                            await super().run()
                            nursery.cancel_scope.cancel()
            except Exception as exc:
                failures = self.guard.connection_failed(exc) if self.guard else 1
                if failures == 1 or failures % 1000 == 0:  # news, then rarely
                    log.warning(
                        "a connection failed and was dropped (%d so far): %s: %s",
                        failures,
                        type(exc).__name__,
                        exc,
                    )
                with contextlib.suppress(Exception):
                    await self.stream.aclose()

    worker.TCPServer = FrameTCPServer  # type: ignore[attr-defined]
    return True


def _peer_host(stream: Any) -> str:
    sock = stream.socket if hasattr(stream, "socket") else stream.transport_stream.socket
    peer = sock.getpeername()
    return str(peer[0]) if isinstance(peer, tuple) else str(peer)
