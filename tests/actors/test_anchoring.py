"""The anchoring supervisor over the in-memory store and the local chain, on virtual time:
intents end confirmed with proofs that verify against the roots the chain holds, in batches,
only once final; every chain fault (drop, delay, re-org, RPC errors), admin abandon and retry,
crashes at every step of a batch, and a second supervisor taking over a lost leadership."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from actors.anchoring import AnchoringHandle, run_anchoring
from actors.chain import LocalChainClient, run_local_chain
from actors.supervisor import SupervisorStats, supervise
from registry.anchoring import ChainStatus, with_anchor_state
from registry.chain import Chain, ChainUnavailable, LocalChain
from registry.changes import Change, IdemKey, LogRecord, Outcome, Refusal
from registry.config import AnchoringConfig
from registry.errors import Unavailable
from registry.merkle import MerkleTree, leaf_hash, verify_proof
from registry.store import IntentRow
from registry.store.memory import MemoryStore
from registry.usecases.entries import entry_change

_names = itertools.count()
RAND = 0.5  # every jitter draw: backoffs are exact (3/4 of their base delay)


def now_ms() -> int:
    return round(trio.current_time() * 1000)


@dataclass(frozen=True)
class Intent:
    intent_id: str
    did: str
    sequence: int
    item_data_hash: str


async def publish(store: MemoryStore, count: int) -> list[Intent]:
    """Append `count` entry creations, each recording its anchor intent."""
    made = []
    for _ in range(count):
        did = f"did:web:agents.example:{next(_names)}"
        digest = hashlib.sha256(did.encode()).hexdigest()
        change = entry_change(
            "entry.created",
            did=did,
            expected_head=None,
            publisher="did:web:publisher.example",
            entry_type="AgentDefinition",
            lifecycle="active",
            prefix=f'{{"anchorState":"pending","entryDid":"{did}","sequence":',
            suffix="}",
            item_data_hash=digest,
        )
        made.append((did, digest, change))
    outcomes = await store.append([(change, None) for _, _, change in made])
    intents = []
    for (did, digest, _), outcome in zip(made, outcomes, strict=True):
        assert outcome.sequence is not None
        intents.append(Intent(f"ai_{outcome.sequence}", did, outcome.sequence, digest))
    return intents


class Gate:
    """A `Chain` that stops for good at one point of a batch (`before_submit`: the batch is
    claimed; `after_submit`: the chain has the transaction, the store does not; `before_status`:
    the transaction is recorded), so that a test can crash the supervisor exactly there."""

    def __init__(self, inner: Chain, stop: str) -> None:
        self.inner = inner
        self.stop = stop
        self.reached = trio.Event()

    async def _halt(self, point: str) -> None:
        if point == self.stop:
            self.reached.set()
            await trio.sleep_forever()

    async def submit(self, root: str, *, key: str) -> str:
        await self._halt("before_submit")
        tx_id = await self.inner.submit(root, key=key)
        await self._halt("after_submit")
        return tx_id

    async def status(self, tx_id: str) -> ChainStatus:
        await self._halt("before_status")
        return await self.inner.status(tx_id)


@dataclass
class Rig:
    """A store, a local chain with its block producer, and supervisors started on them."""

    store: MemoryStore
    chain: LocalChain
    client: LocalChainClient
    config: AnchoringConfig
    appended: list[tuple[Change, Outcome]] = field(default_factory=list)
    before_append: Callable[[Change], Awaitable[None]] | None = None

    async def append(self, change: Change, idem: IdemKey | None) -> Outcome:
        """The supervisor's append: one change through the store's append path."""
        if self.before_append is not None:
            await self.before_append(change)
        [outcome] = await self.store.append([(change, idem)])
        self.appended.append((change, outcome))
        return outcome

    def body(
        self, handle: AnchoringHandle, chain: Chain | None = None
    ) -> Callable[[], Awaitable[None]]:
        """One run of a supervisor (it ends only by cancellation or an error)."""
        return partial(
            run_anchoring,
            self.store,
            self.append,
            chain or self.client,
            self.config,
            handle=handle,
            clock_ms=now_ms,
            rand=lambda: RAND,
        )

    async def admin(self, intent: Intent, from_: str, to: str) -> Outcome:
        """An admin's retry / abandon, as the anchors use-case appends it."""
        change = Change(
            "anchor.updated",
            intent.did,
            {"intentId": intent.intent_id, "from": from_, "to": to},
            event={"intentId": intent.intent_id, "sequence": intent.sequence, "state": to},
        )
        [outcome] = await self.store.append([(change, None)])
        return outcome


