"""Operations routes: health, deep health, the OpenAPI document."""

from __future__ import annotations

import functools
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Response, current_app, request
from quart_trio import QuartTrio

from api.http import Ctx, deps, dumps, endpoint, json_response
from api.openapi import documented, ok, openapi_document
from registry.config import Config
from registry.errors import RegistryError, Unauthorized
from registry.store.migrate import load_migrations
from registry.usecases.common import Principal

QUARANTINED_SHOWN = 20  # per peer, in the overview


def on_metrics_listener(config: Config, scope: Any = None) -> bool:
    """Whether this request (or WebSocket handshake: its `scope`) came through `metrics.listen`
    (where only /metrics is served)."""
    address = config.metrics.address
    if address is None:
        return False
    host, port = address
    server = (request.scope if scope is None else scope).get("server")
    if not server or server[1] is None or int(server[1]) != port:
        return False
    return host in ("0.0.0.0", "::", "*", str(server[0]))


async def _deep_health(principal: Principal) -> dict[str, Any]:
    principal.require("admin")
    checks = await _checks()
    if checks.get("database") == "ok":
        checks["federation"] = await deps().federation.health()
        checks["anchoring"] = await deps().anchors.health()
        log_head = await deps().store.log_head()
    else:
        # Busy or failing: not asked again (a busy pool would keep it 30 s, then a 503), so that
        # the answer is still the 200 whose status says so. The log as this process read it.
        log_head = max((cache.followed for cache in deps().caches), default=0)
    return {"status": _status(checks), "checks": checks, "logHead": log_head}


@functools.cache
def _expected_migrations() -> int:
    """The migrations this code ships with: read once (scanning them took ~1.4 ms a call)."""
    return len(load_migrations().numbered)


async def _checks() -> dict[str, str]:
    d = deps()
    checks: dict[str, str] = {}
    try:
        with trio.fail_after(2):
            version = await d.store.schema_version()
            read_only = await d.store.write_condition()  # asked now: recovery shows at once
        checks["database"] = "ok"
        expected = _expected_migrations()
        checks["migrations"] = "ok" if version == expected else f"at {version}, expected {expected}"
        # Writes: refused now (a read-only database), or the last write failed for a
        # condition of the database (a full disk) and none has succeeded since.
        refused = read_only or _write_refusal(d.write_condition())
        checks["writes"] = "ok" if refused is None else f"failing: {refused}"
    except trio.TooSlowError:
        if _pool_busy(d.store.pool_statistics()):
            # Every pooled connection is at work and the probe waited in line: the database
            # answers, slowly. Degraded, not failing: every process shares it, and a load
            # balancer that dropped each busy node would drop them all at once.
            checks["database"] = "busy: no pooled connection came free within 2 s"
        else:
            checks["database"] = "failing: TooSlowError"
    except (RegistryError, OSError) as exc:
        code = exc.code if isinstance(exc, RegistryError) else type(exc).__name__
        checks["database"] = f"failing: {code}"
    live = all(cache.enabled for cache in d.caches)
    checks["cache"] = "ok" if live else "degraded: not following the log live"
    return checks


def _pool_busy(stats: dict[str, int]) -> bool:
    """Whether every connection the pool may have is open and in use: its most, or as many
    as PostgreSQL admits (it refused more)."""
    if not stats or not stats["open"] or stats["in_use"] < stats["open"]:
        return False
    return stats["open"] >= stats["max"] or stats["held_back"] > 0


# What only a write can show: a full disk (reads, and the read-only probe, go on working).
# The other conditions of a failed write show in the database check or the probe, now.
WRITE_ONLY_CONDITIONS = frozenset({"database_full"})


def _write_refusal(condition: str | None) -> str | None:
    """The writer's last refusal, where nothing else can tell it is over (until a write
    succeeds): a full disk. A lost connection that is back, or a read-only spell the probe no
    longer sees, has passed."""
    return condition if condition in WRITE_ONLY_CONDITIONS else None


def _status(checks: dict[str, str]) -> str:
    """`failing` (503) when the database cannot be used at all; `degraded` (200) when it
    serves reads but refuses writes, or a cache is not live: reads go on, so a load balancer
    should keep the node."""
    if checks.get("database", "").startswith("failing"):
        return "failing"
    return "ok" if all(v == "ok" for v in checks.values()) else "degraded"


def register(app: QuartTrio) -> None:
    @app.get("/v1/health")
    @endpoint("read")
    @documented(
        "Basic health",
        ok={"200": ok("Health"), "503": ok("Health", "Failing")},
    )
    async def health(ctx: Ctx) -> Response:
        checks = await _checks()
        status = _status(checks)
        return json_response(
            dumps({"status": status, "checks": checks, "registryDid": deps().registry_did}),
            200 if status != "failing" else 503,
        )

    @app.get("/v1/health/deep")
    @endpoint("read", auth="required")
    @documented(
        "Deep health (admin)",
        ok={"200": ok("DeepHealth")},
        errors={"403": "not admin"},
    )
    async def deep_health(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        return json_response(dumps(await _deep_health(ctx.principal)))

    @app.get("/v1/admin/overview")
    @endpoint("read", auth="required")
    @documented(
        "The registry at a glance (admin): deep health, the log head, every peer's sync status"
        " with its latest quarantined entries, the anchoring backlog",
        ok={"200": ok("Overview")},
        errors={"403": "not admin"},
    )
    async def overview(ctx: Ctx) -> Response:
        assert ctx.principal is not None
        d = deps()
        body = await _deep_health(ctx.principal)
        body["registryDid"] = d.registry_did
        body["peers"] = await d.federation.statuses(ctx.principal, quarantined=QUARANTINED_SHOWN)
        body["anchoring"] = await d.anchors.overview(ctx.principal)
        return json_response(dumps(body))

    @app.get("/metrics")
    @endpoint("read", auth="optional")
    @documented(
        "This process's metrics, Prometheus text format (an admin session unless metrics.open)",
        ok={
            "200": {
                "description": "Prometheus text format 0.0.4",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
        errors={"401": "metrics.open is off and no session was given", "403": "not admin"},
    )
    async def metrics(ctx: Ctx) -> Response:
        d = deps()
        if not (d.config.metrics.open or on_metrics_listener(d.config)):
            if ctx.principal is None:
                raise Unauthorized("metrics need an admin session", code="session_missing")
            ctx.principal.require("admin")
        return Response(d.metrics.exposition(), content_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/openapi.json")
    @endpoint("read")
    @documented(
        "This document",
        ok={"200": ok("OpenApiDocument", "OpenAPI 3.1")},
    )
    async def openapi(ctx: Ctx) -> Response:
        # Serialised once (150 KB, ~9 ms of CPU each time before): an anonymous route.
        text = current_app.extensions.get("openapi_text")
        if text is None:
            text = current_app.extensions["openapi_text"] = dumps(openapi_document(current_app))
        return json_response(text)
