"""The `registry` command (docs/cli.md).

Server: serve, migrate. Keys and sessions: keygen, login, logout. Entries: publish, update, get,
versions, delete. Anchors: verify-anchor. Events: watch.

A user's mistake (a malformed file, a stopped server, a port or data directory in use, an error
answer from the registry) ends the command with one line on stderr — what happened and what to
do — and a non-zero exit status; tracebacks are shown only with `registry --debug ...`.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import logging
import math
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote_plus, urlsplit, urlunsplit

from registry.keys import KeyFileError, SigningKey, read_key_file, write_key_file

if TYPE_CHECKING:  # registry.config (pydantic) is imported only by the commands that need it
    from cli.client import RegistryClient, RegistryClientError
    from registry.config import Config

DEFAULT_URL = os.environ.get("REGISTRY_URL", "http://127.0.0.1:8080")
DEFAULT_SESSION_FILE = "~/.registry-session.json"
SESSION_MARGIN_MS = 60_000  # a saved session this close to expiry is not reused

EXIT_FAILED = 1  # the command could not do its work: refused, unreachable, in use
EXIT_USAGE = 2  # the invocation or its input is wrong: options, configuration, key, entry file
EXIT_INTERRUPTED = 130

T = TypeVar("T")


class CliError(Exception):
    """A failure the user can act on: `registry: <message>` on stderr, then exit `status`."""

    def __init__(self, message: str, status: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.status = status


# --- logging (serve, migrate) -------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line; tracebacks are a field, not extra lines."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "t": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        access = getattr(record, "access", None)  # an access-log line: its fields as members
        if isinstance(access, dict):
            line.update(access)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def _setup_logging(config: Config) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if config.logging.format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=config.logging.level, handlers=[handler])
    # The peer actors' HTTP client logs every request at INFO: a pull every few seconds.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


# --- serve, migrate -----------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> Config:
    from registry.config import load_config

    server = {
        "host": getattr(args, "host", None),
        "port": getattr(args, "port", None),
        "data_dir": args.data_dir,
    }
    database = {"url": args.database_url}
    return load_config(args.config, overrides={"server": server, "database": database})


_SECRET_PARAMETERS = frozenset({"password", "sslpassword"})  # libpq's, also taken by asyncpg


def _redacted(url: str) -> str:
    """A database URL without its passwords: the user part's and the query's."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
    query = "&".join(  # the other parameters as they were written
        f"{name}=***" if unquote_plus(name).lower() in _SECRET_PARAMETERS else f"{name}{eq}{value}"
        for name, eq, value in (pair.partition("=") for pair in parts.query.split("&"))
    )
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _check_port_free(host: str, port: int, *, setting: str | None = None) -> None:
    """Fail before anything starts if the listen address is taken (as Hypercorn binds it);
    `setting` names what chooses it."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise CliError(
            f"cannot listen on {host}: {exc.strerror}; check {setting or '--host'}"
        ) from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise _bind_error(host, port, exc, setting=setting) from None


def _bind_error(host: str, port: int, exc: OSError, *, setting: str | None = None) -> CliError:
    if exc.errno == errno.EADDRINUSE:
        return CliError(
            f"port {port} on {host} is already in use (another registry or program listens"
            f" there); stop it, or choose another port with {setting or '--port'}"
        )
    reason = exc.strerror or str(exc)
    return CliError(
        f"cannot listen on {host} port {port}: {reason[:1].lower()}{reason[1:]}; choose another"
        f" with {setting or '--host/--port'}"
    )


@contextmanager
def _data_dir_owned(data_dir: Path) -> Iterator[None]:
    """Hold the data directory's lock (the one `service.serve` takes for its embedded
    database), or fail with the line `serve` would give if another process holds it."""
    from service.serve import DataDirInUse, own_data_dir

    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # e.g. a file of that name
        reason = "a file is there" if data_dir.is_file() else exc.strerror
        raise CliError(
            f"cannot use {data_dir} as the data directory ({reason}); choose another with"
            " --data-dir (server.data_dir)"
        ) from None
    with ExitStack() as stack:
        try:
            stack.enter_context(own_data_dir(data_dir))
        except DataDirInUse as exc:
            raise CliError(str(exc)) from None
        yield


def _check_data_dir_free(data_dir: Path) -> None:
    """Fail before anything starts if another process owns this data directory."""
    with _data_dir_owned(data_dir):
        pass


def cmd_serve(args: argparse.Namespace) -> int:
    # Until `serve` takes SIGHUP (a reload), its default would end the process: with systemd,
    # a `systemctl reload` just after the start stopped the registry for good (a clean exit
    # signal, not restarted). One that comes meanwhile is dropped (the file is read from here
    # on, the imports follow).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    config = _config(args)
    _check_port_free(config.server.host, config.server.port)
    metrics = config.metrics.address
    if metrics is not None:
        _check_port_free(*metrics, setting="metrics.listen")
    if not config.database.url:
        _check_data_dir_free(config.server.data_dir)

    import trio

    from service.serve import serve

    _setup_logging(config)
    serving = False

    async def run() -> None:
        nonlocal serving
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(serve, config, reload=lambda: _config(args)))
            serving = True  # from here a database fault is a condition, never the URL's fault

    try:
        trio.run(run)
    except BaseException as exc:  # the checks above can race: explain what `serve` met
        failure = None if serving else _server_failure(exc, config)
        if failure is None:
            raise
        raise failure from exc
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    config = _config(args)
    data_dir = config.server.data_dir
    # The embedded database's directory is held for the whole run: a `serve` started meanwhile
    # would share the cluster, and the stop at the end would take its database away.
    owned = nullcontext() if config.database.url else _data_dir_owned(data_dir)

    import trio
    import trio_asyncio

    from registry.store.embedded import EmbeddedPostgres
    from registry.store.migrate import migrate

    _setup_logging(config)

    async def apply() -> list[int]:
        async with trio_asyncio.open_loop():
            if config.database.url:
                return await migrate(config.database.url)
            embedded = EmbeddedPostgres(data_dir)
            try:
                return await migrate(await trio.to_thread.run_sync(embedded.start))
            finally:
                with trio.CancelScope(shield=True):  # also when a signal cancelled the run
                    await trio.to_thread.run_sync(embedded.stop)

    async def run() -> list[int] | None:
        """The migrations applied, or None when SIGINT or SIGTERM stopped the run (a wait
        for another process's migrations too, which Ctrl-C did not end)."""
        with trio.CancelScope() as whole:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async with trio.open_nursery() as nursery:

                    async def stop_on_signal() -> None:
                        async for signum in signals:
                            logging.getLogger("registry").info(
                                "received %s, stopping", signal.Signals(signum).name
                            )
                            whole.cancel()

                    nursery.start_soon(stop_on_signal)
                    applied = await apply()
                    nursery.cancel_scope.cancel()
            return applied
        return None

    try:
        with owned:
            applied = trio.run(run)
    except BaseException as exc:
        failure = _server_failure(exc, config)
        if failure is None:
            raise
        raise failure from exc
    if applied is None:
        raise CliError(
            "migrate interrupted; each migration runs in its own transaction, so those applied"
            " stay and none is half-applied: run `registry migrate` again for the rest",
            EXIT_INTERRUPTED,
        )
    print(f"applied {applied}" if applied else "up to date")
    return 0


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _server_failure(exc: BaseException, config: Config) -> CliError | None:
    """What `serve`/`migrate` met, as a `CliError` when it is something the user can fix;
    None for anything else (a bug, Ctrl-C)."""
    import asyncpg

    from registry.store.embedded import EmbeddedPostgresError
    from registry.store.migrate import MigrationError
    from service.serve import DataDirInUse

    for leaf in _leaves(exc):
        if isinstance(leaf, DataDirInUse):
            return CliError(str(leaf))
        if isinstance(leaf, OSError) and leaf.errno == errno.EADDRINUSE:
            metrics = config.metrics.address
            if metrics is not None:  # which of the two was taken in between is not known
                return CliError(
                    f"port {config.server.port} on {config.server.host} or the metrics"
                    f" listener {config.metrics.listen} is already in use; stop what listens"
                    " there, or choose another (--port, metrics.listen)"
                )
            return _bind_error(config.server.host, config.server.port, leaf)
        if isinstance(leaf, KeyFileError):  # the registry's own key (server.key_file)
            return CliError(
                f"{leaf}; restore the registry's key file there, or name it with"
                " server.key_file (its did:key is the registry DID: a new key is another registry)",
                EXIT_USAGE,
            )
        if isinstance(leaf, MigrationError | EmbeddedPostgresError):
            return CliError(str(leaf))
        if isinstance(leaf, OSError) and leaf.filename is not None:
            # A path this process could not make or use (the data directory, a key file):
            # not the database's fault, whatever database.url says.
            return CliError(
                f"cannot use {leaf.filename}: {leaf.strerror or leaf}; check --data-dir"
                " (server.data_dir) and the paths of the configuration"
            )
        if isinstance(leaf, asyncpg.PostgresError | OSError) and config.database.url:
            return CliError(
                f"cannot use the database at {_redacted(config.database.url)}:"
                f" {leaf.__class__.__name__}: {leaf}; check --database-url (database.url)"
            )
        if isinstance(leaf, asyncpg.PostgresError | OSError):  # the embedded one's
            return CliError(
                f"the embedded PostgreSQL of {config.server.data_dir} failed:"
                f" {leaf.__class__.__name__}: {leaf}; see server.log in its cluster directory"
                " (postgres/ there, or where postgres.location says)"
            )
    return None


# --- keys and sessions --------------------------------------------------------------------------


def cmd_keygen(args: argparse.Namespace) -> int:
    key = SigningKey.generate()
    try:
        write_key_file(Path(args.out), key)
    except FileExistsError:
        raise CliError(f"{args.out} exists; not overwriting a key (choose another --out)") from None
    except OSError as exc:
        raise CliError(f"{args.out}: {exc.strerror}", EXIT_USAGE) from None
    print(key.did)
    return 0


def session_file() -> Path:
    """Where `registry login` saves sessions: $REGISTRY_SESSION_FILE, else the default."""
    return Path(os.environ.get("REGISTRY_SESSION_FILE") or DEFAULT_SESSION_FILE).expanduser()


def _url_key(url: str) -> str:
    return url.rstrip("/")


def _now_ms() -> int:
    return int(time.time() * 1000)


def _load_sessions() -> list[dict[str, Any]]:
    """The saved sessions; a missing or unreadable file is no sessions, and a session of
    another form (a file edited by hand) is none."""
    try:
        data = json.loads(session_file().read_text())
    except (OSError, ValueError):
        return []
    if isinstance(data, dict) and isinstance(data.get("sessions"), list):
        return [s for s in data["sessions"] if _is_session(s)]
    if isinstance(data, dict) and _is_session(data):  # the earlier one-session format
        return [{**data, "did": data.get("signerDid")}]
    return []


def _is_session(saved: Any) -> bool:
    """A saved session as `_save_session` writes it (the members the commands read)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("sessionToken"), str):
        return False
    if not isinstance(saved.get("url", ""), str):
        return False
    return all(
        isinstance(saved.get(m, 0), int) and not isinstance(saved.get(m), bool)
        for m in ("expiresAtMs", "savedAtMs")
    )


def _store_sessions(sessions: list[dict[str, Any]]) -> None:
    """Write the session file atomically, mode 0600 (its tokens are credentials)."""
    path = session_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    live = [s for s in sessions if int(s.get("expiresAtMs") or 0) > _now_ms()]
    fd, tmp = tempfile.mkstemp(prefix=".registry-session-", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump({"sessions": live}, handle, indent=2)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _save_session(url: str, result: dict[str, Any]) -> None:
    did = result.get("signerDid")
    kept = [
        s
        for s in _load_sessions()
        if not (_url_key(str(s.get("url", ""))) == _url_key(url) and s.get("did") == did)
    ]
    saved = {
        "url": _url_key(url),
        "did": did,
        "sessionToken": result["sessionToken"],
        "expiresAtMs": result.get("expiresAtMs"),
        "capabilities": result.get("capabilities", []),
        "savedAtMs": _now_ms(),
    }
    _store_sessions([*kept, saved])


def _forget_session(url: str, token: str) -> None:
    sessions = _load_sessions()
    kept = [
        s
        for s in sessions
        if not (_url_key(str(s.get("url", ""))) == _url_key(url) and s["sessionToken"] == token)
    ]
    if len(kept) != len(sessions):
        _store_sessions(kept)


def saved_session(url: str, did: str | None = None) -> dict[str, Any] | None:
    """The latest saved session for `url` (and the principal `did`, if given) that does not
    expire within a minute."""
    usable = [
        s
        for s in _load_sessions()
        if _url_key(str(s.get("url", ""))) == _url_key(url)
        and (did is None or s.get("did") == did)
        and int(s.get("expiresAtMs") or 0) > _now_ms() + SESSION_MARGIN_MS
    ]
    return max(usable, key=lambda s: int(s.get("savedAtMs") or 0), default=None)


def _read_key(path: str) -> SigningKey:
    try:
        return read_key_file(Path(path))
    except KeyFileError as exc:
        if isinstance(exc.__cause__, FileNotFoundError):
            raise CliError(
                f"{path}: no such key file; check --key, or make one with"
                f" `registry keygen --out {path}`",
                EXIT_USAGE,
            ) from exc
        if isinstance(exc.__cause__, OSError):
            raise CliError(f"{path}: {exc.__cause__.strerror}; check --key", EXIT_USAGE) from exc
        raise CliError(f"{exc}: not a key file made by `registry keygen`", EXIT_USAGE) from exc


def _key(args: argparse.Namespace) -> SigningKey | None:
    return _read_key(args.key) if args.key else None


@contextmanager
def _client(args: argparse.Namespace) -> Iterator[RegistryClient]:
    from cli.client import RegistryClient

    with RegistryClient(args.url) as client:
        yield client


def _as_principal(
    args: argparse.Namespace,
    client: RegistryClient,
    key: SigningKey | None,
    call: Callable[[], T],
) -> T:
    """Run `call` signed in: with the saved session of `key`'s DID (any saved session for the
    URL without a key) while it lasts; else, or when the registry refuses it, sign in with
    `key`."""
    from cli.client import RegistryClientError

    saved = saved_session(args.url, key.did if key else None)
    if saved is None:
        if key is None:
            raise CliError(
                f"no saved session for {_url_key(args.url)}; pass --key FILE, or sign in first"
                f" with `registry login --key FILE --url {_url_key(args.url)}`",
                EXIT_USAGE,
            )
        client.sign_in(key)
        return call()
    client.token = str(saved["sessionToken"])
    try:
        return call()
    except RegistryClientError as exc:
        if exc.status != 401:
            raise
        _forget_session(args.url, client.token)  # expired early, revoked, or another database
        if key is None:
            raise CliError(
                f"the session saved for {_url_key(args.url)} is no longer valid; sign in again"
                f" with `registry login --key FILE --url {_url_key(args.url)}`, or pass --key"
            ) from None
        client.sign_in(key)
        return call()


def cmd_login(args: argparse.Namespace) -> int:
    key = _read_key(args.key)
    with _client(args) as client:
        result = client.sign_in(key)
    with _reading("a session"):
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(result["expiresAtMs"] / 1000))
    _save_session(args.url, result)
    if args.print_token:  # for a script, or the console: the token alone on stdout
        print(result["sessionToken"])
    else:
        print(json.dumps({k: v for k, v in result.items() if k != "sessionToken"}, indent=2))
    print(f"session saved to {session_file()} (until {expires})", file=sys.stderr)
    return 0


def cmd_logout(args: argparse.Namespace) -> int:
    from cli.client import RegistryClientError

    key = _key(args)
    mine = [
        s
        for s in _load_sessions()
        if _url_key(str(s.get("url", ""))) == _url_key(args.url)
        and (key is None or s.get("did") == key.did)
    ]
    if not mine:
        print(f"no saved session for {_url_key(args.url)}", file=sys.stderr)
        return 0
    with _client(args) as client:
        for session in mine:
            client.token = str(session["sessionToken"])
            try:
                client.logout()
            except RegistryClientError as exc:
                if exc.status != 401:  # 401: already expired or revoked, nothing to revoke
                    raise
            _forget_session(args.url, str(session["sessionToken"]))
            print(f"logged out {session.get('did')} from {_url_key(args.url)}", file=sys.stderr)
    return 0


# --- entries ------------------------------------------------------------------------------------


def _read_entry(path: str) -> dict[str, Any]:
    """ENTRY.json: one JSON object under the registry's input rules, with entryDid and itemData."""
    from registry.canonical import parse_strict
    from registry.errors import Invalid

    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise CliError(f"{path}: {exc.strerror}", EXIT_USAGE) from None
    try:
        entry = parse_strict(raw)
    except Invalid as exc:
        raise CliError(f"{path}: {exc.message}; fix the file and retry", EXIT_USAGE) from None
    if not isinstance(entry, dict):
        raise CliError(f"{path}: an entry is a JSON object, not {type(entry).__name__}", EXIT_USAGE)
    missing = [m for m in ("entryDid", "itemData") if m not in entry]
    if missing:
        raise CliError(f"{path}: the entry has no {' and no '.join(missing)}", EXIT_USAGE)
    if not isinstance(entry["entryDid"], str):
        raise CliError(f"{path}: entryDid must be a string (a DID)", EXIT_USAGE)
    return entry


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def cmd_publish(args: argparse.Namespace) -> int:
    from cli.client import RegistryClientError

    entry = _read_entry(args.entry)
    key = _read_key(args.key)
    with _client(args) as client:
        try:
            result = _as_principal(args, client, key, lambda: client.publish(entry, key))
        except RegistryClientError as exc:
            if exc.code != "entry_exists":
                raise
            did = entry["entryDid"]
            try:
                client.get(did)
            except RegistryClientError as gone:
                if gone.code != "entry_not_found":
                    raise
                raise CliError(
                    f"{did} was deleted, and a deleted DID is never reused; publish under"
                    " another entryDid"
                ) from None
            raise CliError(
                f"{did} already exists; to publish a new version run"
                f" `registry update {args.entry} --key {args.key}`"
            ) from None
    _print_json(result)
    return 0


