"""A create's searchable row is written before the log head is locked (migration 0021,
docs/architecture.md "The critical section"): every entry keeps exactly one `entry_search` row,
of its head version, whatever a batch's changes turn out to be, and batches that create the same
DIDs at once never deadlock.
"""

from __future__ import annotations

import json
import secrets

import asyncpg
import trio
import trio_asyncio

from registry.changes import Change, IdemKey
from registry.store.pg import PgStore, open_pg_store
from registry.usecases.entries import entry_change


def _create(did: str, name: str) -> Change:
    return entry_change(
        "entry.created",
        did=did,
        expected_head=None,
        publisher="did:key:zSearch",
        entry_type="AgentDefinition",
        lifecycle="active",
        prefix=json.dumps({"entryDid": did, "name": name, "tags": ["t"]})[:-1] + ',"sequence":',
        suffix="}",
    )


def _version(did: str, name: str, head: int, lifecycle: str = "active") -> Change:
    return entry_change(
        "entry.deleted" if lifecycle == "deleted" else "entry.updated",
        did=did,
        expected_head=head,
        publisher="did:key:zSearch2",
        entry_type="AgentDefinition",
        lifecycle=lifecycle,
        prefix=json.dumps({"entryDid": did, "name": name, "tags": ["u"]})[:-1] + ',"sequence":',
        suffix="}",
    )


def _key(key: str) -> IdemKey:
    return IdemKey("did:key:zSearch", "entry.create", key, b"fingerprint")


async def _search_row(url: str, did: str) -> dict[str, object]:
    conn = await trio_asyncio.aio_as_trio(asyncpg.connect)(url)
    try:
        row = await trio_asyncio.aio_as_trio(conn.fetchrow)(
            "SELECT s.head_seq, s.name, s.tags, s.publisher_did, s.lifecycle,"
            " e.head_seq AS entry_head FROM entry_search s JOIN entries e USING (entry_did)"
            " WHERE s.entry_did = $1",
            did,
        )
    finally:
        await trio_asyncio.aio_as_trio(conn.close)()
    assert row is not None
    return dict(row)


async def _rows(url: str, did: str) -> tuple[int, list[str]]:
    """(entries rows, names of entry_search rows) of `did`."""
    conn = await trio_asyncio.aio_as_trio(asyncpg.connect)(url)
    try:
        entries = await trio_asyncio.aio_as_trio(conn.fetchval)(
            "SELECT count(*) FROM entries WHERE entry_did = $1", did
        )
        names = await trio_asyncio.aio_as_trio(conn.fetch)(
            "SELECT name FROM entry_search WHERE entry_did = $1", did
        )
    finally:
        await trio_asyncio.aio_as_trio(conn.close)()
    return int(entries), [r["name"] for r in names]


async def _refusal_under_a_key(store: PgStore) -> tuple[str, str]:
    """A fresh key `tag` whose recorded outcome is a refusal (`entry_exists`: the create of a
    DID that exists, `taken`, whose entry is named "first")."""
    tag = secrets.token_hex(4)
    taken = f"did:web:search.test:{tag}:taken"
    (first,) = await store.append([(_create(taken, "first"), None)])
    first.unwrap()
    (refused,) = await store.append([(_create(taken, "again"), _key(tag))])
    assert refused.refusal is not None
    assert refused.refusal.code == "entry_exists"
    return tag, taken


async def test_the_searchable_row_follows_every_version(database_url: str) -> None:
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        did = f"did:web:search.test:{secrets.token_hex(4)}:versions"
        (created,) = await store.append([(_create(did, "first"), None)])
        assert created.sequence is not None
        row = await _search_row(database_url, did)
        assert row == {
            "head_seq": created.sequence,  # set under the lock, after the staged insert
            "name": "first",
            "tags": ["t"],
            "publisher_did": "did:key:zSearch",
            "lifecycle": "active",
            "entry_head": created.sequence,
        }
        (updated,) = await store.append([(_version(did, "second", created.sequence), None)])
        assert updated.sequence is not None
        row = await _search_row(database_url, did)
        assert (row["head_seq"], row["entry_head"]) == (updated.sequence, updated.sequence)
        assert (row["name"], row["tags"], row["publisher_did"]) == (
            "second",
            ["u"],
            "did:key:zSearch2",
        )
        (deleted,) = await store.append(
            [(_version(did, "second", updated.sequence, "deleted"), None)]
        )
        row = await _search_row(database_url, did)
        assert (row["head_seq"], row["lifecycle"]) == (deleted.sequence, "deleted")
        assert row["name"] == "second"  # a tombstone keeps the projection it had


