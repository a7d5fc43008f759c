"""The PeerActors over the in-memory store and a fake peer registry, on virtual time: signed pages
become replicas in order (tombstones too) with the cursor and lag, forged entries are
quarantined with their code, answers that fail a check import nothing and count as failures,
the breaker's exact schedule (backoff, open, half-open trials, doubling cooldown, cap), 429 and
timeouts, durability across restarts and a cursor moved by another leader, the `peer.status`
records, and `run_federation` pulling only while it holds the `federation` leadership."""

from __future__ import annotations

import itertools
import json
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import pytest
import trio
import trio.testing

from actors.federation import (
    SYNC_PATH,
    FederationHandle,
    PeerAnswer,
    PeerDeps,
    PeerUnreachable,
    run_federation,
    run_peer,
)
from registry.breaker import Breaker
from registry.canonical import canonicalize
from registry.changes import Change, IdemKey, LogRecord, Outcome, rfc3339_ms
from registry.config import FederationConfig, PeerConfig
from registry.entries import sign_entry
from registry.envelope import build_response, verify_envelope
from registry.errors import Invalid, Unavailable
from registry.federation import PeerState, sort_entries
from registry.keys import SigningKey, b64url_encode
from registry.store import PeerRow, ReplicaVersion
from registry.store.memory import MemoryStore
from tests.helpers import entry_template, new_did

RAND = 0.5  # every jitter draw: the closed breaker's retries come 3/4 of 1, 2, 4, 8 s later
STATUS_KEYS = frozenset(
    {
        "peerDid",
        "breakerState",
        "consecutiveFailures",
        "cursor",
        "lag",
        "latencyMs",
        "lastSuccessAt",
        "nextAttemptAt",
        "quarantines",
    }
)
STATUS_REQUIRED = STATUS_KEYS - {"latencyMs", "lastSuccessAt", "nextAttemptAt"}
LONG = 4 * 3600.0  # the longest any wait here may take, in virtual seconds


def now_ms() -> int:
    return round(trio.current_time() * 1000)


def jcs(doc: dict[str, Any]) -> str:
    return canonicalize(doc).decode("utf-8")


# --- what a peer serves ------------------------------------------------------------------------


def version(publisher: SigningKey, seq: int, did: str, **fields: Any) -> dict[str, Any]:
    """An entry version as a peer serves it: signed by its publisher, with the peer's `sequence`
    and `anchorState` (registry-managed members, outside the signature)."""
    fields.setdefault("lifecycleStatus", "active")
    signed = sign_entry(entry_template(did, **fields), publisher)
    return {**signed, "sequence": seq, "anchorState": "pending"}


def tombstone(seq: int, did: str) -> dict[str, Any]:
    return {
        "deletedAt": "2026-11-02T00:00:00.000Z",
        "entryDid": did,
        "lifecycleStatus": "deleted",
        "sequence": seq,
    }


def forged(served: dict[str, Any], how: str) -> dict[str, Any]:
    """`served` altered after signing: a member under the signature, `itemData` (its hash no
    longer matches), or a tombstone whose `deletedAt` is not a date."""
    if how == "signature":
        return {**served, "name": "Not what the publisher signed"}
    if how == "item_data_hash":
        return {**served, "itemData": {**served["itemData"], "temperature": 1.5}}
    assert how == "tombstone"
    return {**tombstone(served["sequence"], served["entryDid"]), "deletedAt": 17}


Fault = Literal[
    "unreachable",  # PeerUnreachable: no HTTP answer
    "error",  # 500
    "hang",  # never answers (the actor's timeout must end the call)
    "wrong_key",  # the envelope claims the peer's key but another key signed it
    "impostor",  # a valid envelope from another DID than the one asked
    "wrong_digest",  # validly signed, but answers another request
    "out_of_order",  # the page's entries in descending sequence
    "stale",  # a proper answer, but dated more than 300 s ago
    "stuck",  # hasMore with no entry and nextSequence = fromSequence (no progress)
]
Scripted = Fault | PeerAnswer | None  # None: a proper answer; a PeerAnswer: sent as is


class FakePeer:
    """A peer registry behind `PeerTransport.post`. It checks each request as the real server
    does (a signed `sync_request` addressed to it, from the puller, a nonce never seen before)
    and answers a signed `sync_response` paging over `log` as `Federation.sync` does: entries
    after `fromSequence`, at most `maxEntries`, `nextSequence` the last one served if there is
    more, else the head. `script` says what to do on each next call (then `fault`, for every
    call after); `delay` is how long each call takes."""

    def __init__(self, puller: str, endpoint: str) -> None:
        self.key = SigningKey.generate()
        self.publisher = SigningKey.generate()  # who signs the entries this peer serves
        self.puller = puller
        self.endpoint = endpoint
        self.log: list[dict[str, Any]] = []
        self.head = 0
        self.script: deque[Scripted] = deque()
        self.fault: Scripted = None
        self.delay = 0.0
        self.calls: list[float] = []  # when each request came (virtual seconds)
        self.asked: list[int] = []  # the fromSequence of each
        self.max_entries: list[int] = []
        self.gate: trio.Event | None = None  # when set, a proper answer waits for it
        self._nonces: set[str] = set()
        self._called = trio.Event()

    @property
    def did(self) -> str:
        return self.key.did

    def serve(self, *docs: dict[str, Any], head: int | None = None) -> None:
        """Append served documents (in sequence order); the head moves to the last one, or to
        `head` (the peer's log has other records after it)."""
        for doc in docs:
            assert doc["sequence"] > self.head
            self.log.append(doc)
            self.head = doc["sequence"]
        self.head = max(self.head, head or 0)

    def entries(self, *seqs: int) -> list[dict[str, Any]]:
        """Serve a new active entry at each of `seqs`; return them."""
        made = [version(self.publisher, seq, new_did()) for seq in seqs]
        self.serve(*made)
        return made

    async def wait_calls(self, count: int, within: float = LONG) -> None:
        """Until `count` requests came, then until the actor is done with the last one."""
        with trio.fail_after(within):
            while len(self.calls) < count:
                await self._called.wait()
        await trio.testing.wait_all_tasks_blocked()

    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.calls)]

    async def post(self, url: str, body: bytes) -> PeerAnswer:
        assert url == self.endpoint + SYNC_PATH
        request = json.loads(body)
        verified = verify_envelope(
            request, recipient_did=self.did, now_ms=now_ms(), expected_kind="sync_request"
        )
        assert verified.sender_did == self.puller
        assert verified.nonce not in self._nonces, "a nonce is single use"
        self._nonces.add(verified.nonce)
        after, limit = verified.payload["fromSequence"], verified.payload["maxEntries"]
        assert set(verified.payload) == {"fromSequence", "maxEntries"}
        self.calls.append(trio.current_time())
        self.asked.append(after)
        self.max_entries.append(limit)
        self._called.set()
        self._called = trio.Event()
        what = self.script.popleft() if self.script else self.fault
        if self.delay:
            await trio.sleep(self.delay)
        if isinstance(what, PeerAnswer):
            return what
        if what == "unreachable":
            raise PeerUnreachable("ConnectError: connection refused")
        if what == "error":
            return PeerAnswer(500, b'{"code":"internal_error"}')
        if what == "hang":
            await trio.sleep_forever()
        if self.gate is not None:
            await self.gate.wait()
        return PeerAnswer(200, json.dumps(self.answer(request, after, limit, what)).encode())

    def answer(
        self, request: dict[str, Any], after: int, limit: int, what: Scripted
    ) -> dict[str, Any]:
        later = [doc for doc in self.log if doc["sequence"] > after]
        page, more = later[:limit], len(later) > limit
        head = max(self.head, after)
        payload = {
            "entries": page,
            "hasMore": more,
            "nextSequence": page[-1]["sequence"] if more else head,
            "headSequence": head,
        }
        if what == "out_of_order":
            assert len(page) > 1
            payload["entries"] = page[::-1]
        if what == "stuck":
            payload = {"entries": [], "hasMore": True, "nextSequence": after, "headSequence": head}
        signer, answered = self.key, request
        if what == "impostor":
            signer = SigningKey.generate()
        if what == "wrong_digest":
            answered = {**request, "payload": {"fromSequence": after + 1, "maxEntries": limit}}
        dated = now_ms() - (301_000 if what == "stale" else 0)
        envelope = build_response(
            signer, request=answered, kind="sync_response", payload=payload, now_ms=dated
        )
        if what == "wrong_key":
            unsigned = {k: v for k, v in envelope.items() if k != "signature"}
            envelope["signature"] = b64url_encode(
                SigningKey.generate().sign(canonicalize(unsigned))
            )
        return envelope


