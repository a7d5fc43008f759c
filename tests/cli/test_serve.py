"""`registry serve` and `registry migrate` refuse what cannot work in one line (a port in use, a
data directory in use, a database that is not there); the help of every command; a
`max_page_size` below the default page size."""

from __future__ import annotations

import argparse
import errno
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from cli.main import _server_failure, build_parser
from registry.config import ConfigError, load_config
from registry.keys import SigningKey
from registry.store.embedded import EmbeddedPostgres
from service.serve import DataDirInUse
from tests.cli.cli_support import Cli
from tests.db.proc import (
    Server,
    free_port,
    migration_waiters,
    migrations_held,
    query,
    run_server,
)
from tests.helpers import entry_template


def test_serve_on_a_port_in_use(tmp_path: Path, database_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ran = Cli(tmp_path)(
            *("serve", "--port", port, "--data-dir", tmp_path / "data"),
            *("--database-url", database_url),
        )
    assert ran.error_line() == (
        f"registry: port {port} on 127.0.0.1 is already in use (another registry or program"
        " listens there); stop it, or choose another port with --port"
    )


def test_serve_with_its_metrics_listener_port_in_use_names_that_port(
    tmp_path: Path, database_url: str
) -> None:
    """It was reported as the API's port (which was free), with --port as the way out."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        metrics_port = taken.getsockname()[1]
        cli = Cli(tmp_path)
        toml = cli.write("registry.toml", f'[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n')
        ran = cli(
            *("serve", "--port", free_port(), "--data-dir", tmp_path / "data"),
            *("--database-url", database_url, "--config", toml),
        )
    assert ran.error_line() == (
        f"registry: port {metrics_port} on 127.0.0.1 is already in use (another registry or"
        " program listens there); stop it, or choose another port with metrics.listen"
    )


def test_a_data_dir_that_cannot_be_made_is_named_not_blamed_on_the_database(
    tmp_path: Path, database_url: str
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    ran = Cli(tmp_path)(
        *("serve", "--port", free_port(), "--data-dir", blocker / "data"),
        *("--database-url", database_url),
    )
    line = ran.error_line()
    assert line.startswith(f"registry: cannot use {blocker / 'data'}"), line
    assert "database" not in line.replace("(server.data_dir)", ""), line


def test_a_configuration_file_that_is_not_utf8_is_an_invalid_configuration(
    tmp_path: Path,
) -> None:
    """An invalid configuration stops the command with status 2 and a line naming the file,
    also when the file is not UTF-8 (it ended as an unexpected error, status 1)."""
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'[server]\nhost = "caf\xe9"\n')
    line = Cli(tmp_path)("migrate", "--config", bad).error_line(2)
    assert line == f"registry: {bad}: not UTF-8 text (byte 20); save it as UTF-8, as TOML requires"


def test_serve_with_a_malformed_registry_key_file_is_a_usage_error(tmp_path: Path) -> None:
    """A malformed `server.key_file` is a usage error (status 2) whose line says what to do."""
    cli = Cli(tmp_path)
    key = cli.write("registry.key", {"type": "Ed25519", "seed": "AAAA"})
    config = cli.write("registry.toml", f'[server]\nkey_file = "{key}"\n')
    ran = cli(
        *("serve", "--config", config, "--port", free_port()),
        *("--database-url", "postgresql://postgres@127.0.0.1:1/x"),
    )
    assert ran.error_line(2) == (
        f"registry: {key}: seed must be 32 bytes; restore the registry's key file there, or name"
        " it with server.key_file (its did:key is the registry DID: a new key is another registry)"
    )


def test_a_data_dir_that_is_a_file_says_so_and_what_to_do(tmp_path: Path) -> None:
    """`--data-dir` naming a regular file: one line that says so and what to do (it was
    `registry: FILE: File exists`)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    expected = (
        f"registry: cannot use {blocker} as the data directory (a file is there); choose another"
        " with --data-dir (server.data_dir)"
    )
    cli = Cli(tmp_path)
    assert cli("serve", "--port", free_port(), "--data-dir", blocker).error_line() == expected
    assert cli("migrate", "--data-dir", blocker).error_line() == expected


def test_a_second_serve_or_migrate_on_a_data_dir_in_use(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with run_server(data_dir) as first:  # the embedded PostgreSQL of data_dir
        cli = Cli(tmp_path)
        expected = (
            f"registry: {data_dir} is in use by a running registry (pid {first.proc.pid}); give"
            " this one its own --data-dir, or a --database-url to share a database"
        )
        second = cli("serve", "--port", free_port(), "--data-dir", data_dir)
        assert second.error_line() == expected
        assert cli("migrate", "--data-dir", data_dir).error_line() == expected
        assert httpx.get(f"{first.url}/v1/health", timeout=10).status_code == 200
    location = data_dir / "postgres.location"
    if location.exists():  # the root fallback lives outside tmp_path: remove it
        shutil.rmtree(location.read_text().strip(), ignore_errors=True)


def test_serve_with_a_database_that_is_not_there(tmp_path: Path) -> None:
    port = free_port()
    url = f"postgresql://postgres:secret@127.0.0.1:{port}/registry"
    ran = Cli(tmp_path)(
        "serve", "--port", free_port(), "--data-dir", tmp_path / "data", "--database-url", url
    )
    assert ran.status == 1
    assert "Traceback" not in ran.stderr
    last = ran.stderr.splitlines()[-1]  # after the log lines of the start
    assert last.startswith(
        "registry: cannot use the database at"
        f" postgresql://postgres:***@127.0.0.1:{port}/registry: "
    )
    assert last.endswith("; check --database-url (database.url)")
    assert "secret" not in ran.stderr


def test_the_database_password_is_hidden_also_in_the_url_query(tmp_path: Path) -> None:
    """A password given as `?password=` (libpq and asyncpg take it there) is hidden as the one
    of the user part is; the rest of the URL is shown as written."""
    url = "postgresql://postgres@127.0.0.1:1/x?sslmode=disable&password=hunter2&sslpassword=pw2"
    line = Cli(tmp_path)("migrate", "--database-url", url).error_line()
    assert line.startswith(
        "registry: cannot use the database at"
        " postgresql://postgres@127.0.0.1:1/x?sslmode=disable&password=***&sslpassword=***: "
    ), line
    assert "hunter2" not in line
    assert "pw2" not in line


def test_the_checks_that_race_are_explained_after_the_fact_too(tmp_path: Path) -> None:
    """The port or the data directory can be taken between the checks and `serve`'s own bind
    or lock: the error `serve` then raises, deep in exception groups, is explained the same."""
    config = load_config(None, environ={}, overrides={"server": {"port": 18999}})
    in_use = OSError(errno.EADDRINUSE, "Address already in use")
    failure = _server_failure(ExceptionGroup("serve", [ExceptionGroup("http", [in_use])]), config)
    assert failure is not None
    assert str(failure).startswith("port 18999 on 127.0.0.1 is already in use")
    failure = _server_failure(ExceptionGroup("serve", [DataDirInUse("the message")]), config)
    assert failure is not None
    assert str(failure) == "the message"
    assert _server_failure(ExceptionGroup("serve", [RuntimeError("a bug")]), config) is None


def test_migrate_has_only_the_database_options(tmp_path: Path, database_url: str) -> None:
    cli = Cli(tmp_path)
    usage = cli.ok("migrate", "--help").stdout
    assert "--database-url" in usage
    assert "--data-dir" in usage
    assert "--port" not in usage
    assert "--host" not in usage
    # "up to date" (the session fixture migrated), unless a migration was added since.
    assert re.fullmatch(
        r"up to date\n|applied \[[0-9, ]+\]\n",
        cli.ok("migrate", "--database-url", database_url).stdout,
    )
    line = cli("migrate", "--port", "1").stderr.splitlines()[-1]
    assert line == "registry: error: unrecognized arguments: --port 1"


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_has_help_that_says_its_default() -> None:
    parser = build_parser()
    commands = _commands(parser)
    assert set(commands) == {
        *("serve", "migrate", "keygen", "login", "logout", "publish", "update"),
        *("get", "versions", "delete", "watch", "verify-anchor", "peers", "status"),
        *("verify-entry", "audit"),
    }
    for name, command in [("registry", parser), *commands.items()]:
        for action in command._actions:
            if isinstance(
                action, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction
            ):
                continue
            if action.help == argparse.SUPPRESS:  # --debug, repeated after the command
                continue
            assert action.help, (name, action.dest)
            if action.option_strings:
                assert "default" in action.help or "required" in action.help, (name, action.help)


def test_version_prints_the_installed_version(tmp_path: Path) -> None:
    from importlib.metadata import version

    assert Cli(tmp_path).ok("--version").stdout == f"registry {version('registry')}\n"


def test_help_shows_the_defaults(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    assert "(default: http://127.0.0.1:8080;" in cli.ok("publish", "--help").stdout
    serve = " ".join(cli.ok("serve", "--help").stdout.split())
    assert "--port PORT listen port (default: server.port, 8080)" in serve
    assert "--host HOST listen address (default: server.host, 127.0.0.1)" in serve
    assert "(default: server.data_dir, .registry)" in serve


def test_a_max_page_size_below_the_default_lowers_the_default() -> None:
    limits = load_config(None, environ={"REGISTRY_LIMITS__MAX_PAGE_SIZE": "5"}).limits
    assert (limits.max_page_size, limits.default_page_size) == (5, 5)
    limits = load_config(None, environ={}, overrides={"limits": {"max_page_size": 50}}).limits
    assert (limits.max_page_size, limits.default_page_size) == (50, 20)
    with pytest.raises(ConfigError, match="default_page_size must not exceed max_page_size"):
        load_config(
            None, environ={}, overrides={"limits": {"max_page_size": 5, "default_page_size": 6}}
        )


@pytest.mark.parametrize("key", ["discover_page_bytes", "versions_page_bytes", "trust_page_bytes"])
def test_a_page_byte_budget_above_one_gib_is_refused_at_load(key: str) -> None:
    """A page's byte budget is a PostgreSQL parameter: one it could not take (2**63 was
    accepted and then failed every list with a 400 blaming the request) is refused here."""
    assert getattr(load_config(None, environ={}, overrides={"limits": {key: 1 << 30}}).limits, key)
    with pytest.raises(ConfigError, match=key):
        load_config(None, environ={}, overrides={"limits": {key: (1 << 30) + 1}})
    with pytest.raises(ConfigError, match=key):
        load_config(None, environ={f"REGISTRY_LIMITS__{key.upper()}": str(2**63)})


def test_a_negative_count_of_trusted_proxies_is_refused_at_load() -> None:
    """-1 read the client's own choice of address from X-Forwarded-For (rate limits evaded),
    and every request without the header failed (IndexError, 500)."""
    with pytest.raises(ConfigError, match="trusted_proxies"):
        load_config(None, environ={"REGISTRY_SERVER__TRUSTED_PROXIES": "-1"})
    assert load_config(None, environ={"REGISTRY_SERVER__TRUSTED_PROXIES": "2"}).server


@pytest.mark.parametrize("listen", ["localhost:9464", "metrics.internal:9464"])
def test_a_metrics_listener_named_by_a_host_name_is_refused_at_load(listen: str) -> None:
    """The listener is told by the address a request reached: a name never equalled it, and
    the whole API was served on the metrics port."""
    with pytest.raises(ConfigError, match="IP address"):
        load_config(None, environ={}, overrides={"metrics": {"listen": listen}})
    for fine in ("127.0.0.1:9464", "[::1]:9464", "0.0.0.0:9464"):
        config = load_config(None, environ={}, overrides={"metrics": {"listen": fine}})
        assert config.metrics.listen == fine


def test_a_metrics_listener_on_the_apis_port_is_refused_at_load(
    tmp_path: Path, database_url: str
) -> None:
    """The same port as the API's, on its address or a wildcard one: the second bind failed
    once the start was done (migrations applied), saying to stop what listens there."""
    port = free_port()
    cli = Cli(tmp_path)
    config = cli.write("registry.toml", f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    ran = cli(
        *("serve", "--config", config, "--port", port, "--data-dir", tmp_path / "data"),
        *("--database-url", database_url),
    )
    assert ran.status == 2, ran.stderr
    assert "takes the port the API is served on" in ran.stderr
    with pytest.raises(ConfigError, match="takes the port the API is served on"):
        load_config(
            None,
            environ={"REGISTRY_METRICS__LISTEN": f"0.0.0.0:{port}"},
            overrides={"server": {"port": port}},
        )
    fine = load_config(None, environ={"REGISTRY_METRICS__LISTEN": f"127.0.0.2:{port}"})
    assert fine.metrics.listen == f"127.0.0.2:{port}"


def test_the_service_starts_with_max_page_size_2_and_pages_by_2(server: Server) -> None:
    """The module's server runs with REGISTRY_LIMITS__MAX_PAGE_SIZE=2 and no default page size."""
    from cli.client import RegistryClient

    key = SigningKey.generate()
    with RegistryClient(server.url) as client:
        client.sign_in(key)
        entry = client.publish(entry_template(), key)
        for n in range(2):
            entry = client.update({**entry, "version": f"1.{n}"}, key, based_on=entry["sequence"])
        page = client.versions(entry["entryDid"])
    assert (len(page["versions"]), page["hasMore"], page["totalCount"]) == (2, True, 3)


def test_the_open_files_limit_is_raised_and_the_connection_cap_kept_below_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import resource

    from registry.config import load_config
    from service.serve import FILES_RESERVED, connection_limits, raise_file_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(1024, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        with caplog.at_level("INFO", logger="registry"):
            assert raise_file_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
        if hard > lowered:
            assert f"open files limit raised from {lowered} to {hard}" in caplog.text
        config = load_config(None, environ={})
        limits = connection_limits(config, 1024)
        assert limits.max_connections == 1024 - FILES_RESERVED
        assert "server.max_connections lowered from 4096 to 768" in caplog.text
        assert connection_limits(config, 1 << 20).max_connections == 4096
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_pool_the_held_connections_would_fill_is_refused_at_load(tmp_path: Path) -> None:
    """Each process holds a pooled connection for its lifetime for the log's LISTEN and for each
    leadership (transparency, anchoring, federation with a peer to sync): with database.pool_max
    at or below their number nothing else got a connection, and `serve` never got to serving
    (pool_max 1) or answered a GET in tens of seconds, health "degraded" (pool_max 2)."""
    cli = Cli(tmp_path)
    config = cli.write("registry.toml", "[database]\npool_max = 3\n")
    ran = cli(
        *("serve", "--config", config, "--port", free_port()),
        *("--database-url", "postgresql://postgres@127.0.0.1:1/x"),
    )
    assert (ran.status, "Traceback" in ran.stderr) == (2, False), ran.stderr
    assert ran.stderr.splitlines()[1].strip() == (
        "database.pool_max must be at least 4 with this configuration: 3"
        " connection(s) are held for the process's lifetime (the log's LISTEN, the transparency"
        " leadership, the anchoring leadership) and requests need at least one more"
    )
    off = {"transparency": {"enabled": False}, "anchoring": {"enabled": False}}
    peer = {"peer_did": SigningKey.generate().did, "endpoint": "https://peer.example"}
    for overrides, least in [
        ({**off, "database": {"pool_max": 1}}, 2),
        (
            {
                **off,
                "database": {"pool_max": 1, "url": "postgresql://x", "read_url": "postgresql://y"},
            },
            0,
        ),
        ({**off, "federation": {"peers": [peer]}, "database": {"pool_max": 2}}, 3),
    ]:
        if least:
            with pytest.raises(ConfigError, match=f"pool_max must be at least {least} "):
                load_config(None, environ={}, overrides=overrides)
        else:
            assert load_config(None, environ={}, overrides=overrides).database.pool_max == 1


def test_the_service_serves_at_once_with_the_smallest_pool_it_accepts(
    database_url: str, tmp_path: Path
) -> None:
    """run_server turns anchoring off: the LISTEN and the transparency leadership are held,
    and a third connection serves the requests."""
    env = {"REGISTRY_DATABASE__POOL_MAX": "3", "REGISTRY_DATABASE__POOL_MIN": "1"}
    with run_server(tmp_path, database_url=database_url, extra_env=env) as server:
        health = httpx.get(f"{server.url}/v1/health", timeout=10).json()
        assert health["status"] == "ok", health
        answer = httpx.get(f"{server.url}/v1/entries/did:web:pool-probe.example", timeout=5)
        assert answer.status_code == 404


@contextmanager
def _migrate_waiting(cli: Cli, url: str, *args: str | Path) -> Iterator[subprocess.Popen[str]]:
    """`registry migrate *args` (its database `url`), once it waits for the migrations' lock
    (the caller holds it: `migrations_held`); killed at the end if it still runs."""
    migrate = subprocess.Popen(
        [sys.executable, "-m", "cli", "migrate", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cli.home,
        env=cli.env(),
    )
    try:
        deadline = time.monotonic() + 60
        while not migration_waiters(url):
            assert migrate.poll() is None, migrate.communicate()
            assert time.monotonic() < deadline, "migrate never waited for the migrations' lock"
            time.sleep(0.05)
        yield migrate
    finally:
        if migrate.poll() is None:
            migrate.kill()
            migrate.wait()


@contextmanager
def _embedded_cluster() -> Iterator[tuple[Path, Cli, EmbeddedPostgres, str]]:
    """A running embedded cluster in a fresh data directory (a `migrate --data-dir` of it reuses
    it), a CLI beside it, and its DSN; stopped and removed at the end."""
    top = Path(tempfile.mkdtemp(prefix="registry-migrate-"))
    top.chmod(0o755)  # reachable by the cluster's OS user (as root: postgres)
    data_dir = top / "data"
    embedded = EmbeddedPostgres(data_dir)
    try:
        yield data_dir, Cli(top / "cli"), embedded, embedded.start()
    finally:
        embedded.stop()
        shutil.rmtree(top, ignore_errors=True)


def test_migrate_waiting_for_another_migration_stops_on_sigint(
    database_url: str, tmp_path: Path
) -> None:
    """Ctrl-C did not stop `registry migrate` while it waited for another process's
    migrations (only SIGKILL or SIGTERM's default did); it stops, status 130, one line."""
    cli = Cli(tmp_path)
    with (
        migrations_held(database_url),
        _migrate_waiting(cli, database_url, "--database-url", database_url) as migrate,
    ):
        migrate.send_signal(signal.SIGINT)
        _, stderr = migrate.communicate(timeout=30)
    assert migrate.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.splitlines()[-1].startswith("registry: migrate interrupted; "), stderr
    assert not migration_waiters(database_url)


def test_migrate_holds_the_embedded_data_dir_until_it_ends() -> None:
    """`migrate` checked that no other process held the data directory, then let it go: a
    `serve` (or `migrate`) started meanwhile shared its embedded cluster, which the first
    one's stop at its end took away. Now it is `in use` until the first ends (here by SIGTERM,
    while it waits for the migrations' lock: the cluster is stopped again, status 130)."""
    with _embedded_cluster() as (data_dir, cli, _, dsn):
        with migrations_held(dsn), _migrate_waiting(cli, dsn, "--data-dir", data_dir) as first:
            line = cli("migrate", "--data-dir", data_dir).error_line()
            assert line.startswith(f"registry: {data_dir} is in use by a running registry ")
            first.send_signal(signal.SIGTERM)
            _, stderr = first.communicate(timeout=60)
        assert first.returncode == 130, stderr
        assert not (data_dir / "postgres" / "postmaster.pid").exists()


def test_a_database_connection_lost_during_the_migrations_is_one_line(
    database_url: str, tmp_path: Path
) -> None:
    """The migrations' connection ended by the server: the runner's cleanup (unlocking on the
    closed connection) replaced the error with `InterfaceError: connection is closed`, an
    `unexpected error ... (a bug)`."""
    cli = Cli(tmp_path)
    with (
        migrations_held(database_url),
        _migrate_waiting(cli, database_url, "--database-url", database_url) as migrate,
    ):
        [waiting] = migration_waiters(database_url)
        query(database_url, "SELECT pg_terminate_backend($1)", waiting)
        _, stderr = migrate.communicate(timeout=30)
    assert migrate.returncode == 1, stderr
    line = stderr.splitlines()[-1]
    assert line.startswith(f"registry: cannot use the database at {database_url}: "), stderr
    assert "unexpected error" not in stderr


def test_an_embedded_cluster_that_stops_during_the_migrations_is_one_line() -> None:
    """Also a cluster that is gone when `migrate` stops it at the end (its pid file read, then
    removed) was an error of its own (`pg_ctl stop failed ... Is server running?`)."""
    with _embedded_cluster() as (data_dir, cli, embedded, dsn):
        with migrations_held(dsn), _migrate_waiting(cli, dsn, "--data-dir", data_dir) as migrate:
            embedded.control("stop", "-m", "immediate")
            _, stderr = migrate.communicate(timeout=60)
        assert migrate.returncode == 1, stderr
        line = stderr.splitlines()[-1]
        assert line.startswith(f"registry: the embedded PostgreSQL of {data_dir} failed: "), stderr
