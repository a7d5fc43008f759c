"""`GET /v1/openapi.json`: an OpenAPI 3.1 document that describes the service as it behaves,
generated from the app's route table and pydantic models; nothing in it is written by hand.

* Paths come from the route table (`app.url_map`): path, method, `operationId` (the view's
  name), path parameters; whether it needs a session and takes a body from its
  `api.http.endpoint`; the rest from its `@documented` (summary, success responses, the
  use-case's refusals, body schema, Idempotency-Key, query and header parameters), declared next
  to the route. A route without both is refused.
* Schemas come from pydantic models: those that validate requests (`registry.models`,
  `registry.discovery`) and those of what the API accepts and serves (`api/schemas.py`).
* `_harden` adds what every JSON body obeys (`registry.canonical.parse_strict`): no U+0000 in a
  string or member name, numbers within ±(2^53−1); a free-form member is a `JsonValue`.
* Every operation lists every status it can answer: the admission statuses of
  `api.http.endpoint` (413, 415 and 400 for a body, 401 for a session, 429), 400 and 409 of an
  `Idempotency-Key`, 404 for a path parameter (also one that cannot be routed), 503, and the
  use-case's own. A few refusals depend on what no schema can say (signatures and hashes, the
  RegistryQL grammar, opaque cursors, time windows, other resources); their descriptions say so.

`tests/api/test_schema_fuzz.py` holds the document to this: Schemathesis, all checks.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel
from quart import Quart

from api.http import Admission
from api.schemas import REF, SEQUENCE_TEXT_PATTERN, TIME, document_schemas, ref
from registry.discovery import DiscoverRequest, RegistryQLRequest
from registry.models import (
    MAX_SAFE_INTEGER,
    NO_NUL_PATTERN,
    NUMBER_SCHEMAS,
    Challenge,
    ChallengeRequest,
    ErrorResponse,
    RegistryEntry,
    SignInResponse,
    VerifyRequest,
)
from registry.usecases.entries import MAX_NEW_ENTRY_DID_LENGTH

# --- schemas -----------------------------------------------------------------------------------

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

JSON_VALUE: dict[str, Any] = {
    "description": (
        "Any JSON value under the registry's I-JSON rules: no U+0000 in a string or member"
        " name, numbers within ±(2^53−1) (or doubles beyond ±10^21), at most 64 levels of"
        " nesting"
    ),
    "anyOf": [
        {"type": "null"},
        {"type": "boolean"},
        *NUMBER_SCHEMAS,
        {"type": "string", "pattern": NO_NUL_PATTERN},
        {"type": "array", "items": ref("JsonValue")},
        {
            "type": "object",
            "propertyNames": {"pattern": NO_NUL_PATTERN},
            "additionalProperties": ref("JsonValue"),
        },
    ],
}

STR: dict[str, Any] = {"type": "string"}


def _entry_variants(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry schemas of each operation, from the model's (`RegistryEntry`)."""

    def variant(description: str, required: tuple[str, ...] = (), **props: Any) -> dict[str, Any]:
        schema = copy.deepcopy(entry)
        schema["description"] = description
        schema["required"] = sorted({*schema["required"], *required})
        for name, value in props.items():
            if value is None:
                del schema["properties"][name]
            else:
                schema["properties"][name] = value
        return schema

    lifecycle = entry["properties"]["lifecycleStatus"]
    return {
        "NewRegistryEntry": variant(
            "A new entry (create): it starts as draft (lifecycleStatus absent or null) or"
            " active. itemDataHash must be SHA-256 of JCS(itemData) and the signature must"
            " verify (400 otherwise)",
            lifecycleStatus={
                "anyOf": [{"enum": ["draft", "active"]}, {"type": "null"}],
                "default": None,
            },
            entryDid={**entry["properties"]["entryDid"], "maxLength": MAX_NEW_ENTRY_DID_LENGTH},
        ),
        "UpdatedRegistryEntry": variant(
            "A new version (update): entryDid is the DID in the path, and sequence the one"
            " of the version it is based on (409 when that is not the latest)",
            required=("sequence",),
            sequence={"type": "integer", "minimum": 1},
        ),
        "TransferredEntry": variant(
            "The entry a recipient accepts: the offered snapshot, signed by the recipient"
            " (spec 4.2 rules a-e); sequence is the offered one; verifiableAttestations must"
            " be omitted",
            required=("sequence",),
            sequence={"type": "integer", "minimum": 1},
            verifiableAttestations=None,
        ),
        "ServedEntry": variant(
            "An entry as served: as published, with the registry-managed sequence, updatedAt,"
            " anchorState and, when attested, verifiableAttestations",
            required=("sequence", "updatedAt", "anchorState"),
            sequence={"type": "integer", "minimum": 1},
            anchorState={"enum": ["unanchored", "pending", "anchored", "failed", "abandoned"]},
            updatedAt=TIME,
            lifecycleStatus=lifecycle,
            verifiableAttestations={"type": "array", "items": ref("JsonValue")},
        ),
    }


