"""The one place errors become HTTP responses (design §7).

A `RegistryError` becomes its status and an `ErrorResponse`; anything else is logged with its
traceback and answered with a generic 500 that carries only the request id.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from quart import Response

from api.headers import RESPONSE_HEADERS, current_scope
from registry.errors import RateLimited, RegistryError, Unavailable

log = logging.getLogger("registry.api")


_BODY_READ = "registry.body_read"  # in the request's ASGI scope, once its body is all read


def mark_body_read() -> None:
    """Record that this request's body was read to its end (`body_unread` is then False)."""
    scope = current_scope()
    if scope is not None:
        scope[_BODY_READ] = True


def body_unread() -> bool:
    """Whether this request carries a body that nothing has read to its end.

    An answer sent before the body is in leaves the connection unusable: Hypercorn cannot
    recycle it, and a client that sends its next request on it waits forever. Such an answer
    says `Connection: close` (a 404 or 405 of routing, an early 401 or 429, a body where the
    operation takes none)."""
    scope = current_scope()
    if scope is None or scope["type"] != "http" or scope.get(_BODY_READ, False):
        return False
    chunked, length = False, None
    for key, value in scope["headers"]:
        if key == b"transfer-encoding":
            chunked = chunked or bool(value)
        elif key == b"content-length" and length is None:
            length = value
    return chunked or (length is not None and length != b"0")


def error_body(code: str, message: str, request_id: str, details: dict[str, Any] | None) -> str:
    error: dict[str, Any] = {"code": code, "message": message, "requestId": request_id}
    if details:
        error["details"] = details
    return json.dumps({"error": error}, ensure_ascii=False, separators=(",", ":"))


def error_response(exc: BaseException, request_id: str) -> Response:
    if isinstance(exc, RegistryError):
        status, code, message, details = exc.status, exc.code, exc.message, exc.details
    else:
        log.error("unhandled error (request %s)", request_id, exc_info=exc)
        status, code, message, details = 500, "internal_error", "internal server error", None
    response = Response(
        error_body(code, message, request_id, details),
        status=status,
        content_type="application/json",
    )
    response.headers["X-Request-Id"] = request_id
    scope = current_scope()
    if scope is not None:
        # A route that answered before something failed (a hook after it) left its own headers
        # for the ASGI entry (api/headers.py): this answer is not that one.
        scope.pop(RESPONSE_HEADERS, None)
    if body_unread():
        response.headers["Connection"] = "close"
    if isinstance(exc, RateLimited):
        response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
        response.headers["RateLimit-Limit"] = str(exc.limit)
        response.headers["RateLimit-Remaining"] = "0"
        response.headers["RateLimit-Reset"] = str(max(1, math.ceil(exc.retry_after)))
    elif isinstance(exc, Unavailable):  # a condition that passes: say when to try again
        response.headers["Retry-After"] = "1"
    return response
