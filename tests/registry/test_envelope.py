"""The signed federation envelope (spec 2.9, design §9): build, verify, every refusal by code."""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import jcs
import nacl.signing
import pytest

from registry.canonical import canonicalize, parse_strict
from registry.envelope import (
    MEMBERS,
    STRING_MEMBERS,
    VerifiedEnvelope,
    build_request,
    build_response,
    clamp_max_entries,
    format_timestamp,
    nonce_expiry_ms,
    sync_request_payload,
    verify_envelope,
)
from registry.errors import Invalid, Unauthorized
from registry.keys import SigningKey, b64url_decode, b64url_encode

ALICE = SigningKey(bytes(range(32)))  # the peer that asks
BOB = SigningKey(bytes([7] * 32))  # this registry, which answers
MALLORY = SigningKey(bytes([9] * 32))
NOW = 1_767_225_600_000  # 2026-01-01T00:00:00.000Z
SYNC = {"fromSequence": 41, "maxEntries": 100}
ANSWER = {"entries": [{"entryDid": "did:web:a.example"}], "hasMore": True, "nextSequence": 42}


def request(key: SigningKey = ALICE, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "kind": "sync_request",
        "recipient_did": BOB.did,
        "payload": SYNC,
        "now_ms": NOW,
    }
    args.update(kw)
    return build_request(key, **args)


def response(req: dict[str, Any], key: SigningKey = BOB, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"kind": "sync_response", "payload": ANSWER, "now_ms": NOW}
    args.update(kw)
    return build_response(key, request=req, **args)


def verify_request(env: Any, **kw: Any) -> VerifiedEnvelope:
    args: dict[str, Any] = {
        "recipient_did": BOB.did,
        "now_ms": NOW,
        "expected_kind": "sync_request",
    }
    args.update(kw)
    return verify_envelope(env, **args)


def verify_response(env: Any, req: dict[str, Any], **kw: Any) -> VerifiedEnvelope:
    args: dict[str, Any] = {
        "recipient_did": ALICE.did,
        "now_ms": NOW,
        "expected_kind": "sync_response",
        "request": req,
    }
    args.update(kw)
    return verify_envelope(env, **args)


def refused(call: Any, *args: Any, **kw: Any) -> Unauthorized:
    with pytest.raises(Unauthorized) as info:
        call(*args, **kw)
    assert info.value.status == 401
    assert info.value.code.startswith("envelope_")
    assert isinstance(info.value.details["reason"], str)
    return info.value


def resigned(env: dict[str, Any], key: SigningKey, **members: Any) -> dict[str, Any]:
    """A consistent forgery: members replaced, then signed by `key` over the new JCS bytes."""
    out = {k: v for k, v in copy.deepcopy(env).items() if k != "signature"}
    out.update(members)
    out["signature"] = b64url_encode(key.sign(canonicalize(out)))
    return out


# --- round trips ------------------------------------------------------------------------------


def test_request_round_trip() -> None:
    env = request(nonce="AAAAAAAAAAAAAAAAAAAAAA")
    assert set(env) == MEMBERS
    verified = verify_request(env)
    assert verified == VerifiedEnvelope(
        sender_did=ALICE.did,
        key_id=ALICE.key_id,
        kind="sync_request",
        nonce="AAAAAAAAAAAAAAAAAAAAAA",
        timestamp_ms=NOW,
        payload=SYNC,
    )
    assert sync_request_payload(verified.payload) == (41, 100, None)


def test_response_round_trip_is_addressed_to_the_requester() -> None:
    req = request()
    resp = response(req)
    assert resp["recipientDid"] == ALICE.did
    assert resp["senderDid"] == BOB.did
    assert resp["requestDigest"] == hashlib.sha256(canonicalize(req)).hexdigest()
    verified = verify_response(resp, req)
    assert (verified.sender_did, verified.kind, verified.payload) == (
        BOB.did,
        "sync_response",
        ANSWER,
    )


