"""The PeerActors: one per federation peer, each pulling its peer's changes (design §9).

Theory of operation. Pulling is leader work: `run_federation` first takes the `federation`
leadership (a PostgreSQL advisory lock on a connection of its own), so of several `registry
serve` processes on one database exactly one pulls; if that connection is lost the run ends
(`Unavailable`) and `supervise` restarts it, competing for the lock again. As leader it runs one
`PeerActor` per configured peer allowed to `sync`, each in the same nursery.

A PeerActor drives the sans-IO rules of `registry/federation.py` and `registry/breaker.py`:

1. load the peer's durable state (cursor, breaker, head, quarantines) from the store;
2. wait while the breaker forbids a call (open: its cooldown; closed after failures: the
   jittered backoff);
3. send a signed `sync_request` for the changes after the cursor to the peer's endpoint (its
   self-registered one, else the configured one), within `request_timeout_seconds`;
4. verify the signed `sync_response` (bound to this request by its digest), the payload's
   shape and order, then every entry: verified ones become replicas of that origin, the others
   are quarantined with their reason;
5. store replicas, quarantines, the new cursor and status as one change of the append path
   (`peer.status`, compare-and-set on the cursor; its log record is the admin-only event);
6. at once again while the peer says `hasMore`, else after `poll_seconds`.

A failure (unreachable, timeout, an error status, a bad envelope or payload) is counted by the
breaker (5 in a row open it; its cooldown doubles up to 10 minutes) and recorded as a status
change. A 429 is back-pressure, not a failure: the actor waits for `Retry-After`. Nothing is
imported from an answer that fails any check, and the cursor only moves with what was stored.
"""

from __future__ import annotations

import json
import logging
import random
import re
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol
from urllib.parse import urlsplit

import httpx
import trio

from actors.supervisor import database_ready, supervise
from actors.witness import PeerWitness, WitnessDeps, WitnessSkipped
from registry.breaker import DEFAULT_POLICY, BreakerPolicy
from registry.canonical import parse_strict
from registry.changes import Change, IdemKey, Outcome
from registry.config import FederationConfig, PeerConfig
from registry.endpoints import EndpointPolicy, IPAddress, is_public, literal_address
from registry.envelope import build_request, verify_envelope
from registry.errors import Invalid, NotFound, RegistryError
from registry.federation import (
    PeerState,
    Quarantined,
    Replica,
    SyncAnswer,
    SyncAnswerInvalid,
    after_pull,
    read_sync_response,
    sort_entries,
    sync_request,
    within_checkpoint,
)
from registry.keys import SigningKey
from registry.store import FederationStore, HealthStore
from registry.usecases.federation import peer_state

log = logging.getLogger(__name__)

Append = Callable[[Change, IdemKey | None], Awaitable[Outcome]]
LEADERSHIP = "federation"
SYNC_PATH = "/v1/federation/sync"
MAX_RETRY_AFTER_SECONDS = 600.0  # a peer's Retry-After is honoured up to this
VERIFY_INLINE_ENTRIES = 32  # larger pages are verified in a worker thread


# --- the transport port --------------------------------------------------------------------


class PeerUnreachable(Exception):
    """The request got no HTTP answer (connection refused, reset, timed out, too large)."""


@dataclass(frozen=True)
class PeerAnswer:
    status: int
    body: bytes
    retry_after: float | None = None


class PeerTransport(Protocol):
    async def post(self, url: str, body: bytes) -> PeerAnswer:
        """POST a JSON body; raise `PeerUnreachable` when no HTTP answer came back."""
        ...

    async def get(self, url: str) -> PeerAnswer:
        """GET a public resource of the peer (its log's checkpoint and proofs)."""
        ...


