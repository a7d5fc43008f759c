"""The log's LISTEN connection is read once per wait, not once per notification: between two
waits its socket is left unread (asyncio flow control), and nothing sent meanwhile is lost."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest
import trio
import trio.testing
import trio_asyncio

from registry.errors import Unavailable
from registry.store.pg import Notifications, open_pg_store


class _Transport:
    def __init__(self) -> None:
        self.pauses = 0
        self.resumes = 0

    def pause_reading(self) -> None:
        self.pauses += 1

    def resume_reading(self) -> None:
        self.resumes += 1


class _Conn:
    def __init__(self) -> None:
        self._transport = _Transport()


async def test_a_held_listener_pauses_once_per_burst_and_resumes_when_waited_on() -> None:
    conn = _Conn()
    notes = Notifications(hold=True)
    notes.read_through(conn)
    for payload in ("1", "2", "3"):
        notes.push(conn, 0, "registry_log", payload)
    assert (conn._transport.pauses, conn._transport.resumes) == (1, 0)
    assert notes.held
    # What is at hand is taken without reading the connection again.
    assert await notes.receive() == [("registry_log", p) for p in ("1", "2", "3")]
    assert (conn._transport.pauses, conn._transport.resumes) == (1, 0)
    assert notes.held
    # With nothing at hand, a wait reads it again, and the next notification holds it.
    async with trio.open_nursery() as nursery:
        got: list[list[tuple[str, str]] | None] = []

        async def receive() -> None:
            got.append(await notes.receive())

        nursery.start_soon(receive)
        await trio.testing.wait_all_tasks_blocked()
        assert (conn._transport.pauses, conn._transport.resumes) == (1, 1)
        assert not notes.held
        notes.push(conn, 0, "registry_log", "4")
    assert got == [[("registry_log", "4")]]
    assert (conn._transport.pauses, conn._transport.resumes) == (2, 1)


async def test_a_listener_that_does_not_hold_never_pauses() -> None:
    conn = _Conn()
    notes = Notifications()
    notes.read_through(conn)
    notes.push(conn, 0, "registry_log", "1")
    notes.push(conn, 0, "registry_log", "2")
    assert await notes.receive() == [("registry_log", "1"), ("registry_log", "2")]
    assert (conn._transport.pauses, conn._transport.resumes) == (0, 0)
    assert not notes.held


async def _until_lost(notes: Notifications) -> None:
    """Receive until the lost connection is reported (what was left in its socket first)."""
    while True:
        await notes.receive()


def _aio(fn: Any) -> Any:
    return trio_asyncio.aio_as_trio(fn)


async def test_the_log_listener_leaves_its_socket_unread_between_waits_and_loses_nothing(
    database_url: str,
) -> None:
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        sender = await _aio(asyncpg.connect)(database_url)
        try:
            async with store.listen_log() as wakeups:
                assert isinstance(wakeups, Notifications)
                notes = wakeups
                await _aio(sender.execute)("NOTIFY registry_log, '1'")
                with trio.fail_after(10):
                    assert await notes.receive() == [("registry_log", "1")]
                # Read, and the connection is not read again until a wait finds nothing.
                assert notes.held
                transport = notes._transport
                assert transport is not None
                assert not transport.is_reading()
                for i in range(2, 6):
                    await _aio(sender.execute)(f"NOTIFY registry_log, '{i}'")
                assert not transport.is_reading()
                got: list[str] = []
                with trio.fail_after(10):
                    while len(got) < 4:
                        got += [payload for _, payload in await notes.receive()]
                assert got == ["2", "3", "4", "5"]
                # A connection lost while its socket is left unread is still seen as lost.
                await _aio(sender.execute)(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND query LIKE 'LISTEN%'"
                )
                with trio.fail_after(10), pytest.raises(Unavailable):
                    await _until_lost(notes)
        finally:
            await _aio(sender.close)()
