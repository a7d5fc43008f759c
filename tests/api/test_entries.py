"""Entries over HTTP against real PostgreSQL: create, update, lifecycle, read, versions, delete."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from werkzeug.datastructures import Headers

from registry import canonical
from registry.entries import sign_entry
from registry.keys import SigningKey, b64url_encode
from tests.api.api_support import (
    JSON,
    RFC3339,
    anon_client,
    assert_publisher_signature,
    create,
    error_of,
    expected_served,
    update,
    updated,
    versions,
    with_harness,
)
from tests.conftest import Harness, make_config
from tests.helpers import bearer, entry_template, idem, new_did, sign_in, signed_entry

# --- create ---------------------------------------------------------------------------------


async def test_create_returns_submitted_entry_plus_managed_fields(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(
        key,
        description="An agent",
        customMetadata={"team": "blue", "n": 3},
        relationships=[
            {"label": "uses", "relationshipType": "dependsOn", "targetDid": new_did()},
        ],
        serviceEndpoints=[
            {
                "id": "main",
                "priority": 1,
                "properties": {"x": True},
                "type": "https",
                "url": "https://agent.example.com/api",
            }
        ],
    )
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    assert r.status_code == 201, await r.get_data()
    assert r.headers["Content-Type"].startswith("application/json")
    assert r.headers.get("X-Request-Id")
    served = await r.get_json()
    assert isinstance(served["sequence"], int)
    assert served["sequence"] >= 1
    assert served["anchorState"] == "unanchored"
    assert RFC3339.match(served["updatedAt"])
    assert RFC3339.match(served["signature"]["created"])
    assert served == expected_served(entry, served)
    assert_publisher_signature(served)


async def test_create_keeps_client_signature_created(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = sign_entry(entry_template(), key, created="2026-11-01T12:00:01Z")
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    assert r.status_code == 201, await r.get_data()
    served = await r.get_json()
    assert served["signature"]["created"] == "2026-11-01T12:00:01Z"
    assert served == expected_served(entry, served)
    assert_publisher_signature(served)


async def test_create_replaces_client_supplied_managed_fields(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    entry["anchorState"] = "anchored"
    entry["updatedAt"] = "2000-01-01T00:00:00Z"
    entry["verifiableAttestations"] = [{"forged": True}]
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    assert r.status_code == 201, await r.get_data()
    served = await r.get_json()
    assert served["anchorState"] == "unanchored"
    assert served["updatedAt"] != "2000-01-01T00:00:00Z"
    assert "verifiableAttestations" not in served
    assert_publisher_signature(served)


async def test_created_entry_defaults_to_draft_and_reads_back(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    served = await create(harness, key, token)
    assert served.get("lifecycleStatus", "draft") == "draft"
    r = await anon_client(harness).get(f"/v1/entries/{served['entryDid']}")
    assert r.status_code == 200
    assert await r.get_json() == served


async def _post_raw(h: Harness, token: str, body: bytes) -> Any:
    return await h.client.post("/v1/entries", data=body, headers=bearer(token, **idem(**JSON)))


async def test_create_malformed_json_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    for body in (b'{"entryDid": ', b"not json", b"\xff\xfe{}", b""):
        r = await _post_raw(harness, token, body)
        await error_of(r, 400, "invalid_json")


async def test_create_unsafe_integer_in_item_data_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    text = json.dumps(entry)
    # Put 2^53 into itemData: not representable exactly under JCS (I-JSON).
    assert '"temperature": 0.5' in text
    body = text.replace('"temperature": 0.5', '"temperature": 9007199254740992').encode()
    r = await _post_raw(harness, token, body)
    await error_of(r, 400, "invalid_json")
    # The same number below the bound parses (and fails only the hash, not the parser).
    body = text.replace('"temperature": 0.5', '"temperature": 9007199254740991').encode()
    r = await _post_raw(harness, token, body)
    await error_of(r, 400, "item_data_hash_mismatch")


async def test_create_other_i_json_violations_are_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    text = json.dumps(signed_entry(key))
    target = '"temperature": 0.5'
    for replacement in (
        '"temperature": NaN',
        '"temperature": Infinity',
        '"temperature": 1e400',
        '"temperature": "\\ud800"',
        '"temperature": -9007199254740993',
    ):
        r = await _post_raw(harness, token, text.replace(target, replacement).encode())
        await error_of(r, 400, "invalid_json")


async def test_create_duplicate_member_names_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    text = json.dumps(entry)
    # Duplicate a top-level member (same value), and separately one inside itemData.
    top = text[:-1] + ', "name": ' + json.dumps(entry["name"]) + "}"
    r = await _post_raw(harness, token, top.encode())
    await error_of(r, 400, "invalid_json")
    inner = text.replace('"model": "m-1"', '"model": "m-1", "model": "m-1"')
    assert inner != text
    r = await _post_raw(harness, token, inner.encode())
    await error_of(r, 400, "invalid_json")


@pytest.mark.parametrize(
    "field",
    ["entryDid", "entryType", "itemData", "itemSchemaUri", "name", "publishedAt", "version"],
)
async def test_create_missing_required_field_is_400(harness: Harness, field: str) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    template = entry_template()
    if field == "itemData":
        # sign_entry needs itemData to hash; drop it after signing.
        entry = sign_entry(template, key)
        del entry["itemData"]
    else:
        del template[field]
        entry = sign_entry(template, key)
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    error = await error_of(r, 400, "entry_invalid")
    fields = [e["field"] for e in error.get("details", {}).get("errors", [])]
    assert field in fields


async def test_create_missing_signature_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    del entry["signature"]
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    await error_of(r, 400, "entry_invalid")


async def test_create_unknown_field_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key, surprise="x")
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    await error_of(r, 400, "entry_invalid")


async def test_create_non_object_body_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    for body in (b"[]", b'"entry"', b"42", b"null"):
        r = await _post_raw(harness, token, body)
        await error_of(r, 400, "entry_invalid")


async def test_create_wrong_item_data_hash_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    template = entry_template()
    entry = sign_entry(template, key)
    # Re-sign over a hash of different data: the signature is good, the hash is wrong.
    payload = {k: v for k, v in entry.items() if k != "signature"}
    payload["itemDataHash"] = canonical.item_data_hash({"other": 1})
    value = b64url_encode(key.sign(canonical.canonicalize(payload)))
    wrong = {**payload, "signature": {**entry["signature"], "value": value}}
    r = await harness.client.post("/v1/entries", json=wrong, headers=bearer(token, **idem()))
    await error_of(r, 400, "item_data_hash_mismatch")


async def test_create_item_data_changed_after_signing_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    entry["itemData"] = {**entry["itemData"], "model": "m-2"}
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    await error_of(r, 400, "item_data_hash_mismatch")


async def test_create_bad_signature_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    # A signed field changed after signing (hash still right): the signature no longer verifies.
    tampered = {**entry, "name": "Another name"}
    r = await harness.client.post("/v1/entries", json=tampered, headers=bearer(token, **idem()))
    await error_of(r, 400, "signature_invalid")
    # A well-formed signature value that is not a signature over the payload.
    forged = {**entry, "signature": {**entry["signature"], "value": b64url_encode(bytes(64))}}
    r = await harness.client.post("/v1/entries", json=forged, headers=bearer(token, **idem()))
    await error_of(r, 400, "signature_invalid")
    # Signed by the right key over the wrong bytes (the whole entry, not the payload).
    other = {**entry, "signature": {**entry["signature"], "value": b64url_encode(key.sign(b"x"))}}
    r = await harness.client.post("/v1/entries", json=other, headers=bearer(token, **idem()))
    await error_of(r, 400, "signature_invalid")


async def test_create_malformed_signature_value_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    broken = {**entry, "signature": {**entry["signature"], "value": "not base64!"}}
    r = await harness.client.post("/v1/entries", json=broken, headers=bearer(token, **idem()))
    await error_of(r, 400, "entry_invalid")
    short = {
        **entry,
        "signature": {**entry["signature"], "value": entry["signature"]["value"][:-2]},
    }
    r = await harness.client.post("/v1/entries", json=short, headers=bearer(token, **idem()))
    await error_of(r, 400, "entry_invalid")


async def test_create_key_not_controlled_by_publisher_is_400(harness: Harness) -> None:
    publisher = SigningKey.generate()
    signer = SigningKey.generate()
    token = await sign_in(harness.client, publisher)
    # publisherDid names the session principal; the signature is by another key (valid for it).
    payload = {k: v for k, v in signed_entry(publisher).items() if k != "signature"}
    value = b64url_encode(signer.sign(canonical.canonicalize(payload)))
    entry = {
        **payload,
        "signature": {"algorithm": "Ed25519", "keyId": signer.key_id, "value": value},
    }
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    await error_of(r, 400, "signature_key_mismatch")


@pytest.mark.parametrize(
    "bad_did", ["not-a-did", "did:web:", "did:Web:example.com", "did:web:a b", "did:web:x%zz"]
)
async def test_create_bad_entry_did_is_400(harness: Harness, bad_did: str) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key, bad_did)
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    error = await error_of(r, 400, "entry_invalid")
    assert "entryDid" in [e["field"] for e in error["details"]["errors"]]


async def test_create_bad_publisher_did_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    payload = {k: v for k, v in signed_entry(key).items() if k != "signature"}
    payload["publisherDid"] = "publisher"
    value = b64url_encode(key.sign(canonical.canonicalize(payload)))
    entry = {**payload, "signature": {"algorithm": "Ed25519", "keyId": key.key_id, "value": value}}
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    await error_of(r, 400, "entry_invalid")


async def test_create_without_session_is_401(harness: Harness) -> None:
    client = anon_client(harness)
    entry = signed_entry(SigningKey.generate())
    r = await client.post("/v1/entries", json=entry, headers=idem())
    await error_of(r, 401, "session_missing")
    r = await client.get(f"/v1/entries/{entry['entryDid']}")
    await error_of(r, 404, "entry_not_found")


async def test_create_with_garbage_bearer_is_401(harness: Harness) -> None:
    client = anon_client(harness)
    entry = signed_entry(SigningKey.generate())
    for header in ("Bearer not-a-session", "Bearer " + "A" * 43, "Basic dXNlcjpwdw==", "Bearer"):
        r = await client.post(
            "/v1/entries", json=entry, headers={"Authorization": header, **idem()}
        )
        await error_of(r, 401, "session_invalid")


async def test_create_with_revoked_session_is_401(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    r = await harness.client.post("/v1/auth/logout", headers=bearer(token, **idem()))
    assert r.status_code == 200, await r.get_data()
    entry = signed_entry(key)
    r = await anon_client(harness).post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    await error_of(r, 401, "session_invalid")


async def test_create_for_another_publisher_is_403(harness: Harness) -> None:
    me = SigningKey.generate()
    someone = SigningKey.generate()
    token = await sign_in(harness.client, me)
    entry = signed_entry(someone)  # valid, but publisherDid is someone else
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    await error_of(r, 403, "publisher_mismatch")
    r = await harness.client.get(f"/v1/entries/{entry['entryDid']}")
    await error_of(r, 404, "entry_not_found")


async def test_create_same_did_twice_is_409(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    again = signed_entry(key, first["entryDid"], version="2.0.0")
    r = await harness.client.post("/v1/entries", json=again, headers=bearer(token, **idem()))
    await error_of(r, 409, "entry_exists")
    # Another publisher cannot take the DID either.
    other = SigningKey.generate()
    other_token = await sign_in(harness.client, other)
    theirs = signed_entry(other, first["entryDid"])
    r = await harness.client.post("/v1/entries", json=theirs, headers=bearer(other_token, **idem()))
    await error_of(r, 409, "entry_exists")
    r = await harness.client.get(f"/v1/entries/{first['entryDid']}")
    assert await r.get_json() == first


async def test_create_as_revoked_or_deleted_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    for status in ("revoked", "deprecated"):
        entry = signed_entry(key, lifecycleStatus=status)
        r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
        await error_of(r, 400, "entry_invalid")
    entry = signed_entry(key, lifecycleStatus="deleted")
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    await error_of(r, 400, "entry_invalid")


async def test_create_wrong_content_type_is_rejected(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    body = json.dumps(signed_entry(key)).encode()
    r = await harness.client.post(
        "/v1/entries", data=body, headers=bearer(token, **idem(**{"Content-Type": "text/plain"}))
    )
    await error_of(r, 415, "unsupported_media_type")


# --- cookie sessions ------------------------------------------------------------------------


async def test_cookie_session_is_an_alternative_to_bearer(harness: Harness) -> None:
    client = harness.client.app.test_client()  # with a cookie jar
    key = SigningKey.generate()
    await sign_in(client, key)
    entry = signed_entry(key)
    r = await client.post("/v1/entries", json=entry, headers=idem())  # no Authorization header
    assert r.status_code == 201, await r.get_data()
    served = await r.get_json()
    assert served["publisherDid"] == key.did


async def test_explicit_cookie_header_authenticates(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    client = anon_client(harness)
    entry = signed_entry(key)
    r = await client.post(
        "/v1/entries", json=entry, headers={"Cookie": f"registry_session={token}", **idem()}
    )
    assert r.status_code == 201, await r.get_data()
    r = await client.post(
        "/v1/entries",
        json=signed_entry(key),
        headers={"Cookie": "registry_session=garbage", **idem()},
    )
    await error_of(r, 401, "session_invalid")


# --- update ---------------------------------------------------------------------------------


async def test_update_returns_new_higher_sequence(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    did = first["entryDid"]
    entry = signed_entry(key, did, sequence=first["sequence"], version="1.1.0", name="Renamed")
    r = await harness.client.put(f"/v1/entries/{did}", json=entry, headers=bearer(token, **idem()))
    assert r.status_code == 200, await r.get_data()
    second = await r.get_json()
    assert second["sequence"] > first["sequence"]
    assert second["version"] == "1.1.0"
    assert second["name"] == "Renamed"
    assert second == expected_served(entry, second)
    assert_publisher_signature(second)
    r = await harness.client.get(f"/v1/entries/{did}")
    assert r.status_code == 200
    assert await r.get_json() == second
    third = await updated(harness, key, token, did, second["sequence"], version="1.2.0")
    assert third["sequence"] > second["sequence"]


async def test_update_unknown_did_is_404(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    r = await update(harness, key, token, new_did(), 1)
    await error_of(r, 404, "entry_not_found")


async def test_update_with_stale_sequence_is_409(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    did = first["entryDid"]
    second = await updated(harness, key, token, did, first["sequence"], version="1.1.0")
    r = await update(harness, key, token, did, first["sequence"], version="1.2.0")
    error = await error_of(r, 409, "sequence_conflict")
    assert error.get("details", {}).get("latestSequence", second["sequence"]) == second["sequence"]
    # A sequence that never was the head (in the future) is a conflict too.
    r = await update(harness, key, token, did, second["sequence"] + 1000, version="1.2.0")
    await error_of(r, 409, "sequence_conflict")
    r = await harness.client.get(f"/v1/entries/{did}")
    assert await r.get_json() == second


async def test_update_without_sequence_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    r = await update(harness, key, token, first["entryDid"], None, version="1.1.0")
    await error_of(r, 400, "sequence_required")


async def test_update_path_did_differs_from_body_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    a = await create(harness, key, token)
    b = await create(harness, key, token)
    entry = signed_entry(key, b["entryDid"], sequence=a["sequence"])
    r = await harness.client.put(
        f"/v1/entries/{a['entryDid']}", json=entry, headers=bearer(token, **idem())
    )
    await error_of(r, 400, "entry_invalid")


async def test_update_by_another_principal_is_403(harness: Harness) -> None:
    owner = SigningKey.generate()
    owner_token = await sign_in(harness.client, owner)
    first = await create(harness, owner, owner_token)
    did = first["entryDid"]
    intruder = SigningKey.generate()
    intruder_token = await sign_in(harness.client, intruder)
    # Signed by the intruder as publisher: valid entry, but not the entry's publisher.
    r = await update(harness, intruder, intruder_token, did, first["sequence"], name="Mine")
    await error_of(r, 403, "publisher_mismatch")
    # Signed by the owner, sent with the intruder's session: publisherDid is not the principal.
    entry = signed_entry(owner, did, sequence=first["sequence"], name="Mine")
    r = await harness.client.put(
        f"/v1/entries/{did}", json=entry, headers=bearer(intruder_token, **idem())
    )
    await error_of(r, 403, "publisher_mismatch")
    r = await harness.client.get(f"/v1/entries/{did}")
    assert await r.get_json() == first


async def test_update_without_session_is_401(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    entry = signed_entry(key, first["entryDid"], sequence=first["sequence"])
    r = await anon_client(harness).put(
        f"/v1/entries/{first['entryDid']}", json=entry, headers=idem()
    )
    await error_of(r, 401, "session_missing")


async def test_update_invalid_entry_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    did = first["entryDid"]
    entry = signed_entry(key, did, sequence=first["sequence"])
    tampered = {**entry, "version": "9.9.9"}
    r = await harness.client.put(
        f"/v1/entries/{did}", json=tampered, headers=bearer(token, **idem())
    )
    await error_of(r, 400, "signature_invalid")
    r = await harness.client.put(
        f"/v1/entries/{did}", data=b"{", headers=bearer(token, **idem(**JSON))
    )
    await error_of(r, 400, "invalid_json")


# --- lifecycle ------------------------------------------------------------------------------


async def test_lifecycle_allowed_moves(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    head = await create(harness, key, token)
    did = head["entryDid"]
    for status in ("active", "deprecated", "active", "deprecated", "revoked"):
        nxt = await updated(harness, key, token, did, head["sequence"], lifecycleStatus=status)
        assert nxt["lifecycleStatus"] == status
        assert nxt["sequence"] > head["sequence"]
        head = nxt
    r = await harness.client.get(f"/v1/entries/{did}")
    assert r.status_code == 200
    assert (await r.get_json())["lifecycleStatus"] == "revoked"


@pytest.mark.parametrize("start", ["draft", "active", "deprecated"])
async def test_every_live_state_can_be_revoked(harness: Harness, start: str) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    fields = {} if start == "draft" else {"lifecycleStatus": "active"}
    head = await create(harness, key, token, **fields)
    if start == "deprecated":
        head = await updated(
            harness, key, token, head["entryDid"], head["sequence"], lifecycleStatus="deprecated"
        )
    if start == "draft":
        assert head.get("lifecycleStatus", "draft") == "draft"
    r = await update(
        harness, key, token, head["entryDid"], head["sequence"], lifecycleStatus="revoked"
    )
    assert r.status_code == 200, await r.get_data()


async def test_lifecycle_active_to_draft_is_409(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    head = await create(harness, key, token, lifecycleStatus="active")
    did = head["entryDid"]
    r = await update(harness, key, token, did, head["sequence"], lifecycleStatus="draft")
    error = await error_of(r, 409, "lifecycle_conflict")
    assert error.get("details", {}).get("from", "active") == "active"
    deprecated = await updated(
        harness, key, token, did, head["sequence"], lifecycleStatus="deprecated"
    )
    r = await update(harness, key, token, did, deprecated["sequence"], lifecycleStatus="draft")
    await error_of(r, 409, "lifecycle_conflict")


async def test_lifecycle_draft_to_deprecated_is_409(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    head = await create(harness, key, token)
    r = await update(
        harness, key, token, head["entryDid"], head["sequence"], lifecycleStatus="deprecated"
    )
    await error_of(r, 409, "lifecycle_conflict")


async def test_nothing_moves_after_revoked(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    head = await create(harness, key, token, lifecycleStatus="active")
    did = head["entryDid"]
    revoked = await updated(harness, key, token, did, head["sequence"], lifecycleStatus="revoked")
    for status in ("draft", "active", "deprecated", "revoked"):
        r = await update(harness, key, token, did, revoked["sequence"], lifecycleStatus=status)
        await error_of(r, 409, "lifecycle_conflict")
    r = await versions(harness, did)
    assert (await r.get_json())["totalCount"] == 2


# --- get, ETag, lineage ---------------------------------------------------------------------


async def test_get_entry_etag_and_if_none_match(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    did = first["entryDid"]
    client = anon_client(harness)
    r = await client.get(f"/v1/entries/{did}")
    assert r.status_code == 200
    etag = r.headers["ETag"]
    assert etag.startswith('"') or etag.startswith('W/"')
    r = await client.get(f"/v1/entries/{did}", headers={"If-None-Match": etag})
    assert r.status_code == 304
    assert await r.get_data() == b""
    assert r.headers["ETag"] == etag
    r = await client.get(f"/v1/entries/{did}", headers={"If-None-Match": '"something-else"'})
    assert r.status_code == 200
    # After an update the old validator no longer matches.
    second = await updated(harness, key, token, did, first["sequence"], version="2.0.0")
    r = await client.get(f"/v1/entries/{did}", headers={"If-None-Match": etag})
    assert r.status_code == 200
    assert await r.get_json() == second
    assert r.headers["ETag"] != etag


async def test_if_none_match_with_a_list_of_etags(harness: Harness) -> None:
    """RFC 9110 §13.1.2: If-None-Match is a list; any match means 304."""
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    did = first["entryDid"]
    r = await harness.client.get(f"/v1/entries/{did}")
    etag = r.headers["ETag"]
    r = await harness.client.get(
        f"/v1/entries/{did}", headers={"If-None-Match": f'"other", {etag}'}
    )
    assert r.status_code == 304


async def test_get_unknown_entry_is_404(harness: Harness) -> None:
    client = anon_client(harness)
    did = new_did()
    for path in (
        f"/v1/entries/{did}",
        f"/v1/entries/{did}/lineage",
        f"/v1/entries/{did}/versions",
        f"/v1/entries/{did}/versions/1",
    ):
        r = await client.get(path)
        await error_of(r, 404, "entry_not_found")


async def test_lineage_is_null_when_absent(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    served = await create(harness, key, token)
    r = await anon_client(harness).get(f"/v1/entries/{served['entryDid']}/lineage")
    assert r.status_code == 200
    assert await r.get_json() == {"entryDid": served["entryDid"], "lineage": None}


async def test_lineage_returns_the_lineage_reference(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    parent = new_did()
    reference = {"parentDid": parent, "relation": "forkOf", "generation": 2, "path": [parent]}
    served = await create(harness, key, token, lineageReference=reference)
    did = served["entryDid"]
    r = await anon_client(harness).get(f"/v1/entries/{did}/lineage")
    assert r.status_code == 200
    assert await r.get_json() == {"entryDid": did, "lineage": reference}
    # The latest version decides: an update without lineage gives null again.
    await updated(harness, key, token, did, served["sequence"], version="2.0.0")
    r = await anon_client(harness).get(f"/v1/entries/{did}/lineage")
    assert await r.get_json() == {"entryDid": did, "lineage": None}


# --- versions -------------------------------------------------------------------------------


async def _entry_with_versions(h: Harness, count: int) -> tuple[str, list[dict]]:
    key = SigningKey.generate()
    token = await sign_in(h.client, key)
    head = await create(h, key, token)
    history = [head]
    for n in range(1, count):
        head = await updated(h, key, token, head["entryDid"], head["sequence"], version=f"1.{n}")
        history.append(head)
    return head["entryDid"], history


async def test_versions_newest_first_with_paging(harness: Harness) -> None:
    did, history = await _entry_with_versions(harness, 5)
    newest_first = list(reversed(history))
    r = await versions(harness, did)
    assert r.status_code == 200
    page = await r.get_json()
    assert page["entryDid"] == did
    assert page["versions"] == newest_first
    assert page["hasMore"] is False
    assert page["totalCount"] == 5
    assert page.get("cursor") in (None, "")

    seen: list[dict] = []
    cursor = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 2}
        if cursor is not None:
            params["cursor"] = cursor
        r = await versions(harness, did, **params)
        assert r.status_code == 200, await r.get_data()
        page = await r.get_json()
        pages += 1
        assert page["totalCount"] == 5
        assert len(page["versions"]) <= 2
        seen.extend(page["versions"])
        if not page["hasMore"]:
            assert page.get("cursor") in (None, "")
            break
        assert page["cursor"] == str(page["versions"][-1]["sequence"])
        cursor = page["cursor"]
        assert pages < 10
    assert pages == 3
    assert seen == newest_first
    sequences = [v["sequence"] for v in seen]
    assert sequences == sorted(sequences, reverse=True)
    assert len(set(sequences)) == 5


async def test_a_page_of_versions_ends_once_its_documents_hold_the_page_bytes(
    database_url: str, tmp_path: Path
) -> None:
    """Versions may be 1 MiB each: a page ends early (hasMore, a cursor) once the documents
    before the next one hold `limits.versions_page_bytes`; its first version always comes, and
    paging on lists every version once."""
    config = make_config(database_url, tmp_path, limits={"versions_page_bytes": 2048})

    async def body(h: Harness) -> None:
        did, history = await _entry_with_versions(h, 6)
        sizes = [len(canonical.canonicalize(v)) for v in history]
        assert all(700 < size < 1000 for size in sizes), sizes  # so three fit, not four
        seen: list[dict] = []
        cursor = None
        pages = []
        while True:
            params: dict[str, Any] = {"limit": 100}
            if cursor is not None:
                params["cursor"] = cursor
            r = await versions(h, did, **params)
            assert r.status_code == 200, await r.get_data()
            page = await r.get_json()
            assert page["totalCount"] == 6
            seen.extend(page["versions"])
            pages.append((len(page["versions"]), page["hasMore"]))
            if not page["hasMore"]:
                break
            cursor = page["cursor"]
            assert cursor == str(page["versions"][-1]["sequence"])
        assert pages == [(3, True), (3, False)]
        assert seen == list(reversed(history))

    await with_harness(config, body)


async def test_versions_limit_is_clamped_to_max_page_size(harness: Harness) -> None:
    did, history = await _entry_with_versions(harness, 102)
    r = await versions(harness, did, limit=1000)
    assert r.status_code == 200
    page = await r.get_json()
    assert len(page["versions"]) == 100
    assert page["hasMore"] is True
    assert page["totalCount"] == 102
    assert page["versions"][0] == history[-1]
    assert page["cursor"] == str(page["versions"][-1]["sequence"])
    r = await versions(harness, did, limit=1000, cursor=page["cursor"])
    rest = await r.get_json()
    assert rest["versions"] == [history[1], history[0]]
    assert rest["hasMore"] is False
    # Default page size is 20.
    r = await versions(harness, did)
    assert len((await r.get_json())["versions"]) == 20


@pytest.mark.parametrize("limit", ["0", "-1", "abc", "1.5", ""])
async def test_versions_bad_limit_is_400(harness: Harness, limit: str) -> None:
    did, _ = await _entry_with_versions(harness, 1)
    r = await harness.client.get(f"/v1/entries/{did}/versions?limit={limit}")
    await error_of(r, 400, "invalid_limit")


@pytest.mark.parametrize("cursor", ["0", "01", "-3", "abc", "1e3", "", "%20"])
async def test_versions_bad_cursor_is_400(harness: Harness, cursor: str) -> None:
    did, _ = await _entry_with_versions(harness, 1)
    r = await harness.client.get(f"/v1/entries/{did}/versions?cursor={cursor}")
    await error_of(r, 400, "invalid_cursor")


async def test_versions_huge_cursor_is_not_a_server_error(harness: Harness) -> None:
    """A cursor matching `^[1-9][0-9]*$` beyond int64 must not give 500."""
    did, history = await _entry_with_versions(harness, 2)
    r = await harness.client.get(f"/v1/entries/{did}/versions?cursor=9999999999999999999")
    assert r.status_code in (200, 400), await r.get_data()
    if r.status_code == 400:
        await error_of(r, 400, "invalid_cursor")
    else:
        assert (await r.get_json())["versions"] == list(reversed(history))


async def test_get_one_version(harness: Harness) -> None:
    did, history = await _entry_with_versions(harness, 3)
    client = anon_client(harness)
    for version in history:
        r = await client.get(f"/v1/entries/{did}/versions/{version['sequence']}")
        assert r.status_code == 200, await r.get_data()
        assert await r.get_json() == version
        assert_publisher_signature(version)


async def test_get_version_of_another_entry_is_404(harness: Harness) -> None:
    did, _ = await _entry_with_versions(harness, 1)
    _, other_history = await _entry_with_versions(harness, 1)
    r = await harness.client.get(f"/v1/entries/{did}/versions/{other_history[0]['sequence']}")
    await error_of(r, 404, "version_not_found")


@pytest.mark.parametrize("sequence", ["0", "abc", "-1", "01"])
async def test_get_version_bad_sequence_is_400(harness: Harness, sequence: str) -> None:
    did, _ = await _entry_with_versions(harness, 1)
    r = await harness.client.get(f"/v1/entries/{did}/versions/{sequence}")
    await error_of(r, 400, "invalid_sequence")


async def test_get_version_beyond_int64_is_not_a_server_error(harness: Harness) -> None:
    did, _ = await _entry_with_versions(harness, 1)
    r = await harness.client.get(f"/v1/entries/{did}/versions/9999999999999999999")
    assert r.status_code in (400, 404), await r.get_data()


# --- delete ---------------------------------------------------------------------------------


async def test_delete_writes_a_tombstone_and_hides_the_entry(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    did = first["entryDid"]
    r = await harness.client.delete(f"/v1/entries/{did}", headers=bearer(token, **idem()))
    assert r.status_code == 200, await r.get_data()
    tombstone = await r.get_json()
    assert set(tombstone) == {"entryDid", "lifecycleStatus", "sequence", "deletedAt"}
    assert tombstone["entryDid"] == did
    assert tombstone["lifecycleStatus"] == "deleted"
    assert tombstone["sequence"] > first["sequence"]
    assert RFC3339.match(tombstone["deletedAt"])

    client = anon_client(harness)
    for path in (
        f"/v1/entries/{did}",
        f"/v1/entries/{did}/versions",
        f"/v1/entries/{did}/lineage",
        f"/v1/entries/{did}/versions/{first['sequence']}",
    ):
        r = await client.get(path)
        await error_of(r, 404, "entry_not_found")

    # design §4: "Updating a revoked or deleted entry → 409 lifecycle_conflict".
    for based_on in (first["sequence"], tombstone["sequence"]):
        r = await update(harness, key, token, did, based_on)
        error = await error_of(r, 409, "lifecycle_conflict")
        assert error["details"]["from"] == "deleted", error

    r = await harness.client.delete(f"/v1/entries/{did}", headers=bearer(token, **idem()))
    await error_of(r, 404, "entry_not_found")


async def test_deleted_did_is_never_reused(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    did = first["entryDid"]
    r = await harness.client.delete(f"/v1/entries/{did}", headers=bearer(token, **idem()))
    assert r.status_code == 200
    again = signed_entry(key, did)
    r = await harness.client.post("/v1/entries", json=again, headers=bearer(token, **idem()))
    await error_of(r, 409, "entry_exists")
    other = SigningKey.generate()
    other_token = await sign_in(harness.client, other)
    theirs = signed_entry(other, did)
    r = await harness.client.post("/v1/entries", json=theirs, headers=bearer(other_token, **idem()))
    await error_of(r, 409, "entry_exists")
    r = await harness.client.get(f"/v1/entries/{did}")
    await error_of(r, 404, "entry_not_found")


async def test_delete_by_another_principal_is_403(harness: Harness) -> None:
    owner = SigningKey.generate()
    owner_token = await sign_in(harness.client, owner)
    first = await create(harness, owner, owner_token)
    did = first["entryDid"]
    intruder_token = await sign_in(harness.client, SigningKey.generate())
    r = await harness.client.delete(f"/v1/entries/{did}", headers=bearer(intruder_token, **idem()))
    await error_of(r, 403, "publisher_mismatch")
    r = await harness.client.get(f"/v1/entries/{did}")
    assert await r.get_json() == first


async def test_delete_without_session_is_401_and_unknown_is_404(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    r = await anon_client(harness).delete(f"/v1/entries/{first['entryDid']}", headers=idem())
    await error_of(r, 401, "session_missing")
    r = await harness.client.delete(f"/v1/entries/{new_did()}", headers=bearer(token, **idem()))
    await error_of(r, 404, "entry_not_found")
    r = await harness.client.get(f"/v1/entries/{first['entryDid']}")
    assert r.status_code == 200


async def test_registry_min_sequence_is_checked_on_reads_only(harness: Harness) -> None:
    """docs/replicas.md: a GET's Registry-Min-Sequence is a decimal 0..2^63-1, else 400
    `invalid_min_sequence`; a write does not read it (its reads are the primary's)."""
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    r = await harness.client.post(
        "/v1/entries",
        json=entry,
        headers=bearer(token, **idem(), **{"Registry-Min-Sequence": "soon"}),
    )
    assert r.status_code == 201, await r.get_data()
    sequence = r.headers["Registry-Sequence"]
    client = anon_client(harness)
    path = f"/v1/entries/{entry['entryDid']}"
    for bad in ("soon", "-1", "1.5", "٣", str(2**63)):
        r = await client.get(path, headers={"Registry-Min-Sequence": bad})
        await error_of(r, 400, "invalid_min_sequence")
    for good in ("0", sequence, str(2**63 - 1)):
        r = await client.get(path, headers={"Registry-Min-Sequence": good})
        assert r.status_code == 200, (good, await r.get_data())


async def test_a_repeated_registry_min_sequence_is_refused(harness: Harness) -> None:
    """Two `Registry-Min-Sequence` lines mean what one line of both values joined by a comma
    means (RFC 9110 §5.3): not a sequence, `400 invalid_min_sequence`. Read as its first line,
    `0` and a sequence the process has not followed were answered from its caches, a state
    that may predate the sequence the client named (a proxy may keep the last line)."""
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    assert r.status_code == 201, await r.get_data()
    path = f"/v1/entries/{entry['entryDid']}"
    client = anon_client(harness)
    for lines in (["0", str(2**63 - 1)], ["7", "7"]):
        headers = Headers([("Registry-Min-Sequence", line) for line in lines])
        r = await client.get(path, headers=headers)
        await error_of(r, 400, "invalid_min_sequence")
    for value in ("0, 7", ""):
        r = await client.get(path, headers={"Registry-Min-Sequence": value})
        await error_of(r, 400, "invalid_min_sequence")


async def test_a_repeated_query_parameter_is_read_from_its_first_occurrence(
    harness: Harness,
) -> None:
    """docs/api.md, "Query parameters": the first occurrence wins, the later ones are ignored."""
    did, _ = await _entry_with_versions(harness, 2)
    r = await harness.client.get(f"/v1/entries/{did}/versions?limit=1&limit=abc")
    assert r.status_code == 200, await r.get_data()
    assert len((await r.get_json())["versions"]) == 1
    r = await harness.client.get(f"/v1/entries/{did}/versions?limit=abc&limit=1")
    await error_of(r, 400, "invalid_limit")


async def test_the_widest_valid_entry_is_stored_and_a_longer_did_is_400(harness: Harness) -> None:
    """The longest DID a new entry may have beside the widest name (256 characters of 4 UTF-8
    bytes, incompressible): their row in the name ordering's index must fit PostgreSQL's B-tree
    limit (a 2,048-character DID did not: SQLSTATE 54000 ended the writer, and the process with
    it). A DID up to 2,048 characters stays valid elsewhere (a peer's entry, an older one)."""
    import random
    import string

    from registry.usecases.entries import MAX_NEW_ENTRY_DID_LENGTH

    rnd = random.Random(1)
    prefix = "did:example:"
    did = prefix + "".join(
        rnd.choice(string.ascii_letters + string.digits)
        for _ in range(MAX_NEW_ENTRY_DID_LENGTH - len(prefix))
    )
    name = "".join(chr(rnd.randrange(0x20000, 0x2A6DF)) for _ in range(256))
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key, did, name=name)
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    assert r.status_code == 201, await r.get_data()
    r = await harness.client.get(f"/v1/entries/{did}")
    assert (await r.get_json())["name"] == name
    r = await harness.client.post(
        "/v1/discover",
        json={"entryType": "*", "publisherDid": key.did, "orderBy": "name"},
        headers=bearer(token),
    )
    assert [e["entryDid"] for e in (await r.get_json())["entries"]] == [did]
    longer = signed_entry(key, did + "x", name=name)
    r = await harness.client.post("/v1/entries", json=longer, headers=bearer(token, **idem()))
    error = await error_of(r, 400, "entry_invalid")
    assert "entryDid" in [e["field"] for e in error["details"]["errors"]], error
    # The writer and the process are still there.
    r = await harness.client.post(
        "/v1/entries", json=signed_entry(key), headers=bearer(token, **idem())
    )
    assert r.status_code == 201, await r.get_data()


