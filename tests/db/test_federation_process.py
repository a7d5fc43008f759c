"""Federation across real `registry serve` processes on loopback (design §9, §12; spec 4.4, 4.5).

Each node is one process with its own database (created on the server of `database_url`, as
conftest creates its own), its own key file, and every other node of its cluster as a peer
(`sync` and `discover`, agreement `default`), pulling every 0.2 s. Ports are chosen before any
node starts, since each node's configuration names the others' endpoints. The three-node tests
share one cluster (starting processes is most of their time), each with entries of its own and
every node running at its start; the forgery test has two nodes of its own.

- three nodes: entries published on each reach the other two as replicas, byte for byte as the
  origin serves them, with `Registry-Origin: <origin DID>`; updates and deletes follow;
- kill -9 of one node while the others publish, then a restart on the same database and key:
  everything published meanwhile reaches it, what it had published reaches the others, nothing
  is lost or imported twice, and the others' status of it is closed with lag 0;
- a peer serving a forged version (signature no longer over the document): quarantined on the
  puller, never served, the rest of the page imported;
- federated discovery with a peer stopped (SIGSTOP: it accepts connections and never answers)
  answers within its time budget with `partial: true`, and with every peer up from all three;
- idle peers come to rest: once caught up, no node keeps appending to its log.

The processes are external: progress is read over HTTP and from the databases at short
intervals, each wait under a deadline.
"""

from __future__ import annotations

import json
import secrets
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx

from cli.client import RegistryClient, entry_path
from registry.canonical import canonicalize
from registry.keys import SigningKey, write_key_file
from registry.models import parse_datetime
from tests.db.proc import Server, free_port, query, run_server
from tests.helpers import entry_template

T = TypeVar("T")

POLL_SECONDS = 0.2
BUDGET_SECONDS = 2.0
# For replication. A peer refused at startup is retried after a backoff of up to 8 s; refused
# 5 times in a row (a node slow to start, or a restart slower than 7.5 s on a loaded machine)
# it is retried after the breaker's 30 s cooldown.
DEADLINE = 45.0
POLL = 0.05


# --- nodes -------------------------------------------------------------------------------------


