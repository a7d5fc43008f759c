"""The log actor: one reader of the durable log per process, fanning records out to subscribers.

Theory of operation. The log (every accepted change, gap-free, commit order = sequence order)
is the source of truth; LISTEN/NOTIFY only wakes readers (a process that reads a streaming
replica polls instead: `store.listen_log`, docs/replicas.md). The actor owns the LISTEN connection,
the last position it has read (`head`), a ring of the most recent records, and the set of live
subscribers. On each wake-up (and every `poll_seconds`, in case a notification is lost) it reads
the log after `head` page by page and hands each page, as one `Batch`, to every live subscriber's
`Sink`, synchronously: a sink never waits (a queue sink puts the records into its consumer's
bounded queue; the WebSocket sink writes the frames to the socket without blocking), so a slow
subscriber cannot slow the others or the writers. Reads are at least `coalesce_seconds` apart:
under a steady stream of commits each read, and so each sink call, carries several records.

A queue `Subscription` starts in *replay*: it reads the log itself (in its consumer's task)
from its `after` position, page by page. When a page comes back short it asks the actor to
attach its sink at its position. (An event socket asks to be attached first, and replays only
when the actor answers "behind": ws/events.py.) The actor handles each request between reads,
so the hand-over is atomic:
if the position is at or past `head`, the sink simply gets every record after its position from
now on; if it is behind but the ring still holds the missing records (and they fit its
`capacity`), the actor delivers them first; otherwise it answers "behind" and the subscription
replays on. Every sequence is delivered once, in order, with no gap at the hand-over.

Failures. A sink that cannot keep up answers `slow` and is dropped (a queue subscription's
consumer gets `Lagged` with the last sequence it received, to resume from). If the LISTEN
connection is lost the actor tells every sink `disconnected` (they go back to replay and
re-attach), answers "behind" to every attach still waiting in its inbox (those replay too,
rather than wait for the database), and fails with `Unavailable`; its supervisor restarts it
with backoff. Wake-ups share the inbox with attaches: a burst of attaches that fills it does
not lose one (a flag the actor checks after each message). Closing the handle's request channel
stops it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import trio

from actors.supervisor import database_ready, supervise
from registry.changes import LogRecord
from registry.store import HealthStore, LogStore, LogWakeups

log = logging.getLogger(__name__)

PAGE = 500  # records per read of the log
RING = 4096  # recent records kept for subscribers attaching slightly behind
PRUNE_FLOOR = 64  # subscribers the actor keeps before an attach looks for ended ones


class LogActorStore(LogStore, HealthStore, Protocol):
    """What the log actor reads: the log, and whether the database is back after an outage."""


class Lagged(Exception):
    """The subscriber fell too far behind and was dropped; resume after `last_sequence`."""

    def __init__(self, last_sequence: int) -> None:
        super().__init__(f"subscriber too slow; resume after sequence {last_sequence}")
        self.last_sequence = last_sequence


@dataclass(frozen=True)
class Batch:
    """Consecutive log records handed to every sink at once (one read of the log).

    `memo` is scratch space the sinks of one batch share for what they derive from it, so that
    work done for one subscriber (the frames of the records its filter admits) is done once
    for every subscriber with the same filter."""

    records: Sequence[LogRecord]
    at: float  # trio.current_time() when the batch was handed out
    memo: dict[Any, Any] = field(default_factory=dict)


Delivery = Literal["ok", "slow", "gone"]


class Sink(Protocol):
    """Where a live subscription's records go, called from the log actor's task: it must not
    block. Each batch follows the previous one without gap or overlap."""

    @property
    def capacity(self) -> int:
        """How many records the sink can take at the hand-over from replay to live."""
        ...

    def deliver(self, batch: Batch) -> Delivery:
        """Take the batch: "ok"; "slow" (the sink fell too far behind: drop it, it has noted
        why); "gone" (the subscriber has ended)."""
        ...

    def disconnected(self) -> None:
        """The actor lost the log and dropped the sink: replay, then attach again."""
        ...

    def gone(self) -> bool:
        """Whether the subscriber has ended: the actor drops the sink without waiting for a
        batch to offer it (a quiet log would otherwise keep every ended subscription)."""
        ...


@dataclass
class _Subscriber:
    """The actor's side of a live subscription (touched only by the actor's task)."""

    sink: Sink
    position: int  # the last sequence delivered to it


@dataclass(frozen=True)
class _Attach:
    after: int
    subscriber: _Subscriber
    reply: trio.MemorySendChannel[bool]  # True: attached; False: behind, replay on


class _QueueSink:
    """A subscription's sink: the records go, one by one, into its consumer's bounded queue."""

    def __init__(self, queue: trio.MemorySendChannel[LogRecord], capacity: int) -> None:
        self.queue = queue
        self.capacity = capacity
        self.dropped: Literal["slow", "disconnected"] | None = None

    def deliver(self, batch: Batch) -> Delivery:
        for record in batch.records:
            try:
                self.queue.send_nowait(record)
            except trio.WouldBlock:
                self.dropped = "slow"
                self.queue.close()
                return "slow"
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return "gone"  # the consumer went away
        return "ok"

    def disconnected(self) -> None:
        self.dropped = "disconnected"
        self.queue.close()

    def gone(self) -> bool:
        return self.dropped is not None or self.queue.statistics().open_receive_channels == 0


@dataclass
class LogStats:
    head: int = 0
    subscribers: int = 0
    attached: int = 0  # sinks made live, in all
    records_read: int = 0
    reads: int = 0  # reads of the log that succeeded (the database answered)
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
        self._sink: _QueueSink | None = None
        self.live_changed = trio.Event()  # set (and replaced) whenever `live` changes

    @property
    def live(self) -> bool:
        return self._live is not None

    def ready(self) -> bool:
        """Whether `receive()` has a record at hand (returns without waiting)."""
        if self._pending:
            return True
        return self._live is not None and self._live.statistics().current_buffer_used > 0

    def receive_nowait(self) -> LogRecord:
        """The next record if one is at hand (`ready()`), without a checkpoint; raises
        `trio.WouldBlock` otherwise, and `receive()` then waits (or replays, or detaches).
        A consumer draining a burst this way yields to the scheduler once per burst, not once
        per record: one pass per record was most of what a process spent following the
        other processes' writes (bench/README.md, "Following the log")."""
        if self._pending:
            return self._deliver(self._pending.popleft())
        if self._live is not None:
            try:
                record = self._live.receive_nowait()
            except trio.EndOfChannel:
                raise trio.WouldBlock from None  # receive() detaches
            return self._deliver(record)
        raise trio.WouldBlock

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
        assert self._sink is not None
        reason = self._sink.dropped
        self._live.close()
        self._live = self._sink = None
        self._flip()
        if reason == "slow":
            raise Lagged(self.last)
        # disconnected (the actor restarts) or stopped: replay from the store again

    async def _replay(self) -> None:
        records = await self._handle.read(self.last)
        self._pending.extend(records)
        if len(records) < PAGE:
            after = records[-1].seq if records else self.last
            await self._attach(after)

    async def _attach(self, after: int) -> None:
        send, receive = trio.open_memory_channel[LogRecord](self._queue_size)
        sink = _QueueSink(send, self._queue_size)
        try:
            attached = await self._handle.attach(after, sink)
        except BaseException:
            receive.close()  # cancelled after the actor took the sink: it is gone
            raise
        if attached:
            self._live, self._sink = receive, sink
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
        store: LogStore,
        requests: trio.MemorySendChannel[_Attach | _Wake],
        stats: LogStats,
        queue_size: int,
        observers: Sequence[Callable[[Sequence[LogRecord]], None]] = (),
    ) -> None:
        self.store = store
        self._requests = requests
        self._stats = stats
        self.queue_size = queue_size
        self._observers = observers

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

    @property
    def connected(self) -> bool:
        """Whether the actor is reading the log now (an attach is answered without waiting
        for the database to come back)."""
        return self._stats.connected

    @property
    def reads(self) -> int:
        """How many of the actor's reads of the log have succeeded so far."""
        return self._stats.reads

    async def head(self) -> int:
        """The log's current last sequence (read from the store)."""
        return await self.store.log_head()

    async def read(self, after: int) -> Sequence[LogRecord]:
        """Up to `PAGE` records after `after`, from the store (a replay's page). Records the
        actor has not read yet are shown to the observers first, as the actor would."""
        records = await self.store.log_after(after, PAGE)
        if records and records[-1].seq > self._stats.head and self._observers:
            ahead = [r for r in records if r.seq > self._stats.head]
            for observe in self._observers:
                observe(ahead)
        return records

    async def attach(self, after: int, sink: Sink) -> bool:
        """Make `sink` live after sequence `after` (the last record its subscriber has): from
        now on the actor delivers it every record after that. False: the subscriber is too far
        behind live; it replays more from the store and asks again."""
        reply, answer = trio.open_memory_channel[bool](1)
        async with answer:
            await self._requests.send(_Attach(after, _Subscriber(sink, after), reply))
            return await answer.receive()

    def statistics(self) -> LogStats:
        return LogStats(**vars(self._stats))


