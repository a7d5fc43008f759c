"""The verifiable log's routes (issue 20, docs/transparency.md): records, checkpoints, proofs."""

from __future__ import annotations

from typing import Any

from quart import Response
from quart_trio import QuartTrio

from api.entries import int_param, version_sequence
from api.http import Ctx, deps, dumps, endpoint, json_response
from api.openapi import documented, ok
from registry.errors import Invalid
from registry.models import MAX_SAFE_INTEGER


def _param(
    name: str, description: str, *, required: bool = False, minimum: int = 1
) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": required,
        "description": description,
        "schema": {"type": "integer", "minimum": minimum, "maximum": MAX_SAFE_INTEGER},
    }


# One code for a bad treeSize, malformed or out of range (registry/usecases/transparency.py).
TREE_SIZE_CODE = "invalid_tree_size"


def _required(name: str, *, code: str | None = None) -> int:
    """A required integer parameter: `invalid_<name>` when it is missing, `code` (default the
    same) when it is malformed; the range checks of the use-case follow."""
    value = int_param(name, code=code)
    if value is None:
        raise Invalid(f"{name} is required", code=f"invalid_{name}")
    return value


CHECKPOINT_TEXT = {
    "description": "a C2SP tlog-checkpoint signed note (docs/transparency.md)",
    "content": {"text/plain": {"schema": {"type": "string"}}},
}


def register(app: QuartTrio) -> None:
    @app.get("/v1/log/records")
    @endpoint("read")
    @documented(
        "Log records in sequence order, as the Merkle tree commits to them",
        ok={"200": ok("LogRecords")},
        errors={"400": "bad from or limit"},
        params=[
            _param("from", "the first sequence (inclusive); default 1"),
            _param("limit", "page size, clamped to 1000; default 100"),
        ],
    )
    async def log_records(ctx: Ctx) -> Response:
        start = int_param("from")
        body = await deps().transparency.records(1 if start is None else start, int_param("limit"))
        return json_response(dumps(body))

    @app.get("/v1/log/checkpoint")
    @endpoint("read")
    @documented(
        "The newest signed checkpoint of the log's tree, or a stored one of a given size",
        ok={"200": CHECKPOINT_TEXT},
        errors={"400": "bad treeSize", "404": "no checkpoint of that size is stored"},
        params=[_param("treeSize", "the tree size of a stored checkpoint", minimum=0)],
    )
    async def log_checkpoint(ctx: Ctx) -> Response:
        transparency = deps().transparency
        checkpoint = await transparency.checkpoint(int_param("treeSize", code=TREE_SIZE_CODE))
        note = await transparency.served_note(checkpoint)
        return Response(note, content_type="text/plain; charset=utf-8")

    @app.get("/v1/log/proof/inclusion")
    @endpoint("read")
    @documented(
        "RFC 9162 inclusion proof of the record at a sequence in a tree",
        ok={"200": ok("InclusionProof")},
        errors={
            "400": "bad sequence or treeSize, or the sequence is not in that tree",
            "404": "treeSize is beyond the newest checkpoint",
        },
        params=[
            _param("sequence", "the record's sequence (leaf index + 1)", required=True),
            _param("treeSize", "the tree size; default the newest checkpoint's"),
        ],
    )
    async def inclusion_proof(ctx: Ctx) -> Response:
        body = await deps().transparency.inclusion(
            _required("sequence"), int_param("treeSize", code=TREE_SIZE_CODE)
        )
        return json_response(dumps(body))

    @app.get("/v1/log/proof/consistency")
    @endpoint("read")
    @documented(
        "RFC 9162 consistency proof between two tree sizes",
        ok={"200": ok("ConsistencyProof")},
        errors={"400": "bad from or to", "404": "to is beyond the newest checkpoint"},
        params=[
            _param("from", "the smaller tree size", required=True),
            _param("to", "the larger tree size", required=True),
        ],
    )
    async def consistency_proof(ctx: Ctx) -> Response:
        body = await deps().transparency.consistency(
            _required("from", code=TREE_SIZE_CODE), _required("to", code=TREE_SIZE_CODE)
        )
        return json_response(dumps(body))

    @app.get("/v1/entries/<did>/versions/<sequence>/proof")
    @endpoint("read")
    @documented(
        "Everything to verify one entry version offline: checkpoint, record, inclusion proof",
        ok={"200": ok("VersionProof")},
        errors={
            "400": "sequence is not a positive integer",
            "404": "no such version, or it is not in a checkpoint yet",
        },
    )
    async def version_proof(ctx: Ctx, did: str, sequence: str) -> Response:
        bundle = await deps().transparency.version_bundle(did, version_sequence(sequence))
        return json_response(dumps(bundle))
