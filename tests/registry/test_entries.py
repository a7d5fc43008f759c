"""Entries: structural validation, the signed publisher payload, the stored form, lifecycle."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from registry.canonical import MAX_SAFE_INTEGER, canonicalize, item_data_hash
from registry.entries import (
    UNSIGNED_FIELDS,
    CheckedEntry,
    check_entry,
    check_move,
    lifecycle_of,
    publisher_payload,
    sign_entry,
    signing_bytes,
    stored_form,
)
from registry.errors import Conflict, Invalid
from registry.keys import SigningKey, b64url_decode, b64url_encode, verify

PUBLISHER = SigningKey(
    bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
)
OTHER = SigningKey(
    bytes.fromhex("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb")
)
ENTRY_DID = "did:web:agents.example.com:helper"
UPDATED_AT = "2026-11-02T08:00:00Z"
CREATED = "2026-11-02T08:00:00.5Z"

REQUIRED = [
    "entryDid",
    "entryType",
    "itemData",
    "itemDataHash",
    "itemSchemaUri",
    "registryVersion",
    "name",
    "publishedAt",
    "publisherDid",
    "signature",
    "version",
]


def template(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "entryDid": ENTRY_DID,
        "entryType": "AgentDefinition",
        "itemData": {"model": "m-1", "instructions": "be helpful", "temperature": 0.5},
        "itemSchemaUri": "https://schemas.example.com/agent/v1",
        "registryVersion": "1.0",
        "name": "Helpful agent",
        "publishedAt": "2026-11-01T12:00:00Z",
        "version": "1.0.0",
        "description": "Answers questions.",
        "tags": ["demo", "helpful"],
        "customMetadata": {"team": "core", "limits": {"rps": 5}},
        "relationships": [
            {"relationshipType": "dependsOn", "targetDid": "did:web:tools.example.com:search"}
        ],
        "semanticAnnotations": [
            {"predicateUri": "https://schema.org/category", "objectLiteral": "assistant"}
        ],
        "serviceEndpoints": [
            {
                "id": "a2a",
                "type": "A2A",
                "url": "https://agents.example.com/helper",
                "priority": 1,
                "properties": {"auth": "none"},
            }
        ],
    }
    base.update(fields)
    return base


def signed(key: SigningKey = PUBLISHER, **fields: Any) -> dict[str, Any]:
    return sign_entry(template(**fields), key)


def invalid(entry: Any) -> Invalid:
    with pytest.raises(Invalid) as caught:
        check_entry(entry)
    assert caught.value.status == 400
    return caught.value


def mutated(mutate: Callable[[dict[str, Any]], None], entry: dict[str, Any] | None = None) -> Any:
    out = copy.deepcopy(entry if entry is not None else signed())
    mutate(out)
    return out


def setter(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that sets `a.b[0].c`-style `path` to `value`."""

    def apply(doc: dict[str, Any]) -> None:
        node: Any = doc
        parts = path.replace("[", ".").replace("]", "").split(".")
        for part in parts[:-1]:
            node = node[int(part)] if part.isdigit() else node[part]
        last = parts[-1]
        node[int(last) if last.isdigit() else last] = value

    return apply


# --- a valid entry ------------------------------------------------------------------------------


def test_entry_signed_with_sign_entry_passes_every_check() -> None:
    entry = signed()
    checked = check_entry(entry)
    assert isinstance(checked, CheckedEntry)
    assert checked.did == ENTRY_DID
    assert checked.publisher == PUBLISHER.did == entry["publisherDid"]
    assert checked.lifecycle == "draft"
    assert checked.based_on is None
    assert checked.doc == entry
    assert entry["itemDataHash"] == item_data_hash(entry["itemData"])
    assert entry["signature"]["keyId"] == PUBLISHER.key_id
    assert entry["signature"]["algorithm"] == "Ed25519"


def test_signature_is_ed25519_over_jcs_of_the_publisher_payload() -> None:
    entry = signed()
    payload = {k: v for k, v in entry.items() if k != "signature"}
    signature = b64url_decode(entry["signature"]["value"])
    assert signing_bytes(entry) == canonicalize(payload)
    assert verify(PUBLISHER.public_key, canonicalize(payload), signature)


