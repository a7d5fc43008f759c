"""The signed federation envelope (spec 2.9, design §9): building and verifying, no I/O.

Theory of operation. Every federation message is one JSON object with eleven members:

    version "1", kind, algorithm "Ed25519", keyId (the sender's did:key key id), senderDid,
    recipientDid, timestamp (RFC 3339), nonce (base64url of 16..64 random bytes), requestDigest,
    payload (an object), signature

`signature` is base64url (no padding) of the Ed25519 signature over JCS of the envelope without
`signature`. `requestDigest` ties the message to its request: a request's is the lowercase hex
SHA-256 of JCS(its payload); a response's is the same digest of JCS(the complete request envelope,
signature included), so a response answers exactly one request and cannot be replayed against
another.

`verify_envelope` runs the checks in a fixed order, cheapest and least sensitive first, the
signature last; each failure is `Unauthorized` (401) with its own `code` and a snake_case
`details["reason"]`. It works on the parsed JSON as received (style §8): the signature is checked
over JCS of those members, never over a re-serialised model.

What it does NOT check, because it is stateful: that the nonce is used once. The server stores
(senderDid, nonce) durably until `nonce_expiry_ms` and refuses a second use with 401; past that
instant the timestamp window refuses the envelope anyway. Whether the sender is a known peer with
an active agreement (403) is the caller's check too.
"""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from registry.canonical import canonical_members, canonicalize, join_members, sha256_hex
from registry.did import controller_of, public_key_from_key_id
from registry.errors import Invalid, Unauthorized
from registry.keys import SigningKey, b64url_decode, b64url_encode, verify
from registry.models import parse_datetime

VERSION: Final = "1"
ALGORITHM: Final = "Ed25519"
WINDOW_SECONDS: Final = 300
NONCE_BYTES: Final = 16  # what we send: 128 bits (design §9)
NONCE_MIN_BYTES: Final = 16  # what we accept
NONCE_MAX_BYTES: Final = 64
MAX_ENTRIES_LIMIT: Final = 1000
MAX_SEQUENCE: Final = 2**63 - 1

REQUEST_KINDS: Final = frozenset({"sync_request", "discover_request", "cosignature_request"})
RESPONSE_KINDS: Final = frozenset({"sync_response", "discover_response", "cosignature_response"})
KINDS: Final = REQUEST_KINDS | RESPONSE_KINDS
RESPONSE_FOR: Final = {
    "sync_request": "sync_response",
    "discover_request": "discover_response",
    "cosignature_request": "cosignature_response",  # a witness's cosignature (transparency.md)
}

STRING_MEMBERS: Final = (
    "version",
    "kind",
    "algorithm",
    "keyId",
    "senderDid",
    "recipientDid",
    "timestamp",
    "nonce",
    "requestDigest",
    "signature",
)
MEMBERS: Final = frozenset({*STRING_MEMBERS, "payload"})

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class VerifiedEnvelope:
    """What a verified envelope tells the caller; `payload` is the object as received."""

    sender_did: str
    key_id: str
    kind: str
    nonce: str
    timestamp_ms: int
    payload: dict[str, Any]


# --- building ---------------------------------------------------------------------------------


def format_timestamp(now_ms: int) -> str:
    """RFC 3339 UTC with milliseconds, e.g. `2026-01-01T00:00:00.000Z` (integer arithmetic)."""
    m = _EPOCH + timedelta(milliseconds=now_ms)
    return (
        f"{m.year:04d}-{m.month:02d}-{m.day:02d}T{m.hour:02d}:{m.minute:02d}:{m.second:02d}"
        f".{m.microsecond // 1000:03d}Z"
    )


def new_nonce() -> str:
    return b64url_encode(secrets.token_bytes(NONCE_BYTES))


def request_digest(request_payload: dict[str, Any]) -> str:
    """`requestDigest` of a request: hex SHA-256 of JCS(its payload)."""
    return sha256_hex(canonicalize(request_payload))


