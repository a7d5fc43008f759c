"""The writer actor over the in-memory store (each round trip takes one virtual second): group
commit, refusals and failures answered to the right callers, and callers that give up."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing

from actors.writer import Writer, run_writer
from registry.changes import Change, IdemKey, Outcome
from registry.errors import Invalid, RegistryError, Unavailable
from registry.store.memory import MemoryStore
from registry.store.pg import QUERY_TIMEOUT_SECONDS
from tests.helpers import entry_created

_names = itertools.count()


def new_did() -> str:
    return f"did:web:agents.example:{next(_names)}"


def create(did: str) -> Change:
    return entry_created(did)


@asynccontextmanager
async def open_writer(store: MemoryStore, **options: int) -> AsyncIterator[Writer]:
    async with trio.open_nursery() as nursery:
        writer: Writer = await nursery.start(partial(run_writer, store, **options))
        yield writer
        nursery.cancel_scope.cancel()


async def submit(
    writer: Writer,
    did: str,
    into: dict[str, Outcome | Exception],
    idem: IdemKey | None = None,
) -> None:
    """Append a creation of `did`; record its outcome (or error) under the DID."""
    try:
        into[did] = await writer.append(create(did), idem)
    except Unavailable as exc:
        into[did] = exc


def sequence(outcome: Outcome | Exception) -> int | None:
    assert isinstance(outcome, Outcome), outcome
    return outcome.sequence


def entry_did(outcome: Outcome | Exception) -> str:
    assert isinstance(outcome, Outcome)
    return str(json.loads(outcome.unwrap())["entryDid"])


async def test_concurrent_appends_are_committed_in_batches(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(latency=1.0)
    outcomes: dict[str, Outcome | Exception] = {}
    dids = [new_did() for _ in range(8)]
    async with open_writer(store, max_batch=4) as writer, trio.open_nursery() as callers:
        callers.start_soon(submit, writer, dids[0], outcomes)
        await trio.testing.wait_all_tasks_blocked()  # the first batch is in flight
        for did in dids[1:]:
            callers.start_soon(submit, writer, did, outcomes)
        await trio.testing.wait_all_tasks_blocked()
        assert writer.statistics()["queued"] == 7
    assert trio.current_time() == 3.0  # three round trips: 1, then 4, then 3 changes
    assert store.batch_sizes == [1, 4, 3]
    assert writer.statistics() == {"batches": 3, "changes": 8, "largest_batch": 4, "queued": 0}
    assert {did: entry_did(outcome) for did, outcome in outcomes.items()} == {d: d for d in dids}
    assert sorted(sequence(outcome) or 0 for outcome in outcomes.values()) == list(range(1, 9))
    assert sequence(outcomes[dids[0]]) == 1


async def test_an_idle_writer_commits_a_single_change_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(latency=1.0)
    async with open_writer(store) as writer:
        for expected in (1, 2, 3):
            began = trio.current_time()
            outcome = await writer.append(create(new_did()), None)
            assert (outcome.sequence, trio.current_time() - began) == (expected, 1.0)
    assert store.batch_sizes == [1, 1, 1]


async def test_a_refusal_is_its_own_callers_outcome_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(latency=1.0)
    taken = new_did()
    await store.append([(create(taken), None)])
    outcomes: dict[str, Outcome | Exception] = {}
    dids = [new_did(), taken, new_did(), new_did()]
    async with open_writer(store) as writer, trio.open_nursery() as callers:
        callers.start_soon(writer.append, create(new_did()), None)  # occupies the writer
        await trio.testing.wait_all_tasks_blocked()
        for did in dids:
            callers.start_soon(submit, writer, did, outcomes)
    assert store.batch_sizes == [1, 1, 4]
    refused = outcomes[taken]
    assert isinstance(refused, Outcome)
    assert refused.refusal is not None
    assert (refused.sequence, refused.refusal.code) == (None, "entry_exists")
    others = [outcomes[did] for did in dids if did != taken]
    assert all(isinstance(o, Outcome) and o.refusal is None for o in others)
    assert sorted(sequence(o) or 0 for o in others) == [3, 4, 5]


async def test_a_store_failure_is_every_batch_members_error_and_the_writer_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(latency=1.0)
    outcomes: dict[str, Outcome | Exception] = {}
    failing = [new_did() for _ in range(3)]
    async with open_writer(store) as writer:
        async with trio.open_nursery() as callers:
            callers.start_soon(writer.append, create(new_did()), None)
            await trio.testing.wait_all_tasks_blocked()
            store.fail_writes = True  # the next batch meets the database down
            for did in failing:
                callers.start_soon(submit, writer, did, outcomes)
        for did in failing:
            error = outcomes[did]
            assert isinstance(error, Unavailable)
            assert error.code == "database_unavailable"
        store.fail_writes = False
        outcome = await writer.append(create(failing[0]), None)  # nothing of it was written
        assert outcome.sequence == 2
        assert writer.statistics()["batches"] == 2  # the failed batch is not counted


async def test_callers_that_give_up_do_not_break_the_writer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(latency=1.0)
    outcomes: dict[str, Outcome | Exception] = {}
    in_flight, queued, patient = new_did(), new_did(), new_did()
    async with open_writer(store) as writer, trio.open_nursery() as callers:

        async def gives_up(did: str, after: float) -> None:
            with trio.move_on_after(after):
                await submit(writer, did, outcomes)

        callers.start_soon(gives_up, in_flight, 0.5)  # gives up while its change is written
        await trio.testing.wait_all_tasks_blocked()
        callers.start_soon(gives_up, queued, 0.25)  # gives up while its change is queued
        callers.start_soon(submit, writer, patient, outcomes)
        await trio.testing.wait_all_tasks_blocked()
        assert writer.statistics()["queued"] == 2
    assert trio.current_time() == 2.0
    assert set(outcomes) == {patient}
    assert entry_did(outcomes[patient]) == patient
    # The abandoned changes were written all the same (their idempotency keys make a retry
    # safe), and the writer carries on.
    records = await store.log_after(0, 10)
    assert records[0].entry_did == in_flight
    assert {r.entry_did for r in records[1:]} == {queued, patient}
    async with open_writer(store) as writer:
        assert (await writer.append(create(new_did()), None)).sequence == 4


async def test_shutdown_mid_batch_tells_its_callers_the_write_was_interrupted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(latency=1.0)
    outcomes: dict[str, Outcome | Exception] = {}
    dids = [new_did(), new_did()]
    async with trio.open_nursery() as callers, trio.open_nursery() as actor:
        writer: Writer = await actor.start(run_writer, store)
        for did in dids:
            callers.start_soon(submit, writer, did, outcomes)
        await trio.testing.wait_all_tasks_blocked()
        actor.cancel_scope.cancel()
    for did in dids:
        error = outcomes[did]
        assert isinstance(error, Unavailable)
        assert error.code == "write_interrupted"
    assert await store.log_head() == 0


async def test_shutdown_tells_the_callers_whose_changes_were_still_queued(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(latency=1.0)
    outcomes: dict[str, Outcome | Exception] = {}
    in_flight, queued = new_did(), [new_did(), new_did()]
    # A caller left unanswered would wait forever: the deadline makes that a failure.
    with trio.fail_after(60):
        async with trio.open_nursery() as callers, trio.open_nursery() as actor:
            writer: Writer = await actor.start(run_writer, store)
            callers.start_soon(submit, writer, in_flight, outcomes)
            await trio.testing.wait_all_tasks_blocked()  # its batch is being written
            for did in queued:
                callers.start_soon(submit, writer, did, outcomes)
            await trio.testing.wait_all_tasks_blocked()
            assert writer.statistics()["queued"] == 2
            actor.cancel_scope.cancel()
    assert set(outcomes) == {in_flight, *queued}  # every caller answered: none left waiting
    for did in (in_flight, *queued):
        error = outcomes[did]
        assert isinstance(error, Unavailable)
        assert error.code == "write_interrupted"


class RefusesBatches(MemoryStore):
    """A batch of several changes fails as a value the database refused would make it fail,
    so the writer applies them again one by one."""

    async def append(self, items: list[tuple[Change, IdemKey | None]]) -> list[Outcome]:
        if len(items) > 1:
            await trio.sleep(1.0)
            raise Invalid("a value the database refused", code="invalid_value")
        return await super().append(items)


async def test_shutdown_while_a_batch_is_applied_one_by_one_answers_every_caller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = RefusesBatches(latency=1.0)
    outcomes: dict[str, Outcome | Exception] = {}
    first, batch = new_did(), [new_did(), new_did(), new_did()]
    # A caller left unanswered would wait forever: the deadline makes that a failure.
    with trio.fail_after(60):
        async with trio.open_nursery() as callers, trio.open_nursery() as actor:
            writer: Writer = await actor.start(run_writer, store)
            callers.start_soon(submit, writer, first, outcomes)
            await trio.testing.wait_all_tasks_blocked()
            for did in batch:  # queued in this order while `first` is written: one batch of three
                callers.start_soon(submit, writer, did, outcomes)
                await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(3.5)  # t=1 first written, t=2 the batch refused, t=3 its first retry
            actor.cancel_scope.cancel()
    assert set(outcomes) == {first, *batch}  # every caller answered: none left waiting
    assert entry_did(outcomes[first]) == first
    assert entry_did(outcomes[batch[0]]) == batch[0]  # written on its own before the stop
    for did in batch[1:]:
        error = outcomes[did]
        assert isinstance(error, Unavailable)
        assert error.code == "write_interrupted"


async def test_closing_every_handle_stops_the_writer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    async with trio.open_nursery() as nursery:
        writer: Writer = await nursery.start(run_writer, store)
        other = writer.clone()
        await writer.aclose()
        assert (await other.append(create(new_did()), None)).sequence == 1
        await other.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await other.append(create(new_did()), None)


class BreaksOn(MemoryStore):
    """Appending the change of one DID fails as nothing the storage seam knows does (a bug, a
    limit no check foresaw): a raw exception, not a RegistryError."""

    def __init__(self, poison: str, **options: float) -> None:
        super().__init__(**options)
        self.poison = poison

    async def append(self, items: list[tuple[Change, IdemKey | None]]) -> list[Outcome]:
        if any(change.subject == self.poison for change, _ in items):
            await trio.sleep(1.0)
            raise RuntimeError("index row size 3088 exceeds btree version 4 maximum 2704")
        return await super().append(items)


async def test_an_unexpected_failure_is_its_own_callers_500_and_the_writer_goes_on(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    poison = new_did()
    store = BreaksOn(poison, latency=1.0)
    outcomes: dict[str, Outcome | Exception] = {}
    batch = [new_did(), poison, new_did()]

    async def attempt(did: str) -> None:
        try:
            outcomes[did] = await writer.append(create(did), None)
        except RegistryError as exc:
            outcomes[did] = exc

    with trio.fail_after(60):
        async with open_writer(store) as writer:
            async with trio.open_nursery() as callers:
                callers.start_soon(writer.append, create(new_did()), None)  # occupies the writer
                await trio.testing.wait_all_tasks_blocked()
                for did in batch:  # one batch of three, the poisoned change among them
                    callers.start_soon(attempt, did)
            error = outcomes[poison]
            assert type(error) is RegistryError
            assert (error.status, error.code) == (500, "internal_error")
            assert [entry_did(outcomes[did]) for did in batch if did != poison] == [
                batch[0],
                batch[2],
            ]
            later = new_did()  # the actor is still there
            assert entry_did(await writer.append(create(later), None)) == later
    assert "RuntimeError: index row size" in caplog.text  # logged with its traceback


class Hangs(MemoryStore):
    """While `hung`, a write waits for the seam's deadline and fails as PgStore's does then (a
    lock held on the log head, a database that stopped answering): `database_timeout`."""

    def __init__(self, **options: float) -> None:
        super().__init__(**options)
        self.hung = False

    async def append(self, items: list[tuple[Change, IdemKey | None]]) -> list[Outcome]:
        if self.hung:
            await trio.sleep(QUERY_TIMEOUT_SECONDS)
            raise Unavailable("the database did not answer in time", code="database_timeout")
        return await super().append(items)


async def test_callers_queued_behind_a_timed_out_batch_are_answered_with_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A database that does not answer: each batch (64 changes) took the seam's 30 s to fail,
    so 200 writers queued behind the first waited up to four batches, 120 s, and a full queue
    (1,024) 8 minutes, each HTTP request hanging meanwhile. Nothing of a queued change was
    tried: it gets the batch's 503 (its retry is safe) when the batch fails."""
    store = Hangs(latency=1.0)
    outcomes: dict[str, Outcome | Exception] = {}
    queued = [new_did() for _ in range(200)]
    async with open_writer(store) as writer:
        store.hung = True
        start = trio.current_time()
        async with trio.open_nursery() as callers:
            callers.start_soon(submit, writer, new_did(), outcomes)
            await trio.testing.wait_all_tasks_blocked()  # the first batch is in flight
            for did in queued:
                callers.start_soon(submit, writer, did, outcomes)
        assert trio.current_time() - start == QUERY_TIMEOUT_SECONDS  # one deadline, not four
        for did in queued:
            error = outcomes[did]
            assert isinstance(error, Unavailable)
            assert error.code == "database_timeout"
        assert writer.condition() == "database_timeout"
        store.hung = False  # the database answers again: the next write goes through
        assert entry_did(await writer.append(create(queued[0]), None)) == queued[0]
        assert writer.condition() is None
