"""The verifiable log's rules, sans I/O (issue 20): an RFC 9162 Merkle tree over the log's
records, its inclusion and consistency proofs, and C2SP signed-note checkpoints.

Hashes are raw 32-byte SHA-256 digests: a leaf is SHA-256(0x00 ‖ leaf bytes), an interior node
SHA-256(0x01 ‖ left ‖ right) (RFC 9162 §2.1.1). The tree of n leaves splits at k, the largest
power of two below n. Proofs are built from the leaf hashes (`inclusion_proof`,
`consistency_proof`: RFC 9162 §2.1.3.1, §2.1.4.1) and checked with the RFC's verification
algorithms (§2.1.3.2, §2.1.4.2), which need only the proof, the sizes and the roots.

A checkpoint is a C2SP signed note (c2sp.org/signed-note, c2sp.org/tlog-checkpoint): the body
`<origin>\\n<tree size>\\n<base64 root>\\n`, a blank line, and one signature line per signer,
`— <key name> <base64(key id ‖ Ed25519 signature)>`, where the key id is the first 4 bytes of
SHA-256(key name ‖ 0x0A ‖ 0x01 ‖ public key) (0x01: the Ed25519 signature type).

Not wired to the service yet: the records, the stored tree, the endpoints and the witnesses are
issue 20's next steps.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import nacl.exceptions
import nacl.signing

from registry.canonical import canonicalize
from registry.changes import LogRecord, rfc3339_ms
from registry.entries import check_entry
from registry.errors import Invalid
from registry.events import PUBLIC_KINDS
from registry.keys import SigningKey

EMPTY_ROOT = hashlib.sha256(b"").digest()
ED25519_TYPE = b"\x01"
SIGNATURE_PREFIX = "\u2014 "  # an em dash and a space start every signature line


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two smaller than n (n > 1)."""
    return 1 << ((n - 1).bit_length() - 1)


def root(leaves: Sequence[bytes]) -> bytes:
    """MTH of the leaf hashes `leaves` (RFC 9162 §2.1.1)."""
    n = len(leaves)
    if n == 0:
        return EMPTY_ROOT
    if n == 1:
        return leaves[0]
    k = _split(n)
    return node_hash(root(leaves[:k]), root(leaves[k:]))


def inclusion_proof(index: int, leaves: Sequence[bytes]) -> list[bytes]:
    """PATH(index, D[n]): the audit path of leaf `index` in the tree of `leaves`."""
    return inclusion_path(index, len(leaves), lambda lo, hi: root(leaves[lo:hi]))


def consistency_proof(m: int, leaves: Sequence[bytes]) -> list[bytes]:
    """PROOF(m, D[n]): that the tree of the first `m` of `leaves` is a prefix of theirs."""
    return consistency_path(m, len(leaves), lambda lo, hi: root(leaves[lo:hi]))


RangeHash = Callable[[int, int], bytes]  # MTH(D[lo:hi])


def inclusion_path(index: int, size: int, mth: RangeHash) -> list[bytes]:
    """PATH(index, D[size]) (RFC 9162 §2.1.3.1), asking `mth` for the hash of each sibling
    range; the recursion unrolled top-down, the path returned bottom-up."""
    if not 0 <= index < size:
        raise ValueError(f"leaf index {index} is not in a tree of {size}")
    path: list[bytes] = []
    lo, hi = 0, size
    while hi - lo > 1:
        k = _split(hi - lo)
        if index < lo + k:
            path.append(mth(lo + k, hi))
            hi = lo + k
        else:
            path.append(mth(lo, lo + k))
            lo += k
    path.reverse()
    return path


def consistency_path(m: int, size: int, mth: RangeHash) -> list[bytes]:
    """PROOF(m, D[size]) (RFC 9162 §2.1.4.1): SUBPROOF(m, D[size], true), unrolled."""
    if not 0 < m <= size:
        raise ValueError(f"no consistency proof from {m} to {size}")
    path: list[bytes] = []
    lo, hi, complete = 0, size, True
    while m != hi - lo:
        k = _split(hi - lo)
        if m <= k:
            path.append(mth(lo + k, hi))
            hi = lo + k
        else:
            path.append(mth(lo, lo + k))
            lo += k
            m -= k
            complete = False
    if not complete:
        path.append(mth(lo, hi))
    path.reverse()
    return path


