"""Anchoring across real `registry serve` processes on one database (design §2, §8).

- kill -9 of the anchoring process while batches are under way, then a restart on the same
  database and data directory (its local chain journal, `<data_dir>/chain.jsonl`): every intent
  ends confirmed exactly once — one confirmed receipt, one `anchor.updated` confirmed record in
  the log, no intent lost, no batch dropped (the journal brought the chain back).
- two processes on one database: only the leader (the advisory lock's holder) submits batches,
  also for the intents written through the other; when the leader is killed the other takes
  over within the lock's poll (2 s) and finishes.

The processes are external: progress is read from the database at short intervals, each wait
under a deadline.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import httpx

from cli.client import RegistryClient
from registry.anchoring import verify_anchor
from registry.chain import LocalChain
from registry.keys import SigningKey
from registry.merkle import MerkleProof, leaf_hash, verify_proof
from registry.store.pg import LEADERSHIP_POLL_SECONDS
from tests.db.proc import Server, run_server
from tests.helpers import entry_template

T = TypeVar("T")

ENTRIES = 30
BLOCK_SECONDS = 0.2
ANCHORING_ENV = {
    "REGISTRY_ANCHORING__ENABLED": "true",
    "REGISTRY_ANCHORING__BLOCK_INTERVAL_SECONDS": str(BLOCK_SECONDS),
    "REGISTRY_ANCHORING__FINALITY_DEPTH": "2",
    # Small batches, two at a time: anchoring 30 entries takes several rounds of blocks, so a
    # kill lands mid-way, with batches open (all of them are resumed).
    "REGISTRY_ANCHORING__BATCH_SIZE": "4",
    "REGISTRY_ANCHORING__BATCHES_IN_FLIGHT": "2",
}
LEADER_LINE = "this process is the anchoring leader"
POLL = 0.05


class Db:
    """One asyncpg connection driven from synchronous test code."""

    def __init__(self, url: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._conn = self._loop.run_until_complete(asyncpg.connect(url))

    def fetch(self, sql: str, *args: Any) -> list[Any]:
        return list(self._loop.run_until_complete(self._conn.fetch(sql, *args)))

    def fetchval(self, sql: str, *args: Any) -> Any:
        return self._loop.run_until_complete(self._conn.fetchval(sql, *args))

    def close(self) -> None:
        self._loop.run_until_complete(self._conn.close())
        self._loop.close()


@contextmanager
def database(url: str) -> Iterator[Db]:
    db = Db(url)
    try:
        yield db
    finally:
        db.close()


def wait_until(what: str, probe: Callable[[], T | None], deadline_s: float) -> T:
    """Poll `probe` until it returns something other than None (or False)."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {deadline_s}s: {what}")
        time.sleep(POLL)


def publish(url: str, count: int) -> dict[str, dict[str, Any]]:
    """`count` new entries of one publisher: entry DID → the served entry."""
    key = SigningKey.generate()
    tag = secrets.token_hex(4)
    with RegistryClient(url) as client:
        client.sign_in(key)
        published = [
            client.publish(entry_template(f"did:web:anchoring.test:{tag}:{n}"), key)
            for n in range(count)
        ]
    return {e["entryDid"]: e for e in published}


def states(db: Db, dids: list[str]) -> dict[str, int]:
    rows = db.fetch(
        "SELECT state, count(*) AS n FROM anchor_intents WHERE entry_did = ANY($1::text[])"
        " GROUP BY state",
        dids,
    )
    return {r["state"]: r["n"] for r in rows}


def all_confirmed(db: Db, dids: list[str]) -> bool:
    return states(db, dids) == {"confirmed": len(dids)}


def submits(data_dir: Path) -> list[dict[str, Any]]:
    """The submissions in a process's local chain journal."""
    journal = data_dir / "chain.jsonl"
    if not journal.exists():
        return []
    events = [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]
    return [e for e in events if e["op"] == "submit"]


def chain_of(data_dir: Path) -> LocalChain:
    journal = data_dir / "chain.jsonl"
    return LocalChain.replay(json.loads(line) for line in journal.read_text().splitlines())


def check_confirmed_exactly_once(db: Db, published: dict[str, dict[str, Any]]) -> None:
    """Each entry has one intent, for its version; each intent is confirmed, with exactly one
    confirmed receipt and exactly one `anchor.updated` confirmed record in the log."""
    dids = list(published)
    intents = db.fetch(
        "SELECT intent_id, entry_did, sequence, item_data_hash, state, attempts"
        " FROM anchor_intents WHERE entry_did = ANY($1::text[])",
        dids,
    )
    assert len(intents) == len(dids)
    for row in intents:
        entry = published[row["entry_did"]]
        assert row["intent_id"] == f"ai_{entry['sequence']}"
        assert row["sequence"] == entry["sequence"]
        assert row["item_data_hash"] == entry["itemDataHash"]
        assert row["state"] == "confirmed"
    receipts = db.fetch(
        "SELECT r.intent_id, count(*) FILTER (WHERE b.state = 'confirmed') AS confirmed,"
        " count(*) FILTER (WHERE b.state IN ('claimed', 'submitted')) AS open"
        " FROM anchor_receipts r JOIN anchor_batches b USING (batch_id)"
        " JOIN anchor_intents i USING (intent_id)"
        " WHERE i.entry_did = ANY($1::text[]) GROUP BY r.intent_id",
        dids,
    )
    assert len(receipts) == len(dids)
    assert all(r["confirmed"] == 1 and r["open"] == 0 for r in receipts), receipts
    events = db.fetch(
        "SELECT data ->> 'intentId' AS intent, count(*) AS n FROM log"
        " WHERE kind = 'anchor.updated' AND data ->> 'state' = 'confirmed'"
        " AND entry_did = ANY($1::text[]) GROUP BY 1",
        dids,
    )
    assert sorted((e["intent"], e["n"]) for e in events) == sorted(
        (f"ai_{e['sequence']}", 1) for e in published.values()
    )
    head = db.fetchval("SELECT seq FROM log_head")
    count, top = db.fetch("SELECT count(*), coalesce(max(seq), 0) FROM log")[0]
    assert count == top == head, "the log has a gap"