def test_discover_kinds_round_trip_and_a_set_of_expected_kinds() -> None:
    req = request(kind="discover_request", payload={"text": "x"})
    kinds = {"sync_request", "discover_request"}
    assert verify_request(req, expected_kind=kinds).kind == "discover_request"
    resp = response(req, kind="discover_response", payload={"results": []})
    assert verify_response(resp, req, expected_kind="discover_response").kind == (
        "discover_response"
    )


def test_verifies_the_parsed_body_whatever_its_member_order_and_whitespace() -> None:
    env = request()
    body = json.dumps(dict(reversed(list(env.items()))), indent=3, ensure_ascii=True)
    assert verify_request(parse_strict(body.encode())).payload == SYNC


def test_default_nonce_is_fresh_128_bits() -> None:
    one, two = request()["nonce"], request()["nonce"]
    assert one != two
    assert len(b64url_decode(one)) == 16


def test_the_payload_is_copied_so_later_edits_do_not_unsign_it() -> None:
    payload = {"fromSequence": 1, "maxEntries": 2}
    env = request(payload=payload)
    payload["maxEntries"] = 3
    assert verify_request(env).payload == {"fromSequence": 1, "maxEntries": 2}


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "1970-01-01T00:00:00.000Z"),
        (NOW + 123, "2026-01-01T00:00:00.123Z"),
        (-1, "1969-12-31T23:59:59.999Z"),
        (NOW + 59_999, "2026-01-01T00:00:59.999Z"),
    ],
)
def test_timestamp_is_rfc3339_utc_with_milliseconds(ms: int, text: str) -> None:
    assert format_timestamp(ms) == text


def test_builders_refuse_caller_mistakes() -> None:
    with pytest.raises(ValueError, match="request kind"):
        request(kind="sync_response")
    with pytest.raises(ValueError, match="nonce"):
        request(nonce="AAAA")  # 3 bytes
    with pytest.raises(ValueError, match="does not answer"):
        response(request(), kind="discover_response")
    with pytest.raises(TypeError):
        request(payload=[1])


def test_verifier_refuses_caller_mistakes() -> None:
    req = request()
    with pytest.raises(ValueError, match="pass request"):
        verify_request(response(req), expected_kind="sync_response")
    with pytest.raises(ValueError, match="only for verifying responses"):
        verify_request(req, request=req)
    with pytest.raises(ValueError, match="envelope kinds"):
        verify_request(req, expected_kind="sync")
    with pytest.raises(ValueError, match="envelope kinds"):
        verify_request(req, expected_kind=set())


# --- tampering ---------------------------------------------------------------------------------

OTHER_NONCE = b64url_encode(bytes(range(16)))
OTHER_SIGNATURE = b64url_encode(MALLORY.sign(b"something else"))

# member -> (tampered value, code); the signature is left as it was.
REQUEST_TAMPERING: dict[str, tuple[Any, str]] = {
    "version": ("2", "envelope_version_unsupported"),
    "kind": ("discover_request", "envelope_kind_unexpected"),
    "algorithm": ("EdDSA", "envelope_algorithm_unsupported"),
    "keyId": (MALLORY.key_id, "envelope_controller_mismatch"),
    "senderDid": (MALLORY.did, "envelope_controller_mismatch"),
    "recipientDid": (MALLORY.did, "envelope_wrong_recipient"),
    "timestamp": (format_timestamp(NOW + 1), "envelope_signature_invalid"),
    "nonce": (OTHER_NONCE, "envelope_signature_invalid"),
    "requestDigest": ("0" * 64, "envelope_digest_mismatch"),
    "payload": ({"fromSequence": 0, "maxEntries": 100}, "envelope_digest_mismatch"),
    "signature": (OTHER_SIGNATURE, "envelope_signature_invalid"),
}


def test_the_tampering_tables_cover_every_member() -> None:
    assert set(REQUEST_TAMPERING) == MEMBERS
    assert set(RESPONSE_TAMPERING) == MEMBERS