# --- the rig ----------------------------------------------------------------------------------


@dataclass
class Rig:
    """Our key, the store, the fake peers (routed by URL: the rig is the transport) and the
    federation settings naming them."""

    key: SigningKey
    store: MemoryStore
    peers: list[FakePeer]
    config: FederationConfig
    appended: list[tuple[Change, Outcome]] = field(default_factory=list)

    @property
    def peer(self) -> FakePeer:
        return self.peers[0]

    async def post(self, url: str, body: bytes) -> PeerAnswer:
        for peer in self.peers:
            if url.startswith(peer.endpoint + "/"):
                return await peer.post(url, body)
        raise PeerUnreachable(f"no route to {url}")

    async def get(self, url: str) -> PeerAnswer:
        """These fake peers serve no verifiable log (an older release): pulled from without
        witnessing (the witnessing is tested over real processes, tests/db)."""
        await trio.lowlevel.checkpoint()
        return PeerAnswer(404, b'{"error": {"code": "not_found"}}')

    async def endpoint_of(self, did: str) -> str:
        await trio.lowlevel.checkpoint()
        [endpoint] = [p.endpoint for p in self.config.peers if p.peer_did == did]
        return endpoint

    async def append(self, change: Change, idem: IdemKey | None) -> Outcome:
        [outcome] = await self.store.append([(change, idem)])
        self.appended.append((change, outcome))
        return outcome

    def deps(self, handle: FederationHandle, rand: Callable[[], float] = lambda: RAND) -> PeerDeps:
        return PeerDeps(
            store=self.store,
            append=self.append,
            key=self.key,
            transport=self,
            config=self.config,
            endpoint_of=self.endpoint_of,
            handle=handle,
            clock_ms=now_ms,
            rand=rand,
        )

    def replica_seqs(self) -> list[int]:
        """The `seq` of every replica the actors stored, in the order they stored them."""
        return [r["seq"] for change, _ in self.appended for r in change.rows["replicas"]]


def make_rig(
    peers: int = 1,
    *,
    kinds: list[list[Literal["sync", "discover"]]] | None = None,
    **settings: Any,
) -> Rig:
    key = SigningKey.generate()
    fakes = [FakePeer(key.did, f"https://peer{n}.example") for n in range(peers)]
    kinds = kinds or [["sync", "discover"]] * peers
    config = FederationConfig(
        peers=[
            PeerConfig(peer_did=f.did, endpoint=f.endpoint, kinds=k)
            for f, k in zip(fakes, kinds, strict=True)
        ],
        **{"poll_seconds": 5.0, "request_timeout_seconds": 10.0, **settings},
    )
    return Rig(key, MemoryStore(clock_ms=now_ms), fakes, config)


@asynccontextmanager
async def running(
    rig: Rig,
    handle: FederationHandle | None = None,
    rand: Callable[[], float] = lambda: RAND,
) -> AsyncIterator[FederationHandle]:
    """A PeerActor for the rig's first peer runs inside (entered once the actor is blocked:
    what it could do at once is done); leaving stops it wherever it was."""
    handle = handle or FederationHandle()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_peer, rig.deps(handle, rand), rig.config.peers[0])
        await trio.testing.wait_all_tasks_blocked()
        yield handle
        nursery.cancel_scope.cancel()


def live(handle: FederationHandle, peer: FakePeer) -> PeerState:
    return handle.states[peer.did]


async def peer_records(store: MemoryStore) -> list[LogRecord]:
    return [r for r in await store.log_after(0, 1_000_000) if r.kind == "peer.status"]


def status(
    peer: FakePeer,
    *,
    state: str = "closed",
    failures: int = 0,
    cursor: int = 0,
    lag: int = 0,
    latency: int | None = None,
    success_ms: int | None = None,
    next_ms: int | None = None,
    quarantines: int = 0,
) -> dict[str, Any]:
    """A FederationPeerStatus (spec 2.8), defaults those of a peer never reached; members
    without a value are omitted (spec §2)."""
    out: dict[str, Any] = {
        "peerDid": peer.did,
        "breakerState": state,
        "consecutiveFailures": failures,
        "cursor": cursor,
        "lag": lag,
        "quarantines": quarantines,
    }
    if latency is not None:
        out["latencyMs"] = latency
    if success_ms is not None:
        out["lastSuccessAt"] = rfc3339_ms(success_ms)
    if next_ms is not None:
        out["nextAttemptAt"] = rfc3339_ms(next_ms)
    return out


def approx(times: list[float]) -> Any:
    return pytest.approx(times, abs=1e-6)


# --- pulling ----------------------------------------------------------------------------------


