"""The component schemas of what the API accepts and serves, beyond the pydantic models that
validate requests (`registry.models`, `registry.discovery`): each a pydantic model here, turned
into JSON Schema by pydantic for the OpenAPI document (`api/openapi.py`).

The bodies the use-cases check by hand (trust and transfer records) are described next to the
constants of the rules they mirror (`registry.trust`, `registry.usecases.records`); a constraint
plain types cannot state is given as its JSON Schema fragment (`WithJsonSchema`).
`tests/api/test_schema_fuzz.py` holds the schemas to the service (Schemathesis: responses
conform, valid requests are accepted, invalid ones refused).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import (
    GenerateJsonSchema,
    JsonRef,
    JsonSchemaValue,
    WithJsonSchema,
    models_json_schema,
)
from pydantic_core import core_schema

from registry import trust
from registry.anchoring import STATES as INTENT_STATES
from registry.did import B58_ALPHABET as BASE58_ALPHABET
from registry.did import ED25519_MULTICODEC, b58encode
from registry.models import DATE_TIME_SCHEMA, DID_SCHEMA, NO_NUL_PATTERN, WHITESPACE
from registry.usecases.records import MAX_TEXT

REF = "#/components/schemas/"


def ref(name: str) -> dict[str, Any]:
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


# --- fragments ---------------------------------------------------------------------------------

TIME: dict[str, Any] = {"type": "string", "format": "date-time"}
AMOUNT: dict[str, Any] = {
    "type": "string",
    "pattern": trust.AMOUNT.pattern,
    "description": "a decimal string (exact arithmetic)",
}
POSITIVE_AMOUNT: dict[str, Any] = {
    "type": "string",
    "pattern": POSITIVE_AMOUNT_PATTERN,
    "description": "a decimal string above zero: at most 30 integer and 18 fractional digits",
}
HASH_HEX: dict[str, Any] = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
ANCHOR_STATES = Literal["unanchored", "pending", "anchored", "failed", "abandoned"]


def _as(fragment: dict[str, Any]) -> WithJsonSchema:
    return WithJsonSchema(fragment)


Time = Annotated[str, _as(TIME)]
Did = Annotated[str, _as(DID_SCHEMA)]
Amount = Annotated[str, _as(AMOUNT)]
PositiveAmount = Annotated[str, _as(POSITIVE_AMOUNT)]
Text = Annotated[str, _as(TEXT_SCHEMA)]
Sequence = Annotated[int, Field(ge=1)]
SequenceCursor = Annotated[str, Field(pattern=SEQUENCE_TEXT_PATTERN)]
FreeObject = Annotated[dict[str, Any], _as({"type": "object"})]
AnyJson = Annotated[Any, _as({"$ref": REF + "JsonValue"})]


class Response(BaseModel):
    """What the server writes: members may be added later (no additionalProperties)."""


class Body(BaseModel):
    """A request body with exactly these members (`records.body_object` refuses others)."""

    model_config = ConfigDict(extra="forbid")


# --- entries, discovery, sign-in, operations ---------------------------------------------------


class VersionsResponse(Response):
    entryDid: str
    versions: list[Annotated[dict[str, Any], _as({"$ref": REF + "ServedEntry"})]]
    cursor: SequenceCursor | None = None
    hasMore: bool
    totalCount: int


class QueryResult(Response):
    entries: list[Annotated[dict[str, Any], _as({"$ref": REF + "ServedEntry"})]]
    cursor: Annotated[str, Field(description="opaque; absent on the last page")] | None = None
    hasMore: bool
    totalCount: Annotated[int, Field(description="exact up to 1000")]
    totalCountExact: (
        Annotated[Literal[False], Field(description="present when totalCount is capped")] | None
    ) = None


class LineageResponse(Response):
    entryDid: str
    lineage: AnyJson


class Tombstone(Response):
    entryDid: str
    lifecycleStatus: Literal["deleted"]
    sequence: int
    deletedAt: Time


class ChallengeResponse(Response):
    challenge: Annotated[dict[str, Any], _as({"$ref": REF + "Challenge"})]


class Session(Response):
    expiresAtMs: int
    hmrDid: str
    rootDid: str
    rootKind: str
    signerDid: str | None = None
    capabilities: list[str] | None = None


class VerifyResponse(Session):
    sessionExpiresAtMs: int
    sessionToken: str
    signerPublicKey: str


class LoggedOut(Response):
    loggedOut: Literal[True]


class Health(Response):
    status: Literal["ok", "degraded", "failing"]
    checks: dict[str, str]
    registryDid: str | None = None


class DeepHealth(Response):
    status: Literal["ok", "degraded", "failing"]
    checks: dict[str, str]
    logHead: int


class OpenApiDocument(Response):
    openapi: str
    info: AnyJson
    paths: AnyJson


# --- trust and ownership records ---------------------------------------------------------------


class AttestationRequest(Body):
    attestation: Annotated[
        dict[str, Any],
        _as(
            {
                "type": "object",
                "description": (
                    "a W3C Verifiable Credential secured by one eddsa-jcs-2022"
                    " DataIntegrityProof from an Ed25519 did:key of its issuer, the signed-in"
                    " principal; its credentialSubject.id is entryDid (400 credential_invalid,"
                    " proof_invalid or subject_mismatch otherwise)"
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
                            "verificationMethod": {"type": "string"},
                            "proofValue": {"type": "string"},
                        },
                        "additionalProperties": {"$ref": REF + "JsonValue"},
                    }
                },
                "propertyNames": {"pattern": NO_NUL_PATTERN},
                "additionalProperties": {"$ref": REF + "JsonValue"},
            }
        ),
    ]
    entryDid: Did


class Attestation(Response):
    acceptedAt: Time
    attestationId: str
    credential: FreeObject
    entryDid: str
    issuerDid: str
    issuedAt: Time | None = None
    expiresAt: Time | None = None
    revokedAt: Time | None = None


class AttestationPage(Response):
    entryDid: str | None = None
    attestations: list[Attestation]
    cursor: SequenceCursor | None = None
    hasMore: bool


class ReportRequest(Body):
    entryDid: Did
    reason: Text


class ReportCreated(Response):
    entryDid: str
    reportId: str
    status: Literal["reported"]


class Report(Response):
    createdAt: Time
    entryDid: str
    reason: str
    reportId: str
    reporterDid: str
    status: Literal["reported", "dismissed", "upheld"]
    resolvedAt: Time | None = None
    resolution: FreeObject | None = None


class ReportPage(Response):
    reports: list[Report]
    cursor: SequenceCursor | None = None
    hasMore: bool


class SlashOrder(Body):
    """Checked once the report is found."""

    bondId: str
    amount: PositiveAmount


class ResolveRequest(Body):
    # Only an upheld report can slash a bond.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"required": ["slash"], "properties": {"slash": {"type": "object"}}},
            "then": {"properties": {"decision": {"const": "uphold"}}},
        }
    )

    decision: Literal["dismiss", "uphold"]
    note: Text | None = None
    slash: Annotated[
        SlashOrder | None,
        _as({"anyOf": [{"$ref": REF + "SlashOrder"}, {"type": "null"}]}),
    ] = None


class BondRequest(Body):
    amount: PositiveAmount
    bondId: Annotated[str, Field(pattern=trust.RECORD_ID.pattern)]
    currency: Annotated[str, Field(pattern=trust.CURRENCY.pattern)]
    entryDid: Did
    publisherDid: Annotated[
        str,
        _as(
            {
                **DID_SCHEMA,
                "description": "the entry's publisher (400 bond_publisher_mismatch otherwise)",
            }
        ),
    ]
    status: Literal["active"] | None = None


class SlashDistribution(Response):
    harmedPartiesShare: Amount
    reporterShare: Amount
    treasuryShare: Amount


class Slash(Response):
    amount: Amount
    distribution: SlashDistribution
    reason: str
    reporterDid: str
    timestamp: Time


class Bond(Response):
    amount: Amount
    bondId: str
    createdAt: Time
    currency: str
    entryDid: str
    publisherDid: str
    registryDid: str
    remainingAmount: Amount
    slashHistory: list[Slash]
    status: Literal["active", "slashed", "exhausted", "released"]
    releasedAt: Time | None = None


class SlashRequest(Body):
    amount: PositiveAmount
    reason: Text
    reporterDid: Did


class ServedSignature(Response):
    algorithm: Literal["Ed25519"]
    keyId: str
    value: str
    created: Time | None = None


class OfferSignature(ServedSignature):
    """The owner's Ed25519 signature over JCS of the offer (400 otherwise)."""

    model_config = ConfigDict(
        json_schema_extra={
            "propertyNames": {"pattern": NO_NUL_PATTERN},
            "additionalProperties": {"$ref": REF + "JsonValue"},
        }
    )

    created: Annotated[
        str | None,
        _as(
            {
                **DATE_TIME_SCHEMA,
                "maxLength": 64,
                "description": "not signed; stored and served as sent (400 otherwise)",
            }
        ),
    ] = None