def response_digest(request: dict[str, Any]) -> str:
    """`requestDigest` of a response: hex SHA-256 of JCS(the complete request envelope)."""
    return sha256_hex(canonicalize(request))


def _sign(
    key: SigningKey,
    *,
    kind: str,
    recipient_did: str,
    payload: dict[str, Any],
    digest: str,
    now_ms: int,
    nonce: str | None,
) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise TypeError("payload must be a JSON object")
    if nonce is None:
        nonce = new_nonce()
    elif _nonce_problem(nonce) is not None:
        raise ValueError(f"nonce must be unpadded base64url of {NONCE_MIN_BYTES}..64 bytes")
    envelope: dict[str, Any] = {
        "version": VERSION,
        "kind": kind,
        "algorithm": ALGORITHM,
        "keyId": key.key_id,
        "senderDid": key.did,
        "recipientDid": recipient_did,
        "timestamp": format_timestamp(now_ms),
        "nonce": nonce,
        "requestDigest": digest,
        "payload": copy.deepcopy(payload),  # the caller's later edits must not unsign it
    }
    envelope["signature"] = b64url_encode(key.sign(canonicalize(envelope)))
    return envelope


def build_request(
    key: SigningKey,
    *,
    kind: str,
    recipient_did: str,
    payload: dict[str, Any],
    now_ms: int,
    nonce: str | None = None,
) -> dict[str, Any]:
    """A signed request envelope from `key`'s DID to `recipient_did`."""
    if kind not in REQUEST_KINDS:
        raise ValueError(f"{kind!r} is not a request kind")
    return _sign(
        key,
        kind=kind,
        recipient_did=recipient_did,
        payload=payload,
        digest=request_digest(payload),
        now_ms=now_ms,
        nonce=nonce,
    )


def build_response(
    key: SigningKey,
    *,
    request: dict[str, Any],
    kind: str,
    payload: dict[str, Any],
    now_ms: int,
    nonce: str | None = None,
) -> dict[str, Any]:
    """A signed response to `request` (a verified request envelope), addressed to its sender."""
    if kind != RESPONSE_FOR.get(request.get("kind", "")):
        raise ValueError(f"{kind!r} does not answer a {request.get('kind')!r}")
    return _sign(
        key,
        kind=kind,
        recipient_did=request["senderDid"],
        payload=payload,
        digest=response_digest(request),
        now_ms=now_ms,
        nonce=nonce,
    )


def build_response_text(
    key: SigningKey,
    *,
    request: dict[str, Any],
    kind: str,
    payload_jcs: str,
    now_ms: int,
    nonce: str | None = None,
) -> str:
    """`build_response` for a payload already in JCS form (e.g. stored entry documents joined
    as they are): the signed envelope's JCS text, without parsing or re-encoding the payload."""
    if kind != RESPONSE_FOR.get(request.get("kind", "")):
        raise ValueError(f"{kind!r} does not answer a {request.get('kind')!r}")
    if nonce is None:
        nonce = new_nonce()
    members = canonical_members(
        {
            "version": VERSION,
            "kind": kind,
            "algorithm": ALGORITHM,
            "keyId": key.key_id,
            "senderDid": key.did,
            "recipientDid": request["senderDid"],
            "timestamp": format_timestamp(now_ms),
            "nonce": nonce,
            "requestDigest": response_digest(request),
        }
    )
    members["payload"] = payload_jcs
    signature = key.sign(join_members(members).encode("utf-8"))
    members["signature"] = canonicalize(b64url_encode(signature)).decode("utf-8")
    return join_members(members)


# --- verifying --------------------------------------------------------------------------------


def _fail(code: str, reason: str, message: str, **details: Any) -> Unauthorized:
    return Unauthorized(
        f"federation envelope refused: {message}",
        code=code,
        details={"reason": reason, **details},
    )


