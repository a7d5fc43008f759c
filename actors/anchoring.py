"""The anchoring supervisor: pending intents → Merkle batches → the chain → receipts → finality.

Theory of operation. One supervisor works per database: it first takes the `anchoring`
leadership (a PostgreSQL advisory lock on a connection of its own), so several `registry serve`
processes can share a database and only one anchors; if that connection is lost, the run ends
(`Unavailable`) and the supervisor restarts, competing for the lock again. As leader it loops:

1. **Resume** the open batches (claimed or submitted) from the store — after a crash, the
   batches a previous run left are finished, never claimed again.
2. **Claim** a batch while fewer than `batches_in_flight` are open: one change of the append
   path moves up to `batch_size` available pending intents to `submitted` under a new batch id
   (the claim's log position). With batches already open, a new one is claimed right away only
   if the last claim was full (more work waits), else once a block interval after it: each
   block then carries what arrived meanwhile, never a crowd of tiny batches.
3. **Submit** the batch's Merkle root (registry/merkle.py over the members' leaves, in sequence
   order) with the batch id as the chain's idempotency key, then record the transaction id. A
   crash between the two re-submits under the same key and gets the same transaction.
4. **Poll** the transaction; `registry.anchoring.settle` decides: final and carrying this root →
   one change marks the members `confirmed` (their entries read `anchored`), with one
   `anchor.updated` event per intent; dropped or re-orged → back to `pending` after a jittered
   backoff, or `failed` once `max_attempts` submissions were used.

Steps 3 and 4 run for every open batch, oldest first, so several batches wait for finality at
once: with blocks every 2 s and finality depth 3 a batch takes about 8 s, and one batch at a time
would anchor at most `batch_size` intents per 8 s.

Every intent state change is a change of the one append path, compare-and-set on the intents'
states: an admin who abandons an intent meanwhile makes the settle `Retry`, and the next loop
reads the open batches again and settles that one without it. Chain RPC failures and database
outages back off with jitter.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import trio

from actors.supervisor import while_leading
from registry.anchoring import (
    ChainStatus,
    Member,
    Settlement,
    chain_answer_problem,
    entry_state,
    settle,
    tree_of,
)
from registry.chain import Chain, ChainUnavailable
from registry.changes import RETRY, Also, Change, IdemKey, Outcome
from registry.config import AnchoringConfig
from registry.errors import Unavailable
from registry.histogram import Histogram
from registry.merkle import MerkleTree
from registry.outage import ConditionLog
from registry.ratelimit import Backoff
from registry.store import AnchorStore, OpenBatch

log = logging.getLogger(__name__)

Append = Callable[[Change, IdemKey | None], Awaitable[Outcome]]
BACKOFF = Backoff(initial=0.5, maximum=30.0)
TREE_IN_THREAD = 2048  # leaves above which a batch's tree is built off the event loop
BACKFILL_PAGE = 100  # batches without a stored tree read at once
LEADERSHIP = "anchoring"
# The longest a chain call may take: one that has not answered by then is a failed call (a hung
# RPC would otherwise hold every batch and every claim behind it for good).
CHAIN_CALL_SECONDS = 30.0


BACKLOG_READ_SECONDS = 5.0
FINALITY_BUCKETS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


@dataclass
class AnchoringStats:
    """What the supervisor has done (read by health checks and tests)."""

    leader: bool = False
    trees_backfilled: int = 0  # trees stored for batches submitted before migration 0025
    batches: int = 0
    confirmed: int = 0
    requeued: int = 0
    failed: int = 0
    chain_errors: int = 0
    last_error: str | None = None
    # The backlog as the leader last read it (every BACKLOG_READ_SECONDS), and its batches.
    pending: int = 0
    oldest_pending_ms: int | None = None
    in_flight: int = 0
    # Seconds from a batch's claim to its confirmation.
    finality: Histogram = field(default_factory=lambda: Histogram(FINALITY_BUCKETS))


class AnchoringHandle:
    """The supervisor's handle, which outlives its restarts: statistics, and a nudge when new
    intents may be pending (an entry version was written, an admin requeued one)."""

    def __init__(self) -> None:
        self.stats = AnchoringStats()
        self.wake = trio.Event()
        self.trees_backfilled = trio.Event()  # set once a leader has stored the old trees

    def nudge(self) -> None:
        self.wake.set()


async def run_anchoring(
    store: AnchorStore,
    append: Append,
    chain: Chain,
    config: AnchoringConfig,
    *,
    handle: AnchoringHandle,
    clock_ms: Callable[[], int],
    rand: Callable[[], float] = random.random,
) -> None:
    """Anchor until cancelled (run it under `supervise`: a lost database or leadership ends a
    run with `Unavailable`)."""
    stats = handle.stats
    supervisor = _Supervisor(store, append, chain, config, clock_ms, rand, handle)
    try:
        async with store.leadership(LEADERSHIP) as leadership:
            stats.leader = True
            log.info("anchoring: this process is the anchoring leader")
            await while_leading(leadership, supervisor.lead)
    finally:
        stats.leader = False


class _Supervisor:
    def __init__(
        self,
        store: AnchorStore,
        append: Append,
        chain: Chain,
        config: AnchoringConfig,
        clock_ms: Callable[[], int],
        rand: Callable[[], float],
        handle: AnchoringHandle,
    ) -> None:
        self.store = store
        self.append = append
        self.chain = chain
        self.config = config
        self.clock_ms = clock_ms
        self.rand = rand
        self.handle = handle
        self.stats = handle.stats
        # The open batches and their trees, by batch id, kept between polls; read from the
        # store again when `loaded` is False (at the start, and after an intent moved).
        self.open: dict[int, tuple[OpenBatch, MerkleTree]] = {}
        self.loaded = False
        self.last_claim_at = -math.inf  # trio.current_time() of the last claim
        self.claimed_at: dict[int, int] = {}  # batch id → clock_ms() of its claim (this run)
        self.backlog_read_at = -math.inf
        self.last_claim_full = False
        # Chain calls failing for some batches while others answer (logged as one condition).
        self.failing = ConditionLog("anchoring: chain calls of some batches")
        # How long to wait before polling a submitted batch again: a fraction of a block.
        self.poll_seconds = min(config.block_interval_seconds / 4, 1.0)

    async def lead(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.backfill_trees)
            await self.loop()
            nursery.cancel_scope.cancel()

    async def backfill_trees(self) -> None:
        """Store the tree of every batch submitted before trees were stored (migration 0025),
        so that no read rebuilds one: once per batch, oldest first, each rebuilt from its
        members and stored only if it leads to the batch's recorded root."""
        after = 0
        while True:
            batches = await self.store.batches_without_tree(after, BACKFILL_PAGE)
            if not batches:
                self.handle.trees_backfilled.set()
                return
            for batch_id, root in batches:
                after = batch_id
                members = await self.store.anchor_batch_members(batch_id)
                if not members:
                    continue
                tree = await self.tree_of(members)
                if tree.root != root:
                    log.error("anchoring: batch %s: its members do not lead to its root", batch_id)
                    continue
                await self.store.store_anchor_tree(batch_id, await self.levels(tree), len(tree))
                self.stats.trees_backfilled += 1

    async def loop(self) -> None:
        failures = 0
        while True:
            try:
                busy = await self.step()
                failures = 0
            except ChainUnavailable as exc:
                failures += 1
                self.stats.chain_errors += 1
                self.stats.last_error = f"chain: {exc}"
                delay = BACKOFF.jittered(failures, self.rand())
                log.warning("anchoring: chain unavailable (%s); retry in %.1fs", exc, delay)
                await trio.sleep(delay)
                continue
            if busy:
                await trio.lowlevel.checkpoint()
                continue
            with trio.move_on_after(self.idle_seconds()):
                await self.handle.wake.wait()
            self.handle.wake = trio.Event()

    def idle_seconds(self) -> float:
        """Nothing to do now: wait for a nudge, or a while (a batch waiting for blocks is
        polled a few times per block; with nothing open, pending work is looked for as often,
        by a plain read, and claimed only when there is some)."""
        interval = self.config.block_interval_seconds
        return max(self.poll_seconds, 0.05) if interval else 0.05

    async def step(self) -> bool:
        """One move of every open batch, then a new claim if one is due; False when there was
        nothing to do now (waiting for blocks or for intents)."""
        if not self.loaded:
            for batch in await self.store.open_anchor_batches():
                if batch.batch_id not in self.open:
                    self.open[batch.batch_id] = (batch, await self.tree(batch))
            self.loaded = True
        busy = False
        # A chain call failed for one batch does not hold the others back: each batch goes on,
        # and so does the claim unless a submission failed (the chain takes no transaction
        # now); only when no call got an answer is the chain unavailable.
        failed: list[ChainUnavailable] = []
        answered = unsent = False
        for batch_id in sorted(self.open):  # oldest first
            held = self.open.get(batch_id)
            if held is not None:
                try:
                    busy = await self.advance(*held) or busy
                    answered = True
                except ChainUnavailable as exc:
                    failed.append(exc)
                    unsent = unsent or self.open[batch_id][0].transaction_id is None
        # (After a refused settle, a claim waits for the batches to be read again.)
        if not unsent and self.loaded and self.may_claim():
            try:
                claimed = await self.claim()
                busy = claimed or busy
                answered = answered or claimed
            except ChainUnavailable as exc:
                failed.append(exc)
        self.stats.in_flight = len(self.open)
        if failed:
            self.stats.chain_errors += len(failed) - (0 if answered else 1)
            if not answered:
                raise failed[0]  # counted by the loop, which backs off
            self.stats.last_error = f"chain: {failed[-1]}"
            # A transaction that keeps failing is polled every round: a line a minute at most.
            line = self.failing.failed(f"chain unavailable ({failed[-1]})", trio.current_time())
        else:
            line = self.failing.succeeded(trio.current_time())
        if line is not None:
            log.warning("%s", line)
        if trio.current_time() - self.backlog_read_at >= BACKLOG_READ_SECONDS:
            self.backlog_read_at = trio.current_time()
            backlog = await self.store.anchoring_overview(0)
            self.stats.pending = backlog.pending
            self.stats.oldest_pending_ms = backlog.oldest_pending_ms
        return busy

    def may_claim(self) -> bool:
        if not self.open:
            return True
        if len(self.open) >= self.config.batches_in_flight:
            return False
        waited = trio.current_time() - self.last_claim_at
        return self.last_claim_full or waited >= self.config.block_interval_seconds

    async def claim(self) -> bool:
        """Claim a batch of the pending intents and submit it; False if there were none."""
        now = self.clock_ms()
        if not await self.store.anchor_pending(now):
            return False  # a plain read: claims (which take the log lock) only when there is work
        outcome = await self.append(
            Change(
                "anchor.claimed",
                None,
                {"batchSize": self.config.batch_size, "availableAtMs": now},
            ),
            None,
        )
        if outcome.refusal is not None or outcome.sequence is None:
            return False  # nothing pending
        members = [Member(*m) for m in json.loads(outcome.unwrap())]
        self.stats.batches += 1
        self.claimed_at[outcome.sequence] = now
        self.last_claim_at = trio.current_time()
        self.last_claim_full = len(members) >= self.config.batch_size
        batch = OpenBatch(outcome.sequence, None, None, tuple((m, "submitted") for m in members))
        await self.advance(batch, await self.tree(batch))
        return True

    async def tree(self, batch: OpenBatch) -> MerkleTree:
        """The batch's tree; a large one is built in a worker thread, so that a leader that
        also serves requests does not stall them while it hashes."""
        return await self.tree_of([m for m, _ in batch.members])

    async def tree_of(self, members: list[Member]) -> MerkleTree:
        if len(members) <= TREE_IN_THREAD:
            return tree_of(members)
        return await trio.to_thread.run_sync(tree_of, members)

    async def levels(self, tree: MerkleTree) -> bytes:
        """The tree as stored with its root, so that reads slice proofs out of it instead of
        building it; off the event loop for a large tree, as the tree itself."""
        if len(tree) <= TREE_IN_THREAD:
            return tree.packed_levels()
        return await trio.to_thread.run_sync(tree.packed_levels)

    async def advance(self, batch: OpenBatch, tree: MerkleTree) -> bool:
        """Submit the batch if it is not yet, poll it, and settle it once the chain decides.
        The batch and its tree are kept between polls (`open`), and dropped when it is
        settled or its intents moved (then the open batches are read again)."""
        self.open[batch.batch_id] = (batch, tree)
        live = [m for m, state in batch.members if state == "submitted"]
        tx_id = batch.transaction_id
        if tx_id is None:
            # The key names the batch and its root: idempotent for this batch, and never
            # confused with another database's batch of the same number on a shared chain.
            key = f"batch-{batch.batch_id}-{tree.root[:16]}"
            tx_id = await self.submit(tree.root, key)
            await self.store.record_anchor_submission(
                batch.batch_id, tree.root, tx_id, await self.levels(tree), len(tree)
            )
            batch = replace(batch, root=tree.root, transaction_id=tx_id)
            self.open[batch.batch_id] = (batch, tree)
        status = await self.status(tx_id)
        decision = settle(
            live,
            tree.root,
            status,
            finality_depth=self.config.finality_depth,
            max_attempts=self.config.max_attempts,
            now_ms=self.clock_ms(),
            rand=self.rand(),
        )
        if decision is None:
            return self.config.block_interval_seconds == 0  # instant blocks: poll again now
        outcome = await self.append(self.settle_change(batch.batch_id, live, decision), None)
        del self.open[batch.batch_id]
        if outcome.refusal is not None:
            if outcome.refusal.kind == RETRY:
                self.loaded = False  # an intent moved meanwhile: read the batches again
                return True
            raise Unavailable(f"anchoring: settle refused: {outcome.refusal.message}")
        claimed = self.claimed_at.pop(batch.batch_id, None)
        if decision.outcome == "confirmed":
            self.stats.confirmed += len(live)
            if claimed is not None:
                self.stats.finality.observe((self.clock_ms() - claimed) / 1000)
        else:
            self.stats.requeued += len(decision.pending)
            self.stats.failed += len(decision.failed)
        return True

    async def submit(self, root: str, key: str) -> str:
        """The chain's `submit`, within CHAIN_CALL_SECONDS, answering a transaction id (a call
        that hangs or answers anything else is `ChainUnavailable`: retried under the same key,
        it gets the same transaction)."""
        with trio.move_on_after(CHAIN_CALL_SECONDS):
            tx_id: object = await self.chain.submit(root, key=key)
            if not isinstance(tx_id, str) or not tx_id:
                raise ChainUnavailable(f"submit answered {tx_id!r}, not a transaction id")
            return tx_id
        raise ChainUnavailable(f"submit did not answer within {CHAIN_CALL_SECONDS:g}s")

    async def status(self, tx_id: str) -> ChainStatus:
        """The chain's `status`, within CHAIN_CALL_SECONDS, and one the port allows
        (`chain_answer_problem`); else `ChainUnavailable`, and the batch is polled again."""
        with trio.move_on_after(CHAIN_CALL_SECONDS):
            status: object = await self.chain.status(tx_id)
            problem = chain_answer_problem(status)
            if problem is not None:
                raise ChainUnavailable(f"status answered {problem}")
            assert isinstance(status, ChainStatus)
            return status
        raise ChainUnavailable(f"status did not answer within {CHAIN_CALL_SECONDS:g}s")

    def settle_change(self, batch_id: int, live: list[Member], s: Settlement) -> Change:
        rows: dict[str, object] = {
            "batchId": batch_id,
            "intents": [m.intent_id for m in live],
            "outcome": s.outcome,
        }
        also: list[Also] = []
        if s.outcome == "confirmed":
            rows.update(
                blockHeight=s.block_height, blockHash=s.block_hash, anchorTimeMs=s.anchor_time_ms
            )
            states = dict.fromkeys((m.intent_id for m in live), "confirmed")
        else:
            rows.update(
                pending=list(s.pending), failed=list(s.failed), availableAtMs=s.available_at_ms
            )
            states = {**dict.fromkeys(s.pending, "pending"), **dict.fromkeys(s.failed, "failed")}
        if s.outcome == "confirmed":  # the common case, 100,000 at a time: one shape
            anchored, height = entry_state("confirmed"), s.block_height
            also = [
                Also(
                    "anchor.updated",
                    m.entry_did,
                    {
                        "intentId": m.intent_id,
                        "sequence": m.sequence,
                        "state": "confirmed",
                        "anchorState": anchored,
                        "blockHeight": height,
                    },
                )
                for m in live
            ]
        else:
            for m in live:
                state = states[m.intent_id]
                event: dict[str, object] = {
                    "intentId": m.intent_id,
                    "sequence": m.sequence,
                    "state": state,
                    "anchorState": entry_state(state),
                }
                also.append(Also("anchor.updated", m.entry_did, event))
        return Change(
            "anchor.settled",
            None,
            rows,
            event={"batchId": batch_id, "outcome": s.outcome, "intents": len(live)},
            also=tuple(also),
        )