@asynccontextmanager
async def open_rig(
    *,
    interval: float = 1.0,
    depth: int = 2,
    batch_size: int = 4,
    max_attempts: int = 5,
    in_flight: int = 8,
    latency: float = 0.001,
    store: MemoryStore | None = None,
    journal: Path | None = None,
) -> AsyncIterator[Rig]:
    """A new store (or `store`), and a local chain (replayed from `journal`, if given) sealing a
    block every `interval` seconds (0: instant blocks)."""
    config = AnchoringConfig(
        batch_size=batch_size,
        block_interval_seconds=interval,
        finality_depth=depth,
        max_attempts=max_attempts,
        batches_in_flight=in_flight,
    )
    store = store or MemoryStore(clock_ms=now_ms, latency=latency)
    async with trio.open_nursery() as nursery:
        chain: LocalChain = await nursery.start(
            partial(run_local_chain, journal, interval=interval, clock_ms=now_ms)
        )
        client = LocalChainClient(chain, instant=interval == 0, clock_ms=now_ms)
        yield Rig(store, chain, client, config)
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def running(
    rig: Rig, handle: AnchoringHandle, chain: Chain | None = None
) -> AsyncIterator[None]:
    """A supervisor runs inside; leaving stops it (as a crash would: wherever it was)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rig.body(handle, chain))
        yield
        nursery.cancel_scope.cancel()


async def rows(store: MemoryStore, intents: list[Intent]) -> list[IntentRow]:
    found = []
    for intent in intents:
        row = await store.get_anchor_intent(intent.intent_id)
        assert row is not None
        found.append(row)
    return found


async def wait_for_states(
    store: MemoryStore, intents: list[Intent], *states: str, within: float = 120.0
) -> None:
    """Wait (on the log's wake-ups) until every intent is in one of `states`."""

    async def done() -> bool:
        return all(row.state in states for row in await rows(store, intents))

    with trio.fail_after(within):
        async with store.listen_log() as wakeups:
            while not await done():
                await wakeups.wait()


async def log_of(store: MemoryStore) -> list[LogRecord]:
    return await store.log_after(0, 1_000_000)


async def updates(store: MemoryStore, state: str | None = None) -> list[LogRecord]:
    return [
        r
        for r in await log_of(store)
        if r.kind == "anchor.updated" and (state is None or r.data["state"] == state)
    ]


def on_chain(chain: LocalChain) -> list[str]:
    """Every root the chain holds in a block, in block order."""
    return [root for height in range(chain.head + 1) for root in chain.block_roots(height)]


async def assert_anchored_once(rig: Rig, intents: list[Intent]) -> None:
    """Each intent confirmed exactly once: one `anchor.updated` confirmed event, one confirmed
    receipt (its latest), a proof from the batch's members that verifies against a root the
    chain holds, final, in the block the receipt names, and its entry reads `anchored`."""
    store, chain = rig.store, rig.chain
    confirmed = await updates(store, "confirmed")
    assert sorted(r.data["intentId"] for r in confirmed) == sorted(i.intent_id for i in intents)
    event_of = {r.data["intentId"]: r for r in confirmed}
    for intent, row in zip(intents, await rows(store, intents), strict=True):
        assert row.state == "confirmed"
        [receipt] = [r for r in row.receipts if r.state == "confirmed"]
        assert receipt == row.receipts[-1]
        members = await store.anchor_batch_members(receipt.batch_id)
        tree = MerkleTree([m.leaf for m in members])
        assert members[receipt.leaf_index].intent_id == intent.intent_id
        proof = tree.proof(receipt.leaf_index)
        assert verify_proof(proof, leaf_hash(intent.did, intent.sequence, intent.item_data_hash))
        assert receipt.root == proof.root
        assert receipt.block_height is not None
        assert chain.block_roots(receipt.block_height).count(proof.root) == 1
        assert receipt.transaction_id is not None
        status = chain.status(receipt.transaction_id)
        assert status.state == "included"
        assert (status.block_height, status.block_hash) == (
            receipt.block_height,
            receipt.block_hash,
        )
        assert status.block_root == proof.root
        assert status.confirmations >= rig.config.finality_depth
        event = event_of[intent.intent_id]
        assert event.entry_did == intent.did
        assert event.public
        assert event.data == {
            "intentId": intent.intent_id,
            "sequence": intent.sequence,
            "state": "confirmed",
            "anchorState": "anchored",
            "blockHeight": receipt.block_height,
        }
        head = await store.get_entry_head(intent.did)
        assert head is not None
        assert head.anchor_state == "confirmed"
        assert json.loads(with_anchor_state(head.doc, head.anchor_state))["anchorState"] == (
            "anchored"
        )


async def assert_one_transaction_per_batch(rig: Rig, intents: list[Intent]) -> None:
    """Every batch has its own transaction, and the chain holds exactly the confirmed ones
    (those of dropped batches are gone); nothing is left waiting."""
    batches = {r.batch_id: r for row in await rows(rig.store, intents) for r in row.receipts}
    txs = [r.transaction_id for r in batches.values()]
    assert len(set(txs)) == len(txs)
    roots = []
    for r in batches.values():
        assert r.transaction_id is not None
        assert r.root is not None
        assert r.state in ("confirmed", "dropped")
        status = rig.chain.status(r.transaction_id)
        assert status.state == ("included" if r.state == "confirmed" else "dropped")
        if r.state == "confirmed":
            roots.append(r.root)
    assert rig.chain.mempool == 0
    assert sorted(on_chain(rig.chain)) == sorted(roots)


def batch_sizes(all_rows: list[IntentRow]) -> list[int]:
    sizes: dict[int, int] = {}
    for row in all_rows:
        for receipt in row.receipts:
            sizes[receipt.batch_id] = sizes.get(receipt.batch_id, 0) + 1
    return [sizes[b] for b in sorted(sizes)]


# --- the happy path ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "batch_size", "sizes"),
    [(10, 4, [4, 4, 2]), (7, 1, [1] * 7), (5, 5, [5]), (3, 256, [3])],
)
@pytest.mark.parametrize("interval", [1.0, 0.0])
async def test_intents_are_confirmed_in_batches_with_proofs_that_verify(
    autojump_clock: trio.testing.MockClock,
    count: int,
    batch_size: int,
    sizes: list[int],
    interval: float,
) -> None:
    async with open_rig(batch_size=batch_size, interval=interval) as rig:
        intents = await publish(rig.store, count)
        assert {row.state for row in await rows(rig.store, intents)} == {"pending"}
        handle = AnchoringHandle()
        async with running(rig, handle):
            await wait_for_states(rig.store, intents, "confirmed")
            assert handle.stats.leader
        assert not handle.stats.leader
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)
        all_rows = await rows(rig.store, intents)
        assert batch_sizes(all_rows) == sizes
        assert all(row.attempts == 1 for row in all_rows)
        # Leaf order is sequence order, oldest intents first.
        by_batch = sorted(
            all_rows, key=lambda r: (r.receipts[0].batch_id, r.receipts[0].leaf_index)
        )
        assert [r.sequence for r in by_batch] == sorted(i.sequence for i in intents)
        assert handle.stats.batches == len(sizes)
        assert handle.stats.confirmed == count
        assert (handle.stats.requeued, handle.stats.failed, handle.stats.chain_errors) == (0, 0, 0)
        # The supervisor's own changes are internal; the updates are public, one per intent.
        kinds = [r.kind for r in await log_of(rig.store) if r.kind.startswith("anchor.")]
        assert kinds.count("anchor.claimed") == kinds.count("anchor.settled") == len(sizes)
        assert kinds.count("anchor.updated") == count
        assert not any(
            r.public
            for r in await log_of(rig.store)
            if r.kind != "anchor.updated" and r.kind.startswith("anchor.")
        )


