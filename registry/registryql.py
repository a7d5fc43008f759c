"""RegistryQL: the text front end of discovery (`POST /v1/discover/registryql`).

`parse_registryql` turns a query such as

    DISCOVER agent WITH SERVICE 'A2A' WHERE tags CONTAINS 'nlp' AND lifecycleStatus = 'active'
    ORDER BY publishedAt DESC LIMIT 20

into the `RegistryQuery` that `POST /v1/discover` also compiles to; `render_registryql` is its
inverse (`parse_registryql(render_registryql(q)) == q`). The grammar is `registryql.lark` next to
this module, parsed by Lark's LALR(1) parser with the contextual lexer; the syntax tree is built
during parsing (no recursion over the tree, so deeply nested input cannot exhaust the stack).

Every problem is an `Invalid` with code `invalid_registryql`, a message that starts with
`line L, column C:` and says what was expected, and `details` {line, column, expected[, found]}.
Lines and columns count from 1; columns count characters (code points). See docs/registryql.md.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections import OrderedDict
from pathlib import Path
from typing import Any, NoReturn, cast

from lark import Lark, Token, Transformer, UnexpectedCharacters, UnexpectedEOF, UnexpectedToken
from lark.exceptions import UnexpectedInput

from registry.errors import Invalid
from registry.models import parse_datetime
from registry.query import (
    ALL_TYPES,
    FIELDS,
    MAX_IN_VALUES,
    MAX_NODES,
    MAX_OFFSET,
    MAX_TEXT,
    METADATA_PREFIX,
    ORDER_FIELDS,
    And,
    Compare,
    CompareOp,
    Contains,
    Expr,
    HasRelationship,
    InList,
    Match,
    Not,
    Or,
    OrderField,
    OrderKey,
    RegistryQuery,
    Value,
    check_operator,
    check_query,
    count_nodes,
    field_spec,
    match_texts,
)

__all__ = ["MAX_QUERY_BYTES", "parse_registryql", "render_registryql"]

MAX_QUERY_BYTES = 8 * 1024
MAX_SAFE_INTEGER = 2**53 - 1
MAX_TYPE_LENGTH = 64
ERROR_CODE = "invalid_registryql"
GRAMMAR_PATH = Path(__file__).with_name("registryql.lark")

_TYPE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,63}")
_FIELD_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*(?:\.[A-Za-z0-9_-]+)*")

# Terminal names → what a person reads in "expected …", in the order they are listed.
_DISPLAY: dict[str, str] = {
    "DISCOVER": "DISCOVER",
    "STAR": "'*'",
    "TYPE_NAME": "entry type",
    "WITH": "WITH SERVICE",
    "SERVICE": "SERVICE",
    "WHERE": "WHERE",
    "NOT": "NOT",
    "MATCH": "MATCH",
    "_LPAR": "'('",
    "FIELD": "field name",
    "COMPARE_OP": "comparison operator (=, !=, <, >, <=, >=)",
    "IN": "IN",
    "CONTAINS": "CONTAINS",
    "STRING": "string",
    "NUMBER": "number",
    "TRUE": "TRUE",
    "FALSE": "FALSE",
    "NULL": "NULL",
    "_COMMA": "','",
    "_RPAR": "')'",
    "AND": "AND",
    "OR": "OR",
    "ORDER": "ORDER BY",
    "BY": "BY",
    "ORDER_FIELD": "order field",
    "ASC": "ASC",
    "DESC": "DESC",
    "LIMIT": "LIMIT",
    "OFFSET": "OFFSET",
    "$END": "end of query",
}
_RANK = {name: i for i, name in enumerate(_DISPLAY)}


# --- errors -----------------------------------------------------------------------------------


def _fail(line: int, column: int, what: str, expected: list[str], found: str | None) -> NoReturn:
    details: dict[str, Any] = {"line": line, "column": column, "expected": expected}
    if found is not None:
        details["found"] = found
    raise Invalid(f"line {line}, column {column}: {what}", code=ERROR_CODE, details=details)


def _fail_at(token: Token, what: str, expected: list[str]) -> NoReturn:
    _fail(_line(token), _column(token), what, expected, _show_token(token))


def _line(token: Token) -> int:
    return token.line if token.line is not None else 1


def _column(token: Token) -> int:
    return token.column if token.column is not None else 1


def _show_char(char: str) -> str:
    if char.isprintable() and char not in "\t\n\r":
        return f"'{char}'"
    return f"U+{ord(char):04X}"


def _show_token(token: Token) -> str:
    if token.type == "$END":
        return "end of query"
    text = "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in str(token.value))
    if len(text) > 40:
        text = text[:40] + "…"
    return text if token.type == "STRING" else f"'{text}'"


def _readable(names: set[str] | frozenset[str]) -> list[str]:
    known = sorted((n for n in names if n in _DISPLAY), key=_RANK.__getitem__)
    return [_DISPLAY[n] for n in known]


def _expecting(expected: list[str]) -> str:
    if not expected:  # pragma: no cover - the parser always accepts something
        return "unexpected input"
    if len(expected) == 1:
        return f"expected {expected[0]}"
    return "expected one of: " + ", ".join(expected)


def _accepted(text: str, error: UnexpectedInput) -> set[str]:
    """The terminals the parser accepts just before the failing token.

    Lark's own set comes from the state the parser reached after reducing on the bad token, and
    LALR states share lookaheads, so that set can be too narrow or too wide (after `name = 'x'`,
    a stray ')' reduces the whole WHERE clause, which then no longer lists AND and OR). So the
    text is read again, up to that token, and each terminal is tried in that state."""
    stop = error.token if isinstance(error, UnexpectedToken) else None
    probe = _PARSER.parse_interactive(text)
    try:
        for token in probe.iter_parse():  # yields each token before feeding it
            if stop is not None and token.start_pos == stop.start_pos and token.type == stop.type:
                break
    except UnexpectedInput:
        pass  # the lexer stopped at the same place as before: the state is the one wanted
    accepts: set[str] = probe.accepts()  # type: ignore[no-untyped-call]
    return accepts


def _syntax_error(text: str, error: UnexpectedInput) -> NoReturn:
    if isinstance(error, UnexpectedCharacters):
        line, column, char = error.line, error.column, error.char
        if char == "'":
            _fail(
                line,
                column,
                "unterminated string: expected a closing ' before the end of the query",
                ["' (end of string)"],
                "end of query",
            )
        expected = _readable(_accepted(text, error))
        hint = " (strings use single quotes)" if char == '"' else ""
        found = _show_char(char)
        _fail(line, column, f"{_expecting(expected)}; found {found}{hint}", expected, found)
    if isinstance(error, UnexpectedToken):
        token = error.token
        expected = _readable(_accepted(text, error))
        if token.type == "$END":
            line = token.end_line if token.end_line is not None else _line(token)
            column = token.end_column if token.end_column is not None else _column(token)
        else:
            line, column = _line(token), _column(token)
        found = _show_token(token)
        _fail(line, column, f"{_expecting(expected)}; found {found}", expected, found)
    if isinstance(error, UnexpectedEOF):  # pragma: no cover - LALR reports the end as a token
        expected = _readable(set(error.expected))
        line = text.count("\n") + 1
        column = len(text) - (text.rfind("\n") + 1) + 1
        _fail(line, column, f"{_expecting(expected)}; found end of query", expected, "end of query")
    _fail(1, 1, "the query could not be parsed", [], None)  # pragma: no cover - no other kind


# --- values -----------------------------------------------------------------------------------


def _string_problem(char: str) -> bool:
    """Characters a string may not hold: control characters other than tab, and surrogates."""
    return char != "\t" and unicodedata.category(char) in ("Cc", "Cs")


def _decode_string(token: Token) -> str:
    """The value of a STRING token: \\\\ → \\, \\' and '' → '; nothing else is an escape."""
    raw = str(token.value)
    out: list[str] = []
    line, column = _line(token), _column(token)
    i = 1
    while i < len(raw) - 1:
        char = raw[i]
        if _string_problem(char):
            _fail(
                line,
                column + i,
                f"control character {_show_char(char)} in a string: expected printable text "
                "(tab is the only control character allowed)",
                ["printable character"],
                _show_char(char),
            )
        if char == "\\":
            escaped = raw[i + 1]
            if escaped not in "\\'":
                shown = f"\\{escaped}" if escaped.isprintable() else f"\\ {_show_char(escaped)}"
                _fail(
                    line,
                    column + i,
                    f"unknown escape {shown} in a string: expected \\\\ or \\'",
                    ["\\\\", "\\'"],
                    shown,
                )
            out.append(escaped)
            i += 2
        elif char == "'":  # the regex admits a quote inside only as ''
            out.append("'")
            i += 2
        else:
            out.append(char)
            i += 1
    return "".join(out)


def _number(token: Token) -> int | float:
    text = str(token.value)
    if not any(c in text for c in ".eE"):
        digits = text.lstrip("-").lstrip("0")
        value = int(text) if len(digits) <= 16 else MAX_SAFE_INTEGER + 1
        if abs(value) > MAX_SAFE_INTEGER:
            _fail_at(
                token,
                f"integer out of range: expected a whole number between -{MAX_SAFE_INTEGER} and "
                f"{MAX_SAFE_INTEGER}",
                [f"integer within ±{MAX_SAFE_INTEGER}"],
            )
        return value
    number = float(text)
    if not math.isfinite(number):
        _fail_at(token, "number out of range: expected a finite number", ["finite number"])
    return number


def _value(token: Token) -> Value:
    kind = token.type
    if kind == "STRING":
        return _decode_string(token)
    if kind == "NUMBER":
        return _number(token)
    if kind == "TRUE":
        return True
    if kind == "FALSE":
        return False
    return None  # NULL


def _check_field(token: Token, op: str) -> str:
    """The field's name, when `op` applies to it (`registry.query.check_operator`)."""
    name = str(token.value)
    problem = check_operator(name, op)
    if problem is not None:
        spec = field_spec(name)
        expected = [*FIELDS, "customMetadata.<key>"] if spec is None else sorted(spec.ops)
        _fail_at(token, problem, expected)
    return name


