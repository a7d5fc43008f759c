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


# --- the stored tree: tiles ----------------------------------------------------------------------


def build(n: int, height: int, *, every: int = 1) -> tuple[t.TreeBuilder, dict[t.TileKey, bytes]]:
    """A builder fed the first n test leaves, its tiles written every `every` leaves (each
    write resuming a new builder from the stored edge, as a restarted leader would)."""
    stored: dict[t.TileKey, bytes] = {}
    builder = t.TreeBuilder(0, height=height)
    for i, leaf in enumerate(leaves(n)):
        builder.append(leaf)
        if (i + 1) % every == 0:
            stored.update(builder.take_tiles())
            edge = t.TreeBuilder.edge_tiles(builder.size, height=height)
            builder = t.TreeBuilder(
                builder.size, {level: stored[(level, idx)] for level, idx in edge}, height=height
            )
    stored.update(builder.take_tiles())
    return builder, stored


@pytest.mark.parametrize("height", [1, 2, 3])
def test_the_builders_root_is_the_trees_at_every_size_across_several_tile_levels(
    height: int,
) -> None:
    builder = t.TreeBuilder(0, height=height)
    for size, leaf in enumerate(leaves(80), start=1):
        builder.append(leaf)
        assert builder.root() == mth(leaves(size)), size


@pytest.mark.parametrize(("height", "every"), [(1, 1), (2, 3), (3, 5), (8, 7)])
def test_proofs_read_from_tiles_match_the_recursive_definitions(height: int, every: int) -> None:
    """The tiles written as the tree grows (resumed from the stored edge after every write)
    answer every proof of every smaller tree, with an RFC verifier's agreement."""
    n = 70
    _, stored = build(n, height, every=every)
    for size in range(1, n + 1):
        reader = t.TileReader(size, stored.__getitem__, height=height)
        expected = mth(leaves(size))
        assert reader.root() == expected
        for index in range(size):
            proof = t.inclusion_path(index, size, reader.mth)
            assert root_from_path(index, size, leaves(size)[index], proof) == expected
        for m in range(1, size + 1):
            proof = t.consistency_path(m, size, reader.mth)
            assert roots_from_proof(m, size, proof, mth(leaves(m))) == (
                mth(leaves(m)),
                expected,
            )


def test_a_proof_reads_only_the_tiles_its_dry_run_named_and_fewer_once_nodes_are_known() -> None:
    _, stored = build(1000, 3)
    size = 999
    expected = mth(leaves(size))
    memo = t.NodeMemo()
    for index in (517, 0, 998, 517):
        needed = t.TileReader.needed_for(
            size, lambda r, i=index: t.inclusion_path(i, size, r.mth), height=3, memo=memo
        )
        only = {key: stored[key] for key in needed}
        reader = t.TileReader(size, only.__getitem__, height=3, memo=memo)
        proof = t.inclusion_path(index, size, reader.mth)
        assert t.verify_inclusion(index, size, leaves(size)[index], proof, expected)
        assert len(needed) <= 12
    assert len(memo) > 0
    # 517 again: every node the memo keeps is known; only the tiles of low nodes are read, the
    # leaf's and the right edge's
    assert needed <= {(0, 517 >> 3), (1, 517 >> 6), (0, (size - 1) >> 3)}
    # a memo emptied when full still answers
    small = t.NodeMemo(capacity=2)
    reader = t.TileReader(size, stored.__getitem__, height=3, memo=small)
    assert reader.root() == expected
    assert len(small) <= 2


def test_tiles_hold_32_bytes_per_leaf_and_a_width_th_per_level_above() -> None:
    _, stored = build(4096, 8)
    total = sum(len(v) for v in stored.values())
    assert total == 32 * (4096 + 16)  # 16 level-1 nodes, no level-2 node yet
    assert all(len(v) <= 32 * 256 for v in stored.values())


