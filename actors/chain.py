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
    events = _read_journal(path) if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as journal:

        def write(event: dict[str, Any]) -> None:
            journal.write(json.dumps(event, separators=(",", ":")) + "\n")
            journal.flush()

        yield LocalChain.replay(events, journal=write)


def _read_journal(path: Path) -> list[dict[str, Any]]:
    """The journal's events, the journal repaired for appending: only the last line may be
    torn (a write cut by a crash), and it is cut off, as a whole last event's missing newline
    is restored, so that what is appended next starts a line of its own. An unreadable line
    before the last is corruption, not a crash: refused rather than silently dropping every
    event after it."""
    data = path.read_bytes()
    events: list[dict[str, Any]] = []
    whole = 0  # the length of the prefix that holds whole events
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        if line.strip():
            try:
                event = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                event = None
            if not isinstance(event, dict):
                if line.endswith(b"\n") or whole + len(line) < len(data):
                    raise ValueError(f"local chain journal {path}: line {number} is corrupt")
                log.warning("local chain journal: ignoring a torn last line")
                break
            events.append(event)
        whole += len(line)
    unterminated = whole > 0 and not data[:whole].endswith(b"\n")
    if whole < len(data) or unterminated:
        with path.open("r+b") as f:
            f.truncate(whole)
            if unterminated:
                f.seek(whole)
                f.write(b"\n")
    return events


def load_local_chain(path: Path) -> LocalChain:
    """The local chain of a journal, read only (for an independent verifier): every whole
    event, a torn last line ignored, the file untouched."""
    events: list[dict[str, Any]] = []
    for line in path.read_bytes().splitlines():
        if line.strip():
            try:
                event = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                break
            if isinstance(event, dict):
                events.append(event)
    return LocalChain.replay(events)


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
    settle: int | None = None,
    task_status: trio.TaskStatus[LocalChain] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Own the local chain (and its journal file) until cancelled, sealing a block every
    `interval` seconds (0: blocks are sealed by the client's calls instead). With `settle`, a
    block only while the chain is not idle: a transaction waits, or the newest sealed one has
    fewer than `settle` confirmations (the finality depth, and one more)."""
    with open_local_chain(path) as chain:
        task_status.started(chain)
        if interval <= 0:
            await trio.sleep_forever()
        while True:
            await trio.sleep(interval)
            if settle is None or not chain.idle(settle):
                chain.produce_block(clock_ms())
