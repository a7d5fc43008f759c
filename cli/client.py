"""A small Python client for people: sign in with a key file, publish and read signed entries.

from cli.client import RegistryClient
from registry.keys import read_key_file
key = read_key_file(Path("me.key"))
with RegistryClient("http://127.0.0.1:8080") as client:
    client.sign_in(key)
    entry = client.publish({...unsigned entry...}, key)
    entry = client.update({**entry, "version": "1.0.1"}, key, based_on=entry["sequence"])
    for version in client.iter_versions(entry["entryDid"]):   # newest first, every page
        ...
    client.delete(entry["entryDid"])

Every mutation carries a fresh `Idempotency-Key` unless one is given. An error answer raises
`RegistryClientError` (its `status`, `code` and `body`); a registry that cannot be reached raises
httpx's `TransportError` (`ConnectError`, `TimeoutException`, ...).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx

from registry.keys import SigningKey


class RegistryClientError(Exception):
    """The registry answered with an error; `status` and the `ErrorResponse` body are kept.

    `code` and `message` come from the body's `error` member; an answer that is not an
    `ErrorResponse` (or a success that is not JSON: not a registry) has `code` None."""

    def __init__(self, status: int, body: Any) -> None:
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {}
        code, details = error.get("code"), error.get("details")
        self.status = status
        self.body = body
        self.code: str | None = code if isinstance(code, str) else None
        self.details: dict[str, Any] = details if isinstance(details, dict) else {}
        if self.code is not None:
            self.message = str(error.get("message", ""))
        else:
            self.message = "the answer is not a registry ErrorResponse"
        super().__init__(f"{status} {self.code or ''}: {self.message}")


class UnexpectedAnswer(RegistryClientError):
    """A success answer no registry gives (`message` says what was wrong with it): not a
    registry, or a broken one."""

    def __init__(self, what: str, status: int, body: Any) -> None:
        super().__init__(status, body)
        self.message = what
        self.args = (f"{status}: {what}",)


def _not_json(constant: str) -> Any:
    """NaN and Infinity, which Python's parser takes and JSON (and so a registry) has not."""
    raise ValueError(f"{constant} is not JSON")


def _objects(items: Any, what: str) -> list[dict[str, Any]]:
    """`items`, which must be an array of objects (the commands read their members)."""
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise UnexpectedAnswer(f"HTTP 200 whose {what} are not objects", 200, items)
    return items


def next_cursor(page: dict[str, Any], seen: set[str]) -> str | None:
    """The cursor that asks for the page after `page`, None after the last page; `seen`, the
    cursors asked with so far, is added to. A cursor given before would page forever."""
    if not page.get("hasMore") or page.get("cursor") is None:
        return None
    cursor = str(page["cursor"])
    if cursor in seen:
        raise UnexpectedAnswer(
            f"the page of cursor {cursor!r} again (paging would not end)", 200, page
        )
    seen.add(cursor)
    return cursor


