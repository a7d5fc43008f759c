"""Peers as witnesses of each other's logs (issue 20, item 5), over real `registry serve`
processes: three nodes cosign each other's checkpoints; a node whose log is rewritten behind
its back (rows changed in its database) is caught as a fork by its peer; kill -9 while the log
grows loses no checkpoint that was served. Cosignatures are checked here from the C2SP formats,
with code of the test's own."""

from __future__ import annotations

import base64
import hashlib
import time
from functools import partial
from typing import Any

import nacl.signing

from registry.did import public_key_from_did_key
from registry.keys import SigningKey
from tests.db.test_federation_process import (
    DEADLINE,
    Cluster,
    Node,
    publish,
    query,
    replicated,
    statuses,
)
from tests.registry.test_transparency import roots_from_proof


def checkpoint(node: Node, size: int | None = None) -> str:
    params = {} if size is None else {"treeSize": size}
    answer = node.http().get("/v1/log/checkpoint", params=params)
    assert answer.status_code == 200, answer.text
    return answer.text


def signers(note: str) -> dict[str, bytes]:
    """Each signature line's name and its decoded blob."""
    _, lines = note.split("\n\n", 1)
    out = {}
    for line in lines.rstrip("\n").split("\n"):
        name, blob = line.removeprefix("\u2014 ").split(" ")
        out[name] = base64.b64decode(blob)
    return out


def cosigned_by(note: str, witness: Node) -> bool:
    """Whether `note` carries a valid C2SP cosignature/v1 of `witness` (checked here)."""
    blob = signers(note).get(witness.did)
    if blob is None:
        return False
    body = note.split("\n\n", 1)[0] + "\n"
    public = public_key_from_did_key(witness.did)
    assert blob[:4] == hashlib.sha256(witness.did.encode() + b"\n\x04" + public).digest()[:4]
    timestamp = int.from_bytes(blob[4:12], "big")
    assert abs(timestamp - time.time()) < 600
    message = f"cosignature/v1\ntime {timestamp}\n{body}".encode()
    nacl.signing.VerifyKey(public).verify(message, blob[12:])
    return True


def cosigned_checkpoint(node: Node, witness: Node) -> str | None:
    note = checkpoint(node)
    return note if cosigned_by(note, witness) else None


def checkpoint_past(node: Node, size: int) -> str | None:
    note = checkpoint(node)
    return note if int(note.split("\n")[1]) > size else None


def witnessed_since(
    holder: Node, peer: Node, admin: SigningKey, size: int
) -> dict[str, Any] | None:
    status = log_of(holder, peer, admin)
    return status if status and status.get("treeSize", 0) >= size else None


def log_of(holder: Node, peer: Node, admin: SigningKey) -> dict[str, Any] | None:
    status: dict[str, Any] | None = statuses(holder, admin)[peer.did].get("log")
    return status


def test_three_peers_cosign_each_others_checkpoints(cluster3: Cluster) -> None:
    cluster = cluster3
    nodes = list(cluster.nodes.values())
    for node in nodes:
        publish(node, SigningKey.generate(), 1)
    for node in nodes:
        for witness in nodes:
            if witness is node:
                continue
            note = cluster.wait_until(
                f"{node.name}'s checkpoint cosigned by {witness.name}",
                partial(cosigned_checkpoint, node, witness),
                DEADLINE,
            )
            # the registry's own signature comes first, the witnesses' after it
            assert next(iter(signers(note))) == node.did
            status = cluster.wait_until(
                f"{witness.name} shows {node.name}'s log consistent",
                partial(witnessed_since, witness, node, cluster.admin, 1),
                DEADLINE,
            )
            assert status["state"] == "consistent"
            assert status["treeSize"] >= 1
    cluster.check_no_traceback()