def test_minimal_entry_with_only_required_fields_is_valid() -> None:
    minimal = {k: v for k, v in template().items() if k in REQUIRED}
    checked = check_entry(sign_entry(minimal, PUBLISHER))
    assert checked.lifecycle == "draft"


def test_explicit_lifecycle_status_is_reported() -> None:
    assert check_entry(signed(lifecycleStatus="active")).lifecycle == "active"


def test_reordered_members_and_respelled_numbers_keep_hash_and_signature_valid() -> None:
    entry = signed(itemData={"b": [1, 2.5], "a": {"y": 2, "x": 1}})
    respelled = {key: entry[key] for key in reversed(list(entry))}
    respelled["itemData"] = {"a": {"x": 1.0, "y": 2}, "b": [1.0, 2.5]}
    check_entry(respelled)


def test_sign_entry_keeps_sequence_but_not_other_registry_managed_fields() -> None:
    entry = sign_entry(
        template(sequence=4, updatedAt=UPDATED_AT, anchorState="anchored"), PUBLISHER
    )
    assert entry["sequence"] == 4
    assert not {"updatedAt", "anchorState"} & entry.keys()
    assert check_entry(entry).based_on == 4


# --- structural errors (400 entry_invalid naming the field) --------------------------------------


@pytest.mark.parametrize("field", REQUIRED)
def test_missing_required_field(field: str) -> None:
    error = invalid(mutated(lambda doc: doc.pop(field)))
    assert error.code == "entry_invalid"
    assert error.message.startswith(f"{field}:")
    assert error.details["errors"][0]["field"] == field


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("entryDid", 42),
        ("entryType", 1),
        ("entryType", "Agent Definition"),
        ("itemDataHash", 1234),
        ("itemSchemaUri", ["https://schemas.example.com"]),
        ("itemSchemaUri", "not a uri"),
        ("registryVersion", 1.0),
        ("name", 5),
        ("name", ""),
        ("name", "line\nbreak"),
        ("publishedAt", 1_700_000_000),
        ("publisherDid", None),
        ("signature", "signed"),
        ("signature.algorithm", "RSA"),
        ("signature.keyId", 7),
        ("signature.value", "too-short"),
        ("version", 1),
        ("description", ["text"]),
        ("customMetadata", ["not", "an", "object"]),
        ("lifecycleStatus", "deleted"),
        ("lifecycleStatus", "Active"),
        ("tags", "demo"),
        ("tags[1]", 3),
        ("tags[0]", ""),
        ("relationships", {"relationshipType": "dependsOn"}),
        ("relationships[0].relationshipType", 3),
        ("semanticAnnotations[0].predicateUri", "category"),
        ("serviceEndpoints", {}),
        ("serviceEndpoints[0].priority", "1"),
        ("serviceEndpoints[0].priority", True),
        ("serviceEndpoints[0].priority", 1.5),
        ("serviceEndpoints[0].priority", -1),
        ("serviceEndpoints[0].url", 80),
        ("serviceEndpoints[0].properties", ["x"]),
        ("sequence", True),
        ("sequence", "3"),
        ("sequence", 0),
        ("updatedAt", 0),
        ("verifiableAttestations", {"a": 1}),
    ],
)
def test_wrong_type_or_value_names_the_field(path: str, value: Any) -> None:
    error = invalid(mutated(setter(path, value)))
    assert error.code == "entry_invalid"
    assert error.message.startswith(f"{path}:"), error.message


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("", "colour"),
        ("signature", "nonce"),
        ("serviceEndpoints[0]", "weight"),
        ("relationships[0]", "note"),
        ("semanticAnnotations[0]", "extra"),
    ],
)
def test_unknown_field_is_rejected(path: str, name: str) -> None:
    full = f"{path}.{name}" if path else name
    error = invalid(mutated(setter(full, "x")))
    assert error.code == "entry_invalid"
    assert error.message == f"{full}: unknown field"


@pytest.mark.parametrize("entry", [[], "entry", None, 42])
def test_entry_must_be_an_object(entry: Any) -> None:
    assert invalid(entry).code == "entry_invalid"


