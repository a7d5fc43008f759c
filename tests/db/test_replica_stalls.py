"""A replica that stopped replaying, and one that stays away (docs/replicas.md, "When the replica
fails"), seen by a process that only reads. The "replica" that stopped is a copy of the
primary's database frozen at one moment: what a replica whose replay stopped looks like to the
process (its head never moves). In-process: the service wired as `registry serve` wires it."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
import trio
import trio_asyncio

import registry.store.routing as routing
from registry.identity import DidKeyIdentity
from registry.keys import SigningKey
from registry.store.pg import RoutedPgStore, open_pg_store
from service.wiring import open_service
from tests.conftest import Harness, make_config
from tests.db.proc import databases
from tests.helpers import entry_created

DEADLINE = 20.0


def _admin(url: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/postgres"))


def _run(url: str, sql: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(_admin(url))
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())


@pytest.fixture
def frozen(database_url: str) -> Iterator[tuple[str, str]]:
    """A fresh primary database and a "replica" of it whose replay stopped at its start."""
    with databases(database_url) as new_database:
        primary = new_database()
        parts = urlsplit(primary)
        copy = parts.path.lstrip("/") + "_frozen"
        _run(primary, f'CREATE DATABASE "{copy}" TEMPLATE "{parts.path.lstrip("/")}"')
        try:
            yield primary, urlunsplit(parts._replace(path=f"/{copy}"))
        finally:
            _run(primary, f'DROP DATABASE IF EXISTS "{copy}" WITH (FORCE)')


@asynccontextmanager
async def reader(primary: str, replica: str, tmp_path: Path) -> AsyncIterator[Harness]:
    """A process that only reads (not the checkpointer), with `read_url` set."""
    config = make_config(
        primary,
        tmp_path,
        database={"read_url": replica, "read_poll_seconds": 0.05},
        transparency={"enabled": False},
        metrics={"open": True},
    )
    async with (
        open_pg_store(primary, read_dsn=replica, read_poll_seconds=0.05) as store,
        open_service(config, store, key=SigningKey.generate(), identity=DidKeyIdentity()) as svc,
        svc.app.test_app() as test_app,
    ):
        yield Harness(svc, test_app.test_client())


async def until(condition: Callable[[], Awaitable[bool]]) -> bool:
    """Whether `condition` held within the deadline (asked every 50 ms: what it reads belongs
    to the service's actors, which signal nothing a test could wait on)."""
    with trio.move_on_after(DEADLINE):
        while True:
            if await condition():
                return True
            await trio.sleep(0.05)
    return False


async def _lag(h: Harness) -> float:
    text = (await (await h.client.get("/metrics")).get_data()).decode()
    [value] = [
        row.split()[-1]
        for row in text.splitlines()
        if row.startswith("registry_replica_lag_records ")
    ]
    return float(value)


async def test_a_replica_that_stopped_replaying_shows_its_lag_and_is_left_alone(
    frozen: tuple[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A process that writes nothing learned of the log only from its stopped replica: its lag
    stayed 0 (the RegistryReplicaBehind alert never fired) and its GETs served the frozen state
    for good. It reads the primary's head every second: the lag shows, and once the replica's
    head has not moved for STALL_SECONDS while the primary is ahead, reads go to the primary."""
    monkeypatch.setattr(routing, "STALL_SECONDS", 1.0)
    caplog.set_level(logging.WARNING, logger="registry.store.pg")
    primary, replica = frozen
    async with trio_asyncio.open_loop(), reader(primary, replica, tmp_path) as h:
        assert isinstance(h.store, RoutedPgStore)
        async with open_pg_store(primary) as writer:  # another process writes
            changes = [entry_created() for _ in range(20)]
            for change in changes:
                await writer.append([(change, None)])
            head = await writer.log_head()

        async def lag_shows() -> bool:  # the replica replayed nothing of it
            return await _lag(h) >= head

        async def primary_answers() -> bool:
            r = await h.client.get(f"/v1/entries/{changes[-1].subject}")
            return r.status_code == 200

        assert await until(lag_shows), await _lag(h)
        assert await until(primary_answers)
        assert h.store.replica_state.reads["primary"] > 0
    stopped = [r for r in caplog.records if "stopped replaying" in r.getMessage()]
    assert len(stopped) == 1, [r.getMessage() for r in caplog.records]


async def test_a_replica_that_stays_away_is_one_warning(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """ "One WARNING line says so": every failed retry (every RETRY_SECONDS) logged it again,
    720 lines an hour; now once, then one a minute with a count, and the recovery."""
    with socket.socket() as sock:  # a port nothing listens on: a replica that is down
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    caplog.set_level(logging.WARNING, logger="registry.store.pg")
    async with (
        trio_asyncio.open_loop(),
        open_pg_store(
            database_url, read_dsn=f"postgresql://postgres@127.0.0.1:{port}/registry"
        ) as store,
    ):
        assert isinstance(store, RoutedPgStore)
        for _ in range(20):
            store.replica_state.down_until = 0.0  # its retry time has come
            await store.refresh_replica()  # what the log actor's poll does
    warnings = [r for r in caplog.records if "read replica cannot be reached" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
