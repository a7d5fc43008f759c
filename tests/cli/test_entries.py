"""The entry life cycle from the command line, against a real `registry serve`: keygen, publish,
get, update, versions, delete; and the one-line answers to the mistakes a user makes on the way."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from cli.client import RegistryClient
from registry.keys import SigningKey, read_key_file, write_key_file
from tests.cli.cli_support import Cli
from tests.helpers import entry_template


def _did() -> str:
    return f"did:web:cli.test:{secrets.token_hex(6)}"


def _key(cli: Cli, name: str = "me.key") -> Path:
    path = cli.home / name
    if not path.exists():
        write_key_file(path, SigningKey.generate())
    return path


def _publish(cli: Cli, *, by_cli: bool = False, **fields: Any) -> tuple[dict[str, Any], Path, Path]:
    """A key, an entry file and the entry published from it: (served entry, file, key).
    Published with the Python client unless `by_cli` (the command costs a process start)."""
    key = _key(cli)
    entry = entry_template(_did(), **fields)
    path = cli.write("agent.json", entry)
    if by_cli:
        return cli.ok("publish", path, "--key", key).json(), path, key
    assert cli.url is not None
    with RegistryClient(cli.url) as client:
        signing_key = read_key_file(key)
        client.sign_in(signing_key)
        return client.publish(entry, signing_key), path, key


def _edit(path: Path, **fields: Any) -> None:
    entry = json.loads(path.read_text())
    entry.update(fields)
    path.write_text(json.dumps(entry))


def test_keygen_prints_the_did_writes_a_0600_file_and_never_overwrites(cli: Cli) -> None:
    key = cli.home / "me.key"
    did = cli.ok("keygen", "--out", key).stdout.strip()
    assert did.startswith("did:key:z6Mk")
    assert json.loads(key.read_text())["did"] == did
    assert key.stat().st_mode & 0o777 == 0o600
    line = cli("keygen", "--out", key).error_line()
    assert f"{key} exists" in line
    assert "--out" in line
    assert json.loads(key.read_text())["did"] == did


def test_publish_prints_the_served_entry_and_get_reads_it(cli: Cli) -> None:
    served, _, key = _publish(cli, by_cli=True)
    did = json.loads(key.read_text())["did"]
    assert served["publisherDid"] == did
    assert served["sequence"] >= 1
    assert served["signature"]["keyId"].startswith(did)
    assert cli.ok("get", served["entryDid"]).json() == served


def test_publish_of_an_existing_did_says_to_use_update(cli: Cli) -> None:
    served, path, key = _publish(cli)
    line = cli("publish", path, "--key", key).error_line()
    assert line == (
        f"registry: {served['entryDid']} already exists; to publish a new version run"
        f" `registry update {path} --key {key}`"
    )


def test_update_signs_a_new_version_based_on_the_current_sequence(cli: Cli) -> None:
    first, path, key = _publish(cli)
    _edit(path, version="1.0.1")
    second = cli.ok("update", path, "--key", key).json()
    _edit(path, version="1.0.2", description="third")
    third = cli.ok("update", path, "--key", key).json()
    assert first["sequence"] < second["sequence"] < third["sequence"]
    assert (second["version"], third["version"], third["description"]) == (
        "1.0.1",
        "1.0.2",
        "third",
    )
    assert cli.ok("get", first["entryDid"]).json() == third
    assert cli.ok("get", first["entryDid"], "--sequence", first["sequence"]).json() == first


def test_update_of_an_unchanged_file_or_a_reused_version_is_refused(cli: Cli) -> None:
    first, path, key = _publish(cli)
    line = cli("update", path, "--key", key).error_line()
    assert line.startswith("registry: 409 version_unchanged: ")
    assert "nothing to update" in line
    _edit(path, description="other content, same version string")
    line = cli("update", path, "--key", key).error_line()
    assert line.startswith("registry: 409 version_exists: ")
    assert f'is sequence {first["sequence"]}: give this content a new "version"' in line
    assert cli.ok("get", first["entryDid"]).json() == first  # nothing was written


def test_update_based_on_a_stale_sequence_is_refused(cli: Cli) -> None:
    first, path, key = _publish(cli)
    _edit(path, version="1.0.1")
    second = cli.ok("update", path, "--key", key).json()
    _edit(path, version="1.0.2")
    line = cli("update", path, "--key", key, "--based-on", first["sequence"]).error_line()
    assert line == (
        f"registry: {first['entryDid']} changed since sequence {first['sequence']} (latest:"
        f" {second['sequence']}); check `registry versions {first['entryDid']}` and update again"
    )
    # --based-on the current one is accepted.
    cli.ok("update", path, "--key", key, "--based-on", second["sequence"])


def test_an_update_that_drops_lifecycle_status_names_the_member(cli: Cli) -> None:
    _, path, key = _publish(cli, lifecycleStatus="active")
    entry = json.loads(path.read_text())
    del entry["lifecycleStatus"]
    path.write_text(json.dumps(entry))
    line = cli("update", path, "--key", key).error_line()
    assert "lifecycle cannot move from active to draft" in line
    assert f'set "lifecycleStatus" in {path}' in line


def test_update_of_an_unknown_did_says_to_publish(cli: Cli) -> None:
    _key(cli)
    path = cli.write("new.json", entry_template(_did()))
    line = cli("update", path, "--key", "me.key").error_line()
    assert "does not exist at http://127.0.0.1:" in line
    assert f"`registry publish {path} --key me.key`" in line


def test_update_with_another_publishers_key_is_refused(cli: Cli) -> None:
    _, path, _ = _publish(cli)
    _key(cli, "other.key")
    line = cli("update", path, "--key", "other.key").error_line()
    assert line.startswith("registry: 403 publisher_mismatch: ")
    assert "check --key" in line


def test_get_of_an_unknown_did_or_version(cli: Cli) -> None:
    did = _did()
    line = cli("get", did).error_line()
    assert line == f"registry: 404 entry_not_found: entry not found ({did} at {cli.url})"
    served, _, _ = _publish(cli)
    line = cli("get", served["entryDid"], "--sequence", "999999999").error_line()
    assert line.startswith("registry: 404 version_not_found: ")


def _versions(cli: Cli, count: int) -> tuple[str, list[dict[str, Any]]]:
    """An entry with `count` versions; returns its DID and the versions, newest first."""
    first, path, key = _publish(cli)
    served = [first]
    assert cli.url is not None
    with RegistryClient(cli.url) as client:
        signing_key = read_key_file(key)
        client.sign_in(signing_key)
        for n in range(1, count):
            entry = {**json.loads(path.read_text()), "version": f"1.0.{n}"}
            served.append(client.update(entry, signing_key, based_on=served[-1]["sequence"]))
    return first["entryDid"], served[::-1]


def test_versions_lists_newest_first_across_pages(cli: Cli) -> None:
    did, newest_first = _versions(cli, 5)  # the server's pages hold 2
    table = cli.ok("versions", did)
    rows = table.stdout.splitlines()
    assert rows[0].split() == ["SEQUENCE", "VERSION", "STATUS", "UPDATED", "NAME"]
    assert [row.split()[:3] for row in rows[1:]] == [
        [str(v["sequence"]), v["version"], "draft"] for v in newest_first
    ]
    assert table.stderr == ""
    as_json = cli.ok("versions", did, "--json")
    assert [json.loads(line) for line in as_json.stdout.splitlines()] == newest_first


def test_versions_limit_and_cursor(cli: Cli) -> None:
    did, newest_first = _versions(cli, 5)
    sequences = [v["sequence"] for v in newest_first]
    head = cli.ok("versions", did, "--json", "--limit", "3")
    assert [json.loads(line)["sequence"] for line in head.stdout.splitlines()] == sequences[:3]
    assert head.stderr.strip() == (
        f"more versions below sequence {sequences[2]}: continue with --cursor {sequences[2]}"
    )
    rest = cli.ok("versions", did, "--json", "--cursor", sequences[2])
    assert [json.loads(line)["sequence"] for line in rest.stdout.splitlines()] == sequences[3:]
    assert rest.stderr == ""
    # A limit that ends exactly at the last version says nothing more.
    assert cli.ok("versions", did, "--limit", "5").stderr == ""
    line = cli("versions", did, "--limit", "0").stderr.splitlines()[-1]
    assert "--limit: must be at least 1, not 0" in line


def test_versions_of_an_unknown_did(cli: Cli) -> None:
    did = _did()
    line = cli("versions", did).error_line()
    assert line == f"registry: 404 entry_not_found: entry not found ({did} at {cli.url})"


def test_delete_answers_the_tombstone_and_the_did_is_gone_for_good(cli: Cli) -> None:
    served, path, key = _publish(cli)
    did = served["entryDid"]
    tombstone = cli.ok("delete", did, "--key", key).json()
    assert (tombstone["entryDid"], tombstone["lifecycleStatus"]) == (did, "deleted")
    assert tombstone["sequence"] > served["sequence"]
    assert "entry_not_found" in cli("get", did).error_line()
    assert "entry_not_found" in cli("delete", did, "--key", key).error_line()
    line = cli("publish", path, "--key", key).error_line()
    assert line == (
        f"registry: {did} was deleted, and a deleted DID is never reused; publish under another"
        " entryDid"
    )


def test_delete_without_a_key_or_a_saved_session_says_how_to_sign_in(cli: Cli) -> None:
    served, _, _ = _publish(cli)
    line = cli("delete", served["entryDid"]).error_line(status=2)
    assert line == (
        f"registry: no saved session for {cli.url}; pass --key FILE, or sign in first with"
        f" `registry login --key FILE --url {cli.url}`"
    )
    assert cli.ok("get", served["entryDid"]).json() == served
