"""Anchoring end to end: HTTP in, the supervisor over PostgreSQL and the local chain, HTTP out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from registry.keys import SigningKey
from registry.merkle import MerkleProof, leaf_hash, verify_proof
from tests.conftest import Harness, make_config, open_harness
from tests.helpers import bearer, idem, sign_in, signed_entry


@pytest.fixture
async def anchored(database_url: str, tmp_path: Path) -> AsyncIterator[tuple[Harness, SigningKey]]:
    admin = SigningKey.generate()
    config = make_config(
        database_url,
        tmp_path,
        auth={"admin_dids": [admin.did]},
        anchoring={"enabled": True, "block_interval_seconds": 0, "finality_depth": 2},
    )
    async for h in open_harness(config):
        yield h, admin


async def _anchors(h: Harness, did: str) -> dict[str, Any]:
    r = await h.client.get(f"/v1/anchors/{did}")
    assert r.status_code == 200, await r.get_data()
    return dict(await r.get_json())


async def test_a_published_entry_is_anchored_with_a_proof_that_verifies(
    anchored: tuple[Harness, SigningKey],
) -> None:
    h, _ = anchored
    head = await h.store.log_head()
    key = SigningKey.generate()
    token = await sign_in(h.client, key)
    entry = signed_entry(key)
    r = await h.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    assert r.status_code == 201
    created = await r.get_json()
    assert created["anchorState"] == "pending"
    did = created["entryDid"]
    with trio.fail_after(10):
        async with h.service.logs.subscribe(head, queue_size=1000) as events:
            while True:
                record = await events.receive()
                if record.kind == "anchor.updated" and record.entry_did == did:
                    assert record.data["state"] == "confirmed"
                    break
    listing = await _anchors(h, did)
    [record] = listing["records"]
    assert record["state"] == "confirmed"
    assert record["operation"] == "create"
    anchor = record["anchor"]
    proof = MerkleProof.from_json(anchor["proof"])
    assert proof.leaf_hash == leaf_hash(did, created["sequence"], created["itemDataHash"])
    assert verify_proof(proof)
    assert (await (await h.client.get(f"/v1/entries/{did}")).get_json())[
        "anchorState"
    ] == "anchored"