@dataclass
class Node:
    name: str
    key: SigningKey
    port: int
    database_url: str
    data_dir: Path
    server: Server | None = None
    past_output: str = ""
    _http: httpx.Client | None = None

    @property
    def did(self) -> str:
        return self.key.did

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def key_file(self) -> Path:
        return self.data_dir / "node.key"

    def output(self) -> str:
        return self.past_output + (self.server.output() if self.server else "")

    def http(self) -> httpx.Client:
        """A client of this node kept for the reads (closed when the node stops)."""
        if self._http is None:
            self._http = httpx.Client(base_url=self.url, timeout=10)
        return self._http

    def close_http(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None


class Cluster:
    """Nodes that are each other's peers; each can be started, killed and restarted."""

    def __init__(self, tmp_path: Path, new_database: Callable[[], str], names: str) -> None:
        self.admin = SigningKey.generate()
        self.nodes: dict[str, Node] = {}
        for name in names:
            node = Node(name, SigningKey.generate(), free_port(), new_database(), tmp_path / name)
            write_key_file(node.key_file, node.key)
            self.nodes[name] = node
        self._running: dict[str, AbstractContextManager[Server]] = {}

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def env(self, node: Node) -> dict[str, str]:
        peers = [
            {
                "peer_did": other.did,
                "endpoint": other.url,
                "agreement_ids": ["default"],
                "kinds": ["sync", "discover"],
            }
            for other in self.nodes.values()
            if other is not node
        ]
        return {
            "REGISTRY_SERVER__KEY_FILE": str(node.key_file),
            "REGISTRY_FEDERATION__PEERS": json.dumps(peers),
            "REGISTRY_FEDERATION__POLL_SECONDS": str(POLL_SECONDS),
            "REGISTRY_FEDERATION__DISCOVER_BUDGET_SECONDS": str(BUDGET_SECONDS),
            "REGISTRY_AUTH__ADMIN_DIDS": json.dumps([self.admin.did]),
            # Peers polling a node every 0.2 s keep it in Hypercorn's graceful shutdown for the
            # whole timeout (10 s by default) on SIGTERM: keep the teardowns short.
            "REGISTRY_SERVER__GRACEFUL_TIMEOUT_SECONDS": "1",
        }

    def start(self, *names: str) -> None:
        """Start the named nodes at once (so peers are not long refused while the others are
        still starting) and wait until each is healthy."""
        managers = {
            name: run_server(
                self.nodes[name].data_dir,
                database_url=self.nodes[name].database_url,
                extra_env=self.env(self.nodes[name]),
                port=self.nodes[name].port,
            )
            for name in names
        }
        with ThreadPoolExecutor(len(managers)) as pool:
            futures = {name: pool.submit(cm.__enter__) for name, cm in managers.items()}
        failure: BaseException | None = None
        for name, future in futures.items():
            try:
                self.nodes[name].server = future.result()
                self._running[name] = managers[name]
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        for name in names:
            # free_port is a guess: make sure what answered the health check is this node.
            node = self.nodes[name]
            self.wait_until(
                f"{name} serving on its own port",
                lambda s=node.server, n=node: f"serving on {n.url}" in s.output(),
                10,
            )

    def heal(self) -> None:
        """Every node running again (after a test that failed with one stopped or killed)."""
        for name, node in self.nodes.items():
            if node.server is not None:
                if node.server.proc.poll() is None:
                    node.server.proc.send_signal(signal.SIGCONT)
                else:
                    self.stop(name)
        down = [name for name, node in self.nodes.items() if node.server is None]
        if down:
            self.start(*down)

    def stop(self, name: str) -> None:
        node = self.nodes[name]
        manager = self._running.pop(name)
        manager.__exit__(None, None, None)
        assert node.server is not None
        node.past_output += node.server.output()
        node.server = None
        node.close_http()

    def kill(self, name: str) -> None:
        server = self.nodes[name].server
        assert server is not None
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=10)
        assert server.proc.returncode == -signal.SIGKILL
        self.stop(name)

    def close(self) -> None:
        names = list(self._running)
        if names:
            with ThreadPoolExecutor(len(names)) as pool:
                list(pool.map(self.stop, names))

    def logs(self) -> str:
        return "\n".join(
            f"--- {n.name} ({n.did}) ---\n{n.output()[-4000:]}" for n in self.nodes.values()
        )

    def wait_until(self, what: str, probe: Callable[[], T | None], deadline_s: float) -> T:
        """Poll `probe` until it returns something other than None or False."""
        deadline = time.monotonic() + deadline_s
        while True:
            value = probe()
            if value is not None and value is not False:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {deadline_s}s: {what}\n{self.logs()}")
            time.sleep(POLL)

    def check_no_traceback(self) -> None:
        for node in self.nodes.values():
            assert "Traceback" not in node.output(), node.output()


# --- entries -----------------------------------------------------------------------------------


def publish(node: Node, key: SigningKey, count: int, **fields: Any) -> list[dict[str, Any]]:
    """`count` new entries of `key`'s publisher on `node`: the served entries."""
    tag = secrets.token_hex(4)
    with RegistryClient(node.url) as client:
        client.sign_in(key)
        return [
            client.publish(
                entry_template(f"did:web:federation.test:{node.name}:{tag}:{n}", **fields), key
            )
            for n in range(count)
        ]


def update(node: Node, key: SigningKey, entry: dict[str, Any]) -> dict[str, Any]:
    with RegistryClient(node.url) as client:
        client.sign_in(key)
        template = entry_template(entry["entryDid"], name="Renamed agent", version="1.0.1")
        return client.update(template, key, based_on=entry["sequence"])


def delete(node: Node, key: SigningKey, did: str) -> dict[str, Any]:
    with RegistryClient(node.url) as client:
        client.sign_in(key)
        return client.delete(did)


def get(node: Node, did: str, suffix: str = "") -> httpx.Response:
    return node.http().get(entry_path(did) + suffix)


