"""docs/discovery.md is checked against the service: every request example is sent and must be
accepted, every row of the error table must give its status and code, and the real-output error
bodies shown must be what the service answers (but for the request id)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.api.api_support import JSON, anon_client, error_of
from tests.api.test_discover import discover, publisher
from tests.conftest import Harness

DOC = Path(__file__).resolve().parents[2] / "docs" / "discovery.md"
REQUEST = re.compile(r"^```json request( registryql)?\n(.*?)\n```", re.S | re.M)
ERROR_ROW = re.compile(r"^\| `(.+?)` \| (\d{3}) \| `([a-z_]+)` \|", re.M)
ERROR_OUTPUT = re.compile(r"^ *(\{\"error\":.*\})$", re.M)
DOC_PUBLISHER = "did:key:z6MkqWVcWLBLCV6nHVnzRBTSCHN9nBe7X9xmn7p1mhkK59hT"


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


async def _corpus(h: Harness) -> str:
    """Entries like the page's examples, so that the examples have something to find."""
    pub = await publisher(h)
    common = {
        "lifecycleStatus": "active",
        "serviceEndpoints": [{"id": "mcp", "type": "MCP", "url": "https://x.example/mcp"}],
        "customMetadata": {"team": "finance", "gpu": False},
        "relationships": [
            {"relationshipType": "dependsOn", "targetDid": "did:web:models.example:llm-7b"}
        ],
        "publishedAt": "2026-03-01T09:00:00Z",
    }
    await pub.publish(
        tags=["ocr", "finance"],
        name="Invoice reader",
        description="Extracts and summarizes invoices",
        **common,
    )
    await pub.publish(tags=["ocr"], name="Receipt scanner", **common)
    return pub.did


async def test_every_request_example_is_accepted(harness: Harness) -> None:
    publisher_did = await _corpus(harness)
    # The examples' publisher is the one of the page's real output; here it is the corpus's.
    examples = REQUEST.findall(_text().replace(DOC_PUBLISHER, publisher_did))
    assert len(examples) >= 10
    for registryql, text in examples:
        path = "/v1/discover/registryql" if registryql else "/v1/discover"
        body = json.loads(text)
        if str(body.get("cursor", "")).startswith("<"):
            without = {k: v for k, v in body.items() if k != "cursor"}
            first = await discover(harness, without, path)
            assert first["hasMore"], text
            body = {**body, "cursor": first["cursor"]}
        result = await discover(harness, body, path)
        assert result["entries"] or "offset" in body, text


async def test_every_error_row_gives_its_status_and_code(harness: Harness) -> None:
    rows = ERROR_ROW.findall(_text())
    assert len(rows) >= 10
    for body, status, code in rows:
        r = await anon_client(harness).post("/v1/discover", data=body.encode(), headers=JSON)
        await error_of(r, int(status), code)


async def test_the_error_outputs_shown_are_real(harness: Harness) -> None:
    requests = {
        "invalid_query": b'{"sort": "name"}',
        "invalid_cursor": b'{"cursor": "abc"}',
        "body_too_large": b"{}" + b" " * 65535,
    }
    shown = [json.loads(line) for line in ERROR_OUTPUT.findall(_text())]
    assert {e["error"]["code"] for e in shown} == set(requests)
    for example in shown:
        body = requests[example["error"]["code"]]
        headers = {**JSON, "Content-Length": str(len(body))}
        r = await anon_client(harness).post("/v1/discover", data=body, headers=headers)
        got = await r.get_json()
        assert r.status_code in (400, 413)
        example["error"]["requestId"] = got["error"]["requestId"]
        assert got == example
