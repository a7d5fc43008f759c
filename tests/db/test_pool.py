"""The lean connection pool: connections are reused after normal work and server-reported errors,
closed after cancellation or a lost connection, and the pool never loses a slot."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
import trio
import trio_asyncio

from registry.store import pool as pool_module
from registry.store.pg import SESSION_SETTINGS
from registry.store.pool import LeanPool


@asynccontextmanager
async def lean_pool(database_url: str, size: int = 2) -> AsyncIterator[LeanPool]:
    async with trio_asyncio.open_loop():
        pool = LeanPool(
            database_url, min_size=1, max_size=size, server_settings=dict(SESSION_SETTINGS)
        )
        await trio_asyncio.aio_as_trio(pool.open)()
        try:
            yield pool
        finally:
            with trio.CancelScope(shield=True):
                await trio_asyncio.aio_as_trio(pool.close)()


def aio(fn: Any) -> Any:
    return trio_asyncio.aio_as_trio(fn)


async def _backend_pid(pool: LeanPool) -> int:
    return int(await aio(pool.fetchval)("SELECT pg_backend_pid()"))


async def test_a_connection_is_reused_after_work_and_after_a_statement_error(
    database_url: str,
) -> None:
    async with lean_pool(database_url, size=1) as pool:
        first = await _backend_pid(pool)
        with pytest.raises(asyncpg.PostgresError):
            await aio(pool.execute)("SELECT 1/0")
        assert await _backend_pid(pool) == first
        assert await aio(pool.fetchval)("SHOW TimeZone") == "UTC"  # the session settings


async def test_cancelling_a_query_closes_its_connection_and_frees_its_slot(
    database_url: str,
) -> None:
    async with lean_pool(database_url, size=1) as pool:
        first = await _backend_pid(pool)
        with trio.move_on_after(0.2) as scope:
            await aio(pool.execute)("SELECT pg_sleep(30)")
        assert scope.cancelled_caught
        # The only slot is free again, on a new connection (the old one may still be busy).
        with trio.fail_after(10):
            assert await _backend_pid(pool) != first


async def test_a_transaction_left_open_is_not_given_back(database_url: str) -> None:
    async with lean_pool(database_url, size=1) as pool:

        async def leave_open() -> int:
            async with pool.acquire() as conn:
                await conn.execute("BEGIN")
                return int(await conn.fetchval("SELECT pg_backend_pid()"))

        pid = await aio(leave_open)()
        assert await _backend_pid(pool) != pid


async def test_a_connection_the_server_closed_is_replaced(database_url: str) -> None:
    async with lean_pool(database_url, size=1) as pool:
        first = await _backend_pid(pool)
        other = await aio(asyncpg.connect)(database_url)
        try:
            await aio(other.execute)(f"SELECT pg_terminate_backend({first})")
        finally:
            await aio(other.close)()
        with trio.fail_after(10):
            while True:  # the first query may meet the dead connection (503 to that caller)
                try:
                    pid = await _backend_pid(pool)
                    break
                except Exception:  # that caller fails; the pool recovers
                    continue
        assert pid != first


async def test_more_callers_than_connections_wait_their_turn(database_url: str) -> None:
    async with lean_pool(database_url, size=2) as pool:
        pids: list[int] = []

        async def one() -> None:
            sql = "SELECT pg_backend_pid() FROM pg_sleep(0.05)"
            pids.append(int(await aio(pool.fetchval)(sql)))

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(one)
        assert len(pids) == 8
        assert len(set(pids)) <= 2  # never more than max_size connections


async def test_a_full_server_leaves_callers_waiting_for_the_pools_own_connections(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL refusing more connections (53300: here a role's CONNECTION LIMIT, in
    production max_connections shared by several processes) is not the callers' error while the
    pool holds connections: they take turns on those, and the pool never exceeds what the
    server admits; it grows back when the server has room again. With none lent out (none that
    will come back), the refusal is the caller's."""
    role = f"pool_limit_{secrets.token_hex(4)}"
    await _admin(
        database_url,
        f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 2",
        f"GRANT ALL ON SCHEMA public TO {role}",
    )
    try:
        limited = _with_user(database_url, role)
        async with lean_pool(limited, size=6) as pool:
            pids: list[int] = []

            async def one() -> None:
                sql = "SELECT pg_backend_pid() FROM pg_sleep(0.05)"
                pids.append(int(await aio(pool.fetchval)(sql)))

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    for _ in range(12):
                        nursery.start_soon(one)
            assert len(pids) == 12  # every caller answered, none refused
            assert len(set(pids)) <= 2
            stats = pool.statistics()
            assert stats["open"] == 2
            assert stats["held_back"] == 4  # refused within RETRY_SECONDS: 6 - 2 it lacks
            # Room appears: the pool opens more once RETRY_SECONDS passed (0 here).
            await _admin(database_url, f"ALTER ROLE {role} CONNECTION LIMIT 4")
            monkeypatch.setattr(pool_module, "RETRY_SECONDS", 0.0)
            pids.clear()
            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    for _ in range(24):
                        nursery.start_soon(one)
            assert len(pids) == 24
            assert 2 < pool.statistics()["open"] <= 4
            # A pool that holds nothing, against a server with no room: the caller's error.
            hold = [await aio(pool.take)(), await aio(pool.take)()]
            try:
                empty = LeanPool(
                    limited, min_size=0, max_size=1, server_settings=dict(SESSION_SETTINGS)
                )
                with pytest.raises(asyncpg.TooManyConnectionsError):
                    await aio(empty.fetchval)("SELECT 1")
                assert empty.statistics()["open"] == 0
                await aio(empty.close)()
            finally:
                for conn in hold:
                    pool.give_back(conn)
    finally:
        await _admin(
            database_url,
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'",
            f"DROP OWNED BY {role}",
            f"DROP ROLE {role}",
        )


