"""`GET /v1/openapi.json`: an OpenAPI 3.1 document that describes the service as it behaves.

* Request schemas come from the pydantic models that validate them (`registry.models`,
  `registry.discovery`); the bodies the use-cases check by hand (trust and transfer records) are
  described here, next to the constants of the rules they mirror (`registry.trust`,
  `registry.usecases.records`).
* `_harden` adds what every JSON body obeys (`registry.canonical.parse_strict`): no U+0000 in a
  string or member name, numbers within ±(2^53−1); a free-form member is a `JsonValue`.
* Every operation lists every status it can answer: the admission statuses of
  `api.http.endpoint` (413, 415 and 400 for a body, 401 for a session, 429), 400 and 409 of an
  `Idempotency-Key`, 404 for a path parameter (also one that cannot be routed), 503, and the
  use-case's own. A few refusals depend on what no schema can say (signatures and hashes, the
  RegistryQL grammar, opaque cursors, time windows, other resources); their descriptions say so.

`tests/api/test_schema_fuzz.py` holds the document to this: Schemathesis, all checks.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel
from quart import Quart

from api.http import Admission
from registry import trust
from registry.anchoring import STATES as INTENT_STATES
from registry.did import B58_ALPHABET as BASE58_ALPHABET
from registry.did import ED25519_MULTICODEC, b58encode
from registry.discovery import DiscoverRequest, RegistryQLRequest
from registry.envelope import MEMBERS as ENVELOPE_MEMBERS
from registry.models import (
    DATE_TIME_SCHEMA,
    DID_SCHEMA,
    MAX_SAFE_INTEGER,
    NO_NUL_PATTERN,
    NUMBER_SCHEMAS,
    WHITESPACE,
    Challenge,
    ChallengeRequest,
    ErrorResponse,
    RegistryEntry,
    SignInResponse,
    VerifyRequest,
)
from registry.usecases.records import MAX_TEXT

REF = "#/components/schemas/"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": REF + name}


# --- patterns of the rules the use-cases check by hand -----------------------------------------


def _base58_class(first: str, last: str) -> str:
    """A regex class of the base58 digits from `first` to `last`, in the alphabet's order."""
    digits = BASE58_ALPHABET[BASE58_ALPHABET.index(first) : BASE58_ALPHABET.index(last) + 1]
    runs: list[str] = []
    start = prev = digits[0]
    for char in digits[1:]:
        if ord(char) != ord(prev) + 1:
            runs.append(start if start == prev else f"{start}-{prev}")
            start = char
        prev = char
    runs.append(start if start == prev else f"{start}-{prev}")
    return "[" + "".join(runs) + "]"


def _did_key_pattern() -> str:
    """An Ed25519 did:key: `did:key:z` + base58btc(0xed 0x01 ‖ 32 bytes), 47 digits, from the
    least such value's to the greatest's. The pattern bounds the digits up to the fourth: a few
    strings it admits are not such a value (the exact regex is 5 KB, too slow to generate
    from); `registry.did.public_key_from_did_key` refuses those."""
    low = b58encode(ED25519_MULTICODEC + bytes(32))
    high = b58encode(ED25519_MULTICODEC + b"\xff" * 32)
    assert len(low) == len(high)
    assert low[:3] == high[:3]
    rest = _base58_class(BASE58_ALPHABET[0], BASE58_ALPHABET[-1])
    return f"^did:key:z{low[:3]}{_base58_class(low[3], high[3])}{rest}{{{len(low) - 4}}}$"


ED25519_DID_KEY_PATTERN = _did_key_pattern()
# A positive amount: `trust.AMOUNT` without zero (`trust.parse_amount`).
_FRACTION = "|".join(f"0{{{n}}}[1-9][0-9]{{0,{17 - n}}}" for n in range(18))
POSITIVE_AMOUNT_PATTERN = rf"^(?:[1-9][0-9]{{0,29}}(?:\.[0-9]{{1,18}})?|0\.(?:{_FRACTION}))$"
# A sequence as text: 1 to 2^63−1 (`registry.usecases.common.parse_sequence`).
_INT64_MAX = str(2**63 - 1)


def _decimal_at_most(limit: str) -> str:
    """A regex for the decimal numerals 1..`limit` without leading zeros."""
    shorter = f"[1-9][0-9]{{0,{len(limit) - 2}}}"

    def upto(digits: str) -> str:  # numerals of len(digits) digits, at most `digits`
        first = int(digits[0])
        if len(digits) == 1:
            return f"[0-{first}]"
        parts = []
        if first > 0:
            parts.append(f"[0-{first - 1}][0-9]{{{len(digits) - 1}}}")
        parts.append(digits[0] + upto(digits[1:]))
        return "(?:" + "|".join(parts) + ")"

    first = int(limit[0])
    same = [f"[1-{first - 1}][0-9]{{{len(limit) - 1}}}"] if first > 1 else []
    same.append(limit[0] + upto(limit[1:]))
    return "^(?:" + "|".join([shorter, *same]) + ")$"