class HttpTransport:
    """The transport over HTTP (httpx on Trio), answers capped at `max_bytes`."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        max_bytes: int,
        policy: Callable[[], EndpointPolicy] | None = None,
    ) -> None:
        self.client = client
        self.max_bytes = max_bytes
        self.policy = policy  # None: every destination (tests of the transport alone)

    async def _check_destination(self, url: str) -> None:
        """A registered endpoint's name is resolved before each request: one that resolves to
        a private or local address is refused (registry/endpoints.py). Hosts the operator's
        configuration names are not checked. (A name that changes its answer between this
        look-up and the client's own is not caught: document, don't pretend.)"""
        if self.policy is None:
            return
        policy = self.policy()
        if policy.names(url):
            return
        try:  # a configured endpoint is any string: `https://peer.example:99999` is a typo
            parts = urlsplit(url)
            host = (parts.hostname or "").lower()
            port = parts.port or 443
        except ValueError as exc:
            raise PeerUnreachable(f"the endpoint is not a URL: {exc}") from None
        literal = literal_address(host)
        addresses: list[IPAddress | None] = [literal]
        if literal is None:
            try:
                infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except (OSError, UnicodeError) as exc:  # UnicodeError: a name IDNA 2008 refuses
                raise PeerUnreachable(f"cannot resolve {host}: {exc}") from None
            addresses = [literal_address(str(info[4][0])) for info in infos]
        for address in addresses:
            if address is None or (  # (a scoped IPv6 address, say: not one to send to)
                not is_public(address)
                and not any(address in network for network in policy.networks)
            ):
                raise PeerUnreachable(f"{host} resolves to a private or local address")

    async def post(self, url: str, body: bytes) -> PeerAnswer:
        return await self._request("POST", url, body)

    async def get(self, url: str) -> PeerAnswer:
        return await self._request("GET", url, None)

    async def _request(self, method: str, url: str, body: bytes | None) -> PeerAnswer:
        await self._check_destination(url)
        headers = {"Accept-Encoding": "identity"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self.client.stream(
                method,
                url,
                content=body,
                # No compression: the size cap applies to what arrives, not to what it inflates to.
                headers=headers,
            ) as response:
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise PeerUnreachable(f"the answer exceeds {self.max_bytes} bytes")
                    chunks.append(chunk)
                return PeerAnswer(
                    response.status_code, b"".join(chunks), _retry_after(response.headers)
                )
        except PeerUnreachable:
            raise
        except Exception as exc:  # any failure to get an answer (HTTP, a URL httpx refuses, …)
            raise PeerUnreachable(f"{type(exc).__name__}: {exc}") from None

    async def call(self, url: str, body: bytes) -> tuple[int, bytes]:
        """`post` as the federated discovery's `DiscoverCall`."""
        answer = await self.post(url, body)
        return answer.status, answer.body


def _retry_after(headers: httpx.Headers) -> float | None:
    """Delay-seconds only (ASCII digits: `"²".isdigit()` is true, and `float` refuses it)."""
    value = headers.get("Retry-After", "")
    return float(value) if re.fullmatch(r"[0-9]{1,9}", value) else None


# --- the handle ------------------------------------------------------------------------------


class FederationHandle:
    """What outlives the actors' restarts: the peers as configured now (a reload replaces
    them), each peer's live state (written only by its own actor; readers take a copy), and
    whether this process leads."""

    def __init__(self, peers: Iterable[PeerConfig] = ()) -> None:
        self.peers: tuple[PeerConfig, ...] = tuple(peers)
        self.states: dict[str, PeerState] = {}
        self.leader = False
        self._changed = trio.Event()

    def live(self) -> dict[str, PeerState]:
        return dict(self.states) if self.leader else {}

    def reconfigure(self, peers: Iterable[PeerConfig]) -> None:
        """New peers from a configuration reload: actors start and stop to match."""
        self.peers = tuple(peers)
        self._changed.set()
        self._changed = trio.Event()

    async def changed(self) -> None:
        await self._changed.wait()


class PeerActorStore(FederationStore, HealthStore, Protocol):
    """What the PeerActors use: federation's state, and whether the database is back after an
    outage (their restarts' backoff asks it every second, as every actor's does)."""


@dataclass(frozen=True)
class PeerDeps:
    store: PeerActorStore
    append: Append
    key: SigningKey
    transport: PeerTransport
    config: FederationConfig  # timings and page size (the peers are the handle's)
    endpoint_of: Callable[[str], Awaitable[str]]
    handle: FederationHandle
    clock_ms: Callable[[], int]
    rand: Callable[[], float] = random.random
    policy: BreakerPolicy = DEFAULT_POLICY