async def test_pages_become_replicas_in_order_then_the_actor_polls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Five versions (an update and a tombstone among them) in pages of two: three requests at
    once (hasMore), the cursor ends at the head (other records follow the last entry), lag 0;
    then a request every `poll_seconds`, and what the peer published meanwhile comes with the
    next one."""
    rig = make_rig(page_size=2)
    peer, p = rig.peer, rig.peer.publisher
    a, b, c, d = (new_did() for _ in range(4))
    served = [
        version(p, 2, a, version="1.0.0"),
        version(p, 3, b),
        version(p, 5, a, version="1.1.0"),
        version(p, 6, c, lifecycleStatus="deprecated"),
        tombstone(8, a),
    ]
    peer.serve(*served, head=9)
    async with running(rig) as handle:
        await peer.wait_calls(3)
        assert peer.calls == approx([0, 0, 0])
        assert peer.asked == [0, 3, 6]
        assert set(peer.max_entries) == {2}
        assert rig.replica_seqs() == [2, 3, 5, 6, 8]
        state = live(handle, peer)
        assert (state.cursor, state.head, state.lag, state.quarantines) == (9, 9, 0, 0)
        records = await peer_records(rig.store)
        assert [(r.data["cursor"], r.data["lag"], r.at_ms) for r in records] == [
            (3, 6, 0),
            (6, 3, 0),
            (9, 0, 0),
        ]
        await trio.sleep_until(7.0)
        assert peer.calls == approx([0, 0, 0, 5])  # caught up: the next poll is 5 s later
        later = version(p, 11, d)
        peer.serve(later)
        await peer.wait_calls(6)
        assert peer.calls == approx([0, 0, 0, 5, 10, 15])
        assert peer.asked == [0, 3, 6, 9, 9, 11]
        assert rig.replica_seqs() == [2, 3, 5, 6, 8, 11]
        assert len(await peer_records(rig.store)) == 4  # the polls at 5 and 15 wrote nothing
        state = live(handle, peer)
        assert (state.cursor, state.head, state.lag) == (11, 11, 0)
    assert await rig.store.replica_head(a) == ReplicaVersion(peer.did, 8, "deleted", jcs(served[4]))
    # The versions of `a` as served (newest first), the tombstone not among them.
    assert await rig.store.replica_versions(a, peer.did, None, 10, 1 << 20) == (
        [jcs(served[2]), jcs(served[0])],
        2,
    )
    assert await rig.store.replica_head(b) == ReplicaVersion(peer.did, 3, "active", jcs(served[1]))
    assert await rig.store.replica_head(c) == ReplicaVersion(
        peer.did, 6, "deprecated", jcs(served[3])
    )
    assert await rig.store.replica_head(d) == ReplicaVersion(peer.did, 11, "active", jcs(later))
    row = await rig.store.get_peer(peer.did)
    assert row is not None
    assert (row.cursor, row.quarantines, row.status["head"]) == (11, 0, 11)
    assert row.status["breaker"]["state"] == "closed"


@pytest.mark.parametrize(
    ("how", "code"),
    [
        ("signature", "signature_invalid"),
        ("item_data_hash", "item_data_hash_mismatch"),
        ("tombstone", "tombstone_invalid"),
    ],
)
async def test_a_forged_entry_is_quarantined_and_the_rest_of_the_page_imported(
    autojump_clock: trio.testing.MockClock, how: str, code: str
) -> None:
    rig = make_rig()
    peer = rig.peer
    good = peer.entries(1)
    bad = forged(version(peer.publisher, 2, new_did()), how)
    peer.serve(bad)
    good += peer.entries(3)
    async with running(rig) as handle:
        await peer.wait_calls(1)
        assert rig.replica_seqs() == [1, 3]
        [(change, _)] = rig.appended
        [quarantined] = change.rows["quarantined"]
        assert quarantined["seq"] == 2
        assert quarantined["entryDid"] == bad["entryDid"]
        assert quarantined["code"] == code
        assert quarantined["doc"] == jcs(bad)
        state = live(handle, peer)
        assert (state.cursor, state.quarantines, state.breaker.consecutive_failures) == (3, 1, 0)
        [record] = await peer_records(rig.store)
        assert record.data == status(peer, cursor=3, latency=0, success_ms=0, quarantines=1)
        # Another forged one later: the counts add up.
        peer.serve(forged(version(peer.publisher, 4, new_did()), how))
        await peer.wait_calls(2)
        assert live(handle, peer).quarantines == 2
        assert live(handle, peer).cursor == 4
    assert await rig.store.replica_head(bad["entryDid"]) is None
    for doc in good:
        head = await rig.store.replica_head(doc["entryDid"])
        assert head is not None
        assert head.doc == jcs(doc)
    row = await rig.store.get_peer(peer.did)
    assert row is not None
    assert (row.cursor, row.quarantines) == (4, 2)
    assert (await peer_records(rig.store))[-1].data["quarantines"] == 2


@pytest.mark.parametrize(
    "fault",
    [
        "unreachable",
        "error",
        "wrong_key",
        "impostor",
        "wrong_digest",
        "stale",
        "out_of_order",
        pytest.param(PeerAnswer(200, b"<html>"), id="not_json"),
        pytest.param(PeerAnswer(200, b"[" * 200_000 + b"]" * 200_000), id="nested_too_deep"),
    ],
)
async def test_an_answer_that_fails_a_check_imports_nothing_and_is_one_failure(
    autojump_clock: trio.testing.MockClock, fault: Scripted
) -> None:
    """One bad answer: nothing stored but the failure (cursor 0), retried 0.75 s later (the
    first backoff, 1 s jittered at 0.5), which imports the page."""
    rig = make_rig()
    peer = rig.peer
    served = peer.entries(1, 2, 3)
    peer.script.append(fault)
    async with running(rig) as handle:
        await peer.wait_calls(1)
        assert rig.replica_seqs() == []
        assert [c.rows["cursor"] for c, _ in rig.appended] == [0]
        assert live(handle, peer).breaker.consecutive_failures == 1
        [record] = await peer_records(rig.store)
        assert record.data == status(peer, failures=1, next_ms=750)
        for doc in served:
            assert await rig.store.replica_head(doc["entryDid"]) is None
        row = await rig.store.get_peer(peer.did)
        assert row is not None
        assert row.cursor == 0
        await peer.wait_calls(2)
        assert peer.calls == approx([0, 0.75])
        assert peer.asked == [0, 0]
        assert rig.replica_seqs() == [1, 2, 3]
        state = live(handle, peer)
        assert (state.cursor, state.breaker.state, state.breaker.consecutive_failures) == (
            3,
            "closed",
            0,
        )


# --- the breaker --------------------------------------------------------------------------------


async def test_five_failures_open_the_breaker_and_its_cooldown_doubles_up_to_ten_minutes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rig = make_rig()
    peer = rig.peer
    peer.fault = "unreachable"
    async with running(rig) as handle:
        await peer.wait_calls(5)
        # Closed: retries after 0.75, 1.5, 3 and 6 s; the fifth failure opens the breaker.
        assert peer.calls == approx([0, 0.75, 2.25, 5.25, 11.25])
        state = live(handle, peer)
        assert state.breaker.state == "open"
        assert state.status_json(now_ms()) == status(peer, state="open", failures=5, next_ms=41_250)
        await trio.sleep_until(41.249)
        assert len(peer.calls) == 5  # no call during the cooldown
        assert live(handle, peer).status_json(41_250)["breakerState"] == "half_open"
        await peer.wait_calls(6)
        assert peer.calls[5] == pytest.approx(41.25)  # the half-open trial
        # The failed trial re-opens the breaker for 60 s.
        assert live(handle, peer).status_json(now_ms()) == status(
            peer, state="open", failures=6, next_ms=101_250
        )
        await peer.wait_calls(12)
        trials = [30.0, 60.0, 120.0, 240.0, 480.0, 600.0, 600.0]
        assert peer.gaps()[4:] == approx(trials)
        row = await rig.store.get_peer(peer.did)
        assert row is not None
        assert row.status["breaker"]["cooldownMs"] == 600_000
        assert row.status["breaker"]["consecutiveFailures"] == 12
        # The peer is back: the next trial closes the breaker and imports.
        peer.fault = None
        peer.entries(1, 2)
        await peer.wait_calls(13)
        assert peer.gaps()[-1] == pytest.approx(600.0)
        success_ms = now_ms()
        assert success_ms == 2_741_250
        assert rig.replica_seqs() == [1, 2]
        assert live(handle, peer).status_json(now_ms()) == status(
            peer, cursor=2, latency=0, success_ms=success_ms
        )
        row = await rig.store.get_peer(peer.did)
        assert row is not None
        assert row.status["breaker"]["state"] == "closed"
        assert row.status["breaker"]["consecutiveFailures"] == 0
        assert row.status["breaker"]["cooldownMs"] == 0
        # Failing again starts over: a 0.75 s backoff while closed, not a cooldown.
        peer.fault = "unreachable"
        await peer.wait_calls(15)
        assert peer.gaps()[-2:] == approx([5.0, 0.75])
        assert live(handle, peer).breaker.consecutive_failures == 2
    records = await peer_records(rig.store)
    assert len(records) == 15  # one per call: each changed the breaker
    assert [r.data["breakerState"] for r in records] == ["closed"] * 4 + ["open"] * 8 + [
        "closed"
    ] * 3
    assert [r.data["nextAttemptAt"] for r in records[4:12]] == [
        rfc3339_ms(round(t * 1000)) for t in [41.25, 101.25, 221.25, 461.25, 941.25, 1541.25]
    ] + [rfc3339_ms(2_141_250), rfc3339_ms(2_741_250)]


async def test_failures_while_closed_are_spaced_by_the_jittered_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One draw per failure: 1, 2, 4, 8 s with draws 0, 0.25, 0.5, 0.75 wait 0.5, 1.25, 3, 7 s;
    the fifth call succeeds and the next is a poll."""
    rig = make_rig()
    peer = rig.peer
    peer.entries(1)
    peer.script.extend(["error", "unreachable", "error", "unreachable"])
    draws = iter([0.0, 0.25, 0.5, 0.75])
    async with running(rig, rand=lambda: next(draws)) as handle:
        await peer.wait_calls(6)
    assert peer.gaps() == approx([0.5, 1.25, 3.0, 7.0, 5.0])
    assert list(draws) == []
    records = await peer_records(rig.store)
    assert [r.data.get("nextAttemptAt") for r in records] == [
        rfc3339_ms(500),
        rfc3339_ms(1750),
        rfc3339_ms(4750),
        rfc3339_ms(11_750),
        None,
    ]
    assert [r.data["consecutiveFailures"] for r in records] == [1, 2, 3, 4, 0]
    assert {r.data["breakerState"] for r in records} == {"closed"}
    assert live(handle, peer).cursor == 1


