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


_STR: dict[str, Any] = {"type": "string"}
_TIME: dict[str, Any] = {"type": "string", "format": "date-time"}
_AMOUNT: dict[str, Any] = {
    "type": "string",
    "pattern": r"^(0|[1-9][0-9]{0,29})(\.[0-9]{1,18})?$",
    "description": "a decimal string (exact arithmetic)",
}
_SIGNATURE: dict[str, Any] = {
    "type": "object",
    "required": ["algorithm", "keyId", "value"],
    "properties": {
        "algorithm": {"const": "Ed25519"},
        "keyId": _STR,
        "value": _STR,
        "created": _TIME,
    },
}


def _obj(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties}


def _page_of(name: str, item: str, **extra: Any) -> dict[str, Any]:
    return _obj(
        [name, "hasMore"],
        **extra,
        **{name: {"type": "array", "items": _ref(item)}},
        cursor={"type": "string", "pattern": "^[1-9][0-9]*$"},
        hasMore={"type": "boolean"},
    )


_TRUST_SCHEMAS: dict[str, Any] = {
    "AttestationRequest": _obj(
        ["attestation", "entryDid"],
        attestation={
            "type": "object",
            "description": "a W3C Verifiable Credential with an eddsa-jcs-2022 DataIntegrityProof",
        },
        entryDid=_STR,
    ),
    "Attestation": _obj(
        ["acceptedAt", "attestationId", "credential", "entryDid", "issuerDid"],
        acceptedAt=_TIME,
        attestationId=_STR,
        credential={"type": "object"},
        entryDid=_STR,
        issuerDid=_STR,
        issuedAt=_TIME,
        expiresAt=_TIME,
        revokedAt=_TIME,
    ),
    "ReportRequest": _obj(
        ["entryDid", "reason"], entryDid=_STR, reason={"type": "string", "maxLength": 2000}
    ),
    "ReportCreated": _obj(
        ["entryDid", "reportId", "status"],
        entryDid=_STR,
        reportId=_STR,
        status={"const": "reported"},
    ),
    "Report": _obj(
        ["createdAt", "entryDid", "reason", "reportId", "reporterDid", "status"],
        createdAt=_TIME,
        entryDid=_STR,
        reason=_STR,
        reportId=_STR,
        reporterDid=_STR,
        status={"enum": ["reported", "dismissed", "upheld"]},
        resolvedAt=_TIME,
        resolution={"type": "object"},
    ),
    "ResolveRequest": _obj(
        ["decision"],
        decision={"enum": ["dismiss", "uphold"]},
        note={"type": "string", "maxLength": 2000},
        slash=_obj(["bondId", "amount"], bondId=_STR, amount=_AMOUNT),
    ),
    "BondRequest": _obj(
        ["amount", "bondId", "currency", "entryDid", "publisherDid"],
        amount=_AMOUNT,
        bondId={"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"},
        currency={"type": "string", "pattern": "^[A-Z0-9]{2,10}$"},
        entryDid=_STR,
        publisherDid=_STR,
        status={"const": "active"},
    ),
    "Bond": _obj(
        [
            "amount",
            "bondId",
            "createdAt",
            "currency",
            "entryDid",
            "publisherDid",
            "registryDid",
            "remainingAmount",
            "slashHistory",
            "status",
        ],
        amount=_AMOUNT,
        bondId=_STR,
        createdAt=_TIME,
        currency=_STR,
        entryDid=_STR,
        publisherDid=_STR,
        registryDid=_STR,
        remainingAmount=_AMOUNT,
        status={"enum": ["active", "slashed", "exhausted", "released"]},
        releasedAt=_TIME,
        slashHistory={
            "type": "array",
            "items": _obj(
                ["amount", "distribution", "reason", "reporterDid", "timestamp"],
                amount=_AMOUNT,
                reason=_STR,
                reporterDid=_STR,
                timestamp=_TIME,
                distribution=_obj(
                    ["harmedPartiesShare", "reporterShare", "treasuryShare"],
                    harmedPartiesShare=_AMOUNT,
                    reporterShare=_AMOUNT,
                    treasuryShare=_AMOUNT,
                ),
            ),
        },
    ),
    "SlashRequest": _obj(
        ["amount", "reason", "reporterDid"],
        amount=_AMOUNT,
        reason={"type": "string", "maxLength": 2000},
        reporterDid=_STR,
    ),
    "OfferRequest": _obj(
        ["entryDid", "entrySequence", "recipientDid", "ownerSignature"],
        entryDid=_STR,
        entrySequence={"type": "integer", "minimum": 1},
        recipientDid=_STR,
        expiresAt=_TIME,
        ownerSignature=_SIGNATURE,
    ),
    "TransferOffer": _obj(
        [
            "createdAt",
            "entryDid",
            "entrySequence",
            "expiresAt",
            "offerId",
            "ownerDid",
            "ownerSignature",
            "recipientDid",
            "status",
        ],
        createdAt=_TIME,
        entryDid=_STR,
        entrySequence={"type": "integer"},
        expiresAt=_TIME,
        offerId=_STR,
        ownerDid=_STR,
        ownerSignature=_SIGNATURE,
        recipientDid=_STR,
        status={"enum": ["offered", "accepted", "declined", "cancelled", "expired"]},
        decidedAt=_TIME,
        declineReason=_STR,
    ),
    "AcceptRequest": _obj(["entry"], entry={"$ref": "#/components/schemas/RegistryEntry"}),
    "DeclineRequest": {
        "type": "object",
        "properties": {"reason": {"type": "string", "maxLength": 2000}},
    },
    "AttestationPage": _page_of("attestations", "Attestation", entryDid=_STR),
    "MerkleProof": _obj(
        ["root", "path", "leafHash"],
        root={"type": "string", "pattern": "^[0-9a-f]{64}$"},
        leafHash={"type": "string", "pattern": "^[0-9a-f]{64}$"},
        path={
            "type": "array",
            "items": _obj(
                ["hash", "direction"],
                hash={"type": "string", "pattern": "^[0-9a-f]{64}$"},
                direction={"enum": ["left", "right"]},
            ),
        },
    ),
    "AnchorRecord": _obj(
        ["entryDid", "itemDataHash", "blockHeight", "txHash", "anchorTime"],
        entryDid=_STR,
        itemDataHash=_STR,
        blockHeight={"type": "integer", "minimum": 0},
        txHash=_STR,
        anchorTime=_TIME,
        proof={"oneOf": [{"$ref": "#/components/schemas/MerkleProof"}, {"type": "null"}]},
    ),
    "AnchorIntent": _obj(
        [
            "intentId",
            "entryDid",
            "sequence",
            "operation",
            "state",
            "attempts",
            "availableAt",
            "createdAt",
            "updatedAt",
            "receipts",
        ],
        intentId=_STR,
        entryDid=_STR,
        sequence={"type": "integer"},
        operation={"enum": ["create", "update", "transfer", "delete"]},
        state={"enum": ["pending", "submitted", "confirmed", "failed", "abandoned"]},
        attempts={"type": "integer"},
        availableAt=_TIME,
        createdAt=_TIME,
        updatedAt=_TIME,
        transactionId=_STR,
        receipts={
            "type": "array",
            "items": _obj(
                ["blockHeight", "observedAt", "proof", "receiptKey", "state", "transactionId"],
                blockHeight={"type": ["integer", "null"]},
                observedAt=_TIME,
                proof={"oneOf": [{"$ref": "#/components/schemas/MerkleProof"}, {"type": "null"}]},
                receiptKey=_STR,
                state={"enum": ["submitted", "confirmed", "dropped"]},
                transactionId={"type": ["string", "null"]},
                anchorTime=_TIME,
            ),
        },
        anchor={"$ref": "#/components/schemas/AnchorRecord"},
    ),
    "AnchorList": _obj(
        ["anchorState", "entryDid", "hasMore", "records"],
        anchorState={"enum": ["unanchored", "pending", "anchored", "failed", "abandoned"]},
        entryDid=_STR,
        hasMore={"type": "boolean"},
        cursor={"type": "string", "minLength": 1, "maxLength": 2048, "pattern": "^[A-Za-z0-9_-]+$"},
        records={"type": "array", "items": {"$ref": "#/components/schemas/AnchorIntent"}},
    ),
    "AnchorControl": _obj(
        ["intentId", "state"], intentId=_STR, state={"enum": ["pending", "abandoned"]}
    ),
    "ReportPage": _page_of("reports", "Report"),
}