async def run_federation(deps: PeerDeps) -> None:
    """Lead the PeerActors until cancelled (run it under `supervise`): while no peer may be
    pulled from, wait for a reload without taking the leadership."""
    handle = deps.handle
    while not _sync_peers(handle):
        await handle.changed()
    try:
        async with deps.store.leadership(LEADERSHIP) as leadership:
            handle.leader = True
            log.info("federation: this process pulls from its peers")
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    await leadership.lost()  # raises Unavailable: the run ends

                nursery.start_soon(watch)
                running: dict[str, tuple[PeerConfig, trio.CancelScope]] = {}
                while True:
                    wanted = _sync_peers(handle)
                    for did in list(running):
                        if wanted.get(did) != running[did][0]:
                            running.pop(did)[1].cancel()
                            handle.states.pop(did, None)
                            log.info("federation: stopped pulling from %s", did)
                    for did, peer in wanted.items():
                        if did not in running:
                            scope = await nursery.start(_run_scoped, deps, peer)
                            running[did] = (peer, scope)
                    await handle.changed()
    finally:
        handle.leader = False


def _sync_peers(handle: FederationHandle) -> dict[str, PeerConfig]:
    return {p.peer_did: p for p in handle.peers if "sync" in p.kinds}


async def _run_scoped(
    deps: PeerDeps, peer: PeerConfig, *, task_status: trio.TaskStatus[trio.CancelScope]
) -> None:
    with trio.CancelScope() as scope:
        task_status.started(scope)
        await supervise(
            f"peer {peer.peer_did[:24]}…",
            partial(run_peer, deps, peer),
            ready=database_ready(deps.store, writes=True),
        )


class _Failed(Exception):
    """One pull failed for a reason the breaker counts."""


