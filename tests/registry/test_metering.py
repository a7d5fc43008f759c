"""The meter of a request's database time (registry/metering.py)."""

from __future__ import annotations

import time

import trio

from registry.metering import metered, metering


def test_a_metered_block_adds_its_time_to_the_meter_and_nothing_without_one() -> None:
    with metered():  # no meter: nothing to add to, and no error
        pass
    with metering() as meter:
        assert meter.seconds == 0.0
        with metered():
            started = time.perf_counter()
            while time.perf_counter() - started < 0.002:
                pass
        first = meter.seconds
        assert first >= 0.002
        with metered():
            pass
        assert meter.seconds >= first
    with metered():  # the block is over: its meter no longer collects
        pass
    assert meter.seconds < first + 0.002


async def test_child_tasks_add_to_the_meter_of_the_task_that_started_them() -> None:
    async def statement() -> None:
        with metered():
            await trio.lowlevel.checkpoint()

    with metering() as meter:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(statement)
    assert meter.seconds > 0.0

    async def elsewhere() -> None:  # a task started outside the metered block
        with metered():
            await trio.lowlevel.checkpoint()

    with metering() as other:
        pass
    async with trio.open_nursery() as nursery:
        nursery.start_soon(elsewhere)
    assert other.seconds == 0.0