def test_a_builder_refuses_an_edge_shorter_than_its_size() -> None:
    with pytest.raises(ValueError, match="fewer"):
        t.TreeBuilder(5, {0: bytes(32 * 4)}, height=8)


# --- what a monitor checks -----------------------------------------------------------------------


def test_a_compact_range_gives_every_root_and_keeps_one_hash_per_bit_of_the_size() -> None:
    tree = t.CompactRange()
    assert tree.root() == mth([])
    for size, leaf in enumerate(leaves(130), start=1):
        tree.append(leaf)
        assert tree.root() == mth(leaves(size))
        assert len(tree.hashes) == size.bit_count()
        resumed = t.CompactRange(size, tree.hashes)  # what a monitor reloads from its state
        assert resumed.root() == tree.root()
    with pytest.raises(ValueError, match="subtree roots"):
        t.CompactRange(5, leaves(1))


def test_a_checkpoint_opens_only_with_its_signers_key_and_a_well_formed_body() -> None:
    key = nacl.signing.SigningKey(bytes(range(32)))
    public = bytes(key.verify_key)
    root = h(b"root")
    note = t.sign_note(t.checkpoint_body("example.org/log", 42, root), "example.org/log", key)
    assert t.open_checkpoint(note, public) == t.Checkpoint("example.org/log", 42, root)
    other = bytes(nacl.signing.SigningKey(bytes(32)).verify_key)
    with pytest.raises(ValueError, match="no signature"):
        t.open_checkpoint(note, other)
    for size in ("042", "-1", "x", "+1"):
        body = f"example.org/log\n{size}\n{base64.b64encode(root).decode()}\n"
        with pytest.raises(ValueError, match="not a decimal integer"):
            t.open_checkpoint(t.sign_note(body, "example.org/log", key), public)
    short = t.sign_note("example.org/log\n1\nAAAA\n", "example.org/log", key)
    with pytest.raises(ValueError, match="32 bytes"):
        t.open_checkpoint(short, public)


def test_a_checkpoint_opens_with_a_pinned_origin_only_if_it_is_that_logs() -> None:
    """A monitor pins the log's origin: a checkpoint of another origin does not open, even
    signed by the same key under the pinned key name."""
    key = nacl.signing.SigningKey(bytes(range(32)))
    public, root = bytes(key.verify_key), h(b"root")
    body = t.checkpoint_body("another.example/log", 42, root)
    note = t.sign_note(body, "example.org/log", key)
    assert t.open_checkpoint(note, public, "example.org/log").origin == "another.example/log"
    with pytest.raises(ValueError, match=r"not of 'example\.org/log'"):
        t.open_checkpoint(note, public, "example.org/log", origin="example.org/log")
    ours = t.sign_note(t.checkpoint_body("example.org/log", 42, root), "example.org/log", key)
    assert t.open_checkpoint(ours, public, origin="example.org/log").size == 42


# --- the records ---------------------------------------------------------------------------------


def test_the_checkpointers_leaf_bytes_are_the_served_records_jcs() -> None:
    """`record_bytes` (written member by member, for speed) is JCS of the record as served,
    also with text outside the BMP, escapes, floats, nulls, nesting and every kind."""
    import random

    from registry.canonical import canonicalize
    from registry.changes import CHANGE_KINDS, LogRecord

    rng = random.Random(5)
    texts = [
        "",
        "plain",
        'quote " and \\ slash',
        "tab\t\u2028line",
        "é漢字",
        "\U0001f600 smile",
        "\x01",
    ]

    def value(depth: int) -> object:
        choice = rng.randrange(8 if depth < 3 else 5)
        if choice == 0:
            return rng.choice(texts)
        if choice == 1:
            return rng.randint(-(2**53) + 1, 2**53 - 1)
        if choice == 2:
            return rng.choice([0.5, -1.25, 1e21, 3.0])
        if choice == 3:
            return rng.choice([None, True, False])
        if choice == 4:
            return rng.choice(texts) + str(rng.random())
        if choice == 5:
            return [value(depth + 1) for _ in range(rng.randrange(3))]
        return {rng.choice(texts) + k: value(depth + 1) for k in ("a", "b", "\U0001f600")}

    for i in range(2000):
        record = LogRecord(
            rng.randint(1, 2**53 - 1),
            rng.choice(sorted(CHANGE_KINDS)),
            rng.choice([None, "did:web:x.example:" + rng.choice(texts)]),
            rng.randint(0, 4102444800000),
            {rng.choice(texts): value(0) for _ in range(rng.randrange(4))},
        )
        digest = rng.choice([None, hashlib.sha256(str(i).encode()).hexdigest()])
        served = t.log_record(record, digest)
        assert t.record_bytes(record, digest) == canonicalize(served), served
        assert t.leaves_of([(record, digest)]) == [t.record_leaf(served)]


