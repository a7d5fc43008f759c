"""A user's mistake is one line on stderr and a non-zero exit status, never a traceback (unless
`registry --debug`): a malformed entry file, a missing key, a registry that is not running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from registry.keys import SigningKey, write_key_file
from tests.cli.cli_support import Cli
from tests.db.proc import free_port
from tests.helpers import entry_template


@pytest.fixture
def offline(tmp_path: Path) -> Cli:
    """The command pointed (through REGISTRY_URL) at a port nothing listens on."""
    cli = Cli(tmp_path, f"http://127.0.0.1:{free_port()}")
    write_key_file(tmp_path / "me.key", SigningKey.generate())
    cli.write("agent.json", entry_template())
    return cli


def _unreachable(url: str | None) -> str:
    return (
        f"registry: cannot reach the registry at {url} (connection refused); is `registry serve`"
        " running there? Name another with --url (or REGISTRY_URL)"
    )


@pytest.mark.parametrize("command", ["publish", "update"])
def test_a_malformed_entry_file(offline: Cli, command: str) -> None:
    path = offline.write("bad.json", '{\n  "entryDid": "did:web:x",\n  "name": \n}\n')
    line = offline(command, path, "--key", "me.key").error_line(status=2)
    assert line == (
        f"registry: {path}: malformed JSON: Expecting value at line 4 column 1; fix the file"
        " and retry"
    )


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("[1, 2]", "an entry is a JSON object, not list"),
        ('{"name": "x"}', "the entry has no entryDid and no itemData"),
        ('{"entryDid": 7, "itemData": {}}', "entryDid must be a string (a DID)"),
        ('{"a": 1, "a": 2}', "duplicate member name 'a'"),
        ("", "malformed JSON"),
    ],
)
def test_an_entry_file_that_is_not_an_entry(offline: Cli, content: str, says: str) -> None:
    path = offline.write("bad.json", content)
    line = offline("publish", path, "--key", "me.key").error_line(status=2)
    assert line.startswith(f"registry: {path}: ")
    assert says in line


def test_a_missing_entry_file(offline: Cli) -> None:
    line = offline("publish", "missing.json", "--key", "me.key").error_line(status=2)
    assert line == "registry: missing.json: No such file or directory"


def test_a_missing_or_malformed_key_file(offline: Cli) -> None:
    line = offline("publish", "agent.json", "--key", "nope.key").error_line(status=2)
    assert line == (
        "registry: nope.key: no such key file; check --key, or make one with"
        " `registry keygen --out nope.key`"
    )
    offline.write("bad.key", json.dumps({"type": "RSA"}))
    line = offline("login", "--key", "bad.key").error_line(status=2)
    assert (
        line == "registry: bad.key: type must be Ed25519: not a key file made by `registry keygen`"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["get", "did:web:x"],
        ["versions", "did:web:x"],
        ["publish", "agent.json", "--key", "me.key"],
        ["update", "agent.json", "--key", "me.key"],
        ["delete", "did:web:x", "--key", "me.key"],
        ["login", "--key", "me.key"],
        ["watch", "--from", "0"],
    ],
    ids=lambda args: args[0],
)
def test_every_client_command_when_the_registry_is_not_running(
    offline: Cli, args: list[str]
) -> None:
    assert offline(*args).error_line() == _unreachable(offline.url)


def test_url_flag_overrides_the_default_and_is_named(offline: Cli) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert offline("get", "did:web:x", "--url", url).error_line() == _unreachable(url)
    line = offline("get", "did:web:x", "--url", "ftp://example.com").error_line(status=2)
    assert line == "registry: --url 'ftp://example.com' is not an http(s) URL of a registry"


@pytest.mark.parametrize(
    "args",
    [["--debug", "get", "did:web:x"], ["get", "did:web:x", "--debug"]],
    ids=["before", "after"],
)
def test_debug_shows_the_traceback_before_the_line(offline: Cli, args: list[str]) -> None:
    ran = offline(*args)
    assert ran.status == 1
    assert ran.stderr.startswith("Traceback (most recent call last):")
    assert "httpx.ConnectError" in ran.stderr
    assert ran.stderr.splitlines()[-1] == _unreachable(offline.url)


def test_bad_usage_is_argparse_status_2(offline: Cli) -> None:
    ran = offline("versions", "did:web:x", "--limit", "0")
    assert ran.status == 2
    assert "Traceback" not in ran.stderr
    assert ran.stderr.splitlines()[-1] == (
        "registry versions: error: argument --limit: must be at least 1, not 0"
    )


@pytest.mark.parametrize("count", ["0", "-1"])
def test_watch_max_events_below_1_is_a_usage_error(offline: Cli, count: str) -> None:
    """`watch --max-events N` stops after N events, N >= 1: 0 or less is argparse's usage
    error before anything is printed (the count was checked only after an event)."""
    ran = offline("watch", "--from", "0", "--max-events", count)
    assert (ran.status, ran.stdout) == (2, "")
    assert ran.stderr.splitlines()[-1] == (
        f"registry watch: error: argument --max-events: must be at least 1, not {count}"
    )


@pytest.mark.parametrize(
    "saved",
    [
        {"sessionToken": "t", "expiresAtMs": "soon"},
        {"sessionToken": "t", "expiresAtMs": 1e400},
        {"sessionToken": "t", "expiresAtMs": 99999999999999, "savedAtMs": "x"},
        {"sessionToken": ["t"], "expiresAtMs": 99999999999999},
    ],
)
def test_a_session_file_edited_into_another_form_is_no_session(
    offline: Cli, saved: dict[str, object]
) -> None:
    """A saved session whose members are not what `login` writes ended `delete` as
    `unexpected error: ValueError ... (a bug; ...)`; it is no session, like an unreadable file."""
    offline.session_file.write_text(json.dumps({"sessions": [{"url": offline.url, **saved}]}))
    line = offline("delete", "did:web:x").error_line(status=2)
    assert line.startswith(f"registry: no saved session for {offline.url}; "), line


def test_output_to_a_full_disk_is_one_line(offline: Cli) -> None:
    """`registry keygen > /dev/full`: standard output cannot be written. It was "unexpected
    error: OSError ... (a bug)"; the key file itself was written."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "cli", "keygen", "--out", "new.key"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
            cwd=offline.home,
            env=offline.env(),
        )
    assert done.returncode == 1
    assert done.stderr == "registry: cannot write the output: No space left on device\n"
    assert (offline.home / "new.key").exists()
