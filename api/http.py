"""Per-request plumbing shared by every route: request id, admission, auth, rate limits, bodies.

`endpoint(...)` wraps a route so that every response — success or error, ours or Quart's — carries
`X-Request-Id`, the rate-limit headers of the bucket it used, and an `ErrorResponse` on failure.
Order of checks: declared size (413) → session (401/403) → rate limit (429) → body read with the
limit enforced while streaming (413) → strict JSON (400) → the handler.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import secrets
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from quart import Response, current_app, g, request
from werkzeug.exceptions import RequestEntityTooLarge

from actors.ratelimiter import RateLimiter, SessionLookups
from api.errors import body_unread, error_response, mark_body_read
from api.headers import RESPONSE_HEADERS, current_scope, header, peer_address
from api.metrics import Metrics
from registry import canonical
from registry.caches import FollowedCache
from registry.config import Config
from registry.errors import Invalid, RateLimited, TooLarge, Unauthorized, UnsupportedMediaType
from registry.metering import DB_TIME_CLASS, db_meter
from registry.ratelimit import Decision, client_host_of, client_of, joined_lines
from registry.store import Store
from registry.usecases.anchors import Anchors
from registry.usecases.common import Principal
from registry.usecases.discovery import Discovery
from registry.usecases.entries import Entries
from registry.usecases.federation import Federation
from registry.usecases.sessions import Sessions
from registry.usecases.transfers import Transfers
from registry.usecases.transparency import Transparency
from registry.usecases.trust import Attestations, Bonds, Reports

SESSION_COOKIE = "registry_session"
_UNSAFE_VALUE = re.compile(r"[\r\n\0]")  # in a response header's value
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


@dataclass
class Deps:
    """What routes need, attached to the app as `app.deps` by the composition root."""

    entries: Entries
    sessions: Sessions
    discovery: Discovery
    store: Store
    limiter: RateLimiter
    config: Config
    caches: list[FollowedCache[Any, Any]]
    metrics: Metrics
    attestations: Attestations
    reports: Reports
    bonds: Bonds
    transfers: Transfers
    anchors: Anchors
    federation: Federation
    transparency: Transparency
    write_condition: Callable[[], str | None] = lambda: None  # the writer's last refusal

    @property
    def registry_did(self) -> str:
        return self.sessions.did


def deps() -> Deps:
    return current_app.deps  # type: ignore[attr-defined, no-any-return]


@dataclass
class Ctx:
    """The state of one request, handed to the route."""

    request_id: str
    principal: Principal | None = None
    body: bytes = b""
    body_read: bool = False
    decision: Decision | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)
    _parsed: Any = None
    _plain: bool = False  # json.dumps of the parsed body is its JCS (canonical.parse_document)
    _members: dict[str, str] | None = None

    def json(self) -> Any:
        """The body under the I-JSON rules, parsed once."""
        if self._parsed is None:
            if not self.body:
                raise Invalid("a JSON body is required", code="invalid_json")
            self._parsed, self._plain = canonical.parse_document(self.body)
        return self._parsed

    def members(self) -> dict[str, str] | None:
        """The JCS text of each member of the body when it is a JSON object
        (`canonical.canonical_members`), made once: the idempotency fingerprint and the entry
        checks of one request share them. None when the body is not an object."""
        if self._members is None:
            data = self.json()
            if not isinstance(data, dict):
                return None
            self._members = canonical.canonical_members(data, plain=self._plain)
        return self._members


_ID_PREFIX = secrets.token_hex(4)  # per process: ids are unique across a deployment's nodes
_ID_COUNTER = itertools.count(1)


def fresh_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


def new_request_id() -> str:
    supplied = header(b"x-request-id")
    if supplied and _REQUEST_ID.fullmatch(supplied):
        return supplied
    return fresh_request_id()


def client_address(config: Config) -> str:
    """The client a budget is kept for (`registry.ratelimit.client_of`: an IPv6 one by its /64)."""
    return _client(config, client_of)


def client_host(config: Config) -> str:
    """The client's address as `client_address` picks it, an IPv6 one whole (not its /64):
    what the access log names."""
    return _client(config, client_host_of)


def _client(config: Config, pick: Callable[[str, str | None, int], str]) -> str:
    scope = current_scope()
    assert scope is not None, "a client's address outside a request"
    return pick(
        joined_lines(scope["headers"], b"x-forwarded-for"),
        peer_address(scope),
        config.server.trusted_proxies,
    )


def bearer_token() -> str | None:
    authorization = header(b"authorization")
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("Authorization must be 'Bearer <token>'", code="session_invalid")
        return token.strip()
    return request.cookies.get(SESSION_COOKIE) or None


async def read_body(limit: int, pay: Callable[[int], None] | None = None) -> bytes:
    """The request's body, at most `limit` bytes; `pay` is given each piece's size before the
    piece is kept (and may refuse it by raising)."""
    declared = header(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(
            f"body exceeds the admission limit of {limit} bytes", details={"limitBytes": limit}
        )
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.body:
            size += len(chunk)
            if size > limit:
                raise TooLarge(
                    f"body exceeds the admission limit of {limit} bytes",
                    details={"limitBytes": limit},
                )
            if pay is not None:
                pay(len(chunk))
            chunks.append(chunk)
    except RequestEntityTooLarge:
        raise TooLarge(
            f"body exceeds the admission limit of {limit} bytes", details={"limitBytes": limit}
        ) from None
    return b"".join(chunks)


def _check_content_type() -> None:
    content_type = request.headers.get("Content-Type")
    if content_type is None:
        return  # tolerated: the body must still be JSON
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMediaType(
            "Content-Type must be application/json", code="unsupported_media_type"
        )


async def _drain(limit: int, ctx: Ctx) -> None:
    """Read and discard the body of a request answered early (401, 415, 429, ...), so the
    connection stays usable: Hypercorn cannot recycle or even close a connection whose request
    body is unread. Bounded by the admission limit and a few seconds; otherwise the answer says
    close. Each piece is dropped as it comes: no budget paid for this body, so none of it is
    held (held whole, 20 bodies of 4 MiB each one byte short took ~80 MiB)."""
    with trio.move_on_after(5):
        size = 0
        try:
            async for chunk in request.body:
                size += len(chunk)
                if size > limit:
                    return
        except RequestEntityTooLarge:
            return
        ctx.body_read = True
        mark_body_read()


# The classes whose every request also spends a budget of its client address, and its name.
_BY_ADDRESS = {"write": "write_address", "query": "query_address"}
# The classes whose database time its client address pays after the fact, in milliseconds, from
# its DB_TIME_CLASS budget (registry/metering.py).
_PAYS_DATABASE_TIME = frozenset({"query"})


def _spend_body_bytes(d: Deps, ctx: Ctx, klass: str, address: str, size: int) -> int:
    """Spend `size` bytes of the address's byte budget, or refuse (429); returns the budget's
    size (a minute's bytes)."""
    spent = d.limiter.acquire("body_bytes", address, cost=size)
    if not spent.allowed:
        g.rate_class = "body_bytes"
        ctx.decision = None  # the answer's RateLimit-* are the byte budget's
        raise RateLimited(
            "request bodies from this client address exceed"
            " limits.body_bytes_per_minute_per_address",
            retry_after=spent.retry_after,
            limit=spent.limit,
            code=f"{klass}_rate_limited",
        )
    return spent.limit


def _paying_as_read(d: Deps, ctx: Ctx, klass: str, address: str) -> Callable[[int], None]:
    """What a body that declares no length (chunked) pays: each piece as it is read, before it
    is kept, so that no unpaid byte is held (paid once read, 120 chunked 4 MiB bodies, each a
    piece short, held ~415 MiB). Once it has paid a whole budget it pays no more, as a body
    that declares more than the budget passes on a full one."""
    paid = 0
    budget: int | None = None

    def pay(size: int) -> None:
        nonlocal paid, budget
        if budget is not None:
            size = min(size, budget - paid)
            if size <= 0:
                return
        budget = _spend_body_bytes(d, ctx, klass, address, size)
        paid += size

    return pay


@contextmanager
def _paying_database_time(d: Deps, ctx: Ctx, klass: str, address: str) -> Iterator[None]:
    """Run a request of `klass` for `address` and charge the database time its statements
    took to the address's budget when it ends, however it ends (registry/metering.py). What
    requests in flight will cost is known only when they end, so an address runs at most
    `limits.query_concurrency_per_address` at once: a burst cannot outrun its budget."""
    most = d.config.limits.query_concurrency_per_address
    if not d.limiter.enter(DB_TIME_CLASS, address, most):
        g.rate_class = "query_concurrency"
        ctx.decision = None  # the answer's RateLimit-* say how many may run
        raise RateLimited(
            f"{most} {klass} requests of this client address are running"
            " (limits.query_concurrency_per_address)",
            retry_after=1.0,
            limit=most,
            code=f"{klass}_rate_limited",
        )
    with db_meter() as meter:
        try:
            yield
        finally:
            d.limiter.leave(DB_TIME_CLASS, address)
            d.limiter.charge(DB_TIME_CLASS, address, meter.seconds * 1000)


SESSION_LOOKUPS_BUCKET = "session_lookups"  # registry_rate_limited_total's label for them


def rate_headers(decision: Decision) -> list[tuple[bytes, bytes]]:
    return [
        (b"ratelimit-limit", b"%d" % decision.limit),
        (b"ratelimit-remaining", b"%d" % decision.remaining),
        (b"ratelimit-reset", b"%d" % math.ceil(decision.reset_after)),
    ]


@dataclass(frozen=True)
class Admission:
    """What `endpoint` checks before a handler runs (the OpenAPI document reads it)."""

    klass: str  # the rate-limit class
    auth: str  # "none" | "optional" | "required"
    body_limit: str | None  # the LimitsConfig field (or property) bounding the body; None: none


def endpoint(
    klass: str,
    *,
    auth: str = "none",  # "none" | "optional" | "required"
    body_limit: str | None = None,  # a LimitsConfig field (or property) name; None: no body
) -> Callable[[Callable[..., Awaitable[Response]]], Callable[..., Awaitable[Response]]]:
    def wrap(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
        @functools.wraps(handler)
        async def route(**kwargs: Any) -> Response:
            ctx = Ctx(new_request_id())
            scope = current_scope()
            assert scope is not None, "a route outside a request"
            added = [(b"x-request-id", ctx.request_id.encode("latin-1"))]
            d = deps()
            g.rate_class = klass  # what a 429 is counted under (api/observe.py)
            try:
                limit = getattr(d.config.limits, body_limit) if body_limit else 0
                declared = header(b"content-length")
                if body_limit and declared and declared.isdigit() and int(declared) > limit:
                    raise TooLarge(
                        f"body exceeds the admission limit of {limit} bytes",
                        details={"limitBytes": limit},
                    )
                address = client_address(d.config)
                if auth != "none":
                    token = bearer_token()
                    if token is not None:
                        # A token the process does not know costs the database a lookup:
                        # within the address's budget of failed lookups (docs/limits.md,
                        # "Session tokens").
                        lookups = SessionLookups(d.limiter, address, f"{klass}_rate_limited")
                        try:
                            ctx.principal = await d.sessions.authenticate(token, lookups=lookups)
                        except RateLimited:
                            if lookups.refused:  # counted apart (api/observe.py)
                                g.rate_class = SESSION_LOOKUPS_BUCKET
                            raise
                        except Unauthorized:
                            # Failed attempts also spend the client address's bucket: guessing
                            # tokens is throttled like any other traffic.
                            ctx.decision = d.limiter.acquire(klass, address)
                            if not ctx.decision.allowed:
                                raise RateLimited(
                                    f"{klass} rate limit exceeded",
                                    retry_after=ctx.decision.retry_after,
                                    limit=ctx.decision.limit,
                                    code=f"{klass}_rate_limited",
                                ) from None
                            raise
                    elif auth == "required":
                        raise Unauthorized("a session is required", code="session_missing")
                address_class = _BY_ADDRESS.get(klass)
                if address_class is not None:
                    # Keys cost nothing to make: every write and query also spends its client
                    # address's budget, so signing in as new keys never buys an address more
                    # of them (a federated query costs every peer a query).
                    by_address = d.limiter.acquire(address_class, address)
                    if not by_address.allowed:
                        g.rate_class = address_class
                        raise RateLimited(
                            f"{klass} rate limit exceeded for this client address",
                            retry_after=by_address.retry_after,
                            limit=by_address.limit,
                            code=f"{klass}_rate_limited",
                        )
                pays_database_time = klass in _PAYS_DATABASE_TIME
                if pays_database_time:
                    # Paid after the fact: an address whose queries took more database time
                    # than its budget is refused until the budget has refilled.
                    in_debt = d.limiter.acquire(DB_TIME_CLASS, address, cost=0)
                    if not in_debt.allowed:
                        g.rate_class = DB_TIME_CLASS
                        raise RateLimited(
                            f"{klass} database time exceeded for this client address"
                            " (limits.query_db_ms_per_minute_per_address)",
                            retry_after=in_debt.retry_after,
                            limit=in_debt.limit,
                            code=f"{klass}_rate_limited",
                        )
                client = ctx.principal.did if ctx.principal else address
                ctx.decision = d.limiter.acquire(klass, client)
                if not ctx.decision.allowed:
                    raise RateLimited(
                        f"{klass} rate limit exceeded",
                        retry_after=ctx.decision.retry_after,
                        limit=ctx.decision.limit,
                        code=f"{klass}_rate_limited",
                    )
                if body_limit:
                    _check_content_type()
                    # What a body costs to parse, canonicalise and verify grows with its bytes
                    # (and more for some shapes: numbers, floats): an address's bodies share a
                    # budget of bytes, spent before any of that work. A body that declares its
                    # length pays before it is read, so that concurrent bodies are not all
                    # held in memory first; a chunked one pays each piece as it is read.
                    declared = header(b"content-length")
                    if declared is not None and declared.isdigit():
                        _spend_body_bytes(d, ctx, klass, address, int(declared))
                        ctx.body = await read_body(limit)
                    else:
                        ctx.body = await read_body(limit, _paying_as_read(d, ctx, klass, address))
                    ctx.body_read = True
                    mark_body_read()
                if pays_database_time:
                    with _paying_database_time(d, ctx, klass, address):
                        response = await handler(ctx, **kwargs)
                else:
                    response = await handler(ctx, **kwargs)
            except Exception as exc:  # mapped in one place; unknown errors become a bare 500
                # A body refused for its size is not read at all (the connection closes).
                refused_for_size = isinstance(exc, TooLarge) or g.rate_class == "body_bytes"
                if body_limit and not ctx.body_read and not refused_for_size:
                    await _drain(limit, ctx)
                response = error_response(exc, ctx.request_id)  # with its X-Request-Id
                added = []
                if isinstance(exc, RateLimited):  # with the refusing bucket's RateLimit-*
                    ctx.decision = None
            if ctx.principal is not None:
                g.principal = ctx.principal.did  # for the access log
            if body_unread():
                # Answered before reading the body (or an operation that takes none got one):
                # the rest of it may still be on the wire, so this connection cannot carry
                # another request.
                response.headers["Connection"] = "close"
            # The answer's own headers go to the ASGI entry as bytes (api/headers.py); the
            # names are none that a handler's response or `error_response` sets.
            if ctx.decision is not None and ctx.decision.allowed:
                added += rate_headers(ctx.decision)
            for name, value in ctx.extra_headers.items():
                if _UNSAFE_VALUE.search(value):  # werkzeug refused these; h11 would, later
                    raise ValueError(f"header {name} carries a line break or NUL")
                added.append((name.lower().encode("latin-1"), value.encode("latin-1")))
            scope[RESPONSE_HEADERS] = added
            return response

        route.__admission__ = Admission(klass, auth, body_limit)  # type: ignore[attr-defined]
        return route

    return wrap


def json_response(body: str | bytes, status: int = 200, **headers: str) -> Response:
    response = Response(body, status=status, content_type="application/json")
    for name, value in headers.items():
        response.headers[name.replace("_", "-")] = value
    return response


def dumps(value: Any) -> str:
    return canonical.canonicalize(value).decode("utf-8")
