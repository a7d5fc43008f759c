"""The query model: one `RegistryQuery` that `POST /v1/discover` and RegistryQL both compile to.

A query names an entry type (or all types), optionally a service endpoint type, a boolean filter
expression over the fields below, an ordering, a page size and an offset or cursor. The SQL
compiler (`registry.store.discover`) turns it into one parameterised statement; nothing from
the input is ever spliced into SQL text.

Expression nodes are frozen, hashable dataclasses in a canonical shape: `And`/`Or` are n-ary
with at least two children, none of which is of the same kind (so `a AND b AND c` is one
`And` of three), which makes "parse(render(q)) == q" a meaningful property.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Literal, Union

from registry.errors import Invalid

Value = str | int | float | bool | None
CompareOp = Literal["=", "!=", "<", ">", "<=", ">="]

ALL_TYPES = "*"
MAX_OFFSET = 10_000
MAX_IN_VALUES = 100
MAX_TEXT = 512
MAX_NODES = 256
# MATCH, and CONTAINS on name or description, filters in one query. Each is a test of text per
# candidate row, and a CONTAINS of under three characters (or a negated one) uses no index: 200
# of them OR-ed cost PostgreSQL ~1.3 s at 20,000 entries (a hostile review), ~5 ms for one.
MAX_TEXT_FILTERS = 16


@dataclass(frozen=True)
class Compare:
    field: str
    op: CompareOp
    value: Value


@dataclass(frozen=True)
class InList:
    field: str
    values: tuple[Value, ...]

    @functools.cached_property
    def typed_values(self) -> frozenset[tuple[type, Value]]:
        """The values that are strings, booleans or integers, each with its type (jsonb tells
        `true` from `1`): what a cached page's list is tested with, once per list."""
        return frozenset((type(v), v) for v in self.values if simple_value(v))

    @functools.cached_property
    def all_simple(self) -> bool:
        return all(simple_value(v) for v in self.values)


def simple_value(v: object) -> bool:
    """A string, boolean or integer: a value jsonb compares as matching does."""
    return isinstance(v, str | bool) or (isinstance(v, int) and not isinstance(v, bool))


@dataclass(frozen=True)
class Contains:
    field: str
    value: Value


@dataclass(frozen=True)
class Match:
    """Full-text match over name, description and tags."""

    text: str


@dataclass(frozen=True)
class Not:
    expr: Expr


@dataclass(frozen=True)
class And:
    exprs: tuple[Expr, ...]


@dataclass(frozen=True)
class Or:
    exprs: tuple[Expr, ...]


@dataclass(frozen=True)
class HasRelationship:
    """Some relationship of the entry has this type and/or target (both on the same element)."""

    relationship_type: str | None
    target_did: str | None


Expr = Union[Compare, InList, Contains, Match, Not, And, Or, HasRelationship]  # noqa: UP007

OrderField = Literal["relevance", "publishedAt", "updatedAt", "name", "sequence"]
ORDER_FIELDS: tuple[str, ...] = ("relevance", "publishedAt", "updatedAt", "name", "sequence")


@dataclass(frozen=True)
class OrderKey:
    field: OrderField
    descending: bool


@dataclass(frozen=True)
class RegistryQuery:
    entry_type: str = ALL_TYPES
    service_type: str | None = None
    where: Expr | None = None
    order: tuple[OrderKey, ...] = ()
    limit: int | None = None
    offset: int | None = None
    cursor: str | None = field(default=None, compare=True)


# --- fields -----------------------------------------------------------------------------------

FieldKind = Literal["text", "token", "did", "time", "int", "list", "metadata", "relationship"]


@dataclass(frozen=True)
class FieldSpec:
    kind: FieldKind
    ops: frozenset[str]


_EQ = frozenset({"=", "!=", "IN"})
_ORD = frozenset({"=", "!=", "<", ">", "<=", ">=", "IN"})

FIELDS: dict[str, FieldSpec] = {
    "entryDid": FieldSpec("did", _ORD),
    "entryType": FieldSpec("token", _EQ),
    "name": FieldSpec("text", _ORD | {"CONTAINS"}),
    "description": FieldSpec("text", frozenset({"CONTAINS"})),
    "version": FieldSpec("text", _EQ),
    "publisherDid": FieldSpec("did", _EQ),
    "lifecycleStatus": FieldSpec("token", _EQ),
    "tags": FieldSpec("list", frozenset({"CONTAINS", "IN"})),
    "serviceType": FieldSpec("list", frozenset({"=", "CONTAINS", "IN"})),
    "publishedAt": FieldSpec("time", _ORD - {"IN"}),
    "updatedAt": FieldSpec("time", _ORD - {"IN"}),
    "sequence": FieldSpec("int", _ORD),
    "relationships.targetDid": FieldSpec("relationship", frozenset({"=", "IN"})),
    "relationships.relationshipType": FieldSpec("relationship", frozenset({"=", "IN"})),
}
METADATA_PREFIX = "customMetadata."
METADATA_OPS = frozenset({"=", "!="})
_METADATA_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
LIFECYCLE_DEFAULT_EXCLUDES = ("revoked",)