@pytest.mark.parametrize("path", ["entryDid", "publisherDid", "relationships[0].targetDid"])
@pytest.mark.parametrize(
    "bad",
    ["example.com", "did:web", "did:web:", "did:WEB:example.com", "did:web:a b", "did:web:x#frag"],
)
def test_bad_did_syntax_is_rejected(path: str, bad: str) -> None:
    error = invalid(mutated(setter(path, bad)))
    assert error.code == "entry_invalid"
    assert error.message.startswith(f"{path}:")
    assert "DID" in error.message


@pytest.mark.parametrize("path", ["publishedAt", "updatedAt", "signature.created"])
@pytest.mark.parametrize(
    "bad",
    [
        "2026-11-01",
        "2026-11-01T12:00:00",
        "2026-11-01 12:00:00Z",
        "2026-11-01T12:00Z",
        "26-11-01T12:00:00Z",
        "2026-02-30T00:00:00Z",
        "2026-13-01T00:00:00Z",
        "2026-11-01T24:00:00Z",
        "2026-11-01T12:60:00Z",
        "2026-11-01T12:00:00+2400",
        "2026-11-01T12:00:00+24:00",
        "2026-11-01T12:00:00.Z",
        "yesterday",
        "",
    ],
)
def test_bad_date_time_is_rejected(path: str, bad: str) -> None:
    error = invalid(mutated(setter(path, bad)))
    assert error.code == "entry_invalid"
    assert error.message.startswith(f"{path}:")


@pytest.mark.parametrize(
    "good",
    [
        "2026-11-01T12:00:00Z",
        "2026-11-01t12:00:00z",
        "2026-11-01T12:00:00.123456789+05:30",
        "2026-11-01T12:00:00-00:00",
        "2028-02-29T23:59:59.5Z",
    ],
)
def test_rfc_3339_date_times_are_accepted(good: str) -> None:
    check_entry(signed(publishedAt=good))
    check_entry(mutated(setter("updatedAt", good)))
    check_entry(mutated(setter("signature.created", good)))


# --- hash, key and signature --------------------------------------------------------------------


def test_wrong_item_data_hash_is_a_hash_mismatch() -> None:
    entry = signed()
    error = invalid(mutated(setter("itemDataHash", "0" * 64), entry))
    assert error.code == "item_data_hash_mismatch"
    assert error.details == {"field": "itemDataHash", "expected": entry["itemDataHash"]}


def test_item_data_changed_after_signing_is_a_hash_mismatch() -> None:
    error = invalid(mutated(setter("itemData.temperature", 0.7)))
    assert error.code == "item_data_hash_mismatch"


def test_item_data_hash_must_be_lowercase_hex() -> None:
    entry = signed()
    error = invalid(mutated(setter("itemDataHash", entry["itemDataHash"].upper()), entry))
    assert error.code == "entry_invalid"
    assert error.message.startswith("itemDataHash:")


def test_key_id_controlled_by_someone_else_is_a_key_mismatch() -> None:
    entry = signed()
    error = invalid(mutated(setter("signature.keyId", OTHER.key_id), entry))
    assert error.code == "signature_key_mismatch"
    assert error.details == {"field": "signature.keyId"}


def test_entry_signed_by_someone_else_for_the_publisher_is_a_key_mismatch() -> None:
    # OTHER signs honestly with its own key id, then claims PUBLISHER as the publisher.
    entry = signed(OTHER)
    entry["publisherDid"] = PUBLISHER.did
    assert invalid(entry).code == "signature_key_mismatch"


@pytest.mark.parametrize(
    "key_id",
    [
        PUBLISHER.did + "#" + OTHER.did.removeprefix("did:key:"),
        PUBLISHER.did + "#key-1",
    ],
    ids=["fragment-of-another-key", "named-fragment"],
)
def test_key_id_fragment_not_naming_the_publishers_key_is_invalid(key_id: str) -> None:
    error = invalid(mutated(setter("signature.keyId", key_id)))
    assert error.code == "signature_key_invalid"