@dataclass
class _State:
    """The actor's own state, kept across restarts of its connection."""

    head: int
    ring: deque[LogRecord] = field(default_factory=lambda: deque(maxlen=RING))
    subscribers: list[_Subscriber] = field(default_factory=list)
    observers: Sequence[Callable[[Sequence[LogRecord]], None]] = ()
    prune_at: int = PRUNE_FLOOR  # an attach that finds this many subscribers drops ended ones


async def run_log(
    store: LogActorStore,
    *,
    queue_size: int = 1024,
    poll_seconds: float = 5.0,
    coalesce_seconds: float = 0.0,
    observers: Sequence[Callable[[Sequence[LogRecord]], None]] = (),
    task_status: trio.TaskStatus[LogHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The actor: started with `nursery.start`, it reports its handle once the log head is known.

    Each connection of the actor runs under the supervisor (restarted after a lost LISTEN).
    `coalesce_seconds` is the least time between two reads of the log. `observers` see every
    batch read, synchronously, before any subscriber does (the caches drop what it changed,
    so that a GET after an event shows the change)."""
    send, inbox = trio.open_memory_channel[_Attach | _Wake](1024)
    stats = LogStats()
    state = _State(head=await store.log_head(), observers=observers)
    stats.head = state.head
    async with inbox, send.clone() as wake:
        task_status.started(LogHandle(store, send, stats, queue_size, observers))
        await supervise(
            "log",
            lambda: _connected(store, state, stats, inbox, wake, poll_seconds, coalesce_seconds),
            ready=database_ready(store, writes=False),
        )


@dataclass(frozen=True)
class _Wake:
    """The log may have grown."""


@dataclass
class _Woken:
    """Set when the log may have grown, whether or not a `_Wake` found room in the inbox (a
    burst of attaches may fill it): the actor reads after the message it takes next."""

    pending: bool = False


async def _connected(
    store: LogStore,
    state: _State,
    stats: LogStats,
    inbox: trio.MemoryReceiveChannel[_Attach | _Wake],
    wake: trio.MemorySendChannel[_Attach | _Wake],
    poll_seconds: float,
    coalesce_seconds: float,
) -> None:
    woken = _Woken()
    try:
        async with store.listen_log() as wakeups, trio.open_nursery() as nursery:
            stats.connected = True
            nursery.start_soon(
                _forward_wakeups, wakeups, wake, woken, poll_seconds, coalesce_seconds
            )
            await _read(store, state, stats)  # changes may have committed while disconnected
            async for message in inbox:
                if isinstance(message, _Attach):
                    _attach(state, stats, message)
                if woken.pending:  # a `_Wake`, or one that found the inbox full of attaches
                    woken.pending = False
                    await _read(store, state, stats)
    finally:
        stats.connected = False
        for subscriber in state.subscribers:
            subscriber.sink.disconnected()
        state.subscribers.clear()
        stats.subscribers = 0
        _refuse_waiting_attaches(inbox)


def _refuse_waiting_attaches(inbox: trio.MemoryReceiveChannel[_Attach | _Wake]) -> None:
    """Answer every attach that came while the actor was reading: False, so its subscriber
    replays from the store (and fails cleanly while the database is down) instead of waiting
    for a reconnection that may take the whole outage. Wakes go too: a reconnection reads."""
    while True:
        try:
            message = inbox.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return
        if isinstance(message, _Attach):
            _reply(message, False)


async def _forward_wakeups(
    wakeups: LogWakeups,
    wake: trio.MemorySendChannel[_Attach | _Wake],
    woken: _Woken,
    poll_seconds: float,
    coalesce_seconds: float,
) -> None:
    """Turn notifications (and, as a safety net, silence of `poll_seconds`) into reads, at
    most one per `coalesce_seconds` (notifications meanwhile are kept: `wait` returns at once)."""
    while True:
        with trio.move_on_after(poll_seconds):
            await wakeups.wait()
        woken.pending = True
        # A full inbox means the actor is busy: it reads after the next message it takes.
        with contextlib.suppress(trio.WouldBlock):
            wake.send_nowait(_Wake())
        if coalesce_seconds > 0:
            await trio.sleep(coalesce_seconds)


async def _read(store: LogStore, state: _State, stats: LogStats) -> None:
    while True:
        records = await store.log_after(state.head, PAGE)
        stats.reads += 1
        for record in records:
            assert record.seq == state.head + 1, f"log gap: {state.head} then {record.seq}"
            state.head = record.seq
            state.ring.append(record)
        if records:
            _fan_out(state, stats, records)
        else:  # a quiet log (the poll, at least): no batch drops the ended sinks
            _prune(state, stats)
        stats.head = state.head
        stats.records_read += len(records)
        if len(records) < PAGE:
            return


def _fan_out(state: _State, stats: LogStats, records: Sequence[LogRecord]) -> None:
    """Hand `records` (consecutive) to every live sink, each from where it stands."""
    for observe in state.observers:
        observe(records)
    first, last = records[0].seq, records[-1].seq
    batch = Batch(records, trio.current_time())
    kept: list[_Subscriber] = []
    for subscriber in state.subscribers:
        if subscriber.position >= last:
            kept.append(subscriber)  # it read this far itself before attaching
            continue
        given = batch
        if subscriber.position >= first:  # it attached within these records
            given = Batch(records[subscriber.position - first + 1 :], batch.at)
        outcome = subscriber.sink.deliver(given)
        if outcome == "ok":
            subscriber.position = last
            kept.append(subscriber)
        elif outcome == "slow":
            stats.dropped_slow += 1
    state.subscribers = kept
    stats.subscribers = len(kept)


def _prune(state: _State, stats: LogStats) -> None:
    state.subscribers = [s for s in state.subscribers if not s.sink.gone()]
    stats.subscribers = len(state.subscribers)
    state.prune_at = max(PRUNE_FLOOR, 2 * len(state.subscribers))


def _attach(state: _State, stats: LogStats, request: _Attach) -> None:
    if len(state.subscribers) >= state.prune_at:
        # Subscriptions may end many times a second while nothing is written: the list stays
        # within twice the live ones (and PRUNE_FLOOR), at a scan per doubling.
        _prune(state, stats)
    subscriber = request.subscriber
    sink = subscriber.sink
    if request.after < state.head:
        missing = state.head - request.after
        oldest = state.ring[0].seq if state.ring else state.head + 1
        if oldest > request.after + 1 or missing > sink.capacity:
            _reply(request, False)  # not in the ring, or too many: replay on from the store
            return
        if not _reply(request, True):
            return  # the subscriber gave up waiting
        catch_up = list(itertools.islice(state.ring, len(state.ring) - missing, None))
        outcome = sink.deliver(Batch(catch_up, trio.current_time()))
        if outcome != "ok":  # it fits the capacity, so only a subscriber that ended says so
            stats.dropped_slow += outcome == "slow"
            return
        subscriber.position = state.head
    elif not _reply(request, True):
        return
    state.subscribers.append(subscriber)
    stats.subscribers = len(state.subscribers)
    stats.attached += 1


def _reply(request: _Attach, attached: bool) -> bool:
    try:
        request.reply.send_nowait(attached)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False  # the subscriber gave up waiting
    return True
