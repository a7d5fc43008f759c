"""The SQL compiler of `RegistryQuery`: one parameterised statement per page, one for the count.

Every value from the query is bound as a parameter (`$n`); SQL text is assembled only from the
fixed fragments below, chosen by field and operator names that `registry.query` validated.
Each filter maps onto an index of migration 0002 (GIN for tags, service types, relationships,
metadata, full text and trigram substrings; btree for the rest).

Paging is keyset: the page is ordered by the query's keys, then by `entry_did` in the direction of
the last key, and the cursor carries the last row's key values. `sequence` is unique, so an
ordering that reaches it needs no tie-breaker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from registry.errors import Invalid
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
    OrderKey,
    RegistryQuery,
    Value,
    effective_order,
    match_texts,
    mentions,
)

_COLUMNS = {
    "entryDid": "entry_did",
    "entryType": "entry_type",
    "name": "name",
    "version": "version",
    "publisherDid": "publisher_did",
    "lifecycleStatus": "lifecycle",
    "publishedAt": "published_at",
    "updatedAt": "updated_at",
    "sequence": "head_seq",
}
_TIME_KEYS = {"publishedAt": "published_at", "updatedAt": "updated_at"}
_SQL_OPS = {"=": "=", "!=": "<>", "<": "<", ">": ">", "<=": "<=", ">=": ">="}
_TS_CONFIG = "english"


class _Params:
    def __init__(self) -> None:
        self.values: list[Any] = []

    def bind(self, value: Any, cast: str = "") -> str:
        self.values.append(value)
        return f"${len(self.values)}{cast}"


def _bad(message: str) -> Invalid:
    return Invalid(message, code="invalid_query")


def _typed(field: str, value: Value) -> Any:
    """The value as the column's type, or a 400 naming the field."""
    if field in ("publishedAt", "updatedAt"):
        if not isinstance(value, str):
            raise _bad(f"{field} compares with an RFC 3339 date-time string")
        try:
            return parse_datetime(value)
        except ValueError as exc:
            raise _bad(f"{field}: {exc}") from None
    if field == "sequence":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**63 - 1:
            raise _bad("sequence compares with a non-negative integer")
        return value
    if not isinstance(value, str):
        raise _bad(f"{field} compares with a string")
    return value


def _like_pattern(text: str) -> str:
    """`text` as a LIKE pattern matching it anywhere, its own case kept: the database lowers it
    (`_contains`) as it lowers the column. Python's `lower()` is not PostgreSQL's (`İ` becomes
    `i̇`, a final `Σ` becomes `ς`; under a C ctype PostgreSQL lowers ASCII only), and an entry
    did not match its own name. `lower()` never makes a `\\`, `%` or `_`: the escapes hold."""
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _metadata_value(field: str, value: Value) -> str:
    key = field[len(METADATA_PREFIX) :]
    return json.dumps({key: value})


def _compile(expr: Expr, p: _Params) -> str:
    if isinstance(expr, And):
        return "(" + " AND ".join(_compile(e, p) for e in expr.exprs) + ")"
    if isinstance(expr, Or):
        return "(" + " OR ".join(_compile(e, p) for e in expr.exprs) + ")"
    if isinstance(expr, Not):
        return f"(NOT {_compile(expr.expr, p)})"
    if isinstance(expr, Match):
        return f"search @@ websearch_to_tsquery('{_TS_CONFIG}', {p.bind(expr.text)})"
    if isinstance(expr, HasRelationship):
        element = {
            k: v
            for k, v in (
                ("relationshipType", expr.relationship_type),
                ("targetDid", expr.target_did),
            )
            if v is not None
        }
        return f"relationships @> {p.bind(json.dumps([element]), '::jsonb')}"
    if isinstance(expr, Compare):
        return _compare(expr, p)
    if isinstance(expr, InList):
        return _in_list(expr, p)
    if isinstance(expr, Contains):
        return _contains(expr, p)
    raise TypeError(f"unknown expression {expr!r}")


