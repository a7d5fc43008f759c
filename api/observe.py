"""What each request leaves for operators: one access-log line and its metrics.

Every HTTP request that reaches the app (routed or not: a 404 for an unknown path is a request
too) is timed from the moment the app sees it to its response, and then:

* **logged** on `registry.access` at INFO (when `logging.access` is on), one line: the request
  id, method, route template (never the raw path or the query), status, duration, response
  bytes, client address, the principal's DID when signed in, and whether it was an idempotent
  replay. Never a token, cookie, signature, key or body: none of them is read here. In the
  JSON log format these are the line's members; in the text format, `key=value` pairs.
* **counted** in `Metrics`: a duration histogram by route template, method and status class;
  refusals by rate limit, by bucket class; idempotent replays by route.

Requests refused before the app (a malformed frame answered by `api/framing.py`, a connection
refused or cut by `ws/transport.py`) and WebSocket connections are not requests of the app. The
connections are counted by `ws/transport.py` (`registry_connections_*`), the event sockets by
the event stream; an ambiguous frame only by the 400 its client gets.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from quart import Response, g, request
from quart_trio import QuartTrio

from api.headers import current_scope, response_header
from api.http import client_host, deps
from api.metrics import METHODS, OTHER_METHOD, UNROUTED, Metrics

ACCESS = logging.getLogger("registry.access")


_STARTED = "registry.started"  # in the request's ASGI scope: when the app first saw it


def note_start(scope: dict[str, Any]) -> None:
    """Start the request's clock: the app's one `before_request` hook calls this first
    (api/app.py)."""
    scope[_STARTED] = time.perf_counter()


def install(app: QuartTrio, metrics: Metrics, *, access_log: bool) -> None:
    """Log and count every request of `app`, timed from `note_start`."""

    @app.after_request
    async def finished(response: Response) -> Response:
        now = time.perf_counter()
        scope = current_scope()
        seconds = now - (scope or {}).get(_STARTED, now)
        route = request.url_rule.rule if request.url_rule is not None else UNROUTED
        status = response.status_code
        replayed = response_header(scope, b"idempotent-replayed") == "true"
        metrics.observe_request(route, request.method, status, seconds)
        if status == 429:
            metrics.rate_limited.labels(g.get("rate_class", "unknown")).inc()
        if replayed:
            metrics.replays.labels(route).inc()
        if access_log and ACCESS.isEnabledFor(logging.INFO):
            request_id = response_header(scope, b"x-request-id")
            if request_id is None:  # not a route's answer: an error handler's
                request_id = response.headers.get("X-Request-Id", "")
            _log(response, request_id, route, status, seconds, replayed)
        return response


def _log(
    response: Response, request_id: str, route: str, status: int, seconds: float, replayed: bool
) -> None:
    fields: dict[str, object] = {
        "requestId": request_id,
        # Bounded as the metrics' label is: HTTP/2 lets a client send any method but CR, LF
        # and NUL (spaces, ANSI escapes, 60 KB), which forged key=value pairs in the line.
        "method": request.method if request.method in METHODS else OTHER_METHOD,
        "route": route,
        "status": status,
        "ms": round(seconds * 1000, 2),
        # A HEAD answer has the GET's Content-Length and no body (RFC 9110 §9.3.2).
        "bytes": 0 if request.method == "HEAD" else response.content_length or 0,
        "client": client_host(deps().config),
    }
    principal = g.get("principal")
    if principal is not None:
        fields["principal"] = principal
    if replayed:
        fields["replayed"] = True
    ACCESS.info(
        " ".join(f"{key}={value}" for key, value in fields.items()), extra={"access": fields}
    )
