"""Whether one entry can match a `RegistryQuery`: what keeps cached discovery pages valid.

A change to entry E leaves a discovery result untouched when E matches the query neither before
nor after the change: the set of matching entries and their sort keys are then the same, so are
the page and the count. `may_match` answers False only when that is certain from E's stored
document, with the semantics of the SQL compiler (`registry/store/discover.py`) over the columns
`entry_projection` derives (migration 0002). Full-text MATCH is decided by the database when it
was asked (`facts_of(..., asked=, matched=)`). Whatever else Python cannot decide exactly as
PostgreSQL does is "maybe" (True): MATCH not asked about (stemming), substrings of non-ASCII text
(`lower()` may differ), `<`/`>` on text in the database's collation, dates PostgreSQL would parse
differently, JSON values other than strings, integers and booleans.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from registry.models import parse_datetime
from registry.query import (
    ALL_TYPES,
    LIFECYCLE_DEFAULT_EXCLUDES,
    METADATA_PREFIX,
    And,
    Compare,
    Contains,
    Expr,
    HasRelationship,
    InList,
    Match,
    Not,
    Or,
    RegistryQuery,
    Value,
    mentions,
    simple_value,
)

Maybe = bool | None  # True, False, or None: cannot tell


@dataclass(frozen=True)
class Facts:
    """The searchable projection of one stored document, as `entry_projection` computes it."""

    entry_did: str
    entry_type: str
    publisher_did: str
    lifecycle: str
    sequence: int | None
    name: str
    description: str
    version: str
    tags: tuple[Any, ...]
    service_types: frozenset[Any]
    relationships: tuple[Any, ...]
    custom_metadata: dict[str, Any]
    published_at: datetime | None  # None: absent or unparseable (PostgreSQL would decide)
    updated_at: datetime | None
    # The MATCH texts the database found this version to match, among those it was asked
    # about (`asked`); any other text: maybe.
    matched: frozenset[str] = frozenset()
    asked: frozenset[str] = frozenset()

    @functools.cached_property
    def relationship_index(self) -> Relationships:
        """The relationships as lookups, built once per version: a change is tested against
        every cached page, and a page may ask about hundreds of values (hostile review: 134
        pages of 1,800 targets against 256 relationships held the event loop ~1 s a write)."""
        return _relationships_of(self.relationships)


@dataclass(frozen=True)
class Relationships:
    """An entry's relationship elements, indexed for jsonb containment of simple values."""

    holding: dict[tuple[str, type, Any], frozenset[int]]  # (key, type, value) → elements
    values: dict[str, frozenset[tuple[type, Any]]]  # key → its simple values, typed
    present: frozenset[str]  # keys some element holds
    unsure: frozenset[str]  # keys some element holds with a value that is not simple
    odd: bool  # some element is not an object


def _relationships_of(elements: tuple[Any, ...]) -> Relationships:
    holding: dict[tuple[str, type, Any], set[int]] = {}
    values: dict[str, set[tuple[type, Any]]] = {}
    present: set[str] = set()
    unsure: set[str] = set()
    odd = False
    for at, element in enumerate(elements):
        if not isinstance(element, dict):
            odd = True
            continue
        for key, value in element.items():
            present.add(key)
            if simple_value(value):
                holding.setdefault((key, type(value), value), set()).add(at)
                values.setdefault(key, set()).add((type(value), value))
            else:
                unsure.add(key)
    return Relationships(
        {k: frozenset(v) for k, v in holding.items()},
        {k: frozenset(v) for k, v in values.items()},
        frozenset(present),
        frozenset(unsure),
        odd,
    )


def facts_of(doc: str, *, asked: Iterable[str] = (), matched: Iterable[str] = ()) -> Facts | None:
    """The facts of a stored document; None when it is not a JSON object (then: maybe).
    `asked`: MATCH texts the database tested against this version, `matched` those it matched."""
    try:
        data = json.loads(doc)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    tags = data.get("tags")
    endpoints = data.get("serviceEndpoints")
    relationships = data.get("relationships")
    metadata = data.get("customMetadata")
    sequence = data.get("sequence")
    return Facts(
        entry_did=_text(data.get("entryDid")),
        entry_type=_text(data.get("entryType")),
        publisher_did=_text(data.get("publisherDid")),
        lifecycle=_text(data.get("lifecycleStatus")) or "draft",
        sequence=sequence if isinstance(sequence, int) else None,
        name=_text(data.get("name")),
        description=_text(data.get("description")),
        version=_text(data.get("version")),
        tags=tuple(tags) if isinstance(tags, list) else (),
        service_types=frozenset(
            e["type"]
            for e in (endpoints if isinstance(endpoints, list) else ())
            if isinstance(e, dict) and e.get("type") is not None
        ),
        relationships=tuple(relationships) if isinstance(relationships, list) else (),
        custom_metadata=metadata if isinstance(metadata, dict) else {},
        published_at=_moment(data.get("publishedAt")),
        updated_at=_moment(data.get("updatedAt")),
        matched=frozenset(matched),
        asked=frozenset(asked),
    )