def field_spec(name: str) -> FieldSpec | None:
    """The spec of a filterable field; `customMetadata.<key>` is a family of fields."""
    if name.startswith(METADATA_PREFIX):
        key = name[len(METADATA_PREFIX) :]
        return FieldSpec("metadata", METADATA_OPS) if _METADATA_KEY.match(key) else None
    return FIELDS.get(name)


def check_operator(name: str, op: str) -> str | None:
    """None when `name op …` is allowed, else a message saying why not."""
    spec = field_spec(name)
    if spec is None:
        known = ", ".join([*FIELDS, "customMetadata.<key>"])
        return f"unknown field {name!r} (fields: {known})"
    if op not in spec.ops:
        allowed = ", ".join(sorted(spec.ops))
        return f"operator {op} does not apply to {name} (allowed: {allowed})"
    return None


def mentions(expr: Expr | None, name: str) -> bool:
    """Whether the expression filters on field `name` anywhere."""
    if expr is None:
        return False
    if isinstance(expr, Compare | InList | Contains):
        return expr.field == name
    if isinstance(expr, Not):
        return mentions(expr.expr, name)
    if isinstance(expr, And | Or):
        return any(mentions(e, name) for e in expr.exprs)
    return False


def match_texts(expr: Expr | None) -> list[str]:
    """The MATCH texts outside any NOT: they rank results for `relevance` ordering."""
    if isinstance(expr, Match):
        return [expr.text]
    if isinstance(expr, And | Or):
        return [t for e in expr.exprs for t in match_texts(e)]
    return []


def count_nodes(expr: Expr | None) -> int:
    if expr is None:
        return 0
    if isinstance(expr, Not):
        return 1 + count_nodes(expr.expr)
    if isinstance(expr, And | Or):
        return 1 + sum(count_nodes(e) for e in expr.exprs)
    return 1


def count_text_filters(expr: Expr | None) -> int:
    if isinstance(expr, Not):
        return count_text_filters(expr.expr)
    if isinstance(expr, And | Or):
        return sum(count_text_filters(e) for e in expr.exprs)
    if isinstance(expr, Contains):  # tags and serviceType are array tests, on their indexes
        return 1 if expr.field in ("name", "description") else 0
    return 1 if isinstance(expr, Match) else 0


def conjunction(parts: list[Expr]) -> Expr | None:
    """`And` of `parts` in canonical shape (flattened; None when empty)."""
    flat: list[Expr] = []
    for part in parts:
        flat.extend(part.exprs if isinstance(part, And) else (part,))
    if not flat:
        return None
    return flat[0] if len(flat) == 1 else And(tuple(flat))


def effective_order(query: RegistryQuery) -> tuple[OrderKey, ...]:
    """The ordering actually applied: the query's, else relevance for text queries, else newest
    change first. The compiler breaks ties by `entryDid` (byte order) in the direction of the
    last key; `sequence` is unique and needs no tie-break."""
    if query.order:
        return query.order
    if match_texts(query.where):
        return (OrderKey("relevance", True),)
    return (OrderKey("sequence", True),)


def check_query(query: RegistryQuery) -> None:
    """Semantic checks shared by both front ends (the parsers check syntax and positions)."""
    if count_nodes(query.where) > MAX_NODES:
        raise Invalid(f"the filter has more than {MAX_NODES} nodes", code="query_too_complex")
    if count_text_filters(query.where) > MAX_TEXT_FILTERS:
        raise Invalid(
            f"the filter has more than {MAX_TEXT_FILTERS} text filters (CONTAINS, MATCH)",
            code="query_too_complex",
        )
    if query.limit is not None and query.limit < 1:
        raise Invalid("limit must be at least 1", code="invalid_limit")
    if query.offset is not None and not 0 <= query.offset <= MAX_OFFSET:
        raise Invalid(f"offset must be between 0 and {MAX_OFFSET}", code="invalid_offset")
    if query.offset and query.cursor:
        raise Invalid("use either offset or cursor, not both", code="invalid_cursor")
    fields = [k.field for k in query.order]
    if len(set(fields)) != len(fields):
        raise Invalid("each ORDER BY field may appear once", code="invalid_order")
    if "relevance" in fields and not match_texts(query.where):
        raise Invalid("ordering by relevance needs a text match", code="invalid_order")