SEQUENCE_TEXT_PATTERN = _decimal_at_most(_INT64_MAX)
# A reason or a note: at most MAX_TEXT characters, not only whitespace (`records.text_field`).
TEXT_SCHEMA: dict[str, Any] = {
    "type": "string",
    "maxLength": MAX_TEXT,
    "pattern": rf"^[^\x00]*[^\x00{WHITESPACE}][^\x00]*$",
}


# --- schemas -----------------------------------------------------------------------------------

_MODELS: list[type[BaseModel]] = [
    DiscoverRequest,
    RegistryQLRequest,
    RegistryEntry,
    ErrorResponse,
    ChallengeRequest,
    Challenge,
    SignInResponse,
    VerifyRequest,
]

JSON_VALUE: dict[str, Any] = {
    "description": (
        "Any JSON value under the registry's I-JSON rules: no U+0000 in a string or member"
        " name, numbers within ±(2^53−1) (or doubles beyond ±10^21), at most 64 levels of"
        " nesting"
    ),
    "anyOf": [
        {"type": "null"},
        {"type": "boolean"},
        *NUMBER_SCHEMAS,
        {"type": "string", "pattern": NO_NUL_PATTERN},
        {"type": "array", "items": _ref("JsonValue")},
        {
            "type": "object",
            "propertyNames": {"pattern": NO_NUL_PATTERN},
            "additionalProperties": _ref("JsonValue"),
        },
    ],
}

STR: dict[str, Any] = {"type": "string"}
_INT: dict[str, Any] = {"type": "integer"}
_TIME: dict[str, Any] = {"type": "string", "format": "date-time"}
_DID: dict[str, Any] = DID_SCHEMA
_AMOUNT: dict[str, Any] = {
    "type": "string",
    "pattern": trust.AMOUNT.pattern,
    "description": "a decimal string (exact arithmetic)",
}
_POSITIVE_AMOUNT: dict[str, Any] = {
    "type": "string",
    "pattern": POSITIVE_AMOUNT_PATTERN,
    "description": "a decimal string above zero: at most 30 integer and 18 fractional digits",
}
_SIGNATURE: dict[str, Any] = {
    "type": "object",
    "required": ["algorithm", "keyId", "value"],
    "properties": {
        "algorithm": {"const": "Ed25519"},
        "keyId": STR,
        "value": STR,
        "created": _TIME,
    },
}


def _obj(required: list[str], **properties: Any) -> dict[str, Any]:
    """A response object (what the server writes: members may be added later)."""
    return {"type": "object", "required": required, "properties": properties}


def _body(required: list[str], **properties: Any) -> dict[str, Any]:
    """A request body with exactly these members (`records.body_object` refuses others)."""
    return {
        "type": "object",
        "required": required,
        "properties": properties,
        "additionalProperties": False,
    }


def _page_of(name: str, item: str, **extra: Any) -> dict[str, Any]:
    return _obj(
        [name, "hasMore"],
        **extra,
        **{name: {"type": "array", "items": _ref(item)}},
        cursor={"type": "string", "pattern": SEQUENCE_TEXT_PATTERN},
        hasMore={"type": "boolean"},
    )