def _compare(expr: Compare, p: _Params) -> str:
    field, op, value = expr.field, expr.op, expr.value
    if field.startswith(METADATA_PREFIX):
        test = f"custom_metadata @> {p.bind(_metadata_value(field, value), '::jsonb')}"
        return test if op == "=" else f"(NOT {test})"
    if field == "serviceType":
        return f"service_types @> ARRAY[{p.bind(_typed(field, value), '::text')}]"
    if field.startswith("relationships."):
        element = {field.split(".", 1)[1]: _typed(field, value)}
        return f"relationships @> {p.bind(json.dumps([element]), '::jsonb')}"
    column = _COLUMNS[field]
    if field == "name" and op in ("<", ">", "<=", ">="):
        column = 'name COLLATE "C"'
    return f"{column} {_SQL_OPS[op]} {p.bind(_typed(field, value))}"


def _in_list(expr: InList, p: _Params) -> str:
    field = expr.field
    values = [_typed(field, v) for v in expr.values]
    if field == "tags":
        return f"tags && {p.bind(values, '::text[]')}"
    if field == "serviceType":
        return f"service_types && {p.bind(values, '::text[]')}"
    if field.startswith("relationships."):
        key = field.split(".", 1)[1]
        tests = [f"relationships @> {p.bind(json.dumps([{key: v}]), '::jsonb')}" for v in values]
        return "(" + " OR ".join(tests) + ")"
    cast = "::bigint[]" if field == "sequence" else "::text[]"
    return f"{_COLUMNS[field]} = ANY({p.bind(values, cast)})"


def _contains(expr: Contains, p: _Params) -> str:
    field = expr.field
    value = _typed(field, expr.value)
    if field == "tags":
        return f"tags @> ARRAY[{p.bind(value, '::text')}]"
    if field == "serviceType":
        return f"service_types @> ARRAY[{p.bind(value, '::text')}]"
    column = "lower(name)" if field == "name" else "lower(description)"
    return f"{column} LIKE lower({p.bind(_like_pattern(value))})"


COUNT_CAP = 1000  # totalCount is exact up to this many matches
# What discovery reads: entry_search (migration 0021), one row per entry with the searchable
# projection of its head version, its head sequence, publisher, type and lifecycle.
SOURCE = "entry_search"
# A walk in sequence order: entry_search has no index on head_seq (the log head's critical
# section sets it on a new row, a heap-only update), so it goes down entries' sequence indexes
# and joins each entry's row; the filters name entry_search's columns (entries' are renamed).
WALK = (
    "(SELECT entry_did AS walk_did, head_seq AS walk_seq, lifecycle AS walk_lifecycle,"
    " entry_type AS walk_type FROM entries) AS w"
    " JOIN entry_search ON entry_search.entry_did = w.walk_did"
)


@dataclass(frozen=True)
class Plan:
    """One page of a query: `sql` answers rows of (`total`, `doc`, `entry_did`, `head_seq`, sort
    keys k0…) in one statement, hence one snapshot. A page past the last result is one row with
    `doc` NULL, so the count is never lost.

    `total` counts matches up to `COUNT_CAP + 1`: exact when at most COUNT_CAP, else "more".
    The count is computed first and decides how the page is found (see `compile_discover`).
    `page_sql` and `count_sql` are the statement's two parts on their own (for EXPLAIN).
    """

    sql: str
    params: list[Any]
    page_sql: str
    page_params: list[Any]
    count_sql: str
    count_params: list[Any]
    order: tuple[OrderKey, ...]
    tiebreak: bool  # whether entry_did is a sort key after `order`


