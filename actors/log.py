"""The log actor: one reader of the durable log per process, fanning records out to subscribers.

Theory of operation. The log (every accepted change, gap-free, commit order = sequence order)
is the source of truth; LISTEN/NOTIFY only wakes readers. The actor owns the LISTEN connection,
the last position it has read (`head`), a ring of the most recent records, and the set of live
subscribers. On each wake-up (and every `poll_seconds`, in case a notification is lost) it reads
the log after `head` page by page and hands each record to every live subscriber whose position
is below it, with `send_nowait` into that subscriber's bounded queue: the actor never waits for a
subscriber, so a slow one cannot slow the others or the writers.

A subscription starts in *replay*: it reads the log itself (in its consumer's task) from its
`after` position, page by page. When a page comes back short it asks the actor to attach it at
its position. The actor handles the request between reads, so the hand-over is atomic: if the
position is at or past `head`, the subscriber simply gets every record after its position from
now on; if it is behind but the ring still holds the missing records (and they fit its queue),
the actor queues them first; otherwise it answers "behind" and the subscription replays on.
Every sequence is delivered once, in order, with no gap at the hand-over.

Failures. A subscriber whose queue is full is dropped: its queue is closed with the reason
`slow`, and its consumer gets `Lagged` with the last sequence it received, to resume from. If
the LISTEN connection is lost the actor drops every subscriber with the reason `disconnected`
(they go back to replay and re-attach) and fails with `Unavailable`; its supervisor restarts it
with backoff. Closing the handle's request channel stops it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

import trio

from actors.supervisor import supervise
from registry.changes import LogRecord
from registry.store import LogWakeups, Store

log = logging.getLogger(__name__)

PAGE = 500  # records per read of the log
RING = 4096  # recent records kept for subscribers attaching slightly behind


class Lagged(Exception):
    """The subscriber fell too far behind and was dropped; resume after `last_sequence`."""

    def __init__(self, last_sequence: int) -> None:
        super().__init__(f"subscriber too slow; resume after sequence {last_sequence}")
        self.last_sequence = last_sequence


@dataclass
class _Subscriber:
    """The actor's side of a live subscription (touched only by the actor's task)."""

    queue: trio.MemorySendChannel[LogRecord]
    position: int  # the last sequence queued to it
    dropped: Literal["slow", "disconnected"] | None = None


@dataclass(frozen=True)
class _Attach:
    after: int
    subscriber: _Subscriber
    reply: trio.MemorySendChannel[bool]  # True: attached; False: behind, replay on


@dataclass
class LogStats:
    head: int = 0
    subscribers: int = 0
    records_read: int = 0
    dropped_slow: int = 0
    connected: bool = False


class Subscription:
    """An ordered, gap-free stream of log records after a position: replay, then live."""

    def __init__(self, handle: LogHandle, after: int, queue_size: int) -> None:
        self._handle = handle
        self.last = after  # the last sequence handed to the consumer
        self._queue_size = queue_size
        self._pending: deque[LogRecord] = deque()
        self._live: trio.MemoryReceiveChannel[LogRecord] | None = None
        self._subscriber: _Subscriber | None = None
        self.live_changed = trio.Event()  # set (and replaced) whenever `live` changes

    @property
    def live(self) -> bool:
        return self._live is not None

    def ready(self) -> bool:
        """Whether `receive()` has a record at hand (returns without waiting)."""
        if self._pending:
            return True
        return self._live is not None and self._live.statistics().current_buffer_used > 0

    async def receive(self) -> LogRecord:
        """The next record; raises `Lagged` once dropped for being slow, and the store's
        `Unavailable` if the log cannot be read during replay."""
        while True:
            if self._pending:
                record = self._pending.popleft()
                return self._deliver(record)
            if self._live is not None:
                try:
                    record = await self._live.receive()
                except trio.EndOfChannel:
                    self._detached()
                    continue
                return self._deliver(record)
            await self._replay()

    def _deliver(self, record: LogRecord) -> LogRecord:
        assert record.seq == self.last + 1, f"log gap: {self.last} then {record.seq}"
        self.last = record.seq
        return record

    def _detached(self) -> None:
        assert self._live is not None
        assert self._subscriber is not None
        reason = self._subscriber.dropped
        self._live.close()
        self._live = self._subscriber = None
        self._flip()
        if reason == "slow":
            raise Lagged(self.last)
        # disconnected (the actor restarts) or stopped: replay from the store again

    async def _replay(self) -> None:
        records = await self._handle.store.log_after(self.last, PAGE)
        self._pending.extend(records)
        if len(records) < PAGE:
            after = records[-1].seq if records else self.last
            await self._attach(after)

    async def _attach(self, after: int) -> None:
        send, receive = trio.open_memory_channel[LogRecord](self._queue_size)
        subscriber = _Subscriber(send, after)
        reply, answer = trio.open_memory_channel[bool](1)
        async with answer:
            await self._handle._requests.send(_Attach(after, subscriber, reply))
            attached = await answer.receive()
        if attached:
            self._live, self._subscriber = receive, subscriber
            self._flip()
        else:
            receive.close()

    def _flip(self) -> None:
        self.live_changed.set()
        self.live_changed = trio.Event()

    def close(self) -> None:
        if self._live is not None:
            self._live.close()  # the actor drops it on its next send
            self._live = None


class LogHandle:
    """The handle of the log actor."""

    def __init__(
        self,
        store: Store,
        requests: trio.MemorySendChannel[_Attach | _Wake],
        stats: LogStats,
        queue_size: int,
    ) -> None:
        self.store = store
        self._requests = requests
        self._stats = stats
        self.queue_size = queue_size

    @asynccontextmanager
    async def subscribe(
        self, after: int, *, queue_size: int | None = None
    ) -> AsyncIterator[Subscription]:
        """Every record after sequence `after`, in order: `receive()` them from the yielded
        subscription. `queue_size` bounds how far the consumer may fall behind live."""
        subscription = Subscription(self, after, queue_size or self.queue_size)
        try:
            yield subscription
        finally:
            subscription.close()

    async def head(self) -> int:
        """The log's current last sequence (read from the store)."""
        return await self.store.log_head()

    def statistics(self) -> LogStats:
        return LogStats(**vars(self._stats))