def _entry_variants(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry schemas of each operation, from the model's (`RegistryEntry`)."""

    def variant(description: str, required: tuple[str, ...] = (), **props: Any) -> dict[str, Any]:
        schema = copy.deepcopy(entry)
        schema["description"] = description
        schema["required"] = sorted({*schema["required"], *required})
        for name, value in props.items():
            if value is None:
                del schema["properties"][name]
            else:
                schema["properties"][name] = value
        return schema

    lifecycle = entry["properties"]["lifecycleStatus"]
    return {
        "NewRegistryEntry": variant(
            "A new entry (create): it starts as draft (lifecycleStatus absent or null) or"
            " active. itemDataHash must be SHA-256 of JCS(itemData) and the signature must"
            " verify (400 otherwise)",
            lifecycleStatus={
                "anyOf": [{"enum": ["draft", "active"]}, {"type": "null"}],
                "default": None,
            },
        ),
        "UpdatedRegistryEntry": variant(
            "A new version (update): entryDid is the DID in the path, and sequence the one"
            " of the version it is based on (409 when that is not the latest)",
            required=("sequence",),
            sequence={"type": "integer", "minimum": 1},
        ),
        "TransferredEntry": variant(
            "The entry a recipient accepts: the offered snapshot, signed by the recipient"
            " (spec 4.2 rules a-e); sequence is the offered one; verifiableAttestations must"
            " be omitted",
            required=("sequence",),
            sequence={"type": "integer", "minimum": 1},
            verifiableAttestations=None,
        ),
        "ServedEntry": variant(
            "An entry as served: as published, with the registry-managed sequence, updatedAt,"
            " anchorState and, when attested, verifiableAttestations",
            required=("sequence", "updatedAt", "anchorState"),
            sequence={"type": "integer", "minimum": 1},
            anchorState={"enum": ["unanchored", "pending", "anchored", "failed", "abandoned"]},
            updatedAt=_TIME,
            lifecycleStatus=lifecycle,
            verifiableAttestations={"type": "array", "items": _ref("JsonValue")},
        ),
    }


_HAND_SCHEMAS: dict[str, Any] = {
    "VersionsResponse": _obj(
        ["entryDid", "versions", "hasMore", "totalCount"],
        entryDid=STR,
        versions={"type": "array", "items": _ref("ServedEntry")},
        cursor={"type": "string", "pattern": SEQUENCE_TEXT_PATTERN},
        hasMore={"type": "boolean"},
        totalCount=_INT,
    ),
    "QueryResult": _obj(
        ["entries", "hasMore", "totalCount"],
        entries={"type": "array", "items": _ref("ServedEntry")},
        cursor={"type": "string", "description": "opaque; absent on the last page"},
        hasMore={"type": "boolean"},
        totalCount={"type": "integer", "description": "exact up to 1000"},
        totalCountExact={"const": False, "description": "present when totalCount is capped"},
    ),
    "LineageResponse": _obj(["entryDid", "lineage"], entryDid=STR, lineage=_ref("JsonValue")),
    "Tombstone": _obj(
        ["entryDid", "lifecycleStatus", "sequence", "deletedAt"],
        entryDid=STR,
        lifecycleStatus={"const": "deleted"},
        sequence=_INT,
        deletedAt=_TIME,
    ),
    "ChallengeResponse": _obj(["challenge"], challenge=_ref("Challenge")),
    "VerifyResponse": _obj(
        [
            "expiresAtMs",
            "hmrDid",
            "rootDid",
            "rootKind",
            "sessionExpiresAtMs",
            "sessionToken",
            "signerPublicKey",
        ],
        expiresAtMs=_INT,
        hmrDid=STR,
        rootDid=STR,
        rootKind=STR,
        sessionExpiresAtMs=_INT,
        sessionToken=STR,
        signerPublicKey=STR,
        signerDid=STR,
        capabilities={"type": "array", "items": STR},
    ),
    "Session": _obj(
        ["expiresAtMs", "hmrDid", "rootDid", "rootKind"],
        expiresAtMs=_INT,
        hmrDid=STR,
        rootDid=STR,
        rootKind=STR,
        signerDid=STR,
        capabilities={"type": "array", "items": STR},
    ),
    "LoggedOut": _obj(["loggedOut"], loggedOut={"const": True}),
    "Health": _obj(
        ["status", "checks"],
        status={"enum": ["ok", "degraded", "failing"]},
        checks={"type": "object", "additionalProperties": STR},
        registryDid=STR,
    ),
    "DeepHealth": _obj(
        ["status", "checks", "logHead"],
        status={"enum": ["ok", "degraded", "failing"]},
        checks={"type": "object", "additionalProperties": STR},
        logHead=_INT,
    ),
    "OpenApiDocument": _obj(["openapi", "info", "paths"], openapi=STR),
}

_TRUST_SCHEMAS: dict[str, Any] = {
    "AttestationRequest": _body(
        ["attestation", "entryDid"],
        attestation={
            "type": "object",
            "description": (
                "a W3C Verifiable Credential secured by one eddsa-jcs-2022 DataIntegrityProof"
                " from an Ed25519 did:key of its issuer, the signed-in principal; its"
                " credentialSubject.id is entryDid (400 credential_invalid, proof_invalid or"
                " subject_mismatch otherwise)"
            ),
            "required": ["proof"],
            "properties": {
                "proof": {
                    "type": "object",
                    "required": ["type", "cryptosuite", "proofPurpose", "verificationMethod"],
                    "properties": {
                        "type": {"const": "DataIntegrityProof"},
                        "cryptosuite": {"const": "eddsa-jcs-2022"},
                        "proofPurpose": {"const": "assertionMethod"},
                        "verificationMethod": STR,
                        "proofValue": STR,
                    },
                    "additionalProperties": _ref("JsonValue"),
                }
            },
            "propertyNames": {"pattern": NO_NUL_PATTERN},
            "additionalProperties": _ref("JsonValue"),
        },
        entryDid=_DID,
    ),
    "Attestation": _obj(
        ["acceptedAt", "attestationId", "credential", "entryDid", "issuerDid"],
        acceptedAt=_TIME,
        attestationId=STR,
        credential={"type": "object"},
        entryDid=STR,
        issuerDid=STR,
        issuedAt=_TIME,
        expiresAt=_TIME,
        revokedAt=_TIME,
    ),
    "ReportRequest": _body(["entryDid", "reason"], entryDid=_DID, reason=TEXT_SCHEMA),
    "ReportCreated": _obj(
        ["entryDid", "reportId", "status"],
        entryDid=STR,
        reportId=STR,
        status={"const": "reported"},
    ),
    "Report": _obj(
        ["createdAt", "entryDid", "reason", "reportId", "reporterDid", "status"],
        createdAt=_TIME,
        entryDid=STR,
        reason=STR,
        reportId=STR,
        reporterDid=STR,
        status={"enum": ["reported", "dismissed", "upheld"]},
        resolvedAt=_TIME,
        resolution={"type": "object"},
    ),
    "ResolveRequest": {
        **_body(
            ["decision"],
            decision={"enum": ["dismiss", "uphold"]},
            note=TEXT_SCHEMA,
            slash={
                "anyOf": [
                    {
                        **_body(["bondId", "amount"], bondId=STR, amount=_POSITIVE_AMOUNT),
                        "description": "checked once the report is found",
                    },
                    {"type": "null"},
                ]
            },
        ),
        # Only an upheld report can slash a bond.
        "if": {"required": ["slash"], "properties": {"slash": {"type": "object"}}},
        "then": {"properties": {"decision": {"const": "uphold"}}},
    },
    "BondRequest": _body(
        ["amount", "bondId", "currency", "entryDid", "publisherDid"],
        amount=_POSITIVE_AMOUNT,
        bondId={"type": "string", "pattern": trust.RECORD_ID.pattern},
        currency={"type": "string", "pattern": trust.CURRENCY.pattern},
        entryDid=_DID,
        publisherDid={
            **_DID,
            "description": "the entry's publisher (400 bond_publisher_mismatch otherwise)",
        },
        status={"const": "active"},
    ),
    "Bond": _obj(
        [
            "amount",
            "bondId",
            "createdAt",
            "currency",
            "entryDid",
            "publisherDid",
            "registryDid",
            "remainingAmount",
            "slashHistory",
            "status",
        ],
        amount=_AMOUNT,
        bondId=STR,
        createdAt=_TIME,
        currency=STR,
        entryDid=STR,
        publisherDid=STR,
        registryDid=STR,
        remainingAmount=_AMOUNT,
        status={"enum": ["active", "slashed", "exhausted", "released"]},
        releasedAt=_TIME,
        slashHistory={
            "type": "array",
            "items": _obj(
                ["amount", "distribution", "reason", "reporterDid", "timestamp"],
                amount=_AMOUNT,
                reason=STR,
                reporterDid=STR,
                timestamp=_TIME,
                distribution=_obj(
                    ["harmedPartiesShare", "reporterShare", "treasuryShare"],
                    harmedPartiesShare=_AMOUNT,
                    reporterShare=_AMOUNT,
                    treasuryShare=_AMOUNT,
                ),
            ),
        },
    ),
    "SlashRequest": _body(
        ["amount", "reason", "reporterDid"],
        amount=_POSITIVE_AMOUNT,
        reason=TEXT_SCHEMA,
        reporterDid=_DID,
    ),
    "OfferRequest": _body(
        ["entryDid", "entrySequence", "recipientDid", "ownerSignature"],
        entryDid=_DID,
        entrySequence={"type": "integer", "minimum": 1},
        recipientDid={
            "type": "string",
            "pattern": ED25519_DID_KEY_PATTERN,
            "description": (
                "an Ed25519 did:key other than the owner's (a few strings of this pattern are"
                " not one: 400 offer_invalid)"
            ),
        },
        expiresAt={
            "anyOf": [
                {
                    **DATE_TIME_SCHEMA,
                    "description": "in the future and at most 30 days away (400 otherwise)",
                },
                {"type": "null"},
            ],
            "description": "default: 7 days from now",
        },
        ownerSignature={
            **_SIGNATURE,
            "description": "the owner's Ed25519 signature over JCS of the offer (400 otherwise)",
            "properties": {
                "algorithm": {"const": "Ed25519"},
                "keyId": STR,
                "value": STR,
                "created": _ref("JsonValue"),
            },
            "propertyNames": {"pattern": NO_NUL_PATTERN},
            "additionalProperties": _ref("JsonValue"),
        },
    ),
    "TransferOffer": _obj(
        [
            "createdAt",
            "entryDid",
            "entrySequence",
            "expiresAt",
            "offerId",
            "ownerDid",
            "ownerSignature",
            "recipientDid",
            "status",
        ],
        createdAt=_TIME,
        entryDid=STR,
        entrySequence=_INT,
        expiresAt=_TIME,
        offerId=STR,
        ownerDid=STR,
        ownerSignature=_SIGNATURE,
        recipientDid=STR,
        status={"enum": ["offered", "accepted", "declined", "cancelled", "expired"]},
        decidedAt=_TIME,
        declineReason=STR,
    ),
    "AcceptRequest": _body(["entry"], entry=_ref("TransferredEntry")),
    "DeclineRequest": _body([], reason=TEXT_SCHEMA),
    "AttestationPage": _page_of("attestations", "Attestation", entryDid=STR),
    "MerkleProof": _obj(
        ["root", "path", "leafHash"],
        root={"type": "string", "pattern": "^[0-9a-f]{64}$"},
        leafHash={"type": "string", "pattern": "^[0-9a-f]{64}$"},
        path={
            "type": "array",
            "items": _obj(
                ["hash", "direction"],
                hash={"type": "string", "pattern": "^[0-9a-f]{64}$"},
                direction={"enum": ["left", "right"]},
            ),
        },
    ),
    "AnchorRecord": _obj(
        ["entryDid", "itemDataHash", "blockHeight", "txHash", "anchorTime"],
        entryDid=STR,
        itemDataHash=STR,
        blockHeight={"type": "integer", "minimum": 0},
        txHash=STR,
        anchorTime=_TIME,
        proof={"oneOf": [_ref("MerkleProof"), {"type": "null"}]},
    ),
    "AnchorIntent": _obj(
        [
            "intentId",
            "entryDid",
            "sequence",
            "operation",
            "state",
            "attempts",
            "availableAt",
            "createdAt",
            "updatedAt",
            "receipts",
        ],
        intentId=STR,
        entryDid=STR,
        sequence=_INT,
        operation={"enum": ["create", "update", "transfer", "delete"]},
        state={"enum": list(INTENT_STATES)},
        attempts=_INT,
        availableAt=_TIME,
        createdAt=_TIME,
        updatedAt=_TIME,
        transactionId=STR,
        receipts={
            "type": "array",
            "items": _obj(
                ["blockHeight", "observedAt", "proof", "receiptKey", "state", "transactionId"],
                blockHeight={"type": ["integer", "null"]},
                observedAt=_TIME,
                proof={"oneOf": [_ref("MerkleProof"), {"type": "null"}]},
                receiptKey=STR,
                state={"enum": ["submitted", "confirmed", "dropped"]},
                transactionId={"type": ["string", "null"]},
                anchorTime=_TIME,
            ),
        },
        anchor=_ref("AnchorRecord"),
    ),
    "AnchorList": _obj(
        ["anchorState", "entryDid", "hasMore", "records"],
        anchorState={"enum": ["unanchored", "pending", "anchored", "failed", "abandoned"]},
        entryDid=STR,
        hasMore={"type": "boolean"},
        cursor={"type": "string", "minLength": 1, "maxLength": 2048, "pattern": "^[A-Za-z0-9_-]+$"},
        records={"type": "array", "items": _ref("AnchorIntent")},
    ),
    "AnchorControl": _obj(
        ["intentId", "state"], intentId=STR, state={"enum": ["pending", "abandoned"]}
    ),
    "ReportPage": _page_of("reports", "Report"),
    # Federation (spec 2.8, 2.9).
    "FederationPeer": _obj(
        ["peerDid", "endpoint", "agreementIds"],
        peerDid=STR,
        endpoint=STR,
        grpcEndpoint=STR,
        agreementIds={"type": "array", "items": STR},
        lastSeen=_TIME,
    ),
    "FederationPeers": {"type": "array", "items": _ref("FederationPeer")},
    "FederatedResult": _obj(
        ["entries", "hasMore", "totalCount", "federation"],
        entries={"type": "array", "items": _ref("ServedEntry")},
        cursor={"type": "string", "description": "opaque and tamper-evident"},
        hasMore={"type": "boolean"},
        totalCount=_INT,
        federation=_obj(
            [
                "federated",
                "partial",
                "peersAttempted",
                "peersFailed",
                "peersSucceeded",
                "peers",
                "origins",
            ],
            federated={"type": "boolean"},
            partial={"type": "boolean"},
            peersAttempted=_INT,
            peersFailed=_INT,
            peersSucceeded=_INT,
            peers={
                "type": "array",
                "items": _obj(
                    ["peerDid", "status"],
                    peerDid=STR,
                    status={"enum": ["ok", "failed", "skipped"]},
                    reason=STR,
                ),
            },
            origins={"type": "array", "items": STR},
        ),
    ),
    "FederationPeerStatus": _obj(
        ["peerDid", "breakerState", "consecutiveFailures", "cursor", "lag", "quarantines"],
        peerDid=STR,
        breakerState={"enum": ["closed", "open", "half_open"]},
        consecutiveFailures=_INT,
        cursor=_INT,
        lag=_INT,
        latencyMs=_INT,
        lastSuccessAt=_TIME,
        nextAttemptAt=_TIME,
        quarantines=_INT,
    ),
    "FederationPeerStatuses": {"type": "array", "items": _ref("FederationPeerStatus")},
    "PeerUpdate": _body(
        ["endpoint"],
        endpoint={"type": "string", "minLength": 8, "maxLength": 2048, "pattern": "^https?://"},
        grpcEndpoint={"type": "string", "maxLength": 2048},
    ),
    "Envelope": _obj(
        sorted(ENVELOPE_MEMBERS),
        version={"const": "1"},
        kind={"enum": ["sync_request", "sync_response", "discover_request", "discover_response"]},
        algorithm={"const": "Ed25519"},
        keyId=STR,
        senderDid=STR,
        recipientDid=STR,
        timestamp=_TIME,
        nonce=STR,
        requestDigest=STR,
        payload={"type": "object"},
        signature=STR,
    ),
}


def _is_free_form(schema: dict[str, Any]) -> bool:
    """A schema that says nothing about the value (pydantic's `Any`)."""
    return not set(schema) - {"title", "description", "default"}


def _harden(node: Any, *, request: bool) -> Any:
    """Apply the rules of every JSON body to a request schema (`request`), and make free-form
    members `JsonValue` in both directions."""
    if isinstance(node, list):
        return [_harden(item, request=request) for item in node]
    if not isinstance(node, dict):
        return node
    if _is_free_form(node):
        return {**node, **_ref("JsonValue")}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "$defs"):
            out[key] = {name: _harden(sub, request=request) for name, sub in value.items()}
        elif key in ("examples", "enum", "const", "default", "required"):
            out[key] = value
        else:
            out[key] = _harden(value, request=request)
    if out.get("additionalProperties") is True:
        out["additionalProperties"] = _ref("JsonValue")
    if request and out.get("type") == "object" and out.get("additionalProperties") is not False:
        out.setdefault("propertyNames", {"pattern": NO_NUL_PATTERN})
    if request and out.get("type") == "string" and "pattern" not in out:
        out["pattern"] = NO_NUL_PATTERN
    beyond = out.get("minimum", 0) > MAX_SAFE_INTEGER or out.get("maximum", 0) < -MAX_SAFE_INTEGER
    if request and out.get("type") in ("integer", "number") and not beyond:
        out["minimum"] = max(out.get("minimum", -MAX_SAFE_INTEGER), -MAX_SAFE_INTEGER)
        out["maximum"] = min(out.get("maximum", MAX_SAFE_INTEGER), MAX_SAFE_INTEGER)
    return out


