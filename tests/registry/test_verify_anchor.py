"""`verify_anchor`: an anchor record re-checked from the documents alone."""

from __future__ import annotations

import copy
from typing import Any

from registry.anchoring import verify_anchor
from registry.canonical import item_data_hash
from registry.merkle import MerkleTree, leaf_hash


def _versions(n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        item = {"model": f"m-{i}", "n": i}
        out.append(
            {
                "entryDid": f"did:example:agent-{i}",
                "sequence": i + 1,
                "itemData": item,
                "itemDataHash": item_data_hash(item),
            }
        )
    return out


def _anchored(n: int, index: int) -> tuple[dict[str, Any], dict[str, Any], str]:
    versions = _versions(n)
    tree = MerkleTree(
        [leaf_hash(v["entryDid"], v["sequence"], v["itemDataHash"]) for v in versions]
    )
    version = versions[index]
    anchor = {
        "entryDid": version["entryDid"],
        "itemDataHash": version["itemDataHash"],
        "blockHeight": 7,
        "txHash": "ab" * 32,
        "anchorTime": "2026-11-23T00:00:00Z",
        "proof": tree.proof(index).to_json(),
    }
    return version, anchor, tree.root


def test_a_true_anchor_passes_every_check() -> None:
    for n, index in ((1, 0), (2, 1), (5, 4), (9, 3)):
        version, anchor, root = _anchored(n, index)
        result = verify_anchor(version, anchor, [root, "00" * 32])
        assert result.ok, result.problems
        assert result.checks == {"itemDataHash": True, "leaf": True, "path": True, "chain": True}


def test_without_chain_roots_the_chain_is_not_claimed_checked() -> None:
    version, anchor, _ = _anchored(3, 1)
    result = verify_anchor(version, anchor, None)
    assert result.ok
    assert "chain" not in result.checks


def test_each_lie_is_caught_by_its_check() -> None:
    version, anchor, root = _anchored(6, 2)
    changed_item = copy.deepcopy(version)
    changed_item["itemData"]["model"] = "other"
    assert not verify_anchor(changed_item, anchor, [root]).checks["itemDataHash"]
    other_sequence = {**version, "sequence": 99}
    assert not verify_anchor(other_sequence, anchor, [root]).checks["leaf"]
    bent = copy.deepcopy(anchor)
    bent["proof"]["path"][0]["direction"] = (
        "left" if bent["proof"]["path"][0]["direction"] == "right" else "right"
    )
    assert not verify_anchor(version, bent, [root]).checks["path"]
    assert not verify_anchor(version, anchor, ["00" * 32]).checks["chain"]
    broken = {**anchor, "proof": {"root": "xyz"}}
    result = verify_anchor(version, broken, [root])
    assert not result.ok
    assert result.checks["proof"] is False
