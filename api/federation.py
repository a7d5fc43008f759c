"""Federation routes (spec 4.5; design §9, §12)."""

from __future__ import annotations

from typing import Any

from quart import Response
from quart_trio import QuartTrio

from api.http import Ctx, deps, dumps, endpoint, json_response
from api.idempotency import idem_key, respond
from api.openapi import documented, ok
from registry.errors import Invalid, Unauthorized


def _envelope(ctx: Ctx) -> Any:
    """The body as the envelope to verify; no envelope at all is refused like a bad one (401,
    design §12), not as a malformed request."""
    try:
        return ctx.json()
    except Invalid as exc:
        raise Unauthorized(
            f"federation envelope refused: {exc.message}",
            code="envelope_invalid",
            details={"reason": "not_json"},
        ) from None


# What a peer's signed envelope can be refused for (registry/envelope.py).
ENVELOPE_REFUSED = (
    "envelope missing or malformed; signature, timestamp, nonce or controller invalid; wrong"
    " recipient; nonce replayed"
)


def register(app: QuartTrio) -> None:
    @app.post("/v1/federation/sync")
    @endpoint("write", body_limit="federation_body_bytes")
    @documented(
        "Pull local entry versions after fromSequence (a peer, by signed envelope)",
        ok={"200": ok("Envelope", "A signed sync_response")},
        errors={
            "400": "the payload is not {fromSequence, maxEntries, agreementId?}",
            "401": ENVELOPE_REFUSED,
            "403": "unknown peer; peer may not sync; agreement not active",
        },
        body="Envelope",
    )
    async def federation_sync(ctx: Ctx) -> Response:
        return json_response(await deps().federation.sync(_envelope(ctx)))

    @app.post("/v1/federation/cosignature")
    @endpoint("write", body_limit="small_body_bytes")
    @documented(
        "A peer's cosignature of one of this registry's checkpoints (signed envelope)",
        ok={"200": ok("Envelope", "A signed cosignature_response")},
        errors={
            "400": "the payload is not {treeSize, cosignature}; the cosignature does not hold",
            "401": ENVELOPE_REFUSED,
            "403": "unknown peer; peer may not sync",
            "404": "no checkpoint of that tree size is stored",
        },
        body="Envelope",
    )
    async def federation_cosignature(ctx: Ctx) -> Response:
        return json_response(await deps().federation.cosignature(_envelope(ctx)))

    @app.post("/v1/federation/discover")
    @endpoint("query", body_limit="query_body_bytes")
    @documented(
        "A peer's federated query (signed discover_request; local entries only)",
        ok={"200": ok("Envelope", "A signed discover_response")},
        errors={
            "400": "the payload is not {query: DiscoverRequest, agreementId?}",
            "401": ENVELOPE_REFUSED,
            "403": "unknown peer; peer may not discover; agreement not active",
        },
        body="Envelope",
    )
    async def federation_discover(ctx: Ctx) -> Response:
        return json_response(await deps().federation.discover_for_peer(_envelope(ctx)))

    @app.post("/v1/discover/federated")
    @endpoint("query", auth="required", body_limit="query_body_bytes")
    @documented(
        "Discover here and at every reachable peer, merged (design \u00a79)",
        ok={"200": ok("FederatedResult")},
        errors={
            "400": "invalid query; entryType missing; offset used; a cursor this"
            " server did not issue for this query",
            "403": "the session lacks discover.federated",
        },
        body="FederatedQuery",
    )
    async def discover_federated(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        return json_response(await deps().federation.discover_federated(ctx.principal, ctx.json()))

    @app.get("/v1/federation/peers")
    @endpoint("read")
    @documented(
        "The configured federation peers",
        ok={"200": ok("FederationPeers")},
    )
    async def list_federation_peers(ctx: Ctx) -> Response:
        return json_response(dumps(await deps().federation.list_peers()))

    @app.put("/v1/federation/peers/self")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    @documented(
        "A peer registers its endpoint (session of a configured peer)",
        ok={"200": ok("FederationPeer")},
        errors={"400": "endpoint is not an http(s) URL", "403": "not a federation peer"},
        body="PeerUpdate",
        idempotent=True,
    )
    async def update_federation_peer(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        idem = idem_key(ctx, "update_federation_peer")
        outcome = await deps().federation.update_self(ctx.principal, ctx.json(), idem)
        return respond(ctx, outcome, 200)

    @app.get("/v1/admin/federation/peers")
    @endpoint("read", auth="required")
    @documented(
        "Each peer's sync status: breaker, cursor, lag, latency, quarantines (admin)",
        ok={"200": ok("FederationPeerStatuses")},
        errors={"403": "not admin"},
    )
    async def federation_peer_status(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        return json_response(dumps(await deps().federation.statuses(ctx.principal)))
