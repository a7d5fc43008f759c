"""Trust routes: attestations, reports, bonds (spec 4.3; design §8, §12)."""

from __future__ import annotations

from quart import Response, request
from quart_trio import QuartTrio

from api.entries import int_param
from api.http import Ctx, deps, endpoint, json_response
from api.idempotency import idem_key, respond


def register(app: QuartTrio) -> None:
    # --- attestations ----------------------------------------------------------------------

    @app.post("/v1/attestations")
    @endpoint("write", auth="required", body_limit="entry_body_bytes")
    async def create_attestation(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "create_attestation")
        outcome = await deps().attestations.create(ctx.principal, ctx.json(), idem)
        return respond(ctx, outcome, 201)

    @app.get("/v1/attestations/<attestation_id>")
    @endpoint("read")
    async def get_attestation(ctx: Ctx, attestation_id: str) -> Response:
        return json_response((await deps().attestations.get_row(attestation_id)).doc)

    @app.post("/v1/attestations/<attestation_id>/revoke")
    @endpoint("write", auth="required")
    async def revoke_attestation(ctx: Ctx, attestation_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "revoke_attestation")
        outcome = await deps().attestations.revoke(ctx.principal, attestation_id, idem)
        return respond(ctx, outcome, 200)

    @app.get("/v1/entries/<did>/attestations")
    @endpoint("read")
    async def list_attestations(ctx: Ctx, did: str) -> Response:
        body = await deps().attestations.list_for(
            did, limit=int_param("limit"), cursor=request.args.get("cursor")
        )
        return json_response(body)

    # --- reports ---------------------------------------------------------------------------

    @app.post("/v1/report")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    async def create_report(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "create_report")
        outcome = await deps().reports.create(ctx.principal, ctx.json(), idem)
        return respond(ctx, outcome, 201)

    @app.get("/v1/admin/reports")
    @endpoint("read", auth="required")
    async def list_reports(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        body = await deps().reports.list(
            ctx.principal,
            status=request.args.get("status"),
            limit=int_param("limit"),
            cursor=request.args.get("cursor"),
        )
        return json_response(body)

    @app.post("/v1/admin/reports/<report_id>/resolve")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    async def resolve_report(ctx: Ctx, report_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "resolve_report")
        outcome = await deps().reports.resolve(ctx.principal, report_id, ctx.json(), idem)
        return respond(ctx, outcome, 200)

    # --- bonds -----------------------------------------------------------------------------

    @app.post("/v1/admin/bonds")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    async def provision_bond(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "provision_bond")
        outcome = await deps().bonds.provision(ctx.principal, ctx.json(), idem)
        return respond(ctx, outcome, 201)

    @app.get("/v1/bonds/<bond_id>")
    @endpoint("read")
    async def get_bond(ctx: Ctx, bond_id: str) -> Response:
        return json_response(await deps().bonds.get(bond_id))

    @app.post("/v1/admin/bonds/<bond_id>/slash")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    async def slash_bond(ctx: Ctx, bond_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "slash_bond")
        outcome = await deps().bonds.slash(ctx.principal, bond_id, ctx.json(), idem)
        return respond(ctx, outcome, 200)

    @app.post("/v1/admin/bonds/<bond_id>/release")
    @endpoint("write", auth="required")
    async def release_bond(ctx: Ctx, bond_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "release_bond")
        return respond(ctx, await deps().bonds.release(ctx.principal, bond_id, idem), 200)
