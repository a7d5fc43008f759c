"""Strict JSON input (I-JSON, RFC 7493) and canonical output (JCS, RFC 8785).

Every signature and hash in the registry is computed over JCS bytes, and JCS is defined over
IEEE-754 doubles and Unicode strings. A document that JCS cannot represent faithfully is refused at
the door instead of being silently altered:

* integers outside ±(2^53 − 1), and any number whose canonical form would be one (a double in
  [2^53, 10^21) is printed by JCS as a plain integer, which strict parsers read as unsafe);
* NaN, Infinity and numbers that overflow a double;
* duplicate member names (which member would the signer have meant?);
* lone UTF-16 surrogates in strings or member names (they have no UTF-8 encoding);
* invalid UTF-8, and nesting deeper than `MAX_DEPTH`;
* U+0000 in any string or member name: PostgreSQL can store it neither in text nor in jsonb,
  so a document holding one could never be stored byte for byte (the error names where it is).

`canonicalize` is our own JCS serializer: the `jcs` package rounds unsafe integers through float
without a word and is ~10x slower; tests cross-check the two on RFC 8785's vectors and on
Hypothesis-generated documents.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from typing import Any

from registry.errors import Invalid

MAX_SAFE_INTEGER = 2**53 - 1
MAX_DEPTH = 64

_SURROGATE = re.compile("[\ud800-\udfff]")
_FORBIDDEN = re.compile("[\ud800-\udfff\x00]")

JSONValue = Any  # None | bool | int | float | str | list[JSONValue] | dict[str, JSONValue]


class _Rejected(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.path: list[str] = []  # JSON Pointer tokens of where, innermost last

    def pointer(self) -> str:
        return "".join("/" + t.replace("~", "~0").replace("/", "~1") for t in self.path)


def _string_rule(text: str, what: str) -> None:
    if _FORBIDDEN.search(text):  # one scan for both rules on the common, clean path
        if "\x00" in text:
            raise _Rejected("nul_character", f"{what} contains U+0000 (NUL)")
        raise _Rejected("lone_surrogate", f"{what} contains a lone UTF-16 surrogate")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _Rejected("duplicate_member", f"duplicate member name {key!r}")
        obj[key] = value
    return obj


# Digits are bounded before any conversion: `int()` of a literal over 4,300 digits raises (and
# is quadratic below that), `float()` of a long one is slow. 2^53 - 1 has 16 digits; no double
# needs more than 17 significant digits to round-trip, so these bounds refuse nothing exact.
_MAX_INT_LITERAL = len(str(-MAX_SAFE_INTEGER))  # 17: a sign and 16 digits
_MAX_FLOAT_LITERAL = 400


def _parse_int(literal: str) -> int:
    if len(literal) <= _MAX_INT_LITERAL:
        value = int(literal)
        if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
            return value
    raise _Rejected(
        "unsafe_integer",
        f"integer {literal[:40]} is outside ±(2^53-1) and cannot be signed exactly",
    )


def _parse_float(literal: str) -> float:
    if len(literal) > _MAX_FLOAT_LITERAL:
        raise _Rejected(
            "number_out_of_range",
            f"number {literal[:40]}... has more than {_MAX_FLOAT_LITERAL} characters",
        )
    value = float(literal)
    if math.isinf(value):
        raise _Rejected("number_out_of_range", f"number {literal[:40]} overflows a double")
    if MAX_SAFE_INTEGER < abs(value) < 1e21:
        raise _Rejected(
            "unsafe_integer",
            f"number {literal[:40]} is an integer outside ±(2^53-1) and cannot be signed exactly",
        )
    if not _plain_float(value):
        _parsing.plain = False
    return value


def _parse_constant(name: str) -> float:
    raise _Rejected("invalid_number", f"{name} is not a JSON number")


_DECODER = json.JSONDecoder(
    object_pairs_hook=_pairs,
    parse_int=_parse_int,
    parse_float=_parse_float,
    parse_constant=_parse_constant,
)


def _check_tree(value: Any, depth: int) -> None:
    """`depth` counts the containers enclosing `value`; at most MAX_DEPTH may nest."""
    if isinstance(value, dict | list) and depth >= MAX_DEPTH:
        raise _Rejected("too_deep", f"JSON nesting deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        _string_rule(value, "string")
    elif isinstance(value, dict):
        for key, item in value.items():
            _string_rule(key, "member name")  # the pointer stops at its object
            try:
                _check_tree(item, depth + 1)
            except _Rejected as exc:
                exc.path.insert(0, key)
                raise
    elif isinstance(value, list):
        for index, item in enumerate(value):
            try:
                _check_tree(item, depth + 1)
            except _Rejected as exc:
                exc.path.insert(0, str(index))
                raise


# What only a walk of the parsed tree can tell (`_check_tree`), told from the text when it
# cannot be there. A NUL or a lone surrogate in a parsed string comes from a `\u0000` or
# `\uD800`-`\uDFFF` escape: the decoder refuses raw control characters in strings, UTF-8
# cannot encode a surrogate, and a `str` argument that is not ASCII is scanned for a raw one.
# Nesting deeper than MAX_DEPTH needs more than MAX_DEPTH brackets. A text that could hold
# either is walked (an escaped backslash before such letters, or brackets inside strings, only
# cost the walk). The walk was ~21 of the ~36 us of parsing a ~1.9 KB entry.
_RISKY_ESCAPE = re.compile(r"\\u(?:0000|[dD][89a-fA-F])")


def _may_break_a_tree_rule(text: str, *, decoded: bool) -> bool:
    return (
        text.count("{") + text.count("[") > MAX_DEPTH
        or _RISKY_ESCAPE.search(text) is not None
        or (not decoded and not text.isascii() and _SURROGATE.search(text) is not None)
    )


def parse_strict(raw: bytes | str) -> JSONValue:
    """Parse one JSON text under the I-JSON rules; raise `Invalid` naming what was wrong."""
    return parse_document(raw)[0]


# Whether the parse under way has met a float that `json.dumps` does not write as JCS does
# (`_parse_float`). A parse runs without a yield, but threads may each run one.
_parsing = threading.local()


def parse_document(raw: bytes | str) -> tuple[JSONValue, bool]:
    """`parse_strict`, and whether `json.dumps(sort_keys)` of the value is already its JCS
    (what `_plain` tells by a walk of the tree), told from the parse: every integer the parser
    takes is safe, its float hook sees each float, and a member name above the BMP needs a
    character above the BMP in the text, raw or as an escaped surrogate pair.
    `canonical_members(value, plain=...)` takes it."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        raise Invalid(
            "body is not valid UTF-8", code="invalid_json", details={"rule": "invalid_utf8"}
        ) from None
    if text.startswith("\ufeff"):
        raise Invalid(
            "body must not start with a byte order mark",
            code="invalid_json",
            details={"rule": "byte_order_mark"},
        )
    _parsing.plain = True
    try:
        value = _DECODER.decode(text)
        walked = _may_break_a_tree_rule(text, decoded=isinstance(raw, bytes))
        if walked:
            _check_tree(value, 0)
    except _Rejected as exc:
        details = {"rule": exc.code}
        if exc.path and exc.code != "too_deep":
            details["pointer"] = exc.pointer()
        raise Invalid(str(exc), code="invalid_json", details=details) from None
    except RecursionError:
        raise Invalid(
            f"JSON nesting deeper than {MAX_DEPTH} levels",
            code="invalid_json",
            details={"rule": "too_deep"},
        ) from None
    except json.JSONDecodeError as exc:
        raise Invalid(
            f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            code="invalid_json",
            details={"line": exc.lineno, "column": exc.colno},
        ) from None
    # A character above the BMP comes raw, or escaped as a surrogate pair (which sends the text
    # to the walk: any surrogate escape does).
    plain = (
        bool(_parsing.plain) and not walked and (text.isascii() or _NON_BMP.search(text) is None)
    )
    return value, plain


