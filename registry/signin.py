"""Sign-in by challenge and signature (spec 4.6 and 5, design §5) — the pure part.

The client renders `message` from the challenge with `render_message` (documented, byte for byte,
in docs/signin.md), signs its UTF-8 bytes with Ed25519, and sends the challenge back with the
response. `check_response` verifies every field against the stored challenge; the caller burns
the nonce atomically when it opens the session.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

from registry import canonical
from registry.did import b58decode, b58encode, public_key_from_did_key
from registry.errors import Unauthorized
from registry.keys import SigningKey, b64url_decode, b64url_encode, verify
from registry.models import SignInResponse

CHALLENGE_TTL_MS = 5 * 60 * 1000
MESSAGE_TEMPLATE = (
    "{origin} wants you to sign in to registry {hmrDid}\n"
    "Signer: {signerDid}\n"
    "Audience: {audience}\n"
    "Chain ID: {chainId}\n"
    "Nonce: {nonce}\n"
    "Request ID: {requestId}\n"
    "Issued At (ms): {issuedAtMs}\n"
    "Expires At (ms): {expiresAtMs}\n"
    "Root: {rootDid}\n"
    "Version: {version}"
)


def new_challenge(
    *, audience: str, origin: str, chain_id: str, registry_did: str, root_did: str, now_ms: int
) -> dict[str, Any]:
    return {
        "version": 1,
        "kind": "siws",
        "audience": audience,
        "origin": origin,
        "chainId": chain_id,
        "nonce": secrets.token_hex(16),
        "requestId": secrets.token_hex(8),
        "issuedAtMs": now_ms,
        "expiresAtMs": now_ms + CHALLENGE_TTL_MS,
        "hmrDid": registry_did,
        "rootDid": root_did,
    }


def render_message(challenge: dict[str, Any], signer_did: str) -> str:
    fields = {k: challenge.get(k, "") for k in challenge}
    return MESSAGE_TEMPLATE.format(signerDid=signer_did, **{"rootDid": "", **fields})


def signer_public_key_text(public_key: bytes) -> str:
    """`signerPublicKey`: base58btc of the raw 32-byte key (no multibase prefix)."""
    return b58encode(public_key)


def _public_key_matches(text: str, expected: bytes) -> bool:
    """Accept raw base58btc, or multibase `z` + base58btc of the multicodec key."""
    candidates = [text]
    if text.startswith("z"):
        candidates.append(text[1:])
    for candidate in candidates:
        try:
            raw = b58decode(candidate)
        except ValueError:
            continue
        if raw == expected or raw == b"\xed\x01" + expected:
            return True
    return False


def build_response(challenge: dict[str, Any], key: SigningKey) -> dict[str, str]:
    """What a client sends as `response` (used by `cli.client` and the tests)."""
    message = render_message(challenge, key.did)
    return {
        "kind": "siws",
        "chainId": challenge["chainId"],
        "origin": challenge["origin"],
        "message": message,
        "digest": hashlib.sha256(message.encode()).hexdigest(),
        "transcript": b64url_encode(canonical.canonicalize(challenge)),
        "signature": b64url_encode(key.sign(message.encode())),
        "signerDid": key.did,
        "signerPublicKey": signer_public_key_text(key.public_key),
    }


@dataclass(frozen=True)
class VerifiedSigner:
    did: str
    public_key: bytes


def _fail(reason: str) -> Unauthorized:
    return Unauthorized(
        f"sign-in verification failed: {reason}", code="signin_failed", details={"reason": reason}
    )


def check_response(
    *,
    stored: dict[str, Any],
    submitted_challenge: Any,
    audience: str,
    response: SignInResponse,
    now_ms: int,
) -> VerifiedSigner:
    """Every check of design §5 except the nonce burn; raises `Unauthorized` naming the check."""
    # As JSON values (JCS): Python's `==` takes `true` for `1`.
    if not isinstance(submitted_challenge, dict) or canonical.canonicalize(
        submitted_challenge
    ) != canonical.canonicalize(stored):
        raise _fail("challenge does not match the one issued")
    if audience != stored["audience"]:
        raise _fail("audience does not match the challenge")
    if response.chain_id != stored["chainId"] or response.origin != stored["origin"]:
        raise _fail("chainId or origin does not match the challenge")
    if now_ms >= stored["expiresAtMs"]:
        raise _fail("challenge expired")
    try:
        public_key = public_key_from_did_key(response.signer_did)
    except ValueError:
        raise _fail("signerDid is not an Ed25519 did:key") from None
    if not _public_key_matches(response.signer_public_key, public_key):
        raise _fail("signerPublicKey is not the key of signerDid")
    expected_message = render_message(stored, response.signer_did)
    if response.message != expected_message:
        raise _fail("message is not the rendered template")
    if response.digest != hashlib.sha256(expected_message.encode()).hexdigest():
        raise _fail("digest is not the SHA-256 of the message")
    if response.transcript != b64url_encode(canonical.canonicalize(stored)):
        raise _fail("transcript is not base64url of JCS(challenge)")
    try:
        signature = b64url_decode(response.signature)
    except ValueError:
        raise _fail("signature is not base64url") from None
    if len(signature) != 64 or not verify(public_key, expected_message.encode(), signature):
        raise _fail("signature does not verify")
    return VerifiedSigner(response.signer_did, public_key)


# --- sessions ---------------------------------------------------------------------------------


def new_session_token() -> tuple[str, bytes]:
    """An opaque 256-bit token and the hash under which it is stored."""
    token = secrets.token_urlsafe(32)
    return token, hash_token(token)


def hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def capabilities_for(
    principal: str, *, defaults: list[str], admin_dids: list[str], federation_dids: list[str]
) -> tuple[str, ...]:
    caps = list(defaults)
    if principal in federation_dids:
        caps.append("federation")
    if principal in admin_dids:
        caps.append("admin")
    return tuple(dict.fromkeys(caps))
