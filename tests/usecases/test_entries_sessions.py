"""Use-cases over the in-memory store and the real writer actor, on Trio's virtual clock.

What the one write path promises a caller, without HTTP and without a database: every change is
one log record at the next sequence, refusals and replays write nothing, an idempotency key
answers its first outcome forever (24 h), and logout is a logged internal change.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from actors.writer import run_writer
from registry.caches import FollowedCache
from registry.changes import ChangeLog, IdemKey, Outcome
from registry.coherence import Caches
from registry.config import Config, load_config
from registry.errors import Conflict, Forbidden, NotFound, RateLimited, Unauthorized, Unavailable
from registry.identity import DidKeyIdentity
from registry.keys import SigningKey
from registry.signin import build_response
from registry.store.memory import MemoryStore
from registry.usecases.common import Principal
from registry.usecases.entries import Entries
from registry.usecases.sessions import Sessions
from tests.helpers import signed_entry


@dataclass
class World:
    store: MemoryStore
    entries: Entries
    sessions: Sessions


def _config() -> Config:
    return load_config(
        None,
        environ={},
        overrides={"server": {"data_dir": str(Path("/nonexistent")), "public_origin": "http://t"}},
    )


@pytest.fixture
async def world(autojump_clock: trio.testing.MockClock) -> AsyncIterator[World]:
    clock_ms = lambda: 1_790_000_000_000 + int(trio.current_time() * 1000)  # noqa: E731
    store = MemoryStore(clock_ms=clock_ms)
    config = _config()
    async with trio.open_nursery() as nursery:
        writer = await nursery.start(run_writer, store)
        changes = ChangeLog(writer.append, store)
        entries = Entries(
            store=store,
            changes=changes,
            config=config,
            caches=Caches(discover_capacity=10),
            clock_ms=clock_ms,
        )
        sessions = Sessions(
            store=store,
            changes=changes,
            config=config,
            key=SigningKey.generate(),
            identity=DidKeyIdentity(),
            cache=FollowedCache(),
            clock_ms=clock_ms,
        )
        yield World(store, entries, sessions)
        nursery.cancel_scope.cancel()


async def sign_in(w: World, key: SigningKey) -> tuple[Principal, str]:
    challenge = await w.sessions.challenge({"audience": "tests"})
    body, token = await w.sessions.verify(
        {"audience": "tests", "challenge": challenge, "response": build_response(challenge, key)}
    )
    assert body["signerDid"] == key.did
    return await w.sessions.authenticate(token), token


def idem(principal: Principal, operation: str, key: str, body: Any) -> IdemKey:
    fingerprint = hashlib.sha256(repr((operation, body)).encode()).digest()
    return IdemKey(principal.did, operation, key, fingerprint)


def error_of(outcome: Outcome) -> str:
    assert outcome.refusal is not None, outcome
    return outcome.refusal.code


async def test_each_change_is_one_log_record_at_the_next_sequence(world: World) -> None:
    key = SigningKey.generate()
    me, _ = await sign_in(world, key)
    entry = signed_entry(key)
    created = await world.entries.create(me, entry, None)
    did = entry["entryDid"]
    assert created.sequence == await world.store.log_head()
    v2 = signed_entry(key, did, sequence=created.sequence, version="2")
    updated = await world.entries.update(me, did, v2, None)
    deleted = await world.entries.delete(me, did, None)
    records = await world.store.log_after(0, 10)
    assert [(r.seq, r.kind, r.entry_did) for r in records] == [
        (created.sequence, "entry.created", did),
        (updated.sequence, "entry.updated", did),
        (deleted.sequence, "entry.deleted", did),
    ]
    assert records[1].data["version"] == "2"
    with pytest.raises(NotFound):
        await world.entries.get(did)


async def test_a_replay_answers_the_first_outcome_and_writes_nothing(world: World) -> None:
    key = SigningKey.generate()
    me, _ = await sign_in(world, key)
    entry = signed_entry(key)
    k = idem(me, "create_entry", "k1", entry)
    first = await world.entries.create(me, entry, k)
    head = await world.store.log_head()
    again = await world.entries.create(me, entry, k)
    assert again.replayed
    assert (again.sequence, again.result) == (first.sequence, first.result)
    assert await world.store.log_head() == head  # no second record, so no second event
    other = signed_entry(key)
    conflict = await world.entries.create(me, other, idem(me, "create_entry", "k1", other))
    assert error_of(conflict) == "idempotency_conflict"


async def test_a_refusal_is_recorded_and_a_success_outlives_later_refusals(world: World) -> None:
    key = SigningKey.generate()
    me, _ = await sign_in(world, key)
    entry = signed_entry(key)
    created = await world.entries.create(me, entry, None)
    did = entry["entryDid"]
    v2 = signed_entry(key, did, sequence=created.sequence, version="2")
    k2 = idem(me, "update_entry", "u1", v2)
    first = await world.entries.update(me, did, v2, k2)
    assert first.refusal is None
    # Retried after the entry moved on: the check now refuses, the record answers the success.
    retried = await world.entries.update(me, did, v2, k2)
    assert retried.replayed
    assert retried.result == first.result
    # A stale update is refused and the refusal is recorded: the retry is a replay of it.
    stale = signed_entry(key, did, sequence=created.sequence, version="3")
    k3 = idem(me, "update_entry", "u2", stale)
    refused = await world.entries.update(me, did, stale, k3)
    assert error_of(refused) == "sequence_conflict"
    assert not refused.replayed
    assert (await world.entries.update(me, did, stale, k3)).replayed
    with pytest.raises(Conflict):
        refused.unwrap()


async def test_another_publishers_update_is_forbidden_and_recorded(world: World) -> None:
    owner, intruder = SigningKey.generate(), SigningKey.generate()
    me, _ = await sign_in(world, owner)
    them, _ = await sign_in(world, intruder)
    entry = signed_entry(owner)
    created = await world.entries.create(me, entry, None)
    forged = signed_entry(intruder, entry["entryDid"], sequence=created.sequence)
    k = idem(them, "update_entry", "x", forged)
    refused = await world.entries.update(them, entry["entryDid"], forged, k)
    assert error_of(refused) == "publisher_mismatch"
    with pytest.raises(Forbidden):
        refused.unwrap()
    assert (await world.entries.update(them, entry["entryDid"], forged, k)).replayed
    assert await world.store.log_head() == created.sequence


async def test_logout_is_a_logged_internal_change_and_ends_the_session(world: World) -> None:
    key = SigningKey.generate()
    me, token = await sign_in(world, key)
    head = await world.store.log_head()
    outcome = await world.sessions.logout(me, idem(me, "logout", "bye", None))
    assert outcome.result == '{"loggedOut":true}'
    (record,) = await world.store.log_after(head, 10)
    assert record.kind == "session.revoked"
    assert not record.public
    assert record.data == {"tokenHash": me.token_hash.hex()}
    with pytest.raises(Unauthorized):
        await world.sessions.authenticate(token)


async def test_concurrent_creates_of_one_did_give_exactly_one_entry(world: World) -> None:
    key = SigningKey.generate()
    me, _ = await sign_in(world, key)
    entry = signed_entry(key)
    outcomes: list[Outcome] = []

    async def create() -> None:
        outcomes.append(await world.entries.create(me, entry, None))

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(create)
    assert sorted(o.refusal.code if o.refusal else "created" for o in outcomes) == [
        "created",
        "entry_exists",
        "entry_exists",
        "entry_exists",
        "entry_exists",
    ]
    assert await world.store.log_head() == 1


@dataclass
class Budget:
    """A `LookupBudget` that counts (actors.ratelimiter.SessionLookups is the real one)."""

    taken: int = 0
    given_back: int = 0
    refusing: bool = False

    def take(self) -> None:
        if self.refusing:
            raise RateLimited("spent", retry_after=1.0, limit=1, code="read_rate_limited")
        self.taken += 1

    def give_back(self) -> None:
        self.given_back += 1


async def test_a_session_lookup_spends_its_budget_only_when_it_finds_no_live_session(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, token = await sign_in(world, SigningKey.generate())
    budget = Budget()
    await world.sessions.authenticate(token, lookups=budget)
    assert (budget.taken, budget.given_back) == (1, 1)  # a live session: no guess
    with pytest.raises(Unauthorized):
        await world.sessions.authenticate("a-guess", lookups=budget)
    assert (budget.taken, budget.given_back) == (2, 1)
    looked_up: list[bytes] = []
    real = world.store.get_session

    async def failing(token_hash: bytes) -> Any:
        looked_up.append(token_hash)
        raise Unavailable("the database did not answer in time")

    monkeypatch.setattr(world.store, "get_session", failing)
    with pytest.raises(Unavailable):
        await world.sessions.authenticate("another", lookups=budget)
    assert (budget.taken, budget.given_back) == (3, 1)  # a timeout may have run the query

    async def hanging(token_hash: bytes) -> Any:
        looked_up.append(token_hash)
        await trio.sleep_forever()

    monkeypatch.setattr(world.store, "get_session", hanging)
    with trio.move_on_after(5):  # the client hangs up during the lookup
        await world.sessions.authenticate("a-third", lookups=budget)
    assert (budget.taken, budget.given_back) == (4, 1)  # made, so spent

    async def counted(token_hash: bytes) -> Any:
        looked_up.append(token_hash)
        return await real(token_hash)

    monkeypatch.setattr(world.store, "get_session", counted)
    budget.refusing = True
    calls = len(looked_up)
    with pytest.raises(RateLimited):
        await world.sessions.authenticate("refused", lookups=budget)
    assert len(looked_up) == calls  # refused before the lookup
    budget.refusing = False
    with pytest.raises(Unauthorized):
        await world.sessions.authenticate("refused", lookups=budget)
    assert len(looked_up) == calls + 1
