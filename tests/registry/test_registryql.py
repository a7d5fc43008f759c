"""RegistryQL: every construct, precedence, escaping, every error with its position, the limits,
the documented examples, and a Hypothesis round trip (render → parse gives the same query)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from registry.errors import Invalid
from registry.query import (
    FIELDS,
    MAX_IN_VALUES,
    MAX_NODES,
    MAX_OFFSET,
    MAX_TEXT,
    METADATA_PREFIX,
    ORDER_FIELDS,
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
    check_operator,
    check_query,
    count_nodes,
    field_spec,
    match_texts,
)
from registry.registryql import (
    GRAMMAR_PATH,
    MAX_QUERY_BYTES,
    MAX_SAFE_INTEGER,
    parse_registryql,
    render_registryql,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "registryql.md"


def where(text: str) -> Expr | None:
    return parse_registryql(f"DISCOVER * WHERE {text}").where


def eq(field: str, value: Value) -> Compare:
    return Compare(field, "=", value)


A, B, C, D = eq("name", "a"), eq("name", "b"), eq("name", "c"), eq("name", "d")


def assert_invalid(text: str) -> Invalid:
    with pytest.raises(Invalid) as caught:
        parse_registryql(text)
    error = caught.value
    assert error.code == "invalid_registryql"
    assert set(error.details) >= {"line", "column", "expected"}
    assert error.message.startswith(
        f"line {error.details['line']}, column {error.details['column']}: "
    )
    return error


# --- constructs -------------------------------------------------------------------------------


def test_discover_star_alone() -> None:
    assert parse_registryql("DISCOVER *") == RegistryQuery(entry_type="*")


def test_discover_type_is_case_sensitive_and_token_shaped() -> None:
    assert parse_registryql("DISCOVER Agent.v2_beta-1").entry_type == "Agent.v2_beta-1"
    assert parse_registryql("DISCOVER " + "a" * 64).entry_type == "a" * 64


def test_a_keyword_is_a_type_name_after_discover() -> None:
    # the contextual lexer reads a keyword only where the grammar accepts it
    assert parse_registryql("DISCOVER where WHERE name = 'x'") == RegistryQuery(
        entry_type="where", where=eq("name", "x")
    )
    assert parse_registryql("DISCOVER limit LIMIT 3").entry_type == "limit"


def test_with_service() -> None:
    assert parse_registryql("DISCOVER agent WITH SERVICE 'A2A'") == RegistryQuery(
        entry_type="agent", service_type="A2A"
    )


def test_every_clause_in_order() -> None:
    text = (
        "DISCOVER agent WITH SERVICE 'MCP' WHERE MATCH 'translate' AND tags CONTAINS 'nlp' "
        "ORDER BY relevance DESC, publishedAt LIMIT 20 OFFSET 40"
    )
    assert parse_registryql(text) == RegistryQuery(
        entry_type="agent",
        service_type="MCP",
        where=And((Match("translate"), Contains("tags", "nlp"))),
        order=(OrderKey("relevance", True), OrderKey("publishedAt", False)),
        limit=20,
        offset=40,
    )


@pytest.mark.parametrize("op", ["=", "!=", "<", ">", "<=", ">="])
def test_comparison_operators(op: str) -> None:
    assert where(f"sequence {op} 7") == Compare("sequence", op, 7)  # type: ignore[arg-type]
    assert where(f"name{op}'x'") == Compare("name", op, "x")  # type: ignore[arg-type]


def test_in_list() -> None:
    assert where("tags IN ('a')") == InList("tags", ("a",))
    assert where("tags IN ('a', 'b','c')") == InList("tags", ("a", "b", "c"))
    assert where("sequence IN (1, 2, 3)") == InList("sequence", (1, 2, 3))
    values = ", ".join(f"'t{i}'" for i in range(MAX_IN_VALUES))
    assert where(f"tags IN ({values})") == InList(
        "tags", tuple(f"t{i}" for i in range(MAX_IN_VALUES))
    )


def test_contains_and_match() -> None:
    assert where("serviceType CONTAINS 'A2A'") == Contains("serviceType", "A2A")
    assert where("name CONTAINS 'bot'") == Contains("name", "bot")
    assert where("description CONTAINS 'pdf'") == Contains("description", "pdf")
    assert where("MATCH 'pdf summariser'") == Match("pdf summariser")


def test_fields_from_the_issue() -> None:
    assert where("customMetadata.team = 'x'") == eq("customMetadata.team", "x")
    assert where("customMetadata.cost-center_2 != 'ops'") == Compare(
        "customMetadata.cost-center_2", "!=", "ops"
    )
    assert where("relationships.targetDid = 'did:web:example.com:a'") == eq(
        "relationships.targetDid", "did:web:example.com:a"
    )
    assert where("relationships.relationshipType IN ('dependsOn', 'extends')") == InList(
        "relationships.relationshipType", ("dependsOn", "extends")
    )
    assert where("serviceType = 'A2A'") == eq("serviceType", "A2A")


SAMPLES: dict[str, tuple[str, Value]] = {
    # a value of the type each kind of field compares with: (text, value)
    "time": ("'2026-01-02T03:04:05Z'", "2026-01-02T03:04:05Z"),
    "int": ("12", 12),
    "metadata": ("TRUE", True),
}


def test_every_field_with_every_operator_it_allows() -> None:
    for name, spec in [*FIELDS.items(), ("customMetadata.k", field_spec("customMetadata.k"))]:
        assert spec is not None
        text, value = SAMPLES.get(spec.kind, ("'v'", "v"))
        for op in spec.ops:
            condition = {
                "IN": f"{name} IN ({text})",
                "CONTAINS": f"{name} CONTAINS {text}",
            }.get(op, f"{name} {op} {text}")
            expected = {
                "IN": InList(name, (value,)),
                "CONTAINS": Contains(name, value),
            }.get(op, Compare(name, op, value))  # type: ignore[arg-type]
            assert where(condition) == expected, condition


def test_value_types_follow_the_field() -> None:
    assert where("publishedAt >= '2026-01-02T03:04:05.123+02:00'") == Compare(
        "publishedAt", ">=", "2026-01-02T03:04:05.123+02:00"
    )
    assert where("sequence IN (0, 5)") == InList("sequence", (0, 5))
    for value, parsed in [("'x'", "x"), ("-1.5", -1.5), ("FALSE", False), ("NULL", None)]:
        assert where(f"customMetadata.k != {value}") == Compare("customMetadata.k", "!=", parsed)


def test_values() -> None:
    assert where("customMetadata.n = 42") == eq("customMetadata.n", 42)
    assert where("customMetadata.n = -42") == eq("customMetadata.n", -42)
    assert where("customMetadata.n = 0.5") == eq("customMetadata.n", 0.5)
    assert where("customMetadata.n = -2.5e-3") == eq("customMetadata.n", -0.0025)
    assert where("customMetadata.n = 1E3") == eq("customMetadata.n", 1000.0)
    assert where(f"sequence < {MAX_SAFE_INTEGER}") == Compare("sequence", "<", MAX_SAFE_INTEGER)
    assert where(f"customMetadata.n = -{MAX_SAFE_INTEGER}") == eq(
        "customMetadata.n", -MAX_SAFE_INTEGER
    )
    for text, value in [("TRUE", True), ("false", False), ("Null", None)]:
        parsed = where(f"customMetadata.x = {text}")
        assert isinstance(parsed, Compare)
        assert parsed.value is value
    one = where("customMetadata.n = 1")
    assert isinstance(one, Compare)
    assert type(one.value) is int
    one_point_oh = where("customMetadata.n = 1.0")
    assert isinstance(one_point_oh, Compare)
    assert type(one_point_oh.value) is float


def test_string_escapes() -> None:
    assert where(r"name = 'it\'s'") == eq("name", "it's")
    assert where("name = 'it''s'") == eq("name", "it's")
    assert where(r"name = 'back\\slash'") == eq("name", "back\\slash")
    assert where(r"name = '\\\''") == eq("name", "\\'")
    assert where("name = ''") == eq("name", "")
    assert where("name = ''''") == eq("name", "'")
    assert where("name = 'tab\there'") == eq("name", "tab\there")
    assert where("name = 'ünïcødé ✓ 𝄞'") == eq("name", "ünïcødé ✓ 𝄞")
    assert where("name = 'AND OR NOT ( ) --'") == eq("name", "AND OR NOT ( ) --")


def test_order_by_keys_and_default_direction() -> None:
    query = parse_registryql("DISCOVER * ORDER BY name, updatedAt DESC, sequence ASC")
    assert query.order == (
        OrderKey("name", False),
        OrderKey("updatedAt", True),
        OrderKey("sequence", False),
    )


def test_relevance_order_needs_a_match_outside_not() -> None:
    query = parse_registryql("DISCOVER * WHERE MATCH 'x' OR NOT MATCH 'y' ORDER BY relevance")
    assert query.order == (OrderKey("relevance", False),)


def test_limit_and_offset() -> None:
    assert parse_registryql("DISCOVER * LIMIT 1").limit == 1
    assert parse_registryql(f"DISCOVER * LIMIT {MAX_SAFE_INTEGER}").limit == MAX_SAFE_INTEGER
    query = parse_registryql(f"DISCOVER * OFFSET {MAX_OFFSET}")
    assert (query.limit, query.offset) == (None, MAX_OFFSET)
    assert parse_registryql("DISCOVER * LIMIT 5 OFFSET 0").offset == 0
    assert parse_registryql("DISCOVER * LIMIT 00000000000000000000005").limit == 5


def test_keywords_are_case_insensitive() -> None:
    upper = parse_registryql(
        "DISCOVER agent WITH SERVICE 'A2A' WHERE NOT name = 'a' AND tags IN ('x') OR "
        "tags CONTAINS 'y' OR MATCH 'z' ORDER BY name DESC LIMIT 5 OFFSET 1"
    )
    lower = parse_registryql(
        "discover agent with service 'A2A' where not name = 'a' and tags in ('x') or "
        "tags contains 'y' or match 'z' order by name desc limit 5 offset 1"
    )
    mixed = parse_registryql(
        "Discover agent With Service 'A2A' Where nOt name = 'a' And tags iN ('x') oR "
        "tags Contains 'y' Or Match 'z' Order By name Desc Limit 5 Offset 1"
    )
    assert upper == lower == mixed


def test_names_are_case_sensitive() -> None:
    assert parse_registryql("DISCOVER Agent").entry_type == "Agent"
    assert_invalid("DISCOVER * WHERE Name = 'x'")
    assert_invalid("DISCOVER * ORDER BY Name")


def test_whitespace_and_newlines() -> None:
    text = "\n  DISCOVER\tagent\r\n  WHERE name='x'\n  ORDER BY name\n  LIMIT 5\n"
    assert parse_registryql(text) == RegistryQuery(
        entry_type="agent", where=eq("name", "x"), order=(OrderKey("name", False),), limit=5
    )


# --- precedence and shape -----------------------------------------------------------------------


def test_and_binds_tighter_than_or() -> None:
    assert where("name = 'a' OR name = 'b' AND name = 'c'") == Or((A, And((B, C))))
    assert where("name = 'a' AND name = 'b' OR name = 'c'") == Or((And((A, B)), C))


def test_not_binds_tighter_than_and() -> None:
    assert where("NOT name = 'a' AND name = 'b'") == And((Not(A), B))
    assert where("name = 'a' OR NOT name = 'b'") == Or((A, Not(B)))
    assert where("NOT NOT name = 'a'") == Not(Not(A))


def test_parentheses_override() -> None:
    assert where("NOT (name = 'a' OR name = 'b')") == Not(Or((A, B)))
    assert where("(name = 'a' OR name = 'b') AND name = 'c'") == And((Or((A, B)), C))
    assert where("name = 'a' AND (name = 'b' OR (name = 'c' AND NOT (name = 'd')))") == And(
        (A, Or((B, And((C, Not(D))))))
    )
    assert where("((((name = 'a'))))") == A


def test_chains_are_flattened_to_the_canonical_shape() -> None:
    assert where("name = 'a' AND name = 'b' AND name = 'c'") == And((A, B, C))
    assert where("(name = 'a' AND name = 'b') AND (name = 'c' AND name = 'd')") == And((A, B, C, D))
    assert where("name = 'a' OR (name = 'b' OR name = 'c') OR name = 'd'") == Or((A, B, C, D))
    assert where("(name = 'a' OR name = 'b') AND name = 'c' AND name = 'd'") == And(
        (Or((A, B)), C, D)
    )


# --- errors -----------------------------------------------------------------------------------

LONG_TYPE = "a" * 65
TOO_MANY_IN = ", ".join(["'t'"] * (MAX_IN_VALUES + 1))
# MAX_NODES leaves under one OR: MAX_NODES + 1 nodes; the OR before the last leaf crosses the limit
TOO_MANY_OR = " OR ".join(["name = 'a'"] * MAX_NODES)
LAST_OR = len("DISCOVER agent WHERE ") + len("name = 'a' OR ") * (MAX_NODES - 1) - 2

ERRORS = [
    # (query, line, column, a word of the message)
    ("", 1, 1, "expected DISCOVER"),
    ("   ", 1, 1, "expected DISCOVER"),
    ("FIND agent", 1, 1, "expected DISCOVER; found 'FIND'"),
    ("DISCOVER", 1, 9, "entry type"),
    ("DISCOVER 'agent'", 1, 10, "entry type"),
    ("DISCOVER 9agent", 1, 10, "entry type"),
    (f"DISCOVER {LONG_TYPE}", 1, 10, "64 characters"),
    ("DISCOVER agent FROM x", 1, 16, "WITH SERVICE, WHERE, ORDER BY, LIMIT, OFFSET, end of query"),
    (
        "DISCOVER agent WHERE name = 'x' FROM",
        1,
        33,
        "expected one of: AND, OR, ORDER BY, LIMIT, OFFSET, end of query; found 'FROM'",
    ),
    ("DISCOVER agent WITH 'A2A'", 1, 21, "expected SERVICE"),
    ("DISCOVER agent WITH SERVICE A2A", 1, 29, "expected string"),
    ("DISCOVER agent WHERE", 1, 21, "NOT, MATCH, '(', field name; found end of query"),
    ("DISCOVER agent WHERE name", 1, 26, "comparison operator"),
    ("DISCOVER agent WHERE name =", 1, 28, "string, number, TRUE, FALSE, NULL"),
    ("DISCOVER agent WHERE name == 'x'", 1, 28, "found '='"),
    ("DISCOVER agent WHERE name = x", 1, 29, "found 'x'"),
    ("DISCOVER agent WHERE name = TRUEST", 1, 29, "found 'TRUEST'"),
    ("DISCOVER agent WHERE name = 'x' AND", 1, 36, "field name; found end of query"),
    ("DISCOVER agent WHERE name = 'x' AND OR name = 'y'", 1, 37, "found 'OR'"),
    ("DISCOVER agent WHERE NOT", 1, 25, "field name"),
    ("DISCOVER agent WHERE (name = 'x'", 1, 33, "')'"),
    ("DISCOVER agent WHERE name = 'x')", 1, 32, "AND, OR, ORDER BY"),
    ("DISCOVER agent WHERE ()", 1, 23, "found ')'"),
    ("DISCOVER agent WHERE name = 'x' # note", 1, 33, "found '#'"),
    ('DISCOVER agent WHERE name = "x"', 1, 29, "strings use single quotes"),
    ("DISCOVER agent WHERE name = 'x", 1, 29, "unterminated string"),
    ("DISCOVER agent WHERE name = 'it''s", 1, 29, "unterminated string"),
    (r"DISCOVER agent WHERE name = 'x\'", 1, 29, "unterminated string"),
    (r"DISCOVER agent WHERE name = 'a\nb'", 1, 31, "unknown escape \\n"),
    ("DISCOVER agent WHERE name = 'a\x01b'", 1, 31, "control character U+0001"),
    ("DISCOVER agent WHERE name = 'a\nb'", 1, 31, "control character U+000A"),
    ("DISCOVER agent WHERE name = 'a' AND \x00", 1, 37, "found U+0000"),
    ("DISCOVER agent WHERE tags IN 'a'", 1, 30, "expected '('"),
    ("DISCOVER agent WHERE tags IN ()", 1, 31, "string"),
    ("DISCOVER agent WHERE tags IN ('a',)", 1, 35, "found ')'"),
    ("DISCOVER agent WHERE tags IN ('a' 'b')", 1, 35, "expected one of: ',', ')'"),
    (f"DISCOVER agent WHERE tags IN ({TOO_MANY_IN})", 1, 31 + 5 * MAX_IN_VALUES, "at most 100"),
    ("DISCOVER agent WHERE nme = 'x'", 1, 22, "unknown field 'nme'"),
    ("DISCOVER agent WHERE customMetadata.a.b = 'x'", 1, 22, "unknown field"),
    ("DISCOVER agent WHERE tags = 'x'", 1, 22, "operator = does not apply to tags"),
    ("DISCOVER agent WHERE name = 'x' OR description = 'x'", 1, 36, "does not apply"),
    ("DISCOVER agent WHERE publishedAt IN ('x')", 1, 22, "operator IN does not apply"),
    ("DISCOVER agent WHERE customMetadata.a CONTAINS 'x'", 1, 22, "CONTAINS does not apply"),
    ("DISCOVER agent WHERE customMetadata.a < 1", 1, 22, "allowed: !=, ="),
    ("DISCOVER agent WHERE serviceType != 'A2A'", 1, 22, "does not apply"),
    ("DISCOVER agent WHERE name = 5", 1, 29, "name compares with text: expected a string"),
    ("DISCOVER agent WHERE tags CONTAINS NULL", 1, 36, "expected a string"),
    ("DISCOVER agent WHERE tags IN ('a', TRUE)", 1, 36, "tags compares with text"),
    ("DISCOVER agent WHERE sequence = '5'", 1, 33, "non-negative integer"),
    ("DISCOVER agent WHERE sequence = 1.0", 1, 33, "non-negative integer"),
    ("DISCOVER agent WHERE sequence > -1", 1, 33, "non-negative integer"),
    ("DISCOVER agent WHERE publishedAt > 5", 1, 36, "RFC 3339 date-time string"),
    ("DISCOVER agent WHERE updatedAt < '2026-01-02'", 1, 34, "date-time with offset"),
    ("DISCOVER agent WHERE sequence > 9007199254740992", 1, 33, "out of range"),
    ("DISCOVER agent WHERE sequence > -9007199254740992", 1, 33, "out of range"),
    ("DISCOVER agent WHERE sequence > " + "9" * 5000, 1, 33, "out of range"),
    ("DISCOVER agent WHERE sequence > 1e400", 1, 33, "finite number"),
    ("DISCOVER agent WHERE MATCH", 1, 27, "expected string"),
    ("DISCOVER agent WHERE MATCH 5", 1, 28, "expected string"),
    ("DISCOVER agent WHERE MATCH '  '", 1, 28, "MATCH needs some text"),
    (f"DISCOVER agent WHERE MATCH '{'x' * (MAX_TEXT + 1)}'", 1, 28, "longer than 512"),
    (f"DISCOVER agent WHERE {TOO_MANY_OR}", 1, LAST_OR, "too complex"),
    (f"DISCOVER agent WHERE {'NOT ' * MAX_NODES}name = 'x'", 1, 22, "too complex"),
    ("DISCOVER agent ORDER name", 1, 22, "expected BY"),
    ("DISCOVER agent ORDER BY", 1, 24, "expected order field"),
    ("DISCOVER agent ORDER BY nam", 1, 25, "unknown order field 'nam'"),
    ("DISCOVER agent ORDER BY name,", 1, 30, "order field"),
    ("DISCOVER agent ORDER BY name ASC DESC", 1, 34, "found 'DESC'"),
    ("DISCOVER agent ORDER BY name, sequence, name DESC", 1, 41, "name appears twice"),
    ("DISCOVER agent ORDER BY relevance", 1, 25, "needs a MATCH"),
    ("DISCOVER agent WHERE NOT MATCH 'x' ORDER BY relevance", 1, 45, "needs a MATCH"),
    ("DISCOVER agent LIMIT", 1, 21, "expected number"),
    ("DISCOVER agent LIMIT 0", 1, 22, "LIMIT must be a whole number between 1 and"),
    ("DISCOVER agent LIMIT -3", 1, 22, "LIMIT must be"),
    ("DISCOVER agent LIMIT 2.5", 1, 22, "whole number"),
    ("DISCOVER agent LIMIT 1e2", 1, 22, "whole number"),
    ("DISCOVER agent LIMIT 9007199254740992", 1, 22, "LIMIT must be"),
    ("DISCOVER agent LIMIT 'ten'", 1, 22, "expected number"),
    ("DISCOVER agent OFFSET 10001", 1, 23, "OFFSET must be a whole number between 0 and 10000"),
    ("DISCOVER agent OFFSET -1", 1, 23, "OFFSET must be"),
    ("DISCOVER agent OFFSET 5 LIMIT 5", 1, 25, "expected end of query; found 'LIMIT'"),
    ("DISCOVER agent LIMIT 5 WHERE name = 'x'", 1, 24, "expected one of: OFFSET, end of query"),
    ("DISCOVER agent WHERE name = 'x' WITH SERVICE 'A2A'", 1, 33, "found 'WITH'"),
    ("DISCOVER agent DISCOVER agent", 1, 16, "found 'DISCOVER'"),
    ("DISCOVER agent LIMIT 5 LIMIT 6", 1, 24, "found 'LIMIT'"),
    # positions on later lines
    ("DISCOVER agent\nWHERE name = 'x'\n  AND tags = 'y'", 3, 7, "does not apply to tags"),
    ("DISCOVER agent\nWHERE name = 'x'\nORDER BY\n", 3, 9, "order field"),
    ("DISCOVER agent\nWHERE\n  name = 'ab\\q'", 3, 13, "unknown escape \\q"),
    ("DISCOVER agent\nWHERE name = 'x\nLIMIT 5", 2, 14, "unterminated string"),
    ("DISCOVER agent\n\n  WHERE name = 'x'\n  LIMIT 0", 4, 9, "LIMIT must be"),
    ("\n\nDISCOVER agent\nWHERE (name = 'x'\n  OR tags CONTAINS 'y'", 5, 23, "')'"),
    ("DISCOVER agent\nWHERE MATCH 'x'\nORDER BY name,\n  name", 4, 3, "twice"),
]


@pytest.mark.parametrize(("text", "line", "column", "word"), ERRORS)
def test_invalid_queries_name_their_position(text: str, line: int, column: int, word: str) -> None:
    error = assert_invalid(text)
    assert (error.details["line"], error.details["column"]) == (line, column), error.message
    assert word in error.message
    assert error.details["expected"], error.message


def test_error_shape() -> None:
    error = assert_invalid("DISCOVER agent WHERE name = 'x' FROM")
    assert error.message == (
        "line 1, column 33: expected one of: AND, OR, ORDER BY, LIMIT, OFFSET, end of query; "
        "found 'FROM'"
    )
    assert error.details == {
        "line": 1,
        "column": 33,
        "expected": ["AND", "OR", "ORDER BY", "LIMIT", "OFFSET", "end of query"],
        "found": "'FROM'",
    }
    assert error.status == 400


def test_semantic_error_lists_what_is_allowed() -> None:
    error = assert_invalid("DISCOVER agent WHERE tags < 'x'")
    assert error.details["expected"] == ["CONTAINS", "IN"]
    assert error.details["found"] == "'tags'"
    error = assert_invalid("DISCOVER agent WHERE nme = 'x'")
    assert error.details["expected"] == [*FIELDS, "customMetadata.<key>"]


def test_no_parser_internals_in_messages() -> None:
    for text, *_ in ERRORS:
        message = assert_invalid(text).message
        for internal in ("Token(", "Tree(", "$END", "_LPAR", "_RPAR", "_COMMA", "TYPE_NAME"):
            assert internal not in message, message


def test_the_query_text_is_limited_to_8_kib() -> None:
    padding = " " * (MAX_QUERY_BYTES - len("DISCOVER *"))
    assert parse_registryql("DISCOVER *" + padding) == RegistryQuery()
    error = assert_invalid("DISCOVER *" + padding + " ")
    assert (error.details["line"], error.details["column"]) == (1, MAX_QUERY_BYTES + 1)
    assert "8192 bytes" in error.message
    # bytes, not characters: 3000 three-byte characters are over the limit
    error = assert_invalid("DISCOVER * WHERE\nname = '" + "€" * 3000 + "'")
    assert error.details["line"] == 2
    assert "8192 bytes" in error.message


def test_node_limit_boundary() -> None:
    # MAX_NODES - 1 leaves joined by OR: exactly MAX_NODES nodes
    exactly = " OR ".join(["name = 'a'"] * (MAX_NODES - 1))
    parsed = where(exactly)
    assert isinstance(parsed, Or)
    assert count_nodes(parsed) == MAX_NODES
    assert_invalid(f"DISCOVER * WHERE {exactly} OR name = 'a'")
    assert count_nodes(where("NOT " * (MAX_NODES - 1) + "name = 'a'")) == MAX_NODES


def test_deep_nesting_is_an_error_not_a_crash() -> None:
    for text in [
        "DISCOVER * WHERE " + "NOT " * 2000 + "name = 'x'",
        "DISCOVER * WHERE " + "(name = 'x' AND " * 400 + "name = 'x'" + ")" * 400,
        "DISCOVER * WHERE " + "(" * 4000,
    ]:
        assert_invalid(text)
    # parentheses alone add no nodes, up to MAX_PARENTHESES of them (parsing costs their tokens)
    assert where("(" * 256 + "name = 'x'" + ")" * 256) == eq("name", "x")
    assert_invalid("DISCOVER * WHERE " + "(" * 3000 + "name = 'x'" + ")" * 3000)


def test_match_text_boundary() -> None:
    assert where(f"MATCH '{'x' * MAX_TEXT}'") == Match("x" * MAX_TEXT)


# --- rendering --------------------------------------------------------------------------------


def test_render_text() -> None:
    query = RegistryQuery(
        entry_type="agent",
        service_type="A2A",
        where=And(
            (
                Or((A, Not(B))),
                Not(And((C, D))),
                Compare("customMetadata.k", "!=", "it's \\ fine"),
                InList("sequence", (1, 2)),
                Compare("customMetadata.n", "=", -2.5),
                Compare("customMetadata.b", "=", True),
                Compare("customMetadata.z", "!=", None),
                Match("x"),
            )
        ),
        order=(OrderKey("relevance", True), OrderKey("name", False)),
        limit=10,
        offset=0,
    )
    text = render_registryql(query)
    assert text == (
        "DISCOVER agent WITH SERVICE 'A2A' WHERE (name = 'a' OR NOT name = 'b') AND "
        "NOT (name = 'c' AND name = 'd') AND customMetadata.k != 'it\\'s \\\\ fine' AND "
        "sequence IN (1, 2) AND customMetadata.n = -2.5 AND customMetadata.b = TRUE AND "
        "customMetadata.z != NULL AND MATCH 'x' "
        "ORDER BY relevance DESC, name ASC LIMIT 10 OFFSET 0"
    )
    assert parse_registryql(text) == query
    assert render_registryql(RegistryQuery()) == "DISCOVER *"


@pytest.mark.parametrize(
    "query",
    [
        RegistryQuery(cursor="abc"),
        RegistryQuery(entry_type="not a token"),
        RegistryQuery(where=HasRelationship("dependsOn", None)),
        RegistryQuery(where=Compare("customMetadata.k", "=", float("nan"))),
        RegistryQuery(where=Compare("customMetadata.k", "=", float("inf"))),
        RegistryQuery(where=Compare("sequence", "=", 2**53)),
        RegistryQuery(where=Compare("name", "=", "line\nbreak")),
        RegistryQuery(where=Compare("bad field", "=", "x")),
    ],
)
def test_render_refuses_what_the_language_cannot_say(query: RegistryQuery) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own message
        render_registryql(query)


# --- the documentation ------------------------------------------------------------------------


def doc_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", DOCS.read_text("utf-8"), re.M | re.S)


def test_the_documented_grammar_is_the_grammar_file() -> None:
    assert doc_blocks("lark") == [GRAMMAR_PATH.read_text("utf-8")]


def test_every_documented_example_parses_and_round_trips() -> None:
    examples = doc_blocks("registryql")
    assert len(examples) >= 10
    for example in examples:
        query = parse_registryql(example)
        assert parse_registryql(render_registryql(query)) == query, example


def test_documented_error_messages_are_real() -> None:
    text = DOCS.read_text("utf-8")
    section = text[text.index("More messages") : text.index("A query may have several")]
    rows = re.findall(r"^\| `(.+?)` \| `(.+)` \|$", section, re.M)
    assert len(rows) >= 8
    for query, message in rows:
        actual = assert_invalid(query).message
        if "…" in message:  # shortened in the docs: the start and the end must match
            head, tail = message.split("…")
            assert actual.startswith(head.rstrip(", ")), actual
            assert actual.endswith(tail), actual
        else:
            assert actual == message


def test_documented_examples_mean_what_the_docs_say() -> None:
    assert parse_registryql(
        "DISCOVER agent WITH SERVICE 'A2A'\n"
        "WHERE MATCH 'invoice extraction' AND lifecycleStatus = 'active'\n"
        "ORDER BY relevance DESC, publishedAt DESC\n"
        "LIMIT 20"
    ) == RegistryQuery(
        entry_type="agent",
        service_type="A2A",
        where=And((Match("invoice extraction"), eq("lifecycleStatus", "active"))),
        order=(OrderKey("relevance", True), OrderKey("publishedAt", True)),
        limit=20,
    )
    assert parse_registryql(
        "DISCOVER * WHERE tags IN ('ocr', 'pdf') AND (customMetadata.team = 'finance' "
        "OR publisherDid = 'did:web:acme.example') ORDER BY name LIMIT 50 OFFSET 100"
    ) == RegistryQuery(
        where=And(
            (
                InList("tags", ("ocr", "pdf")),
                Or(
                    (
                        eq("customMetadata.team", "finance"),
                        eq("publisherDid", "did:web:acme.example"),
                    )
                ),
            )
        ),
        order=(OrderKey("name", False),),
        limit=50,
        offset=100,
    )


# --- properties -------------------------------------------------------------------------------

TEXT_CHARS = st.characters(exclude_categories=["Cc", "Cs"], include_characters="\t'\\")
strings = st.text(TEXT_CHARS, max_size=12) | st.sampled_from(["", "'", "''", "\\", "\\'", "a b"])
safe_ints = st.integers(-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
timestamps = st.datetimes().map(lambda d: d.isoformat() + "Z")
dids = st.from_regex(r"did:(web|key):[A-Za-z0-9.:_-]{1,30}", fullmatch=True)
VALUES: dict[str, st.SearchStrategy[Value]] = {
    "text": strings,
    "token": st.from_regex(r"[A-Za-z][A-Za-z0-9._-]{0,20}", fullmatch=True),
    "did": dids,
    "time": timestamps,
    "int": st.integers(0, MAX_SAFE_INTEGER),
    "list": strings,
    "relationship": dids | strings,
    "metadata": st.one_of(strings, safe_ints, finite_floats, st.booleans(), st.none()),
}
metadata_fields = st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True).map(
    lambda key: METADATA_PREFIX + key
)
field_names = st.sampled_from(sorted(FIELDS)) | metadata_fields


@st.composite
def predicates(draw: st.DrawFn) -> Expr:
    name = draw(field_names)
    spec = field_spec(name)
    assert spec is not None
    op = draw(st.sampled_from(sorted(spec.ops)))
    assert check_operator(name, op) is None
    values = VALUES[spec.kind]
    if op == "IN":
        return InList(name, tuple(draw(st.lists(values, min_size=1, max_size=5))))
    if op == "CONTAINS":
        return Contains(name, draw(values))
    return Compare(name, op, draw(values))  # type: ignore[arg-type]


match_text = st.text(TEXT_CHARS, min_size=1, max_size=20).filter(str.strip)
leaves = predicates() | st.builds(Match, match_text)


def joined(kind: type[And] | type[Or], parts: list[Expr]) -> Expr:
    flat: list[Expr] = []
    for part in parts:
        flat.extend(part.exprs if isinstance(part, kind) else (part,))
    return kind(tuple(flat))


def compound(children: st.SearchStrategy[Expr]) -> st.SearchStrategy[Expr]:
    several = st.lists(children, min_size=2, max_size=4)
    return st.one_of(
        children.map(Not),
        several.map(lambda parts: joined(And, parts)),
        several.map(lambda parts: joined(Or, parts)),
    )


expressions = st.recursive(leaves, compound, max_leaves=12).filter(
    lambda e: count_nodes(e) <= MAX_NODES
)
entry_types = st.one_of(
    st.just("*"),
    st.from_regex(r"[A-Za-z][A-Za-z0-9._-]{0,63}", fullmatch=True),
    st.sampled_from(["where", "DISCOVER", "Order", "limit", "not", "with", "asc", "null"]),
)


@st.composite
def queries(draw: st.DrawFn) -> RegistryQuery:
    expr = draw(st.none() | expressions)
    usable = [f for f in ORDER_FIELDS if f != "relevance" or match_texts(expr)]
    fields = draw(st.lists(st.sampled_from(usable), unique=True, max_size=len(usable)))
    query = RegistryQuery(
        entry_type=draw(entry_types),
        service_type=draw(st.none() | strings),
        where=expr,
        order=tuple(OrderKey(f, draw(st.booleans())) for f in fields),  # type: ignore[arg-type]
        limit=draw(st.none() | st.integers(1, MAX_SAFE_INTEGER)),
        offset=draw(st.none() | st.integers(0, MAX_OFFSET)),
    )
    check_query(query)
    return query


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(queries())
def test_render_then_parse_gives_the_same_query(query: RegistryQuery) -> None:
    text = render_registryql(query)
    assume(len(text.encode("utf-8")) <= MAX_QUERY_BYTES)
    parsed = parse_registryql(text)
    assert parsed == query
    # == alone would equate True with 1 and 1.0 with 1; repr tells the types apart
    assert repr(parsed) == repr(query)


VOCABULARY = [
    "DISCOVER", "discover", "*", "agent", "WITH", "SERVICE", "WHERE", "where", "AND", "OR",
    "NOT", "(", ")", ",", "IN", "CONTAINS", "MATCH", "ORDER", "BY", "ASC", "DESC", "LIMIT",
    "OFFSET", "TRUE", "NULL", "name", "tags", "sequence", "relevance", "customMetadata.k",
    "nme", "=", "!=", "<", ">=", "'x'", "'it''s'", "'a\\nb'", "'", "\"", "5", "-1", "0",
    "2.5", "1e999", "#", "\x00", "\n",
]  # fmt: skip


def outcome(text: str) -> RegistryQuery | Invalid:
    """The parsed query, or the `Invalid` it raised (any other exception fails the test)."""
    try:
        return parse_registryql(text)
    except Invalid as error:
        return error


def assert_clean_failure(text: str, error: Invalid) -> None:
    assert error.code == "invalid_registryql"
    line, column = error.details["line"], error.details["column"]
    assert 1 <= line <= text.count("\n") + 1
    assert 1 <= column <= len(text.split("\n")[line - 1]) + 1
    assert error.message.startswith(f"line {line}, column {column}: ")
    assert error.details["expected"]
    assert all(isinstance(word, str) for word in error.details["expected"])


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["", "DISCOVER * ", "DISCOVER agent WHERE "]),
    st.lists(st.sampled_from(VOCABULARY), max_size=14),
    st.sampled_from([" ", "", "\n"]),
)
def test_any_token_soup_parses_or_fails_cleanly(start: str, words: list[str], gap: str) -> None:
    text = start + gap.join(words)
    result = outcome(text)
    if isinstance(result, Invalid):
        assert_clean_failure(text, result)
    else:
        assert parse_registryql(render_registryql(result)) == result


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_any_text_parses_or_fails_cleanly(tail: str) -> None:
    for text in (tail, "DISCOVER * WHERE " + tail):
        result = outcome(text)
        if isinstance(result, Invalid):
            assert_clean_failure(text, result)


def test_parses_are_remembered_but_errors_are_raised_every_time() -> None:
    from registry.registryql import MEMO_TEXT_CHARS

    text = "DISCOVER * WHERE tags CONTAINS 'memo' LIMIT 5"
    assert parse_registryql(text) is parse_registryql(text)
    for _ in range(2):
        with pytest.raises(Invalid):
            parse_registryql("DISCOVER * WHERE")
    long = "DISCOVER * WHERE name = '" + "x" * MEMO_TEXT_CHARS + "'"
    assert parse_registryql(long) == parse_registryql(long)
    assert parse_registryql(long) is not parse_registryql(long)  # too long to remember


def test_the_memo_holds_a_bounded_size_of_queries_whatever_their_shape() -> None:
    """Hostile review: the memo kept the last 4,096 queries of up to 1,024 characters, and a
    query of that length parses into up to ~19 KB (`NOT NOT … name = '…' OR …`): any client
    could make it hold ~76 MiB, past every documented cache. Its texts are bounded in all."""
    import gc
    import tracemalloc

    from registry.registryql import MEMO_CHARS, MEMO_TEXT_CHARS

    def hostile(i: int) -> str:
        term = f"NOT NOT NOT NOT NOT NOT NOT NOT name = 'm{i}'"
        text = "DISCOVER * WHERE " + " OR ".join([term] * 20)
        assert len(text) <= MEMO_TEXT_CHARS  # each one is remembered
        return text

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1000):  # ~18 MB if every one is kept
            parse_registryql(hostile(i))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert MEMO_CHARS * 19 <= 6 * 2**20  # the bound as measured: ~19 bytes a character
    assert held < 8 * 2**20, f"{held / 2**20:.1f} MiB held after 1,000 queries"
    recent = hostile(999)
    assert parse_registryql(recent) is parse_registryql(recent)  # the latest are remembered
