"""Helpers shared by the HTTP tests in tests/api (not a test module itself)."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import jcs

from registry.config import Config
from registry.did import public_key_from_did_key
from registry.entries import signing_bytes
from registry.identity import IdentityResolver
from registry.keys import SigningKey, b64url_decode, verify
from tests.conftest import Harness, open_harness
from tests.helpers import bearer, idem, next_version, signed_entry

RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
JSON = {"Content-Type": "application/json"}


async def with_harness(
    config: Config,
    body: Callable[[Harness], Awaitable[None]],
    identity: IdentityResolver | None = None,
) -> None:
    """Run `body` in a harness of its own (e.g. small limits) and close it whatever happens.

    A failure inside `body` is re-raised only after the harness has shut down, so the harness's
    async generator always runs to completion (an exception thrown through it would leave its
    nursery and trio-asyncio loop half closed).
    """
    failure: Exception | None = None
    async for h in open_harness(config, identity=identity):
        try:
            await body(h)
        except Exception as exc:
            failure = exc
    if failure is not None:
        raise failure


def anon_client(h: Harness) -> Any:
    """A client of the same app with no cookie jar: requests carry no session at all.

    (The harness client keeps the `registry_session` cookie of the last sign-in.)
    """
    return h.client.app.test_client(use_cookies=False)


async def error_of(response: Any, status: int, code: str, *, own_request_id: bool = True) -> dict:
    """Assert an `ErrorResponse` with this status and code; return its `error` object."""
    raw = (await response.get_data()).decode("utf-8")
    assert response.status_code == status, raw
    assert response.headers.get("Content-Type", "").startswith("application/json"), raw
    assert "Traceback" not in raw
    assert 'File "' not in raw
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    error = body["error"]
    assert error["code"] == code, error
    assert isinstance(error["message"], str)
    assert error["message"]
    assert isinstance(error["requestId"], str)
    assert error["requestId"]
    assert set(error) <= {"code", "message", "requestId", "details"}
    if "details" in error:
        assert isinstance(error["details"], dict)
    assert response.headers.get("X-Request-Id")
    if own_request_id:
        assert error["requestId"] == response.headers["X-Request-Id"]
    return error


def assert_publisher_signature(served: dict) -> None:
    """The served entry verifies under the publisher-payload rule (design §3).

    Checked twice: with the registry's own JCS and with the independent `jcs` package.
    """
    public_key = public_key_from_did_key(served["publisherDid"])
    assert served["signature"]["keyId"].split("#", 1)[0] == served["publisherDid"]
    signature = b64url_decode(served["signature"]["value"])
    assert verify(public_key, signing_bytes(served), signature)
    unsigned = {"signature", "sequence", "anchorState", "verifiableAttestations", "updatedAt"}
    payload = {k: v for k, v in served.items() if k not in unsigned}
    assert verify(public_key, jcs.canonicalize(payload), signature)


def expected_served(submitted: dict, served: dict) -> dict:
    """What the registry should serve for `submitted`: the same fields plus the managed ones."""
    managed = {"sequence", "anchorState", "updatedAt", "verifiableAttestations"}
    expected = {k: v for k, v in submitted.items() if k not in managed}
    signature = dict(submitted["signature"])
    signature.setdefault("created", served["signature"].get("created"))
    expected["signature"] = signature
    expected["sequence"] = served["sequence"]
    expected["anchorState"] = "unanchored"
    expected["updatedAt"] = served["updatedAt"]
    return expected


async def create(
    h: Harness, key: SigningKey, token: str, did: str | None = None, **fields: Any
) -> dict:
    """Publish a new entry through HTTP; return the served body."""
    entry = signed_entry(key, did, **fields)
    r = await h.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    assert r.status_code == 201, await r.get_data()
    return dict(await r.get_json())


async def update(
    h: Harness, key: SigningKey, token: str, did: str, based_on: int | None, **fields: Any
) -> Any:
    """PUT a new version signed by `key`; return the raw response."""
    if based_on is not None:
        fields["sequence"] = based_on
    fields.setdefault("version", next_version())
    entry = signed_entry(key, did, **fields)
    return await h.client.put(f"/v1/entries/{did}", json=entry, headers=bearer(token, **idem()))


async def updated(
    h: Harness, key: SigningKey, token: str, did: str, based_on: int, **fields: Any
) -> dict:
    r = await update(h, key, token, did, based_on, **fields)
    assert r.status_code == 200, await r.get_data()
    return dict(await r.get_json())


async def versions(h: Harness, did: str, **params: Any) -> Any:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return await h.client.get(f"/v1/entries/{did}/versions" + (f"?{query}" if query else ""))


async def total_versions(h: Harness, did: str) -> int:
    r = await versions(h, did)
    assert r.status_code == 200, await r.get_data()
    return int((await r.get_json())["totalCount"])


def count_session_lookups(
    h: Harness, answer: Callable[[bytes], Awaitable[Any]] | None = None
) -> list[bytes]:
    """From now on, each session lookup the harness's process makes in its store is recorded
    (the token hash) and answered by `answer`, or by the store as before."""
    store = h.service.deps.sessions.store
    looked_up: list[bytes] = []
    answer = answer or store.get_session

    async def counted(token_hash: bytes) -> Any:
        looked_up.append(token_hash)
        return await answer(token_hash)

    store.get_session = counted  # type: ignore[method-assign]
    return looked_up