async def test_a_429_is_not_a_failure_and_the_actor_waits_retry_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """After one failure (retry at 0.75 s), seven 429s (more than would open the breaker): the
    first says Retry-After 7, the others none (1 s); the failure count stays 1 throughout."""
    rig = make_rig()
    peer = rig.peer
    peer.entries(1)
    peer.script.append("unreachable")
    peer.script.append(PeerAnswer(429, b'{"code":"rate_limited"}', retry_after=7.0))
    peer.script.extend([PeerAnswer(429, b"{}")] * 6)
    async with running(rig) as handle:
        await peer.wait_calls(5)
        state = live(handle, peer)
        assert (state.breaker.state, state.breaker.consecutive_failures) == ("closed", 1)
        assert len(await peer_records(rig.store)) == 1  # a 429 changes nothing durable
        await peer.wait_calls(9)
    assert peer.calls == approx([0, 0.75, 7.75, 8.75, 9.75, 10.75, 11.75, 12.75, 13.75])
    records = await peer_records(rig.store)
    assert [(r.at_ms, r.data["consecutiveFailures"]) for r in records] == [(0, 1), (13_750, 0)]
    assert rig.replica_seqs() == [1]


@pytest.mark.parametrize("seconds", [3.0, 10.0])
async def test_a_hanging_peer_times_out_as_a_failure(
    autojump_clock: trio.testing.MockClock, seconds: float
) -> None:
    rig = make_rig(request_timeout_seconds=seconds)
    peer = rig.peer
    peer.entries(1)
    peer.script.append("hang")
    async with running(rig) as handle:
        await trio.sleep_until(seconds - 0.001)
        assert await peer_records(rig.store) == []  # still waiting for the answer
        await peer.wait_calls(2)
        assert live(handle, peer).cursor == 1
    assert peer.calls == approx([0, seconds + 0.75])
    first, second = await peer_records(rig.store)
    assert first.at_ms == seconds * 1000
    assert first.data == status(peer, failures=1, next_ms=round((seconds + 0.75) * 1000))
    assert second.data["consecutiveFailures"] == 0


# --- durability ---------------------------------------------------------------------------------


