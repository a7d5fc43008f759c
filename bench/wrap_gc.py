#!/usr/bin/env python3
"""Run `registry` with the collector's pauses written to stderr: a diagnostic for the soak.

    .venv/bin/python bench/soak.py --minutes 10 --wrap bench/wrap_gc.py

Every collection of the oldest generation, and any other over 5 ms, prints one line
(`gc gen=2 ms=41.3 collected=0 tracked=812345`) to the server's stderr (its log file in the
soak's work directory), so long pauses can be put next to the soak's p99 spikes. With
`REGISTRY_GC_GARBAGE_AT=S`, S seconds after the start it also lists, once, the cyclic garbage
the collector finds, by type and by the function of each closure (what the request paths leave
to the collector rather than to reference counting). With `REGISTRY_MALLOC_EVERY=S`, every S
seconds it prints the C allocator's view (glibc `mallinfo2`: heap size, in use, free inside it)
and the number of objects the collector tracks, to tell a growing heap of live objects from a
fragmented one.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections import Counter
from typing import Any

_started = 0.0


def _watch(phase: str, info: dict[str, Any]) -> None:
    global _started
    if phase == "start":
        _started = time.perf_counter()
        return
    elapsed = (time.perf_counter() - _started) * 1000
    generation = info.get("generation", -1)
    if generation == 2 or elapsed > 5:
        tracked = len(gc.get_objects()) if generation == 2 else -1
        print(
            f"gc gen={generation} ms={elapsed:.1f} collected={info.get('collected')}"
            f" tracked={tracked} at={time.monotonic():.1f}",
            file=sys.stderr,
            flush=True,
        )


def _garbage(after: float) -> None:
    time.sleep(after)
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = list(gc.garbage)
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
    kinds = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in found)
    print(f"garbage: {len(found)} objects", file=sys.stderr)
    for kind, count in kinds.most_common(40):
        print(f"garbage {count:7d} {kind}", file=sys.stderr)
    functions = Counter(
        f"{o.__qualname__} ({o.__code__.co_filename}:{o.__code__.co_firstlineno})"
        for o in found
        if type(o).__name__ == "function"
    )
    for function, count in functions.most_common(10):
        print(f"garbage {count:7d} function {function}", file=sys.stderr)
    for o in found:
        if isinstance(o, BaseException) or type(o).__name__ == "frame":
            text = repr(o)[:300]
            print(f"garbage sample {type(o).__name__}: {text}", file=sys.stderr)
            if isinstance(o, BaseException) and o.__traceback__ is not None:
                tb = o.__traceback__
                while tb is not None:
                    code = tb.tb_frame.f_code
                    where = f"{code.co_filename}:{tb.tb_lineno} {code.co_name}"
                    print(f"   at {where}", file=sys.stderr)
                    tb = tb.tb_next
            break
    del found
    sys.stderr.flush()


def _malloc(every: float) -> None:
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost",
            )
        ]  # fmt: skip

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    mib = 1 << 20
    trim = os.environ.get("REGISTRY_MALLOC_TRIM") == "1"
    while True:
        time.sleep(every)
        if trim:
            libc.malloc_trim(0)
        info = libc.mallinfo2()
        print(
            f"malloc heap={info.arena / mib:.1f} mmapped={info.hblkhd / mib:.1f}"
            f" used={info.uordblks / mib:.1f} free={info.fordblks / mib:.1f} MiB"
            f" tracked={len(gc.get_objects())} at={time.monotonic():.1f}",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    every = os.environ.get("REGISTRY_MALLOC_EVERY")
    if every:
        threading.Thread(target=_malloc, args=(float(every),), daemon=True).start()
    gc.callbacks.append(_watch)
    at = os.environ.get("REGISTRY_GC_GARBAGE_AT")
    if at:
        threading.Thread(target=_garbage, args=(float(at),), daemon=True).start()
    from cli.main import main

    sys.exit(main(sys.argv[1:]))