def replicated(holder: Node, origin: Node, did: str) -> bool:
    """`holder` serves `did` as a replica of `origin`: the body byte for byte as the origin
    serves it (its latest version), with the origin's DID in `Registry-Origin`."""
    mine = get(holder, did)
    if mine.status_code != 200:
        return False
    theirs = get(origin, did)
    assert theirs.status_code == 200, theirs.text
    assert "Registry-Origin" not in theirs.headers  # the origin serves its own entry
    if mine.content != theirs.content:
        return False
    assert mine.headers["Registry-Origin"] == origin.did
    return True


def serves(holder: Node, did: str, sequence: int) -> bool:
    """`holder` serves the version `sequence` of `did` as its latest."""
    served = get(holder, did)
    return served.status_code == 200 and served.json()["sequence"] == sequence


def gone(holder: Node, origin: Node, did: str) -> bool:
    """The entry was deleted at its origin and `holder` no longer serves it."""
    assert get(origin, did).status_code == 404
    return get(holder, did).status_code == 404


def local_versions(node: Node) -> set[int]:
    """The sequences of every entry version `node` holds as origin (tombstones included)."""
    return {r["seq"] for r in query(node.database_url, "SELECT seq FROM entry_versions")}


def replica_versions(holder: Node, origin: Node) -> list[int]:
    rows = query(
        holder.database_url,
        "SELECT origin_seq FROM replica_versions WHERE origin_did = $1 ORDER BY origin_seq",
        origin.did,
    )
    return [r["origin_seq"] for r in rows]


def converged(cluster: Cluster) -> bool:
    """Every node holds exactly every other node's entry versions as replicas of it."""
    nodes = list(cluster.nodes.values())
    origin_versions = {n.name: local_versions(n) for n in nodes}
    for holder in nodes:
        for origin in nodes:
            if origin is holder:
                continue
            held = replica_versions(holder, origin)
            assert len(held) == len(set(held))
            if set(held) != origin_versions[origin.name]:
                return False
    return True


def statuses(node: Node, admin: SigningKey) -> dict[str, dict[str, Any]]:
    """`node`'s admin view of its peers (GET /v1/admin/federation/peers), by peer DID."""
    with RegistryClient(node.url) as client:
        client.sign_in(admin)
        return {s["peerDid"]: s for s in client.peer_status()}


def ms(rfc3339: str) -> int:
    return int(parse_datetime(rfc3339).timestamp() * 1000)


def log_head(node: Node) -> int:
    return int(query(node.database_url, "SELECT seq FROM log_head WHERE id = 1")[0]["seq"])


# --- tests -------------------------------------------------------------------------------------


def test_entries_published_on_each_node_reach_the_other_two_with_updates_and_deletes(
    cluster3: Cluster,
) -> None:
    cluster = cluster3
    nodes = list(cluster.nodes.values())
    keys = {n.name: SigningKey.generate() for n in nodes}
    published = {n.name: publish(n, keys[n.name], 3) for n in nodes}

    for origin in nodes:
        for holder in nodes:
            if holder is origin:
                continue
            for entry in published[origin.name]:
                cluster.wait_until(
                    f"{entry['entryDid']} of {origin.name} on {holder.name}",
                    partial(replicated, holder, origin, entry["entryDid"]),
                    DEADLINE,
                )

    # On each origin: update its first entry, delete its second (the third stays as it was).
    updated = {}
    for origin in nodes:
        first, second, _ = published[origin.name]
        updated[origin.name] = update(origin, keys[origin.name], first)
        assert updated[origin.name]["sequence"] > first["sequence"]
        tombstone = delete(origin, keys[origin.name], second["entryDid"])
        assert tombstone["lifecycleStatus"] == "deleted"

    for origin in nodes:
        first, second, third = published[origin.name]
        for holder in nodes:
            if holder is origin:
                continue
            cluster.wait_until(
                f"update of {origin.name} on {holder.name}",
                partial(serves, holder, first["entryDid"], updated[origin.name]["sequence"]),
                DEADLINE,
            )
            assert replicated(holder, origin, first["entryDid"])
            assert get(holder, first["entryDid"]).json()["name"] == "Renamed agent"
            # Both versions, as the origin lists them, and each one by its origin sequence.
            mine = get(holder, first["entryDid"], "/versions")
            theirs = get(origin, first["entryDid"], "/versions")
            assert mine.status_code == theirs.status_code == 200
            assert mine.headers["Registry-Origin"] == origin.did
            assert mine.json()["totalCount"] == theirs.json()["totalCount"] == 2
            assert mine.json()["versions"] == theirs.json()["versions"]
            for version in (first, updated[origin.name]):
                suffix = f"/versions/{version['sequence']}"
                one = get(holder, first["entryDid"], suffix)
                assert one.status_code == 200
                assert one.content == get(origin, first["entryDid"], suffix).content
                assert one.headers["Registry-Origin"] == origin.did

            cluster.wait_until(
                f"delete of {origin.name} on {holder.name}",
                partial(gone, holder, origin, second["entryDid"]),
                DEADLINE,
            )
            assert get(holder, second["entryDid"], "/versions").status_code == 404
            assert replicated(holder, origin, third["entryDid"])
    assert cluster.wait_until(
        "replica versions equal origin versions", lambda: converged(cluster), DEADLINE
    )
    cluster.check_no_traceback()