async def run_peer(deps: PeerDeps, peer: PeerConfig) -> None:
    """One PeerActor: pull from `peer` until cancelled (see the module docstring).

    While the peer says `hasMore`, the request for the next page goes out as soon as a page
    arrives, so that fetching it overlaps verifying and storing this one; it is used only if
    this page's change stores the cursor it was asked from (else it is cancelled)."""
    did = peer.peer_did
    state = peer_state(await deps.store.get_peer(did), did, deps.policy)
    witness = PeerWitness.of(did, (await deps.store.peer_checkpoints()).get(did))
    if witness.accepted is not None:
        state = replace(state, witnessed_size=witness.accepted.size)
    deps.handle.states[did] = state
    settings = deps.config
    witnessing = WitnessDeps(
        deps.store,
        deps.key,
        deps.clock_ms,
        deps.endpoint_of,
        deps.transport.get,
        deps.transport.post,
    )
    if state.log_fork is not None or witness.fork is not None:
        log.error("federation: %s is quarantined: its log is inconsistent", did)
        detail = str((witness.fork or {}).get("detail", "the log is inconsistent"))
        deps.handle.states[did] = replace(state, log_fork=state.log_fork or detail)
        await trio.sleep_forever()  # nothing more is imported from a forked log
    async with trio.open_nursery() as nursery:
        ahead: _Fetch | None = None
        while True:
            now = deps.clock_ms()
            breaker = state.breaker
            # (A next attempt further away than any wait of the policy is due now: `due`.)
            wait_ms = 0 if breaker.due(now) else breaker.next_attempt_at_ms - now
            if wait_ms > 0 and (breaker.state != "closed" or breaker.consecutive_failures):
                await trio.sleep(wait_ms / 1000)
                continue
            if ahead is None and witness.due(state.cursor, settings.poll_seconds):
                try:
                    # Bounded as a pull is: a peer that trickles its checkpoint would otherwise
                    # hold this actor (no pull, no failure counted) for as long as it likes.
                    with trio.fail_after(deps.config.request_timeout_seconds):
                        fork = await witness.check(witnessing)
                except (
                    WitnessSkipped,
                    PeerUnreachable,
                    trio.TooSlowError,
                    Invalid,
                    NotFound,
                ) as exc:
                    # (Invalid: what the peer sent, the store refused to keep. NotFound: a
                    # reload removed the peer meanwhile, and this actor is being stopped.)
                    reason = "timed out" if isinstance(exc, trio.TooSlowError) else exc
                    log.info("federation: %s's log not checked this time: %s", did, reason)
                    fork = None
                if fork is not None:
                    forked = replace(state, log_fork=fork.detail)
                    await _record(deps, state, forked, [], [])
                    deps.handle.states[did] = forked
                    await trio.sleep_forever()
                if witness.accepted is not None:
                    state = replace(state, witnessed_size=witness.accepted.size)
                    deps.handle.states[did] = state
            # Pulled even when the accepted tree holds nothing new (the breaker keeps seeing
            # the peer's health); what lies past it is not imported (`within_checkpoint`).
            limit = witness.import_limit()
            state = replace(state, breaker=breaker.on_attempt(now))
            if ahead is not None and ahead.cursor == state.cursor:
                fetch, ahead = ahead, None
            else:
                if ahead is not None:
                    ahead.scope.cancel()
                    ahead = None
                fetch = _Fetch.start(nursery, deps, did, state.cursor, now)
            try:
                answer = await fetch.result()
            except _Failed as exc:
                log.warning("federation: pull from %s failed: %s", did, exc)
                state = await _record_failure(deps, state)
                continue
            except _BackPressure as exc:
                # Back-pressure is not an answer on the peer's health: the breaker stays as it
                # was before this attempt (a half-open trial is not used up by it).
                state = replace(state, breaker=breaker)
                deps.handle.states[did] = state
                await trio.sleep(exc.seconds)
                continue
            if limit is not None:
                answer = within_checkpoint(answer, limit, fetch.cursor)
            if answer.has_more:
                ahead = _Fetch.start(nursery, deps, did, answer.next_sequence, deps.clock_ms())
            # Verifying a page is ~0.2 ms of CPU an entry: large pages are verified in a worker
            # thread (PyNaCl releases the GIL while it checks a signature), so this process
            # keeps answering its own requests meanwhile.
            if len(answer.entries) > VERIFY_INLINE_ENTRIES:
                replicas, quarantined = await trio.to_thread.run_sync(sort_entries, answer.entries)
            else:
                replicas, quarantined = sort_entries(answer.entries)
            for q in quarantined:
                log.warning(
                    "federation: quarantined %s seq %d from %s: %s",
                    q.entry_did,
                    q.seq,
                    did,
                    q.code,
                )
            pulled = after_pull(state, answer, len(quarantined))
            pulled = replace(
                pulled, breaker=state.breaker.on_success(deps.clock_ms(), fetch.elapsed_ms)
            )
            try:
                state = await _record(deps, state, pulled, replicas, quarantined)
            except Invalid as exc:
                # A page the database refuses (a value no check above caught): a failed pull
                # of this peer, counted by its breaker, never the end of the process.
                log.error("federation: the database refused a page from %s: %s", did, exc)
                state = await _record_failure(deps, state)
                continue
            if answer.has_more and state.cursor == pulled.cursor:
                await trio.lowlevel.checkpoint()
                continue
            await trio.sleep(settings.poll_seconds)


class _Fetch:
    """One sync request in flight, from `cursor`: its answer, or the failure it met."""

    def __init__(self, cursor: int) -> None:
        self.cursor = cursor
        self.scope = trio.CancelScope()
        self.elapsed_ms = 0.0
        self._done = trio.Event()
        self._answer: SyncAnswer | None = None
        self._error: _Failed | _BackPressure | None = None

    @classmethod
    def start(
        cls, nursery: trio.Nursery, deps: PeerDeps, did: str, cursor: int, now_ms: int
    ) -> _Fetch:
        fetch = cls(cursor)
        request = build_request(
            deps.key,
            kind="sync_request",
            recipient_did=did,
            payload=sync_request(PeerState(did, cursor=cursor), deps.config.page_size),
            now_ms=now_ms,
        )
        nursery.start_soon(fetch._run, deps, did, request)
        return fetch

    async def _run(self, deps: PeerDeps, did: str, request: dict[str, object]) -> None:
        started = trio.current_time()
        with self.scope:
            try:
                self._answer = await _pull(deps, did, request, self.cursor)
            except (_Failed, _BackPressure) as exc:
                self._error = exc
        self.elapsed_ms = (trio.current_time() - started) * 1000
        self._done.set()

    async def result(self) -> SyncAnswer:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        if self._answer is None:  # cancelled: never awaited by the loop
            raise _Failed("the request was cancelled")
        return self._answer


