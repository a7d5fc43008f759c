"""The runs that produce the documented examples ("stories").

Each story runs once and returns its outputs by item name; a marker `<!-- example: STORY ITEM -->`
on a page names the output its example must match (tests/docs/matching.py says how). A story
that needs a registry starts its own `registry serve` on a fresh database, so that sequences
start at 1 as in the documented runs. Transcripts (blocks of `$ command` lines) are run as the
page writes them, in the story's sandbox (tests/docs/running.py).

The stories, and the pages whose examples they produce:

- `worked`: the worked example of signin.md and signing.md sent to a registry (examples in
  api.md, idempotency.md, errors.md, signin.md, signing.md);
- `cli`, `cli-errors`, `usage`: cli.md (and the key file of signing.md);
- `events`: events.md; `anchoring`: anchoring.md; `trust`: trust.md and transfers.md;
- `discovery`: discovery.md, registryql.md's errors, signing.md's I-JSON messages, and
  errors.md's 429;
- `config`, `embedded`: configuration.md (invalid configurations and precedence; the embedded
  PostgreSQL's start, a second `serve`, the shutdown);
- `app`: the in-process app: errors.md's 500 and signin.md's 502;
- `federation`: federation.md (two peered registries).

`<!-- example: python output -->` (the output of the page's script above it) and `python
same-output` are run by the test itself (test_examples.py).
"""

from __future__ import annotations

import argparse
import http.server
import json
import re
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from registry.entries import sign_entry
from registry.envelope import response_digest
from registry.keys import SigningKey, write_key_file
from registry.signin import build_response
from registry.trust import sign_offer
from registry.vc import issue_credential
from tests.db.proc import free_port
from tests.docs.markdown import ROOT, Marker, markers, pages
from tests.docs.matching import FIXED_KEYS
from tests.docs.running import (
    DEADLINE,
    Aliases,
    Databases,
    Relay,
    Relayed,
    Sandbox,
    Transcript,
    commands,
    exchange,
    port_in_use,
    registry,
    request_lines,
    serving,
    together,
)

Outputs = dict[str, str]

DOC_URL = "http://127.0.0.1:8080"  # the registry URL of the documented runs


@dataclass
class Context:
    databases: Databases
    database_url: str  # the shared test database (the in-process app uses it)
    tmp: Path  # a directory of the story's own

    def markers(self, story: str) -> list[Marker]:
        return [m for m in markers() if m.story == story]

    def marker(self, story: str, item: str) -> Marker:
        found = [m for m in self.markers(story) if m.item == item]
        assert len(found) == 1, f"one example marked {story} {item}, found {len(found)}"
        return found[0]

    def block(self, story: str, item: str) -> str:
        block = self.marker(story, item).block
        assert block is not None, f"{story} {item} marks no block"
        return block.text

    def block_before(self, story: str, item: str, info: str) -> str:
        """The last block of this kind (```python, ```json request) above the marked one."""
        marker = self.marker(story, item)
        (page,) = [p for p in pages() if p.path == marker.page]
        return [b for b in page.blocks if b.line < marker.line and b.info == info][-1].text


STORIES: dict[str, Callable[[Context], Outputs]] = {}


def story(function: Callable[[Context], Outputs]) -> Callable[[Context], Outputs]:
    STORIES[function.__name__.removeprefix("story_").replace("_", "-")] = function
    return function


def idem() -> str:
    return str(uuid.uuid4())


def sign_in(http: httpx.Client, key: SigningKey, audience: str = "example-app") -> str:
    challenge = http.post("/v1/auth/siws/challenge", json={"audience": audience})
    assert challenge.status_code == 200, challenge.text
    issued = challenge.json()["challenge"]
    body = {"audience": audience, "challenge": issued, "response": build_response(issued, key)}
    verified = http.post("/v1/auth/siws/verify", json=body)
    assert verified.status_code == 200, verified.text
    return str(verified.json()["sessionToken"])


def publish(http: httpx.Client, token: str, entry: dict[str, Any], key: SigningKey) -> Any:
    created = http.post(
        "/v1/entries",
        json=sign_entry(entry, key),
        headers={"Authorization": f"Bearer {token}", "Idempotency-Key": idem()},
    )
    assert created.status_code == 201, created.text
    return created.json()


# --- the worked example -------------------------------------------------------------------------

SIGNER, REGISTRY_KEY = FIXED_KEYS  # seeds 32 x 0x01 and 32 x 0x02 (signin.md, signing.md)

