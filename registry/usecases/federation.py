"""Federation: the sync a peer pulls, the peer list, a peer's self-registration, and the
operator view of peer status (spec 2.8, 2.9, 4.5; design §9, §12).

Sync (server side). `POST /v1/federation/sync` carries a signed `sync_request` envelope; the
checks run in this order, each with its own status and code:

1. the envelope itself (`registry.envelope.verify_envelope`: shape, version, algorithm, kind,
   keyId controlled by senderDid, recipient is this registry, timestamp within ±300 s, nonce
   form, requestDigest, signature) → 401;
2. the sender is a configured peer → 403 `peer_unknown`; allowed to sync (its `kinds`) → 403
   `peer_capability_missing`;
3. the payload (`fromSequence`, `maxEntries`, optional `agreementId`) → 400; the agreement is
   one of the peer's (or, absent, the peer has one) → 403 `agreement_unknown`;
4. the nonce was never used by this sender (stored durably until the window refuses a
   replay) → 401 `envelope_nonce_replayed`.

Only then is the page read: local entry versions (tombstones included, never replicas) after
`fromSequence`, at most `maxEntries` (clamped to 1,000) and about the federation body limit, with
`nextSequence` (send it back as the next `fromSequence`), `hasMore` and `headSequence` (the log
head when the page was read, for the puller's lag), signed as a `sync_response`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import idna
import trio

from registry.breaker import BreakerPolicy
from registry.canonical import canonicalize, join_members, parse_strict
from registry.changes import Change, ChangeLog, IdemKey, Outcome, rfc3339_ms
from registry.config import Config, PeerConfig
from registry.cursors import SealedCursors
from registry.did import public_key_from_did_key
from registry.discovery import parse_discover_request, query_fingerprint
from registry.endpoints import EndpointPolicy, endpoint_problem
from registry.envelope import (
    AGREEMENT_ID_RULE,
    MAX_SEQUENCE,
    VerifiedEnvelope,
    agreement_id_valid,
    build_request,
    build_response_text,
    clamp_max_entries,
    nonce_expiry_ms,
    sync_request_payload,
    verify_envelope,
)
from registry.errors import Forbidden, Invalid, NotFound, Unauthorized
from registry.federation import (
    PeerState,
    SourcePage,
    check_replica,
    in_merge_order,
    merge_pages,
)
from registry.keys import SigningKey
from registry.models import MAX_SAFE_INTEGER
from registry.query import MAX_OFFSET, OrderKey, effective_order
from registry.store import FederationStore, PeerRow, TransparencyStore, TrustStore
from registry.transparency import note_body, verify_cosignature
from registry.usecases.common import Principal, now_ms, page_size
from registry.usecases.records import body_object, put
from registry.usecases.transparency import stored_checkpoint

# A source's offset in a federated cursor once it has paged past MAX_OFFSET: it is done.
ENDED = -1

if TYPE_CHECKING:
    from registry.usecases.discovery import Discovery

log = logging.getLogger(__name__)

MAX_ENDPOINT = 2048
PEER_RECORD = "peer"
DISCOVER_PATH = "/v1/federation/discover"


class DiscoverCall(Protocol):
    async def __call__(self, url: str, body: bytes) -> tuple[int, bytes]:
        """POST a JSON body to a peer: (status, body); raise `OSError`-like errors when no
        answer came (any exception is taken as the peer's failure)."""
        ...


def peer_state(row: PeerRow | None, peer_did: str, policy: BreakerPolicy) -> PeerState:
    if row is None:
        return PeerState(peer_did)
    return PeerState.from_stored(
        peer_did, cursor=row.cursor, status=row.status, quarantines=row.quarantines, policy=policy
    )


class FederationUseStore(FederationStore, TrustStore, TransparencyStore, Protocol):
    """What federation reads: sync pages, nonces, peers' state, and the peer records."""


class Federation:
    def __init__(
        self,
        *,
        store: FederationUseStore,
        changes: ChangeLog,
        config: Config,
        key: SigningKey,
        policy: BreakerPolicy | None = None,
        live: Callable[[], dict[str, PeerState]] = dict,
        clock_ms: Callable[[], int] = now_ms,
        discovery: Discovery | None = None,
        call: DiscoverCall | None = None,
        peer_list: Callable[[], Sequence[PeerConfig]] | None = None,
    ) -> None:
        self.store = store
        self.changes = changes
        self.config = config
        self.key = key
        self.policy = policy or BreakerPolicy()
        self.live = live  # the PeerActors' current states in this process (if it leads them)
        self.clock_ms = clock_ms
        self.peer_list = peer_list or (lambda: config.federation.peers)
        self.discovery = discovery
        self.call = call
        self._cursors = SealedCursors(key.seed, b"registry federated cursor")

    @property
    def peers(self) -> dict[str, PeerConfig]:
        """The configured peers now (a configuration reload may change them)."""
        return {p.peer_did: p for p in self.peer_list()}

    # --- sync (the server side) -----------------------------------------------------------

    async def sync(self, envelope: Any) -> str:
        """Answer a signed sync request with the signed sync response (its JSON text)."""
        now = self.clock_ms()
        verified = verify_envelope(
            envelope, recipient_did=self.key.did, now_ms=now, expected_kind="sync_request"
        )
        peer = self.peer_allowed(verified.sender_did, "sync")
        after, max_entries, agreement = sync_request_payload(verified.payload)
        self.check_agreement(peer, agreement)
        await self._burn(verified)
        limit = clamp_max_entries(max_entries)
        budget = max(1024, self.config.limits.federation_body_bytes - 64 * 1024)
        page, head, more = await self.store.sync_page(after, limit, budget)
        next_sequence = page[-1][0] if more else max(head, after)
        payload = join_members(
            {
                "entries": "[" + ",".join(doc for _, doc in page) + "]",
                "hasMore": "true" if more else "false",
                "headSequence": str(head),
                "nextSequence": str(next_sequence),
            }
        )
        return build_response_text(
            self.key, request=envelope, kind="sync_response", payload_jcs=payload, now_ms=now
        )

    # --- witnessing: a peer's cosignature of this registry's checkpoint ----------------------

    async def cosignature(self, envelope: Any) -> str:
        """Keep a peer's cosignature of one of this registry's checkpoints (a signed
        `cosignature_request`, payload `{"treeSize", "cosignature"}`: the C2SP cosignature
        line, under the peer's DID as its name); answer a signed `cosignature_response`."""
        now = self.clock_ms()
        verified = verify_envelope(
            envelope, recipient_did=self.key.did, now_ms=now, expected_kind="cosignature_request"
        )
        peer = self.peer_allowed(verified.sender_did, "sync")
        payload = verified.payload
        size = payload.get("treeSize") if isinstance(payload, dict) else None
        line = payload.get("cosignature") if isinstance(payload, dict) else None
        if (
            not isinstance(size, int)
            or isinstance(size, bool)
            or not 0 <= size <= MAX_SEQUENCE
            or not isinstance(line, str)
            or len(line) > 1024
            or set(payload) != {"treeSize", "cosignature"}
        ):
            raise Invalid(
                "the payload is not {treeSize, cosignature}", code="cosignature_payload_invalid"
            )
        await self._burn(verified)
        body = note_body((await stored_checkpoint(self.store, size)).note)
        try:
            verify_cosignature(body, line, peer.peer_did, public_key_from_did_key(peer.peer_did))
        except ValueError as exc:
            raise Invalid(
                f"the cosignature does not hold: {exc}", code="cosignature_invalid"
            ) from None
        await self.store.add_cosignature(size, peer.peer_did, line)
        return build_response_text(
            self.key,
            request=envelope,
            kind="cosignature_response",
            payload_jcs=join_members({"accepted": "true", "treeSize": str(size)}),
            now_ms=now,
        )

    async def _burn(self, verified: VerifiedEnvelope) -> None:
        """Single use of the nonce (kept durably until the window refuses a replay)."""
        expires = nonce_expiry_ms(verified)
        if not await self.store.burn_nonce(verified.sender_did, verified.nonce, expires):
            raise Unauthorized(
                "federation envelope refused: this nonce was already used",
                code="envelope_nonce_replayed",
                details={"reason": "nonce_replayed"},
            )

    # --- federated discovery: the peer side -----------------------------------------------

    async def discover_for_peer(self, envelope: Any) -> str:
        """Answer a signed `discover_request` (payload `{query, agreementId?}`: `query` is a
        DiscoverRequest) with a signed `discover_response` of local entries
        (`{entries, hasMore, totalCount}`). The checks are those of sync, for `discover`."""
        now = self.clock_ms()
        verified = verify_envelope(
            envelope, recipient_did=self.key.did, now_ms=now, expected_kind="discover_request"
        )
        peer = self.peer_allowed(verified.sender_did, "discover")
        payload = verified.payload
        unknown = sorted(set(payload) - {"query", "agreementId"})
        if unknown or not isinstance(payload.get("query"), dict):
            raise Invalid(
                "a discover request payload is {query: DiscoverRequest, agreementId?}",
                code="discover_request_invalid",
                details={"members": unknown},
            )
        agreement = payload.get("agreementId")
        if not agreement_id_valid(agreement):  # as a sync request's
            raise Invalid(
                AGREEMENT_ID_RULE, code="discover_request_invalid", details={"field": "agreementId"}
            )
        self.check_agreement(peer, agreement)
        query = parse_discover_request(payload["query"])
        if query.cursor is not None:
            raise Invalid(
                "a peer query pages by offset, not cursor", code="discover_request_invalid"
            )
        await self._burn(verified)
        assert self.discovery is not None
        body = json.loads(await self.discovery.discover(query))
        answer = join_members(
            {
                "entries": "["
                + ",".join(canonicalize(e).decode("utf-8") for e in body["entries"])
                + "]",
                "hasMore": "true" if body["hasMore"] else "false",
                "totalCount": str(int(body["totalCount"])),
            }
        )
        return build_response_text(
            self.key, request=envelope, kind="discover_response", payload_jcs=answer, now_ms=now
        )

    # --- federated discovery: the querying side -------------------------------------------

    async def discover_federated(self, principal: Principal, data: Any) -> str:
        """POST /v1/discover/federated: the local page merged with each reachable peer's
        signed page (see docs/federation.md for the merge, the cursor and the metadata)."""
        principal.require("discover.federated")
        if not isinstance(data, dict):
            raise Invalid("the request must be a JSON object", code="invalid_query")
        if data.get("entryType") is None:  # required: null is no type
            raise Invalid(
                'entryType is required ("*" for all types)',
                code="invalid_query",
                details={"field": "entryType"},
            )
        offset = data.get("offset")
        if offset is not None and (type(offset) is not int or offset != 0):  # False is not 0
            raise Invalid(
                "a federated query pages with its cursor, not offset", code="invalid_offset"
            )
        base = {k: v for k, v in data.items() if k not in ("cursor", "offset")}
        query = parse_discover_request(base)  # 400 for anything a local query refuses
        limit = page_size(self.config.limits, query.limit)
        fingerprint = query_fingerprint(query)
        offsets: dict[str, int] = {}
        dropped: set[str] = set()
        if data.get("cursor") is not None:
            offsets, dropped = self._decode_cursor(fingerprint, data["cursor"])
        order = effective_order(query)[0]
        # Sources paged to their end: past offset 10,000 (MAX_OFFSET), a source shows no more
        # (its offset in the cursor is ENDED); it is not asked again.
        ended = {did for did, offset in offsets.items() if offset == ENDED}

        pages: list[SourcePage] = []
        if self.key.did not in ended:
            local_query = parse_discover_request(
                {**base, "offset": offsets.get(self.key.did, 0), "limit": limit}
            )
            assert self.discovery is not None
            local = json.loads(await self.discovery.discover(local_query))
            pages.append(
                SourcePage(
                    self.key.did,
                    tuple(canonicalize(e).decode("utf-8") for e in local["entries"]),
                    bool(local["hasMore"]),
                    int(local["totalCount"]),
                    offsets.get(self.key.did, 0),
                )
            )
        report: dict[str, dict[str, Any]] = {}
        now = self.clock_ms()
        states = self.live()
        rows = {r.peer_did: r for r in await self.store.list_peers()}
        callable_peers: list[str] = []
        peers = self.peers  # (the property builds the mapping anew: once, not once a peer)
        for did in sorted(peers):
            if "discover" not in peers[did].kinds:
                continue
            if did in dropped:
                report[did] = {"peerDid": did, "status": "failed", "reason": "failed_earlier"}
                continue
            if did in ended:  # it answered every page up to the bound: nothing is missing
                report[did] = {"peerDid": did, "status": "ok"}
                continue
            state = states.get(did) or peer_state(rows.get(did), did, self.policy)
            if state.breaker.state_at(now) == "open" or self.call is None:
                report[did] = {"peerDid": did, "status": "skipped", "reason": "breaker_open"}
                continue
            callable_peers.append(did)

        answers: dict[str, SourcePage] = {}

        async def ask(did: str) -> None:
            try:
                answers[did] = await self._ask_peer(
                    did, {**base, "offset": offsets.get(did, 0), "limit": limit}, order
                )
            except Exception as exc:  # any failure of a peer is its part missing, never a 5xx
                log.info("federated discovery: %s failed: %s", did, exc)
                report[did] = {"peerDid": did, "status": "failed", "reason": _reason(exc)}

        with trio.move_on_after(self.config.federation.discover_budget_seconds):
            async with trio.open_nursery() as nursery:
                for did in callable_peers:
                    nursery.start_soon(ask, did)
        for did in callable_peers:
            if did in answers:
                pages.append(answers[did])
                report[did] = {"peerDid": did, "status": "ok"}
            elif did not in report:
                report[did] = {"peerDid": did, "status": "failed", "reason": "time_budget"}

        shown, consumed = merge_pages(order, pages, limit)
        next_offsets = {did: ENDED for did in ended}
        for p in pages:
            offset = p.offset + consumed[p.origin]
            next_offsets[p.origin] = offset if offset <= MAX_OFFSET else ENDED
        more = any(
            p.has_more or consumed[p.origin] < len(p.entries)
            for p in pages
            if next_offsets[p.origin] != ENDED
        )
        failed = {d for d, r in report.items() if r["status"] != "ok"}
        body: dict[str, str] = {
            "entries": "[" + ",".join(text for text, _ in shown) + "]",
            "hasMore": "true" if more else "false",
            "totalCount": str(sum(p.total for p in pages)),
            "federation": canonicalize(
                {
                    "federated": True,
                    "partial": bool(failed),
                    "peersAttempted": len(callable_peers),
                    "peersSucceeded": len(answers),
                    "peersFailed": len(callable_peers) - len(answers),
                    "peers": [report[d] for d in sorted(report)],
                    "origins": [origin for _, origin in shown],
                }
            ).decode("utf-8"),
        }
        if more:
            cursor = self._encode_cursor(fingerprint, next_offsets, dropped | failed)
            body["cursor"] = canonicalize(cursor).decode("utf-8")
        return join_members(body)

    async def _ask_peer(self, did: str, query: dict[str, Any], order: OrderKey) -> SourcePage:
        assert self.call is not None
        request = build_request(
            self.key,
            kind="discover_request",
            recipient_did=did,
            payload={"query": query},
            now_ms=self.clock_ms(),
        )
        url = (await self.endpoint_of(did)).rstrip("/") + DISCOVER_PATH
        status, raw = await self.call(
            url, json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        )
        if status != 200:
            raise PeerRefused(f"answered {status}")
        verified = verify_envelope(
            parse_strict(raw),  # I-JSON: no lone surrogate (no UTF-8 form), no duplicate
            recipient_did=self.key.did,
            now_ms=self.clock_ms(),
            expected_kind="discover_response",
            request=request,
            raw=raw,
        )
        payload = verified.payload
        entries, more, total = (
            payload.get("entries"),
            payload.get("hasMore"),
            payload.get("totalCount"),
        )
        if (
            not isinstance(entries, list)
            or not isinstance(more, bool)
            or not isinstance(total, int)
            or isinstance(total, bool)
            or len(entries) > int(query["limit"])
        ):
            raise PeerRefused("the discover response payload is malformed")
        texts = []
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("sequence"), int):
                raise PeerRefused("an entry of the discover response is malformed")
            replica = check_replica(entry)  # Invalid: the peer served an entry that fails
            texts.append(replica.doc)
        if more and not entries:  # a next page would be asked at the same offset: endless
            raise PeerRefused("the peer says it has more but answered no entry")
        total = min(max(total, 0), MAX_SAFE_INTEGER)  # a peer's word: bounded
        page = SourcePage(did, tuple(texts), more, total, int(query.get("offset", 0)))
        if not in_merge_order(order, page):
            raise PeerRefused("the peer's page is not in the query's order")
        return page

    def _encode_cursor(self, fingerprint: str, offsets: dict[str, int], dropped: set[str]) -> str:
        position = {"v": 1, "q": fingerprint, "n": offsets, "x": sorted(dropped)}
        return self._cursors.seal(position, sort_keys=True)

    def _decode_cursor(self, fingerprint: str, cursor: Any) -> tuple[dict[str, int], set[str]]:
        bad = Invalid(
            "cursor is not one this server issued for this federated query",
            code="invalid_cursor",
        )
        # No length bound but the body's (limits.query_body_bytes): the cursor names every
        # peer that failed, so it grows with the peers configured (~80 characters each), and
        # one this server issued must always be taken back. The seal refuses any other.
        if not isinstance(cursor, str) or not cursor:
            raise bad
        data = self._cursors.open(cursor, bad)
        if not isinstance(data, dict) or data.get("v") != 1 or data.get("q") != fingerprint:
            raise bad
        offsets, dropped = data.get("n"), data.get("x")
        if not isinstance(offsets, dict) or not isinstance(dropped, list):
            raise bad
        if not all(
            isinstance(v, int) and (0 <= v <= MAX_OFFSET or v == ENDED) for v in offsets.values()
        ):
            raise bad
        return {str(k): int(v) for k, v in offsets.items()}, {str(d) for d in dropped}

    def peer_allowed(self, sender_did: str, kind: str) -> PeerConfig:
        peer = self.peers.get(sender_did)
        if peer is None:
            raise Forbidden(
                "the sender is not a federation peer of this registry",
                code="peer_unknown",
                details={"peerDid": sender_did},
            )
        if kind not in peer.kinds:
            raise Forbidden(
                f"this peer may not {kind} with this registry",
                code="peer_capability_missing",
                details={"peerDid": sender_did, "capability": kind},
            )
        return peer

    @staticmethod
    def check_agreement(peer: PeerConfig, agreement: str | None) -> None:
        if agreement is None and peer.agreement_ids:
            return
        if agreement is None or agreement not in peer.agreement_ids:
            raise Forbidden(
                "no active agreement with this peer"
                if agreement is None
                else f"agreement {agreement[:80]!r} is not active with this peer",
                code="agreement_unknown",
                details={"peerDid": peer.peer_did},
            )

    # --- the peer list --------------------------------------------------------------------

    async def list_peers(self) -> list[dict[str, Any]]:
        """FederationPeer of every configured peer (spec 2.8), in peerDid order: its endpoint
        as it registered it (else as configured) and when it was last seen."""
        peers = self.peers  # as configured when the request came: a reload may come meanwhile
        rows = {r.peer_did: r for r in await self.store.list_peers()}
        out = []
        for did in sorted(peers):
            out.append(await self._peer_json(peers[did], rows.get(did)))
        return out

    async def _peer_json(self, peer: PeerConfig, row: PeerRow | None) -> dict[str, Any]:
        did = peer.peer_did
        registered = await self.store.get_record(PEER_RECORD, did)
        doc = json.loads(registered.doc) if registered is not None else {}
        seen = [doc.get("registeredAtMs")]
        state = self.live().get(did) or peer_state(row, did, self.policy)
        seen.append(state.breaker.last_success_at_ms)
        last_seen = max((s for s in seen if isinstance(s, int)), default=None)
        out: dict[str, Any] = {
            "peerDid": did,
            "endpoint": doc.get("endpoint", peer.endpoint),
            "agreementIds": list(peer.agreement_ids),
        }
        if doc.get("grpcEndpoint"):  # optional members are omitted when empty (spec §2)
            out["grpcEndpoint"] = doc["grpcEndpoint"]
        if last_seen is not None:
            out["lastSeen"] = rfc3339_ms(last_seen)
        return out

    async def endpoint_of(self, did: str) -> str:
        """Where to reach a peer: its self-registered endpoint, else the configured one;
        `NotFound` for a peer no longer configured (a reload removed it meanwhile)."""
        registered = await self.store.get_record(PEER_RECORD, did)
        if registered is not None:
            return str(json.loads(registered.doc)["endpoint"])
        peer = self.peers.get(did)
        if peer is None:
            raise NotFound(f"{did} is no longer a configured peer", code="peer_unknown")
        return peer.endpoint

    async def update_self(self, principal: Principal, data: Any, idem: IdemKey | None) -> Outcome:
        """PUT /v1/federation/peers/self: a peer registers where it can be reached."""

        async def decide() -> Change:
            principal.require("federation")
            peers = self.peers  # as configured when the request came: a reload may come meanwhile
            if principal.did not in peers:
                raise Forbidden(
                    "the signed-in principal is not a federation peer of this registry",
                    code="peer_unknown",
                    details={"peerDid": principal.did},
                )
            body = body_object(
                data, required={"endpoint"}, optional={"grpcEndpoint"}, code="peer_invalid"
            )
            policy = EndpointPolicy.of(
                allow_http=self.config.federation.allow_http_endpoints,
                configured=[p.endpoint for p in peers.values()],
                allowed=self.config.federation.allowed_endpoint_hosts,
            )
            endpoint = _url(body, "endpoint", required=True, policy=policy)
            grpc = _url(body, "grpcEndpoint", required=False, policy=policy)
            current = await self.store.get_record(PEER_RECORD, principal.did)
            registered = self.clock_ms()
            doc = {
                "endpoint": endpoint,
                "grpcEndpoint": grpc,
                "peerDid": principal.did,
                "registeredAtMs": registered,
            }
            row = put(
                PEER_RECORD,
                principal.did,
                based_on=current,
                entry_did=principal.did,
                owner_did=principal.did,
                status="active",
                doc=doc,
            )
            peer = peers[principal.did]
            result = {
                "agreementIds": list(peer.agreement_ids),
                "endpoint": endpoint,
                "lastSeen": rfc3339_ms(registered),
                "peerDid": principal.did,
            }
            if grpc:
                result["grpcEndpoint"] = grpc
            return Change(
                "peer.updated",
                None,
                {"puts": [row], "result": canonicalize(result).decode("utf-8")},
                event={"peerDid": principal.did, "endpoint": endpoint},
            )

        return await self.changes.submit(idem, decide)

    # --- the operator view ----------------------------------------------------------------

    async def health(self) -> str:
        """The deep health check of the peers: `ok`, or how many have an open breaker and how
        many a forked log (nothing more is imported from those, though their breaker stays
        closed)."""
        peers = self.peers
        if not peers:
            return "ok"
        rows = {r.peer_did: r for r in await self.store.list_peers()}
        live = self.live()
        now = self.clock_ms()
        states = [live.get(did) or peer_state(rows.get(did), did, self.policy) for did in peers]
        forked = sum(1 for s in states if s.log_fork is not None)
        down = sum(1 for s in states if s.log_fork is None and s.breaker.state_at(now) != "closed")
        problems = []
        if down:
            problems.append(f"{down} of {len(peers)} peers unreachable (breaker open)")
        if forked:
            problems.append(f"{forked} of {len(peers)} peers quarantined (log forked)")
        return "degraded: " + "; ".join(problems) if problems else "ok"

    async def statuses(self, principal: Principal, *, quarantined: int = 0) -> list[dict[str, Any]]:
        """FederationPeerStatus of every configured peer (admin); with `quarantined`, each
        also lists its latest quarantined entries (`quarantined` at most) and why."""
        principal.require("admin")
        rows = {r.peer_did: r for r in await self.store.list_peers()}
        live = self.live()
        now = self.clock_ms()
        out = []
        for did in sorted(self.peers):
            status = (live.get(did) or peer_state(rows.get(did), did, self.policy)).status_json(now)
            if quarantined:
                status["quarantined"] = [
                    {
                        "sequence": q.origin_seq,
                        "entryDid": q.entry_did,
                        "code": q.code,
                        "reason": q.reason,
                    }
                    for q in await self.store.quarantined(did, quarantined)
                ]
            out.append(status)
        return out


