"""Entry routes (spec 4.1, design §4)."""

from __future__ import annotations

import hashlib
import re
from urllib.parse import quote

from quart import Response, request
from quart_trio import QuartTrio

from api.headers import header
from api.http import Ctx, deps, dumps, endpoint, json_response
from api.idempotency import idem_key, respond
from api.openapi import LIMIT, SEQUENCE_CURSOR, STR, documented, ok
from registry.caches import Served
from registry.changes import Outcome
from registry.errors import Invalid, NotFound
from registry.models import MAX_SAFE_INTEGER
from registry.usecases.common import parse_sequence


def _etag(sequence: int) -> str:
    return f'"s{sequence}"'


def _attested_etag(served: Served, doc: str) -> str:
    """The tag of a served text other than the stored version (attestations, a later
    anchorState): its digest, made once per text (`Served.tagged`)."""
    memo = served.tagged
    if memo[0] is not doc:
        memo[1] = f'"s{served.sequence}-{hashlib.sha256(doc.encode()).hexdigest()[:16]}"'
        memo[0] = doc
    return str(memo[1])


def _entry_headers(ctx: Ctx, outcome: Outcome) -> None:
    if outcome.refusal is None and outcome.sequence is not None:
        ctx.extra_headers["ETag"] = _etag(outcome.sequence)


def _matches(if_none_match: str | None, etag: str) -> bool:
    """RFC 9110 §13.1.2: `*` or any listed tag, compared weakly."""
    if not if_none_match:
        return False
    tags = [t.strip().removeprefix("W/") for t in if_none_match.split(",")]
    return "*" in tags or etag in tags


# A decimal integer, a whole number also written with a zero fraction (`2.0`); at most int64's
# 19 digits, so that no long text is converted.
_INTEGER = re.compile(r"(-?[0-9]{1,19})(?:\.0+)?")
INT64_MAX = 2**63 - 1


def int_param(name: str, *, code: str | None = None, most: int = MAX_SAFE_INTEGER) -> int | None:
    """An integer query parameter, within ±`most` (±(2^53−1) like every number the API reads);
    refused with `code` (default `invalid_<name>`), the code its range checks use too."""
    raw = request.args.get(name)
    if raw is None:
        return None
    match = _INTEGER.fullmatch(raw)
    if match is None or abs(int(match[1])) > most:
        raise Invalid(f"{name} must be an integer within ±{most}", code=code or f"invalid_{name}")
    return int(match[1])


def limit_param() -> int | None:
    """A page's `limit` (spec 4.1: int64, minimum 1; above the maximum page size it is clamped):
    any int64 is taken, and above 2^53−1 it asks for the same page as 2^53−1."""
    limit = int_param("limit", most=INT64_MAX)
    return None if limit is None else min(limit, MAX_SAFE_INTEGER)


def version_sequence(sequence: str) -> int:
    """A version's sequence from its path segment: 400 when it is not a positive integer, 404
    when it is one beyond any sequence."""
    number = parse_sequence(sequence)
    if number is None:
        if re.fullmatch(r"[1-9][0-9]*", sequence):  # well-formed, beyond any sequence
            raise NotFound("no such version of this entry", code="version_not_found")
        raise Invalid("sequence must be a positive integer", code="invalid_sequence")
    return number


