"""Idempotency for every mutating operation (design §6).

Scope (principal or anonymous) × operation × `Idempotency-Key`. The request's fingerprint is
SHA-256 over method, path and JCS of the body, so whitespace and member order do not matter.
A completed request is replayed with `Idempotent-Replayed: true`; a different request under the
same key is 409 `idempotency_conflict`; the same key while the first is still running is 409
`idempotency_in_progress`. Success outcomes are recorded by the store in the transaction of
their effect; 4xx outcomes are recorded afterwards; 5xx outcomes are not recorded at all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable

import trio
from quart import Response, request

from api.errors import error_body
from api.http import Ctx, deps, json_response
from registry import canonical
from registry.errors import Conflict, Invalid, RegistryError
from registry.store import IdemKey

HEADER = "Idempotency-Key"
LEASE_SECONDS = 60.0


def _key_from_header() -> str:
    key = request.headers.get(HEADER)
    if key is None or key == "":
        raise Invalid(f"the {HEADER} header is required", code="idempotency_key_required")
    if len(key) > 255 or not all("\x21" <= c <= "\x7e" for c in key):
        raise Invalid(
            f"{HEADER} must be 1-255 visible ASCII characters", code="idempotency_key_invalid"
        )
    return key


def fingerprint(method: str, path: str, ctx: Ctx) -> bytes:
    canonical_body = canonical.canonicalize(ctx.json()) if ctx.body else b""
    return hashlib.sha256(b"\0".join([method.encode(), path.encode(), canonical_body])).digest()


async def idempotent(
    ctx: Ctx,
    operation: str,
    effect: Callable[[IdemKey], Awaitable[tuple[int, str, bool]]],
    *,
    scope: str | None = None,
) -> Response:
    """Run `effect` at most once per key. `effect` returns (status, body, recorded) where
    `recorded` says the store already wrote the idempotency record with the effect."""
    key = _key_from_header()
    if scope is None:
        scope = ctx.principal.did if ctx.principal else "anonymous"
    idem = IdemKey(scope, operation, key, fingerprint(request.method, request.path, ctx))
    store = deps().registry.store
    state = await store.idem_begin(idem, LEASE_SECONDS)
    if state.outcome == "done":
        if state.fingerprint != idem.fingerprint:
            raise Conflict(
                f"this {HEADER} was already used for a different request",
                code="idempotency_conflict",
            )
        assert state.status is not None
        assert state.response is not None
        return json_response(state.response, state.status, Idempotent_Replayed="true")
    if state.outcome == "running":
        if state.fingerprint != idem.fingerprint:
            raise Conflict(
                f"this {HEADER} is in use by a different request", code="idempotency_conflict"
            )
        raise Conflict(
            f"a request with this {HEADER} is still running", code="idempotency_in_progress"
        )
    try:
        status, body, recorded = await effect(idem)
    except RegistryError as exc:
        if exc.status < 500 and exc.code != "idempotency_conflict":
            body = error_body(exc.code, exc.message, ctx.request_id, exc.details)
            await _finish(idem, exc.status, body)
        else:
            await _finish(idem, None, None)
        raise
    except BaseException:
        await _finish(idem, None, None)
        raise
    if not recorded:
        await _finish(idem, status, body)
    return json_response(body, status)


async def idempotent_write(
    ctx: Ctx,
    operation: str,
    effect: Callable[[IdemKey], Awaitable[tuple[int, str, int | None]]],
) -> Response:
    """Like `idempotent`, for entry changes whose store write checks and records the key itself
    in one round trip. `effect` returns (status, body, replayed status or None).

    A concurrent duplicate waits for the first to commit and then receives its replay (it never
    sees 409 idempotency_in_progress). An error outcome is answered from the key's record when
    one exists, else recorded (4xx) so that a retry of the same request answers the same.
    """
    key = _key_from_header()
    scope = ctx.principal.did if ctx.principal else "anonymous"
    idem = IdemKey(scope, operation, key, fingerprint(request.method, request.path, ctx))
    store = deps().registry.store
    try:
        status, body, replayed = await effect(idem)
    except RegistryError as exc:
        if exc.status >= 500:
            raise
        state = await store.idem_lookup(idem)
        if state is not None:
            if state.fingerprint != idem.fingerprint:
                raise Conflict(
                    f"this {HEADER} was already used for a different request",
                    code="idempotency_conflict",
                ) from None
            assert state.status is not None
            assert state.response is not None
            return json_response(state.response, state.status, Idempotent_Replayed="true")
        await _finish(
            idem, exc.status, error_body(exc.code, exc.message, ctx.request_id, exc.details)
        )
        raise
    if replayed is not None:
        return json_response(body, replayed, Idempotent_Replayed="true")
    return json_response(body, status)


async def _finish(idem: IdemKey, status: int | None, body: str | None) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(5):
        await deps().registry.store.idem_finish(idem, status, body)