def _is_free_form(schema: dict[str, Any]) -> bool:
    """A schema that says nothing about the value (pydantic's `Any`)."""
    return not set(schema) - {"title", "description", "default"}


def _harden(node: Any, *, request: bool) -> Any:
    """Apply the rules of every JSON body to a request schema (`request`), and make free-form
    members `JsonValue` in both directions."""
    if isinstance(node, list):
        return [_harden(item, request=request) for item in node]
    if not isinstance(node, dict):
        return node
    if _is_free_form(node):
        return {**node, **ref("JsonValue")}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "$defs"):
            out[key] = {name: _harden(sub, request=request) for name, sub in value.items()}
        elif key in ("examples", "enum", "const", "default", "required"):
            out[key] = value
        else:
            out[key] = _harden(value, request=request)
    if out.get("additionalProperties") is True:
        out["additionalProperties"] = ref("JsonValue")
    if request and out.get("type") == "object" and out.get("additionalProperties") is not False:
        out.setdefault("propertyNames", {"pattern": NO_NUL_PATTERN})
    if request and out.get("type") == "string" and "pattern" not in out:
        out["pattern"] = NO_NUL_PATTERN
    beyond = out.get("minimum", 0) > MAX_SAFE_INTEGER or out.get("maximum", 0) < -MAX_SAFE_INTEGER
    if request and out.get("type") in ("integer", "number") and not beyond:
        out["minimum"] = max(out.get("minimum", -MAX_SAFE_INTEGER), -MAX_SAFE_INTEGER)
        out["maximum"] = min(out.get("maximum", MAX_SAFE_INTEGER), MAX_SAFE_INTEGER)
    return out


# Schemas only ever received, only ever sent, or both (a served entry is also what a client
# sends back: its request rules hold for it too).
_REQUEST_SCHEMAS = frozenset(
    {
        "DiscoverRequest",
        "RegistryQLRequest",
        "RegistryEntry",
        "NewRegistryEntry",
        "UpdatedRegistryEntry",
        "TransferredEntry",
        "ChallengeRequest",
        "Challenge",
        "SignInResponse",
        "VerifyRequest",
        "Signature",
        "Relationship",
        "SemanticAnnotation",
        "ServiceEndpoint",
        "RelationshipFilter",
        "AttestationRequest",
        "ReportRequest",
        "ResolveRequest",
        "BondRequest",
        "SlashRequest",
        "OfferRequest",
        "AcceptRequest",
        "DeclineRequest",
        "PeerUpdate",
        "FederatedQuery",
        "SlashOrder",
        "OfferSignature",
    }
)


def _schemas() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in _MODELS:
        schema = model.model_json_schema(by_alias=True, ref_template=REF + "{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    schemas.update(_entry_variants(schemas["RegistryEntry"]))
    schemas.update(document_schemas())
    federated = copy.deepcopy(schemas["DiscoverRequest"])
    federated["required"] = ["entryType"]
    # Required, and not null: null is "all types" only where entryType may be left out.
    entry_type = federated["properties"]["entryType"]
    federated["properties"]["entryType"] = next(
        alternative for alternative in entry_type["anyOf"] if alternative.get("type") == "string"
    )
    # The cursor names every peer that failed (~80 characters each): no bound but the body's
    # (limits.query_body_bytes, docs/federation.md), unlike a local query's.
    for alternative in federated["properties"]["cursor"]["anyOf"]:
        alternative.pop("maxLength", None)
    federated["description"] = "A DiscoverRequest with entryType required; paged by cursor only"
    federated["properties"]["offset"] = {"enum": [0, None]}
    schemas["FederatedQuery"] = federated
    hardened = {
        name: _harden(schema, request=name in _REQUEST_SCHEMAS) for name, schema in schemas.items()
    }
    hardened["JsonValue"] = JSON_VALUE
    return hardened


# --- operations --------------------------------------------------------------------------------


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": ref("ErrorResponse")}},
    }