async def test_a_nudge_starts_work_without_waiting_for_the_idle_poll(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Idle, the supervisor tries a claim every quarter block (t = 10.0, 10.25, ...); a nudge
    at 10.1 s has it claim at once."""
    async with open_rig(interval=1.0, latency=0.0) as rig:
        handle = AnchoringHandle()
        async with running(rig, handle):
            await trio.sleep_until(10.1)
            intents = await publish(rig.store, 2)
            handle.nudge()
            await wait_for_states(rig.store, intents, "confirmed")
        [claim] = [r for r in await log_of(rig.store) if r.kind == "anchor.claimed"]
        assert claim.at_ms == 10_100


@pytest.mark.parametrize("depth", [1, 3, 5])
async def test_confirmed_only_once_final(
    autojump_clock: trio.testing.MockClock, depth: int
) -> None:
    """Submitted at t=0, the transaction is in block 1 (t=1 s) and final at block `depth`;
    the supervisor polls four times a block."""
    async with open_rig(depth=depth, latency=0.0) as rig:
        intents = await publish(rig.store, 3)
        async with running(rig, AnchoringHandle()):
            await trio.sleep_until(depth - 0.01)
            [row] = {r.state: r for r in await rows(rig.store, intents)}.values()
            assert row.state == "submitted"
            tx = row.receipts[-1].transaction_id
            assert tx is not None
            status = rig.chain.status(tx)
            expected = ("included", depth - 1) if depth > 1 else ("pending", 0)
            assert (status.state, status.confirmations) == expected
            assert await updates(rig.store) == []
            await wait_for_states(rig.store, intents, "confirmed")
        times = {r.at_ms for r in await updates(rig.store, "confirmed")}
        assert len(times) == 1  # one change confirms the batch
        assert depth * 1000 <= times.pop() <= depth * 1000 + 250
        await assert_anchored_once(rig, intents)


# --- chain faults -----------------------------------------------------------------------------


async def test_a_dropped_transaction_sends_the_batch_back_to_pending_after_a_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_rig(depth=1, latency=0.0) as rig:
        intents = await publish(rig.store, 3)
        rig.chain.drop_next(1)
        handle = AnchoringHandle()
        async with running(rig, handle):
            await wait_for_states(rig.store, intents, "confirmed")
        requeued = await updates(rig.store, "pending")
        assert sorted(r.data["intentId"] for r in requeued) == [i.intent_id for i in intents]
        assert {r.at_ms for r in requeued} == {0}  # dropped: seen on the first poll
        assert all(r.data["anchorState"] == "pending" for r in requeued)
        all_rows = await rows(rig.store, intents)
        # Backoff for a first attempt: 1 s, jittered at 0.5 to 0.75 s.
        assert {row.available_ms for row in all_rows} == {750}
        claims = [r.at_ms for r in await log_of(rig.store) if r.kind == "anchor.claimed"]
        assert claims[0] == 0
        assert claims[1] >= 750
        assert [row.attempts for row in all_rows] == [2, 2, 2]
        for row in all_rows:
            assert [r.state for r in row.receipts] == ["dropped", "confirmed"]
            assert row.receipts[0].transaction_id is not None
            assert rig.chain.status(row.receipts[0].transaction_id).state == "dropped"
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)
        assert (handle.stats.batches, handle.stats.requeued, handle.stats.confirmed) == (2, 3, 3)


async def test_attempts_exhausted_fail_the_intents_until_an_admin_retries(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_rig(depth=1, max_attempts=2) as rig:
        intents = await publish(rig.store, 2)
        rig.chain.drop_next(2)
        handle = AnchoringHandle()
        async with running(rig, handle):
            await wait_for_states(rig.store, intents, "failed")
            assert [row.attempts for row in await rows(rig.store, intents)] == [2, 2]
            failed = await updates(rig.store, "failed")
            assert sorted(r.data["intentId"] for r in failed) == [i.intent_id for i in intents]
            assert all(r.data["anchorState"] == "failed" for r in failed)
            for intent in intents:
                head = await rig.store.get_entry_head(intent.did)
                assert head is not None
                assert head.anchor_state == "failed"
                assert json.loads(with_anchor_state(head.doc, "failed"))["anchorState"] == "failed"
            assert (handle.stats.requeued, handle.stats.failed, handle.stats.confirmed) == (2, 2, 0)
            # Failed intents stay failed: the supervisor idles.
            await trio.sleep(60)
            assert handle.stats.batches == 2
            assert {row.state for row in await rows(rig.store, intents)} == {"failed"}
            # An admin retry starts the attempts again.
            for intent in intents:
                assert (await rig.admin(intent, "failed", "pending")).refusal is None
            handle.nudge()
            await wait_for_states(rig.store, intents, "confirmed")
        assert [row.attempts for row in await rows(rig.store, intents)] == [1, 1]
        await assert_anchored_once(rig, intents)


async def test_a_delayed_transaction_is_confirmed_late_without_a_resubmission(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_rig(depth=2, latency=0.0) as rig:
        intents = await publish(rig.store, 2)
        rig.chain.delay_next(1, blocks=3)  # ready for block 4 (t=4 s), final at block 5
        async with running(rig, AnchoringHandle()):
            await trio.sleep_until(3.99)
            row = (await rows(rig.store, intents))[0]
            assert row.state == "submitted"
            assert row.receipts[-1].transaction_id is not None
            assert rig.chain.status(row.receipts[-1].transaction_id).state == "pending"
            await wait_for_states(rig.store, intents, "confirmed")
        [at] = {r.at_ms for r in await updates(rig.store, "confirmed")}
        assert 5000 <= at <= 5250
        assert [row.attempts for row in await rows(rig.store, intents)] == [1, 1]
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)


@pytest.mark.parametrize("k", [1, 2])
async def test_a_reorg_before_finality_reanchors_and_never_confirms_twice(
    autojump_clock: trio.testing.MockClock, k: int
) -> None:
    async with open_rig(depth=3, latency=0.0) as rig:
        intents = await publish(rig.store, 3)
        handle = AnchoringHandle()
        async with running(rig, handle):
            await trio.sleep_until(k + 0.5)  # included in block 1, with k confirmations
            first = (await rows(rig.store, intents))[0].receipts[-1]
            assert first.transaction_id is not None
            assert first.root is not None
            assert rig.chain.status(first.transaction_id).confirmations == k
            assert rig.chain.reorg(k) == [first.transaction_id]
            await wait_for_states(rig.store, intents, "confirmed")
            await trio.sleep(10)  # and nothing more happens
        all_rows = await rows(rig.store, intents)
        for row in all_rows:
            assert [r.state for r in row.receipts] == ["dropped", "confirmed"]
            assert row.attempts == 2
        # The same leaves in the same order: the new batch has the same root, in a new
        # transaction (another key); the re-orged one is gone for good.
        assert first.transaction_id is not None
        assert rig.chain.status(first.transaction_id).state == "dropped"
        assert on_chain(rig.chain) == [first.root]
        assert all_rows[0].receipts[1].transaction_id != first.transaction_id
        assert len(await updates(rig.store, "pending")) == 3
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)
        assert (handle.stats.batches, handle.stats.requeued, handle.stats.confirmed) == (2, 3, 3)


async def test_rpc_errors_back_off_and_lose_no_intent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_rig(depth=2, latency=0.0) as rig:
        intents = await publish(rig.store, 5)
        rig.chain.fail_next(3)  # the first submission fails three times
        handle = AnchoringHandle()
        async with running(rig, handle):
            # Backoff 0.5 s, 1 s, 2 s, each jittered to 3/4: the submission lands at 2.625 s.
            await trio.sleep_until(2.6)
            assert rig.chain.mempool == 0
            assert handle.stats.chain_errors == 3
            assert handle.stats.last_error == "chain: injected RPC failure"
            await trio.sleep_until(2.7)
            assert rig.chain.mempool == 2  # batch 1 was full: batch 2 went right after it
            rig.chain.fail_next(6)  # and then some polls fail
            await wait_for_states(rig.store, intents, "confirmed")
        assert handle.stats.chain_errors == 9
        assert handle.stats.batches == 2
        assert [row.attempts for row in await rows(rig.store, intents)] == [1] * 5
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)


BLOCKLESS = "blockless"  # the chain's own `included`, without its block's height, hash or time


class Hostile:
    """A `Chain` over the local chain whose next calls hang for good (`hangs`: in turn, the
    call that hangs next), or answer
    the next of `submits` / `statuses` (BLOCKLESS: the chain's own answer once it is
    `included`, stripped of its block and made final), before it answers as the chain does."""

    def __init__(
        self,
        inner: Chain,
        *,
        hangs: tuple[str, ...] = (),
        submits: tuple[object, ...] = (),
        statuses: tuple[object, ...] = (),
    ) -> None:
        self.inner = inner
        self.hangs = list(hangs)
        self.submits = list(submits)
        self.statuses = list(statuses)
        self.answered: list[object] = []

    async def _hang(self, call: str) -> None:
        if self.hangs and self.hangs[0] == call:
            self.hangs.pop(0)
            await trio.sleep_forever()

    async def submit(self, root: str, *, key: str) -> str:
        await self._hang("submit")
        if not self.submits:
            return await self.inner.submit(root, key=key)
        self.answered.append(self.submits.pop(0))
        return self.answered[-1]  # type: ignore[return-value]

    async def status(self, tx_id: str) -> ChainStatus:
        await self._hang("status")
        real = await self.inner.status(tx_id)
        if not self.statuses or (self.statuses[0] == BLOCKLESS and real.state != "included"):
            return real
        answer = self.statuses.pop(0)
        self.answered.append(answer)
        if answer == BLOCKLESS:
            return replace(
                real, block_height=None, block_hash=None, block_time_ms=None, confirmations=99
            )
        return answer  # type: ignore[return-value]


async def test_a_chain_call_that_never_answers_fails_and_is_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hung RPC is a failed call after CHAIN_CALL_SECONDS, not a supervisor stopped for good:
    the submission and a poll hang, and the batch is still confirmed, once."""
    async with open_rig(depth=2, latency=0.0) as rig:
        intents = await publish(rig.store, 3)
        chain = Hostile(rig.client, hangs=("submit", "status"))
        handle = AnchoringHandle()
        async with running(rig, handle, chain):
            await wait_for_states(rig.store, intents, "confirmed", within=300)
        assert handle.stats.chain_errors == 2
        assert handle.stats.last_error == "chain: status did not answer within 30s"
        assert [row.attempts for row in await rows(rig.store, intents)] == [1] * 3
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)


