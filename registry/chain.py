"""The anchoring chain: the port a chain client implements, and the built-in local chain.

**The port** (`Chain`) is what the anchoring supervisor needs from any chain:

- `submit(root, key)` → a transaction id. Idempotent by `key` (the batch id): submitting the
  same key again returns the same transaction, so a supervisor that crashed between submitting
  and recording the transaction never anchors a batch twice.
- `status(tx_id)` → `ChainStatus` (registry.anchoring): `pending` (known, not in a block),
  `included` (block height and hash, confirmations = head − height + 1, the root the
  transaction put in that block, the block's time) or `dropped` (unknown: never seen, dropped,
  or removed by a re-org).
- Any call may raise `ChainUnavailable` (an RPC failure): the supervisor backs off and retries.
  It treats a call that hangs past `CHAIN_CALL_SECONDS` (actors/anchoring.py), or answers
  outside the above (`registry.anchoring.chain_answer_problem`), the same way.

A real chain adapter implements these two calls (an EVM client, for example, would put the root
in a transaction's calldata or a contract event and read the receipt and the head).

**The local chain** (`LocalChain`) is a deterministic simulation with the same behaviour,
driven by the caller (a block producer task on a timer, `actors/chain.py`): a mempool, blocks
that include every ready transaction, a head, and injectable faults — `drop_next(n)` (the next n
submissions vanish), `delay_next(n, blocks)` (the next n submissions wait that many blocks),
`reorg(k)` (the last k blocks are replaced by empty ones; their transactions are gone, as a
dropped transaction), `fail_next(n)` (the next n calls raise `ChainUnavailable`). It is durable
through an optional journal: every event it applies is handed to `journal` as a JSON-safe dict,
and `LocalChain.replay(events)` rebuilds the same chain after a restart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from registry.anchoring import ChainStatus


class ChainUnavailable(Exception):
    """The chain could not be reached or answered with an error; try again later."""


class Chain(Protocol):
    async def submit(self, root: str, *, key: str) -> str: ...
    async def status(self, tx_id: str) -> ChainStatus: ...


@dataclass
class _Tx:
    tx_id: str
    root: str
    ready_at: int  # the first block height that may include it
    height: int | None = None


@dataclass
class _Block:
    height: int
    hash: str
    time_ms: int
    txs: list[str] = field(default_factory=list)


Journal = Callable[[dict[str, Any]], None]


class LocalChain:
    """The simulated chain's state (see the module docstring). Not thread-safe; one owner."""

    def __init__(self, journal: Journal | None = None) -> None:
        self._journal = journal
        self._txs: dict[str, _Tx] = {}
        self._by_key: dict[str, str] = {}
        self._blocks: list[_Block] = [_Block(0, _hash("genesis"), 0)]
        self._drop = 0
        self._delay: list[int] = []  # blocks to wait, for each of the next submissions
        self._fail = 0
        self.calls = 0
        self._last_reorged: list[str] = []
        self._waiting: dict[str, _Tx] = {}  # transactions not in a block yet (the mempool)
        self._last_busy: int | None = None  # the newest block that carries a transaction

    # --- faults ---------------------------------------------------------------------------

    def drop_next(self, n: int = 1) -> None:
        self._drop += n

    def delay_next(self, n: int, blocks: int) -> None:
        self._delay.extend([blocks] * n)

    def fail_next(self, n: int = 1) -> None:
        self._fail += n

    def reorg(self, k: int) -> list[str]:
        """Replace the last `k` blocks (never genesis) with empty ones; return the transactions
        that are gone."""
        self._apply({"op": "reorg", "k": k})
        return self._last_reorged

    # --- the port's calls (synchronous; the async client wraps them) ------------------------

    def check(self) -> None:
        """A call reaching the chain: raises `ChainUnavailable` while a failure is injected."""
        self.calls += 1
        if self._fail:
            self._fail -= 1
            raise ChainUnavailable("injected RPC failure")

    def submit(self, root: str, *, key: str) -> str:
        self.check()
        if key in self._by_key:
            return self._by_key[key]
        tx_id = _hash(f"tx:{key}:{root}")
        if self._drop:
            self._drop -= 1
            # Accepted, then lost: status says dropped, and so does a replay (journaled, or a
            # restart would accept the key's resubmission as a new transaction).
            self._apply({"op": "drop", "key": key, "tx": tx_id})
            return tx_id
        wait = self._delay.pop(0) if self._delay else 0
        self._apply({"op": "submit", "key": key, "root": root, "tx": tx_id, "wait": wait})
        return tx_id

    def status(self, tx_id: str) -> ChainStatus:
        self.check()
        tx = self._txs.get(tx_id)
        if tx is None:
            return ChainStatus("dropped")
        if tx.height is None:
            return ChainStatus("pending")
        block = self._blocks[tx.height]
        return ChainStatus(
            "included",
            block_height=block.height,
            block_hash=block.hash,
            confirmations=self.head - block.height + 1,
            block_root=tx.root,
            block_time_ms=block.time_ms,
        )

    def produce_block(self, now_ms: int) -> int:
        """Seal the next block with every transaction ready for it; return its height."""
        self._apply({"op": "block", "time": now_ms})
        return self.head

    # --- reads ------------------------------------------------------------------------------

    @property
    def head(self) -> int:
        return self._blocks[-1].height

    @property
    def mempool(self) -> int:
        return len(self._waiting)

    def idle(self, settle: int) -> bool:
        """Nothing to seal: no transaction waits for a block, and the newest that was sealed
        has `settle` confirmations (as final as anyone asks). An idle chain seals no block, so
        its journal grows with the anchoring it does, not with time."""
        settled = self._last_busy is None or self.head - self._last_busy + 1 >= settle
        return not self._waiting and settled

    def block_roots(self, height: int) -> list[str]:
        """The roots anchored in block `height` (what an independent verifier checks)."""
        if not 0 <= height <= self.head:
            return []
        return [self._txs[t].root for t in self._blocks[height].txs if t in self._txs]

    # --- events: applied live and on replay ----------------------------------------------

    @classmethod
    def replay(cls, events: Iterable[dict[str, Any]], journal: Journal | None = None) -> LocalChain:
        chain = cls()
        for event in events:
            chain._apply(event)
        chain._journal = journal
        return chain

    def _apply(self, event: dict[str, Any]) -> None:
        op = event["op"]
        if op == "submit":
            tx = _Tx(event["tx"], event["root"], self.head + 1 + int(event["wait"]))
            self._txs[tx.tx_id] = tx
            self._by_key[event["key"]] = tx.tx_id
            self._waiting[tx.tx_id] = tx
        elif op == "drop":
            self._by_key[event["key"]] = event["tx"]
        elif op == "block":
            height = self.head + 1
            block = _Block(height, _hash(f"{self._blocks[-1].hash}:{height}:{event['time']}"), 0)
            block.time_ms = int(event["time"])
            for tx in list(self._waiting.values()):  # in submission order, as before
                if tx.ready_at <= height:
                    tx.height = height
                    block.txs.append(tx.tx_id)
                    del self._waiting[tx.tx_id]
            if block.txs:
                self._last_busy = height
            self._blocks.append(block)
        elif op == "reorg":
            k = min(int(event["k"]), self.head)
            gone: list[str] = []
            for block in self._blocks[len(self._blocks) - k :]:
                for tx_id in block.txs:
                    self._txs.pop(tx_id, None)
                    gone.append(tx_id)
                block.txs = []
                block.hash = _hash(f"reorged:{block.hash}")
            self._last_reorged = gone
        else:  # pragma: no cover - a journal from a newer version
            raise ValueError(f"unknown chain event {op!r}")
        if self._journal is not None:
            self._journal(event)


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
