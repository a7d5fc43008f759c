"""Request headers read on every request, without werkzeug's cost for an absent one.

`request.headers.get(name)` raises and catches a `BadRequestKeyError` (an HTTPException, with
its description) for every header the request does not carry; most of the headers the service
looks at on each request (X-Request-Id, X-Forwarded-For, Registry-Min-Sequence, If-None-Match,
Transfer-Encoding, ...) are usually absent. This reads the ASGI scope's header list instead:
names there are lower case (ASGI), values are decoded as Quart decodes them (latin-1), and the
first of repeated headers is the one answered, as `Headers.get` does.

The scope itself is found in `REQUEST_SCOPE`, which the app's ASGI entry (`api/framing.py`) sets
for each request and WebSocket handshake: Quart's `request` and `websocket` are werkzeug proxies,
and the few lookups of them a request made this way cost more than the header scans
(bench/app_cpu.py). Outside that entry (a test's `test_request_context`) the proxies answer.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from quart import has_request_context, has_websocket_context, request, websocket

# In a request's ASGI scope: headers the app's ASGI entry (api/framing.py) adds to the answer as
# they are, lower-case names and values as bytes. `endpoint` puts the headers every answer of a
# route carries there (X-Request-Id, the rate-limit headers, the route's own): werkzeug's
# `Headers` checks and scans for each one it sets, several times what the rest of it costs.
RESPONSE_HEADERS = "registry.response_headers"

REQUEST_SCOPE: ContextVar[dict[str, Any] | None] = ContextVar(
    "registry_request_scope", default=None
)


def current_scope() -> dict[str, Any] | None:
    """The ASGI scope of the request or WebSocket handshake being served; None outside one."""
    scope = REQUEST_SCOPE.get()
    if scope is not None:
        return scope
    if has_request_context():
        return request.scope  # type: ignore[return-value]
    if has_websocket_context():
        return websocket.scope  # type: ignore[return-value]
    return None


def _scope() -> dict[str, Any]:
    scope = current_scope()
    if scope is None:
        raise RuntimeError("not within a request or WebSocket handshake")
    return scope


def peer_address(scope: dict[str, Any]) -> str:
    """The TCP peer's address, as Quart's `remote_addr` gives it ("<local>" without one)."""
    client = scope.get("client")
    return str(client[0]) if client else "<local>"


def header(name: bytes) -> str | None:
    """The request's (or WebSocket handshake's) header `name`, given in lower case."""
    for key, value in _scope()["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def header_lines(name: bytes) -> list[str]:
    """Every line of the request's header `name` (lower case), in order."""
    return [str(value.decode("latin-1")) for key, value in _scope()["headers"] if key == name]


def response_header(scope: dict[str, Any] | None, name: bytes) -> str | None:
    """The value of the header `name` (lower case) that the answer to `scope` is to get from
    `RESPONSE_HEADERS`; None when it gets none there."""
    for key, value in (scope or {}).get(RESPONSE_HEADERS, ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None
