"""Ownership transfer offers over HTTP and PostgreSQL (spec 2.7, 3, 4.2; design §6, §8, §12).

Every success path and every refusal of create / get / accept / decline / cancel, with the exact
error code, plus idempotent replays and the races a recipient and an owner can run into.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from registry.changes import rfc3339_ms
from registry.entries import sign_entry
from registry.keys import SigningKey
from registry.models import parse_datetime
from registry.trust import sign_offer
from registry.usecases.common import now_ms
from registry.vc import issue_credential
from tests.api.api_support import (
    JSON,
    anon_client,
    create,
    error_of,
    total_versions,
    with_harness,
)
from tests.conftest import Harness, make_config
from tests.helpers import bearer, idem, next_version, sign_in, signed_entry

DAY_MS = 24 * 3600 * 1000
UNSIGNED = ("signature", "anchorState", "updatedAt", "verifiableAttestations")


# --- the world of a transfer -------------------------------------------------------------------


@dataclass
class World:
    h: Harness
    owner: SigningKey
    owner_t: str
    recipient: SigningKey
    recipient_t: str
    other: SigningKey
    other_t: str
    entry: dict[str, Any]  # as created by the owner

    @property
    def did(self) -> str:
        return str(self.entry["entryDid"])


@pytest.fixture
async def world(harness: Harness) -> World:
    return await make_world(harness)


async def make_world(harness: Harness) -> World:
    owner, recipient, other = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    owner_t, recipient_t, other_t = [
        await sign_in(harness.client, k) for k in (owner, recipient, other)
    ]
    entry = await create(harness, owner, owner_t, description="an agent worth having")
    return World(harness, owner, owner_t, recipient, recipient_t, other, other_t, entry)


@contextmanager
def clock(target: Any, at_ms: int) -> Iterator[None]:
    """The use-case `target` reads `at_ms` as the time, until the block ends."""
    saved: Callable[[], int] = target.clock_ms
    target.clock_ms = lambda: at_ms
    try:
        yield
    finally:
        target.clock_ms = saved


def offer_body(
    w: World,
    *,
    signer: SigningKey | None = None,
    sequence: int | None = None,
    recipient: str | None = None,
    expires_at: str | None = None,
    entry_did: str | None = None,
) -> dict[str, Any]:
    did = entry_did or w.did
    seq = w.entry["sequence"] if sequence is None else sequence
    to = recipient or w.recipient.did
    body: dict[str, Any] = {
        "entryDid": did,
        "entrySequence": seq,
        "recipientDid": to,
        "ownerSignature": sign_offer(
            signer or w.owner,
            entry_did=did,
            entry_sequence=seq,
            recipient_did=to,
            expires_at=expires_at,
        ),
    }
    if expires_at is not None:
        body["expiresAt"] = expires_at
    return body


async def post(
    w: World, path: str, token: str | None, body: Any = None, *, key: str | None = None
) -> Any:
    headers: dict[str, str] = {"Idempotency-Key": key or str(uuid.uuid4())}
    if token is not None:
        headers = bearer(token, **headers)
    client = w.h.client if token is not None else anon_client(w.h)
    if body is None:
        return await client.post(path, headers=headers)
    return await client.post(path, json=body, headers=headers)


async def make_offer(w: World, **fields: Any) -> dict[str, Any]:
    r = await post(w, "/v1/transfers/offers", w.owner_t, offer_body(w, **fields))
    assert r.status_code == 201, await r.get_data()
    return dict(await r.get_json())


async def get_offer(w: World, offer_id: str) -> dict[str, Any]:
    r = await w.h.client.get(f"/v1/transfers/offers/{offer_id}")
    assert r.status_code == 200, await r.get_data()
    return dict(await r.get_json())


async def head(w: World) -> dict[str, Any]:
    r = await w.h.client.get(f"/v1/entries/{w.did}")
    assert r.status_code == 200, await r.get_data()
    return dict(await r.get_json())


def moved(snapshot: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """The snapshot's publisher-authored fields and its sequence, with `changes` applied."""
    out = {k: v for k, v in snapshot.items() if k not in UNSIGNED}
    out.update(changes)
    return out