async def test_chain_answers_outside_the_port_are_failed_calls_never_settlements(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A submission that answers no transaction id, an `included` without its block (it
    confirmed an anchor naming no block, whose GET /v1/anchors record could not be written), an
    unknown state (it read as dropped and anchored the batch again) and a status that is no
    ChainStatus at all (it ended the process): each is a failed call, retried."""
    async with open_rig(depth=2, latency=0.0) as rig:
        intents = await publish(rig.store, 3)
        submits: tuple[object, ...] = (None, "")
        statuses: tuple[object, ...] = (
            BLOCKLESS,
            ChainStatus("confirmed"),  # type: ignore[arg-type]
            {"state": "included"},
            None,
        )
        chain = Hostile(rig.client, submits=submits, statuses=statuses)
        handle = AnchoringHandle()
        async with running(rig, handle, chain):
            await wait_for_states(rig.store, intents, "confirmed", within=300)
        assert chain.answered == [*submits, *statuses]
        assert handle.stats.chain_errors == len(submits) + len(statuses)
        assert handle.stats.requeued == 0
        assert [row.attempts for row in await rows(rig.store, intents)] == [1] * 3
        for row in await rows(rig.store, intents):
            assert row.receipts[-1].anchor_time_ms is not None
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)


class FailsForTheFirst:
    """A `Chain` over the local chain whose status of the first transaction submitted fails
    (`ChainUnavailable`) until `heal()`: an RPC that fails for one transaction only."""

    def __init__(self, inner: Chain) -> None:
        self.inner = inner
        self.first: str | None = None
        self.healed = False
        self.failures = 0

    def heal(self) -> None:
        self.healed = True

    async def submit(self, root: str, *, key: str) -> str:
        tx_id = await self.inner.submit(root, key=key)
        self.first = self.first or tx_id
        return tx_id

    async def status(self, tx_id: str) -> ChainStatus:
        if tx_id == self.first and not self.healed:
            self.failures += 1
            raise ChainUnavailable("this transaction's receipt cannot be read")
        return await self.inner.status(tx_id)


async def test_a_chain_call_failing_for_one_batch_holds_no_other_back(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The status of the oldest open batch's transaction fails, call after call: the batches
    after it are still submitted, polled and confirmed (before, every step stopped at the
    oldest batch's failure, and nothing behind it moved); once it answers, it is confirmed."""
    async with open_rig(depth=2, batch_size=2, latency=0.0) as rig:
        intents = await publish(rig.store, 6)
        chain = FailsForTheFirst(rig.client)
        handle = AnchoringHandle()
        async with running(rig, handle, chain):
            await wait_for_states(rig.store, intents[2:], "confirmed", within=60)
            assert {row.state for row in await rows(rig.store, intents[:2])} == {"submitted"}
            assert chain.failures > 0
            assert handle.stats.chain_errors == chain.failures
            assert handle.stats.last_error == "chain: this transaction's receipt cannot be read"
            chain.heal()
            await wait_for_states(rig.store, intents[:2], "confirmed", within=60)
        assert [row.attempts for row in await rows(rig.store, intents)] == [1] * 6
        # While the others answered, its failures were one condition: a line, then its end.
        lines = [r.getMessage() for r in caplog.records if "of some batches" in r.getMessage()]
        assert len(lines) == 2, lines
        assert lines[0] == (
            "anchoring: chain calls of some batches:"
            " chain unavailable (this transaction's receipt cannot be read)"
        )
        assert lines[1].startswith("anchoring: chain calls of some batches: back after")
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)


