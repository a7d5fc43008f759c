"""The sans-IO federation rules: what a synced entry must be, and the federated merge."""

from __future__ import annotations

import json
from typing import Any

import pytest

from registry.canonical import canonicalize
from registry.errors import Invalid
from registry.federation import SourcePage, check_replica, merge_pages, sort_entries
from registry.keys import SigningKey
from registry.query import OrderKey
from tests.helpers import signed_entry

KEY = SigningKey(bytes([3] * 32))


def served(seq: int, **fields: Any) -> dict[str, Any]:
    """An entry as an origin serves it: signed, with its registry-managed members."""
    entry = signed_entry(KEY, **fields)
    entry.update(sequence=seq, anchorState="unanchored", updatedAt="2026-11-24T00:00:00.000Z")
    return entry


def test_a_served_entry_is_kept_byte_exact_as_jcs() -> None:
    entry = served(7)
    replica = check_replica(entry)
    assert (replica.seq, replica.entry_did, replica.lifecycle) == (7, entry["entryDid"], "draft")
    assert replica.doc == canonicalize(entry).decode("utf-8")


def test_a_peers_entries_from_before_the_key_id_rule_and_with_long_dids_are_kept() -> None:
    """What an origin accepted before 2026-11-29, a replica takes: a bare did:key as keyId
    (the DID names the same key), and a DID of up to 2,048 characters (a new local entry's is
    held to 1,536, for an index replicas are not in)."""
    bare = served(4)
    bare["signature"]["keyId"] = KEY.did
    assert check_replica(bare).seq == 4
    long_did = served(5, entryDid="did:example:" + "a" * (2048 - len("did:example:")))
    assert check_replica(long_did).entry_did == long_did["entryDid"]
    forged = served(6)
    forged["signature"]["keyId"] = f"{KEY.did}#key-1"  # a fragment must still be the key
    with pytest.raises(Invalid) as info:
        check_replica(forged)
    assert info.value.code == "signature_key_invalid"


@pytest.mark.parametrize(
    ("change", "code"),
    [
        (lambda e: e.update(name="changed after signing"), "signature_invalid"),
        (lambda e: e["itemData"].update(extra=1), "item_data_hash_mismatch"),
        (lambda e: e.update(publisherDid=SigningKey.generate().did), "signature_key_mismatch"),
        (lambda e: e.pop("signature"), "entry_invalid"),
        (lambda e: e.update(signature="nope"), "entry_invalid"),
        (lambda e: e.pop("itemData"), "entry_invalid"),
        (lambda e: e.update(entryDid="not a did"), "entry_invalid"),
        (lambda e: e.update(lifecycleStatus="deleted"), "entry_invalid"),
        (lambda e: e["signature"].update(value=7), "entry_invalid"),
    ],
)
def test_a_served_entry_that_fails_is_refused_with_its_reason(change: Any, code: str) -> None:
    entry = served(3)
    change(entry)
    with pytest.raises(Invalid) as info:
        check_replica(entry)
    assert info.value.code == code


def test_one_bad_entry_is_quarantined_and_the_rest_of_the_page_kept() -> None:
    good, bad, tomb = (
        served(1),
        served(2),
        {
            "deletedAt": "2026-11-24T00:00:00.000Z",
            "entryDid": "did:web:gone.example",
            "lifecycleStatus": "deleted",
            "sequence": 3,
        },
    )
    bad["name"] = "forged"
    replicas, quarantined = sort_entries([good, bad, tomb])
    assert [(r.seq, r.lifecycle) for r in replicas] == [(1, "draft"), (3, "deleted")]
    [q] = quarantined
    assert (q.seq, q.entry_did, q.code) == (2, bad["entryDid"], "signature_invalid")
    assert json.loads(q.doc)["name"] == "forged"


def page(origin: str, docs: list[dict[str, Any]], offset: int = 0) -> SourcePage:
    texts = tuple(canonicalize(d).decode("utf-8") for d in docs)
    return SourcePage(origin, texts, has_more=False, total=len(docs), offset=offset)