async def _admin(url: str, *statements: str) -> None:
    async with trio_asyncio.open_loop():
        conn = await aio(asyncpg.connect)(url)
        try:
            for sql in statements:
                await aio(conn.execute)(sql)
        finally:
            await aio(conn.close)()


def _with_user(url: str, user: str) -> str:
    parts = urlsplit(url)
    netloc = f"{user}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


async def test_with_only_lasting_connections_out_a_full_server_is_an_error_not_a_wait(
    database_url: str,
) -> None:
    """A LISTEN or a leadership holds its connection for the process's lifetime: a caller that
    finds PostgreSQL full must not wait for it (it would wait forever); it gets the refusal at
    once, and the next caller connects as soon as the server has room."""
    role = f"pool_lasting_{secrets.token_hex(4)}"
    await _admin(database_url, f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 1")
    try:
        limited = _with_user(database_url, role)
        async with trio_asyncio.open_loop():
            pool = LeanPool(limited, min_size=0, max_size=4, server_settings={})
            listener = await aio(pool.take)(lasting=True)  # the role's one connection
            try:
                with trio.fail_after(10), pytest.raises(asyncpg.TooManyConnectionsError):
                    await aio(pool.fetchval)("SELECT 1")
                await _admin(database_url, f"ALTER ROLE {role} CONNECTION LIMIT 3")
                with trio.fail_after(10):  # within RETRY_SECONDS of the refusal, too
                    assert await aio(pool.fetchval)("SELECT 1") == 1
            finally:
                pool.discard(listener)
                await aio(pool.close)()
    finally:
        await _admin(
            database_url,
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'",
            f"DROP ROLE {role}",
        )


async def test_the_server_ends_a_statement_soon_after_its_caller_gave_up(database_url: str) -> None:
    # The caller gives up after QUERY_TIMEOUT_SECONDS and closes the connection; PostgreSQL
    # would run the statement on until it next writes to the socket. Its own timeout ends it.
    from registry.store.pg import QUERY_TIMEOUT_SECONDS, open_pg_store

    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        shown = await aio(store._pool.fetchval)("SHOW statement_timeout")  # type: ignore[attr-defined]
    assert shown == f"{int(QUERY_TIMEOUT_SECONDS) + 5}s"


async def test_a_statement_whose_caller_went_away_stops_within_a_fraction_of_a_second(
    database_url: str,
) -> None:
    """A client that disconnects cancels its handler, and the pool closes the connection; the
    server checks for a closed client every `client_connection_check_interval` (PostgreSQL
    14 on), so the statement stops there, not at statement_timeout 35 s later."""
    from registry.store.pg import open_pg_store

    key = secrets.randbits(40)
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        pool = store._pool  # type: ignore[attr-defined]
        if int(await aio(pool.fetchval)("SHOW server_version_num")) < 140000:
            pytest.skip("client_connection_check_interval is PostgreSQL 14's")
        assert await aio(pool.fetchval)("SHOW client_connection_check_interval") == "100ms"
        with trio.move_on_after(0.3):  # the statement holds a lock for as long as it runs
            await aio(pool.fetchval)(f"SELECT pg_advisory_lock({key}), pg_sleep(20)")
        with trio.fail_after(5):  # without the setting: held 20 s longer
            await _admin_value(database_url, f"SELECT pg_advisory_lock({key})")


async def _admin_value(database_url: str, sql: str) -> Any:
    conn = await aio(asyncpg.connect)(database_url)
    try:
        return await aio(conn.fetchval)(sql)
    finally:
        await aio(conn.close)()


async def test_the_statements_a_request_pays_for_are_metered(database_url: str) -> None:
    """Discovery pages and log pages (a replay's) add their time to the request's meter
    (registry/metering.py); outside a meter they add to nothing."""
    from registry.metering import db_meter
    from registry.query import RegistryQuery
    from registry.store.pg import open_pg_store

    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        await store.log_after(0, 10)  # no meter: nothing to add to
        with db_meter() as replay:
            await store.log_after(0, 10)
        with db_meter() as query:
            await store.discover(RegistryQuery(), limit=5, after=None)
    assert replay.seconds > 0
    assert query.seconds > 0


async def test_a_setting_the_server_refuses_is_warned_about_once_and_connections_work(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with trio_asyncio.open_loop():
        pool = LeanPool(
            database_url,
            min_size=2,
            max_size=2,
            server_settings=dict(SESSION_SETTINGS),
            settings_since={0: {"registry_no_such_setting": "1", "work_mem": "8MB"}},
        )
        await aio(pool.open)()
        try:
            assert await aio(pool.fetchval)("SHOW work_mem") == "8MB"  # the others still set
        finally:
            await aio(pool.close)()
    refused = [r for r in caplog.records if "registry_no_such_setting" in r.getMessage()]
    assert len(refused) == 1  # two connections, one warning
    assert refused[0].levelname == "WARNING"