# The entry of signing.md's worked example.
WORKED_ENTRY: dict[str, Any] = {
    "entryDid": "did:example:agent-42",
    "entryType": "AgentDefinition",
    "itemData": {"model": "example-model", "tools": ["search", "calc"], "temperature": 0.5},
    "itemSchemaUri": "https://example.com/schemas/agent/v1",
    "registryVersion": "1.0",
    "name": "Example agent",
    "publishedAt": "2026-01-01T00:00:00Z",
    "version": "1.0.0",
    "lifecycleStatus": "active",
    "tags": ["example"],
}


@story
def story_worked(ctx: Context) -> Outputs:
    """The worked example sent to a registry whose key is seed 0x02 and which lists the signer
    (seed 0x01) in `auth.admin_dids`; default limits; anchoring off, so versions read
    `unanchored` and take consecutive sequences. In order: a read of the unknown entry, sign-in
    (a verify without `response` first), create (and its replay), an update to 1.1.0, a stale
    update, an update that would make it a draft, a draft created and deleted, a create whose
    signature fails (twice, same key), a key reused for another body, an oversized challenge,
    the versions page, health, deep health, and signing.md's verification script."""
    out: Outputs = {}
    key_file = ctx.tmp / "registry.key"
    write_key_file(key_file, REGISTRY_KEY)
    env = {
        "REGISTRY_SERVER__KEY_FILE": str(key_file),
        "REGISTRY_AUTH__ADMIN_DIDS": json.dumps([SIGNER.did]),
    }
    with (
        registry(ctx.databases, "worked", ctx.tmp / "data", env) as server,
        httpx.Client(base_url=server.url, timeout=DEADLINE) as http,
    ):
        did = WORKED_ENTRY["entryDid"]
        out["entry-not-found"] = http.get(f"/v1/entries/{did}").text

        audience = "example-app"
        issued = http.post("/v1/auth/siws/challenge", json={"audience": audience}).json()
        challenge = issued["challenge"]
        out["verify-without-response"] = http.post(
            "/v1/auth/siws/verify", json={"audience": audience, "challenge": challenge}
        ).text
        response = build_response(challenge, SIGNER)
        verified = http.post(
            "/v1/auth/siws/verify",
            json={"audience": audience, "challenge": challenge, "response": response},
        )
        out["signed-in"] = exchange(verified)
        token = verified.json()["sessionToken"]
        auth = {"Authorization": f"Bearer {token}"}

        signed = json.dumps(sign_entry(WORKED_ENTRY, SIGNER))
        headers = {**auth, "Idempotency-Key": "create-agent-42", "Content-Type": "application/json"}
        shown = request_lines("POST", "/v1/entries", headers)
        stand_in = "<the signed entry from signing.md>"
        created = http.post("/v1/entries", content=signed, headers=headers)
        out["create"] = exchange(created, request=shown, body=stand_in)
        out["served"] = created.text
        replayed = http.post("/v1/entries", content=signed, headers=headers)
        out["create-replayed"] = exchange(replayed, request=shown, body=stand_in)

        def put(entry: dict[str, Any], based_on: int) -> httpx.Response:
            return http.put(
                f"/v1/entries/{entry['entryDid']}",
                json={**sign_entry(entry, SIGNER), "sequence": based_on},
                headers={**auth, "Idempotency-Key": idem()},
            )

        updated = put({**WORKED_ENTRY, "version": "1.1.0"}, 1)
        assert updated.status_code == 200, updated.text
        out["stale-update"] = put({**WORKED_ENTRY, "version": "1.2.0"}, 1).text
        draft = {k: v for k, v in WORKED_ENTRY.items() if k != "lifecycleStatus"}
        out["update-to-draft"] = put({**draft, "version": "1.2.0"}, 2).text

        created_draft = http.post(
            "/v1/entries",
            json=sign_entry({**draft, "entryDid": "did:example:draft-1"}, SIGNER),
            headers={**auth, "Idempotency-Key": idem()},
        )
        assert created_draft.status_code == 201, created_draft.text
        out["draft-served"] = created_draft.text
        out["tombstone"] = http.delete(
            "/v1/entries/did:example:draft-1", headers={**auth, "Idempotency-Key": idem()}
        ).text

        bad = sign_entry({**WORKED_ENTRY, "entryDid": "did:example:agent-43"}, SIGNER)
        bad["name"] = "Changed after signing"
        bad_headers = {**auth, "Idempotency-Key": "create-agent-43"}
        first = http.post("/v1/entries", json=bad, headers=bad_headers)
        assert first.status_code == 400, first.text
        out["refusal-replayed"] = exchange(http.post("/v1/entries", json=bad, headers=bad_headers))
        out["idempotency-conflict"] = http.post("/v1/entries", json=bad, headers=headers).text
        out["body-too-large"] = http.post(
            "/v1/auth/siws/challenge",
            content=b"{}" + b" " * 65535,
            headers={"Content-Type": "application/json"},
        ).text

        path = f"/v1/entries/{did}/versions?limit=1"
        out["versions-page"] = exchange(http.get(path), request=[f"GET {path}"])
        # The page's words about the next request: the version with sequence 1, no cursor.
        following = http.get(f"{path}&cursor=2").json()
        assert [v["sequence"] for v in following["versions"]] == [1], following
        assert "cursor" not in following, following
        assert (following["hasMore"], following["totalCount"]) == (False, 2), following

        out["health"] = http.get("/v1/health").text
        out["deep-health"] = http.get("/v1/health/deep", headers=auth).text

        sandbox = Sandbox(ctx.tmp / "shell")
        script = ctx.block_before("worked", "verify", "python")
        (sandbox.home / "verify_served.py").write_text(script)
        aliases = Aliases()
        aliases.add(server.url, DOC_URL)
        out["verify"] = Transcript(sandbox, aliases).run(ctx.block("worked", "verify"))
    return out


