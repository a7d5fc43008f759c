"""Database time spent for the request in progress (docs/limits.md, "Database time").

A discovery statement's cost depends on what it asks and on the data, not on its size: an OR of
fifty common words ranks most of the table, a negated word cannot use an index. So a query
endpoint meters the database time its statements take (`metering`), and its client address
pays it from a budget after the fact: a client may spend a little past its budget, once, and is
then refused until the budget has refilled.

The meter travels in a context variable: the store adds to the meter of the task that runs the
statement (and of its child tasks, which share the object), whatever layers lie in between.
Time is the statement's wall-clock time once it holds a connection: waiting for a connection is
not charged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class Meter:
    seconds: float = 0.0


_CURRENT: ContextVar[Meter | None] = ContextVar("registry_db_meter", default=None)


@contextmanager
def metering() -> Iterator[Meter]:
    """Meter the database time of the statements run inside the block (and by its children)."""
    meter = Meter()
    token = _CURRENT.set(meter)
    try:
        yield meter
    finally:
        _CURRENT.reset(token)


@contextmanager
def metered() -> Iterator[None]:
    """Add the block's wall-clock time to the current meter, if any."""
    meter = _CURRENT.get()
    if meter is None:
        yield
        return
    started = time.perf_counter()
    try:
        yield
    finally:
        meter.seconds += time.perf_counter() - started
