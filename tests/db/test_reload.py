"""SIGHUP reloads what can change while running: here `auth.admin_dids`."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from cli.client import RegistryClient
from registry.keys import SigningKey
from tests.db.proc import migrations_held, run_server, wait_healthy

DEADLINE_S = 30


def _capabilities(url: str, key: SigningKey) -> list[str]:
    with RegistryClient(url) as client:
        return list(client.sign_in(key).get("capabilities", []))


def test_an_admin_added_to_the_file_is_granted_at_the_next_sign_in_after_sighup(
    database_url: str, tmp_path: Path
) -> None:
    key = SigningKey.generate()
    config = tmp_path / "registry.toml"
    config.write_text("[auth]\nadmin_dids = []\n")
    with run_server(tmp_path / "node", database_url=database_url, config=config) as server:
        assert "admin" not in _capabilities(server.url, key)
        config.write_text(f'[auth]\nadmin_dids = ["{key.did}"]\n')
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + DEADLINE_S
        while "1 admin DID(s)" not in server.output():
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.05)
        assert "admin" in _capabilities(server.url, key)
        with RegistryClient(server.url) as client:
            client.sign_in(key)
            assert client._request("GET", "/v1/health/deep")["status"] in ("ok", "degraded")


def test_a_reload_names_the_changed_keys_it_does_not_apply(
    database_url: str, tmp_path: Path
) -> None:
    """Only the peers and `auth.admin_dids` change while running. A reload of a file that
    changed others said `configuration reloaded` and nothing else, as if they had taken
    effect; it names them and says they need a restart."""
    config = tmp_path / "registry.toml"
    config.write_text("[metrics]\nopen = false\n")
    with run_server(tmp_path / "node", database_url=database_url, config=config) as server:
        config.write_text("[metrics]\nopen = true\n[anchoring]\nbatch_size = 7\n")
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + DEADLINE_S
        while "configuration reloaded" not in server.output():
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.05)
        [line] = [x for x in server.output().splitlines() if "not applied" in x]
        assert "anchoring.batch_size, metrics.open" in line
        assert "restart" in line
        assert httpx.get(f"{server.url}/metrics").status_code == 401  # still closed


def test_a_sighup_while_starting_is_applied_once_serving(database_url: str, tmp_path: Path) -> None:
    """SIGHUP was taken only once serving; before (the embedded PostgreSQL starting, the
    migrations running) its default action ended the process: `systemctl reload` during a
    start killed the registry (and left its embedded cluster running)."""
    key = SigningKey.generate()
    config = tmp_path / "registry.toml"
    config.write_text("[auth]\nadmin_dids = []\n")
    with (
        migrations_held(database_url) as release,
        run_server(
            tmp_path / "node", database_url=database_url, config=config, healthy=False
        ) as server,
    ):
        deadline = time.monotonic() + DEADLINE_S
        while "registry DID" not in server.output():  # logged once SIGHUP is taken
            assert server.proc.poll() is None, server.output()
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.05)
        config.write_text(f'[auth]\nadmin_dids = ["{key.did}"]\n')
        server.proc.send_signal(signal.SIGHUP)
        release.set()
        wait_healthy(server, DEADLINE_S)
        while "1 admin DID(s)" not in server.output():
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.05)
        assert "admin" in _capabilities(server.url, key)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[auth\nadmin_dids = [", "invalid TOML"),
        ('[auth]\nadmin_dids = ["not-a-did"]\n', "auth.admin_dids"),
        ("[database]\npool_max = 2\n", "database.pool_max must be at least"),
        (b'[auth]\nroot_did = "caf\xe9"\n', "not UTF-8"),
        (None, "cannot read the configuration file"),
    ],
)
def test_a_reload_of_a_file_that_does_not_load_keeps_the_running_configuration(
    database_url: str, tmp_path: Path, text: str | bytes | None, says: str
) -> None:
    """SIGHUP with a file that does not load (bad TOML, a bad value, not UTF-8, gone): one
    ERROR line that says why, the process serves on with what it runs, and a later good file
    is applied."""
    key = SigningKey.generate()
    config = tmp_path / "registry.toml"
    config.write_text(f'[auth]\nadmin_dids = ["{key.did}"]\n')
    with run_server(tmp_path / "node", database_url=database_url, config=config) as server:
        if text is None:
            config.unlink()
        elif isinstance(text, bytes):
            config.write_bytes(text)
        else:
            config.write_text(text)
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + DEADLINE_S
        while "configuration reload refused" not in server.output():
            assert server.proc.poll() is None, server.output()
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.05)
        [line] = [x for x in server.output().splitlines() if "reload refused" in x]
        assert " ERROR " in line
        why = server.output().split("reload refused", 1)[1]  # the line and the ones it adds
        assert says in why.split(" INFO ")[0], why
        assert "admin" in _capabilities(server.url, key)
        config.write_text("[auth]\nadmin_dids = []\n")
        server.proc.send_signal(signal.SIGHUP)
        while "0 admin DID(s)" not in server.output():
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.05)
        assert "admin" not in _capabilities(server.url, key)


def test_a_sighup_before_the_service_runs_at_all_does_not_end_it(
    database_url: str, tmp_path: Path
) -> None:
    """Before trio runs (the configuration read, the imports), SIGHUP's default action ended
    the process. The configuration file is a FIFO here, so `serve` waits in reading it."""
    fifo = tmp_path / "registry.toml"
    os.mkfifo(fifo)
    with run_server(
        tmp_path / "node", database_url=database_url, config=fifo, healthy=False
    ) as server:
        with fifo.open("w") as writer:  # returns once `serve` has opened the FIFO to read it
            server.proc.send_signal(signal.SIGHUP)
            writer.write("[auth]\nadmin_dids = []\n")
        wait_healthy(server, DEADLINE_S)