def ok(name: str, description: str = "OK", **headers: str) -> dict[str, Any]:
    """A success response whose JSON body is the schema `name`, with `headers` described."""
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": ref(name)}},
    }
    if headers:
        response["headers"] = {
            header: {"description": text, "schema": {"type": "string"}}
            for header, text in headers.items()
        }
    return response


IDEMPOTENCY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": True,
    "description": "1-255 visible ASCII characters; a retry with the same key replays",
    "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[!-~]+$"},
}
AUTH: list[dict[str, list[str]]] = [{"bearer": []}, {"cookie": []}]
# `api.entries.limit_param` and `page_size`: at least 1, any int64 (spec 4.1), above the maximum
# page size clamped. int64 is said by its format: the document, served as I-JSON, can hold no
# number beyond 2^53−1.
LIMIT = {
    "name": "limit",
    "in": "query",
    "description": "page size (an int64); above the maximum page size it is clamped",
    "schema": {"type": "integer", "format": "int64", "minimum": 1},
}
SEQUENCE_CURSOR = {
    "name": "cursor",
    "in": "query",
    "description": "the cursor of the previous page",
    "schema": {"type": "string", "pattern": SEQUENCE_TEXT_PATTERN},
}


PAGE = [LIMIT, SEQUENCE_CURSOR]


def _path(name: str, description: str = "") -> dict[str, Any]:
    param: dict[str, Any] = {"name": name, "in": "path", "required": True, "schema": STR}
    if description:
        param["description"] = description
    return param


# Path parameters by name (a route's `<name>`); any other is a string.
PATH_PARAMETERS = {
    "did": _path("did", "an entry DID (any other text is simply not found)"),
    "sequence": {
        "name": "sequence",
        "in": "path",
        "required": True,
        "schema": {"type": "integer", "minimum": 1},
    },
}


@dataclass(frozen=True)
class OperationDoc:
    """What the document says of one operation beyond what its route says (its path and
    parameters, its method, its view's name as `operationId`, and from `api.http.endpoint`
    whether it needs a session and takes a body)."""

    summary: str
    ok: dict[str, Any]  # status -> response (`ok(...)`)
    errors: dict[str, str] = field(default_factory=dict)  # the use-case's refusals
    body: str | None = None  # the schema of the JSON body
    body_required: bool = True
    idempotent: bool = False  # takes an Idempotency-Key
    params: list[dict[str, Any]] = field(default_factory=list)  # query and header ones


_F = TypeVar("_F", bound=Callable[..., Any])


def documented(
    summary: str,
    *,
    ok: dict[str, Any],
    errors: dict[str, str] | None = None,
    body: str | None = None,
    body_required: bool = True,
    idempotent: bool = False,
    params: list[dict[str, Any]] | None = None,
) -> Callable[[_F], _F]:
    """Declare a route's operation for the document (under `api.http.endpoint`)."""
    doc = OperationDoc(summary, ok, errors or {}, body, body_required, idempotent, params or [])

    def mark(view: _F) -> _F:
        view.__openapi__ = doc  # type: ignore[attr-defined]
        return view

    return mark


def _operation(
    op_id: str, doc: OperationDoc, admission: Admission, path_params: list[dict[str, Any]]
) -> dict[str, Any]:
    """An operation with every status it can answer: the use-case's `errors`, and those of
    admission (`api.http.endpoint`), sessions, idempotency keys and path parameters."""
    if (doc.body is not None) != (admission.body_limit is not None):
        raise ValueError(f"{op_id}: a body schema is declared iff the endpoint admits a body")
    auth = admission.auth == "required"
    parameters = [*path_params, *doc.params]
    found: dict[str, list[str]] = {}

    def add(status: str, text: str) -> None:
        found.setdefault(status, []).append(text)

    for status, text in doc.errors.items():
        add(status, text)
    if doc.body is not None:
        add("400", "the body is not I-JSON (RFC 7493) or breaks the schema")
        add("413", "the body exceeds the admission limit")
        add("415", "Content-Type is not JSON")
    if auth:
        add("401", "session missing, malformed, expired or revoked")
    if doc.idempotent:
        parameters.append(IDEMPOTENCY)
        add("400", "Idempotency-Key missing or malformed")
        add("409", "Idempotency-Key reused for another request")
    if path_params:
        add("404", "also for a path parameter that cannot be routed")
    add("429", "rate limit exceeded")
    add("503", "the database is unavailable, or the service is stopping")
    responses: dict[str, Any] = copy.deepcopy(doc.ok)
    for status in sorted(found):
        if status not in responses:
            responses[status] = _error("; ".join(dict.fromkeys(found[status])))
    operation: dict[str, Any] = {"operationId": op_id, "summary": doc.summary}
    if parameters:
        operation["parameters"] = parameters
    if doc.body is not None:
        operation["requestBody"] = {
            "required": doc.body_required,
            "content": {"application/json": {"schema": ref(doc.body)}},
        }
    if auth:
        operation["security"] = AUTH
    operation["responses"] = responses
    return operation


