"""Discovery routes (spec 4.4, design §12): structured requests and RegistryQL."""

from __future__ import annotations

from quart import Response
from quart_trio import QuartTrio

from api.http import Ctx, deps, endpoint, json_response
from api.openapi import documented, ok
from registry.discovery import RegistryQLRequest, parse_discover_request
from registry.errors import Invalid
from registry.models import validate_model
from registry.query import RegistryQuery
from registry.registryql import parse_registryql


def register(app: QuartTrio) -> None:
    @app.post("/v1/discover")
    @endpoint("query", body_limit="query_body_bytes")
    @documented(
        "Discover entries by a structured request ({} lists everything)",
        ok={"200": ok("QueryResult", **{"X-Cache": "hit or miss"})},
        errors={
            "400": "a cursor this server did not issue for this query; more than 256 filter nodes",
        },
        body="DiscoverRequest",
    )
    async def discover(ctx: Ctx) -> Response:
        return await _answer(parse_discover_request(ctx.json()))

    @app.post("/v1/discover/registryql")
    @endpoint("query", body_limit="query_body_bytes")
    @documented(
        "Discover entries by a RegistryQL expression",
        ok={"200": ok("QueryResult", **{"X-Cache": "hit or miss"})},
        errors={
            "400": "the expression breaks the grammar (details: line, column,"
            " expected); a cursor this server did not issue for this query",
        },
        body="RegistryQLRequest",
    )
    async def discover_registryql(ctx: Ctx) -> Response:
        data = ctx.json()
        if not isinstance(data, dict):
            raise Invalid("the request must be a JSON object", code="invalid_registryql")
        request = validate_model(RegistryQLRequest, data, code="invalid_registryql")
        query = parse_registryql(request.query)
        if request.cursor is not None:
            if query.offset:
                raise Invalid("use either OFFSET or cursor, not both", code="invalid_cursor")
            query = RegistryQuery(
                entry_type=query.entry_type,
                service_type=query.service_type,
                where=query.where,
                order=query.order,
                limit=query.limit,
                cursor=request.cursor,
            )
        return await _answer(query)


async def _answer(query: RegistryQuery) -> Response:
    """The page, with `X-Cache: hit` when it came from the result cache (else `miss`)."""
    body, hit = await deps().discovery.discover_page(query)
    return json_response(body, X_Cache="hit" if hit else "miss")