def verify_inclusion(
    index: int, size: int, leaf: bytes, proof: Sequence[bytes], expected_root: bytes
) -> bool:
    """RFC 9162 §2.1.3.2: whether `proof` shows leaf hash `leaf` at `index` of the tree of
    `size` leaves whose root is `expected_root`."""
    if not 0 <= index < size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == expected_root


def verify_consistency(
    m: int, n: int, proof: Sequence[bytes], first_root: bytes, second_root: bytes
) -> bool:
    """RFC 9162 §2.1.4.2: whether `proof` shows the tree of `m` leaves (root `first_root`) is
    a prefix of the tree of `n` leaves (root `second_root`)."""
    if not 0 < m <= n:
        return False
    if m == n:
        return not proof and first_root == second_root
    if not proof:
        return False
    path = list(proof)
    if m & (m - 1) == 0:  # a power of two: the first root is the proof's implicit first node
        path.insert(0, first_root)
    fn, sn = m - 1, n - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == first_root and sr == second_root


# --- checkpoints: C2SP signed notes --------------------------------------------------------------


def checkpoint_body(origin: str, size: int, tree_root: bytes) -> str:
    """The checkpoint's text (c2sp.org/tlog-checkpoint), each line ending with a newline."""
    if not origin or "\n" in origin:
        raise ValueError("an origin is one non-empty line")
    return f"{origin}\n{size}\n{base64.b64encode(tree_root).decode()}\n"


def key_id(key_name: str, public_key: bytes) -> bytes:
    return hashlib.sha256(key_name.encode() + b"\n" + ED25519_TYPE + public_key).digest()[:4]


def sign_note(body: str, key_name: str, key: nacl.signing.SigningKey) -> str:
    """`body` signed by `key` under `key_name`: the signed note's text."""
    if " " in key_name or "+" in key_name or not key_name:
        raise ValueError("a key name is non-empty, with no space or plus sign")
    signature = key.sign(body.encode()).signature
    blob = key_id(key_name, bytes(key.verify_key)) + signature
    return f"{body}\n{SIGNATURE_PREFIX}{key_name} {base64.b64encode(blob).decode()}\n"


def note_body(note: str) -> str:
    """The signed text of a note: everything before the blank line, with its final newline."""
    return note.split("\n\n", 1)[0] + "\n"


def checkpoint_note(origin: str, size: int, tree_root: bytes, key: SigningKey) -> str:
    """The registry's checkpoint of a tree: signed by its key, under the key name `origin`."""
    return sign_note(
        checkpoint_body(origin, size, tree_root), origin, nacl.signing.SigningKey(key.seed)
    )


def verify_note(note: str, key_name: str, public_key: bytes) -> str:
    """The body of `note` if it carries a valid signature of `public_key` under `key_name`
    (other signers' lines are ignored); ValueError otherwise."""
    body, sep, signatures = note.rpartition("\n\n")
    if not sep or not signatures.endswith("\n"):
        raise ValueError("not a signed note")
    body += "\n"
    wanted = key_id(key_name, public_key)
    for line in signatures[:-1].split("\n"):
        if not line.startswith(SIGNATURE_PREFIX):
            raise ValueError("a signature line starts with an em dash and a space")
        name, _, encoded = line[len(SIGNATURE_PREFIX) :].partition(" ")
        blob = base64.b64decode(encoded, validate=True)
        if name != key_name or blob[:4] != wanted:
            continue
        try:
            nacl.signing.VerifyKey(public_key).verify(body.encode(), blob[4:])
        except nacl.exceptions.BadSignatureError:
            raise ValueError("the signature does not verify") from None
        return body
    raise ValueError(f"no signature of {key_name}")


# --- the stored tree: tiles ----------------------------------------------------------------------
#
# The tree is stored as tiles (the layout of c2sp.org/tlog-tiles, in database rows): a tile of
# level L holds up to TILE_WIDTH consecutive hashes of the tree's nodes at height L·TILE_HEIGHT,
# each the root of a complete subtree of 2^(L·TILE_HEIGHT) leaves; level 0 holds the leaf hashes.
# Tile (L, t) holds nodes t·W … t·W + W − 1; only the rightmost tile of a level is partial. Every
# hash in a tile is final once written (a complete subtree never changes), so a full tile is
# immutable and the partial one only grows. Any complete aligned subtree of height h is the root
# of 2^(h mod TILE_HEIGHT) consecutive hashes of one tile of level h // TILE_HEIGHT, and any range
# MTH(D[lo:hi]) the proofs ask for splits into such subtrees, so a proof reads a few tiles per
# level. Storage: 32 bytes per leaf, plus 1/W of that per level above.