def register(app: QuartTrio) -> None:
    @app.post("/v1/entries")
    @endpoint("write", auth="required", body_limit="entry_body_bytes")
    @documented(
        "Publish a new signed entry",
        ok={"201": ok("ServedEntry", "Created", Location="the entry", ETag="its version")},
        errors={
            "400": "invalid entry: the schema, itemDataHash or the signature",
            "403": "entries.write capability missing, or publisherDid is not the session",
            "409": "the entry exists",
        },
        body="NewRegistryEntry",
        idempotent=True,
    )
    async def create_entry(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "create_entry")
        outcome = await deps().entries.create(
            ctx.principal, ctx.json(), idem, members=ctx.members()
        )
        _entry_headers(ctx, outcome)
        if outcome.refusal is None:
            ctx.extra_headers["Location"] = "/v1/entries/" + quote(ctx.json()["entryDid"], safe=":")
        return respond(ctx, outcome, 201)

    @app.put("/v1/entries/<did>")
    @endpoint("write", auth="required", body_limit="entry_body_bytes")
    @documented(
        "Publish a new version of an entry",
        ok={"200": ok("ServedEntry", ETag="the new version")},
        errors={
            "400": "invalid entry: the schema, itemDataHash, the signature, or entryDid"
            " is not the DID in the path",
            "403": "entries.write capability missing, or not the entry's publisher",
            "404": "entry not found",
            "409": "sequence is not the latest; the lifecycle cannot move so",
        },
        body="UpdatedRegistryEntry",
        idempotent=True,
    )
    async def update_entry(ctx: Ctx, did: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "update_entry")
        outcome = await deps().entries.update(
            ctx.principal, did, ctx.json(), idem, members=ctx.members()
        )
        _entry_headers(ctx, outcome)
        return respond(ctx, outcome, 200)

    @app.delete("/v1/entries/<did>")
    @endpoint("write", auth="required")
    @documented(
        "Delete an entry (writes a tombstone version)",
        ok={"200": ok("Tombstone")},
        errors={
            "403": "not the entry's publisher (nor admin), or entries.write missing",
            "404": "entry not found",
        },
        idempotent=True,
    )
    async def delete_entry(ctx: Ctx, did: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "delete_entry")
        return respond(ctx, await deps().entries.delete(ctx.principal, did, idem), 200)

    @app.get("/v1/entries/<did>")
    @endpoint("read")
    @documented(
        "The latest version of an entry",
        ok={
            "200": ok("ServedEntry", ETag="the version (and attestations)"),
            "304": {"description": "Not modified (If-None-Match)"},
        },
        errors={"404": "entry not found (or deleted)"},
        params=[{"name": "If-None-Match", "in": "header", "schema": STR}],
    )
    async def get_entry(ctx: Ctx, did: str) -> Response:
        entries = deps().entries
        served = await entries.read(did)
        doc = served.at(entries.clock_ms())
        # Attestations and the anchor state change what is served without a new version: a
        # body other than the version's stored text has a tag of its own (RFC 9110 §8.8.3).
        etag = (
            _etag(served.sequence)
            if doc is served.doc and served.stored
            else _attested_etag(served, doc)
        )
        origin = {} if served.origin is None else {"Registry-Origin": served.origin}
        if served.origin is not None:
            etag = f'"r{served.sequence}-{hashlib.sha256(served.origin.encode()).hexdigest()[:8]}"'
        if _matches(header(b"if-none-match"), etag):
            response = Response(b"", status=304, headers={"ETag": etag, **origin})
            del response.headers["Content-Type"]
            return response
        ctx.extra_headers.update(ETag=etag, **origin)  # as bytes, past werkzeug (api/http.py)
        return json_response(doc, 200)

    @app.get("/v1/entries/<did>/lineage")
    @endpoint("read")
    @documented(
        "The entry's lineage reference",
        ok={"200": ok("LineageResponse")},
        errors={"404": "entry not found"},
    )
    async def get_entry_lineage(ctx: Ctx, did: str) -> Response:
        served = await deps().entries.read(did)
        lineage = served.lineage
        origin = {} if served.origin is None else {"Registry-Origin": served.origin}
        return json_response(dumps({"entryDid": did, "lineage": lineage}), 200, **origin)

    @app.get("/v1/entries/<did>/versions")
    @endpoint("read")
    @documented(
        "Versions of an entry, newest first",
        ok={"200": ok("VersionsResponse")},
        errors={"400": "bad limit or cursor", "404": "entry not found"},
        params=[LIMIT, SEQUENCE_CURSOR],
    )
    async def list_entry_versions(ctx: Ctx, did: str) -> Response:
        docs, cursor, has_more, total, origin = await deps().entries.read_versions(
            did, limit=limit_param(), cursor=request.args.get("cursor")
        )
        head = '{"entryDid":' + dumps(did) + ',"versions":[' + ",".join(docs) + "]"
        tail = f',"hasMore":{"true" if has_more else "false"},"totalCount":{total}'
        if cursor is not None:
            tail = ',"cursor":' + dumps(cursor) + tail
        headers = {} if origin is None else {"Registry-Origin": origin}
        return json_response(head + tail + "}", 200, **headers)

    @app.get("/v1/entries/<did>/versions/<sequence>")
    @endpoint("read")
    @documented(
        "One version of an entry",
        ok={"200": ok("ServedEntry")},
        errors={
            "400": "sequence is not a positive integer",
            "404": "entry or version not found",
        },
    )
    async def get_entry_version(ctx: Ctx, did: str, sequence: str) -> Response:
        doc, origin = await deps().entries.read_version(did, version_sequence(sequence))
        return json_response(doc, 200, **({} if origin is None else {"Registry-Origin": origin}))