_ROUTE_PARAMETER = re.compile(r"<(?:[a-z]+:)?([a-z_]+)>")


def _paths(app: Quart) -> dict[str, Any]:
    """Every HTTP route of `app`, in the order they were added (the WebSocket aside)."""
    paths: dict[str, Any] = {}
    for rule in app.url_map.iter_rules():
        if rule.websocket or rule.endpoint == "static":
            continue
        view = app.view_functions[rule.endpoint]
        doc: OperationDoc | None = getattr(view, "__openapi__", None)
        admission: Admission | None = getattr(view, "__admission__", None)
        if doc is None or admission is None:
            raise ValueError(f"route {rule.rule} is not @endpoint and @documented")
        names = _ROUTE_PARAMETER.findall(rule.rule)
        path = _ROUTE_PARAMETER.sub(r"{\1}", rule.rule)
        path_params = [PATH_PARAMETERS.get(name) or _path(name) for name in names]
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            paths.setdefault(path, {})[method.lower()] = _operation(
                rule.endpoint, doc, admission, path_params
            )
    return paths


# What a created resource leads to: operation → (target operation, its parameters from the
# response), on the operation's success response.
_ENTRY = {"did": "$response.body#/entryDid"}
_ENTRY_LINKS = {
    "get_entry": _ENTRY,
    "update_entry": _ENTRY,
    "delete_entry": _ENTRY,
    "get_entry_lineage": _ENTRY,
    "list_entry_versions": _ENTRY,
    "get_entry_version": {**_ENTRY, "sequence": "$response.body#/sequence"},
    "list_entry_attestations": _ENTRY,
    "get_anchors": _ENTRY,
}
_LINKS: dict[str, dict[str, dict[str, str]]] = {
    "create_entry": _ENTRY_LINKS,
    "update_entry": _ENTRY_LINKS,
    "accept_transfer_offer": _ENTRY_LINKS,
    "provision_bond": {
        op: {"bond_id": "$response.body#/bondId"}
        for op in ("get_bond", "slash_bond", "release_bond")
    },
    "create_attestation": {
        op: {"attestation_id": "$response.body#/attestationId"}
        for op in ("get_attestation", "revoke_attestation")
    },
    "create_report": {"resolve_report": {"report_id": "$response.body#/reportId"}},
    "create_transfer_offer": {
        op: {"offer_id": "$response.body#/offerId"}
        for op in (
            "get_transfer_offer",
            "accept_transfer_offer",
            "decline_transfer_offer",
            "cancel_transfer_offer",
        )
    },
}


def _with_links(paths: dict[str, Any]) -> dict[str, Any]:
    for item in paths.values():
        for operation in item.values():
            links = _LINKS.get(operation["operationId"])
            if links is None:
                continue
            status = min(code for code in operation["responses"] if code.startswith("2"))
            operation["responses"][status]["links"] = {
                target: {"operationId": target, "parameters": parameters}
                for target, parameters in links.items()
            }
    return paths


def openapi_document(app: Quart) -> dict[str, Any]:
    """The document of `app`'s routes (built once per app)."""
    document: dict[str, Any] | None = app.extensions.get("openapi")
    if document is None:
        document = app.extensions["openapi"] = _document(app)
    return document


def _document(app: Quart) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "registry",
            "version": "1.0.0",
            "description": (
                "Every JSON body is I-JSON (RFC 7493): no U+0000 in any string or member name,"
                " no duplicate member names, integers within ±(2^53−1), at most 64 levels of"
                " nesting; the schemas say so where they can."
            ),
        },
        "paths": _with_links(_paths(app)),
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "cookie": {"type": "apiKey", "in": "cookie", "name": "registry_session"},
            },
        },
    }