@pytest.mark.parametrize("member", sorted(REQUEST_TAMPERING))
def test_tampering_with_any_request_member_is_refused(member: str) -> None:
    value, code = REQUEST_TAMPERING[member]
    env = request()
    assert env[member] != value
    env[member] = value
    assert refused(verify_request, env).code == code


RESPONSE_TAMPERING: dict[str, tuple[Any, str]] = {
    **REQUEST_TAMPERING,
    "kind": ("discover_response", "envelope_kind_unexpected"),
    "recipientDid": (BOB.did, "envelope_wrong_recipient"),
    "senderDid": (MALLORY.did, "envelope_controller_mismatch"),
    "payload": ({**ANSWER, "hasMore": False}, "envelope_signature_invalid"),  # not digested
}


@pytest.mark.parametrize("member", sorted(RESPONSE_TAMPERING))
def test_tampering_with_any_response_member_is_refused(member: str) -> None:
    value, code = RESPONSE_TAMPERING[member]
    req = request()
    env = response(req)
    assert env[member] != value
    env[member] = value
    assert refused(verify_response, env, req).code == code


def test_a_changed_kind_among_the_expected_ones_breaks_the_signature() -> None:
    env = request()
    env["kind"] = "discover_request"
    error = refused(verify_request, env, expected_kind={"sync_request", "discover_request"})
    assert error.code == "envelope_signature_invalid"  # the digest is over the payload only


def tampered_payloads(payload: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every member changed, every member removed, one member added."""
    out: list[tuple[str, dict[str, Any]]] = []
    for name, value in payload.items():
        changed = copy.deepcopy(payload)
        if isinstance(value, bool):
            changed[name] = not value
        elif isinstance(value, int):
            changed[name] = value + 1
        else:
            changed[name] = [*value, {}]
        out.append((f"change {name}", changed))
        out.append((f"drop {name}", {k: v for k, v in payload.items() if k != name}))
    out.append(("add a member", {**payload, "extra": None}))
    return out


@pytest.mark.parametrize(("what", "payload"), tampered_payloads(SYNC))
def test_tampering_with_any_request_payload_member_is_refused(
    what: str, payload: dict[str, Any]
) -> None:
    env = request()
    env["payload"] = payload
    assert refused(verify_request, env).code == "envelope_digest_mismatch", what
    # Fixing the digest too does not help: the signature covers it.
    env["requestDigest"] = hashlib.sha256(jcs.canonicalize(payload)).hexdigest()
    assert refused(verify_request, env).code == "envelope_signature_invalid", what


@pytest.mark.parametrize(("what", "payload"), tampered_payloads(ANSWER))
def test_tampering_with_any_response_payload_member_is_refused(
    what: str, payload: dict[str, Any]
) -> None:
    req = request()
    env = response(req)
    env["payload"] = payload
    assert refused(verify_response, env, req).code == "envelope_signature_invalid", what


def test_checks_run_in_the_documented_order() -> None:
    breaks: list[tuple[str, dict[str, Any]]] = [  # in check order
        ("envelope_version_unsupported", {"version": "0"}),
        ("envelope_algorithm_unsupported", {"algorithm": "RS256"}),
        ("envelope_kind_unexpected", {"kind": "discover_request"}),
        ("envelope_controller_mismatch", {"senderDid": MALLORY.did}),
        ("envelope_wrong_recipient", {"recipientDid": MALLORY.did}),
        ("envelope_stale", {"timestamp": format_timestamp(NOW - 600_000)}),
        ("envelope_nonce_invalid", {"nonce": "short"}),
        ("envelope_digest_mismatch", {"requestDigest": "f" * 64}),
        ("envelope_signature_invalid", {"signature": b64url_encode(bytes(64))}),
    ]
    for index, (code, _) in enumerate(breaks):
        env = request()
        for _, members in breaks[index:]:
            env.update(members)
        assert refused(verify_request, env).code == code


# --- replay and binding ------------------------------------------------------------------------


def test_replaying_the_exact_request_still_verifies_here() -> None:
    """Single use is the nonce store's job, keyed on (senderDid, nonce) until nonce_expiry_ms."""
    env = request()
    assert verify_request(env) == verify_request(copy.deepcopy(env))


def test_a_response_built_for_one_request_fails_against_another() -> None:
    first, second = request(), request()
    assert first["payload"] == second["payload"]  # only the nonce differs
    error = refused(verify_response, response(first), second)
    assert error.code == "envelope_digest_mismatch"
    assert error.details["reason"] == "digest_mismatch"


def test_a_response_to_a_request_whose_signature_differs_fails() -> None:
    req = request()
    altered = {**req, "signature": OTHER_SIGNATURE}
    assert refused(verify_response, response(req), altered).code == "envelope_digest_mismatch"


def test_a_response_must_come_from_the_peer_asked() -> None:
    req = request()  # sent to BOB; MALLORY saw it and answers with her own valid signature
    forged = response(req, key=MALLORY)
    error = refused(verify_response, forged, req)
    assert error.code == "envelope_wrong_sender"


def test_a_response_kind_must_answer_the_request_kind() -> None:
    req = request()
    resp = resigned(response(req), BOB, kind="discover_response")
    kinds = {"sync_response", "discover_response"}
    error = refused(verify_response, resp, req, expected_kind=kinds)
    assert (error.code, error.details["reason"]) == (
        "envelope_kind_unexpected",
        "kind_does_not_answer_request",
    )


def test_a_request_is_not_accepted_where_a_response_is_expected() -> None:
    req = request()
    assert refused(verify_response, request(), req).code == "envelope_kind_unexpected"


# --- time ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent_at", "code"),
    [
        (NOW - 300_000, None),
        (NOW - 300_001, "envelope_stale"),
        (NOW + 300_000, None),
        (NOW + 300_001, "envelope_from_future"),
        (NOW, None),
    ],
)
def test_the_timestamp_window_is_inclusive_300_seconds(sent_at: int, code: str | None) -> None:
    env = request(now_ms=sent_at)
    if code is None:
        assert verify_request(env).timestamp_ms == sent_at
    else:
        assert refused(verify_request, env).code == code


