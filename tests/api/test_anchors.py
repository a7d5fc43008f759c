"""GET /v1/anchors/{did} and admin retry / abandon over HTTP, against PostgreSQL (spec 2.2, 2.3,
4.3; design §8, §12).

Two set-ups:

* `anchored`: the service's own supervisor anchors with instant blocks (what `registry serve`
  does), for confirmed intents with proofs.
* `held`: anchoring is on (every version records its intent) but the test holds the anchoring
  leadership, so the service's supervisor waits for the lock and the intents keep their states.
  Where a test needs an intent to be submitted, failed or confirmed it runs the supervisor
  itself, under that leadership, over a local chain it controls (no blocks, dropped
  submissions, instant blocks).

Waits are on the log (`anchor.updated`, `anchor.claimed`), never on the clock.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio_asyncio

from actors.anchoring import AnchoringHandle, run_anchoring
from actors.chain import LocalChainClient
from registry.anchoring import tree_of, verify_anchor
from registry.chain import LocalChain
from registry.changes import LogRecord, rfc3339_ms
from registry.config import AnchoringConfig
from registry.identity import DidKeyIdentity
from registry.keys import SigningKey
from registry.merkle import MerkleProof, leaf_hash, verify_proof
from registry.store.pg import open_pg_store
from registry.usecases.common import now_ms
from registry.usecases.entries import entry_change
from service.wiring import open_service
from tests.api.api_support import anon_client, error_of
from tests.conftest import Harness, make_config, open_harness
from tests.helpers import bearer, idem, sign_in, signed_entry

MAX_PAGE = 3
DEADLINE = 15


# --- set-ups ----------------------------------------------------------------------------------


@pytest.fixture
async def anchored(database_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    config = make_config(
        database_url,
        tmp_path,
        anchoring={"enabled": True, "block_interval_seconds": 0, "finality_depth": 2},
    )
    async for h in open_harness(config):
        yield h


class Held:
    """A harness whose anchoring leadership the test holds, and an admin of it."""

    def __init__(self, h: Harness, admin: SigningKey) -> None:
        self.h = h
        self.client = h.client
        self.admin = admin


@pytest.fixture
async def held(database_url: str, tmp_path: Path) -> AsyncIterator[Held]:
    admin = SigningKey.generate()
    config = make_config(
        database_url,
        tmp_path,
        auth={"admin_dids": [admin.did]},
        anchoring={"enabled": True, "block_interval_seconds": 0, "finality_depth": 1},
        limits={"max_page_size": MAX_PAGE},
    )
    async with (
        trio_asyncio.open_loop(),
        open_pg_store(config.database.url) as store,
        # Taken before the service starts: its supervisor polls for the lock and never leads.
        store.leadership("anchoring"),
        open_service(
            config, store, key=SigningKey.generate(), identity=DidKeyIdentity()
        ) as service,
        service.app.test_app() as test_app,
    ):
        h = Harness(service, test_app.test_client())
        yield Held(h, admin)
        assert not service.anchoring.stats.leader


class _Leading:
    """The harness's store with the leadership already held (by the test): `run_anchoring`
    over it leads at once."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    @asynccontextmanager
    async def leadership(self, name: str) -> AsyncIterator[_Leading]:
        yield self

    async def lost(self) -> None:
        await trio.sleep_forever()


