"""The checkpointer: extends the stored Merkle tree over the log and issues signed checkpoints.

Theory of operation. One checkpointer works per database: it takes the `transparency`
leadership (an advisory lock on a connection of its own, like anchoring), so several `registry
serve` processes share one tree. As leader it resumes from the newest stored checkpoint (the
partial tiles of its right edge are all the state it needs, a few KiB), checks that those tiles
still give that checkpoint's root, and then, every `checkpoint_seconds` while the log has grown:

1. reads the records after the tree's size up to the log head read first (commit order is
   sequence order, so every record up to that head is visible and none is skipped), in pages,
   and hashes each served record into a leaf (`registry.transparency.record_bytes`), a few
   milliseconds at a time between turns of the event loop (a worker thread would not run
   meanwhile anyway, for the GIL, and would give the heap an arena of its own);
2. signs a checkpoint of the new size with the registry's key, and stores the changed tiles and
   the checkpoint in one transaction (`store_checkpoint`). A checkpoint is visible only with
   every tile of its tree, and a crash in between loses nothing that was served.

A step takes at most `MAX_STEP` records, so after a long outage the tree catches up in bounded
transactions. Losing the leadership, or finding a newer checkpoint than its own (a stale
leader), ends the run; the supervisor restarts it and it competes for the lock again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial

import trio

from actors.supervisor import while_leading
from registry.changes import LogRecord
from registry.errors import Invalid, Unavailable
from registry.keys import SigningKey
from registry.store import TransparencyStore
from registry.transparency import (
    EMPTY_ROOT,
    StoredCheckpoint,
    TreeBuilder,
    checkpoint_note,
    leaves_of,
)

log = logging.getLogger(__name__)

LEADERSHIP = "transparency"
PAGE = 2000  # records read at a time
HASH_CHUNK = 200  # records hashed between two turns of the event loop (about 3 ms)
MAX_STEP = 200_000  # records one checkpoint may add


@dataclass
class TransparencyHandle:
    """What the checkpointer has done (read by metrics and tests)."""

    leader: bool = False
    latest: StoredCheckpoint | None = None
    issued: int = 0
    records_hashed: int = 0
    wakeup: trio.Event = field(default_factory=trio.Event)  # set: look at the log now
    issued_event: trio.Event = field(default_factory=trio.Event)  # set at each checkpoint

    async def checkpointed(self, size: int) -> StoredCheckpoint:
        """Wait until a checkpoint of at least `size` records is issued (asks for it now)."""
        while self.latest is None or self.latest.size < size:
            self.wakeup.set()
            await self.issued_event.wait()
        return self.latest


async def run_checkpointer(
    store: TransparencyStore,
    key: SigningKey,
    origin: str,
    *,
    every_seconds: float,
    handle: TransparencyHandle,
) -> None:
    """Checkpoint until cancelled (run it under `supervise`: a lost database or leadership
    ends a run with `Unavailable`)."""
    try:
        async with store.leadership(LEADERSHIP) as leadership:
            handle.leader = True
            log.info("transparency: this process issues the log's checkpoints")
            await while_leading(
                leadership, partial(_checkpoint_loop, store, key, origin, every_seconds, handle)
            )
    finally:
        handle.leader = False


async def resume(store: TransparencyStore) -> tuple[TreeBuilder, StoredCheckpoint | None]:
    """A builder at the newest stored checkpoint, checked against its root."""
    latest = await store.latest_checkpoint()
    size = 0 if latest is None else latest.size
    keys = TreeBuilder.edge_tiles(size)
    tiles = await store.tree_tiles(keys)
    try:
        builder = TreeBuilder(size, {level: tiles[(level, idx)] for level, idx in keys})
        intact = latest is None or builder.root() == latest.root
    except (KeyError, ValueError, LookupError):
        intact = False
    if not intact:
        # Not this process's to repair: say so loudly and keep trying (the supervisor's
        # backoff), while the rest of the service runs; the proofs of what is stored still hold.
        log.error("transparency: the stored tiles do not give checkpoint %d's root", size)
        raise Unavailable(
            f"the stored tree does not give checkpoint {size}'s root: it was altered",
            code="log_tree_altered",
        )
    return builder, latest


async def _checkpoint_loop(
    store: TransparencyStore,
    key: SigningKey,
    origin: str,
    every_seconds: float,
    handle: TransparencyHandle,
) -> None:
    builder, latest = await resume(store)
    if latest is None:  # a new log: the empty tree's checkpoint, so there is always one
        latest = await _issue(store, key, origin, builder, handle)
    handle.latest = latest
    while True:
        head = await store.log_head()
        if head > builder.size:
            target = min(head, builder.size + MAX_STEP)
            while builder.size < target:
                records = await store.log_records(builder.size, min(PAGE, target - builder.size))
                if not records or records[0][0].seq != builder.size + 1:
                    raise Unavailable("the log has a gap below its head", code="log_gap")
                for start in range(0, len(records), HASH_CHUNK):
                    for leaf in _leaves(records[start : start + HASH_CHUNK]):
                        builder.append(leaf)
                    await trio.lowlevel.checkpoint()  # the event loop runs between chunks
                handle.records_hashed += len(records)
            handle.latest = await _issue(store, key, origin, builder, handle)
            if builder.size < head:
                continue  # more waits: no pause between bounded steps
        with trio.move_on_after(every_seconds):
            await handle.wakeup.wait()
        handle.wakeup = trio.Event()


def _leaves(records: list[tuple[LogRecord, str | None]]) -> list[bytes]:
    """The records' leaves; a record with no JCS form (an integer beyond 2^53-1 that an older
    release let into its data) has none, and stops the tree before it with a known failure:
    the supervisor retries with backoff and says so in the log, while the service runs."""
    try:
        return leaves_of(records)
    except Invalid as exc:
        for record, digest in records:
            try:
                leaves_of([(record, digest)])
            except Invalid:
                break
        raise Unavailable(
            f"log record {record.seq} has no JCS form ({exc.message}): the tree stops before it",
            code="log_record_unhashable",
        ) from None


async def _issue(
    store: TransparencyStore,
    key: SigningKey,
    origin: str,
    builder: TreeBuilder,
    handle: TransparencyHandle,
) -> StoredCheckpoint:
    tree_root = builder.root() if builder.size else EMPTY_ROOT
    checkpoint = StoredCheckpoint(
        builder.size, tree_root, checkpoint_note(origin, builder.size, tree_root, key), 0
    )
    if not await store.store_checkpoint(builder.take_tiles(), checkpoint):
        raise Unavailable(
            "a newer checkpoint is stored: another process issues them",
            code="checkpoint_superseded",
        )
    handle.issued += 1
    handle.latest = checkpoint
    handle.issued_event.set()
    handle.issued_event = trio.Event()
    return checkpoint
