"""`GET /console/`: the operator console, static files shipped in the package (no build step).

The page loads its script and style from this origin only and talks to this origin only (the
overview over HTTP, the event stream over WebSocket): its Content-Security-Policy says so, and
it holds no inline script or style. docs/operations.md, "Console".
"""

from __future__ import annotations

from pathlib import Path

from quart import Response
from quart_trio import QuartTrio

from api.http import Ctx, endpoint
from api.openapi import documented
from registry.errors import NotFound

STATIC = Path(__file__).with_name("static") / "console"
FILES = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self';"
    " img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _text_response(*kinds: str) -> dict[str, object]:
    return {
        "description": ", ".join(kinds),
        "content": {kind: {"schema": {"type": "string"}} for kind in kinds},
    }


def _serve(name: str) -> Response:
    response = Response((STATIC / name).read_bytes(), content_type=FILES[name])
    response.headers["Content-Security-Policy"] = POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Cache-Control"] = "no-cache"
    return response


def register(app: QuartTrio) -> None:
    @app.get("/console/")
    @endpoint("read")
    @documented(
        "The operator console (an HTML page; an admin signs in with a session token)",
        ok={"200": _text_response("text/html")},
    )
    async def console_page(ctx: Ctx) -> Response:
        return _serve("index.html")

    @app.get("/console/<name>")
    @endpoint("read")
    @documented(
        "A file of the operator console (console.js, console.css, favicon.svg)",
        ok={"200": _text_response("text/javascript", "text/css", "image/svg+xml")},
        errors={"404": "no such file"},
    )
    async def console_file(ctx: Ctx, name: str) -> Response:
        if name not in FILES or name == "index.html":
            raise NotFound(f"no console file {name!r}", code="route_not_found")
        return _serve(name)