@asynccontextmanager
async def supervising(
    h: Harness, chain: LocalChain, *, instant: bool, **settings: Any
) -> AsyncIterator[AnchoringHandle]:
    """Run the anchoring supervisor over `chain` (under the test's leadership) while inside."""
    handle = AnchoringHandle()
    client = LocalChainClient(chain, instant=instant, clock_ms=now_ms)
    run = partial(
        run_anchoring,
        _Leading(h.store),
        h.service.writer.append,
        client,
        AnchoringConfig(**settings),
        handle=handle,
        clock_ms=now_ms,
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        yield handle
        nursery.cancel_scope.cancel()


# --- helpers ----------------------------------------------------------------------------------


async def wait_for(
    h: Harness, after: int, matches: Callable[[LogRecord], bool], count: int = 1
) -> list[LogRecord]:
    """The first `count` log records after `after` that match."""
    found: list[LogRecord] = []
    with trio.fail_after(DEADLINE):
        async with h.service.logs.subscribe(after, queue_size=100_000) as events:
            while len(found) < count:
                record = await events.receive()
                if matches(record):
                    found.append(record)
    return found


def anchor_update(did: str, state: str) -> Callable[[LogRecord], bool]:
    return lambda r: r.kind == "anchor.updated" and r.entry_did == did and r.data["state"] == state


async def publish(client: Any, key: SigningKey, token: str, versions: int = 1) -> list[dict]:
    """An entry and `versions - 1` updates (each with other itemData): the served versions."""
    r = await client.post("/v1/entries", json=signed_entry(key), headers=bearer(token, **idem()))
    assert r.status_code == 201, await r.get_data()
    served = [await r.get_json()]
    did = served[0]["entryDid"]
    for n in range(1, versions):
        entry = signed_entry(
            key,
            did,
            sequence=served[-1]["sequence"],
            version=f"1.{n}.0",
            itemData={"model": "m-1", "instructions": f"revision {n}"},
        )
        r = await client.put(f"/v1/entries/{did}", json=entry, headers=bearer(token, **idem()))
        assert r.status_code == 200, await r.get_data()
        served.append(await r.get_json())
    return served


async def anchors(client: Any, did: str, query: str = "") -> dict[str, Any]:
    r = await client.get(f"/v1/anchors/{did}{query}")
    assert r.status_code == 200, await r.get_data()
    return dict(await r.get_json())


async def state_of(client: Any, did: str, intent_id: str) -> dict[str, Any]:
    listing = await anchors(client, did, f"?limit={MAX_PAGE}")
    [record] = [r for r in listing["records"] if r["intentId"] == intent_id]
    return dict(record)


async def control(client: Any, token: str | None, intent_id: str, action: str, key: str) -> Any:
    headers = {"Idempotency-Key": key}
    if token is not None:
        headers = bearer(token, **headers)
    return await client.post(f"/v1/admin/anchors/{intent_id}/{action}", headers=headers)


def key() -> str:
    return idem()["Idempotency-Key"]


# --- GET /v1/anchors/{did} ----------------------------------------------------------------------


async def test_versions_are_listed_ascending_each_confirmed_with_a_proof_that_verifies(
    anchored: Harness,
) -> None:
    h = anchored
    publisher = SigningKey.generate()
    token = await sign_in(h.client, publisher)
    head = await h.store.log_head()
    served = await publish(h.client, publisher, token, versions=3)
    did = served[0]["entryDid"]
    confirmed = await wait_for(h, head, anchor_update(did, "confirmed"), count=3)
    assert sorted(e.data["sequence"] for e in confirmed) == [v["sequence"] for v in served]
    for event in confirmed:
        assert event.data["intentId"] == f"ai_{event.data['sequence']}"
        assert event.data["anchorState"] == "anchored"
        assert isinstance(event.data["blockHeight"], int)

    use_case = h.deps.anchors

    async def no_tree(batch_id: int) -> Any:
        raise AssertionError(f"the proofs of batch {batch_id} are stored: read, not built")

    use_case._tree = no_tree  # type: ignore[method-assign]
    try:
        listing = await anchors(h.client, did)
    finally:
        del use_case._tree
    # A stored tree that does not lead to the root (never expected) is not served from: the
    # proofs come from the batch's members, the same ones.
    execute = trio_asyncio.aio_as_trio(h.store._pool.execute)  # type: ignore[attr-defined]
    await execute(
        "UPDATE anchor_trees SET levels = decode(repeat('00', octet_length(levels)), 'hex')"
        " WHERE batch_id IN (SELECT batch_id FROM anchor_receipts"
        " WHERE intent_id = ANY($1::text[]))",
        [f"ai_{v['sequence']}" for v in served],
    )
    assert await anchors(h.client, did) == listing
    # A batch submitted before its tree was stored (migration 0025) is served from its
    # members: the same proofs.
    await execute(
        "DELETE FROM anchor_trees WHERE batch_id IN (SELECT batch_id FROM anchor_receipts"
        " WHERE intent_id = ANY($1::text[]))",
        [f"ai_{v['sequence']}" for v in served],
    )
    assert await anchors(h.client, did) == listing
    # The leader's backfill of such batches (actors/anchoring.py) finds them, and the trees it
    # stores serve the same proofs, read again without a rebuild.
    ids = {int(r["receipts"][0]["receiptKey"].removeprefix("batch-")) for r in listing["records"]}
    found = {b: root for b, root in await h.store.batches_without_tree(0, 1_000) if b in ids}
    assert set(found) == ids
    for batch_id, root in found.items():
        tree = tree_of(await h.store.anchor_batch_members(batch_id))
        assert tree.root == root
        await h.store.store_anchor_tree(batch_id, tree.packed_levels(), len(tree))
    assert not {b for b, _ in await h.store.batches_without_tree(0, 1_000)} & ids
    use_case._tree = no_tree  # type: ignore[method-assign]
    try:
        assert await anchors(h.client, did) == listing
    finally:
        del use_case._tree
    assert listing["entryDid"] == did
    assert listing["anchorState"] == "anchored"
    assert listing["hasMore"] is False
    assert "cursor" not in listing
    records = listing["records"]
    keys = [(r["sequence"], r["createdAt"], r["intentId"]) for r in records]
    assert keys == sorted(keys)
    assert [r["sequence"] for r in records] == [v["sequence"] for v in served]
    assert [r["operation"] for r in records] == ["create", "update", "update"]
    for record, version in zip(records, served, strict=True):
        assert record["intentId"] == f"ai_{version['sequence']}"
        assert record["entryDid"] == did
        assert record["state"] == "confirmed"
        assert record["attempts"] == 1
        [receipt] = record["receipts"]
        assert receipt["state"] == "confirmed"
        assert receipt["receiptKey"].startswith("batch-")
        anchor = record["anchor"]
        assert set(anchor) == {
            "entryDid",
            "itemDataHash",
            "blockHeight",
            "txHash",
            "anchorTime",
            "proof",
        }
        assert anchor["entryDid"] == did
        assert anchor["itemDataHash"] == version["itemDataHash"]
        assert anchor["blockHeight"] == receipt["blockHeight"] >= 1
        assert anchor["txHash"] == receipt["transactionId"] == record["transactionId"]
        assert anchor["anchorTime"] == receipt["anchorTime"]
        assert anchor["proof"] == receipt["proof"]
        proof = MerkleProof.from_json(anchor["proof"])
        leaf = leaf_hash(did, version["sequence"], version["itemDataHash"])
        assert proof.leaf_hash == leaf
        assert verify_proof(proof, leaf)
        # The independent check from the served version alone (docs/anchoring.md).
        r = await h.client.get(f"/v1/entries/{did}/versions/{version['sequence']}")
        assert verify_anchor(await r.get_json(), anchor, None).ok
    # The versions' itemData differ, so their leaves do.
    assert len({r["anchor"]["proof"]["leafHash"] for r in records}) == 3
    entry = await (await h.client.get(f"/v1/entries/{did}")).get_json()
    assert entry["anchorState"] == "anchored"
    # Every version reads the same wherever it is served: the list and each version too.
    listed = await (await h.client.get(f"/v1/entries/{did}/versions")).get_json()
    assert [v["anchorState"] for v in listed["versions"]] == ["anchored"] * 3
    assert listed["versions"][0] == entry
    for shown in listed["versions"]:
        r = await h.client.get(f"/v1/entries/{did}/versions/{shown['sequence']}")
        assert await r.get_json() == shown

    # Delete writes a tombstone version, which records (and anchors) a `delete` intent; the
    # entry then reads 404 everywhere, the anchors listing included (spec 4.3: 404 entry not
    # found; docs/anchoring.md), so that intent and the earlier proofs are no longer listed.
    head = await h.store.log_head()
    r = await h.client.delete(f"/v1/entries/{did}", headers=bearer(token, **idem()))
    assert r.status_code == 200, await r.get_data()
    tombstone = await r.get_json()
    [event] = await wait_for(h, head, anchor_update(did, "confirmed"))
    assert event.data["sequence"] == tombstone["sequence"]
    # The tombstone has no itemData: the deletion's leaf carries the itemDataHash of the
    # version it deleted, at the tombstone's sequence (docs/anchoring.md).
    fetchval = trio_asyncio.aio_as_trio(h.store._pool.fetchval)  # type: ignore[attr-defined]
    deleted = await fetchval(
        "SELECT item_data_hash FROM anchor_intents WHERE intent_id = $1 AND operation = 'delete'",
        f"ai_{tombstone['sequence']}",
    )
    assert deleted == served[-1]["itemDataHash"]
    await error_of(await h.client.get(f"/v1/anchors/{did}"), 404, "entry_not_found")


async def test_an_unknown_entry_is_404(harness: Harness) -> None:
    r = await anon_client(harness).get("/v1/anchors/did:web:nobody.example.com:nothing")
    await error_of(r, 404, "entry_not_found")


async def test_with_anchoring_off_versions_record_no_intent(harness: Harness) -> None:
    """`[anchoring] enabled = false` (the default of these tests): a version records no
    intent, so the entry lists no records and reads `unanchored` (docs/anchoring.md)."""
    publisher = SigningKey.generate()
    token = await sign_in(harness.client, publisher)
    [version] = await publish(harness.client, publisher, token)
    assert version["anchorState"] == "unanchored"
    listing = await anchors(harness.client, version["entryDid"])
    assert listing == {
        "anchorState": "unanchored",
        "entryDid": version["entryDid"],
        "hasMore": False,
        "records": [],
    }


async def test_pages_are_clamped_and_cursors_cover_every_record_once(held: Held) -> None:
    client = held.client
    publisher = SigningKey.generate()
    token = await sign_in(client, publisher)
    served = await publish(client, publisher, token, versions=5)
    did = served[0]["entryDid"]
    sequences = [v["sequence"] for v in served]

    # No limit: the default page size (lowered to the maximum); a large limit: clamped.
    for query in ("", "?limit=1000", f"?limit={MAX_PAGE}"):
        listing = await anchors(client, did, query)
        assert [r["sequence"] for r in listing["records"]] == sequences[:MAX_PAGE]
        assert listing["hasMore"] is True
        assert listing["anchorState"] == "pending"
        for record in listing["records"]:
            assert record["state"] == "pending"
            assert record["attempts"] == 0
            assert record["receipts"] == []
            assert "anchor" not in record
            assert "transactionId" not in record

    for limit in (1, 2, 3):
        seen: list[int] = []
        cursor: str | None = None
        pages = 0
        while True:
            query = f"?limit={limit}" + (f"&cursor={cursor}" if cursor else "")
            listing = await anchors(client, did, query)
            pages += 1
            seen += [r["sequence"] for r in listing["records"]]
            if not listing["hasMore"]:
                assert "cursor" not in listing
                break
            cursor = listing["cursor"]
            assert isinstance(cursor, str)
            assert 1 <= len(cursor) <= 2048
            assert cursor.replace("-", "").replace("_", "").isalnum()
        assert seen == sequences, limit
        assert pages == -(-len(sequences) // limit)


async def test_a_limit_below_one_or_not_an_integer_is_400(held: Held) -> None:
    client = held.client
    publisher = SigningKey.generate()
    token = await sign_in(client, publisher)
    [version] = await publish(client, publisher, token)
    did = version["entryDid"]
    for limit in ("0", "-1"):
        r = await client.get(f"/v1/anchors/{did}?limit={limit}")
        await error_of(r, 400, "invalid_limit")
    r = await client.get(f"/v1/anchors/{did}?limit=ten")
    await error_of(r, 400, "invalid_limit")
    r = await client.get(f"/v1/anchors/{did}?limit={2**63 - 1}")  # int64: clamped (spec 4.3)
    assert r.status_code == 200, await r.get_data()


async def test_cursors_not_issued_for_this_entry_are_400(held: Held) -> None:
    client = held.client
    publisher = SigningKey.generate()
    token = await sign_in(client, publisher)
    first = (await publish(client, publisher, token, versions=2))[0]["entryDid"]
    second = (await publish(client, publisher, token, versions=2))[0]["entryDid"]
    cursor = (await anchors(client, first, "?limit=1"))["cursor"]
    assert (await anchors(client, first, f"?limit=1&cursor={cursor}"))["records"]

    async def refused(did: str, raw: str) -> None:
        r = await client.get(f"/v1/anchors/{did}", query_string={"cursor": raw})
        await error_of(r, 400, "invalid_cursor")

    # Another entry's cursor: bound to the entry it was issued for.
    await refused(second, cursor)
    # Tampered: every single-character change, anywhere in it, is refused.
    for i in range(len(cursor)):
        flipped = "A" if cursor[i] != "A" else "B"
        await refused(first, cursor[:i] + flipped + cursor[i + 1 :])
    await refused(first, cursor[:-1])
    await refused(first, cursor + "A")
    # Forged: a well-formed cursor naming a position, without the server's tag.
    body = f'["{first}",1,0,"ai_1"]'.encode()
    await refused(first, base64.urlsafe_b64encode(bytes(16) + body).rstrip(b"=").decode())
    # Outside ^[A-Za-z0-9_-]+$ (length 1 to 2048), even when the rest is the valid cursor.
    for bad in ("", "=", cursor + "=", cursor + "\n", cursor + " ", cursor + ".", "a/b", "é"):
        await refused(first, bad)
    await refused(first, "A" * 2049)
    await refused(first, cursor + "A" * (2049 - len(cursor)))


async def test_a_cursor_with_a_trailing_newline_is_400(held: Held) -> None:
    """`$` of a regular expression also matches before a final newline, and the base64 decoder
    skips a newline: a cursor of a length that needs no padding, plus "\n", must still be
    refused (spec 4.3: ^[A-Za-z0-9_-]+$)."""
    client = held.client
    publisher = SigningKey.generate()
    token = await sign_in(client, publisher)
    cursors: dict[str, str] = {}
    for n in range(6):  # DIDs of six consecutive lengths: cursors of every length mod 4
        did = f"did:web:newline.example.com:{'x' * n}{secrets.token_hex(4)}"
        r = await client.post(
            "/v1/entries", json=signed_entry(publisher, did), headers=bearer(token, **idem())
        )
        assert r.status_code == 201, await r.get_data()
        seq = (await r.get_json())["sequence"]
        entry = signed_entry(publisher, did, sequence=seq, version="1.1.0", name="next")
        r = await client.put(f"/v1/entries/{did}", json=entry, headers=bearer(token, **idem()))
        assert r.status_code == 200, await r.get_data()
        cursors[did] = (await anchors(client, did, "?limit=1"))["cursor"]
    assert any(len(c) % 4 == 0 for c in cursors.values())
    for did, cursor in cursors.items():
        r = await client.get(f"/v1/anchors/{did}", query_string={"cursor": cursor + "\n"})
        await error_of(r, 400, "invalid_cursor")


async def test_a_batch_larger_than_a_read_page_serves_proofs_that_verify(held: Held) -> None:
    """A batch of more members than the store reads per round trip (5,000) and than the
    use-case builds inline (2,048): its members are read in pages and its tree is built off the
    event loop; the first, a middle and the last leaf's proofs lead to the one root."""
    h = held.h
    count = 5_003
    tag = secrets.token_hex(4)
    dids = [f"did:web:large.example.com:{tag}:{n}" for n in range(count)]
    hashes = [hashlib.sha256(f"item {tag} {n}".encode()).hexdigest() for n in range(count)]
    changes = [
        entry_change(
            "entry.created",
            did=did,
            expected_head=None,
            publisher="did:key:zLargeBatch",
            entry_type="AgentDefinition",
            lifecycle="active",
            prefix=f'{{"entryDid":"{did}","sequence":',
            suffix="}",
            item_data_hash=item_hash,
        )
        for did, item_hash in zip(dids, hashes, strict=True)
    ]
    head = await h.store.log_head()
    # In the writer's batches (at most 64 changes): one append of 5,003 took ~23 s, near the
    # statement timeout on a loaded machine (the bulk path's key lookups re-sort the batch's
    # DIDs for every change; a writer's batch never holds more than 64).
    outcomes = []
    for start in range(0, count, 64):
        outcomes += await h.store.append([(c, None) for c in changes[start : start + 64]])
    sequences = [o.sequence for o in outcomes]
    assert all(s is not None for s in sequences)
    chain = LocalChain()
    async with supervising(h, chain, instant=True, finality_depth=1, batch_size=100_000):
        await wait_for(h, head, anchor_update(dids[-1], "confirmed"))
    roots = set()
    for n in (0, 2_500, count - 1):
        [record] = (await anchors(held.client, dids[n]))["records"]
        assert record["state"] == "confirmed"
        anchor = record["anchor"]
        proof = MerkleProof.from_json(anchor["proof"])
        assert verify_proof(proof, leaf_hash(dids[n], sequences[n], hashes[n]))
        # The root the supervisor submitted (from the batch as claimed) is the proofs' root.
        assert chain.block_roots(anchor["blockHeight"]) == [proof.root]
        # A batch of 4,097 to 8,192 leaves: 13 levels for each of its first 4,096 leaves (a few
        # intents pending from earlier tests may come first); the last leaf is promoted past the
        # levels where it has no sibling.
        assert len(proof.path) == 13 or n == count - 1
        assert len(proof.path) <= 13
        roots.add(proof.root)
    assert len(roots) == 1


def docs_jcs(value: Any) -> bytes:
    """JCS of the simple documents hashed here (ASCII strings, small integers, objects)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def docs_root(leaf: str, path: list[dict[str, Any]]) -> str:
    """The root a served path leads to, from docs/anchoring.md alone: a node is SHA-256 of the
    UTF-8 bytes of the left hex string followed by the right one (`left`: the sibling first)."""
    node = leaf
    for step in path:
        assert set(step) == {"hash", "direction"}, step
        assert re.fullmatch("[0-9a-f]{64}", step["hash"]), step
        assert step["direction"] in ("left", "right"), step
        pair = step["hash"] + node if step["direction"] == "left" else node + step["hash"]
        node = hashlib.sha256(pair.encode("utf-8")).hexdigest()
    return node


async def test_every_served_proof_verifies_by_the_documented_bytes_alone(held: Held) -> None:
    """Seven versions of three entries in batches of three (odd and one-leaf batches): every
    proof served, in the listing and its receipts, page by page, is checked without the
    project's code: the version's itemDataHash, its leaf, its path to the root, and that root in
    the block the anchor names, once."""
    h, client = held.h, held.client
    publisher = SigningKey.generate()
    token = await sign_in(client, publisher)
    head = await h.store.log_head()
    served = [
        *await publish(client, publisher, token, versions=3),
        *await publish(client, publisher, token, versions=3),
        *await publish(client, publisher, token),
    ]
    dids = {v["entryDid"] for v in served}
    chain = LocalChain()
    async with supervising(h, chain, instant=True, finality_depth=1, batch_size=3):
        await wait_for(
            h,
            head,
            lambda r: (
                r.kind == "anchor.updated"
                and r.entry_did in dids
                and r.data["state"] == "confirmed"
            ),
            count=len(served),
        )
    checked = 0
    for did in sorted(dids):
        records: list[dict[str, Any]] = []
        page = await anchors(client, did)
        records += page["records"]
        while page["hasMore"]:
            page = await anchors(client, did, f"?cursor={page['cursor']}")
            records += page["records"]
        assert [r["sequence"] for r in records] == [
            v["sequence"] for v in served if v["entryDid"] == did
        ]
        for record in records:
            r = await client.get(f"/v1/entries/{did}/versions/{record['sequence']}")
            version = await r.get_json()
            item_hash = hashlib.sha256(docs_jcs(version["itemData"])).hexdigest()
            anchor = record["anchor"]
            assert anchor["itemDataHash"] == version["itemDataHash"] == item_hash
            leaf = hashlib.sha256(
                docs_jcs(
                    {"entryDid": did, "itemDataHash": item_hash, "sequence": version["sequence"]}
                )
            ).hexdigest()
            proof = anchor["proof"]
            assert set(proof) == {"root", "path", "leafHash"}
            assert proof["leafHash"] == leaf
            assert docs_root(leaf, proof["path"]) == proof["root"]
            assert chain.block_roots(anchor["blockHeight"]).count(proof["root"]) == 1
            [receipt] = [x for x in record["receipts"] if x["state"] == "confirmed"]
            assert receipt["proof"] == proof
            checked += 1
    assert checked == len(served)


# --- admin retry / abandon --------------------------------------------------------------------


async def test_control_needs_a_session_and_the_admin_capability(held: Held) -> None:
    client = held.client
    publisher = SigningKey.generate()
    token = await sign_in(client, publisher)
    [version] = await publish(client, publisher, token)
    intent = f"ai_{version['sequence']}"
    anonymous = anon_client(held.h)
    for action in ("retry", "abandon"):
        r = await control(anonymous, None, intent, action, key())
        await error_of(r, 401, "session_missing")
        r = await control(anonymous, "not-a-session", intent, action, key())
        await error_of(r, 401, "session_invalid")
        # Signed in without `admin`: 403, also for an intent that does not exist.
        for target in (intent, "ai_999999999999"):
            r = await control(anonymous, token, target, action, key())
            error = await error_of(r, 403, "capability_missing")
            assert error["details"] == {"capability": "admin"}
    assert (await state_of(client, version["entryDid"], intent))["state"] == "pending"


async def test_control_of_an_unknown_intent_is_404(held: Held) -> None:
    token = await sign_in(held.client, held.admin)
    for action in ("retry", "abandon"):
        for intent in ("ai_999999999999", "nonsense"):
            r = await control(held.client, token, intent, action, key())
            error = await error_of(r, 404, "intent_not_found")
            assert error["details"] == {"intentId": intent}


async def test_abandon_and_retry_a_pending_intent_with_their_events(held: Held) -> None:
    h, client = held.h, held.client
    publisher = SigningKey.generate()
    publisher_token = await sign_in(client, publisher)
    [version] = await publish(client, publisher, publisher_token)
    did, sequence = version["entryDid"], version["sequence"]
    intent = f"ai_{sequence}"
    token = await sign_in(client, held.admin)

    # pending: retry is refused, abandon is allowed.
    r = await control(client, token, intent, "retry", key())
    error = await error_of(r, 409, "intent_state_conflict")
    assert error["details"] == {
        "intentId": intent,
        "state": "pending",
        "allowedFrom": ["abandoned", "failed"],
    }
    head = await h.store.log_head()
    abandon_key = key()
    r = await control(client, token, intent, "abandon", abandon_key)
    assert r.status_code == 200, await r.get_data()
    # Compact, in JCS order, as every other body (it was PostgreSQL's jsonb text).
    answer = b'{"intentId":"' + intent.encode() + b'","state":"abandoned"}'
    assert await r.get_data() == answer
    assert r.headers.get("Idempotent-Replayed") is None
    [event] = await wait_for(h, head, lambda e: e.kind == "anchor.updated")
    assert event.entry_did == did
    assert event.data == {
        "intentId": intent,
        "sequence": sequence,
        "state": "abandoned",
        "anchorState": "abandoned",
        "by": held.admin.did,
    }
    assert (await state_of(client, did, intent))["state"] == "abandoned"
    assert (await anchors(client, did))["anchorState"] == "abandoned"
    entry = await (await client.get(f"/v1/entries/{did}")).get_json()
    assert entry["anchorState"] == "abandoned"

    # The same key and request again: the recorded answer, no second change or event.
    after = await h.store.log_head()
    r = await control(client, token, intent, "abandon", abandon_key)
    assert r.status_code == 200
    assert await r.get_data() == answer
    assert r.headers.get("Idempotent-Replayed") == "true"
    assert await h.store.log_head() == after
    # The same key for another intent: a different request.
    [other] = await publish(client, publisher, publisher_token)
    r = await control(client, token, f"ai_{other['sequence']}", "abandon", abandon_key)
    await error_of(r, 409, "idempotency_conflict")
    assert (await state_of(client, other["entryDid"], f"ai_{other['sequence']}"))[
        "state"
    ] == "pending"

    # abandoned: abandon again is refused (a new key), retry requeues.
    r = await control(client, token, intent, "abandon", key())
    error = await error_of(r, 409, "intent_state_conflict")
    assert error["details"]["state"] == "abandoned"
    assert error["details"]["allowedFrom"] == ["failed", "pending", "submitted"]
    head = await h.store.log_head()
    retry_key = key()
    r = await control(client, token, intent, "retry", retry_key)
    assert r.status_code == 200, await r.get_data()
    assert await r.get_json() == {"intentId": intent, "state": "pending"}
    [event] = await wait_for(h, head, lambda e: e.kind == "anchor.updated")
    assert event.data == {
        "intentId": intent,
        "sequence": sequence,
        "state": "pending",
        "anchorState": "pending",
        "by": held.admin.did,
    }
    record = await state_of(client, did, intent)
    assert record["state"] == "pending"
    assert record["attempts"] == 0
    entry = await (await client.get(f"/v1/entries/{did}")).get_json()
    assert entry["anchorState"] == "pending"
    # A replay of the retry stands although retry is no longer allowed from `pending`.
    r = await control(client, token, intent, "retry", retry_key)
    assert r.status_code == 200
    assert r.headers.get("Idempotent-Replayed") == "true"
    # A refusal is recorded under its key too, and replayed as such.
    conflict_key = key()
    r = await control(client, token, intent, "retry", conflict_key)
    await error_of(r, 409, "intent_state_conflict")
    r = await control(client, token, intent, "retry", conflict_key)
    await error_of(r, 409, "intent_state_conflict")
    assert r.headers.get("Idempotent-Replayed") == "true"
    # The retry and abandon operations keep their keys apart.
    r = await control(client, token, intent, "abandon", retry_key)
    assert r.status_code == 200, await r.get_data()
    assert r.headers.get("Idempotent-Replayed") is None


async def test_a_submitted_intent_can_be_abandoned_but_not_retried(held: Held) -> None:
    h, client = held.h, held.client
    publisher = SigningKey.generate()
    publisher_token = await sign_in(client, publisher)
    head = await h.store.log_head()
    [kept, dropped] = [(await publish(client, publisher, publisher_token))[0] for _ in range(2)]
    token = await sign_in(client, held.admin)
    chain = LocalChain()
    # No blocks until the test seals them: the batch stays submitted.
    async with supervising(h, chain, instant=False, block_interval_seconds=3600, finality_depth=1):
        while True:
            await wait_for(h, head, lambda e: e.kind == "anchor.claimed")
            head = await h.store.log_head()
            if (await state_of(client, dropped["entryDid"], f"ai_{dropped['sequence']}"))[
                "state"
            ] == "submitted":
                break
        intent = f"ai_{dropped['sequence']}"
        record = await state_of(client, dropped["entryDid"], intent)
        assert record["attempts"] == 1
        [receipt] = record["receipts"]
        assert receipt["state"] == "submitted"
        assert receipt["proof"] is None
        # Spec 2.3 types blockHeight an integer and spec 2 omits absent fields: not in a block
        # yet, it is left out (it was null); the transaction, once sent, is a string.
        assert "blockHeight" not in receipt, receipt
        assert isinstance(receipt.get("transactionId", ""), str), receipt
        from api.openapi import document_schemas  # the published schema says the same

        assert set(document_schemas()["AnchorReceipt"]["required"]) <= set(receipt)
        r = await control(client, token, intent, "retry", key())
        error = await error_of(r, 409, "intent_state_conflict")
        assert error["details"]["state"] == "submitted"
        head = await h.store.log_head()
        r = await control(client, token, intent, "abandon", key())
        assert r.status_code == 200, await r.get_data()
        assert await r.get_json() == {"intentId": intent, "state": "abandoned"}
        # The batch settles without the abandoned intent.
        chain.produce_block(now_ms())
        await wait_for(h, head, anchor_update(kept["entryDid"], "confirmed"))
    record = await state_of(client, dropped["entryDid"], intent)
    assert record["state"] == "abandoned"
    assert "anchor" not in record
    assert (await anchors(client, dropped["entryDid"]))["anchorState"] == "abandoned"
    assert (await anchors(client, kept["entryDid"]))["anchorState"] == "anchored"


async def test_a_failed_intent_is_retried_and_then_anchored(held: Held) -> None:
    h, client = held.h, held.client
    publisher = SigningKey.generate()
    publisher_token = await sign_in(client, publisher)
    head = await h.store.log_head()
    [version] = await publish(client, publisher, publisher_token)
    did, intent = version["entryDid"], f"ai_{version['sequence']}"
    token = await sign_in(client, held.admin)

    # Every submission is dropped and one attempt is all there is: failed.
    dropping = LocalChain()
    dropping.drop_next(1_000)
    async with supervising(h, dropping, instant=True, max_attempts=1, finality_depth=1):
        [event] = await wait_for(h, head, anchor_update(did, "failed"))
    assert event.data["anchorState"] == "failed"
    record = await state_of(client, did, intent)
    assert record["state"] == "failed"
    assert record["attempts"] == 1
    assert [r["state"] for r in record["receipts"]] == ["dropped"]
    assert (await anchors(client, did))["anchorState"] == "failed"

    # failed → abandoned → pending again (both allowed from there).
    r = await control(client, token, intent, "abandon", key())
    assert r.status_code == 200, await r.get_data()
    r = await control(client, token, intent, "retry", key())
    assert await r.get_json() == {"intentId": intent, "state": "pending"}
    assert (await state_of(client, did, intent))["attempts"] == 0

    # Requeued: anchored on the next run, with a second receipt.
    head = await h.store.log_head()
    async with supervising(h, LocalChain(), instant=True, finality_depth=2):
        await wait_for(h, head, anchor_update(did, "confirmed"))
    record = await state_of(client, did, intent)
    assert record["state"] == "confirmed"
    assert record["attempts"] == 1
    assert [r["state"] for r in record["receipts"]] == ["dropped", "confirmed"]
    assert record["receipts"][0]["proof"] is None
    assert record["transactionId"] == record["receipts"][1]["transactionId"]
    assert record["anchor"]["txHash"] == record["receipts"][1]["transactionId"]
    proof = MerkleProof.from_json(record["anchor"]["proof"])
    assert verify_proof(proof, leaf_hash(did, version["sequence"], version["itemDataHash"]))

    # confirmed is final: neither action is allowed.
    for action in ("retry", "abandon"):
        r = await control(client, token, intent, action, key())
        error = await error_of(r, 409, "intent_state_conflict")
        assert error["details"]["state"] == "confirmed"
    assert (await anchors(client, did))["anchorState"] == "anchored"


async def test_the_overview_shows_the_backlog_then_the_confirmed_batch(held: Held) -> None:
    h, client = held.h, held.client
    publisher = SigningKey.generate()
    publisher_token = await sign_in(client, publisher)
    head = await h.store.log_head()
    [version] = await publish(client, publisher, publisher_token)
    did = version["entryDid"]
    admin = bearer(await sign_in(client, held.admin))

    async def anchoring() -> dict[str, Any]:
        r = await client.get("/v1/admin/overview", headers=admin)
        assert r.status_code == 200
        return dict((await r.get_json())["anchoring"])

    published = rfc3339_ms(now_ms())
    before = await anchoring()
    assert before["enabled"] is True
    assert before["pending"] >= 1  # ours waits: the test holds the leadership
    assert before["oldestPendingAt"] <= published
    async with supervising(h, LocalChain(), instant=True, finality_depth=1):
        await wait_for(h, head, anchor_update(did, "confirmed"))
    after = await anchoring()
    newest = after["recentBatches"][0]
    assert newest["state"] == "confirmed"
    assert newest["intents"] >= 1
    assert {"transactionId", "blockHeight", "anchorTime"} <= set(newest)
    assert after["batchesInFlight"] == 0


async def test_the_entrys_etag_changes_when_its_anchor_state_does(
    held: Held, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET serves the current anchorState without a new version: the tag must change with it
    (RFC 9110 §8.8.3), or a revalidation keeps the stale `pending` (it was `"s<sequence>"`
    throughout, and If-None-Match answered 304)."""
    h, client = held.h, held.client
    publisher = SigningKey.generate()
    token = await sign_in(client, publisher)
    head = await h.store.log_head()
    [version] = await publish(client, publisher, token)
    did = version["entryDid"]
    r = await client.get(f"/v1/entries/{did}")
    pending_tag = r.headers["ETag"]
    assert ((await r.get_json())["anchorState"], pending_tag) == (
        "pending",
        f'"s{version["sequence"]}"',
    )
    async with supervising(h, LocalChain(), instant=True, finality_depth=1):
        await wait_for(h, head, anchor_update(did, "confirmed"))
    r = await client.get(f"/v1/entries/{did}", headers={"If-None-Match": pending_tag})
    assert r.status_code == 200, r.headers
    assert (await r.get_json())["anchorState"] == "anchored"
    anchored_tag = r.headers["ETag"]
    assert anchored_tag.startswith(f'"s{version["sequence"]}-')
    r = await client.get(f"/v1/entries/{did}", headers={"If-None-Match": anchored_tag})
    assert r.status_code == 304
    # The tag is a digest of the body (up to 1 MiB): made once per served text, not per GET.
    import types

    import api.entries

    hashed: list[int] = []

    def counting(data: bytes = b"") -> Any:
        hashed.append(len(data))
        return hashlib.sha256(data)

    monkeypatch.setattr(api.entries, "hashlib", types.SimpleNamespace(sha256=counting))
    for _ in range(10):
        r = await client.get(f"/v1/entries/{did}", headers={"If-None-Match": anchored_tag})
        assert r.status_code == 304
    assert len(hashed) <= 1, hashed


async def test_deep_health_says_when_the_anchoring_backlog_is_old(
    held: Held, database_url: str
) -> None:
    """design §11: deep health checks the anchoring backlog. An intent that waited over 600 s
    for a batch (the RegistryAnchoringBacklog alert's bound) degrades it; anchored, it is ok."""
    from tests.db.proc import query

    h, client = held.h, held.client
    publisher = SigningKey.generate()
    head = await h.store.log_head()
    [version] = await publish(client, publisher, await sign_in(client, publisher))
    admin = bearer(await sign_in(client, held.admin))

    async def deep() -> dict[str, Any]:
        r = await client.get("/v1/health/deep", headers=admin)
        assert r.status_code == 200, await r.get_data()
        return dict(await r.get_json())

    # Every queued intent (ours, and any other test's left in this database) is 11 minutes old.
    await trio.to_thread.run_sync(
        query,
        database_url,
        "UPDATE anchor_intents SET created_at = created_at - interval '11 minutes'"
        " WHERE intent_id IN (SELECT intent_id FROM anchor_queue)",
    )
    body = await deep()
    assert body["checks"]["anchoring"].startswith("degraded: the oldest of "), body
    assert body["status"] == "degraded"
    async with supervising(h, LocalChain(), instant=True, finality_depth=1):
        await wait_for(h, head, anchor_update(version["entryDid"], "confirmed"))
        while (await h.store.anchoring_overview(0)).pending:  # the others' too
            await wait_for(h, await h.store.log_head(), lambda r: r.kind == "anchor.updated")
    assert (await deep())["checks"]["anchoring"] == "ok"
