"""Database time spent for the request in progress (docs/limits.md, "Database time").

A discovery statement's cost depends on what it asks and on the data, not on its size: an OR of
fifty common words ranks most of the table, a negated word cannot use an index. So a query
route opens a meter (`db_meter`) around its handler, the store times each statement it runs for
it (`timed_statement`), and the route's client address pays the total from a budget after the
fact.

The meter travels in a context variable: a statement run by the handler's task, or by a task it
started (child tasks see the same meter object), adds to it, whatever layers lie in between.
The time is the statement's wall-clock time once it holds a connection: waiting for a
connection is not charged, but time the event loop spends on other tasks while the statement's
answer waits to be read is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

# The rate-limit class of a client address's database time (limits.query_db_ms_per_minute_...).
DB_TIME_CLASS = "query_db_ms"


@dataclass
class Meter:
    seconds: float = 0.0


_CURRENT: ContextVar[Meter | None] = ContextVar("registry_db_meter", default=None)


@contextmanager
def db_meter() -> Iterator[Meter]:
    """A meter of the database time of the statements timed inside the block (and by the tasks
    started there)."""
    meter = Meter()
    token = _CURRENT.set(meter)
    try:
        yield meter
    finally:
        _CURRENT.reset(token)


@contextmanager
def timed_statement() -> Iterator[None]:
    """Add the block's wall-clock time to the current meter, if there is one."""
    meter = _CURRENT.get()
    if meter is None:
        yield
        return
    started = time.perf_counter()
    try:
        yield
    finally:
        meter.seconds += time.perf_counter() - started