class OfferRequest(Body):
    entryDid: Did
    entrySequence: Annotated[
        Sequence | None,
        Field(description="the entry's latest sequence, which the signature covers (default)"),
    ] = None
    recipientDid: Annotated[
        str,
        Field(
            pattern=ED25519_DID_KEY_PATTERN,
            description=(
                "an Ed25519 did:key other than the owner's (a few strings of this pattern are"
                " not one: 400 offer_invalid)"
            ),
        ),
    ]
    expiresAt: Annotated[
        str | None,
        _as(
            {
                "anyOf": [
                    {
                        **DATE_TIME_SCHEMA,
                        "description": "in the future and at most 30 days away (400 otherwise)",
                    },
                    {"type": "null"},
                ],
                "description": "default: 7 days from now",
            }
        ),
    ] = None
    ownerSignature: OfferSignature


class TransferOffer(Response):
    createdAt: Time
    entryDid: str
    entrySequence: int
    expiresAt: Time
    offerId: str
    ownerDid: str
    ownerSignature: ServedSignature
    recipientDid: str
    status: Literal["offered", "accepted", "declined", "cancelled", "expired"]
    decidedAt: Time | None = None
    declineReason: str | None = None


class AcceptRequest(Body):
    entry: Annotated[dict[str, Any], _as({"$ref": REF + "TransferredEntry"})]