def test_the_window_is_configurable_and_applies_to_responses() -> None:
    req = request()
    resp = response(req, now_ms=NOW - 10_001)
    assert verify_response(resp, req, window_seconds=11).timestamp_ms == NOW - 10_001
    assert refused(verify_response, resp, req, window_seconds=10).code == "envelope_stale"


@pytest.mark.parametrize(
    ("timestamp", "ms"),
    [
        ("2026-01-01T01:00:00.250+01:00", NOW + 250),  # another offset, same instant
        ("2026-01-01T00:00:00Z", NOW),  # no fraction
        ("2026-01-01T00:00:00.0005Z", NOW),  # sub-millisecond: floored
    ],
)
def test_any_rfc3339_timestamp_is_read_as_an_instant(timestamp: str, ms: int) -> None:
    env = resigned(request(), ALICE, timestamp=timestamp)
    assert verify_request(env).timestamp_ms == ms


@pytest.mark.parametrize(
    "timestamp",
    ["", "yesterday", "2026-01-01 00:00:00Z", "2026-01-01T00:00:00", "2026-13-01T00:00:00Z"],
)
def test_an_unreadable_timestamp_is_refused(timestamp: str) -> None:
    env = resigned(request(), ALICE, timestamp=timestamp)
    assert refused(verify_request, env).code == "envelope_timestamp_invalid"


@pytest.mark.parametrize("timestamp", [format_timestamp(NOW), "2026-01-01T00:00:00.0005Z"])
def test_nonce_expiry_is_the_first_instant_the_window_refuses_a_replay(timestamp: str) -> None:
    env = resigned(request(), ALICE, timestamp=timestamp)
    expiry = nonce_expiry_ms(verify_request(env))
    assert expiry == NOW + 300_001
    assert verify_request(env, now_ms=expiry - 1)  # still accepted: the store must remember
    assert refused(verify_request, env, now_ms=expiry).code == "envelope_stale"
    assert nonce_expiry_ms(verify_request(env, window_seconds=10), 10) == NOW + 10_001


