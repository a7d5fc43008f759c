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
import functools
from typing import Any

from pydantic import BaseModel

from registry import trust
from registry.anchoring import STATES as INTENT_STATES
from registry.did import _B58 as BASE58_ALPHABET
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

_STR: dict[str, Any] = {"type": "string"}
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
        "keyId": _STR,
        "value": _STR,
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
        entryDid=_STR,
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
    "LineageResponse": _obj(["entryDid", "lineage"], entryDid=_STR, lineage=_ref("JsonValue")),
    "Tombstone": _obj(
        ["entryDid", "lifecycleStatus", "sequence", "deletedAt"],
        entryDid=_STR,
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
        hmrDid=_STR,
        rootDid=_STR,
        rootKind=_STR,
        sessionExpiresAtMs=_INT,
        sessionToken=_STR,
        signerPublicKey=_STR,
        signerDid=_STR,
        capabilities={"type": "array", "items": _STR},
    ),
    "Session": _obj(
        ["expiresAtMs", "hmrDid", "rootDid", "rootKind"],
        expiresAtMs=_INT,
        hmrDid=_STR,
        rootDid=_STR,
        rootKind=_STR,
        signerDid=_STR,
        capabilities={"type": "array", "items": _STR},
    ),
    "LoggedOut": _obj(["loggedOut"], loggedOut={"const": True}),
    "Health": _obj(
        ["status", "checks"],
        status={"enum": ["ok", "degraded", "failing"]},
        checks={"type": "object", "additionalProperties": _STR},
        registryDid=_STR,
    ),
    "DeepHealth": _obj(
        ["status", "checks", "logHead"],
        status={"enum": ["ok", "degraded", "failing"]},
        checks={"type": "object", "additionalProperties": _STR},
        logHead=_INT,
    ),
    "OpenApiDocument": _obj(["openapi", "info", "paths"], openapi=_STR),
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
                        "verificationMethod": _STR,
                        "proofValue": _STR,
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
        attestationId=_STR,
        credential={"type": "object"},
        entryDid=_STR,
        issuerDid=_STR,
        issuedAt=_TIME,
        expiresAt=_TIME,
        revokedAt=_TIME,
    ),
    "ReportRequest": _body(["entryDid", "reason"], entryDid=_DID, reason=TEXT_SCHEMA),
    "ReportCreated": _obj(
        ["entryDid", "reportId", "status"],
        entryDid=_STR,
        reportId=_STR,
        status={"const": "reported"},
    ),
    "Report": _obj(
        ["createdAt", "entryDid", "reason", "reportId", "reporterDid", "status"],
        createdAt=_TIME,
        entryDid=_STR,
        reason=_STR,
        reportId=_STR,
        reporterDid=_STR,
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
                        **_body(["bondId", "amount"], bondId=_STR, amount=_POSITIVE_AMOUNT),
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
        bondId=_STR,
        createdAt=_TIME,
        currency=_STR,
        entryDid=_STR,
        publisherDid=_STR,
        registryDid=_STR,
        remainingAmount=_AMOUNT,
        status={"enum": ["active", "slashed", "exhausted", "released"]},
        releasedAt=_TIME,
        slashHistory={
            "type": "array",
            "items": _obj(
                ["amount", "distribution", "reason", "reporterDid", "timestamp"],
                amount=_AMOUNT,
                reason=_STR,
                reporterDid=_STR,
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
                "keyId": _STR,
                "value": _STR,
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
        entryDid=_STR,
        entrySequence=_INT,
        expiresAt=_TIME,
        offerId=_STR,
        ownerDid=_STR,
        ownerSignature=_SIGNATURE,
        recipientDid=_STR,
        status={"enum": ["offered", "accepted", "declined", "cancelled", "expired"]},
        decidedAt=_TIME,
        declineReason=_STR,
    ),
    "AcceptRequest": _body(["entry"], entry=_ref("TransferredEntry")),
    "DeclineRequest": _body([], reason=TEXT_SCHEMA),
    "AttestationPage": _page_of("attestations", "Attestation", entryDid=_STR),
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
        entryDid=_STR,
        itemDataHash=_STR,
        blockHeight={"type": "integer", "minimum": 0},
        txHash=_STR,
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
        intentId=_STR,
        entryDid=_STR,
        sequence=_INT,
        operation={"enum": ["create", "update", "transfer", "delete"]},
        state={"enum": list(INTENT_STATES)},
        attempts=_INT,
        availableAt=_TIME,
        createdAt=_TIME,
        updatedAt=_TIME,
        transactionId=_STR,
        receipts={
            "type": "array",
            "items": _obj(
                ["blockHeight", "observedAt", "proof", "receiptKey", "state", "transactionId"],
                blockHeight={"type": ["integer", "null"]},
                observedAt=_TIME,
                proof={"oneOf": [_ref("MerkleProof"), {"type": "null"}]},
                receiptKey=_STR,
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
        entryDid=_STR,
        hasMore={"type": "boolean"},
        cursor={"type": "string", "minLength": 1, "maxLength": 2048, "pattern": "^[A-Za-z0-9_-]+$"},
        records={"type": "array", "items": _ref("AnchorIntent")},
    ),
    "AnchorControl": _obj(
        ["intentId", "state"], intentId=_STR, state={"enum": ["pending", "abandoned"]}
    ),
    "ReportPage": _page_of("reports", "Report"),
    # Federation (spec 2.8, 2.9).
    "FederationPeer": _obj(
        ["peerDid", "endpoint", "agreementIds"],
        peerDid=_STR,
        endpoint=_STR,
        grpcEndpoint=_STR,
        agreementIds={"type": "array", "items": _STR},
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
                    peerDid=_STR,
                    status={"enum": ["ok", "failed", "skipped"]},
                    reason=_STR,
                ),
            },
            origins={"type": "array", "items": _STR},
        ),
    ),
    "FederationPeerStatus": _obj(
        ["peerDid", "breakerState", "consecutiveFailures", "cursor", "lag", "quarantines"],
        peerDid=_STR,
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
        keyId=_STR,
        senderDid=_STR,
        recipientDid=_STR,
        timestamp=_TIME,
        nonce=_STR,
        requestDigest=_STR,
        payload={"type": "object"},
        signature=_STR,
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


def _ok(name: str, description: str = "OK", **headers: str) -> dict[str, Any]:
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


def _path(name: str, description: str = "") -> dict[str, Any]:
    param: dict[str, Any] = {"name": name, "in": "path", "required": True, "schema": _STR}
    if description:
        param["description"] = description
    return param


DID_PATH = _path("did", "an entry DID (any other text is simply not found)")


def _operation(
    op_id: str,
    summary: str,
    ok: dict[str, Any],
    errors: dict[str, str] | None = None,
    *,
    auth: bool = False,
    idempotent: bool = False,
    body: str | None = None,
    body_required: bool = True,
    params: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """An operation with every status it can answer: the use-case's `errors`, and those of
    admission (`api.http.endpoint`), sessions, idempotency keys and path parameters."""
    parameters = list(params or [])
    found: dict[str, list[str]] = {}

    def add(status: str, text: str) -> None:
        found.setdefault(status, []).append(text)

    for status, text in (errors or {}).items():
        add(status, text)
    if body is not None:
        add("400", "the body is not I-JSON (RFC 7493) or breaks the schema")
        add("413", "the body exceeds the admission limit")
        add("415", "Content-Type is not JSON")
    if auth:
        add("401", "session missing, malformed, expired or revoked")
    if idempotent:
        parameters.append(IDEMPOTENCY)
        add("400", "Idempotency-Key missing or malformed")
        add("409", "Idempotency-Key reused for another request")
    if any(p["in"] == "path" for p in parameters):
        add("404", "also for a path parameter that cannot be routed")
    add("429", "rate limit exceeded")
    add("503", "the database is unavailable, or the service is stopping")
    responses: dict[str, Any] = dict(ok)
    for status in sorted(found):
        if status not in responses:
            responses[status] = _error("; ".join(dict.fromkeys(found[status])))
    operation: dict[str, Any] = {"operationId": op_id, "summary": summary}
    if parameters:
        operation["parameters"] = parameters
    if body is not None:
        operation["requestBody"] = {
            "required": body_required,
            "content": {"application/json": {"schema": _ref(body)}},
        }
    if auth:
        operation["security"] = AUTH
    operation["responses"] = responses
    return operation


def _paths() -> dict[str, Any]:
    return {
        "/v1/entries": {
            "post": _operation(
                "create_entry",
                "Publish a new signed entry",
                {"201": _ok("ServedEntry", "Created", Location="the entry", ETag="its version")},
                {
                    "400": "invalid entry: the schema, itemDataHash or the signature",
                    "403": "entries.write capability missing, or publisherDid is not the session",
                    "409": "the entry exists",
                },
                auth=True,
                idempotent=True,
                body="NewRegistryEntry",
            )
        },
        "/v1/entries/{did}": {
            "get": _operation(
                "get_entry",
                "The latest version of an entry",
                {
                    "200": _ok("ServedEntry", ETag="the version (and attestations)"),
                    "304": {"description": "Not modified (If-None-Match)"},
                },
                {"404": "entry not found (or deleted)"},
                params=[
                    DID_PATH,
                    {"name": "If-None-Match", "in": "header", "schema": _STR},
                ],
            ),
            "put": _operation(
                "update_entry",
                "Publish a new version of an entry",
                {"200": _ok("ServedEntry", ETag="the new version")},
                {
                    "400": "invalid entry: the schema, itemDataHash, the signature, or entryDid"
                    " is not the DID in the path",
                    "403": "entries.write capability missing, or not the entry's publisher",
                    "404": "entry not found",
                    "409": "sequence is not the latest; the lifecycle cannot move so",
                },
                auth=True,
                idempotent=True,
                body="UpdatedRegistryEntry",
                params=[DID_PATH],
            ),
            "delete": _operation(
                "delete_entry",
                "Delete an entry (writes a tombstone version)",
                {"200": _ok("Tombstone")},
                {
                    "403": "not the entry's publisher (nor admin), or entries.write missing",
                    "404": "entry not found",
                },
                auth=True,
                idempotent=True,
                params=[DID_PATH],
            ),
        },
        "/v1/entries/{did}/lineage": {
            "get": _operation(
                "get_entry_lineage",
                "The entry's lineage reference",
                {"200": _ok("LineageResponse")},
                {"404": "entry not found"},
                params=[DID_PATH],
            )
        },
        "/v1/entries/{did}/versions": {
            "get": _operation(
                "list_entry_versions",
                "Versions of an entry, newest first",
                {"200": _ok("VersionsResponse")},
                {"400": "bad limit or cursor", "404": "entry not found"},
                params=[DID_PATH, LIMIT, SEQUENCE_CURSOR],
            )
        },
        "/v1/entries/{did}/versions/{sequence}": {
            "get": _operation(
                "get_entry_version",
                "One version of an entry",
                {"200": _ok("ServedEntry")},
                {
                    "400": "sequence is not a positive integer",
                    "404": "entry or version not found",
                },
                params=[
                    DID_PATH,
                    {
                        "name": "sequence",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "integer", "minimum": 1},
                    },
                ],
            )
        },
        "/v1/discover": {
            "post": _operation(
                "discover",
                "Discover entries by a structured request ({} lists everything)",
                {"200": _ok("QueryResult", **{"X-Cache": "hit or miss"})},
                {
                    "400": "a cursor this server did not issue for this query; more than 256"
                    " filter nodes",
                },
                body="DiscoverRequest",
            )
        },
        "/v1/discover/registryql": {
            "post": _operation(
                "discover_registryql",
                "Discover entries by a RegistryQL expression",
                {"200": _ok("QueryResult", **{"X-Cache": "hit or miss"})},
                {
                    "400": "the expression breaks the grammar (details: line, column,"
                    " expected); a cursor this server did not issue for this query",
                },
                body="RegistryQLRequest",
            )
        },
        "/v1/auth/siws/challenge": {
            "post": _operation(
                "siws_challenge",
                "A single-use sign-in challenge",
                {"200": _ok("ChallengeResponse")},
                body="ChallengeRequest",
            )
        },
        "/v1/auth/siws/verify": {
            "post": _operation(
                "siws_verify",
                "Verify a signed challenge and open a session",
                {"200": _ok("VerifyResponse")},
                {
                    "401": "verification failed (also a body that breaks the schema)",
                    "502": "identity lookup failed",
                },
                body="VerifyRequest",
            )
        },
        "/v1/auth/session": {
            "get": _operation("session", "The current session", {"200": _ok("Session")}, auth=True)
        },
        "/v1/auth/logout": {
            "post": _operation(
                "logout",
                "Revoke the current session",
                {"200": _ok("LoggedOut", "Logged out")},
                auth=True,
                idempotent=True,
                body="JsonValue",
                body_required=False,
            )
        },
        "/v1/health": {
            "get": _operation(
                "health",
                "Basic health",
                {"200": _ok("Health"), "503": _ok("Health", "Failing")},
            )
        },
        "/v1/health/deep": {
            "get": _operation(
                "deep_health",
                "Deep health (admin)",
                {"200": _ok("DeepHealth")},
                {"403": "not admin"},
                auth=True,
            )
        },
        "/v1/openapi.json": {
            "get": _operation(
                "openapi", "This document", {"200": _ok("OpenApiDocument", "OpenAPI 3.1")}
            )
        },
        **_trust_paths(),
    }


def _trust_paths() -> dict[str, Any]:
    def write(
        op_id: str,
        summary: str,
        ok: tuple[str, str],
        errors: dict[str, str],
        *,
        body: str | None = None,
        body_required: bool = True,
        params: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        return _operation(
            op_id,
            summary,
            {ok[0]: _ok(ok[1])},
            errors,
            auth=True,
            idempotent=True,
            body=body,
            body_required=body_required,
            params=params,
        )

    page = [LIMIT, SEQUENCE_CURSOR]
    offer = _path("offer_id")
    return {
        "/v1/attestations": {
            "post": write(
                "create_attestation",
                "Attest an entry with a Verifiable Credential (eddsa-jcs-2022)",
                ("201", "Attestation"),
                {
                    "400": "the credential or its proof does not verify, or its subject is"
                    " not entryDid",
                    "403": "issuer is not the session principal, or attest capability missing",
                    "404": "entry not found",
                    "409": "this credential is already attested on the entry",
                },
                body="AttestationRequest",
            )
        },
        "/v1/attestations/{attestation_id}": {
            "get": _operation(
                "get_attestation",
                "One attestation record",
                {"200": _ok("Attestation")},
                {"404": "attestation not found"},
                params=[_path("attestation_id")],
            )
        },
        "/v1/attestations/{attestation_id}/revoke": {
            "post": write(
                "revoke_attestation",
                "Revoke an attestation (its issuer)",
                ("200", "Attestation"),
                {
                    "403": "not the issuer",
                    "404": "attestation not found",
                    "409": "already revoked",
                },
                params=[_path("attestation_id")],
            )
        },
        "/v1/entries/{did}/attestations": {
            "get": _operation(
                "list_entry_attestations",
                "Every attestation of an entry (revoked ones too), oldest first",
                {"200": _ok("AttestationPage")},
                {"400": "bad limit or cursor", "404": "entry not found"},
                params=[DID_PATH, *page],
            )
        },
        "/v1/report": {
            "post": write(
                "create_report",
                "Report an entry",
                ("201", "ReportCreated"),
                {
                    "403": "report capability missing",
                    "404": "entry not found",
                    "409": "an open report by this reporter exists",
                },
                body="ReportRequest",
            )
        },
        "/v1/admin/reports": {
            "get": _operation(
                "list_reports",
                "Reports, oldest first (admin)",
                {"200": _ok("ReportPage")},
                {"400": "bad status, limit or cursor", "403": "not admin"},
                auth=True,
                params=[
                    {
                        "name": "status",
                        "in": "query",
                        "schema": {"enum": ["reported", "dismissed", "upheld"]},
                    },
                    *page,
                ],
            )
        },
        "/v1/admin/reports/{report_id}/resolve": {
            "post": write(
                "resolve_report",
                "Dismiss or uphold a report; upholding may slash a bond (admin)",
                ("200", "Report"),
                {
                    "403": "not admin",
                    "404": "report or bond not found",
                    "409": "already resolved; slash beyond the bond",
                },
                body="ResolveRequest",
                params=[_path("report_id")],
            )
        },
        "/v1/admin/bonds": {
            "post": write(
                "provision_bond",
                "Provision a bond (admin)",
                ("201", "Bond"),
                {
                    "400": "publisherDid is not the entry's publisher",
                    "403": "not admin",
                    "404": "entry not found",
                    "409": "bondId exists",
                },
                body="BondRequest",
            )
        },
        "/v1/bonds/{bond_id}": {
            "get": _operation(
                "get_bond",
                "A bond and its slash history",
                {"200": _ok("Bond")},
                {"404": "bond not found"},
                params=[_path("bond_id")],
            )
        },
        "/v1/admin/bonds/{bond_id}/slash": {
            "post": write(
                "slash_bond",
                "Slash a bond (admin): the amount is split harmed/reporter/treasury exactly",
                ("200", "Bond"),
                {
                    "403": "not admin",
                    "404": "bond not found",
                    "409": "bond not active; slash beyond the remaining amount",
                },
                body="SlashRequest",
                params=[_path("bond_id")],
            )
        },
        "/v1/admin/bonds/{bond_id}/release": {
            "post": write(
                "release_bond",
                "Release a bond (admin)",
                ("200", "Bond"),
                {"403": "not admin", "404": "bond not found", "409": "bond not active"},
                params=[_path("bond_id")],
            )
        },
        "/v1/anchors/{did}": {
            "get": _operation(
                "get_anchors",
                "The entry's anchor intents and receipts, ascending (sequence, createdAt, id)",
                {"200": _ok("AnchorList")},
                {
                    "400": "bad limit, or a cursor this server did not issue for the entry",
                    "404": "entry not found",
                },
                params=[
                    DID_PATH,
                    LIMIT,
                    {
                        "name": "cursor",
                        "in": "query",
                        "schema": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 2048,
                            "pattern": "^[A-Za-z0-9_-]+$",
                        },
                    },
                ],
            )
        },
        "/v1/admin/anchors/{intent_id}/retry": {
            "post": write(
                "retry_anchor",
                "Requeue a failed or abandoned intent (admin)",
                ("200", "AnchorControl"),
                {
                    "403": "not admin",
                    "404": "intent not found",
                    "409": "the intent's state does not permit it",
                },
                params=[_path("intent_id")],
            )
        },
        "/v1/admin/anchors/{intent_id}/abandon": {
            "post": write(
                "abandon_anchor",
                "Abandon a pending, submitted or failed intent (admin)",
                ("200", "AnchorControl"),
                {
                    "403": "not admin",
                    "404": "intent not found",
                    "409": "the intent's state does not permit it",
                },
                params=[_path("intent_id")],
            )
        },
        "/v1/federation/sync": {
            "post": _operation(
                "federation_sync",
                "Pull local entry versions after fromSequence (a peer, by signed envelope)",
                {"200": _ok("Envelope", "A signed sync_response")},
                {
                    "400": "the payload is not {fromSequence, maxEntries, agreementId?}",
                    "401": "envelope missing or malformed; signature, timestamp, nonce or"
                    " controller invalid; wrong recipient; nonce replayed",
                    "403": "unknown peer; peer may not sync; agreement not active",
                },
                body="Envelope",
            )
        },
        "/v1/federation/discover": {
            "post": _operation(
                "federation_discover",
                "A peer's federated query (signed discover_request; local entries only)",
                {"200": _ok("Envelope", "A signed discover_response")},
                {
                    "400": "the payload is not {query: DiscoverRequest, agreementId?}",
                    "401": "envelope missing or malformed; signature, timestamp, nonce or"
                    " controller invalid; wrong recipient; nonce replayed",
                    "403": "unknown peer; peer may not discover; agreement not active",
                },
                body="Envelope",
            )
        },
        "/v1/discover/federated": {
            "post": _operation(
                "discover_federated",
                "Discover here and at every reachable peer, merged (design §9)",
                {"200": _ok("FederatedResult")},
                {
                    "400": "invalid query; entryType missing; offset used; a cursor this"
                    " server did not issue for this query",
                    "403": "the session lacks discover.federated",
                },
                auth=True,
                body="FederatedQuery",
            )
        },
        "/v1/federation/peers": {
            "get": _operation(
                "list_federation_peers",
                "The configured federation peers",
                {"200": _ok("FederationPeers")},
            )
        },
        "/v1/federation/peers/self": {
            "put": write(
                "update_federation_peer",
                "A peer registers its endpoint (session of a configured peer)",
                ("200", "FederationPeer"),
                {"400": "endpoint is not an http(s) URL", "403": "not a federation peer"},
                body="PeerUpdate",
            )
        },
        "/v1/admin/federation/peers": {
            "get": _operation(
                "federation_peer_status",
                "Each peer's sync status: breaker, cursor, lag, latency, quarantines (admin)",
                {"200": _ok("FederationPeerStatuses")},
                {"403": "not admin"},
                auth=True,
            )
        },
        "/v1/transfers/offers": {
            "post": write(
                "create_transfer_offer",
                "Offer an entry to a recipient (its publisher, with a signed offer)",
                ("201", "TransferOffer"),
                {
                    "400": "recipientDid is the owner; expiresAt not within 30 days; the"
                    " owner's signature does not verify",
                    "403": "not the entry's publisher",
                    "404": "entry not found",
                    "409": "stale entrySequence; an open offer exists; revoked entry",
                },
                body="OfferRequest",
            )
        },
        "/v1/transfers/offers/{offer_id}": {
            "get": _operation(
                "get_transfer_offer",
                "A transfer offer (status expired once past expiresAt)",
                {"200": _ok("TransferOffer")},
                {"404": "offer not found"},
                params=[offer],
            )
        },
        "/v1/transfers/offers/{offer_id}/accept": {
            "post": write(
                "accept_transfer_offer",
                "Accept an offer with the recipient-signed entry (rules a-e of spec 4.2)",
                ("200", "ServedEntry"),
                {
                    "400": "the entry is not the offered one, changes a field, or does not verify",
                    "403": "not the recipient; publisherDid not the recipient",
                    "404": "offer not found",
                    "409": "offer expired or decided; entry changed; sequence conflict",
                },
                body="AcceptRequest",
                params=[offer],
            )
        },
        "/v1/transfers/offers/{offer_id}/decline": {
            "post": write(
                "decline_transfer_offer",
                "Decline an offer (the recipient)",
                ("200", "TransferOffer"),
                {
                    "403": "not the recipient",
                    "404": "offer not found",
                    "409": "offer expired or already decided",
                },
                body="DeclineRequest",
                body_required=False,
                params=[offer],
            )
        },
        "/v1/transfers/offers/{offer_id}/cancel": {
            "post": write(
                "cancel_transfer_offer",
                "Cancel an offer (the owner)",
                ("200", "TransferOffer"),
                {
                    "403": "not the owner",
                    "404": "offer not found",
                    "409": "offer expired or already decided",
                },
                params=[offer],
            )
        },
    }


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


@functools.cache
def openapi_document() -> dict[str, Any]:
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
        "paths": _with_links(_paths()),
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "cookie": {"type": "apiKey", "in": "cookie", "name": "registry_session"},
            },
        },
    }