# --- several batches in flight -----------------------------------------------------------------


async def most_open_batches(store: MemoryStore, into: list[int]) -> None:
    """Record how many batches are open, every tenth of a (virtual) second."""
    while True:
        into.append(len(await store.open_anchor_batches()))
        await trio.sleep(0.1)


@pytest.mark.parametrize(("in_flight", "finished_by"), [(1, 22.0), (4, 7.0), (8, 5.0)])
async def test_several_batches_wait_for_finality_at_once(
    autojump_clock: trio.testing.MockClock, in_flight: int, finished_by: float
) -> None:
    # 40 intents in batches of 4, a block a second, final 2 blocks later: one batch at a time
    # takes about 3 s a batch; with several in flight the backlog goes in a few rounds.
    async with open_rig(depth=2, batch_size=4, in_flight=in_flight) as rig:
        intents = await publish(rig.store, 40)
        handle = AnchoringHandle()
        seen: list[int] = []
        async with running(rig, handle), trio.open_nursery() as watching:
            watching.start_soon(most_open_batches, rig.store, seen)
            await wait_for_states(rig.store, intents, "confirmed")
            finished = trio.current_time()
            watching.cancel_scope.cancel()
        assert max(seen) == in_flight  # full claims follow each other up to the bound
        assert finished <= finished_by
        if in_flight == 1:
            assert finished >= 20.0  # the limit this lifts
        assert batch_sizes(await rows(rig.store, intents)) == [4] * 10
        assert handle.stats.batches == 10
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)


async def test_a_trickle_of_intents_makes_one_batch_a_block_not_many_tiny_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # An intent every 0.1 s for 5 s, batches of up to 256, a block a second: while batches are
    # open a partial claim waits a block interval after the previous one.
    async with open_rig(depth=2, batch_size=256) as rig:
        handle = AnchoringHandle()
        intents: list[Intent] = []
        async with running(rig, handle):
            for _ in range(50):
                intents += await publish(rig.store, 1)
                handle.nudge()
                await trio.sleep(0.1)
            await wait_for_states(rig.store, intents, "confirmed")
        sizes = batch_sizes(await rows(rig.store, intents))
        assert sum(sizes) == 50
        assert len(sizes) <= 7  # about one a block (5 s of intents), never one per intent
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)


async def test_a_restart_resumes_every_open_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_rig(depth=3, batch_size=4) as rig:
        intents = await publish(rig.store, 14)
        async with running(rig, AnchoringHandle()):
            await trio.sleep(0.5)  # all four claimed and submitted; none final yet
        before = await rig.store.open_anchor_batches()
        assert [len(b.members) for b in before] == [4, 4, 4, 2]
        handle = AnchoringHandle()
        async with running(rig, handle):
            await wait_for_states(rig.store, intents, "confirmed")
        assert handle.stats.batches == 0  # resumed, none claimed again
        assert [row.attempts for row in await rows(rig.store, intents)] == [1] * 14
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)