# Schemas only ever received, only ever sent, or both (a served entry is also what a client
# sends back: its request rules hold for it too).
_REQUEST_SCHEMAS = frozenset(
    {
        "DiscoverRequest",
        "RegistryQLRequest",
        "RegistryEntry",
        "NewRegistryEntry",
        "UpdatedRegistryEntry",
        "TransferredEntry",
        "ChallengeRequest",
        "Challenge",
        "SignInResponse",
        "VerifyRequest",
        "Signature",
        "Relationship",
        "SemanticAnnotation",
        "ServiceEndpoint",
        "RelationshipFilter",
        "AttestationRequest",
        "ReportRequest",
        "ResolveRequest",
        "BondRequest",
        "SlashRequest",
        "OfferRequest",
        "AcceptRequest",
        "DeclineRequest",
        "PeerUpdate",
        "FederatedQuery",
    }
)


def _schemas() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in _MODELS:
        schema = model.model_json_schema(by_alias=True, ref_template=REF + "{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    schemas.update(_entry_variants(schemas["RegistryEntry"]))
    schemas.update(_HAND_SCHEMAS)
    schemas.update(_TRUST_SCHEMAS)
    federated = copy.deepcopy(schemas["DiscoverRequest"])
    federated["required"] = ["entryType"]
    federated["description"] = "A DiscoverRequest with entryType required; paged by cursor only"
    federated["properties"]["offset"] = {"enum": [0, None]}
    schemas["FederatedQuery"] = federated
    hardened = {
        name: _harden(schema, request=name in _REQUEST_SCHEMAS) for name, schema in schemas.items()
    }
    hardened["JsonValue"] = JSON_VALUE
    return hardened


# --- operations --------------------------------------------------------------------------------


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": _ref("ErrorResponse")}},
    }


