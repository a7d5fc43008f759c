"""Request framing per RFC 9112 §6, checked before the app sees a request.

h11 already refuses a malformed or conflicting `Content-Length` (400, connection closed) and
merges identical repeated ones (RFC 9110 §8.6 allows it). What it accepts and we refuse is a
request carrying both `Transfer-Encoding` and `Content-Length`: h11 frames it by the chunks, a
proxy in front may frame it by the length, and the difference is a request smuggled in the body
(RFC 9112 §6.1: such a request is rejected or, at least, the connection closed after it). It is
answered 400 `ambiguous_framing` with `Connection: close`, so nothing after it on that connection
is read; a WebSocket handshake so framed gets that answer instead of its 101.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from api.errors import error_body
from api.headers import REQUEST_SCOPE, RESPONSE_HEADERS
from ws.transport import CURRENT_STREAM

log = logging.getLogger(__name__)

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


def framing_problem(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """Why a request's framing headers are ambiguous, or None."""
    names = {name.lower() for name, _ in headers}
    if b"transfer-encoding" in names and b"content-length" in names:
        return "a request must not carry both Transfer-Encoding and Content-Length"
    return None


def with_framing_checks(app: ASGIApp, new_request_id: Callable[[], str]) -> ASGIApp:
    """`app` behind the framing check; also where each request's and handshake's scope is
    published in `REQUEST_SCOPE` (api/headers.py) while the app serves it, and where an answer
    gets the headers the app left in its scope's `RESPONSE_HEADERS`."""

    async def checked(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await app(scope, receive, send)
            return
        published = REQUEST_SCOPE.set(scope)
        try:
            await _checked(scope, receive, send)
        finally:
            REQUEST_SCOPE.reset(published)

    async def refuse(problem: str, receive: Any, send: Any, prefix: str) -> None:
        """400 `ambiguous_framing`, closing the connection; for a WebSocket handshake, its
        HTTP answer instead of the 101 (`prefix`: the ASGI messages' `websocket.`)."""
        if prefix:
            await receive()  # its `websocket.connect`
        request_id = new_request_id()
        body = error_body("ambiguous_framing", problem, request_id, None).encode()
        await send(
            {
                "type": f"{prefix}http.response.start",
                "status": 400,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-request-id", request_id.encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": f"{prefix}http.response.body", "body": body})

    async def _checked(scope: Any, receive: Any, send: Any) -> None:
        problem = framing_problem(scope["headers"])
        if problem is not None and scope["type"] == "http":
            await refuse(problem, receive, send, "")
            return
        if problem is not None:  # a handshake is a request too: refused, not upgraded
            try:
                await refuse(problem, receive, send, "websocket.")
            except Exception as exc:  # Hypercorn answered first (bytes came before the answer)
                log.debug("ambiguous handshake not answered: %s: %s", type(exc).__name__, exc)
            return
        if scope["type"] == "http":

            async def send_with_headers(message: Any) -> None:
                if message["type"] == "http.response.start":
                    added = scope.get(RESPONSE_HEADERS)
                    if added:
                        message["headers"] = [*message["headers"], *added]
                await send(message)

            stream = CURRENT_STREAM.get()
            if stream is not None:

                async def receive_noting_the_end() -> Any:
                    message = await receive()
                    if message["type"] == "http.request" and not message.get("more_body"):
                        stream.request_read()  # the read deadline stops: the rest is ours
                    return message

                await app(scope, receive_noting_the_end, send_with_headers)
                return
            await app(scope, receive, send_with_headers)
            return
        await app(scope, receive, send)

    return checked