# --- admin control ----------------------------------------------------------------------------


async def test_abandon_while_submitted_settles_the_batch_without_that_intent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_rig(depth=2) as rig:
        intents = await publish(rig.store, 4)
        kept = [intents[0], intents[2], intents[3]]
        abandoned = intents[1]
        injected: list[Outcome] = []

        async def abandon_first(change: Change) -> None:
            """The admin's abandon lands between the supervisor's read and its settle."""
            if change.kind == "anchor.settled" and not injected:
                injected.append(await rig.admin(abandoned, "submitted", "abandoned"))

        rig.before_append = abandon_first
        handle = AnchoringHandle()
        async with running(rig, handle):
            await wait_for_states(rig.store, kept, "confirmed")
            await trio.sleep(30)
        assert injected[0].refusal is None
        settles = [(c.rows, o) for c, o in rig.appended if c.kind == "anchor.settled"]
        assert len(settles) == 2
        (stale, retried), (fresh, done) = settles
        assert retried.refusal is not None
        assert retried.refusal.kind == "Retry"
        assert retried.refusal.code == "intents_changed"
        assert retried.sequence is None
        assert len(stale["intents"]) == 4
        assert abandoned.intent_id not in fresh["intents"]
        assert done.refusal is None
        [row] = await rows(rig.store, [abandoned])
        assert row.state == "abandoned"
        assert row.attempts == 1
        assert [
            u.data["state"] for u in await updates(rig.store) if u.entry_did == abandoned.did
        ] == ["abandoned"]
        await assert_anchored_once(rig, kept)
        # The batch's root still covers all four leaves (it is what the chain holds).
        members = await rig.store.anchor_batch_members(row.receipts[0].batch_id)
        assert [m.intent_id for m in members] == [i.intent_id for i in intents]
        assert handle.stats.confirmed == 3
        assert handle.stats.batches == 1
        head = await rig.store.get_entry_head(abandoned.did)
        assert head is not None
        assert head.anchor_state == "abandoned"


async def test_abandoned_pending_intents_are_not_claimed_until_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_rig(depth=1) as rig:
        intents = await publish(rig.store, 3)
        assert (await rig.admin(intents[0], "pending", "abandoned")).refusal is None
        # A stale admin decision is a Retry, and changes nothing.
        stale = await rig.admin(intents[0], "pending", "abandoned")
        assert stale.refusal is not None
        assert stale.refusal.kind == "Retry"
        handle = AnchoringHandle()
        async with running(rig, handle):
            await wait_for_states(rig.store, intents[1:], "confirmed")
            await trio.sleep(30)
            [row] = await rows(rig.store, intents[:1])
            assert (row.state, row.attempts, row.receipts) == ("abandoned", 0, ())
            assert (await rig.admin(intents[0], "abandoned", "pending")).refusal is None
            handle.nudge()
            await wait_for_states(rig.store, intents, "confirmed")
        await assert_anchored_once(rig, intents)
        assert handle.stats.batches == 2


async def test_a_batch_whose_intents_are_all_abandoned_settles_and_work_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_rig(depth=2, batch_size=3) as rig:
        intents = await publish(rig.store, 5)
        handle = AnchoringHandle()
        async with running(rig, handle):
            await trio.sleep(0.5)  # batch 1 (three intents) submitted
            for intent in intents[:3]:
                assert (await rig.admin(intent, "submitted", "abandoned")).refusal is None
            await wait_for_states(rig.store, intents[3:], "confirmed")
            with trio.fail_after(60):  # batch 1, all abandoned, settles too (a log record)
                async with rig.store.listen_log() as wakeups:
                    while await rig.store.open_anchor_batches():
                        await wakeups.wait()
        assert {row.state for row in await rows(rig.store, intents[:3])} == {"abandoned"}
        assert (handle.stats.batches, handle.stats.confirmed) == (2, 2)
        await assert_anchored_once(rig, intents[3:])


