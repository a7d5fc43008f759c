"""Shared fixtures: a real PostgreSQL database per test session, and the app over it.

Database choice (so the README's test command works anywhere): `REGISTRY_TEST_DATABASE_URL` if
set; else a fresh database on the server at 127.0.0.1:5432 when one answers; else an embedded
cluster in a temporary directory. Migrations run once, synchronously, in the session fixture.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import trio_asyncio

from registry.config import Config, load_config
from registry.identity import DidKeyIdentity, IdentityResolver
from registry.keys import SigningKey
from registry.store.migrate import _migrate, load_migrations
from registry.store.pg import open_pg_store
from service.wiring import Service, open_service
from tests import secrets_watch
from tests.secrets_watch import watching

LOCAL_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def _local_server_answers() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session", autouse=True)
def secrets_are_never_logged() -> Iterator[None]:
    """Fails the run when any log line of it holds a token, key seed or signature the run
    planted (tests/secrets_watch.py)."""
    with pytest.MonkeyPatch.context() as monkeypatch, watching(monkeypatch):
        yield
    assert secrets_watch.LEAKS == [], "secrets in the log:\n" + "\n".join(secrets_watch.LEAKS)


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    explicit = os.environ.get("REGISTRY_TEST_DATABASE_URL")
    if explicit:
        asyncio.run(_migrate(explicit, load_migrations()))
        yield explicit
        return
    if _local_server_answers():
        name = f"registry_test_{secrets.token_hex(4)}"

        async def admin(sql: str) -> None:
            conn = await asyncpg.connect(LOCAL_ADMIN)
            try:
                await conn.execute(sql)
            finally:
                await conn.close()

        asyncio.run(admin(f"CREATE DATABASE {name}"))
        url = f"postgresql://postgres@127.0.0.1:5432/{name}"
        try:
            asyncio.run(_migrate(url, load_migrations()))
            yield url
        finally:
            asyncio.run(admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        return
    from registry.store.embedded import EmbeddedPostgres

    with tempfile.TemporaryDirectory(prefix="registry-test-") as tmp:
        cluster = EmbeddedPostgres(Path(tmp))
        url = cluster.start()
        try:
            asyncio.run(_migrate(url, load_migrations()))
            yield url
        finally:
            cluster.stop()


def make_config(database_url: str, tmp_path: Path, **sections: dict[str, Any]) -> Config:
    overrides: dict[str, dict[str, Any]] = {
        "server": {"data_dir": str(tmp_path), "public_origin": "http://registry.test"},
        "database": {"url": database_url},
        # Anchoring runs only in the tests that ask for it (its background changes would
        # interleave with the log positions other tests assert).
        "anchoring": {"enabled": False},
        "limits": {
            "read_per_minute": 100_000,
            "write_per_minute": 100_000,
            "write_per_minute_per_address": 100_000,
            "query_per_minute": 100_000,
            "query_per_minute_per_address": 100_000,
            "body_bytes_per_minute_per_address": 10_000_000_000,
            "query_db_ms_per_minute_per_address": 100_000_000,
            "query_concurrency_per_address": 1000,
        },
    }
    for section, values in sections.items():
        overrides.setdefault(section, {}).update(values)
    return load_config(None, environ={}, overrides=overrides)


class Harness:
    """The service over real PostgreSQL, wired as `registry serve` wires it, and a test client."""

    def __init__(self, service: Service, client: Any) -> None:
        self.service = service
        self.client = client
        self.config = service.config
        self.store = service.store
        self.deps = service.deps


async def open_harness(
    config: Config, identity: IdentityResolver | None = None
) -> AsyncIterator[Harness]:
    async with (
        trio_asyncio.open_loop(),
        open_pg_store(config.database.url) as store,
        open_service(
            config, store, key=SigningKey.generate(), identity=identity or DidKeyIdentity()
        ) as service,
        service.app.test_app() as test_app,
    ):
        yield Harness(service, test_app.test_client())


@pytest.fixture
async def harness(database_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in open_harness(make_config(database_url, tmp_path)):
        yield h