def test_a_killed_node_restarted_catches_up_and_is_caught_up_without_loss_or_duplicates(
    cluster3: Cluster,
) -> None:
    cluster = cluster3
    a, b, c = cluster["a"], cluster["b"], cluster["c"]
    keys = {name: SigningKey.generate() for name in "abc"}
    entries = {name: publish(cluster[name], keys[name], 2) for name in "abc"}
    cluster.wait_until("every node holds the others' entries", lambda: converged(cluster), DEADLINE)

    # C publishes and dies at once: A and B may not have pulled these yet.
    entries["c"] += publish(c, keys["c"], 3)
    cluster.kill("c")
    # Meanwhile A and B publish, update and delete.
    entries["a"] += publish(a, keys["a"], 3)
    entries["b"] += publish(b, keys["b"], 3)
    updated = update(a, keys["a"], entries["a"][0])
    deleted = entries["b"][0]["entryDid"]
    delete(b, keys["b"], deleted)
    # A federated query on A while C is dead: answered, partial, without C.
    with RegistryClient(a.url) as client:
        client.sign_in(keys["a"])
        federation = client.discover_federated({"entryType": "*"})["federation"]
    report = {p["peerDid"]: p for p in federation["peers"]}
    assert federation["partial"] is True, federation
    assert report[c.did]["status"] in ("failed", "skipped"), federation
    assert report[b.did]["status"] == "ok", federation
    assert c.did not in federation["origins"]
    assert b.did in federation["origins"]

    cluster.start("c")
    cluster.wait_until(
        "every node holds the others' entries after the restart",
        lambda: converged(cluster),
        DEADLINE,
    )

    # No loss: every write acknowledged before or during the outage is at its origin, hence
    # (converged) at the other two.
    written = [(name, e["sequence"]) for name in "abc" for e in entries[name]]
    written.append(("a", updated["sequence"]))
    for name, sequence in written:
        assert sequence in local_versions(cluster[name]), (name, sequence)

    for origin in (a, b, c):
        for holder in (a, b, c):
            if holder is origin:
                continue
            for entry in entries[origin.name]:
                did = entry["entryDid"]
                if did == deleted:
                    assert gone(holder, origin, did)
                    continue
                assert replicated(holder, origin, did), (holder.name, origin.name, did)
                mine = get(holder, did, "/versions").json()
                theirs = get(origin, did, "/versions").json()
                # Nothing imported twice: as many versions as at the origin, the same ones.
                assert mine["totalCount"] == theirs["totalCount"]
                assert mine["versions"] == theirs["versions"]
    assert get(b, updated["entryDid"]).json()["sequence"] == updated["sequence"]
    assert get(c, updated["entryDid"]).json()["sequence"] == updated["sequence"]

    heads = {n.name: max(local_versions(n)) for n in (a, b, c)}

    def recovered(node: Node, peer: Node) -> dict[str, Any] | None:
        status = statuses(node, cluster.admin)[peer.did]
        ok = (
            status["breakerState"] == "closed"
            and status["consecutiveFailures"] == 0
            and status["lag"] == 0
            and status["cursor"] >= heads[peer.name]
        )
        return status if ok else None

    for node, peer in ((a, c), (b, c), (c, a), (c, b)):
        status = cluster.wait_until(
            f"{node.name}'s status of {peer.name} recovered",
            partial(recovered, node, peer),
            DEADLINE,
        )
        assert status["quarantines"] == 0
        assert status.get("lastSuccessAt") is not None
    assert "Traceback" not in c.past_output
    cluster.check_no_traceback()


