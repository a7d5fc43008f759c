"""The `registry` command: serve, migrate, keygen, login, publish, watch."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from registry.config import Config, ConfigError, load_config
from registry.keys import KeyFileError, SigningKey, read_key_file, write_key_file

DEFAULT_URL = os.environ.get("REGISTRY_URL", "http://127.0.0.1:8080")
SESSION_FILE = Path(
    os.environ.get("REGISTRY_SESSION_FILE", "~/.registry-session.json")
).expanduser()


class JsonFormatter(logging.Formatter):
    """One JSON object per line; tracebacks are a field, not extra lines."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "t": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
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


def _config(args: argparse.Namespace) -> Config:
    server = {"host": args.host, "port": args.port, "data_dir": args.data_dir}
    database = {"url": getattr(args, "database_url", None)}
    return load_config(args.config, overrides={"server": server, "database": database})


def cmd_serve(args: argparse.Namespace) -> int:
    import trio

    from service.serve import DataDirInUse, serve

    config = _config(args)
    _setup_logging(config)
    try:
        trio.run(serve, config)
    except DataDirInUse as exc:
        print(f"registry: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    import trio
    import trio_asyncio

    from registry.store.embedded import EmbeddedPostgres
    from registry.store.migrate import migrate

    config = _config(args)
    _setup_logging(config)

    async def run() -> list[int]:
        async with trio_asyncio.open_loop():
            dsn = config.database.url
            embedded = None
            if not dsn:
                config.server.data_dir.mkdir(parents=True, exist_ok=True)
                embedded = EmbeddedPostgres(config.server.data_dir)
                dsn = await trio.to_thread.run_sync(embedded.start)
            try:
                return await migrate(dsn)
            finally:
                if embedded is not None:
                    await trio.to_thread.run_sync(embedded.stop)

    applied = trio.run(run)
    print(f"applied {applied}" if applied else "up to date")
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    key = SigningKey.generate()
    try:
        write_key_file(Path(args.out), key)
    except FileExistsError:
        print(f"registry: {args.out} exists; not overwriting a key", file=sys.stderr)
        return 1
    print(key.did)
    return 0


def _save_session(url: str, result: dict[str, Any]) -> None:
    fd = os.open(SESSION_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"url": url, **result}, handle)


def cmd_login(args: argparse.Namespace) -> int:
    from api.client import RegistryClient

    key = read_key_file(Path(args.key))
    with RegistryClient(args.url) as client:
        result = client.sign_in(key)
    _save_session(args.url, result)
    print(json.dumps({k: v for k, v in result.items() if k != "sessionToken"}, indent=2))
    print(f"session saved to {SESSION_FILE}", file=sys.stderr)
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    from api.client import RegistryClient
    from registry.canonical import parse_strict

    key = read_key_file(Path(args.key))
    entry = parse_strict(Path(args.entry).read_bytes())
    with RegistryClient(args.url) as client:
        client.sign_in(key)
        result = client.publish(entry, key)
    print(json.dumps(result, indent=2, ensure_ascii=False))
    return 0


def _saved_token(url: str) -> str | None:
    """The session token `registry login` saved for this URL, if any."""
    try:
        saved = json.loads(SESSION_FILE.read_text())
    except (OSError, ValueError):
        return None
    token = saved.get("sessionToken") if saved.get("url") == url else None
    return str(token) if token else None


def cmd_watch(args: argparse.Namespace) -> int:
    import trio

    from ws.watch import Watcher, WatchError, WatchOptions

    options = WatchOptions(
        url=args.url,
        from_sequence=args.from_sequence,
        kinds=args.kind,
        entry_types=args.entry_type,
        entry_dids=args.did,
        token=os.environ.get("REGISTRY_SESSION_TOKEN") or _saved_token(args.url),
        max_events=args.max_events,
    )

    def out(line: str) -> None:
        print(line, flush=True)

    try:
        trio.run(Watcher(options, out).run)
    except WatchError as exc:
        print(f"registry watch: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="registry", description="A federated registry of signed entries."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def server_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", type=Path, help="TOML configuration file (or REGISTRY_CONFIG)")
        p.add_argument("--host", help="listen address [server.host]")
        p.add_argument("--port", type=int, help="listen port [server.port]")
        p.add_argument("--data-dir", type=Path, help="key, embedded PostgreSQL [server.data_dir]")
        p.add_argument("--database-url", help="PostgreSQL URL; empty: embedded [database.url]")

    p = sub.add_parser("serve", help="run the registry (embedded PostgreSQL unless a URL is set)")
    server_flags(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("migrate", help="apply database migrations and exit")
    server_flags(p)
    p.set_defaults(func=cmd_migrate)
    p = sub.add_parser("keygen", help="write a new Ed25519 key file and print its did:key")
    p.add_argument("--out", required=True, help="key file to create (mode 0600)")
    p.set_defaults(func=cmd_keygen)
    p = sub.add_parser("login", help="sign in with a key file; saves the session token")
    p.add_argument("--key", required=True)
    p.add_argument("--url", default=DEFAULT_URL)
    p.set_defaults(func=cmd_login)
    p = sub.add_parser("publish", help="sign ENTRY.json with a key file and publish it")
    p.add_argument("entry")
    p.add_argument("--key", required=True)
    p.add_argument("--url", default=DEFAULT_URL)
    p.set_defaults(func=cmd_publish)
    p = sub.add_parser(
        "watch",
        help="print the event stream as JSON lines; resumes after a disconnect",
        description="Follow /v1/events and print each event as one JSON line. After a"
        " disconnect it reconnects with backoff and resumes after the last sequence it saw."
        " Admin-only kinds use REGISTRY_SESSION_TOKEN or the session saved by `registry login`.",
    )
    p.add_argument("--url", default=DEFAULT_URL, help="registry base URL (default: %(default)s)")
    p.add_argument(
        "--from",
        dest="from_sequence",
        type=int,
        metavar="N",
        help="replay the log after sequence N (0: from the start); default: from now on",
    )
    p.add_argument("--kind", action="append", help="only this event kind (repeatable)")
    p.add_argument("--entry-type", action="append", help="only this entry type (repeatable)")
    p.add_argument("--did", action="append", help="only this entry DID (repeatable)")
    p.add_argument("--max-events", type=int, metavar="N", help="exit after N events")
    p.set_defaults(func=cmd_watch)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"registry: {exc}", file=sys.stderr)
        return 2
    except KeyFileError as exc:
        print(f"registry: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the CLI's user sees one line, not a traceback
        from api.client import RegistryClientError

        if isinstance(exc, RegistryClientError | OSError):
            print(f"registry: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())