def _typed_value(name: str, token: Token) -> Value:
    """The value of `token` when its type suits field `name` (the rules the SQL compiler applies,
    checked here so that a mismatch is reported at the value's position)."""
    value = _value(token)
    if name.startswith(METADATA_PREFIX):
        return value  # any JSON scalar
    if name in ("publishedAt", "updatedAt"):
        problem = None
        if not isinstance(value, str):
            problem = "expected an RFC 3339 date-time string"
        else:
            try:
                parse_datetime(value)
            except ValueError:
                problem = "expected an RFC 3339 date-time with offset"
        if problem is not None:
            _fail_at(
                token,
                f"{name} compares with a date-time: {problem}, e.g. '2026-01-02T03:04:05Z'",
                ["RFC 3339 date-time string"],
            )
        return value
    if name == "sequence":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            _fail_at(
                token,
                "sequence compares with a number: expected a non-negative integer",
                ["non-negative integer"],
            )
        return value
    if not isinstance(value, str):
        _fail_at(token, f"{name} compares with text: expected a string", ["string"])
    return value


def _whole(token: Token, clause: str, low: int, high: int) -> int:
    text = str(token.value)
    whole = not any(c in text for c in ".eE") and len(text.lstrip("-").lstrip("0")) <= 17
    value = int(text) if whole else None
    if value is None or not low <= value <= high:
        _fail_at(
            token,
            f"{clause} must be a whole number between {low} and {high}",
            [f"integer from {low} to {high}"],
        )
    return value


