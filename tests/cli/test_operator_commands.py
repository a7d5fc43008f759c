"""Every command survives a reader that stops early, prints JSON where it says so, and tells
how to get a capability it lacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cli.main import status_screen
from registry.keys import SigningKey, write_key_file
from tests.cli.cli_support import DEADLINE, Cli
from tests.cli.test_sessions import _key, _published
from tests.db.proc import run_server


def _piped(cli: Cli, *args: str, read: int) -> tuple[int, bytes, str]:
    """Run the command, read `read` bytes of its output and close the pipe, as `| head -c`
    does; return its exit status, what was read and its standard error. (With `read=0` the
    pipe is closed before the command writes anything, so its first write meets it closed
    whatever the pipe's buffer could have held.)"""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cli.home,
        env=cli.env(),
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    got = proc.stdout.read(read)
    proc.stdout.close()
    status = proc.wait(timeout=DEADLINE)  # a command that retried forever fails here
    with proc.stderr:
        return status, got, proc.stderr.read().decode()


def test_versions_json_into_a_closed_pipe_exits_quietly(cli: Cli) -> None:
    path, key = _key(cli)
    entry = _published(cli, key)
    for n in range(3):  # enough output to outgrow what the reader takes
        edited = {**entry, "description": f"v{n}", "version": f"2.0.{n}"}
        cli.ok("update", cli.write("e.json", edited), "--key", path)
    status, got, stderr = _piped(cli, "versions", entry["entryDid"], "--json", read=300)
    assert len(got) == 300
    assert (status, stderr) == (0, "")
    assert _piped(cli, "versions", entry["entryDid"], "--json", read=0) == (0, b"", "")


def test_watch_into_a_closed_pipe_stops_at_once(cli: Cli) -> None:
    _, key = _key(cli)
    _published(cli, key)
    assert _piped(cli, "watch", "--from", "0", read=0) == (0, b"", "")


def test_peers_json_is_the_apis_list(cli: Cli) -> None:
    assert json.loads(cli.ok("peers", "--json").stdout) == []


def test_a_missing_admin_capability_says_how_to_grant_it(cli: Cli) -> None:
    path, _ = _key(cli)
    line = cli("peers", "--status", "--key", path).error_line()
    assert line.startswith("registry: 403 capability_missing: ")
    assert "add this key's DID there, reload it (SIGHUP) or restart" in line
    assert "`auth.admin_dids`" in line


def test_status_shows_the_registry_at_a_glance(database_url: str, tmp_path: Path) -> None:
    admin = SigningKey.generate()
    admins = json.dumps([admin.did])
    with run_server(
        tmp_path / "node",
        database_url=database_url,
        extra_env={"REGISTRY_AUTH__ADMIN_DIDS": admins},
    ) as server:
        cli = Cli(tmp_path / "home", server.url)
        path = cli.home / "admin.key"
        write_key_file(path, admin)
        body = cli.ok("status", "--key", path, "--json").json()
        assert body["status"] in ("ok", "degraded")
        assert body["peers"] == []
        assert body["anchoring"]["enabled"] is False
        assert isinstance(body["logHead"], int)
        screen = cli.ok("status", "--key", path).stdout
        assert screen.splitlines()[0] == f"registry  {body['registryDid']}"
        assert "peers     none configured" in screen
        assert "anchoring off" in screen


def test_the_status_screen_lists_peers_quarantines_and_batches() -> None:
    body = {
        "registryDid": "did:key:zR",
        "status": "degraded",
        "logHead": 42,
        "checks": {"database": "ok", "federation": "degraded: 1 of 1 peers failing"},
        "peers": [
            {
                "peerDid": "did:key:zP",
                "breakerState": "open",
                "consecutiveFailures": 5,
                "cursor": 7,
                "lag": 3,
                "quarantines": 1,
                "nextAttemptAt": "2026-11-26T21:00:00.000Z",
                "log": {
                    "state": "inconsistent",
                    "reason": "log_inconsistent",
                    "detail": "two roots for tree size 7",
                },
                "quarantined": [
                    {
                        "sequence": 6,
                        "entryDid": "did:web:x",
                        "code": "signature_invalid",
                        "reason": "the signature fails",
                    }
                ],
            }
        ],
        "anchoring": {
            "enabled": True,
            "pending": 2,
            "oldestPendingAt": "2026-11-26T20:00:00.000Z",
            "batchesInFlight": 1,
            "recentBatches": [
                {"batchId": 40, "state": "submitted", "intents": 3, "transactionId": "0xab"}
            ],
        },
    }
    screen = "\n".join(status_screen(body))
    assert "status    degraded   log head 42" in screen
    assert "did:key:zP  open  5  7  3  -  -  1" in screen
    assert "quarantined #6 did:web:x: signature_invalid (the signature fails)" in screen
    assert (
        "LOG INCONSISTENT (log_inconsistent): two roots for tree size 7; nothing more is imported"
        in screen
    )
    assert "anchoring 2 pending (oldest 2026-11-26T20:00:00.000Z), 1 batch(es) in flight" in screen
    assert "batch 40: submitted, 3 intent(s) tx 0xab" in screen