# --- witnesses -----------------------------------------------------------------------------------


def test_a_cosignature_is_c2sp_cosignature_v1_byte_for_byte() -> None:
    from registry.keys import SigningKey

    witness = SigningKey(bytes([7] * 32))
    body = t.checkpoint_body("example.org/log", 5, h(b"root"))
    line = t.cosign(body, "w.example", witness, 1_700_000_000)
    name, encoded = line.removeprefix("\u2014 ").rstrip("\n").split(" ")
    assert name == "w.example"
    blob = base64.b64decode(encoded)
    assert blob[:4] == h(b"w.example\n\x04" + witness.public_key)[:4]
    assert int.from_bytes(blob[4:12], "big") == 1_700_000_000
    message = b"cosignature/v1\ntime 1700000000\n" + body.encode()
    nacl.signing.VerifyKey(witness.public_key).verify(message, blob[12:])
    assert t.verify_cosignature(body, line, "w.example", witness.public_key) == 1_700_000_000
    other = t.checkpoint_body("example.org/log", 6, h(b"root"))
    with pytest.raises(ValueError, match="does not verify"):
        t.verify_cosignature(other, line, "w.example", witness.public_key)
    with pytest.raises(ValueError, match="not a cosignature"):
        t.verify_cosignature(body, line, "w.example", SigningKey(bytes(32)).public_key)
    with pytest.raises(ValueError, match="not a signature line"):
        t.verify_cosignature(body, line, "x.example", witness.public_key)


def test_a_witness_accepts_only_checkpoints_that_extend_the_last_it_accepted() -> None:
    key = nacl.signing.SigningKey(bytes([3] * 32))
    public = bytes(key.verify_key)

    def offered(
        n: int, *, origin: str = "log.example", tampered: bool = False
    ) -> tuple[str, t.Checkpoint]:
        hashes = leaves(n)
        if tampered:
            hashes[0] = h(b"rewritten")
        note = t.sign_note(t.checkpoint_body(origin, n, mth(hashes)), origin, key)
        return note, t.open_checkpoint(note, public)

    note, checkpoint = offered(5)
    first = t.judge(None, note, checkpoint, None)
    assert isinstance(first, t.Witnessed)
    assert first.size == 5
    same = t.judge(first, *offered(5), None)
    assert same is first
    note, checkpoint = offered(9)
    grown = t.judge(first, note, checkpoint, t.consistency_proof(5, leaves(9)))
    assert isinstance(grown, t.Witnessed)
    assert grown.size == 9
    for verdict, detail in (
        (t.judge(grown, *offered(7), None), "shrank"),
        (t.judge(grown, *offered(9, tampered=True), None), "two roots"),
        (t.judge(grown, *offered(9, origin="other.example"), None), "origin changed"),
        (
            t.judge(grown, *offered(12, tampered=True), t.consistency_proof(9, leaves(12))),
            "does not extend",
        ),
    ):
        assert isinstance(verdict, t.Fork), detail
        assert verdict.reason == "log_inconsistent"
        assert detail in verdict.detail
        assert verdict.evidence["accepted"] == grown.note