# --- JCS (RFC 8785) -------------------------------------------------------------------------

_encode_string = json.encoder.encode_basestring  # JSON text of a str, not escaping non-ASCII


def _format_number(value: float | int) -> str:
    """ECMAScript Number.prototype.toString for a finite double (RFC 8785 §3.2.2.3)."""
    if isinstance(value, int):
        if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
            return str(value)
        raise Invalid("integer outside ±(2^53-1) cannot be canonicalized", code="unsafe_integer")
    if not math.isfinite(value):
        raise Invalid("NaN and Infinity cannot be canonicalized", code="invalid_number")
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    # repr gives the shortest round-tripping digits, as ECMAScript requires.
    mantissa, _, exp_text = repr(abs(value)).partition("e")
    whole, _, frac = mantissa.partition(".")
    digits = (whole + frac).lstrip("0")
    exponent = int(exp_text or "0") + len(whole)  # value = 0.digits × 10^exponent, before strip
    exponent -= len(whole + frac) - len((whole + frac).lstrip("0"))
    digits = digits.rstrip("0") or "0"
    k, n = len(digits), exponent
    if k <= n <= 21:
        text = digits + "0" * (n - k)
    elif 0 < n <= 21:
        text = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        text = "0." + "0" * (-n) + digits
    else:
        e = n - 1
        text = digits[0] + ("." + digits[1:] if k > 1 else "") + "e" + ("+" if e >= 0 else "-")
        text += str(abs(e))
    return sign + text


