"""Discovery: the structured `DiscoverRequest`, its translation to `RegistryQuery`, keyset cursors.

Cursors are opaque and tamper-evident: base64url of a small JSON position (the last row's sort
values), bound to the query it came from by a hash of that query, and authenticated with an
HMAC keyed from the registry's own key. A cursor that fails any check is a 400.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StringConstraints, WithJsonSchema

from registry.cursors import SealedCursors
from registry.errors import Invalid
from registry.models import (
    MAX_SAFE_INTEGER,
    NO_NUL_PATTERN,
    NUMBER_SCHEMAS,
    WHOLE,
    DateTime,
    Did,
    Tag,
    Token,
    WholeInt,
    WireModel,
    validate_model,
)
from registry.query import (
    ALL_TYPES,
    MAX_IN_VALUES,
    MAX_OFFSET,
    MAX_TEXT,
    Compare,
    Contains,
    Expr,
    HasRelationship,
    InList,
    Match,
    OrderKey,
    RegistryQuery,
    check_query,
    conjunction,
    effective_order,
)
from registry.registryql import MAX_QUERY_BYTES

# The longest cursor a client may send back: the longest this codec issues (~7,000 characters:
# the sort values of a name of 256 astral characters, each written as two JSON \u escapes, and
# a DID of 2,048 characters, with the tag, in base64). At 2,048 a page ending on a long name or
# DID gave a cursor that its next request refused.
MAX_CURSOR_CHARS = 8192
Cursor = Annotated[str, StringConstraints(min_length=1, max_length=MAX_CURSOR_CHARS)]
EntryTypeOrAll = Annotated[str, StringConstraints(pattern=r"^(\*|[A-Za-z][A-Za-z0-9._-]{0,63})$")]
METADATA_KEY_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MetadataKey = Annotated[str, StringConstraints(pattern=METADATA_KEY_PATTERN)]
Scalar = Annotated[str, StringConstraints(max_length=1024)] | int | float | bool | None
# The schema of `metadata` (its keys are a pattern, and no other key is accepted).
_METADATA_SCHEMA = {
    "type": "object",
    "maxProperties": 32,
    "propertyNames": {"pattern": METADATA_KEY_PATTERN},
    "additionalProperties": {
        "anyOf": [
            {"type": "string", "maxLength": 1024, "pattern": NO_NUL_PATTERN},
            *NUMBER_SCHEMAS,
            {"type": "boolean"},
            {"type": "null"},
        ]
    },
}
# Rules between fields (request_to_query, check_query), for the OpenAPI document.
_CROSS_FIELD_RULES: dict[str, Any] = {
    "allOf": [
        {  # a direction alone does not say what to order by
            "if": {"required": ["order"], "properties": {"order": {"type": "string"}}},
            "then": {"required": ["orderBy"], "properties": {"orderBy": {"type": "string"}}},
        },
        {  # relevance ranks by text
            "if": {"required": ["orderBy"], "properties": {"orderBy": {"const": "relevance"}}},
            "then": {"required": ["text"], "properties": {"text": {"type": "string"}}},
        },
        {  # either a page offset or a cursor
            "not": {
                "required": ["offset", "cursor"],
                "properties": {
                    "offset": {"type": "integer", "minimum": 1},
                    "cursor": {"type": "string"},
                },
            }
        },
    ]
}


class RelationshipFilter(WireModel):
    relationship_type: Token | None = Field(default=None, alias="relationshipType")
    target_did: Did | None = Field(default=None, alias="targetDid")


class DiscoverRequest(WireModel):
    """`POST /v1/discover` (design §12). Every field is optional; `{}` lists everything."""

    model_config = ConfigDict(json_schema_extra=_CROSS_FIELD_RULES)

    # null is absent, as for every member: all types.
    entry_type: EntryTypeOrAll | None = Field(default=None, alias="entryType")
    text: Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT)] | None = None
    tags: Annotated[list[Tag], Field(max_length=MAX_IN_VALUES)] | None = None
    any_tags: Annotated[list[Tag], Field(min_length=1, max_length=MAX_IN_VALUES)] | None = Field(
        default=None, alias="anyTags"
    )
    publisher_did: Did | None = Field(default=None, alias="publisherDid")
    lifecycle_status: (
        Annotated[
            list[Literal["draft", "active", "deprecated", "revoked"]],
            Field(min_length=1, max_length=4),
        ]
        | None
    ) = Field(default=None, alias="lifecycleStatus")
    service_type: Token | None = Field(default=None, alias="serviceType")
    relationship: RelationshipFilter | None = None
    metadata: (
        Annotated[dict[MetadataKey, Scalar], Field(max_length=32), WithJsonSchema(_METADATA_SCHEMA)]
        | None
    ) = None
    published_after: DateTime | None = Field(default=None, alias="publishedAfter")
    published_before: DateTime | None = Field(default=None, alias="publishedBefore")
    updated_after: DateTime | None = Field(default=None, alias="updatedAfter")
    updated_before: DateTime | None = Field(default=None, alias="updatedBefore")
    order_by: Literal["relevance", "publishedAt", "updatedAt", "name", "sequence"] | None = Field(
        default=None, alias="orderBy"
    )
    order: Literal["asc", "desc"] | None = None
    # At least 1 (check_query says so, with its own code); above the maximum page size it is
    # clamped.
    limit: (
        Annotated[
            WholeInt,
            WithJsonSchema({"type": "integer", "minimum": 1, "maximum": MAX_SAFE_INTEGER}),
        ]
        | None
    ) = None
    cursor: Cursor | None = None
    offset: Annotated[int, Field(ge=0, le=MAX_OFFSET), WHOLE] | None = None


class RegistryQLRequest(WireModel):
    """`POST /v1/discover/registryql`: an expression, and the cursor of a previous page."""

    # Its length and emptiness are the parser's to report, with positions; the schema says
    # what it can (the grammar is docs/registryql.md).
    query: Annotated[
        str,
        WithJsonSchema(
            {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_QUERY_BYTES,
                "pattern": NO_NUL_PATTERN,
                "description": f"a RegistryQL expression of at most {MAX_QUERY_BYTES} bytes",
                "examples": [
                    "DISCOVER *",
                    "DISCOVER AgentDefinition WHERE tags CONTAINS 'demo' ORDER BY name LIMIT 10",
                ],
            }
        ),
    ]
    cursor: Cursor | None = None


def request_to_query(request: DiscoverRequest) -> RegistryQuery:
    parts: list[Expr] = []
    if request.text is not None:
        parts.append(Match(request.text))
    for tag in request.tags or ():
        parts.append(Contains("tags", tag))
    if request.any_tags:
        parts.append(InList("tags", tuple(request.any_tags)))
    if request.publisher_did is not None:
        parts.append(Compare("publisherDid", "=", request.publisher_did))
    if request.lifecycle_status:
        parts.append(InList("lifecycleStatus", tuple(request.lifecycle_status)))
    relationship = request.relationship
    if relationship is not None and (relationship.relationship_type or relationship.target_did):
        parts.append(HasRelationship(relationship.relationship_type, relationship.target_did))
    for key, value in (request.metadata or {}).items():
        parts.append(Compare(f"customMetadata.{key}", "=", value))
    for name, op, value in (
        ("publishedAt", ">", request.published_after),
        ("publishedAt", "<", request.published_before),
        ("updatedAt", ">", request.updated_after),
        ("updatedAt", "<", request.updated_before),
    ):
        if value is not None:
            parts.append(Compare(name, op, value))  # type: ignore[arg-type]
    order: tuple[OrderKey, ...] = ()
    if request.order_by is not None:
        default_desc = request.order_by != "name"
        descending = default_desc if request.order is None else request.order == "desc"
        order = (OrderKey(request.order_by, descending),)
    elif request.order is not None:
        raise Invalid("order needs orderBy", code="invalid_order")
    query = RegistryQuery(
        entry_type=ALL_TYPES if request.entry_type is None else request.entry_type,
        service_type=request.service_type,
        where=conjunction(parts),
        order=order,
        limit=request.limit,
        offset=request.offset,
        cursor=request.cursor,
    )
    check_query(query)
    return query


def parse_discover_request(data: Any) -> RegistryQuery:
    if not isinstance(data, dict):
        raise Invalid("the request must be a JSON object", code="invalid_query")
    return request_to_query(validate_model(DiscoverRequest, data, code="invalid_query"))


# --- cursors ------------------------------------------------------------------------------


def query_fingerprint(query: RegistryQuery) -> str:
    """What a cursor is bound to: the query without its paging fields."""
    shape = (query.entry_type, query.service_type, query.where, query.order)
    return hashlib.sha256(repr(shape).encode()).hexdigest()[:16]


# 2: relevance is ts_rank (was ts_rank_cd in 1, whose other orderings are still accepted).
CURSOR_VERSION = 2


class CursorCodec:
    def __init__(self, secret: bytes) -> None:
        self._sealed = SealedCursors(secret, b"registry discover cursor")

    def encode(self, query: RegistryQuery, position: list[Any]) -> str:
        values = [v.isoformat() if isinstance(v, datetime) else v for v in position]
        return self._sealed.seal({"v": CURSOR_VERSION, "q": query_fingerprint(query), "k": values})

    def decode(self, query: RegistryQuery, cursor: str) -> list[Any]:
        bad = Invalid("cursor is not one this server issued for this query", code="invalid_cursor")
        data = self._sealed.open(cursor, bad)
        if not isinstance(data, dict):
            raise bad
        if data.get("q") != query_fingerprint(query):
            raise bad
        version = data.get("v")
        ranked = any(key.field == "relevance" for key in effective_order(query))
        if version != CURSOR_VERSION and not (version == 1 and not ranked):
            raise bad  # version 1 ranked by ts_rank_cd: its rank values mean nothing now
        position = data.get("k")
        if not isinstance(position, list):
            raise bad
        return position
