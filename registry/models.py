"""Wire models (pydantic v2), defined once: the API, the client and the federation read these.

The models *validate* the JSON a client sent; they never re-serialise it. Signatures and hashes are
checked over the parsed JSON as received (`registry.entries`), and the stored/served form of an
entry is the received document plus the registry-managed fields, canonicalised with JCS.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    WithJsonSchema,
)

from registry import did
from registry.did import is_did
from registry.errors import Invalid

# ASCII digits only: `\d` would also take other scripts' digits, which no date parser reads back.
# Offsets up to ±15:59, what PostgreSQL's timestamptz takes.
_OFFSET = r"(?:[Zz]|[+-](?:0[0-9]|1[0-5]):[0-5][0-9])"
_RFC3339 = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?" + _OFFSET
)
# Whitespace spelled out (what Python's `\s` matches), so the OpenAPI pattern below means the
# same in every regex dialect that reads it.
WHITESPACE = r"\x09-\x0d\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_URI = re.compile(rf"[A-Za-z][A-Za-z0-9+.-]*:[^{WHITESPACE}\x00-\x1f\x7f]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# --- the JSON Schema of each rule, for the OpenAPI document (api/openapi.py) --------------------
# Validation is the validators' above; these say the same for clients and schema fuzzers.

MAX_SAFE_INTEGER = 2**53 - 1  # I-JSON: every number in a body (registry.canonical.parse_strict)
# The numbers `parse_strict` takes: within ±(2^53−1), or doubles of magnitude 10^21 and more
# (which JCS writes with an exponent); an integer beyond ±(2^53−1) written as digits alone is
# refused, and so is any number in between. JSON Schema cannot tell `1e22` from its digits: the
# description says it.
_BIG = "a double written with an exponent or a fraction (as digits alone it is refused)"
NUMBER_SCHEMAS: list[dict[str, Any]] = [
    {"type": "number", "minimum": -MAX_SAFE_INTEGER, "maximum": MAX_SAFE_INTEGER},
    {"type": "number", "minimum": 1e21, "description": _BIG},
    {"type": "number", "maximum": -1e21, "description": _BIG},
]
# The year 0000 and a 60th second are valid RFC 3339 but not dates that Python can hold.
_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"
DATE_TIME_PATTERN = (
    rf"^{_YEAR}-[0-9]{{2}}-[0-9]{{2}}[Tt][0-9]{{2}}:[0-9]{{2}}:[0-5][0-9](\.[0-9]{{1,9}})?"
    rf"{_OFFSET}$"
)
# The instant must be one Python can hold (0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999Z):
# the schema leaves out the first day with an offset ahead of UTC and the last behind it.
_NONZERO_OFFSET = r"(?:0[0-9]:(?:0[1-9]|[1-5][0-9])|(?:0[1-9]|1[0-5]):[0-5][0-9])"
_OUT_OF_RANGE = {
    "anyOf": [
        {"pattern": rf"^0001-01-01[Tt][^+]*\+{_NONZERO_OFFSET}$"},
        {"pattern": rf"^9999-12-31[Tt][0-9:.]*-{_NONZERO_OFFSET}$"},
        # the last microsecond, rounded up
        {"pattern": r"^9999-12-31[Tt]23:59:59\.999999[5-9][0-9]{0,2}(?:[Zz]|[+-]00:00)$"},
    ]
}
DID_PATTERN = f"^{did._DID_RE.pattern}$"  # the one `is_did` matches
URI_PATTERN = f"^{_URI.pattern}$"
PRINTABLE_PATTERN = r"^[^\x00-\x1f\x7f]*$"
NO_NUL_PATTERN = r"^[^\x00]*$"  # U+0000 is refused in every string of every body

DATE_TIME_SCHEMA: dict[str, Any] = {
    "type": "string",
    "format": "date-time",
    "pattern": DATE_TIME_PATTERN,
    "not": _OUT_OF_RANGE,
    "description": (
        "RFC 3339 with an offset up to ±15:59 and at most 9 fractional digits, at an instant"
        " from 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999Z"
    ),
}
DID_SCHEMA: dict[str, Any] = {
    "type": "string",
    "maxLength": did.MAX_DID_LENGTH,
    "pattern": DID_PATTERN,
}


def parse_datetime(value: str) -> datetime:
    """An RFC 3339 date-time with an explicit offset; `ValueError` otherwise.

    Fractional seconds are rounded to microseconds exactly as PostgreSQL rounds `timestamptz`
    input (`rint(strtod(fraction) * 1e6)`: binary double, ties to even), so a value compares the
    same here as in the database's columns."""
    if not _RFC3339.fullmatch(value):
        raise ValueError("must be an RFC 3339 date-time with offset, e.g. 2026-01-02T03:04:05Z")
    text = value.upper().replace("Z", "+00:00")
    head, dot, rest = text.partition(".")
    try:
        if not dot:
            moment = datetime.fromisoformat(text)
        else:
            digits = re.match(r"[0-9]+", rest)
            assert digits is not None
            micro = round(float("0." + digits.group()) * 1_000_000)
            moment = datetime.fromisoformat(head + rest[digits.end() :])
            moment += timedelta(microseconds=micro)
        moment.astimezone(UTC)  # an instant Python (and the database driver) can hold
    except OverflowError:
        raise ValueError(
            "out of range: the instant must be from 0001-01-01T00:00:00Z to"
            " 9999-12-31T23:59:59.999999Z"
        ) from None
    return moment