def _interleave_before(harness: Harness, kind: str, run: Any) -> None:
    """Run `run()` once, after the use-case decided a change of `kind` and before it is
    appended: what another request committing in between does."""
    changes = harness.service.deps.entries.changes
    original = changes._append
    state = {"done": False}

    async def append(change: Any, key: Any) -> Any:
        if change.kind == kind and not state["done"]:
            state["done"] = True
            await run()
        return await original(change, key)

    changes._append = append  # type: ignore[method-assign]


async def test_a_delete_that_races_an_update_still_deletes(harness: Harness) -> None:
    """A delete has no sequence precondition: an update committed between its decision and its
    append makes it decide again (it was a recorded 409 sequence_conflict: its key answered
    that for 24 h, so a retry never deleted)."""
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    did = first["entryDid"]

    async def concurrent_update() -> None:
        await updated(harness, key, token, did, first["sequence"])

    _interleave_before(harness, "entry.deleted", concurrent_update)
    headers = bearer(token, **idem())
    r = await harness.client.delete(f"/v1/entries/{did}", headers=headers)
    assert r.status_code == 200, await r.get_data()
    tombstone = await r.get_json()
    assert tombstone["lifecycleStatus"] == "deleted"
    r = await harness.client.delete(f"/v1/entries/{did}", headers=headers)  # the same key
    assert (r.status_code, await r.get_json()) == (200, tombstone)
    await error_of(await harness.client.get(f"/v1/entries/{did}"), 404, "entry_not_found")


