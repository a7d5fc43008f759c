"""The documentation pages as the docs tests read them: fenced blocks, example markers, and the
rules that say which blocks are examples of real output.

A marker is an HTML comment, invisible on the rendered page:

    <!-- example: STORY ITEM [OPTION ...] -->

- directly above a fenced block: that block is the example;
- directly below a paragraph or table (no blank line between): that paragraph or table is the
  example (an inline example: a response quoted in the text, a table of messages).

STORY names the run that produces the output (tests/docs/stories.py), ITEM the output within it.
`<!-- example: not-run REASON -->` marks an example that is not reproduced, with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

MARKER = re.compile(r"^\s*<!-- example: (?P<spec>.*?) -->\s*$")
LOOSE_MARKER = re.compile(r"<!--\s*example\b", re.I)  # anything that tries to be a marker
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+)(?P<info>[^`]*)$")
HEADING = re.compile(r"^#{1,6} ")

# Phrases that announce real output. A page that says all its examples are real output makes
# every block on it an example, except blocks of input languages.
REAL_PHRASE = re.compile(
    r"(?i:\breal\s+(?:output|exchange|example|stale\s+update|first\s+page|startup\s+log"
    r"|response\s+message)\b)|^[ \t]*Output:[ \t]*$",
    re.M,
)
PAGE_CLAIM = re.compile(
    r"(?:every\s+example\s+on\s+(?:this\s+page|these\s+pages)\s+is|examples\s+are)\s+real"
    r"\s+output",
    re.I,
)
INPUT_INFOS = frozenset(
    {"python", "toml", "sql", "lark", "registryql", "sh", "json request", "json request registryql"}
)
# What output looks like: a shell prompt, an HTTP response, an ErrorResponse, a line of the
# `registry` command's errors, a log line.
OUTPUT_CONTENT = re.compile(
    r"^(?:\$ |< \d{3}\b|HTTP/\d|registry: |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} )|\{\"error\":",
    re.M,
)


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository, e.g. "docs/api.md"
    line: int  # 1-based line of the opening fence
    info: str
    text: str  # the content, without the fence lines and the fence's indentation
    lead_in: str  # the prose since the previous block or heading


@dataclass(frozen=True)
class Marker:
    page: str
    line: int
    story: str
    item: str
    options: frozenset[str]
    block: Block | None  # the block it marks, or None for an inline example
    inline: str  # for an inline example: the paragraph or table above the marker

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}:{self.story}/{self.item}"


@dataclass
class Page:
    path: str
    text: str
    blocks: list[Block] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    bad_markers: list[tuple[int, str]] = field(default_factory=list)
    # (line, phrase, section end line): a real-output phrase in prose and where its section ends
    phrases: list[tuple[int, str, int]] = field(default_factory=list)


def parse_spec(spec: str) -> tuple[str, str, frozenset[str]] | None:
    """`STORY ITEM [OPTION ...]`, or `not-run REASON...`."""
    words = spec.split()
    if len(words) >= 2 and words[0] == "not-run":
        return "not-run", " ".join(words[1:]), frozenset()
    if len(words) < 2 or not all(re.fullmatch(r"[a-z0-9][a-z0-9._-]*", w) for w in words):
        return None
    return words[0], words[1], frozenset(words[2:])


def parse_page(path: Path) -> Page:
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    page = Page(rel, text)
    pending: tuple[int, str] | None = None  # (line, spec) of a marker right above a fence
    prose = [""] * len(lines)  # the lines outside blocks and markers, others empty
    lead: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        opened = FENCE.match(line)
        if opened:
            indent = len(opened["indent"])
            fence = opened["fence"]
            body: list[str] = []
            j = i + 1
            while j < len(lines) and lines[j].strip() != fence:
                body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
                j += 1
            block = Block(rel, i + 1, opened["info"].strip(), "\n".join(body), "\n".join(lead))
            page.blocks.append(block)
            if pending is not None:
                _add_marker(page, *pending, block, "")
            pending, lead = None, []
            i = j + 1
            continue
        marked = MARKER.match(line)
        if marked:
            if i + 1 < len(lines) and FENCE.match(lines[i + 1]):
                pending = (i + 1, marked["spec"])
            elif i > 0 and lines[i - 1].strip():
                _add_marker(page, i + 1, marked["spec"], None, _paragraph_above(lines, i))
            else:
                page.bad_markers.append((i + 1, "a marker must touch what it marks"))
        elif LOOSE_MARKER.search(line):
            page.bad_markers.append((i + 1, f"not a marker: {line.strip()}"))
        elif HEADING.match(line):
            lead = []
        else:
            lead.append(line)
            prose[i] = line
        i += 1
    _find_phrases(page, lines, "\n".join(prose))
    return page


def _find_phrases(page: Page, lines: list[str], prose: str) -> None:
    """The real-output phrases of the prose (blocks and markers blanked out), except those of a
    claim about a whole page ("every example on this page is real output")."""
    claims = [m.span() for m in PAGE_CLAIM.finditer(prose)]
    for found in REAL_PHRASE.finditer(prose):
        if any(start <= found.start() < end for start, end in claims):
            continue
        line = prose.count("\n", 0, found.start())
        page.phrases.append((line + 1, " ".join(found.group(0).split()), _section_end(lines, line)))


def _add_marker(page: Page, line: int, spec: str, block: Block | None, inline: str) -> None:
    parsed = parse_spec(spec)
    if parsed is None:
        page.bad_markers.append((line, f"cannot read the marker {spec!r}"))
        return
    story, item, options = parsed
    page.markers.append(Marker(page.path, line, story, item, options, block, inline))


def _paragraph_above(lines: list[str], i: int) -> str:
    start = i
    while start > 0 and lines[start - 1].strip() and not MARKER.match(lines[start - 1]):
        start -= 1
    return "\n".join(lines[start:i])


def _section_end(lines: list[str], i: int) -> int:
    j = i + 1
    in_block = False
    while j < len(lines):
        if FENCE.match(lines[j]):
            in_block = not in_block
        elif not in_block and HEADING.match(lines[j]):
            break
        j += 1
    return j  # 1-based line of the next heading (or one past the end)


@cache
def pages() -> tuple[Page, ...]:
    return tuple(parse_page(path) for path in PAGES)


def markers() -> list[Marker]:
    return [m for page in pages() for m in page.markers]


def is_output_example(page: Page, block: Block, previous: Block | None) -> str | None:
    """Why `block` is an example of real output that needs a marker, or None."""
    if block.info in INPUT_INFOS:
        return None
    if PAGE_CLAIM.search(" ".join(page.text[:1000].split())):
        return "the page says its examples are real output"
    lead_in = block.lead_in
    if not lead_in.strip() and previous is not None:
        lead_in = previous.lead_in  # blocks one after the other share their introduction
    if REAL_PHRASE.search(lead_in):
        return "its introduction says it is real output"
    if block.info == "json":
        return "a JSON example (requests are `json request` blocks)"
    if OUTPUT_CONTENT.search(block.text):
        return "it looks like output (a prompt, a response, an error, a log line)"
    return None