# --- building the query while parsing ---------------------------------------------------------


def _too_complex(operator: Token) -> NoReturn:
    _fail_at(
        operator,
        f"the WHERE expression is too complex: expected at most {MAX_NODES} operators and "
        "conditions",
        [f"at most {MAX_NODES} nodes"],
    )


class _Build(Transformer[Token, RegistryQuery]):
    """Callbacks run by the LALR parser at each reduction (bottom-up, no recursion)."""

    def start(self, clauses: list[tuple[str, Any]]) -> RegistryQuery:
        parts = dict(clauses)
        where: Expr | None = parts.get("where")
        order: list[tuple[OrderKey, Token]] = parts.get("order", [])
        for key, token in order:
            if key.field == "relevance" and not match_texts(where):
                _fail_at(
                    token,
                    "ORDER BY relevance needs a MATCH in WHERE (outside NOT)",
                    ["an order field other than relevance"],
                )
        query = RegistryQuery(
            entry_type=parts["discover"],
            service_type=parts.get("service"),
            where=where,
            order=tuple(key for key, _ in order),
            limit=parts.get("limit"),
            offset=parts.get("offset"),
        )
        try:
            check_query(query)
        except Invalid as error:  # pragma: no cover - every rule is checked above with a position
            _fail(1, 1, error.message, [], None)
        return query

    def discover(self, children: list[Token]) -> tuple[str, str]:
        token = children[1]
        if token.type == "STAR":
            return ("discover", ALL_TYPES)
        if len(token.value) > MAX_TYPE_LENGTH:
            _fail_at(
                token,
                f"entry type longer than {MAX_TYPE_LENGTH} characters",
                [f"entry type of at most {MAX_TYPE_LENGTH} characters"],
            )
        return ("discover", str(token.value))

    def service(self, children: list[Token]) -> tuple[str, str]:
        return ("service", _decode_string(children[2]))

    def where(self, children: list[Any]) -> tuple[str, Expr]:
        return ("where", children[1])

    def order(self, children: list[Any]) -> tuple[str, list[tuple[OrderKey, Token]]]:
        keys: list[tuple[OrderKey, Token]] = children[2:]
        seen: set[str] = set()
        for key, token in keys:
            if key.field in seen:
                _fail_at(
                    token,
                    f"{key.field} appears twice in ORDER BY",
                    ["an order field not used yet"],
                )
            seen.add(key.field)
        return ("order", keys)

    def order_key(self, children: list[Token]) -> tuple[OrderKey, Token]:
        token = children[0]
        name = str(token.value)
        if name not in ORDER_FIELDS:
            _fail_at(
                token,
                f"unknown order field '{name}': expected one of: {', '.join(ORDER_FIELDS)}",
                list(ORDER_FIELDS),
            )
        descending = len(children) > 1 and children[1].type == "DESC"
        return (OrderKey(cast(OrderField, name), descending), token)

    def limit(self, children: list[Token]) -> tuple[str, int]:
        return ("limit", _whole(children[1], "LIMIT", 1, MAX_SAFE_INTEGER))

    def offset(self, children: list[Token]) -> tuple[str, int]:
        return ("offset", _whole(children[1], "OFFSET", 0, MAX_OFFSET))

    def or_expr(self, children: list[Any]) -> Expr:
        return self._nary(Or, children)

    def and_expr(self, children: list[Any]) -> Expr:
        return self._nary(And, children)

    @staticmethod
    def _nary(kind: type[And] | type[Or], children: list[Any]) -> Expr:
        """`a op b op c` (operands at even positions, operator tokens between) in canonical
        shape: an operand of the same kind (parenthesised) is spliced in."""
        flat: list[Expr] = []
        nodes = 1
        for i in range(0, len(children), 2):
            operand: Expr = children[i]
            if isinstance(operand, kind):
                flat.extend(operand.exprs)
                nodes += count_nodes(operand) - 1
            else:
                flat.append(operand)
                nodes += count_nodes(operand)
            if nodes > MAX_NODES:
                _too_complex(children[i - 1] if i else children[1])
        return kind(tuple(flat))

    def negation(self, children: list[Any]) -> Expr:
        expr = Not(children[1])
        if count_nodes(expr) > MAX_NODES:
            _too_complex(children[0])
        return expr

    def compare(self, children: list[Token]) -> Expr:
        field_token, op, value = children
        name = _check_field(field_token, str(op.value))
        return Compare(name, cast(CompareOp, str(op.value)), _typed_value(name, value))

    def in_list(self, children: list[Token]) -> Expr:
        name = _check_field(children[0], "IN")
        tokens = children[2:]
        if len(tokens) > MAX_IN_VALUES:
            _fail_at(
                tokens[MAX_IN_VALUES],
                f"too many IN values: expected at most {MAX_IN_VALUES}",
                ["')'"],
            )
        return InList(name, tuple(_typed_value(name, t) for t in tokens))

    def contains(self, children: list[Token]) -> Expr:
        name = _check_field(children[0], "CONTAINS")
        return Contains(name, _typed_value(name, children[2]))

    def match(self, children: list[Token]) -> Expr:
        token = children[1]
        text = _decode_string(token)
        if not text.strip():
            _fail_at(token, "MATCH needs some text to search for", ["non-blank string"])
        if len(text) > MAX_TEXT:
            _fail_at(
                token,
                f"MATCH text longer than {MAX_TEXT} characters",
                [f"string of at most {MAX_TEXT} characters"],
            )
        return Match(text)