def test_a_forged_version_served_by_a_peer_is_quarantined_and_the_rest_of_the_page_imported(
    cluster2: Cluster,
) -> None:
    cluster = cluster2
    a, b = cluster["a"], cluster["b"]
    cluster.start("a")  # B is not running: nothing of A reaches it before the forgery
    key = SigningKey.generate()
    entries = publish(a, key, 5)
    kept, only = entries[0], entries[1]
    second = update(a, key, kept)
    # Forge two versions in A's database: another name under the publisher's old signature.
    # `kept` has an intact first version; `only` has no other version.
    forged = [second["sequence"], only["sequence"]]
    for seq in forged:
        [row] = query(a.database_url, "SELECT doc FROM entry_versions WHERE seq = $1", seq)
        doc = json.loads(row["doc"])
        doc["name"] = "Forged agent"
        text = canonicalize(doc).decode("utf-8")
        query(a.database_url, "UPDATE entry_versions SET doc = $2 WHERE seq = $1", seq, text)

    cluster.start("b")
    head = max(local_versions(a))

    def pulled() -> dict[str, Any] | None:
        status = statuses(b, cluster.admin).get(a.did)
        return status if status is not None and status["cursor"] >= head else None

    status = cluster.wait_until("B pulled A's page", pulled, DEADLINE)
    assert status["quarantines"] == len(forged), status
    assert status["breakerState"] == "closed"  # a forged entry is not a failed call

    # Not served: the entry with an intact earlier version reads as that version...
    served = get(b, kept["entryDid"])
    assert served.status_code == 200
    assert served.headers["Registry-Origin"] == a.did
    assert served.content == get(a, kept["entryDid"], f"/versions/{kept['sequence']}").content
    assert served.json()["name"] != "Forged agent"
    versions = get(b, kept["entryDid"], "/versions").json()
    assert [v["sequence"] for v in versions["versions"]] == [kept["sequence"]]
    assert versions["totalCount"] == 1
    assert get(b, kept["entryDid"], f"/versions/{second['sequence']}").status_code == 404
    # ...and the one without is not there at all.
    assert get(b, only["entryDid"]).status_code == 404
    # The rest of that page was imported.
    for entry in entries[2:]:
        assert replicated(b, a, entry["entryDid"])
    assert set(replica_versions(b, a)) == local_versions(a) - set(forged)
    rows = query(
        b.database_url,
        "SELECT origin_seq, entry_did, code FROM replica_quarantine WHERE origin_did = $1",
        a.did,
    )
    assert sorted(r["origin_seq"] for r in rows) == sorted(forged)
    assert {r["entry_did"] for r in rows} == {kept["entryDid"], only["entryDid"]}
    assert {r["code"] for r in rows} == {"signature_invalid"}
    assert "quarantined" in b.output()
    cluster.check_no_traceback()