async def test_a_restarted_actor_resumes_from_the_stored_cursor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Stopped while its third request hangs (two pages of two stored), a new actor over the
    same store asks from the stored cursor: each version is imported exactly once."""
    rig = make_rig(page_size=2)
    peer = rig.peer
    served = peer.entries(1, 2, 3, 4, 5, 6)
    peer.script.extend([None, None, "hang"])
    async with running(rig):
        await peer.wait_calls(3)
        assert rig.replica_seqs() == [1, 2, 3, 4]
        await trio.sleep(1.0)
    row = await rig.store.get_peer(peer.did)
    assert row is not None
    assert row.cursor == 4
    async with running(rig) as handle:
        await peer.wait_calls(5)
        assert peer.asked == [0, 2, 4, 4, 6]
        assert peer.calls[3] == pytest.approx(1.0)  # at once: the first run had no failure
        assert live(handle, peer).cursor == 6
    assert rig.replica_seqs() == [1, 2, 3, 4, 5, 6]
    for doc in served:
        head = await rig.store.replica_head(doc["entryDid"])
        assert head is not None
        assert (head.origin_seq, head.doc) == (doc["sequence"], jcs(doc))


async def test_a_restarted_actor_keeps_the_breaker_open(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Opened at 11.25 s (cooldown until 41.25 s), stopped at 20 s and restarted at 25 s: no
    call before 41.25 s; the failed trial doubles the stored cooldown; then the peer is back."""
    rig = make_rig()
    peer = rig.peer
    peer.fault = "unreachable"
    async with running(rig):
        await peer.wait_calls(5)
        await trio.sleep_until(20.0)
    await trio.sleep_until(25.0)
    async with running(rig) as handle:
        state = live(handle, peer)
        assert (state.breaker.state, state.breaker.consecutive_failures) == ("open", 5)
        assert state.status_json(now_ms())["nextAttemptAt"] == rfc3339_ms(41_250)
        await peer.wait_calls(6)
        assert peer.calls[5] == pytest.approx(41.25)
        peer.fault = None
        peer.entries(1)
        await peer.wait_calls(7)
        assert peer.calls[6] == pytest.approx(101.25)  # 60 s: the stored cooldown doubled
        state = live(handle, peer)
        assert (state.breaker.state, state.breaker.consecutive_failures, state.cursor) == (
            "closed",
            0,
            1,
        )


async def test_a_breaker_stored_by_a_clock_far_ahead_is_due_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A leader whose clock ran a day ahead stored the breaker open until a day from now (our
    clock). Waited out as stored, the peer was not pulled for a day; a next attempt further
    away than any wait of the policy (10 min) is due now: the trial goes at once."""
    rig = make_rig()
    peer = rig.peer
    peer.entries(1)
    day_ahead = Breaker(
        state="open",
        consecutive_failures=5,
        next_attempt_at_ms=now_ms() + 86_400_000,
        cooldown_ms=30_000,
    )
    ahead = PeerState(peer.did, breaker=day_ahead)
    [stored] = await rig.store.append(
        [
            (
                Change(
                    "peer.status",
                    None,
                    {
                        "peerDid": peer.did,
                        "expectedCursor": 0,
                        "cursor": 0,
                        "status": ahead.to_stored(),
                        "replicas": [],
                        "quarantined": [],
                    },
                    event=ahead.status_json(now_ms()),
                ),
                None,
            )
        ]
    )
    assert stored.refusal is None
    # As every process reads it (federated discovery, the peers' view, metrics): due.
    assert day_ahead.state_at(now_ms()) == "half_open"
    assert day_ahead.allows(now_ms())
    started = trio.current_time()
    async with running(rig) as handle:
        with trio.fail_after(1):
            await peer.wait_calls(1)
        assert peer.calls[0] == pytest.approx(started)
        await trio.testing.wait_all_tasks_blocked()
        assert live(handle, peer).cursor == 1


async def test_a_cursor_moved_by_another_leader_is_reloaded_not_overwritten(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """While our request is in flight, another leader stores the peer's first four versions
    (cursor 0 → 4). Our page (1..6) is refused by the compare-and-set on the cursor: nothing of
    it is written; the actor reloads and the next poll asks from 4."""
    rig = make_rig()
    peer = rig.peer
    served = peer.entries(1, 2, 3, 4, 5, 6)
    peer.gate = trio.Event()
    async with running(rig) as handle:
        await peer.wait_calls(1)
        replicas, _ = sort_entries(served[:4])
        theirs = PeerState(peer.did, cursor=4, head=6)
        [moved] = await rig.store.append(
            [
                (
                    Change(
                        "peer.status",
                        None,
                        {
                            "peerDid": peer.did,
                            "expectedCursor": 0,
                            "cursor": 4,
                            "status": theirs.to_stored(),
                            "replicas": [r.row() for r in replicas],
                            "quarantined": [],
                        },
                        event=theirs.status_json(now_ms()),
                    ),
                    None,
                )
            ]
        )
        assert moved.refusal is None
        peer.gate.set()
        peer.gate = None
        await trio.testing.wait_all_tasks_blocked()
        [(refused, outcome)] = rig.appended
        assert outcome.refusal is not None
        assert outcome.refusal.code == "peer_cursor_moved"
        assert live(handle, peer).cursor == 4
        await peer.wait_calls(2)
        assert peer.asked == [0, 4]
        assert peer.calls == approx([0, 5])
        assert rig.replica_seqs()[len(refused.rows["replicas"]) :] == [5, 6]
        assert live(handle, peer).cursor == 6
    for doc in served:
        head = await rig.store.replica_head(doc["entryDid"])
        assert head is not None
        assert head.origin_seq == doc["sequence"]
    row = await rig.store.get_peer(peer.did)
    assert row is not None
    assert row.cursor == 6


# --- the peer.status records --------------------------------------------------------------------


async def test_each_durable_change_is_one_peer_status_record_and_an_idle_poll_writes_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Each call takes 0.2 s: a failure at 0.2 s (retry at 0.95), an import at 1.15 s (latency
    200 ms), then idle polls that leave the log alone while the live state keeps up."""
    rig = make_rig()
    peer = rig.peer
    peer.delay = 0.2
    peer.entries(1, 2)
    peer.script.append("unreachable")
    async with running(rig) as handle:
        await peer.wait_calls(5)
        await trio.sleep(0.5)  # the last poll answered
        head = await rig.store.log_head()
        records = await peer_records(rig.store)
        assert len(records) == head == 2
        failure, imported = records
        assert failure.data == status(peer, failures=1, next_ms=950)
        assert failure.at_ms == 200
        assert imported.data == status(peer, cursor=2, latency=200, success_ms=1150)
        assert imported.at_ms == 1150
        for record, (change, outcome) in zip(records, rig.appended, strict=True):
            assert record.seq == outcome.sequence
            assert record.entry_did is None
            assert STATUS_REQUIRED <= set(record.data) <= STATUS_KEYS
            assert record.data == change.event
        assert peer.calls == approx([0, 0.95, 6.15, 11.35, 16.55])
        state = live(handle, peer)
        assert state.breaker.last_success_at_ms == 16_750  # live, though not written
        assert state.status_json(now_ms())["latencyMs"] == 200
        assert [r.data for r in await peer_records(rig.store)] == [failure.data, imported.data]
    row = await rig.store.get_peer(peer.did)
    assert row is not None
    assert row.status == {"breaker": row.status["breaker"], "head": 2}
    assert row.status["breaker"]["lastSuccessAtMs"] == 1150