def _nonce_problem(nonce: str) -> str | None:
    try:
        raw = b64url_decode(nonce)
    except ValueError:
        return "nonce_not_base64url"
    if len(raw) < NONCE_MIN_BYTES:
        return "nonce_too_short"
    if len(raw) > NONCE_MAX_BYTES:
        return "nonce_too_long"
    return None


def _expected_kinds(
    expected_kind: str | Iterable[str], request: dict[str, Any] | None
) -> frozenset[str]:
    """Validate the caller's arguments (a mistake here is a bug, hence `ValueError`)."""
    kinds = frozenset({expected_kind} if isinstance(expected_kind, str) else expected_kind)
    if not kinds or not kinds <= KINDS:
        raise ValueError(f"expected_kind must name envelope kinds, got {sorted(kinds)}")
    if request is None and kinds & RESPONSE_KINDS:
        raise ValueError("a response is verified against the request it answers: pass request")
    if request is not None and kinds & REQUEST_KINDS:
        raise ValueError("request is only for verifying responses")
    return kinds


def _signed_bytes_of(raw: bytes, signature: str) -> bytes | None:
    """The received text without its `signature` member: what the sender signed, if it sent
    its envelope as JCS (as this registry does). None when the member is not found exactly
    once; a wrong guess only fails the signature check, which then falls back to JCS."""
    member = b'"signature":' + json.dumps(signature).encode("ascii")
    for needle in (b"," + member, member + b","):
        if raw.count(needle) == 1:
            return raw.replace(needle, b"", 1)
    return None


def _check_shape(envelope: Any, *, canonical: bool = True) -> bytes:
    """Exactly the members, with their types; returns JCS of the envelope without `signature`
    (empty when not `canonical`: the caller has the received bytes to try first)."""
    if not isinstance(envelope, dict):
        raise _fail("envelope_invalid", "not_an_object", "the envelope must be a JSON object")
    missing = sorted(MEMBERS - envelope.keys())
    if missing:
        raise _fail("envelope_invalid", "missing_members", f"missing {missing}", members=missing)
    unknown = sorted(envelope.keys() - MEMBERS)
    if unknown:
        raise _fail(
            "envelope_invalid", "unknown_members", f"unknown members {unknown}", members=unknown
        )
    for name in STRING_MEMBERS:
        if not isinstance(envelope[name], str):
            raise _fail("envelope_invalid", "wrong_type", f"{name} must be a string", member=name)
    if not isinstance(envelope["payload"], dict):
        raise _fail("envelope_invalid", "wrong_type", "payload must be an object", member="payload")
    if not canonical:
        return b""
    return _unsigned_jcs(envelope)


def _unsigned_jcs(envelope: dict[str, Any]) -> bytes:
    unsigned = {k: v for k, v in envelope.items() if k != "signature"}
    try:
        return canonicalize(unsigned)
    except (Invalid, TypeError, ValueError, RecursionError):  # a lone surrogate, a set, …
        raise _fail(
            "envelope_invalid", "not_canonical_json", "the envelope cannot be canonicalised"
        ) from None


