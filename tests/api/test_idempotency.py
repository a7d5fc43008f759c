"""Idempotency-Key on every mutating operation (design §6), over HTTP and real PostgreSQL."""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

import pytest
import trio_asyncio
from werkzeug.datastructures import Headers

from api.http import Ctx
from api.idempotency import fingerprint
from registry import canonical
from registry.changes import IDEMPOTENCY_WINDOW_MS
from registry.keys import SigningKey
from tests.api.api_support import (
    JSON,
    anon_client,
    create,
    error_of,
    total_versions,
)
from tests.conftest import Harness
from tests.helpers import bearer, sign_in, signed_entry


def key_header() -> dict[str, str]:
    return {"Idempotency-Key": f"k-{uuid.uuid4()}"}


# --- missing or malformed key -----------------------------------------------------------------


async def test_create_without_key_is_400_and_creates_nothing(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token))
    await error_of(r, 400, "idempotency_key_required")
    r = await harness.client.post(
        "/v1/entries", json=entry, headers=bearer(token, **{"Idempotency-Key": ""})
    )
    await error_of(r, 400, "idempotency_key_required")
    r = await harness.client.get(f"/v1/entries/{entry['entryDid']}")
    await error_of(r, 404, "entry_not_found")


async def test_update_without_key_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    did = first["entryDid"]
    entry = signed_entry(key, did, sequence=first["sequence"], version="2")
    r = await harness.client.put(f"/v1/entries/{did}", json=entry, headers=bearer(token))
    await error_of(r, 400, "idempotency_key_required")
    assert await total_versions(harness, did) == 1


