"""Transfer offer routes (spec 4.2; design §8, §12)."""

from __future__ import annotations

from quart import Response
from quart_trio import QuartTrio

from api.http import Ctx, deps, endpoint, json_response
from api.idempotency import idem_key, respond
from api.openapi import documented, ok


def register(app: QuartTrio) -> None:
    @app.post("/v1/transfers/offers")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    @documented(
        "Offer an entry to a recipient (its publisher, with a signed offer)",
        ok={"201": ok("TransferOffer")},
        errors={
            "400": "recipientDid is the owner; expiresAt not within 30 days; the"
            " owner's signature does not verify",
            "403": "not the entry's publisher",
            "404": "entry not found",
            "409": "stale entrySequence; an open offer exists; revoked entry",
        },
        body="OfferRequest",
        idempotent=True,
    )
    async def create_transfer_offer(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "create_transfer_offer")
        outcome = await deps().transfers.create(ctx.principal, ctx.json(), idem)
        return respond(ctx, outcome, 201)

    @app.get("/v1/transfers/offers/<offer_id>")
    @endpoint("read")
    @documented(
        "A transfer offer (status expired once past expiresAt)",
        ok={"200": ok("TransferOffer")},
        errors={"404": "offer not found"},
    )
    async def get_transfer_offer(ctx: Ctx, offer_id: str) -> Response:
        return json_response(await deps().transfers.get(offer_id))

    @app.post("/v1/transfers/offers/<offer_id>/accept")
    @endpoint("write", auth="required", body_limit="accept_body_bytes")
    @documented(
        "Accept an offer with the recipient-signed entry (rules a-e of spec 4.2)",
        ok={"200": ok("ServedEntry")},
        errors={
            "400": "the entry is not the offered one, changes a field, or does not verify",
            "403": "not the recipient; publisherDid not the recipient",
            "404": "offer not found",
            "409": "offer expired or decided; entry changed; sequence conflict",
        },
        body="AcceptRequest",
        idempotent=True,
    )
    async def accept_transfer_offer(ctx: Ctx, offer_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "accept_transfer_offer")
        outcome = await deps().transfers.accept(ctx.principal, offer_id, ctx.json(), idem)
        return respond(ctx, outcome, 200)

    @app.post("/v1/transfers/offers/<offer_id>/decline")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    @documented(
        "Decline an offer (the recipient)",
        ok={"200": ok("TransferOffer")},
        errors={
            "403": "not the recipient",
            "404": "offer not found",
            "409": "offer expired or already decided",
        },
        body="DeclineRequest",
        body_required=False,
        idempotent=True,
    )
    async def decline_transfer_offer(ctx: Ctx, offer_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "decline_transfer_offer")
        data = ctx.json() if ctx.body else None
        outcome = await deps().transfers.decline(ctx.principal, offer_id, data, idem)
        return respond(ctx, outcome, 200)

    @app.post("/v1/transfers/offers/<offer_id>/cancel")
    @endpoint("write", auth="required")
    @documented(
        "Cancel an offer (the owner)",
        ok={"200": ok("TransferOffer")},
        errors={
            "403": "not the owner",
            "404": "offer not found",
            "409": "offer expired or already decided",
        },
        idempotent=True,
    )
    async def cancel_transfer_offer(ctx: Ctx, offer_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "cancel_transfer_offer")
        return respond(ctx, await deps().transfers.cancel(ctx.principal, offer_id, idem), 200)