def _timestamp_us(text: str) -> int:
    try:
        moment = parse_datetime(text)
        delta = moment - _EPOCH
    except (ValueError, OverflowError):
        raise _fail(
            "envelope_timestamp_invalid",
            "timestamp_not_rfc3339",
            "timestamp is not an RFC 3339 date-time with offset",
        ) from None
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def verify_envelope(
    envelope: Any,
    *,
    recipient_did: str,
    now_ms: int,
    expected_kind: str | set[str] | frozenset[str],
    request: dict[str, Any] | None = None,
    window_seconds: int = WINDOW_SECONDS,
    raw: bytes | None = None,
) -> VerifiedEnvelope:
    """Verify a received envelope addressed to `recipient_did` (us) at `now_ms`.

    For a response, `request` is the complete request envelope we sent: the response must be of
    the matching kind, come from the DID we asked, and carry that request's digest.

    Checks, in order (code in brackets): shape [envelope_invalid], version
    [envelope_version_unsupported], algorithm [envelope_algorithm_unsupported], kind
    [envelope_kind_unexpected], keyId a did:key key id controlled by senderDid
    [envelope_controller_mismatch], recipientDid [envelope_wrong_recipient], for a response the
    sender [envelope_wrong_sender], timestamp [envelope_timestamp_invalid, envelope_stale,
    envelope_from_future], nonce [envelope_nonce_invalid], requestDigest
    [envelope_digest_mismatch], signature [envelope_signature_invalid].

    `raw`: the bytes `envelope` was parsed from (exactly those: the caller's promise, as the
    verdict then rests on them). The signature is then checked over them minus
    the `signature` member first (no re-serialisation of a large payload when the sender sent
    JCS), and over JCS of the envelope only if that fails: the same verdict, cheaper.

    The nonce is NOT checked for reuse here: single use is the nonce store's job (see
    `nonce_expiry_ms`). Replaying an envelope verbatim passes this function.
    """
    kinds = _expected_kinds(expected_kind, request)
    unsigned_bytes = _check_shape(envelope, canonical=raw is None)
    env: dict[str, Any] = envelope

    if env["version"] != VERSION:
        raise _fail(
            "envelope_version_unsupported", "version_unsupported", f"version must be {VERSION!r}"
        )
    if env["algorithm"] != ALGORITHM:
        raise _fail(
            "envelope_algorithm_unsupported",
            "algorithm_unsupported",
            f"algorithm must be {ALGORITHM!r}",
        )
    kind = env["kind"]
    if kind not in kinds:
        raise _fail(
            "envelope_kind_unexpected",
            "kind_unexpected",
            f"kind {kind[:40]!r} is not expected here",
            expected=sorted(kinds),
        )
    if request is not None and kind != RESPONSE_FOR.get(request.get("kind", "")):
        raise _fail(
            "envelope_kind_unexpected",
            "kind_does_not_answer_request",
            f"a {kind!r} does not answer a {request.get('kind')!r}",
        )

    key_id = env["keyId"]
    try:
        if "#" not in key_id:
            raise ValueError("a key id has a fragment")
        public_key = public_key_from_key_id(key_id)
    except ValueError:
        raise _fail(
            "envelope_controller_mismatch",
            "key_id_not_did_key",
            "keyId is not an Ed25519 did:key key id",
        ) from None
    if controller_of(key_id) != env["senderDid"]:
        raise _fail(
            "envelope_controller_mismatch",
            "controller_not_sender",
            "keyId is not a key of senderDid",
        )
    if env["recipientDid"] != recipient_did:
        raise _fail(
            "envelope_wrong_recipient", "wrong_recipient", "recipientDid is not this registry"
        )
    if request is not None and env["senderDid"] != request.get("recipientDid"):
        raise _fail(
            "envelope_wrong_sender",
            "sender_not_requested_peer",
            "the response does not come from the peer the request was sent to",
        )

    timestamp_us = _timestamp_us(env["timestamp"])
    skew_us = timestamp_us - now_ms * 1000
    window_us = window_seconds * 1_000_000
    if skew_us < -window_us:
        raise _fail(
            "envelope_stale",
            "timestamp_too_old",
            f"timestamp is more than {window_seconds} s in the past",
        )
    if skew_us > window_us:
        raise _fail(
            "envelope_from_future",
            "timestamp_in_future",
            f"timestamp is more than {window_seconds} s in the future",
        )

    problem = _nonce_problem(env["nonce"])
    if problem is not None:
        raise _fail(
            "envelope_nonce_invalid",
            problem,
            f"nonce must be unpadded base64url of {NONCE_MIN_BYTES}..{NONCE_MAX_BYTES} bytes",
        )

    payload: dict[str, Any] = env["payload"]
    expected_digest = request_digest(payload) if request is None else response_digest(request)
    if env["requestDigest"] != expected_digest:
        raise _fail(
            "envelope_digest_mismatch",
            "digest_mismatch",
            "requestDigest does not match "
            + ("the payload" if request is None else "the request it claims to answer"),
        )

    try:
        signature = b64url_decode(env["signature"])
    except ValueError:
        raise _fail(
            "envelope_signature_invalid", "signature_not_base64url", "signature is not base64url"
        ) from None
    if len(signature) == 64 and raw is not None:
        received = _signed_bytes_of(raw, env["signature"])
        if received is None or not verify(public_key, received, signature):
            unsigned_bytes = _unsigned_jcs(env)
        else:
            unsigned_bytes = received
    if len(signature) != 64 or not verify(public_key, unsigned_bytes, signature):
        raise _fail("envelope_signature_invalid", "signature_mismatch", "signature does not verify")

    return VerifiedEnvelope(
        sender_did=env["senderDid"],
        key_id=key_id,
        kind=kind,
        nonce=env["nonce"],
        timestamp_ms=timestamp_us // 1000,
        payload=payload,
    )


