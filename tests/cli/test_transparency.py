"""`registry verify-entry` and `registry audit` against a real `registry serve`: a version
checked against the signed log, a monitor that resumes from its state, and a log rewritten
behind the registry's back (rows changed in its database) caught by a monitor."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.client import RegistryClient
from registry.keys import SigningKey
from tests.cli.cli_support import Cli
from tests.db.proc import Server, databases, query, run_server
from tests.helpers import entry_template

DEADLINE = 30.0


def checkpointed(url: str, size: int) -> int:
    """Wait (an external process: poll its answer) until a checkpoint holds `size` records."""
    deadline = time.monotonic() + DEADLINE
    with RegistryClient(url) as client:
        while True:
            got = int(client.checkpoint().split("\n")[1])
            if got >= size:
                return got
            assert time.monotonic() < deadline, f"no checkpoint of {size} records yet"
            time.sleep(0.05)


def publish(url: str) -> tuple[str, int]:
    key = SigningKey.generate()
    with RegistryClient(url) as client:
        client.sign_in(key)
        served = client.publish(entry_template(), key)
    return served["entryDid"], int(served["sequence"])


def test_an_entry_version_verifies_against_the_signed_log(cli: Cli, server: Server) -> None:
    did, sequence = publish(server.url)
    checkpointed(server.url, sequence)
    ran = cli.ok("verify-entry", did)
    assert (
        ran.stdout.splitlines()[0]
        == f"ok: version {sequence} of {did} is record {sequence} of the log"
    )
    assert "signed by did:key:" in ran.stdout
    assert "documentHash and its publisher's signature hold" in ran.stdout
    assert cli.ok("verify-entry", did, "--sequence", str(sequence)).stdout == ran.stdout
    other = SigningKey.generate().did
    refused = cli("verify-entry", did, "--registry-did", other)
    assert refused.status == 1
    assert "FAILED: the checkpoint does not hold" in refused.stdout


@pytest.fixture
def own_server(database_url: str, tmp_path: Path) -> Iterator[Server]:
    """A registry on a database of its own: its log holds only what the test wrote (the
    shared test database's log has rows other tests tamper with)."""
    with (
        databases(database_url) as new_database,
        run_server(tmp_path / "node", database_url=new_database()) as server,
    ):
        yield server


def test_a_monitor_verifies_every_record_and_resumes_from_its_state(
    own_server: Server, tmp_path: Path
) -> None:
    server = own_server
    cli = Cli(tmp_path / "cli", server.url)
    state = tmp_path / "audit.json"
    _, sequence = publish(server.url)
    size = checkpointed(server.url, sequence)
    first = cli.ok("audit", server.url, "--state", state)
    assert first.stdout.startswith("checkpoint ")
    assert " verified: " in first.stdout
    saved = json.loads(state.read_text())
    assert saved["size"] >= size
    _, sequence = publish(server.url)
    checkpointed(server.url, sequence)
    second = cli.ok("audit", server.url, "--state", state)
    added = int(second.stdout.split(": ", 1)[1].split(" new records")[0])
    assert 0 < added < saved["size"] + 5  # only what is new since the last pass
    assert "1 entry versions checked" in second.stdout


def test_a_log_rewritten_in_the_database_is_caught_by_a_monitor(
    database_url: str, tmp_path: Path
) -> None:
    with databases(database_url) as new_database:
        database = new_database()  # its own: its rows are about to be tampered with
        with run_server(tmp_path / "node", database_url=database) as server:
            cli = Cli(tmp_path / "cli", server.url)
            state = tmp_path / "audit.json"
            did, sequence = publish(server.url)
            size = checkpointed(server.url, sequence)
            cli.ok("audit", server.url, "--state", state)
            # A record's data changed behind the registry's back: the records no longer hash
            # to the signed tree, which a monitor starting afresh sees.
            query(
                database,
                "UPDATE log SET data = jsonb_set(data, '{name}', '\"Evil\"') WHERE seq = $1",
                sequence,
            )
            fresh = cli("audit", server.url, "--state", tmp_path / "fresh.json")
            assert fresh.status == 1, fresh.stdout
            assert "do not hash to checkpoint" in fresh.stdout
            assert "evidence:" in fresh.stdout
            refused = cli("verify-entry", did)
            assert refused.status == 1
            assert "inclusion proof does not lead to the checkpoint's root" in refused.stdout
        # History rewritten whole: the tree and its checkpoints dropped and rebuilt from the
        # altered rows. The new checkpoints are signed and self-consistent, but the monitor
        # that verified the old one sees the fork.
        query(database, "DELETE FROM log_checkpoints")
        query(database, "DELETE FROM log_tiles")
        with run_server(tmp_path / "node", database_url=database) as server:
            publish(server.url)
            checkpointed(server.url, size + 1)
            resumed = cli("audit", server.url, "--state", state)
            assert resumed.status == 1, resumed.stdout
            assert "is not consistent with checkpoint" in resumed.stdout