def recipient_entry(w: World, snapshot: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """What a well-behaved recipient submits: the snapshot, re-signed by the recipient."""
    return sign_entry(moved(snapshot, **changes), w.recipient)


async def accept(
    w: World, offer_id: str, entry: Any, *, token: str | None = None, key: str | None = None
) -> Any:
    return await post(
        w,
        f"/v1/transfers/offers/{offer_id}/accept",
        w.recipient_t if token is None else token,
        {"entry": entry},
        key=key,
    )


async def update_as_owner(w: World, based_on: int, **fields: Any) -> Any:
    fields.setdefault("version", next_version())
    entry = signed_entry(w.owner, w.did, sequence=based_on, **fields)
    return await w.h.client.put(
        f"/v1/entries/{w.did}", json=entry, headers=bearer(w.owner_t, **idem())
    )


async def assert_untouched(w: World, offer_id: str, snapshot: dict[str, Any]) -> None:
    """A refused accept wrote nothing: the offer is open and the entry is the snapshot."""
    assert (await get_offer(w, offer_id))["status"] == "offered"
    assert await head(w) == snapshot


async def log_kinds(w: World, after: int) -> list[tuple[int, str]]:
    return [(r.seq, r.kind) for r in await w.h.store.log_after(after, 1000) if r.entry_did == w.did]


# --- create ------------------------------------------------------------------------------------


async def test_owner_creates_an_offer_that_reads_back_offered_with_every_field(
    world: World,
) -> None:
    w = world
    before = await w.h.store.log_head()
    body = offer_body(w)
    r = await post(w, "/v1/transfers/offers", w.owner_t, body)
    assert r.status_code == 201, await r.get_data()
    offer = await r.get_json()
    assert offer["offerId"]
    assert offer["entryDid"] == w.did
    assert offer["entrySequence"] == w.entry["sequence"]
    assert offer["ownerDid"] == w.owner.did
    assert offer["recipientDid"] == w.recipient.did
    assert offer["status"] == "offered"
    assert {k: offer["ownerSignature"][k] for k in ("algorithm", "keyId", "value")} == body[
        "ownerSignature"
    ]
    assert offer["ownerSignature"]["created"]
    created = parse_datetime(offer["createdAt"])
    expires = parse_datetime(offer["expiresAt"])
    assert (expires - created).total_seconds() == 7 * 24 * 3600  # the default lifetime
    assert await get_offer(w, offer["offerId"]) == offer
    assert await log_kinds(w, before) == [(before + 1, "transfer.offered")]


async def test_offer_with_an_explicit_expiry_keeps_it(world: World) -> None:
    w = world
    expires_at = rfc3339_ms(now_ms() + 2 * DAY_MS)
    offer = await make_offer(w, expires_at=expires_at)
    assert offer["expiresAt"] == expires_at


async def test_offer_expiry_may_be_exactly_thirty_days_but_not_a_millisecond_more(
    world: World,
) -> None:
    w = world
    t = now_ms()
    with clock(w.h.deps.transfers, t):
        r = await post(
            w,
            "/v1/transfers/offers",
            w.owner_t,
            offer_body(w, expires_at=rfc3339_ms(t + 30 * DAY_MS + 1)),
        )
        error = await error_of(r, 400, "invalid_expiry")
        assert error["details"]["field"] == "expiresAt"
        offer = await make_offer(w, expires_at=rfc3339_ms(t + 30 * DAY_MS))
    assert offer["status"] == "offered"


@pytest.mark.parametrize(
    ("make_body", "code", "field"),
    [
        pytest.param(lambda w: [offer_body(w)], "offer_invalid", None, id="not-an-object"),
        pytest.param(
            lambda w: {k: v for k, v in offer_body(w).items() if k != "recipientDid"},
            "offer_invalid",
            "recipientDid",
            id="recipient-missing",
        ),
        pytest.param(
            lambda w: {**offer_body(w), "note": "hi"}, "offer_invalid", "note", id="unknown-field"
        ),
        pytest.param(
            lambda w: {**offer_body(w), "entrySequence": str(w.entry["sequence"])},
            "offer_invalid",
            "entrySequence",
            id="sequence-as-string",
        ),
        # A whole number written as a float beyond I-JSON's integers (design §3) is no
        # sequence: it was taken as a 309-digit integer and answered 409 sequence_conflict.
        pytest.param(
            lambda w: {**offer_body(w), "entrySequence": 1e308},
            "offer_invalid",
            "entrySequence",
            id="sequence-beyond-safe-integers",
        ),
        pytest.param(
            lambda w: offer_body(w, recipient="did:web:example.com:someone"),
            "offer_invalid",
            "recipientDid",
            id="recipient-not-did-key",
        ),
        pytest.param(
            lambda w: offer_body(w, recipient=w.owner.did),
            "offer_invalid",
            "recipientDid",
            id="offer-to-yourself",
        ),
        pytest.param(
            lambda w: offer_body(w, expires_at=rfc3339_ms(now_ms() - 60_000)),
            "invalid_expiry",
            "expiresAt",
            id="expiry-in-the-past",
        ),
        pytest.param(
            lambda w: offer_body(w, expires_at=rfc3339_ms(now_ms() + 31 * DAY_MS)),
            "invalid_expiry",
            "expiresAt",
            id="expiry-beyond-30-days",
        ),
        pytest.param(
            lambda w: offer_body(w, expires_at="next tuesday"),
            "invalid_expiry",
            "expiresAt",
            id="expiry-not-a-date",
        ),
        pytest.param(
            lambda w: {
                **offer_body(w),
                "ownerSignature": offer_body(w, recipient=w.other.did)["ownerSignature"],
            },
            "signature_invalid",
            "ownerSignature.value",
            id="signature-over-another-recipient",
        ),
        pytest.param(
            lambda w: {
                **offer_body(w),
                "ownerSignature": {**offer_body(w)["ownerSignature"], "value": "AAAA"},
            },
            "signature_invalid",
            "ownerSignature.value",
            id="signature-value-garbage",
        ),
        pytest.param(
            lambda w: {
                **offer_body(w),
                "ownerSignature": {**offer_body(w)["ownerSignature"], "created": [1e-7] * 100},
            },
            "offer_invalid",
            "ownerSignature.created",
            id="signature-created-not-a-date",
        ),
        pytest.param(
            lambda w: {
                **offer_body(w),
                "ownerSignature": {**offer_body(w)["ownerSignature"], "created": "yesterday"},
            },
            "offer_invalid",
            "ownerSignature.created",
            id="signature-created-not-rfc3339",
        ),
        pytest.param(
            lambda w: {
                **offer_body(w),
                "ownerSignature": {**offer_body(w)["ownerSignature"], "created": None},
            },
            "offer_invalid",
            "ownerSignature.created",
            id="signature-created-null",
        ),
        pytest.param(
            lambda w: offer_body(w, signer=w.other),
            "signature_key_mismatch",
            "ownerSignature.keyId",
            id="key-not-the-owners",
        ),
        pytest.param(
            lambda w: {**offer_body(w), "ownerSignature": "signed"},
            "offer_invalid",
            "ownerSignature",
            id="signature-not-an-object",
        ),
    ],
)
async def test_create_offer_rejects_an_invalid_request_with_400(
    world: World, make_body: Callable[[World], Any], code: str, field: str | None
) -> None:
    w = world
    r = await post(w, "/v1/transfers/offers", w.owner_t, make_body(w))
    error = await error_of(r, 400, code)
    if field is not None:
        assert error["details"]["field"] == field
    # Nothing was offered: a valid offer still goes through.
    await make_offer(w)


async def test_the_openapi_document_says_what_an_offer_signature_created_may_be(
    world: World,
) -> None:
    # The server takes only an RFC 3339 date-time string of at most 64 characters (the
    # refusals above); the document called any JSON value valid there.
    r = await anon_client(world.h).get("/v1/openapi.json")
    schemas = (await r.get_json())["components"]["schemas"]
    created = schemas["OfferSignature"]["properties"]["created"]
    assert created["type"] == "string"
    assert created["format"] == "date-time"
    assert created["maxLength"] == 64
    assert "created" not in schemas["OfferSignature"].get("required", [])


async def test_create_offer_rejects_malformed_json_with_400(world: World) -> None:
    w = world
    r = await w.h.client.post(
        "/v1/transfers/offers", data=b"{not json", headers=bearer(w.owner_t, **idem(**JSON))
    )
    await error_of(r, 400, "invalid_json")


async def test_create_offer_without_a_session_is_401(world: World) -> None:
    r = await post(world, "/v1/transfers/offers", None, offer_body(world))
    await error_of(r, 401, "session_missing")


async def test_only_the_publisher_may_offer_an_entry(world: World) -> None:
    w = world
    body = offer_body(w, signer=w.other, recipient=w.recipient.did)
    r = await post(w, "/v1/transfers/offers", w.other_t, body)
    await error_of(r, 403, "owner_mismatch")


async def test_offering_an_unknown_entry_is_404(world: World) -> None:
    w = world
    body = offer_body(w, entry_did="did:web:agents.example.com:nobody-here")
    r = await post(w, "/v1/transfers/offers", w.owner_t, body)
    await error_of(r, 404, "entry_not_found")


async def test_offer_on_a_stale_sequence_is_a_sequence_conflict(world: World) -> None:
    w = world
    r = await update_as_owner(w, w.entry["sequence"], version="2.0.0")
    assert r.status_code == 200, await r.get_data()
    latest = (await r.get_json())["sequence"]
    r = await post(w, "/v1/transfers/offers", w.owner_t, offer_body(w))
    error = await error_of(r, 409, "sequence_conflict")
    assert error["details"]["latestSequence"] == latest
    offer = await make_offer(w, sequence=latest)
    assert offer["entrySequence"] == latest


async def test_an_offer_without_entry_sequence_is_of_the_latest_one_its_signature_covers(
    world: World,
) -> None:
    # Design §8 lists the body as entryDid, recipientDid, expiresAt?, ownerSignature: the
    # sequence the signature covers is the entry's latest.
    w = world
    r = await update_as_owner(w, w.entry["sequence"], version="2.0.0")
    latest = (await r.get_json())["sequence"]
    stale = offer_body(w)  # signed over the older sequence
    del stale["entrySequence"]
    for body in (stale, {**stale, "entrySequence": None}):
        # The signature does not verify over the latest sequence: nothing is offered.
        r = await post(w, "/v1/transfers/offers", w.owner_t, body)
        assert (await error_of(r, 400, "signature_invalid"))["details"]["field"] == (
            "ownerSignature.value"
        )
    body = offer_body(w, sequence=latest)
    del body["entrySequence"]
    r = await post(w, "/v1/transfers/offers", w.owner_t, body)
    assert r.status_code == 201, await r.get_data()
    offer = await r.get_json()
    assert offer["entrySequence"] == latest
    assert await get_offer(w, offer["offerId"]) == offer


async def test_a_revoked_entry_cannot_be_offered(world: World) -> None:
    w = world
    r = await update_as_owner(w, w.entry["sequence"], lifecycleStatus="revoked")
    assert r.status_code == 200, await r.get_data()
    revoked = await r.get_json()
    r = await post(
        w, "/v1/transfers/offers", w.owner_t, offer_body(w, sequence=revoked["sequence"])
    )
    await error_of(r, 409, "lifecycle_conflict")


async def test_a_second_open_offer_on_the_same_entry_is_refused(world: World) -> None:
    w = world
    first = await make_offer(w)
    r = await post(w, "/v1/transfers/offers", w.owner_t, offer_body(w, recipient=w.other.did))
    error = await error_of(r, 409, "offer_exists")
    assert error["details"]["offerId"] == first["offerId"]


async def test_a_new_offer_is_allowed_once_the_previous_one_is_cancelled(world: World) -> None:
    w = world
    first = await make_offer(w)
    r = await post(w, f"/v1/transfers/offers/{first['offerId']}/cancel", w.owner_t)
    assert r.status_code == 200, await r.get_data()
    second = await make_offer(w, recipient=w.other.did)
    assert second["offerId"] != first["offerId"]
    assert second["recipientDid"] == w.other.did


async def test_a_new_offer_is_allowed_once_the_previous_one_expired(world: World) -> None:
    w = world
    first = await make_offer(w)
    later = now_ms() + 8 * DAY_MS
    with clock(w.h.deps.transfers, later):
        second = await make_offer(w, recipient=w.other.did)
        assert second["status"] == "offered"
        assert (await get_offer(w, first["offerId"]))["status"] == "expired"
    # The replaced offer stays expired even when read before its expiry (it was stored so).
    assert (await get_offer(w, first["offerId"]))["status"] == "expired"


# --- get ---------------------------------------------------------------------------------------


async def test_get_unknown_offer_is_404(world: World) -> None:
    r = await world.h.client.get("/v1/transfers/offers/off_doesnotexist")
    await error_of(r, 404, "offer_not_found")


async def test_offer_reads_expired_after_its_expiry_and_no_earlier(world: World) -> None:
    w = world
    offer = await make_offer(w)
    expires = int(parse_datetime(offer["expiresAt"]).timestamp() * 1000)
    with clock(w.h.deps.transfers, expires - 1):
        assert (await get_offer(w, offer["offerId"]))["status"] == "offered"
    with clock(w.h.deps.transfers, expires):
        got = await get_offer(w, offer["offerId"])
    assert got == {**offer, "status": "expired"}


# --- accept: success ---------------------------------------------------------------------------


async def test_accept_transfers_the_entry_to_the_recipient(world: World) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    before = await w.h.store.log_head()
    submitted = recipient_entry(w, snapshot)
    r = await accept(w, offer["offerId"], submitted)
    assert r.status_code == 200, await r.get_data()
    transferred = await r.get_json()
    assert transferred["publisherDid"] == w.recipient.did
    assert transferred["signature"]["keyId"] == w.recipient.key_id
    assert transferred["sequence"] > offer["entrySequence"]
    for name in ("name", "description", "itemData", "itemDataHash", "tags", "version"):
        assert transferred[name] == snapshot[name]
    assert "verifiableAttestations" not in transferred

    # The offer is decided, the entry serves the new version.
    decided = await get_offer(w, offer["offerId"])
    assert decided["status"] == "accepted"
    assert await head(w) == transferred
    assert await total_versions(w.h, w.did) == 2

    # Events: the entry version, then the offer's acceptance, at consecutive positions.
    assert await log_kinds(w, before) == [
        (transferred["sequence"], "entry.transferred"),
        (transferred["sequence"] + 1, "transfer.accepted"),
    ]
    moved_event, accepted_event = [
        r for r in await w.h.store.log_after(before, 100) if r.entry_did == w.did
    ]
    assert moved_event.data["offerId"] == offer["offerId"]
    assert moved_event.data["previousPublisherDid"] == w.owner.did
    assert accepted_event.data == {
        "offerId": offer["offerId"],
        "ownerDid": w.owner.did,
        "recipientDid": w.recipient.did,
    }

    # The old owner lost the entry; the recipient owns it.
    r = await update_as_owner(w, transferred["sequence"], version="9.9.9")
    await error_of(r, 403, "publisher_mismatch")
    mine = signed_entry(w.recipient, w.did, sequence=transferred["sequence"], version="3.0.0")
    r = await w.h.client.put(
        f"/v1/entries/{w.did}", json=mine, headers=bearer(w.recipient_t, **idem())
    )
    assert r.status_code == 200, await r.get_data()
    assert (await r.get_json())["publisherDid"] == w.recipient.did


async def test_attestations_stay_with_the_entry_across_a_transfer(world: World) -> None:
    w = world
    vc = issue_credential(w.other, subject_id=w.did)
    r = await w.h.client.post(
        "/v1/attestations",
        json={"attestation": vc, "entryDid": w.did},
        headers=bearer(w.other_t, **idem()),
    )
    assert r.status_code == 201, await r.get_data()
    attestation = await r.get_json()
    offer = await make_offer(w)
    snapshot = await head(w)
    assert snapshot["verifiableAttestations"] == [attestation]
    r = await accept(w, offer["offerId"], recipient_entry(w, snapshot))  # drops the field
    assert r.status_code == 200, await r.get_data()
    after = await head(w)
    assert after["publisherDid"] == w.recipient.did
    assert after["verifiableAttestations"] == [attestation]


def compact(value: Any) -> bytes:
    """The smallest JSON text of `value` (what the admission limit counts)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sized_entry(key: SigningKey, size: int, **fields: Any) -> dict[str, Any]:
    """A signed entry whose compact JSON is exactly `size` bytes (padded in itemData)."""
    entry = signed_entry(key, itemData={"pad": ""}, **fields)
    pad = "x" * (size - len(compact(entry)))
    entry = signed_entry(key, entry["entryDid"], itemData={"pad": pad}, **fields)
    assert len(compact(entry)) == size
    return entry


async def test_an_entry_as_large_as_an_entry_body_may_be_transferred(world: World) -> None:
    # The accept body is {"entry": ...} around the entry with its sequence: 23 bytes more
    # than the entry's create body here. With the entry body's own limit, an entry created at
    # that limit could be offered but never accepted (413).
    await transfer_an_entry_at_the_limit(world)


async def test_an_entry_at_the_limit_may_be_transferred_when_no_other_body_limit_is_larger(
    database_url: str, tmp_path: Path
) -> None:
    # The app's own cap (Quart's MAX_CONTENT_LENGTH) is the largest admission limit: where
    # that is the entry's (federation_body_bytes no larger), it refused the accept with 413
    # before the route's limit (limits.accept_body_bytes) was asked.
    limits = {"entry_body_bytes": 1024 * 1024, "federation_body_bytes": 1024 * 1024}

    async def body(h: Harness) -> None:
        await transfer_an_entry_at_the_limit(await make_world(h))

    await with_harness(make_config(database_url, tmp_path, limits=limits), body)


async def transfer_an_entry_at_the_limit(w: World) -> None:
    """Create an entry exactly as large as an entry body may be, offer it, and accept it."""
    limit = w.h.config.limits.entry_body_bytes
    entry = sized_entry(w.owner, limit)
    r = await w.h.client.post(
        "/v1/entries", data=compact(entry), headers=bearer(w.owner_t, **idem(**JSON))
    )
    assert r.status_code == 201, await r.get_data()
    w.entry = dict(await r.get_json())
    offer = await make_offer(w)
    body = compact({"entry": recipient_entry(w, await head(w))})
    assert len(body) > limit
    r = await w.h.client.post(
        f"/v1/transfers/offers/{offer['offerId']}/accept",
        data=body,
        headers=bearer(w.recipient_t, **idem(**JSON)),
    )
    assert r.status_code == 200, await r.get_data()
    assert (await head(w))["publisherDid"] == w.recipient.did


async def test_the_new_owner_may_offer_the_entry_on_and_the_old_owner_may_not(
    world: World,
) -> None:
    w = world
    offer = await make_offer(w)
    r = await accept(w, offer["offerId"], recipient_entry(w, await head(w)))
    assert r.status_code == 200, await r.get_data()
    seq = (await r.get_json())["sequence"]
    r = await post(w, "/v1/transfers/offers", w.owner_t, offer_body(w, sequence=seq))
    await error_of(r, 403, "owner_mismatch")
    body = offer_body(w, signer=w.recipient, sequence=seq, recipient=w.other.did)
    r = await post(w, "/v1/transfers/offers", w.recipient_t, body)
    assert r.status_code == 201, await r.get_data()


# --- accept: rules (a)-(e), each broken alone ---------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        pytest.param({"name": "Renamed agent"}, "entry.name", id="changed"),
        pytest.param({"customMetadata": {"k": 1}}, "entry.customMetadata", id="added-optional"),
        pytest.param({"lifecycleStatus": "active"}, "entry.lifecycleStatus", id="added"),
        pytest.param({"itemData": {"model": "m-2"}}, "entry.itemData", id="payload"),
    ],
)
async def test_accept_refuses_a_changed_or_added_publisher_field(
    world: World, changes: dict[str, Any], field: str
) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    r = await accept(w, offer["offerId"], recipient_entry(w, snapshot, **changes))
    error = await error_of(r, 400, "transfer_field_changed")
    assert error["details"]["field"] == field
    await assert_untouched(w, offer["offerId"], snapshot)


async def test_accept_refuses_a_dropped_publisher_field(world: World) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    kept = {k: v for k, v in moved(snapshot).items() if k != "description"}
    r = await accept(w, offer["offerId"], sign_entry(kept, w.recipient))
    error = await error_of(r, 400, "transfer_field_changed")
    assert error["details"]["field"] == "entry.description"
    await assert_untouched(w, offer["offerId"], snapshot)


async def test_accept_with_a_publisher_other_than_the_recipient_is_403(world: World) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    by_other = sign_entry(moved(snapshot), w.other)  # publisherDid: other, validly signed
    r = await accept(w, offer["offerId"], by_other)
    await error_of(r, 403, "publisher_mismatch")
    await assert_untouched(w, offer["offerId"], snapshot)


@pytest.mark.parametrize("delta", [1, -1])
async def test_accept_based_on_another_sequence_is_a_sequence_conflict(
    world: World, delta: int
) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    entry = recipient_entry(w, snapshot, sequence=snapshot["sequence"] + delta)
    r = await accept(w, offer["offerId"], entry)
    error = await error_of(r, 409, "sequence_conflict")
    assert error["details"]["offeredSequence"] == offer["entrySequence"]
    await assert_untouched(w, offer["offerId"], snapshot)


async def test_accept_without_a_sequence_is_400(world: World) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    entry = sign_entry({k: v for k, v in moved(snapshot).items() if k != "sequence"}, w.recipient)
    r = await accept(w, offer["offerId"], entry)
    await error_of(r, 400, "sequence_required")
    await assert_untouched(w, offer["offerId"], snapshot)


async def test_accept_after_the_owner_changed_the_entry_is_entry_changed(world: World) -> None:
    w = world
    offer = await make_offer(w)
    offered = await head(w)
    r = await update_as_owner(w, offered["sequence"], description="changed after the offer")
    assert r.status_code == 200, await r.get_data()
    changed = await r.get_json()
    r = await accept(w, offer["offerId"], recipient_entry(w, offered))
    error = await error_of(r, 409, "entry_changed")
    assert error["details"] == {
        "offeredSequence": offered["sequence"],
        "latestSequence": changed["sequence"],
    }
    await assert_untouched(w, offer["offerId"], changed)


async def test_accept_after_the_owner_deleted_the_entry_is_entry_changed(world: World) -> None:
    """A delete writes a tombstone version: the entry changed since the offer (409), it is not
    a missing one (404), and nothing is transferred."""
    w = world
    offer = await make_offer(w)
    offered = await head(w)
    r = await w.h.client.delete(f"/v1/entries/{w.did}", headers=bearer(w.owner_t, **idem()))
    assert r.status_code == 200, await r.get_data()
    tombstone = await r.get_json()
    r = await accept(w, offer["offerId"], recipient_entry(w, offered))
    error = await error_of(r, 409, "entry_changed")
    assert error["details"] == {
        "offeredSequence": offered["sequence"],
        "latestSequence": tombstone["sequence"],
    }
    assert (await w.h.client.get(f"/v1/entries/{w.did}")).status_code == 404


async def test_accept_with_verifiable_attestations_is_400(world: World) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    entry = recipient_entry(w, snapshot)
    entry["verifiableAttestations"] = []
    r = await accept(w, offer["offerId"], entry)
    error = await error_of(r, 400, "attestations_not_allowed")
    assert error["details"]["field"] == "entry.verifiableAttestations"
    await assert_untouched(w, offer["offerId"], snapshot)


async def test_accept_signed_by_the_owner_instead_of_the_recipient_is_400(world: World) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    entry = sign_entry(moved(snapshot), w.owner)
    entry["publisherDid"] = w.recipient.did  # claims the recipient, signed by the owner's key
    r = await accept(w, offer["offerId"], entry)
    await error_of(r, 400, "signature_key_mismatch")
    await assert_untouched(w, offer["offerId"], snapshot)


async def test_accept_signed_over_part_of_the_payload_is_400(world: World) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    partial = {k: v for k, v in moved(snapshot).items() if k != "tags"}
    entry = sign_entry(partial, w.recipient)
    entry["tags"] = snapshot["tags"]  # rule (a) holds; the signature does not cover tags
    r = await accept(w, offer["offerId"], entry)
    await error_of(r, 400, "signature_invalid")
    await assert_untouched(w, offer["offerId"], snapshot)


async def test_the_owners_offer_signature_does_not_stand_in_for_the_recipients(
    world: World,
) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    entry = recipient_entry(w, snapshot)
    entry["signature"] = {k: offer["ownerSignature"][k] for k in ("algorithm", "keyId", "value")}
    r = await accept(w, offer["offerId"], entry)
    await error_of(r, 400, "signature_key_mismatch")
    await assert_untouched(w, offer["offerId"], snapshot)


async def test_accept_of_another_entry_is_400(world: World) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    other = await create(w.h, w.owner, w.owner_t)
    r = await accept(w, offer["offerId"], recipient_entry(w, other))
    error = await error_of(r, 400, "entry_invalid")
    assert error["details"]["field"] == "entry.entryDid"
    await assert_untouched(w, offer["offerId"], snapshot)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({}, id="no-entry"),
        pytest.param({"entry": {}, "extra": 1}, id="unknown-field"),
        pytest.param({"entry": "nope"}, id="entry-not-an-object"),
    ],
)
async def test_accept_with_a_malformed_body_is_400(world: World, body: dict[str, Any]) -> None:
    w = world
    offer = await make_offer(w)
    r = await post(w, f"/v1/transfers/offers/{offer['offerId']}/accept", w.recipient_t, body)
    await error_of(r, 400, "entry_invalid")


# --- accept: who and when ----------------------------------------------------------------------


async def test_accept_without_a_session_is_401(world: World) -> None:
    w = world
    offer = await make_offer(w)
    entry = recipient_entry(w, await head(w))
    r = await post(w, f"/v1/transfers/offers/{offer['offerId']}/accept", None, {"entry": entry})
    await error_of(r, 401, "session_missing")


@pytest.mark.parametrize("who", ["owner", "other"])
async def test_accept_by_anyone_but_the_recipient_is_403(world: World, who: str) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    key, token = (w.owner, w.owner_t) if who == "owner" else (w.other, w.other_t)
    entry = sign_entry(moved(snapshot), key)
    r = await accept(w, offer["offerId"], entry, token=token)
    await error_of(r, 403, "recipient_mismatch")
    await assert_untouched(w, offer["offerId"], snapshot)


async def test_accept_of_an_unknown_offer_is_404(world: World) -> None:
    w = world
    r = await accept(w, "off_unknown", recipient_entry(w, await head(w)))
    await error_of(r, 404, "offer_not_found")


async def test_accept_after_expiry_is_409_offer_expired(world: World) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    expires = int(parse_datetime(offer["expiresAt"]).timestamp() * 1000)
    with clock(w.h.deps.transfers, expires):
        r = await accept(w, offer["offerId"], recipient_entry(w, snapshot))
        await error_of(r, 409, "offer_expired")
    assert await head(w) == snapshot


async def test_accept_of_an_offer_replaced_after_expiry_is_409_offer_expired(
    world: World,
) -> None:
    w = world
    first = await make_offer(w)
    snapshot = await head(w)
    with clock(w.h.deps.transfers, now_ms() + 8 * DAY_MS):
        await make_offer(w, recipient=w.other.did)  # stores the first one as expired
    r = await accept(w, first["offerId"], recipient_entry(w, snapshot))
    await error_of(r, 409, "offer_expired")
    r = await post(w, f"/v1/transfers/offers/{first['offerId']}/decline", w.recipient_t)
    await error_of(r, 409, "offer_expired")


@pytest.mark.parametrize("decision", ["decline", "cancel", "accept"])
async def test_accept_of_a_decided_offer_is_409_offer_decided(world: World, decision: str) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    oid = offer["offerId"]
    if decision == "decline":
        r = await post(w, f"/v1/transfers/offers/{oid}/decline", w.recipient_t)
    elif decision == "cancel":
        r = await post(w, f"/v1/transfers/offers/{oid}/cancel", w.owner_t)
    else:
        r = await accept(w, oid, recipient_entry(w, snapshot))
    assert r.status_code == 200, await r.get_data()
    served = await head(w)
    r = await accept(w, oid, recipient_entry(w, snapshot))
    error = await error_of(r, 409, "offer_decided")
    assert (
        error["details"]["status"]
        == {
            "decline": "declined",
            "cancel": "cancelled",
            "accept": "accepted",
        }[decision]
    )
    assert await head(w) == served


# --- decline and cancel ------------------------------------------------------------------------


async def test_recipient_declines_with_a_reason(world: World) -> None:
    w = world
    offer = await make_offer(w)
    before = await w.h.store.log_head()
    r = await post(
        w,
        f"/v1/transfers/offers/{offer['offerId']}/decline",
        w.recipient_t,
        {"reason": "not for me"},
    )
    assert r.status_code == 200, await r.get_data()
    declined = await r.get_json()
    assert declined["status"] == "declined"
    assert declined["declineReason"] == "not for me"
    rest = {k: v for k, v in declined.items() if k not in ("status", "declineReason", "decidedAt")}
    assert rest == {k: v for k, v in offer.items() if k != "status"}
    assert await get_offer(w, offer["offerId"]) == declined
    assert await log_kinds(w, before) == [(before + 1, "transfer.declined")]
    # The entry is untouched and may be offered again.
    await make_offer(w, recipient=w.other.did)


async def test_recipient_declines_with_an_empty_body(world: World) -> None:
    w = world
    offer = await make_offer(w)
    r = await post(w, f"/v1/transfers/offers/{offer['offerId']}/decline", w.recipient_t)
    assert r.status_code == 200, await r.get_data()
    declined = await r.get_json()
    assert declined["status"] == "declined"
    assert "declineReason" not in declined


async def test_recipient_declines_with_an_empty_object(world: World) -> None:
    w = world
    offer = await make_offer(w)
    r = await post(w, f"/v1/transfers/offers/{offer['offerId']}/decline", w.recipient_t, {})
    assert r.status_code == 200, await r.get_data()
    assert (await r.get_json())["status"] == "declined"


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"reason": ""}, id="empty-reason"),
        pytest.param({"reason": 7}, id="reason-not-a-string"),
        pytest.param({"why": "x"}, id="unknown-field"),
        pytest.param(["x"], id="not-an-object"),
    ],
)
async def test_decline_with_an_invalid_body_is_400(world: World, body: Any) -> None:
    w = world
    offer = await make_offer(w)
    r = await post(w, f"/v1/transfers/offers/{offer['offerId']}/decline", w.recipient_t, body)
    await error_of(r, 400, "decline_invalid")
    assert (await get_offer(w, offer["offerId"]))["status"] == "offered"


async def test_decline_without_a_session_is_401(world: World) -> None:
    w = world
    offer = await make_offer(w)
    r = await post(w, f"/v1/transfers/offers/{offer['offerId']}/decline", None)
    await error_of(r, 401, "session_missing")


async def test_the_owner_cannot_decline_their_own_offer(world: World) -> None:
    w = world
    offer = await make_offer(w)
    r = await post(w, f"/v1/transfers/offers/{offer['offerId']}/decline", w.owner_t)
    await error_of(r, 403, "recipient_mismatch")
    assert (await get_offer(w, offer["offerId"]))["status"] == "offered"


async def test_decline_of_an_unknown_offer_is_404(world: World) -> None:
    r = await post(world, "/v1/transfers/offers/off_nope/decline", world.recipient_t)
    await error_of(r, 404, "offer_not_found")


async def test_decline_after_expiry_is_409_offer_expired(world: World) -> None:
    w = world
    offer = await make_offer(w)
    with clock(w.h.deps.transfers, now_ms() + 8 * DAY_MS):
        r = await post(w, f"/v1/transfers/offers/{offer['offerId']}/decline", w.recipient_t)
        await error_of(r, 409, "offer_expired")


@pytest.mark.parametrize("first", ["decline", "cancel"])
async def test_decline_after_a_decision_is_409_offer_decided(world: World, first: str) -> None:
    w = world
    offer = await make_offer(w)
    oid = offer["offerId"]
    token = w.recipient_t if first == "decline" else w.owner_t
    r = await post(w, f"/v1/transfers/offers/{oid}/{first}", token)
    assert r.status_code == 200, await r.get_data()
    r = await post(w, f"/v1/transfers/offers/{oid}/decline", w.recipient_t)
    await error_of(r, 409, "offer_decided")


async def test_owner_cancels_an_open_offer(world: World) -> None:
    w = world
    offer = await make_offer(w)
    before = await w.h.store.log_head()
    r = await post(w, f"/v1/transfers/offers/{offer['offerId']}/cancel", w.owner_t)
    assert r.status_code == 200, await r.get_data()
    cancelled = await r.get_json()
    assert cancelled["status"] == "cancelled"
    assert await get_offer(w, offer["offerId"]) == cancelled
    assert await log_kinds(w, before) == [(before + 1, "transfer.cancelled")]


async def test_the_recipient_cannot_cancel(world: World) -> None:
    w = world
    offer = await make_offer(w)
    r = await post(w, f"/v1/transfers/offers/{offer['offerId']}/cancel", w.recipient_t)
    await error_of(r, 403, "owner_mismatch")
    assert (await get_offer(w, offer["offerId"]))["status"] == "offered"


async def test_cancel_without_a_session_is_401_and_of_an_unknown_offer_404(
    world: World,
) -> None:
    w = world
    offer = await make_offer(w)
    r = await post(w, f"/v1/transfers/offers/{offer['offerId']}/cancel", None)
    await error_of(r, 401, "session_missing")
    r = await post(w, "/v1/transfers/offers/off_nope/cancel", w.owner_t)
    await error_of(r, 404, "offer_not_found")


@pytest.mark.parametrize("first", ["decline", "cancel", "accept"])
async def test_cancel_after_a_decision_is_409_offer_decided(world: World, first: str) -> None:
    w = world
    offer = await make_offer(w)
    oid = offer["offerId"]
    if first == "accept":
        r = await accept(w, oid, recipient_entry(w, await head(w)))
    else:
        token = w.recipient_t if first == "decline" else w.owner_t
        r = await post(w, f"/v1/transfers/offers/{oid}/{first}", token)
    assert r.status_code == 200, await r.get_data()
    r = await post(w, f"/v1/transfers/offers/{oid}/cancel", w.owner_t)
    await error_of(r, 409, "offer_decided")


async def test_cancel_after_expiry_is_409_offer_expired(world: World) -> None:
    w = world
    offer = await make_offer(w)
    with clock(w.h.deps.transfers, now_ms() + 8 * DAY_MS):
        r = await post(w, f"/v1/transfers/offers/{offer['offerId']}/cancel", w.owner_t)
        await error_of(r, 409, "offer_expired")


# --- idempotency -------------------------------------------------------------------------------


async def test_replayed_accept_answers_the_same_body_and_writes_nothing(world: World) -> None:
    w = world
    offer = await make_offer(w)
    entry = recipient_entry(w, await head(w))
    key = f"accept-{uuid.uuid4()}"
    first = await accept(w, offer["offerId"], entry, key=key)
    assert first.status_code == 200, await first.get_data()
    assert "Idempotent-Replayed" not in first.headers
    head_seq = await w.h.store.log_head()
    again = await accept(w, offer["offerId"], entry, key=key)
    assert again.status_code == 200, await again.get_data()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert await again.get_data() == await first.get_data()
    assert await w.h.store.log_head() == head_seq
    assert await total_versions(w.h, w.did) == 2


async def test_accept_key_reused_for_another_body_is_409_idempotency_conflict(
    world: World,
) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    key = f"accept-{uuid.uuid4()}"
    r = await accept(w, offer["offerId"], recipient_entry(w, snapshot), key=key)
    assert r.status_code == 200, await r.get_data()
    different = recipient_entry(w, snapshot, name="Another name")
    r = await accept(w, offer["offerId"], different, key=key)
    await error_of(r, 409, "idempotency_conflict")


async def test_a_refused_accept_replays_its_refusal_under_the_same_key(
    world: World,
) -> None:
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    bad = recipient_entry(w, snapshot, name="changed")
    key = f"accept-{uuid.uuid4()}"
    r = await accept(w, offer["offerId"], bad, key=key)
    await error_of(r, 400, "transfer_field_changed")
    r = await accept(w, offer["offerId"], bad, key=key)
    await error_of(r, 400, "transfer_field_changed")
    assert r.headers["Idempotent-Replayed"] == "true"
    # A fresh key with a good entry still goes through: the refusal decided nothing.
    r = await accept(w, offer["offerId"], recipient_entry(w, snapshot))
    assert r.status_code == 200, await r.get_data()


@pytest.mark.parametrize("operation", ["accept", "decline", "cancel", "create"])
async def test_transfer_writes_without_an_idempotency_key_are_400(
    world: World, operation: str
) -> None:
    w = world
    offer = await make_offer(w)
    oid = offer["offerId"]
    path, token, body = {
        "accept": (
            f"/v1/transfers/offers/{oid}/accept",
            w.recipient_t,
            {"entry": recipient_entry(w, await head(w))},
        ),
        "decline": (f"/v1/transfers/offers/{oid}/decline", w.recipient_t, {}),
        "cancel": (f"/v1/transfers/offers/{oid}/cancel", w.owner_t, None),
        "create": ("/v1/transfers/offers", w.owner_t, offer_body(w, recipient=w.other.did)),
    }[operation]
    if body is None:
        r = await w.h.client.post(path, headers=bearer(token))
    else:
        r = await w.h.client.post(path, json=body, headers=bearer(token))
    await error_of(r, 400, "idempotency_key_required")
    assert (await get_offer(w, oid))["status"] == "offered"


# --- races -------------------------------------------------------------------------------------


async def _accept_twice(w: World, offer_id: str, entry: Any) -> list[Any]:
    """The recipient accepts the offer twice at once, with two keys; both responses."""
    responses: list[Any] = []

    async def one() -> None:
        responses.append(await accept(w, offer_id, entry))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            nursery.start_soon(one)
    return responses


async def test_two_concurrent_accepts_transfer_once_and_the_other_is_offer_decided(
    world: World,
) -> None:
    w = world
    for _ in range(10):
        w.entry = await create(w.h, w.owner, w.owner_t)
        offer = await make_offer(w)
        responses = await _accept_twice(w, offer["offerId"], recipient_entry(w, await head(w)))
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200, 409], [await r.get_data() for r in responses]
        loser = next(r for r in responses if r.status_code == 409)
        # The loser learns the truth: the offer is decided (not "the entry changed").
        await error_of(loser, 409, "offer_decided")
        assert await total_versions(w.h, w.did) == 2
        assert (await get_offer(w, offer["offerId"]))["status"] == "accepted"


async def _race_accept_and_update(w: World, offer_id: str, accepted: Any, based_on: int) -> Any:
    """Run the recipient's accept and the owner's update at once; return both responses."""
    results: dict[str, Any] = {}

    async def do_accept() -> None:
        results["accept"] = await accept(w, offer_id, accepted)

    async def do_update() -> None:
        results["update"] = await update_as_owner(w, based_on, version="raced")

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            if based_on % 2:
                nursery.start_soon(do_accept)
                nursery.start_soon(do_update)
            else:
                nursery.start_soon(do_update)
                nursery.start_soon(do_accept)
    return results["accept"], results["update"]


async def test_accept_racing_an_owner_update_lets_exactly_one_win(harness: Harness) -> None:
    owner, recipient = SigningKey.generate(), SigningKey.generate()
    owner_t = await sign_in(harness.client, owner)
    recipient_t = await sign_in(harness.client, recipient)
    outcomes: dict[str, int] = {}
    for _ in range(10):
        entry = await create(harness, owner, owner_t)
        w = World(harness, owner, owner_t, recipient, recipient_t, owner, owner_t, entry)
        offer = await make_offer(w)
        snapshot = await head(w)
        a, u = await _race_accept_and_update(
            w, offer["offerId"], recipient_entry(w, snapshot), snapshot["sequence"]
        )
        assert sorted([a.status_code, u.status_code]) in ([200, 403], [200, 409]), (
            await a.get_data(),
            await u.get_data(),
        )
        served = await head(w)
        assert await total_versions(harness, w.did) == 2
        if a.status_code == 200:
            # The transfer won: the owner's update is refused, as stale or as no longer theirs.
            code = json.loads(await u.get_data())["error"]["code"]
            assert (u.status_code, code) in (
                (409, "sequence_conflict"),
                (403, "publisher_mismatch"),
            )
            assert served == await a.get_json()
            assert served["publisherDid"] == recipient.did
            assert (await get_offer(w, offer["offerId"]))["status"] == "accepted"
            label = f"accept won, update {code}"
        else:
            # The update won: the transfer is refused as stale (as it would be after the
            # update, whenever it was decided); the offer stays open.
            code = json.loads(await a.get_data())["error"]["code"]
            assert (a.status_code, code) == (409, "entry_changed")
            assert served == await u.get_json()
            assert served["publisherDid"] == owner.did
            assert (await get_offer(w, offer["offerId"]))["status"] == "offered"
            label = f"update won, accept {code}"
        outcomes[label] = outcomes.get(label, 0) + 1
    assert sum(outcomes.values()) == 10, outcomes


class _PausedRead:
    """`inner` whose method `name` reads and then waits for `go` (after telling `read`): what a
    concurrent write does meanwhile lands between a decision's read and its append."""

    def __init__(self, inner: Any, name: str) -> None:
        self._inner = inner
        self._name = name
        self.read = trio.Event()
        self.go = trio.Event()

    def __getattr__(self, attr: str) -> Any:
        found = getattr(self._inner, attr)
        if attr != self._name:
            return found

        async def paused(*args: Any, **kw: Any) -> Any:
            result = await found(*args, **kw)
            self.read.set()
            await self.go.wait()
            return result

        return paused


@contextmanager
def paused_heads(w: World, use_case: str = "transfers") -> Iterator[_PausedRead]:
    """The entries of the use-case `w.h.deps.<use_case>`, their `live_head` paused."""
    target = getattr(w.h.deps, use_case)
    saved = target.entries
    paused = _PausedRead(saved, "live_head")
    target.entries = paused
    try:
        yield paused
    finally:
        target.entries = saved


async def test_an_offer_decided_before_an_owner_update_and_appended_after_it_is_refused(
    world: World,
) -> None:
    """The offer read the head at sequence s; the owner's update to s' committed before the
    offer's append. Appended as it was, the offer would name a sequence that is not the entry's
    latest (it could never be accepted, and it would block every new offer): it is decided
    again on the new head, and refused `sequence_conflict` as a stale offer is."""
    w = world
    s = w.entry["sequence"]
    responses: dict[str, Any] = {}

    async def offer() -> None:
        responses["offer"] = await post(w, "/v1/transfers/offers", w.owner_t, offer_body(w))

    with trio.fail_after(30), paused_heads(w) as paused:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(offer)
            await paused.read.wait()
            updated = await update_as_owner(w, s)
            assert updated.status_code == 200, await updated.get_data()
            paused.go.set()
    error = await error_of(responses["offer"], 409, "sequence_conflict")
    latest = (await head(w))["sequence"]
    assert latest > s
    assert error["details"] == {"latestSequence": latest}
    kinds = [kind for _, kind in await log_kinds(w, s)]
    assert "transfer.offered" not in kinds, kinds
    # And a fresh offer of the latest sequence is not blocked by a stale one.
    w.entry = await head(w)
    assert (await make_offer(w))["entrySequence"] == latest


async def test_a_bond_decided_before_a_transfer_and_appended_after_it_is_refused(
    database_url: str, tmp_path: Path
) -> None:
    """The admin's bond read the entry while the owner published it; the transfer committed
    before the bond's append. Appended as it was, the bond would name a `publisherDid` that is
    no longer the entry's publisher: it is decided again on the new head, and refused
    `bond_publisher_mismatch` as it would be one after the other (docs/trust.md)."""
    admin = SigningKey.generate()
    config = make_config(database_url, tmp_path, auth={"admin_dids": [admin.did]})

    async def body(h: Harness) -> None:
        w = await make_world(h)
        admin_t = await sign_in(h.client, admin)
        offer = await make_offer(w)
        bond = {
            "amount": "100.00",
            "bondId": f"bond-{uuid.uuid4().hex}",
            "currency": "USD",
            "entryDid": w.did,
            "publisherDid": w.owner.did,
        }
        responses: dict[str, Any] = {}

        async def provision() -> None:
            responses["bond"] = await post(w, "/v1/admin/bonds", admin_t, bond)

        with trio.fail_after(30), paused_heads(w, "bonds") as paused:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(provision)
                await paused.read.wait()
                r = await accept(w, offer["offerId"], recipient_entry(w, await head(w)))
                assert r.status_code == 200, await r.get_data()
                paused.go.set()
        error = await error_of(responses["bond"], 400, "bond_publisher_mismatch")
        assert error["details"]["publisherDid"] == w.recipient.did
        r = await h.client.get(f"/v1/bonds/{bond['bondId']}")
        await error_of(r, 404, "bond_not_found")

    await with_harness(config, body)


class _EntriesReadThrough:
    def __init__(self, entries: Any, store: Any) -> None:
        self._entries = entries
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._entries, name)