def doc(did: str, name: str = "", published: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"entryDid": did, "name": name}
    if published is not None:
        out["publishedAt"] = published
    return out


def test_the_merge_orders_by_the_field_then_entry_did_then_origin() -> None:
    order = OrderKey("name", False)
    a = page("did:key:a", [doc("did:x:1", "alpha"), doc("did:x:3", "gamma")])
    b = page("did:key:b", [doc("did:x:1", "alpha"), doc("did:x:2", "beta")])
    shown, consumed = merge_pages(order, [b, a], 3)
    assert [(json.loads(t)["entryDid"], o) for t, o in shown] == [
        ("did:x:1", "did:key:a"),
        ("did:x:1", "did:key:b"),
        ("did:x:2", "did:key:b"),
    ]
    assert consumed == {"did:key:a": 1, "did:key:b": 2}


def test_times_compare_across_offsets_and_descending_reverses_every_key() -> None:
    order = OrderKey("publishedAt", True)
    a = page("did:key:a", [doc("did:x:a", published="2026-01-01T02:00:00+02:00")])  # 00:00Z
    b = page("did:key:b", [doc("did:x:b", published="2026-01-01T01:00:00Z")])
    shown, _ = merge_pages(order, [a, b], 10)
    assert [o for _, o in shown] == ["did:key:b", "did:key:a"]


def test_relevance_interleaves_the_sources_by_rank() -> None:
    order = OrderKey("relevance", True)
    a = page("did:key:a", [doc("did:x:a1"), doc("did:x:a2")], offset=4)
    b = page("did:key:b", [doc("did:x:b1"), doc("did:x:b2")], offset=4)
    shown, consumed = merge_pages(order, [a, b], 3)
    assert [json.loads(t)["entryDid"] for t, _ in shown] == ["did:x:a1", "did:x:b1", "did:x:a2"]
    assert consumed == {"did:key:a": 2, "did:key:b": 1}


def test_a_source_whose_order_disagrees_is_consumed_only_as_a_prefix() -> None:
    """A source that does not return its page in the merge order (it sorts differently):
    only the prefix of its page that was shown counts as consumed, so the next page repeats
    nothing and skips nothing of it."""
    order = OrderKey("name", False)
    odd = page("did:key:odd", [doc("did:x:9", "zulu"), doc("did:x:1", "alpha")])
    shown, consumed = merge_pages(order, [odd], 1)
    assert consumed == {"did:key:odd": 0}
    assert shown == []


def test_a_page_out_of_the_merge_order_is_detected_and_missing_times_sort_as_postgresql() -> None:
    from registry.federation import in_merge_order

    order = OrderKey("publishedAt", True)
    # Descending, as PostgreSQL sorts it: an entry without publishedAt (NULL) comes first.
    sorted_page = page(
        "did:key:p",
        [
            doc("did:x:0"),
            doc("did:x:2", published="2026-02-01T00:00:00Z"),
            doc("did:x:1", published="2026-01-01T00:00:00Z"),
        ],
    )
    assert in_merge_order(order, sorted_page)
    shuffled = page("did:key:p", list(reversed([json.loads(t) for t in sorted_page.entries])))
    assert not in_merge_order(order, shuffled)
    assert in_merge_order(OrderKey("relevance", True), shuffled)  # ranks: any order is its own


def test_a_pull_imports_only_what_the_witnessed_checkpoint_covers() -> None:
    from registry.federation import SyncAnswer, within_checkpoint

    entries = tuple({"sequence": s} for s in (4, 6, 9))
    answer = SyncAnswer(entries, has_more=True, next_sequence=9, head=20)
    assert within_checkpoint(answer, 9, 3) is answer  # all inside the accepted tree
    cut = within_checkpoint(answer, 7, 3)
    assert [e["sequence"] for e in cut.entries] == [4, 6]
    assert cut.next_sequence == 7  # the next pull goes on after the tree's last record
    assert cut.has_more is False  # and waits for a newer checkpoint
    behind = within_checkpoint(answer, 2, 3)  # a cursor past the tree never goes back
    assert behind.entries == ()
    assert behind.next_sequence == 3
