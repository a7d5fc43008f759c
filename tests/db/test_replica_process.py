"""Reads from a real streaming replica (`database.read_url`, docs/replicas.md).

The test starts its own primary (an embedded cluster) and a hot standby copied from it with
`pg_basebackup -R` (`EmbeddedPostgres.start(replica_of=...)`), and two `registry serve`
processes reading from the standby: A, through which the test writes, and B, which only reads.
Pausing the standby's replay makes its lag as long as the test needs, so each rule is seen
from outside: B's GETs come from the replica (they miss what it has not replayed), A's client
reads its own writes, a client naming the sequence it got reads it anywhere, a write's decision
reads the primary, the event stream follows the replica, and a replica that goes away leaves
reads on the primary until it is back.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from cli.client import RegistryClient, RegistryClientError
from registry.keys import SigningKey
from registry.store.embedded import EmbeddedPostgres
from tests.db.proc import Server, run_server
from tests.helpers import entry_template

DEADLINE = 20.0


@pytest.fixture(scope="module")
def primary_and_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, ...]]:
    root = tmp_path_factory.mktemp("replica")
    primary = EmbeddedPostgres(root / "primary")
    primary_url = primary.start()
    standby = EmbeddedPostgres(root / "standby")
    try:
        replica_url = standby.start(replica_of=primary_url)
        try:
            yield primary_url, replica_url, standby
        finally:
            standby.stop()
    finally:
        primary.stop()


def sql(url: str, statement: str) -> Any:
    """One statement on `url` (asyncpg in a thread of its own: the test's Trio loop is busy)."""
    import asyncio

    import asyncpg

    async def run() -> Any:
        conn = await asyncpg.connect(url)
        try:
            return await conn.fetchval(statement)
        finally:
            await conn.close()

    return asyncio.run(run())


def status(server: Server, did: str, headers: dict[str, str] | None = None) -> int:
    url = f"{server.url}/v1/entries/{did}"
    return httpx.get(url, headers=headers or {}, timeout=10).status_code


def versions(server: Server, did: str) -> int:
    return httpx.get(f"{server.url}/v1/entries/{did}/versions", timeout=10).status_code


def reads(server: Server, database: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    line = f'registry_db_reads_total{{database="{database}"}} '
    return sum(float(row.split()[-1]) for row in text.splitlines() if row.startswith(line))


def gauge(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    [value] = [row.split()[-1] for row in text.splitlines() if row.startswith(name + " ")]
    return float(value)


def eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not check():
        assert time.monotonic() < deadline, f"not within {DEADLINE}s: {what}"
        time.sleep(0.05)


async def next_event(ws: WebSocketConnection, did: str) -> dict[str, Any]:
    with trio.fail_after(DEADLINE):
        while True:
            message = json.loads(await ws.get_message())
            if message["type"] == "event" and message["entryDid"] == did:
                return dict(message)


async def test_reads_come_from_the_replica_and_stay_consistent(
    primary_and_replica: tuple[Any, ...], tmp_path: Path
) -> None:
    primary_url, replica_url, standby = primary_and_replica
    env = {"REGISTRY_DATABASE__READ_URL": replica_url, "REGISTRY_METRICS__OPEN": "true"}
    key = SigningKey.generate()
    tag = secrets.token_hex(4)
    x, y, z = (f"did:web:replica.test:{tag}:{n}" for n in "xyz")
    with (
        run_server(tmp_path / "a", database_url=primary_url, extra_env=env) as a,
        # B only reads: it must not be the checkpointer, whose look at the primary's log head
        # every second counts as seen (then B's reads would go to the primary by design).
        run_server(
            tmp_path / "b",
            database_url=primary_url,
            extra_env={**env, "REGISTRY_TRANSPARENCY__ENABLED": "false"},
        ) as b,
        RegistryClient(a.url) as writer,
        RegistryClient(b.url) as other,
    ):
        writer.sign_in(key)
        other.sign_in(key)
        async with open_websocket_url(b.url.replace("http://", "ws://") + "/v1/events") as ws:
            await ws.send_message(json.dumps({"type": "subscribe", "entryDids": [x, y, z]}))

            def replicated() -> int:
                # Written through A, read through B once the replica has replayed it.
                created = writer.publish(entry_template(x), key)
                assert status(a, x) == 200  # A's client reads its own write at once
                eventually(lambda: status(b, x) == 200, "B reads x from the replica")
                return int(created["sequence"])

            x_seq = await trio.to_thread.run_sync(replicated)
            assert (await next_event(ws, x))["sequence"] == x_seq

            def while_replay_paused() -> int:
                sql(replica_url, "SELECT pg_wal_replay_pause()")
                from_replica = reads(b, "replica")
                created = writer.publish(entry_template(y), key)
                sequence = int(created["sequence"])
                # The writing process reads its write: its replica has not replayed it.
                assert writer.get(y)["sequence"] == sequence
                # B's reads come from the paused replica: y is not there yet ...
                assert status(b, y) == 404
                assert reads(b, "replica") > from_replica
                # What the RegistryReplicaBehind alert reads (deploy/registry-alerts.yml): B
                # writes nothing, yet its lag shows (it reads the primary's head every second).
                assert gauge(b, "registry_replica_replayed_sequence") == x_seq
                eventually(
                    lambda: gauge(b, "registry_replica_lag_records") >= sequence - x_seq,
                    "B's lag counts what the primary holds",
                )
                # ... unless the client names the sequence it got: then the primary answers.
                assert status(b, y, {"Registry-Min-Sequence": str(sequence)}) == 200
                assert status(b, y, {"Registry-Min-Sequence": "-1"}) == 400
                return sequence

            y_seq = await trio.to_thread.run_sync(while_replay_paused)
            with trio.move_on_after(0.5):  # B follows the log on its paused replica
                await next_event(ws, y)
                raise AssertionError("an event B's replica has not replayed was delivered")

            def decisions_read_the_primary() -> None:
                # An update based on x's head, through B after a GET on the same connection:
                # the decision reads the primary (the replica's x is as fresh here, but B's
                # update makes B's own write the newest it has seen).
                assert other.get(x)["sequence"] == x_seq
                writer.update(entry_template(x, version="1.0.1"), key, based_on=x_seq)
                head = writer.get(x)["sequence"]
                assert status(b, x) == 200  # B's x is still the replica's (or its cache's)
                updated = other.update(entry_template(x, version="1.0.2"), key, based_on=head)
                assert updated["sequence"] > head
                with pytest.raises(RegistryClientError) as stale:
                    other.update(entry_template(x, version="1.0.3"), key, based_on=head)
                assert stale.value.code == "sequence_conflict"
                # B wrote past its replica: its reads now come from the primary.
                assert other.get(x)["sequence"] == updated["sequence"]

            await trio.to_thread.run_sync(decisions_read_the_primary)

            def resumed() -> None:
                sql(replica_url, "SELECT pg_wal_replay_resume()")
                eventually(lambda: status(b, y) == 200, "B reads y once replay resumes")

            await trio.to_thread.run_sync(resumed)
            assert (await next_event(ws, y))["sequence"] == y_seq

            def replica_gone() -> int:
                standby.stop()
                # Reads fall back to the primary (the first failing one included; the version
                # list is never cached, so each of these reads the store).
                assert versions(b, x) == 200
                assert httpx.get(f"{b.url}/v1/health", timeout=10).status_code == 200
                return int(writer.publish(entry_template(z), key)["sequence"])

            z_seq = await trio.to_thread.run_sync(replica_gone)
            # The log is followed on the primary meanwhile: events keep coming.
            assert (await next_event(ws, z))["sequence"] == z_seq

            def replica_back() -> None:
                standby.start()
                from_replica = reads(b, "replica")
                eventually(
                    lambda: versions(b, z) == 200 and reads(b, "replica") > from_replica,
                    "B reads from the replica again once it is back",
                )

            await trio.to_thread.run_sync(replica_back)
            await ws.aclose()
        for server in (a, b):
            assert "Traceback" not in server.output()
        assert "the read replica cannot be reached" in b.output()
