"""Trust routes: attestations, reports, bonds (spec 4.3; design §8, §12)."""

from __future__ import annotations

from quart import Response, request
from quart_trio import QuartTrio

from api.entries import limit_param
from api.http import Ctx, deps, endpoint, json_response
from api.idempotency import idem_key, respond
from api.openapi import PAGE, documented, ok


def register(app: QuartTrio) -> None:
    # --- attestations ----------------------------------------------------------------------

    @app.post("/v1/attestations")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    @documented(
        "Attest an entry with a Verifiable Credential (eddsa-jcs-2022)",
        ok={"201": ok("Attestation")},
        errors={
            "400": "the credential or its proof does not verify, or its subject is not entryDid",
            "403": "issuer is not the session principal, or attest capability missing",
            "404": "entry not found",
            "409": "this credential is already attested on the entry",
        },
        body="AttestationRequest",
        idempotent=True,
    )
    async def create_attestation(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "create_attestation")
        outcome = await deps().attestations.create(ctx.principal, ctx.json(), idem)
        return respond(ctx, outcome, 201)

    @app.get("/v1/attestations/<attestation_id>")
    @endpoint("read")
    @documented(
        "One attestation record",
        ok={"200": ok("Attestation")},
        errors={"404": "attestation not found"},
    )
    async def get_attestation(ctx: Ctx, attestation_id: str) -> Response:
        return json_response((await deps().attestations.get_row(attestation_id)).doc)

    @app.post("/v1/attestations/<attestation_id>/revoke")
    @endpoint("write", auth="required")
    @documented(
        "Revoke an attestation (its issuer)",
        ok={"200": ok("Attestation")},
        errors={
            "403": "not the issuer",
            "404": "attestation not found",
            "409": "already revoked",
        },
        idempotent=True,
    )
    async def revoke_attestation(ctx: Ctx, attestation_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "revoke_attestation")
        outcome = await deps().attestations.revoke(ctx.principal, attestation_id, idem)
        return respond(ctx, outcome, 200)

    @app.get("/v1/entries/<did>/attestations")
    @endpoint("read")
    @documented(
        "Every attestation of an entry (revoked ones too), oldest first",
        ok={"200": ok("AttestationPage")},
        errors={"400": "bad limit or cursor", "404": "entry not found"},
        params=[*PAGE],
    )
    async def list_entry_attestations(ctx: Ctx, did: str) -> Response:
        body = await deps().attestations.list_for(
            did, limit=limit_param(), cursor=request.args.get("cursor")
        )
        return json_response(body)

    # --- reports ---------------------------------------------------------------------------

    @app.post("/v1/report")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    @documented(
        "Report an entry",
        ok={"201": ok("ReportCreated")},
        errors={
            "403": "report capability missing",
            "404": "entry not found",
            "409": "an open report by this reporter exists",
        },
        body="ReportRequest",
        idempotent=True,
    )
    async def create_report(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "create_report")
        outcome = await deps().reports.create(ctx.principal, ctx.json(), idem)
        return respond(ctx, outcome, 201)

    @app.get("/v1/admin/reports")
    @endpoint("read", auth="required")
    @documented(
        "Reports, oldest first (admin)",
        ok={"200": ok("ReportPage")},
        errors={"400": "bad status, limit or cursor", "403": "not admin"},
        params=[
            {
                "name": "status",
                "in": "query",
                "schema": {"enum": ["reported", "dismissed", "upheld"]},
            },
            *PAGE,
        ],
    )
    async def list_reports(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        body = await deps().reports.list(
            ctx.principal,
            status=request.args.get("status"),
            limit=limit_param(),
            cursor=request.args.get("cursor"),
        )
        return json_response(body)

    @app.post("/v1/admin/reports/<report_id>/resolve")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    @documented(
        "Dismiss or uphold a report; upholding may slash a bond (admin)",
        ok={"200": ok("Report")},
        errors={
            "403": "not admin",
            "404": "report or bond not found",
            "409": "already resolved; slash beyond the bond",
        },
        body="ResolveRequest",
        idempotent=True,
    )
    async def resolve_report(ctx: Ctx, report_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "resolve_report")
        outcome = await deps().reports.resolve(ctx.principal, report_id, ctx.json(), idem)
        return respond(ctx, outcome, 200)

    # --- bonds -----------------------------------------------------------------------------

    @app.post("/v1/admin/bonds")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    @documented(
        "Provision a bond (admin)",
        ok={"201": ok("Bond")},
        errors={
            "400": "publisherDid is not the entry's publisher",
            "403": "not admin",
            "404": "entry not found",
            "409": "bondId exists",
        },
        body="BondRequest",
        idempotent=True,
    )
    async def provision_bond(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "provision_bond")
        outcome = await deps().bonds.provision(ctx.principal, ctx.json(), idem)
        return respond(ctx, outcome, 201)

    @app.get("/v1/bonds/<bond_id>")
    @endpoint("read")
    @documented(
        "A bond and its slash history",
        ok={"200": ok("Bond")},
        errors={"404": "bond not found"},
    )
    async def get_bond(ctx: Ctx, bond_id: str) -> Response:
        return json_response(await deps().bonds.get(bond_id))

    @app.post("/v1/admin/bonds/<bond_id>/slash")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    @documented(
        "Slash a bond (admin): the amount is split harmed/reporter/treasury exactly",
        ok={"200": ok("Bond")},
        errors={
            "403": "not admin",
            "404": "bond not found",
            "409": "bond not active; slash beyond the remaining amount",
        },
        body="SlashRequest",
        idempotent=True,
    )
    async def slash_bond(ctx: Ctx, bond_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "slash_bond")
        outcome = await deps().bonds.slash(ctx.principal, bond_id, ctx.json(), idem)
        return respond(ctx, outcome, 200)

    @app.post("/v1/admin/bonds/<bond_id>/release")
    @endpoint("write", auth="required")
    @documented(
        "Release a bond (admin)",
        ok={"200": ok("Bond")},
        errors={"403": "not admin", "404": "bond not found", "409": "bond not active"},
        idempotent=True,
    )
    async def release_bond(ctx: Ctx, bond_id: str) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "release_bond")
        return respond(ctx, await deps().bonds.release(ctx.principal, bond_id, idem), 200)
