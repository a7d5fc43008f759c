"""The append path's invariants with several real processes writing at once (docs/architecture.md,
"The critical section"): three `registry serve` on one database take creates, updates and
idempotent retries sent to two processes at once, a fourth is killed with SIGKILL in the middle
of its burst, and a live subscriber of a fifth listens. Afterwards: the log is gap-free; every
acknowledged write is in it once, at the position its answer named; a key sent to two processes
at once took effect once; the subscriber got every acknowledged write's event, in order."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from cli.client import RegistryClient
from registry.keys import SigningKey
from tests.db.proc import Server, run_server
from tests.helpers import signed_entry

WRITERS_PER_PROCESS = 6
ENTRIES_PER_WRITER = 5
DUPLICATED_KEYS = 10
DEADLINE = 120


@contextmanager
def servers(tmp_path: Path, database_url: str, n: int) -> Iterator[list[Server]]:
    with ExitStack() as stack:
        yield [
            stack.enter_context(run_server(tmp_path / f"p{i}", database_url=database_url))
            for i in range(n)
        ]


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


# Killing a server mid-request makes httpx abandon its request-body generator (test_process).
@pytest.mark.filterwarnings("ignore:Async generator 'httpx:ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_processes_writing_at_once_keep_the_log_gap_free_and_exact(
    tmp_path: Path, database_url: str
) -> None:
    key = SigningKey.generate()
    with servers(tmp_path, database_url, 5) as (a, b, c, doomed, listener):
        token = await trio.to_thread.run_sync(lambda: RegistryClient(a.url).sign_in(key))
        bearer = {"Authorization": f"Bearer {token['sessionToken']}"}
        start = (await log_rows(database_url, 0) or [(0, "", None)])[-1][0]
        acked: dict[int, str] = {}  # sequence -> entry DID, from the answers
        duplicates: list[tuple[int, int]] = []
        subscriber = Subscriber()

        async def post(http: httpx.AsyncClient, entry: dict[str, Any], idem: str) -> int:
            r = await http.post(
                "/v1/entries", json=entry, headers={**bearer, "Idempotency-Key": idem}
            )
            assert r.status_code == 201, r.text
            assert r.headers["Registry-Sequence"] == str(r.json()["sequence"])
            return int(r.json()["sequence"])

        async def writer(server: Server) -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                for _ in range(ENTRIES_PER_WRITER):
                    entry = signed_entry(key)
                    did = entry["entryDid"]
                    created = await post(http, entry, f"c-{did}")
                    acked[created] = did
                    update = signed_entry(key, did, sequence=created, version="2.0.0")
                    r = await http.put(
                        f"/v1/entries/{did}",
                        json=update,
                        headers={**bearer, "Idempotency-Key": f"u-{did}"},
                    )
                    assert r.status_code == 200, r.text
                    acked[int(r.json()["sequence"])] = did

        async def duplicate() -> None:
            # One request, sent to two processes at once under one key: one effect.
            entry = signed_entry(key)
            answers: list[int] = []
            async with (
                httpx.AsyncClient(base_url=a.url, timeout=30) as ha,
                httpx.AsyncClient(base_url=b.url, timeout=30) as hb,
                trio.open_nursery() as nursery,
            ):
                for http in (ha, hb):

                    async def send(http: httpx.AsyncClient = http) -> None:
                        answers.append(await post(http, entry, f"d-{entry['entryDid']}"))

                    nursery.start_soon(send)
            duplicates.append((answers[0], answers[1]))
            acked[answers[0]] = entry["entryDid"]

        doomed_acked: dict[int, str] = {}
        enough = trio.Event()

        async def burst_until_killed() -> None:
            async with httpx.AsyncClient(base_url=doomed.url, timeout=30) as http:

                async def one() -> None:
                    while True:
                        entry = signed_entry(key)
                        try:
                            sequence = await post(http, entry, f"k-{entry['entryDid']}")
                        except (httpx.HTTPError, AssertionError):
                            return  # the server died under us: nothing is promised
                        doomed_acked[sequence] = entry["entryDid"]
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
                    for server in (a, b, c):
                        for _ in range(WRITERS_PER_PROCESS):
                            nursery.start_soon(writer, server)
                    for _ in range(DUPLICATED_KEYS):
                        nursery.start_soon(duplicate)
                    await enough.wait()
                    doomed.proc.send_signal(signal.SIGKILL)  # in the middle of its batches
                acked.update(doomed_acked)
                await subscriber.has(set(acked))  # the subscriber catches up
                outer.cancel_scope.cancel()
        assert doomed.proc.wait(timeout=10) == -signal.SIGKILL

    rows = await log_rows(database_url, start)
    sequences = [seq for seq, _, _ in rows]
    assert sequences == list(range(start + 1, start + 1 + len(rows))), "the log has a gap"
    by_sequence = {seq: did for seq, _, did in rows}
    for sequence, did in acked.items():  # each acknowledged write, where its answer said
        assert by_sequence.get(sequence) == did
    assert all(first == second for first, second in duplicates), "a key took effect twice"
    dids = [did for _, kind, did in rows if kind == "entry.created"]
    assert len(dids) == len(set(dids)), "an entry was created twice"
    expected = WRITERS_PER_PROCESS * ENTRIES_PER_WRITER * 3 * 2 + DUPLICATED_KEYS
    assert len(acked) == expected + len(doomed_acked)
    received = subscriber.received
    assert received == sorted(set(received)), "events out of order or twice"
    assert set(acked) <= set(received)
