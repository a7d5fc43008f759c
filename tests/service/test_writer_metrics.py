"""The writer's metrics as Prometheus reads them (service/metrics.py), over the in-memory store."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from actors.writer import Writer, run_writer
from registry.changes import Change, IdemKey, Outcome
from registry.errors import Unavailable
from registry.store.memory import MemoryStore
from service.metrics import collectors
from tests.helpers import entry_created, new_did


class FailsOnce(MemoryStore):
    """The next batch fails with `code`, as PgStore's seam says it (then writes go through)."""

    def __init__(self) -> None:
        super().__init__()
        self.code: str | None = None

    async def append(self, items: list[tuple[Change, IdemKey | None]]) -> list[Outcome]:
        code, self.code = self.code, None
        if code is not None:
            await trio.lowlevel.checkpoint()
            raise Unavailable("the database failed the batch", code=code)
        return await super().append(items)


def failing(writer: Writer) -> float:
    (writer_metrics, *_) = collectors(SimpleNamespace(writer=writer))  # type: ignore[arg-type]
    [family] = [m for m in writer_metrics() if m.name == "registry_writer_failing"]
    [sample] = family.samples
    return sample.value


async def test_writer_failing_says_refusals_only_not_a_batch_that_met_a_passing_condition(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`registry_writer_failing` is 1 while the database refuses writes (read-only, full), and
    `RegistryWritesFailing` pages on it after a minute. It was 1 after any failed batch until
    one succeeded: a deadlock, a timeout or a restart, then no write through this process for a
    minute (an idle registry, writes behind the load balancer elsewhere), paged "the database
    refuses writes" on a database that takes them."""
    store = FailsOnce()
    async with trio.open_nursery() as nursery:
        writer: Writer = await nursery.start(partial(run_writer, store))
        for code, refused in [
            ("database_busy", 0.0),
            ("database_timeout", 0.0),
            ("database_unavailable", 0.0),
            ("database_read_only", 1.0),
            ("database_full", 1.0),
        ]:
            store.code = code
            with pytest.raises(Unavailable) as failed:
                await writer.append(entry_created(new_did()), None)
            assert failed.value.code == code
            assert writer.condition() == code
            assert failing(writer) == refused, code
            await writer.append(entry_created(new_did()), None)  # a write succeeds: over
            assert failing(writer) == 0.0
        nursery.cancel_scope.cancel()
