"""`registry watch` against real servers: events printed as JSON lines, exactly once and in
order, across a server restart in the middle of the stream; and the command line itself."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from cli.client import RegistryClient
from cli.watch import Watcher, WatchError, WatchOptions
from registry.keys import SigningKey
from tests.db.proc import free_port, run_server
from tests.helpers import entry_template

DEADLINE = 60


class Server:
    """`run_server` entered and left in a thread: its exit waits for the process to stop,
    which must not block the Trio loop the watcher runs on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._cm = run_server(*args, **kwargs)

    async def __aenter__(self) -> Any:
        return await trio.to_thread.run_sync(self._cm.__enter__)

    async def __aexit__(self, *exc: object) -> None:
        await trio.to_thread.run_sync(self._cm.__exit__, None, None, None)


def publish(url: str, key: SigningKey, dids: list[str]) -> list[int]:
    with RegistryClient(url) as client:
        client.sign_in(key)
        return [int(client.publish(entry_template(did), key)["sequence"]) for did in dids]


async def test_watch_resumes_after_a_server_restart_without_duplicates_or_gaps(
    database_url: str, tmp_path: Path
) -> None:
    key = SigningKey.generate()
    dids = [f"did:web:watch.test:{secrets.token_hex(6)}" for _ in range(6)]
    port = free_port()
    lines: list[str] = []
    notes: list[str] = []
    printed_three, printed_six = trio.Event(), trio.Event()

    def out(line: str) -> None:
        lines.append(line)
        if len(lines) == 3:
            printed_three.set()
        if len(lines) == 6:
            printed_six.set()

    options = WatchOptions(url=f"http://127.0.0.1:{port}", entry_dids=dids, max_events=6)
    watcher = Watcher(options, out, note=notes.append, draw=lambda: 0.0)
    sequences: list[int] = []
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            async with Server(tmp_path / "a", database_url=database_url, port=port) as server:
                nursery.start_soon(watcher.run)
                await watcher.subscribed.wait()
                sequences += await trio.to_thread.run_sync(publish, server.url, key, dids[:3])
                await printed_three.wait()
            # The server is gone: the watcher retries. Three more entries, then a new server.
            async with Server(tmp_path / "b", database_url=database_url, port=port) as server:
                sequences += await trio.to_thread.run_sync(publish, server.url, key, dids[3:])
                await printed_six.wait()  # the watcher reconnects, resumes, and returns
    assert [json.loads(line)["sequence"] for line in lines] == sequences
    assert [json.loads(line)["entryDid"] for line in lines] == dids
    assert watcher.connections >= 2
    assert any("resuming after sequence" in note for note in notes), notes
    assert any("1001" in note and "server_stopping" in note for note in notes), notes


async def test_a_refused_subscription_ends_the_watch(database_url: str, tmp_path: Path) -> None:
    with run_server(tmp_path, database_url=database_url) as server:
        options = WatchOptions(url=server.url, kinds=["peer.status"])  # admin-only, no session
        with trio.fail_after(DEADLINE), pytest.raises(WatchError, match="capability_missing"):
            await Watcher(options, lambda line: None, note=lambda text: None).run()


def test_the_watch_command_prints_json_lines(database_url: str, tmp_path: Path) -> None:
    key = SigningKey.generate()
    did = f"did:web:watch.test:{secrets.token_hex(6)}"
    with run_server(tmp_path, database_url=database_url) as server:
        (sequence,) = publish(server.url, key, [did])
        done = subprocess.run(
            [
                *(sys.executable, "-m", "cli", "watch", "--url", server.url),
                *("--from", "0", "--did", did, "--max-events", "1"),
            ],
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    event: dict[str, Any] = json.loads(done.stdout)
    assert (event["type"], event["kind"], event["entryDid"], event["sequence"]) == (
        "event",
        "entry.created",
        did,
        sequence,
    )