@dataclass
class _State:
    """The actor's own state, kept across restarts of its connection."""

    head: int
    ring: deque[LogRecord] = field(default_factory=lambda: deque(maxlen=RING))
    subscribers: list[_Subscriber] = field(default_factory=list)


async def run_log(
    store: Store,
    *,
    queue_size: int = 1024,
    poll_seconds: float = 5.0,
    task_status: trio.TaskStatus[LogHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The actor: started with `nursery.start`, it reports its handle once the log head is known.

    Each connection of the actor runs under the supervisor (restarted after a lost LISTEN)."""
    send, inbox = trio.open_memory_channel[_Attach | _Wake](1024)
    stats = LogStats()
    state = _State(head=await store.log_head())
    stats.head = state.head
    async with inbox, send.clone() as wake:
        task_status.started(LogHandle(store, send, stats, queue_size))
        await supervise("log", lambda: _connected(store, state, stats, inbox, wake, poll_seconds))


@dataclass(frozen=True)
class _Wake:
    """The log may have grown."""


async def _connected(
    store: Store,
    state: _State,
    stats: LogStats,
    inbox: trio.MemoryReceiveChannel[_Attach | _Wake],
    wake: trio.MemorySendChannel[_Attach | _Wake],
    poll_seconds: float,
) -> None:
    try:
        async with store.listen_log() as wakeups, trio.open_nursery() as nursery:
            stats.connected = True
            nursery.start_soon(_forward_wakeups, wakeups, wake, poll_seconds)
            await _read(store, state, stats)  # changes may have committed while disconnected
            async for message in inbox:
                if isinstance(message, _Attach):
                    _attach(state, stats, message)
                else:
                    await _read(store, state, stats)
    finally:
        stats.connected = False
        for subscriber in state.subscribers:
            subscriber.dropped = "disconnected"
            subscriber.queue.close()
        state.subscribers.clear()
        stats.subscribers = 0


async def _forward_wakeups(
    wakeups: LogWakeups, wake: trio.MemorySendChannel[_Attach | _Wake], poll_seconds: float
) -> None:
    """Turn notifications (and, as a safety net, silence of `poll_seconds`) into reads."""
    while True:
        with trio.move_on_after(poll_seconds):
            await wakeups.wait()
        # A full inbox means the actor is busy; it reads again soon, and so does the poll.
        with contextlib.suppress(trio.WouldBlock):
            wake.send_nowait(_Wake())


async def _read(store: Store, state: _State, stats: LogStats) -> None:
    while True:
        records = await store.log_after(state.head, PAGE)
        for record in records:
            assert record.seq == state.head + 1, f"log gap: {state.head} then {record.seq}"
            state.head = record.seq
            state.ring.append(record)
            _fan_out(state, stats, record)
        stats.head = state.head
        stats.records_read += len(records)
        if len(records) < PAGE:
            return


def _fan_out(state: _State, stats: LogStats, record: LogRecord) -> None:
    kept: list[_Subscriber] = []
    for subscriber in state.subscribers:
        if subscriber.position >= record.seq:
            kept.append(subscriber)  # it read this far itself before attaching
            continue
        try:
            subscriber.queue.send_nowait(record)
        except trio.WouldBlock:
            subscriber.dropped = "slow"
            subscriber.queue.close()
            stats.dropped_slow += 1
            continue
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            continue  # the consumer went away
        subscriber.position = record.seq
        kept.append(subscriber)
    state.subscribers = kept
    stats.subscribers = len(kept)


def _attach(state: _State, stats: LogStats, request: _Attach) -> None:
    subscriber = request.subscriber
    if request.after < state.head:
        missing = state.head - request.after
        oldest = state.ring[0].seq if state.ring else state.head + 1
        if oldest > request.after + 1 or missing > subscriber.queue.statistics().max_buffer_size:
            _reply(request, False)  # not in the ring, or too many: replay on from the store
            return
        for record in itertools.islice(state.ring, len(state.ring) - missing, None):
            subscriber.queue.send_nowait(record)
        subscriber.position = state.head
    if _reply(request, True):
        state.subscribers.append(subscriber)
        stats.subscribers = len(state.subscribers)


def _reply(request: _Attach, attached: bool) -> bool:
    try:
        request.reply.send_nowait(attached)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False  # the subscriber gave up waiting
    return True