async def test_an_intent_retried_while_its_batch_is_open_is_anchored_in_the_next_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Abandoned then retried before its batch settles: the batch settles without it (it is
    pending, not submitted), and the next batch anchors it; it is confirmed once."""
    async with open_rig(depth=3, batch_size=3) as rig:
        intents = await publish(rig.store, 3)
        moved = intents[1]
        async with running(rig, AnchoringHandle()):
            await trio.sleep(0.5)
            assert (await rig.admin(moved, "submitted", "abandoned")).refusal is None
            assert (await rig.admin(moved, "abandoned", "pending")).refusal is None
            await wait_for_states(rig.store, intents, "confirmed")
            await trio.sleep(20)
        [row] = await rows(rig.store, [moved])
        assert row.attempts == 1  # the retry started the count again
        assert len({r.batch_id for r in row.receipts}) == len(row.receipts) == 2
        states = [u.data["state"] for u in await updates(rig.store) if u.entry_did == moved.did]
        assert states == ["abandoned", "pending", "confirmed"]
        confirmed = {u.data["intentId"]: u for u in await updates(rig.store, "confirmed")}
        assert confirmed[moved.intent_id].data["blockHeight"] == row.receipts[-1].block_height
        assert row.receipts[-1].state == "confirmed"


# --- crashes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["before_submit", "after_submit", "before_status"])
async def test_a_restarted_supervisor_finishes_the_batch_a_crashed_one_left(
    autojump_clock: trio.testing.MockClock, stop: str
) -> None:
    async with open_rig(depth=2) as rig:
        intents = await publish(rig.store, 6)  # two batches: 4 + 2
        gate = Gate(rig.client, stop)
        async with running(rig, AnchoringHandle(), gate):
            with trio.fail_after(10):
                await gate.reached.wait()
        # Crashed with batch 1 claimed ...
        [open_batch] = await rig.store.open_anchor_batches()
        assert [s for _, s in open_batch.members] == ["submitted"] * 4
        if stop == "before_submit":
            assert (rig.chain.calls, rig.chain.mempool) == (0, 0)
            assert open_batch.transaction_id is None
        elif stop == "after_submit":  # ... and submitted, not recorded
            assert (rig.chain.calls, rig.chain.mempool) == (1, 1)
            assert open_batch.transaction_id is None
        else:  # ... and recorded, not settled
            assert (rig.chain.calls, rig.chain.mempool) == (1, 1)
            assert open_batch.transaction_id is not None
        handle = AnchoringHandle()
        async with running(rig, handle):
            await wait_for_states(rig.store, intents, "confirmed")
        all_rows = await rows(rig.store, intents)
        assert all_rows[0].receipts[0].batch_id == open_batch.batch_id  # resumed, not reclaimed
        assert batch_sizes(all_rows) == [4, 2]
        assert [row.attempts for row in all_rows] == [1] * 6
        assert handle.stats.batches == 1  # the restarted run claimed only the second batch
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)


@pytest.mark.parametrize("dropped", [False, True])
async def test_a_process_restart_replays_the_chain_journal_and_resumes(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, dropped: bool
) -> None:
    """The whole process dies after submitting, before recording (the chain included the
    transaction meanwhile, or dropped it); the next process replays the chain's journal: the
    resubmission under the batch's key finds the same transaction, included or dropped."""
    journal = tmp_path / "chain.jsonl"
    async with open_rig(depth=2, journal=journal) as rig:
        store = rig.store
        intents = await publish(store, 6)
        if dropped:
            rig.chain.drop_next(1)
        gate = Gate(rig.client, "after_submit")
        async with running(rig, AnchoringHandle(), gate):
            with trio.fail_after(10):
                await gate.reached.wait()
            await trio.sleep(1.5)  # the chain seals block 1 (with the transaction, unless lost)
        first_roots = on_chain(rig.chain)
        assert len(first_roots) == (0 if dropped else 1)
    async with open_rig(depth=2, journal=journal, store=store) as rig:
        assert rig.chain.head >= 1
        assert on_chain(rig.chain) == first_roots
        handle = AnchoringHandle()
        async with running(rig, handle):
            await wait_for_states(store, intents, "confirmed")
        all_rows = await rows(store, intents)
        if dropped:  # the first batch was requeued, then anchored in a third batch
            assert [len(row.receipts) for row in all_rows] == [2] * 4 + [1] * 2
            assert [row.attempts for row in all_rows] == [2] * 4 + [1] * 2
        else:
            assert [row.attempts for row in all_rows] == [1] * 6
            assert on_chain(rig.chain)[0] == first_roots[0]  # resumed, not submitted again
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)


