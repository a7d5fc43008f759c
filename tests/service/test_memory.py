"""The heap trimmer: glibc's malloc_trim where there is one, on a schedule, never fatal."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import trio
import trio.testing

from service.memory import Trim, malloc_trimmer, trim_every


def test_on_glibc_the_trimmer_gives_free_heap_pages_back() -> None:
    if ctypes.util.find_library("c") is None or not hasattr(ctypes.CDLL(None), "malloc_trim"):
        pytest.skip("not glibc: the trimmer is off there (service/memory.py)")
    trim = malloc_trimmer()
    assert trim is not None
    garbage = [bytes(4096) * 16 for _ in range(200)]  # 12.8 MB of 64 KB blocks: the heap
    del garbage
    assert trim() in (0, 1)  # 1: memory was released


async def test_trims_on_its_period_and_survives_a_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    times: list[float] = []

    def trim() -> int:
        return 1

    async def run(fn: Trim) -> int:
        times.append(trio.current_time())
        if len(times) == 2:
            raise OSError("no")
        return fn()

    with trio.move_on_after(95):
        await trim_every(30, trim, run=run)
    assert times == [30, 60, 90]
