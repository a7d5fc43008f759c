"""DIDs: W3C DID Core syntax for entry DIDs, and did:key (Ed25519) for every principal.

A did:key Ed25519 DID is `did:key:z` + base58btc(0xed 0x01 ‖ 32-byte public key); its key id is
`<did>#<the same z… string>`, and the controller of a key id is the part before `#`.
"""

from __future__ import annotations

import functools
import re

B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(B58_ALPHABET)}
ED25519_MULTICODEC = b"\xed\x01"

# DID Core §3.1: did:method-name:method-specific-id, with pct-encoding; 2 KiB is our bound (a
# new local entry's DID is held to less: registry/usecases/entries.py MAX_NEW_ENTRY_DID_LENGTH).
# One name, one spelling (RFC 3986 §6.2.2 normal form): a percent-encoding is accepted only for
# a byte a DID may not carry as itself (anything but A-Z a-z 0-9 - . _) and only in uppercase
# hex, so `did:example:a-b`, `did:example:a%2Db` and `did:example:a%2db` cannot be three
# entries: the last two are refused (docs/lifecycle.md, "One name, one entry"). `~`, unreserved
# in URIs but not a DID character, has one spelling: `%7E`.
_PCT = r"%(?:[01][0-9A-F]|2[0-9A-CF]|3[A-F]|40|5[B-E]|60|7[B-F]|[89A-F][0-9A-F])"
_IDCHAR = rf"(?:[A-Za-z0-9._-]|{_PCT})"
_DID_RE = re.compile(rf"did:[a-z0-9]+:(?:{_IDCHAR}*:)*{_IDCHAR}+")
MAX_DID_LENGTH = 2048


def b58encode(data: bytes) -> str:
    number = int.from_bytes(data, "big")
    out = []
    while number:
        number, rem = divmod(number, 58)
        out.append(B58_ALPHABET[rem])
    zeros = len(data) - len(data.lstrip(b"\0"))
    return "1" * zeros + "".join(reversed(out))


# The longest base58 text decoded: keys (34 bytes, 47 characters) and signatures (64 bytes, 88)
# are far shorter. Decoding is quadratic in the length (one big integer), and the text comes
# from clients (a credential's proofValue, a sign-in's public key).
B58_MAX_CHARS = 128


def b58decode(text: str) -> bytes:
    if len(text) > B58_MAX_CHARS:
        raise ValueError(f"base58 text longer than {B58_MAX_CHARS} characters")
    number = 0
    for char in text:
        try:
            number = number * 58 + _B58_INDEX[char]
        except KeyError:
            raise ValueError(f"invalid base58 character {char!r}") from None
    zeros = len(text) - len(text.lstrip("1"))
    body = number.to_bytes((number.bit_length() + 7) // 8, "big") if number else b""
    return b"\0" * zeros + body


def is_did(value: str) -> bool:
    return len(value) <= MAX_DID_LENGTH and _DID_RE.fullmatch(value) is not None


def did_key_from_public_key(public_key: bytes) -> str:
    if len(public_key) != 32:
        raise ValueError("an Ed25519 public key is 32 bytes")
    return "did:key:z" + b58encode(ED25519_MULTICODEC + public_key)


@functools.lru_cache(maxsize=4096)  # pure; a replica page repeats its publishers' keys
def public_key_from_did_key(did: str) -> bytes:
    """The raw Ed25519 key of a did:key DID; `ValueError` when it is not one."""
    if not did.startswith("did:key:z") or len(did) > 128:
        raise ValueError("not an Ed25519 did:key")
    raw = b58decode(did[len("did:key:z") :])
    if len(raw) != 34 or raw[:2] != ED25519_MULTICODEC:
        raise ValueError("not an Ed25519 did:key")
    return raw[2:]


def key_id_for(did: str) -> str:
    return f"{did}#{did[len('did:key:') :]}"


def controller_of(key_id: str) -> str:
    return key_id.split("#", 1)[0]


def public_key_from_key_id(key_id: str, *, bare: bool = False) -> bytes:
    """The key a key id names: `did:key:z…#z…`, the fragment the DID's own multibase key
    (design §3). A bare DID is not a key id, unless `bare` (what a peer serves: releases before
    2026-11-29 accepted such entries, and the DID names the same key)."""
    did, sep, fragment = key_id.partition("#")
    key = public_key_from_did_key(did)
    if (sep or not bare) and fragment != did[len("did:key:") :]:
        raise ValueError("a key id is did:key:z…#z…, its fragment the DID's own key")
    return key
