"""`GET /v1/openapi.json`: an OpenAPI 3.1 document generated from the wire models."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel

from registry.discovery import DiscoverRequest, RegistryQLRequest
from registry.models import (
    Challenge,
    ChallengeRequest,
    ErrorResponse,
    RegistryEntry,
    SignInResponse,
    VerifyRequest,
)

_MODELS: list[type[BaseModel]] = [
    DiscoverRequest,
    RegistryQLRequest,
    RegistryEntry,
    ErrorResponse,
    ChallengeRequest,
    Challenge,
    SignInResponse,
    VerifyRequest,
]

_HAND_SCHEMAS: dict[str, Any] = {
    "VersionsResponse": {
        "type": "object",
        "required": ["entryDid", "versions", "hasMore", "totalCount"],
        "properties": {
            "entryDid": {"type": "string"},
            "versions": {"type": "array", "items": {"$ref": "#/components/schemas/RegistryEntry"}},
            "cursor": {"type": "string", "pattern": "^[1-9][0-9]*$"},
            "hasMore": {"type": "boolean"},
            "totalCount": {"type": "integer"},
        },
    },
    "QueryResult": {
        "type": "object",
        "required": ["entries", "hasMore", "totalCount"],
        "properties": {
            "entries": {"type": "array", "items": {"$ref": "#/components/schemas/RegistryEntry"}},
            "cursor": {"type": "string", "description": "opaque; absent on the last page"},
            "hasMore": {"type": "boolean"},
            "totalCount": {"type": "integer"},
        },
    },
    "LineageResponse": {
        "type": "object",
        "required": ["entryDid", "lineage"],
        "properties": {"entryDid": {"type": "string"}, "lineage": {}},
    },
    "Tombstone": {
        "type": "object",
        "required": ["entryDid", "lifecycleStatus", "sequence", "deletedAt"],
        "properties": {
            "entryDid": {"type": "string"},
            "lifecycleStatus": {"const": "deleted"},
            "sequence": {"type": "integer"},
            "deletedAt": {"type": "string", "format": "date-time"},
        },
    },
    "ChallengeResponse": {
        "type": "object",
        "required": ["challenge"],
        "properties": {"challenge": {"$ref": "#/components/schemas/Challenge"}},
    },
    "VerifyResponse": {
        "type": "object",
        "required": [
            "expiresAtMs",
            "hmrDid",
            "rootDid",
            "rootKind",
            "sessionExpiresAtMs",
            "sessionToken",
            "signerPublicKey",
        ],
        "properties": {
            "expiresAtMs": {"type": "integer"},
            "hmrDid": {"type": "string"},
            "rootDid": {"type": "string"},
            "rootKind": {"type": "string"},
            "sessionExpiresAtMs": {"type": "integer"},
            "sessionToken": {"type": "string"},
            "signerPublicKey": {"type": "string"},
            "signerDid": {"type": "string"},
            "capabilities": {"type": "array", "items": {"type": "string"}},
        },
    },
    "Session": {
        "type": "object",
        "required": ["expiresAtMs", "hmrDid", "rootDid", "rootKind"],
        "properties": {
            "expiresAtMs": {"type": "integer"},
            "hmrDid": {"type": "string"},
            "rootDid": {"type": "string"},
            "rootKind": {"type": "string"},
            "signerDid": {"type": "string"},
            "capabilities": {"type": "array", "items": {"type": "string"}},
        },
    },
    "Health": {
        "type": "object",
        "required": ["status", "checks"],
        "properties": {
            "status": {"enum": ["ok", "degraded", "failing"]},
            "checks": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    },
}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": _ref("ErrorResponse")}},
    }


def _ok(name: str, description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


IDEMPOTENCY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": True,
    "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[!-~]+$"},
}
DID_PATH = {"name": "did", "in": "path", "required": True, "schema": {"type": "string"}}
AUTH: list[dict[str, list[str]]] = [{"bearer": []}, {"cookie": []}]


def _op(op_id: str, summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    codes = {"429": _error("rate limit exceeded"), **responses}
    return {"operationId": op_id, "summary": summary, "responses": codes, **extra}


def _body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(name)}}}


@functools.cache
def openapi_document() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in _MODELS:
        schema = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    schemas.update(_HAND_SCHEMAS)
    write_errors = {
        "400": _error("invalid request or entry"),
        "401": _error("session missing or invalid"),
        "403": _error("capability missing or publisher mismatch"),
        "409": _error("conflict (entry exists, sequence, lifecycle, idempotency)"),
        "413": _error("body exceeds the admission limit"),
    }
    paths: dict[str, Any] = {
        "/v1/entries": {
            "post": _op(
                "create_entry",
                "Publish a new signed entry",
                {"201": _ok("RegistryEntry", "Created"), **write_errors},
                parameters=[IDEMPOTENCY],
                requestBody=_body("RegistryEntry"),
                security=AUTH,
            )
        },
        "/v1/entries/{did}": {
            "get": _op(
                "get_entry",
                "The latest version of an entry",
                {
                    "200": _ok("RegistryEntry"),
                    "304": {"description": "Not modified"},
                    "404": _error("entry not found"),
                },
                parameters=[DID_PATH],
            ),
            "put": _op(
                "update_entry",
                "Publish a new version of an entry",
                {"200": _ok("RegistryEntry"), "404": _error("entry not found"), **write_errors},
                parameters=[DID_PATH, IDEMPOTENCY],
                requestBody=_body("RegistryEntry"),
                security=AUTH,
            ),
            "delete": _op(
                "delete_entry",
                "Delete an entry (writes a tombstone version)",
                {"200": _ok("Tombstone"), "404": _error("entry not found"), **write_errors},
                parameters=[DID_PATH, IDEMPOTENCY],
                security=AUTH,
            ),
        },
        "/v1/entries/{did}/lineage": {
            "get": _op(
                "get_entry_lineage",
                "The entry's lineage reference",
                {"200": _ok("LineageResponse"), "404": _error("entry not found")},
                parameters=[DID_PATH],
            )
        },
        "/v1/entries/{did}/versions": {
            "get": _op(
                "list_entry_versions",
                "Versions of an entry, newest first",
                {
                    "200": _ok("VersionsResponse"),
                    "400": _error("bad limit or cursor"),
                    "404": _error("entry not found"),
                },
                parameters=[
                    DID_PATH,
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1}},
                    {
                        "name": "cursor",
                        "in": "query",
                        "schema": {"type": "string", "pattern": "^[1-9][0-9]*$"},
                    },
                ],
            )
        },
        "/v1/entries/{did}/versions/{sequence}": {
            "get": _op(
                "get_entry_version",
                "One version of an entry",
                {"200": _ok("RegistryEntry"), "404": _error("entry or version not found")},
                parameters=[
                    DID_PATH,
                    {
                        "name": "sequence",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "integer", "minimum": 1},
                    },
                ],
            )
        },
        "/v1/discover": {
            "post": _op(
                "discover",
                "Discover entries by a structured request ({} lists everything)",
                {
                    "200": _ok("QueryResult"),
                    "400": _error("invalid request or cursor"),
                    "413": _error("body exceeds 64 KiB"),
                },
                requestBody=_body("DiscoverRequest"),
            )
        },
        "/v1/discover/registryql": {
            "post": _op(
                "discover_registryql",
                "Discover entries by a RegistryQL expression",
                {
                    "200": _ok("QueryResult"),
                    "400": _error("invalid expression (details: line, column, expected)"),
                    "413": _error("body exceeds 64 KiB"),
                },
                requestBody=_body("RegistryQLRequest"),
            )
        },
        "/v1/auth/siws/challenge": {
            "post": _op(
                "siws_challenge",
                "A single-use sign-in challenge",
                {"200": _ok("ChallengeResponse"), "400": _error("invalid challenge request")},
                requestBody=_body("ChallengeRequest"),
            )
        },
        "/v1/auth/siws/verify": {
            "post": _op(
                "siws_verify",
                "Verify a signed challenge and open a session",
                {
                    "200": _ok("VerifyResponse"),
                    "401": _error("verification failed"),
                    "502": _error("identity lookup failed"),
                },
                requestBody=_body("VerifyRequest"),
            )
        },
        "/v1/auth/session": {
            "get": _op(
                "session",
                "The current session",
                {"200": _ok("Session"), "401": _error("session missing, expired or unknown")},
                security=AUTH,
            )
        },
        "/v1/auth/logout": {
            "post": _op(
                "logout",
                "Revoke the current session",
                {"200": {"description": "Logged out"}, "401": _error("session missing")},
                parameters=[IDEMPOTENCY],
                security=AUTH,
            )
        },
        "/v1/health": {
            "get": _op(
                "health",
                "Basic health",
                {"200": _ok("Health"), "503": _ok("Health", "Failing")},
            )
        },
        "/v1/health/deep": {
            "get": _op(
                "deep_health",
                "Deep health (admin)",
                {"200": _ok("Health"), "401": _error("no session"), "403": _error("not admin")},
                security=AUTH,
            )
        },
        "/v1/openapi.json": {
            "get": _op(
                "openapi",
                "This document",
                {"200": {"description": "OpenAPI 3.1 document"}},
            )
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "registry", "version": "1.0.0"},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "cookie": {"type": "apiKey", "in": "cookie", "name": "registry_session"},
            },
        },
    }