def match_texts_in(expr: Expr | None) -> set[str]:
    """Every MATCH text of the expression, under NOT too."""
    if isinstance(expr, Match):
        return {expr.text}
    if isinstance(expr, Not):
        return match_texts_in(expr.expr)
    if isinstance(expr, And | Or):
        return {t for e in expr.exprs for t in match_texts_in(e)}
    return set()


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _moment(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return parse_datetime(value)
    except ValueError:
        return None


def may_match(query: RegistryQuery, facts: Facts | None) -> bool:
    """False only if the entry certainly does not match `query`'s filters."""
    if facts is None:
        return True
    # Cheapest first, each a certain "no": every write asks this of every cached page.
    if facts.lifecycle == "deleted":
        return False
    if query.entry_type != ALL_TYPES and facts.entry_type != query.entry_type:
        return False
    if query.service_type is not None and query.service_type not in facts.service_types:
        return False
    if facts.lifecycle in LIFECYCLE_DEFAULT_EXCLUDES and not mentions(
        query.where, "lifecycleStatus"
    ):
        return False
    return query.where is None or _eval(query.where, facts) is not False


def anchor_of(query: RegistryQuery) -> Expr | None:
    """One condition every entry matching `query` satisfies, chosen to be selective: a MATCH,
    else a `tags CONTAINS`, else another conjunct, else the entry type (or service type)
    the query names; None when the query has none (it may match any entry).

    A cache indexes its pages by it: an entry for which `anchor_may_hold` is False cannot
    match the query (`may_match` is False), so a change need not look at those pages."""
    where = query.where
    conjuncts = where.exprs if isinstance(where, And) else (where,) if where is not None else ()
    for wanted in (_is_match, _is_tag, _is_equality):
        for conjunct in conjuncts:
            if wanted(conjunct):
                return conjunct
    if conjuncts:
        return conjuncts[0]  # any conjunct is a necessary condition
    if query.entry_type != ALL_TYPES:
        return Compare("entryType", "=", query.entry_type)
    if query.service_type is not None:
        return Contains("serviceType", query.service_type)
    return None


def anchor_may_hold(anchor: Expr, facts: Facts | None) -> bool:
    """False only if the entry whose facts these are certainly fails `anchor`."""
    return facts is None or _eval(anchor, facts) is not False


def _is_match(expr: Expr) -> bool:
    return isinstance(expr, Match)


def _is_tag(expr: Expr) -> bool:
    return isinstance(expr, Contains) and expr.field == "tags"


def _is_equality(expr: Expr) -> bool:
    return isinstance(expr, Compare) and expr.op == "="


def _all(values: list[Maybe]) -> Maybe:
    if any(v is False for v in values):
        return False
    return True if all(v is True for v in values) else None


def _any(values: list[Maybe]) -> Maybe:
    if any(v is True for v in values):
        return True
    return False if all(v is False for v in values) else None


def _not(value: Maybe) -> Maybe:
    return None if value is None else not value


def _eval(expr: Expr, f: Facts) -> Maybe:
    if isinstance(expr, And):
        return _all([_eval(e, f) for e in expr.exprs])
    if isinstance(expr, Or):
        return _any([_eval(e, f) for e in expr.exprs])
    if isinstance(expr, Not):
        return _not(_eval(expr.expr, f))
    if isinstance(expr, Match):
        return (expr.text in f.matched) if expr.text in f.asked else None
    if isinstance(expr, HasRelationship):
        wanted = {"relationshipType": expr.relationship_type, "targetDid": expr.target_did}
        return _has_relationship(f, {k: v for k, v in wanted.items() if v is not None})
    if isinstance(expr, Compare):
        result = _equals(expr.field, expr.value, f) if expr.op in ("=", "!=") else None
        if expr.op == "!=":
            return _not(result)
        if expr.op == "=":
            return result
        return _order(expr.field, expr.op, expr.value, f)
    if isinstance(expr, InList):
        if expr.field.startswith("relationships."):
            return _relationship_in(f, expr.field.split(".", 1)[1], expr)
        return _any([_equals(expr.field, v, f) for v in expr.values])
    if isinstance(expr, Contains):
        if expr.field in ("tags", "serviceType"):
            return _equals(expr.field, expr.value, f)
        text = f.name if expr.field == "name" else f.description
        if not isinstance(expr.value, str) or not (text.isascii() and expr.value.isascii()):
            return None
        return expr.value.lower() in text.lower()
    return None


def _equals(field: str, value: Value, f: Facts) -> Maybe:
    """`field = value` (for tags and service types: contains `value`)."""
    if field.startswith(METADATA_PREFIX):
        key = field[len(METADATA_PREFIX) :]
        if key not in f.custom_metadata:
            return False
        return _same_json(f.custom_metadata[key], value)
    if field == "tags":
        return _member(value, f.tags)
    if field == "serviceType":
        return _member(value, tuple(f.service_types))
    if field.startswith("relationships."):
        return _has_relationship(f, {field.split(".", 1)[1]: value})
    column = _column(field, f)
    if column is _UNKNOWN:
        return None
    if isinstance(column, datetime):
        moment = _moment(value)
        return None if moment is None else column == moment
    if isinstance(column, bool) or isinstance(value, bool):
        return None
    if isinstance(column, int) and isinstance(value, int):
        return column == value
    if isinstance(column, str) and isinstance(value, str):
        return column == value
    return None


def _order(field: str, op: str, value: Value, f: Facts) -> Maybe:
    column = _column(field, f)
    if isinstance(column, datetime):
        moment = _moment(value)
        if moment is None:
            return None
        return _compare(column, op, moment)
    if field == "sequence" and isinstance(column, int) and type(value) is int:
        return _compare(column, op, value)
    if field == "name" and isinstance(value, str):  # COLLATE "C": code point order
        return _compare(f.name, op, value)
    return None  # other text orders follow the database's collation


def _compare(left: Any, op: str, right: Any) -> bool:
    if op == "<":
        return bool(left < right)
    if op == ">":
        return bool(left > right)
    if op == "<=":
        return bool(left <= right)
    return bool(left >= right)


_UNKNOWN = object()


def _column(field: str, f: Facts) -> Any:
    columns: dict[str, Any] = {
        "entryDid": f.entry_did,
        "entryType": f.entry_type,
        "name": f.name,
        "version": f.version,
        "publisherDid": f.publisher_did,
        "lifecycleStatus": f.lifecycle,
        "publishedAt": f.published_at,
        "updatedAt": f.updated_at,
        "sequence": f.sequence,
    }
    value = columns.get(field, _UNKNOWN)
    return _UNKNOWN if value is None else value


def _same_json(stored: Any, value: Value) -> Maybe:
    """jsonb equality of two scalars, when both are strings, booleans or integers."""
    if not (simple_value(stored) and simple_value(value)):
        return None
    return type(stored) is type(value) and stored == value


def _member(value: Value, items: tuple[Any, ...]) -> Maybe:
    if not isinstance(value, str):
        return None
    if value in items:
        return True
    return False if all(isinstance(i, str) for i in items) else None


def _has_relationship(f: Facts, wanted: dict[str, Value]) -> Maybe:
    """Some relationship element contains every member of `wanted` (jsonb containment): True
    when one holds them all; False when none can (every element an object, every value it
    holds for a wanted key simple); else maybe."""
    index = f.relationship_index
    if not wanted:
        return None if index.odd else bool(f.relationships)
    if not all(simple_value(v) for v in wanted.values()):  # no element holds it: at best maybe
        return None if index.odd or any(k in index.present for k in wanted) else False
    found: frozenset[int] | None = None
    for key, value in wanted.items():
        holders = index.holding.get((key, type(value), value), frozenset())
        found = holders if found is None else found & holders
        if not found:
            break
    if found:
        return True
    return None if index.odd or any(k in index.unsure for k in wanted) else False


def _relationship_in(f: Facts, key: str, expr: InList) -> Maybe:
    """`relationships.<key> IN (…)`: some element holds one of the values."""
    index = f.relationship_index
    held = index.values.get(key, frozenset())
    if not held.isdisjoint(expr.typed_values):
        return True
    if index.odd or key in index.unsure:
        return None
    if not expr.all_simple and key in index.present:
        return None  # a value that is not simple: an element holding the key may hold it
    return False
