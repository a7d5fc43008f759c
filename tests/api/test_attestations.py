"""Verifiable attestations over HTTP and PostgreSQL (spec 2.4, 4.3, 5; design §8, §10, §12).

Create (every refusal with its code), read, list with paging, revoke, what the entry shows
(only unrevoked, unexpired attestations) and the events each change emits.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import trio

from registry.keys import SigningKey
from registry.models import parse_datetime
from registry.store import INLINE_ATTESTATIONS
from registry.usecases.common import now_ms
from registry.vc import VC_V2_CONTEXT, add_proof, format_datetime, issue_credential
from tests.api.api_support import JSON, RFC3339, anon_client, create, error_of, with_harness
from tests.conftest import Harness, make_config
from tests.helpers import bearer, idem, sign_in

HOUR = timedelta(hours=1)
_NOW = format_datetime(datetime.now(UTC).replace(microsecond=0))


@dataclass
class World:
    h: Harness
    owner: SigningKey
    owner_t: str
    issuer: SigningKey
    issuer_t: str
    other: SigningKey
    other_t: str
    entry: dict[str, Any]

    @property
    def did(self) -> str:
        return str(self.entry["entryDid"])


@pytest.fixture
async def world(harness: Harness) -> World:
    owner, issuer, other = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    owner_t, issuer_t, other_t = [await sign_in(harness.client, k) for k in (owner, issuer, other)]
    entry = await create(harness, owner, owner_t)
    return World(harness, owner, owner_t, issuer, issuer_t, other, other_t, entry)


@contextmanager
def clock(target: Any, at_ms: int) -> Iterator[None]:
    saved = target.clock_ms
    target.clock_ms = lambda: at_ms
    try:
        yield
    finally:
        target.clock_ms = saved


def credential(
    w: World,
    *,
    key: SigningKey | None = None,
    subject: str | None = None,
    valid_from: datetime | None = None,
    valid_until: datetime | None = None,
    claims: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return issue_credential(
        key or w.issuer,
        subject_id=subject or w.did,
        claims=claims or {"audited": True, "nonce": uuid.uuid4().hex},
        valid_from=valid_from,
        valid_until=valid_until,
    )


async def submit(
    w: World, vc: Any, *, token: str | None = None, entry_did: str | None = None, key: str = ""
) -> Any:
    body = {"attestation": vc, "entryDid": entry_did or w.did}
    headers = bearer(token or w.issuer_t, **{"Idempotency-Key": key or str(uuid.uuid4())})
    return await w.h.client.post("/v1/attestations", json=body, headers=headers)


async def attest(
    w: World, vc: dict[str, Any] | None = None, *, token: str | None = None
) -> dict[str, Any]:
    r = await submit(w, vc or credential(w), token=token)
    assert r.status_code == 201, await r.get_data()
    return dict(await r.get_json())


async def revoke(w: World, attestation_id: str, token: str | None = None) -> Any:
    return await w.h.client.post(
        f"/v1/attestations/{attestation_id}/revoke",
        headers=bearer(token or w.issuer_t, **idem()),
    )


async def shown(w: World) -> list[str]:
    """The attestation ids the entry shows in verifiableAttestations."""
    r = await w.h.client.get(f"/v1/entries/{w.did}")
    assert r.status_code == 200, await r.get_data()
    return [a["attestationId"] for a in (await r.get_json()).get("verifiableAttestations", [])]


def at(text: str) -> datetime:
    return parse_datetime(text)


# --- create ------------------------------------------------------------------------------------


async def test_create_attestation_returns_the_record_and_stores_it(world: World) -> None:
    w = world
    start = datetime.now(UTC).replace(microsecond=0) - HOUR
    end = start + timedelta(days=30)
    vc = credential(w, valid_from=start, valid_until=end)
    before = await w.h.store.log_head()
    r = await submit(w, vc)
    assert r.status_code == 201, await r.get_data()
    record = await r.get_json()
    assert set(record) == {
        "acceptedAt",
        "attestationId",
        "credential",
        "entryDid",
        "expiresAt",
        "issuedAt",
        "issuerDid",
    }
    assert record["credential"] == vc
    assert record["entryDid"] == w.did
    assert record["issuerDid"] == w.issuer.did
    assert at(record["issuedAt"]) == start
    assert at(record["expiresAt"]) == end
    assert RFC3339.match(record["acceptedAt"])
    assert abs(at(record["acceptedAt"]).timestamp() * 1000 - now_ms()) < 60_000

    r = await w.h.client.get(f"/v1/attestations/{record['attestationId']}")
    assert r.status_code == 200, await r.get_data()
    assert await r.get_json() == record

    # Stored apart from the entry: no new entry version, but the entry shows it.
    r = await w.h.client.get(f"/v1/entries/{w.did}/versions")
    assert (await r.get_json())["totalCount"] == 1
    r = await w.h.client.get(f"/v1/entries/{w.did}")
    served = await r.get_json()
    assert served["sequence"] == w.entry["sequence"]
    assert served["verifiableAttestations"] == [record]

    records = [x for x in await w.h.store.log_after(before, 100) if x.entry_did == w.did]
    assert [(x.seq, x.kind) for x in records] == [(before + 1, "attestation.created")]
    assert records[0].data["attestationId"] == record["attestationId"]
    assert records[0].data["issuerDid"] == w.issuer.did


async def test_a_credential_without_validity_dates_has_no_issued_or_expiry_fields(
    world: World,
) -> None:
    record = await attest(world)
    assert "issuedAt" not in record
    assert "expiresAt" not in record
    assert "revokedAt" not in record


async def test_the_same_issuer_may_attest_two_different_credentials_on_one_entry(
    world: World,
) -> None:
    w = world
    first = await attest(w)
    second = await attest(w)
    assert first["attestationId"] != second["attestationId"]
    assert await shown(w) == [first["attestationId"], second["attestationId"]]


async def test_the_same_credential_twice_on_one_entry_is_409(world: World) -> None:
    w = world
    vc = credential(w)
    first = await attest(w, vc)
    r = await submit(w, copy.deepcopy(vc))
    error = await error_of(r, 409, "attestation_exists")
    assert error["details"]["entryDid"] == w.did
    assert await shown(w) == [first["attestationId"]]


async def test_replaying_a_create_with_its_key_answers_the_same_record_once(
    world: World,
) -> None:
    w = world
    vc = credential(w)
    key = f"att-{uuid.uuid4()}"
    first = await submit(w, vc, key=key)
    assert first.status_code == 201, await first.get_data()
    head = await w.h.store.log_head()
    again = await submit(w, vc, key=key)
    assert again.status_code == 201, await again.get_data()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert await again.get_data() == await first.get_data()
    assert await w.h.store.log_head() == head
    other = await submit(w, credential(w), key=key)
    await error_of(other, 409, "idempotency_conflict")


def _tamper_claim(vc: dict[str, Any]) -> dict[str, Any]:
    vc["credentialSubject"]["audited"] = False
    return vc


def _tamper_proof_value(vc: dict[str, Any]) -> dict[str, Any]:
    value = vc["proof"]["proofValue"]
    vc["proof"]["proofValue"] = value[:-2] + ("11" if value[-2:] != "11" else "22")
    return vc


def _drop_proof(vc: dict[str, Any]) -> dict[str, Any]:
    del vc["proof"]
    return vc


def _tamper_validity(vc: dict[str, Any]) -> dict[str, Any]:
    vc["validUntil"] = "2999-01-01T00:00:00Z"
    return vc


@pytest.mark.parametrize(
    ("tamper", "code"),
    [
        (_tamper_claim, "proof_invalid"),
        (_tamper_proof_value, "proof_invalid"),
        (_tamper_validity, "proof_invalid"),
        (_drop_proof, "credential_invalid"),
    ],
)
async def test_a_credential_whose_proof_does_not_verify_is_400(
    world: World, tamper: Any, code: str
) -> None:
    w = world
    vc = credential(w, valid_until=datetime.now(UTC) + timedelta(days=1))
    r = await submit(w, tamper(vc))
    await error_of(r, 400, code)
    assert await shown(w) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("validUntil", "9999-12-31T23:59:59-01:00"),  # the year 10000 in UTC
        ("validFrom", "0001-01-01T00:00:00+01:00"),  # the year 0 in UTC
    ],
)
async def test_a_validity_outside_the_years_1_to_9999_in_utc_is_400(
    world: World, field: str, value: str
) -> None:
    # The registry writes the period in UTC (issuedAt, expiresAt): such a time was a bare 500.
    w = world
    vc = credential(w)
    del vc["proof"]
    vc[field] = value
    signed = add_proof(vc, w.issuer, verification_method=w.issuer.key_id, created=_NOW)
    r = await submit(w, signed)
    body = await error_of(r, 400, "credential_invalid")
    assert field in json.dumps(body)
    assert await shown(w) == []


async def test_a_credential_claiming_an_issuer_whose_key_did_not_sign_it_is_400(
    world: World,
) -> None:
    w = world
    document = {
        "@context": [VC_V2_CONTEXT],
        "type": ["VerifiableCredential"],
        "issuer": w.issuer.did,
        "credentialSubject": {"id": w.did, "audited": True},
    }
    # A valid proof, but by another key than the issuer's.
    vc = add_proof(document, w.other, verification_method=w.other.key_id, created=_NOW)
    r = await submit(w, vc)
    error = await error_of(r, 400, "proof_invalid")
    assert error["details"]["reason"] == "issuer_not_controller"
    assert await shown(w) == []


async def test_the_same_credential_submitted_twice_at_once_is_stored_once(world: World) -> None:
    w = world
    vc = credential(w)
    responses: list[Any] = []

    async def one() -> None:
        responses.append(await submit(w, vc))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            nursery.start_soon(one)
    assert sorted(r.status_code for r in responses) == [201, 409]
    loser = next(r for r in responses if r.status_code == 409)
    await error_of(loser, 409, "attestation_exists")
    winner = await next(r for r in responses if r.status_code == 201).get_json()
    assert await shown(w) == [winner["attestationId"]]


async def test_a_credential_about_another_subject_is_400_subject_mismatch(world: World) -> None:
    w = world
    elsewhere = await create(w.h, w.owner, w.owner_t)
    vc = credential(w, subject=elsewhere["entryDid"])
    r = await submit(w, vc)  # filed on w.did
    error = await error_of(r, 400, "subject_mismatch")
    assert error["details"]["field"] == "attestation.credentialSubject.id"
    assert await shown(w) == []


async def test_an_expired_credential_is_400(world: World) -> None:
    w = world
    now = datetime.now(UTC)
    vc = credential(w, valid_from=now - timedelta(days=2), valid_until=now - HOUR)
    r = await submit(w, vc)
    await error_of(r, 400, "credential_expired")


async def test_a_credential_that_expires_by_the_registrys_clock_is_400(world: World) -> None:
    w = world
    end = datetime.now(UTC).replace(microsecond=0) + timedelta(days=1)
    vc = credential(w, valid_until=end)
    with clock(w.h.deps.attestations, int(end.timestamp() * 1000)):
        r = await submit(w, vc)
        await error_of(r, 400, "credential_expired")
    await attest(w, vc)  # a moment earlier it is accepted


async def test_a_credential_not_yet_valid_is_400(world: World) -> None:
    w = world
    vc = credential(w, valid_from=datetime.now(UTC) + timedelta(days=1))
    r = await submit(w, vc)
    await error_of(r, 400, "credential_not_yet_valid")


@pytest.mark.parametrize(
    ("body", "code"),
    [
        pytest.param(["not", "an", "object"], "attestation_invalid", id="not-an-object"),
        pytest.param({"entryDid": "did:web:example.com:x"}, "attestation_invalid", id="no-vc"),
        pytest.param({"attestation": {}}, "attestation_invalid", id="no-entry-did"),
        pytest.param(
            {"attestation": {}, "entryDid": "did:web:example.com:x", "note": 1},
            "attestation_invalid",
            id="unknown-field",
        ),
        pytest.param(
            {"attestation": {}, "entryDid": "not a did"}, "attestation_invalid", id="bad-did"
        ),
    ],
)
async def test_a_malformed_attestation_request_is_400(world: World, body: Any, code: str) -> None:
    w = world
    r = await w.h.client.post("/v1/attestations", json=body, headers=bearer(w.issuer_t, **idem()))
    await error_of(r, 400, code)


async def test_a_credential_that_is_not_an_object_is_400(world: World) -> None:
    w = world
    r = await submit(w, "a credential, trust me")
    await error_of(r, 400, "credential_invalid")


async def test_malformed_json_is_400(world: World) -> None:
    w = world
    r = await w.h.client.post(
        "/v1/attestations", data=b'{"attestation":', headers=bearer(w.issuer_t, **idem(**JSON))
    )
    await error_of(r, 400, "invalid_json")


async def test_create_attestation_without_a_session_is_401(world: World) -> None:
    w = world
    r = await anon_client(w.h).post(
        "/v1/attestations",
        json={"attestation": credential(w), "entryDid": w.did},
        headers=idem(),
    )
    await error_of(r, 401, "session_missing")


async def test_an_issuer_other_than_the_session_principal_is_403(world: World) -> None:
    w = world
    vc = credential(w)  # issued by w.issuer
    r = await submit(w, vc, token=w.other_t)
    error = await error_of(r, 403, "issuer_mismatch")
    assert error["details"] == {"issuerDid": w.issuer.did, "principal": w.other.did}
    assert await shown(w) == []


async def test_an_unknown_entry_is_404(world: World) -> None:
    w = world
    missing = "did:web:agents.example.com:never-published"
    r = await submit(w, credential(w, subject=missing), entry_did=missing)
    await error_of(r, 404, "entry_not_found")


async def test_a_deleted_entry_cannot_be_attested(world: World) -> None:
    w = world
    r = await w.h.client.delete(f"/v1/entries/{w.did}", headers=bearer(w.owner_t, **idem()))
    assert r.status_code == 200, await r.get_data()
    r = await submit(w, credential(w))
    await error_of(r, 404, "entry_not_found")


async def test_without_the_attest_capability_create_is_403(
    database_url: str, tmp_path: Path
) -> None:
    config = make_config(
        database_url, tmp_path, auth={"default_capabilities": ["entries.write", "report"]}
    )

    async def body(h: Harness) -> None:
        owner = SigningKey.generate()
        token = await sign_in(h.client, owner)
        entry = await create(h, owner, token)
        vc = issue_credential(owner, subject_id=entry["entryDid"])
        r = await h.client.post(
            "/v1/attestations",
            json={"attestation": vc, "entryDid": entry["entryDid"]},
            headers=bearer(token, **idem()),
        )
        error = await error_of(r, 403, "capability_missing")
        assert error["details"]["capability"] == "attest"

    await with_harness(config, body)


async def test_create_without_an_idempotency_key_is_400(world: World) -> None:
    w = world
    r = await w.h.client.post(
        "/v1/attestations",
        json={"attestation": credential(w), "entryDid": w.did},
        headers=bearer(w.issuer_t),
    )
    await error_of(r, 400, "idempotency_key_required")


# --- read and list -----------------------------------------------------------------------------


async def test_get_unknown_attestation_is_404(world: World) -> None:
    r = await world.h.client.get("/v1/attestations/att_nothing")
    await error_of(r, 404, "attestation_not_found")


async def test_list_pages_through_every_attestation_of_the_entry_oldest_first(
    world: World,
) -> None:
    w = world
    made = [(await attest(w))["attestationId"] for _ in range(5)]
    elsewhere = await create(w.h, w.owner, w.owner_t)
    vc = credential(w, subject=elsewhere["entryDid"])
    r = await submit(w, vc, entry_did=elsewhere["entryDid"])
    assert r.status_code == 201, await r.get_data()

    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        url = f"/v1/entries/{w.did}/attestations?limit=2"
        if cursor is not None:
            url += f"&cursor={cursor}"
        r = await w.h.client.get(url)
        assert r.status_code == 200, await r.get_data()
        page = await r.get_json()
        pages += 1
        assert page["entryDid"] == w.did
        assert len(page["attestations"]) <= 2
        assert all(a["entryDid"] == w.did for a in page["attestations"])
        seen += [a["attestationId"] for a in page["attestations"]]
        if not page["hasMore"]:
            assert "cursor" not in page
            break
        cursor = page["cursor"]
    assert seen == made
    assert pages == 3

    r = await w.h.client.get(f"/v1/entries/{w.did}/attestations")
    page = await r.get_json()
    assert [a["attestationId"] for a in page["attestations"]] == made
    assert page["hasMore"] is False


async def test_a_list_page_ends_once_its_attestations_hold_the_page_bytes(
    database_url: str, tmp_path: Path
) -> None:
    """`limits.trust_page_bytes`: a page ends early (hasMore, with a cursor) before the first
    attestation whose predecessors on the page hold that many bytes; one larger than the whole
    budget still comes, alone."""
    config = make_config(database_url, tmp_path, limits={"trust_page_bytes": 4096})

    async def body(h: Harness) -> None:
        owner, issuer = SigningKey.generate(), SigningKey.generate()
        owner_t, issuer_t = await sign_in(h.client, owner), await sign_in(h.client, issuer)
        entry = await create(h, owner, owner_t)
        w = World(h, owner, owner_t, issuer, issuer_t, issuer, issuer_t, entry)
        blobs = [6000, 1500, 1500, 1500, 1500]  # one of ~7 KB stored, then ~2.5 KB each
        made = [
            (await attest(w, credential(w, claims={"blob": "x" * n, "nonce": i})))["attestationId"]
            for i, n in enumerate(blobs)
        ]
        pages: list[list[str]] = []
        cursor: str | None = None
        while True:
            url = f"/v1/entries/{w.did}/attestations?limit=100"
            r = await h.client.get(url + (f"&cursor={cursor}" if cursor else ""))
            assert r.status_code == 200, await r.get_data()
            page = await r.get_json()
            pages.append([a["attestationId"] for a in page["attestations"]])
            if not page["hasMore"]:
                assert "cursor" not in page
                break
            cursor = page["cursor"]
        # The 7 KB one comes alone; 2.5 + 2.5 KB hold 4 KB: the third starts a page.
        assert pages == [made[0:1], made[1:3], made[3:5]]

    await with_harness(config, body)


async def test_the_largest_page_byte_budgets_list_through_postgresql(
    database_url: str, tmp_path: Path
) -> None:
    """At the largest budget the configuration accepts (1 GiB), every byte-capped list still
    answers (each budget is a parameter of its SQL)."""
    largest = 1 << 30
    limits = {"trust_page_bytes": largest, "versions_page_bytes": largest}
    config = make_config(database_url, tmp_path, limits={**limits, "discover_page_bytes": largest})

    async def body(h: Harness) -> None:
        owner, issuer = SigningKey.generate(), SigningKey.generate()
        owner_t, issuer_t = await sign_in(h.client, owner), await sign_in(h.client, issuer)
        entry = await create(h, owner, owner_t)
        w = World(h, owner, owner_t, issuer, issuer_t, issuer, issuer_t, entry)
        made = (await attest(w))["attestationId"]
        r = await h.client.get(f"/v1/entries/{w.did}/attestations")
        assert r.status_code == 200, await r.get_data()
        assert [a["attestationId"] for a in (await r.get_json())["attestations"]] == [made]
        r = await h.client.get(f"/v1/entries/{w.did}/versions")
        assert r.status_code == 200, await r.get_data()
        assert (await r.get_json())["totalCount"] == 1
        r = await h.client.post("/v1/discover", json={"entryType": "*"})
        assert r.status_code == 200, await r.get_data()
        assert w.did in [e["entryDid"] for e in (await r.get_json())["entries"]]

    await with_harness(config, body)


async def test_list_of_an_entry_without_attestations_is_empty(world: World) -> None:
    r = await world.h.client.get(f"/v1/entries/{world.did}/attestations")
    assert r.status_code == 200, await r.get_data()
    assert await r.get_json() == {"entryDid": world.did, "attestations": [], "hasMore": False}


async def test_list_of_an_unknown_entry_is_404(world: World) -> None:
    r = await world.h.client.get("/v1/entries/did:web:agents.example.com:nope/attestations")
    await error_of(r, 404, "entry_not_found")


@pytest.mark.parametrize(
    ("query", "code"),
    [
        ("cursor=abc", "invalid_cursor"),
        ("cursor=0", "invalid_cursor"),
        ("cursor=-5", "invalid_cursor"),
        ("limit=0", "invalid_limit"),
        ("limit=two", "invalid_limit"),
    ],
)
async def test_list_with_a_bad_cursor_or_limit_is_400(world: World, query: str, code: str) -> None:
    r = await world.h.client.get(f"/v1/entries/{world.did}/attestations?{query}")
    await error_of(r, 400, code)


# --- what the entry shows ----------------------------------------------------------------------


async def test_the_entry_shows_only_unrevoked_unexpired_attestations(world: World) -> None:
    w = world
    end = datetime.now(UTC).replace(microsecond=0) + timedelta(days=1)
    expiring = await attest(w, credential(w, valid_until=end))
    lasting = await attest(w)
    revoked = await attest(w)
    r = await revoke(w, revoked["attestationId"])
    assert r.status_code == 200, await r.get_data()

    assert await shown(w) == [expiring["attestationId"], lasting["attestationId"]]
    end_ms = int(end.timestamp() * 1000)
    with clock(w.h.deps.entries, end_ms - 1):
        assert await shown(w) == [expiring["attestationId"], lasting["attestationId"]]
    with clock(w.h.deps.entries, end_ms):
        assert await shown(w) == [lasting["attestationId"]]
    # The list still has all three, the revoked one with revokedAt.
    r = await w.h.client.get(f"/v1/entries/{w.did}/attestations")
    listed = {a["attestationId"]: a for a in (await r.get_json())["attestations"]}
    assert set(listed) == {a["attestationId"] for a in (expiring, lasting, revoked)}
    assert "revokedAt" in listed[revoked["attestationId"]]
    assert "revokedAt" not in listed[lasting["attestationId"]]


async def test_the_entry_shows_no_attestations_field_when_none_is_shown(world: World) -> None:
    w = world
    r = await w.h.client.get(f"/v1/entries/{w.did}")
    assert "verifiableAttestations" not in await r.get_json()
    record = await attest(w)
    assert await shown(w) == [record["attestationId"]]
    assert (await revoke(w, record["attestationId"])).status_code == 200
    r = await w.h.client.get(f"/v1/entries/{w.did}")
    assert "verifiableAttestations" not in await r.get_json()


# --- revoke ------------------------------------------------------------------------------------


async def test_the_issuer_revokes_an_attestation(world: World) -> None:
    w = world
    record = await attest(w)
    before = await w.h.store.log_head()
    r = await revoke(w, record["attestationId"])
    assert r.status_code == 200, await r.get_data()
    revoked = await r.get_json()
    assert RFC3339.match(revoked["revokedAt"])
    assert {k: v for k, v in revoked.items() if k != "revokedAt"} == record
    r = await w.h.client.get(f"/v1/attestations/{record['attestationId']}")
    assert await r.get_json() == revoked
    records = [x for x in await w.h.store.log_after(before, 100) if x.entry_did == w.did]
    assert [(x.seq, x.kind) for x in records] == [(before + 1, "attestation.revoked")]
    assert records[0].data["attestationId"] == record["attestationId"]


async def test_only_the_issuer_may_revoke(world: World) -> None:
    w = world
    record = await attest(w)
    for token in (w.other_t, w.owner_t):  # not even the entry's publisher
        r = await revoke(w, record["attestationId"], token=token)
        await error_of(r, 403, "issuer_mismatch")
    assert await shown(w) == [record["attestationId"]]


async def test_revoking_an_unknown_attestation_is_404(world: World) -> None:
    r = await revoke(world, "att_unknown")
    await error_of(r, 404, "attestation_not_found")


async def test_revoking_twice_is_409(world: World) -> None:
    w = world
    record = await attest(w)
    assert (await revoke(w, record["attestationId"])).status_code == 200
    r = await revoke(w, record["attestationId"])
    await error_of(r, 409, "attestation_revoked")


async def test_revoke_without_a_session_is_401_and_without_a_key_400(world: World) -> None:
    w = world
    record = await attest(w)
    path = f"/v1/attestations/{record['attestationId']}/revoke"
    r = await anon_client(w.h).post(path, headers=idem())
    await error_of(r, 401, "session_missing")
    r = await w.h.client.post(path, headers=bearer(w.issuer_t))
    await error_of(r, 400, "idempotency_key_required")
    assert await shown(w) == [record["attestationId"]]


async def test_a_revoked_credential_cannot_be_attested_again(world: World) -> None:
    w = world
    vc = credential(w)
    record = await attest(w, vc)
    assert (await revoke(w, record["attestationId"])).status_code == 200
    r = await submit(w, vc)
    await error_of(r, 409, "attestation_exists")
    assert await shown(w) == []


# --- bounds --------------------------------------------------------------------------------------


async def test_an_entry_serves_its_oldest_unexpired_attestations_up_to_the_bound(
    world: World,
) -> None:
    """Anyone with `attest` may attest any entry, and every GET serves them: the entry serves
    the oldest INLINE_ATTESTATIONS active, unexpired ones (new ones never displace them), and
    lists them all at /attestations. A credential is at most `limits.small_body_bytes`."""
    w = world
    past = datetime.now(UTC).replace(microsecond=0) - 3 * HOUR
    with clock(w.h.deps.attestations, int((past + HOUR).timestamp() * 1000)):
        expired = await attest(w, credential(w, valid_from=past, valid_until=past + 2 * HOUR))
    issuers = [(w.issuer, w.issuer_t), (w.other, w.other_t)] * INLINE_ATTESTATIONS
    made = [
        await attest(w, credential(w, key=key), token=token)
        for key, token in issuers[: INLINE_ATTESTATIONS + 1]
    ]
    ids = [a["attestationId"] for a in made]
    assert await shown(w) == ids[:INLINE_ATTESTATIONS]  # the expired one is not served
    r = await revoke(w, ids[0])
    assert r.status_code == 200
    assert await shown(w) == ids[1:]
    url = f"/v1/entries/{w.did}/attestations?limit=100"
    page = await (await w.h.client.get(url)).get_json()
    listed = [a["attestationId"] for a in page["attestations"]]
    assert listed == [expired["attestationId"], *ids]  # everything, revoked and expired too
    big = credential(w, claims={"blob": "x" * (64 * 1024)})
    await error_of(await submit(w, big), 413, "body_too_large")


# --- expired attestations and the entry's read -----------------------------------------------


async def _records_read(w: World) -> tuple[int, int]:
    """What the entry's head statement reads of `records` (EXPLAIN ANALYZE): the rows it returns
    or its filter drops, and the buffers (index and heap pages, old row versions included)."""
    import json

    import trio_asyncio

    from registry.store.pg import ENTRY_HEAD_SQL

    fetchval = trio_asyncio.aio_as_trio(w.h.store._pool.fetchval)  # type: ignore[attr-defined]
    raw = await fetchval(
        f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {ENTRY_HEAD_SQL}", w.did, INLINE_ATTESTATIONS
    )

    def read(node: dict[str, Any]) -> tuple[int, int]:
        rows = buffers = 0
        if node.get("Relation Name") == "records":
            loops = node["Actual Loops"]
            rows = (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * loops
            buffers = node["Shared Hit Blocks"] + node["Shared Read Blocks"]
        for child in node.get("Plans", ()):
            more = read(child)
            rows, buffers = rows + more[0], buffers + more[1]
        return rows, buffers

    return read(json.loads(raw)[0]["Plan"])


async def test_expired_attestations_are_not_walked_once_the_janitor_marks_them(
    world: World,
) -> None:
    """Any key with `attest` may attest any entry with a credential valid for seconds; the
    entry's read must not walk every one of them that has since expired (hostile review: ~0.75
    ms of database time per 1,000, forever)."""
    import trio_asyncio

    w = world
    live = await attest(w)
    dead = 3000
    execute = trio_asyncio.aio_as_trio(w.h.store._pool.execute)  # type: ignore[attr-defined]
    # What 3,000 two-second credentials leave behind once expired, written after the live one.
    await execute(
        "INSERT INTO records (kind, id, entry_did, owner_did, status, version, expires_at,"
        " created_seq, updated_seq, doc)"
        " SELECT 'attestation', $2 || n, $1, 'did:key:zAttacker', 'active', 1,"
        "        now() - interval '1 hour', 1000000000 + n, 1000000000 + n, '{}'"
        " FROM generate_series(1, $3) AS n",
        w.did,
        f"dead-{uuid.uuid4().hex}-",
        dead,
    )
    rows, before = await _records_read(w)
    assert rows >= dead  # before the janitor's pass: each one is read

    assert await w.h.store.lapse_attestations() >= dead
    await w.h.store.vacuum_records()  # what the janitor does after 1,000 (actors/janitor.py)
    rows, after = await _records_read(w)
    assert rows <= 2  # the live one (and nothing expired)
    # Nor their old versions, which the index held until the vacuum (a standby reads them).
    assert after <= 8 < before, (before, after)
    assert await shown(w) == [live["attestationId"]]
    # Nothing served changed: the listing still has every one, the expired ones as stored.
    r = await w.h.client.get(f"/v1/entries/{w.did}/attestations?limit=100")
    assert r.status_code == 200
    body = await r.get_json()
    assert body["attestations"][0] == live
    assert len(body["attestations"]) == 100


async def test_a_revoked_attestation_that_had_lapsed_stays_unshown(world: World) -> None:
    """A change to a lapsed record clears the flag; revoked, it is not shown either way."""
    import trio_asyncio

    w = world
    record = await attest(w)
    execute = trio_asyncio.aio_as_trio(w.h.store._pool.execute)  # type: ignore[attr-defined]
    await execute(
        "UPDATE records SET lapsed = true WHERE kind = 'attestation' AND id = $1",
        record["attestationId"],
    )
    r = await revoke(w, record["attestationId"])
    assert r.status_code == 200, await r.get_data()
    fetchval = trio_asyncio.aio_as_trio(w.h.store._pool.fetchval)  # type: ignore[attr-defined]
    assert not await fetchval(
        "SELECT lapsed FROM records WHERE kind = 'attestation' AND id = $1",
        record["attestationId"],
    )
    assert await shown(w) == []


async def test_routes_that_only_check_the_entry_read_none_of_its_attestations(
    world: World,
) -> None:
    """Anyone may attest any entry with up to 50 credentials of 64 KiB: the routes that only
    need the entry to exist (its versions, a version, its anchors, its attestation list) must
    not read them from the database on every request (hostile review: 2.7 MB a request)."""
    w = world
    await attest(w)
    store = w.h.store
    asked: list[int] = []
    original = store.get_entry_head

    async def counting(did: str, *, attestations: int = INLINE_ATTESTATIONS) -> Any:
        asked.append(attestations)
        return await original(did, attestations=attestations)

    store.get_entry_head = counting  # type: ignore[method-assign]
    try:
        for path in ("versions", f"versions/{w.entry['sequence']}", "attestations"):
            r = await w.h.client.get(f"/v1/entries/{w.did}/{path}")
            assert r.status_code == 200, (path, await r.get_data())
        r = await w.h.client.get(f"/v1/anchors/{w.did}")
        assert r.status_code == 200
        assert asked
        assert set(asked) == {0}
        w.h.deps.entries.cache.clear()
        assert len(await shown(w)) == 1  # the entry itself: read with them
        assert asked[-1] == INLINE_ATTESTATIONS
    finally:
        del store.get_entry_head