def ok(name: str, description: str = "OK", **headers: str) -> dict[str, Any]:
    """A success response whose JSON body is the schema `name`, with `headers` described."""
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": _ref(name)}},
    }
    if headers:
        response["headers"] = {
            header: {"description": text, "schema": {"type": "string"}}
            for header, text in headers.items()
        }
    return response


IDEMPOTENCY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": True,
    "description": "1-255 visible ASCII characters; a retry with the same key replays",
    "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[!-~]+$"},
}
AUTH: list[dict[str, list[str]]] = [{"bearer": []}, {"cookie": []}]
# `api.entries.int_param` and `page_size`: at least 1, above the maximum page size clamped.
LIMIT = {
    "name": "limit",
    "in": "query",
    "description": "page size; above the maximum page size it is clamped",
    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_SAFE_INTEGER},
}
SEQUENCE_CURSOR = {
    "name": "cursor",
    "in": "query",
    "description": "the cursor of the previous page",
    "schema": {"type": "string", "pattern": SEQUENCE_TEXT_PATTERN},
}


PAGE = [LIMIT, SEQUENCE_CURSOR]


def _path(name: str, description: str = "") -> dict[str, Any]:
    param: dict[str, Any] = {"name": name, "in": "path", "required": True, "schema": STR}
    if description:
        param["description"] = description
    return param


