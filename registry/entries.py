"""Entries: structural validation, the signed publisher payload, lifecycle, the stored form.

Signed payload rule (design §3): the payload is the entry as received minus `signature`,
`sequence`, `anchorState`, `verifiableAttestations` and `updatedAt`; the publisher signs
JCS(payload) with Ed25519, with a key whose controller is `publisherDid`.

The registry never adds or changes a signed field, so any served version verifies with the same
rule. An entry without `lifecycleStatus` is a draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from registry import canonical
from registry.did import controller_of, public_key_from_key_id
from registry.errors import Conflict, Invalid
from registry.keys import SigningKey, b64url_decode, b64url_encode, verify
from registry.models import RegistryEntry, validate_model

UNSIGNED_FIELDS = frozenset(
    {"signature", "sequence", "anchorState", "verifiableAttestations", "updatedAt"}
)
MANAGED_FIELDS = frozenset({"sequence", "anchorState", "verifiableAttestations", "updatedAt"})

# Lifecycle (design §4): draft → active → deprecated → active; any live state → revoked.
_MOVES: dict[str, frozenset[str]] = {
    "draft": frozenset({"draft", "active", "revoked"}),
    "active": frozenset({"active", "deprecated", "revoked"}),
    "deprecated": frozenset({"deprecated", "active", "revoked"}),
    "revoked": frozenset(),
    "deleted": frozenset(),
}
CREATE_STATES = frozenset({"draft", "active"})


def publisher_payload(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k not in UNSIGNED_FIELDS}


def signing_bytes(entry: dict[str, Any]) -> bytes:
    """The exact bytes the publisher signs: JCS of the publisher payload."""
    return canonical.canonicalize(publisher_payload(entry))


def lifecycle_of(entry: dict[str, Any]) -> str:
    status = entry.get("lifecycleStatus") or "draft"
    return str(status)


def check_move(current: str, new: str) -> None:
    if new not in _MOVES.get(current, frozenset()):
        raise Conflict(
            f"lifecycle cannot move from {current} to {new}",
            code="lifecycle_conflict",
            details={"from": current, "to": new},
        )


@dataclass(frozen=True)
class CheckedEntry:
    """An entry that passed every structural and cryptographic check."""

    doc: dict[str, Any]  # as received, minus registry-managed fields
    members: dict[str, str]  # JCS text of each member value as received
    model: RegistryEntry
    based_on: int | None  # the `sequence` the client sent (update: the version it edited)

    @property
    def did(self) -> str:
        return self.model.entry_did

    @property
    def publisher(self) -> str:
        return self.model.publisher_did

    @property
    def lifecycle(self) -> str:
        return lifecycle_of(self.doc)


def check_entry(data: Any, members: dict[str, str] | None = None) -> CheckedEntry:
    """Validate a parsed entry: every field of spec 2.1, the hash, the key and the signature.

    `members`: `canonical.canonical_members(data)` where the caller has made them already."""
    if not isinstance(data, dict):
        raise Invalid("the entry must be a JSON object", code="entry_invalid")
    model = validate_model(RegistryEntry, data, code="entry_invalid")
    if members is None:
        members = canonical.canonical_members(data)
    verify_publisher(
        members,
        publisher_did=model.publisher_did,
        item_data_hash=model.item_data_hash,
        key_id=model.signature.key_id,
        signature_value=model.signature.value,
    )
    doc = {k: v for k, v in data.items() if k not in MANAGED_FIELDS}
    return CheckedEntry(doc=doc, members=members, model=model, based_on=model.sequence)


def verify_publisher(
    members: dict[str, str],
    *,
    publisher_did: str,
    item_data_hash: str,
    key_id: str,
    signature_value: str,
    bare_key_id: bool = False,
) -> None:
    """The cryptographic checks of an entry, over the JCS text of its members: `itemDataHash`
    is SHA-256 of JCS(itemData), the key is an Ed25519 did:key key of `publisherDid`, and the
    signature verifies over JCS of the publisher payload. `Invalid` says which failed.
    `bare_key_id`: a key id without its fragment is taken (a peer's entries, `check_replica`)."""
    expected = canonical.sha256_hex(members["itemData"].encode("utf-8"))
    if item_data_hash != expected:
        raise Invalid(
            "itemDataHash is not the SHA-256 of JCS(itemData)",
            code="item_data_hash_mismatch",
            details={"field": "itemDataHash", "expected": expected},
        )
    if controller_of(key_id) != publisher_did:
        raise Invalid(
            "signature.keyId is not controlled by publisherDid",
            code="signature_key_mismatch",
            details={"field": "signature.keyId"},
        )
    try:
        public_key = public_key_from_key_id(key_id, bare=bare_key_id)
    except ValueError:
        raise Invalid(
            "signature.keyId must be an Ed25519 did:key key id (did:key:z…#z…)",
            code="signature_key_invalid",
            details={"field": "signature.keyId"},
        ) from None
    signature = b64url_decode(signature_value) if _is_b64(signature_value) else b""
    payload = canonical.join_members(
        {k: v for k, v in members.items() if k not in UNSIGNED_FIELDS}
    ).encode("utf-8")
    if len(signature) != 64 or not verify(public_key, payload, signature):
        raise Invalid(
            "signature does not verify over JCS of the publisher payload",
            code="signature_invalid",
            details={"field": "signature.value"},
        )


def _is_b64(text: str) -> bool:
    try:
        b64url_decode(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class StoredForm:
    """The served JSON of a version, split around its `sequence` value.

    The registry assigns the sequence inside the committing transaction; the store joins
    `prefix ‖ sequence ‖ suffix`, which is exactly JCS of the served entry.
    """

    prefix: str
    suffix: str

    def render(self, sequence: int) -> str:
        return f"{self.prefix}{sequence}{self.suffix}"


def stored_form(
    doc: dict[str, Any],
    *,
    updated_at: str,
    signature_created: str,
    members: dict[str, str] | None = None,
    anchor_state: str = "unanchored",
) -> StoredForm:
    """JCS of `doc` + registry-managed fields, with a hole where `sequence` goes.

    `members` (from `canonical.canonical_members` of the received entry) saves re-encoding.
    """
    pieces = dict(members) if members is not None else canonical.canonical_members(doc)
    for name in MANAGED_FIELDS:
        pieces.pop(name, None)
    if doc["signature"].get("created") is None:  # absent, or null: not signed, filled in
        signature = {**doc["signature"], "created": signature_created}
        pieces["signature"] = canonical.canonicalize(signature).decode("utf-8")
    pieces["anchorState"] = canonical.canonicalize(anchor_state).decode("utf-8")
    pieces["updatedAt"] = canonical.canonicalize(updated_at).decode("utf-8")
    prefix, suffix = canonical.split_members(pieces, "sequence")
    return StoredForm(prefix=prefix, suffix=suffix)


def sign_entry(
    entry: dict[str, Any], key: SigningKey, *, created: str | None = None
) -> dict[str, Any]:
    """Fill `itemDataHash` and `signature` of an entry with `key` (what a publisher does)."""
    out = {k: v for k, v in entry.items() if k not in UNSIGNED_FIELDS}
    out["publisherDid"] = key.did
    out["itemDataHash"] = canonical.item_data_hash(out["itemData"])
    signature = b64url_encode(key.sign(canonical.canonicalize(out)))
    sig: dict[str, Any] = {"algorithm": "Ed25519", "keyId": key.key_id, "value": signature}
    if created is not None:
        sig["created"] = created
    out["signature"] = sig
    if "sequence" in entry:
        out["sequence"] = entry["sequence"]
    return out