# --- leadership ---------------------------------------------------------------------------------


async def test_run_federation_pulls_each_sync_peer_only_while_it_leads(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Someone else holds the `federation` leadership until 31 s: nothing is pulled. Then one
    actor per peer allowed to `sync` (a discover-only peer is never called): each at its own
    pace, the failing one backing off without disturbing the other."""
    rig = make_rig(3, kinds=[["sync"], ["sync", "discover"], ["discover"]])
    healthy, failing, discover_only = rig.peers
    healthy.entries(1, 2)
    failing.fault = "error"
    handle = FederationHandle(rig.config.peers)
    release = trio.Event()

    async def other_leader() -> None:
        async with rig.store.leadership("federation"):
            await release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_leader)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(run_federation, rig.deps(handle))
        await trio.sleep_until(31.0)
        assert [p.calls for p in rig.peers] == [[], [], []]
        assert not handle.leader
        assert handle.live() == {}
        release.set()
        await healthy.wait_calls(3)
        assert handle.leader
        start = 32.0  # its first try for the leadership (one every 2 s) after the release
        assert healthy.calls == approx([start, start + 5, start + 10])
        assert failing.calls[:4] == approx([start, start + 0.75, start + 2.25, start + 5.25])
        assert discover_only.calls == []
        assert set(handle.live()) == {healthy.did, failing.did}
        assert handle.live()[healthy.did].cursor == 2
        assert handle.live()[failing.did].breaker.consecutive_failures == len(failing.calls)
        nursery.cancel_scope.cancel()
    assert not handle.leader
    assert handle.live() == {}


async def test_losing_the_leadership_ends_the_run_with_unavailable_and_stops_pulling(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rig = make_rig(2)
    first, second = rig.peers
    first.entries(1)
    second.entries(1, 2)
    handle = FederationHandle(rig.config.peers)
    ended = trio.Event()

    async def run_once() -> None:
        try:
            await run_federation(rig.deps(handle))
        except* Unavailable:
            ended.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_once)
        await first.wait_calls(2)
        await second.wait_calls(2)
        assert handle.leader
        rig.store.break_leadership("federation")
        with trio.fail_after(1):
            await ended.wait()
        assert not handle.leader
        assert handle.live() == {}
        calls = [len(p.calls) for p in rig.peers]
        await trio.sleep(60)
        assert [len(p.calls) for p in rig.peers] == calls  # no actor outlived the run
    assert sorted(rig.replica_seqs()) == [1, 1, 2]  # 1 from the first peer, 1 and 2 from the other
    # A new run (as `supervise` would start) resumes where the first stopped.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_federation, rig.deps(handle))
        await first.wait_calls(calls[0] + 1)
        await second.wait_calls(calls[1] + 1)
        assert first.asked[-1] == 1
        assert second.asked[-1] == 2
        nursery.cancel_scope.cancel()


async def test_a_database_outage_restarts_the_peer_actor_without_losing_anything(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Writes fail for 10 s: each pull's append raises `Unavailable`, the actor restarts under
    `run_federation`'s supervision (from the stored cursor, so it asks from 0 again) and the
    run keeps its leadership; once writes succeed the page is stored exactly once."""
    rig = make_rig()
    peer = rig.peer
    peer.entries(1, 2, 3)
    rig.store.fail_writes = True
    handle = FederationHandle(rig.config.peers)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_federation, rig.deps(handle))
        await peer.wait_calls(3)
        assert rig.replica_seqs() == []
        await trio.sleep_until(10.0)
        rig.store.fail_writes = False
        await trio.sleep_until(60.0)
        assert handle.leader
        assert set(peer.asked[: peer.asked.index(3)]) == {0}
        assert handle.live()[peer.did].cursor == 3
        nursery.cancel_scope.cancel()
    assert rig.replica_seqs() == [1, 2, 3]


# --- found while writing these tests ------------------------------------------------------------


async def test_a_page_that_makes_no_progress_is_not_asked_again_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A peer answering `hasMore: true` with no entry and `nextSequence` = `fromSequence`
    (buggy or hostile) must not make the actor ask again at the same instant, forever."""
    rig = make_rig()
    peer = rig.peer
    peer.entries(1)
    peer.script.extend(["stuck"] * 50)
    async with running(rig):
        await peer.wait_calls(2)
    assert peer.calls[1] - peer.calls[0] >= 0.5, (
        f"{sum(1 for t in peer.calls if t == peer.calls[0])} requests at the same instant"
    )


async def test_a_429_answering_the_half_open_trial_waits_retry_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The module's rule: a 429 is back-pressure, the actor waits for Retry-After (5 s here),
    also when the 429 answers the half-open trial."""
    rig = make_rig()
    peer = rig.peer
    peer.entries(1)
    peer.script.extend(["unreachable"] * 5)
    peer.script.append(PeerAnswer(429, b"{}", retry_after=5.0))
    async with running(rig) as handle:
        await peer.wait_calls(7)
        assert live(handle, peer).cursor == 1
    assert peer.calls[5] == pytest.approx(41.25)  # the trial
    assert peer.calls[6] == pytest.approx(46.25)


