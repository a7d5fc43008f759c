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
import re
from dataclasses import dataclass
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
_ORDER_SQL = {
    "publishedAt": "published_at",
    "updatedAt": "updated_at",
    "name": 'name COLLATE "C"',
    "sequence": "head_seq",
}
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
    escaped = text.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
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
    return f"{column} LIKE {p.bind(_like_pattern(value))}"


COUNT_CAP = 1000  # totalCount is exact up to this many matches


@dataclass(frozen=True)
class Plan:
    """One page of a query: `sql` answers rows of (`total`, `doc`, sort keys k0…) in one
    statement, hence one snapshot; `page_sql` and `count_sql` are its two parts (for EXPLAIN).

    `total` counts matches up to `COUNT_CAP + 1`: exact when at most COUNT_CAP, else "more".
    A page past the last result is one row with `doc` NULL, so the count is never lost.
    """

    page_sql: str
    page_params: list[Any]
    count_sql: str
    count_params: list[Any]
    order: tuple[OrderKey, ...]
    tiebreak: bool  # whether entry_did is a sort key after `order`

    @property
    def sql(self) -> str:
        shift = len(self.page_params)
        count = re.sub(r"\$(\d+)", lambda m: f"${int(m.group(1)) + shift}", self.count_sql)
        keys = re.findall(r"\bk\d+ (?:ASC|DESC)", self.page_sql.rsplit("ORDER BY", 1)[1])
        return (
            f"SELECT t.total, p.* FROM ({count}) AS t LEFT JOIN LATERAL ({self.page_sql}) AS p"
            f" ON true ORDER BY {', '.join('p.' + k for k in keys)}"
        )

    @property
    def params(self) -> list[Any]:
        return [*self.page_params, *self.count_params]


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


def compile_discover(query: RegistryQuery, *, limit: int, after: list[Any] | None) -> Plan:
    """SQL for one page of `query`: `limit + 1` rows (the extra one says whether more exist),
    after the position `after` (the previous page's last sort values) or at `query.offset`."""
    order = effective_order(query)
    keys: list[tuple[str, bool]] = []  # (sql expression, descending)
    count_params = _Params()
    count_where = _filters(query, count_params)
    p = _Params()
    where = _filters(query, p)
    for key in order:
        if key.field == "relevance":
            # Ranked by any of the MATCH texts (OR of their queries), so `MATCH 'a' OR MATCH 'b'`
            # ranks an entry that matches either.
            ranked = " || ".join(
                f"websearch_to_tsquery('{_TS_CONFIG}', {p.bind(text)})"
                for text in match_texts(query.where)
            )
            expr = f"ts_rank_cd(search, ({ranked}))"
        else:
            expr = _ORDER_SQL[key.field]
        keys.append((expr, key.descending))
        if key.field == "sequence":
            break  # unique: nothing after it can matter
    tiebreak = keys[-1][0] != "head_seq"
    if tiebreak:
        keys.append(('entry_did COLLATE "C"', keys[-1][1]))
    if after is not None:
        if len(after) != len(keys):
            raise Invalid("cursor does not belong to this query", code="invalid_cursor")
        where.append(_keyset(keys, after, p))
    selected = ", ".join(f"{expr} AS k{i}" for i, (expr, _) in enumerate(keys))
    order_sql = ", ".join(f"k{i} {'DESC' if desc else 'ASC'}" for i, (_, desc) in enumerate(keys))
    page_sql = (
        f"SELECT doc, entry_did, {selected} FROM entries WHERE {' AND '.join(where)}"
        f" ORDER BY {order_sql} LIMIT {p.bind(limit + 1)}"
    )
    if query.offset and after is None:
        page_sql += f" OFFSET {p.bind(query.offset)}"
    capped = count_params.bind(COUNT_CAP + 1)
    count_sql = (
        f"SELECT count(*) AS total FROM (SELECT 1 FROM entries"
        f" WHERE {' AND '.join(count_where)} LIMIT {capped}) AS matches"
    )
    return Plan(page_sql, p.values, count_sql, count_params.values, order, tiebreak)


def _keyset(keys: list[tuple[str, bool]], after: list[Any], p: _Params) -> str:
    """Rows strictly after `after` in the order of `keys`."""
    if all(desc == keys[0][1] for _, desc in keys):
        op = "<" if keys[0][1] else ">"
        columns = ", ".join(expr for expr, _ in keys)
        values = ", ".join(_bind_key(expr, v, p) for (expr, _), v in zip(keys, after, strict=True))
        return f"({columns}) {op} ({values})"
    alternatives = []
    for i, (expr, desc) in enumerate(keys):
        equal = [
            f"{e} = {_bind_key(e, v, p)}" for (e, _), v in zip(keys[:i], after[:i], strict=True)
        ]
        step = f"{expr} {'<' if desc else '>'} {_bind_key(expr, after[i], p)}"
        alternatives.append("(" + " AND ".join([*equal, step]) + ")")
    return "(" + " OR ".join(alternatives) + ")"


def _bind_key(expr: str, value: Any, p: _Params) -> str:
    if expr.startswith("ts_rank_cd"):
        return p.bind(float(value), "::real")
    if expr in ("published_at", "updated_at"):
        return p.bind(datetime.fromisoformat(value) if isinstance(value, str) else value)
    if expr == "head_seq":
        return p.bind(int(value), "::bigint")
    return p.bind(str(value), "::text")