async def test_a_create_that_is_not_applied_leaves_no_searchable_row(database_url: str) -> None:
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        tag, taken = await _refusal_under_a_key(store)
        # The same key again, now on a new DID: the recorded refusal answers (a replay), and
        # the row staged for the new DID before the lock is gone with it.
        fresh = f"did:web:search.test:{tag}:fresh"
        (replayed,) = await store.append([(_create(fresh, "fresh"), _key(tag))])
        assert replayed.replayed
        assert await _rows(database_url, fresh) == (0, [])
        assert await _rows(database_url, taken) == (1, ["first"])


async def test_a_did_staged_twice_in_one_batch_ends_with_the_applied_version(
    database_url: str,
) -> None:
    async with trio_asyncio.open_loop(), open_pg_store(database_url) as store:
        tag, _ = await _refusal_under_a_key(store)
        did = f"did:web:search.test:{tag}:twice"
        # The first change stages the DID's row and is replayed (so deletes it); the second
        # creates the entry (its row is written under the lock); the third is refused.
        outcomes = await store.append(
            [
                (_create(did, "replayed"), _key(tag)),
                (_create(did, "applied"), None),
                (_create(did, "refused"), None),
            ]
        )
        assert outcomes[0].replayed
        assert outcomes[1].refusal is None
        assert outcomes[1].sequence is not None
        assert outcomes[2].refusal is not None
        assert outcomes[2].refusal.code == "entry_exists"
        assert await _rows(database_url, did) == (1, ["applied"])


async def test_batches_creating_the_same_dids_in_opposite_orders_do_not_deadlock(
    database_url: str,
) -> None:
    """Each DID is created once, by whichever batch stages it first; the other batch waits for
    it before the lock (never under it) and is refused `entry_exists`."""
    tag = secrets.token_hex(4)
    dids = [f"did:web:search.test:{tag}:{i:03d}" for i in range(96)]
    created: list[str] = []
    refused: list[str] = []
    async with trio_asyncio.open_loop(), open_pg_store(database_url, max_size=6) as store:

        async def writer(store: PgStore, order: list[str], w: int) -> None:
            for first in range(0, len(order), 8):
                part = order[first : first + 8]
                batch: list[tuple[Change, IdemKey | None]] = [
                    (_create(did, f"w{w}"), None) for did in part
                ]
                for did, outcome in zip(part, await store.append(batch), strict=True):
                    if outcome.refusal is None:
                        created.append(did)
                    else:
                        assert outcome.refusal.code == "entry_exists"
                        refused.append(did)

        with trio.fail_after(60):  # a deadlock would stall a batch 1 s, then fail it
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer, store, dids, 0)
                nursery.start_soon(writer, store, dids[::-1], 1)
                nursery.start_soon(writer, store, dids[48:] + dids[:48], 2)
        assert sorted(created) == dids  # each once
        assert len(refused) == 2 * len(dids)
        conn = await trio_asyncio.aio_as_trio(asyncpg.connect)(database_url)
        try:
            pattern = f"did:web:search.test:{tag}:%"
            rows = await trio_asyncio.aio_as_trio(conn.fetch)(
                "SELECT e.entry_did, count(s.entry_did) AS n FROM entries e"
                " LEFT JOIN entry_search s"
                "   ON s.entry_did = e.entry_did AND s.head_seq = e.head_seq"
                "  AND s.publisher_did = e.publisher_did AND s.lifecycle = e.lifecycle"
                " WHERE e.entry_did LIKE $1 GROUP BY e.entry_did",
                pattern,
            )
            orphans = await trio_asyncio.aio_as_trio(conn.fetchval)(
                "SELECT count(*) FROM entry_search s WHERE s.entry_did LIKE $1"
                " AND NOT EXISTS (SELECT 1 FROM entries e WHERE e.entry_did = s.entry_did)",
                pattern,
            )
        finally:
            await trio_asyncio.aio_as_trio(conn.close)()
    assert {r["entry_did"]: r["n"] for r in rows} == {did: 1 for did in dids}
    assert orphans == 0
