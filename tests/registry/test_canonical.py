"""I-JSON input (RFC 7493) and JCS output (RFC 8785): the bytes every signature and hash is over.

Vectors are RFC 8785's own (§3.2.2 example object, §3.2.3 sorting example, Appendix B number
samples); Hypothesis cross-checks our serializer against the `jcs` reference package and checks
that canonical bytes parse back to the same value.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import jcs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from registry import canonical
from registry.canonical import (
    MAX_DEPTH,
    MAX_SAFE_INTEGER,
    canonical_members,
    canonicalize,
    item_data_hash,
    join_members,
    parse_document,
    parse_strict,
)
from registry.errors import Invalid

# --- RFC 8785 Appendix B: IEEE-754 bit patterns and their canonical text ------------------------

APPENDIX_B = [
    ("0000000000000000", "0"),
    ("8000000000000000", "0"),
    ("0000000000000001", "5e-324"),
    ("8000000000000001", "-5e-324"),
    ("7fefffffffffffff", "1.7976931348623157e+308"),
    ("ffefffffffffffff", "-1.7976931348623157e+308"),
    ("4340000000000000", "9007199254740992"),
    ("c340000000000000", "-9007199254740992"),
    ("4430000000000000", "295147905179352830000"),
    ("44b52d02c7e14af5", "9.999999999999997e+22"),
    ("44b52d02c7e14af6", "1e+23"),
    ("44b52d02c7e14af7", "1.0000000000000001e+23"),
    ("444b1ae4d6e2ef4e", "999999999999999700000"),
    ("444b1ae4d6e2ef4f", "999999999999999900000"),
    ("444b1ae4d6e2ef50", "1e+21"),
    ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
    ("3eb0c6f7a0b5ed8d", "0.000001"),
    ("41b3de4355555553", "333333333.3333332"),
    ("41b3de4355555554", "333333333.33333325"),
    ("41b3de4355555555", "333333333.3333333"),
    ("41b3de4355555556", "333333333.3333334"),
    ("41b3de4355555557", "333333333.33333343"),
    ("becbf647612f3696", "-0.0000033333333333333333"),
    ("43143ff3c1cb0959", "1424953923781206.2"),
]


def _double(bits: str) -> float:
    value: float = struct.unpack(">d", bytes.fromhex(bits))[0]
    return value


@pytest.mark.parametrize(("bits", "expected"), APPENDIX_B)
def test_appendix_b_number_serialisation(bits: str, expected: str) -> None:
    assert canonicalize(_double(bits)) == expected.encode()


@pytest.mark.parametrize(("bits", "expected"), APPENDIX_B)
def test_appendix_b_numbers_inside_a_document_use_the_same_text(bits: str, expected: str) -> None:
    # Inside a container the serializer takes its general (non fast-path) route.
    assert canonicalize({"n": [_double(bits)]}) == f'{{"n":[{expected}]}}'.encode()


@pytest.mark.parametrize("bits", ["7fffffffffffffff", "7ff0000000000000", "fff0000000000000"])
def test_appendix_b_nan_and_infinity_cannot_be_canonicalised(bits: str) -> None:
    with pytest.raises(Invalid) as caught:
        canonicalize({"n": _double(bits)})
    assert caught.value.code == "invalid_number"


# --- RFC 8785 §3.2.2 and §3.2.3 examples --------------------------------------------------------

RFC_EXAMPLE_INPUT = r"""{
  "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
  "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
  "literals": [null, true, false]
}"""
# The RFC prints the expected output as a hex dump; transcribed here byte for byte.
RFC_EXAMPLE_OUTPUT = bytes.fromhex(
    "7b 22 6c 69 74 65 72 61 6c 73 22 3a 5b 6e 75 6c 6c 2c 74 72"
    "75 65 2c 66 61 6c 73 65 5d 2c 22 6e 75 6d 62 65 72 73 22 3a"
    "5b 33 33 33 33 33 33 33 33 33 2e 33 33 33 33 33 33 33 2c 31"
    "65 2b 33 30 2c 34 2e 35 2c 30 2e 30 30 32 2c 31 65 2d 32 37"
    "5d 2c 22 73 74 72 69 6e 67 22 3a 22 e2 82 ac 24 5c 75 30 30"
    "30 66 5c 6e 41 27 42 5c 22 5c 5c 5c 5c 5c 22 2f 22 7d"
)


def test_rfc_8785_example_object_canonical_bytes() -> None:
    assert canonicalize(json.loads(RFC_EXAMPLE_INPUT)) == RFC_EXAMPLE_OUTPUT
    # 1E30 canonicalises to exponent form ("1e+30"), which every parser reads back as the same
    # double, so the strict parser accepts the RFC's own example too.
    assert canonicalize(parse_strict(RFC_EXAMPLE_INPUT)) == RFC_EXAMPLE_OUTPUT


def test_rfc_8785_example_without_1e30_parses_strictly_and_canonicalises() -> None:
    text = RFC_EXAMPLE_INPUT.replace("1E30", "1E15")
    expected = RFC_EXAMPLE_OUTPUT.replace(b"1e+30", b"1000000000000000")
    assert canonicalize(parse_strict(text)) == expected


def test_rfc_8785_utf16_key_sorting_example() -> None:
    document = {
        "\u20ac": "Euro Sign",
        "\r": "Carriage Return",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "1": "One",
        "\U0001f600": "Emoji: Grinning Face",
        "\u0080": "Control",
        "\u00f6": "Latin Small Letter O With Diaeresis",
    }
    out = canonicalize(document)
    values = [value for _, value in json.loads(out, object_pairs_hook=list)]
    assert values == [
        "Carriage Return",
        "One",
        "Control",
        "Latin Small Letter O With Diaeresis",
        "Euro Sign",
        "Emoji: Grinning Face",
        "Hebrew Letter Dalet With Dagesh",
    ]
    assert out.startswith(b'{"\\r":"Carriage Return","1":"One","\xc2\x80":"Control"')


def test_utf16_sorting_applies_to_nested_objects_and_to_floats_documents() -> None:
    # U+FB33 is above every high surrogate unit (D83D), so it sorts after the emoji in UTF-16,
    # though before it by code point. The float forces the general serializer path.
    nested = {"x": {"\ufb33": 1, "\U0001f600": 2}, "f": 0.5}
    assert canonicalize(nested) == '{"f":0.5,"x":{"\U0001f600":2,"\ufb33":1}}'.encode()


# --- string escaping (RFC 8785 §3.2.2.2) --------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("\b\t\n\f\r", '"\\b\\t\\n\\f\\r"'),
        ("\u0000\u0001\u001f", '"\\u0000\\u0001\\u001f"'),
        ('"\\', '"\\"\\\\"'),
        ("/", '"/"'),
        ("\u007f", '"\u007f"'),
        ("\u2028\u2029", '"\u2028\u2029"'),
        ("é€😀", '"é€😀"'),
    ],
    ids=[
        "short-escapes",
        "u-escapes-lowercase",
        "quote-backslash",
        "solidus",
        "del",
        "ls-ps",
        "utf8",
    ],
)
def test_string_escaping(value: str, expected: str) -> None:
    assert canonicalize(value) == expected.encode()
    assert canonicalize({"k": [value, 0.5]}) == f'{{"k":[{expected},0.5]}}'.encode()


def test_integers_floats_and_literals() -> None:
    assert (
        canonicalize([0, -0.0, 1.0, -1, 4.5, True, False, None])
        == b"[0,0,1,-1,4.5,true,false,null]"
    )


@pytest.mark.parametrize("value", [2**53, -(2**53), 10**30, [1, 2**60], {"a": {"b": -(2**63)}}])
def test_canonicalize_refuses_unsafe_python_integers(value: Any) -> None:
    with pytest.raises(Invalid) as caught:
        canonicalize(value)
    assert caught.value.code == "unsafe_integer"


def test_canonicalize_refuses_non_json_types() -> None:
    with pytest.raises(TypeError):
        canonicalize({"when": object(), "f": 0.5})


def test_item_data_hash_is_sha256_of_jcs() -> None:
    item = {"b": [1.0, "x"], "a": {"z": None, "y": True}}
    expected = hashlib.sha256(b'{"a":{"y":true,"z":null},"b":[1,"x"]}').hexdigest()
    assert item_data_hash(item) == expected
    assert item_data_hash(None) == hashlib.sha256(b"null").hexdigest()


# --- I-JSON rejections (parse_strict) -----------------------------------------------------------


def _nested(depth: int, leaf: str, kind: str) -> str:
    """`depth` nested arrays or objects; the innermost holds `leaf`, or is empty when it is ""."""
    if kind == "array":
        return "[" * depth + leaf + "]" * depth
    if leaf:
        return '{"a":' * depth + leaf + "}" * depth
    return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)


I_JSON_REJECTIONS = [
    ("9007199254740992", "unsafe_integer", "2^53"),
    ("-9007199254740992", "unsafe_integer", "-2^53"),
    ('{"n":123456789012345678901234567890}', "unsafe_integer", "huge-member"),
    ("[1,[2,[18446744073709551616]]]", "unsafe_integer", "2^64-nested"),
    ("1e20", "unsafe_integer", "1e20-canonical-form-is-an-unsafe-integer"),
    ("9007199254740992.0", "unsafe_integer", "2^53-as-float"),
    ("9007199254740993.0", "unsafe_integer", "2^53+1-as-float"),
    ("-9007199254740993e0", "unsafe_integer", "-(2^53+1)-exponent"),
    ("1e400", "number_out_of_range", "1e400"),
    ("-1.5e309", "number_out_of_range", "-1.5e309"),
    ('{"x":[1e999]}', "number_out_of_range", "1e999-nested"),
    ("NaN", "invalid_number", "NaN"),
    ("Infinity", "invalid_number", "Infinity"),
    ("-Infinity", "invalid_number", "-Infinity"),
    ('[1,{"n":NaN}]', "invalid_number", "NaN-nested"),
    ('{"a":1,"a":2}', "duplicate_member", "duplicate"),
    ('{"a":1,"b":{"c":1,"c":1}}', "duplicate_member", "duplicate-nested"),
    ('{"a":1,"\\u0061":2}', "duplicate_member", "duplicate-escaped-spelling"),
    ('"\\ud800"', "lone_surrogate", "high-alone"),
    ('"x\\udc00y"', "lone_surrogate", "low-alone"),
    ('"\\ude00\\ud83d"', "lone_surrogate", "pair-reversed"),
    ('["ok",{"k":"\\udbff"}]', "lone_surrogate", "nested-string"),
    ('{"\\ud800":1}', "lone_surrogate", "member-name"),
    ('{"a":{"\\udfff":1}}', "lone_surrogate", "nested-member-name"),
    (_nested(MAX_DEPTH + 1, "1", "array"), "too_deep", "65-arrays-with-scalar"),
    (_nested(MAX_DEPTH + 1, "", "array"), "too_deep", "65-arrays-innermost-empty"),
    (_nested(MAX_DEPTH + 1, "1", "object"), "too_deep", "65-objects-with-scalar"),
    (_nested(MAX_DEPTH + 1, "", "object"), "too_deep", "65-objects-innermost-empty"),
    (_nested(100_000, "", "array"), "too_deep", "100000-arrays"),
]


@pytest.mark.parametrize(
    ("text", "rule"),
    [pytest.param(text, rule, id=name) for text, rule, name in I_JSON_REJECTIONS],
)
def test_parse_strict_rejects_with_rule(text: str, rule: str) -> None:
    for raw in (text, text.encode("utf-8")):
        with pytest.raises(Invalid) as caught:
            parse_strict(raw)
        assert caught.value.code == "invalid_json"
        assert caught.value.details["rule"] == rule
        assert caught.value.status == 400


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        pytest.param(b"\xff", "UTF-8", id="ff"),
        pytest.param(b'"\xc0\xaf"', "UTF-8", id="overlong-solidus"),
        pytest.param(b'"\xed\xa0\x80"', "UTF-8", id="cesu-surrogate"),
        pytest.param(b'{"a":"\xe2\x82"}', "UTF-8", id="truncated-sequence"),
        pytest.param(b"\xef\xbb\xbf{}", "byte order mark", id="bom-bytes"),
        pytest.param("\ufeff{}", "byte order mark", id="bom-str"),
    ],
)
def test_parse_strict_rejects_bad_encoding(raw: bytes | str, words: str) -> None:
    with pytest.raises(Invalid) as caught:
        parse_strict(raw)
    assert caught.value.code == "invalid_json"
    assert words in caught.value.message


@pytest.mark.parametrize("raw", [b'{"a":"\xff"}', b"\xef\xbb\xbf{}"], ids=["utf8", "bom"])
def test_encoding_rejections_name_their_rule_like_every_other_i_json_rejection(raw: bytes) -> None:
    with pytest.raises(Invalid) as caught:
        parse_strict(raw)
    assert isinstance(caught.value.details.get("rule"), str)


@pytest.mark.parametrize("text", ['{"a":1', "[1,]", "{'a':1}", "", "1 2", '{"a" 1}'])
def test_parse_strict_rejects_malformed_json_with_position(text: str) -> None:
    with pytest.raises(Invalid) as caught:
        parse_strict(text)
    assert caught.value.code == "invalid_json"
    assert {"line", "column"} <= caught.value.details.keys()


@pytest.mark.parametrize("sign", ["", "-"])
def test_largest_safe_integer_is_accepted_and_the_next_is_not(sign: str) -> None:
    assert parse_strict(f"{sign}9007199254740991") == int(f"{sign}9007199254740991")
    assert canonicalize(parse_strict(f"[{sign}9007199254740991]")) == (
        f"[{sign}9007199254740991]".encode()
    )
    with pytest.raises(Invalid) as caught:
        parse_strict(f"{sign}9007199254740992")
    assert caught.value.details["rule"] == "unsafe_integer"


@pytest.mark.parametrize("kind", ["array", "object"])
@pytest.mark.parametrize("leaf", ["", "1"])
def test_nesting_of_exactly_max_depth_is_accepted(kind: str, leaf: str) -> None:
    value = parse_strict(_nested(MAX_DEPTH, leaf, kind))
    assert canonicalize(value).decode() == _nested(MAX_DEPTH, leaf, kind)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("9007199254740991.0", 9007199254740991),  # the largest safe integer, spelled as a float
        ("1e15", 1e15),
        ("-0", 0),
        ("-0.0", 0.0),
        ("5e-324", 5e-324),
        ("1.5", 1.5),
        ('"\\ud83d\\ude00"', "😀"),  # a proper surrogate pair is one character
        ('{"a":1,"A":2}', {"a": 1, "A": 2}),
    ],
)
def test_parse_strict_accepts_representable_values(text: str, value: Any) -> None:
    assert parse_strict(text) == value


@pytest.mark.parametrize(
    "text",
    ["1e20", "9007199254740992.0", "1.0e16", "-123456789012345680000.0", "1e21", "1e22"],
)
def test_every_accepted_number_has_canonical_bytes_that_are_accepted_again(text: str) -> None:
    # Peers and the idempotency layer re-parse canonical bytes with parse_strict, so whatever
    # parse_strict accepts must survive canonicalize → parse_strict unchanged.
    try:
        value = parse_strict(text)
    except Invalid:
        return  # rejecting the literal in the first place is also consistent
    assert parse_strict(canonicalize(value)) == value


# --- Hypothesis: cross-check with the `jcs` reference package, and round trips ------------------

_chars = st.characters(exclude_categories=["Cs"])  # no lone surrogates
_keys = st.text(_chars, max_size=8) | st.sampled_from(
    ["a", "\ue000", "\uffff", "\ufb33", "\U00010000", "\U0001f600", "\u20ac", "\r"]
)
_safe_ints = st.integers(-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER)


def _json(floats: st.SearchStrategy[float]) -> st.SearchStrategy[Any]:
    scalars = st.none() | st.booleans() | _safe_ints | floats | st.text(_chars, max_size=12)
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_keys, inner, max_size=5),
        max_leaves=25,
    )


_any_finite = st.floats(allow_nan=False, allow_infinity=False)
# Every double beyond ±(2^53-1) is an integer outside the safe range; keep to the safe range.
_safe_floats = st.floats(
    min_value=-MAX_SAFE_INTEGER, max_value=MAX_SAFE_INTEGER, allow_nan=False, allow_infinity=False
)


@given(_json(_any_finite))
def test_canonicalize_equals_the_jcs_reference_implementation(value: Any) -> None:
    assert canonicalize(value) == jcs.canonicalize(value)


def _written(value: Any, style: int) -> str:
    """A JSON text of `value` as a client might write it: compact, spaced, or ASCII-escaped."""
    if style == 0:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if style == 1:
        return json.dumps(value, ensure_ascii=False, indent=1)
    return json.dumps(value)  # \uXXXX escapes, surrogate pairs for characters above the BMP


# The doubles the parser takes: within ±(2^53-1) or of magnitude 1e21 and more.
_parseable_floats = (
    _safe_floats
    | st.floats(min_value=1e21, allow_infinity=False)
    | st.floats(max_value=-1e21, allow_infinity=False)
)


@given(st.dictionaries(_keys, _json(_parseable_floats), max_size=6), st.integers(0, 2))
def test_members_made_with_the_parses_word_are_the_reference_jcs(
    value: dict[str, Any], style: int
) -> None:
    # parse_document tells from the parse whether json.dumps already writes JCS (no walk);
    # wherever it says so wrongly, a member's text differs from the reference's.
    text = _written(value, style)
    if _has_nul(value):
        return  # refused by the parser (PostgreSQL cannot store U+0000)
    for raw in (text, text.encode()):
        parsed, plain = parse_document(raw)
        members = canonical_members(parsed, plain=plain)
        assert members == {k: jcs.canonicalize(v).decode() for k, v in parsed.items()}
        assert join_members(members).encode() == jcs.canonicalize(parsed)


@pytest.mark.parametrize(
    ("text", "plain"),
    [
        ('{"a":[1,0.5,"\\u00e9"]}', True),
        ('{"a":2.0}', False),  # json.dumps writes "2.0", JCS "2"
        ('{"a":[{"b":1e-7}]}', False),  # "1e-07" against "1e-7"
        ('{"a":1e21}', False),
        ('{"\\ud83d\\ude00":1,"b":2}', False),  # a key above the BMP: UTF-16 order
        ('{"b":"\\ud83d\\ude00"}', False),  # above the BMP anywhere: not told apart from a key
        ('{"b":"😀"}', False),
        ("[1,2]", True),
    ],
)
def test_the_parse_says_where_json_dumps_is_not_jcs(text: str, plain: bool) -> None:
    assert parse_document(text)[1] is plain
    assert parse_document(text.encode())[1] is plain


@given(st.dictionaries(_keys, _safe_ints | st.text(_chars, max_size=4), max_size=8))
def test_key_order_is_by_utf16_code_units(value: dict[str, Any]) -> None:
    out = canonicalize(value)
    keys = [key for key, _ in json.loads(out, object_pairs_hook=list)]
    assert keys == sorted(value, key=lambda key: key.encode("utf-16-be"))


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


@given(_json(_safe_floats))
def test_parse_strict_round_trips_canonical_bytes(value: Any) -> None:
    out = canonicalize(value)
    if _has_nul(value):  # the parser refuses U+0000 (PostgreSQL cannot store it)
        with pytest.raises(Invalid) as refused:
            parse_strict(out)
        assert refused.value.details["rule"] == "nul_character"
        return
    parsed = parse_strict(out)
    assert parsed == value
    assert canonicalize(parsed) == out


@given(_json(_safe_floats), _json(_any_finite))
def test_canonical_form_is_compositional(left: Any, right: Any) -> None:
    # Whatever route the serializer takes for each part, the whole is the parts joined.
    whole = canonicalize({"l": left, "r": right, "z": 0.25})
    assert whole == b'{"l":' + canonicalize(left) + b',"r":' + canonicalize(right) + b',"z":0.25}'


@given(_json(_safe_floats))
def test_canonical_bytes_do_not_depend_on_member_order(value: Any) -> None:
    def reverse(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: reverse(node[key]) for key in reversed(list(node))}
        if isinstance(node, list):
            return [reverse(item) for item in node]
        return node

    assert canonicalize(reverse(value)) == canonicalize(value)


# Where `repr` (what json.dumps writes) and ECMAScript part ways: exponents below 1e-4 and from
# 1e16, integral values. Floats between are serialised by json.dumps (the fast path).
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0.5, "0.5"),
        (-0.5, "-0.5"),
        (0.0001, "0.0001"),
        (0.00009999, "0.00009999"),
        (0.000001, "0.000001"),
        (1e-7, "1e-7"),
        (2.0, "2"),
        (-0.0, "0"),
        (123456789012345.6, "123456789012345.6"),
        (1234567890123456.8, "1234567890123456.8"),
        (1e16, "10000000000000000"),
        (1.5e300, "1.5e+300"),
        (5e-324, "5e-324"),
    ],
)
def test_floats_near_where_the_fast_path_ends_serialise_as_ecmascript_does(
    value: float, expected: str
) -> None:
    document = {"a": [value, {"b": value}]}
    assert canonicalize(value) == expected.encode()
    assert canonicalize(document) == jcs.canonicalize(document)
    assert canonicalize(document) == f'{{"a":[{expected},{{"b":{expected}}}]}}'.encode()


class _OddFloat(float):
    def __repr__(self) -> str:
        return "odd"


def test_tuples_and_float_subclasses_take_the_same_rules_as_lists_and_floats() -> None:
    # Parsed input has neither, but canonicalize is also called on values the code builds.
    assert canonicalize((2.0, 1e-7, 0.5)) == b"[2,1e-7,0.5]"
    assert canonicalize({"a": [_OddFloat(2.0), _OddFloat(0.25)]}) == b'{"a":[2,0.25]}'
    with pytest.raises(Invalid):
        canonicalize({"a": (1e-7, 2**60)})


# --- the walk of the parsed tree, skipped where the text rules it out ---------------------------


def _rule_or_value(parse: Any, raw: bytes | str) -> tuple[str, Any]:
    try:
        return ("value", parse(raw))
    except Invalid as exc:
        return ("rule", exc.details.get("rule", "malformed"))


def _always_walked(raw: bytes | str) -> Any:
    """parse_strict as it was: the decoder, then the walk of every parsed value."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    try:
        value = canonical._DECODER.decode(text)
        canonical._check_tree(value, 0)
    except canonical._Rejected as exc:
        raise Invalid(str(exc), code="invalid_json", details={"rule": exc.code}) from None
    except json.JSONDecodeError:
        raise Invalid("malformed", code="invalid_json", details={}) from None
    return value


