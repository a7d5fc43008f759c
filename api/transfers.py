"""Transfer offer routes (spec 4.2; design §8, §12)."""

from __future__ import annotations

from quart import Response
from quart_trio import QuartTrio

from api.http import Ctx, deps, endpoint, json_response
from api.idempotency import idem_key, respond


def register(app: QuartTrio) -> None:
    @app.post("/v1/transfers/offers")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    async def create_transfer_offer(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "create_transfer_offer")
        outcome = await deps().transfers.create(ctx.principal, ctx.json(), idem)
        return respond(ctx, outcome, 201)

    @app.get("/v1/transfers/offers/<offer_id>")
    @endpoint("read")
    async def get_transfer_offer(ctx: Ctx, offer_id: str) -> Response:
        return json_response(await deps().transfers.get(offer_id))

    @app.post("/v1/transfers/offers/<offer_id>/accept")
    @endpoint("write", auth="required", body_limit="entry_body_bytes")
    async def accept_transfer_offer(ctx: Ctx, offer_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "accept_transfer_offer")
        outcome = await deps().transfers.accept(ctx.principal, offer_id, ctx.json(), idem)
        return respond(ctx, outcome, 200)

    @app.post("/v1/transfers/offers/<offer_id>/decline")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    async def decline_transfer_offer(ctx: Ctx, offer_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "decline_transfer_offer")
        data = ctx.json() if ctx.body else None
        outcome = await deps().transfers.decline(ctx.principal, offer_id, data, idem)
        return respond(ctx, outcome, 200)

    @app.post("/v1/transfers/offers/<offer_id>/cancel")
    @endpoint("write", auth="required")
    async def cancel_transfer_offer(ctx: Ctx, offer_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "cancel_transfer_offer")
        return respond(ctx, await deps().transfers.cancel(ctx.principal, offer_id, idem), 200)