def test_non_did_key_publisher_cannot_sign() -> None:
    entry = signed()
    entry["publisherDid"] = "did:web:publisher.example.com"
    entry["signature"]["keyId"] = "did:web:publisher.example.com#key-1"
    assert invalid(entry).code == "signature_key_invalid"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("name", "Evil agent"),
        ("entryDid", "did:web:agents.example.com:other"),
        ("entryType", "ToolDefinition"),
        ("version", "1.0.1"),
        ("publishedAt", "2026-11-01T12:00:01Z"),
        ("description", "Answers questions badly."),
        ("tags", ["helpful", "demo"]),
        ("lifecycleStatus", "active"),
        ("customMetadata.team", "evil"),
        ("relationships[0].targetDid", "did:web:evil.example.com"),
        ("serviceEndpoints[0].url", "https://evil.example.com"),
        ("serviceEndpoints[0].priority", 2),
        ("itemSchemaUri", "https://schemas.example.com/agent/v2"),
        ("shardAssignment", "shard-1"),
    ],
)
def test_signed_field_changed_after_signing_invalidates_the_signature(
    path: str, value: Any
) -> None:
    error = invalid(mutated(setter(path, value)))
    assert error.code == "signature_invalid"
    assert error.details == {"field": "signature.value"}


def test_removing_an_optional_signed_field_invalidates_the_signature() -> None:
    assert invalid(mutated(lambda doc: doc.pop("description"))).code == "signature_invalid"


@pytest.mark.parametrize(
    "value",
    [
        b64url_encode(PUBLISHER.sign(b"something else")),
        b64url_encode(bytes(64)),
        "A" * 85 + "B",  # 86 characters whose last one carries non-zero padding bits
    ],
    ids=["signature-of-other-bytes", "zero-signature", "non-canonical-base64url"],
)
def test_signature_value_that_does_not_verify(value: str) -> None:
    assert invalid(mutated(setter("signature.value", value))).code == "signature_invalid"


def test_signature_with_flipped_bit_does_not_verify() -> None:
    entry = signed()
    raw = bytearray(b64url_decode(entry["signature"]["value"]))
    raw[10] ^= 0x01
    assert invalid(mutated(setter("signature.value", b64url_encode(raw)), entry)).code == (
        "signature_invalid"
    )


def test_registry_managed_and_signature_fields_are_outside_the_signed_payload() -> None:
    assert (
        frozenset({"signature", "sequence", "anchorState", "verifiableAttestations", "updatedAt"})
        == UNSIGNED_FIELDS
    )
    base = signed()
    extended = dict(
        base,
        sequence=12,
        updatedAt=UPDATED_AT,
        anchorState="anchored",
        verifiableAttestations=[{"id": "urn:uuid:1"}],
    )
    assert signing_bytes(extended) == signing_bytes(base)
    assert publisher_payload(extended) == publisher_payload(base)


def test_unsigned_fields_can_change_without_breaking_the_signature() -> None:
    entry = sign_entry(template(sequence=3, updatedAt="2026-11-01T12:00:00Z"), PUBLISHER)
    entry.update(
        sequence=9,
        updatedAt=UPDATED_AT,
        anchorState="confirmed",
        verifiableAttestations=[{"type": ["VerifiableCredential"]}],
    )
    entry["signature"]["created"] = CREATED
    checked = check_entry(entry)
    assert checked.based_on == 9
    # The registry-managed fields are dropped from what will be stored; the signature stays.
    assert not {"sequence", "updatedAt", "anchorState", "verifiableAttestations"} & set(checked.doc)
    assert checked.doc["signature"] == entry["signature"]


# --- the stored (served) form -------------------------------------------------------------------


def served(doc: dict[str, Any], sequence: int, created: str = CREATED) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    out["signature"].setdefault("created", created)
    out.update(anchorState="unanchored", updatedAt=UPDATED_AT, sequence=sequence)
    return out


@pytest.mark.parametrize("sequence", [1, 42, MAX_SAFE_INTEGER])
def test_stored_form_renders_jcs_of_the_served_doc(sequence: int) -> None:
    doc = check_entry(signed()).doc
    form = stored_form(doc, updated_at=UPDATED_AT, signature_created=CREATED)
    text = form.render(sequence)
    assert text.encode() == canonicalize(served(doc, sequence))
    assert json.loads(text) == served(doc, sequence)