class DeclineRequest(Body):
    reason: Text | None = None


# --- anchoring ---------------------------------------------------------------------------------


class MerkleStep(Response):
    hash: Annotated[str, _as(HASH_HEX)]
    direction: Literal["left", "right"]


class MerkleProof(Response):
    root: Annotated[str, _as(HASH_HEX)]
    path: list[MerkleStep]
    leafHash: Annotated[str, _as(HASH_HEX)]


MaybeProof = Annotated[
    MerkleProof | None, _as({"oneOf": [{"$ref": REF + "MerkleProof"}, {"type": "null"}]})
]


class AnchorRecord(Response):
    entryDid: str
    itemDataHash: str
    blockHeight: Annotated[int, Field(ge=0)]
    txHash: str
    anchorTime: Time
    proof: MaybeProof = None


class AnchorReceipt(Response):
    # blockHeight once the chain has put the batch in a block, transactionId once it is sent:
    # absent before (spec 2: absent fields are omitted).
    blockHeight: Annotated[int, Field(ge=0)] | None = None
    observedAt: Time
    proof: MaybeProof
    receiptKey: str
    state: Literal["submitted", "confirmed", "dropped"]
    transactionId: str | None = None
    anchorTime: Time | None = None


class AnchorIntent(Response):
    intentId: str
    entryDid: str
    sequence: int
    operation: Literal["create", "update", "transfer", "delete"]
    state: Annotated[str, _as({"enum": list(INTENT_STATES)})]
    attempts: int
    availableAt: Time
    createdAt: Time
    updatedAt: Time
    transactionId: str | None = None
    receipts: list[AnchorReceipt]
    anchor: AnchorRecord | None = None


