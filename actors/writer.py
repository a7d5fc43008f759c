"""The writer actor: group commit of every change, through the one append path.

Theory of operation: use-cases call `Writer.append(change, idem)`, which queues the change with
a one-shot reply (an event and its result) and waits. The actor's task takes every change queued
at that moment (up to `max_batch`), applies them with one `Store.append` call (one round trip,
one transaction, one commit) and answers each caller with its own `Outcome`. When the service is
idle a batch is a single change and nothing waits longer than before; under load the per-change
cost of crossing into asyncpg, committing and holding the log head is shared by the batch.

Failures: a refusal of one change (entry exists, sequence conflict, ...) is that caller's outcome
only. If the batch fails because the database refused a value (`Invalid`, e.g. a character it
cannot store), the changes are applied again one by one, so only the offending caller gets the
error. If the batch fails with another known error (database down), every caller of the batch
gets that error and the actor goes on with the next batch; when the database did not answer
in time (`database_timeout`: a lock held on the log head, a database that stopped answering),
the changes queued meanwhile get it too, untried, rather than each wait out the deadline again
behind one another (a full queue would have waited minutes). Anything else (a bug, or a limit no
check foresaw) is found like a refused value and is its caller's 500, logged with its traceback:
the actor goes on, where ending it would end every later write and the process with them. If
the actor is cancelled (shutdown) mid-batch, its callers are told the write was interrupted: the
batch may or may not have committed, exactly as for a request cut off by a crash, and the
idempotency key makes the retry safe. A caller that gave up (cancelled) is
skipped when its answer comes. Closing every handle's send side stops the actor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from registry.changes import Change, IdemKey, Outcome
from registry.errors import Invalid, RegistryError, Unavailable
from registry.histogram import Histogram
from registry.outage import ConditionLog
from registry.store import LogStore

log = logging.getLogger(__name__)

# Handlers enqueue without a rendezvous (they are many and each waits for its own reply); the
# bound applies backpressure to request handlers beyond it.
BUFFER = 1024


class _Reply:
    """A caller's answer: given once by the actor, awaited by the caller (lighter than a
    channel pair per append). A caller that gave up (cancelled) leaves it unread; its outcome
    stays recorded under its idempotency key."""

    __slots__ = ("_given", "result")

    def __init__(self) -> None:
        self._given = trio.Event()
        self.result: Outcome | RegistryError | None = None

    def give(self, result: Outcome | RegistryError) -> None:
        if not self._given.is_set():
            self.result = result
            self._given.set()

    async def wait(self) -> Outcome | RegistryError:
        await self._given.wait()
        assert self.result is not None
        return self.result


@dataclass(frozen=True)
class _Append:
    change: Change
    idem: IdemKey | None
    reply: _Reply


BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class WriterStats:
    sizes: Histogram = field(default_factory=lambda: Histogram(BATCH_SIZE_BUCKETS))  # changes
    batches: int = 0
    changes: int = 0
    largest_batch: int = 0
    refused: str | None = None  # the condition of the last batch, if the database refused it
    outage: ConditionLog = field(default_factory=lambda: ConditionLog("writes"))


class Writer:
    """The handle of the writer actor."""

    def __init__(self, send: trio.MemorySendChannel[_Append], stats: WriterStats) -> None:
        self._send = send
        self._stats = stats

    async def append(self, change: Change, idem: IdemKey | None) -> Outcome:
        """Append `change` in the next batch; the `registry.changes.Append` contract."""
        reply = _Reply()
        await self._send.send(_Append(change, idem, reply))
        result = await reply.wait()
        if isinstance(result, RegistryError):
            raise result
        return result

    def clone(self) -> Writer:
        return Writer(self._send.clone(), self._stats)

    async def aclose(self) -> None:
        await self._send.aclose()

    def condition(self) -> str | None:
        """Why the last batch failed (`database_full`, `database_read_only`, ...), until one
        succeeds; None while writes succeed."""
        return self._stats.refused

    def batch_sizes(self) -> Histogram:
        """Changes per committed batch."""
        return self._stats.sizes

    def statistics(self) -> dict[str, int]:
        return {
            "batches": self._stats.batches,
            "changes": self._stats.changes,
            "largest_batch": self._stats.largest_batch,
            "queued": self._send.statistics().current_buffer_used,
        }


async def run_writer(
    store: LogStore,
    *,
    max_batch: int = 64,
    task_status: trio.TaskStatus[Writer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The actor's task: write batches until every handle is closed (or cancelled)."""
    send, receive = trio.open_memory_channel[_Append](BUFFER)
    stats = WriterStats()
    async with receive:
        task_status.started(Writer(send, stats))
        try:
            async for first in receive:
                batch = [first]
                while len(batch) < max_batch:
                    try:
                        batch.append(receive.receive_nowait())
                    except trio.WouldBlock:
                        break
                failed = await _write_batch(store, batch, stats)
                if failed is not None and failed.code == "database_timeout":
                    for item in _queued(receive):  # untried: nothing of theirs was written
                        item.reply.give(failed)
        except BaseException:  # stopped: what is still queued was never written
            _interrupted(_queued(receive))
            raise