async def test_a_reload_starts_and_stops_peer_actors_without_a_restart(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No peer at start: the federation lock is not even taken. A reload adding two peers
    starts their actors; one removing the first stops it (no call after), keeping the other."""
    rig = make_rig(2)
    first, second = rig.peers
    first.entries(1)
    (_, latest) = second.entries(1, 2)
    handle = FederationHandle()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_federation, rig.deps(handle))
        await trio.sleep(60)
        assert not handle.leader
        assert first.calls == second.calls == []
        handle.reconfigure(rig.config.peers)
        await first.wait_calls(1)
        await second.wait_calls(1)
        assert handle.leader
        handle.reconfigure([rig.config.peers[1]])
        await trio.testing.wait_all_tasks_blocked()
        stopped_at = len(first.calls)
        await second.wait_calls(len(second.calls) + 3)
        assert len(first.calls) == stopped_at
        assert set(handle.live()) == {second.did}
        replica = await rig.store.replica_head(latest["entryDid"])
        assert replica is not None
        assert replica.origin_did == second.did
        nursery.cancel_scope.cancel()


async def test_a_cursor_moved_only_over_the_peers_bookkeeping_is_not_written_until_a_change(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The peer's head moves over records that are no entry versions (e.g. its own
    `peer.status` records): the live cursor follows, nothing is written (else idle peers would
    write to each other forever); the next import stores it, compare-and-set on the cursor as
    stored."""
    rig = make_rig()
    peer = rig.peer
    peer.entries(1)
    async with running(rig) as handle:
        await peer.wait_calls(1)
        assert len(await peer_records(rig.store)) == 1  # the import of sequence 1
        peer.serve(head=5)  # four records of the peer's own, no entry version
        await peer.wait_calls(3)
        assert live(handle, peer).cursor == 5
        assert live(handle, peer).lag == 0
        assert len(await peer_records(rig.store)) == 1
        stored = await rig.store.get_peer(peer.did)
        assert stored is not None
        assert stored.cursor == 1
        peer.serve(version(peer.publisher, 6, new_did()))
        await peer.wait_calls(5)
        records = await peer_records(rig.store)
        assert len(records) == 2
        assert records[-1].data["cursor"] == 6
        stored = await rig.store.get_peer(peer.did)
        assert stored is not None
        assert stored.cursor == 6
        assert peer.asked[:3] == [0, 1, 5]  # from the live cursor, not the stored one


def test_retry_after_is_whole_ascii_seconds_only() -> None:
    from actors.federation import _retry_after

    assert _retry_after(httpx.Headers({"Retry-After": "7"})) == 7.0
    # As received: header bytes decoded as Latin-1 (b"\xb2" is "²", which isdigit() accepts).
    for odd in (b"\xb2", b"1.5", b"-1", b"Wed, 21 Oct 2026 07:28:00 GMT", b""):
        assert _retry_after(httpx.Headers([(b"Retry-After", odd)])) is None


async def test_an_entry_another_peer_already_brought_is_quarantined_not_imported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One origin per entry: a second peer serving the same DID (a tombstone, or an older
    signed version) cannot hide or roll back the first origin's replica."""
    rig = make_rig(2)
    first, second = rig.peers
    [original] = first.entries(1)
    second.serve(
        {
            "deletedAt": "2026-11-24T00:00:00.000Z",
            "entryDid": original["entryDid"],
            "lifecycleStatus": "deleted",
            "sequence": 1,
        }
    )
    handle = FederationHandle(rig.config.peers)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_peer, rig.deps(handle), rig.config.peers[0])
        await first.wait_calls(1)
        nursery.start_soon(run_peer, rig.deps(handle), rig.config.peers[1])
        await second.wait_calls(1)
        replica = await rig.store.replica_head(original["entryDid"])
        assert replica is not None
        assert (replica.origin_did, replica.lifecycle) == (first.did, "active")
        assert live(handle, second).quarantines == 1
        row = await rig.store.get_peer(second.did)
        assert row is not None
        assert row.quarantines == 1
        nursery.cancel_scope.cancel()


# --- what a hostile peer cannot do to the actor (review of the puller) -----------------------