def test_a_log_rewritten_behind_a_peers_back_is_a_fork_its_witness_quarantines(
    cluster2: Cluster,
) -> None:
    cluster = cluster2
    cluster.start("a", "b")
    a, b = cluster["a"], cluster["b"]
    [entry] = publish(b, SigningKey.generate(), 1)
    cluster.wait_until(
        "a replicates b's entry", partial(replicated, a, b, entry["entryDid"]), DEADLINE
    )
    cluster.wait_until(
        "a witnessed b's log",
        lambda: (log_of(a, b, cluster.admin) or {}).get("treeSize", 0) >= entry["sequence"],
        DEADLINE,
    )

    # b's history rewritten whole: a record changed, the tree and its checkpoints rebuilt.
    # a is stopped meanwhile: a log without checkpoints first signs the empty tree's (so there
    # is always one), and a pull in between would see the log shrink, a fork too, but not the
    # one this test is about.
    cluster.stop("a")
    accepted = query(a.database_url, "SELECT note FROM peer_checkpoints")[0]["note"]
    cluster.stop("b")
    query(
        b.database_url,
        "UPDATE log SET data = jsonb_set(data, '{name}', '\"Rewritten\"') WHERE seq = $1",
        entry["sequence"],
    )
    query(b.database_url, "DELETE FROM log_checkpoints")
    query(b.database_url, "DELETE FROM log_tiles")
    cluster.start("b")
    [grown] = publish(b, SigningKey.generate(), 1)  # a's next pull sees a grown, rewritten log
    cluster.wait_until(
        "b signed its rebuilt log",
        lambda: (
            query(b.database_url, "SELECT max(tree_size) AS size FROM log_checkpoints")[0]["size"]
            >= grown["sequence"]
        ),
        DEADLINE,
    )
    cluster.start("a")

    status = cluster.wait_until(
        "a finds b's log inconsistent",
        lambda: (s := log_of(a, b, cluster.admin)) and s["state"] == "inconsistent" and s,
        DEADLINE,
    )
    assert status["reason"] == "log_inconsistent"
    # The evidence is kept: the checkpoint a had accepted, the one b offered, the proof.
    [row] = query(a.database_url, "SELECT fork FROM peer_checkpoints WHERE peer_did = $1", b.did)
    import json

    fork = json.loads(row["fork"])
    assert fork["reason"] == "log_inconsistent"
    assert fork["accepted"] == accepted
    assert fork["offered"] != accepted
    assert "proof" in fork or "two roots" in fork["detail"]
    # The admin event: a peer.status record on a's log saying so.
    events = query(
        a.database_url,
        "SELECT data FROM log WHERE kind = 'peer.status' AND data -> 'log' ->> 'state' = $1",
        "inconsistent",
    )
    assert events
    cluster.check_no_traceback()


def test_kill_9_while_the_log_grows_loses_no_checkpoint_that_was_served(
    cluster2: Cluster,
) -> None:
    cluster = cluster2
    cluster.start("a")
    a = cluster["a"]
    key = SigningKey.generate()
    served: dict[int, str] = {}
    for _ in range(6):
        publish(a, key, 3)
        note = checkpoint(a)
        served[int(note.split("\n")[1])] = note
    cluster.kill("a")
    cluster.start("a")
    publish(a, key, 1)
    newest = cluster.wait_until(
        "a checkpoint past the restart", partial(checkpoint_past, a, max(served)), DEADLINE
    )
    size = int(newest.split("\n")[1])
    root = base64.b64decode(newest.split("\n")[2])
    for old_size, note in served.items():
        if old_size == 0:
            continue
        # still served, byte for byte (its own signature line; witnesses may have added theirs)
        assert checkpoint(a, old_size).startswith(note.split("\n\n")[0] + "\n\n")
        proof = (
            a.http()
            .get("/v1/log/proof/consistency", params={"from": old_size, "to": size})
            .json()["proof"]
        )
        old_root = base64.b64decode(note.split("\n")[2])
        path = [base64.b64decode(p) for p in proof]
        assert roots_from_proof(old_size, size, path, old_root) == (old_root, root)