def _date_time(value: str) -> str:
    parse_datetime(value)
    return value


def _did(value: str) -> str:
    if not is_did(value):
        raise ValueError(
            "must be a DID (did:<method>:<method-specific-id>) in normal form: percent-encoding"
            " only for characters other than A-Z a-z 0-9 . - _, in uppercase hex"
        )
    return value


def _uri(value: str) -> str:
    if not _URI.fullmatch(value):
        raise ValueError("must be an absolute URI")
    return value


def _printable(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError("must not contain control characters")
    return value


def _printable_schema(min_length: int, max_length: int) -> WithJsonSchema:
    return WithJsonSchema(
        {
            "type": "string",
            "minLength": min_length,
            "maxLength": max_length,
            "pattern": PRINTABLE_PATTERN,
        }
    )


DateTime = Annotated[str, AfterValidator(_date_time), WithJsonSchema(DATE_TIME_SCHEMA)]
Did = Annotated[
    str,
    StringConstraints(max_length=did.MAX_DID_LENGTH),
    AfterValidator(_did),
    WithJsonSchema(DID_SCHEMA),
]
Uri = Annotated[
    str,
    StringConstraints(max_length=2048),
    AfterValidator(_uri),
    WithJsonSchema({"type": "string", "maxLength": 2048, "pattern": URI_PATTERN}),
]
Label = Annotated[
    str,
    StringConstraints(min_length=1, max_length=256),
    AfterValidator(_printable),
    _printable_schema(1, 256),
]
# Text rendered into one line of a message a user signs (the sign-in audience): besides the
# control characters `Label` refuses, none of the C1 controls (NEL among them) nor the line and
# paragraph separators, which some readers break lines on (a forged line in the message).
_LINE_BREAKING = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
ONE_LINE_PATTERN = r"^[^\x00-\x1f\x7f-\x9f\u2028\u2029]*$"


def _one_line(value: str) -> str:
    if _LINE_BREAKING.search(value):
        raise ValueError("must not contain control characters or line separators")
    return value


OneLine = Annotated[
    str,
    StringConstraints(min_length=1, max_length=256),
    AfterValidator(_one_line),
    WithJsonSchema(
        {"type": "string", "minLength": 1, "maxLength": 256, "pattern": ONE_LINE_PATTERN}
    ),
]
Tag = Annotated[
    str,
    StringConstraints(min_length=1, max_length=64),
    AfterValidator(_printable),
    _printable_schema(1, 64),
]
Token = Annotated[str, StringConstraints(pattern=r"^[A-Za-z][A-Za-z0-9._-]{0,63}$")]


def _whole(value: Any) -> Any:
    """`2.0` is the integer 2: JSON (and JCS, which every signature is over) has one kind of
    number, and JSON Schema calls a whole number an integer however it is written."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_SAFE_INTEGER:
        return int(value)
    return value


# After any `Field` constraints in an `Annotated` (so the schema keeps minimum and maximum).
WHOLE = BeforeValidator(_whole)
WholeInt = Annotated[int, WHOLE]

LIFECYCLE_STATES = ("draft", "active", "deprecated", "revoked", "deleted")
LifecycleStatus = Literal["draft", "active", "deprecated", "revoked"]


class WireModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=False, frozen=True)


class Signature(WireModel):
    algorithm: Literal["Ed25519"]
    key_id: Annotated[str, StringConstraints(min_length=1, max_length=256)] = Field(alias="keyId")
    value: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{86}$")]
    created: DateTime | None = None


class Relationship(WireModel):
    relationship_type: Token = Field(alias="relationshipType")
    target_did: Did = Field(alias="targetDid")
    label: Label | None = None


class SemanticAnnotation(WireModel):
    predicate_uri: Uri = Field(alias="predicateUri")
    object_uri: Uri | None = Field(default=None, alias="objectUri")
    object_literal: Annotated[str, StringConstraints(max_length=4096)] | None = Field(
        default=None, alias="objectLiteral"
    )


class ServiceEndpoint(WireModel):
    id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    type: Token
    url: Uri
    priority: Annotated[int, Field(ge=0, le=1_000_000), WHOLE] | None = None
    properties: dict[str, Any] | None = None


class RegistryEntry(WireModel):
    """The entry (spec 2.1): the canonical wire and stored form of every artifact."""

    entry_did: Did = Field(alias="entryDid")
    entry_type: Token = Field(alias="entryType")
    item_data: Any = Field(alias="itemData")
    item_data_hash: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] = Field(
        alias="itemDataHash"
    )
    item_schema_uri: Uri = Field(alias="itemSchemaUri")
    registry_version: Annotated[str, StringConstraints(min_length=1, max_length=32)] = Field(
        alias="registryVersion"
    )
    name: Label
    published_at: DateTime = Field(alias="publishedAt")
    publisher_did: Did = Field(alias="publisherDid")
    signature: Signature
    version: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    description: Annotated[str, StringConstraints(max_length=8192)] | None = None
    access_policy: Any = Field(default=None, alias="accessPolicy")
    bond_reference: Any = Field(default=None, alias="bondReference")
    custom_metadata: dict[str, Any] | None = Field(default=None, alias="customMetadata")
    lifecycle_status: LifecycleStatus | None = Field(default=None, alias="lifecycleStatus")
    lineage_reference: Any = Field(default=None, alias="lineageReference")
    relationships: Annotated[list[Relationship], Field(max_length=256)] | None = None
    semantic_annotations: Annotated[list[SemanticAnnotation], Field(max_length=256)] | None = Field(
        default=None, alias="semanticAnnotations"
    )
    service_endpoints: Annotated[list[ServiceEndpoint], Field(max_length=64)] | None = Field(
        default=None, alias="serviceEndpoints"
    )
    shard_assignment: Annotated[str, StringConstraints(max_length=256)] | None = Field(
        default=None, alias="shardAssignment"
    )
    tags: Annotated[list[Tag], Field(max_length=64)] | None = None
    # Registry-managed: accepted (a client may send back what it read) and then replaced.
    sequence: Annotated[int, Field(ge=1), WHOLE] | None = None
    anchor_state: str | None = Field(default=None, alias="anchorState")
    updated_at: DateTime | None = Field(default=None, alias="updatedAt")
    verifiable_attestations: list[Any] | None = Field(default=None, alias="verifiableAttestations")


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith(("function-", "constrained-", "lax-", "strict-")):
            out += ("." if out else "") + part
    return out or "body"


M = TypeVar("M", bound=BaseModel)


def validate_model(model: type[M], data: Any, *, code: str) -> M:
    """Validate parsed JSON against a wire model; the 400 names the first offending field."""
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        errors = [
            {"field": _loc(err["loc"]), "reason": err["msg"].removeprefix("Value error, ")}
            for err in exc.errors(include_url=False, include_input=False)
        ]
        first = errors[0]
        if first["reason"] == "Extra inputs are not permitted":
            first["reason"] = "unknown field"
        raise Invalid(
            f"{first['field']}: {first['reason']}", code=code, details={"errors": errors[:20]}
        ) from None


# --- API bodies ---------------------------------------------------------------------------------


class ChallengeRequest(WireModel):
    audience: OneLine  # it is rendered into the signed message, one line


class Challenge(WireModel):
    version: Literal[1]
    kind: Literal["siws"]
    audience: str
    origin: str
    chain_id: str = Field(alias="chainId")
    nonce: str
    request_id: str = Field(alias="requestId")
    issued_at_ms: int = Field(alias="issuedAtMs")
    expires_at_ms: int = Field(alias="expiresAtMs")
    hmr_did: str = Field(alias="hmrDid")
    root_did: str | None = Field(default=None, alias="rootDid")


class SignInResponse(WireModel):
    kind: Literal["siws"]
    chain_id: str = Field(alias="chainId")
    origin: str
    message: Annotated[str, StringConstraints(max_length=8192)]
    digest: str
    transcript: Annotated[str, StringConstraints(max_length=16384)]
    signature: str
    signer_did: Annotated[str, StringConstraints(max_length=256)] = Field(alias="signerDid")
    signer_public_key: Annotated[str, StringConstraints(max_length=128)] = Field(
        alias="signerPublicKey"
    )


class VerifyRequest(WireModel):
    audience: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    challenge: Challenge
    response: SignInResponse


class ErrorBody(WireModel):
    code: str
    message: str
    details: dict[str, Any] | None = None
    request_id: str = Field(alias="requestId")


class ErrorResponse(WireModel):
    """Every error response: `{"error": {code, message, details?, requestId}}`."""

    error: ErrorBody