class AnchorList(Response):
    anchorState: ANCHOR_STATES
    entryDid: str
    hasMore: bool
    cursor: (
        Annotated[str, Field(min_length=1, max_length=2048, pattern="^[A-Za-z0-9_-]+$")] | None
    ) = None
    records: list[AnchorIntent]


class AnchorControl(Response):
    intentId: str
    state: Literal["pending", "abandoned"]


# --- federation (spec 2.8, 2.9) ----------------------------------------------------------------


class FederationPeer(Response):
    peerDid: str
    endpoint: str
    grpcEndpoint: str | None = None
    agreementIds: list[str]
    lastSeen: Time | None = None


class PeerOutcome(Response):
    peerDid: str
    status: Literal["ok", "failed", "skipped"]
    reason: str | None = None


class FederationSummary(Response):
    federated: bool
    partial: bool
    peersAttempted: int
    peersFailed: int
    peersSucceeded: int
    peers: list[PeerOutcome]
    origins: list[str]


class FederatedResult(Response):
    entries: list[Annotated[dict[str, Any], _as({"$ref": REF + "ServedEntry"})]]
    cursor: Annotated[str, Field(description="opaque and tamper-evident")] | None = None
    hasMore: bool
    totalCount: int
    federation: FederationSummary


class PeerLog(Response):
    """The peer's log as witnessed (docs/transparency.md)."""

    state: Literal["consistent", "inconsistent"]
    treeSize: Annotated[int, Field(ge=0)] | None = None
    reason: Literal["log_inconsistent"] | None = None
    detail: str | None = None


class FederationPeerStatus(Response):
    peerDid: str
    breakerState: Literal["closed", "open", "half_open"]
    consecutiveFailures: int
    cursor: int
    lag: int
    latencyMs: int | None = None
    lastSuccessAt: Time | None = None
    nextAttemptAt: Time | None = None
    quarantines: int
    log: PeerLog | None = None


class PeerUpdate(Body):
    endpoint: Annotated[str, Field(min_length=8, max_length=2048, pattern="^https?://")]
    grpcEndpoint: Annotated[str, Field(max_length=2048)] | None = None


class Envelope(Response):
    version: Literal["1"]
    kind: Literal["sync_request", "sync_response", "discover_request", "discover_response"]
    algorithm: Literal["Ed25519"]
    keyId: str
    senderDid: str
    recipientDid: str
    timestamp: Time
    nonce: str
    requestDigest: str
    payload: FreeObject
    signature: str


class QuarantinedEntry(Response):
    sequence: int  # at the peer
    entryDid: str | None = None
    code: str
    reason: str


class PeerOverview(FederationPeerStatus):
    """A FederationPeerStatus with the peer's latest quarantined entries."""

    quarantined: list[QuarantinedEntry]


class RecentAnchorBatch(Response):
    batchId: int
    state: Literal["claimed", "submitted", "confirmed", "dropped"]
    intents: int
    transactionId: str | None = None
    blockHeight: int | None = None
    anchorTime: Time | None = None


class AnchoringOverview(Response):
    enabled: bool
    pending: int
    oldestPendingAt: Time | None = None
    batchesInFlight: int
    recentBatches: list[RecentAnchorBatch]


class Overview(DeepHealth):
    registryDid: str
    peers: list[PeerOverview]
    anchoring: AnchoringOverview


# --- the verifiable log (docs/transparency.md) --------------------------------------------------

B64_HASH = {"type": "string", "pattern": "^[A-Za-z0-9+/]{43}=$", "description": "base64 SHA-256"}


