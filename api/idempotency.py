"""The edge of idempotency (design §6): the key and fingerprint in, the outcome out as HTTP.

The mechanism itself is below the API (`registry.changes.ChangeLog` and the store's append
path): this module only reads the `Idempotency-Key` header, fingerprints the request (SHA-256
over method, path and JCS of the body, so whitespace and member order do not matter), and maps
an `Outcome` to a response: a result with the operation's success status, a refusal as its error,
and `Idempotent-Replayed: true` on either when it is the key's recorded outcome.
"""

from __future__ import annotations

import hashlib
import re

from quart import Response, request

from api.headers import header_lines
from api.http import Ctx, json_response
from registry import canonical
from registry.changes import IdemKey, Outcome
from registry.errors import Invalid

HEADER = "Idempotency-Key"
SEQUENCE_HEADER = "Registry-Sequence"
_HEADER_NAME = HEADER.lower().encode()
_KEY = re.compile("[\x21-\x7e]{1,255}")  # visible ASCII, no space


def idem_key(ctx: Ctx, operation: str, *, scope: str | None = None) -> IdemKey:
    """The request's idempotency key (400 when the header is missing or malformed).

    Scope: the principal (or "anonymous") unless the operation names another. A body that is
    not JSON is refused first (`invalid_json`), as docs/api.md orders the checks."""
    if ctx.body:
        ctx.json()
    lines = header_lines(_HEADER_NAME)
    if len(lines) > 1:
        # Which one is meant? A proxy may take the last where this would take the first: the
        # same request, two keys. (A structured-field Item, as the IETF draft defines the
        # header, is invalid when repeated too.)
        raise Invalid(
            f"send one {HEADER} header (this request has {len(lines)})",
            code="idempotency_key_invalid",
        )
    key = lines[0] if lines else None
    if key is None or key == "":
        raise Invalid(f"the {HEADER} header is required", code="idempotency_key_required")
    if _KEY.fullmatch(key) is None:
        raise Invalid(
            f"{HEADER} must be 1-255 visible ASCII characters", code="idempotency_key_invalid"
        )
    if scope is None:
        scope = ctx.principal.did if ctx.principal else "anonymous"
    return IdemKey(scope, operation, key, fingerprint(request.method, request.path, ctx))


def fingerprint(method: str, path: str, ctx: Ctx) -> bytes:
    """SHA-256 over method, path and JCS of the body (empty without one). An object's JCS is
    joined from its members' (`Ctx.members`), which the entry checks then reuse."""
    canonical_body = b""
    if ctx.body:
        members = ctx.members()
        canonical_body = (
            canonical.canonicalize(ctx.json())
            if members is None
            else canonical.join_members(members).encode("utf-8")
        )
    return hashlib.sha256(b"\0".join([method.encode(), path.encode(), canonical_body])).digest()


def respond(ctx: Ctx, outcome: Outcome, status: int) -> Response:
    """The response to an idempotent operation's outcome; a refusal is raised as its error
    (the endpoint maps it), carrying the replay header when it was recorded before."""
    if outcome.replayed:
        ctx.extra_headers["Idempotent-Replayed"] = "true"
    body = outcome.unwrap()
    if outcome.sequence is not None:
        # The position the write took: what a later GET may name in Registry-Min-Sequence.
        ctx.extra_headers[SEQUENCE_HEADER] = str(outcome.sequence)
    return json_response(body, status)
