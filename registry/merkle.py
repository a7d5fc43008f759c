"""Merkle trees and proofs for anchoring (pure: no I/O, no clock, no randomness).

Encoding (proof encoding version 1, a fixed compatibility contract of the HTTP spec's 2.2):

* every hash (`leafHash`, `root`, each sibling `hash`) is a lowercase hexadecimal SHA-256 digest
  in textual form, 64 characters `0-9a-f`;
* a leaf is `leaf_hash(entryDid, sequence, itemDataHash)` = hex SHA-256 of
  JCS({"entryDid", "sequence", "itemDataHash"}) (design §8);
* an interior node is `node_hash(left, right)` = hex SHA-256 of the UTF-8 bytes of the 128-character
  string `left + right` (the hex strings concatenated, never the raw 32-byte digests);
* a proof's `path` runs from the leaf up to the root; each `ProofNode` carries the sibling's hash
  and the side the sibling is on (`left`: the sibling goes first, `right`: it goes second).

Odd-node rule: when a level has an odd number of nodes, the last node is promoted unchanged to the
next level. It is hashed with nothing, and the proofs of the leaves below it get no path node for
that level. A tree of one leaf therefore has root = that leaf and proofs with an empty path.
Bitcoin-style duplication (pairing the odd node with itself) is deliberately not used: it makes the
lists [a, b, c] and [a, b, c, c] share a root (CVE-2012-2459), so a root would not pin its leaf
list. With promotion, two different leaf lists share a root only through a SHA-256 collision.

Leaf/node separation: the encoding has no explicit domain prefix, but the preimage of a leaf is a
JCS object (it starts with "{") while the preimage of an interior node is 128 lowercase hex
characters, so no leaf hash made by `leaf_hash` can equal an interior node hash without a SHA-256
collision. A verifier must therefore recompute `leafHash` from (entryDid, sequence, itemDataHash)
itself rather than trust the proof's `leafHash`; otherwise an interior node could be presented as a
"leaf" of a shorter proof. `MerkleTree` itself hashes whatever leaf hashes it is given.

Complexity: building a tree of n leaves costs n - 1 hashes (O(n)); `proofs()` returns every proof in
O(n log n) time, sharing one `ProofNode` per tree node and the common upper parts of the paths.
"""

from __future__ import annotations

import gc
import hashlib
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final, Literal

from registry.canonical import MAX_SAFE_INTEGER, canonicalize, sha256_hex

Direction = Literal["left", "right"]

LEFT: Final = "left"
RIGHT: Final = "right"

# A proof longer than this would need a tree of more than 2^64 leaves; refusing it bounds the work
# `from_json` and `verify_proof` do on untrusted input.
MAX_PATH_LENGTH: Final = 64

_HEX_DIGEST = re.compile("[0-9a-f]{64}")
_DIGEST_RULE = "a lowercase hex SHA-256 digest (64 characters 0-9a-f)"


def is_hex_digest(value: object) -> bool:
    """True when `value` is a str of exactly 64 lowercase hexadecimal characters."""
    return isinstance(value, str) and _HEX_DIGEST.fullmatch(value) is not None


def _require_digest(value: object, what: str) -> str:
    if not is_hex_digest(value):
        raise ValueError(f"{what} must be {_DIGEST_RULE}, got {_describe(value)}")
    assert isinstance(value, str)
    return value


def _describe(value: object) -> str:
    if isinstance(value, str):
        shown = value if len(value) <= 80 else value[:77] + "..."
        return f"string {shown!r} of length {len(value)}"
    return type(value).__name__


def leaf_hash(entry_did: str, sequence: int, item_data_hash: str) -> str:
    """Hex SHA-256 of JCS({"entryDid": …, "sequence": …, "itemDataHash": …}) (design §8)."""
    if not isinstance(entry_did, str) or not entry_did:
        raise ValueError(f"entry_did must be a non-empty string, got {_describe(entry_did)}")
    if (
        not isinstance(sequence, int)
        or isinstance(sequence, bool)
        or not 0 <= sequence <= MAX_SAFE_INTEGER
    ):
        raise ValueError(f"sequence must be an integer in [0, 2^53-1], got {sequence!r}")
    _require_digest(item_data_hash, "item_data_hash")
    document = {"entryDid": entry_did, "sequence": sequence, "itemDataHash": item_data_hash}
    return sha256_hex(canonicalize(document))