# Path parameters by name (a route's `<name>`); any other is a string.
PATH_PARAMETERS = {
    "did": _path("did", "an entry DID (any other text is simply not found)"),
    "sequence": {
        "name": "sequence",
        "in": "path",
        "required": True,
        "schema": {"type": "integer", "minimum": 1},
    },
}


@dataclass(frozen=True)
class OperationDoc:
    """What the document says of one operation beyond what its route says (its path and
    parameters, its method, its view's name as `operationId`, and from `api.http.endpoint`
    whether it needs a session and takes a body)."""

    summary: str
    ok: dict[str, Any]  # status -> response (`ok(...)`)
    errors: dict[str, str] = field(default_factory=dict)  # the use-case's refusals
    body: str | None = None  # the schema of the JSON body
    body_required: bool = True
    idempotent: bool = False  # takes an Idempotency-Key
    params: list[dict[str, Any]] = field(default_factory=list)  # query and header ones


_F = TypeVar("_F", bound=Callable[..., Any])


def documented(
    summary: str,
    *,
    ok: dict[str, Any],
    errors: dict[str, str] | None = None,
    body: str | None = None,
    body_required: bool = True,
    idempotent: bool = False,
    params: list[dict[str, Any]] | None = None,
) -> Callable[[_F], _F]:
    """Declare a route's operation for the document (under `api.http.endpoint`)."""
    doc = OperationDoc(summary, ok, errors or {}, body, body_required, idempotent, params or [])

    def mark(view: _F) -> _F:
        view.__openapi__ = doc  # type: ignore[attr-defined]
        return view

    return mark