# --- identity ------------------------------------------------------------------------------------


def test_wrong_recipient() -> None:
    error = refused(verify_request, request(recipient_did=MALLORY.did))
    assert error.code == "envelope_wrong_recipient"


def test_a_key_not_controlled_by_the_sender_is_refused_even_when_consistently_signed() -> None:
    env = resigned(request(), MALLORY, keyId=MALLORY.key_id)  # senderDid stays ALICE
    error = refused(verify_request, env)
    assert (error.code, error.details["reason"]) == (
        "envelope_controller_mismatch",
        "controller_not_sender",
    )


@pytest.mark.parametrize(
    "key_id",
    [
        ALICE.did,  # a DID, not a key id
        f"{ALICE.did}#{MALLORY.did[len('did:key:') :]}",  # fragment names another key
        "did:web:example.com#key-1",
        "did:key:zNotBase58!#zNotBase58!",
        "",
    ],
)
def test_a_key_id_that_is_not_a_did_key_key_id_is_refused(key_id: str) -> None:
    env = resigned(request(), ALICE, keyId=key_id)
    error = refused(verify_request, env)
    assert (error.code, error.details["reason"]) == (
        "envelope_controller_mismatch",
        "key_id_not_did_key",
    )


def test_a_signature_by_another_key_is_refused() -> None:
    env = resigned(request(), MALLORY)  # keyId and senderDid still ALICE's
    error = refused(verify_request, env)
    assert (error.code, error.details["reason"]) == (
        "envelope_signature_invalid",
        "signature_mismatch",
    )


def test_a_consistent_envelope_from_another_sender_verifies_and_names_that_sender() -> None:
    """Whether MALLORY is a known peer is the caller's (403) check, not this one."""
    env = request(key=MALLORY)
    assert verify_request(env).sender_did == MALLORY.did


@pytest.mark.parametrize(
    ("signature", "reason"),
    [
        ("", "signature_mismatch"),
        (b64url_encode(bytes(63)), "signature_mismatch"),
        (b64url_encode(bytes(65)), "signature_mismatch"),
        ("not base64url!", "signature_not_base64url"),
        (b64url_encode(bytes(64)) + "=", "signature_not_base64url"),
    ],
)
def test_malformed_signatures_are_refused(signature: str, reason: str) -> None:
    env = request()
    env["signature"] = signature
    error = refused(verify_request, env)
    assert (error.code, error.details["reason"]) == ("envelope_signature_invalid", reason)


# --- shape ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("envelope", [None, [], "envelope", 1, True])
def test_a_non_object_or_missing_envelope_is_401(envelope: Any) -> None:
    error = refused(verify_request, envelope)
    assert (error.code, error.details["reason"]) == ("envelope_invalid", "not_an_object")


@pytest.mark.parametrize("member", sorted(MEMBERS))
def test_a_missing_member_is_refused(member: str) -> None:
    env = request()
    del env[member]
    error = refused(verify_request, env)
    assert (error.code, error.details) == (
        "envelope_invalid",
        {"reason": "missing_members", "members": [member]},
    )


def test_an_extra_member_is_refused_even_if_signed() -> None:
    env = resigned(request(), ALICE, extra="x")
    error = refused(verify_request, env)
    assert (error.code, error.details) == (
        "envelope_invalid",
        {"reason": "unknown_members", "members": ["extra"]},
    )


@pytest.mark.parametrize("member", sorted(MEMBERS))
def test_a_member_of_the_wrong_type_is_refused(member: str) -> None:
    env = request()
    env[member] = ["x"] if member == "payload" else 1
    error = refused(verify_request, env)
    assert (error.code, error.details) == (
        "envelope_invalid",
        {"reason": "wrong_type", "member": member},
    )
    assert member in STRING_MEMBERS or member == "payload"