def cmd_update(args: argparse.Namespace) -> int:
    from cli.client import RegistryClientError

    entry = _read_entry(args.entry)
    key = _read_key(args.key)
    did = entry["entryDid"]
    with _client(args) as client:
        based_on = args.based_on
        if based_on is None:
            try:
                based_on = int(client.get(did)["sequence"])
            except RegistryClientError as exc:
                if exc.code == "entry_not_found":
                    raise CliError(
                        f"{did} does not exist at {_url_key(args.url)} (or was deleted); create"
                        " it with"
                        f" `registry publish {args.entry} --key {args.key}`"
                    ) from None
                raise

        base: int = based_on

        def put() -> dict[str, Any]:
            return client.update(entry, key, based_on=base)

        try:
            result = _as_principal(args, client, key, put)
        except RegistryClientError as exc:
            if exc.code == "sequence_conflict":
                latest = exc.details.get("latestSequence", "newer")
                raise CliError(
                    f"{did} changed since sequence {based_on} (latest: {latest}); check"
                    f" `registry versions {did}` and update again"
                ) from None
            if exc.code == "lifecycle_conflict":
                raise CliError(
                    f'{exc.message}; set "lifecycleStatus" in {args.entry} (an entry without'
                    " it is a draft)"
                ) from None
            raise
    _print_json(result)
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.sequence is None:
            result = client.get(args.did)
        else:
            result = client.version(args.did, args.sequence)
    _print_json(result)
    return 0


