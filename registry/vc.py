"""Verifiable Credentials secured with the W3C Data Integrity cryptosuite `eddsa-jcs-2022`.

The cryptosuite is the one of "Data Integrity EdDSA Cryptosuites v1.0" (W3C Recommendation,
https://www.w3.org/TR/vc-di-eddsa/ §3.3), applied to a single `DataIntegrityProof`:

* transformed document = JCS (RFC 8785) of the credential without `proof`;
* canonical proof config = JCS of the proof without `proofValue` (`@context` included when the
  proof carries one: Create Proof copies the document's `@context` into the proof);
* hash data = SHA-256(canonical proof config) ‖ SHA-256(transformed document), the proof
  configuration hash first (§3.3.4);
* `proofValue` = multibase base58btc (`z…`) of the 64-byte Ed25519 signature of the hash data.

`verify_proof` is the spec's "Verify Proof (eddsa-jcs-2022)" algorithm (§3.3.2) plus the Data
Integrity checks on the proof's shape and purpose. `verify_credential` runs it first and then
applies the credential rules: the proof's key must be controlled by the issuer, the subject must
have an `id`, and the validity period (VC 2.0 `validFrom`/`validUntil`, VC 1.1
`issuanceDate`/`expirationDate`) must hold at `now`. Checking the signature first means that any
alteration of a signed credential is reported as `proof_invalid`; shape errors
(`credential_invalid`) are only ever reported about content the issuer really signed.

Keys are not resolved over the network: the verification method must be an Ed25519 did:key key id
(`did:key:z6Mk…#z6Mk…`), whose public key is in the identifier itself.

Pure: no I/O; the only ambient input is the clock when `issue_credential` gets no `created`.
"""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from registry.canonical import canonicalize
from registry.did import b58decode, b58encode, controller_of, public_key_from_key_id
from registry.errors import Invalid
from registry.keys import SigningKey, verify

PROOF_TYPE = "DataIntegrityProof"
CRYPTOSUITE = "eddsa-jcs-2022"
PROOF_PURPOSE = "assertionMethod"
VC_V2_CONTEXT = "https://www.w3.org/ns/credentials/v2"
VC_V1_CONTEXT = "https://www.w3.org/2018/credentials/v1"
SIGNATURE_LENGTH = 64

__all__ = [
    "CRYPTOSUITE",
    "PROOF_PURPOSE",
    "PROOF_TYPE",
    "VC_V1_CONTEXT",
    "VC_V2_CONTEXT",
    "VerifiedCredential",
    "VerifiedProof",
    "add_proof",
    "format_datetime",
    "hash_data",
    "issue_credential",
    "parse_rfc3339",
    "parse_xsd_datetime_stamp",
    "proof_configuration",
    "transform_document",
    "verify_credential",
    "verify_proof",
]


@dataclass(frozen=True)
class VerifiedProof:
    """What `verify_proof` established: this key signed this document for this purpose."""

    verification_method: str
    public_key: bytes
    proof_purpose: str
    created: datetime | None
    unsecured_document: dict[str, Any]  # the document as verified (§3.3.2 verifiedDocument)


@dataclass(frozen=True)
class VerifiedCredential:
    """A credential whose proof verified and whose issuer controls the signing key."""

    issuer_did: str
    subject_id: str
    valid_from: datetime | None
    valid_until: datetime | None
    proof_created: datetime | None
    verification_method: str


# --- errors ---------------------------------------------------------------------------------


def _credential_invalid(message: str, field: str, **details: Any) -> Invalid:
    return Invalid(message, code="credential_invalid", details={"field": field, **details})


def _proof_invalid(message: str, reason: str, field: str | None = None) -> Invalid:
    details: dict[str, Any] = {"reason": reason}
    if field is not None:
        details["field"] = field
    return Invalid(message, code="proof_invalid", details=details)


# --- date-times -----------------------------------------------------------------------------