def test_a_payload_jcs_cannot_represent_is_refused_as_invalid_not_500() -> None:
    env = request()
    env["payload"] = {"fromSequence": 2**60, "maxEntries": 1}
    error = refused(verify_request, env)
    assert (error.code, error.details["reason"]) == ("envelope_invalid", "not_canonical_json")
    env["payload"] = {"x": "\ud800"}
    assert refused(verify_request, env).details["reason"] == "not_canonical_json"


@pytest.mark.parametrize(
    ("size", "reason"),
    [
        (15, "nonce_too_short"),
        (16, None),
        (64, None),
        (65, "nonce_too_long"),
        (4096, "nonce_too_long"),
    ],
)
def test_nonce_length_is_16_to_64_bytes(size: int, reason: str | None) -> None:
    env = resigned(request(), ALICE, nonce=b64url_encode(bytes(size)))
    if reason is None:
        assert verify_request(env).nonce == env["nonce"]
    else:
        error = refused(verify_request, env)
        assert (error.code, error.details["reason"]) == ("envelope_nonce_invalid", reason)


@pytest.mark.parametrize(
    "nonce",
    [
        b64url_encode(bytes(16)) + "==",  # padded
        "AAAAAAAAAAAAAAAAAAAAA+",  # standard alphabet
        "AAAAAAAAAAAAAAAAAAAAAB",  # non-canonical trailing bits
        "ÄAAAAAAAAAAAAAAAAAAAAA",
        "",
    ],
)
def test_a_nonce_that_is_not_unpadded_base64url_is_refused(nonce: str) -> None:
    env = resigned(request(), ALICE, nonce=nonce)
    error = refused(verify_request, env)
    assert error.code == "envelope_nonce_invalid"
    assert error.details["reason"] in {"nonce_not_base64url", "nonce_too_short"}


# --- pinned canonical bytes ----------------------------------------------------------------------

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def independent_did(seed: bytes) -> str:
    """did:key of an Ed25519 seed, without registry.did: multicodec 0xed01, base58btc."""
    data = b"\xed\x01" + bytes(nacl.signing.SigningKey(seed).verify_key)
    number, text = int.from_bytes(data, "big"), ""
    while number:
        number, rem = divmod(number, 58)
        text = _B58[rem] + text
    return "did:key:z" + text


def test_jcs_bytes_and_signature_are_pinned_for_a_fixed_envelope() -> None:
    sender = "did:key:z6MkehRgf7yJbgaGfYsdoAsKdBPE3dj2CYhowQdcjqSJgvVd"
    assert independent_did(bytes(range(32))) == sender == ALICE.did
    recipient = independent_did(bytes([7] * 32))
    assert recipient == BOB.did
    key_id = sender + "#" + sender[len("did:key:") :]
    digest = hashlib.sha256(b'{"fromSequence":41,"maxEntries":100}').hexdigest()
    expected = (
        '{"algorithm":"Ed25519",'
        f'"keyId":"{key_id}",'
        '"kind":"sync_request",'
        '"nonce":"AAAAAAAAAAAAAAAAAAAAAA",'
        '"payload":{"fromSequence":41,"maxEntries":100},'
        f'"recipientDid":"{recipient}",'
        f'"requestDigest":"{digest}",'
        f'"senderDid":"{sender}",'
        '"timestamp":"2026-01-01T00:00:00.000Z",'
        '"version":"1"}'
    ).encode()

    env = request(nonce="AAAAAAAAAAAAAAAAAAAAAA")
    unsigned = {k: v for k, v in env.items() if k != "signature"}
    assert canonicalize(unsigned) == expected
    assert jcs.canonicalize(unsigned) == expected
    signature = b64url_decode(env["signature"])
    nacl.signing.SigningKey(bytes(range(32))).verify_key.verify(expected, signature)
    assert signature == nacl.signing.SigningKey(bytes(range(32))).sign(expected).signature
    assert env["signature"] == (  # Ed25519 is deterministic (RFC 8032)
        "UPnYqoiN28gmoxtLHMWnjE8VdEnFYA-ZcHoq5cOnlYOnJdrIJx0w9Pj8J4SJBLzNBBB8pzw9sVHU5G0uTK21DA"
    )

    # The response's digest is over the complete request, signature member included.
    # Members sort …, senderDid, signature, timestamp, …
    complete = expected.replace(
        b',"timestamp"', f',"signature":"{env["signature"]}","timestamp"'.encode()
    )
    assert jcs.canonicalize(env) == complete
    resp = response(env)
    assert resp["requestDigest"] == hashlib.sha256(complete).hexdigest()


