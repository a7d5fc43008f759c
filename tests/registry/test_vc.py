"""eddsa-jcs-2022 Verifiable Credentials (registry.vc), checked against the W3C test vectors.

Vectors: "Data Integrity EdDSA Cryptosuites v1.0", W3C Recommendation 15 May 2025,
https://www.w3.org/TR/2025/REC-vc-di-eddsa-20250515/ (= https://www.w3.org/TR/vc-di-eddsa/),
Appendix B.3 "Representation: eddsa-jcs-2022", Examples 29–39; copied from the stored
transitions/2025/REC/index.html of https://github.com/w3c/vc-di-eddsa. The same canonical forms
and hashes are in that repository's TestVectors/eddsa-jcs-2022/ (canonDocJCS.txt, docHashJCS.txt,
proofCanonJCS.txt, proofHashJCS.txt, combinedHashJCS.txt) and the key pair in
TestVectors/keyPair.json. (Some stored versions of proofConfigJCS.json / signedJCS.json there are
older drafts with an https: verificationMethod; the values below are the Recommendation's.)

The vector's issuer (https://vc.example/issuers/5678) is not the controller of its did:key
verificationMethod, so the vector passes the cryptosuite's Verify Proof (`verify_proof`) but not
`verify_credential`, which also requires the issuer to control the signing key. Credential-level
tests use the vector's document re-signed with issuer = the vector key's did:key ("REISSUED",
derived here, not published).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from registry.did import b58decode, b58encode
from registry.errors import Invalid
from registry.keys import SigningKey
from registry.vc import (
    VC_V1_CONTEXT,
    VC_V2_CONTEXT,
    VerifiedCredential,
    add_proof,
    format_datetime,
    hash_data,
    issue_credential,
    parse_rfc3339,
    parse_xsd_datetime_stamp,
    proof_configuration,
    transform_document,
    verify_credential,
    verify_proof,
)

# --- W3C vectors (REC Appendix B.3) --------------------------------------------------------------

# Example 29: Private and Public keys for Signature.
PUBLIC_KEY_MULTIBASE = "z6MkrJVnaZkeFzdQyMZu1cgjg7k1pZZ6pvBQ7XJPt4swbTQ2"
SECRET_KEY_MULTIBASE = "z3u2en7t5LR2WtQH5PfFqMqwVHBeXouLzo6haApm8XHqvjxq"

EXAMPLES_CONTEXT = "https://www.w3.org/ns/credentials/examples/v2"
CONTEXT = [VC_V2_CONTEXT, EXAMPLES_CONTEXT]
VECTOR_DID = "did:key:" + PUBLIC_KEY_MULTIBASE
VERIFICATION_METHOD = f"{VECTOR_DID}#{PUBLIC_KEY_MULTIBASE}"
CREATED = "2023-02-24T23:36:38Z"

# Example 30: Credential without Proof.
UNSIGNED: dict[str, Any] = {
    "@context": [VC_V2_CONTEXT, EXAMPLES_CONTEXT],
    "id": "urn:uuid:58172aac-d8ba-11ed-83dd-0b3aef56cc33",
    "type": ["VerifiableCredential", "AlumniCredential"],
    "name": "Alumni Credential",
    "description": "A minimum viable example of an Alumni Credential.",
    "issuer": "https://vc.example/issuers/5678",
    "validFrom": "2023-01-01T00:00:00Z",
    "credentialSubject": {"id": "did:example:abcdefgh", "alumniOf": "The School of Examples"},
}

# Example 31: Canonical Credential without Proof.
CANONICAL_DOCUMENT = (
    '{"@context":["https://www.w3.org/ns/credentials/v2",'
    '"https://www.w3.org/ns/credentials/examples/v2"],"credentialSubject":'
    '{"alumniOf":"The School of Examples","id":"did:example:abcdefgh"},'
    '"description":"A minimum viable example of an Alumni Credential.",'
    '"id":"urn:uuid:58172aac-d8ba-11ed-83dd-0b3aef56cc33",'
    '"issuer":"https://vc.example/issuers/5678","name":"Alumni Credential",'
    '"type":["VerifiableCredential","AlumniCredential"],"validFrom":"2023-01-01T00:00:00Z"}'
)

# Example 32: Hash of Canonical Credential without Proof (hex).
DOCUMENT_HASH = "59b7cb6251b8991add1ce0bc83107e3db9dbbab5bd2c28f687db1a03abc92f19"

# Example 33: Proof Options Document.
PROOF_OPTIONS: dict[str, Any] = {
    "type": "DataIntegrityProof",
    "cryptosuite": "eddsa-jcs-2022",
    "created": CREATED,
    "verificationMethod": VERIFICATION_METHOD,
    "proofPurpose": "assertionMethod",
    "@context": [VC_V2_CONTEXT, EXAMPLES_CONTEXT],
}

# Example 34: Canonical Proof Options Document.
CANONICAL_PROOF_CONFIG = (
    '{"@context":["https://www.w3.org/ns/credentials/v2",'
    '"https://www.w3.org/ns/credentials/examples/v2"],"created":"2023-02-24T23:36:38Z",'
    '"cryptosuite":"eddsa-jcs-2022","proofPurpose":"assertionMethod","type":"DataIntegrityProof",'
    '"verificationMethod":"did:key:z6MkrJVnaZkeFzdQyMZu1cgjg7k1pZZ6pvBQ7XJPt4swbTQ2'
    '#z6MkrJVnaZkeFzdQyMZu1cgjg7k1pZZ6pvBQ7XJPt4swbTQ2"}'
)

# Example 35: Hash of Canonical Proof Options Document (hex).
PROOF_CONFIG_HASH = "66ab154f5c2890a140cb8388a22a160454f80575f6eae09e5a097cabe539a1db"

# Example 36: Combine hashes of Proof Options and Credential (hex): proof options hash first.
COMBINED_HASH = (
    "66ab154f5c2890a140cb8388a22a160454f80575f6eae09e5a097cabe539a1db"
    "59b7cb6251b8991add1ce0bc83107e3db9dbbab5bd2c28f687db1a03abc92f19"
)

# Example 37: Signature of Combined Hashes (hex).
SIGNATURE_HEX = (
    "407cd12654b33d718ecbb99179a1506daaa849450bf3fc523cce3e1c96f8b803"
    "51da3f253d725c6f00b07c9e5448d50b3ef78012b9ab54255116d069c6dd2808"
)

# Example 38: Signature of Combined Hashes base58-btc.
PROOF_VALUE = (
    "z2HnFSSPPBzR36zdDgK8PbEHeXbR56YF24jwMpt3R1eHXQzJDMWS93FCzpvJpwTWd3GAVFuUfjoJdcnTMuVor51aX"
)

# Example 39: Signed Credential.
SIGNED: dict[str, Any] = {
    "@context": [VC_V2_CONTEXT, EXAMPLES_CONTEXT],
    "id": "urn:uuid:58172aac-d8ba-11ed-83dd-0b3aef56cc33",
    "type": ["VerifiableCredential", "AlumniCredential"],
    "name": "Alumni Credential",
    "description": "A minimum viable example of an Alumni Credential.",
    "issuer": "https://vc.example/issuers/5678",
    "validFrom": "2023-01-01T00:00:00Z",
    "credentialSubject": {"id": "did:example:abcdefgh", "alumniOf": "The School of Examples"},
    "proof": {
        "type": "DataIntegrityProof",
        "cryptosuite": "eddsa-jcs-2022",
        "created": "2023-02-24T23:36:38Z",
        "verificationMethod": VERIFICATION_METHOD,
        "proofPurpose": "assertionMethod",
        "@context": [VC_V2_CONTEXT, EXAMPLES_CONTEXT],
        "proofValue": PROOF_VALUE,
    },
}

# Multicodec varint prefixes (multiformats table): ed25519-priv 0x1300, ed25519-pub 0xed.
ED25519_PRIV_PREFIX = b"\x80\x26"
ED25519_PUB_PREFIX = b"\xed\x01"


def vector_key() -> SigningKey:
    """The signing key of secretKeyMultibase: 'z' + base58btc(varint 0x1300 ‖ 32-byte seed)."""
    assert SECRET_KEY_MULTIBASE.startswith("z")
    raw = b58decode(SECRET_KEY_MULTIBASE[1:])
    assert raw[:2] == ED25519_PRIV_PREFIX
    assert len(raw) == 34
    return SigningKey(raw[2:])


OTHER_KEY = SigningKey(bytes(range(32)))


def signed() -> dict[str, Any]:
    return copy.deepcopy(SIGNED)


def reissued() -> dict[str, Any]:
    """The vector's credential with issuer = the vector key's DID, signed like the vector."""
    document = {**copy.deepcopy(UNSIGNED), "issuer": VECTOR_DID}
    return add_proof(
        document, vector_key(), verification_method=VERIFICATION_METHOD, created=CREATED
    )


def refused(credential: Any, *, credential_level: bool = False, **kw: Any) -> Invalid:
    """The `Invalid` that verify_proof (or verify_credential) raises for `credential`."""
    try:
        if credential_level:
            verify_credential(credential, **kw)
        else:
            verify_proof(credential)
    except Invalid as exc:
        return exc
    pytest.fail("verification succeeded")


# --- the vectors -------------------------------------------------------------------------------


def test_secret_key_yields_the_vector_public_key() -> None:
    key = vector_key()
    assert "z" + b58encode(ED25519_PUB_PREFIX + key.public_key) == PUBLIC_KEY_MULTIBASE
    assert key.did == VECTOR_DID
    assert key.key_id == VERIFICATION_METHOD


def test_signed_vector_is_the_unsigned_vector_plus_proof() -> None:
    assert {k: v for k, v in SIGNED.items() if k != "proof"} == UNSIGNED
    assert {k: v for k, v in SIGNED["proof"].items() if k != "proofValue"} == PROOF_OPTIONS


def test_canonical_document_matches_vector() -> None:
    assert transform_document(UNSIGNED) == CANONICAL_DOCUMENT.encode()


def test_canonical_proof_config_matches_vector() -> None:
    assert proof_configuration(PROOF_OPTIONS) == CANONICAL_PROOF_CONFIG.encode()


def test_hashes_match_vector() -> None:
    document = transform_document(UNSIGNED)
    config = proof_configuration(PROOF_OPTIONS)
    assert hashlib.sha256(document).hexdigest() == DOCUMENT_HASH
    assert hashlib.sha256(config).hexdigest() == PROOF_CONFIG_HASH
    assert hash_data(config, document).hex() == COMBINED_HASH
    assert hash_data(document, config).hex() != COMBINED_HASH  # the order matters


def test_signature_reproduces_vector() -> None:
    signature = vector_key().sign(bytes.fromhex(COMBINED_HASH))
    assert signature.hex() == SIGNATURE_HEX
    assert "z" + b58encode(signature) == PROOF_VALUE


def test_add_proof_reproduces_signed_vector() -> None:
    unsigned = copy.deepcopy(UNSIGNED)
    result = add_proof(
        unsigned, vector_key(), verification_method=VERIFICATION_METHOD, created=CREATED
    )
    assert result == SIGNED
    assert list(result["proof"]) == list(SIGNED["proof"])  # member order as in Example 39
    assert unsigned == UNSIGNED  # the input is not modified


def test_verify_proof_accepts_signed_vector() -> None:
    original = signed()
    proof = verify_proof(original)
    assert proof.verification_method == VERIFICATION_METHOD
    assert proof.public_key == vector_key().public_key
    assert proof.proof_purpose == "assertionMethod"
    assert proof.created == datetime(2023, 2, 24, 23, 36, 38, tzinfo=UTC)
    assert proof.unsecured_document == UNSIGNED
    assert original == SIGNED  # the input is not modified


def test_verify_credential_refuses_vector_because_issuer_is_not_the_key_controller() -> None:
    # The signature verifies (above); the credential-level binding is what fails.
    error = refused(signed(), credential_level=True)
    assert error.code == "proof_invalid"
    assert error.details["reason"] == "issuer_not_controller"


def test_reissued_vector_verifies_as_credential() -> None:
    result = verify_credential(reissued())
    assert result == VerifiedCredential(
        issuer_did=VECTOR_DID,
        subject_id="did:example:abcdefgh",
        valid_from=datetime(2023, 1, 1, tzinfo=UTC),
        valid_until=None,
        proof_created=datetime(2023, 2, 24, 23, 36, 38, tzinfo=UTC),
        verification_method=VERIFICATION_METHOD,
    )


# --- tampering -----------------------------------------------------------------------------------


def _leaf_paths(value: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaf_paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaf_paths(item, (*path, index))
    else:
        yield path


def _altered(text: str) -> str:
    """A different value of the same kind: a date-time one second later, else one more char."""
    try:
        return format_datetime(parse_rfc3339(text) + timedelta(seconds=1))
    except ValueError:
        return text + "x"


def _expected_reason(path: tuple[str | int, ...]) -> str:
    if path[0] == "@context" or path[:2] == ("proof", "@context"):
        return "context_mismatch"
    if path[0] != "proof":
        return "signature_mismatch"
    return {
        "type": "wrong_type",
        "cryptosuite": "wrong_cryptosuite",
        "created": "signature_mismatch",
        "verificationMethod": "unsupported_verification_method",
        "proofPurpose": "wrong_proof_purpose",
        "proofValue": "bad_proof_value",
    }[str(path[1])]


def _with(document: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    result = copy.deepcopy(document)
    target: Any = result
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return result


LEAVES = list(_leaf_paths(SIGNED))


def test_every_field_of_the_vector_is_covered() -> None:
    assert len(LEAVES) == 19
    assert {p[0] for p in LEAVES} == set(SIGNED)
    assert {p[1] for p in LEAVES if p[0] == "proof"} == set(SIGNED["proof"])


def _get(document: dict[str, Any], path: tuple[str | int, ...]) -> Any:
    value: Any = document
    for step in path:
        value = value[step]
    return value


@pytest.mark.parametrize("path", LEAVES, ids=lambda p: ".".join(map(str, p)))
def test_altering_any_field_of_the_vector_fails(path: tuple[str | int, ...]) -> None:
    original = signed()
    tampered = _with(original, path, _altered(_get(original, path)))
    error = refused(tampered)
    assert error.code == "proof_invalid"
    assert error.details["reason"] == _expected_reason(path)


@pytest.mark.parametrize("path", LEAVES, ids=lambda p: ".".join(map(str, p)))
def test_altering_any_field_of_a_did_key_credential_fails(path: tuple[str | int, ...]) -> None:
    original = reissued()
    tampered = _with(original, path, _altered(_get(original, path)))
    error = refused(tampered, credential_level=True)
    assert error.code == "proof_invalid"
    assert error.details["reason"] == _expected_reason(path)


REMOVAL_REASONS = {
    "@context": "context_mismatch",  # the proof's @context no longer prefixes the document's
    "id": "signature_mismatch",
    "type": "signature_mismatch",
    "name": "signature_mismatch",
    "description": "signature_mismatch",
    "issuer": "signature_mismatch",
    "validFrom": "signature_mismatch",
    "credentialSubject": "signature_mismatch",
    "proof.type": "wrong_type",
    "proof.cryptosuite": "wrong_cryptosuite",
    "proof.created": "signature_mismatch",
    "proof.verificationMethod": "bad_verification_method",
    "proof.proofPurpose": "wrong_proof_purpose",
    "proof.@context": "signature_mismatch",
    "proof.proofValue": "bad_proof_value",
}


@pytest.mark.parametrize("field", sorted(REMOVAL_REASONS))
@pytest.mark.parametrize("credential_level", [False, True], ids=["proof", "credential"])
def test_removing_any_field_fails(field: str, credential_level: bool) -> None:
    document = reissued() if credential_level else signed()
    if field.startswith("proof."):
        del document["proof"][field.removeprefix("proof.")]
    else:
        del document[field]
    error = refused(document, credential_level=credential_level)
    assert error.code == "proof_invalid"
    assert error.details["reason"] == REMOVAL_REASONS[field]


@pytest.mark.parametrize("where", ["credential", "proof", "credentialSubject"])
def test_adding_a_field_fails(where: str) -> None:
    document = signed()
    target = document if where == "credential" else document[where]
    target["extra"] = "x"
    assert refused(document).details["reason"] == "signature_mismatch"


def test_removing_the_proof_is_a_shape_error() -> None:
    document = signed()
    del document["proof"]
    error = refused(document)
    assert (error.code, error.details["field"]) == ("credential_invalid", "proof")


def test_every_flipped_bit_of_the_proof_value_fails() -> None:
    signature = b58decode(PROOF_VALUE[1:])
    assert len(signature) == 64
    for bit in range(64 * 8):
        flipped = bytearray(signature)
        flipped[bit // 8] ^= 1 << (bit % 8)
        document = signed()
        document["proof"]["proofValue"] = "z" + b58encode(bytes(flipped))
        error = refused(document)
        assert (error.code, error.details["reason"]) == ("proof_invalid", "signature_mismatch")


@pytest.mark.parametrize(
    "proof_value",
    ["", "z", "u" + "A" * 86, PROOF_VALUE[1:], PROOF_VALUE + "1", PROOF_VALUE[:-2], "z0OIl", 7],
)
def test_malformed_proof_value_fails(proof_value: Any) -> None:
    document = signed()
    document["proof"]["proofValue"] = proof_value
    error = refused(document)
    assert (error.code, error.details["reason"]) == ("proof_invalid", "bad_proof_value")


@pytest.mark.parametrize("credential_level", [False, True], ids=["proof", "credential"])
def test_verification_method_of_another_key_fails(credential_level: bool) -> None:
    document = reissued()
    document["proof"]["verificationMethod"] = OTHER_KEY.key_id
    if credential_level:  # so that the issuer check would pass: only the signature fails
        document["issuer"] = OTHER_KEY.did
    error = refused(document, credential_level=credential_level)
    assert (error.code, error.details["reason"]) == ("proof_invalid", "signature_mismatch")


@pytest.mark.parametrize(
    "method",
    [
        "https://vc.example/issuers/5678#" + PUBLIC_KEY_MULTIBASE,  # an older draft's vector
        VECTOR_DID,  # no fragment
        f"{VECTOR_DID}#key-1",
        f"{OTHER_KEY.did}#{PUBLIC_KEY_MULTIBASE}",
        "did:key:zDnaerDaTF5BXEavCrfRZEk316dpbLsfPDZ3WJ5hRTPFU2169#zDnaerDaTF5BXEavCrfRZEk316dpbLsfP",
        "",
        ["did:key:" + PUBLIC_KEY_MULTIBASE],
    ],
)
def test_verification_method_must_be_an_ed25519_did_key_id(method: Any) -> None:
    document = signed()
    document["proof"]["verificationMethod"] = method
    error = refused(document)
    assert error.code == "proof_invalid"
    assert error.details["field"] == "proof.verificationMethod"


@pytest.mark.parametrize("issuer_form", ["string", "object"])
def test_issuer_not_the_controller_fails(issuer_form: str) -> None:
    key = vector_key()
    issuer: Any = OTHER_KEY.did if issuer_form == "string" else {"id": OTHER_KEY.did, "name": "O"}
    document = {**copy.deepcopy(UNSIGNED), "issuer": issuer}
    secured = add_proof(document, key, verification_method=key.key_id, created=CREATED)
    verify_proof(secured)  # a good signature, by the wrong party
    error = refused(secured, credential_level=True)
    assert (error.code, error.details["reason"]) == ("proof_invalid", "issuer_not_controller")


def test_issuer_object_with_the_controller_id_verifies() -> None:
    key = vector_key()
    document = {**copy.deepcopy(UNSIGNED), "issuer": {"id": key.did, "name": "Example U"}}
    secured = add_proof(document, key, verification_method=key.key_id, created=CREATED)
    assert verify_credential(secured).issuer_did == key.did


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("cryptosuite", "eddsa-rdfc-2022", "wrong_cryptosuite"),
        ("cryptosuite", "ecdsa-jcs-2019", "wrong_cryptosuite"),
        ("type", "Ed25519Signature2020", "wrong_type"),
        ("type", ["DataIntegrityProof"], "wrong_type"),
        ("proofPurpose", "authentication", "wrong_proof_purpose"),
        ("created", "2023-02-24T23:36:38", "bad_created"),  # no time zone
        ("created", "2023-02-30T23:36:38Z", "bad_created"),
        ("created", "2023-02-24 23:36:38Z", "bad_created"),
        ("created", 1677281798, "bad_created"),
    ],
)
def test_wrong_proof_options_fail(field: str, value: Any, reason: str) -> None:
    document = signed()
    document["proof"][field] = value
    error = refused(document)
    assert (error.code, error.details["reason"]) == ("proof_invalid", reason)
    assert error.details["field"] == f"proof.{field}"


@pytest.mark.parametrize(
    "proof_context",
    [
        [EXAMPLES_CONTEXT, VC_V2_CONTEXT],  # same values, another order
        [VC_V2_CONTEXT, EXAMPLES_CONTEXT, "https://example.org/more"],  # longer than the document's
        [EXAMPLES_CONTEXT],
        "https://example.org/other",
    ],
)
def test_proof_context_must_prefix_document_context(proof_context: Any) -> None:
    document = signed()
    document["proof"]["@context"] = proof_context
    error = refused(document)
    assert (error.code, error.details["reason"]) == ("proof_invalid", "context_mismatch")


def test_document_context_may_extend_the_signed_context() -> None:
    # Verify Proof §3.3.2 step 4: only the proof's @context must prefix the document's, and the
    # unsecured document is then verified with the proof's @context, so appended entries pass.
    document = reissued()
    document["@context"] = [*CONTEXT, "https://example.org/appended"]
    assert verify_proof(document).unsecured_document["@context"] == CONTEXT
    assert verify_credential(document).issuer_did == VECTOR_DID


def test_proof_without_context_verifies_over_the_document_as_is() -> None:
    key = vector_key()
    document = {**copy.deepcopy(UNSIGNED), "issuer": key.did}
    options = {k: v for k, v in PROOF_OPTIONS.items() if k != "@context"}
    signature = key.sign(hash_data(proof_configuration(options), transform_document(document)))
    secured = {**document, "proof": {**options, "proofValue": "z" + b58encode(signature)}}
    assert verify_credential(secured).subject_id == "did:example:abcdefgh"


def test_verification_does_not_modify_the_input() -> None:
    document = reissued()
    document["@context"] = [*CONTEXT, "https://example.org/appended"]
    before = copy.deepcopy(document)
    verify_credential(document)
    assert document == before


# --- credential shape --------------------------------------------------------------------------


def _signed_credential(**changes: Any) -> dict[str, Any]:
    """The reissued vector credential with `changes` (None deletes), validly signed."""
    key = vector_key()
    document = {**copy.deepcopy(UNSIGNED), "issuer": key.did}
    for field, value in changes.items():
        if value is None:
            document.pop(field, None)
        else:
            document[field] = value
    return add_proof(document, key, verification_method=key.key_id, created=CREATED)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (
            {"credentialSubject": [{"id": "did:example:a"}, {"id": "did:example:b"}]},
            "credentialSubject",
        ),
        ({"credentialSubject": "did:example:a"}, "credentialSubject"),
        ({"credentialSubject": {"alumniOf": "The School of Examples"}}, "credentialSubject.id"),
        ({"credentialSubject": {"id": ""}}, "credentialSubject.id"),
        ({"credentialSubject": {"id": 5}}, "credentialSubject.id"),
        ({"credentialSubject": None}, "credentialSubject"),
        ({"issuer": None}, "issuer"),
        ({"issuer": {"name": "no id"}}, "issuer.id"),
        ({"issuer": 5}, "issuer"),
        ({"type": ["AlumniCredential"]}, "type"),
        ({"type": None}, "type"),
        ({"@context": [EXAMPLES_CONTEXT, VC_V2_CONTEXT]}, "@context"),
        ({"@context": VC_V2_CONTEXT}, "@context"),
        ({"validFrom": "2023-01-01"}, "validFrom"),
        ({"validFrom": "2023-01-01T00:00:00"}, "validFrom"),
        ({"validFrom": "2023-13-01T00:00:00Z"}, "validFrom"),
        ({"validFrom": 1672531200}, "validFrom"),
        ({"validUntil": "2022-12-31T23:59:59Z"}, "validUntil"),  # before validFrom
        ({"issuanceDate": "2023-01-01T00:00:00Z"}, "issuanceDate"),  # VC 1.1 term in VC 2.0
    ],
)
def test_malformed_credentials_are_refused(changes: dict[str, Any], field: str) -> None:
    credential = _signed_credential(**changes)
    verify_proof(credential)  # validly signed: the shape is what is wrong
    error = refused(credential, credential_level=True)
    assert error.code == "credential_invalid"
    assert error.details["field"] == field


def test_subject_list_error_is_explicit() -> None:
    credential = _signed_credential(credentialSubject=[{"id": "did:example:a"}])
    error = refused(credential, credential_level=True)
    assert "single object" in error.message


@pytest.mark.parametrize(
    ("credential", "field"),
    [
        (None, ""),
        ([SIGNED], ""),
        ({**SIGNED, "proof": [SIGNED["proof"]]}, "proof"),
        ({**SIGNED, "proof": "z123"}, "proof"),
    ],
)
def test_documents_that_are_not_one_credential_with_one_proof(credential: Any, field: str) -> None:
    error = refused(credential)
    assert (error.code, error.details["field"]) == ("credential_invalid", field)


def test_non_json_values_are_refused() -> None:
    document = signed()
    document["credentialSubject"]["degrees"] = {"BSc", "MSc"}
    error = refused(document)
    assert error.code == "credential_invalid"
    assert error.details["field"] == "credentialSubject.degrees"


# --- issuing -----------------------------------------------------------------------------------

T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


def test_issue_credential_round_trip() -> None:
    key = SigningKey.generate()
    credential = issue_credential(
        key,
        subject_id="did:example:subject",
        claims={"name": "Ada", "score": 3, "tags": ["a", "b"]},
        valid_from=T0,
        valid_until=T0 + timedelta(days=30),
        created=T0,
        credential_id="urn:uuid:0c2e8f4e-6b3a-4d0e-9a4f-2f0a3c1d9e77",
    )
    assert credential == {
        "@context": [VC_V2_CONTEXT],
        "id": "urn:uuid:0c2e8f4e-6b3a-4d0e-9a4f-2f0a3c1d9e77",
        "type": ["VerifiableCredential"],
        "issuer": key.did,
        "validFrom": "2024-05-01T12:00:00Z",
        "validUntil": "2024-05-31T12:00:00Z",
        "credentialSubject": {
            "id": "did:example:subject",
            "name": "Ada",
            "score": 3,
            "tags": ["a", "b"],
        },
        "proof": {
            "type": "DataIntegrityProof",
            "cryptosuite": "eddsa-jcs-2022",
            "created": "2024-05-01T12:00:00Z",
            "verificationMethod": key.key_id,
            "proofPurpose": "assertionMethod",
            "@context": [VC_V2_CONTEXT],
            "proofValue": credential["proof"]["proofValue"],
        },
    }
    assert verify_credential(credential, now=T0 + timedelta(days=1)) == VerifiedCredential(
        issuer_did=key.did,
        subject_id="did:example:subject",
        valid_from=T0,
        valid_until=T0 + timedelta(days=30),
        proof_created=T0,
        verification_method=key.key_id,
    )


def test_issue_credential_minimal() -> None:
    key = SigningKey.generate()
    credential = issue_credential(key, subject_id="did:example:s")
    result = verify_credential(credential)
    assert (result.valid_from, result.valid_until) == (None, None)
    assert result.proof_created is not None
    assert set(credential) == {"@context", "type", "issuer", "credentialSubject", "proof"}


def test_issue_credential_is_deterministic_for_fixed_inputs() -> None:
    key = vector_key()
    first = issue_credential(key, subject_id="did:example:s", created=T0)
    second = issue_credential(key, subject_id="did:example:s", created=T0)
    assert first == second


def test_issue_credential_formats_other_time_zones_as_utc() -> None:
    plus_two = timezone(timedelta(hours=2))
    credential = issue_credential(
        vector_key(),
        subject_id="did:example:s",
        valid_from=datetime(2024, 5, 1, 14, 0, 0, 250000, tzinfo=plus_two),
        created=T0,
    )
    assert credential["validFrom"] == "2024-05-01T12:00:00.25Z"
    assert verify_credential(credential).valid_from == T0 + timedelta(milliseconds=250)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"subject_id": ""}, "credentialSubject.id"),
        (
            {"subject_id": "did:example:s", "claims": {"id": "did:example:t"}},
            "credentialSubject.id",
        ),
        (
            {
                "subject_id": "did:example:s",
                "valid_from": T0,
                "valid_until": T0 - timedelta(seconds=1),
            },
            "validUntil",
        ),
        ({"subject_id": "did:example:s", "claims": {"when": T0}}, "credentialSubject.when"),
    ],
)
def test_issue_credential_refuses_bad_input(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(Invalid) as info:
        issue_credential(vector_key(), created=T0, **kwargs)
    assert (info.value.code, info.value.details["field"]) == ("credential_invalid", field)


def test_issue_credential_refuses_naive_datetimes() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        issue_credential(vector_key(), subject_id="did:example:s", created=datetime(2024, 1, 1))


def test_add_proof_refuses_a_second_proof() -> None:
    with pytest.raises(Invalid) as info:
        add_proof(signed(), vector_key(), verification_method=VERIFICATION_METHOD, created=CREATED)
    assert info.value.details["field"] == "proof"


@pytest.mark.parametrize(
    "method",
    [OTHER_KEY.key_id, VECTOR_DID, "https://vc.example/issuers/5678#" + PUBLIC_KEY_MULTIBASE],
)
def test_add_proof_refuses_a_verification_method_that_is_not_the_key(method: str) -> None:
    with pytest.raises(ValueError, match="signing key"):
        add_proof(UNSIGNED, vector_key(), verification_method=method, created=CREATED)


def test_add_proof_refuses_invalid_created() -> None:
    with pytest.raises(Invalid) as info:
        add_proof(
            UNSIGNED, vector_key(), verification_method=VERIFICATION_METHOD, created="yesterday"
        )
    assert info.value.details["field"] == "proof.created"


# --- validity period ---------------------------------------------------------------------------


def _window_credential() -> dict[str, Any]:
    return issue_credential(
        vector_key(),
        subject_id="did:example:s",
        valid_from=T0,
        valid_until=T0 + timedelta(hours=1),
        created=T0,
    )


@pytest.mark.parametrize(
    ("offset", "code"),
    [
        (timedelta(seconds=-1), "credential_not_yet_valid"),
        (timedelta(days=-400), "credential_not_yet_valid"),
        (timedelta(0), None),  # valid from its first instant
        (timedelta(minutes=59, seconds=59, microseconds=999999), None),
        (timedelta(hours=1), "credential_expired"),  # validUntil is when it ceases to be valid
        (timedelta(days=400), "credential_expired"),
    ],
)
def test_validity_window(offset: timedelta, code: str | None) -> None:
    credential = _window_credential()
    now = T0 + offset
    if code is None:
        assert verify_credential(credential, now=now).subject_id == "did:example:s"
    else:
        error = refused(credential, credential_level=True, now=now)
        assert error.code == code
        assert error.details["now"] == format_datetime(now)


def test_validity_window_details_name_the_field() -> None:
    credential = _window_credential()
    early = refused(credential, credential_level=True, now=T0 - timedelta(seconds=1))
    assert early.details["validFrom"] == "2024-05-01T12:00:00Z"
    late = refused(credential, credential_level=True, now=T0 + timedelta(hours=2))
    assert late.details["validUntil"] == "2024-05-01T13:00:00Z"


def test_validity_window_compares_instants_across_time_zones() -> None:
    credential = _window_credential()
    tokyo = timezone(timedelta(hours=9))
    assert verify_credential(credential, now=datetime(2024, 5, 1, 21, 30, tzinfo=tokyo))
    error = refused(
        credential, credential_level=True, now=datetime(2024, 5, 1, 22, 0, tzinfo=tokyo)
    )
    assert error.code == "credential_expired"


def test_without_now_the_window_is_not_checked() -> None:
    assert verify_credential(_window_credential()).valid_until == T0 + timedelta(hours=1)


def test_now_must_be_timezone_aware() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        verify_credential(_window_credential(), now=datetime(2024, 5, 1, 12, 30))


def _v1_credential(**dates: str) -> dict[str, Any]:
    key = vector_key()
    document = {
        "@context": [VC_V1_CONTEXT, "https://www.w3.org/2018/credentials/examples/v1"],
        "type": ["VerifiableCredential"],
        "issuer": key.did,
        **dates,
        "credentialSubject": {"id": "did:example:s"},
    }
    return add_proof(document, key, verification_method=key.key_id, created=CREATED)


def test_vc_1_1_issuance_and_expiration_dates() -> None:
    credential = _v1_credential(
        issuanceDate="2024-05-01T12:00:00Z", expirationDate="2024-05-01T13:00:00Z"
    )
    result = verify_credential(credential, now=T0)
    assert (result.valid_from, result.valid_until) == (T0, T0 + timedelta(hours=1))
    early = refused(credential, credential_level=True, now=T0 - timedelta(seconds=1))
    assert (early.code, early.details["issuanceDate"]) == (
        "credential_not_yet_valid",
        "2024-05-01T12:00:00Z",
    )
    late = refused(credential, credential_level=True, now=T0 + timedelta(hours=1))
    assert (late.code, late.details["expirationDate"]) == (
        "credential_expired",
        "2024-05-01T13:00:00Z",
    )


@pytest.mark.parametrize(
    ("dates", "field"),
    [
        ({}, "issuanceDate"),  # required by VC 1.1
        ({"issuanceDate": "2024-05-01"}, "issuanceDate"),
        ({"issuanceDate": "2024-05-01T12:00:00Z", "expirationDate": "soon"}, "expirationDate"),
        (
            {"issuanceDate": "2024-05-01T12:00:00Z", "validUntil": "2025-05-01T12:00:00Z"},
            "validUntil",
        ),
    ],
)
def test_vc_1_1_malformed_dates(dates: dict[str, str], field: str) -> None:
    error = refused(_v1_credential(**dates), credential_level=True)
    assert (error.code, error.details["field"]) == ("credential_invalid", field)


# --- date-time grammars ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2024-05-01T12:00:00Z", T0),
        ("2024-05-01t12:00:00z", T0),
        ("2024-05-01T14:00:00+02:00", T0),
        ("2024-05-01T07:30:00-04:30", T0),
        ("2024-05-01T12:00:00-00:00", T0),
        ("2024-05-01T12:00:00.5Z", T0 + timedelta(milliseconds=500)),
        ("2024-05-01T12:00:00.1234567Z", T0 + timedelta(microseconds=123456)),
        ("2016-12-31T23:59:60Z", datetime(2017, 1, 1, tzinfo=UTC)),  # leap second
    ],
)
def test_rfc3339_accepts(text: str, expected: datetime) -> None:
    assert parse_rfc3339(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "2024-05-01",
        "2024-05-01T12:00:00",
        "2024-05-01 12:00:00Z",
        "2024-05-01T12:00Z",
        "2024-05-01T24:00:00Z",
        "2024-02-30T12:00:00Z",
        "2024-05-01T12:00:61Z",
        "2024-05-01T12:00:00+24:00",
        "2024-05-01T12:00:00+0200",
        "+2024-05-01T12:00:00Z",
        "2024-05-01T12:00:00.Z",
        " 2024-05-01T12:00:00Z",
        "9999-12-31T23:59:59-01:00",  # the year 10000 in UTC
        "9999-12-31T23:59:60Z",
        "0001-01-01T00:00:00+01:00",  # the year 0 in UTC
    ],
)
def test_rfc3339_refuses(text: str) -> None:
    with pytest.raises(ValueError, match=r"RFC 3339|range|must be in"):
        parse_rfc3339(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (CREATED, datetime(2023, 2, 24, 23, 36, 38, tzinfo=UTC)),
        ("2024-05-01T14:00:00+02:00", T0),
        ("2024-04-30T24:00:00Z", datetime(2024, 5, 1, tzinfo=UTC)),  # XSD end of day
        ("2024-05-01T12:00:00.000Z", T0),
        ("2024-05-01T12:00:00+14:00", datetime(2024, 4, 30, 22, tzinfo=UTC)),
    ],
)
def test_xsd_datetime_stamp_accepts(text: str, expected: datetime) -> None:
    assert parse_xsd_datetime_stamp(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "2024-05-01T12:00:00",  # dateTime without a time zone is not a dateTimeStamp
        "2024-05-01t12:00:00z",
        "2024-05-01T12:00:60Z",
        "2024-05-01T24:00:01Z",
        "2024-05-01T12:00:00+14:01",
        "2024-02-30T12:00:00Z",
        "-2024-05-01T12:00:00Z",
        "12024-05-01T12:00:00Z",
        "9999-12-31T24:00:00Z",
    ],
)
def test_xsd_datetime_stamp_refuses(text: str) -> None:
    with pytest.raises(ValueError, match=r"dateTimeStamp|range|year|must be in"):
        parse_xsd_datetime_stamp(text)
