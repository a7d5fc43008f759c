"""HTTP identity resolver: `GET <url>?did=<signer>` → `{rootDid, rootKind, hmrDid}`.

Any transport failure, non-200 answer or malformed body is an `UpstreamFailed` (502 at sign-in);
a peer's error is never presented as ours.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import trio

from registry.canonical import parse_strict
from registry.did import is_did
from registry.errors import Invalid, UpstreamFailed
from registry.identity import Identity

MAX_ANSWER_BYTES = 64 * 1024  # an answer is three DIDs and a kind: a few hundred bytes
TIMEOUT_SECONDS = 5.0


class HttpIdentityResolver:
    def __init__(
        self, url: str, client: httpx.AsyncClient, *, timeout: float = TIMEOUT_SECONDS
    ) -> None:
        self._url = url
        self._client = client
        self._timeout = timeout

    @classmethod
    @asynccontextmanager
    async def open(
        cls, url: str, request_timeout: float = TIMEOUT_SECONDS
    ) -> AsyncIterator[HttpIdentityResolver]:
        async with httpx.AsyncClient(timeout=request_timeout) as client:
            yield cls(url, client, timeout=request_timeout)

    async def _get(self, signer_did: str) -> tuple[int, bytes]:
        """The answer's status and body, within the timeout and MAX_ANSWER_BYTES as a whole
        (httpx's timeout bounds each read: a resolver trickling its answer held the sign-in)."""
        with trio.move_on_after(self._timeout):
            async with self._client.stream("GET", self._url, params={"did": signer_did}) as got:
                chunks: list[bytes] = []
                size = 0
                async for chunk in got.aiter_bytes():
                    size += len(chunk)
                    if size > MAX_ANSWER_BYTES:
                        raise UpstreamFailed(
                            "identity lookup failed",
                            code="identity_lookup_failed",
                            details={"reason": "answer_too_large"},
                        )
                    chunks.append(chunk)
                return got.status_code, b"".join(chunks)
        raise UpstreamFailed(
            "identity lookup failed", code="identity_lookup_failed", details={"reason": "timeout"}
        )

    async def resolve(self, signer_did: str) -> Identity:
        try:
            status, content = await self._get(signer_did)
        except httpx.HTTPError as exc:
            raise UpstreamFailed(
                "identity lookup failed",
                code="identity_lookup_failed",
                details={"reason": type(exc).__name__},
            ) from exc
        if status != 200:
            raise UpstreamFailed(
                "identity lookup failed",
                code="identity_lookup_failed",
                details={"upstreamStatus": status},
            )
        try:
            # I-JSON, as every body we read: no lone surrogate or U+0000 (no store keeps the
            # session then), no nesting too deep (RecursionError was a 500 of the sign-in).
            body = parse_strict(content)
            root_did, root_kind = body["rootDid"], body["rootKind"]
            hmr_did = body.get("hmrDid") or signer_did
            if not all(isinstance(v, str) and v for v in (root_did, root_kind, hmr_did)):
                raise TypeError("rootDid, rootKind and hmrDid must be non-empty strings")
            identity = Identity(root_did=root_did, root_kind=root_kind, hmr_did=hmr_did)
        except (Invalid, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UpstreamFailed(
                "identity lookup answered malformed JSON", code="identity_lookup_failed"
            ) from exc
        if not (is_did(identity.root_did) and is_did(identity.hmr_did)):
            raise UpstreamFailed("identity lookup answered non-DIDs", code="identity_lookup_failed")
        return identity