def _operation(
    op_id: str, doc: OperationDoc, admission: Admission, path_params: list[dict[str, Any]]
) -> dict[str, Any]:
    """An operation with every status it can answer: the use-case's `errors`, and those of
    admission (`api.http.endpoint`), sessions, idempotency keys and path parameters."""
    if (doc.body is not None) != (admission.body_limit is not None):
        raise ValueError(f"{op_id}: a body schema is declared iff the endpoint admits a body")
    auth = admission.auth == "required"
    parameters = [*path_params, *doc.params]
    found: dict[str, list[str]] = {}

    def add(status: str, text: str) -> None:
        found.setdefault(status, []).append(text)

    for status, text in doc.errors.items():
        add(status, text)
    if doc.body is not None:
        add("400", "the body is not I-JSON (RFC 7493) or breaks the schema")
        add("413", "the body exceeds the admission limit")
        add("415", "Content-Type is not JSON")
    if auth:
        add("401", "session missing, malformed, expired or revoked")
    if doc.idempotent:
        parameters.append(IDEMPOTENCY)
        add("400", "Idempotency-Key missing or malformed")
        add("409", "Idempotency-Key reused for another request")
    if path_params:
        add("404", "also for a path parameter that cannot be routed")
    add("429", "rate limit exceeded")
    add("503", "the database is unavailable, or the service is stopping")
    responses: dict[str, Any] = copy.deepcopy(doc.ok)
    for status in sorted(found):
        if status not in responses:
            responses[status] = _error("; ".join(dict.fromkeys(found[status])))
    operation: dict[str, Any] = {"operationId": op_id, "summary": doc.summary}
    if parameters:
        operation["parameters"] = parameters
    if doc.body is not None:
        operation["requestBody"] = {
            "required": doc.body_required,
            "content": {"application/json": {"schema": _ref(doc.body)}},
        }
    if auth:
        operation["security"] = AUTH
    operation["responses"] = responses
    return operation


