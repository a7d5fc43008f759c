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
from collections.abc import Sequence

import nacl.exceptions
import nacl.signing

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
    n = len(leaves)
    if not 0 <= index < n:
        raise ValueError(f"leaf index {index} is not in a tree of {n}")
    if n == 1:
        return []
    k = _split(n)
    if index < k:
        return [*inclusion_proof(index, leaves[:k]), root(leaves[k:])]
    return [*inclusion_proof(index - k, leaves[k:]), root(leaves[:k])]


def consistency_proof(m: int, leaves: Sequence[bytes]) -> list[bytes]:
    """PROOF(m, D[n]): that the tree of the first `m` of `leaves` is a prefix of theirs."""
    n = len(leaves)
    if not 0 < m <= n:
        raise ValueError(f"no consistency proof from {m} to {n}")
    return _subproof(m, leaves, True)


def _subproof(m: int, leaves: Sequence[bytes], complete: bool) -> list[bytes]:
    n = len(leaves)
    if m == n:
        return [] if complete else [root(leaves)]
    k = _split(n)
    if m <= k:
        return [*_subproof(m, leaves[:k], complete), root(leaves[k:])]
    return [*_subproof(m - k, leaves[k:], False), root(leaves[:k])]


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