# XML Schema 1.1 Part 2 §3.3.7 dateTime (the spec's own regular expression), with the time zone
# made mandatory: Data Integrity requires `created` to be a dateTimeStamp (§3.3.8 of XSD).
_XSD_DATETIME_STAMP = re.compile(
    r"(?P<sign>-?)(?P<year>[1-9][0-9]{3,}|0[0-9]{3})-(?P<month>0[1-9]|1[0-2])"
    r"-(?P<day>0[1-9]|[12][0-9]|3[01])T"
    r"(?:(?P<hour>[01][0-9]|2[0-3]):(?P<minute>[0-5][0-9]):(?P<second>[0-5][0-9])"
    r"(?:\.(?P<fraction>[0-9]+))?|(?P<end_of_day>24:00:00(?:\.0+)?))"
    r"(?P<tz>Z|[+-](?:(?:0[0-9]|1[0-3]):[0-5][0-9]|14:00))"
)

# RFC 3339 §5.6 date-time. "T" and "Z" may be lower case (§5.6 NOTE); seconds may be 60.
_RFC3339 = re.compile(
    r"(?P<year>[0-9]{4})-(?P<month>[0-9]{2})-(?P<day>[0-9]{2})[Tt]"
    r"(?P<hour>[0-9]{2}):(?P<minute>[0-9]{2}):(?P<second>[0-9]{2})(?:\.(?P<fraction>[0-9]+))?"
    r"(?P<tz>[Zz]|[+-][0-9]{2}:[0-9]{2})"
)


def _offset(tz: str) -> timezone:
    if tz in ("Z", "z"):
        return UTC
    hours, minutes = int(tz[1:3]), int(tz[4:6])
    if hours > 23 or minutes > 59:
        raise ValueError("time zone offset out of range")
    delta = timedelta(hours=hours, minutes=minutes)
    return timezone(-delta if tz[0] == "-" else delta)


def _microseconds(fraction: str | None) -> int:
    return int((fraction or "").ljust(6, "0")[:6])  # digits beyond microseconds are truncated


def parse_xsd_datetime_stamp(text: str) -> datetime:
    """An XML Schema 1.1 dateTimeStamp as an aware datetime; `ValueError` if it is not one.

    `24:00:00` is the first instant of the next day, as XSD defines it. Years outside 0001–9999
    are valid XSD but cannot be represented, and are refused.
    """
    match = _XSD_DATETIME_STAMP.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not an XML Schema dateTimeStamp")
    if match["sign"] or len(match["year"]) > 4 or match["year"] == "0000":
        raise ValueError(f"year of {text!r} is outside 0001-9999")
    tz = _offset(match["tz"])
    date = (int(match["year"]), int(match["month"]), int(match["day"]))
    try:
        if match["end_of_day"]:
            return datetime(*date, tzinfo=tz) + timedelta(days=1)
        return datetime(
            *date,
            int(match["hour"]),
            int(match["minute"]),
            int(match["second"]),
            _microseconds(match["fraction"]),
            tzinfo=tz,
        )
    except OverflowError:
        raise ValueError(f"{text!r} is out of range") from None


def parse_rfc3339(text: str) -> datetime:
    """An RFC 3339 date-time as an aware datetime; `ValueError` if it is not one.

    A leap second (`:60`) is read as the first instant of the next minute; `-00:00` as UTC.
    """
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not an RFC 3339 date-time")
    second = int(match["second"])
    if second > 60:
        raise ValueError(f"{text!r} has seconds out of range")
    value = datetime(
        int(match["year"]),
        int(match["month"]),
        int(match["day"]),
        int(match["hour"]),
        int(match["minute"]),
        min(second, 59),
        _microseconds(match["fraction"]) if second < 60 else 0,
        tzinfo=_offset(match["tz"]),
    )
    try:
        value = value + timedelta(seconds=1) if second == 60 else value
        # An instant of years 1-9999 in UTC too: the registry writes it in UTC (issuedAt,
        # expiresAt), and 9999-12-31T23:59:59-01:00 is in the year 10000 there.
        value.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"{text!r} is out of range") from None
    return value