class _BackPressure(Exception):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"retry after {seconds}s")
        self.seconds = seconds


async def _pull(deps: PeerDeps, did: str, request: dict[str, object], cursor: int) -> SyncAnswer:
    try:
        url = (await deps.endpoint_of(did)).rstrip("/") + SYNC_PATH
    except NotFound as exc:  # a reload removed the peer meanwhile: this actor is being stopped
        raise _Failed(exc.message) from None
    body = json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    try:
        with trio.fail_after(deps.config.request_timeout_seconds):
            got = await deps.transport.post(url, body)
    except trio.TooSlowError:
        raise _Failed("timed out") from None
    except PeerUnreachable as exc:
        raise _Failed(str(exc)) from None
    if got.status == 429:
        wait = got.retry_after if got.retry_after is not None else 1.0
        raise _BackPressure(min(wait, MAX_RETRY_AFTER_SECONDS))
    if got.status != 200:
        raise _Failed(f"answered {got.status}: {got.body[:200]!r}")
    try:
        # I-JSON, as a request to this registry is read: no duplicate member, no lone
        # surrogate or U+0000 (which a store refuses), no unsafe number.
        envelope = parse_strict(got.body)
        verified = verify_envelope(
            envelope,
            recipient_did=deps.key.did,
            now_ms=deps.clock_ms(),
            expected_kind="sync_response",
            request=dict(request),
            raw=got.body,
        )
        return read_sync_response(verified.payload, cursor)
    except (ValueError, RecursionError, RegistryError, SyncAnswerInvalid) as exc:
        raise _Failed(f"bad answer: {exc}") from None


async def _record_failure(deps: PeerDeps, state: PeerState) -> PeerState:
    """A failed pull of the peer: counted by its breaker, stored; the state that now holds."""
    failed = replace(state, breaker=state.breaker.on_failure(deps.clock_ms(), deps.rand()))
    return await _record(deps, state, failed, [], [])


async def _record(
    deps: PeerDeps,
    before: PeerState,
    after: PeerState,
    replicas: list[Replica],
    quarantined: list[Quarantined],
) -> PeerState:
    """Store a pull's outcome when it changes anything durable; the state that now holds."""
    now = deps.clock_ms()
    # A cursor that only moved over positions without entry versions is not a change worth a
    # log record: stored, it would move this registry's head, which its peers pull in turn, and
    # idle peers would write to each other forever. It is stored with the next real change.
    unchanged = (
        not replicas
        and not quarantined
        and after.breaker.state == before.breaker.state
        and after.breaker.consecutive_failures == before.breaker.consecutive_failures
        and after.log_fork == before.log_fork
    )
    if unchanged:
        deps.handle.states[after.peer_did] = after
        return after
    change = Change(
        "peer.status",
        None,
        {
            "peerDid": after.peer_did,
            "expectedCursor": before.stored_cursor,
            "cursor": after.cursor,
            "status": after.to_stored(),
            "replicas": [r.row() for r in replicas],
            "quarantined": [q.row() for q in quarantined],
        },
        event=after.status_json(now),
    )
    outcome = await deps.append(change, None)
    if outcome.refusal is not None:  # the cursor moved (another leader meanwhile): reload
        log.warning("federation: %s: %s; reloading", after.peer_did, outcome.refusal.message)
        after = peer_state(await deps.store.get_peer(after.peer_did), after.peer_did, deps.policy)
    else:
        # The store's count of quarantined entries (it may quarantine more than this page's
        # own: one origin per entry).
        stored = json.loads(outcome.unwrap())
        after = replace(after, stored_cursor=after.cursor, quarantines=stored["quarantines"])
    deps.handle.states[after.peer_did] = after
    return after
