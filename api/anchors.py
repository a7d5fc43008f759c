"""Anchor routes (spec 4.3 anchors; design §8, §12)."""

from __future__ import annotations

from quart import Response, request
from quart_trio import QuartTrio

from api.entries import limit_param
from api.http import Ctx, deps, endpoint, json_response
from api.idempotency import idem_key, respond
from api.openapi import LIMIT, documented, ok

# What an admin's retry or abandon of an intent can meet.
CONTROL_ERRORS = {
    "403": "not admin",
    "404": "intent not found",
    "409": "the intent's state does not permit it",
}


def register(app: QuartTrio) -> None:
    @app.get("/v1/anchors/<did>")
    @endpoint("read")
    @documented(
        "The entry's anchor intents and receipts, ascending (sequence, createdAt, id)",
        ok={"200": ok("AnchorList")},
        errors={
            "400": "bad limit, or a cursor this server did not issue for the entry",
            "404": "entry not found",
        },
        params=[
            LIMIT,
            {
                "name": "cursor",
                "in": "query",
                "schema": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 2048,
                    "pattern": "^[A-Za-z0-9_-]+$",
                },
            },
        ],
    )
    async def get_anchors(ctx: Ctx, did: str) -> Response:
        body = await deps().anchors.list(
            did, limit=limit_param(), cursor=request.args.get("cursor")
        )
        return json_response(body)

    @app.post("/v1/admin/anchors/<intent_id>/retry")
    @endpoint("write", auth="required")
    @documented(
        "Requeue a failed or abandoned intent (admin)",
        ok={"200": ok("AnchorControl")},
        errors=CONTROL_ERRORS,
        idempotent=True,
    )
    async def retry_anchor(ctx: Ctx, intent_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "retry_anchor")
        return respond(ctx, await deps().anchors.retry(ctx.principal, intent_id, idem), 200)

    @app.post("/v1/admin/anchors/<intent_id>/abandon")
    @endpoint("write", auth="required")
    @documented(
        "Abandon a pending, submitted or failed intent (admin)",
        ok={"200": ok("AnchorControl")},
        errors=CONTROL_ERRORS,
        idempotent=True,
    )
    async def abandon_anchor(ctx: Ctx, intent_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "abandon_anchor")
        return respond(ctx, await deps().anchors.abandon(ctx.principal, intent_id, idem), 200)
