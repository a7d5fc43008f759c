"""The local chain, a deterministic simulation of the `Chain` port: idempotent submission,
blocks and confirmations, every injectable fault, and durability through its journal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from actors.chain import open_local_chain
from registry.anchoring import ChainStatus
from registry.chain import ChainUnavailable, LocalChain


def root(n: int) -> str:
    return f"{n:064x}"


def state(chain: LocalChain, tx: str) -> str:
    return chain.status(tx).state


def snapshot(chain: LocalChain, txs: list[str]) -> tuple[Any, ...]:
    """Everything an observer of the chain can see."""
    return (
        chain.head,
        chain.mempool,
        [chain.status(tx) for tx in txs],
        [chain.block_roots(h) for h in range(chain.head + 1)],
    )


def test_a_new_chain_has_only_genesis() -> None:
    chain = LocalChain()
    assert chain.head == 0
    assert chain.mempool == 0
    assert chain.block_roots(0) == []
    assert chain.block_roots(1) == []
    assert chain.block_roots(-1) == []


def test_submit_is_idempotent_by_key() -> None:
    chain = LocalChain()
    tx = chain.submit(root(1), key="batch-1")
    assert chain.submit(root(1), key="batch-1") == tx
    assert chain.submit(root(2), key="batch-1") == tx  # the key decides, not the root
    assert chain.mempool == 1
    other = chain.submit(root(1), key="batch-2")
    assert other != tx
    assert chain.mempool == 2
    assert chain.calls == 4


def test_a_block_includes_every_ready_transaction() -> None:
    chain = LocalChain()
    a = chain.submit(root(1), key="a")
    b = chain.submit(root(2), key="b")
    assert state(chain, a) == "pending"
    assert chain.produce_block(5_000) == 1
    assert chain.mempool == 0
    assert chain.block_roots(1) == [root(1), root(2)]
    status = chain.status(a)
    assert status.state == "included"
    assert (status.block_height, status.confirmations) == (1, 1)
    assert status.block_root == root(1)
    assert status.block_time_ms == 5_000
    assert status.block_hash is not None
    assert len(status.block_hash) == 64
    assert chain.status(b).block_root == root(2)
    c = chain.submit(root(3), key="c")  # after the block: waits for the next one
    assert chain.status(c) == ChainStatus("pending")
    chain.produce_block(6_000)
    assert chain.block_roots(2) == [root(3)]


def test_confirmations_count_the_blocks_on_top() -> None:
    chain = LocalChain()
    tx = chain.submit(root(1), key="a")
    chain.produce_block(1)
    seen = [chain.status(tx).confirmations]
    for t in range(2, 6):
        chain.produce_block(t)
        seen.append(chain.status(tx).confirmations)
    assert seen == [1, 2, 3, 4, 5]
    assert chain.status(tx).block_height == 1


def test_an_unknown_transaction_reads_as_dropped() -> None:
    assert LocalChain().status("00" * 32) == ChainStatus("dropped")


def test_delay_next_holds_submissions_back_for_that_many_blocks() -> None:
    chain = LocalChain()
    chain.delay_next(2, blocks=3)
    slow1 = chain.submit(root(1), key="s1")
    slow2 = chain.submit(root(2), key="s2")
    fast = chain.submit(root(3), key="f")
    chain.produce_block(1)
    assert chain.status(fast).block_height == 1
    for t in (2, 3):
        chain.produce_block(t)
        assert state(chain, slow1) == state(chain, slow2) == "pending"
    chain.produce_block(4)
    assert chain.status(slow1).block_height == chain.status(slow2).block_height == 4
    assert chain.mempool == 0


def test_drop_next_loses_the_next_submissions() -> None:
    chain = LocalChain()
    chain.drop_next(1)
    lost = chain.submit(root(1), key="lost")
    kept = chain.submit(root(2), key="kept")
    for t in range(3):
        chain.produce_block(t)
    assert state(chain, lost) == "dropped"
    assert state(chain, kept) == "included"
    assert chain.submit(root(1), key="lost") == lost  # the same key: the same (lost) tx
    assert state(chain, lost) == "dropped"
    assert [r for h in range(chain.head + 1) for r in chain.block_roots(h)] == [root(2)]


def test_fail_next_raises_then_works() -> None:
    chain = LocalChain()
    chain.fail_next(2)
    with pytest.raises(ChainUnavailable):
        chain.submit(root(1), key="a")
    assert chain.mempool == 0  # a failed call does nothing
    with pytest.raises(ChainUnavailable):
        chain.status("00" * 32)
    tx = chain.submit(root(1), key="a")
    assert state(chain, tx) == "pending"
    assert chain.calls == 4


def test_reorg_removes_the_transactions_of_the_last_k_blocks() -> None:
    chain = LocalChain()
    txs = []
    for n in range(1, 5):
        txs.append(chain.submit(root(n), key=f"k{n}"))
        chain.produce_block(n)
    hashes = [chain.status(tx).block_hash for tx in txs]
    gone = chain.reorg(2)
    assert gone == txs[2:]
    assert chain.head == 4  # replaced by empty blocks, not removed
    assert [state(chain, tx) for tx in txs] == ["included", "included", "dropped", "dropped"]
    assert chain.block_roots(3) == chain.block_roots(4) == []
    assert chain.status(txs[1]).block_hash == hashes[1]
    assert chain.status(txs[1]).confirmations == 3
    # Resubmitting under the same key does not bring a re-orged transaction back.
    assert chain.submit(root(3), key="k3") == txs[2]
    assert state(chain, txs[2]) == "dropped"


def test_reorg_leaves_the_mempool_and_never_touches_genesis() -> None:
    chain = LocalChain()
    included = chain.submit(root(1), key="a")
    chain.produce_block(1)
    waiting = chain.submit(root(2), key="b")
    genesis = chain._blocks[0].hash
    assert chain.reorg(50) == [included]  # k is capped at the head: block 1 only
    assert chain._blocks[0].hash == genesis
    assert chain.head == 1
    assert state(chain, waiting) == "pending"
    assert chain.reorg(0) == []
    chain.produce_block(2)
    assert chain.status(waiting).block_height == 2


def test_reorg_of_everything_keeps_genesis_hash() -> None:
    chain = LocalChain()
    chain.produce_block(1)
    probe = LocalChain()
    chain.reorg(10)
    chain.produce_block(2)
    probe.produce_block(1)
    # Block 1 was replaced (other hash), but genesis and heights are as before.
    assert chain.head == 2
    assert chain._blocks[0].hash == probe._blocks[0].hash
    assert chain._blocks[1].hash != probe._blocks[1].hash


def _busy_chain(journal: list[dict[str, Any]] | None = None) -> tuple[LocalChain, list[str]]:
    """A chain through every kind of event and fault."""
    chain = LocalChain(journal.append if journal is not None else None)
    txs = [chain.submit(root(1), key="a")]
    chain.produce_block(1_000)
    chain.delay_next(1, blocks=2)
    txs.append(chain.submit(root(2), key="b"))
    txs.append(chain.submit(root(3), key="c"))
    chain.produce_block(2_000)
    chain.drop_next(1)
    txs.append(chain.submit(root(4), key="d"))
    chain.fail_next(1)
    with pytest.raises(ChainUnavailable):
        chain.submit(root(5), key="e")
    txs.append(chain.submit(root(5), key="e"))
    chain.produce_block(3_000)
    chain.produce_block(4_000)
    chain.reorg(1)
    chain.produce_block(5_000)
    txs.append(chain.submit(root(6), key="f"))
    return chain, txs


def test_journal_replay_rebuilds_an_identical_chain() -> None:
    events: list[dict[str, Any]] = []
    chain, txs = _busy_chain(events)
    assert all(json.loads(json.dumps(e)) == e for e in events)  # JSON-safe
    copy = LocalChain.replay(events)
    assert snapshot(copy, txs) == snapshot(chain, txs)
    assert [s.state for s in snapshot(chain, txs)[2]] == [
        "included",
        "dropped",  # delayed into block 4, then re-orged away
        "included",
        "dropped",  # dropped at submission
        "included",  # (after an RPC failure) in block 3, below the re-org
        "pending",
    ]
    # The replayed chain keeps going the same way, and keeps journaling.
    more: list[dict[str, Any]] = []
    copy = LocalChain.replay(events, journal=more.append)
    assert more == []
    for c in (chain, copy):
        c.submit(root(7), key="g")
        c.produce_block(6_000)
    assert more == events[-2:]
    assert snapshot(copy, txs) == snapshot(chain, txs)


@pytest.mark.parametrize("key", ["a", "b", "d", "e"])
def test_replay_keeps_submissions_idempotent_by_key(key: str) -> None:
    """Included, re-orged, dropped: after a restart, resubmitting under a key answers what the
    chain answered before it (a dropped submission stays dropped; it is not accepted anew)."""
    events: list[dict[str, Any]] = []
    chain, txs = _busy_chain(events)
    copy = LocalChain.replay(events)
    n = "abcde".index(key) + 1
    assert copy.submit(root(n), key=key) == chain.submit(root(n), key=key)
    for c in (chain, copy):
        c.produce_block(9_000)
    assert snapshot(copy, txs) == snapshot(chain, txs)


# --- the journal file --------------------------------------------------------------------------


def _chain_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines()]


def test_open_local_chain_journals_to_a_file_and_replays_it(tmp_path: Path) -> None:
    path = tmp_path / "data" / "chain.jsonl"  # the directory is made too
    with open_local_chain(path) as chain:
        tx = chain.submit(root(1), key="a")
        chain.produce_block(1_000)
        chain.produce_block(2_000)
        before = snapshot(chain, [tx])
    assert [e["op"] for e in _chain_lines(path)] == ["submit", "block", "block"]
    with open_local_chain(path) as chain:
        assert snapshot(chain, [tx]) == before
        assert chain.submit(root(1), key="a") == tx
        chain.produce_block(3_000)
    with open_local_chain(path) as chain:
        assert chain.head == 3
        assert chain.status(tx).confirmations == 3


def test_open_local_chain_without_a_path_is_in_memory(tmp_path: Path) -> None:
    with open_local_chain(None) as chain:
        chain.produce_block(1)
        assert chain.head == 1
    assert list(tmp_path.iterdir()) == []


def test_a_torn_last_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "chain.jsonl"
    with open_local_chain(path) as chain:
        tx = chain.submit(root(1), key="a")
        chain.produce_block(1_000)
    with path.open("a", encoding="utf-8") as f:
        f.write('{"op":"block","ti')  # the crash cut this write short
    with open_local_chain(path) as chain:
        assert chain.head == 1
        assert chain.status(tx).confirmations == 1
        chain.produce_block(2_000)  # the chain goes on after the torn line
        chain.produce_block(3_000)
    # ... and what it wrote after the restart survives the next restart.
    with open_local_chain(path) as chain:
        assert chain.head == 3
        assert chain.status(tx).confirmations == 3
    assert [e["op"] for e in _chain_lines(path)] == ["submit", "block", "block", "block"]


def test_a_complete_last_line_without_its_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "chain.jsonl"
    path.write_text('{"op":"block","time":5}', encoding="utf-8")
    with open_local_chain(path) as chain:
        assert chain.head == 1
        chain.produce_block(6)
    with open_local_chain(path) as chain:
        assert chain.head == 2


def test_a_corrupt_line_before_the_last_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "chain.jsonl"
    path.write_text('{"op":"block","time":5}\n{"op":"blo\n{"op":"block","time":6}\n', "utf-8")
    with pytest.raises(ValueError, match="line 2 is corrupt"), open_local_chain(path):
        pass  # pragma: no cover
    assert path.read_text("utf-8").count("\n") == 3  # left as found, for an operator


def test_blank_lines_in_the_journal_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "chain.jsonl"
    path.write_text('{"op":"block","time":5}\n\n  \n{"op":"block","time":6}\n', "utf-8")
    with open_local_chain(path) as chain:
        assert chain.head == 2


def test_an_idle_chain_seals_no_block_once_its_last_transaction_is_settled() -> None:
    """The block producer asks `idle(settle)` before each block: the journal then grows with the
    anchoring done, not with time (issue 17: 130 empty blocks in 5 idle minutes)."""
    chain = LocalChain()
    assert chain.idle(4)  # nothing ever submitted
    chain.submit("ab" * 32, key="batch-1")
    assert not chain.idle(4)  # a transaction waits
    chain.produce_block(1_000)
    assert chain.mempool == 0
    for n in range(3):  # the block that carries it, and three more: 4 confirmations
        assert not chain.idle(4)
        chain.produce_block(2_000 + n)
    assert chain.idle(4)
    status = chain.status(chain.submit("ab" * 32, key="batch-1"))
    assert status.confirmations == 4
