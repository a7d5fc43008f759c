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

`install_in_hypercorn` makes Hypercorn's trio worker wrap every plain TCP connection this way
and publish the wrapper in `CURRENT_STREAM` for the tasks that serve it. Hypercorn has no public
hook for this: it replaces the worker's `TCPServer` with a subclass (checked against the pinned
version by tests/ws/test_transport.py). Connections over TLS or HTTP/2 are not wrapped; their
subscribers take the ordinary path, one ASGI message per event.
"""

from __future__ import annotations

import os
from collections import deque
from contextvars import ContextVar
from typing import Any

import trio

CURRENT_STREAM: ContextVar[FrameStream | None] = ContextVar("registry_frame_stream", default=None)


def text_frame(payload: bytes) -> bytes:
    """One final, unmasked text frame (RFC 6455 §5.2) carrying `payload` (UTF-8)."""
    size = len(payload)
    if size < 126:
        return bytes((0x81, size)) + payload
    if size < 1 << 16:
        return bytes((0x81, 126)) + size.to_bytes(2, "big") + payload
    return bytes((0x81, 127)) + size.to_bytes(8, "big") + payload


class FrameStream(trio.abc.HalfCloseableStream):
    """A TCP connection that can also take bytes without waiting (`offer`).

    Every write, awaited or not, goes through one queue of pending chunks written with
    non-blocking system calls, so a cancelled wait never leaves part of a frame behind: the
    rest stays first in the queue. `stalled_since` is when the socket last refused more
    bytes while some were waiting (None while it takes them): how long a client has taken
    no data, whoever is writing."""

    def __init__(self, inner: trio.SocketStream) -> None:
        self._inner = inner
        self._fd = inner.socket.fileno()
        self._pending: deque[bytes | memoryview] = deque()
        self.pending_bytes = 0
        self._lock = trio.Lock()  # held by whoever awaits a write
        self._closed = False
        self.broken = False
        self.websocket = False  # upgraded: every write is now one WebSocket frame
        self.sealed = False  # a close frame went out: nothing may follow it
        self.stalled_since: float | None = None

    @property
    def socket(self) -> trio.socket.SocketType:
        return self._inner.socket

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

    def _write(self, data: bytes | memoryview) -> int:
        """As much of `data` as the kernel takes now (0 when it takes nothing)."""
        try:
            sent = os.write(self._fd, data)
        except BlockingIOError:
            if self.stalled_since is None:
                self.stalled_since = trio.current_time()
            return 0
        except OSError as exc:  # reset, broken pipe: the client is gone
            self.broken = True
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

    async def _flush_locked(self) -> None:
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
            # Cancellable: what is not written stays first in the queue, whole or in part.
            await trio.lowlevel.wait_writable(self._inner.socket)
        await trio.lowlevel.checkpoint()

    def abort(self) -> None:
        """Drop the connection now: a write waiting for the client fails, and nothing more is
        sent (no close frame: a client that reads nothing would not read that either)."""
        self.broken = True
        self._pending.clear()
        self.pending_bytes = 0
        self._inner.socket.close()  # wakes a task waiting to write, with ClosedResourceError

    # --- trio.abc.HalfCloseableStream, as Hypercorn uses it ------------------------------

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.sealed and data:
            raise trio.ClosedResourceError("a close frame was sent")
        if self.websocket and data[:1] == b"\x88":  # a close frame, Hypercorn's or ours:
            self.sealed = True  # the event fan-out stops before it, not after
        async with self._lock:
            self._queue(bytes(data))
            await self._flush_locked()

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        # Hypercorn ends a connection this way once its last message (a close frame, which
        # went out after every offered byte) is sent; bytes offered since have no reader.
        self._pending.clear()
        self.pending_bytes = 0
        async with self._lock:
            await self._inner.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self._inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        self._closed = True
        self._pending.clear()
        self.pending_bytes = 0
        await self._inner.aclose()


def install_in_hypercorn() -> None:
    """Wrap every plain TCP connection of Hypercorn's trio worker in a `FrameStream` (once)."""
    from hypercorn.config import Config
    from hypercorn.trio import run as worker
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import AppWrapper, LifespanState

    if getattr(worker.TCPServer, "registry_frame_stream", False):  # type: ignore[attr-defined]
        return

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
            if isinstance(stream, trio.SocketStream):
                stream = FrameStream(stream)
            super().__init__(app, config, context, state, stream)

        async def run(self) -> None:
            # The tasks serving this connection (the app's included) start from this one and
            # inherit its context.
            stream: Any = self.stream
            CURRENT_STREAM.set(stream if isinstance(stream, FrameStream) else None)
            await super().run()

    worker.TCPServer = FrameTCPServer  # type: ignore[attr-defined]