# --- the `registry` command ---------------------------------------------------------------------

# A file that is not JSON: its member list ends with a comma.
BROKEN_JSON = '{\n  "entryDid": "did:web:agents.example.com:summarizer",\n  "itemData": {},\n}\n'
THIRD_VERSION = [  # made between two commands of cli.md's update example
    """sed -i 's/"1.1.0"/"1.2.0"/' agent.json""",
    "registry update agent.json --key me.key",
]


def readme_agent_json() -> str:
    """The README's agent.json (its here-document): the entry cli.md publishes."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(r"cat > agent\.json <<'JSON'\n(.*?\n)JSON\n", readme, re.S)
    assert found, "README.md has no agent.json here-document"
    return found[1]


@story
def story_cli(ctx: Context) -> Outputs:
    """cli.md's session, in one HOME (/tmp/docrun/home on the page) with the README's
    agent.json, against a registry at the documented URL (anchoring off): publish, update,
    versions, login and delete, then get of the deleted entry."""
    out: Outputs = {}
    with registry(ctx.databases, "cli", ctx.tmp / "data") as server:
        sandbox = Sandbox(ctx.tmp / "home", {"REGISTRY_URL": server.url})
        (sandbox.home / "agent.json").write_text(readme_agent_json())
        aliases = Aliases()
        aliases.add(server.url, DOC_URL)
        aliases.add(str(sandbox.home), "/tmp/docrun/home")

        def keep(item: str, name: str) -> Callable[[], None]:
            def keep_file() -> None:
                out[item] = aliases.documented((sandbox.home / name).read_text())

            return keep_file

        based_on = (
            "registry update agent.json --key me.key --based-on 2      # after a third version,"
            " sequence 3"
        )
        transcript = Transcript(
            sandbox,
            aliases,
            hidden={based_on: THIRD_VERSION},
            after={
                "registry keygen --out me.key": keep("key-file", "me.key"),
                "registry login --key me.key": keep("session-file", ".registry-session.json"),
            },
        )
        for item in ("publish", "update", "versions", "delete", "get-deleted"):
            out[item] = transcript.run(ctx.block("cli", item))
    return out


@story
def story_cli_errors(ctx: Context) -> Outputs:
    """cli.md's mistakes, in a HOME with the README's agent.json and a malformed broken.json,
    no registry needed: port 8080 in use, nothing listening on 9999, ./.registry locked as a
    running `serve` locks it (by this process); and a database that cannot be used."""
    from service.serve import own_data_dir

    with socket.socket() as probe:  # `registry serve --port 8081` must reach the data-dir check
        try:
            probe.bind(("127.0.0.1", 8081))
        except OSError:
            raise AssertionError("cli.md's example needs port 8081 on 127.0.0.1 free") from None
    with ExitStack() as stack:
        stack.enter_context(port_in_use("127.0.0.1", 8080))
        stack.enter_context(port_in_use("127.0.0.1", 9999, listen=False))
        sandbox = Sandbox(ctx.tmp / "home")
        (sandbox.home / ".registry").mkdir()
        stack.enter_context(own_data_dir(sandbox.home / ".registry"))
        (sandbox.home / "agent.json").write_text(readme_agent_json())
        (sandbox.home / "broken.json").write_text(BROKEN_JSON)
        out = {"errors": Transcript(sandbox, Aliases()).run(ctx.block("cli-errors", "errors"))}

    # A database that cannot be used (its password hidden in the message).
    status, output = Sandbox(ctx.tmp / "elsewhere").run(
        "registry serve --database-url postgresql://postgres:secret@127.0.0.1:1/x"
        f" --port {free_port()}"
    )
    assert status == 1, output
    out["database-unusable"] = output.rstrip("\n").split("\n")[-1]
    return out


USAGE_GROUP = re.compile(r"\[[^\]]*\]|--?\S+(?: [A-Z][A-Z_.]*)?|\S+")


@story
def story_usage(ctx: Context) -> Outputs:
    """cli.md's synopsis: the usage line of `registry --help` and of each `registry COMMAND
    --help`, as argparse writes it, but without `[-h]`, with a command's positionals first
    and `...` after the options that may be repeated."""
    from cli.main import build_parser

    parser = build_parser()
    lines = [f"registry {_usage(parser, 'registry', positionals_first=False)}", ""]
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in commands.choices.items():
        lines.append(f"registry {name:<8} {_usage(sub, f'registry {name}')}".rstrip())
    return {"synopsis": "\n".join(lines)}


def _usage(parser: argparse.ArgumentParser, prog: str, *, positionals_first: bool = True) -> str:
    usage = " ".join(parser.format_usage().split()).removeprefix(f"usage: {prog}")
    repeatable = {
        option
        for action in parser._actions
        if isinstance(action, argparse._AppendAction)
        for option in action.option_strings
    }
    groups = [
        group + ("..." if group.strip("[]").split(" ")[0] in repeatable else "")
        for group in USAGE_GROUP.findall(usage)
        if group != "[-h]"
    ]
    positionals = [g for g in groups if not g.startswith(("[", "-"))] if positionals_first else []
    return " ".join(positionals + [g for g in groups if g not in positionals])


# --- events.md ----------------------------------------------------------------------------------

QS_ENTRY = {
    "entryDid": "did:example:qs-agent-1",
    "entryType": "AgentDefinition",
    "itemData": {"model": "small-1"},
    "itemSchemaUri": "https://schemas.example.com/agent/v1",
    "registryVersion": "1.0",
    "name": "QS agent",
    "publishedAt": "2026-11-21T12:00:00Z",
    "version": "1.0.0",
}


@story
def story_events(ctx: Context) -> Outputs:
    """events.md: one publish on a fresh registry, then `registry watch`."""
    with registry(ctx.databases, "events", ctx.tmp / "data") as server:
        with httpx.Client(base_url=server.url, timeout=DEADLINE) as http:
            key = SigningKey.generate()
            publish(http, sign_in(http, key), QS_ENTRY, key)
        sandbox = Sandbox(ctx.tmp / "home", {"REGISTRY_URL": server.url})
        out = {"watch-one": sandbox.ok("registry watch --from 0 --max-events 1")}
        aliases = Aliases()
        aliases.add(server.url, DOC_URL)
        follow = "registry watch --url http://127.0.0.1:8080 --from 0 --kind entry.created"
        transcript = Transcript(sandbox, aliases, lines={follow: 1})  # it runs until stopped
        out["watch"] = transcript.run(ctx.block("events", "watch"))
    return out


def _shown_headers(real: str, documented: str) -> str:
    """The page shows the headers it names only ("headers filtered"): the others are left out
    of the real output too."""
    names = {line.split(":")[0].lower() for line in documented.split("\n") if ": " in line}
    kept, in_headers = [], False
    for line in real.replace("\r", "").split("\n"):
        if line.startswith("HTTP/"):
            in_headers = True
        elif not line.strip():
            in_headers = False
        elif in_headers and line.split(":")[0].lower() not in names:
            continue
        kept.append(line)
    return "\n".join(kept)


@contextmanager
def failing_resolver() -> Iterator[str]:
    """An identity resolver that answers 500 to everything."""

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/identity"
    finally:
        server.shutdown()
        server.server_close()


# --- discovery.md, registryql.md, the I-JSON rules of signing.md --------------------------------

DISCOVERY_ENTRIES: list[dict[str, Any]] = [
    {
        "entryDid": "did:web:agents.example.com:invoice-reader",
        "entryType": "AgentDefinition",
        "itemData": {"model": "llm-7b"},
        "itemSchemaUri": "https://schemas.example.com/agent/v1",
        "registryVersion": "1.0",
        "name": "Invoice reader",
        "description": "Extracts and summarizes invoices",
        "publishedAt": "2026-03-01T09:00:00Z",
        "version": "1.0.0",
        "lifecycleStatus": "active",
        "tags": ["ocr", "finance"],
        "customMetadata": {"team": "finance", "gpu": False},
        "relationships": [
            {"relationshipType": "dependsOn", "targetDid": "did:web:models.example:llm-7b"}
        ],
        "serviceEndpoints": [
            {"id": "mcp", "type": "MCP", "url": "https://agents.example.com/invoice/mcp"}
        ],
    },
    {
        "entryDid": "did:web:agents.example.com:receipt-scanner",
        "entryType": "AgentDefinition",
        "itemData": {"model": "llm-7b"},
        "itemSchemaUri": "https://schemas.example.com/agent/v1",
        "registryVersion": "1.0",
        "name": "Receipt scanner",
        "publishedAt": "2026-02-01T09:00:00Z",
        "version": "1.0.0",
        "lifecycleStatus": "active",
        "tags": ["ocr"],
    },
]

# Bodies breaking each I-JSON rule, in the order of signing.md's table.
IJSON_BODIES = [
    b'{"a": 1, "a": 2}',
    b'{"limit": 9007199254740992}',
    b'{"limit": 9007199254740993.0}',
    b'{"limit": 1e400}',
    b'{"limit": NaN}',
    b'{"text": "\\ud800"}',
    b'{"text": "\\u0000"}',
    b"[" * 65 + b"]" * 65,
    b'{"text": "\xff"}',
    b"\xef\xbb\xbf{}",
]


def _rows(table: str) -> list[list[str]]:
    return [[c.strip() for c in row.split("|")[1:-1]] for row in table.split("\n")]


def _table(table: str, rows: list[list[str]]) -> str:
    """The table with its header as written and `rows` below it."""
    head = table.split("\n")[:2]
    return "\n".join([*head, *("| " + " | ".join(row) + " |" for row in rows)])


def _span(cell: str) -> str:
    found = re.fullmatch(r"`(.*)`", cell)
    assert found, f"not a code span: {cell}"
    return found[1]


@story
def story_discovery(ctx: Context) -> Outputs:
    """discovery.md's registry: two active entries tagged `ocr` by one publisher. The page's
    request blocks are sent as written (the cursor of the previous answer where they say so);
    the error tables of registryql.md and signing.md are run row by row. The registry limits
    reads to 2 a minute (`REGISTRY_LIMITS__READ_PER_MINUTE=2`) for errors.md's 429, the same
    read three times with curl (discovery queries are not reads: they have a class of their
    own)."""
    out: Outputs = {}
    env = {"REGISTRY_LIMITS__READ_PER_MINUTE": "2"}
    with (
        registry(ctx.databases, "discovery", ctx.tmp / "data", env) as server,
        httpx.Client(base_url=server.url, timeout=DEADLINE) as http,
    ):
        key = SigningKey.generate()
        token = sign_in(http, key)
        for entry in DISCOVERY_ENTRIES:
            publish(http, token, entry, key)

        cursor = ""
        for item in ("first-page", "next-page"):
            request = ctx.block_before("discovery", item, "json request")
            request = request.replace("<cursor of the previous page>", cursor)
            answer = http.post("/v1/discover", content=request)
            assert answer.status_code == 200, answer.text
            out[item] = answer.text
            cursor = answer.json().get("cursor", "")

        out["unknown-member"] = http.post("/v1/discover", json={"sort": "name"}).text
        out["foreign-cursor"] = http.post("/v1/discover", json={"cursor": "abc"}).text
        out["too-large"] = http.post(
            "/v1/discover",
            content=b"{}" + b" " * 65535,
            headers={"Content-Type": "application/json"},
        ).text
        out["registryql-error"] = http.post(
            "/v1/discover/registryql", json={"query": "DISCOVER agent WHERE name = 'x' FROM"}
        ).text

        table = ctx.marker("discovery", "registryql-messages").inline
        rows = _rows(table)[2:]
        for row in rows:
            answer = http.post("/v1/discover/registryql", json={"query": _span(row[0])})
            row[1] = f"`{answer.json()['error']['message']}`"
        out["registryql-messages"] = _table(table, rows)

        table = ctx.marker("discovery", "ijson-messages").inline
        rows = _rows(table)[2:]
        assert len(rows) == len(IJSON_BODIES), "a body for each row of the table"
        for row, body in zip(rows, IJSON_BODIES, strict=True):
            error = http.post("/v1/discover", content=body).json()["error"]
            assert error["code"] == "invalid_json", error
            row[1], row[2] = f"`{error['details']['rule']}`", f"`{error['message']}`"
        out["ijson-messages"] = _table(table, rows)

        aliases = Aliases()
        aliases.add(server.url, "http://127.0.0.1:18951")
        documented = ctx.block("discovery", "read-429")
        (command,) = commands(documented)
        transcript = Transcript(Sandbox(ctx.tmp / "home"), aliases, {command: [command, command]})
        out["read-429"] = _shown_headers(transcript.run(documented), documented)
    return out


# --- trust.md and transfers.md ------------------------------------------------------------------


@story
def story_trust(ctx: Context) -> Outputs:
    """trust.md's and transfers.md's registry: a publisher's entry did:example:agent-42; an
    issuer attests it and reports it; an admin provisions bond-42 (100.00 USD), upholds the
    report with a slash of 33.10; the publisher offers the entry to a recipient."""
    admin, publisher, issuer, recipient = (SigningKey.generate() for _ in range(4))
    env = {"REGISTRY_AUTH__ADMIN_DIDS": json.dumps([admin.did])}
    out: Outputs = {}
    with (
        registry(ctx.databases, "trust", ctx.tmp / "data", env) as server,
        httpx.Client(base_url=server.url, timeout=DEADLINE) as http,
    ):
        tokens = {key.did: sign_in(http, key) for key in (admin, publisher, issuer)}

        def post(key: SigningKey, path: str, body: Any, status: int) -> str:
            headers = {"Authorization": f"Bearer {tokens[key.did]}", "Idempotency-Key": idem()}
            answer = http.post(path, json=body, headers=headers)
            assert answer.status_code == status, answer.text
            return answer.text

        did = WORKED_ENTRY["entryDid"]
        publish(http, tokens[publisher.did], WORKED_ENTRY, publisher)
        credential = issue_credential(
            issuer,
            subject_id=did,
            claims={"audited": True},
            valid_from=datetime(2026, 11, 1, tzinfo=UTC),
            valid_until=datetime(2036, 11, 1, tzinfo=UTC),
        )
        body = {"attestation": credential, "entryDid": did}
        out["attestation"] = post(issuer, "/v1/attestations", body, 201)
        reason = "impersonates another agent"
        report = json.loads(post(issuer, "/v1/report", {"entryDid": did, "reason": reason}, 201))
        bond = {
            "amount": "100.00",
            "bondId": "bond-42",
            "currency": "USD",
            "entryDid": did,
            "publisherDid": publisher.did,
        }
        post(admin, "/v1/admin/bonds", bond, 201)
        resolution = {
            "decision": "uphold",
            "note": "confirmed",
            "slash": {"bondId": "bond-42", "amount": "33.10"},
        }
        path = f"/v1/admin/reports/{report['reportId']}/resolve"
        out["report"] = post(admin, path, resolution, 200)
        out["bond"] = http.get("/v1/bonds/bond-42").text

        signature = sign_offer(
            publisher, entry_did=did, entry_sequence=1, recipient_did=recipient.did
        )
        offer = {
            "entryDid": did,
            "entrySequence": 1,
            "recipientDid": recipient.did,
            "ownerSignature": signature,
        }
        out["offer"] = post(publisher, "/v1/transfers/offers", offer, 201)
    return out


# --- anchoring.md -------------------------------------------------------------------------------


@story
def story_anchoring(ctx: Context) -> Outputs:
    """anchoring.md: one version on a fresh registry with anchoring on and the local chain
    sealing a block per call (`block_interval_seconds = 0`); its anchors once it is confirmed
    (waited for on the event stream: `registry watch` until the `anchor.updated` event)."""
    env = {
        "REGISTRY_ANCHORING__ENABLED": "true",
        "REGISTRY_ANCHORING__BLOCK_INTERVAL_SECONDS": "0",
    }
    with (
        registry(ctx.databases, "anchoring", ctx.tmp / "data", env) as server,
        httpx.Client(base_url=server.url, timeout=DEADLINE) as http,
    ):
        key = SigningKey.generate()
        publish(http, sign_in(http, key), {**WORKED_ENTRY, "entryDid": "did:example:agent-7"}, key)
        sandbox = Sandbox(ctx.tmp / "home", {"REGISTRY_URL": server.url})
        event = json.loads(
            sandbox.ok("registry watch --from 0 --kind anchor.updated --max-events 1")
        )
        assert event["data"]["state"] == "confirmed", event
        return {"anchors": http.get("/v1/anchors/did:example:agent-7").text}


# --- configuration.md ---------------------------------------------------------------------------


@story
def story_config(ctx: Context) -> Outputs:
    """configuration.md: invalid configurations given to `registry serve` (an unknown key in a
    file; a list that is not JSON; a bad DID and a limit of 0), and the precedence of file,
    environment and flags as `registry serve` reads them (the page's values)."""
    sandbox = Sandbox(ctx.tmp / "home")
    (sandbox.home / "portt.toml").write_text("[server]\nportt = 9000\n")
    invalid = []
    for command in (
        "registry serve --config portt.toml",
        "REGISTRY_AUTH__ADMIN_DIDS='[nope' registry serve",
        """REGISTRY_AUTH__ADMIN_DIDS='["did:key:nope"]' REGISTRY_LIMITS__READ_PER_MINUTE=0"""
        " registry serve",
    ):
        status, output = sandbox.run(command)
        assert status == 2, (command, output)
        invalid.append(output.rstrip("\n"))

    spans = re.findall(r"`([^`]+)`", ctx.marker("config", "precedence").inline)
    port, host, env_port, env_host, flag = spans[:5]
    (sandbox.home / "precedence.toml").write_text(f"[server]\n{port}\n{host}\n")
    (sandbox.home / "read_config.py").write_text(
        "import sys\n"
        "from cli.main import _config, build_parser\n"
        "config = _config(build_parser().parse_args(sys.argv[1:]))\n"
        "print(config.server.host, config.server.port)\n"
    )
    command = f"{env_port} {env_host} python read_config.py serve --config precedence.toml {flag}"
    read = sandbox.ok(command).split()
    return {"invalid": "\n".join(invalid), "precedence": "\n".join([*spans[:5], *read])}


@story
def story_embedded(ctx: Context) -> Outputs:
    """configuration.md: `registry serve --data-dir DIR --port P` with the default configuration
    and a fresh data directory (/tmp/docrun/fresh and 18950 on the page): the embedded
    PostgreSQL starts; a second `serve` on DIR is refused; SIGTERM stops it all. DIR is made
    under /tmp with mode 0755, so that as root the cluster's OS user can reach it. The actors'
    log lines (logger `actors.*`) run beside the start, so they are shown after it, in the order
    of their loggers."""
    base = Path(tempfile.mkdtemp(prefix="registry-docs-"))
    try:
        base.chmod(0o755)
        data, port = base / "fresh", free_port()
        aliases = Aliases()
        aliases.add(str(data), "/tmp/docrun/fresh")
        aliases.add(f"127.0.0.1:{port}", "127.0.0.1:18950")
        sandbox = Sandbox(ctx.tmp / "home")
        args = ["--data-dir", str(data), "--port", str(port)]
        with serving(args, sandbox.environ(), sandbox.home) as server:
            log = server.log
            log.until(lambda got: _logged(got, "anchoring leader") and _logged(got, "checkpoints"))
            started = len(log.lines)
            status, in_use = sandbox.run(f"registry serve --data-dir {data} --port {free_port()}")
            assert status == 1, in_use
        log.until(lambda got: False)  # to its end: the process has exited
        start = [line.rstrip("\n") for line in log.lines[:started]]
        actors = sorted((x for x in start if " actors." in x), key=lambda x: x.split(" ", 3)[3])
        start = [x for x in start if " actors." not in x] + actors
        stop = [line.rstrip("\n") for line in log.lines[started:]]
        return {
            "startup-log": aliases.documented("\n".join(start)),
            "in-use": aliases.documented(in_use),
            "shutdown-log": aliases.documented("\n".join(stop)),
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _logged(lines: list[str], text: str) -> bool:
    return any(text in line for line in lines)


# --- limits.md: a connection over the per-address cap ------------------------------------------


@story
def story_limits(ctx: Context) -> Outputs:
    """A registry allowing one connection per client address: a held connection (answered once,
    so it is counted), then a second from the same address, answered without its request being
    read (headers shown: the status line, content-type, retry-after, connection)."""
    import socket

    env = {"REGISTRY_SERVER__MAX_CONNECTIONS_PER_CLIENT": "1"}
    with registry(ctx.databases, "limits", ctx.tmp / "data", env) as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=DEADLINE) as held:
            held.sendall(b"GET /v1/health HTTP/1.1\r\nHost: r\r\n\r\n")
            assert held.recv(12) == b"HTTP/1.1 200"
            with socket.create_connection((host, int(port)), timeout=DEADLINE) as extra:
                answer = b""
                while chunk := extra.recv(65536):
                    answer += chunk
    head, _, body = answer.decode().partition("\r\n\r\n")
    status, *headers = head.split("\r\n")
    shown = [h for h in headers if h.split(":")[0] in ("content-type", "retry-after", "connection")]
    return {"refused": "\n".join([status, *shown, "", body])}


# --- errors.md: an unexpected failure -----------------------------------------------------------


@story
def story_app(ctx: Context) -> Outputs:
    """The app in process, over the test database: errors.md's 500, the answer to a route that
    fails unexpectedly (a route added for the example: no route of the service fails on
    purpose); signin.md's 502, a sign-in with `auth.identity_resolver_url` naming a resolver
    that answers 500 (the service's own HTTP resolver)."""
    import trio

    from api.identity import HttpIdentityResolver
    from tests.conftest import make_config, open_harness

    out: Outputs = {}

    async def failure() -> None:
        async for h in open_harness(make_config(ctx.database_url, ctx.tmp)):

            async def fail() -> str:
                raise RuntimeError("an unexpected failure (docs example)")

            h.service.app.add_url_rule("/v1/docs-example-failure", "docs_example_failure", fail)
            response = await h.client.get("/v1/docs-example-failure")
            body = (await response.get_data()).decode()
            out["internal-error"] = f"{response.status_code} {body}"

    async def lookup(url: str) -> None:
        config = make_config(ctx.database_url, ctx.tmp, auth={"identity_resolver_url": url})
        async with HttpIdentityResolver.open(url) as resolver:
            async for h in open_harness(config, identity=resolver):
                key = SigningKey.generate()
                challenge = await h.client.post(
                    "/v1/auth/siws/challenge", json={"audience": "example-app"}
                )
                issued = (await challenge.get_json())["challenge"]
                body = {
                    "audience": "example-app",
                    "challenge": issued,
                    "response": build_response(issued, key),
                }
                response = await h.client.post("/v1/auth/siws/verify", json=body)
                out["lookup-failed"] = (await response.get_data()).decode()

    trio.run(failure)
    with failing_resolver() as url:
        trio.run(lookup, url)
    return out


# --- federation.md ------------------------------------------------------------------------------

SYNC_PATH = "/v1/federation/sync"


def _sync_from(relayed: Relayed, sequence: int) -> bool:
    """A sync request (to the relay's peer) for what follows `sequence` or more."""
    if relayed.path != SYNC_PATH:
        return False
    return int(json.loads(relayed.body)["payload"]["fromSequence"]) >= sequence


@story
def story_federation(ctx: Context) -> Outputs:
    """federation.md: registries A and B, each with a key made at random and the other as its
    peer (`sync` and `discover`, agreement `default`, pulling every 0.2 s), default page size;
    B's admin is a third key. Each reaches its peer through a relay in this process
    (tests/docs/running.py) that records the exchanges and holds them until both serve (the
    request timeout outlasts that): no first pull fails (a failure is a status change, a record
    in the puller's log), so the log heads are the documented ones. A's first sync request to B
    and B's answer, as relayed; the same request sent to B again; one entry published on A and,
    once B has stored it (B asks A for what follows it), B's admin view of its peers and a
    federated query on B (`*`)."""
    a_key, b_key, admin, publisher = (SigningKey.generate() for _ in range(4))
    to_a, to_b = Relay(), Relay()

    def env(name: str, key: SigningKey, peer: SigningKey, relay: Relay) -> dict[str, str]:
        key_file = ctx.tmp / f"{name}.key"
        write_key_file(key_file, key)
        peers = [
            {
                "peer_did": peer.did,
                "endpoint": relay.url,
                "agreement_ids": ["default"],
                "kinds": ["sync", "discover"],
            }
        ]
        return {
            "REGISTRY_SERVER__KEY_FILE": str(key_file),
            "REGISTRY_FEDERATION__PEERS": json.dumps(peers),
            "REGISTRY_FEDERATION__POLL_SECONDS": "0.2",
            "REGISTRY_AUTH__ADMIN_DIDS": json.dumps([admin.did]),
            # A first request held by the relay while the peer starts must not time out.
            "REGISTRY_FEDERATION__REQUEST_TIMEOUT_SECONDS": str(DEADLINE),
            # A peer polling every 0.2 s would keep it in its graceful shutdown (10 s).
            "REGISTRY_SERVER__GRACEFUL_TIMEOUT_SECONDS": "1",
        }

    out: Outputs = {}
    with ExitStack() as stack:
        stack.enter_context(to_a.running())
        stack.enter_context(to_b.running())
        a, b = stack.enter_context(
            together(
                registry(
                    ctx.databases, "federation-a", ctx.tmp / "a", env("a", a_key, b_key, to_b)
                ),
                registry(
                    ctx.databases, "federation-b", ctx.tmp / "b", env("b", b_key, a_key, to_a)
                ),
            )
        )
        to_a.open(a.url)
        to_b.open(b.url)

        first = to_b.until(lambda relayed: _sync_from(relayed, 0))
        request = json.loads(first.body)
        assert first.status == 200, first.answer
        assert json.loads(first.answer)["requestDigest"] == response_digest(request)
        out["sync-request"] = first.body.decode()
        out["sync-response"] = first.answer.decode()
        with httpx.Client(timeout=DEADLINE) as http:
            again = http.post(
                b.url + SYNC_PATH, content=first.body, headers={"Content-Type": "application/json"}
            )
        out["nonce-replayed"] = again.text

        with httpx.Client(base_url=a.url, timeout=DEADLINE) as http:
            entry = {**WORKED_ENTRY, "entryDid": "did:example:agent-7"}
            sequence = publish(http, sign_in(http, publisher), entry, publisher)["sequence"]
        to_a.until(lambda relayed: _sync_from(relayed, sequence))

        with httpx.Client(base_url=b.url, timeout=DEADLINE) as http:
            auth = {"Authorization": f"Bearer {sign_in(http, admin)}"}
            status = http.get("/v1/admin/federation/peers", headers=auth)
            assert status.status_code == 200, status.text
            out["peer-status"] = status.text
            found = http.post("/v1/discover/federated", json={"entryType": "*"}, headers=auth)
            assert found.status_code == 200, found.text
            out["federated"] = found.text
    return out
