"""End to end through HTTP and PostgreSQL: the trust and ownership flows in one pass each."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from registry.entries import sign_entry
from registry.keys import SigningKey
from registry.trust import sign_offer
from registry.vc import issue_credential
from tests.conftest import Harness, make_config, open_harness
from tests.helpers import bearer, idem, sign_in, signed_entry


@pytest.fixture
async def admin_harness(
    database_url: str, tmp_path: Path
) -> AsyncIterator[tuple[Harness, SigningKey]]:
    admin = SigningKey.generate()
    config = make_config(database_url, tmp_path, auth={"admin_dids": [admin.did]})
    async for h in open_harness(config):
        yield h, admin


async def _publish(h: Harness, key: SigningKey, token: str) -> dict[str, Any]:
    entry = signed_entry(key)
    r = await h.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    assert r.status_code == 201, await r.get_data()
    return dict(await r.get_json())


async def test_attestation_report_bond_and_transfer_flows(
    admin_harness: tuple[Harness, SigningKey],
) -> None:
    h, admin = admin_harness
    c = h.client
    owner, issuer, recipient = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    owner_t, issuer_t, recipient_t, admin_t = [
        await sign_in(c, k) for k in (owner, issuer, recipient, admin)
    ]
    entry = await _publish(h, owner, owner_t)
    did = entry["entryDid"]

    # Attestation: verified, stored, shown on the entry.
    now = datetime.now(UTC)
    vc = issue_credential(issuer, subject_id=did, valid_until=now + timedelta(days=1))
    r = await c.post(
        "/v1/attestations",
        json={"attestation": vc, "entryDid": did},
        headers=bearer(issuer_t, **idem()),
    )
    assert r.status_code == 201, await r.get_data()
    att = await r.get_json()
    shown = await (await c.get(f"/v1/entries/{did}")).get_json()
    assert [a["attestationId"] for a in shown["verifiableAttestations"]] == [att["attestationId"]]
    r = await c.post(
        f"/v1/attestations/{att['attestationId']}/revoke", headers=bearer(issuer_t, **idem())
    )
    assert r.status_code == 200, await r.get_data()
    assert "verifiableAttestations" not in await (await c.get(f"/v1/entries/{did}")).get_json()

    # Report, bond, uphold with a slash.
    r = await c.post(
        "/v1/report", json={"entryDid": did, "reason": "spam"}, headers=bearer(issuer_t, **idem())
    )
    assert r.status_code == 201, await r.get_data()
    report = await r.get_json()
    assert report["status"] == "reported"
    bond = {
        "amount": "100.00",
        "bondId": "bond-1",
        "currency": "USD",
        "entryDid": did,
        "publisherDid": owner.did,
        "status": "active",
    }
    r = await c.post("/v1/admin/bonds", json=bond, headers=bearer(admin_t, **idem()))
    assert r.status_code == 201, await r.get_data()
    r = await c.post(
        f"/v1/admin/reports/{report['reportId']}/resolve",
        json={"decision": "uphold", "slash": {"bondId": "bond-1", "amount": "33.10"}},
        headers=bearer(admin_t, **idem()),
    )
    assert r.status_code == 200, await r.get_data()
    got = await (await c.get("/v1/bonds/bond-1")).get_json()
    assert got["slashHistory"][0]["distribution"] == {
        "harmedPartiesShare": "16.55",
        "reporterShare": "9.93",
        "treasuryShare": "6.62",
    }
    assert got["remainingAmount"] == "66.90"
    assert got["status"] == "slashed"

    # Transfer: offer, accept; the old owner can no longer update.
    seq = entry["sequence"]
    sig = sign_offer(owner, entry_did=did, entry_sequence=seq, recipient_did=recipient.did)
    r = await c.post(
        "/v1/transfers/offers",
        json={
            "entryDid": did,
            "entrySequence": seq,
            "recipientDid": recipient.did,
            "ownerSignature": sig,
        },
        headers=bearer(owner_t, **idem()),
    )
    assert r.status_code == 201, await r.get_data()
    offer = await r.get_json()
    assert offer["status"] == "offered"
    head = await (await c.get(f"/v1/entries/{did}")).get_json()
    moved = {
        k: v
        for k, v in head.items()
        if k not in ("signature", "anchorState", "updatedAt", "verifiableAttestations")
    }
    moved["publisherDid"] = recipient.did
    new_entry = sign_entry(moved, recipient)
    r = await c.post(
        f"/v1/transfers/offers/{offer['offerId']}/accept",
        json={"entry": new_entry},
        headers=bearer(recipient_t, **idem()),
    )
    assert r.status_code == 200, await r.get_data()
    transferred = await r.get_json()
    assert transferred["publisherDid"] == recipient.did
    assert transferred["sequence"] > seq
    assert (await (await c.get(f"/v1/transfers/offers/{offer['offerId']}")).get_json())[
        "status"
    ] == "accepted"
    update = sign_entry({**moved, "publisherDid": owner.did, "version": "2"}, owner)
    update["sequence"] = transferred["sequence"]
    r = await c.put(f"/v1/entries/{did}", json=update, headers=bearer(owner_t, **idem()))
    assert r.status_code == 403, await r.get_data()

    records = await h.store.log_after(entry["sequence"] - 1, 100)
    kinds = [r.kind for r in records if r.entry_did == did]
    assert kinds == [
        "entry.created",
        "attestation.created",
        "attestation.revoked",
        "report.created",
        "bond.provisioned",
        "report.resolved",
        "bond.slashed",
        "transfer.offered",
        "entry.transferred",
        "transfer.accepted",
    ]
    assert [r.seq for r in records] == list(range(records[0].seq, records[0].seq + len(records)))


async def test_the_configured_shares_split_a_slash(database_url: str, tmp_path: Path) -> None:
    admin = SigningKey.generate()
    config = make_config(
        database_url,
        tmp_path,
        auth={"admin_dids": [admin.did]},
        bonds={"harmed_share": "0.6", "reporter_share": "0.25", "treasury_share": "0.15"},
    )
    async for h in open_harness(config):
        owner = SigningKey.generate()
        owner_t, admin_t = await sign_in(h.client, owner), await sign_in(h.client, admin)
        did = (await _publish(h, owner, owner_t))["entryDid"]
        bond = {
            "amount": "10.00",
            "bondId": f"bond-{did[-8:]}",
            "currency": "EUR",
            "entryDid": did,
            "publisherDid": owner.did,
        }
        r = await h.client.post("/v1/admin/bonds", json=bond, headers=bearer(admin_t, **idem()))
        assert r.status_code == 201, await r.get_data()
        r = await h.client.post(
            f"/v1/admin/bonds/{bond['bondId']}/slash",
            json={"amount": "3.33", "reason": "spam", "reporterDid": owner.did},
            headers=bearer(admin_t, **idem()),
        )
        assert r.status_code == 200, await r.get_data()
        split = (await r.get_json())["slashHistory"][0]["distribution"]
        assert split == {
            "harmedPartiesShare": "1.99",
            "reporterShare": "0.83",
            "treasuryShare": "0.51",
        }
