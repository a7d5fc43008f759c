"""Discovery over HTTP (`POST /v1/discover`) against real PostgreSQL: every DiscoverRequest field,
every ordering with its tie-break, paging by cursor and by offset, totalCount, and the shape of
the result.

The database is shared by the whole test session, so every test scopes its queries to entries of
its own: a tag made for the test (`scope()`), usually passed as `tags`, so totals and pages are
exact whatever else the session has published.
"""

from __future__ import annotations

import json
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

import trio
import trio.lowlevel

from registry.keys import SigningKey
from tests.api.api_support import anon_client, create, error_of, updated, with_harness
from tests.conftest import Harness, make_config
from tests.helpers import bearer, idem, sign_in

# --- helpers (also used by the other test_discover_*.py modules) ------------------------------


def scope() -> str:
    """A tag no other test uses."""
    return "t-" + secrets.token_hex(6)


class Publisher:
    """A signed-in publisher: its key and session token."""

    def __init__(self, h: Harness, key: SigningKey, token: str) -> None:
        self.h = h
        self.key = key
        self.token = token
        self.did = key.did

    async def publish(self, did: str | None = None, **fields: Any) -> dict:
        return await create(self.h, self.key, self.token, did, **fields)

    async def update(self, entry: dict, **changes: Any) -> dict:
        """A new version of `entry` (the publisher-authored fields of `entry`, then `changes`)."""
        skip = {
            "entryDid",
            "signature",
            "sequence",
            "anchorState",
            "updatedAt",
            "verifiableAttestations",
            "itemDataHash",
            "publisherDid",
            "version",  # a new version string: the update's own (a version names one content)
        }
        fields = {k: v for k, v in entry.items() if k not in skip}
        fields.update(changes)
        return await updated(
            self.h, self.key, self.token, entry["entryDid"], entry["sequence"], **fields
        )

    async def delete(self, entry: dict) -> None:
        r = await self.h.client.delete(
            f"/v1/entries/{entry['entryDid']}", headers=bearer(self.token, **idem())
        )
        assert r.status_code == 200, await r.get_data()


async def publisher(h: Harness) -> Publisher:
    key = SigningKey.generate()
    return Publisher(h, key, await sign_in(anon_client(h), key))


async def post(h: Harness, body: Any, path: str = "/v1/discover") -> Any:
    return await anon_client(h).post(path, json=body)


async def discover(h: Harness, body: Any, path: str = "/v1/discover") -> dict:
    """One page; asserts 200 and the result shape."""
    r = await post(h, body, path)
    raw = (await r.get_data()).decode()
    assert r.status_code == 200, raw
    assert r.headers["Content-Type"].startswith("application/json")
    result = json.loads(raw)
    assert set(result) <= {"entries", "cursor", "hasMore", "totalCount", "totalCountExact"}, result
    assert isinstance(result["entries"], list)
    assert isinstance(result["hasMore"], bool)
    assert isinstance(result["totalCount"], int)
    assert ("cursor" in result) == result["hasMore"], result
    return result


async def dids(h: Harness, body: Any, path: str = "/v1/discover") -> list[str]:
    return [e["entryDid"] for e in (await discover(h, body, path))["entries"]]


async def page_all(
    h: Harness, body: dict, path: str = "/v1/discover", *, max_pages: int = 100
) -> list[list[dict]]:
    """Every page of a query, following cursors; the body's `cursor` member is replaced."""
    pages: list[list[dict]] = []
    request = dict(body)
    for _ in range(max_pages):
        result = await discover(h, request, path)
        pages.append(result["entries"])
        if not result["hasMore"]:
            return pages
        request = {**body, "cursor": result["cursor"]}
    raise AssertionError("paging did not end")


def flat_dids(pages: list[list[dict]]) -> list[str]:
    return [e["entryDid"] for page in pages for e in page]


def sorted_dids(entries: list[dict], key: Any, *, descending: bool) -> list[str]:
    """The expected order: `key(entry)`, ties by entryDid, both in the same direction."""
    ordered = sorted(entries, key=lambda e: (key(e), e["entryDid"]), reverse=descending)
    return [e["entryDid"] for e in ordered]


