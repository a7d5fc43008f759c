"""How a documented example is compared with the output the code really produces.

The documented text is turned into a regular expression that the real output must match as a
whole. Everything is literal — member names and their order, statuses, headers, codes, messages,
numbers — except:

1. Layout. Lines are compared without trailing whitespace and with `\\r\\n` read as `\\n`;
   leading and trailing blank lines do not count. In a ```json block, whitespace outside
   strings does not count either (an example may be wrapped or indented for reading).
2. Elision. `…` standing alone (not glued to a word) stands for any text, also across lines:
   `{"a": 1, …}` or a line `…` in a transcript.
3. Shortening. A word glued to `…` (`z6MkfQY8…`, `dd6039f5…09c0`) stands for one value of
   word characters `[A-Za-z0-9_-]+`: a shortened DID, hash or signature.
4. Values that differ from run to run (VARIABLES below), in the places named there: request
   ids, session tokens, times, measured latencies, rate-limit counters, process and user ids,
   random record ids, discovery cursors, federation envelopes' nonces and the digests of
   request envelopes, and key material of keys made at random. DIDs and public keys of the
   fixed seeds the examples use (KNOWN) are literal; signature values are literal unless the
   example shows a key made at random (a signature by a fixed key over fixed bytes is fixed).

A value that varies is a placeholder bound by its first appearance: where the example shows the
same value twice (a request id in the header and in the body, `created` = `updatedAt`), the
real output must have the same value twice too.

URLs, ports and directories of the test run are replaced by the documented ones before
matching (per story, tests/docs/stories.py), and so are the commands run for a transcript.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from registry.keys import SigningKey
from registry.signin import signer_public_key_text

ELLIPSIS = "…"
WORD = r"[A-Za-z0-9_-]"
B58 = r"[1-9A-HJ-NP-Za-km-z]"

# The keys of the worked examples (docs/signin.md, docs/signing.md): the publisher's seed is 32
# bytes of 0x01, the registry's 32 bytes of 0x02. Their DIDs and public keys are literal.
FIXED_SEEDS = (0x01, 0x02)
FIXED_KEYS = tuple(SigningKey(bytes([seed] * 32)) for seed in FIXED_SEEDS)
KNOWN = frozenset(
    value
    for key in FIXED_KEYS
    for value in (key.did.removeprefix("did:key:"), signer_public_key_text(key.public_key))
)


@dataclass(frozen=True)
class Variable:
    name: str
    find: re.Pattern[str]  # where it is in the documented text; group "v" is the value
    value: str  # a regular expression of that value in the real output
    key: bool = False  # key material: literal when it is one of KNOWN


def _v(name: str, find: str, value: str, *, key: bool = False) -> Variable:
    return Variable(name, re.compile(find, re.M), value, key)


TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
HTTP_DATE = rf"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), \d\d {MONTH} \d{{4}} \d\d:\d\d:\d\d GMT"

VARIABLES = (
    # Request ids: made per request (16 hex digits), in the body and the X-Request-Id header.
    _v("request-id", r'"requestId":\s*"(?P<v>[0-9a-f]{16})"', "[0-9a-f]{16}"),
    _v("request-id", r"^(?:< )?x-request-id: (?P<v>[0-9a-f]{16})$", "[0-9a-f]{16}"),
    # Session tokens: 256 random bits.
    _v("token", rf"(?:Bearer |registry_session=)(?P<v>{WORD}{{43}})(?!{WORD})", f"{WORD}{{43}}"),
    _v("token", rf'"sessionToken":\s*"(?P<v>{WORD}{{43}})"', f"{WORD}{{43}}"),
    # Times the server stamps (RFC 3339 UTC with milliseconds), log times, cookie expiry, the
    # session expiry `registry login` prints, and the Unix-millisecond session times.
    _v("time", rf"(?P<v>{TIME})", TIME),
    _v("log-time", r"^(?P<v>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", r"\d{4}-\d\d-\d\d [\d:,]{12}"),
    _v("http-date", rf"Expires=(?P<v>{HTTP_DATE})", HTTP_DATE),
    _v("time", r"\(until (?P<v>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)\)", r"[\dT:-]{19}Z"),
    _v("ms", r'"(?:expiresAtMs|sessionExpiresAtMs|savedAtMs)":\s*(?P<v>\d{13})', r"\d{13}"),
    # Measured durations: a peer's average pull latency (the admin view of federation peers).
    _v("latency", r'"latencyMs":\s*(?P<v>\d+)', r"\d+"),
    # Rate-limit counters: the buckets refill continuously, so what is left depends on timing.
    _v("ratelimit", r"^(?:< )?ratelimit-(?:remaining|reset): (?P<v>\d+)$", r"\d+"),
    _v("retry", r'"retryAfterSeconds":\s*(?P<v>\d+(?:\.\d+)?)', r"\d+(?:\.\d+)?"),
    # Process and user ids.
    _v("pid", r"\((?:pid|uid) (?P<v>\d+)\)", r"\d+"),
    # Random record ids (attestations, reports, offers).
    _v("record-id", r"\b(?:att|rep|off)_(?P<v>[0-9a-f]{32})\b", "[0-9a-f]{32}"),
    # Discovery cursors: authenticated with the registry's own key (the versions cursor, a
    # sequence, is literal).
    _v("cursor", rf'"cursor":\s*"(?P<v>{WORD}{{20,}})"', f"{WORD}{{20,}}"),
    # Federation envelopes: the nonce (16 random bytes, base64url), and a response's
    # `requestDigest`, the digest of the request envelope it answers, which holds a nonce, a
    # time and a signature (its story checks that binding). A request's `requestDigest`, of its
    # payload, is literal. The response's `kind` comes before it (JCS orders the members).
    _v("nonce", rf'"nonce":\s*"(?P<v>{WORD}{{22}})"', f"{WORD}{{22}}"),
    _v(
        "digest",
        r'"kind":\s*"(?:sync|discover)_response",.*?"requestDigest":\s*"(?P<v>[0-9a-f]{64})"',
        "[0-9a-f]{64}",
    ),
    # Keys made at random: did:key multibase keys, raw public keys, key-file seeds.
    _v(
        "key",
        rf"(?<![A-Za-z0-9])(?P<v>z6Mk{B58}{{44}})(?![A-Za-z0-9])",
        f"z6Mk{B58}{{44}}",
        key=True,
    ),
    _v("key", rf'"signerPublicKey":\s*"(?P<v>{B58}{{43,44}})"', f"{B58}{{43,44}}", key=True),
    _v("key", rf'"seed":\s*"(?P<v>{WORD}{{43}})"', f"{WORD}{{43}}", key=True),
)
# Ed25519 signature values (of an entry's or credential's proof, of a federation envelope):
# literal unless the example shows a key made at random.
SIGNATURE = _v("signature", rf'"(?:value|signature)":\s*"(?P<v>{WORD}{{86}})"', f"{WORD}{{86}}")
SHORTENED = _v("shortened", rf"(?P<v>{WORD}+{ELLIPSIS}{WORD}*)", f"{WORD}+")


@dataclass(frozen=True)
class Piece:
    doc: str  # the documented text of this piece
    regex: str


def layout(text: str, *, json: bool) -> str:
    """Rule 1: the text as compared."""
    text = text.replace("\r\n", "\n")
    if json:
        return _compact_json(text)
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


def _compact_json(text: str) -> str:
    out: list[str] = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            out.append(ch)
        elif not ch.isspace():
            out.append(ch)
    return "".join(out)


def pieces(doc: str, *, fixed: bool = False) -> list[Piece]:
    """The documented text (after `layout`) as literal pieces, placeholders and elisions."""
    spans: list[tuple[int, int, Variable]] = []
    if not fixed:
        for variable in VARIABLES:
            for found in variable.find.finditer(doc):
                if variable.key and found["v"] in KNOWN:
                    continue
                spans.append((*found.span("v"), variable))
        if any(v.key for _, _, v in spans):
            spans += [(*f.span("v"), SIGNATURE) for f in SIGNATURE.find.finditer(doc)]
        spans += [(*f.span("v"), SHORTENED) for f in SHORTENED.find.finditer(doc)]
    spans.sort(key=lambda s: (s[0], s[0] - s[1]))
    result: list[Piece] = []
    groups: dict[tuple[str, str], str] = {}
    at = 0
    for start, end, variable in spans:
        if start < at:
            continue  # overlaps a placeholder already taken
        result += _literal(doc[at:start], fixed=fixed)
        value = doc[start:end]
        group = groups.get((variable.name, value))
        if group is None:
            group = groups[(variable.name, value)] = f"g{len(groups)}"
            result.append(Piece(value, f"(?P<{group}>{variable.value})"))
        else:
            result.append(Piece(value, f"(?P={group})"))
        at = end
    return result + _literal(doc[at:], fixed=fixed)


def _literal(text: str, *, fixed: bool) -> list[Piece]:
    if fixed:
        return [Piece(text, re.escape(text))] if text else []
    out: list[Piece] = []
    for i, part in enumerate(text.split(ELLIPSIS)):
        if i:
            out.append(Piece(ELLIPSIS, ".*?"))
        if part:
            out.append(Piece(part, re.escape(part)))
    return out


def check(doc: str, actual: str, *, json: bool = False, fixed: bool = False) -> None:
    """Assert that the real output `actual` is what the documented `doc` shows.

    `fixed`: the output is deterministic (a script over fixed inputs): no placeholder at all.
    """
    doc, actual = layout(doc, json=json), layout(actual, json=json)
    parts = pieces(doc, fixed=fixed)
    if re.fullmatch("".join(p.regex for p in parts), actual, re.S):
        return
    raise AssertionError(_explain(doc, actual, parts))


def _explain(doc: str, actual: str, parts: list[Piece]) -> str:
    """Where the real output leaves the documented text, and a diff of the two."""
    reached, where = 0, 0
    for k in range(1, len(parts) + 1):
        found = re.match("".join(p.regex for p in parts[:k]), actual, re.S)
        if found is None:
            break
        reached, where = k, found.end()
    if reached == len(parts):
        point = f"the real output goes on after the documented text: {actual[where:][:200]!r}"
    else:
        point = f"documented {parts[reached].doc[:200]!r}, real output has {actual[where:][:200]!r}"
    diff = "\n".join(
        difflib.unified_diff(
            doc.split("\n"), actual.split("\n"), "documented", "real output", lineterm=""
        )
    )
    return f"the example is not what the code does: {point}\n{diff}"