async def test_a_checkpoint_request_that_never_answers_is_bounded_like_a_pull(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The witness round before a pull: a peer that never answers its checkpoint (or trickles
    it) held the actor there for good, with no pull and no failure counted. It is bounded by
    `request_timeout_seconds`, and the pull goes on (importing nothing its peer's witnessed
    checkpoint does not cover: none yet) and the round is tried again."""
    rig = make_rig(request_timeout_seconds=10.0)
    rig.peer.entries(1, 2)
    asked_at: list[float] = []

    async def hanging(url: str) -> PeerAnswer:
        asked_at.append(trio.current_time())
        await trio.sleep_forever()
        raise AssertionError

    rig.get = hanging  # type: ignore[method-assign]
    async with running(rig):
        await rig.peer.wait_calls(2)
        await trio.testing.wait_all_tasks_blocked()
    assert rig.peer.calls[0] - asked_at[0] == approx(10.0)  # pulled once the round timed out
    assert len(asked_at) >= 2  # and the next round is tried again
    assert rig.replica_seqs() == []  # nothing is imported past a witnessed checkpoint


async def test_a_page_the_store_refuses_is_a_failed_pull_not_the_end_of_the_actor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Whatever value no check caught, a page the database refuses (`Invalid`) is counted as a
    failed pull of that peer by its breaker; the actor goes on (it ended the process)."""
    rig = make_rig()
    rig.peer.entries(1)
    refused: list[int] = []
    store_append = rig.append

    async def append(change: Change, idem: IdemKey | None) -> Outcome:
        if change.rows.get("replicas") and len(refused) < 2:
            refused.append(len(change.rows["replicas"]))
            raise Invalid("the database cannot store a value of this request")
        return await store_append(change, idem)

    rig.append = append  # type: ignore[method-assign]
    async with running(rig) as handle:
        await rig.peer.wait_calls(3)  # refused twice, then taken
        await trio.testing.wait_all_tasks_blocked()
        assert live(handle, rig.peer).cursor == 1
    assert refused == [1, 1]
    assert rig.replica_seqs() == [1]
    failures = [r.data["consecutiveFailures"] for r in await peer_records(rig.store)]
    assert failures[:2] == [1, 2]
    assert failures[-1] == 0


async def test_a_checkpoint_holding_nul_is_not_witnessed() -> None:
    """A peer may sign any note: one holding U+0000 (here in its origin line) was accepted and
    then refused by PostgreSQL as a value it cannot keep, which ended the actor."""
    from actors.witness import PeerWitness, WitnessDeps, WitnessSkipped
    from registry.transparency import checkpoint_note

    peer = SigningKey.generate()
    note = checkpoint_note("registry\x00forged", 1, b"\x01" * 32, peer)

    async def get(url: str) -> PeerAnswer:
        await trio.lowlevel.checkpoint()
        return PeerAnswer(200, note.encode())

    async def endpoint_of(did: str) -> str:
        await trio.lowlevel.checkpoint()
        return "https://peer.example"

    async def post(url: str, body: bytes) -> PeerAnswer:
        raise AssertionError("nothing is cosigned")

    deps = WitnessDeps(
        MemoryStore(clock_ms=now_ms), SigningKey.generate(), now_ms, endpoint_of, get, post
    )
    witness = PeerWitness(peer.did)
    with pytest.raises(WitnessSkipped, match="U\\+0000"):
        await witness.check(deps)
    assert witness.accepted is None


async def test_a_witness_answer_nested_too_deep_is_a_skipped_round_not_the_end_of_the_actor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A peer's answer to the cosignature (and its consistency proof) was read with
    `json.loads`: JSON nested 100,000 deep raised RecursionError, which no one catches (a
    bug, for the supervisor), and so ended the PeerActor and the process. It is read under the
    I-JSON rules, as a sync answer is: a skipped witness round, and the pulls go on."""
    from registry.transparency import checkpoint_note

    rig = make_rig()
    rig.peer.entries(1, 2)
    nested = b"[" * 100_000 + b"]" * 100_000
    sizes = iter([1, 2])
    rounds: list[str] = []

    async def get(url: str) -> PeerAnswer:
        await trio.lowlevel.checkpoint()
        if "/v1/log/proof/consistency" in url:
            rounds.append("proof")
            return PeerAnswer(200, nested)
        size = next(sizes, 2)
        return PeerAnswer(
            200, checkpoint_note("peer", size, bytes([size]) * 32, rig.peer.key).encode()
        )

    async def post(url: str, body: bytes) -> PeerAnswer:
        if url.endswith("/v1/federation/cosignature"):
            rounds.append("cosignature")
            await trio.lowlevel.checkpoint()
            return PeerAnswer(200, nested)
        return await rig.peer.post(url, body)

    rig.get = get  # type: ignore[method-assign]
    rig.post = post  # type: ignore[method-assign]
    async with running(rig, rand=lambda: RAND):
        await rig.peer.wait_calls(3)
    assert rounds[:2] == ["cosignature", "proof"]


async def test_a_checkpoint_beyond_safe_integers_is_not_witnessed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A peer signs any tree size it likes: a first checkpoint of 2^60 records was accepted
    (it is a bigint), its size went into the peer's status (`log.treeSize`) and so into the
    next `peer.status` log record, which JCS cannot write (an integer beyond 2^53-1): the
    checkpointer, hashing that record into this registry's own tree, raised `Invalid` (a bug to
    the supervisor) and ended the process, then every restart after it. A tree size beyond
    2^53-1 is a checkpoint that does not hold (a skipped round, as a sync answer's sequences
    are held to I-JSON); the log records stay hashable."""
    from registry.transparency import checkpoint_note, leaves_of

    rig = make_rig()
    rig.peer.entries(1, 2)
    rig.peer.script.append("error")  # a failed pull, then a good one: two status records

    async def get(url: str) -> PeerAnswer:
        await trio.lowlevel.checkpoint()
        return PeerAnswer(200, checkpoint_note("peer", 2**60, b"\x01" * 32, rig.peer.key).encode())

    rig.get = get  # type: ignore[method-assign]
    async with running(rig) as handle:
        await rig.peer.wait_calls(2)
        assert live(handle, rig.peer).witnessed_size is None
    assert await rig.store.peer_checkpoints() == {}
    records = await peer_records(rig.store)
    assert [r.data["consecutiveFailures"] for r in records] == [1, 0]
    assert "log" not in records[-1].data
    assert len(leaves_of([(r, None) for r in records])) == 2  # the checkpointer can hash them


@pytest.mark.parametrize(
    "status",
    [
        pytest.param(
            {"breaker": {**Breaker().to_json(), "halfOpenTrials": 1}, "head": 9},
            id="a_newer_breaker",
        ),
        pytest.param({"breaker": {"state": "closed"}, "head": 9}, id="an_older_breaker"),
        pytest.param({"head": 9}, id="no_breaker"),
        pytest.param(None, id="json_null"),
        pytest.param([], id="not_an_object"),
    ],
)
async def test_a_stored_status_of_another_shape_does_not_end_the_actor(
    autojump_clock: trio.testing.MockClock, status: Any
) -> None:
    """A peer's stored status is read at every start of its PeerActor: a breaker another
    release wrote (one member more or less), none, or a status that is not an object raised
    ValueError or AttributeError there, a bug to the supervisor, which ended the process, and
    every restart after it read the same row. Such a breaker is read as a new one (closed, no
    failures); the cursor, a column, holds, and the next status stored is this release's."""

    rig = make_rig()
    rig.peer.entries(1, 2, 3)
    rig.store._tables.peers[rig.peer.did] = PeerRow(rig.peer.did, 2, status, 0)
    async with running(rig) as handle:
        await rig.peer.wait_calls(1)
        assert live(handle, rig.peer).breaker.state == "closed"
        assert live(handle, rig.peer).cursor == 3
    assert rig.peer.asked[0] == 2
    assert rig.replica_seqs() == [3]


async def test_a_reload_that_removes_a_peer_midway_through_a_lookup_stops_its_actor_cleanly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A reload (SIGHUP) that removes a peer while its PeerActor looks up the peer's endpoint
    (`Federation.endpoint_of`: a registered one in the store, else the configured one), the
    store's answer coming back before `run_federation` stops that actor: the configured one was
    `self.peers[did]` of the new configuration, a KeyError, a bug to the supervisor, which
    ended the process. A peer no longer configured is a failed lookup (`NotFound`), a failed
    pull of the actor that is being stopped."""
    from registry.changes import ChangeLog
    from registry.config import Config
    from registry.usecases.federation import PEER_RECORD, Federation

    rig = make_rig(2)
    first, second = rig.peers
    first.entries(1)
    second.entries(1)
    handle = FederationHandle(rig.config.peers)
    federation = Federation(
        store=rig.store,
        changes=ChangeLog(rig.append, rig.store),
        config=Config(),
        key=rig.key,
        peer_list=lambda: handle.peers,
    )
    rig.endpoint_of = federation.endpoint_of  # type: ignore[method-assign]
    lookup = rig.store.get_record
    reload_at_lookup = False

    async def get_record(kind: str, record_id: str) -> Any:
        found = await lookup(kind, record_id)
        if reload_at_lookup and kind == PEER_RECORD and record_id == first.did:
            # The reload took effect while the look-up was in flight; its answer is back first.
            handle.reconfigure([p for p in handle.peers if p.peer_did != first.did])
        return found

    rig.store.get_record = get_record  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_federation, rig.deps(handle))
        await first.wait_calls(1)
        await second.wait_calls(1)
        reload_at_lookup = True
        await second.wait_calls(3)
        assert set(handle.live()) == {second.did}
        assert len(first.calls) == 1
        nursery.cancel_scope.cancel()


class Restarts(MemoryStore):
    """Says when a PeerActor (re)starts: it reads its peer's stored state first."""

    def __init__(self) -> None:
        super().__init__(clock_ms=now_ms)
        self.started = trio.Event()

    async def get_peer(self, peer_did: str) -> PeerRow | None:
        self.started.set()
        self.started = trio.Event()
        return await super().get_peer(peer_did)


async def test_pulls_resume_within_a_second_or_two_of_a_long_outage_s_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The database down for minutes: the peer actor's restarts back off to 15-30 s, and the
    backoff asks every second whether the database is back (docs/faults.md), as every other
    actor's does. It did not: pulling resumed up to 30 s after the database, not in a second."""
    rig = make_rig()
    rig.store = store = Restarts()
    rig.peer.entries(1, 2, 3)
    handle = FederationHandle(rig.config.peers)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_federation, rig.deps(handle))
        store.fail_reads = store.fail_writes = True
        await trio.sleep_until(100.0)  # seven failures and more: each backoff is 15 s at least
        await store.started.wait()  # a restart (failing): the next is 15-30 s away
        store.fail_reads = store.fail_writes = False
        back = trio.current_time()
        await trio.sleep_until(back + 2.0)  # (virtual time)
        assert rig.replica_seqs() == [1, 2, 3]
        nursery.cancel_scope.cancel()
