"""Sign-in routes (spec 4.6, design §5): challenge, verify, session, logout."""

from __future__ import annotations

from quart import Response
from quart_trio import QuartTrio

from api.http import SESSION_COOKIE, Ctx, deps, dumps, endpoint, json_response
from api.idempotency import idem_key, respond
from api.openapi import documented, ok
from registry.usecases.sessions import session_body


def register(app: QuartTrio) -> None:
    @app.post("/v1/auth/siws/challenge")
    @endpoint("write", body_limit="small_body_bytes")
    @documented(
        "A single-use sign-in challenge",
        ok={"200": ok("ChallengeResponse")},
        body="ChallengeRequest",
    )
    async def siws_challenge(ctx: Ctx) -> Response:
        challenge = await deps().sessions.challenge(ctx.json())
        return json_response(dumps({"challenge": challenge}))

    @app.post("/v1/auth/siws/verify")
    @endpoint("write", body_limit="small_body_bytes")
    @documented(
        "Verify a signed challenge and open a session",
        ok={"200": ok("VerifyResponse")},
        errors={
            "401": "verification failed (also a body that breaks the schema)",
            "502": "identity lookup failed",
        },
        body="VerifyRequest",
    )
    async def siws_verify(ctx: Ctx) -> Response:
        body, token = await deps().sessions.verify(ctx.json())
        response = json_response(dumps(body))
        response.set_cookie(
            SESSION_COOKIE,
            token,
            max_age=deps().config.auth.session_ttl_seconds,
            httponly=True,
            secure=True,
            samesite="Strict",
            path="/",
        )
        return response

    @app.get("/v1/auth/session")
    @endpoint("read", auth="required")
    @documented(
        "The current session",
        ok={"200": ok("Session")},
    )
    async def session(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        return json_response(dumps(session_body(ctx.principal)))

    @app.post("/v1/auth/logout")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    @documented(
        "Revoke the current session",
        ok={"200": ok("LoggedOut", "Logged out")},
        body="JsonValue",
        body_required=False,
        idempotent=True,
    )
    async def logout(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        # Scoped by session: another session of the same principal is a different logout.
        scope = "session:" + ctx.principal.token_hash.hex()
        idem = idem_key(ctx, "logout", scope=scope)
        response = respond(ctx, await deps().sessions.logout(ctx.principal, idem), 200)
        response.delete_cookie(
            SESSION_COOKIE, path="/", httponly=True, secure=True, samesite="Strict"
        )
        return response