# Built once, at import; the transformer is stateless, so one parser serves every caller.
_PARSER = Lark(
    GRAMMAR_PATH.read_text(encoding="utf-8"),
    parser="lalr",
    lexer="contextual",
    transformer=_Build(),
)


def parse_registryql(text: str) -> RegistryQuery:
    """Parse a RegistryQL query; `Invalid` (code `invalid_registryql`) names where it fails.

    Parsing costs ~0.2 ms, more than answering a cached page, so the queries of up to
    `MEMO_TEXT_CHARS` characters last parsed are remembered (`_Memo`; a `RegistryQuery` is
    immutable; errors are not remembered)."""
    if len(text) > MEMO_TEXT_CHARS:
        return _parse(text)
    query = _MEMO.get(text)
    if query is None:
        query = _parse(text)
        _MEMO.put(text, query)
    return query


MEMO_TEXT_CHARS = 1024
MEMO_QUERIES = 4096
# The memo's texts together, in characters. A parsed query holds up to ~19 bytes a character
# of its text (tracemalloc: 1,000 characters of `NOT NOT … name = 'x' OR …` hold 18 KB), so
# this bounds the memo to ~5 MiB whatever clients send, and still holds 4,096 queries of 64
# characters. By count alone, 4,096 queries of 1,024 characters held ~76 MiB.
MEMO_CHARS = 256 * 1024


