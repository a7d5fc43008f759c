"""A small Python client for people: sign in with a key file, publish and read signed entries.

from api.client import RegistryClient
from registry.keys import read_key_file
key = read_key_file(Path("me.key"))
with RegistryClient("http://127.0.0.1:8080") as client:
    client.sign_in(key)
    entry = client.publish({...unsigned entry...}, key)
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from registry.entries import sign_entry
from registry.keys import SigningKey
from registry.signin import build_response


class RegistryClientError(Exception):
    """The registry answered with an error; `status` and the `ErrorResponse` body are kept."""

    def __init__(self, status: int, body: Any) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(f"{status} {error.get('code', '')}: {error.get('message', body)}")
        self.status = status
        self.body = body
        self.code = error.get("code")


class RegistryClient:
    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.token = token
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout, transport=transport
        )

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, *, idempotent: bool = False, **kwargs: Any) -> Any:
        headers: dict[str, str] = kwargs.pop("headers", {})
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if idempotent:
            headers.setdefault("Idempotency-Key", str(uuid.uuid4()))
        response = self._http.request(method, path, headers=headers, **kwargs)
        try:
            body = response.json()
        except ValueError:
            body = response.text
        if response.status_code >= 400:
            raise RegistryClientError(response.status_code, body)
        return body

    def sign_in(self, key: SigningKey, audience: str = "registry-client") -> dict[str, Any]:
        """Challenge → sign → verify; keeps the session token for later calls."""
        challenge = self._request("POST", "/v1/auth/siws/challenge", json={"audience": audience})[
            "challenge"
        ]
        result: dict[str, Any] = self._request(
            "POST",
            "/v1/auth/siws/verify",
            json={
                "audience": audience,
                "challenge": challenge,
                "response": build_response(challenge, key),
            },
        )
        self.token = result["sessionToken"]
        return result

    def session(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", "/v1/auth/session")
        return result

    def publish(
        self, entry: dict[str, Any], key: SigningKey, *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """Sign `entry` with `key` (fills publisherDid, itemDataHash, signature) and create it."""
        signed = sign_entry(entry, key)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        result: dict[str, Any] = self._request(
            "POST", "/v1/entries", idempotent=True, json=signed, headers=headers
        )
        return result

    def update(self, entry: dict[str, Any], key: SigningKey, *, based_on: int) -> dict[str, Any]:
        signed = sign_entry({**entry, "sequence": based_on}, key)
        result: dict[str, Any] = self._request(
            "PUT", f"/v1/entries/{entry['entryDid']}", idempotent=True, json=signed
        )
        return result

    def get(self, did: str) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", f"/v1/entries/{did}")
        return result

    def delete(self, did: str) -> dict[str, Any]:
        result: dict[str, Any] = self._request("DELETE", f"/v1/entries/{did}", idempotent=True)
        return result
