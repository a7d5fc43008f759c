"""Request headers read on every request, without werkzeug's cost for an absent one.

`request.headers.get(name)` raises and catches a `BadRequestKeyError` (an HTTPException, with
its description) for every header the request does not carry; most of the headers the service
looks at on each request (X-Request-Id, X-Forwarded-For, Registry-Min-Sequence, If-None-Match,
Transfer-Encoding, ...) are usually absent. This reads the ASGI scope's header list instead:
names there are lower case (ASGI), values are decoded as Quart decodes them (latin-1), and the
first of repeated headers is the one answered, as `Headers.get` does.
"""

from __future__ import annotations

from quart import has_request_context, request, websocket

from registry.ratelimit import joined_lines


def header_lines(name: bytes) -> str:
    """Every line of the request's header `name` (lower case), joined (`joined_lines`)."""
    scope = request.scope if has_request_context() else websocket.scope
    return joined_lines(scope["headers"], name)


def header(name: bytes) -> str | None:
    """The request's (or WebSocket handshake's) header `name`, given in lower case."""
    scope = request.scope if has_request_context() else websocket.scope
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None