def _filters(query: RegistryQuery, p: _Params) -> list[str]:
    where = ["lifecycle <> 'deleted'"]
    if query.entry_type != ALL_TYPES:
        where.append(f"entry_type = {p.bind(query.entry_type)}")
    if query.service_type is not None:
        where.append(f"service_types @> ARRAY[{p.bind(query.service_type, '::text')}]")
    if not mentions(query.where, "lifecycleStatus"):
        where.append(f"lifecycle <> ALL({p.bind(list(LIFECYCLE_DEFAULT_EXCLUDES), '::text[]')})")
    if query.where is not None:
        where.append(_compile(query.where, p))
    return where


@dataclass(frozen=True)
class _Key:
    expr: str  # over entry_search (a walk in sequence order: walk_seq, of entries)
    descending: bool
    kind: str  # "rank", "time", "seq" or "text": the SQL type of a cursor value

    def column(self, i: int) -> str:
        """The key as the output column k<i> of a candidate row."""
        return f'k{i} COLLATE "C"' if self.kind == "text" else f"k{i}"


def bytes_before(doc: str, order: str) -> str:
    """SQL: the bytes of the documents `doc` of the rows before this one in `order` (0 for the
    first), the measure of a page's byte budget. octet_length reads a stored value's size
    without decompressing it, so a document a page leaves out is never read."""
    return (
        f"coalesce(sum(octet_length({doc})) OVER (ORDER BY {order}"
        " ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)"
    )


