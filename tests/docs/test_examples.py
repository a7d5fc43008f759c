"""Every example the documentation shows as real output is produced again by the running code
and compared with the page (issue 8 item 7: so that they cannot drift again).

- docs/*.md and README.md mark each such example with `<!-- example: STORY ITEM -->`
  (tests/docs/markdown.py); the story runs it (tests/docs/stories.py) and the page's text must
  match the real output (tests/docs/matching.py: what may differ, and nothing else).
- An example of real output without a marker fails `test_every_real_output_example_is_marked`,
  so a new example cannot escape the check.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.docs.conftest import Stories
from tests.docs.markdown import Marker, Page, is_output_example, markers, pages, parse_page
from tests.docs.matching import check
from tests.docs.running import DEADLINE

CODE_SPAN = re.compile(r"`([^`]+)`")


def documented(marker: Marker) -> str:
    """The example's text on the page: the block, the table, or the code spans of the
    paragraph (one per line)."""
    if marker.block is not None:
        return marker.block.text
    if marker.inline.lstrip().startswith("|"):
        return marker.inline
    return "\n".join(CODE_SPAN.findall(marker.inline))


def python_example(marker: Marker) -> tuple[str, str]:
    """A script's output: (as documented, as it really is).

    `python output`: the block is the output of the ```python block above it, run as is.
    `python same-output`: the block is a script said to print what the script above printed
    (its JSON part), given that script's `challenge` in challenge.json (signin.md).
    """
    (page,) = [p for p in pages() if p.path == marker.page]
    above = [b for b in page.blocks if b.line < marker.line and b.info == "python"][-1]
    if marker.item == "output":
        assert marker.block is not None
        return marker.block.text, _run_script(above.text)
    assert marker.item == "same-output", marker
    assert marker.block is not None
    outputs = [m for m in page.markers if m.story == "python" and m.item == "output"]
    shown = [m.block for m in outputs if m.block is not None and m.line < marker.line][-1]
    lines = shown.text.split("\n")
    with tempfile.TemporaryDirectory() as cwd:
        dump = "\nimport json\nopen('challenge.json', 'w').write(json.dumps(challenge))\n"
        _run_script(above.text + dump, cwd)
        return "\n".join(lines[lines.index("{") :]), _run_script(marker.block.text, cwd)


def _run_script(script: str, cwd: str | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


EXAMPLES = [m for m in markers() if m.story != "not-run"]


@pytest.mark.parametrize("marker", EXAMPLES, ids=[m.id for m in EXAMPLES])
def test_example_is_real_output(marker: Marker, stories: Stories) -> None:
    json = marker.block is not None and marker.block.info == "json"
    if "as-root" in marker.options and os.geteuid() != 0:
        pytest.skip("the documented run was as root (the embedded cluster's OS user)")
    if marker.story == "python":
        check(*python_example(marker), fixed=True)
        return
    outputs = stories.outputs(marker.story)
    assert marker.item in outputs, f"the story {marker.story!r} has no output {marker.item!r}"
    check(documented(marker), outputs[marker.item], json=json)


# Pages written beside this test, whose examples their authors are to mark (and give a story).
# Strict: a page listed here with no unmarked example left fails, so the entry cannot linger.
NOT_YET_MARKED: dict[str, str] = {}


def unmarked(page: Page) -> list[str]:
    """Where `page` has an example of real output without a marker, or a malformed marker."""
    missing: list[str] = []
    marked = {m.block for m in page.markers if m.block is not None}
    previous = None
    for block in page.blocks:
        why = is_output_example(page, block, previous)
        if why and block not in marked:
            missing.append(f"{page.path}:{block.line}: {why}, and has no marker")
        previous = block
    for line, phrase, section_end in page.phrases:
        if not any(line < m.line < section_end for m in page.markers):
            missing.append(f"{page.path}:{line}: {phrase!r} is followed by no marker")
    return missing + [f"{page.path}:{line}: {why}" for line, why in page.bad_markers]


def test_every_real_output_example_is_marked() -> None:
    """A block that is an example of real output (markdown.is_output_example) has a marker, and
    every real-output phrase is followed by a marker in its section (an inline example)."""
    missing: list[str] = []
    for page in pages():
        found = unmarked(page)
        if page.path not in NOT_YET_MARKED:
            missing += found
        elif not found:
            missing.append(f"{page.path}: every example is marked: remove it from NOT_YET_MARKED")
    assert not missing, "examples of real output without a marker:\n" + "\n".join(missing)


UNMARKED_PAGE = """# A page

Real output:

```text
registry: no
```

The answer is `{"a": 1}` (real output).

```json
{"b": 2}
```

```text
$ registry get did:x
{"c": 3}
```

<!-- example: nothing -->
"""


def test_unmarked_examples_are_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(UNMARKED_PAGE)
    found = unmarked(parse_page(page))
    lines = [f.split(": ", 1)[0].rsplit(":", 1)[1] for f in found]
    assert lines == ["5", "11", "15", "3", "9", "20"], found
    marked = (
        UNMARKED_PAGE.replace("```text\nregistry", "<!-- example: s one -->\n```text\nregistry")
        .replace("(real output).", "(real output).\n<!-- example: s two -->")
        .replace("```json", "<!-- example: s three -->\n```json")
        .replace("```text\n$", "<!-- example: not-run it needs kill -9 -->\n```text\n$")
        .replace("<!-- example: nothing -->", "")
    )
    page.write_text(marked)
    assert unmarked(parse_page(page)) == []


# --- the comparison itself: what may differ, and that a real drift fails ------------------------

ERROR_EXCHANGE = (
    "< 409\n< x-request-id: 0123456789abcdef\n"
    '< {"error":{"code":"sequence_conflict","message":"the entry changed","requestId":'
    '"0123456789abcdef","details":{"latestSequence":2}}}'
)
RANDOM_DID = "did:key:z6MkunSsP5gqAqjztEUpcuVf78WHV9VvTfi1FsoL9WJfcn7H"
OTHER_RANDOM_DID = "did:key:z6MkhC7fe8CxnK4gGPEFY71cxjsMrYAJjnMQSGJYpevwUzQw"
FIXED_DID = "did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"  # seed 0x01
DIGEST, OTHER_DIGEST = "0" * 64, "f" * 64
SIGNATURE, OTHER_SIGNATURE = "A" * 86, "B" * 86


def envelope(kind: str, nonce: str, digest: str, did: str, signature: str) -> str:
    return (
        f'{{"kind":"{kind}","nonce":"{nonce}","requestDigest":"{digest}",'
        f'"senderDid":"{did}","signature":"{signature}"}}'
    )


RESPONSE = envelope("sync_response", "n" * 22, DIGEST, RANDOM_DID, SIGNATURE)
REQUEST = envelope("sync_request", "n" * 22, DIGEST, RANDOM_DID, SIGNATURE)


@pytest.mark.parametrize(
    ("documented", "real", "json"),
    [
        (ERROR_EXCHANGE, ERROR_EXCHANGE.replace("0123456789abcdef", "5fabbede0000002a"), False),
        ('{"a": 1,\n "b": [1, 2]}', '{"a":1,"b":[1,2]}', True),
        ('{"a": 1, …}', '{"a":1,"b":{"c":2}}', True),
        (
            "$ registry x\nTraceback (most recent call last):\n…\nboom",
            "$ registry x\nTraceback (most recent call last):\n  File ...\n    raise\nboom",
            False,
        ),
        (
            f'{{"did":"{RANDOM_DID}","again":"{RANDOM_DID}"}}',
            f'{{"did":"{OTHER_RANDOM_DID}","again":"{OTHER_RANDOM_DID}"}}',
            True,
        ),
        ('{"issuer": "did:key:z6MkfQY8…"}', f'{{"issuer":"{OTHER_RANDOM_DID}"}}', True),
        ('{"at":"2026-11-21T08:49:24.349Z"}', '{"at":"2027-01-02T03:04:05.678Z"}', True),
        ("< ratelimit-remaining: 119", "< ratelimit-remaining: 7", False),
        ("line  \r\n\n", "line", False),
        # a federation response: its nonce, the request's digest, a random key's signature
        (
            RESPONSE,
            envelope("sync_response", "m" * 22, OTHER_DIGEST, OTHER_RANDOM_DID, OTHER_SIGNATURE),
            True,
        ),
        ('[{"cursor": 1, "latencyMs": 10}]', '[{"cursor":1,"latencyMs":169}]', True),
    ],
)
def test_what_may_differ(documented: str, real: str, json: bool) -> None:
    check(documented, real, json=json)


@pytest.mark.parametrize(
    ("documented", "real", "json"),
    [
        (ERROR_EXCHANGE, ERROR_EXCHANGE.replace("< 409", "< 410"), False),
        (ERROR_EXCHANGE, ERROR_EXCHANGE.replace("sequence_conflict", "entry_changed"), False),
        (ERROR_EXCHANGE, ERROR_EXCHANGE.replace("the entry changed", "the entry moved"), False),
        (ERROR_EXCHANGE, ERROR_EXCHANGE.replace("latestSequence", "latest"), False),
        (ERROR_EXCHANGE, ERROR_EXCHANGE.replace(":2}", ":3}"), False),
        (ERROR_EXCHANGE, ERROR_EXCHANGE.replace("< x-request-id", "< x-request-ids"), False),
        # the same request id in the header and the body
        (ERROR_EXCHANGE, ERROR_EXCHANGE.replace("0123456789abcdef", "5fabbede0000002a", 1), False),
        (ERROR_EXCHANGE, ERROR_EXCHANGE.replace(',"details"', ',"extra":1,"details"'), False),
        ('{"a":1,"b":2}', '{"b":2,"a":1}', True),  # the order of members
        ('{"a": 1, …}', '{"b":2,"a":1}', True),
        ('{"a": "x y"}', '{"a":"x z"}', True),
        # a fixed seed's DID is literal; a random key must stay the same key where shown twice
        (f'{{"did":"{FIXED_DID}"}}', f'{{"did":"{RANDOM_DID}"}}', True),
        (
            f'{{"did":"{RANDOM_DID}","again":"{RANDOM_DID}"}}',
            f'{{"did":"{RANDOM_DID}","again":"{OTHER_RANDOM_DID}"}}',
            True,
        ),
        ('{"at":"2026-11-21T08:49:24.349Z"}', '{"at":"2026-11-21T08:49:24Z"}', True),
        ("< ratelimit-limit: 120", "< ratelimit-limit: 1200", False),
        ("$ registry x\n[exit 1]", "$ registry x\n[exit 2]", False),
        # a request's digest is of its payload; a nonce is 16 bytes; a fixed key's signature
        (REQUEST, REQUEST.replace(DIGEST, OTHER_DIGEST), True),
        (RESPONSE, RESPONSE.replace("n" * 22, "n" * 43), True),
        (
            RESPONSE.replace(RANDOM_DID, FIXED_DID),
            RESPONSE.replace(RANDOM_DID, FIXED_DID).replace(SIGNATURE, OTHER_SIGNATURE),
            True,
        ),
        ('[{"cursor": 1, "latencyMs": 10}]', '[{"cursor":2,"latencyMs":10}]', True),
        ("registry: a", "registry: a\nregistry: b", False),
    ],
)
def test_a_drift_fails(documented: str, real: str, json: bool) -> None:
    with pytest.raises(AssertionError, match="the example is not what the code does"):
        check(documented, real, json=json)
