"""registry/transparency.py against a second implementation written here from RFC 9162 (the
recursive definitions of PATH and PROOF, read backwards), and checkpoints against the C2SP
signed-note format byte for byte."""

from __future__ import annotations

import base64
import hashlib

import nacl.signing
import pytest

from registry import transparency as t

SIZES = range(1, 65)


def h(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def leaves(n: int) -> list[bytes]:
    return [h(b"\x00" + f"record {i}".encode()) for i in range(n)]


def split(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def mth(hashes: list[bytes]) -> bytes:
    """RFC 9162 §2.1.1, bottom-up: pair the leaves left to right, a lone last node rising."""
    if not hashes:
        return h(b"")
    level = hashes
    while len(level) > 1:
        nxt = [h(b"\x01" + level[i] + level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def root_from_path(index: int, size: int, leaf: bytes, proof: list[bytes]) -> bytes:
    """The root PATH(index, D[size]) leads to: PATH ends with the sibling subtree's root."""
    if size == 1:
        assert proof == []
        return leaf
    k = split(size)
    *rest, sibling = proof
    if index < k:
        return h(b"\x01" + root_from_path(index, k, leaf, rest) + sibling)
    return h(b"\x01" + sibling + root_from_path(index - k, size - k, leaf, rest))


def roots_from_proof(
    m: int, n: int, proof: list[bytes], old_root: bytes, complete: bool = True
) -> tuple[bytes, bytes]:
    """(the tree of m's root, the tree of n's root) that SUBPROOF(m, D[n], complete) proves."""
    if m == n:
        if complete:
            assert proof == []
            return old_root, old_root
        (node,) = proof
        return node, node
    k = split(n)
    *rest, last = proof
    if m <= k:
        old, new_left = roots_from_proof(m, k, rest, old_root, complete)
        return old, h(b"\x01" + new_left + last)
    old_right, new_right = roots_from_proof(m - k, n - k, rest, old_root, False)
    return h(b"\x01" + last + old_right), h(b"\x01" + last + new_right)


def tampered(proof: list[bytes]) -> list[list[bytes]]:
    out = []
    for i in range(len(proof)):
        bad = list(proof)
        bad[i] = bytes([bad[i][0] ^ 1]) + bad[i][1:]
        out.append(bad)
    return out


def test_the_root_is_rfc_9162s() -> None:
    for n in range(0, 65):
        assert t.root(leaves(n)) == mth(leaves(n)), n
    assert t.leaf_hash(b"x") == h(b"\x00x")


@pytest.mark.parametrize("size", SIZES)
def test_every_inclusion_proof_leads_to_the_root_and_a_tampered_one_does_not(size: int) -> None:
    tree = leaves(size)
    expected = mth(tree)
    for index in range(size):
        proof = t.inclusion_proof(index, tree)
        assert root_from_path(index, size, tree[index], proof) == expected
        assert t.verify_inclusion(index, size, tree[index], proof, expected)
        for bad in tampered(proof):
            assert not t.verify_inclusion(index, size, tree[index], bad, expected)
        assert not t.verify_inclusion(index, size, h(b"other"), proof, expected)
        if proof:
            assert not t.verify_inclusion(index, size, tree[index], proof[:-1], expected)


@pytest.mark.parametrize("n", SIZES)
def test_every_consistency_proof_links_the_two_roots_and_a_tampered_one_does_not(n: int) -> None:
    tree = leaves(n)
    new_root = mth(tree)
    for m in range(1, n + 1):
        old_root = mth(tree[:m])
        proof = t.consistency_proof(m, tree)
        assert roots_from_proof(m, n, proof, old_root) == (old_root, new_root), (m, n)
        assert t.verify_consistency(m, n, proof, old_root, new_root), (m, n)
        for bad in tampered(proof):
            assert not t.verify_consistency(m, n, bad, old_root, new_root), (m, n)
        if m < n:
            assert not t.verify_consistency(m, n, proof, h(b"forked"), new_root)
            assert not t.verify_consistency(m, n, proof, old_root, h(b"forked"))
            assert not t.verify_consistency(m, n, [], old_root, new_root)


def test_impossible_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="not in a tree"):
        t.inclusion_proof(3, leaves(3))
    with pytest.raises(ValueError, match="no consistency proof"):
        t.consistency_proof(0, leaves(3))
    with pytest.raises(ValueError, match="no consistency proof"):
        t.consistency_proof(4, leaves(3))
    assert not t.verify_inclusion(5, 5, leaves(6)[5], [], mth(leaves(5)))
    assert not t.verify_consistency(6, 5, [], mth(leaves(6)), mth(leaves(5)))


SEED = bytes(range(32))


def test_a_checkpoint_is_a_c2sp_signed_note_byte_for_byte() -> None:
    key = nacl.signing.SigningKey(SEED)
    public = bytes(key.verify_key)
    tree_root = mth(leaves(5))
    body = t.checkpoint_body("registry.example/log", 5, tree_root)
    assert body == f"registry.example/log\n5\n{base64.b64encode(tree_root).decode()}\n"
    note = t.sign_note(body, "registry.example/log", key)
    # The key id, computed here from c2sp.org/signed-note: SHA-256(name || "\n" || 0x01 || key).
    key_id = hashlib.sha256(b"registry.example/log" + b"\n" + b"\x01" + public).digest()[:4]
    signature = key.sign(body.encode()).signature  # Ed25519 is deterministic
    line = "\u2014 registry.example/log " + base64.b64encode(key_id + signature).decode()
    assert note == body + "\n" + line + "\n"
    assert t.verify_note(note, "registry.example/log", public) == body
    # Another signer's line is ignored; a wrong key, name or altered body is refused.
    other = nacl.signing.SigningKey(bytes(32))
    cosigned = note + t.sign_note(body, "witness.example", other).split("\n\n", 1)[1]
    assert t.verify_note(cosigned, "registry.example/log", public) == body
    assert t.verify_note(cosigned, "witness.example", bytes(other.verify_key)) == body
    with pytest.raises(ValueError, match="no signature"):
        t.verify_note(note, "registry.example/log", bytes(other.verify_key))
    with pytest.raises(ValueError, match="does not verify"):
        t.verify_note(note.replace("\n5\n", "\n6\n"), "registry.example/log", public)