class LogRecordServed(Response):
    """One log position. `subject` and `data` are null and `redacted` holds the hex SHA-256 of
    JCS({"subject", "data"}) for admin-only and internal kinds."""

    sequence: Annotated[int, Field(ge=1)]
    kind: str
    subject: Annotated[str | None, _as({"type": ["string", "null"]})]
    at: Time
    data: Annotated[dict[str, Any] | None, _as({"type": ["object", "null"]})]
    documentHash: Annotated[str, _as(HASH_HEX)] | None = None
    redacted: Annotated[str, _as(HASH_HEX)] | None = None


class LogRecords(Response):
    records: list[LogRecordServed]
    hasMore: bool
    next: Annotated[int, Field(ge=1)]


class InclusionProof(Response):
    leafIndex: Annotated[int, Field(ge=0)]
    treeSize: Annotated[int, Field(ge=1)]
    proof: list[Annotated[str, _as(B64_HASH)]]


class ConsistencyProof(Response):
    from_: Annotated[int, Field(ge=1, alias="from")]
    to: Annotated[int, Field(ge=1)]
    proof: list[Annotated[str, _as(B64_HASH)]]


class VersionProof(Response):
    checkpoint: Annotated[str, _as({"type": "string", "description": "a C2SP signed note"})]
    record: LogRecordServed
    proof: InclusionProof


# Schemas that are a JSON array at the top (no model of their own).
ARRAYS = {
    "FederationPeers": "FederationPeer",
    "FederationPeerStatuses": "FederationPeerStatus",
}

DOCUMENT_MODELS: list[type[BaseModel]] = [
    VersionsResponse,
    QueryResult,
    LineageResponse,
    Tombstone,
    ChallengeResponse,
    VerifyResponse,
    Session,
    LoggedOut,
    Health,
    DeepHealth,
    OpenApiDocument,
    AttestationRequest,
    Attestation,
    AttestationPage,
    ReportRequest,
    ReportCreated,
    Report,
    ReportPage,
    ResolveRequest,
    SlashOrder,
    BondRequest,
    Bond,
    SlashRequest,
    OfferRequest,
    TransferOffer,
    AcceptRequest,
    DeclineRequest,
    MerkleProof,
    AnchorRecord,
    AnchorIntent,
    AnchorList,
    AnchorControl,
    FederationPeer,
    FederatedResult,
    FederationPeerStatus,
    PeerUpdate,
    Envelope,
    Overview,
    LogRecords,
    InclusionProof,
    ConsistencyProof,
    VersionProof,
]


class _Document(GenerateJsonSchema):
    """JSON Schema as the document states it: a member that may be absent is not nullable
    (`X | None = None` says "absent"; a member that may be null says so with its fragment), and
    no titles."""

    def nullable_schema(self, schema: core_schema.NullableSchema) -> JsonSchemaValue:
        return self.generate_inner(schema["schema"])

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        generated = super().default_schema(schema)
        if generated.get("default", ...) is None:
            del generated["default"]
        return generated

    def handle_ref_overrides(self, json_schema: JsonSchemaValue) -> JsonSchemaValue:
        # A fragment may name a component pydantic does not define (JsonValue, ServedEntry).
        if JsonRef(json_schema.get("$ref", "")) not in self.json_to_defs_refs:
            return json_schema
        return super().handle_ref_overrides(json_schema)

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def model_schema(self, schema: core_schema.ModelSchema) -> JsonSchemaValue:
        generated = super().model_schema(schema)
        generated.pop("title", None)
        return generated


def document_schemas() -> dict[str, Any]:
    """The component schemas of DOCUMENT_MODELS (and the arrays of them), by name."""
    _, definitions = models_json_schema(
        [(model, "validation") for model in DOCUMENT_MODELS],
        by_alias=True,
        ref_template=REF + "{model}",
        schema_generator=_Document,
    )
    schemas: dict[str, Any] = dict(definitions.get("$defs", {}))
    for name, item in ARRAYS.items():
        schemas[name] = {"type": "array", "items": ref(item)}
    return schemas