def instant(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


# --- the empty request, the result shape ---------------------------------------------------------


async def test_empty_body_is_a_valid_request_newest_change_first(harness: Harness) -> None:
    pub = await publisher(harness)
    first = await pub.publish(tags=[scope()])
    second = await pub.publish(tags=[scope()])
    result = await discover(harness, {})
    assert result["totalCount"] >= 2
    sequences = [e["sequence"] for e in result["entries"]]
    assert sequences == sorted(sequences, reverse=True)
    assert len(result["entries"]) == min(20, result["totalCount"])
    # Nothing newer than `second` can be missing from the head of the list.
    assert sequences[0] >= second["sequence"] > first["sequence"]


async def test_entries_are_exactly_what_get_entry_serves(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    published = [
        await pub.publish(
            tags=[tag, "ocr"],
            description="Reads invoices",
            serviceEndpoints=[{"id": "e", "type": "MCP", "url": "https://x.example/a"}],
            customMetadata={"team": "finance", "gpu": True, "n": 3},
            relationships=[{"relationshipType": "dependsOn", "targetDid": "did:web:x.example"}],
        ),
        await pub.publish(tags=[tag]),
    ]
    r = await post(harness, {"tags": [tag]})
    raw = (await r.get_data()).decode()
    result = json.loads(raw)
    assert result["totalCount"] == 2
    assert result["hasMore"] is False
    assert "cursor" not in result
    for entry in result["entries"]:
        got = await harness.client.get(f"/v1/entries/{entry['entryDid']}")
        assert got.status_code == 200
        served_text = (await got.get_data()).decode()
        assert entry == json.loads(served_text)
        assert served_text in raw  # byte for byte, not a re-serialisation
    assert {e["entryDid"] for e in result["entries"]} == {e["entryDid"] for e in published}
    # The latest version is the one listed.
    changed = await pub.update(published[1], name="Renamed")
    (entry,) = (await discover(harness, {"tags": [tag], "text": "renamed"}))["entries"]
    assert entry == changed


async def test_no_match_is_an_empty_last_page(harness: Harness) -> None:
    result = await discover(harness, {"tags": [scope()]})
    assert result == {"entries": [], "hasMore": False, "totalCount": 0}


# --- filters ---------------------------------------------------------------------------------


async def test_entry_type_filter_and_star(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    agent = await pub.publish(tags=[tag])
    tool = await pub.publish(tags=[tag], entryType="Tool")
    dataset = await pub.publish(tags=[tag], entryType="Dataset.v2")
    assert await dids(harness, {"tags": [tag], "entryType": "Tool"}) == [tool["entryDid"]]
    assert await dids(harness, {"tags": [tag], "entryType": "AgentDefinition"}) == [
        agent["entryDid"]
    ]
    assert await dids(harness, {"tags": [tag], "entryType": "Dataset.v2"}) == [dataset["entryDid"]]
    everything = {agent["entryDid"], tool["entryDid"], dataset["entryDid"]}
    assert set(await dids(harness, {"tags": [tag], "entryType": "*"})) == everything
    assert set(await dids(harness, {"tags": [tag]})) == everything  # "*" is the default
    assert await dids(harness, {"tags": [tag], "entryType": "tool"}) == []  # case-sensitive
    assert await dids(harness, {"tags": [tag], "entryType": "Nothing"}) == []


async def test_text_matches_name_description_and_tags_with_stemming(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    in_description = await pub.publish(
        tags=[tag], name="Doc tool", description="Summarizes long documents"
    )
    in_name = await pub.publish(tags=[tag], name="Summarizing agent")
    in_tags = await pub.publish(tags=[tag, "summarization"], name="Plain")
    await pub.publish(tags=[tag], name="Translator", description="Translates documents")
    found = set(await dids(harness, {"tags": [tag], "text": "summarize"}))
    assert in_description["entryDid"] in found
    assert in_name["entryDid"] in found
    assert found <= {in_description["entryDid"], in_name["entryDid"], in_tags["entryDid"]}
    # Every word must occur; case does not matter.
    assert await dids(harness, {"tags": [tag], "text": "SUMMARIZES documents"}) == [
        in_description["entryDid"]
    ]
    assert await dids(harness, {"tags": [tag], "text": "summarize translate"}) == []
    # Web-search syntax: `or`, `-word`.
    either = await dids(harness, {"tags": [tag], "text": "translates or summarizing"})
    assert in_name["entryDid"] in either
    assert len(either) >= 2
    excluded = await dids(harness, {"tags": [tag], "text": "documents -translates"})
    assert excluded == [in_description["entryDid"]]
    plain = await dids(harness, {"tags": [tag], "text": "plain"})
    assert plain == [in_tags["entryDid"]]
    # A text made only of stop words has nothing to match.
    assert await dids(harness, {"tags": [tag], "text": "the and of"}) == []


async def test_text_orders_by_relevance_best_first(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    # Weights: name and tags rank above the description; more occurrences rank higher.
    weak = await pub.publish(tags=[tag], name="Tool", description="can read an invoice")
    strong = await pub.publish(
        tags=[tag, "invoice"], name="Invoice reader", description="invoice invoice extraction"
    )
    middle = await pub.publish(tags=[tag], name="Invoice tool", description="reads documents")
    order = [strong["entryDid"], middle["entryDid"], weak["entryDid"]]
    assert await dids(harness, {"tags": [tag], "text": "invoice"}) == order
    explicit = {"tags": [tag], "text": "invoice", "orderBy": "relevance"}
    assert await dids(harness, explicit) == order
    assert await dids(harness, {**explicit, "order": "desc"}) == order
    assert await dids(harness, {**explicit, "order": "asc"}) == order[::-1]


async def test_relevance_ties_are_broken_by_entry_did(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    same = [await pub.publish(tags=[tag], name="Same words here") for _ in range(4)]
    better = await pub.publish(tags=[tag], name="Same words words here same")
    body = {"tags": [tag], "text": "same words"}
    expected = [better["entryDid"], *sorted((e["entryDid"] for e in same), reverse=True)]
    assert await dids(harness, body) == expected
    asc = await dids(harness, {**body, "orderBy": "relevance", "order": "asc"})
    assert asc == [*sorted(e["entryDid"] for e in same), better["entryDid"]]
    # Paging through ties by cursor gives the same order, one entry per page.
    assert flat_dids(await page_all(harness, {**body, "limit": 1})) == expected
    asc_body = {**body, "orderBy": "relevance", "order": "asc", "limit": 2}
    assert flat_dids(await page_all(harness, asc_body)) == asc


async def test_text_without_relevance_ordering_can_be_ordered_otherwise(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    a = await pub.publish(tags=[tag], name="b invoice", description="invoice invoice")
    b = await pub.publish(tags=[tag], name="a invoice")
    body = {"tags": [tag], "text": "invoice", "orderBy": "name"}
    assert await dids(harness, body) == [b["entryDid"], a["entryDid"]]


async def test_tags_are_all_of(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    both = await pub.publish(tags=[tag, "ocr", "pdf"])
    ocr = await pub.publish(tags=[tag, "ocr"])
    await pub.publish(tags=[tag, "pdf"])
    assert await dids(harness, {"tags": [tag, "ocr", "pdf"]}) == [both["entryDid"]]
    assert set(await dids(harness, {"tags": [tag, "ocr"]})) == {both["entryDid"], ocr["entryDid"]}
    assert await dids(harness, {"tags": [tag, "OCR"]}) == []  # exact, case-sensitive
    assert await dids(harness, {"tags": [tag, "oc"]}) == []  # whole tags, not substrings
    assert (await discover(harness, {"tags": [tag]}))["totalCount"] == 3
    # An empty list asks for no tag at all.
    assert (await discover(harness, {"publisherDid": pub.did, "tags": []}))["totalCount"] == 3


async def test_any_tags_are_any_of_and_combine_with_tags(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    other = scope()
    ocr = await pub.publish(tags=[tag, "ocr"])
    pdf = await pub.publish(tags=[tag, "pdf"])
    csv = await pub.publish(tags=[tag, "csv"])
    elsewhere = await pub.publish(tags=[other, "ocr"])
    assert set(await dids(harness, {"tags": [tag], "anyTags": ["ocr", "pdf"]})) == {
        ocr["entryDid"],
        pdf["entryDid"],
    }
    assert set(await dids(harness, {"anyTags": [tag, other]})) == {
        ocr["entryDid"],
        pdf["entryDid"],
        elsewhere["entryDid"],
        csv["entryDid"],
    }
    assert await dids(harness, {"tags": [tag], "anyTags": ["nope"]}) == []


async def test_publisher_did(harness: Harness) -> None:
    alice = await publisher(harness)
    bob = await publisher(harness)
    tag = scope()
    mine = [await alice.publish(tags=[tag]) for _ in range(2)]
    theirs = await bob.publish(tags=[tag])
    assert set(await dids(harness, {"tags": [tag], "publisherDid": alice.did})) == {
        e["entryDid"] for e in mine
    }
    assert await dids(harness, {"publisherDid": bob.did}) == [theirs["entryDid"]]
    stranger = SigningKey.generate().did
    assert await dids(harness, {"publisherDid": stranger}) == []


async def test_lifecycle_default_hides_revoked_and_deleted_never_appear(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    draft = await pub.publish(tags=[tag])
    active = await pub.publish(tags=[tag], lifecycleStatus="active")
    deprecated = await pub.update(
        await pub.publish(tags=[tag], lifecycleStatus="active"), lifecycleStatus="deprecated"
    )
    revoked = await pub.update(
        await pub.publish(tags=[tag], lifecycleStatus="active"), lifecycleStatus="revoked"
    )
    deleted = await pub.publish(tags=[tag, "gone"], lifecycleStatus="active", name="Tombstoned")
    await pub.delete(deleted)
    d, a, dep, rev = (e["entryDid"] for e in (draft, active, deprecated, revoked))

    result = await discover(harness, {"tags": [tag]})
    assert {e["entryDid"] for e in result["entries"]} == {d, a, dep}
    assert result["totalCount"] == 3
    assert {e["lifecycleStatus"] for e in result["entries"] if "lifecycleStatus" in e} <= {
        "active",
        "deprecated",
    }

    def by_status(*statuses: str) -> dict:
        return {"tags": [tag], "lifecycleStatus": list(statuses)}

    assert await dids(harness, by_status("revoked")) == [rev]
    assert await dids(harness, by_status("draft")) == [d]
    assert await dids(harness, by_status("active")) == [a]
    assert set(await dids(harness, by_status("active", "deprecated"))) == {a, dep}
    every = await discover(harness, by_status("draft", "active", "deprecated", "revoked"))
    assert {e["entryDid"] for e in every["entries"]} == {d, a, dep, rev}
    assert every["totalCount"] == 4
    # The tombstone is never listed, whatever the filter.
    every_status = ["draft", "active", "deprecated", "revoked"]
    for body in (
        {"tags": [tag, "gone"]},
        {"tags": [tag, "gone"], "lifecycleStatus": every_status},
        {"tags": [tag], "text": "tombstoned", "lifecycleStatus": every_status},
        {"tags": [tag], "orderBy": "name", "lifecycleStatus": every_status},
    ):
        result = await discover(harness, body)
        assert deleted["entryDid"] not in [e["entryDid"] for e in result["entries"]], body
        assert result["totalCount"] == len(result["entries"]), body


async def test_service_type(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()

    def endpoints(*types: str) -> list[dict]:
        return [
            {"id": f"e{i}", "type": t, "url": f"https://x.example/{i}"} for i, t in enumerate(types)
        ]

    mcp = await pub.publish(tags=[tag], serviceEndpoints=endpoints("MCP"))
    both = await pub.publish(tags=[tag], serviceEndpoints=endpoints("A2A", "MCP"))
    await pub.publish(tags=[tag])
    assert set(await dids(harness, {"tags": [tag], "serviceType": "MCP"})) == {
        mcp["entryDid"],
        both["entryDid"],
    }
    assert await dids(harness, {"tags": [tag], "serviceType": "A2A"}) == [both["entryDid"]]
    assert await dids(harness, {"tags": [tag], "serviceType": "a2a"}) == []
    assert await dids(harness, {"tags": [tag], "serviceType": "HTTP"}) == []


async def test_relationship_matches_type_and_target_on_the_same_element(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    x, y = "did:web:models.example:x", "did:web:models.example:y"
    same = await pub.publish(
        tags=[tag], relationships=[{"relationshipType": "dependsOn", "targetDid": x}]
    )
    split = await pub.publish(
        tags=[tag],
        relationships=[
            {"relationshipType": "dependsOn", "targetDid": y},
            {"relationshipType": "extends", "targetDid": x, "label": "base"},
        ],
    )
    await pub.publish(tags=[tag])

    def rel(**fields: str) -> dict:
        return {"tags": [tag], "relationship": fields}

    assert await dids(harness, rel(relationshipType="dependsOn", targetDid=x)) == [same["entryDid"]]
    assert await dids(harness, rel(relationshipType="extends", targetDid=x)) == [split["entryDid"]]
    assert await dids(harness, rel(relationshipType="extends", targetDid=y)) == []
    assert set(await dids(harness, rel(targetDid=x))) == {same["entryDid"], split["entryDid"]}
    assert await dids(harness, rel(targetDid=y)) == [split["entryDid"]]
    assert set(await dids(harness, rel(relationshipType="dependsOn"))) == {
        same["entryDid"],
        split["entryDid"],
    }
    assert await dids(harness, rel(relationshipType="supersedes")) == []
    # An empty relationship object asks for nothing.
    assert len(await dids(harness, rel())) == 3


async def test_metadata_key_equals_value_of_each_scalar_type(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    a = await pub.publish(
        tags=[tag],
        customMetadata={"team": "finance", "gpu": True, "tokens": 8192, "t": 0.5, "owner": None},
    )
    b = await pub.publish(
        tags=[tag], customMetadata={"team": "legal", "gpu": False, "tokens": "8192", "t": 0.25}
    )
    await pub.publish(tags=[tag])

    async def match(metadata: dict) -> list[str]:
        return await dids(harness, {"tags": [tag], "metadata": metadata})

    assert await match({"team": "finance"}) == [a["entryDid"]]
    assert await match({"team": "legal"}) == [b["entryDid"]]
    assert await match({"gpu": True}) == [a["entryDid"]]
    assert await match({"gpu": False}) == [b["entryDid"]]
    assert await match({"tokens": 8192}) == [a["entryDid"]]  # the number, not the string
    assert await match({"tokens": "8192"}) == [b["entryDid"]]
    assert await match({"t": 0.5}) == [a["entryDid"]]
    assert await match({"tokens": 8192.0}) == [a["entryDid"]]  # JSON numbers: 8192 == 8192.0
    assert await match({"owner": None}) == [a["entryDid"]]  # a member that is JSON null
    assert await match({"team": "finance", "gpu": True, "tokens": 8192}) == [a["entryDid"]]
    assert await match({"team": "finance", "gpu": False}) == []  # every pair must hold
    assert await match({"gpu": "true"}) == []
    assert await match({"missing": "x"}) == []
    assert await match({"team": "Finance"}) == []


async def test_published_after_and_before_are_exclusive(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    times = ["2025-01-01T00:00:00Z", "2025-06-01T00:00:00Z", "2026-01-01T00:00:00Z"]
    old, mid, new = [await pub.publish(tags=[tag], publishedAt=t) for t in times]

    async def window(**bounds: str) -> set[str]:
        return set(await dids(harness, {"tags": [tag], **bounds}))

    assert await window(publishedAfter="2025-06-01T00:00:00Z") == {new["entryDid"]}
    assert await window(publishedAfter="2025-05-31T23:59:59Z") == {
        mid["entryDid"],
        new["entryDid"],
    }
    assert await window(publishedBefore="2025-06-01T00:00:00Z") == {old["entryDid"]}
    assert await window(
        publishedAfter="2025-01-01T00:00:00Z", publishedBefore="2026-01-01T00:00:00Z"
    ) == {mid["entryDid"]}
    # Offsets are instants: 02:00+02:00 is midnight UTC.
    assert await window(publishedBefore="2025-06-01T02:00:00.001+02:00") == {
        old["entryDid"],
        mid["entryDid"],
    }
    assert await window(publishedAfter="2027-01-01T00:00:00Z") == set()


async def test_updated_after_and_before(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    first = await pub.publish(tags=[tag])
    await trio.sleep(0.02)
    second = await pub.publish(tags=[tag])
    await trio.sleep(0.02)
    third = await pub.publish(tags=[tag])
    assert instant(first["updatedAt"]) < instant(second["updatedAt"]) < instant(third["updatedAt"])

    async def window(**bounds: str) -> set[str]:
        return set(await dids(harness, {"tags": [tag], **bounds}))

    assert await window(updatedAfter=first["updatedAt"]) == {
        second["entryDid"],
        third["entryDid"],
    }
    assert await window(updatedBefore=third["updatedAt"]) == {
        first["entryDid"],
        second["entryDid"],
    }
    assert await window(updatedAfter=first["updatedAt"], updatedBefore=third["updatedAt"]) == {
        second["entryDid"]
    }
    # An update moves updatedAt, not publishedAt.
    await trio.sleep(0.02)
    changed = await pub.update(first, description="changed")
    assert await window(updatedAfter=third["updatedAt"]) == {changed["entryDid"]}
    assert changed["publishedAt"] == first["publishedAt"]


async def test_all_filters_together(harness: Harness) -> None:
    pub = await publisher(harness)
    other = await publisher(harness)
    tag = scope()
    fields: dict[str, Any] = {
        "tags": [tag, "ocr"],
        "name": "Invoice summarizer",
        "lifecycleStatus": "active",
        "serviceEndpoints": [{"id": "e", "type": "MCP", "url": "https://x.example/a"}],
        "customMetadata": {"team": "finance"},
        "relationships": [{"relationshipType": "dependsOn", "targetDid": "did:web:x"}],
        "publishedAt": "2026-03-01T00:00:00Z",
    }
    hit = await pub.publish(**fields)
    misses = [
        await pub.publish(**{**fields, "tags": [tag]}),
        await pub.publish(**{**fields, "name": "Translator"}),
        await pub.publish(**{**fields, "lifecycleStatus": "draft"}),
        await pub.publish(**{**fields, "serviceEndpoints": None}),
        await pub.publish(**{**fields, "customMetadata": {"team": "legal"}}),
        await pub.publish(**{**fields, "relationships": None}),
        await pub.publish(**{**fields, "publishedAt": "2026-05-01T00:00:00Z"}),
        await pub.publish(**{**fields, "entryType": "Tool"}),
        await other.publish(**fields),
    ]
    body = {
        "entryType": "AgentDefinition",
        "text": "summarize",
        "tags": [tag],
        "anyTags": ["ocr", "pdf"],
        "publisherDid": pub.did,
        "lifecycleStatus": ["active"],
        "serviceType": "MCP",
        "relationship": {"relationshipType": "dependsOn", "targetDid": "did:web:x"},
        "metadata": {"team": "finance"},
        "publishedAfter": "2026-02-01T00:00:00Z",
        "publishedBefore": "2026-04-01T00:00:00Z",
        "updatedAfter": "2020-01-01T00:00:00Z",
        "updatedBefore": "2100-01-01T00:00:00Z",
        "orderBy": "publishedAt",
        "order": "asc",
        "limit": 5,
    }
    result = await discover(harness, body)
    assert [e["entryDid"] for e in result["entries"]] == [hit["entryDid"]]
    assert result["totalCount"] == 1
    assert len(misses) == 9


# --- ordering --------------------------------------------------------------------------------


async def _ordering_fixture(h: Harness) -> tuple[str, list[dict]]:
    """Entries with ties on publishedAt and on name, and distinct updatedAt."""
    pub = await publisher(h)
    tag = scope()
    specs = [
        ("beta", "2026-01-02T00:00:00Z"),
        ("Alpha", "2026-01-01T00:00:00Z"),
        ("alpha", "2026-01-02T00:00:00Z"),
        ("_under", "2026-01-03T00:00:00Z"),
        ("beta", "2026-01-02T01:00:00+01:00"),  # the same instant as 00:00Z
        ("émigré", "2025-12-31T23:59:59.999Z"),
        ("beta", "2026-01-03T00:00:00Z"),
    ]
    entries = []
    for name, published in specs:
        entries.append(await pub.publish(tags=[tag], name=name, publishedAt=published))
        await trio.sleep(0.005)
    return tag, entries


async def test_every_order_by_in_both_directions(harness: Harness) -> None:
    tag, entries = await _ordering_fixture(harness)
    keys = {
        "publishedAt": lambda e: instant(e["publishedAt"]),
        "updatedAt": lambda e: instant(e["updatedAt"]),
        "name": lambda e: e["name"],  # code point order
        "sequence": lambda e: e["sequence"],
    }
    for field, key in keys.items():
        for order in ("asc", "desc"):
            body = {"tags": [tag], "orderBy": field, "order": order}
            expected = sorted_dids(entries, key, descending=order == "desc")
            assert await dids(harness, body) == expected, (field, order)
            # The same order, page by page through the ties.
            for limit in (1, 2, 3):
                pages = await page_all(harness, {**body, "limit": limit})
                assert flat_dids(pages) == expected, (field, order, limit)
                assert all(len(p) == limit for p in pages[:-1])


async def test_order_by_default_directions(harness: Harness) -> None:
    tag, entries = await _ordering_fixture(harness)
    # Every key but name defaults to descending; name to ascending.
    for field in ("publishedAt", "updatedAt", "sequence"):
        explicit = await dids(harness, {"tags": [tag], "orderBy": field, "order": "desc"})
        assert await dids(harness, {"tags": [tag], "orderBy": field}) == explicit, field
    by_name = await dids(harness, {"tags": [tag], "orderBy": "name"})
    assert by_name == await dids(harness, {"tags": [tag], "orderBy": "name", "order": "asc"})
    assert by_name == sorted_dids(entries, lambda e: e["name"], descending=False)
    # No orderBy: sequence descending (the newest change first).
    assert await dids(harness, {"tags": [tag]}) == sorted_dids(
        entries, lambda e: e["sequence"], descending=True
    )


async def test_published_at_ties_break_by_entry_did_in_the_order_direction(
    harness: Harness,
) -> None:
    pub = await publisher(harness)
    tag = scope()
    prefix = "did:web:ties.example:" + secrets.token_hex(4)
    # DIDs created out of order, all published at the same instant; they differ in case and
    # punctuation, so only code point order (not a linguistic collation) gives `expected`.
    suffixes = ["c", "a", "B", "a.b", "_z", "aB", "a-b", "b"]
    for s in suffixes:
        await pub.publish(f"{prefix}-{s}", tags=[tag], publishedAt="2026-02-02T00:00:00Z")
    expected = [f"{prefix}-{s}" for s in ["B", "_z", "a", "a-b", "a.b", "aB", "b", "c"]]
    assert expected == sorted(expected)
    body = {"tags": [tag], "orderBy": "publishedAt"}
    assert await dids(harness, {**body, "order": "asc"}) == expected
    assert await dids(harness, {**body, "order": "desc"}) == expected[::-1]
    assert await dids(harness, body) == expected[::-1]  # publishedAt defaults to desc
    for order, want in (("asc", expected), ("desc", expected[::-1])):
        for limit in (1, 3):
            pages = await page_all(harness, {**body, "order": order, "limit": limit})
            assert flat_dids(pages) == want, (order, limit)


async def test_an_update_moves_an_entry_in_sequence_order(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    a = await pub.publish(tags=[tag])
    b = await pub.publish(tags=[tag])
    assert await dids(harness, {"tags": [tag]}) == [b["entryDid"], a["entryDid"]]
    await pub.update(a, description="touched")
    assert await dids(harness, {"tags": [tag]}) == [a["entryDid"], b["entryDid"]]
    asc = await dids(harness, {"tags": [tag], "orderBy": "sequence", "order": "asc"})
    assert asc == [b["entryDid"], a["entryDid"]]


# --- limit -----------------------------------------------------------------------------------


async def publish_many(pub: Publisher, count: int, **fields: Any) -> list[dict]:
    """`count` entries published concurrently (a few at a time)."""
    out: list[dict] = []
    limiter = trio.CapacityLimiter(8)

    async def one() -> None:
        async with limiter:
            out.append(await pub.publish(**fields))

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    return out


async def test_limit_default_20_and_clamp_to_100(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    entries = await publish_many(pub, 105, tags=[tag])
    expected = sorted_dids(entries, lambda e: e["sequence"], descending=True)
    first = await discover(harness, {"tags": [tag]})
    assert len(first["entries"]) == 20
    assert first["hasMore"] is True
    assert first["totalCount"] == 105
    clamped = await discover(harness, {"tags": [tag], "limit": 1000})
    assert [e["entryDid"] for e in clamped["entries"]] == expected[:100]
    assert clamped["hasMore"] is True
    rest = await discover(harness, {"tags": [tag], "limit": 10**15, "cursor": clamped["cursor"]})
    assert [e["entryDid"] for e in rest["entries"]] == expected[100:]
    assert rest["hasMore"] is False
    assert "cursor" not in rest
    exact = await discover(harness, {"tags": [tag], "limit": 100})
    assert [e["entryDid"] for e in exact["entries"]] == expected[:100]
    pages = await page_all(harness, {"tags": [tag]})
    assert [len(p) for p in pages] == [20, 20, 20, 20, 20, 5]
    assert flat_dids(pages) == expected


async def test_limit_0_and_negative_are_400(harness: Harness) -> None:
    for limit in (0, -1, -100):
        error = await error_of(await post(harness, {"limit": limit}), 400, "invalid_limit")
        assert "limit" in error["message"]


async def test_limit_1_is_one_per_page(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    for _ in range(3):
        await pub.publish(tags=[tag])
    result = await discover(harness, {"tags": [tag], "limit": 1})
    assert len(result["entries"]) == 1
    assert result["hasMore"] is True
    assert result["totalCount"] == 3


# --- cursors ---------------------------------------------------------------------------------


async def test_cursor_pages_cover_the_result_once_and_the_last_page_has_no_cursor(
    harness: Harness,
) -> None:
    pub = await publisher(harness)
    tag = scope()
    entries = await publish_many(pub, 13, tags=[tag])
    expected = sorted_dids(entries, lambda e: e["sequence"], descending=True)
    body = {"tags": [tag], "limit": 5}
    first = await discover(harness, body)
    assert first["hasMore"] is True
    assert first["totalCount"] == 13
    cursor = first["cursor"]
    assert isinstance(cursor, str)
    assert cursor
    assert all(c.isalnum() or c in "-_" for c in cursor)  # URL-safe, opaque
    second = await discover(harness, {**body, "cursor": cursor})
    assert second["hasMore"] is True
    assert second["totalCount"] == 13  # the total of the whole query, on every page
    third = await discover(harness, {**body, "cursor": second["cursor"]})
    assert third["hasMore"] is False
    assert "cursor" not in third
    assert third["totalCount"] == 13
    got = [e["entryDid"] for r in (first, second, third) for e in r["entries"]]
    assert got == expected
    # A cursor can be used again: it is a position, not a server-side session.
    again = await discover(harness, {**body, "cursor": cursor})
    assert again["entries"] == second["entries"]
    # The page size may change between pages.
    wider = await discover(harness, {**body, "limit": 50, "cursor": cursor})
    assert [e["entryDid"] for e in wider["entries"]] == expected[5:]
    assert wider["hasMore"] is False


async def test_a_result_that_fills_the_last_page_exactly_has_no_cursor(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    await publish_many(pub, 4, tags=[tag])
    first = await discover(harness, {"tags": [tag], "limit": 2})
    assert first["hasMore"] is True
    second = await discover(harness, {"tags": [tag], "limit": 2, "cursor": first["cursor"]})
    assert len(second["entries"]) == 2
    assert second["hasMore"] is False
    assert "cursor" not in second
    whole = await discover(harness, {"tags": [tag], "limit": 4})
    assert whole["hasMore"] is False
    assert "cursor" not in whole


def _tampered(cursor: str) -> list[str]:
    """Variants of a cursor with one character changed, one dropped, one added."""
    mid = len(cursor) // 2
    swap = "A" if cursor[mid] != "A" else "B"
    return [
        cursor[:mid] + swap + cursor[mid + 1 :],
        cursor[:20] + ("x" if cursor[20] != "x" else "y") + cursor[21:],
        cursor[:-2] + ("Q" if cursor[-2] != "Q" else "R") + cursor[-1],
        cursor[:-1],
        cursor + "A",
        cursor[1:],
    ]


async def test_bad_or_tampered_cursor_is_400_invalid_cursor(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    await publish_many(pub, 3, tags=[tag])
    body = {"tags": [tag], "limit": 1}
    cursor = (await discover(harness, body))["cursor"]
    for bad in [*_tampered(cursor), "x", "AAAA", "not-a-cursor", "!!!", "eyJ2IjoxfQ", "0" * 2048]:
        r = await post(harness, {**body, "cursor": bad})
        await error_of(r, 400, "invalid_cursor")
    # Wrong JSON types and lengths are 400 too.
    for bad in (12, "", "A" * 2049, ["x"], {"k": 1}):
        r = await post(harness, {**body, "cursor": bad})
        assert r.status_code == 400, (bad, await r.get_data())


async def test_cursor_from_a_different_query_is_400(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    await publish_many(pub, 3, tags=[tag, "ocr"], name="Invoice reader")
    base: dict[str, Any] = {"tags": [tag], "limit": 1}
    cursor = (await discover(harness, base))["cursor"]
    others: list[dict[str, Any]] = [
        {"tags": [scope()]},
        {"tags": [tag, "ocr"]},
        {"tags": [tag], "entryType": "AgentDefinition"},
        {"tags": [tag], "text": "invoice"},
        {"tags": [tag], "orderBy": "name"},
        {"tags": [tag], "orderBy": "sequence", "order": "asc"},
        {"tags": [tag], "publisherDid": pub.did},
        {"tags": [tag], "metadata": {"a": 1}},
        {"tags": [tag], "lifecycleStatus": ["draft"]},
        {},
    ]
    for other in others:
        r = await post(harness, {**other, "limit": 1, "cursor": cursor})
        await error_of(r, 400, "invalid_cursor")
    # A different sort position shape (relevance has an extra key) is refused just the same.
    text_cursor = (await discover(harness, {"tags": [tag], "text": "invoice", "limit": 1}))[
        "cursor"
    ]
    r = await post(harness, {**base, "cursor": text_cursor})
    await error_of(r, 400, "invalid_cursor")
    # The same query with its paging fields changed is the same query.
    assert (await discover(harness, {**base, "limit": 7, "cursor": cursor}))["entries"]


async def test_cursor_of_another_registry_is_400(harness: Harness, tmp_path: Any) -> None:
    from tests.api.api_support import with_harness
    from tests.conftest import make_config

    pub = await publisher(harness)
    tag = scope()
    await publish_many(pub, 3, tags=[tag])
    body = {"tags": [tag], "limit": 1}
    cursor = (await discover(harness, body))["cursor"]
    config = make_config(harness.config.database.url, tmp_path / "other")

    async def other(h: Harness) -> None:
        # Same database, same query, but another registry key: not a cursor it issued.
        await error_of(await post(h, {**body, "cursor": cursor}), 400, "invalid_cursor")
        assert (await discover(h, body))["totalCount"] == 3

    await with_harness(config, other)


class Inserter:
    """Publishes entries one after another until stopped or `limit` are in; `landed()` waits
    for the next one (or returns at once when no more will come). Bounded, so that a pager
    reading after the insertion point (ascending sequence) always reaches the end."""

    def __init__(self, writer: Publisher, fields: Any, limit: int = 25) -> None:
        self.writer = writer
        self.fields = fields
        self.limit = limit
        self.inserted: list[dict] = []
        self.stopped = False
        self._landed = trio.Event()

    async def run(self) -> None:
        while not self.stopped and len(self.inserted) < self.limit:
            self.inserted.append(await self.writer.publish(**self.fields()))
            self._landed.set()
            await trio.lowlevel.checkpoint()
        self._landed.set()

    async def landed(self) -> None:
        if len(self.inserted) >= self.limit:
            return
        self._landed = trio.Event()
        await self._landed.wait()


async def test_paging_by_cursor_while_entries_are_inserted(harness: Harness) -> None:
    """Entries present throughout paging appear exactly once, whatever is inserted meanwhile
    and wherever the new entries sort (before or after the cursor)."""
    pub = await publisher(harness)
    writer = await publisher(harness)
    tag = scope()

    def fields() -> dict[str, Any]:
        words = ["invoice", "reader", "ocr", "ledger", "receipt"]
        return {
            "tags": [tag],
            "name": secrets.token_hex(3),
            "description": " ".join(secrets.choice(words) for _ in range(6)) + " invoice",
            "publishedAt": f"2026-0{secrets.randbelow(9) + 1}-1{secrets.randbelow(9)}T00:00:00Z",
        }

    present = {(await pub.publish(**fields()))["entryDid"] for _ in range(30)}
    orderings: list[dict[str, Any]] = [
        {},
        {"orderBy": "name"},
        {"orderBy": "name", "order": "desc"},
        {"orderBy": "publishedAt"},
        {"orderBy": "publishedAt", "order": "asc"},
        {"orderBy": "updatedAt", "order": "asc"},
        {"orderBy": "sequence", "order": "asc"},
        {"text": "invoice"},  # relevance, with many ties
        {"text": "invoice", "orderBy": "relevance", "order": "asc"},
    ]
    with trio.fail_after(120):
        for ordering in orderings:
            body = {"tags": [tag], "limit": 4, **ordering}
            inserter = Inserter(writer, fields)
            seen: list[str] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(inserter.run)
                request = dict(body)
                while True:
                    await inserter.landed()  # at least one insert between every two pages
                    result = await discover(harness, request)
                    seen.extend(e["entryDid"] for e in result["entries"])
                    assert all(tag in e["tags"] for e in result["entries"])
                    assert result["totalCount"] >= len(present)
                    if not result["hasMore"]:
                        break
                    request = {**body, "cursor": result["cursor"]}
                inserter.stopped = True
            inserted = {e["entryDid"] for e in inserter.inserted}
            assert inserted, ordering
            assert len(seen) == len(set(seen)), ordering  # no duplicates
            assert present <= set(seen), (ordering, present - set(seen))  # no gaps
            assert set(seen) <= present | inserted
            present |= inserted  # present throughout the paging of the next ordering


async def test_an_entry_updated_during_paging_moves_to_its_new_position(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    entries = {}
    for i in range(9):
        entries[i] = await pub.publish(tags=[tag], name=f"n{i}")
    body = {"tags": [tag], "orderBy": "name", "limit": 3}
    first = await discover(harness, body)
    assert [e["name"] for e in first["entries"]] == ["n0", "n1", "n2"]
    # n1 (already seen) moves to the end; n5 (not yet seen) moves before the cursor.
    moved_back = await pub.update(entries[1], name="n9")
    await pub.update(entries[5], name="m5")
    rest: list[dict] = []
    cursor = first["cursor"]
    while cursor:
        result = await discover(harness, {**body, "cursor": cursor})
        rest.extend(result["entries"])
        cursor = result.get("cursor")
    assert [e["name"] for e in rest] == ["n3", "n4", "n6", "n7", "n8", "n9"]
    assert rest[-1] == moved_back
    # Every entry that did not change was listed exactly once.
    names = [e["name"] for e in first["entries"] + rest]
    for unchanged in ("n0", "n2", "n3", "n4", "n6", "n7", "n8"):
        assert names.count(unchanged) == 1


# --- offset ----------------------------------------------------------------------------------


async def test_offset_paging(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    entries = await publish_many(pub, 12, tags=[tag])
    expected = sorted_dids(entries, lambda e: e["sequence"], descending=True)
    body = {"tags": [tag], "limit": 5}
    pages = []
    for offset in (0, 5, 10):
        result = await discover(harness, {**body, "offset": offset})
        assert result["totalCount"] == 12
        pages.append(result)
    assert [e["entryDid"] for p in pages for e in p["entries"]] == expected
    assert [p["hasMore"] for p in pages] == [True, True, False]
    assert "cursor" not in pages[2]
    assert await dids(harness, {**body, "offset": 3}) == expected[3:8]
    assert await dids(harness, {"tags": [tag], "offset": 11}) == expected[11:]
    beyond = await discover(harness, {**body, "offset": 12})
    assert beyond == {"entries": [], "hasMore": False, "totalCount": 12}
    assert (await discover(harness, {**body, "offset": 10_000}))["entries"] == []
    # The cursor of an offset page continues after it (without the offset).
    cursor = pages[1]["cursor"]
    assert await dids(harness, {**body, "cursor": cursor}) == expected[10:]
    # Offset with an ordering.
    by_name = sorted_dids(entries, lambda e: e["name"], descending=False)
    assert await dids(harness, {**body, "orderBy": "name", "offset": 4}) == by_name[4:9]


async def test_offset_bounds_and_offset_with_cursor_are_400(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    await publish_many(pub, 3, tags=[tag])
    for offset in (10_001, 10**9, -1):
        r = await post(harness, {"tags": [tag], "offset": offset})
        error = await error_of(r, 400, "invalid_query")
        assert "offset" in error["message"]
    for offset in ("5", 1.5, True, [1]):
        r = await post(harness, {"tags": [tag], "offset": offset})
        assert r.status_code == 400, offset
    cursor = (await discover(harness, {"tags": [tag], "limit": 1}))["cursor"]
    r = await post(harness, {"tags": [tag], "limit": 1, "offset": 1, "cursor": cursor})
    await error_of(r, 400, "invalid_cursor")


async def test_a_repeated_query_is_answered_from_the_cache_until_a_change_commits(
    harness: Harness,
) -> None:
    """`X-Cache` says where a page came from; a write clears the cache at once, so the next
    answer is recomputed and shows it, on both discovery endpoints (the same query in either
    form is one cache entry, so the RegistryQL one here orders differently)."""
    pub = await publisher(harness)
    tag = scope()
    await pub.publish(tags=[tag])
    for path, body in (
        ("/v1/discover", {"tags": [tag]}),
        (
            "/v1/discover/registryql",
            {"query": f"DISCOVER * WHERE tags CONTAINS '{tag}' ORDER BY name"},
        ),
    ):
        first = await post(harness, body, path)
        second = await post(harness, body, path)
        assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("miss", "hit")
        assert await first.get_data() == await second.get_data()
    await pub.publish(tags=[tag])
    for path, body in (
        ("/v1/discover", {"tags": [tag]}),
        (
            "/v1/discover/registryql",
            {"query": f"DISCOVER * WHERE tags CONTAINS '{tag}' ORDER BY name"},
        ),
    ):
        after = await post(harness, body, path)
        assert after.headers["X-Cache"] == "miss"
        assert json.loads(await after.get_data())["totalCount"] == 2


async def test_a_page_ends_early_once_its_documents_hold_the_page_byte_budget(
    database_url: str, tmp_path: Path
) -> None:
    """Entries may be up to 1 MiB each: a page of 100 would be 100 MiB. A page ends (with
    hasMore and a cursor) once its documents hold `limits.discover_page_bytes`; the first match
    always comes, so paging goes on, and every match is served once, in order."""
    config = make_config(database_url, tmp_path, limits={"discover_page_bytes": 6000})

    async def body(h: Harness) -> None:
        key = SigningKey.generate()
        token = await sign_in(h.client, key)
        tag = f"heavy-{secrets.token_hex(4)}"
        made = [
            await create(h, key, token, tags=[tag], description=f"{i} " + "x" * 2500)
            for i in range(5)
        ]
        query: dict[str, Any] = {"tags": [tag], "limit": 100, "orderBy": "sequence"}
        seen: list[dict[str, Any]] = []
        pages: list[list[int]] = []  # the size of each document, page by page
        while True:
            page = await discover(h, query)
            pages.append([len(compact(e)) for e in page["entries"]])
            seen.extend(page["entries"])
            if not page["hasMore"]:
                break
            query["cursor"] = page["cursor"]
        assert len(pages) > 1
        for sizes in pages:
            assert sum(sizes[:-1]) < 6000  # each document came while the page held less
        for sizes in pages[:-1]:
            assert sum(sizes) >= 6000  # and a page ended only once it held the budget
        assert sorted(e["entryDid"] for e in seen) == sorted(e["entryDid"] for e in made)
        assert len(seen) == len(made)

    await with_harness(config, body)


def compact(entry: dict[str, Any]) -> str:
    return json.dumps(entry, separators=(",", ":"), ensure_ascii=False)


async def test_an_altered_spelling_of_a_cursor_is_400(harness: Harness) -> None:
    pub = await publisher(harness)
    tag = scope()
    for _ in range(3):
        await pub.publish(tags=[tag])
    cursor = (await discover(harness, {"tags": [tag], "limit": 1}))["cursor"]
    r = await post(
        harness, {"tags": [tag], "limit": 1, "cursor": cursor[:10] + "!!!!" + cursor[10:]}
    )
    await error_of(r, 400, "invalid_cursor")
    r = await post(harness, {"tags": [tag], "limit": 1, "cursor": cursor})
    assert r.status_code == 200


async def test_a_page_ending_on_a_long_name_or_did_gives_a_cursor_that_pages_on(
    harness: Harness,
) -> None:
    """A cursor holds the last entry's sort values: a name of 256 non-ASCII characters (each a
    JSON \\u escape) or a DID of ~1,500 characters made one of more than 2,048 characters, which
    the next request refused as too long (400 invalid_query): paging stopped there."""
    pub = await publisher(harness)
    by_name, by_did = scope(), scope()
    for i in range(3):
        await pub.publish(name=f"{i}" + "語" * 255, tags=[by_name])
        await pub.publish("did:web:agents.example.com:" + "a" * 1490 + str(i), tags=[by_did])
    for tag, order in ((by_name, "name"), (by_did, "publishedAt")):
        body = {"tags": [tag], "orderBy": order, "limit": 1}
        first = await discover(harness, body)
        assert len(first["cursor"]) > 2048
        pages = await page_all(harness, body)
        assert len(flat_dids(pages)) == len(set(flat_dids(pages))) == 3
        rql = f"DISCOVER * WHERE tags CONTAINS '{tag}' ORDER BY {order} LIMIT 1"
        if order == "publishedAt":
            rql = rql.replace("publishedAt", "publishedAt DESC")
        second = await discover(
            harness, {"query": rql, "cursor": first["cursor"]}, "/v1/discover/registryql"
        )
        assert [e["entryDid"] for e in second["entries"]] == flat_dids(pages)[1:2]