def _utf16_key(key: str) -> bytes:
    return key.encode("utf-16-be")


def _emit(value: Any, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(_encode_string(value))
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif value is None:
        out.append("null")
    elif isinstance(value, int | float):
        out.append(_format_number(value))
    elif isinstance(value, dict):
        out.append("{")
        first = True
        keys = sorted(value)
        if any(not key.isascii() and _NON_BMP.search(key) for key in keys):
            keys.sort(key=_utf16_key)
        for key in keys:
            if not first:
                out.append(",")
            first = False
            out.append(_encode_string(key))
            out.append(":")
            _emit(value[key], out)
        out.append("}")
    elif isinstance(value, list | tuple):
        out.append("[")
        for index, item in enumerate(value):
            if index:
                out.append(",")
            _emit(item, out)
        out.append("]")
    else:
        raise TypeError(f"cannot canonicalize {type(value).__name__}")


_NON_BMP = re.compile("[\U00010000-\U0010ffff]")
_fast_dumps = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False
).encode


def _plain(value: Any) -> bool:
    """True when json.dumps(sort_keys) already yields JCS: ints safe, no non-BMP keys, and
    floats whose `repr` (what json.dumps writes) is ECMAScript's text too.

    (Python sorts keys by code point, JCS by UTF-16 code unit; they differ only above the BMP.
    Both print a double's shortest round-tripping digits; they differ in form only where
    `repr` uses an exponent (below 1e-4, from 1e16: "1e-05", ECMAScript "0.00001") or the
    value is integral ("2.0", ECMAScript "2"); those take `_format_number`.)
    """
    if isinstance(value, dict):
        for key, item in value.items():
            if not key.isascii() and _NON_BMP.search(key):
                return False
            if not _plain(item):
                return False
        return True
    if isinstance(value, list | tuple):  # _emit writes a tuple as an array too
        return all(_plain(item) for item in value)
    if isinstance(value, float):
        return _plain_float(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER
    return True


def _plain_float(value: float) -> bool:
    text = float.__repr__(value)  # what json.dumps writes, whatever a subclass says
    return math.isfinite(value) and "e" not in text and not text.endswith(".0")


def canonicalize(value: JSONValue) -> bytes:
    """The JCS (RFC 8785) UTF-8 bytes of a parsed JSON value."""
    return _canonical_text(value).encode("utf-8")


def _canonical_text(value: JSONValue) -> str:
    if _plain(value):
        return _plain_text(value)
    out: list[str] = []
    _emit(value, out)
    return "".join(out)


# `json.dumps(sort_keys=True)`'s encoder, made once (JSONEncoder makes one for each call), and
# without its check for cycles: a JSON value has none (and `_plain` never returns on one).
_make_encoder: Any = getattr(json.encoder, "c_make_encoder", None)  # None: no C accelerator
_plain_encoder = (
    None
    if _make_encoder is None
    else _make_encoder(
        None, json.JSONEncoder().default, _encode_string, None, ":", ",", True, False, False
    )
)


def _plain_text(value: JSONValue) -> str:
    """`json.dumps(value, sort_keys=True)` in JCS's separators: JCS of a `_plain` value."""
    if isinstance(value, str):
        return _encode_string(value)
    if _plain_encoder is None:
        return _fast_dumps(value)
    return "".join(_plain_encoder(value, 0))


def canonical_members(obj: dict[str, Any], *, plain: bool = False) -> dict[str, str]:
    """JCS text of each member value of an object: the pieces of its JCS form.

    `join_members` reassembles them, so a caller that needs JCS of several sub-selections of one
    object (a signed payload, a stored form, a hash of one member) canonicalises each value once.
    `plain`: the object is known to be `_plain` (`parse_document` said so).
    """
    if plain:
        return {key: _plain_text(value) for key, value in obj.items()}
    return {key: _canonical_text(value) for key, value in obj.items()}


def _member_order(keys: Any) -> list[str]:
    ordered = sorted(keys)
    if not all(map(str.isascii, ordered)) and any(_NON_BMP.search(key) for key in ordered):
        ordered.sort(key=_utf16_key)
    return ordered


def join_members(members: dict[str, str]) -> str:
    """JCS text of the object whose members' JCS texts are `members`."""
    return (
        "{" + ",".join(_encode_string(k) + ":" + members[k] for k in _member_order(members)) + "}"
    )


def split_members(members: dict[str, str], hole: str) -> tuple[str, str]:
    """JCS text of the object with a member `hole` whose value is left out: (before, after).

    `before + <JCS of the value> + after` is the JCS text of the complete object.
    """
    keys = _member_order([*members, hole])
    at = keys.index(hole)
    head = ",".join(_encode_string(k) + ":" + members[k] for k in keys[:at])
    tail = ",".join(_encode_string(k) + ":" + members[k] for k in keys[at + 1 :])
    before = "{" + head + ("," if head else "") + _encode_string(hole) + ":"
    return before, ("," + tail if tail else "") + "}"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def item_data_hash(item_data: JSONValue) -> str:
    """`itemDataHash`: lowercase hex SHA-256 of JCS(itemData)."""
    return sha256_hex(canonicalize(item_data))


def with_member(doc: str, name: str, value: str) -> str:
    """The JCS text of the object whose JCS text is `doc`, with member `name` (absent from it)
    set to the value whose JCS text is `value`: spliced in where JCS orders it, so the cost is
    a walk of `doc`'s members (each value parsed by the json module, in C), never a
    canonicalisation of `value`. ValueError where `doc` is not an object text without `name`
    whose members are in JCS order with nothing between them; its values are taken as written
    (a stored version's text is JCS: the registry wrote it)."""
    bad = ValueError(f"not a JCS object text without {name!r}")
    if not doc.startswith("{"):
        raise bad
    decoder = _VALUES
    at = 1  # where the member goes: before the first member whose key orders after `name`
    found = False
    last: bytes | None = None
    i = 1
    try:
        while doc[i] != "}":
            if doc[i] != '"':
                raise bad
            key, end = _scanstring(doc, i + 1)
            if doc[end] != ":":
                raise bad
            order = _utf16_key(key)
            if key == name or (last is not None and order <= last):
                raise bad
            if not found and order > _utf16_key(name):
                at, found = i, True
            last = order
            _, i = decoder.raw_decode(doc, end + 1)
            if doc[i] == ",":
                i += 1
                if doc[i] == "}":
                    raise bad
            elif doc[i] != "}":
                raise bad
    except (IndexError, json.JSONDecodeError):
        raise bad from None
    if i != len(doc) - 1:
        raise bad
    member = _encode_string(name) + ":" + value
    if not found:  # last, or alone
        return doc[:-1] + ("," if len(doc) > 2 else "") + member + "}"
    return doc[:at] + member + "," + doc[at:]


_scanstring: Any = getattr(json.decoder, "scanstring")  # noqa: B009 (untyped in typeshed)
_VALUES = json.JSONDecoder()  # with_member's walk: any JSON value, as the json module reads it
