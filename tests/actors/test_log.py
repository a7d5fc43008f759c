"""The log actor over the in-memory store and virtual time: replay then live with no gap or
duplicate under concurrent writes, dropping a slow subscriber without slowing anyone else,
restarting after a lost LISTEN connection, the poll as a safety net, and its statistics."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import NoReturn

import pytest
import trio
import trio.testing

import actors.log as log_actor
from actors.log import PAGE, Batch, Delivery, Lagged, LogHandle, Subscription, run_log
from actors.supervisor import supervise
from registry.changes import Change, LogRecord
from registry.errors import Unavailable
from registry.store.memory import MemoryStore
from tests.helpers import entry_created

_names = itertools.count()


def create() -> Change:
    return entry_created(f"did:web:agents.example:{next(_names)}")


async def fill(store: MemoryStore, count: int) -> int:
    """Append `count` changes in one batch; the new head."""
    await store.append([(create(), None) for _ in range(count)])
    return await store.log_head()


async def write(store: MemoryStore, batches: list[int], every: float) -> None:
    """Append batches of the given sizes, one every `every` virtual seconds."""
    for size in batches:
        await fill(store, size)
        await trio.sleep(every)


async def consume(
    handle: LogHandle, after: int, until: int, got: list[int], queue_size: int | None = None
) -> None:
    """Receive every sequence after `after` up to `until` into `got`."""
    async with handle.subscribe(after, queue_size=queue_size) as subscription:
        while subscription.last < until:
            got.append((await subscription.receive()).seq)


async def follow_timed(handle: LogHandle, after: int, got: list[tuple[int, float]]) -> NoReturn:
    """Receive every sequence after `after` into `got`, with the time it came."""
    async with handle.subscribe(after) as subscription:
        while True:
            record = await subscription.receive()
            got.append((record.seq, trio.current_time()))


async def drain(subscription: Subscription, got: list[int]) -> NoReturn:
    """Receive into `got` until `receive` raises."""
    while True:
        got.append((await subscription.receive()).seq)


async def consume_retrying(handle: LogHandle, after: int, until: int, got: list[int]) -> None:
    """`consume`, retrying a second later while the log cannot be read."""
    async with handle.subscribe(after) as subscription:
        while subscription.last < until:
            try:
                got.append((await subscription.receive()).seq)
            except Unavailable:
                await trio.sleep(1)


@pytest.fixture
def top_jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The log actor's supervisor draws its jitter at the top: each restart delay is exactly
    `Backoff().delay(failures)` (0.5, 1, 2, 4, 8 ... seconds)."""
    monkeypatch.setattr(log_actor, "supervise", partial(supervise, draw=lambda: 1.0))


@asynccontextmanager
async def open_log(store: MemoryStore, **options: float) -> AsyncIterator[LogHandle]:
    """The actor for the duration of the block (then cancelled)."""
    async with trio.open_nursery() as nursery:
        handle: LogHandle = await nursery.start(partial(run_log, store, **options))
        yield handle
        nursery.cancel_scope.cancel()


# --- (a) replay, then live ------------------------------------------------------------------