class _Memo:
    """The queries last parsed, by text, the least recently used first out: at most `most`
    of them, and at most `most_chars` characters of text in all. Used from the one Trio
    thread (the API's), with no `await` inside."""

    def __init__(self, most: int, most_chars: int) -> None:
        self._queries: OrderedDict[str, RegistryQuery] = OrderedDict()
        self._most = most
        self._most_chars = most_chars
        self.chars = 0

    def get(self, text: str) -> RegistryQuery | None:
        query = self._queries.get(text)
        if query is not None:
            self._queries.move_to_end(text)
        return query

    def put(self, text: str, query: RegistryQuery) -> None:
        if text in self._queries or len(text) > self._most_chars:
            return
        self._queries[text] = query
        self.chars += len(text)
        while len(self._queries) > self._most or self.chars > self._most_chars:
            oldest, _ = self._queries.popitem(last=False)
            self.chars -= len(oldest)

    def __len__(self) -> int:
        return len(self._queries)


_MEMO = _Memo(MEMO_QUERIES, MEMO_CHARS)


def _parse(text: str) -> RegistryQuery:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_QUERY_BYTES:
        _too_long(text)
    if text.count("(") > MAX_PARENTHESES:  # an upper bound: some may be inside strings
        _too_many_parentheses(text)
    try:
        query = _PARSER.parse(text)
    except UnexpectedInput as error:
        _syntax_error(text, error)
    assert isinstance(query, RegistryQuery)  # the `start` callback builds it
    return query


# Parentheses in a query. Parsing costs about its tokens, and `WHERE` allows 256 nodes, so this
# many groups cannot be needed; 8 KiB of nested ones took Lark 35-70 ms (a hostile review).
MAX_PARENTHESES = 256


def _too_many_parentheses(text: str) -> None:
    """Refuse the query at its (MAX_PARENTHESES + 1)-th opening parenthesis outside a string."""
    seen = 0
    line, column = 1, 0
    quoted = False
    chars = iter(text)
    for char in chars:
        column += 1
        if char == "\n":
            line, column = line + 1, 0
        elif quoted:
            if char == "\\":
                next(chars, None)  # an escaped character (STRING: \\.)
                column += 1
            elif char == "'":
                quoted = False  # a doubled quote ('') closes and reopens: the same
        elif char == "'":
            quoted = True
        elif char == "(":
            seen += 1
            if seen > MAX_PARENTHESES:
                _fail(
                    line,
                    column,
                    f"the query has more than {MAX_PARENTHESES} parentheses",
                    [f"at most {MAX_PARENTHESES} parentheses"],
                    "'('",
                )