def _url(body: dict[str, Any], name: str, *, required: bool, policy: EndpointPolicy) -> str:
    value = body.get(name, "" if not required else None)
    if value == "" and not required:
        return ""
    if (
        not isinstance(value, str)
        or len(value) > MAX_ENDPOINT
        or not value.startswith(("http://", "https://"))
        or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in value)
        or len(value.split("://", 1)[1]) == 0
        or not _fetchable(value)
    ):
        raise Invalid(
            f"{name} must be an http(s) URL of at most {MAX_ENDPOINT} characters",
            code="peer_invalid",
            details={"field": name},
        )
    problem = endpoint_problem(value, policy)
    if problem is not None:
        raise Invalid(
            f"{name} {problem} (docs/federation.md, peer endpoints)",
            code="peer_endpoint_refused",
            details={"field": name},
        )
    return value


def _fetchable(url: str) -> bool:
    """Whether an HTTP client can request this URL: a host that parses (`http://[::1` does
    not), whose labels fit DNS (63 characters, 253 in all) and encode as IDNA, both as Python's
    codec does (IDNA 2003) and as trio's resolver does (IDNA 2008, UTS 46): `☃.example` passes
    the first only, and could never be resolved."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        _ = parts.port  # a port that is not a number raises ValueError
        if parts.scheme not in ("http", "https") or not host:
            return False
        if not host.startswith("[") and ":" not in host:
            host.encode("idna")
            if not host.isascii():
                idna.encode(host, uts46=True)
        return len(host) <= 253 and all(len(label) <= 63 for label in host.split("."))
    except (ValueError, UnicodeError):
        return False


class PeerRefused(Exception):
    """A peer's answer to a federated query that cannot be used."""


def _reason(exc: Exception) -> str:
    if isinstance(exc, PeerRefused):
        return "bad_answer"
    if isinstance(exc, Invalid | Unauthorized):
        return exc.code
    return "unreachable"
