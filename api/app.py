"""The Quart-Trio application: routes registered on one app, errors mapped in one place."""

from __future__ import annotations

from urllib.parse import urlsplit

from quart import Response, has_request_context, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException
from werkzeug.routing import Map, RequestRedirect, UnicodeConverter, WebsocketMismatch

from api import (
    anchors,
    auth,
    console,
    discover,
    entries,
    federation,
    ops,
    transfers,
    transparency,
    trust,
)
from api.errors import error_response
from api.framing import with_framing_checks
from api.headers import current_scope, header_lines
from api.http import Deps, client_address, fresh_request_id, new_request_id
from api.observe import install, note_start
from registry.errors import (
    Invalid,
    MethodNotAllowed,
    NotFound,
    RateLimited,
    RegistryError,
    TooLarge,
)
from registry.store.routing import MIN_SEQUENCE_HEADER, ON_PRIMARY, READ_FLOOR, parse_floor


class _Segment(UnicodeConverter):
    """A path parameter, one segment as werkzeug's default, without NUL: no DID or id the
    registry stores can hold one (PostgreSQL's text cannot), so a path naming one matches no
    route (404 `route_not_found`, as a `%2F` does) instead of reaching the database with a
    value it refuses (a 400 that blamed the request's value)."""

    def __init__(
        self, map: Map, minlength: int = 1, maxlength: int | None = None, length: int | None = None
    ) -> None:
        super().__init__(map, minlength, maxlength, length)
        self.regex = self.regex.replace("[^/]", "[^/\\x00]", 1)


def _new_app() -> QuartTrio:
    app = QuartTrio("registry")
    app.url_map.converters["default"] = _Segment
    app.url_map.converters["string"] = _Segment
    return app


def _register_routes(app: QuartTrio) -> None:
    modules = (entries, auth, discover, ops, trust, transfers, anchors, federation, transparency)
    for module in (*modules, console):
        module.register(app)


def route_table() -> QuartTrio:
    """An app with every HTTP route and nothing to serve them with: what the OpenAPI document
    is generated from, without a service (`api.openapi.openapi_document(route_table())`)."""
    app = _new_app()
    _register_routes(app)
    return app


def _moved(redirect: RequestRedirect) -> Response:
    """The framework's redirect to a path's canonical form (`/console` to `/console/`, `//`
    to `/`) as an answer of ours: a request id like every answer, no body, and a Location
    that is a path, where werkzeug's is an absolute URL built from the client's Host header
    (and Quart sends it with an HTML body, past every error handler)."""
    target = urlsplit(redirect.new_url)
    location = target.path + (f"?{target.query}" if target.query else "")
    return Response(
        b"",
        status=redirect.code,
        headers={"Location": location, "X-Request-Id": new_request_id()},
    )


def create_app(dependencies: Deps) -> QuartTrio:
    app = _new_app()
    limits = dependencies.config.limits
    app.config["MAX_CONTENT_LENGTH"] = max(
        limits.accept_body_bytes,  # the entry's limit and an accept's envelope
        limits.query_body_bytes,
        limits.federation_body_bytes,
        limits.small_body_bytes,
    )
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    app.deps = dependencies  # type: ignore[attr-defined]
    install(app, dependencies.metrics, access_log=dependencies.config.logging.access)
    _register_routes(app)

    min_sequence_header = MIN_SEQUENCE_HEADER.lower().encode()

    def spend_unrouted() -> None:
        """A request refused before any route (4xx) spends its address's read budget as a read
        does, else such requests were free to send without end (docs/limits.md): raises 429
        `read_rate_limited` past it."""
        spent = dependencies.limiter.acquire("read", client_address(dependencies.config))
        if not spent.allowed:
            raise RateLimited(
                "read rate limit exceeded",
                retry_after=spent.retry_after,
                limit=spent.limit,
                code="read_rate_limited",
            )

    # One hook for what every request needs first: Quart's call of each hook costs more than
    # what these do (bench/app_cpu.py).
    @app.before_websocket
    async def before_every_handshake() -> None:
        # Quart runs no before_request hook for a WebSocket: the event stream was served on
        # the metrics listener, where only /metrics is.
        scope = current_scope()
        if ops.on_metrics_listener(dependencies.config, scope):
            spend_unrouted()
            raise NotFound(
                f"no route for {websocket.path} on the metrics listener", code="route_not_found"
            )

    @app.before_request
    async def before_every_request() -> Response | None:
        scope = current_scope()
        assert scope is not None
        note_start(scope)
        if ops.on_metrics_listener(dependencies.config) and request.path != "/metrics":
            spend_unrouted()
            raise NotFound(
                f"no route for {request.path} on the metrics listener", code="route_not_found"
            )
        if isinstance(request.routing_exception, RequestRedirect):
            spend_unrouted()  # a 308 to the path's canonical form (`//x`, `/console`)
            return _moved(request.routing_exception)
        # A GET may be answered by the read replica once it has replayed the client's floor
        # (registry/store/routing.py); any other method's reads decide a write: the primary.
        # Set on every request, as a connection's requests may share a task.
        READ_FLOOR.set(None)
        ON_PRIMARY.set(False)
        if scope["method"] in ("GET", "HEAD"):
            # Lines of one header are one list (RFC 9110 §5.3): two are "a, b", no sequence.
            lines = header_lines(min_sequence_header)
            try:
                READ_FLOOR.set(parse_floor(",".join(lines).strip()) if lines else 0)
            except ValueError as exc:
                spend_unrouted()
                raise Invalid(str(exc), code="invalid_min_sequence") from None
        return None

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        # Also reached for a WebSocket handshake (no request context): the answer is then
        # sent as the handshake's HTTP response.
        path = request.path if has_request_context() else websocket.path
        method = request.method if has_request_context() else "GET"
        mapped: RegistryError
        if exc.code is not None and 400 <= exc.code < 500:
            # No route took it (404, 405, a handshake werkzeug refused).
            try:
                spend_unrouted()
            except RateLimited as refused:  # (an error handler's own error would be a 500)
                return error_response(refused, new_request_id())
        # A WebSocket handshake on a path that only HTTP serves (`/v1/health`) is werkzeug's
        # 400 `WebsocketMismatch`: for the handshake, that path has no route, as any other.
        if exc.code == 404 or (isinstance(exc, WebsocketMismatch) and not has_request_context()):
            mapped = NotFound(f"no route for {path}", code="route_not_found")
        elif exc.code == 405:
            mapped = MethodNotAllowed(f"{method} is not allowed on {path}")
            response = error_response(mapped, new_request_id())
            for name, value in exc.get_headers():
                if name.lower() == "allow":
                    response.headers["Allow"] = value
            return response
        elif exc.code == 413:
            mapped = TooLarge("body exceeds the admission limit")
        elif exc.code is not None and 400 <= exc.code < 500:
            mapped = Invalid(exc.description or "bad request", code="bad_request")
        else:
            mapped = RegistryError("internal server error")
        return error_response(mapped, new_request_id())

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        return error_response(exc, new_request_id())

    app.asgi_app = with_framing_checks(app.asgi_app, fresh_request_id)  # type: ignore[method-assign, assignment]
    return app