def _queued(receive: trio.MemoryReceiveChannel[_Append]) -> list[_Append]:
    queued = []
    while True:
        try:
            queued.append(receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return queued


async def _one_by_one(
    store: LogStore, batch: list[_Append], stats: WriterStats, exc: Exception
) -> None:
    """The batch failed for one of its changes, not for the database's condition: alone, the
    change is its caller's answer; in a batch, each change is applied on its own so that one
    bad change does not fail the others."""
    if len(batch) == 1:
        batch[0].reply.give(_answer_of(exc, batch[0]))
        return
    try:
        for item in batch:
            await _write_batch(store, [item], stats)
    except BaseException:  # cancelled midway: those not yet answered are told (`give` keeps
        _interrupted(batch)  # an answer already given)
        raise


def _answer_of(exc: Exception, item: _Append) -> RegistryError:
    """A change's error for its caller. What the storage seam does not know (registry/store/
    pg.py `condition_of`: a bug, or a limit no check foresaw) is that request's 500, logged with
    its traceback, and never the end of the actor (and of the process with it)."""
    if isinstance(exc, RegistryError):
        return exc
    log.error("a write failed (%s of %s)", item.change.kind, item.change.subject, exc_info=exc)
    return RegistryError("internal server error")


def _interrupted(batch: list[_Append]) -> None:
    interrupted = Unavailable("the write was interrupted", code="write_interrupted")
    for item in batch:
        item.reply.give(interrupted)


async def _write_batch(
    store: LogStore, batch: list[_Append], stats: WriterStats
) -> Unavailable | None:
    """Apply the batch and answer its callers; the condition of the database that failed it
    whole, if one did."""
    try:
        outcomes = await store.append([(item.change, item.idem) for item in batch])
    except Invalid as exc:
        await _one_by_one(store, batch, stats, exc)
        return None
    except RegistryError as exc:
        for item in batch:
            item.reply.give(exc)
        if isinstance(exc, Unavailable):  # a condition of the database: health reports it
            stats.refused = exc.code
            line = stats.outage.failed(exc.code, trio.current_time())
            if line is not None:
                log.warning(line)
            return exc
        return None
    except Exception as exc:  # its caller's 500 (`_answer_of`)
        await _one_by_one(store, batch, stats, exc)
        return None
    except BaseException:
        _interrupted(batch)
        raise
    for item, outcome in zip(batch, outcomes, strict=True):
        item.reply.give(outcome)
    if stats.refused is not None:
        stats.refused = None
        line = stats.outage.succeeded(trio.current_time())
        if line is not None:
            log.info(line)
    stats.batches += 1
    stats.changes += len(batch)
    stats.largest_batch = max(stats.largest_batch, len(batch))
    stats.sizes.observe(len(batch))
    return None
