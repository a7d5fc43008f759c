"""The built-in local chain as a running service: its journal file, its block producer, and the
client the anchoring supervisor talks to (the `Chain` port of registry/chain.py).

With `block_interval_seconds` > 0 a task seals a block on that timer. With 0, blocks are
"instant": every call of the client seals one first (a block per submission and per poll),
which is what the anchoring benchmark measures.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio

from registry.anchoring import ChainStatus
from registry.chain import LocalChain

log = logging.getLogger(__name__)


@contextmanager
def open_local_chain(path: Path | None) -> Iterator[LocalChain]:
    """The local chain, replayed from its journal at `path` (JSON lines, appended and flushed
    as the chain changes), or in memory only when `path` is None."""
    if path is None:
        yield LocalChain()
        return
    events: list[dict[str, Any]] = []
    if path.exists():
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                if line.strip():
                    try:
                        events.append(json.loads(line))
                    except json.JSONDecodeError:  # a line cut by a crash: the rest is lost
                        log.warning("local chain journal: ignoring a torn last line")
                        break
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as journal:

        def write(event: dict[str, Any]) -> None:
            journal.write(json.dumps(event, separators=(",", ":")) + "\n")
            journal.flush()

        yield LocalChain.replay(events, journal=write)


class LocalChainClient:
    """The `Chain` port over a `LocalChain` in this process."""

    def __init__(self, chain: LocalChain, *, instant: bool, clock_ms: Callable[[], int]) -> None:
        self.chain = chain
        self.instant = instant
        self.clock_ms = clock_ms

    async def submit(self, root: str, *, key: str) -> str:
        await trio.lowlevel.checkpoint()
        tx_id = self.chain.submit(root, key=key)
        if self.instant:
            self.chain.produce_block(self.clock_ms())
        return tx_id

    async def status(self, tx_id: str) -> ChainStatus:
        await trio.lowlevel.checkpoint()
        if self.instant:
            self.chain.produce_block(self.clock_ms())
        return self.chain.status(tx_id)


async def run_local_chain(
    path: Path | None,
    *,
    interval: float,
    clock_ms: Callable[[], int],
    task_status: trio.TaskStatus[LocalChain] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Own the local chain (and its journal file) until cancelled, sealing a block every
    `interval` seconds (0: blocks are sealed by the client's calls instead)."""
    with open_local_chain(path) as chain:
        task_status.started(chain)
        if interval <= 0:
            await trio.sleep_forever()
        while True:
            await trio.sleep(interval)
            chain.produce_block(clock_ms())
