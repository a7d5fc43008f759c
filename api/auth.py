"""Sign-in routes (spec 4.6, design §5): challenge, verify, session, logout."""

from __future__ import annotations

from quart import Response
from quart_trio import QuartTrio

from api.http import SESSION_COOKIE, Ctx, deps, dumps, endpoint, json_response
from api.idempotency import idempotent
from registry.service import session_body
from registry.store import IdemKey


def register(app: QuartTrio) -> None:
    @app.post("/v1/auth/siws/challenge")
    @endpoint("write", body_limit="small_body_bytes")
    async def siws_challenge(ctx: Ctx) -> Response:
        challenge = await deps().registry.challenge(ctx.json())
        return json_response(dumps({"challenge": challenge}))

    @app.post("/v1/auth/siws/verify")
    @endpoint("write", body_limit="small_body_bytes")
    async def siws_verify(ctx: Ctx) -> Response:
        body, token = await deps().registry.verify(ctx.json())
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
    async def session(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        return json_response(dumps(session_body(ctx.principal)))

    @app.post("/v1/auth/logout")
    @endpoint("write", auth="required", body_limit="small_body_bytes")
    async def logout(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        principal = ctx.principal

        async def effect(idem: IdemKey) -> tuple[int, str, bool]:
            await deps().registry.logout(principal)
            return 200, dumps({"loggedOut": True}), False

        # Scoped by session: another session of the same principal is a different logout.
        scope = "session:" + principal.token_hash.hex()
        response = await idempotent(ctx, "logout", effect, scope=scope)
        response.delete_cookie(
            SESSION_COOKIE, path="/", httponly=True, secure=True, samesite="Strict"
        )
        return response
