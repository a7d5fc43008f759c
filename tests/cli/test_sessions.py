"""`registry login` saves the session (mode 0600); publish, update and delete reuse it until it
expires or the registry refuses it, then sign in with --key; `registry logout` revokes it."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from cli import main as cli_module
from cli.client import RegistryClient, RegistryClientError
from registry.keys import SigningKey, read_key_file, write_key_file
from tests.cli.cli_support import Cli
from tests.helpers import entry_template


def _key(cli: Cli, name: str = "me.key") -> tuple[Path, SigningKey]:
    path = cli.home / name
    write_key_file(path, key := SigningKey.generate())
    return path, key


def _published(cli: Cli, key: SigningKey) -> dict[str, Any]:
    assert cli.url is not None
    with RegistryClient(cli.url) as client:
        client.sign_in(key)
        return client.publish(entry_template(f"did:web:cli.test:{secrets.token_hex(6)}"), key)


def _saved(cli: Cli) -> list[dict[str, Any]]:
    sessions: list[dict[str, Any]] = json.loads(cli.session_file.read_text())["sessions"]
    return sessions


def _rewrite_saved(cli: Cli, **fields: Any) -> None:
    sessions = [{**s, **fields} for s in _saved(cli)]
    cli.session_file.write_text(json.dumps({"sessions": sessions}))


def test_login_saves_the_session_0600_and_delete_reuses_it(cli: Cli) -> None:
    path, key = _key(cli)
    entry = _published(cli, key)
    login = cli.ok("login", "--key", path)
    shown = login.json()
    assert shown["signerDid"] == key.did
    assert "sessionToken" not in shown
    assert login.stderr.startswith(f"session saved to {cli.session_file} (until 20")
    assert cli.session_file.stat().st_mode & 0o777 == 0o600
    (saved,) = _saved(cli)
    assert (saved["url"], saved["did"]) == (cli.url, key.did)
    assert saved["expiresAtMs"] == shown["expiresAtMs"]
    assert cli.url is not None
    with RegistryClient(cli.url, token=saved["sessionToken"]) as client:
        assert client.session()["signerDid"] == key.did
    # delete needs no --key while the saved session lasts.
    tombstone = cli.ok("delete", entry["entryDid"]).json()
    assert tombstone["lifecycleStatus"] == "deleted"
    # A second login (another key) is saved beside the first.
    other_path, other = _key(cli, "other.key")
    cli.ok("login", "--key", other_path)
    assert {s["did"] for s in _saved(cli)} == {key.did, other.did}


def test_login_prints_the_token_alone_for_scripts(cli: Cli) -> None:
    path, key = _key(cli)
    token = cli.ok("login", "--key", path, "--print-token").stdout.strip()
    (saved,) = _saved(cli)
    assert token == saved["sessionToken"]
    assert cli.url is not None
    with RegistryClient(cli.url, token=token) as client:
        assert client.session()["signerDid"] == key.did


def test_publish_update_delete_use_the_saved_session_instead_of_signing_in(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process, so that signing in can be made impossible: each command must still work."""
    assert cli.url is not None
    monkeypatch.setenv("REGISTRY_SESSION_FILE", str(cli.session_file))
    path, _ = _key(cli)
    assert cli_module.main(["login", "--key", str(path), "--url", cli.url]) == 0

    def no_sign_in(*args: object, **kwargs: object) -> None:
        raise AssertionError("signed in although a saved session was valid")

    monkeypatch.setattr(RegistryClient, "sign_in", no_sign_in)
    entry = cli.write("agent.json", entry_template(f"did:web:cli.test:{secrets.token_hex(6)}"))
    capsys.readouterr()
    assert cli_module.main(["publish", str(entry), "--key", str(path), "--url", cli.url]) == 0
    did = json.loads(capsys.readouterr().out)["entryDid"]
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "version": "2.0.0"}))
    assert cli_module.main(["update", str(entry), "--key", str(path), "--url", cli.url]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == "2.0.0"
    assert cli_module.main(["delete", did, "--key", str(path), "--url", cli.url]) == 0
    assert json.loads(capsys.readouterr().out)["lifecycleStatus"] == "deleted"


def test_a_session_the_registry_refuses_is_forgotten_and_the_key_signs_in(cli: Cli) -> None:
    path, key = _key(cli)
    cli.ok("login", "--key", path)
    _rewrite_saved(cli, sessionToken=secrets.token_urlsafe(32))  # unknown to the registry
    entry = cli.write("agent.json", entry_template(f"did:web:cli.test:{secrets.token_hex(6)}"))
    served = cli.ok("publish", entry, "--key", path).json()
    assert served["publisherDid"] == key.did
    assert _saved(cli) == []


def test_without_a_key_a_refused_session_says_to_log_in_again(cli: Cli) -> None:
    path, key = _key(cli)
    entry = _published(cli, key)
    cli.ok("login", "--key", path)
    _rewrite_saved(cli, sessionToken=secrets.token_urlsafe(32))
    line = cli("delete", entry["entryDid"]).error_line()
    assert line == (
        f"registry: the session saved for {cli.url} is no longer valid; sign in again with"
        f" `registry login --key FILE --url {cli.url}`, or pass --key"
    )
    assert _saved(cli) == []
    assert cli.ok("get", entry["entryDid"]).json() == entry


def test_a_session_about_to_expire_is_not_reused(cli: Cli) -> None:
    path, key = _key(cli)
    entry = _published(cli, key)
    cli.ok("login", "--key", path)
    _rewrite_saved(cli, expiresAtMs=int(time.time() * 1000) + 30_000)
    assert "no saved session for" in cli("delete", entry["entryDid"]).error_line(status=2)
    cli.ok("delete", entry["entryDid"], "--key", path)  # the key signs in instead


def test_logout_revokes_the_saved_session_and_forgets_it(cli: Cli) -> None:
    path, key = _key(cli)
    cli.ok("login", "--key", path)
    (saved,) = _saved(cli)
    out = cli.ok("logout")
    assert out.stderr == f"logged out {key.did} from {cli.url}\n"
    assert _saved(cli) == []
    assert cli.url is not None
    with (
        RegistryClient(cli.url, token=saved["sessionToken"]) as client,
        pytest.raises(RegistryClientError) as refused,
    ):
        client.session()
    assert refused.value.code == "session_invalid"
    assert cli.ok("logout").stderr == f"no saved session for {cli.url}\n"


def test_the_session_file_of_earlier_versions_is_read(cli: Cli) -> None:
    """`registry login` used to save one session as the bare sign-in result."""
    path, key = _key(cli)
    entry = _published(cli, key)
    assert cli.url is not None
    with RegistryClient(cli.url) as client:
        result = client.sign_in(read_key_file(path))
    cli.session_file.write_text(json.dumps({"url": cli.url, **result}))
    cli.ok("delete", entry["entryDid"])