def _too_long(text: str) -> NoReturn:
    used = 0
    line, column = 1, 1
    for char in text:
        used += len(char.encode("utf-8", "surrogatepass"))
        if used > MAX_QUERY_BYTES:
            break
        if char == "\n":
            line, column = line + 1, 1
        else:
            column += 1
    _fail(
        line,
        column,
        f"the query is longer than {MAX_QUERY_BYTES} bytes (UTF-8)",
        [f"a query of at most {MAX_QUERY_BYTES} bytes"],
        None,
    )


# --- rendering --------------------------------------------------------------------------------

_OR, _AND, _NOT, _ATOM = 1, 2, 3, 4


def render_registryql(query: RegistryQuery) -> str:
    """The RegistryQL text of `query`, on one line; parsing it gives back an equal query.

    Raises `ValueError` for what the language cannot express: a cursor (sent beside the query),
    a `HasRelationship` node (only `POST /v1/discover` builds those), non-finite numbers,
    strings with control characters, names outside the token syntax."""
    if query.cursor is not None:
        raise ValueError("RegistryQL has no cursor clause")
    if query.entry_type == ALL_TYPES:
        parts = ["DISCOVER *"]
    elif _TYPE_NAME.fullmatch(query.entry_type):
        parts = [f"DISCOVER {query.entry_type}"]
    else:
        raise ValueError(f"entry type {query.entry_type!r} is not a token")
    if query.service_type is not None:
        parts.append(f"WITH SERVICE {_quote(query.service_type)}")
    if query.where is not None:
        parts.append(f"WHERE {_render(query.where, _OR)}")
    if query.order:
        keys = ", ".join(f"{k.field} {'DESC' if k.descending else 'ASC'}" for k in query.order)
        parts.append(f"ORDER BY {keys}")
    if query.limit is not None:
        parts.append(f"LIMIT {query.limit}")
    if query.offset is not None:
        parts.append(f"OFFSET {query.offset}")
    return " ".join(parts)


def _render(expr: Expr, context: int) -> str:
    """`expr` as text, parenthesised when it binds more loosely than its `context` requires."""
    if isinstance(expr, Or):
        text, level = " OR ".join(_render(e, _AND) for e in expr.exprs), _OR
    elif isinstance(expr, And):
        text, level = " AND ".join(_render(e, _NOT) for e in expr.exprs), _AND
    elif isinstance(expr, Not):
        text, level = f"NOT {_render(expr.expr, _NOT)}", _NOT
    elif isinstance(expr, Compare):
        text, level = f"{_field(expr.field)} {expr.op} {_literal(expr.value)}", _ATOM
    elif isinstance(expr, InList):
        values = ", ".join(_literal(v) for v in expr.values)
        text, level = f"{_field(expr.field)} IN ({values})", _ATOM
    elif isinstance(expr, Contains):
        text, level = f"{_field(expr.field)} CONTAINS {_literal(expr.value)}", _ATOM
    elif isinstance(expr, Match):
        text, level = f"MATCH {_quote(expr.text)}", _ATOM
    elif isinstance(expr, HasRelationship):
        raise ValueError("HasRelationship has no RegistryQL form")
    else:  # pragma: no cover - Expr is closed
        raise ValueError(f"not an expression: {expr!r}")
    return f"({text})" if level < context else text


def _field(name: str) -> str:
    if not _FIELD_NAME.fullmatch(name):
        raise ValueError(f"field {name!r} cannot be written in RegistryQL")
    return name


def _literal(value: Value) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        if abs(value) > MAX_SAFE_INTEGER:
            raise ValueError(f"{value} is beyond ±(2^53 - 1)")
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} has no RegistryQL form")
        return repr(value)
    return _quote(value)


def _quote(text: str) -> str:
    bad = next((c for c in text if _string_problem(c)), None)
    if bad is not None:
        raise ValueError(f"strings may not hold {_show_char(bad)}")
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
