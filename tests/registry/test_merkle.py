"""Merkle trees and proofs for anchoring: the spec's 2.2 proof encoding, pinned independently.

Expected values are computed here with hashlib (and, for the literals, cross-checked with coreutils
`sha256sum`), never with the module under test: hex-string concatenation at every level, an odd
node promoted unchanged, leaf = hex SHA-256 of JCS({entryDid, sequence, itemDataHash}).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from registry.merkle import (
    MAX_PATH_LENGTH,
    NODE_BYTES,
    MerkleProof,
    MerkleTree,
    ProofNode,
    leaf_hash,
    node_hash,
    proof_from_slices,
    proof_offsets,
    verify_proof,
)

# --- an independent reference -------------------------------------------------------------------


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def leaves_of(count: int, salt: str = "") -> list[str]:
    return [sha(f"leaf {salt}{i}") for i in range(count)]


def reference_levels(leaves: list[str]) -> list[list[str]]:
    levels = [list(leaves)]
    while len(levels[-1]) > 1:
        below = levels[-1]
        above = []
        for i in range(0, len(below), 2):
            if i + 1 < len(below):
                above.append(sha(below[i] + below[i + 1]))
            else:
                above.append(below[i])  # odd node promoted
        levels.append(above)
    return levels


def reference_path(levels: list[list[str]], index: int) -> list[tuple[str, str]]:
    path = []
    for level in levels[:-1]:
        if index % 2 == 1:
            path.append((level[index - 1], "left"))
        elif index + 1 < len(level):
            path.append((level[index + 1], "right"))
        index //= 2
    return path


def flip(hex_digest: str, position: int, bit: int = 0) -> str:
    """Flip one bit of the hex digit at `position` (the result is still lowercase hex)."""
    digit = format(int(hex_digest[position], 16) ^ (1 << bit), "x")
    return hex_digest[:position] + digit + hex_digest[position + 1 :]


def with_path_node(proof: MerkleProof, at: int, node: ProofNode) -> MerkleProof:
    path = list(proof.path)
    path[at] = node
    return replace(proof, path=tuple(path))


def other(direction: str) -> Any:
    return "right" if direction == "left" else "left"


SIZES = [
    *range(1, 65),
    65,
    96,
    100,
    127,
    128,
    129,
    255,
    256,
    257,
    300,
    511,
    512,
    513,
    640,
    777,
    999,
    1000,
]


# --- hand-computed examples that pin the encoding -----------------------------------------------

A = hashlib.sha256(b"a").hexdigest()
B = hashlib.sha256(b"b").hexdigest()
C = hashlib.sha256(b"c").hexdigest()
D = hashlib.sha256(b"d").hexdigest()


def test_four_leaves_by_hand() -> None:
    ab = hashlib.sha256((A + B).encode("utf-8")).hexdigest()
    cd = hashlib.sha256((C + D).encode("utf-8")).hexdigest()
    root = hashlib.sha256((ab + cd).encode("utf-8")).hexdigest()
    # The same values from coreutils: printf %s "$A$B" | sha256sum, and so on.
    assert ab == "62af5c3cb8da3e4f25061e829ebeea5c7513c54949115b1acc225930a90154da"
    assert cd == "d3a0f1c792ccf7f1708d5422696263e35755a86917ea76ef9242bd4a8cf4891a"
    assert root == "58c89d709329eb37285837b042ab6ff72c7c8f74de0446b091b6a0131c102cfd"

    tree = MerkleTree([A, B, C, D])
    assert tree.root == root
    assert node_hash(A, B) == ab
    assert tree.proof(0) == MerkleProof(
        root=root, path=(ProofNode(B, "right"), ProofNode(cd, "right")), leaf_hash=A
    )
    assert tree.proof(1).path == (ProofNode(A, "left"), ProofNode(cd, "right"))
    assert tree.proof(2).path == (ProofNode(D, "right"), ProofNode(ab, "left"))
    assert tree.proof(3).to_json() == {
        "root": root,
        "path": [{"hash": C, "direction": "left"}, {"hash": ab, "direction": "left"}],
        "leafHash": D,
    }


def test_three_leaves_by_hand_promotes_the_odd_leaf() -> None:
    ab = hashlib.sha256((A + B).encode("utf-8")).hexdigest()
    root = hashlib.sha256((ab + C).encode("utf-8")).hexdigest()  # C is promoted, then paired
    assert root == "d71dc32fa2cd95be60b32dbb3e63009fa8064407ee19f457c92a09a5ff841a8a"

    tree = MerkleTree([A, B, C])
    assert tree.root == root
    assert tree.proof(0).path == (ProofNode(B, "right"), ProofNode(C, "right"))
    assert tree.proof(1).path == (ProofNode(A, "left"), ProofNode(C, "right"))
    assert tree.proof(2).path == (ProofNode(ab, "left"),)  # no node for the promoted level

    # Bitcoin-style duplication would pair C with itself: a different root, not ours.
    cc = hashlib.sha256((C + C).encode("utf-8")).hexdigest()
    assert tree.root != hashlib.sha256((ab + cc).encode("utf-8")).hexdigest()


def test_raw_digest_concatenation_gives_a_different_root() -> None:
    def raw(left: str, right: str) -> str:
        return hashlib.sha256(bytes.fromhex(left) + bytes.fromhex(right)).hexdigest()

    raw_root = raw(raw(A, B), raw(C, D))
    assert raw_root == "14ede5e8e97ad9372327728f5099b95604a39593cac3bd38a343ad76205213e7"
    assert MerkleTree([A, B, C, D]).root != raw_root
    assert MerkleTree([A, B, C]).root != raw(raw(A, B), C)
    assert node_hash(A, B) != raw(A, B)


def test_single_leaf_tree_is_the_leaf() -> None:
    tree = MerkleTree([A])
    assert tree.root == A
    assert tree.proof(0) == MerkleProof(root=A, path=(), leaf_hash=A)
    assert tree.proofs() == [tree.proof(0)]
    assert verify_proof(tree.proof(0), A)
    assert not verify_proof(tree.proof(0), B)


# --- leaf hashes --------------------------------------------------------------------------------


def test_leaf_hash_is_pinned() -> None:
    item = hashlib.sha256(b"{}").hexdigest()  # itemDataHash of the empty object
    jcs = (
        '{"entryDid":"did:example:123","itemDataHash":"'
        + item
        + '","sequence":7}'  # members sorted, no whitespace: RFC 8785
    )
    expected = hashlib.sha256(jcs.encode("utf-8")).hexdigest()
    assert expected == "d72e6beb1779f2a8fa7f9f7ff715ae5ae39a9f37e4c7e052fa9be2e5d14283f8"
    assert leaf_hash("did:example:123", 7, item) == expected


def test_leaf_hash_encodes_non_ascii_as_utf8() -> None:
    item = "0" * 64
    jcs = '{"entryDid":"did:example:caf\u00e9","itemDataHash":"' + item + '","sequence":1}'
    assert leaf_hash("did:example:café", 1, item) == hashlib.sha256(jcs.encode()).hexdigest()


def test_leaf_hash_separates_its_fields() -> None:
    item = sha("item")
    base = leaf_hash("did:example:1", 1, item)
    assert leaf_hash("did:example:1", 2, item) != base
    assert leaf_hash("did:example:2", 1, item) != base
    assert leaf_hash("did:example:1", 1, sha("other")) != base


@pytest.mark.parametrize(
    ("did", "sequence", "item", "message"),
    [
        ("", 1, "0" * 64, "entry_did"),
        (None, 1, "0" * 64, "entry_did"),
        ("did:example:1", True, "0" * 64, "sequence"),
        ("did:example:1", -1, "0" * 64, "sequence"),
        ("did:example:1", 2**53, "0" * 64, "sequence"),
        ("did:example:1", 1.0, "0" * 64, "sequence"),
        ("did:example:1", 1, "A" * 64, "item_data_hash"),
        ("did:example:1", 1, "0" * 63, "item_data_hash"),
        ("did:example:1", 1, "0" * 64 + "\n", "item_data_hash"),
    ],
)
def test_leaf_hash_rejects_bad_input(did: Any, sequence: Any, item: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        leaf_hash(did, sequence, item)


# --- trees of every shape -----------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_every_proof_verifies_and_matches_the_reference(size: int) -> None:
    leaves = leaves_of(size)
    tree = MerkleTree(leaves)
    levels = reference_levels(leaves)
    assert tree.root == levels[-1][0]
    assert len(tree) == size
    assert tree.leaves == tuple(leaves)

    proofs = tree.proofs()
    assert len(proofs) == size
    for index in range(size):
        proof = proofs[index]
        assert proof == tree.proof(index)
        assert proof.root == tree.root
        assert proof.leaf_hash == leaves[index]
        assert [(n.hash, n.direction) for n in proof.path] == reference_path(levels, index)
        assert verify_proof(proof)
        assert verify_proof(proof, leaves[index])
    # A proof for one leaf does not verify another.
    if size > 1:
        for index in range(size):
            proof = proofs[index]
            for other_index in {(index + 1) % size, (index + size // 2) % size} - {index}:
                assert not verify_proof(proof, leaves[other_index])
                assert not verify_proof(replace(proof, leaf_hash=leaves[other_index]))


def _mutations(proof: MerkleProof, positions: list[int]) -> list[tuple[str, MerkleProof]]:
    """Single-character mutations of the leaf, of each path hash, of the root, and swaps."""
    out = []
    for pos in positions:
        for bit in range(4):
            out.append(
                (f"leaf@{pos}/{bit}", replace(proof, leaf_hash=flip(proof.leaf_hash, pos, bit)))
            )
            out.append((f"root@{pos}/{bit}", replace(proof, root=flip(proof.root, pos, bit))))
            for at, node in enumerate(proof.path):
                changed = ProofNode(flip(node.hash, pos, bit), node.direction)
                out.append((f"path[{at}]@{pos}/{bit}", with_path_node(proof, at, changed)))
    for at, node in enumerate(proof.path):
        swapped = ProofNode(node.hash, other(node.direction))
        out.append((f"path[{at}] swapped", with_path_node(proof, at, swapped)))
    return out


@pytest.mark.parametrize("size", SIZES)
def test_any_single_change_breaks_the_proof(size: int) -> None:
    leaves = leaves_of(size, salt="m")
    tree = MerkleTree(leaves)
    proofs = tree.proofs()
    # Every leaf for small trees; first, last, middle and a spread for the larger ones.
    indexes = (
        range(size) if size <= 64 else sorted({0, 1, size // 2, size - 2, size - 1, size // 3})
    )
    for index in indexes:
        proof = proofs[index]
        positions = [0, 63, (7 * index) % 64]
        for label, mutated in _mutations(proof, positions):
            assert mutated != proof
            assert not verify_proof(mutated), (size, index, label)
            assert not verify_proof(mutated, leaves[index]), (size, index, label)


def test_every_hex_position_and_bit_matters() -> None:
    leaves = leaves_of(13, salt="x")
    tree = MerkleTree(leaves)
    for proof in tree.proofs():
        mutations = _mutations(proof, list(range(64)))
        assert len(mutations) == 64 * 4 * (2 + len(proof.path)) + len(proof.path)
        assert not any(verify_proof(mutated) for _, mutated in mutations)


def test_dropping_adding_or_reordering_path_nodes_fails() -> None:
    leaves = leaves_of(37, salt="p")
    tree = MerkleTree(leaves)
    for proof in tree.proofs():
        path = proof.path
        for at in range(len(path)):
            assert not verify_proof(replace(proof, path=path[:at] + path[at + 1 :]))
        assert not verify_proof(replace(proof, path=(*path, ProofNode(A, "left"))))
        if len(path) > 1:
            assert not verify_proof(replace(proof, path=path[::-1]))


def test_no_two_leaf_lists_share_a_root() -> None:
    leaves = leaves_of(300, salt="r")
    roots = [MerkleTree(leaves[:k]).root for k in range(1, len(leaves) + 1)]
    assert len(set(roots)) == len(roots)
    # The CVE-2012-2459 shape: repeating the last leaf of an odd level must change the root.
    for k in (3, 5, 7, 9, 11, 13, 99):
        assert MerkleTree(leaves[:k]).root != MerkleTree([*leaves[:k], leaves[k - 1]]).root
    assert MerkleTree([A, B, C]).root != MerkleTree([A, B, C, C]).root
    # Order matters.
    assert MerkleTree([A, B]).root != MerkleTree([B, A]).root


@settings(max_examples=60, deadline=None)
@given(
    raw_leaves=st.lists(st.binary(max_size=8), min_size=1, max_size=1000, unique=True),
    pick=st.integers(min_value=0),
    target=st.sampled_from(["leaf", "root", "path", "swap"]),
    position=st.integers(min_value=0, max_value=63),
    bit=st.integers(min_value=0, max_value=3),
)
def test_random_trees(
    raw_leaves: list[bytes], pick: int, target: str, position: int, bit: int
) -> None:
    leaves = [hashlib.sha256(raw).hexdigest() for raw in raw_leaves]
    tree = MerkleTree(leaves)
    assert tree.root == reference_levels(leaves)[-1][0]
    proofs = tree.proofs()
    assert all(verify_proof(p, leaf) for p, leaf in zip(proofs, leaves, strict=True))
    index = pick % len(leaves)
    proof = proofs[index]
    assert proof == tree.proof(index)
    if target == "leaf":
        mutated = replace(proof, leaf_hash=flip(proof.leaf_hash, position, bit))
    elif target == "root":
        mutated = replace(proof, root=flip(proof.root, position, bit))
    elif not proof.path:
        return
    else:
        at = pick % len(proof.path)
        node = proof.path[at]
        if target == "path":
            node = ProofNode(flip(node.hash, position, bit), node.direction)
        else:
            node = ProofNode(node.hash, other(node.direction))
        mutated = with_path_node(proof, at, node)
    assert not verify_proof(mutated)


def test_tree_rejects_bad_leaves() -> None:
    with pytest.raises(ValueError, match="at least one leaf"):
        MerkleTree([])
    with pytest.raises(ValueError, match="leaf 1 must be a lowercase hex SHA-256"):
        MerkleTree([A, B.upper()])
    with pytest.raises(ValueError, match="leaf 0"):
        MerkleTree(["0" * 63])
    with pytest.raises(ValueError, match="leaf 0"):
        MerkleTree([b"0" * 64])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        MerkleTree(A)


def test_proof_index_bounds() -> None:
    tree = MerkleTree([A, B, C])
    assert tree.proof(-1) == tree.proof(2)
    with pytest.raises(IndexError):
        tree.proof(3)
    with pytest.raises(IndexError):
        tree.proof(-4)
    with pytest.raises(TypeError):
        tree.proof(True)


# --- verify_proof on malformed proofs -----------------------------------------------------------


def test_verify_returns_false_on_malformed_proofs() -> None:
    proof = MerkleTree([A, B, C, D]).proof(1)
    assert verify_proof(proof)
    assert not verify_proof(replace(proof, root=proof.root.upper()))
    assert not verify_proof(replace(proof, leaf_hash=proof.leaf_hash.upper()), B.upper())
    bad_direction = ProofNode(proof.path[0].hash, "up")  # type: ignore[arg-type]
    assert not verify_proof(with_path_node(proof, 0, bad_direction))
    # A single-leaf "tree" of garbage must not verify just because root == leafHash.
    assert not verify_proof(MerkleProof(root="zz", path=(), leaf_hash="zz"))
    overlong = MerkleProof(
        root=A, path=(ProofNode(B, "left"),) * (MAX_PATH_LENGTH + 1), leaf_hash=A
    )
    assert not verify_proof(overlong)


# --- the wire form ------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 17, 64, 100])
def test_json_round_trip(size: int) -> None:
    for proof in MerkleTree(leaves_of(size, salt="j")).proofs():
        wire = proof.to_json()
        assert set(wire) == {"root", "path", "leafHash"}
        assert all(set(node) == {"hash", "direction"} for node in wire["path"])
        text = json.dumps(wire)
        again = MerkleProof.from_json(json.loads(text))
        assert again == proof
        assert verify_proof(again)
        assert again.to_json() == wire


def _valid_wire() -> dict[str, Any]:
    return MerkleTree([A, B, C]).proof(0).to_json()


def _set(wire: dict[str, Any], pointer: tuple[Any, ...], value: Any) -> dict[str, Any]:
    target: Any = wire
    for key in pointer[:-1]:
        target = target[key]
    target[pointer[-1]] = value
    return wire


def _drop(wire: dict[str, Any], pointer: tuple[Any, ...]) -> dict[str, Any]:
    target: Any = wire
    for key in pointer[:-1]:
        target = target[key]
    del target[pointer[-1]]
    return wire


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda w: [w], r"MerkleProof must be a JSON object, got list"),
        (lambda w: json.dumps(w), r"MerkleProof must be a JSON object, got string"),
        (lambda w: _drop(w, ("root",)), r"missing required member\(s\): root"),
        (lambda w: _drop(w, ("path",)), r"missing required member\(s\): path"),
        (lambda w: _drop(w, ("leafHash",)), r"missing required member\(s\): leafHash"),
        (lambda w: _set(w, ("extra",), 1), r"unknown member\(s\): 'extra'"),
        (lambda w: _set(w, ("leaf_hash",), A), r"unknown member\(s\): 'leaf_hash'"),
        (lambda w: _set(w, ("root",), A.upper()), r"MerkleProof\.root must be a lowercase hex"),
        (lambda w: _set(w, ("root",), A[:63]), r"MerkleProof\.root .* length 63"),
        (lambda w: _set(w, ("root",), A + "0"), r"MerkleProof\.root"),
        (lambda w: _set(w, ("root",), A + "\n"), r"MerkleProof\.root"),
        (lambda w: _set(w, ("root",), "0x" + A[2:]), r"MerkleProof\.root"),
        (lambda w: _set(w, ("root",), "g" * 64), r"MerkleProof\.root"),
        (lambda w: _set(w, ("root",), int(A, 16)), r"MerkleProof\.root .* got int"),
        (lambda w: _set(w, ("root",), None), r"MerkleProof\.root .* got NoneType"),
        (lambda w: _set(w, ("leafHash",), " " + A[1:]), r"MerkleProof\.leafHash"),
        (lambda w: _set(w, ("path",), None), r"MerkleProof\.path must be a JSON array"),
        (lambda w: _set(w, ("path",), {"0": w["path"][0]}), r"path must be a JSON array"),
        (lambda w: _set(w, ("path", 1), [C, "right"]), r"path\[1\] must be a JSON object"),
        (lambda w: _drop(w, ("path", 0, "hash")), r"path\[0\] is missing .*: hash"),
        (lambda w: _drop(w, ("path", 1, "direction")), r"path\[1\] is missing .*: direction"),
        (lambda w: _set(w, ("path", 0, "index"), 0), r"path\[0\] has unknown member"),
        (lambda w: _set(w, ("path", 1, "hash"), C.upper()), r"path\[1\]\.hash must be"),
        (lambda w: _set(w, ("path", 0, "hash"), 5), r"path\[0\]\.hash .* got int"),
        (lambda w: _set(w, ("path", 0, "direction"), "LEFT"), r"path\[0\]\.direction must be"),
        (lambda w: _set(w, ("path", 0, "direction"), "up"), r"'left' or 'right'"),
        (lambda w: _set(w, ("path", 0, "direction"), None), r"direction .* got NoneType"),
        (lambda w: _set(w, ("path", 0, "direction"), True), r"direction .* got bool"),
        (lambda w: _set(w, ("path", 0, "direction"), 0), r"direction .* got int"),
        (
            lambda w: _set(w, ("path",), [{"hash": A, "direction": "left"}] * 65),
            r"path has 65 nodes, more than 64",
        ),
    ],
)
def test_from_json_is_strict(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MerkleProof.from_json(build(_valid_wire()))


def test_from_json_accepts_empty_path_and_does_not_judge_validity() -> None:
    parsed = MerkleProof.from_json({"root": A, "path": [], "leafHash": A})
    assert parsed == MerkleProof(root=A, path=(), leaf_hash=A)
    assert verify_proof(parsed)
    # Well-formed but wrong: parsing succeeds, verification fails.
    wrong = MerkleProof.from_json({"root": B, "path": [], "leafHash": A})
    assert not verify_proof(wrong)
    longest = {"root": A, "path": [{"hash": B, "direction": "right"}] * 64, "leafHash": A}
    assert len(MerkleProof.from_json(longest).path) == MAX_PATH_LENGTH


def test_proofs_are_immutable() -> None:
    proof = MerkleTree([A, B]).proof(0)
    with pytest.raises(AttributeError):
        proof.root = B  # type: ignore[misc]
    with pytest.raises(AttributeError):
        proof.path[0].hash = C  # type: ignore[misc]


# --- the stored form (anchor_trees.levels) ------------------------------------------------------


@pytest.mark.parametrize("size", [*range(1, 40), 255, 256, 257, 1000])
def test_every_proof_sliced_out_of_the_stored_levels_is_the_trees_own(size: int) -> None:
    leaves = [hashlib.sha256(f"leaf {n}".encode()).hexdigest() for n in range(size)]
    tree = MerkleTree(leaves)
    levels = tree.packed_levels()
    assert levels[:NODE_BYTES].hex() == leaves[0]
    assert levels[-NODE_BYTES:].hex() == tree.root
    for index in range(size):
        leaf, steps = proof_offsets(size, index)
        sliced = proof_from_slices(
            tree.root,
            levels[leaf : leaf + NODE_BYTES],
            [(levels[at : at + NODE_BYTES], side) for at, side in steps],
        )
        assert sliced == tree.proof(index)
        assert verify_proof(sliced, leaves[index])


@pytest.mark.parametrize(("size", "index"), [(0, 0), (1, 1), (5, -1), (5, 5)])
def test_offsets_of_a_leaf_outside_the_tree_are_refused(size: int, index: int) -> None:
    with pytest.raises((IndexError, ValueError)):
        proof_offsets(size, index)


def test_slices_of_another_length_are_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        proof_from_slices("00" * 32, b"\x00" * 31, [])