def nonce_expiry_ms(verified: VerifiedEnvelope, window_seconds: int = WINDOW_SECONDS) -> int:
    """The first instant (ms) at which the nonce store may forget (senderDid, nonce).

    `verify_envelope` accepts the envelope at every `now_ms` up to `timestamp_ms + window`
    inclusive, so the nonce must be kept while `now_ms < nonce_expiry_ms(...)`; from then on the
    timestamp check refuses a replay without the store's help.
    """
    return verified.timestamp_ms + window_seconds * 1000 + 1


# --- payloads ---------------------------------------------------------------------------------


def _invalid_payload(reason: str, message: str, **details: Any) -> Invalid:
    return Invalid(
        f"invalid sync request: {message}",
        code="sync_request_invalid",
        details={"reason": reason, **details},
    )


def _count(payload: dict[str, Any], name: str, minimum: int) -> int:
    value = payload[name]
    if not isinstance(value, int) or isinstance(value, bool):
        raise _invalid_payload("wrong_type", f"{name} must be an integer", field=name)
    if value < minimum or value > MAX_SEQUENCE:
        raise _invalid_payload(
            "out_of_range", f"{name} must be in {minimum}..{MAX_SEQUENCE}", field=name
        )
    return value


def sync_request_payload(payload: Any) -> tuple[int, int, str | None]:
    """`(fromSequence, maxEntries, agreementId)` of a sync request payload; 400 `Invalid` when
    malformed.

    `fromSequence` ≥ 0 (exclusive: changes after it), `maxEntries` ≥ 1 (clamp it with
    `clamp_max_entries`; a large value is not an error), and optionally `agreementId` (a
    non-empty string: the agreement the request is made under); no other member."""
    if not isinstance(payload, dict):
        raise _invalid_payload("not_an_object", "payload must be an object")
    members = {"fromSequence", "maxEntries"}
    missing = sorted(members - payload.keys())
    if missing:
        raise _invalid_payload("missing_members", f"missing {missing}", members=missing)
    unknown = sorted(payload.keys() - members - {"agreementId"})
    if unknown:
        raise _invalid_payload("unknown_members", f"unknown {unknown}", members=unknown)
    agreement = payload.get("agreementId")
    if not agreement_id_valid(agreement):
        raise _invalid_payload("wrong_type", AGREEMENT_ID_RULE, field="agreementId")
    return _count(payload, "fromSequence", 0), _count(payload, "maxEntries", 1), agreement


AGREEMENT_ID_RULE = "agreementId must be a string of 1..255 characters"


def agreement_id_valid(agreement: Any) -> bool:
    """Whether a payload's `agreementId` (sync's, discover's) is absent or well formed: an
    empty or overlong one is a malformed request (400), not an agreement unknown here (403)."""
    return agreement is None or (isinstance(agreement, str) and 1 <= len(agreement) <= 255)


def clamp_max_entries(n: int, maximum: int = MAX_ENTRIES_LIMIT) -> int:
    """`maxEntries` bounded to [1, maximum]."""
    return max(1, min(n, maximum))