def node_hash(left: str, right: str) -> str:
    """Hex SHA-256 of the UTF-8 bytes of `left + right` (both lowercase hex digests)."""
    return hashlib.sha256((left + right).encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class ProofNode:
    """One step of a proof: the sibling's hash and the side the sibling is on."""

    hash: str
    direction: Direction

    def to_json(self) -> dict[str, str]:
        return {"hash": self.hash, "direction": self.direction}


@dataclass(frozen=True, slots=True)
class MerkleProof:
    """Inclusion proof of `leaf_hash` under `root`; `path` is ordered from the leaf to the root."""

    root: str
    path: tuple[ProofNode, ...]
    leaf_hash: str

    def to_json(self) -> dict[str, Any]:
        """The wire form: {"root", "path": [{"hash", "direction"}, …], "leafHash"}."""
        return {
            "root": self.root,
            "path": [{"hash": node.hash, "direction": node.direction} for node in self.path],
            "leafHash": self.leaf_hash,
        }

    @classmethod
    def from_json(cls, data: Any) -> MerkleProof:
        """Parse the wire form strictly; raise ValueError naming the offending member.

        Exactly the members root, path and leafHash (each node exactly hash and direction); every
        hash a lowercase 64-character hex string; direction `left` or `right`; at most
        MAX_PATH_LENGTH path nodes. Whether the proof verifies is `verify_proof`'s question.
        """
        if not isinstance(data, dict):
            raise ValueError(f"MerkleProof must be a JSON object, got {_describe(data)}")
        _exact_members(data, ("root", "path", "leafHash"), "MerkleProof")
        root = _require_digest(data["root"], "MerkleProof.root")
        leaf = _require_digest(data["leafHash"], "MerkleProof.leafHash")
        raw_path = data["path"]
        if not isinstance(raw_path, list):
            raise ValueError(f"MerkleProof.path must be a JSON array, got {_describe(raw_path)}")
        if len(raw_path) > MAX_PATH_LENGTH:
            raise ValueError(
                f"MerkleProof.path has {len(raw_path)} nodes, more than {MAX_PATH_LENGTH}"
            )
        path: list[ProofNode] = []
        for index, raw in enumerate(raw_path):
            where = f"MerkleProof.path[{index}]"
            if not isinstance(raw, dict):
                raise ValueError(f"{where} must be a JSON object, got {_describe(raw)}")
            _exact_members(raw, ("hash", "direction"), where)
            sibling = _require_digest(raw["hash"], f"{where}.hash")
            direction = raw["direction"]
            if isinstance(direction, str) and direction == LEFT:
                path.append(ProofNode(sibling, LEFT))
            elif isinstance(direction, str) and direction == RIGHT:
                path.append(ProofNode(sibling, RIGHT))
            else:
                raise ValueError(
                    f"{where}.direction must be 'left' or 'right', got {_describe(direction)}"
                )
        return cls(root=root, path=tuple(path), leaf_hash=leaf)


# A batch's tree as stored (anchor_trees.levels, migration 0025): every level's node hashes, 32
# bytes each, the leaves first and the root last. A proof is read as slices of it: the leaf and
# one sibling per level, at offsets that follow from the number of leaves alone.
NODE_BYTES = 32


def level_sizes(leaves: int) -> list[int]:
    """The number of nodes of each level of a tree of `leaves` leaves, the leaves first."""
    if leaves < 1:
        raise ValueError("a Merkle tree needs at least one leaf")
    sizes = [leaves]
    while sizes[-1] > 1:
        sizes.append((sizes[-1] + 1) // 2)
    return sizes


def proof_offsets(leaves: int, index: int) -> tuple[int, list[tuple[int, Direction]]]:
    """Where the proof of leaf `index` lies in the stored levels of a tree of `leaves` leaves:
    the leaf's byte offset, and each step's sibling's offset and side (leaf to root). A node
    with no sibling at the end of its level is promoted: no step."""
    if not 0 <= index < leaves:
        raise IndexError(f"leaf index {index} out of range for a tree of {leaves} leaves")
    leaf = index * NODE_BYTES
    steps: list[tuple[int, Direction]] = []
    start = 0  # the first node of the level, counted in nodes
    for size in level_sizes(leaves)[:-1]:
        sibling = index ^ 1
        if sibling < size:
            steps.append(((start + sibling) * NODE_BYTES, LEFT if index % 2 else RIGHT))
        start += size
        index >>= 1
    return leaf, steps


def proof_from_slices(
    root: str, leaf: bytes, steps: Sequence[tuple[bytes, Direction]]
) -> MerkleProof:
    """The proof made of the slices read at `proof_offsets` (each NODE_BYTES long)."""
    if len(leaf) != NODE_BYTES or any(len(node) != NODE_BYTES for node, _ in steps):
        raise ValueError(f"a stored tree's nodes are {NODE_BYTES} bytes")
    path = tuple(ProofNode(node.hex(), side) for node, side in steps)
    return MerkleProof(root=root, path=path, leaf_hash=leaf.hex())


def _exact_members(data: dict[Any, Any], names: tuple[str, ...], what: str) -> None:
    missing = [name for name in names if name not in data]
    if missing:
        raise ValueError(f"{what} is missing required member(s): {', '.join(missing)}")
    extra = sorted(repr(key) for key in data if key not in names)
    if extra:
        raise ValueError(f"{what} has unknown member(s): {', '.join(extra)}")


def root_from_path(leaf: str, path: Sequence[ProofNode]) -> str:
    """Fold `path` over `leaf` (no validation): the root the path claims."""
    sha256 = hashlib.sha256
    current = leaf
    for node in path:
        if node.direction == LEFT:
            current = sha256((node.hash + current).encode("utf-8")).hexdigest()
        else:
            current = sha256((current + node.hash).encode("utf-8")).hexdigest()
    return current


def verify_proof(proof: MerkleProof, leaf: str | None = None) -> bool:
    """True when `proof.path` leads from its leaf hash to `proof.root`.

    With `leaf`, it must also equal `proof.leaf_hash`: pass the leaf you computed yourself with
    `leaf_hash(...)`. Malformed proofs (not lowercase hex digests, unknown directions, overlong
    paths) give False, never an exception.
    """
    if leaf is not None and leaf != proof.leaf_hash:
        return False
    if not (is_hex_digest(proof.leaf_hash) and is_hex_digest(proof.root)):
        return False
    if not isinstance(proof.path, tuple | list) or len(proof.path) > MAX_PATH_LENGTH:
        return False
    for node in proof.path:
        if not isinstance(node, ProofNode) or not is_hex_digest(node.hash):
            return False
        if node.direction != LEFT and node.direction != RIGHT:
            return False
    return root_from_path(proof.leaf_hash, proof.path) == proof.root


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many acyclic objects.

    `proofs()` allocates ~3n small containers and no cycles; left on, the collector rescans the
    young generations over and over and costs as much as the work itself (~40% at n = 100,000).
    Only the state seen on entry is restored, so nested or concurrent pauses are harmless.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class MerkleTree:
    """A Merkle tree over a non-empty sequence of leaf hashes (see the module docstring's rules)."""

    __slots__ = ("_levels",)

    def __init__(self, leaves: Sequence[str]) -> None:
        if isinstance(leaves, str):
            raise TypeError("leaves must be a sequence of hex digests, not one string")
        level = list(leaves)
        if not level:
            raise ValueError("a Merkle tree needs at least one leaf")
        fullmatch = _HEX_DIGEST.fullmatch
        for index, value in enumerate(level):
            if not isinstance(value, str) or fullmatch(value) is None:
                raise ValueError(f"leaf {index} must be {_DIGEST_RULE}, got {_describe(value)}")
        sha256 = hashlib.sha256
        levels = [level]
        while len(level) > 1:
            upper = [
                sha256((level[i] + level[i + 1]).encode("utf-8")).hexdigest()
                for i in range(0, len(level) - 1, 2)
            ]
            if len(level) % 2:
                upper.append(level[-1])  # promoted unchanged: no sibling at this level
            levels.append(upper)
            level = upper
        self._levels: list[list[str]] = levels

    @property
    def root(self) -> str:
        return self._levels[-1][0]

    @property
    def leaves(self) -> tuple[str, ...]:
        return tuple(self._levels[0])

    def __len__(self) -> int:
        return len(self._levels[0])

    def packed_levels(self) -> bytes:
        """Every level's node hashes as bytes, the leaves first (the stored form, NODE_BYTES
        each: see `proof_offsets`)."""
        return bytes.fromhex("".join(node for level in self._levels for node in level))

    def proof(self, index: int) -> MerkleProof:
        """The proof of the leaf at `index` (0-based; negative indexes count from the end)."""
        size = len(self._levels[0])
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"leaf index must be an int, got {type(index).__name__}")
        if not -size <= index < size:
            raise IndexError(f"leaf index {index} out of range for a tree of {size} leaves")
        index %= size
        leaf = self._levels[0][index]
        path: list[ProofNode] = []
        for level in self._levels[:-1]:
            sibling = index ^ 1
            if sibling < len(level):
                path.append(ProofNode(level[sibling], LEFT if sibling < index else RIGHT))
            index >>= 1
        return MerkleProof(root=self.root, path=tuple(path), leaf_hash=leaf)

    def proofs(self) -> list[MerkleProof]:
        """Every leaf's proof, in leaf order, in O(n log n).

        Paths are built from the root down: a node's path is its own step (if it has a sibling)
        followed by its parent's path, so each tree node yields one shared `ProofNode`, and the
        nodes of each level are visited once.
        """
        with _collector_paused():
            return self._all_proofs()

    def _all_proofs(self) -> list[MerkleProof]:
        levels = self._levels
        root = levels[-1][0]
        suffixes: list[tuple[ProofNode, ...]] = [()]
        for level in reversed(levels[:-1]):
            width = len(level)
            # The node at position j, seen as a sibling, sits on its own side: even = left.
            as_sibling = [ProofNode(level[j], LEFT if j % 2 == 0 else RIGHT) for j in range(width)]
            upper = suffixes
            suffixes = [(as_sibling[j ^ 1], *upper[j >> 1]) for j in range(width - width % 2)]
            if width % 2:
                suffixes.append(upper[width >> 1])  # promoted: no step at this level
        return [
            MerkleProof(root=root, path=path, leaf_hash=leaf)
            for leaf, path in zip(levels[0], suffixes, strict=True)
        ]
