"""Ed25519 keys (RFC 8032 vectors), did:key identities, base58, base64url and key files."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from registry.did import (
    B58_MAX_CHARS,
    ED25519_MULTICODEC,
    MAX_DID_LENGTH,
    b58decode,
    b58encode,
    controller_of,
    did_key_from_public_key,
    is_did,
    key_id_for,
    public_key_from_did_key,
    public_key_from_key_id,
)
from registry.keys import (
    KeyFileError,
    SigningKey,
    b64url_decode,
    b64url_encode,
    load_or_create_key,
    read_key_file,
    verify,
    write_key_file,
)

# --- RFC 8032 §7.1 -----------------------------------------------------------------------------

# (secret key, public key, message, signature), hex, from RFC 8032 §7.1 TEST 1, 2 and 3; the
# did:key of each public key is the one published for these vectors by did:key implementations.
RFC_8032 = [
    pytest.param(
        "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
        "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a",
        "",
        "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b",
        "did:key:z6MktwupdmLXVVqTzCw4i46r4uGyosGXRnR3XjN4Zq7oMMsw",
        id="TEST-1",
    ),
    pytest.param(
        "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
        "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c",
        "72",
        "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00",
        "did:key:z6MkiaMbhXHNA4eJVCCj8dbzKzTgYDKf6crKgHVHid1F1WCT",
        id="TEST-2",
    ),
    pytest.param(
        "c5aa8df43f9f837bedb7442f31dcb7b166d38535076f094b85ce3a2e0b4458f7",
        "fc51cd8e6218a1a38da47ed00230f0580816ed13ba3303ac5deb911548908025",
        "af82",
        "6291d657deec24024827e69c3abe01a30ce548a284743a445e3680d7db5ac3ac18ff9b538d16f290ae67f760984dc6594a7c15e9716ed28dc027beceea1ec40a",
        "did:key:z6MkwSD8dBdqcXQzKJZQFPy2hh2izzxskndKCjdmC2dBpfME",
        id="TEST-3",
    ),
]


@pytest.mark.parametrize(("secret", "public", "message", "signature", "did"), RFC_8032)
def test_rfc_8032_public_key_and_signature(
    secret: str, public: str, message: str, signature: str, did: str
) -> None:
    key = SigningKey(bytes.fromhex(secret))
    assert key.public_key.hex() == public
    assert key.sign(bytes.fromhex(message)).hex() == signature
    assert verify(bytes.fromhex(public), bytes.fromhex(message), bytes.fromhex(signature))


@pytest.mark.parametrize(("secret", "public", "message", "signature", "did"), RFC_8032)
def test_rfc_8032_keys_have_their_published_did_key(
    secret: str, public: str, message: str, signature: str, did: str
) -> None:
    key = SigningKey(bytes.fromhex(secret))
    assert key.did == did
    assert key.did.startswith("did:key:z6Mk")  # multibase z + multicodec 0xed01
    assert did_key_from_public_key(bytes.fromhex(public)) == did
    assert public_key_from_did_key(did).hex() == public
    assert key.key_id == f"{did}#{did.removeprefix('did:key:')}"


def _flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


_TEST_3_PUBLIC = bytes.fromhex("fc51cd8e6218a1a38da47ed00230f0580816ed13ba3303ac5deb911548908025")
_TEST_3_SIGNATURE = bytes.fromhex(
    "6291d657deec24024827e69c3abe01a30ce548a284743a445e3680d7db5ac3ac"
    "18ff9b538d16f290ae67f760984dc6594a7c15e9716ed28dc027beceea1ec40a"
)
_TEST_3_MESSAGE = bytes.fromhex("af82")


@pytest.mark.parametrize("bit", [0, 7, 255, 256, 300, 511])
def test_verify_rejects_a_flipped_signature_bit(bit: int) -> None:
    assert not verify(_TEST_3_PUBLIC, _TEST_3_MESSAGE, _flip(_TEST_3_SIGNATURE, bit))


@pytest.mark.parametrize("bit", [0, 9, 15])
def test_verify_rejects_a_flipped_message_bit(bit: int) -> None:
    assert not verify(_TEST_3_PUBLIC, _flip(_TEST_3_MESSAGE, bit), _TEST_3_SIGNATURE)


@pytest.mark.parametrize("bit", [0, 100, 254])
def test_verify_rejects_a_flipped_public_key_bit(bit: int) -> None:
    assert not verify(_flip(_TEST_3_PUBLIC, bit), _TEST_3_MESSAGE, _TEST_3_SIGNATURE)


@pytest.mark.parametrize(
    ("public", "signature"),
    [
        (_TEST_3_PUBLIC[:31], _TEST_3_SIGNATURE),
        (_TEST_3_PUBLIC, _TEST_3_SIGNATURE[:63]),
        (_TEST_3_PUBLIC, _TEST_3_SIGNATURE + b"\0"),
        (b"", b""),
    ],
    ids=["short-key", "short-signature", "long-signature", "empty"],
)
def test_verify_answers_false_for_malformed_inputs_instead_of_raising(
    public: bytes, signature: bytes
) -> None:
    assert verify(public, _TEST_3_MESSAGE, signature) is False


@given(st.binary(min_size=32, max_size=32), st.binary(max_size=64))
def test_signatures_of_any_seed_verify_only_for_their_message(seed: bytes, message: bytes) -> None:
    key = SigningKey(seed)
    signature = key.sign(message)
    assert len(signature) == 64
    assert verify(key.public_key, message, signature)
    assert not verify(key.public_key, message + b"\0", signature)


# --- did:key ------------------------------------------------------------------------------------


def test_did_key_of_an_independent_published_base58_key() -> None:
    # A did:key document from another implementation: publicKeyBase58 and its DID.
    public = b58decode("8HH5gYEeNc3z7PYXmd54d4x6qAfCNrqQqEB3nS7Zfu7K")
    assert did_key_from_public_key(public) == (
        "did:key:z6MkmjY8GnV5i9YTDtPETC2uUAW6ejw3nk5mXF5yci5ab7th"
    )


@given(st.binary(min_size=32, max_size=32))
def test_did_key_round_trips_any_32_byte_key(public: bytes) -> None:
    did = did_key_from_public_key(public)
    assert did.startswith("did:key:z6Mk")
    assert is_did(did)
    assert public_key_from_did_key(did) == public
    assert b58decode(did.removeprefix("did:key:z"))[:2] == ED25519_MULTICODEC
    key_id = key_id_for(did)
    assert controller_of(key_id) == did
    assert public_key_from_key_id(key_id) == public


@pytest.mark.parametrize("length", [0, 31, 33, 64])
def test_did_key_requires_a_32_byte_key(length: int) -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        did_key_from_public_key(b"\1" * length)


@pytest.mark.parametrize(
    "did",
    [
        pytest.param("did:web:example.com", id="other-method"),
        pytest.param("did:key:", id="empty"),
        pytest.param("did:key:z", id="z-only"),
        pytest.param(
            "did:key:6MktwupdmLXVVqTzCw4i46r4uGyosGXRnR3XjN4Zq7oMMsw", id="no-multibase-prefix"
        ),
        pytest.param(
            "did:key:z6MktwupdmLXVVqTzCw4i46r4uGyosGXRnR3XjN4Zq7oMMs0", id="non-base58-char"
        ),
        pytest.param(
            "did:key:z6LShLeXRTzevtwcfehaGEzCMyL3bNsAeKCwcqwJxyCo63yE", id="x25519-multicodec"
        ),
        pytest.param("did:key:z" + b58encode(ED25519_MULTICODEC + b"\1" * 31), id="short-key"),
        pytest.param("did:key:z" + b58encode(ED25519_MULTICODEC + b"\1" * 33), id="long-key"),
        pytest.param("did:key:z" + b58encode(b"\xed\x02" + b"\1" * 32), id="wrong-codec-byte"),
        pytest.param("did:key:z" + "2" * 200, id="overlong"),
    ],
)
def test_public_key_from_did_key_rejects_non_ed25519_did_keys(did: str) -> None:
    with pytest.raises(ValueError, match=r"did:key|base58"):
        public_key_from_did_key(did)


def test_key_id_and_controller() -> None:
    did = "did:key:z6MktwupdmLXVVqTzCw4i46r4uGyosGXRnR3XjN4Zq7oMMsw"
    key_id = key_id_for(did)
    assert key_id == (
        "did:key:z6MktwupdmLXVVqTzCw4i46r4uGyosGXRnR3XjN4Zq7oMMsw"
        "#z6MktwupdmLXVVqTzCw4i46r4uGyosGXRnR3XjN4Zq7oMMsw"
    )
    assert controller_of(key_id) == did
    assert controller_of(did) == did  # no fragment: the DID controls itself
    assert controller_of("did:web:example.com#key-1") == "did:web:example.com"


def test_key_id_fragment_must_name_the_dids_own_key() -> None:
    first = "did:key:z6MktwupdmLXVVqTzCw4i46r4uGyosGXRnR3XjN4Zq7oMMsw"
    second = "did:key:z6MkiaMbhXHNA4eJVCCj8dbzKzTgYDKf6crKgHVHid1F1WCT"
    with pytest.raises(ValueError, match="fragment"):
        public_key_from_key_id(f"{first}#{second.removeprefix('did:key:')}")
    with pytest.raises(ValueError, match="fragment"):
        public_key_from_key_id(f"{first}#key-1")
    for bare in (first, f"{first}#"):  # a DID is not a key id (design §3: did:key:z…#z…)
        with pytest.raises(ValueError, match="fragment"):
            public_key_from_key_id(bare)
    # ... except in a peer's entries, published before the fragment was required.
    assert public_key_from_key_id(first, bare=True) == public_key_from_did_key(first)
    with pytest.raises(ValueError, match="fragment"):
        public_key_from_key_id(f"{first}#key-1", bare=True)


# --- DID Core syntax ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "did:web:example.com",
        "did:web:example.com%3A8443",
        "did:web:example.com:users:alice",
        "did:example:123456789abcdefghi",
        "did:ion:EiClkZMDxPKqC9c-umQfTkR8vvZ9JPhl_xLDI9Nfk38w5w",
        "did:key:z6MktwupdmLXVVqTzCw4i46r4uGyosGXRnR3XjN4Zq7oMMsw",
        "did:a1:b",
        "did:web::x",  # DID Core allows empty segments before the last
        "did:x:" + "a" * (MAX_DID_LENGTH - len("did:x:")),
    ],
)
def test_valid_did_syntax(value: str) -> None:
    assert is_did(value)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "did",
        "did:",
        "did:web",
        "did:web:",
        "did::example",
        "DID:web:example.com",
        "did:Web:example.com",
        "did:we-b:example.com",
        "did:web:example.com:",
        "did:web:exa mple.com",
        "did:web:example.com/path",
        "did:web:example.com?query",
        "did:web:example.com#fragment",
        "did:web:%zz",
        "did:web:%4",
        "did:web:ex\u00e4mple.com",
        "did:web:example.com\n",
        " did:web:example.com",
        "did:x:" + "a" * (MAX_DID_LENGTH + 1 - len("did:x:")),
    ],
)
def test_invalid_did_syntax(value: str) -> None:
    assert not is_did(value)


# --- base58btc ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b"", ""),
        (b"\0", "1"),
        (b"\0\0\0", "111"),
        (b"\1", "2"),
        (b"\x3a", "21"),
        (b"\0\x3a", "121"),
        (b"Hello World!", "2NEpo7TZRRrLZSi2U"),
        (
            b"The quick brown fox jumps over the lazy dog.",
            "USm3fpXnKG5EUBx2ndxBDMPVciP5hGey2Jh4NDv6gmeo1LkMeiKrLJUUBk6Z",
        ),
        (bytes.fromhex("0000287fb4cd"), "11233QC4"),
    ],
)
def test_base58_vectors_keep_leading_zero_bytes(raw: bytes, text: str) -> None:
    assert b58encode(raw) == text
    assert b58decode(text) == raw


@given(st.integers(min_value=0, max_value=8), st.binary(max_size=48))
def test_base58_round_trips_with_any_number_of_leading_zeros(zeros: int, tail: bytes) -> None:
    raw = b"\0" * zeros + tail
    text = b58encode(raw)
    assert b58decode(text) == raw
    assert len(text) - len(text.lstrip("1")) == len(raw) - len(raw.lstrip(b"\0"))


@pytest.mark.parametrize("text", ["0", "O", "I", "l", "abc+", "2NEpo7TZ RRrLZSi2U", "é"])
def test_base58_rejects_characters_outside_the_alphabet(text: str) -> None:
    with pytest.raises(ValueError, match="base58"):
        b58decode(text)


# --- base64url (no padding, canonical) ----------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b"", ""),
        (b"\0", "AA"),
        (b"\xfb\xff", "-_8"),
        (b"\xff\xff\xff", "____"),
        (b"hello", "aGVsbG8"),
    ],
)
def test_b64url_vectors(raw: bytes, text: str) -> None:
    assert b64url_encode(raw) == text
    assert b64url_decode(text) == raw


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("AA==", id="padding"),
        pytest.param("AA=", id="partial-padding"),
        pytest.param("+_8", id="standard-alphabet-plus"),
        pytest.param("-/8", id="standard-alphabet-slash"),
        pytest.param("AB", id="non-zero-trailing-bits"),
        pytest.param("aGVsbG9", id="non-zero-trailing-bits-longer"),
        pytest.param("A", id="impossible-length"),
        pytest.param("AAAAA", id="impossible-length-5"),
        pytest.param("aGVs bG8", id="inner-space"),
        pytest.param("aGVsbG8\n", id="trailing-newline"),
        pytest.param("aGVs!bG8", id="punctuation"),
        pytest.param("aGVsbG8é", id="non-ascii"),
    ],
)
def test_b64url_decode_is_strict(text: str) -> None:
    with pytest.raises(ValueError, match="base64url"):
        b64url_decode(text)


def test_b64url_decode_rejects_bytes_input() -> None:
    with pytest.raises(ValueError, match="base64url"):
        b64url_decode(b"AA")  # type: ignore[arg-type]


@given(st.binary(max_size=96))
def test_b64url_round_trips_without_padding(raw: bytes) -> None:
    text = b64url_encode(raw)
    assert not {"=", "+", "/"} & set(text)
    assert b64url_decode(text) == raw


# --- key files ----------------------------------------------------------------------------------

_SEED = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")


def test_key_file_is_written_with_mode_0600_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "registry.key"
    key = SigningKey(_SEED)
    write_key_file(path, key)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(path.read_text()) == {
        "type": "Ed25519",
        "did": "did:key:z6MktwupdmLXVVqTzCw4i46r4uGyosGXRnR3XjN4Zq7oMMsw",
        "seed": b64url_encode(_SEED),
    }
    assert read_key_file(path) == key


def test_key_file_mode_is_0600_even_under_a_permissive_umask(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        write_key_file(tmp_path / "k.key", SigningKey(_SEED))
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "k.key").st_mode) == 0o600


def test_write_key_file_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "registry.key"
    write_key_file(path, SigningKey(_SEED))
    before = path.read_bytes()
    with pytest.raises(FileExistsError):
        write_key_file(path, SigningKey(bytes(32)))
    assert path.read_bytes() == before


def _while_writing(monkeypatch: pytest.MonkeyPatch, act: Callable[[], None]) -> None:
    """Run `act` when a key file's text is first written, before the write."""
    real_fdopen = os.fdopen

    def fdopen(fd: int, *args: Any, **kwargs: Any) -> Any:
        handle = real_fdopen(fd, *args, **kwargs)
        write = handle.write

        def writing(text: str) -> int:
            monkeypatch.setattr(os, "fdopen", real_fdopen)
            act()
            return write(text)

        handle.write = writing  # type: ignore[method-assign]
        return handle

    monkeypatch.setattr(os, "fdopen", fdopen)


