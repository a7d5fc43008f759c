"""The in-memory store follows the SQL of migration 0008: gap-free positions across refusals,
idempotent replay and conflict, the entry and session handlers' refusals, tombstones, expiry,
all-or-nothing batches, and wake-ups."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import trio
import trio.testing

from registry.changes import IDEMPOTENCY_CONFLICT, Change, IdemKey, Refusal
from registry.errors import Unavailable
from registry.query import RegistryQuery
from registry.store import SessionRecord
from registry.store import pg as pg_store
from registry.store.memory import HANDLERS, MemoryStore
from registry.usecases.entries import entry_change

PUBLISHER = "did:web:publisher.example"
DAY_MS = 24 * 3600 * 1000


class Clock:
    """A settable millisecond clock for the store."""

    def __init__(self, now_ms: int = 1_800_000_000_000) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


def did(name: str) -> str:
    return f"did:web:agents.example:{name}"


def version(kind: str, name: str, head: int | None, lifecycle: str = "active") -> Change:
    """An entry.* change of the entry `name`, its document `{"entryDid":…,"sequence":N}`."""
    return entry_change(
        kind,
        did=did(name),
        expected_head=head,
        publisher=PUBLISHER,
        entry_type="AgentDefinition",
        lifecycle=lifecycle,
        prefix=json.dumps({"entryDid": did(name)})[:-1] + ',"sequence":',
        suffix="}",
    )


def create(name: str) -> Change:
    return version("entry.created", name, None)


def update(name: str, head: int) -> Change:
    return version("entry.updated", name, head)


def delete(name: str, head: int) -> Change:
    return version("entry.deleted", name, head, lifecycle="deleted")


def key(name: str, fingerprint: bytes = b"fp") -> IdemKey:
    return IdemKey("did:web:caller.example", "entries.create", name, fingerprint)


def test_the_fake_has_a_handler_for_every_kind_the_sql_adapter_has() -> None:
    assert set(HANDLERS) == set(pg_store.HANDLERS)


@dataclass(frozen=True)
class Case:
    change: Change
    sequence: int | None  # the position taken, or None when refused
    refusal: str | None = None  # the refusal's code


BATCHES = {
    "refusals take no position": [
        Case(create("a"), 1),
        Case(create("a"), None, "entry_exists"),
        Case(create("b"), 2),
        Case(update("a", 2), None, "sequence_conflict"),
        Case(update("c", 1), None, "entry_not_found"),
        Case(update("a", 1), 3),
        Case(delete("b", 2), 4),
        Case(create("b"), None, "entry_exists"),  # a deleted DID is never reused
        Case(update("b", 4), 5),  # the handler, like the SQL, leaves lifecycle rules to use-cases
    ],
    "a batch of refusals only": [
        Case(update("x", 1), None, "entry_not_found"),
        Case(delete("y", 1), None, "entry_not_found"),
    ],
    "create then update in one batch": [
        Case(create("n"), 1),
        Case(update("n", 1), 2),
        Case(update("n", 2), 3),
        Case(update("n", 2), None, "sequence_conflict"),
    ],
}


@pytest.mark.parametrize("cases", BATCHES.values(), ids=BATCHES.keys())
async def test_a_batch_numbers_applied_changes_gap_free(cases: list[Case]) -> None:
    store = MemoryStore(clock_ms=Clock())
    outcomes = await store.append([(case.change, None) for case in cases])
    assert [o.sequence for o in outcomes] == [case.sequence for case in cases]
    assert [o.refusal.code if o.refusal else None for o in outcomes] == [
        case.refusal for case in cases
    ]
    applied = [case for case in cases if case.sequence is not None]
    records = await store.log_after(0, 100)
    assert [r.seq for r in records] == list(range(1, len(applied) + 1))
    assert [(r.kind, r.entry_did) for r in records] == [
        (case.change.kind, case.change.subject) for case in applied
    ]
    assert await store.log_head() == len(applied)
    for outcome in outcomes:
        if outcome.sequence is not None:
            assert outcome.result is not None
            assert json.loads(outcome.result)["sequence"] == outcome.sequence


async def test_a_batch_split_into_single_appends_numbers_the_same() -> None:
    cases = BATCHES["refusals take no position"]
    store = MemoryStore(clock_ms=Clock())
    sequences = [(await store.append([(case.change, None)]))[0].sequence for case in cases]
    assert sequences == [case.sequence for case in cases]


async def test_refusals_carry_the_sql_details() -> None:
    store = MemoryStore(clock_ms=Clock())
    await store.append([(create("a"), None), (update("a", 1), None)])
    exists, conflict, missing = await store.append(
        [(create("a"), None), (update("a", 1), None), (update("zz", 1), None)]
    )
    assert exists.refusal == Refusal(
        "Conflict",
        "entry_exists",
        "an entry with this DID exists or existed",
        {"entryDid": did("a")},
    )
    assert conflict.refusal is not None
    assert (conflict.refusal.kind, dict(conflict.refusal.details)) == (
        "Conflict",
        {"latestSequence": 2},
    )
    assert missing.refusal == Refusal(
        "NotFound", "entry_not_found", "entry not found", {"entryDid": did("zz")}
    )


async def test_log_records_carry_the_event_and_the_clock() -> None:
    clock = Clock()
    store = MemoryStore(clock_ms=clock)
    await store.append([(create("a"), None)])
    clock.now_ms += 1234
    await store.append([(update("a", 1), None)])
    first, second = await store.log_after(0, 10)
    assert second.at_ms - first.at_ms == 1234
    assert first.data == {
        "entryType": "AgentDefinition",
        "publisherDid": PUBLISHER,
        "lifecycleStatus": "active",
    }
    assert [r.seq for r in await store.log_after(1, 10)] == [2]
    assert await store.log_after(2, 10) == []
    assert [r.seq for r in await store.log_after(0, 1)] == [1]


# --- idempotency ----------------------------------------------------------------------------

IDEMPOTENCY = {
    # first change, retry change, retry fingerprint → (retry sequence, replayed, refusal code)
    "same request replays its success": (create("a"), create("a"), b"fp", (1, True, None)),
    "same request replays its refusal": (
        update("none", 1),
        update("none", 1),
        b"fp",
        (None, True, "entry_not_found"),
    ),
    "another request under the key conflicts": (
        create("a"),
        create("b"),
        b"other",
        (None, False, "idempotency_conflict"),
    ),
}


@pytest.mark.parametrize(
    ("first", "retry", "fingerprint", "expected"), IDEMPOTENCY.values(), ids=IDEMPOTENCY.keys()
)
async def test_a_completed_key_answers_from_its_record(
    first: Change,
    retry: Change,
    fingerprint: bytes,
    expected: tuple[int | None, bool, str | None],
) -> None:
    store = MemoryStore(clock_ms=Clock())
    [original] = await store.append([(first, key("k"))])
    head = await store.log_head()
    [again] = await store.append([(retry, key("k", fingerprint))])
    refusal = again.refusal.code if again.refusal else None
    assert (again.sequence, again.replayed, refusal) == expected
    assert await store.log_head() == head  # nothing written, no position taken
    if again.replayed:
        assert (again.sequence, again.result, again.refusal) == (
            original.sequence,
            original.result,
            original.refusal,
        )
    else:
        assert again.refusal == IDEMPOTENCY_CONFLICT


async def test_a_key_replays_within_one_batch_too() -> None:
    store = MemoryStore(clock_ms=Clock())
    outcomes = await store.append(
        [(create("a"), key("k")), (create("a"), key("k")), (create("b"), key("k", b"x"))]
    )
    assert [(o.sequence, o.replayed) for o in outcomes] == [(1, False), (1, True), (None, False)]
    assert outcomes[2].refusal == IDEMPOTENCY_CONFLICT


async def test_a_key_older_than_a_day_is_fresh_again() -> None:
    clock = Clock()
    store = MemoryStore(clock_ms=clock)
    await store.append([(create("a"), key("k"))])
    clock.now_ms += DAY_MS
    [outcome] = await store.append([(create("b"), key("k", b"other"))])
    assert (outcome.sequence, outcome.replayed) == (2, False)
    assert await store.purge_expired() == {}
    clock.now_ms += DAY_MS + 1
    assert await store.purge_expired() == {"idempotency": 1}


async def test_record_refusal_stands_unless_the_key_has_an_outcome() -> None:
    store = MemoryStore(clock_ms=Clock())
    refusal = Refusal("Forbidden", "capability_missing", "no", {"capability": "entries.write"})
    recorded = await store.record_refusal(key("r"), refusal)
    assert (recorded.sequence, recorded.refusal, recorded.replayed) == (None, refusal, False)
    again = await store.record_refusal(key("r"), refusal)
    assert (again.refusal, again.replayed) == (refusal, True)
    assert (await store.record_refusal(key("r", b"other"), refusal)).refusal == IDEMPOTENCY_CONFLICT
    # The append path answers the recorded refusal: the retry is not applied.
    [retry] = await store.append([(create("r"), key("r"))])
    assert (retry.sequence, retry.refusal, retry.replayed) == (None, refusal, True)
    # And a refusal decided late does not overwrite a success.
    [done] = await store.append([(create("s"), key("s"))])
    late = await store.record_refusal(key("s"), refusal)
    assert (late.sequence, late.result, late.refusal, late.replayed) == (
        done.sequence,
        done.result,
        None,
        True,
    )


# --- versions -------------------------------------------------------------------------------


async def test_versions_exclude_the_tombstone_and_the_head_shows_it() -> None:
    store = MemoryStore(clock_ms=Clock())
    await store.append(
        [(create("a"), None), (create("b"), None), (update("a", 1), None), (update("a", 3), None)]
    )
    docs, total = await store.list_versions(did("a"), None, 10, 1 << 20)
    assert ([json.loads(d)["sequence"] for d in docs], total) == ([4, 3, 1], 3)
    docs, total = await store.list_versions(did("a"), 4, 1, 1 << 20)
    assert ([json.loads(d)["sequence"] for d in docs], total) == ([3], 3)
    docs, _ = await store.list_versions(did("a"), None, 10, 1)  # past the page bytes: None
    assert [d is not None for d in docs] == [True, False, False]
    await store.append([(delete("a", 4), None)])
    head = await store.get_entry_head(did("a"))
    assert head is not None
    assert (head.head_seq, head.lifecycle, head.publisher_did) == (5, "deleted", PUBLISHER)
    assert json.loads(head.doc)["sequence"] == 5
    docs, total = await store.list_versions(did("a"), None, 10, 1 << 20)
    assert ([json.loads(d)["sequence"] for d in docs], total) == ([4, 3, 1], 3)
    assert await store.get_version(did("a"), 5) is None
    assert await store.get_version(did("a"), 2) is None  # another entry's version
    assert await store.get_version(did("b"), 2) is not None
    assert await store.get_entry_head(did("nobody")) is None
    found = await store.change_versions([(5, did("a")), (2, did("b")), (3, did("a"))], ["x"])
    assert {s: [json.loads(doc)["sequence"] for doc, _ in v] for s, v in found.items()} == {
        2: [2],
        3: [1, 3],
        5: [4, 5],
    }
    assert all(matched == [] for v in found.values() for _, matched in v)


async def test_a_batch_that_raises_writes_nothing() -> None:
    store = MemoryStore(clock_ms=Clock())
    await store.append([(create("a"), key("k0"))])
    broken = entry_change(
        "entry.created",
        did=did("bad"),
        expected_head=None,
        publisher=PUBLISHER,
        entry_type="AgentDefinition",
        lifecycle="active",
        prefix="not json ",
        suffix="",
    )
    with pytest.raises(ValueError, match="Expecting value"):
        await store.append([(update("a", 1), key("k1")), (create("b"), None), (broken, None)])
    with pytest.raises(KeyError):
        await store.append([(create("c"), None), (Change("no.such.kind", None, {}), None)])
    assert await store.log_head() == 1
    assert await store.get_entry_head(did("b")) is None
    head = await store.get_entry_head(did("a"))
    assert head is not None
    assert head.head_seq == 1
    [retry] = await store.append([(update("a", 1), key("k1"))])
    assert (retry.sequence, retry.replayed) == (2, False)  # k1 was not recorded


# --- sessions -------------------------------------------------------------------------------


def session(expires_at_ms: int) -> SessionRecord:
    return SessionRecord("did:web:me", "did:web:me", "did:web:me", "web", ("read",), expires_at_ms)


def revoke(token_hash: bytes) -> Change:
    return Change("session.revoked", None, {"tokenHash": token_hash.hex()})


async def test_sessions_open_once_expire_and_are_revoked_through_the_log() -> None:
    clock = Clock()
    store = MemoryStore(clock_ms=clock)
    await store.put_challenge("n1", {"nonce": "n1"}, clock.now_ms + 60_000)
    assert await store.get_challenge("n1") == {"nonce": "n1"}
    record = session(clock.now_ms + 3_600_000)
    assert await store.open_session("n1", b"t1", record)
    assert not await store.open_session("n1", b"t2", record)  # the challenge is burnt
    assert await store.get_challenge("n1") is None
    assert await store.get_session(b"t1") == record
    revoked, again, unknown = await store.append(
        [(revoke(b"t1"), None), (revoke(b"t1"), None), (revoke(b"zz"), None)]
    )
    assert (revoked.sequence, revoked.result) == (1, '{"loggedOut":true}')
    assert again.refusal is not None
    assert unknown.refusal is not None
    assert (again.sequence, again.refusal.code) == (None, "session_invalid")
    assert (unknown.sequence, unknown.refusal.kind) == (None, "Unauthorized")
    assert await store.get_session(b"t1") is None
    [record_] = await store.log_after(0, 10)
    assert (record_.kind, record_.public) == ("session.revoked", False)

    await store.put_challenge("n2", {}, clock.now_ms + 60_000)
    assert await store.open_session("n2", b"t2", session(clock.now_ms + 1000))
    clock.now_ms += 1000
    assert await store.get_session(b"t2") is None  # expired
    assert await store.purge_expired() == {}  # kept a day past expiry
    clock.now_ms += DAY_MS + 1
    assert await store.purge_expired() == {"sessions": 1}


async def test_purge_removes_expired_challenges() -> None:
    clock = Clock()
    store = MemoryStore(clock_ms=clock)
    await store.put_challenge("old", {}, clock.now_ms + 10)
    await store.put_challenge("new", {}, clock.now_ms + 10_000)
    clock.now_ms += 11
    assert await store.purge_expired() == {"challenges": 1}
    assert await store.get_challenge("old") is None
    assert await store.get_challenge("new") == {}


# --- failures and wake-ups ------------------------------------------------------------------


async def test_discovery_is_not_modelled() -> None:
    store = MemoryStore()
    with pytest.raises(Unavailable) as caught:
        await store.discover(RegistryQuery(), limit=20, after=None)
    assert caught.value.code == "not_supported"


async def test_failing_reads_and_writes_raise_unavailable() -> None:
    store = MemoryStore()
    store.fail_reads = True
    for read in (store.log_head(), store.log_after(0, 1), store.ping(), store.get_session(b"")):
        with pytest.raises(Unavailable):
            await read
    with pytest.raises(Unavailable):
        async with store.listen_log():
            pass  # pragma: no cover
    store.fail_reads = False
    store.fail_writes = True
    with pytest.raises(Unavailable):
        await store.append([(create("a"), None)])
    store.fail_writes = False
    assert await store.log_head() == 0
    assert await store.schema_version() == 14


async def test_wakeups_follow_appends_that_take_a_position(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    woken: list[float | str] = []
    async with store.listen_log() as wakeups, trio.open_nursery() as nursery:

        async def waiter() -> None:
            try:
                while True:
                    await wakeups.wait()
                    woken.append(trio.current_time())
            except Unavailable:
                woken.append("lost")

        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        await store.append([(update("none", 1), None)])  # refused: no wake-up
        await trio.testing.wait_all_tasks_blocked()
        assert woken == []
        await trio.sleep(1)
        await store.append([(create("a"), None), (create("b"), None)])  # one per batch
        await trio.testing.wait_all_tasks_blocked()
        assert woken == [1.0]
        store.drop_wakeups = True
        await store.append([(create("c"), None)])
        await trio.testing.wait_all_tasks_blocked()
        assert woken == [1.0]
        assert store.listeners == 1
        assert store.break_listeners() == 1
        await trio.testing.wait_all_tasks_blocked()
        assert woken == [1.0, "lost"]
    assert store.listeners == 0


async def test_appends_while_nobody_waits_are_one_wakeup(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    async with store.listen_log() as wakeups:
        await store.append([(create("a"), None)])
        await store.append([(create("b"), None)])
        await wakeups.wait()  # at once
        assert trio.current_time() == 0
        with trio.move_on_after(10) as quiet:
            await wakeups.wait()
        assert quiet.cancelled_caught