def _trust_paths() -> dict[str, Any]:
    def write(
        op_id: str,
        summary: str,
        ok: tuple[str, str],
        errors: dict[str, str],
        *,
        body: str | None = None,
        params: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        extra: dict[str, Any] = {"parameters": [*(params or []), IDEMPOTENCY], "security": AUTH}
        if body is not None:
            extra["requestBody"] = _body(body)
        responses = {
            ok[0]: _ok(ok[1]),
            "400": _error("invalid request, or Idempotency-Key missing"),
            "401": _error("session missing or invalid"),
            **{code: _error(text) for code, text in errors.items()},
        }
        return _op(op_id, summary, responses, **extra)

    def path(name: str) -> dict[str, Any]:
        return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}

    page = [
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1}},
        {"name": "cursor", "in": "query", "schema": {"type": "string", "pattern": "^[1-9][0-9]*$"}},
    ]
    offer = path("offer_id")
    return {
        "/v1/attestations": {
            "post": write(
                "create_attestation",
                "Attest an entry with a Verifiable Credential (eddsa-jcs-2022)",
                ("201", "Attestation"),
                {
                    "403": "issuer is not the session principal, or attest capability missing",
                    "404": "entry not found",
                    "409": "this credential is already attested on the entry; idempotency",
                    "413": "body exceeds the admission limit",
                },
                body="AttestationRequest",
            )
        },
        "/v1/attestations/{attestation_id}": {
            "get": _op(
                "get_attestation",
                "One attestation record",
                {"200": _ok("Attestation"), "404": _error("attestation not found")},
                parameters=[path("attestation_id")],
            )
        },
        "/v1/attestations/{attestation_id}/revoke": {
            "post": write(
                "revoke_attestation",
                "Revoke an attestation (its issuer)",
                ("200", "Attestation"),
                {
                    "403": "not the issuer",
                    "404": "attestation not found",
                    "409": "already revoked; idempotency",
                },
                params=[path("attestation_id")],
            )
        },
        "/v1/entries/{did}/attestations": {
            "get": _op(
                "list_entry_attestations",
                "Every attestation of an entry (revoked ones too), oldest first",
                {
                    "200": _ok("AttestationPage"),
                    "400": _error("bad limit or cursor"),
                    "404": _error("entry not found"),
                },
                parameters=[DID_PATH, *page],
            )
        },
        "/v1/report": {
            "post": write(
                "create_report",
                "Report an entry",
                ("201", "ReportCreated"),
                {
                    "403": "report capability missing",
                    "404": "entry not found",
                    "409": "an open report by this reporter exists; idempotency",
                    "413": "body exceeds the admission limit",
                },
                body="ReportRequest",
            )
        },
        "/v1/admin/reports": {
            "get": _op(
                "list_reports",
                "Reports, oldest first (admin)",
                {
                    "200": _ok("ReportPage"),
                    "400": _error("bad status, limit or cursor"),
                    "401": _error("no session"),
                    "403": _error("not admin"),
                },
                parameters=[
                    {
                        "name": "status",
                        "in": "query",
                        "schema": {"enum": ["reported", "dismissed", "upheld"]},
                    },
                    *page,
                ],
                security=AUTH,
            )
        },
        "/v1/admin/reports/{report_id}/resolve": {
            "post": write(
                "resolve_report",
                "Dismiss or uphold a report; upholding may slash a bond (admin)",
                ("200", "Report"),
                {
                    "403": "not admin",
                    "404": "report or bond not found",
                    "409": "already resolved; slash beyond the bond; idempotency",
                    "413": "body exceeds the admission limit",
                },
                body="ResolveRequest",
                params=[path("report_id")],
            )
        },
        "/v1/admin/bonds": {
            "post": write(
                "provision_bond",
                "Provision a bond (admin)",
                ("201", "Bond"),
                {
                    "403": "not admin",
                    "404": "entry not found",
                    "409": "bondId exists; idempotency conflict",
                    "413": "body exceeds the admission limit",
                },
                body="BondRequest",
            )
        },
        "/v1/bonds/{bond_id}": {
            "get": _op(
                "get_bond",
                "A bond and its slash history",
                {"200": _ok("Bond"), "404": _error("bond not found")},
                parameters=[path("bond_id")],
            )
        },
        "/v1/admin/bonds/{bond_id}/slash": {
            "post": write(
                "slash_bond",
                "Slash a bond (admin): the amount is split harmed/reporter/treasury exactly",
                ("200", "Bond"),
                {
                    "403": "not admin",
                    "404": "bond not found",
                    "409": "bond not active; slash beyond the remaining amount; idempotency",
                    "413": "body exceeds the admission limit",
                },
                body="SlashRequest",
                params=[path("bond_id")],
            )
        },
        "/v1/admin/bonds/{bond_id}/release": {
            "post": write(
                "release_bond",
                "Release a bond (admin)",
                ("200", "Bond"),
                {"403": "not admin", "404": "bond not found", "409": "bond not active"},
                params=[path("bond_id")],
            )
        },
        "/v1/anchors/{did}": {
            "get": _op(
                "get_anchors",
                "The entry's anchor intents and receipts, ascending (sequence, createdAt, id)",
                {
                    "200": _ok("AnchorList"),
                    "400": _error("bad limit or cursor"),
                    "404": _error("entry not found"),
                },
                parameters=[
                    DID_PATH,
                    page[0],
                    {
                        "name": "cursor",
                        "in": "query",
                        "schema": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 2048,
                            "pattern": "^[A-Za-z0-9_-]+$",
                        },
                    },
                ],
            )
        },
        "/v1/admin/anchors/{intent_id}/retry": {
            "post": write(
                "retry_anchor",
                "Requeue a failed or abandoned intent (admin)",
                ("200", "AnchorControl"),
                {
                    "403": "not admin",
                    "404": "intent not found",
                    "409": "intent state does not permit; idempotency",
                },
                params=[path("intent_id")],
            )
        },
        "/v1/admin/anchors/{intent_id}/abandon": {
            "post": write(
                "abandon_anchor",
                "Abandon a pending, submitted or failed intent (admin)",
                ("200", "AnchorControl"),
                {
                    "403": "not admin",
                    "404": "intent not found",
                    "409": "intent state does not permit; idempotency",
                },
                params=[path("intent_id")],
            )
        },
        "/v1/transfers/offers": {
            "post": write(
                "create_transfer_offer",
                "Offer an entry to a recipient (its publisher, with a signed offer)",
                ("201", "TransferOffer"),
                {
                    "403": "not the entry's publisher",
                    "404": "entry not found",
                    "409": "stale entrySequence; an open offer exists; revoked entry",
                    "413": "body exceeds the admission limit",
                },
                body="OfferRequest",
            )
        },
        "/v1/transfers/offers/{offer_id}": {
            "get": _op(
                "get_transfer_offer",
                "A transfer offer (status expired once past expiresAt)",
                {"200": _ok("TransferOffer"), "404": _error("offer not found")},
                parameters=[offer],
            )
        },
        "/v1/transfers/offers/{offer_id}/accept": {
            "post": write(
                "accept_transfer_offer",
                "Accept an offer with the recipient-signed entry (rules a-e of spec 4.2)",
                ("200", "RegistryEntry"),
                {
                    "403": "not the recipient; publisherDid not the recipient",
                    "404": "offer not found",
                    "409": "offer expired or decided; entry changed; sequence conflict",
                    "413": "body exceeds the admission limit",
                },
                body="AcceptRequest",
                params=[offer],
            )
        },
        "/v1/transfers/offers/{offer_id}/decline": {
            "post": write(
                "decline_transfer_offer",
                "Decline an offer (the recipient)",
                ("200", "TransferOffer"),
                {
                    "403": "not the recipient",
                    "404": "offer not found",
                    "409": "offer expired or already decided",
                    "413": "body exceeds the admission limit",
                },
                body="DeclineRequest",
                params=[offer],
            )
        },
        "/v1/transfers/offers/{offer_id}/cancel": {
            "post": write(
                "cancel_transfer_offer",
                "Cancel an offer (the owner)",
                ("200", "TransferOffer"),
                {
                    "403": "not the owner",
                    "404": "offer not found",
                    "409": "offer expired or already decided",
                },
                params=[offer],
            )
        },
    }


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
    schemas.update(_TRUST_SCHEMAS)
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
    paths.update(_trust_paths())
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