@pytest.mark.parametrize("queue_size", [1024, 8])
@pytest.mark.parametrize("latency", [0.0, 0.004], ids=["instant", "slow-store"])
async def test_subscribers_at_any_position_get_every_sequence_once_in_order(
    autojump_clock: trio.testing.MockClock, queue_size: int, latency: float
) -> None:
    # With a slow store, a replay's last page is behind the actor by the time it attaches:
    # the hand-over queues the missing records from the ring, or sends it back to replay.
    store = MemoryStore(latency=latency)
    head = await fill(store, 2 * PAGE + 200)  # a replay of several pages
    batches = [1, 3, 1, 7, 2, 1, 1, 5] * 20
    end = head + sum(batches)
    starts = [0, 1, head // 2, head - 1, head]
    got: dict[int, list[int]] = {start: [] for start in starts}
    late: list[int] = []
    async with open_log(store, queue_size=queue_size) as logs, trio.open_nursery() as nursery:
        nursery.start_soon(write, store, batches, 0.01)
        for start in starts:
            nursery.start_soon(consume, logs, start, end, got[start])
        await trio.sleep(0.5)  # a subscriber starting mid-stream, behind the live head
        middle = await store.log_head()
        nursery.start_soon(consume, logs, middle - 20, end, late)
    for start in starts:
        assert got[start] == list(range(start + 1, end + 1)), start
    assert late == list(range(middle - 19, end + 1))
    assert logs.statistics().dropped_slow == 0


async def test_a_subscriber_past_the_head_waits_for_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    await fill(store, 3)
    got: list[int] = []
    async with open_log(store) as logs, trio.open_nursery() as nursery:
        nursery.start_soon(consume, logs, 5, 7, got)
        await trio.testing.wait_all_tasks_blocked()
        await fill(store, 2)  # up to 5: nothing for it yet
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        await fill(store, 2)
    assert got == [6, 7]


async def test_queued_records_are_taken_without_waiting_in_order_and_a_drop_still_surfaces(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    head = await fill(store, 2)
    async with open_log(store, queue_size=8) as logs, logs.subscribe(head - 1) as subscription:
        assert (await subscription.receive()).seq == head  # attached live at the head
        with pytest.raises(trio.WouldBlock):
            subscription.receive_nowait()  # nothing queued: receive() is the way to wait
        await fill(store, 5)
        await trio.testing.wait_all_tasks_blocked()
        assert subscription.ready()
        # A plain call, so no checkpoint between records: a burst costs one scheduler pass.
        taken = [subscription.receive_nowait().seq for _ in range(5)]
        assert taken == list(range(head + 1, head + 6))
        assert subscription.last == head + 5
        assert not subscription.ready()
        with pytest.raises(trio.WouldBlock):
            subscription.receive_nowait()
        for _ in range(12):  # more than its queue holds: it is dropped as slow
            await fill(store, 1)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(8):
            subscription.receive_nowait()
        with pytest.raises(trio.WouldBlock):  # the drop is not a record ...
            subscription.receive_nowait()
        with pytest.raises(Lagged) as caught:  # ... and receive() says so
            await subscription.receive()
        assert caught.value.last_sequence == head + 13


class HeldReplay(MemoryStore):
    """A store whose read after `held` answers only once `release` is set: a replay's last
    page, read before later changes and delivered after the actor has read them."""

    def __init__(self, held: int) -> None:
        super().__init__()
        self.held = held
        self.release = trio.Event()
        self.reads: list[int] = []  # the position of every log read

    async def log_after(self, after_seq: int, limit: int) -> list[LogRecord]:
        records = await super().log_after(after_seq, limit)
        self.reads.append(after_seq)
        if after_seq == self.held:
            await self.release.wait()
        return records


@pytest.mark.parametrize(
    ("queue_size", "replays_on"),
    [(1024, False), (2, True)],  # the three missing records fit its queue, or they do not
    ids=["from-the-ring", "replay-on"],
)
async def test_a_subscriber_attaching_behind_the_actor_gets_the_missing_records(
    autojump_clock: trio.testing.MockClock, queue_size: int, replays_on: bool
) -> None:
    store = HeldReplay(held=5)
    await fill(store, 10)
    got: list[int] = []
    async with open_log(store, queue_size=queue_size) as logs, trio.open_nursery() as nursery:
        nursery.start_soon(consume, logs, 5, 14, got)
        await trio.testing.wait_all_tasks_blocked()  # its replay read 6..10, held
        await fill(store, 3)
        await trio.testing.wait_all_tasks_blocked()
        assert logs.statistics().head == 13  # the actor read 11..13 before the attach
        released = len(store.reads)
        store.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert got == list(range(6, 14))
        assert (10 in store.reads[released:]) is replays_on  # the next page, from the store
        await fill(store, 1)  # and live
    assert got == list(range(6, 15))


# --- (b) a slow subscriber is dropped --------------------------------------------------------


async def test_a_subscriber_that_does_not_read_is_dropped_and_resumes_from_lagged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    head = await fill(store, 10)
    fast: list[int] = []
    slow: list[int] = []
    resumed: list[int] = []
    async with open_log(store, queue_size=4) as logs, trio.open_nursery() as nursery:
        nursery.start_soon(consume, logs, head, head + 30, fast, 1024)
        async with logs.subscribe(head - 1) as lagging:
            slow.append((await lagging.receive()).seq)  # attached live at the head
            await trio.testing.wait_all_tasks_blocked()
            began = trio.current_time()
            for _ in range(30):
                await fill(store, 1)
            assert trio.current_time() == began  # the writer never waited for anyone
            await trio.testing.wait_all_tasks_blocked()
            assert logs.statistics().dropped_slow == 1
            with pytest.raises(Lagged) as caught:
                await drain(lagging, slow)
        last = caught.value.last_sequence
        assert slow == list(range(head, last + 1))
        assert last == head + 4  # what its queue held when it overflowed
        await consume(logs, last, head + 30, resumed)
    assert fast == list(range(head + 1, head + 31))
    assert resumed == list(range(last + 1, head + 31))
    assert logs.statistics().dropped_slow == 1


# --- (c) a lost LISTEN connection -------------------------------------------------------------


@pytest.mark.usefixtures("top_jitter")
async def test_the_actor_restarts_after_a_lost_listen_and_subscribers_resume(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    head = await fill(store, 5)
    end = head + 20
    got: dict[int, list[int]] = {0: [], head: []}
    async with open_log(store) as logs, trio.open_nursery() as nursery:
        for start in got:
            nursery.start_soon(consume, logs, start, end, got[start])
        await fill(store, 5)
        await trio.testing.wait_all_tasks_blocked()
        assert logs.statistics().connected
        assert store.break_listeners() == 1
        lost = trio.current_time()
        await fill(store, 5)  # while the actor is down
        await trio.testing.wait_all_tasks_blocked()
        assert not logs.statistics().connected
        await trio.sleep_until(lost + 0.49)
        assert not logs.statistics().connected
        await trio.sleep_until(lost + 0.5)  # the first restart waits Backoff().delay(1)
        await trio.testing.wait_all_tasks_blocked()
        assert logs.statistics().connected
        assert store.listeners == 1
        await fill(store, 10)
    for start, seqs in got.items():
        assert seqs == list(range(start + 1, end + 1))


@pytest.mark.usefixtures("top_jitter")
async def test_the_actor_retries_with_backoff_while_the_database_is_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    got: list[int] = []
    async with open_log(store) as logs, trio.open_nursery() as nursery:
        nursery.start_soon(consume_retrying, logs, 0, 12, got)
        await fill(store, 4)
        await trio.testing.wait_all_tasks_blocked()
        store.fail_reads = True  # nor can the listener be opened again
        store.break_listeners()
        lost = trio.current_time()
        await trio.sleep(10)
        store.fail_reads = False
        await fill(store, 8)
        # Failures at 0 (the break), 0.5, 1.5, 3.5 and 7.5; the next attempt is due at 15.5,
        # but the backoff asks every second whether the database answers again (8.5, 9.5:
        # no; 10.5: yes), so the actor is back within a second of the database.
        await trio.sleep_until(lost + 10.49)
        assert not logs.statistics().connected
        await trio.sleep_until(lost + 10.5)
        await trio.testing.wait_all_tasks_blocked()
        assert logs.statistics().connected
    assert got == list(range(1, 13))


# --- (d) the poll ----------------------------------------------------------------------------


async def test_a_lost_wakeup_is_read_after_poll_seconds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    got: list[tuple[int, float]] = []
    origin = trio.current_time()
    async with open_log(store, poll_seconds=5.0) as logs, trio.open_nursery() as nursery:
        nursery.start_soon(follow_timed, logs, 0, got)
        await trio.testing.wait_all_tasks_blocked()
        store.drop_wakeups = True
        await fill(store, 1)  # at 0, its NOTIFY lost
        await trio.sleep_until(origin + 4.99)
        assert got == []
        await trio.sleep_until(origin + 5.1)
        assert got == [(1, origin + 5.0)]  # the first poll
        store.drop_wakeups = False
        await fill(store, 1)  # at 5.1: woken at once
        await trio.testing.wait_all_tasks_blocked()
        assert got[-1] == (2, origin + 5.1)
        nursery.cancel_scope.cancel()


class NullSink:
    """A live subscription that takes everything and never ends."""

    capacity = 1024

    def deliver(self, batch: Batch) -> Delivery:
        return "ok"

    def disconnected(self) -> None:
        pass

    def gone(self) -> bool:
        return False


async def test_a_commit_is_read_at_once_while_attaches_fill_the_inbox(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Attaches and wakeups share the actor's bounded inbox. A burst of subscriptions that
    fills it must not leave a commit made meanwhile unread until the poll."""
    store = MemoryStore()
    head = await fill(store, 1)
    got: list[tuple[int, float]] = []
    origin = trio.current_time()
    async with open_log(store, poll_seconds=60.0) as logs, trio.open_nursery() as nursery:
        nursery.start_soon(follow_timed, logs, head, got)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(1100):  # more than the inbox holds
            nursery.start_soon(logs.attach, head, NullSink())
        await trio.lowlevel.checkpoint()  # they have sent theirs: the inbox is full
        await fill(store, 1)  # its wakeup finds no room
        await trio.sleep(1)
        assert got == [(head + 1, origin)]
        nursery.cancel_scope.cancel()


# --- (e) statistics --------------------------------------------------------------------------


async def test_statistics_follow_the_head_the_subscribers_and_the_drops(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    await fill(store, 3)
    async with open_log(store, queue_size=2) as logs:
        stats = logs.statistics()
        assert (stats.head, stats.subscribers, stats.dropped_slow) == (3, 0, 0)
        await trio.testing.wait_all_tasks_blocked()
        assert logs.statistics().connected
        async with logs.subscribe(2) as one, logs.subscribe(2) as two:
            assert (await one.receive()).seq == 3
            assert (await two.receive()).seq == 3
            assert logs.statistics().subscribers == 2
            await fill(store, 1)
            await trio.testing.wait_all_tasks_blocked()
            assert (await one.receive()).seq == 4  # `two` reads nothing from here on
            await fill(store, 2)  # `two` holds 4 and 5; 6 overflows its queue
            await trio.testing.wait_all_tasks_blocked()
            stats = logs.statistics()
            assert (stats.head, stats.subscribers, stats.dropped_slow) == (6, 1, 1)
            assert stats.records_read == 3  # since it started at 3
        await fill(store, 1)  # the closed subscription is noticed on the next record
        await trio.testing.wait_all_tasks_blocked()
        stats = logs.statistics()
        assert (stats.head, stats.subscribers, stats.dropped_slow) == (7, 0, 1)
        assert await logs.head() == 7


async def test_observers_see_every_batch_before_any_sink(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The caches drop what a record changed before the event's frame can be written: a
    # subscriber that reacts to an event reads the change.
    store = MemoryStore()
    observed: list[int] = []
    early: list[int] = []  # records a sink got before the observer had seen them

    class Recorder:
        capacity = 1000

        def deliver(self, batch: log_actor.Batch) -> log_actor.Delivery:
            early.extend(r.seq for r in batch.records if r.seq not in observed)
            return "ok"

        def disconnected(self) -> None:
            raise AssertionError("not in this test")

        def gone(self) -> bool:
            return False

    async with trio.open_nursery() as nursery:
        logs: LogHandle = await nursery.start(
            partial(run_log, store, observers=[lambda rs: observed.extend(r.seq for r in rs)])
        )
        assert await logs.attach(0, Recorder())
        for _ in range(20):
            await fill(store, 3)
            await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert observed == list(range(1, 61))
    assert early == []


async def test_a_replay_shows_records_the_actor_has_not_read_to_the_observers_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A subscription that replays a record committed a moment ago, before the actor read it:
    # the observers still see it before the subscriber does.
    store = MemoryStore()
    observed: list[int] = []
    async with trio.open_nursery() as nursery:
        logs: LogHandle = await nursery.start(
            partial(
                run_log,
                store,
                coalesce_seconds=1.0,
                observers=[lambda rs: observed.extend(r.seq for r in rs)],
            )
        )
        await fill(store, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert observed == [1]
        await fill(store, 1)  # the actor waits a second before it reads again
        async with logs.subscribe(1) as subscription:
            assert (await subscription.receive()).seq == 2
            assert observed[:2] == [1, 2]  # shown by the replay, not yet read by the actor
            assert logs.statistics().head == 1
        nursery.cancel_scope.cancel()


class _Ending:
    """A sink whose subscriber ends when the test says so."""

    capacity = 16

    def __init__(self) -> None:
        self.over = False

    def deliver(self, batch: log_actor.Batch) -> log_actor.Delivery:
        return "gone" if self.over else "ok"

    def disconnected(self) -> None:
        raise AssertionError("not in this test")

    def gone(self) -> bool:
        return self.over


async def test_ended_subscriptions_are_dropped_while_nothing_is_written(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A client may subscribe and end many times a second on a quiet log: no batch comes to
    # drop the ended sinks, so an attach and the poll do (each sink holds its socket).
    store = MemoryStore()
    async with open_log(store, poll_seconds=5.0) as logs:
        live = _Ending()
        assert await logs.attach(0, live)
        for _ in range(1000):
            ending = _Ending()
            assert await logs.attach(0, ending)
            ending.over = True
            assert logs.statistics().subscribers <= 2 + log_actor.PRUNE_FLOOR
        await trio.sleep(5.5)  # the poll reads nothing, and drops every ended sink
        assert logs.statistics().subscribers == 1
        await fill(store, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert logs.statistics().subscribers == 1  # the live one is still delivered to
        assert logs.statistics().head == 2


async def test_a_subscription_interrupted_as_it_attaches_leaves_no_sink_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Cancelled after the actor took its sink but before the answer came back: the sink must
    # read as gone, or a quiet log would keep it for good.
    store = MemoryStore()
    async with open_log(store, poll_seconds=5.0) as logs:
        attach = logs.attach

        async def attach_then_interrupted(after: int, sink: log_actor.Sink) -> bool:
            assert await attach(after, sink)
            raise RuntimeError("interrupted")

        logs.attach = attach_then_interrupted  # type: ignore[method-assign]
        async with logs.subscribe(0) as subscription:
            with pytest.raises(RuntimeError, match="interrupted"):
                await subscription.receive()
        assert logs.statistics().subscribers == 1
        await trio.sleep(5.5)  # the poll finds nothing to read and drops what has ended
        assert logs.statistics().subscribers == 0
