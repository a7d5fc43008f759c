"""The checkpointer (actors/transparency.py) over the in-memory store on virtual time: it
issues the empty tree's checkpoint, then one per step while the log grows, each a signed note
whose root is the tree of the records as served (recomputed here from RFC 9162's definition);
a restart resumes from the stored edge; a tree altered in the store stops it with a known
failure (the supervisor's backoff), not a crash of the service."""

from __future__ import annotations

import base64
import hashlib

import pytest
import trio
import trio.testing

from actors.supervisor import KNOWN_FAILURES, SupervisorStats, database_ready, is_known, supervise
from actors.transparency import TransparencyHandle, run_checkpointer
from registry.canonical import canonicalize
from registry.errors import Unavailable
from registry.keys import SigningKey
from registry.store.memory import MemoryStore
from registry.transparency import log_record, open_checkpoint
from tests.helpers import entry_created
from tests.registry.test_transparency import mth

KEY = SigningKey(bytes([9] * 32))


async def grow(store: MemoryStore, count: int) -> int:
    for _ in range(count):
        await store.append([(entry_created(), None)])
    return await store.log_head()


async def served_root(store: MemoryStore, size: int) -> bytes:
    rows = await store.log_records(0, size)
    return mth([hashlib.sha256(b"\x00" + canonicalize(log_record(r, d))).digest() for r, d in rows])


async def test_checkpoints_follow_the_log_and_resume_from_the_stored_edge(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    for round_ in range(3):  # each round a new checkpointer, as after a restart
        handle = TransparencyHandle()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda h=handle: run_checkpointer(store, KEY, KEY.did, every_seconds=1.0, handle=h)
            )
            head = await grow(store, 300 + 7 * round_)  # past a tile of 256 leaves
            with trio.fail_after(30):
                latest = await handle.checkpointed(head)
            nursery.cancel_scope.cancel()
        checkpoint = open_checkpoint(latest.note, KEY.public_key)
        assert checkpoint.origin == KEY.did
        assert checkpoint.size == head
        assert checkpoint.root == await served_root(store, head)
        assert base64.b64encode(checkpoint.root).decode() in latest.note
    assert 0 in store._tables.checkpoints  # the empty tree's, issued first


async def test_an_altered_tree_is_a_known_failure_not_a_crash(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    handle = TransparencyHandle()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: run_checkpointer(store, KEY, KEY.did, every_seconds=1.0, handle=handle)
        )
        head = await grow(store, 10)
        with trio.fail_after(30):
            await handle.checkpointed(head)
        nursery.cancel_scope.cancel()
    store._tables.tiles[(0, 0)] = bytes(32) * 10  # the leaves rewritten in the store
    with pytest.raises(BaseException) as refused:  # noqa: PT011 (a group, unwrapped below)
        await run_checkpointer(store, KEY, KEY.did, every_seconds=1.0, handle=TransparencyHandle())
    assert is_known(refused.value, KNOWN_FAILURES)  # the supervisor retries, the service runs
    leaf = refused.value
    while isinstance(leaf, BaseExceptionGroup):
        (leaf,) = leaf.exceptions
    assert isinstance(leaf, Unavailable)
    assert leaf.code == "log_tree_altered"


async def test_a_record_jcs_cannot_write_is_a_known_failure_not_a_crash(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A log record holding an integer beyond 2^53-1 (a peer's status with the tree size of a
    checkpoint it signed, as the release before the witness refused such sizes wrote it) has no
    JCS form, so no leaf: hashing it raised `Invalid`, a bug to the supervisor, which ended the
    process, and every restart after it met the same record. It stops the checkpointer at the
    record with a known failure (retried with backoff, said in the log); the service runs."""
    from registry.changes import Change

    store = MemoryStore()
    await grow(store, 3)
    status = {"peerDid": "did:key:zPeer", "cursor": 0, "log": {"treeSize": 2**60}}
    rows = {
        "peerDid": "did:key:zPeer",
        "expectedCursor": 0,
        "cursor": 0,
        "status": {"head": None},
        "replicas": [],
        "quarantined": [],
    }
    [outcome] = await store.append([(Change("peer.status", None, rows, event=status), None)])
    assert outcome.refusal is None
    await grow(store, 2)
    handle = TransparencyHandle()
    with pytest.raises(BaseException) as refused:  # noqa: PT011 (a group, unwrapped below)
        await run_checkpointer(store, KEY, KEY.did, every_seconds=1.0, handle=handle)
    assert is_known(refused.value, KNOWN_FAILURES)  # the supervisor retries, the service runs
    leaf = refused.value
    while isinstance(leaf, BaseExceptionGroup):
        (leaf,) = leaf.exceptions
    assert isinstance(leaf, Unavailable)
    assert leaf.code == "log_record_unhashable"
    assert "log record 4 " in leaf.message
    assert handle.latest is not None
    assert handle.latest.size == 0  # the tree stops before that record's page


async def test_an_altered_tree_is_retried_with_backoff_while_the_database_answers(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Supervised as the service runs it (wiring: `ready` asks whether the database takes
    writes), an altered tree is retried with the supervisor's growing backoff. The database
    answers all along, so `ready` ended every backoff after its first second: the
    checkpointer restarted (a leadership, the tiles read, an ERROR line) every second, forever."""
    store = MemoryStore()
    head = await grow(store, 10)
    handle = TransparencyHandle()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: run_checkpointer(store, KEY, KEY.did, every_seconds=1.0, handle=handle)
        )
        with trio.fail_after(30):
            await handle.checkpointed(head)
        nursery.cancel_scope.cancel()
    store._tables.tiles[(0, 0)] = bytes(32) * 10  # the leaves rewritten in the store
    stats = SupervisorStats()
    with trio.move_on_after(600):
        await supervise(
            "transparency",
            lambda: run_checkpointer(
                store, KEY, KEY.did, every_seconds=1.0, handle=TransparencyHandle()
            ),
            stats=stats,
            draw=lambda: 0.5,
            ready=database_ready(store, writes=True),
        )
    assert "altered" in (stats.last_error or "")
    # 0.375, 0.75, 1.5, 3, 6, 12, then 22.5 s apart: about 30 runs in ten minutes, not 600.
    assert 25 <= stats.restarts <= 35
    said = [r for r in caplog.records if "do not give checkpoint" in r.getMessage()]
    assert len(said) in (stats.restarts, stats.restarts + 1)  # one a run
