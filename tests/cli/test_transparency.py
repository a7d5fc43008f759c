"""`registry verify-entry` and `registry audit` against a real `registry serve`: a version
checked against the signed log, a monitor that resumes from its state, and a log rewritten
behind the registry's back (rows changed in its database) caught by a monitor; and `audit`
against a small fake registry (an HTTP server in a thread) that serves a log of its own making:
signed checkpoints, records, and hostile answers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import nacl.signing
import pytest

from cli.client import RegistryClient
from registry.keys import SigningKey
from registry.transparency import checkpoint_body, checkpoint_note, record_leaf, root, sign_note
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


# --- audit against a hostile registry ---------------------------------------------------------

Answer = tuple[int, str, str]  # status, content type, body


class FakeRegistry:
    """A registry's public log endpoints, answered from `records` and `note` (both settable),
    with `overrides[path]` replacing an endpoint's answer."""

    def __init__(self) -> None:
        self.key = SigningKey.generate()
        self.records: list[dict[str, Any]] = []
        self.note = ""
        self.overrides: dict[str, Callable[[dict[str, str]], Answer]] = {}

    def grow(self, count: int) -> None:
        """`count` more records (admin-only kinds: redacted, no entry version to fetch)."""
        for _ in range(count):
            sequence = len(self.records) + 1
            self.records.append(
                {
                    "at": "2026-11-21T12:00:00.000Z",
                    "data": None,
                    "kind": "peer.status",
                    "redacted": "00" * 32,
                    "sequence": sequence,
                    "subject": None,
                }
            )
        self.note = checkpoint_note(self.key.did, len(self.records), self.root(), self.key)

    def root(self) -> bytes:
        return root([record_leaf(r) for r in self.records])

    def answer(self, path: str, query: dict[str, str]) -> Answer:
        if path in self.overrides:
            return self.overrides[path](query)
        if path == "/v1/log/checkpoint":
            return 200, "text/plain; charset=utf-8", self.note
        if path == "/v1/log/records":
            start, limit = int(query.get("from", "1")), int(query.get("limit", "100"))
            page = self.records[start - 1 : start - 1 + limit]
            body = {"records": page, "hasMore": False, "next": start + len(page)}
            return 200, "application/json", json.dumps(body)
        error = {"error": {"code": "not_found", "message": "no such route"}}
        return 404, "application/json", json.dumps(error)


@pytest.fixture
def fake() -> Iterator[tuple[FakeRegistry, str]]:
    registry = FakeRegistry()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(parts.query).items()}
            status, kind, body = registry.answer(parts.path, query)
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield registry, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_audit_reports_a_consistency_proof_that_is_not_base64_as_failed(
    fake: tuple[FakeRegistry, str], tmp_path: Path
) -> None:
    """A consistency proof that does not decode is an inconsistency like any other: `FAILED:
    ...`, the evidence and status 1, not an unexpected error."""
    registry, url = fake
    cli = Cli(tmp_path / "cli")
    state = tmp_path / "audit.json"
    registry.grow(2)
    cli.ok("audit", url, "--state", state)
    registry.grow(3)
    registry.overrides["/v1/log/proof/consistency"] = lambda q: (
        200,
        "application/json",
        json.dumps({"from": 2, "to": 5, "proof": ["not base64!"]}),
    )
    ran = cli("audit", url, "--state", state)
    assert ran.status == 1, (ran.stdout, ran.stderr)
    assert "unexpected error" not in ran.stderr, ran.stderr
    assert ran.stdout.startswith("FAILED: "), (ran.stdout, ran.stderr)
    assert "evidence:" in ran.stdout


def test_audit_reports_a_records_answer_without_records_as_failed(
    fake: tuple[FakeRegistry, str], tmp_path: Path
) -> None:
    """The same for a records page that is not one (`{}`)."""
    registry, url = fake
    cli = Cli(tmp_path / "cli")
    registry.grow(2)
    registry.overrides["/v1/log/records"] = lambda q: (200, "application/json", "{}")
    ran = cli("audit", url, "--state", tmp_path / "audit.json")
    assert ran.status == 1, (ran.stdout, ran.stderr)
    assert "unexpected error" not in ran.stderr, ran.stderr
    assert ran.stdout.startswith("FAILED: "), (ran.stdout, ran.stderr)


def test_audit_does_not_accept_a_checkpoint_of_another_origin(
    fake: tuple[FakeRegistry, str], tmp_path: Path
) -> None:
    """The monitor's state names the log by its signer and origin: a checkpoint whose origin
    line names another log (signed by the same key, under the pinned key name) fails, and the
    state keeps the origin it pinned."""
    registry, url = fake
    cli = Cli(tmp_path / "cli")
    state = tmp_path / "audit.json"
    registry.grow(2)
    cli.ok("audit", url, "--state", state)
    assert json.loads(state.read_text())["origin"] == registry.key.did
    registry.note = sign_note(
        checkpoint_body("another.example/log", 2, registry.root()),
        registry.key.did,
        nacl.signing.SigningKey(registry.key.seed),
    )
    ran = cli("audit", url, "--state", state)
    assert ran.status == 1, (ran.stdout, ran.stderr, json.loads(state.read_text())["origin"])
    assert ran.stdout.startswith("FAILED: the checkpoint does not hold: it is of the log")
    assert json.loads(state.read_text())["origin"] == registry.key.did


def test_audit_refuses_a_negative_interval_as_a_usage_error(
    fake: tuple[FakeRegistry, str], tmp_path: Path
) -> None:
    """`--interval` must be above 0: `-1` (or 0) is argparse's usage error, status 2, before
    any pass."""
    registry, url = fake
    cli = Cli(tmp_path / "cli")
    registry.grow(1)
    for interval in ("-1", "0"):
        ran = cli(
            "audit", url, "--state", tmp_path / "audit.json", "--follow", "--interval", interval
        )
        assert ran.status == 2, (ran.stdout, ran.stderr)
        assert "argument --interval: must be above 0" in ran.stderr, ran.stderr
        assert ran.stdout == ""
