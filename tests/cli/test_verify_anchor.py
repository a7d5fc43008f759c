"""`registry verify-anchor`: an entry anchored by a real `registry serve` (instant blocks)
re-checked from the command line, against the local chain's journal too."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.client import RegistryClient
from registry.keys import SigningKey
from tests.cli.cli_support import Cli
from tests.db.proc import Server, run_server
from tests.helpers import entry_template


@pytest.fixture(scope="module")
def anchoring_server(
    database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Path]]:
    data_dir = tmp_path_factory.mktemp("anchoring-server")
    with run_server(
        data_dir,
        database_url=database_url,
        extra_env={
            "REGISTRY_ANCHORING__ENABLED": "true",
            "REGISTRY_ANCHORING__BLOCK_INTERVAL_SECONDS": "0",
            "REGISTRY_ANCHORING__FINALITY_DEPTH": "2",
        },
    ) as server:
        yield server, data_dir / "chain.jsonl"


def _anchored_entry(url: str) -> str:
    key = SigningKey.generate()
    did = f"did:web:cli.test:{secrets.token_hex(6)}"
    with RegistryClient(url) as client:
        client.sign_in(key)
        client.publish(entry_template(did), key)
        deadline = time.monotonic() + 30  # an external process: poll its answer
        while client.anchors(did)["anchorState"] != "anchored":
            assert time.monotonic() < deadline, client.anchors(did)
            time.sleep(0.05)
    return did


def test_an_anchored_entry_verifies_against_the_server_and_the_chain(
    anchoring_server: tuple[Server, Path], tmp_path: Path
) -> None:
    server, chain = anchoring_server
    did = _anchored_entry(server.url)
    cli = Cli(tmp_path, server.url)
    ran = cli.ok("verify-anchor", did, "--chain", chain)
    assert ran.stdout.startswith("sequence ")
    assert "ok (block " in ran.stdout
    assert "checked itemDataHash, leaf, path, chain" in ran.stdout
    without = cli.ok("verify-anchor", did)
    assert "checked itemDataHash, leaf, path)" in without.stdout
    assert "not checked against a chain" in without.stderr


def test_a_chain_that_does_not_hold_the_root_fails(
    anchoring_server: tuple[Server, Path], tmp_path: Path
) -> None:
    server, _ = anchoring_server
    did = _anchored_entry(server.url)
    cli = Cli(tmp_path, server.url)
    other = tmp_path / "other-chain.jsonl"
    other.write_text(json.dumps({"op": "block", "time": 0}) + "\n")
    ran = cli("verify-anchor", did, "--chain", other)
    assert ran.status == 1, (ran.stdout, ran.stderr)
    assert "FAILED" in ran.stdout
    assert "does not hold the root" in ran.stdout


def test_an_entry_not_anchored_yet_says_so(tmp_path: Path, server: Server) -> None:
    """The package's server runs without anchoring: its entries stay unanchored."""
    key = SigningKey.generate()
    did = f"did:web:cli.test:{secrets.token_hex(6)}"
    with RegistryClient(server.url) as client:
        client.sign_in(key)
        client.publish(entry_template(did), key)
    line = Cli(tmp_path, server.url)("verify-anchor", did).error_line()
    assert "has no anchored version yet" in line