def cmd_verify_anchor(args: argparse.Namespace) -> int:
    """Re-check every anchored version of an entry: the served version's hash, its Merkle leaf
    and path, and (with --chain) that the chain's block holds the root."""
    from registry.anchoring import verify_anchor

    chain = None
    if args.chain is not None:
        from actors.chain import load_local_chain

        try:
            chain = load_local_chain(Path(args.chain))
        except OSError as exc:
            raise CliError(f"{args.chain}: {exc.strerror}", EXIT_USAGE) from None
    from cli.client import next_cursor

    records: list[dict[str, Any]] = []
    with _client(args) as client:
        cursor: str | None = None
        seen: set[str] = set()
        while True:
            page = client.anchors(args.did, cursor=cursor)
            records.extend(page["records"])
            cursor = next_cursor(page, seen)
            if cursor is None:
                break
        anchored = [r for r in records if "anchor" in r]
        if not anchored:
            states = ", ".join(f"{r['sequence']}: {r['state']}" for r in records) or "no intents"
            raise CliError(f"{args.did} has no anchored version yet ({states})")
        failed = 0
        for record in anchored:
            anchor = record["anchor"]
            version = client.version(args.did, int(record["sequence"]))
            roots = None if chain is None else chain.block_roots(int(anchor["blockHeight"]))
            check = verify_anchor(version, anchor, roots)
            where = f"block {anchor['blockHeight']}, tx {str(anchor['txHash'])[:16]}…"
            if check.ok:
                checked = ", ".join(check.checks)
                print(f"sequence {record['sequence']}: ok ({where}; checked {checked})")
            else:
                failed += 1
                print(
                    f"sequence {record['sequence']}: FAILED ({where}): {'; '.join(check.problems)}"
                )
        if chain is None:
            print("the roots were not checked against a chain (give --chain)", file=sys.stderr)
    return 1 if failed else 0