def entry_path(did: str) -> str:
    """`/v1/entries/{did}`, the DID percent-encoded as one path segment (`%` as `%25`)."""
    return "/v1/entries/" + quote(did, safe=":")


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
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport)

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(
        self,
        method: str,
        path: str,
        *,
        idempotent: bool = False,
        want: type[dict[str, Any]] | type[list[Any]] | None = None,
        members: tuple[str, ...] = (),
        **kwargs: Any,
    ) -> Any:
        """The answer's JSON; with `want`, it must be of that type (and a dict have `members`),
        else it is an `UnexpectedAnswer` (the commands read its members)."""
        headers: dict[str, str] = kwargs.pop("headers", {})
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if idempotent:
            headers.setdefault("Idempotency-Key", str(uuid.uuid4()))
        response = self._http.request(method, path, headers=headers, **kwargs)
        status = response.status_code
        try:
            body = response.json(parse_constant=_not_json)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than Python reads
            body = response.text
            if status < 400:  # every registry answer is JSON: this is not one
                raise RegistryClientError(status, body) from None
        if status >= 400:
            raise RegistryClientError(status, body)
        if want is not None and not isinstance(body, want):
            kind = "an object" if want is dict else "an array"
            raise UnexpectedAnswer(f"HTTP {status} with JSON that is not {kind}", status, body)
        missing = [m for m in members if m not in body]
        if missing:
            raise UnexpectedAnswer(f"HTTP {status} without {', '.join(missing)}", status, body)
        return body

    @staticmethod
    def _idem(idempotency_key: str | None) -> dict[str, str]:
        return {"Idempotency-Key": idempotency_key} if idempotency_key else {}

    def sign_in(self, key: SigningKey, audience: str = "registry-client") -> dict[str, Any]:
        """Challenge → sign → verify; keeps the session token for later calls."""
        from registry.errors import Invalid
        from registry.signin import build_response  # pydantic models: not for plain reads

        answer = self._request(
            "POST",
            "/v1/auth/siws/challenge",
            json={"audience": audience},
            want=dict,
            members=("challenge",),
        )
        challenge = answer["challenge"]
        try:
            response = build_response(challenge, key)
        except (KeyError, TypeError, ValueError, AttributeError, Invalid) as exc:
            what = f"HTTP 200 with a challenge that cannot be signed ({type(exc).__name__})"
            raise UnexpectedAnswer(what, 200, answer) from exc
        result: dict[str, Any] = self._request(
            "POST",
            "/v1/auth/siws/verify",
            json={"audience": audience, "challenge": challenge, "response": response},
            want=dict,
            members=("sessionToken", "expiresAtMs"),
        )
        self.token = result["sessionToken"]
        return result

    def session(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", "/v1/auth/session", want=dict)
        return result

    def logout(self, *, idempotency_key: str | None = None) -> dict[str, Any]:
        """Revoke this client's session; the token is forgotten."""
        result: dict[str, Any] = self._request(
            "POST",
            "/v1/auth/logout",
            idempotent=True,
            headers=self._idem(idempotency_key),
            want=dict,
        )
        self.token = None
        return result

    def publish(
        self, entry: dict[str, Any], key: SigningKey, *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """Sign `entry` with `key` (fills publisherDid, itemDataHash, signature) and create it."""
        from registry.entries import sign_entry

        signed = sign_entry(entry, key)
        result: dict[str, Any] = self._request(
            "POST",
            "/v1/entries",
            idempotent=True,
            json=signed,
            headers=self._idem(idempotency_key),
            want=dict,
        )
        return result

    def update(
        self,
        entry: dict[str, Any],
        key: SigningKey,
        *,
        based_on: int,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Sign `entry` as the version after sequence `based_on` and replace the latest with it
        (`409 sequence_conflict` if `based_on` is no longer the latest)."""
        from registry.entries import sign_entry

        signed = sign_entry({**entry, "sequence": based_on}, key)
        result: dict[str, Any] = self._request(
            "PUT",
            entry_path(entry["entryDid"]),
            idempotent=True,
            json=signed,
            headers=self._idem(idempotency_key),
            want=dict,
        )
        return result

    def get(self, did: str) -> dict[str, Any]:
        """The latest version of an entry."""
        result: dict[str, Any] = self._request(
            "GET", entry_path(did), want=dict, members=("sequence",)
        )
        return result

    def anchors(self, did: str, *, cursor: str | None = None) -> dict[str, Any]:
        """One page of the entry's anchor intents (GET /v1/anchors/{did})."""
        path = "/v1/anchors/" + entry_path(did).removeprefix("/v1/entries/")
        params = {} if cursor is None else {"cursor": cursor}
        result: dict[str, Any] = self._request(
            "GET", path, params=params, want=dict, members=("records",)
        )
        _objects(result["records"], "records")
        return result

    def version(self, did: str, sequence: int) -> dict[str, Any]:
        """One version of an entry, by its `sequence`."""
        result: dict[str, Any] = self._request(
            "GET", f"{entry_path(did)}/versions/{sequence}", want=dict, members=("sequence",)
        )
        return result

    # --- the verifiable log (docs/transparency.md) -------------------------------------------

    def checkpoint(self, tree_size: int | None = None) -> str:
        """The signed checkpoint note (text), the newest or a stored one of `tree_size`."""
        params = {} if tree_size is None else {"treeSize": str(tree_size)}
        response = self._http.get("/v1/log/checkpoint", params=params)
        if response.status_code >= 400:
            try:
                body: Any = response.json()
            except ValueError:
                body = response.text
            raise RegistryClientError(response.status_code, body)
        return response.text

    def log_records(self, start: int, limit: int = 1000) -> dict[str, Any]:
        """One page of log records from sequence `start` (GET /v1/log/records)."""
        params = {"from": str(start), "limit": str(limit)}
        result: dict[str, Any] = self._request("GET", "/v1/log/records", params=params)
        return result

    def consistency_proof(self, first: int, second: int) -> dict[str, Any]:
        params = {"from": str(first), "to": str(second)}
        result: dict[str, Any] = self._request("GET", "/v1/log/proof/consistency", params=params)
        return result

    def version_proof(self, did: str, sequence: int) -> dict[str, Any]:
        """The proof bundle of one entry version (checkpoint, record, inclusion proof)."""
        path = f"{entry_path(did)}/versions/{sequence}/proof"
        result: dict[str, Any] = self._request("GET", path)
        return result

    def versions(
        self, did: str, *, limit: int | None = None, cursor: str | None = None
    ) -> dict[str, Any]:
        """One page of versions, newest first: `{entryDid, versions, cursor?, hasMore,
        totalCount}`. Pass the page's `cursor` back for the next one."""
        params: dict[str, str | int] = {}
        if limit is not None:
            params["limit"] = limit
        if cursor is not None:
            params["cursor"] = cursor
        result: dict[str, Any] = self._request(
            "GET", f"{entry_path(did)}/versions", params=params, want=dict, members=("versions",)
        )
        _objects(result["versions"], "versions")
        return result

    def iter_versions(
        self, did: str, *, page_size: int | None = None, cursor: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Every version (after `cursor`, if given), newest first, following the pages."""
        seen = set() if cursor is None else {cursor}
        while True:
            page = self.versions(did, limit=page_size, cursor=cursor)
            yield from page["versions"]
            cursor = next_cursor(page, seen)
            if cursor is None:
                return

    def lineage(self, did: str) -> dict[str, Any]:
        """`{entryDid, lineage}`: the `lineageReference` of the latest version, or null."""
        result: dict[str, Any] = self._request("GET", f"{entry_path(did)}/lineage", want=dict)
        return result

    def delete(self, did: str, *, idempotency_key: str | None = None) -> dict[str, Any]:
        """Delete an entry (publisher or admin): answers the tombstone; the DID is never reused."""
        result: dict[str, Any] = self._request(
            "DELETE",
            entry_path(did),
            idempotent=True,
            headers=self._idem(idempotency_key),
            want=dict,
        )
        return result

    # --- federation ---------------------------------------------------------------------------

    def peers(self) -> list[dict[str, Any]]:
        """The registry's federation peers (GET /v1/federation/peers)."""
        result = self._request("GET", "/v1/federation/peers", want=list)
        return _objects(result, "peers")

    def overview(self) -> dict[str, Any]:
        """Deep health, log head, peers with their quarantined entries, anchoring (admin)."""
        result: dict[str, Any] = self._request("GET", "/v1/admin/overview", want=dict)
        return result

    def peer_status(self) -> list[dict[str, Any]]:
        """Each peer's sync status: breaker, cursor, lag, latency, quarantines (admin)."""
        result = self._request("GET", "/v1/admin/federation/peers", want=list)
        return _objects(result, "peers")

    def register_peer_endpoint(
        self, endpoint: str, *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """As a peer registry (signed in with its key): where it can be reached."""
        result: dict[str, Any] = self._request(
            "PUT",
            "/v1/federation/peers/self",
            idempotent=True,
            json={"endpoint": endpoint},
            headers=self._idem(idempotency_key),
            want=dict,
        )
        return result

    def discover_federated(self, query: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/discover/federated: local and peers' results merged (needs a session)."""
        result: dict[str, Any] = self._request(
            "POST", "/v1/discover/federated", json=query, want=dict
        )
        return result
