"""Trust and ownership rules, pure: bond amounts and the slash split, transfer offers and the
accept rules (spec 4.2, design §8 and §12).

Amounts are decimal strings computed with `decimal.Decimal`, never floats: a slash is split at
the amount's own scale, harmed = floor(amount × harmed share), reporter = floor(amount ×
reporter share), treasury = the rest, so the three shares always add up to the amount exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Context, Decimal, localcontext
from typing import Any

from registry import canonical
from registry.did import controller_of, public_key_from_key_id
from registry.entries import UNSIGNED_FIELDS
from registry.errors import Invalid
from registry.keys import SigningKey, b64url_decode, b64url_encode, verify
from registry.models import parse_datetime

# An amount: a non-negative decimal with at most 30 integer digits and 18 fractional digits.
AMOUNT = re.compile(r"^(0|[1-9][0-9]{0,29})(\.[0-9]{1,18})?$")
CURRENCY = re.compile(r"^[A-Z0-9]{2,10}$")
# A client-chosen record id (a bond's) is a path segment: not `.` or `..`, which URL
# normalisation (RFC 3986 §5.2.4) removes before the request is sent.
RECORD_ID = re.compile(
    r"^(?:[A-Za-z0-9_:-][A-Za-z0-9._:-]{0,127}"  # (no look-ahead: JSON Schema and pydantic)
    r"|\.[A-Za-z0-9_:-][A-Za-z0-9._:-]{0,126}"
    r"|\.\.[A-Za-z0-9._:-]{1,126})$"
)
_EXACT = Context(prec=80)  # far beyond 30 + 18 digits: every operation here is exact


def parse_amount(text: Any, field: str, *, positive: bool = True) -> Decimal:
    """A decimal amount from its string form (400 naming `field` when it is not one)."""
    if not isinstance(text, str) or not AMOUNT.fullmatch(text):
        raise Invalid(
            f"{field} must be a decimal string like '12.50' (at most 30 integer and 18"
            " fractional digits)",
            code="invalid_amount",
            details={"field": field},
        )
    value = Decimal(text)
    if positive and value == 0:
        raise Invalid(
            f"{field} must be above zero", code="invalid_amount", details={"field": field}
        )
    return value


@dataclass(frozen=True)
class Shares:
    """How a slashed amount is distributed (fractions adding up to 1)."""

    harmed: Decimal = Decimal("0.5")
    reporter: Decimal = Decimal("0.3")
    treasury: Decimal = Decimal("0.2")

    def __post_init__(self) -> None:
        parts = (self.harmed, self.reporter, self.treasury)
        with localcontext(_exact_for(*parts)):
            total = sum(parts, Decimal(0))
        if any(p < 0 for p in parts) or total != 1:
            raise ValueError("slash shares must be non-negative and add up to 1")


@dataclass(frozen=True)
class Split:
    harmed: Decimal
    reporter: Decimal
    treasury: Decimal

    def to_json(self) -> dict[str, str]:
        return {
            "harmedPartiesShare": format_amount(self.harmed),
            "reporterShare": format_amount(self.reporter),
            "treasuryShare": format_amount(self.treasury),
        }


def split_slash(amount: Decimal, shares: Shares) -> Split:
    """The shares of a slashed `amount` at its own decimal scale (33.10 at 50/30/20 →
    16.55 / 9.93 / 6.62): the first two floored, the treasury takes the rest."""
    unit = Decimal(1).scaleb(amount.as_tuple().exponent)  # type: ignore[arg-type]
    with localcontext(_exact_for(amount, shares.harmed, shares.reporter)):
        harmed = (amount * shares.harmed).quantize(unit, rounding=ROUND_FLOOR)
        reporter = (amount * shares.reporter).quantize(unit, rounding=ROUND_FLOOR)
        treasury = amount - harmed - reporter
    return Split(harmed, reporter, treasury)


def _exact_for(*values: Decimal) -> Context:
    """A context whose precision holds any product or sum of `values` exactly (their digits
    and exponent spans added up), so nothing is rounded before the floor."""
    digits = 0
    for v in values:
        t = v.as_tuple()
        digits += len(t.digits) + abs(int(t.exponent))
    return Context(prec=max(_EXACT.prec, 2 * digits + 10))


def format_amount(value: Decimal) -> str:
    """The plain string of a decimal (no exponent), keeping its scale: 6.60, 0.01, 1000."""
    return f"{value:f}"


def remaining(amount: Decimal, slashed: list[Decimal]) -> Decimal:
    with localcontext(_EXACT):
        left = amount
        for part in slashed:
            left -= part
    return left


# --- transfer offers ------------------------------------------------------------------------


def offer_signing_bytes(
    entry_did: str, entry_sequence: int, recipient_did: str, expires_at: str | None
) -> bytes:
    """What the owner signs: JCS of {entryDid, entrySequence, recipientDid, expiresAt} (without
    expiresAt when the owner lets the registry default it)."""
    payload: dict[str, Any] = {
        "entryDid": entry_did,
        "entrySequence": entry_sequence,
        "recipientDid": recipient_did,
    }
    if expires_at is not None:
        payload["expiresAt"] = expires_at
    return canonical.canonicalize(payload)


def sign_offer(
    key: SigningKey,
    *,
    entry_did: str,
    entry_sequence: int,
    recipient_did: str,
    expires_at: str | None = None,
) -> dict[str, str]:
    """The owner's `ownerSignature` for an offer (what an owner's client does)."""
    message = offer_signing_bytes(entry_did, entry_sequence, recipient_did, expires_at)
    return {
        "algorithm": "Ed25519",
        "keyId": key.key_id,
        "value": b64url_encode(key.sign(message)),
    }


def check_offer_signature(signature: Any, owner_did: str, message: bytes) -> dict[str, Any]:
    """The owner's signature object, checked: Ed25519, a key the owner controls, and a value
    that verifies over `message` (400 otherwise)."""
    if not isinstance(signature, dict) or not all(
        isinstance(signature.get(k), str) for k in ("algorithm", "keyId", "value")
    ):
        raise Invalid(
            "ownerSignature must be an object with algorithm, keyId and value strings",
            code="offer_invalid",
            details={"field": "ownerSignature"},
        )
    if "created" in signature and not _is_timestamp(signature["created"]):
        raise Invalid(
            "ownerSignature.created must be an RFC 3339 date-time with offset",
            code="offer_invalid",
            details={"field": "ownerSignature.created"},
        )
    if signature["algorithm"] != "Ed25519":
        raise Invalid(
            "ownerSignature.algorithm must be Ed25519",
            code="offer_invalid",
            details={"field": "ownerSignature.algorithm"},
        )
    key_id = signature["keyId"]
    if controller_of(key_id) != owner_did:
        raise Invalid(
            "ownerSignature.keyId is not controlled by the entry's owner",
            code="signature_key_mismatch",
            details={"field": "ownerSignature.keyId"},
        )
    try:
        public_key = public_key_from_key_id(key_id)
        value = b64url_decode(signature["value"])
    except ValueError:
        value, public_key = b"", b""
    if len(value) != 64 or len(public_key) != 32 or not verify(public_key, message, value):
        raise Invalid(
            "ownerSignature does not verify over JCS of the offer",
            code="signature_invalid",
            details={"field": "ownerSignature.value"},
        )
    allowed = {"algorithm", "keyId", "value", "created"}
    return {k: v for k, v in signature.items() if k in allowed}


def _is_timestamp(value: Any) -> bool:
    """A string date-time (at most 64 characters): what `created` is everywhere else. Stored
    and served with every read of the offer, it was once any JSON (hostile review: 10,400
    floats cost each anonymous read of the offer 17 ms)."""
    if not isinstance(value, str) or len(value) > 64:
        return False
    try:
        parse_datetime(value)
    except ValueError:
        return False
    return True


# Fields of an entry that change hands in a transfer: who publishes it and the signature.
TRANSFERRED_FIELDS = frozenset({"publisherDid", "signature"})


def changed_field(snapshot: dict[str, Any], submitted: dict[str, Any]) -> str | None:
    """Rule (a) of spec 4.2: the first publisher-authored field of `snapshot` that `submitted`
    does not preserve exactly (JCS-equal), or that it adds; None when all are preserved."""
    ignore = UNSIGNED_FIELDS | TRANSFERRED_FIELDS
    before = {k: v for k, v in snapshot.items() if k not in ignore}
    after = {k: v for k, v in submitted.items() if k not in ignore}
    for name in sorted(before.keys() | after.keys()):
        if name not in before or name not in after:
            return name
        if canonical.canonicalize(before[name]) != canonical.canonicalize(after[name]):
            return name
    return None