@pytest.mark.parametrize("meanwhile", ["delete", "update"])
async def test_an_accept_overtaken_by_an_owner_change_answers_entry_changed(
    world: World, meanwhile: str
) -> None:
    """The accept read the head at the offered sequence; the owner's delete (or update)
    committed before the accept's append. One after the other the accept is `409
    entry_changed` (its `entry.sequence` is the offered one): so it is in the race too, not
    `sequence_conflict`, which says the accept named another sequence than the offer's."""
    w = world
    offer = await make_offer(w)
    snapshot = await head(w)
    transfers = w.h.deps.transfers
    saved = transfers.entries
    paused = _PausedRead(saved.store, "get_entry_head")  # what accept reads the entry by
    responses: dict[str, Any] = {}

    async def do_accept() -> None:
        responses["accept"] = await accept(w, offer["offerId"], recipient_entry(w, snapshot))

    before = await w.h.store.log_head()
    transfers.entries = _EntriesReadThrough(saved, paused)
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(do_accept)
                await paused.read.wait()
                if meanwhile == "delete":
                    r = await w.h.client.delete(
                        f"/v1/entries/{w.did}", headers=bearer(w.owner_t, **idem())
                    )
                else:
                    r = await update_as_owner(w, snapshot["sequence"])
                assert r.status_code == 200, await r.get_data()
                latest = (await r.get_json())["sequence"]
                paused.go.set()
    finally:
        transfers.entries = saved
    error = await error_of(responses["accept"], 409, "entry_changed")
    assert error["details"] == {
        "offeredSequence": snapshot["sequence"],
        "latestSequence": latest,
    }
    assert (await get_offer(w, offer["offerId"]))["status"] == "offered"
    kinds = [kind for _, kind in await log_kinds(w, before)]
    assert kinds == [f"entry.{meanwhile}d"], kinds