_ROUTE_PARAMETER = re.compile(r"<(?:[a-z]+:)?([a-z_]+)>")


def _paths(app: Quart) -> dict[str, Any]:
    """Every HTTP route of `app`, in the order they were added (the WebSocket aside)."""
    paths: dict[str, Any] = {}
    for rule in app.url_map.iter_rules():
        if rule.websocket or rule.endpoint == "static":
            continue
        view = app.view_functions[rule.endpoint]
        doc: OperationDoc | None = getattr(view, "__openapi__", None)
        admission: Admission | None = getattr(view, "__admission__", None)
        if doc is None or admission is None:
            raise ValueError(f"route {rule.rule} is not @endpoint and @documented")
        names = _ROUTE_PARAMETER.findall(rule.rule)
        path = _ROUTE_PARAMETER.sub(r"{\1}", rule.rule)
        path_params = [PATH_PARAMETERS.get(name) or _path(name) for name in names]
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            paths.setdefault(path, {})[method.lower()] = _operation(
                rule.endpoint, doc, admission, path_params
            )
    return paths


# What a created resource leads to: operation → (target operation, its parameters from the
# response), on the operation's success response.
_ENTRY = {"did": "$response.body#/entryDid"}
_ENTRY_LINKS = {
    "get_entry": _ENTRY,
    "update_entry": _ENTRY,
    "delete_entry": _ENTRY,
    "get_entry_lineage": _ENTRY,
    "list_entry_versions": _ENTRY,
    "get_entry_version": {**_ENTRY, "sequence": "$response.body#/sequence"},
    "list_entry_attestations": _ENTRY,
    "get_anchors": _ENTRY,
}
_LINKS: dict[str, dict[str, dict[str, str]]] = {
    "create_entry": _ENTRY_LINKS,
    "update_entry": _ENTRY_LINKS,
    "accept_transfer_offer": _ENTRY_LINKS,
    "provision_bond": {
        op: {"bond_id": "$response.body#/bondId"}
        for op in ("get_bond", "slash_bond", "release_bond")
    },
    "create_attestation": {
        op: {"attestation_id": "$response.body#/attestationId"}
        for op in ("get_attestation", "revoke_attestation")
    },
    "create_report": {"resolve_report": {"report_id": "$response.body#/reportId"}},
    "create_transfer_offer": {
        op: {"offer_id": "$response.body#/offerId"}
        for op in (
            "get_transfer_offer",
            "accept_transfer_offer",
            "decline_transfer_offer",
            "cancel_transfer_offer",
        )
    },
}


def _with_links(paths: dict[str, Any]) -> dict[str, Any]:
    for item in paths.values():
        for operation in item.values():
            links = _LINKS.get(operation["operationId"])
            if links is None:
                continue
            status = min(code for code in operation["responses"] if code.startswith("2"))
            operation["responses"][status]["links"] = {
                target: {"operationId": target, "parameters": parameters}
                for target, parameters in links.items()
            }
    return paths


def openapi_document(app: Quart) -> dict[str, Any]:
    """The document of `app`'s routes (built once per app)."""
    document: dict[str, Any] | None = app.extensions.get("openapi")
    if document is None:
        document = app.extensions["openapi"] = _document(app)
    return document


def _document(app: Quart) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "registry",
            "version": "1.0.0",
            "description": (
                "Every JSON body is I-JSON (RFC 7493): no U+0000 in any string or member name,"
                " no duplicate member names, integers within ±(2^53−1), at most 64 levels of"
                " nesting; the schemas say so where they can."
            ),
        },
        "paths": _with_links(_paths(app)),
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "cookie": {"type": "apiKey", "in": "cookie", "name": "registry_session"},
            },
        },
    }