async def test_delete_without_key_is_400(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    r = await harness.client.delete(f"/v1/entries/{first['entryDid']}", headers=bearer(token))
    await error_of(r, 400, "idempotency_key_required")
    r = await harness.client.get(f"/v1/entries/{first['entryDid']}")
    assert r.status_code == 200


async def test_logout_without_key_is_400_and_keeps_the_session(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    client = anon_client(harness)
    r = await client.post("/v1/auth/logout", headers=bearer(token))
    await error_of(r, 400, "idempotency_key_required")
    r = await client.get("/v1/auth/session", headers=bearer(token))
    assert r.status_code == 200


@pytest.mark.parametrize("bad", ["a b", "x" * 256, "\u00e9t\u00e9"])
async def test_malformed_key_is_400(harness: Harness, bad: str) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    headers = bearer(token, **{"Idempotency-Key": bad})
    r = await harness.client.post("/v1/entries", json=entry, headers=headers)
    await error_of(r, 400, "idempotency_key_invalid")
    r = await harness.client.get(f"/v1/entries/{entry['entryDid']}")
    assert r.status_code == 404


async def test_two_keys_on_one_request_are_400_and_nothing_is_written(harness: Harness) -> None:
    # Which one is meant? A proxy that keys on the last would disagree with a registry that
    # took the first (it did): the same request, two keys.
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    headers = Headers(bearer(token))
    headers.add("Idempotency-Key", "dup-a")
    headers.add("Idempotency-Key", "dup-b")
    r = await harness.client.post("/v1/entries", json=entry, headers=headers)
    await error_of(r, 400, "idempotency_key_invalid")
    r = await harness.client.get(f"/v1/entries/{entry['entryDid']}")
    assert r.status_code == 404


@pytest.mark.parametrize("key", [None, "", "a b"])
async def test_a_body_that_is_not_json_is_invalid_json_before_the_key_is_read(
    harness: Harness, key: str | None
) -> None:
    """docs/api.md, order of checks: JSON parsing (`invalid_json`), then the Idempotency-Key."""
    token = await sign_in(harness.client, SigningKey.generate())
    headers = bearer(token, **JSON)
    if key is not None:
        headers["Idempotency-Key"] = key
    r = await harness.client.post("/v1/entries", data=b"{not json", headers=headers)
    await error_of(r, 400, "invalid_json")


async def test_longest_valid_key_is_accepted(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    headers = bearer(token, **{"Idempotency-Key": "~" * 255})
    r = await harness.client.post("/v1/entries", json=signed_entry(key), headers=headers)
    assert r.status_code == 201, await r.get_data()


# --- replay ---------------------------------------------------------------------------------


async def test_create_replay_returns_the_same_outcome_once(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    headers = bearer(token, **key_header())
    first = await harness.client.post("/v1/entries", json=entry, headers=headers)
    assert first.status_code == 201, await first.get_data()
    assert first.headers.get("Idempotent-Replayed") is None
    body = await first.get_data()
    again = await harness.client.post("/v1/entries", json=entry, headers=headers)
    assert again.status_code == 201, await again.get_data()
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert await again.get_data() == body
    assert again.headers.get("X-Request-Id")
    assert await total_versions(harness, entry["entryDid"]) == 1


async def test_replay_ignores_whitespace_and_member_order(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    headers = bearer(token, **key_header())
    first = await harness.client.post("/v1/entries", json=entry, headers=headers)
    assert first.status_code == 201
    reordered = json.dumps(dict(reversed(list(entry.items()))), indent=3).encode()
    again = await harness.client.post("/v1/entries", data=reordered, headers={**headers, **JSON})
    assert again.status_code == 201, await again.get_data()
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert await again.get_data() == await first.get_data()


async def test_update_replay_creates_no_second_version(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    did = first["entryDid"]
    entry = signed_entry(key, did, sequence=first["sequence"], version="2.0.0")
    headers = bearer(token, **key_header())
    r1 = await harness.client.put(f"/v1/entries/{did}", json=entry, headers=headers)
    assert r1.status_code == 200, await r1.get_data()
    r2 = await harness.client.put(f"/v1/entries/{did}", json=entry, headers=headers)
    assert r2.status_code == 200, await r2.get_data()
    assert r2.headers.get("Idempotent-Replayed") == "true"
    assert await r2.get_data() == await r1.get_data()
    assert await total_versions(harness, did) == 2
    # The replay is not a sequence conflict even though `sequence` is now stale.
    r = await harness.client.get(f"/v1/entries/{did}")
    assert await r.get_data() == await r1.get_data()


async def test_delete_replay_returns_the_same_tombstone(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    did = first["entryDid"]
    headers = bearer(token, **key_header())
    r1 = await harness.client.delete(f"/v1/entries/{did}", headers=headers)
    assert r1.status_code == 200, await r1.get_data()
    r2 = await harness.client.delete(f"/v1/entries/{did}", headers=headers)
    assert r2.status_code == 200, await r2.get_data()
    assert r2.headers.get("Idempotent-Replayed") == "true"
    assert await r2.get_data() == await r1.get_data()


async def test_logout_replay(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    client = anon_client(harness)
    headers = bearer(token, **key_header())
    r = await client.post("/v1/auth/logout", headers=headers)
    assert r.status_code == 200
    # The session is gone, so even the same request is now unauthenticated.
    r = await client.post("/v1/auth/logout", headers=headers)
    await error_of(r, 401, "session_invalid")


# --- conflict -------------------------------------------------------------------------------


async def test_same_key_different_body_is_409(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    headers = bearer(token, **key_header())
    entry = signed_entry(key)
    r = await harness.client.post("/v1/entries", json=entry, headers=headers)
    assert r.status_code == 201
    other = signed_entry(key)
    r = await harness.client.post("/v1/entries", json=other, headers=headers)
    await error_of(r, 409, "idempotency_conflict")
    r = await harness.client.get(f"/v1/entries/{other['entryDid']}")
    await error_of(r, 404, "entry_not_found")
    # The original outcome is still the one replayed.
    r = await harness.client.post("/v1/entries", json=entry, headers=headers)
    assert r.status_code == 201
    assert r.headers.get("Idempotent-Replayed") == "true"


async def test_a_key_answers_for_the_idempotency_window_and_no_longer(harness: Harness) -> None:
    """IDEMPOTENCY_WINDOW_MS (registry/changes.py) is the one window: the append path and the
    refusals recorded before it stop answering from a record older than it."""
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    headers = bearer(token, **key_header())
    first, second = signed_entry(key), signed_entry(key)
    assert (
        await harness.client.post("/v1/entries", json=first, headers=headers)
    ).status_code == 201
    pool_execute = trio_asyncio.aio_as_trio(harness.store._pool.execute)  # type: ignore[attr-defined]

    async def execute(sql: str) -> None:
        await pool_execute(sql + " WHERE key = $1", headers["Idempotency-Key"])

    age = f"{IDEMPOTENCY_WINDOW_MS - 60_000} milliseconds"
    await execute(f"UPDATE idempotency SET created_at = now() - interval '{age}'")
    r = await harness.client.post("/v1/entries", json=second, headers=headers)
    await error_of(r, 409, "idempotency_conflict")  # still inside the window
    # A refusal recorded before the append path (a bad body) answers the same way.
    r = await harness.client.post("/v1/entries", json={"not": "an entry"}, headers=headers)
    await error_of(r, 409, "idempotency_conflict")

    age = f"{IDEMPOTENCY_WINDOW_MS + 60_000} milliseconds"
    await execute(f"UPDATE idempotency SET created_at = now() - interval '{age}'")
    r = await harness.client.post("/v1/entries", json=second, headers=headers)
    assert r.status_code == 201
    assert r.headers.get("Idempotent-Replayed") is None
    await execute(f"UPDATE idempotency SET created_at = now() - interval '{age}'")
    r = await harness.client.post("/v1/entries", json={"not": "an entry"}, headers=headers)
    assert r.status_code == 400


async def test_same_key_different_path_is_409(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    a = await create(harness, key, token)
    b = await create(harness, key, token)
    headers = bearer(token, **key_header())
    r = await harness.client.delete(f"/v1/entries/{a['entryDid']}", headers=headers)
    assert r.status_code == 200
    r = await harness.client.delete(f"/v1/entries/{b['entryDid']}", headers=headers)
    await error_of(r, 409, "idempotency_conflict")
    r = await harness.client.get(f"/v1/entries/{b['entryDid']}")
    assert r.status_code == 200


async def test_update_same_key_different_body_is_409(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    did = first["entryDid"]
    headers = bearer(token, **key_header())
    one = signed_entry(key, did, sequence=first["sequence"], version="2.0.0")
    r = await harness.client.put(f"/v1/entries/{did}", json=one, headers=headers)
    assert r.status_code == 200
    two = signed_entry(key, did, sequence=first["sequence"], version="3.0.0")
    r = await harness.client.put(f"/v1/entries/{did}", json=two, headers=headers)
    await error_of(r, 409, "idempotency_conflict")
    assert await total_versions(harness, did) == 2


# --- replay of 4xx outcomes -----------------------------------------------------------------


async def test_replay_of_a_4xx_outcome_returns_the_same_4xx(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    did = first["entryDid"]
    second = signed_entry(key, did, sequence=first["sequence"], version="2.0.0")
    r = await harness.client.put(
        f"/v1/entries/{did}", json=second, headers=bearer(token, **key_header())
    )
    assert r.status_code == 200
    # A stale update fails with 409 sequence_conflict; replaying it gives the same answer.
    stale = signed_entry(key, did, sequence=first["sequence"], version="3.0.0")
    headers = bearer(token, **key_header())
    r1 = await harness.client.put(f"/v1/entries/{did}", json=stale, headers=headers)
    await error_of(r1, 409, "sequence_conflict")
    r2 = await harness.client.put(f"/v1/entries/{did}", json=stale, headers=headers)
    assert r2.status_code == 409
    assert r2.headers.get("Idempotent-Replayed") == "true"
    assert await same_error(r2, r1)
    await error_of(r2, 409, "sequence_conflict", own_request_id=False)
    assert await total_versions(harness, did) == 2


async def test_replay_of_a_400_outcome(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    broken = {**entry, "name": "changed after signing"}
    headers = bearer(token, **key_header())
    r1 = await harness.client.post("/v1/entries", json=broken, headers=headers)
    await error_of(r1, 400, "signature_invalid")
    r2 = await harness.client.post("/v1/entries", json=broken, headers=headers)
    assert r2.status_code == 400
    assert r2.headers.get("Idempotent-Replayed") == "true"
    assert await same_error(r2, r1)
    # A corrected body under the same key is a different request.
    r3 = await harness.client.post("/v1/entries", json=entry, headers=headers)
    await error_of(r3, 409, "idempotency_conflict")
    r = await harness.client.get(f"/v1/entries/{entry['entryDid']}")
    assert r.status_code == 404


async def test_replay_of_a_403_outcome(harness: Harness) -> None:
    me = SigningKey.generate()
    token = await sign_in(harness.client, me)
    theirs = signed_entry(SigningKey.generate())
    headers = bearer(token, **key_header())
    r1 = await harness.client.post("/v1/entries", json=theirs, headers=headers)
    await error_of(r1, 403, "publisher_mismatch")
    r2 = await harness.client.post("/v1/entries", json=theirs, headers=headers)
    assert r2.status_code == 403
    assert r2.headers.get("Idempotent-Replayed") == "true"
    assert await same_error(r2, r1)


async def test_replay_of_entry_exists(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    first = await create(harness, key, token)
    again = signed_entry(key, first["entryDid"], version="9")
    headers = bearer(token, **key_header())
    r1 = await harness.client.post("/v1/entries", json=again, headers=headers)
    await error_of(r1, 409, "entry_exists")
    r2 = await harness.client.post("/v1/entries", json=again, headers=headers)
    assert r2.status_code == 409
    assert r2.headers.get("Idempotent-Replayed") == "true"
    assert await same_error(r2, r1)


# --- scope ----------------------------------------------------------------------------------


async def test_same_key_for_two_principals_is_independent(harness: Harness) -> None:
    alice = SigningKey.generate()
    bob = SigningKey.generate()
    alice_token = await sign_in(harness.client, alice)
    bob_token = await sign_in(harness.client, bob)
    shared = key_header()
    a = signed_entry(alice)
    b = signed_entry(bob)
    ra = await harness.client.post("/v1/entries", json=a, headers=bearer(alice_token, **shared))
    assert ra.status_code == 201, await ra.get_data()
    rb = await harness.client.post("/v1/entries", json=b, headers=bearer(bob_token, **shared))
    assert rb.status_code == 201, await rb.get_data()
    assert rb.headers.get("Idempotent-Replayed") is None
    assert (await rb.get_json())["publisherDid"] == bob.did
    assert (await ra.get_json())["publisherDid"] == alice.did
    for entry in (a, b):
        r = await harness.client.get(f"/v1/entries/{entry['entryDid']}")
        assert r.status_code == 200


async def test_same_key_same_body_other_principal_is_not_a_replay(harness: Harness) -> None:
    alice = SigningKey.generate()
    alice_token = await sign_in(harness.client, alice)
    mallory_token = await sign_in(harness.client, SigningKey.generate())
    shared = key_header()
    entry = signed_entry(alice)
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(alice_token, **shared))
    assert r.status_code == 201
    # Mallory reuses Alice's key and body: she gets her own outcome, not Alice's stored 201.
    r = await harness.client.post(
        "/v1/entries", json=entry, headers=bearer(mallory_token, **shared)
    )
    assert r.headers.get("Idempotent-Replayed") is None
    await error_of(r, 403, "publisher_mismatch")


async def test_same_key_for_different_operations_is_independent(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    shared = key_header()
    entry = signed_entry(key)
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **shared))
    assert r.status_code == 201
    created = await r.get_json()
    did = entry["entryDid"]
    update = signed_entry(key, did, sequence=created["sequence"], version="2")
    r = await harness.client.put(f"/v1/entries/{did}", json=update, headers=bearer(token, **shared))
    assert r.status_code == 200, await r.get_data()
    assert r.headers.get("Idempotent-Replayed") is None
    r = await harness.client.delete(f"/v1/entries/{did}", headers=bearer(token, **shared))
    assert r.status_code == 200, await r.get_data()
    assert (await r.get_json())["lifecycleStatus"] == "deleted"


async def test_same_key_from_a_new_session_of_the_same_principal_replays(
    harness: Harness,
) -> None:
    key = SigningKey.generate()
    first_token = await sign_in(harness.client, key)
    second_token = await sign_in(harness.client, key)
    shared = key_header()
    entry = signed_entry(key)
    r1 = await harness.client.post("/v1/entries", json=entry, headers=bearer(first_token, **shared))
    assert r1.status_code == 201
    r2 = await harness.client.post(
        "/v1/entries", json=entry, headers=bearer(second_token, **shared)
    )
    assert r2.status_code == 201
    assert r2.headers.get("Idempotent-Replayed") == "true"
    assert await r2.get_data() == await r1.get_data()


async def same_error(replay: Any, first: Any) -> bool:
    """A replayed refusal answers the recorded status, code, message and details; its requestId
    is the replay's own (it matches the replay's X-Request-Id)."""
    a, b = (await replay.get_json())["error"], (await first.get_json())["error"]
    assert a["requestId"] == replay.headers["X-Request-Id"]
    assert replay.status_code == first.status_code
    return {k: v for k, v in a.items() if k != "requestId"} == {
        k: v for k, v in b.items() if k != "requestId"
    }


async def test_a_write_names_the_position_it_took_and_its_replay_the_same(
    harness: Harness,
) -> None:
    """`Registry-Sequence` (docs/replicas.md): what a client sends back as
    `Registry-Min-Sequence` to read its write through another process."""
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    headers = bearer(token, **key_header())
    r = await harness.client.post("/v1/entries", json=entry, headers=headers)
    assert r.status_code == 201
    sequence = (await r.get_json())["sequence"]
    assert r.headers["Registry-Sequence"] == str(sequence)
    again = await harness.client.post("/v1/entries", json=entry, headers=headers)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Registry-Sequence"] == str(sequence)
    r = await harness.client.get(
        f"/v1/entries/{entry['entryDid']}", headers={"Registry-Min-Sequence": str(sequence)}
    )
    assert r.status_code == 200  # no replica: every read has every committed change
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **key_header()))
    await error_of(r, 409, "entry_exists")
    assert "Registry-Sequence" not in r.headers  # a refusal took no position


# --- the fingerprint ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b'{"b": 1, "a": [1.5, 1e-7, "\\u00e9"], "\\ud83d\\ude00": {"z": null, "y": true},'
        b' "\\u00e9": 2, "\\uff21": 3}',
        b"[3, 2, 1]",
        b'"text"',
        b"{}",
    ],
)
def test_the_fingerprint_is_sha256_of_method_path_and_jcs_of_the_body(body: bytes) -> None:
    """Records written before stay comparable: an object's JCS joined from its members (which
    the entry checks reuse) is the JCS of the whole body, member order by UTF-16 included."""
    ctx = Ctx(request_id="r", body=body)
    expected = hashlib.sha256(
        b"POST\0/v1/entries\0" + canonical.canonicalize(json.loads(body))
    ).digest()
    assert fingerprint("POST", "/v1/entries", ctx) == expected
    if body.startswith(b"{"):
        assert ctx.members() == canonical.canonical_members(json.loads(body))
    else:
        assert ctx.members() is None
