"""The append path's invariants with several real processes writing at once (docs/architecture.md,
"The critical section"), every kind of writer at the same time:

- three `registry serve` on one database take entry creates and updates, attestations and
  reports, and idempotent retries sent to two processes at once;
- every process anchors (a fast local chain) and pulls an origin registry (its own database,
  publishing all the while): one of them leads each, and its claims, settlements and replica
  imports go through the same append path;
- a fourth process, started first so that it leads both, is killed with SIGKILL in the middle
  of its burst of creates, and the others take the leadership over;
- a live subscriber of a fifth listens.

Afterwards: the log is gap-free; every acknowledged write is in it once, at the position its
answer named; a key sent to two processes at once took effect once; the subscriber got every
acknowledged write's event, in order; every anchor intent is confirmed exactly once; every
version of the origin is held once as a replica."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, asynccontextmanager, contextmanager
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import httpx
import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from cli.client import RegistryClient
from registry.keys import SigningKey, write_key_file
from registry.vc import issue_credential
from tests.db.proc import Server, databases, free_port, query, run_server
from tests.helpers import signed_entry

WRITERS_PER_PROCESS = 6
ENTRIES_PER_WRITER = 5
WRITES_PER_ENTRY = 4  # create, attestation, report, update
DUPLICATED_KEYS = 10  # each: an entry and an attestation, sent to two processes at once
ORIGIN_ENTRIES = 12
DEADLINE = 120

T = TypeVar("T")
STATE_URL: list[str] = []  # the database `wait_until` reports on

ANCHORING_ENV = {
    "REGISTRY_ANCHORING__ENABLED": "true",
    "REGISTRY_ANCHORING__BLOCK_INTERVAL_SECONDS": "0.2",
    "REGISTRY_ANCHORING__FINALITY_DEPTH": "2",
    "REGISTRY_ANCHORING__BATCH_SIZE": "16",
    "REGISTRY_ANCHORING__BATCHES_IN_FLIGHT": "2",
}
ANCHORING_LEADER = "this process is the anchoring leader"
FEDERATION_LEADER = "federation: this process pulls from its peers"


def peer(key: SigningKey, url: str) -> dict[str, Any]:
    return {
        "peer_did": key.did,
        "endpoint": url,
        "agreement_ids": ["default"],
        "kinds": ["sync", "discover"],
    }


def node_env(key_file: Path, peers: list[dict[str, Any]]) -> dict[str, str]:
    return {
        "REGISTRY_SERVER__KEY_FILE": str(key_file),
        "REGISTRY_FEDERATION__PEERS": json.dumps(peers),
        "REGISTRY_FEDERATION__POLL_SECONDS": "0.2",
        # Peers polling a node keep it in Hypercorn's graceful shutdown: keep teardowns short.
        "REGISTRY_SERVER__GRACEFUL_TIMEOUT_SECONDS": "1",
    }


@contextmanager
def registry_and_origin(
    tmp_path: Path, database_url: str, names: list[str]
) -> Iterator[tuple[dict[str, Server], Server, SigningKey, str, str]]:
    """The registry's processes on a fresh database of `database_url`'s server (the session's
    holds other tests' intents, abandoned ones among them), one key for all of them, the first
    started alone until it leads anchoring and federation; and an origin registry on its own
    database, each the other's peer (the origin pulls from the last process). Yields the
    processes by name, the origin, the origin's key, its database and the registry's."""
    ours, theirs = SigningKey.generate(), SigningKey.generate()
    write_key_file(tmp_path / "registry.key", ours)
    write_key_file(tmp_path / "origin.key", theirs)
    ports = {name: free_port() for name in [*names, "origin"]}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    env = {**node_env(tmp_path / "registry.key", [peer(theirs, url["origin"])]), **ANCHORING_ENV}
    with ExitStack() as stack:
        new_database = stack.enter_context(databases(database_url))
        ours_database, origin_database = new_database(), new_database()
        origin = stack.enter_context(
            run_server(
                tmp_path / "origin",
                database_url=origin_database,
                extra_env=node_env(tmp_path / "origin.key", [peer(ours, url[names[-1]])]),
                port=ports["origin"],
            )
        )
        started: dict[str, Server] = {}
        for name in names:
            started[name] = stack.enter_context(
                run_server(
                    tmp_path / name, database_url=ours_database, extra_env=env, port=ports[name]
                )
            )
            if name == names[0]:
                wait_for_lines(started[name], [ANCHORING_LEADER, FEDERATION_LEADER])
        yield started, origin, theirs, origin_database, ours_database


@asynccontextmanager
async def entered_in_a_thread(manager: AbstractContextManager[T]) -> AsyncIterator[T]:
    """`manager`, entered and exited in a worker thread (it starts processes and runs asyncio)."""
    value = await trio.to_thread.run_sync(manager.__enter__)
    try:
        yield value
    except BaseException as exc:
        with trio.CancelScope(shield=True):
            exit_ = partial(manager.__exit__, type(exc), exc, exc.__traceback__)
            if not await trio.to_thread.run_sync(exit_):
                raise
    else:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(manager.__exit__, None, None, None)


def wait_for_lines(server: Server, lines: list[str]) -> None:
    deadline = time.monotonic() + 30
    while not all(line in server.output() for line in lines):
        assert time.monotonic() < deadline, f"not within 30 s: {lines}\n{server.output()}"
        time.sleep(0.05)


async def log_rows(database_url: str, after: int) -> list[tuple[int, str, str | None]]:
    def read() -> list[tuple[int, str, str | None]]:
        async def run() -> list[tuple[int, str, str | None]]:
            conn = await asyncpg.connect(database_url)
            try:
                rows = await conn.fetch(
                    "SELECT seq, kind, entry_did FROM log WHERE seq > $1 ORDER BY seq", after
                )
                head = await conn.fetchval("SELECT seq FROM log_head")
            finally:
                await conn.close()
            assert head == (rows[-1]["seq"] if rows else after)
            return [(r["seq"], r["kind"], r["entry_did"]) for r in rows]

        return asyncio.run(run())

    return await trio.to_thread.run_sync(read)


class Subscriber:
    """Collects the sequences of the events a WebSocket delivers; `has(wanted)` waits for them."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._wanted: set[int] | None = None
        self._all_in = trio.Event()

    async def collect(self, ws: WebSocketConnection) -> None:
        while True:
            message = json.loads(await ws.get_message())
            if message["type"] == "event":
                self.received.append(message["sequence"])
                self._check()

    def _check(self) -> None:
        if self._wanted is not None and self._wanted <= set(self.received):
            self._all_in.set()

    async def has(self, wanted: set[int]) -> None:
        self._wanted = wanted
        self._check()
        await self._all_in.wait()


def sequences(url: str, sql: str, *args: Any) -> list[int]:
    return [row[0] for row in query(url, sql, *args)]


def anchored_exactly_once(database_url: str) -> dict[int, str]:
    """Every anchor intent confirmed, with one confirmed receipt and one `anchor.updated`
    confirmed record each: the entry version's sequence → its intent's state."""
    intents = query(database_url, "SELECT intent_id, sequence, state FROM anchor_intents")
    assert {r["intent_id"] for r in intents} == {f"ai_{r['sequence']}" for r in intents}
    receipts = query(
        database_url,
        "SELECT r.intent_id, count(*) FILTER (WHERE b.state = 'confirmed') AS confirmed,"
        " count(*) FILTER (WHERE b.state IN ('claimed', 'submitted')) AS open"
        " FROM anchor_receipts r JOIN anchor_batches b USING (batch_id) GROUP BY r.intent_id",
    )
    assert all(r["confirmed"] == 1 and r["open"] == 0 for r in receipts), receipts
    assert {r["intent_id"] for r in receipts} == {r["intent_id"] for r in intents}
    confirmations = query(
        database_url,
        "SELECT data ->> 'intentId' AS intent, count(*) AS n FROM log"
        " WHERE kind = 'anchor.updated' AND data ->> 'state' = 'confirmed' GROUP BY 1",
    )
    assert sorted((r["intent"], r["n"]) for r in confirmations) == sorted(
        (r["intent_id"], 1) for r in intents
    )
    return {r["sequence"]: r["state"] for r in intents}


def all_confirmed(database_url: str) -> bool:
    states = query(database_url, "SELECT DISTINCT state FROM anchor_intents")
    return [r["state"] for r in states] == ["confirmed"]


def replicas_match(database_url: str, origin_database: str, origin_did: str) -> bool:
    """The registry holds every version of the origin, each once."""
    held = sequences(
        database_url,
        "SELECT origin_seq FROM replica_versions WHERE origin_did = $1",
        origin_did,
    )
    assert len(held) == len(set(held)), "a replica version was imported twice"
    return set(held) == set(sequences(origin_database, "SELECT seq FROM entry_versions"))


def wait_until(
    what: str, probe: Callable[[], bool], deadline_s: float = 90, state: str = ""
) -> None:
    """Poll `probe` (state written by other processes) until it is true; `state`, a query
    whose rows say where things stand when it is not."""
    deadline = time.monotonic() + deadline_s
    while not probe():
        if time.monotonic() > deadline:
            rows = [dict(r) for r in query(STATE_URL[0], state)] if state else []
            raise AssertionError(f"not within {deadline_s} s: {what}: {rows}")
        time.sleep(0.1)


# Killing a server mid-request makes httpx abandon its request-body generator (test_process).
@pytest.mark.filterwarnings("ignore:Async generator 'httpx:ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_processes_writing_at_once_keep_the_log_gap_free_and_exact(
    tmp_path: Path, database_url: str
) -> None:
    publisher, issuer, reporter, origin_publisher = (SigningKey.generate() for _ in range(4))
    names = ["doomed", "a", "b", "c", "listener"]
    nodes = registry_and_origin(tmp_path, database_url, names)
    async with entered_in_a_thread(nodes) as (started, origin, them, odb, database_url):
        doomed, a, b, c, listener = (started[name] for name in names)

        def session(url: str, key: SigningKey) -> str:
            with RegistryClient(url) as client:
                return str(client.sign_in(key)["sessionToken"])

        tokens = {
            key: await trio.to_thread.run_sync(session, a.url, key)
            for key in (publisher, issuer, reporter)
        }
        origin_token = await trio.to_thread.run_sync(session, origin.url, origin_publisher)
        start = (await log_rows(database_url, 0) or [(0, "", None)])[-1][0]
        acked: dict[int, str | None] = {}  # sequence -> entry DID, from the answers
        versions: set[int] = set()  # the acknowledged entry versions (each has an intent)
        duplicates: list[tuple[int, int]] = []
        subscriber = Subscriber()
        later = datetime.now(UTC) + timedelta(days=1)

        async def write(
            http: httpx.AsyncClient, method: str, path: str, body: Any, who: SigningKey, key: str
        ) -> int:
            headers = {"Authorization": f"Bearer {tokens[who]}", "Idempotency-Key": key}
            r = await http.request(method, path, json=body, headers=headers)
            assert r.status_code in (200, 201), r.text
            sequence = int(r.headers["Registry-Sequence"])
            if path.startswith("/v1/entries"):
                assert r.json()["sequence"] == sequence
                versions.add(sequence)
            return sequence

        async def attest(http: httpx.AsyncClient, did: str, key: str, vc: Any = None) -> int:
            vc = vc or issue_credential(issuer, subject_id=did, valid_until=later)
            body = {"attestation": vc, "entryDid": did}
            return await write(http, "POST", "/v1/attestations", body, issuer, key)

        async def writer(server: Server) -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                for _ in range(ENTRIES_PER_WRITER):
                    entry = signed_entry(publisher)
                    did = entry["entryDid"]
                    created = await write(http, "POST", "/v1/entries", entry, publisher, f"c-{did}")
                    acked[created] = did
                    acked[await attest(http, did, f"a-{did}")] = did
                    report = {"entryDid": did, "reason": "spam"}
                    acked[await write(http, "POST", "/v1/report", report, reporter, f"r-{did}")] = (
                        did
                    )
                    update = signed_entry(publisher, did, sequence=created, version="2.0.0")
                    path = f"/v1/entries/{did}"
                    acked[await write(http, "PUT", path, update, publisher, f"u-{did}")] = did

        async def duplicate() -> None:
            # One request, sent to two processes at once under one key: one effect. An entry,
            # then an attestation of it.
            entry = signed_entry(publisher)
            did = entry["entryDid"]
            vc = issue_credential(issuer, subject_id=did, valid_until=later)
            async with (
                httpx.AsyncClient(base_url=a.url, timeout=30) as ha,
                httpx.AsyncClient(base_url=b.url, timeout=30) as hb,
            ):
                for send in (
                    lambda http: write(http, "POST", "/v1/entries", entry, publisher, f"d-{did}"),
                    lambda http: attest(http, did, f"da-{did}", vc),
                ):
                    answers: list[int] = []
                    async with trio.open_nursery() as nursery:
                        for http in (ha, hb):

                            async def one(
                                http: httpx.AsyncClient = http,
                                send: Any = send,
                                answers: list[int] = answers,
                            ) -> None:
                                answers.append(await send(http))

                            nursery.start_soon(one)
                    duplicates.append((answers[0], answers[1]))
                    acked[answers[0]] = did

        async def origin_publishes() -> None:
            # The origin's own entries, imported by whichever process leads federation.
            bearer = {"Authorization": f"Bearer {origin_token}"}
            async with httpx.AsyncClient(base_url=origin.url, timeout=30) as http:
                for n in range(ORIGIN_ENTRIES):
                    entry = signed_entry(origin_publisher)
                    headers = {**bearer, "Idempotency-Key": f"o-{entry['entryDid']}"}
                    r = await http.post("/v1/entries", json=entry, headers=headers)
                    assert r.status_code == 201, r.text
                    if n % 3 == 0:
                        update = signed_entry(
                            origin_publisher,
                            entry["entryDid"],
                            sequence=r.json()["sequence"],
                            version="2.0.0",
                        )
                        path = f"/v1/entries/{entry['entryDid']}"
                        headers = {**bearer, "Idempotency-Key": f"ou-{entry['entryDid']}"}
                        r = await http.put(path, json=update, headers=headers)
                        assert r.status_code == 200, r.text
                    await trio.sleep(0.05)  # spread over the burst, before and after the kill

        doomed_acked: dict[int, str | None] = {}
        enough = trio.Event()

        async def burst_until_killed() -> None:
            async with httpx.AsyncClient(base_url=doomed.url, timeout=30) as http:

                async def one() -> None:
                    while True:
                        entry = signed_entry(publisher)
                        did = entry["entryDid"]
                        try:
                            sequence = await write(
                                http, "POST", "/v1/entries", entry, publisher, f"k-{did}"
                            )
                        except (httpx.HTTPError, AssertionError):
                            return  # the server died under us: nothing is promised
                        doomed_acked[sequence] = did
                        if len(doomed_acked) >= 20:
                            enough.set()

                async with trio.open_nursery() as nursery:
                    for _ in range(8):
                        nursery.start_soon(one)

        ws_url = listener.url.replace("http://", "ws://") + "/v1/events"
        with trio.fail_after(DEADLINE):
            async with open_websocket_url(ws_url) as ws, trio.open_nursery() as outer:
                await ws.send_message(json.dumps({"type": "subscribe", "fromSequence": start}))
                outer.start_soon(subscriber.collect, ws)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(burst_until_killed)
                    nursery.start_soon(origin_publishes)
                    for server in (a, b, c):
                        for _ in range(WRITERS_PER_PROCESS):
                            nursery.start_soon(writer, server)
                    for _ in range(DUPLICATED_KEYS):
                        nursery.start_soon(duplicate)
                    await enough.wait()
                    doomed.proc.send_signal(signal.SIGKILL)  # mid-batch, and both leaderships
                acked.update(doomed_acked)
                await subscriber.has(set(acked))  # the subscriber catches up
                outer.cancel_scope.cancel()
            assert doomed.proc.wait(timeout=10) == -signal.SIGKILL
            # The others took over: the origin's versions arrive, every intent is confirmed.
        await trio.to_thread.run_sync(
            wait_until, "the origin's versions", lambda: replicas_match(database_url, odb, them.did)
        )
        STATE_URL[:] = [database_url]
        await trio.to_thread.run_sync(
            partial(
                wait_until,
                "every intent confirmed",
                lambda: all_confirmed(database_url),
                state="SELECT 'intent' AS of, state, count(*) FROM anchor_intents GROUP BY 2"
                " UNION ALL SELECT 'batch', state, count(*) FROM anchor_batches GROUP BY 2",
            )
        )
        for line in (ANCHORING_LEADER, FEDERATION_LEADER):
            assert any(line in s.output() for s in (a, b, c, listener)), "no process took over"
        intents = await trio.to_thread.run_sync(anchored_exactly_once, database_url)
        rows = await log_rows(database_url, start)  # (the database goes with the processes)

    assert versions <= set(intents), "an acknowledged entry version has no anchor intent"
    sequences_ = [seq for seq, _, _ in rows]
    assert sequences_ == list(range(start + 1, start + 1 + len(rows))), "the log has a gap"
    by_sequence = {seq: did for seq, _, did in rows}
    for sequence, did in acked.items():  # each acknowledged write, where its answer said
        assert by_sequence.get(sequence) == did
    assert all(first == second for first, second in duplicates), "a key took effect twice"
    assert len(duplicates) == 2 * DUPLICATED_KEYS
    dids = [did for _, kind, did in rows if kind == "entry.created"]
    assert len(dids) == len(set(dids)), "an entry was created twice"
    kinds = {kind for _, kind, _ in rows}
    assert {"attestation.created", "report.created", "entry.updated", "peer.status"} <= kinds
    expected = WRITERS_PER_PROCESS * ENTRIES_PER_WRITER * 3 * WRITES_PER_ENTRY
    assert len(acked) == expected + 2 * DUPLICATED_KEYS + len(doomed_acked)
    received = subscriber.received
    assert received == sorted(set(received)), "events out of order or twice"
    assert set(acked) <= set(received)