# --- payload validators --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ({"fromSequence": 0, "maxEntries": 1}, None),
        ({"fromSequence": 7, "maxEntries": 5000}, None),
        ({"fromSequence": 7, "maxEntries": 5, "agreementId": "default"}, None),
        ({"fromSequence": 0, "maxEntries": 1, "agreementId": ""}, "wrong_type"),
        ({"fromSequence": 0, "maxEntries": 1, "agreementId": 3}, "wrong_type"),
        ({"fromSequence": 2**63, "maxEntries": 1}, "out_of_range"),
        ([], "not_an_object"),
        (None, "not_an_object"),
        ({"fromSequence": 0}, "missing_members"),
        ({"maxEntries": 1}, "missing_members"),
        ({"fromSequence": 0, "maxEntries": 1, "extra": 1}, "unknown_members"),
        ({"fromSequence": -1, "maxEntries": 1}, "out_of_range"),
        ({"fromSequence": 0, "maxEntries": 0}, "out_of_range"),
        ({"fromSequence": True, "maxEntries": 1}, "wrong_type"),
        ({"fromSequence": 0, "maxEntries": 1.0}, "wrong_type"),
        ({"fromSequence": "0", "maxEntries": 1}, "wrong_type"),
        ({"fromSequence": 0, "maxEntries": None}, "wrong_type"),
    ],
)
def test_sync_request_payload(payload: Any, reason: str | None) -> None:
    if reason is None:
        assert sync_request_payload(payload) == (
            payload["fromSequence"],
            payload["maxEntries"],
            payload.get("agreementId"),
        )
        return
    with pytest.raises(Invalid) as info:
        sync_request_payload(payload)
    assert info.value.status == 400
    assert (info.value.code, info.value.details["reason"]) == ("sync_request_invalid", reason)


@pytest.mark.parametrize(
    ("n", "maximum", "clamped"),
    [
        (1, 1000, 1),
        (999, 1000, 999),
        (1000, 1000, 1000),
        (1001, 1000, 1000),
        (10**9, 50, 50),
        (0, 1000, 1),
    ],
)
def test_clamp_max_entries(n: int, maximum: int, clamped: int) -> None:
    assert clamp_max_entries(n, maximum) == clamped
    assert clamp_max_entries(5000) == 1000


# --- verifying over the bytes received ----------------------------------------------------------


def test_the_received_jcs_bytes_verify_without_re_serialising_and_tampering_still_fails() -> None:
    from registry.envelope import build_response_text

    req = request()
    text = build_response_text(
        BOB,
        request=req,
        kind="sync_response",
        payload_jcs=canonicalize(ANSWER).decode(),
        now_ms=NOW,
    )
    raw = text.encode()
    env = json.loads(raw)
    assert verify_response(env, req, raw=raw).payload == ANSWER
    # Pretty-printed (not JCS): the received bytes do not verify, JCS of the envelope does.
    pretty = json.dumps(env, indent=2).encode()
    assert verify_response(json.loads(pretty), req, raw=pretty).payload == ANSWER
    # A changed payload, in the bytes and the parsed body alike: refused on both paths.
    forged = raw.replace(b'"hasMore":true', b'"hasMore":false')
    assert forged != raw
    error = refused(verify_response, json.loads(forged), req, raw=forged)
    assert error.code == "envelope_signature_invalid"