_ANY_CHAR = st.characters(blacklist_categories=())  # surrogates and NUL included
_TREES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1) | st.text(_ANY_CHAR),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(_ANY_CHAR), inner),
    max_leaves=20,
)


@given(_TREES, st.booleans())
def test_parse_strict_refuses_exactly_what_the_walk_refuses(value: Any, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    inputs: list[bytes | str] = [text]
    if ascii_only or not any("\ud800" <= c <= "\udfff" for c in text):
        inputs.append(text.encode("utf-8"))
    for raw in inputs:
        assert _rule_or_value(parse_strict, raw) == _rule_or_value(_always_walked, raw)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param('"a\ud800b"', ("rule", "lone_surrogate"), id="raw-surrogate-in-a-str"),
        pytest.param('{"\udfff":1}', ("rule", "lone_surrogate"), id="raw-surrogate-member-name"),
        pytest.param('["\\\\u0000"]', ("value", ["\\u0000"]), id="escaped-backslash-not-a-nul"),
        pytest.param('["\\\\ud800"]', ("value", ["\\ud800"]), id="escaped-backslash-not-surrogate"),
        pytest.param('"\\uD800"', ("rule", "lone_surrogate"), id="upper-case-escape"),
        pytest.param('"\\u0000"', ("rule", "nul_character"), id="nul-escape"),
        pytest.param('"\\ud7ff\\ue000"', ("value", "\ud7ff\ue000"), id="next-to-surrogates"),
        pytest.param(
            '["' + "[{" * MAX_DEPTH + '"]', ("value", ["[{" * MAX_DEPTH]), id="brackets-in-a-string"
        ),
    ],
)
def test_what_only_the_walk_can_tell_is_still_told(raw: str, expected: tuple[str, Any]) -> None:
    assert _rule_or_value(parse_strict, raw) == expected


# --- with_member: a member spliced into a JCS object text --------------------------------------


@given(
    st.dictionaries(_keys, _json(_any_finite), max_size=6),
    _keys,
    _json(_any_finite),
)
def test_a_spliced_member_gives_the_canonical_text_of_the_whole(
    obj: dict[str, Any], name: str, value: Any
) -> None:
    obj.pop(name, None)
    spliced = canonical.with_member(canonicalize(obj).decode(), name, canonicalize(value).decode())
    assert spliced == canonicalize({**obj, name: value}).decode()


@pytest.mark.parametrize(
    ("doc", "name"),
    [
        ('{"a":1}', "a"),  # already there
        ("[1]", "a"),  # not an object
        ('{"b":1, "a":2}', "c"),  # not JCS: a space, keys out of order
        ('{"b":1,"a":2}', "c"),  # keys out of order
        ('{"a":1,}', "c"),  # a trailing comma
        ('{"a":1}x', "c"),  # something after it
    ],
)
def test_a_text_that_is_not_a_jcs_object_without_the_member_is_refused(doc: str, name: str) -> None:
    with pytest.raises(ValueError, match="JCS"):
        canonical.with_member(doc, name, "1")