def test_stored_form_keeps_a_signature_created_the_client_sent() -> None:
    doc = check_entry(mutated(setter("signature.created", "2026-11-01T12:00:00Z"))).doc
    parsed = json.loads(
        stored_form(doc, updated_at=UPDATED_AT, signature_created=CREATED).render(5)
    )
    assert parsed["signature"]["created"] == "2026-11-01T12:00:00Z"


def test_stored_form_does_not_touch_nested_sequence_members() -> None:
    item = {"sequence": -1, "steps": [{"sequence": -1}, {"sequence": 2}]}
    entry = signed(
        itemData=item,
        customMetadata={"sequence": -1},
        description='a "sequence":-1 in text',
        name="sequence",
    )
    doc = check_entry(entry).doc
    text = stored_form(doc, updated_at=UPDATED_AT, signature_created=CREATED).render(77)
    parsed = json.loads(text)
    assert parsed["sequence"] == 77
    assert parsed["itemData"] == item
    assert parsed["customMetadata"] == {"sequence": -1}
    assert parsed["description"] == 'a "sequence":-1 in text'
    assert text.encode() == canonicalize(served(doc, 77))


def test_served_doc_still_verifies_with_the_publisher_payload_rule() -> None:
    doc = check_entry(signed()).doc
    text = stored_form(doc, updated_at=UPDATED_AT, signature_created=CREATED).render(42)
    again = check_entry(json.loads(text))
    assert again.based_on == 42
    assert again.publisher == PUBLISHER.did
    assert signing_bytes(json.loads(text)) == signing_bytes(doc)


_chars = st.characters(exclude_categories=["Cs"])
_item_data = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER)
    | st.floats(-1e15, 1e15, allow_nan=False)
    | st.text(_chars, max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["sequence", "a", "z", "\U0001f600"]) | st.text(_chars, max_size=6),
            inner,
            max_size=4,
        )
    ),
    max_leaves=20,
)


@given(_item_data, st.integers(1, MAX_SAFE_INTEGER))
def test_stored_form_equals_jcs_for_any_item_data(item: Any, sequence: int) -> None:
    doc = check_entry(signed(itemData=item)).doc
    text = stored_form(doc, updated_at=UPDATED_AT, signature_created=CREATED).render(sequence)
    assert text.encode() == canonicalize(served(doc, sequence))
    assert check_entry(json.loads(text)).based_on == sequence


# --- lifecycle (design §4) ----------------------------------------------------------------------

ALLOWED_MOVES = [
    ("draft", "draft"),
    ("draft", "active"),
    ("draft", "revoked"),
    ("active", "active"),
    ("active", "deprecated"),
    ("active", "revoked"),
    ("deprecated", "deprecated"),
    ("deprecated", "active"),
    ("deprecated", "revoked"),
]
CONFLICTING_MOVES = [
    ("draft", "deprecated"),
    ("active", "draft"),
    ("deprecated", "draft"),
    ("revoked", "draft"),
    ("revoked", "active"),
    ("revoked", "deprecated"),
    ("revoked", "revoked"),
    ("deleted", "draft"),
    ("deleted", "active"),
    ("deleted", "deprecated"),
    ("deleted", "revoked"),
    ("active", "deleted"),  # deletion is DELETE's tombstone, never an update
]


@pytest.mark.parametrize(("current", "new"), ALLOWED_MOVES)
def test_allowed_lifecycle_move(current: str, new: str) -> None:
    check_move(current, new)


@pytest.mark.parametrize(("current", "new"), CONFLICTING_MOVES)
def test_lifecycle_move_not_in_the_table_is_a_conflict(current: str, new: str) -> None:
    with pytest.raises(Conflict) as caught:
        check_move(current, new)
    assert caught.value.status == 409
    assert caught.value.code == "lifecycle_conflict"
    assert caught.value.details == {"from": current, "to": new}


def test_lifecycle_of_defaults_to_draft() -> None:
    assert lifecycle_of({}) == "draft"
    assert lifecycle_of({"lifecycleStatus": None}) == "draft"
    assert lifecycle_of({"lifecycleStatus": "deprecated"}) == "deprecated"
