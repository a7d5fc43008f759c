"""Every command survives a reader that stops early, prints JSON where it says so, and tells
how to get a capability it lacks."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.cli.cli_support import DEADLINE, Cli
from tests.cli.test_sessions import _key, _published


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
