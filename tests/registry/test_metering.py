"""The meter of a request's database time (registry/metering.py)."""

from __future__ import annotations

import time

import trio

from registry.metering import db_meter, timed_statement


def test_a_timed_statement_adds_its_time_to_the_meter_and_nothing_without_one() -> None:
    with timed_statement():  # no meter: nothing to add to, and no error
        pass
    with db_meter() as meter:
        assert meter.seconds == 0.0
        with timed_statement():
            started = time.perf_counter()
            while time.perf_counter() - started < 0.002:
                pass
        assert meter.seconds >= 0.002
        with timed_statement():
            pass
    metered = meter.seconds
    with timed_statement():  # the meter's block is over: it no longer collects
        started = time.perf_counter()
        while time.perf_counter() - started < 0.002:
            pass
    assert meter.seconds == metered


async def test_tasks_started_inside_the_block_add_to_its_meter() -> None:
    async def statement() -> None:
        with timed_statement():
            await trio.lowlevel.checkpoint()

    with db_meter() as meter:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(statement)
    assert meter.seconds > 0.0

    with db_meter() as other:
        pass
    async with trio.open_nursery() as nursery:  # started outside any meter's block
        nursery.start_soon(statement)
    assert other.seconds == 0.0