def format_datetime(value: datetime) -> str:
    """`YYYY-MM-DDThh:mm:ss[.ffffff]Z` in UTC: valid RFC 3339 and XSD dateTimeStamp both."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("datetime must be timezone-aware")
    utc = value.astimezone(UTC)
    text = utc.strftime("%Y-%m-%dT%H:%M:%S")
    if utc.microsecond:
        text += f".{utc.microsecond:06d}".rstrip("0")
    return text + "Z"


# --- JSON shape -----------------------------------------------------------------------------


def _require_json(value: Any, field: str) -> None:
    """`value` is a JSON value (string-keyed objects, arrays, strings, numbers, booleans, null)."""
    stack: list[tuple[Any, str]] = [(value, field)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict):
            for key, member in item.items():
                if not isinstance(key, str):
                    raise _credential_invalid(f"{where} has a non-string member name", where)
                stack.append((member, f"{where}.{key}" if where else key))
        elif isinstance(item, list):
            stack.extend((member, f"{where}[{i}]") for i, member in enumerate(item))
        elif not (item is None or isinstance(item, str | int | float)):  # bool is an int
            raise _credential_invalid(f"{where} is not a JSON value", where)


def _jcs(value: Any, field: str) -> bytes:
    _require_json(value, field)
    try:
        return canonicalize(value)
    except (Invalid, ValueError) as exc:  # unsafe integers, NaN, lone surrogates
        message = exc.message if isinstance(exc, Invalid) else str(exc)
        raise _credential_invalid(f"{field} cannot be canonicalized: {message}", field) from None


def _contexts(value: Any) -> list[Any]:
    """A JSON-LD `@context` value as the ordered list of its entries."""
    return value if isinstance(value, list) else [value]


# --- the cryptosuite (§3.3.3 – §3.3.7) -----------------------------------------------------


def transform_document(unsecured_document: dict[str, Any]) -> bytes:
    """Transformation (eddsa-jcs-2022), §3.3.3: the JCS bytes of the unsecured document."""
    return _jcs(unsecured_document, "")


def proof_configuration(proof_options: dict[str, Any]) -> bytes:
    """Proof Configuration (eddsa-jcs-2022), §3.3.5: the canonical proof configuration.

    Refuses (`proof_invalid`) a type other than DataIntegrityProof, a cryptosuite other than
    eddsa-jcs-2022, and a `created` that is not an XML Schema dateTimeStamp.
    """
    if proof_options.get("type") != PROOF_TYPE:
        raise _proof_invalid(f"proof type must be {PROOF_TYPE}", "wrong_type", "proof.type")
    if proof_options.get("cryptosuite") != CRYPTOSUITE:
        raise _proof_invalid(
            f"proof cryptosuite must be {CRYPTOSUITE}", "wrong_cryptosuite", "proof.cryptosuite"
        )
    if "created" in proof_options:
        _created(proof_options["created"])
    return _jcs(proof_options, "proof")


def hash_data(canonical_proof_config: bytes, transformed_document: bytes) -> bytes:
    """Hashing (eddsa-jcs-2022), §3.3.4: SHA-256(proof config) ‖ SHA-256(document), 64 bytes."""
    return (
        hashlib.sha256(canonical_proof_config).digest()
        + hashlib.sha256(transformed_document).digest()
    )


def _created(value: Any) -> datetime:
    if not isinstance(value, str):
        raise _proof_invalid("proof created must be a string", "bad_created", "proof.created")
    try:
        return parse_xsd_datetime_stamp(value)
    except ValueError as exc:
        raise _proof_invalid(
            f"proof created is not a valid date-time: {exc}", "bad_created", "proof.created"
        ) from None


def _public_key(verification_method: Any) -> bytes:
    """The Ed25519 key of a did:key key id `did:key:z6Mk…#z6Mk…` (multicodec 0xed01)."""
    if not isinstance(verification_method, str):
        raise _proof_invalid(
            "proof verificationMethod must be a string",
            "bad_verification_method",
            "proof.verificationMethod",
        )
    try:
        if "#" not in verification_method:
            raise ValueError("no fragment")
        return public_key_from_key_id(verification_method)
    except ValueError:
        raise _proof_invalid(
            "proof verificationMethod must be an Ed25519 did:key key id (did:key:z6Mk…#z6Mk…)",
            "unsupported_verification_method",
            "proof.verificationMethod",
        ) from None


def _proof_bytes(proof_value: Any) -> bytes:
    """The signature in a multibase base58btc `proofValue`."""
    if not isinstance(proof_value, str) or not proof_value.startswith("z"):
        raise _proof_invalid(
            "proof proofValue must be a multibase base58btc string (z…)",
            "bad_proof_value",
            "proof.proofValue",
        )
    try:
        raw = b58decode(proof_value[1:])
    except ValueError:
        raise _proof_invalid(
            "proof proofValue is not valid base58btc", "bad_proof_value", "proof.proofValue"
        ) from None
    if len(raw) != SIGNATURE_LENGTH:
        raise _proof_invalid(
            f"proof proofValue must encode a {SIGNATURE_LENGTH}-byte Ed25519 signature",
            "bad_proof_value",
            "proof.proofValue",
        )
    return raw


def _split_secured(secured_document: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    if not isinstance(secured_document, dict):
        raise _credential_invalid("credential must be a JSON object", "")
    if "proof" not in secured_document:
        raise _credential_invalid("credential has no proof", "proof")
    proof = secured_document["proof"]
    if isinstance(proof, list):
        raise _credential_invalid(
            "proof sets and chains are not supported: proof must be a single object", "proof"
        )
    if not isinstance(proof, dict):
        raise _credential_invalid("proof must be a JSON object", "proof")
    return secured_document, proof


def verify_proof(secured_document: Any) -> VerifiedProof:
    """Verify Proof (eddsa-jcs-2022), §3.3.2, of a document's single DataIntegrityProof.

    Also requires what Data Integrity requires of the proof: `proofPurpose` "assertionMethod" and
    a `verificationMethod` (here: an Ed25519 did:key key id). Raises `Invalid` with code
    `proof_invalid` (details.reason says why) unless the proof verifies; `credential_invalid` when
    the document is not an object holding one proof object.
    """
    document, proof = _split_secured(secured_document)
    unsecured = {key: value for key, value in document.items() if key != "proof"}
    options = {key: value for key, value in proof.items() if key != "proofValue"}
    if "proofValue" not in proof:
        raise _proof_invalid("proof has no proofValue", "bad_proof_value", "proof.proofValue")
    proof_bytes = _proof_bytes(proof["proofValue"])

    if "@context" in options:
        expected = _contexts(options["@context"])
        actual = _contexts(document["@context"]) if "@context" in document else []
        prefix = actual[: len(expected)]
        if len(prefix) != len(expected) or any(
            _jcs(a, "@context") != _jcs(e, "proof.@context")
            for a, e in zip(prefix, expected, strict=True)
        ):
            raise _proof_invalid(
                "the credential's @context does not start with the proof's @context",
                "context_mismatch",
                "proof.@context",
            )
        unsecured["@context"] = options["@context"]

    canonical_config = proof_configuration(options)  # checks type, cryptosuite, created
    if options.get("proofPurpose") != PROOF_PURPOSE:
        raise _proof_invalid(
            f"proof proofPurpose must be {PROOF_PURPOSE}",
            "wrong_proof_purpose",
            "proof.proofPurpose",
        )
    if "verificationMethod" not in options:
        raise _proof_invalid(
            "proof has no verificationMethod",
            "bad_verification_method",
            "proof.verificationMethod",
        )
    public_key = _public_key(options["verificationMethod"])
    transformed = transform_document(unsecured)

    if not verify(public_key, hash_data(canonical_config, transformed), proof_bytes):
        raise _proof_invalid("the proof's signature does not verify", "signature_mismatch")
    return VerifiedProof(
        verification_method=options["verificationMethod"],
        public_key=public_key,
        proof_purpose=PROOF_PURPOSE,
        created=_created(options["created"]) if "created" in options else None,
        unsecured_document=unsecured,
    )


# --- credentials ----------------------------------------------------------------------------


def _nonempty_string(value: Any) -> bool:
    return isinstance(value, str) and value != ""


def _issuer_id(credential: dict[str, Any]) -> str:
    if "issuer" not in credential:
        raise _credential_invalid("credential has no issuer", "issuer")
    issuer = credential["issuer"]
    if isinstance(issuer, dict):
        if not _nonempty_string(issuer.get("id")):
            raise _credential_invalid("issuer object must have a string id", "issuer.id")
        return str(issuer["id"])
    if not _nonempty_string(issuer):
        raise _credential_invalid("issuer must be a string or an object with an id", "issuer")
    return str(issuer)


def _subject_id(credential: dict[str, Any]) -> str:
    if "credentialSubject" not in credential:
        raise _credential_invalid("credential has no credentialSubject", "credentialSubject")
    subject = credential["credentialSubject"]
    if isinstance(subject, list):
        raise _credential_invalid(
            "credentialSubject must be a single object: credentials about several subjects "
            "are not supported",
            "credentialSubject",
        )
    if not isinstance(subject, dict):
        raise _credential_invalid("credentialSubject must be a JSON object", "credentialSubject")
    if not _nonempty_string(subject.get("id")):
        raise _credential_invalid("credentialSubject must have a string id", "credentialSubject.id")
    return str(subject["id"])


def _version(credential: dict[str, Any]) -> int:
    context = credential.get("@context")
    if not isinstance(context, list) or not context:
        raise _credential_invalid("@context must be a non-empty array", "@context")
    if context[0] == VC_V2_CONTEXT:
        return 2
    if context[0] == VC_V1_CONTEXT:
        return 1
    raise _credential_invalid(
        f"the first @context must be {VC_V2_CONTEXT} (VC 2.0) or {VC_V1_CONTEXT} (VC 1.1)",
        "@context",
    )


def _check_type(credential: dict[str, Any]) -> None:
    types = credential.get("type")
    listed = types if isinstance(types, list) else [types]
    if not all(isinstance(t, str) for t in listed) or "VerifiableCredential" not in listed:
        raise _credential_invalid("type must include VerifiableCredential", "type")


def _date(credential: dict[str, Any], field: str) -> datetime | None:
    if field not in credential:
        return None
    value = credential[field]
    if not isinstance(value, str):
        raise _credential_invalid(f"{field} must be a date-time string", field)
    try:
        return parse_rfc3339(value)
    except ValueError as exc:
        raise _credential_invalid(f"{field} is not an RFC 3339 date-time: {exc}", field) from None


def _validity(credential: dict[str, Any], version: int) -> tuple[datetime | None, datetime | None]:
    own, other = (
        (("validFrom", "validUntil"), ("issuanceDate", "expirationDate"))
        if version == 2
        else (("issuanceDate", "expirationDate"), ("validFrom", "validUntil"))
    )
    for field in other:  # a verifier must not guess which of two validity periods was meant
        if field in credential:
            raise _credential_invalid(
                f"{field} does not belong in a VC {'2.0' if version == 2 else '1.1'} credential",
                field,
            )
    if version == 1 and own[0] not in credential:
        raise _credential_invalid("a VC 1.1 credential must have an issuanceDate", own[0])
    start, end = _date(credential, own[0]), _date(credential, own[1])
    if start is not None and end is not None and end < start:
        raise _credential_invalid(f"{own[1]} is earlier than {own[0]}", own[1])
    return start, end


def verify_credential(credential: Any, *, now: datetime | None = None) -> VerifiedCredential:
    """Verify a credential secured with one eddsa-jcs-2022 DataIntegrityProof.

    In order: the proof (`verify_proof`; `proof_invalid`), the credential's shape
    (`credential_invalid`, details.field names the field), the issuer's control of the proof's key
    (`proof_invalid`, reason `issuer_not_controller`), and, when `now` is given, the validity
    period: `credential_not_yet_valid` before its start, `credential_expired` from its end on.
    """
    if now is not None and (now.tzinfo is None or now.utcoffset() is None):
        raise ValueError("now must be timezone-aware")
    proof = verify_proof(credential)
    document = proof.unsecured_document  # what was signed (its @context is the proof's, if any)
    version = _version(document)
    _check_type(document)
    issuer = _issuer_id(document)
    subject = _subject_id(document)
    valid_from, valid_until = _validity(document, version)

    if controller_of(proof.verification_method) != issuer:
        raise _proof_invalid(
            "the proof's verificationMethod is not controlled by the credential's issuer",
            "issuer_not_controller",
            "proof.verificationMethod",
        )
    if now is not None:
        names = ("validFrom", "validUntil") if version == 2 else ("issuanceDate", "expirationDate")
        if valid_from is not None and now < valid_from:
            raise Invalid(
                f"credential is not valid before {document[names[0]]}",
                code="credential_not_yet_valid",
                details={names[0]: document[names[0]], "now": format_datetime(now)},
            )
        if valid_until is not None and now >= valid_until:
            raise Invalid(
                f"credential expired at {document[names[1]]}",
                code="credential_expired",
                details={names[1]: document[names[1]], "now": format_datetime(now)},
            )
    return VerifiedCredential(
        issuer_did=issuer,
        subject_id=subject,
        valid_from=valid_from,
        valid_until=valid_until,
        proof_created=proof.created,
        verification_method=proof.verification_method,
    )


# --- issuing --------------------------------------------------------------------------------


def add_proof(
    document: dict[str, Any], key: SigningKey, *, verification_method: str, created: str
) -> dict[str, Any]:
    """Create Proof (eddsa-jcs-2022), §3.3.1: a copy of `document` with a signed `proof`.

    The proof is {type, cryptosuite, created, verificationMethod, proofPurpose "assertionMethod"},
    with the document's `@context` copied in (step 2) and `proofValue` last. `ValueError` unless
    `verification_method` is the did:key key id of `key` (a proof no one could verify).
    """
    if not isinstance(document, dict):
        raise _credential_invalid("document must be a JSON object", "")
    document = copy.deepcopy(document)  # the result shares nothing with the input
    if "proof" in document:
        raise _credential_invalid("document already has a proof", "proof")
    try:
        named = public_key_from_key_id(verification_method) if "#" in verification_method else b""
    except ValueError:
        named = b""
    if named != key.public_key:
        raise ValueError("verification_method must be the did:key key id of the signing key")
    options: dict[str, Any] = {
        "type": PROOF_TYPE,
        "cryptosuite": CRYPTOSUITE,
        "created": created,
        "verificationMethod": verification_method,
        "proofPurpose": PROOF_PURPOSE,
    }
    if "@context" in document:
        options["@context"] = copy.deepcopy(document["@context"])
    canonical_config = proof_configuration(options)
    signature = key.sign(hash_data(canonical_config, transform_document(document)))
    return {**document, "proof": {**options, "proofValue": "z" + b58encode(signature)}}


def issue_credential(
    key: SigningKey,
    *,
    subject_id: str,
    claims: dict[str, Any] | None = None,
    valid_from: datetime | None = None,
    valid_until: datetime | None = None,
    created: datetime | None = None,
    credential_id: str | None = None,
) -> dict[str, Any]:
    """A VC 2.0 credential about `subject_id`, issued and signed by `key`'s did:key."""
    if not _nonempty_string(subject_id):
        raise _credential_invalid("subject id must be a non-empty string", "credentialSubject.id")
    claims = dict(claims or {})
    if "id" in claims:
        raise _credential_invalid("claims must not carry the subject id", "credentialSubject.id")
    if valid_from is not None and valid_until is not None and valid_until < valid_from:
        raise _credential_invalid("validUntil is earlier than validFrom", "validUntil")
    credential: dict[str, Any] = {"@context": [VC_V2_CONTEXT]}
    if credential_id is not None:
        credential["id"] = credential_id
    credential["type"] = ["VerifiableCredential"]
    credential["issuer"] = key.did
    if valid_from is not None:
        credential["validFrom"] = format_datetime(valid_from)
    if valid_until is not None:
        credential["validUntil"] = format_datetime(valid_until)
    credential["credentialSubject"] = {"id": subject_id, **claims}
    when = created if created is not None else datetime.now(UTC).replace(microsecond=0)
    return add_proof(credential, key, verification_method=key.key_id, created=format_datetime(when))