async def test_the_delete_that_loses_a_race_with_another_is_404(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    did = (await create(harness, key, token))["entryDid"]

    async def concurrent_delete() -> None:
        r = await harness.client.delete(f"/v1/entries/{did}", headers=bearer(token, **idem()))
        assert r.status_code == 200, await r.get_data()

    _interleave_before(harness, "entry.deleted", concurrent_delete)
    r = await harness.client.delete(f"/v1/entries/{did}", headers=bearer(token, **idem()))
    await error_of(r, 404, "entry_not_found")


async def test_a_key_id_without_its_fragment_is_refused(harness: Harness) -> None:
    """design §3: a key id is `did:key:z…#z…`; a bare DID was accepted and served."""
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = sign_entry(entry_template(), key)
    entry["signature"]["keyId"] = key.did  # keyId is outside the signed payload
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    await error_of(r, 400, "signature_key_invalid")


async def test_a_null_signature_created_is_filled_in(harness: Harness) -> None:
    """`created` is not signed and optional: null is taken as absent and filled in (it was
    served as null, where spec 2.1 types it a string)."""
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = sign_entry(entry_template(), key)
    entry["signature"]["created"] = None
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    assert r.status_code == 201, await r.get_data()
    served = await r.get_json()
    assert served["signature"]["created"] == served["updatedAt"], served["signature"]


@pytest.mark.parametrize(
    ("limit", "size"),
    [("9007199254740992", 3), ("9223372036854775807", 3), ("2.0", 2), ("1.000", 1)],
)
async def test_any_int64_limit_is_clamped_and_a_whole_number_may_have_a_zero_fraction(
    harness: Harness, limit: str, size: int
) -> None:
    """Spec 4.1: `limit` is an int64, clamped above the maximum page size (one beyond 2^53−1
    was 400); docs/api.md: `2.0` is the integer 2."""
    did, _ = await _entry_with_versions(harness, 3)
    r = await harness.client.get(f"/v1/entries/{did}/versions?limit={limit}")
    assert r.status_code == 200, await r.get_data()
    assert len((await r.get_json())["versions"]) == size


@pytest.mark.parametrize("limit", ["9223372036854775808", "1" * 40, "1.5", "2.", ".0"])
async def test_a_limit_beyond_int64_or_not_whole_is_400(harness: Harness, limit: str) -> None:
    did, _ = await _entry_with_versions(harness, 1)
    r = await harness.client.get(f"/v1/entries/{did}/versions?limit={limit}")
    await error_of(r, 400, "invalid_limit")
