"""Freed memory back to the operating system, now and then (glibc's `malloc_trim`).

CPython allocates every object over 512 bytes (entry documents, response bodies, socket
buffers) with the C library's `malloc`. glibc keeps what is freed inside its heap for reuse and
gives the top of the heap back only past a threshold that it raises on its own after large
allocations, so under a steady load the heap grew by about 7 MiB a minute of free space that
nothing used again: `bench/wrap_gc.py` showed 55 MiB free inside a 77 MiB heap after 8 minutes,
while the objects in use were 22 MiB (bench/README.md, soak). `malloc_trim(0)` returns every
whole free page of the heap (the middle too, with `madvise`), so the resident size follows what
is in use. It runs in a worker thread (it holds the allocator's lock for a few milliseconds;
the event loop keeps running between its own allocations). Elsewhere than glibc it is off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger(__name__)

Trim = Callable[[], int]


def malloc_trimmer() -> Trim | None:
    """glibc's `malloc_trim(0)`, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def trim_all() -> int:
        return int(trim(0))

    return trim_all


async def trim_every(
    seconds: float,
    trim: Trim,
    *,
    run: Callable[[Trim], Awaitable[int]] = trio.to_thread.run_sync,
) -> None:
    """Call `trim` (through `run`: a worker thread) every `seconds`, until cancelled."""
    while True:
        await trio.sleep(seconds)
        try:
            await run(trim)
        except OSError as exc:  # never fatal: memory stays as it is
            log.warning("malloc_trim failed: %s", exc)