async def test_a_crash_in_the_middle_of_recording_the_transaction(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every store call takes a second: open batches 0-1 s, the pending check 1-2 s, claim
    2-3 s, submit at 3 s, record 3-4 s. Cancelled at 3.5 s, the record never happens; the next
    run resubmits under the same key and gets the same transaction."""
    async with open_rig(depth=2, latency=1.0) as rig:
        intents = await publish(rig.store, 3)
        async with running(rig, AnchoringHandle()):
            await trio.sleep_until(trio.current_time() + 3.5)
        [open_batch] = await rig.store.open_anchor_batches()
        assert open_batch.transaction_id is None
        assert rig.chain.calls == 1
        with trio.fail_after(300):
            async with running(rig, AnchoringHandle()):
                await wait_for_states(rig.store, intents, "confirmed")
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)
        assert len(on_chain(rig.chain)) == 1


async def test_a_database_outage_restarts_the_run_and_loses_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_rig(depth=2) as rig:
        intents = await publish(rig.store, 5)
        handle = AnchoringHandle()
        stats = SupervisorStats()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(supervise, "anchoring", rig.body(handle), stats=stats))
            await trio.sleep_until(0.5)  # batch 1 submitted, waiting for finality
            rig.store.fail_writes = True
            await trio.sleep(10)
            assert stats.restarts >= 1
            assert stats.last_error is not None  # (a group of one Unavailable: is_known)
            # Both batches were claimed (the first was full, so the second right after it).
            assert {row.state for row in await rows(rig.store, intents)} == {"submitted"}
            rig.store.fail_writes = False
            await wait_for_states(rig.store, intents, "confirmed")
            nursery.cancel_scope.cancel()
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)


async def test_a_settle_refused_for_another_reason_ends_the_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Only `Retry` is expected from a settle; anything else ends the run with `Unavailable`
    (its supervisor restarts it), rather than looping on it."""
    async with open_rig(depth=1) as rig:
        await publish(rig.store, 2)

        async def refusing(change: Change, idem: IdemKey | None) -> Outcome:
            if change.kind == "anchor.settled":
                return Outcome(None, None, Refusal("NotFound", "batch_not_found", "no batch"))
            return await rig.append(change, idem)

        handle = AnchoringHandle()
        with trio.fail_after(30), pytest.RaisesGroup(Unavailable, flatten_subgroups=True):
            await run_anchoring(
                rig.store, refusing, rig.client, rig.config, handle=handle, clock_ms=now_ms
            )
        assert not handle.stats.leader
        [open_batch] = await rig.store.open_anchor_batches()  # to be resumed by the next run
        assert open_batch.transaction_id is not None


async def test_the_store_lists_intents_and_keeps_settled_batches_settled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The memory store's anchoring reads, as the SQL has them: an entry's intents ascending by
    (sequence, createdAt, intentId) after a position; a submission recorded on a batch that is
    no longer open changes nothing; losing a leadership nobody holds is a no-op."""
    async with open_rig(depth=1) as rig:
        [intent] = await publish(rig.store, 1)
        update = entry_change(
            "entry.updated",
            did=intent.did,
            expected_head=intent.sequence,
            publisher="did:web:publisher.example",
            entry_type="AgentDefinition",
            lifecycle="active",
            prefix=f'{{"anchorState":"pending","entryDid":"{intent.did}","sequence":',
            suffix="}",
            item_data_hash="cd" * 32,
        )
        [updated] = await rig.store.append([(update, None)])
        assert updated.sequence is not None
        listed = await rig.store.anchor_intents_of(intent.did, after=None, limit=10)
        assert [(r.intent_id, r.operation) for r in listed] == [
            (intent.intent_id, "create"),
            (f"ai_{updated.sequence}", "update"),
        ]
        first = listed[0]
        after = (first.sequence, first.created_ms, first.intent_id)
        rest = await rig.store.anchor_intents_of(intent.did, after=after, limit=10)
        assert [r.intent_id for r in rest] == [f"ai_{updated.sequence}"]
        assert await rig.store.anchor_intents_of(intent.did, after=None, limit=1) == listed[:1]
        assert await rig.store.anchor_intents_of("did:web:nobody", after=None, limit=10) == []
        assert await rig.store.get_anchor_intent("ai_999999") is None
        assert await rig.store.anchor_batch_members(999_999) == []
        newer = Intent(f"ai_{updated.sequence}", intent.did, updated.sequence, "cd" * 32)
        rig.store.break_leadership("anchoring")  # nobody holds it
        async with running(rig, AnchoringHandle()):
            await wait_for_states(rig.store, [intent, newer], "confirmed")
        [row] = await rows(rig.store, [intent])
        receipt = row.receipts[-1]
        await rig.store.record_anchor_submission(
            receipt.batch_id, "ee" * 32, "ff" * 32, bytes(32), 1
        )
        [again] = await rows(rig.store, [intent])
        assert again.receipts[-1] == receipt
        head = await rig.store.get_entry_head(intent.did)
        assert head is not None
        assert head.anchor_state == "confirmed"  # the head version's intent


async def test_the_leader_stores_the_trees_of_batches_submitted_before_trees_were_stored() -> None:
    """Batches submitted before migration 0025 have no stored tree (their proofs were rebuilt on
    every read): a new leader rebuilds each once and stores it, unless its members do not lead
    to the root it recorded."""
    from dataclasses import replace

    from registry.merkle import proof_from_slices, proof_offsets

    async with open_rig(interval=0, depth=1, batch_size=3) as rig:
        intents = await publish(rig.store, 9)
        async with running(rig, AnchoringHandle()):
            await wait_for_states(rig.store, intents, "confirmed")
        batches = rig.store._tables.batches
        ids = sorted(batches)
        assert len(ids) == 3
        assert all(batches[b].levels for b in ids)
        stored = {b: batches[b].levels for b in ids}
        for b in ids:  # as they were before the migration; the last one's root is not theirs
            batches[b] = replace(batches[b], levels=b"")
        batches[ids[-1]] = replace(batches[ids[-1]], root="ee" * 32)
        assert [b for b, _ in await rig.store.batches_without_tree(0, 10)] == ids

        handle = AnchoringHandle()
        async with running(rig, handle):
            with trio.fail_after(30):
                await handle.trees_backfilled.wait()
        assert handle.stats.trees_backfilled == 2
        assert [batches[b].levels for b in ids[:2]] == [stored[b] for b in ids[:2]]
        assert batches[ids[-1]].levels == b""  # not stored: it would not lead to the root
        [row] = await rows(rig.store, intents[:1])
        receipt = row.receipts[-1]
        assert receipt.leaves == 3
        leaf, steps = proof_offsets(3, receipt.leaf_index)
        nodes = await rig.store.anchor_tree_slices(
            [(receipt.batch_id, leaf)] + [(receipt.batch_id, at) for at, _ in steps]
        )
        proof = proof_from_slices(
            receipt.root or "",
            nodes[0],
            [(n, side) for n, (_, side) in zip(nodes[1:], steps, strict=True)],
        )
        assert verify_proof(
            proof, leaf_hash(intents[0].did, intents[0].sequence, intents[0].item_data_hash)
        )


# --- leadership -------------------------------------------------------------------------------


async def test_one_leader_works_and_another_takes_over_a_lost_leadership(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One batch at a time, so that the first leader leaves work for the second.
    async with open_rig(depth=2, batch_size=4, in_flight=1) as rig:
        intents = await publish(rig.store, 12)
        first, second = AnchoringHandle(), AnchoringHandle()
        first_lost = trio.Event()
        second_stats = SupervisorStats()

        async def run_first() -> None:
            """The first run, not restarted (a restart would compete for the lock again)."""
            try:
                await rig.body(first)()
            except* Unavailable:
                first_lost.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_first)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(partial(supervise, "second", rig.body(second), stats=second_stats))
            await trio.testing.wait_all_tasks_blocked()
            assert first.stats.leader
            assert not second.stats.leader
            await wait_for_states(rig.store, intents[:4], "confirmed")
            assert second.stats.batches == 0  # the waiting one does nothing
            done_by_first = first.stats.batches
            assert done_by_first >= 1
            rig.store.break_leadership("anchoring")
            with trio.fail_after(1):
                await first_lost.wait()  # its run ended with Unavailable
            assert not first.stats.leader
            await wait_for_states(rig.store, intents, "confirmed")
            assert second.stats.leader
            assert not first.stats.leader
            assert first.stats.batches == done_by_first  # the first did nothing more
            assert second.stats.batches >= 1
            assert first.stats.batches + second.stats.batches == 3
            assert second_stats.restarts == 0
            nursery.cancel_scope.cancel()
        await assert_anchored_once(rig, intents)
        await assert_one_transaction_per_batch(rig, intents)
        assert [row.attempts for row in await rows(rig.store, intents)] == [1] * 12