def _versions_table(versions: list[dict[str, Any]]) -> list[str]:
    rows = [("SEQUENCE", "VERSION", "STATUS", "UPDATED", "NAME")]
    for v in versions:
        rows.append(
            (
                str(v.get("sequence", "")),
                str(v.get("version", "")),
                str(v.get("lifecycleStatus", "draft")),
                str(v.get("updatedAt", "")),
                str(v.get("name", "")),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return [
        "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[4]])
        for row in rows
    ]


def cmd_versions(args: argparse.Namespace) -> int:
    from cli.client import next_cursor

    printed: list[dict[str, Any]] = []
    cursor: str | None = args.cursor
    seen = set() if cursor is None else {cursor}
    more = False
    with _client(args) as client:
        while args.limit is None or len(printed) < args.limit:
            want = None if args.limit is None else args.limit - len(printed)
            page = client.versions(args.did, limit=want, cursor=cursor)
            taken = page["versions"][:want] if want is not None else page["versions"]
            printed += taken
            more = bool(page.get("hasMore")) or len(taken) < len(page["versions"])
            cursor = next_cursor(page, seen)
            if cursor is None:
                break
    if args.json:
        for version in printed:
            print(json.dumps(version, ensure_ascii=False))
    else:
        print("\n".join(_versions_table(printed)))
    if more and printed:
        last = printed[-1]["sequence"]
        print(
            f"more versions below sequence {last}: continue with --cursor {last}", file=sys.stderr
        )
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    key = _key(args)
    with _client(args) as client:
        result = _as_principal(args, client, key, lambda: client.delete(args.did))
    _print_json(result)
    return 0


# --- federation ---------------------------------------------------------------------------------


@contextmanager
def _reading(what: str) -> Iterator[None]:
    """Around code that reads only a registry's answer (a table, the status screen): a member
    missing or of another type there is the server's, not the command's."""
    from cli.client import UnexpectedAnswer

    try:
        yield
    except (KeyError, TypeError, AttributeError, ValueError, OverflowError) as exc:
        detail = f"{type(exc).__name__}: {_one_line(str(exc))}"
        raise UnexpectedAnswer(f"{what} that cannot be shown ({detail})", 200, None) from exc


def cmd_peers(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.status:
            answer = _as_principal(args, client, _key(args), client.peer_status)
        else:
            answer = client.peers()
    if args.json:  # what the API answered: its field names, numbers as numbers
        print(json.dumps(answer, ensure_ascii=False, indent=2))
        return 0
    with _reading("a peer list"):
        table = _peer_status_table(answer) if args.status else _peer_table(answer)
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in table]
    for line in lines:
        print(line.rstrip())
    return 0


def _peer_status_table(rows: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    header = ("PEER", "BREAKER", "FAILURES", "CURSOR", "LAG", "QUARANTINED", "LAST SUCCESS")
    return [header] + [
        (
            r["peerDid"],
            r["breakerState"],
            str(r["consecutiveFailures"]),
            str(r["cursor"]),
            str(r["lag"]),
            str(r["quarantines"]),
            str(r["lastSuccessAt"] or "-"),
        )
        for r in rows
    ]


def _peer_table(peers: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    header = ("PEER", "ENDPOINT", "AGREEMENTS", "LAST SEEN")
    return [header] + [
        (
            p["peerDid"],
            p["endpoint"],
            ",".join(p["agreementIds"]) or "-",
            str(p["lastSeen"] or "-"),
        )
        for p in peers
    ]


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        body = _as_principal(args, client, _key(args), client.overview)
    if args.json:
        print(json.dumps(body, ensure_ascii=False, indent=2))
        return 0
    with _reading("an overview"):
        lines = status_screen(body)
    for line in lines:
        print(line)
    return 0


def status_screen(body: dict[str, Any]) -> list[str]:
    """`registry status` as text: one block per concern, the problems first in each."""
    checks = body.get("checks", {})
    lines = [
        f"registry  {body.get('registryDid', '?')}",
        f"status    {body.get('status', '?')}   log head {body.get('logHead', '?')}",
        "checks    " + ", ".join(f"{name} {value}" for name, value in sorted(checks.items())),
        "",
    ]
    peers = body.get("peers", [])
    if not peers:
        lines.append("peers     none configured")
    else:
        lines.append(
            "peers     PEER  BREAKER  FAILURES  CURSOR  LAG  LATENCY  LAST SUCCESS  QUARANTINED"
        )
        for p in peers:
            latency = f"{p['latencyMs']}ms" if "latencyMs" in p else "-"
            lines.append(
                f"          {p['peerDid']}  {p['breakerState']}  {p['consecutiveFailures']}"
                f"  {p['cursor']}  {p['lag']}  {latency}  {p.get('lastSuccessAt', '-')}"
                f"  {p['quarantines']}"
            )
            peer_log = p.get("log") or {}
            if peer_log.get("state") == "inconsistent":
                lines.append(
                    f"            LOG INCONSISTENT ({peer_log.get('reason')}):"
                    f" {peer_log.get('detail', '')}; nothing more is imported from it"
                )
            for q in p.get("quarantined", []):
                lines.append(
                    f"            quarantined #{q['sequence']} {q.get('entryDid') or '-'}:"
                    f" {q['code']} ({q['reason']})"
                )
    a = body.get("anchoring", {})
    lines.append("")
    if not a.get("enabled", False):
        lines.append("anchoring off")
    else:
        oldest = a.get("oldestPendingAt", "-")
        lines.append(
            f"anchoring {a.get('pending', 0)} pending (oldest {oldest}),"
            f" {a.get('batchesInFlight', 0)} batch(es) in flight"
        )
    for b in a.get("recentBatches", []):
        where = f" tx {b['transactionId']}" if "transactionId" in b else ""
        height = f" at height {b['blockHeight']}" if "blockHeight" in b else ""
        lines.append(
            f"          batch {b['batchId']}: {b['state']}, {b['intents']} intent(s){where}{height}"
        )
    return lines


# --- events -------------------------------------------------------------------------------------


def cmd_watch(args: argparse.Namespace) -> int:
    import httpx
    import trio

    from cli.watch import Watcher, WatchError, WatchOptions

    # The watch retries after a disconnect; a registry that is not there at all is a mistake.
    base = _url_key(args.url)
    for secure, plain in (("wss://", "https://"), ("ws://", "http://")):
        if base.startswith(secure):
            base = plain + base[len(secure) :]
    httpx.get(f"{base}/v1/health", timeout=10)
    saved = saved_session(args.url)
    token = os.environ.get("REGISTRY_SESSION_TOKEN") or None
    if token is None and saved is not None:
        token = str(saved["sessionToken"])
    options = WatchOptions(
        url=args.url,
        from_sequence=args.from_sequence,
        kinds=args.kind,
        entry_types=args.entry_type,
        entry_dids=args.did,
        token=token,
        max_events=args.max_events,
    )

    def out(line: str) -> None:
        try:
            print(line, flush=True)
        except BrokenPipeError:  # the reader went away: stop, do not reconnect
            raise OutputClosed from None

    try:
        trio.run(Watcher(options, out).run)
    except WatchError as exc:
        raise CliError(f"watch: {exc}") from None
    return 0


# --- errors -------------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _transport_reason(exc: Exception) -> str:
    import httpx

    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    text = str(exc) or type(exc).__name__
    if text.startswith("[Errno"):
        text = text.partition("] ")[2] or text
    return text[:1].lower() + text[1:]


def explain(exc: BaseException, args: argparse.Namespace) -> tuple[str, int]:
    """The one line and exit status for an error, or raise it again if it is not one a user
    can act on (a bug: `main` reports those too, without the traceback unless --debug)."""
    import httpx

    from cli.client import RegistryClientError
    from registry.config import ConfigError

    url = _url_key(getattr(args, "url", "") or "")
    if isinstance(exc, CliError):
        return _one_line(str(exc)), exc.status
    if isinstance(exc, ConfigError):
        return str(exc), EXIT_USAGE  # one line per invalid key (docs/configuration.md)
    if isinstance(exc, KeyFileError):
        return f"{_one_line(str(exc))}; check --key (make one with `registry keygen`)", EXIT_USAGE
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
        return f"--url {url!r} is not an http(s) URL of a registry", EXIT_USAGE
    if isinstance(exc, httpx.TransportError):
        return (
            f"cannot reach the registry at {url} ({_transport_reason(exc)}); is `registry serve`"
            " running there? Name another with --url (or REGISTRY_URL)"
        ), EXIT_FAILED
    if isinstance(exc, RegistryClientError):
        return _client_error(exc, url, getattr(args, "did", None)), EXIT_FAILED
    if isinstance(exc, OSError) and exc.filename:  # e.g. the session file cannot be written
        return f"{exc.filename}: {exc.strerror}", EXIT_FAILED
    if isinstance(exc, OSError) and exc.errno in _OUTPUT_ERRORS:  # no file named: stdout
        return f"cannot write the output: {exc.strerror}", EXIT_FAILED
    raise exc


# What writing standard output can fail with when it is a file on a full or failing disk
# (`registry keygen > /dev/full`); a closed pipe is `_output_closed`.
_OUTPUT_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def _grant(capability: str) -> str:
    """How an operator gives a DID `capability` (the registry's configuration says it)."""
    if capability == "admin":
        return (
            "the registry grants admin to the DIDs of `auth.admin_dids` in its configuration;"
            " add this key's DID there, reload it (SIGHUP) or restart, and sign in again"
        )
    return (
        f"the registry grants {capability!r} to every session by `auth.default_capabilities`;"
        " add it there and sign in again"
    )


def _client_error(exc: RegistryClientError, url: str, did: str | None) -> str:
    from cli.client import UnexpectedAnswer

    if isinstance(exc, UnexpectedAnswer):
        return f"{url} answered {exc.message}, which is not a registry answer; check --url"
    if exc.code is None:
        return f"{url} answered HTTP {exc.status}, which is not a registry answer; check --url"
    line = f"{exc.status} {exc.code}: {_one_line(exc.message)}"
    hints = {
        "session_invalid": "sign in again with `registry login --key FILE`",
        "capability_missing": _grant(str(exc.details.get("capability", ""))),
        "publisher_mismatch": "only the entry's publisher (or an admin) may change it: check --key",
    }
    if exc.code in hints:
        line += f"; {hints[exc.code]}"
    if exc.code in ("entry_not_found", "version_not_found") and isinstance(did, str):
        line += f" ({did} at {url})"
    if exc.code in ("read_rate_limited", "write_rate_limited"):
        try:
            wait = int(float(exc.details.get("retryAfterSeconds", 1))) + 1
        except (TypeError, ValueError, OverflowError):  # not a number of seconds: not ours
            wait = 1
        line += f"; retry in {wait} s"
    if exc.code == "entry_is_replica":
        line += f"; it is {exc.details.get('origin', 'another registry')}'s entry: write it there"
    if exc.code == "version_exists":
        line += (
            f"; version {exc.details.get('version')!r} is sequence"
            f' {exc.details.get("sequence")}: give this content a new "version"'
        )
    if exc.code == "version_unchanged":
        line += "; nothing to update: edit the file first"
    return line


# --- the command line ---------------------------------------------------------------------------


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _seconds(text: str) -> float:
    """A number of seconds to wait, finite and above 0 (`time.sleep` takes no other)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < math.inf:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be above 0 (and finite), not {text}")
    return value


class _Formatter(argparse.HelpFormatter):
    """Help texts may name the configuration's defaults as `{server.<key>}`."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        if text and "{server." in text:
            from registry.config import ServerConfig

            defaults = ServerConfig()
            for name in ("host", "port", "data_dir"):
                text = text.replace(f"{{server.{name}}}", str(getattr(defaults, name)))
        return text


def _version() -> str:
    """The installed distribution's version (a source tree that is not installed: unknown)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("registry")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="registry",
        description="A registry of signed entries: run it, and publish, update, read and delete"
        " entries. Documentation: docs/cli.md.",
        epilog="Exit status: 0 done; 1 the command failed (an error answer, the registry cannot"
        " be reached, a port or data directory in use); 2 bad usage or input (options,"
        " configuration, key file, entry file); 130 interrupted.",
        formatter_class=_Formatter,
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error, not just its one line (default: off)",
    )
    parser.add_argument(
        "--version", action="version", version=f"registry {_version()}", help="show the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str = "") -> argparse.ArgumentParser:
        p = sub.add_parser(
            name, help=help, description=description or help, formatter_class=_Formatter
        )
        p.add_argument(  # also accepted after the command; SUPPRESS keeps the global value
            "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
        return p

    def database_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config",
            type=Path,
            metavar="FILE",
            help="TOML configuration file (default: $REGISTRY_CONFIG, else none: built-in"
            " defaults and REGISTRY_<SECTION>__<KEY> variables; docs/configuration.md)",
        )
        p.add_argument(
            "--data-dir",
            type=Path,
            metavar="DIR",
            help="the registry key and the embedded PostgreSQL (default: server.data_dir,"
            " {server.data_dir})",
        )
        p.add_argument(
            "--database-url",
            metavar="URL",
            help="postgresql:// URL of the database (default: database.url; empty: an embedded"
            " PostgreSQL in the data directory)",
        )

    def url_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--url",
            default=DEFAULT_URL,
            help="the registry's base URL (default: %(default)s; $REGISTRY_URL sets it)",
        )

    def key_flag(p: argparse.ArgumentParser, required: bool, what: str) -> None:
        p.add_argument("--key", required=required, metavar="FILE", help=what)

    # serve, migrate
    p = command("serve", "run the registry (embedded PostgreSQL unless a database URL is set)")
    database_flags(p)
    p.add_argument("--host", help="listen address (default: server.host, {server.host})")
    p.add_argument("--port", type=int, help="listen port (default: server.port, {server.port})")
    p.set_defaults(func=cmd_serve)
    p = command(
        "migrate",
        "apply pending database migrations and exit",
        "Apply pending database migrations and exit (`serve` also does this on every start).",
    )
    database_flags(p)
    p.set_defaults(func=cmd_migrate)

    # keys and sessions
    p = command("keygen", "write a new Ed25519 key file and print its did:key")
    p.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="key file to create, mode 0600 (required; an existing file is never overwritten)",
    )
    p.set_defaults(func=cmd_keygen)
    p = command(
        "login",
        "sign in with a key file and save the session for later commands",
        "Sign in with a key file and save the session (token included, mode 0600) to"
        f" $REGISTRY_SESSION_FILE, else {DEFAULT_SESSION_FILE}. publish, update, delete and"
        " watch reuse it for the same --url until it expires.",
    )
    key_flag(p, True, "key file to sign in with (required)")
    p.add_argument(
        "--print-token",
        action="store_true",
        help="print the session token alone (for a script, a scraper or the console) instead"
        " of the session (default: off)",
    )
    url_flag(p)
    p.set_defaults(func=cmd_login)
    p = command(
        "logout",
        "revoke and forget the saved sessions for --url",
        "Revoke the sessions saved by `registry login` for --url (those of --key's DID only,"
        " if given) and remove them from the session file.",
    )
    key_flag(p, False, "only the session of this key's DID (default: every saved one)")
    url_flag(p)
    p.set_defaults(func=cmd_logout)

    # entries
    p = command(
        "publish",
        "sign ENTRY.json with a key file and create the entry",
        "Sign ENTRY.json with --key (fills publisherDid, itemDataHash, signature) and create the"
        " entry. Uses the session `registry login` saved for this key and --url, else signs in"
        " with the key. Prints the entry as served. An existing DID is refused: use `update`.",
    )
    p.add_argument("entry", metavar="ENTRY.json", help="the unsigned entry")
    key_flag(p, True, "the publisher's key file (required)")
    url_flag(p)
    p.set_defaults(func=cmd_publish)
    p = command(
        "update",
        "sign ENTRY.json as the entry's next version and replace the latest",
        "Sign ENTRY.json with --key as a new version of its entryDid, based on the entry's"
        " current sequence (fetched first) or on --based-on, and put it. Uses the saved session"
        " like publish. Prints the new version.",
    )
    p.add_argument("entry", metavar="ENTRY.json", help="the new version, unsigned")
    key_flag(p, True, "the publisher's key file (required)")
    p.add_argument(
        "--based-on",
        type=int,
        metavar="SEQUENCE",
        help="the sequence of the version this one replaces; refused if the entry changed"
        " since (default: the entry's current sequence)",
    )
    url_flag(p)
    p.set_defaults(func=cmd_update)
    p = command("get", "print an entry's latest version (or one version) as JSON")
    p.add_argument("did", metavar="DID", help="the entry's DID")
    p.add_argument(
        "--sequence",
        type=int,
        metavar="N",
        help="print the version with this sequence (default: the latest)",
    )
    url_flag(p)
    p.set_defaults(func=cmd_get)
    p = command(
        "versions",
        "list an entry's versions, newest first",
        "List an entry's versions, newest first, following the pages. Prints a table, or one"
        " JSON object per line with --json. When --limit stops before the end, the command to"
        " continue is printed on stderr.",
    )
    p.add_argument("did", metavar="DID", help="the entry's DID")
    p.add_argument(
        "--limit", type=_positive, metavar="N", help="print at most N versions (default: all)"
    )
    p.add_argument(
        "--cursor",
        metavar="SEQUENCE",
        help="start below this sequence, e.g. the last one printed (default: the newest)",
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON object per line (default: a table)"
    )
    url_flag(p)
    p.set_defaults(func=cmd_versions)
    p = command(
        "delete",
        "delete an entry (a tombstone; the DID is never reused)",
        "Delete an entry: the registry writes a tombstone, answers it, and never serves or"
        " reuses the DID again. Allowed to its publisher or an admin.",
    )
    p.add_argument("did", metavar="DID", help="the entry's DID")
    key_flag(
        p,
        False,
        "the key file to sign in with, unless a session saved for its DID is valid (default:"
        " none: the latest session `registry login` saved for --url)",
    )
    url_flag(p)
    p.set_defaults(func=cmd_delete)

    p = command(
        "peers",
        "list the registry's federation peers, or their sync status (--status, admin)",
        "List the federation peers (endpoint, agreements, last seen). With --status, each"
        " peer's sync status (breaker, failures, cursor, lag, quarantines): an admin's view,"
        " signed in with --key or a saved session.",
    )
    p.add_argument(
        "--status", action="store_true", help="the operator view of each peer (default: off)"
    )
    key_flag(
        p,
        False,
        "for --status: the admin key file to sign in with, unless a saved session is valid"
        " (default: none)",
    )
    p.add_argument("--json", action="store_true", help="the API's JSON list (default: a table)")
    url_flag(p)
    p.set_defaults(func=cmd_peers)

    p = command(
        "status",
        "the registry at a glance: health, log head, peers, anchoring (admin)",
        "One screen: deep health and its checks, the log head, each peer's breaker, cursor,"
        " lag, latency and quarantined entries, the anchoring backlog and the latest batches"
        " (GET /v1/admin/overview). An admin's view, signed in with --key or a saved session.",
    )
    key_flag(
        p,
        False,
        "the admin key file to sign in with, unless a saved session is valid (default: none)",
    )
    p.add_argument(
        "--json", action="store_true", help="the API's JSON object (default: the screen)"
    )
    url_flag(p)
    p.set_defaults(func=cmd_status)

    p = command(
        "verify-anchor",
        "re-check the anchors of an entry's versions, independently of the server's word",
        "Fetch the entry's anchor records and the versions they anchor, and check each one:"
        " itemDataHash is SHA-256 of JCS(itemData), the Merkle leaf is the version's, the proof's"
        " path leads to its root, and (with --chain) the chain's block holds that root. Exit 0"
        " when every anchored version verifies, 1 otherwise.",
    )
    p.add_argument("did", metavar="DID", help="the entry's DID")
    p.add_argument(
        "--chain",
        metavar="FILE",
        help="the local chain's journal (<data_dir>/chain.jsonl) to check the roots against"
        " (default: none: the roots are not checked against a chain)",
    )
    url_flag(p)
    p.set_defaults(func=cmd_verify_anchor)

    # the verifiable log
    def registry_did_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--registry-did",
            metavar="DID",
            help="the registry's did:key, whose key must sign the checkpoints (default: the"
            " checkpoint's origin line, the registry's DID unless transparency.origin is set)",
        )

    p = command(
        "verify-entry",
        "check an entry version against the registry's signed, verifiable log",
        "Fetch the proof bundle of one version (the newest checkpoint, the version's log record"
        " and its inclusion proof) and check it: the checkpoint's signature, the proof up to"
        " the checkpoint's root, the record's documentHash against the version as served and"
        " the publisher's signature. Exit 0 when all hold, 1 with the evidence otherwise."
        " docs/transparency.md.",
    )
    p.add_argument("did", metavar="DID", help="the entry's DID")
    p.add_argument(
        "--sequence",
        type=int,
        metavar="N",
        help="the version's sequence (default: the entry's latest)",
    )
    registry_did_flag(p)
    url_flag(p)
    p.set_defaults(func=_lazy("cli.transparency", "cmd_verify_entry"))
    p = command(
        "audit",
        "monitor a registry's log: every checkpoint consistent, every record hashed",
        "Follow a registry's checkpoints: verify each one's signature and its consistency with"
        " the last one verified, download every record since and check that they hash to the"
        " checkpoint's root, and check each entry version's documentHash and publisher"
        " signature. The state (the last checkpoint and its compact range) is kept in --state,"
        " so a later run resumes. Exit 0 when all holds (and --follow is off), 1 at the first"
        " inconsistency with a report and its evidence. docs/transparency.md.",
    )
    p.add_argument("url", metavar="URL", help="the registry's base URL")
    p.add_argument(
        "--state",
        default="registry-audit.json",
        metavar="FILE",
        help="where the monitor keeps what it verified (default: %(default)s)",
    )
    p.add_argument(
        "--follow",
        action="store_true",
        help="keep following: a pass every --interval seconds (default: one pass)",
    )
    p.add_argument(
        "--interval",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="seconds between passes with --follow (default: %(default)s)",
    )
    registry_did_flag(p)
    p.set_defaults(func=_lazy("cli.transparency", "cmd_audit"))

    # events
    p = command(
        "watch",
        "print the event stream as JSON lines; resumes after a disconnect",
        "Follow /v1/events and print each event as one JSON line. After a disconnect it"
        " reconnects with backoff and resumes after the last sequence it saw. Admin-only kinds"
        " use REGISTRY_SESSION_TOKEN or the session saved by `registry login`.",
    )
    url_flag(p)
    p.add_argument(
        "--from",
        dest="from_sequence",
        type=int,
        metavar="N",
        help="replay the log after sequence N, 0: from the start (default: from now on)",
    )
    p.add_argument(
        "--kind", action="append", help="only this event kind, repeatable (default: all)"
    )
    p.add_argument(
        "--entry-type",
        action="append",
        metavar="TYPE",
        help="only this entry type, repeatable (default: all)",
    )
    p.add_argument("--did", action="append", help="only this entry DID, repeatable (default: all)")
    p.add_argument(
        "--max-events",
        type=_positive,
        metavar="N",
        help="exit after N events, N >= 1 (default: never)",
    )
    p.set_defaults(func=cmd_watch)
    return parser


class OutputClosed(Exception):
    """The reader of standard output went away (`registry watch ... | head -1`)."""


def _output_closed(exc: BaseException) -> bool:
    return any(isinstance(e, BrokenPipeError | OutputClosed) for e in _leaves(exc))


def _quiet_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's last flush of what is
    still buffered cannot fail on the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """A command whose module is imported only when it runs (the CLI starts fast)."""

    def run(args: argparse.Namespace) -> int:
        command: Callable[[argparse.Namespace], int] = getattr(
            importlib.import_module(module), name
        )
        return command(args)

    return run


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = bool(getattr(args, "debug", False))
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:
        if _output_closed(exc):  # a reader that stops early is not an error of the command
            _quiet_stdout()
            return 0
        if debug:
            traceback.print_exc()
        try:
            line, status = explain(exc, args)
        except Exception:
            leaf = next((e for e in _leaves(exc) if isinstance(e, Exception)), exc)
            line = (
                f"unexpected error: {type(leaf).__name__}: {_one_line(str(leaf))} (a bug; run"
                " `registry --debug ...` for the traceback)"
            )
            status = EXIT_FAILED
        print(f"registry: {line}", file=sys.stderr)
        return status


if __name__ == "__main__":
    raise SystemExit(main())