TILE_HEIGHT = 8
TILE_WIDTH = 1 << TILE_HEIGHT
HASH_SIZE = 32

TileKey = tuple[int, int]  # (level, index)


def _complete_root(hashes: Sequence[bytes]) -> bytes:
    """The root over a power-of-two count of node hashes."""
    level = list(hashes)
    while len(level) > 1:
        level = [node_hash(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


class TileReader:
    """The hashes of a tree of `size` leaves, read from tiles (`tiles[(level, index)]`: the
    concatenated hashes). `needed_for` says which tiles a computation reads, before it runs."""

    def __init__(
        self,
        size: int,
        tiles: Callable[[TileKey], bytes],
        *,
        height: int = TILE_HEIGHT,
        memo: NodeMemo | None = None,
    ) -> None:
        self.size = size
        self._tiles = tiles
        self._height = height
        self._memo = memo

    def node(self, h: int, index: int) -> bytes:
        """The root of the complete subtree of height `h` at position `index` of its level."""
        memo = self._memo
        if memo is not None and h >= MEMO_FROM_HEIGHT:
            known = memo.get((h, index))
            if known is None:
                known = memo.put((h, index), self._compute(h, index))
            return known
        return self._compute(h, index)

    def _compute(self, h: int, index: int) -> bytes:
        level, rest = divmod(h, self._height)
        first = index << rest
        tile, offset = divmod(first, 1 << self._height)
        data = self._tiles((level, tile))
        count = 1 << rest
        if len(data) < (offset + count) * HASH_SIZE:
            raise LookupError(f"tile {level}/{tile} does not hold node {h}/{index}")
        return _complete_root(
            [data[i * HASH_SIZE : (i + 1) * HASH_SIZE] for i in range(offset, offset + count)]
        )

    def mth(self, lo: int, hi: int) -> bytes:
        """MTH(D[lo:hi]) for a range the RFC's algorithms ask for (`lo` aligned on the split)."""
        if not 0 <= lo < hi <= self.size:
            raise ValueError(f"range {lo}..{hi} is not in a tree of {self.size}")
        n = hi - lo
        if n & (n - 1) == 0 and lo % n == 0:
            h = n.bit_length() - 1
            return self.node(h, lo >> h)
        k = _split(n)
        return node_hash(self.mth(lo, lo + k), self.mth(lo + k, hi))

    def root(self) -> bytes:
        return EMPTY_ROOT if self.size == 0 else self.mth(0, self.size)

    @staticmethod
    def needed_for(
        size: int,
        compute: Callable[[TileReader], object],
        *,
        height: int = TILE_HEIGHT,
        memo: NodeMemo | None = None,
    ) -> set[TileKey]:
        """The tiles `compute` reads from a reader of a tree of `size` leaves, the nodes
        `memo` knows aside (a dry run: placeholder hashes, nothing hashed or remembered)."""
        return _DryRun(size, height, memo).run(compute)


MEMO_FROM_HEIGHT = 4  # below, a node is at most 15 hashes away from its tile: not worth keeping


class NodeMemo:
    """Complete subtrees' roots, by (height, index): final once the subtree is complete, so
    valid for every tree size. Bounded: emptied when full (cheap, and the hot nodes, those near
    the root and on the right edge, come back at once)."""

    def __init__(self, capacity: int = 65536) -> None:
        self._nodes: dict[tuple[int, int], bytes] = {}
        self._capacity = capacity

    def get(self, key: tuple[int, int]) -> bytes | None:
        return self._nodes.get(key)

    def put(self, key: tuple[int, int], value: bytes) -> bytes:
        if len(self._nodes) >= self._capacity:
            self._nodes.clear()
        self._nodes[key] = value
        return value

    def __len__(self) -> int:
        return len(self._nodes)


class _DryRun(TileReader):
    def __init__(self, size: int, height: int, memo: NodeMemo | None) -> None:
        super().__init__(size, self._record, height=height)
        self._known = memo
        self._seen: set[TileKey] = set()
        self._filler = bytes(HASH_SIZE)

    def _record(self, key: TileKey) -> bytes:
        self._seen.add(key)
        return b""

    def node(self, h: int, index: int) -> bytes:
        if self._known is not None and h >= MEMO_FROM_HEIGHT and self._known.get((h, index)):
            return self._filler
        level, rest = divmod(h, self._height)
        self._record((level, (index << rest) >> self._height))
        return self._filler

    def run(self, compute: Callable[[TileReader], object]) -> set[TileKey]:
        compute(self)
        return self._seen


class TreeBuilder:
    """Extends the stored tree leaf by leaf, holding only the rightmost (partial) tile of each
    level: the tiles to write come out of `take_tiles`, and the root of the tree so far out of
    `root` (every node it needs lies in those partial tiles)."""

    def __init__(
        self, size: int, edge: dict[int, bytes] | None = None, *, height: int = TILE_HEIGHT
    ) -> None:
        """`edge[L]`: the hashes of level L's partial tile of the tree of `size` leaves (as
        stored; longer tiles are cut to the size)."""
        self.size = size
        self._height = height
        self._width = 1 << height
        self._levels: list[list[bytes]] = []
        level = 0
        while size >> (height * level):
            width = (size >> (height * level)) & (self._width - 1)
            data = (edge or {}).get(level, b"")
            if len(data) < width * HASH_SIZE:
                raise ValueError(f"the partial tile of level {level} holds fewer than {width}")
            self._levels.append([data[i * HASH_SIZE : (i + 1) * HASH_SIZE] for i in range(width)])
            level += 1
        self._dirty: set[TileKey] = set()
        self._full: dict[TileKey, bytes] = {}  # tiles filled since the last take_tiles

    @staticmethod
    def edge_tiles(size: int, *, height: int = TILE_HEIGHT) -> list[TileKey]:
        """The partial tiles a builder resumes from, for a tree of `size` leaves."""
        keys = []
        level = 0
        while size >> (height * level):
            if (size >> (height * level)) & ((1 << height) - 1):
                keys.append((level, size >> (height * (level + 1))))
            level += 1
        return keys

    def append(self, leaf: bytes) -> None:
        value, level = leaf, 0
        position = self.size
        while True:
            if level == len(self._levels):
                self._levels.append([])
            tile = self._levels[level]
            tile.append(value)
            self._dirty.add((level, position >> (self._height * (level + 1))))
            if len(tile) < self._width:
                break
            value = _complete_root(tile)
            self._full[(level, position >> (self._height * (level + 1)))] = b"".join(tile)
            self._levels[level] = []
            level += 1
        self.size += 1

    def take_tiles(self) -> dict[TileKey, bytes]:
        """The tiles changed since the last call, each in full (full or partial)."""
        tiles = self._full
        for key in self._dirty - tiles.keys():
            tiles[key] = b"".join(self._levels[key[0]])  # the partial tile of its level
        self._dirty, self._full = set(), {}
        return tiles

    def _edge(self, key: TileKey) -> bytes:
        level, index = key
        if index != self.size >> (self._height * (level + 1)):
            raise LookupError(f"tile {level}/{index} is not on the tree's right edge")
        return b"".join(self._levels[level])

    def root(self) -> bytes:
        return TileReader(self.size, self._edge, height=self._height).root()


@dataclass(frozen=True)
class StoredCheckpoint:
    """A checkpoint the registry issued: the tree size, its root, the signed note (the
    registry's own signature only) and when it was issued."""

    size: int
    root: bytes
    note: str
    at_ms: int


# --- the records ---------------------------------------------------------------------------------


def log_record(record: LogRecord, document_hash: str | None) -> dict[str, Any]:
    """The record of one log position as `GET /v1/log/records` serves it and the tree commits
    to. A public kind shows its subject and data, and an entry version's `documentHash`; an
    admin or internal kind shows neither, only `redacted`: the hex SHA-256 of
    JCS({"subject", "data"}), so the leaf stays the same for everyone who reads it."""
    out: dict[str, Any] = {
        "sequence": record.seq,
        "kind": record.kind,
        "subject": record.entry_did,
        "at": rfc3339_ms(record.at_ms),
        "data": dict(record.data),
    }
    if record.kind not in PUBLIC_KINDS:
        hidden = canonicalize({"subject": record.entry_did, "data": out["data"]})
        out["subject"] = None
        out["data"] = None
        out["redacted"] = hashlib.sha256(hidden).hexdigest()
    elif document_hash is not None:
        out["documentHash"] = document_hash
    return out


def record_leaf(record: dict[str, Any]) -> bytes:
    """The leaf hash of a served record: SHA-256(0x00 ‖ JCS(record))."""
    return leaf_hash(canonicalize(record))


_string = json.encoder.encode_basestring  # JCS's string form for every string (RFC 8785 §3.2.2.2)


def record_bytes(record: LogRecord, document_hash: str | None) -> bytes:
    """JCS(log_record(record, document_hash)), written member by member in JCS's order (at,
    data, documentHash, kind, redacted, sequence, subject): the leaf bytes of every record the
    checkpointer hashes, without building and walking the record first. A test holds it equal
    to `canonicalize(log_record(...))`."""
    if record.kind not in PUBLIC_KINDS:
        return canonicalize(log_record(record, document_hash))
    parts = [
        '{"at":"',
        rfc3339_ms(record.at_ms),
        '","data":',
        canonicalize(dict(record.data)).decode(),
    ]
    if document_hash is not None:
        parts += [',"documentHash":', _string(document_hash)]
    parts += [',"kind":', _string(record.kind), ',"sequence":', str(record.seq), ',"subject":']
    parts.append("null" if record.entry_did is None else _string(record.entry_did))
    parts.append("}")
    return "".join(parts).encode()


def leaves_of(records: Sequence[tuple[LogRecord, str | None]]) -> list[bytes]:
    """The leaf hashes of log records, each with its entry version's document hash."""
    return [
        hashlib.sha256(b"\x00" + record_bytes(record, digest)).digest()
        for record, digest in records
    ]


# --- what a monitor or a client checks -----------------------------------------------------------


class CompactRange:
    """The roots of the complete subtrees that make up a tree of `size` leaves, largest first
    (at most one per bit of the size): enough to extend the tree leaf by leaf and to compute its
    root, in O(log n) memory. What a monitor keeps between runs."""

    def __init__(self, size: int = 0, hashes: Sequence[bytes] = ()) -> None:
        if len(hashes) != size.bit_count():
            raise ValueError(f"a tree of {size} leaves has {size.bit_count()} subtree roots")
        self.size = size
        self.hashes = list(hashes)

    def append(self, leaf: bytes) -> None:
        self.hashes.append(leaf)
        merged = self.size
        while merged & 1:  # each trailing one bit of the old size is a subtree to merge
            right = self.hashes.pop()
            self.hashes[-1] = node_hash(self.hashes[-1], right)
            merged >>= 1
        self.size += 1

    def root(self) -> bytes:
        if not self.hashes:
            return EMPTY_ROOT
        value = self.hashes[-1]
        for left in reversed(self.hashes[:-1]):
            value = node_hash(left, value)
        return value


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's body: origin, tree size and root."""

    origin: str
    size: int
    root: bytes


def open_checkpoint(
    note: str, public_key: bytes, key_name: str | None = None, *, origin: str | None = None
) -> Checkpoint:
    """The checkpoint in `note`, checked: signed by `public_key` under `key_name` (default: the
    note's origin line), of the log `origin` when given (a monitor's pinned one), its size a
    decimal integer and its root 32 bytes; ValueError otherwise."""
    body = verify_note(note, key_name or note.split("\n", 1)[0], public_key)
    lines = body.split("\n")
    if len(lines) < 4:
        raise ValueError("a checkpoint body is origin, size and root")
    if origin is not None and lines[0] != origin:
        raise ValueError(f"it is of the log {lines[0]!r}, not of {origin!r}")
    size_text, root_text = lines[1], lines[2]
    if (
        not size_text.isascii()
        or not size_text.isdigit()
        or (size_text != "0" and size_text[0] == "0")
    ):
        raise ValueError(f"the tree size {size_text!r} is not a decimal integer")
    tree_root = base64.b64decode(root_text, validate=True)
    if len(tree_root) != HASH_SIZE:
        raise ValueError("the root hash is not 32 bytes")
    return Checkpoint(lines[0], int(size_text), tree_root)


def document_hashes(version: Mapping[str, Any]) -> set[str]:
    """The hex SHA-256 a version's record may commit to: of JCS(version) as served now, and as
    it was served when written, `anchorState` being the one member the registry changes later
    (it was `pending` then whenever it has moved since)."""
    served = hashlib.sha256(canonicalize(dict(version))).hexdigest()
    written = hashlib.sha256(canonicalize({**version, "anchorState": "pending"})).hexdigest()
    return {served, written}


def check_version(record: Mapping[str, Any], version: Mapping[str, Any]) -> list[str]:
    """What is wrong between an entry version's log record and the version as served (its
    place, its document hash, its publisher's signature): the problems, none if it holds."""
    problems = []
    if version.get("sequence") != record.get("sequence"):
        problems.append("the version's sequence is not its record's")
    if version.get("entryDid") != record.get("subject"):
        problems.append("the version's entryDid is not its record's subject")
    if record.get("documentHash") not in document_hashes(version):
        problems.append("the record's documentHash is not the SHA-256 of the version's JCS")
    try:
        check_entry(dict(version))
    except Invalid as exc:
        problems.append(f"the publisher's signature does not hold: {exc.message}")
    return problems


# --- witnesses: cosignatures (c2sp.org/tlog-cosignature) and the consistency of a peer's log -----

COSIGNATURE_TYPE = b"\x04"  # cosignature/v1, Ed25519


def cosignature_key_id(name: str, public_key: bytes) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + COSIGNATURE_TYPE + public_key).digest()[:4]


def _cosigned_message(body: str, timestamp: int) -> bytes:
    return f"cosignature/v1\ntime {timestamp}\n{body}".encode()


def cosign(body: str, name: str, key: SigningKey, timestamp: int) -> str:
    """A witness's cosignature of a checkpoint body: the signature line
    `— <name> base64(key id ‖ 8-byte big-endian timestamp ‖ Ed25519 signature)`, the signature
    over "cosignature/v1\\ntime <timestamp>\\n" followed by the body."""
    signature = key.sign(_cosigned_message(body, timestamp))
    blob = cosignature_key_id(name, key.public_key) + timestamp.to_bytes(8, "big") + signature
    return f"{SIGNATURE_PREFIX}{name} {base64.b64encode(blob).decode()}\n"


def verify_cosignature(body: str, line: str, name: str, public_key: bytes) -> int:
    """The timestamp of `line`, a valid cosignature of `body` by `name`'s key; ValueError
    otherwise."""
    prefix = f"{SIGNATURE_PREFIX}{name} "
    if not line.startswith(prefix) or not line.endswith("\n") or line.count("\n") != 1:
        raise ValueError(f"not a signature line of {name}")
    try:
        blob = base64.b64decode(line[len(prefix) : -1], validate=True)
    except ValueError:
        raise ValueError("the cosignature is not base64") from None
    if len(blob) != 4 + 8 + 64 or blob[:4] != cosignature_key_id(name, public_key):
        raise ValueError("not a cosignature/v1 of this key")
    timestamp = int.from_bytes(blob[4:12], "big")
    try:
        nacl.signing.VerifyKey(public_key).verify(_cosigned_message(body, timestamp), blob[12:])
    except nacl.exceptions.BadSignatureError:
        raise ValueError("the cosignature does not verify") from None
    return timestamp


@dataclass(frozen=True)
class Witnessed:
    """The newest checkpoint a witness accepted from a log: what the next one must extend."""

    origin: str
    size: int
    root: bytes
    note: str


@dataclass(frozen=True)
class Fork:
    """A log that contradicts a checkpoint it signed before: why, and the evidence."""

    reason: str  # log_inconsistent
    detail: str
    evidence: dict[str, Any]


def judge(
    previous: Witnessed | None,
    note: str,
    checkpoint: Checkpoint,
    proof: Sequence[bytes] | None,
) -> Witnessed | Fork:
    """Whether a witness accepts a log's new signed checkpoint (already opened with the log's
    key): the first one is taken as it is; later ones must not shrink, must keep the root of a
    size already seen, and must extend the last accepted tree (`proof`: the RFC 9162
    consistency proof from its size, asked for only when the size grew)."""
    accepted = Witnessed(checkpoint.origin, checkpoint.size, checkpoint.root, note)
    if previous is None:
        return accepted
    evidence: dict[str, Any] = {"accepted": previous.note, "offered": note}

    def fork(detail: str) -> Fork:
        return Fork("log_inconsistent", detail, evidence)

    if checkpoint.origin != previous.origin:
        return fork(f"the origin changed from {previous.origin!r} to {checkpoint.origin!r}")
    if checkpoint.size < previous.size:
        return fork(f"the log shrank from {previous.size} to {checkpoint.size} records")
    if checkpoint.size == previous.size:
        if checkpoint.root != previous.root:
            return fork(f"two roots for tree size {previous.size}")
        return previous
    if proof is None:
        raise ValueError("a grown log needs a consistency proof")
    evidence["proof"] = [base64.b64encode(p).decode() for p in proof]
    if previous.size and not verify_consistency(
        previous.size, checkpoint.size, proof, previous.root, checkpoint.root
    ):
        return fork(f"checkpoint {checkpoint.size} does not extend checkpoint {previous.size}")
    return accepted