def test_federated_discovery_is_partial_within_its_budget_while_a_peer_hangs(
    cluster3: Cluster,
) -> None:
    cluster = cluster3
    a, b, c = cluster["a"], cluster["b"], cluster["c"]
    tag = f"federated-{secrets.token_hex(4)}"  # this test's entries only, on the shared nodes
    origin_of = {
        entry["entryDid"]: node.did
        for node in (a, b, c)
        for entry in publish(node, SigningKey.generate(), 2, tags=[tag])
    }
    query_all = {"entryType": "*", "tags": [tag]}

    def check_complete(result: dict[str, Any]) -> None:
        federation = result["federation"]
        assert federation["federated"] is True
        assert federation["partial"] is False, federation
        assert federation["peersAttempted"] == federation["peersSucceeded"] == 2
        assert federation["peersFailed"] == 0
        dids = [e["entryDid"] for e in result["entries"]]
        assert sorted(dids) == sorted(origin_of)
        assert federation["origins"] == [origin_of[d] for d in dids]
        assert set(federation["origins"]) == {a.did, b.did, c.did}

    with RegistryClient(a.url) as client:
        client.sign_in(SigningKey.generate())
        check_complete(client.discover_federated(query_all))

        # C stopped: it accepts connections and never answers.
        assert c.server is not None
        c.server.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            result = client.discover_federated(query_all)
            elapsed = time.monotonic() - started
        finally:
            c.server.proc.send_signal(signal.SIGCONT)
        federation = result["federation"]
        report = {p["peerDid"]: p for p in federation["peers"]}
        assert federation["partial"] is True, federation
        assert federation["peersFailed"] >= 1, federation
        assert report[c.did]["status"] == "failed", report
        assert report[c.did]["reason"] == "time_budget", report
        assert report[b.did]["status"] == "ok", report
        assert BUDGET_SECONDS - 0.1 <= elapsed < BUDGET_SECONDS + 2, elapsed
        shown = {e["entryDid"] for e in result["entries"]}
        assert shown == {d for d, o in origin_of.items() if o != c.did}
        assert set(federation["origins"]) == {a.did, b.did}

        # C resumed: complete again.
        def complete() -> dict[str, Any] | None:
            found = client.discover_federated(query_all)
            return found if not found["federation"]["partial"] else None

        check_complete(cluster.wait_until("a complete answer", complete, DEADLINE))
    cluster.check_no_traceback()


def test_idle_peers_come_to_rest(cluster3: Cluster) -> None:
    """Once every node has pulled everything, an idle cluster writes nothing more.

    A pull that imports nothing and leaves the breaker as it was has nothing to record; yet
    when the served `nextSequence` follows the peer's log head (which the peer's own
    `peer.status` records move), each node's record of a pull moves the head its peers pull
    next, and the nodes append `peer.status` records to their logs forever, each poll
    (migration 0011: "changes do not loop between peers")."""
    cluster = cluster3
    nodes = list(cluster.nodes.values())
    for node in nodes:
        publish(node, SigningKey.generate(), 1)
    cluster.wait_until("every node holds the others' entries", lambda: converged(cluster), DEADLINE)
    pairs = [(node, peer) for node in nodes for peer in nodes if peer is not node]

    def caught_up(node: Node, peer: Node) -> bool:
        status = statuses(node, cluster.admin)[peer.did]
        return status["lag"] == 0 and status["consecutiveFailures"] == 0

    for node, peer in pairs:
        cluster.wait_until(
            f"{node.name} caught up with {peer.name}", partial(caught_up, node, peer), DEADLINE
        )
    heads = {n.name: log_head(n) for n in nodes}
    since_ms = int(time.time() * 1000)

    # Observe ten polls: every node pulled from every peer well after the snapshot.
    def polled_since(node: Node, peer: Node) -> bool:
        last = statuses(node, cluster.admin)[peer.did].get("lastSuccessAt")
        return last is not None and ms(last) >= since_ms + 10 * POLL_SECONDS * 1000

    for node, peer in pairs:
        cluster.wait_until(
            f"ten polls of {peer.name} by {node.name}", partial(polled_since, node, peer), DEADLINE
        )
    grown = {n.name: log_head(n) - heads[n.name] for n in nodes}
    kinds = {
        n.name: {
            r["kind"]: r["n"]
            for r in query(
                n.database_url,
                "SELECT kind, count(*) AS n FROM log WHERE seq > $1 GROUP BY kind",
                heads[n.name],
            )
        }
        for n in nodes
    }
    assert grown == {n.name: 0 for n in nodes}, f"idle nodes kept appending to their logs: {kinds}"
    cluster.check_no_traceback()