def check_served_anchors(
    server: Server, published: dict[str, dict[str, Any]], chains: dict[str, LocalChain]
) -> dict[str, list[str]]:
    """GET /v1/anchors of every entry: anchored, one confirmed receipt, a proof that verifies
    against the served version and the roots of its block on the chain that holds its
    transaction. Returns entry DID → the keys of `chains` whose chain holds its anchor."""
    where: dict[str, str] = {}
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for did, entry in published.items():
            listing = http.get(f"/v1/anchors/{did}").json()
            assert listing["anchorState"] == "anchored", listing
            [record] = listing["records"]
            assert record["state"] == "confirmed"
            assert [r["state"] for r in record["receipts"]].count("confirmed") == 1
            anchor = record["anchor"]
            proof = MerkleProof.from_json(anchor["proof"])
            leaf = leaf_hash(did, entry["sequence"], entry["itemDataHash"])
            assert verify_proof(proof, leaf)
            # The chain(s) holding the transaction in that block with that root. (After a
            # leader change one batch can be on both: submitted by the dead leader just before
            # it died, before the submission was recorded, then again under the same key.)
            holders = [
                name
                for name, chain in chains.items()
                if chain.status(anchor["txHash"]).block_height == anchor["blockHeight"]
                and chain.status(anchor["txHash"]).block_root == proof.root
            ]
            assert holders, did
            chain = chains[holders[0]]
            version = http.get(f"/v1/entries/{did}/versions/{entry['sequence']}").json()
            check = verify_anchor(version, anchor, chain.block_roots(anchor["blockHeight"]))
            assert check.ok, check.problems
            assert http.get(f"/v1/entries/{did}").json()["anchorState"] == "anchored"
            where[did] = holders
    return where


def test_kill_9_while_anchoring_then_restart_confirms_every_intent_exactly_once(
    tmp_path: Path, database_url: str
) -> None:
    data_dir = tmp_path / "data"
    with database(database_url) as db:
        with run_server(data_dir, database_url=database_url, extra_env=ANCHORING_ENV) as server:
            published = publish(server.url, ENTRIES)
            dids = list(published)

            def under_way() -> dict[str, int] | None:
                now = states(db, dids)
                return now if now.get("confirmed", 0) >= 8 and now.get("submitted") else None

            at_kill = wait_until("some batches confirmed, one submitted", under_way, 20)
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(timeout=10)
            assert server.proc.returncode == -signal.SIGKILL
        left = states(db, dids)
        assert left.get("confirmed", 0) < ENTRIES, (at_kill, left)
        assert submits(data_dir), "the chain journal has the submissions"

        with run_server(data_dir, database_url=database_url, extra_env=ANCHORING_ENV) as again:
            wait_until("every intent confirmed", lambda: all_confirmed(db, dids), 30)
            check_confirmed_exactly_once(db, published)
            check_served_anchors(again, published, {"data": chain_of(data_dir)})
        # The journal brought the chain back: the batch open at the kill was finished on it,
        # never dropped and re-anchored.
        dropped = db.fetchval(
            "SELECT count(*) FROM anchor_receipts r JOIN anchor_batches b USING (batch_id)"
            " JOIN anchor_intents i USING (intent_id)"
            " WHERE i.entry_did = ANY($1::text[]) AND b.state = 'dropped'",
            dids,
        )
        assert dropped == 0
        attempts = db.fetchval(
            "SELECT max(attempts) FROM anchor_intents WHERE entry_did = ANY($1::text[])", dids
        )
        assert attempts == 1
    assert "Traceback" not in again.output()


def test_only_the_leader_anchors_and_the_other_takes_over_when_it_dies(
    tmp_path: Path, database_url: str
) -> None:
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    with (
        database(database_url) as db,
        run_server(dir_a, database_url=database_url, extra_env=ANCHORING_ENV) as a,
    ):
        wait_until("a leads", lambda: LEADER_LINE in a.output(), 10)
        with run_server(dir_b, database_url=database_url, extra_env=ANCHORING_ENV) as b:
            # Written through b, anchored by a.
            published = publish(b.url, ENTRIES)
            dids = list(published)

            def under_way() -> dict[str, int] | None:
                now = states(db, dids)
                return now if now.get("confirmed", 0) >= 8 and now.get("submitted") else None

            wait_until("some batches confirmed, one submitted", under_way, 20)
            assert LEADER_LINE not in b.output()
            assert submits(dir_a)
            assert submits(dir_b) == [], "b submitted while a led"

            a.proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            a.proc.wait(timeout=10)
            wait_until("b leads", lambda: LEADER_LINE in b.output(), 10)
            takeover = time.monotonic() - killed
            # The lock is polled every 2 s; a dead session's lock is released at once.
            assert takeover < LEADERSHIP_POLL_SECONDS + 1.5, takeover

            wait_until("every intent confirmed", lambda: all_confirmed(db, dids), 30)
            check_confirmed_exactly_once(db, published)
            where = check_served_anchors(b, published, {"a": chain_of(dir_a), "b": chain_of(dir_b)})
            # Both led in turn: a anchored the first batches, b the rest.
            assert any(holders == ["a"] for holders in where.values())
            assert any("b" in holders for holders in where.values())
        assert "Traceback" not in b.output()