def test_a_key_file_that_could_not_be_written_is_not_left_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk (or a crash) while the key was written left an empty file under its name:
    `keygen` then refused it as existing, and the registry's start as malformed."""
    path = tmp_path / "registry.key"

    def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    _while_writing(monkeypatch, full)
    with pytest.raises(OSError, match="No space"):
        write_key_file(path, SigningKey(_SEED))
    assert list(tmp_path.iterdir()) == []
    write_key_file(path, SigningKey(_SEED))
    assert read_key_file(path) == SigningKey(_SEED)


def test_two_processes_creating_the_key_at_once_agree_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second of two `serve` starting on one `server.key_file` read the first's file while
    it was still empty and failed (`Expecting value`)."""
    path = tmp_path / "registry.key"
    second: list[tuple[SigningKey, bool]] = []
    _while_writing(monkeypatch, lambda: second.append(load_or_create_key(path)))
    first = load_or_create_key(path)
    assert [first[0]] == [k for k, _ in second] == [read_key_file(path)]
    assert sorted(created for _, created in [first, *second]) == [False, True]


def test_key_file_without_did_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "k.key"
    path.write_text(json.dumps({"type": "Ed25519", "seed": b64url_encode(_SEED)}))
    assert read_key_file(path).seed == _SEED


_GOOD_DID = "did:key:z6MktwupdmLXVVqTzCw4i46r4uGyosGXRnR3XjN4Zq7oMMsw"
_GOOD_SEED = b64url_encode(_SEED)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param("", id="empty"),
        pytest.param("not json", id="not-json"),
        pytest.param("[1, 2]", id="json-array"),
        pytest.param('"seed"', id="json-string"),
        pytest.param(json.dumps({"did": _GOOD_DID, "seed": _GOOD_SEED}), id="no-type"),
        pytest.param(
            json.dumps({"type": "X25519", "did": _GOOD_DID, "seed": _GOOD_SEED}), id="wrong-type"
        ),
        pytest.param(json.dumps({"type": "Ed25519", "did": _GOOD_DID}), id="no-seed"),
        pytest.param(
            json.dumps({"type": "Ed25519", "did": _GOOD_DID, "seed": _GOOD_SEED + "="}),
            id="padded-seed",
        ),
        pytest.param(
            json.dumps({"type": "Ed25519", "seed": b64url_encode(_SEED[:16])}), id="short-seed"
        ),
        pytest.param(
            json.dumps({"type": "Ed25519", "seed": b64url_encode(_SEED + b"\0")}), id="long-seed"
        ),
        pytest.param(json.dumps({"type": "Ed25519", "seed": 12345}), id="seed-not-string"),
        pytest.param(
            json.dumps(
                {
                    "type": "Ed25519",
                    "did": "did:key:z6MkiaMbhXHNA4eJVCCj8dbzKzTgYDKf6crKgHVHid1F1WCT",
                    "seed": _GOOD_SEED,
                }
            ),
            id="did-of-another-key",
        ),
    ],
)
def test_malformed_key_file_raises_key_file_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.key"
    path.write_text(content)
    with pytest.raises(KeyFileError, match=r"bad\.key"):
        read_key_file(path)


def test_missing_or_unreadable_key_file_raises_key_file_error(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError):
        read_key_file(tmp_path / "absent.key")
    with pytest.raises(KeyFileError):
        read_key_file(tmp_path)  # a directory
    binary = tmp_path / "binary.key"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(KeyFileError):
        read_key_file(binary)


def test_load_or_create_key_creates_once_then_reuses(tmp_path: Path) -> None:
    path = tmp_path / "data" / "registry.key"
    key, created = load_or_create_key(path)
    assert created
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again, created_again = load_or_create_key(path)
    assert (again, created_again) == (key, False)


def test_load_or_create_key_never_replaces_a_malformed_file(tmp_path: Path) -> None:
    path = tmp_path / "registry.key"
    path.write_text("corrupt")
    with pytest.raises(KeyFileError):
        load_or_create_key(path)
    assert path.read_text() == "corrupt"


def test_base58_longer_than_any_key_or_signature_is_refused_before_decoding() -> None:
    # Decoding is quadratic in the length; the texts come from clients (a proofValue).
    signature = b58encode(b"\xff" * 64)
    assert len(signature) <= B58_MAX_CHARS
    assert b58decode(signature) == b"\xff" * 64
    with pytest.raises(ValueError, match="longer than"):
        b58decode("2" * (B58_MAX_CHARS + 1))
