"""The entry writer actor: group commit of entry changes.

Theory of operation: request handlers call `EntryWriter.write(change, idem)`, which queues the
change with a one-shot reply and waits. The actor's task takes every change queued at that moment
(up to `max_batch`), applies them with one `Store.write_entries` call — one round trip, one
transaction, one commit — and answers each caller with its own outcome. When the service is idle
a batch is a single change and nothing waits longer than before; under load the per-change cost
of crossing into asyncpg, committing and holding the log head is shared by the batch.

Failures: a domain refusal of one change (entry exists, sequence conflict, ...) is that caller's
error only. If the batch itself fails (database down), every caller of the batch gets that
error; the actor goes on with the next batch. If the actor is cancelled (shutdown) mid-batch,
its callers are told the service is unavailable: the batch may or may not have committed,
exactly as for a request cut off by a crash, and the idempotency key makes the retry safe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from registry.errors import RegistryError, Unavailable
from registry.store import EntryWrite, IdemKey, Store, WriteOutcome

log = logging.getLogger(__name__)

# Handlers enqueue without a rendezvous; the bound applies backpressure beyond it.
BUFFER = 1024


@dataclass
class _Pending:
    write: EntryWrite
    idem: IdemKey | None
    done: trio.Event = field(default_factory=trio.Event)
    outcome: WriteOutcome | None = None
    error: BaseException | None = None


class EntryWriter:
    def __init__(self, store: Store, *, max_batch: int = 64) -> None:
        self._store = store
        self._max_batch = max_batch
        self._send, self._receive = trio.open_memory_channel[_Pending](BUFFER)
        self._batches = 0
        self._writes = 0
        self._largest = 0

    async def write(
        self, write: EntryWrite, idem: IdemKey | None
    ) -> tuple[int | None, str, int | None]:
        """Same contract as `Store.write_entry`: (seq, doc, None) or (None, response, status)."""
        pending = _Pending(write, idem)
        await self._send.send(pending)
        await pending.done.wait()
        if pending.error is not None:
            raise pending.error
        assert pending.outcome is not None
        return pending.outcome.result()

    async def run(self) -> None:
        """The actor's task: write batches until cancelled."""
        async for first in self._receive:
            batch = [first]
            while len(batch) < self._max_batch:
                try:
                    batch.append(self._receive.receive_nowait())
                except trio.WouldBlock:
                    break
            await self._write_batch(batch)

    async def _write_batch(self, batch: list[_Pending]) -> None:
        try:
            outcomes = await self._store.write_entries([(p.write, p.idem) for p in batch])
        except RegistryError as exc:
            for pending in batch:
                pending.error = exc
        except BaseException:
            for pending in batch:
                pending.error = Unavailable("the write was interrupted", code="write_interrupted")
            raise
        else:
            for pending, outcome in zip(batch, outcomes, strict=True):
                pending.outcome = outcome
            self._batches += 1
            self._writes += len(batch)
            self._largest = max(self._largest, len(batch))
        finally:
            for pending in batch:
                pending.done.set()

    def statistics(self) -> dict[str, int]:
        return {
            "batches": self._batches,
            "writes": self._writes,
            "largest_batch": self._largest,
            "queued": self._receive.statistics().current_buffer_used,
        }
