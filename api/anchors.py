"""Anchor routes (spec 4.3 anchors; design §8, §12)."""

from __future__ import annotations

from quart import Response, request
from quart_trio import QuartTrio

from api.entries import int_param
from api.http import Ctx, deps, endpoint, json_response
from api.idempotency import idem_key, respond


def register(app: QuartTrio) -> None:
    @app.get("/v1/anchors/<did>")
    @endpoint("read")
    async def get_anchors(ctx: Ctx, did: str) -> Response:
        body = await deps().anchors.list(
            did, limit=int_param("limit"), cursor=request.args.get("cursor")
        )
        return json_response(body)

    @app.post("/v1/admin/anchors/<intent_id>/retry")
    @endpoint("write", auth="required")
    async def retry_anchor(ctx: Ctx, intent_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "retry_anchor")
        return respond(ctx, await deps().anchors.retry(ctx.principal, intent_id, idem), 200)

    @app.post("/v1/admin/anchors/<intent_id>/abandon")
    @endpoint("write", auth="required")
    async def abandon_anchor(ctx: Ctx, intent_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "abandon_anchor")
        return respond(ctx, await deps().anchors.abandon(ctx.principal, intent_id, idem), 200)
