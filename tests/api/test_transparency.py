"""The verifiable log end to end (issue 20): HTTP in, PostgreSQL and the checkpointer, HTTP out,
every byte checked by code written here from RFC 9162, RFC 8785 (the independent `jcs`
package) and C2SP signed notes, never by the service's own verifier."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import jcs
import nacl.signing
import pytest
import trio

from registry.did import public_key_from_did_key
from registry.keys import SigningKey
from tests.api.api_support import anon_client, error_of
from tests.conftest import Harness, make_config, open_harness
from tests.db.proc import databases
from tests.helpers import bearer, idem, next_version, sign_in, signed_entry
from tests.registry.test_transparency import mth, root_from_path, roots_from_proof


def leaf(record: dict[str, Any]) -> bytes:
    return hashlib.sha256(b"\x00" + jcs.canonicalize(record)).digest()


def parse_checkpoint(note: str, registry_did: str) -> tuple[str, int, bytes]:
    """(origin, size, root) of a checkpoint signed by the registry's key, checked here."""
    body, signatures = note.split("\n\n", 1)
    origin, size, root_b64 = body.split("\n")
    public = public_key_from_did_key(registry_did)
    key_id = hashlib.sha256(origin.encode() + b"\n\x01" + public).digest()[:4]
    lines = signatures.rstrip("\n").split("\n")
    ours = [line for line in lines if line.startswith(f"\u2014 {origin} ")]
    assert len(ours) == 1, note
    blob = base64.b64decode(ours[0].rsplit(" ", 1)[1])
    assert blob[:4] == key_id
    nacl.signing.VerifyKey(public).verify((body + "\n").encode(), blob[4:])
    return origin, int(size), base64.b64decode(root_b64)


async def get_json(h: Harness, path: str) -> Any:
    r = await anon_client(h).get(path)
    assert r.status_code == 200, await r.get_data()
    return await r.get_json()


async def all_records(h: Harness) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    start = 1
    while True:
        page = await get_json(h, f"/v1/log/records?from={start}&limit=2")
        records += page["records"]
        start = page["next"]
        if not page["hasMore"]:
            return records


async def publish(h: Harness) -> tuple[str, list[int]]:
    """An entry created and updated, a sign-out: public and internal records."""
    key = SigningKey.generate()
    token = await sign_in(h.client, key)
    r = await h.client.post("/v1/entries", json=signed_entry(key), headers=bearer(token, **idem()))
    assert r.status_code == 201, await r.get_data()
    created = await r.get_json()
    did = created["entryDid"]
    entry = signed_entry(key, did, sequence=created["sequence"], version=next_version())
    r = await h.client.put(f"/v1/entries/{did}", json=entry, headers=bearer(token, **idem()))
    assert r.status_code == 200, await r.get_data()
    updated = await r.get_json()
    r = await h.client.post("/v1/auth/logout", headers=bearer(token, **idem()))
    assert r.status_code in (200, 204), await r.get_data()
    return did, [created["sequence"], updated["sequence"]]


@pytest.fixture
def fresh_url(database_url: str) -> Iterator[str]:
    """A database of this test's own: its log holds only what the test wrote."""
    with databases(database_url) as new_database:
        yield new_database()


