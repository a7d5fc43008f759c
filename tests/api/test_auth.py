"""Sign-in (challenge, verify), sessions, logout and the identity-lookup failure, over HTTP."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import httpx
import jcs

from api.identity import HttpIdentityResolver
from registry.did import b58decode
from registry.errors import UpstreamFailed
from registry.identity import Identity
from registry.keys import SigningKey, b64url_encode
from registry.signin import build_response
from tests.api.api_support import JSON, anon_client, error_of, with_harness
from tests.conftest import Harness, make_config
from tests.helpers import bearer, idem, sign_in, signed_entry

CHALLENGE_FIELDS = {
    "version",
    "kind",
    "audience",
    "origin",
    "chainId",
    "nonce",
    "requestId",
    "issuedAtMs",
    "expiresAtMs",
    "hmrDid",
    "rootDid",
}
VERIFY_FIELDS = {
    "expiresAtMs",
    "hmrDid",
    "rootDid",
    "rootKind",
    "sessionExpiresAtMs",
    "sessionToken",
    "signerPublicKey",
}
SESSION_FIELDS = {"expiresAtMs", "hmrDid", "rootDid", "rootKind"}


async def _challenge(client: Any, audience: str = "tests") -> dict[str, Any]:
    r = await client.post("/v1/auth/siws/challenge", json={"audience": audience})
    assert r.status_code == 200, await r.get_data()
    return dict((await r.get_json())["challenge"])


async def _verify(client: Any, challenge: dict, response: dict, audience: str = "tests") -> Any:
    return await client.post(
        "/v1/auth/siws/verify",
        json={"audience": audience, "challenge": challenge, "response": response},
    )


# --- challenge ------------------------------------------------------------------------------


async def test_challenge_shape(harness: Harness) -> None:
    before = int(time.time() * 1000)
    r = await anon_client(harness).post(
        "/v1/auth/siws/challenge", json={"audience": "https://app.example.com"}
    )
    after = int(time.time() * 1000)
    assert r.status_code == 200, await r.get_data()
    assert r.headers.get("X-Request-Id")
    body = await r.get_json()
    assert set(body) == {"challenge"}
    c = body["challenge"]
    assert set(c) >= CHALLENGE_FIELDS
    assert c["version"] == 1
    assert c["kind"] == "siws"
    assert c["audience"] == "https://app.example.com"
    assert c["origin"] == "http://registry.test"
    assert c["chainId"] == "registry:local"
    assert c["hmrDid"] == harness.deps.registry_did
    assert c["rootDid"] == harness.deps.registry_did  # default trust root: the registry itself
    assert isinstance(c["nonce"], str)
    assert len(c["nonce"]) >= 22  # at least 128 bits of randomness in any text encoding
    assert isinstance(c["requestId"], str)
    assert c["requestId"]
    assert isinstance(c["issuedAtMs"], int)
    assert isinstance(c["expiresAtMs"], int)
    assert before - 1000 <= c["issuedAtMs"] <= after + 1000
    assert c["expiresAtMs"] - c["issuedAtMs"] == 5 * 60 * 1000


async def test_challenges_are_unique(harness: Harness) -> None:
    a = await _challenge(harness.client)
    b = await _challenge(harness.client)
    assert a["nonce"] != b["nonce"]
    assert a["requestId"] != b["requestId"]


async def test_a_challenge_sent_back_with_version_true_is_not_the_one_issued(
    harness: Harness,
) -> None:
    """The challenge must come back unchanged, compared as a JSON value: `true` is not `1`
    (Python's `==` said it was)."""
    client = anon_client(harness)
    challenge = await _challenge(client)
    key = SigningKey.generate()
    for changed in (dict(challenge, version=True), dict(challenge, version=1.5), [challenge]):
        r = await client.post(
            "/v1/auth/siws/verify",
            json={
                "audience": challenge["audience"],
                "challenge": changed,
                "response": build_response(challenge, key),
            },
        )
        await error_of(r, 401, "signin_failed")
    r = await client.post(  # the same challenge, unchanged, still signs in
        "/v1/auth/siws/verify",
        json={
            "audience": challenge["audience"],
            "challenge": challenge,
            "response": build_response(challenge, key),
        },
    )
    assert r.status_code == 200, await r.get_data()


async def test_invalid_challenge_request_is_400(harness: Harness) -> None:
    client = anon_client(harness)
    for body in ({}, {"audience": "x", "extra": 1}, {"audience": ""}, {"audience": 5}, [], "x"):
        r = await client.post("/v1/auth/siws/challenge", json=body)
        await error_of(r, 400, "invalid_challenge_request")
    r = await client.post("/v1/auth/siws/challenge", data=b"{", headers=JSON)
    await error_of(r, 400, "invalid_json")
    r = await client.post(
        "/v1/auth/siws/challenge", data=b'{"audience":"a","audience":"b"}', headers=JSON
    )
    await error_of(r, 400, "invalid_json")


# --- verify ---------------------------------------------------------------------------------


async def test_verify_success_shape_and_cookie(harness: Harness) -> None:
    client = anon_client(harness)
    key = SigningKey.generate()
    challenge = await _challenge(client)
    before = int(time.time() * 1000)
    r = await _verify(client, challenge, build_response(challenge, key))
    assert r.status_code == 200, await r.get_data()
    body = await r.get_json()
    assert set(body) >= VERIFY_FIELDS
    assert body["rootKind"] == "key"
    assert body["rootDid"] == key.did
    assert body["hmrDid"] == key.did
    assert b58decode(body["signerPublicKey"]) in (key.public_key, b"\xed\x01" + key.public_key)
    assert isinstance(body["sessionToken"], str)
    assert len(body["sessionToken"]) >= 32
    assert isinstance(body["sessionExpiresAtMs"], int)
    assert isinstance(body["expiresAtMs"], int)
    twelve_hours = 12 * 3600 * 1000
    assert before + twelve_hours - 60_000 <= body["sessionExpiresAtMs"]
    assert body["sessionExpiresAtMs"] <= int(time.time() * 1000) + twelve_hours + 60_000

    cookies = r.headers.getlist("Set-Cookie")
    session_cookies = [c for c in cookies if c.startswith("registry_session=")]
    assert len(session_cookies) == 1, cookies
    cookie = session_cookies[0]
    value = cookie.split(";", 1)[0].split("=", 1)[1]
    assert value == body["sessionToken"]
    attributes = [a.strip().lower() for a in cookie.split(";")[1:]]
    assert "httponly" in attributes
    assert "secure" in attributes
    assert "samesite=strict" in attributes
    assert "path=/" in attributes


async def test_verify_tokens_are_unique_per_sign_in(harness: Harness) -> None:
    key = SigningKey.generate()
    a = await sign_in(anon_client(harness), key)
    b = await sign_in(anon_client(harness), key)
    assert a != b
    for token in (a, b):
        r = await anon_client(harness).get("/v1/auth/session", headers=bearer(token))
        assert r.status_code == 200


async def test_replayed_sign_in_response_is_401(harness: Harness) -> None:
    client = anon_client(harness)
    key = SigningKey.generate()
    challenge = await _challenge(client)
    response = build_response(challenge, key)
    r = await _verify(client, challenge, response)
    assert r.status_code == 200, await r.get_data()
    r = await _verify(client, challenge, response)
    await error_of(r, 401, "signin_failed")


async def test_tampered_signature_is_401(harness: Harness) -> None:
    client = anon_client(harness)
    key = SigningKey.generate()
    challenge = await _challenge(client)
    good = build_response(challenge, key)
    bad = {**good, "signature": b64url_encode(key.sign(b"something else"))}
    r = await _verify(client, challenge, bad)
    await error_of(r, 401, "signin_failed")
    zeros = {**good, "signature": b64url_encode(bytes(64))}
    r = await _verify(client, challenge, zeros)
    await error_of(r, 401, "signin_failed")
    # A signature by another key, claimed for this signer.
    other = SigningKey.generate()
    stolen = {**good, "signature": b64url_encode(other.sign(good["message"].encode()))}
    r = await _verify(client, challenge, stolen)
    await error_of(r, 401, "signin_failed")


async def test_tampered_message_is_401(harness: Harness) -> None:
    client = anon_client(harness)
    key = SigningKey.generate()
    challenge = await _challenge(client)
    good = build_response(challenge, key)
    message = good["message"].replace("Audience: tests", "Audience: elsewhere")
    assert message != good["message"]
    # Consistently re-signed and re-digested: still not the message of this challenge.
    bad = {
        **good,
        "message": message,
        "digest": hashlib.sha256(message.encode()).hexdigest(),
        "signature": b64url_encode(key.sign(message.encode())),
    }
    r = await _verify(client, challenge, bad)
    await error_of(r, 401, "signin_failed")
    r = await _verify(client, challenge, {**good, "digest": "0" * 64})
    await error_of(r, 401, "signin_failed")


async def test_tampered_challenge_or_fields_are_401(harness: Harness) -> None:
    client = anon_client(harness)
    key = SigningKey.generate()
    challenge = await _challenge(client)
    good = build_response(challenge, key)
    # The challenge sent back must be the one issued.
    forged = {**challenge, "expiresAtMs": challenge["expiresAtMs"] + 3_600_000}
    r = await _verify(client, forged, build_response(forged, key))
    await error_of(r, 401, "signin_failed")
    # Wrong audience at the top level.
    r = await _verify(client, challenge, good, audience="elsewhere")
    await error_of(r, 401, "signin_failed")
    # Fields of the response that must match the challenge.
    for field, value in (
        ("chainId", "other:chain"),
        ("origin", "https://evil.example"),
        ("transcript", b64url_encode(b"{}")),
        ("signerPublicKey", SigningKey.generate().did.removeprefix("did:key:")),
        ("signerDid", SigningKey.generate().did),
    ):
        r = await _verify(client, challenge, {**good, field: value})
        await error_of(r, 401, "signin_failed")
    # An unknown challenge (never issued).
    unknown = {**challenge, "nonce": "0" * 32}
    r = await _verify(client, unknown, build_response(unknown, key))
    await error_of(r, 401, "signin_failed")


async def test_transcript_is_base64url_of_jcs_challenge(harness: Harness) -> None:
    """The client-side contract the server checks (design §5), using an independent JCS."""
    client = anon_client(harness)
    key = SigningKey.generate()
    challenge = await _challenge(client)
    transcript = base64.urlsafe_b64encode(jcs.canonicalize(challenge)).rstrip(b"=").decode()
    response = build_response(challenge, key)
    assert response["transcript"] == transcript
    r = await _verify(client, challenge, response)
    assert r.status_code == 200, await r.get_data()


async def test_session_is_bound_to_the_signer(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    r = await anon_client(harness).get("/v1/auth/session", headers=bearer(token))
    assert r.status_code == 200, await r.get_data()
    body = await r.get_json()
    assert set(body) >= SESSION_FIELDS
    assert body["rootDid"] == key.did
    assert body["hmrDid"] == key.did
    assert body["rootKind"] == "key"
    assert isinstance(body["expiresAtMs"], int)
    assert body["expiresAtMs"] > int(time.time() * 1000)


async def test_session_expiry_matches_verify(harness: Harness) -> None:
    client = anon_client(harness)
    key = SigningKey.generate()
    challenge = await _challenge(client)
    r = await _verify(client, challenge, build_response(challenge, key))
    verified = await r.get_json()
    r = await client.get("/v1/auth/session", headers=bearer(verified["sessionToken"]))
    assert r.status_code == 200
    session = await r.get_json()
    assert session["expiresAtMs"] == verified["sessionExpiresAtMs"]
    for field in ("hmrDid", "rootDid", "rootKind"):
        assert session[field] == verified[field]


async def test_session_without_credentials_is_401(harness: Harness) -> None:
    client = anon_client(harness)
    r = await client.get("/v1/auth/session")
    await error_of(r, 401, "session_missing")
    r = await client.get("/v1/auth/session", headers=bearer("nonsense"))
    await error_of(r, 401, "session_invalid")
    r = await client.get("/v1/auth/session", headers={"Cookie": "registry_session=nonsense"})
    await error_of(r, 401, "session_invalid")
    r = await client.get("/v1/auth/session", headers={"Authorization": "Token abc"})
    await error_of(r, 401, "session_invalid")


async def test_session_by_cookie(harness: Harness) -> None:
    client = harness.client.app.test_client()  # keeps the cookie set by verify
    key = SigningKey.generate()
    await sign_in(client, key)
    r = await client.get("/v1/auth/session")
    assert r.status_code == 200, await r.get_data()
    assert (await r.get_json())["rootDid"] == key.did


# --- logout ---------------------------------------------------------------------------------


async def test_logout_revokes_the_session(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    other = await sign_in(anon_client(harness), key)  # a second session of the same signer
    client = anon_client(harness)
    r = await client.post("/v1/auth/logout", headers=bearer(token, **idem()))
    assert r.status_code == 200, await r.get_data()
    cleared = [c for c in r.headers.getlist("Set-Cookie") if c.startswith("registry_session=")]
    assert cleared
    lowered = cleared[0].lower()
    assert "max-age=0" in lowered or "expires=thu, 01 jan 1970" in lowered
    r = await client.get("/v1/auth/session", headers=bearer(token))
    await error_of(r, 401, "session_invalid")
    r = await client.post("/v1/entries", json=signed_entry(key), headers=bearer(token, **idem()))
    await error_of(r, 401, "session_invalid")
    r = await client.post("/v1/auth/logout", headers=bearer(token, **idem()))
    await error_of(r, 401, "session_invalid")
    # Only that session ends.
    r = await client.get("/v1/auth/session", headers=bearer(other))
    assert r.status_code == 200


async def test_logout_by_cookie_revokes_it(harness: Harness) -> None:
    client = harness.client.app.test_client()
    key = SigningKey.generate()
    token = await sign_in(client, key)
    r = await client.post("/v1/auth/logout", headers=idem())
    assert r.status_code == 200, await r.get_data()
    r = await anon_client(harness).get("/v1/auth/session", headers=bearer(token))
    await error_of(r, 401, "session_invalid")
    r = await client.get("/v1/auth/session")
    assert r.status_code == 401


async def test_logout_without_session_is_401(harness: Harness) -> None:
    r = await anon_client(harness).post("/v1/auth/logout", headers=idem())
    await error_of(r, 401, "session_missing")


# --- identity lookup failure ------------------------------------------------------------------


class FailingIdentity:
    def __init__(self) -> None:
        self.calls = 0

    async def resolve(self, signer_did: str) -> Identity:
        self.calls += 1
        raise UpstreamFailed("identity lookup failed", code="identity_lookup_failed")


async def test_identity_lookup_failure_is_502(database_url: str, tmp_path: Path) -> None:
    identity = FailingIdentity()

    async def body(h: Harness) -> None:
        client = anon_client(h)
        key = SigningKey.generate()
        challenge = await _challenge(client)
        r = await _verify(client, challenge, build_response(challenge, key))
        raw = (await r.get_data()).decode()
        assert r.status_code == 502, raw
        body = json.loads(raw)
        assert set(body) == {"error"}
        assert body["error"]["code"] == "identity_lookup_failed"
        assert body["error"]["requestId"] == r.headers["X-Request-Id"]
        assert "Traceback" not in raw
        assert identity.calls == 1
        assert not [c for c in r.headers.getlist("Set-Cookie") if "registry_session=" in c]
        r = await client.get("/v1/auth/session", headers=bearer("anything"))
        await error_of(r, 401, "session_invalid")

    await with_harness(make_config(database_url, tmp_path), body, identity=identity)


async def test_identity_lookup_failure_default_code(database_url: str, tmp_path: Path) -> None:
    class Down:
        async def resolve(self, signer_did: str) -> Identity:
            raise UpstreamFailed("resolver unreachable")

    async def body(h: Harness) -> None:
        client = anon_client(h)
        key = SigningKey.generate()
        challenge = await _challenge(client)
        r = await _verify(client, challenge, build_response(challenge, key))
        await error_of(r, 502, "upstream_failed")

    await with_harness(make_config(database_url, tmp_path), body, identity=Down())


async def test_custom_identity_is_reflected_in_session(database_url: str, tmp_path: Path) -> None:
    root = SigningKey.generate().did

    class Org:
        async def resolve(self, signer_did: str) -> Identity:
            return Identity(root_did=root, root_kind="organization", hmr_did=signer_did)

    async def body(h: Harness) -> None:
        key = SigningKey.generate()
        token = await sign_in(anon_client(h), key)
        r = await anon_client(h).get("/v1/auth/session", headers=bearer(token))
        session = await r.get_json()
        assert session["rootDid"] == root
        assert session["rootKind"] == "organization"
        assert session["hmrDid"] == key.did

    await with_harness(make_config(database_url, tmp_path), body, identity=Org())


async def test_a_resolver_answer_no_store_can_keep_is_502_and_opens_no_session(
    database_url: str, tmp_path: Path
) -> None:
    """A resolver whose rootKind holds a lone surrogate: the sign-in was 400
    value_not_storable (the database refused the session), blaming the client for the
    resolver's answer. It is a failed lookup (spec 4.6: 502), and the challenge stays usable."""
    answer = b'{"rootDid":"did:web:org.example","rootKind":"\\ud800"}'
    resolver = HttpIdentityResolver(
        "https://idp.example/lookup",
        httpx.AsyncClient(
            transport=httpx.MockTransport(lambda r: httpx.Response(200, content=answer))
        ),
    )

    async def body(h: Harness) -> None:
        client = anon_client(h)
        challenge = await _challenge(client)
        r = await _verify(client, challenge, build_response(challenge, SigningKey.generate()))
        await error_of(r, 502, "identity_lookup_failed")
        assert not [c for c in r.headers.getlist("Set-Cookie") if "registry_session=" in c]
        assert await h.store.get_challenge(challenge["nonce"]) is not None  # not burnt

    await with_harness(make_config(database_url, tmp_path), body, identity=resolver)