def compile_discover(
    query: RegistryQuery, *, limit: int, after: list[Any] | None, page_bytes: int | None = None
) -> Plan:
    """SQL for one page of `query`: `limit + 1` rows (the extra one says whether more exist),
    after the position `after` (the previous page's last sort values) or at `query.offset`.

    One scan collects up to COUNT_CAP + 1 matches with their sort keys (`m`); their number is
    the capped count, and it decides how the page is found, the choice the planner gets wrong
    when it misjudges how many rows a filter keeps:
      * at most COUNT_CAP matches: the page is sorted out of `m`, no second scan;
      * more: the ordering's index is walked and the filter applied until the page is full (the
        planner free to choose otherwise); with over 1% of the table matching, that is on the
        order of a hundred rows per result. A relevance ordering ranks every match instead.
    The stored documents are joined from entry_versions for the page's rows only; with
    `page_bytes`, a row whose predecessors' documents hold that many bytes comes without its
    document (octet_length reads a stored value's size without decompressing it).
    """
    order = effective_order(query)
    keys: list[_Key] = []
    p = _Params()
    where = _filters(query, p)
    for key in order:
        if key.field == "relevance":
            # Ranked by any of the MATCH texts (OR of their queries), so `MATCH 'a' OR MATCH 'b'`
            # ranks an entry that matches either.
            texts = " || ".join(
                f"websearch_to_tsquery('{_TS_CONFIG}', {p.bind(text)})"
                for text in match_texts(query.where)
            )
            keys.append(_Key(f"ts_rank(search, ({texts}))", key.descending, "rank"))
        elif key.field == "sequence":
            keys.append(_Key("head_seq", key.descending, "seq"))
            break  # unique: nothing after it can matter
        elif key.field == "name":
            keys.append(_Key('name COLLATE "C"', key.descending, "text"))
        else:
            keys.append(_Key(_TIME_KEYS[key.field], key.descending, "time"))
    tiebreak = keys[-1].kind != "seq"
    if tiebreak:
        keys.append(_Key('entry_did COLLATE "C"', keys[-1].descending, "text"))
    # The walk of the ordering's index (more than COUNT_CAP matches): by sequence, on entries.
    walk = keys[0].kind == "seq"
    scan_keys = [replace(keys[0], expr="walk_seq"), *keys[1:]] if walk else keys
    scan_where = list(where)
    if walk:  # the conditions of entries' partial sequence indexes
        scan_where.append("walk_lifecycle <> 'deleted'")
        if query.entry_type != ALL_TYPES:
            scan_where.append(f"walk_type = {p.bind(query.entry_type)}")
    few_where = [f"t.total <= {COUNT_CAP}"]
    if after is not None and len(after) != len(keys):
        raise Invalid("cursor does not belong to this query", code="invalid_cursor")
    if after is not None:
        scan_where.append(_keyset([k.expr for k in scan_keys], scan_keys, after, p))
    selected = ", ".join(f"{k.expr} AS k{i}" for i, k in enumerate(keys))
    scan_selected = ", ".join(f"{k.expr} AS k{i}" for i, k in enumerate(scan_keys))
    order_sql = ", ".join(f"k{i} {'DESC' if k.descending else 'ASC'}" for i, k in enumerate(keys))
    window = f" LIMIT {p.bind(limit + 1)}"
    if query.offset and after is None:
        window += f" OFFSET {p.bind(query.offset)}"
    columns = f"entry_did, head_seq, {selected}"
    scan = f"SELECT entry_did, head_seq, {scan_selected} FROM {WALK if walk else SOURCE}"
    page_sql = f"{scan} WHERE {' AND '.join(scan_where)} ORDER BY {order_sql}{window}"
    page_params = list(p.values)  # page_sql uses these only
    if after is not None:
        few_where.append(_keyset([k.column(i) for i, k in enumerate(keys)], keys, after, p))
    candidates = f"SELECT {columns} FROM {SOURCE} WHERE {' AND '.join(where)} LIMIT {COUNT_CAP + 1}"
    scan_where.append(f"t.total > {COUNT_CAP}")
    final_order = ", ".join("p." + part for part in order_sql.split(", "))
    doc = "v.doc"
    if page_bytes is not None:
        before = bytes_before("v.doc", final_order)
        doc = f"CASE WHEN {before} < {p.bind(page_bytes)} THEN v.doc END"
    sql = (
        f"WITH m AS MATERIALIZED ({candidates}), t AS (SELECT count(*) AS total FROM m)"
        f" SELECT t.total, {doc} AS doc, p.* FROM t LEFT JOIN LATERAL ("
        f"({scan} WHERE {' AND '.join(scan_where)} ORDER BY {order_sql}{window})"
        f" UNION ALL (SELECT * FROM m WHERE {' AND '.join(few_where)}"
        f" ORDER BY {order_sql}{window})"
        f") AS p ON true LEFT JOIN entry_versions AS v ON v.seq = p.head_seq"
        f" ORDER BY {final_order}"
    )
    count_params = _Params()
    count_where = _filters(query, count_params)
    count_sql = (
        f"SELECT count(*) AS total FROM (SELECT 1 FROM {SOURCE}"
        f" WHERE {' AND '.join(count_where)} LIMIT {count_params.bind(COUNT_CAP + 1)}) AS matches"
    )
    return Plan(
        sql, p.values, page_sql, page_params, count_sql, count_params.values, order, tiebreak
    )


def _keyset(exprs: list[str], keys: list[_Key], after: list[Any], p: _Params) -> str:
    """Rows strictly after `after` in the order of `keys` (each written as `exprs[i]`)."""
    values = [_bind_key(k, v, p) for k, v in zip(keys, after, strict=True)]
    if all(k.descending == keys[0].descending for k in keys):
        op = "<" if keys[0].descending else ">"
        return f"({', '.join(exprs)}) {op} ({', '.join(values)})"
    alternatives = []
    for i, key in enumerate(keys):
        equal = [f"{exprs[j]} = {values[j]}" for j in range(i)]
        step = f"{exprs[i]} {'<' if key.descending else '>'} {values[i]}"
        alternatives.append("(" + " AND ".join([*equal, step]) + ")")
    return "(" + " OR ".join(alternatives) + ")"


def _bind_key(key: _Key, value: Any, p: _Params) -> str:
    if key.kind == "rank":
        return p.bind(float(value), "::real")
    if key.kind == "time":
        moment = datetime.fromisoformat(value) if isinstance(value, str) else value
        return p.bind(moment, "::timestamptz")
    if key.kind == "seq":
        return p.bind(int(value), "::bigint")
    return p.bind(str(value), "::text")