@pytest.fixture
async def fresh(fresh_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in open_harness(make_config(fresh_url, tmp_path)):
        yield h


async def test_the_served_records_hash_to_the_signed_checkpoint_and_every_proof_verifies(
    fresh: Harness,
) -> None:
    h = fresh
    did, sequences = await publish(h)
    with trio.fail_after(10):
        first = await h.service.transparency.checkpointed(await h.store.log_head())
        await publish(h)  # the log grows past that checkpoint
        await h.service.transparency.checkpointed(await h.store.log_head())
    r = await anon_client(h).get("/v1/log/checkpoint")
    assert r.status_code == 200
    assert r.headers["Content-Type"] == "text/plain; charset=utf-8"
    origin, size, root = parse_checkpoint((await r.get_data()).decode(), h.deps.registry_did)
    assert origin == h.deps.registry_did
    assert size == await h.store.log_head()

    records = await all_records(h)
    assert [rec["sequence"] for rec in records] == list(range(1, size + 1))
    assert mth([leaf(rec) for rec in records]) == root

    # Entry records commit to the version documents as served.
    for sequence in sequences:
        [record] = [rec for rec in records if rec["sequence"] == sequence]
        assert record["subject"] == did
        served = await anon_client(h).get(f"/v1/entries/{did}/versions/{sequence}")
        digest = hashlib.sha256(jcs.canonicalize(json.loads(await served.get_data()))).hexdigest()
        assert record["documentHash"] == digest
    # The sign-out is internal: its subject and data are hidden behind their digest.
    revoked = [rec for rec in records if rec["kind"] == "session.revoked"]
    assert len(revoked) == 2
    for record in revoked:
        assert record["subject"] is None
        assert record["data"] is None
        assert len(record["redacted"]) == 64

    # Every inclusion proof leads to the checkpoint's root.
    leaves = [leaf(rec) for rec in records]
    for sequence in range(1, size + 1):
        proof = await get_json(h, f"/v1/log/proof/inclusion?sequence={sequence}&treeSize={size}")
        assert proof["leafIndex"] == sequence - 1
        assert proof["treeSize"] == size
        path = [base64.b64decode(p) for p in proof["proof"]]
        assert root_from_path(sequence - 1, size, leaves[sequence - 1], path) == root

    # The earlier checkpoint is stored, and the log since is consistent with it.
    r = await anon_client(h).get(f"/v1/log/checkpoint?treeSize={first.size}")
    _, old_size, old_root = parse_checkpoint((await r.get_data()).decode(), h.deps.registry_did)
    assert old_size == first.size < size
    proof = await get_json(h, f"/v1/log/proof/consistency?from={old_size}&to={size}")
    assert (proof["from"], proof["to"]) == (old_size, size)
    path = [base64.b64decode(p) for p in proof["proof"]]
    assert roots_from_proof(old_size, size, path, old_root) == (old_root, root)

    # The bundle of one version verifies offline.
    bundle = await get_json(h, f"/v1/entries/{did}/versions/{sequences[1]}/proof")
    _, b_size, b_root = parse_checkpoint(bundle["checkpoint"], h.deps.registry_did)
    assert bundle["record"]["sequence"] == sequences[1]
    assert bundle["proof"]["treeSize"] == b_size
    path = [base64.b64decode(p) for p in bundle["proof"]["proof"]]
    assert root_from_path(sequences[1] - 1, b_size, leaf(bundle["record"]), path) == b_root


async def test_bad_parameters_are_refused_and_sizes_past_the_checkpoint_are_not_found(
    fresh: Harness,
) -> None:
    h = fresh
    did, sequences = await publish(h)
    with trio.fail_after(10):
        latest = await h.service.transparency.checkpointed(await h.store.log_head())
    c = anon_client(h)
    n = latest.size
    cases = [
        ("/v1/log/records?from=0", 400, "invalid_from"),
        ("/v1/log/records?from=x", 400, "invalid_from"),
        ("/v1/log/records?limit=0", 400, "invalid_limit"),
        ("/v1/log/records?from=99999999999999999", 400, "invalid_from"),
        ("/v1/log/checkpoint?treeSize=-1", 400, "invalid_tree_size"),
        # Malformed: the same code as out of range (it was `invalid_treeSize`).
        ("/v1/log/checkpoint?treeSize=x", 400, "invalid_tree_size"),
        ("/v1/log/checkpoint?treeSize=", 400, "invalid_tree_size"),
        ("/v1/log/checkpoint?treeSize=9007199254740992", 400, "invalid_tree_size"),
        ("/v1/log/proof/inclusion?sequence=1&treeSize=1.5", 400, "invalid_tree_size"),
        (f"/v1/log/checkpoint?treeSize={n + 7}", 404, "checkpoint_not_found"),
        ("/v1/log/proof/inclusion", 400, "invalid_sequence"),
        (f"/v1/log/proof/inclusion?sequence={n + 1}&treeSize={n}", 400, "invalid_sequence"),
        ("/v1/log/proof/inclusion?sequence=1&treeSize=0", 400, "invalid_tree_size"),
        (f"/v1/log/proof/inclusion?sequence=1&treeSize={n + 1}", 404, "tree_size_unknown"),
        ("/v1/log/proof/consistency?from=2&to=1", 400, "invalid_tree_size"),
        ("/v1/log/proof/consistency?from=0&to=1", 400, "invalid_tree_size"),
        ("/v1/log/proof/consistency?to=1", 400, "invalid_from"),
        ("/v1/log/proof/consistency?from=1", 400, "invalid_to"),
        # Malformed or beyond ±(2^53-1): a bad tree size, as 0 or from > to is (and as a bad
        # treeSize is); invalid_from/invalid_to only say that one is missing. They were
        # invalid_from/invalid_to, which docs/transparency.md and docs/errors.md keep for that.
        ("/v1/log/proof/consistency?from=x&to=1", 400, "invalid_tree_size"),
        ("/v1/log/proof/consistency?from=1&to=1.5", 400, "invalid_tree_size"),
        ("/v1/log/proof/consistency?from=&to=1", 400, "invalid_tree_size"),
        ("/v1/log/proof/consistency?from=1&to=9007199254740992", 400, "invalid_tree_size"),
        (f"/v1/log/proof/consistency?from=1&to={n + 1}", 404, "tree_size_unknown"),
        (f"/v1/entries/{did}/versions/0/proof", 400, "invalid_sequence"),
        (f"/v1/entries/{did}/versions/{n + 5}/proof", 404, "version_not_found"),
        (f"/v1/entries/did:example:nobody/versions/{sequences[0]}/proof", 404, "entry_not_found"),
    ]
    for path, status, code in cases:
        await error_of(await c.get(path), status, code)
    # Paging is clamped, and `next` is where to ask from (also at the end, to follow the log).
    page = await get_json(h, "/v1/log/records?limit=5000")
    assert len(page["records"]) == n
    assert page["hasMore"] is False
    assert page["next"] == n + 1
    page = await get_json(h, f"/v1/log/records?from={n + 10}")
    assert page == {"records": [], "hasMore": False, "next": n + 10}
    # A proof of the same size from and to is empty.
    assert (await get_json(h, f"/v1/log/proof/consistency?from={n}&to={n}"))["proof"] == []


async def test_a_deleted_entrys_versions_have_no_proof_bundle_as_they_have_no_reads(
    fresh: Harness,
) -> None:
    """After a delete every read of the entry's versions is 404 entry_not_found; its bundles
    still answered 200 (with the version's record). The records stay in the log."""
    h = fresh
    key = SigningKey.generate()
    token = await sign_in(h.client, key)
    r = await h.client.post("/v1/entries", json=signed_entry(key), headers=bearer(token, **idem()))
    assert r.status_code == 201, await r.get_data()
    did, sequence = (await r.get_json())["entryDid"], (await r.get_json())["sequence"]
    with trio.fail_after(10):
        await h.service.transparency.checkpointed(await h.store.log_head())
    c = anon_client(h)
    assert (await c.get(f"/v1/entries/{did}/versions/{sequence}/proof")).status_code == 200
    r = await h.client.delete(f"/v1/entries/{did}", headers=bearer(token, **idem()))
    assert r.status_code == 200, await r.get_data()
    tombstone = await r.get_json()
    with trio.fail_after(10):
        await h.service.transparency.checkpointed(await h.store.log_head())
    for path in (
        f"/v1/entries/{did}/versions/{sequence}",
        f"/v1/entries/{did}/versions/{sequence}/proof",
    ):
        await error_of(await c.get(path), 404, "entry_not_found")
    records = (await get_json(h, "/v1/log/records"))["records"]
    assert [r["subject"] for r in records if r["kind"].startswith("entry.")] == [did, did]
    # The deletion's documentHash is of the tombstone as DELETE answered it (docs/transparency.md):
    # whoever deleted can check it.
    [deleted] = [r for r in records if r["kind"] == "entry.deleted"]
    assert deleted["sequence"] == tombstone["sequence"]
    assert deleted["documentHash"] == hashlib.sha256(jcs.canonicalize(tombstone)).hexdigest()


# --- a peer's cosignature (POST /v1/federation/cosignature) ------------------------------------


async def test_a_peers_cosignature_is_checked_kept_and_served_with_the_checkpoint(
    fresh_url: str, tmp_path: Path
) -> None:
    from registry.config import PeerConfig
    from registry.envelope import build_request
    from registry.transparency import checkpoint_body, cosign
    from registry.usecases.common import now_ms

    witness, stranger = SigningKey.generate(), SigningKey.generate()
    config = make_config(fresh_url, tmp_path)
    peer = PeerConfig(peer_did=witness.did, endpoint="http://127.0.0.1:9/w", kinds=["sync"])
    config = config.model_copy(
        update={"federation": config.federation.model_copy(update={"peers": [peer]})}
    )
    async for h in open_harness(config):
        await publish(h)
        with trio.fail_after(10):
            latest = await h.service.transparency.checkpointed(await h.store.log_head())
        body = latest.note.split("\n\n")[0] + "\n"
        c = anon_client(h)

        async def send(key: SigningKey, payload: Any, h: Harness = h, c: Any = c) -> Any:
            envelope = build_request(
                key,
                kind="cosignature_request",
                recipient_did=h.deps.registry_did,
                payload=payload,
                now_ms=now_ms(),
            )
            return await c.post("/v1/federation/cosignature", json=envelope)

        line = cosign(body, witness.did, witness, 1_800_000_000)
        r = await send(witness, {"treeSize": latest.size, "cosignature": line})
        assert r.status_code == 200, await r.get_data()
        answer = await r.get_json()
        assert answer["kind"] == "cosignature_response"
        assert answer["payload"] == {"accepted": True, "treeSize": latest.size}
        served = (await (await c.get("/v1/log/checkpoint")).get_data()).decode()
        assert served == latest.note + line  # the registry's signature, then the witness's
        other_body = checkpoint_body(h.deps.registry_did, latest.size + 1, bytes(32))
        bad = cosign(other_body, witness.did, witness, 1_800_000_000)
        cases = [
            (witness, {"treeSize": latest.size, "cosignature": bad}, 400, "cosignature_invalid"),
            (
                witness,
                {"treeSize": latest.size + 9, "cosignature": line},
                404,
                "checkpoint_not_found",
            ),
            (witness, {"treeSize": "1", "cosignature": line}, 400, "cosignature_payload_invalid"),
            (
                witness,
                {"treeSize": 1, "cosignature": line, "x": 1},
                400,
                "cosignature_payload_invalid",
            ),
            (stranger, {"treeSize": latest.size, "cosignature": line}, 403, "peer_unknown"),
        ]
        for key, payload, status, code in cases:
            await error_of(await send(key, payload), status, code)
        # a refused cosignature is not served
        again = (await (await c.get("/v1/log/checkpoint")).get_data()).decode()
        assert again == served


@pytest.fixture
async def small_pages(fresh_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    config = make_config(fresh_url, tmp_path, limits={"versions_page_bytes": 2048})
    async for h in open_harness(config):
        yield h


async def test_a_page_of_records_ends_once_the_versions_it_hashed_hold_the_page_bytes(
    small_pages: Harness,
) -> None:
    """Each record of an entry version carries the version's hash, read and hashed per request:
    a page ends (hasMore, `next`) once the versions before its next record hold
    `limits.versions_page_bytes`. Paging on serves every record once, as one big page would."""
    h = small_pages
    for _ in range(3):
        await publish(h)  # two versions and a sign-out each
    pages: list[list[dict[str, Any]]] = []
    start = 1
    while True:
        page = await get_json(h, f"/v1/log/records?from={start}&limit=1000")
        pages.append(page["records"])
        start = page["next"]
        if not page["hasMore"]:
            break
        assert len(pages) < 50
    records = [r for page in pages for r in page]
    assert [r["sequence"] for r in records] == list(range(1, start))  # each once, in order
    assert sum("documentHash" in r for r in records) == 6
    hashed = [sum("documentHash" in r for r in page) for page in pages]
    assert len(pages) > 1
    assert all(n <= 3 for n in hashed), hashed  # versions of ~900 bytes: 3 fit in 2048
