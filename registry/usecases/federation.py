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
from collections.abc import Callable
from typing import Any

from registry.breaker import BreakerPolicy
from registry.canonical import canonicalize, join_members
from registry.changes import Change, ChangeLog, IdemKey, Outcome, rfc3339_ms
from registry.config import Config, PeerConfig
from registry.envelope import (
    build_response_text,
    clamp_max_entries,
    nonce_expiry_ms,
    sync_request_payload,
    verify_envelope,
)
from registry.errors import Forbidden, Invalid, Unauthorized
from registry.federation import PeerState
from registry.keys import SigningKey
from registry.store import PeerRow, Store
from registry.usecases.common import Principal, now_ms
from registry.usecases.records import body_object, put

MAX_ENDPOINT = 2048
PEER_RECORD = "peer"


def peer_state(row: PeerRow | None, peer_did: str, policy: BreakerPolicy) -> PeerState:
    if row is None:
        return PeerState(peer_did)
    return PeerState.from_stored(
        peer_did, cursor=row.cursor, status=row.status, quarantines=row.quarantines, policy=policy
    )


class Federation:
    def __init__(
        self,
        *,
        store: Store,
        changes: ChangeLog,
        config: Config,
        key: SigningKey,
        policy: BreakerPolicy | None = None,
        live: Callable[[], dict[str, PeerState]] = dict,
        clock_ms: Callable[[], int] = now_ms,
    ) -> None:
        self.store = store
        self.changes = changes
        self.config = config
        self.key = key
        self.policy = policy or BreakerPolicy()
        self.live = live  # the PeerActors' current states in this process (if it leads them)
        self.clock_ms = clock_ms
        self.peers: dict[str, PeerConfig] = {p.peer_did: p for p in config.federation.peers}

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
        expires = nonce_expiry_ms(verified)
        if not await self.store.burn_nonce(verified.sender_did, verified.nonce, expires):
            raise Unauthorized(
                "federation envelope refused: this nonce was already used",
                code="envelope_nonce_replayed",
                details={"reason": "nonce_replayed"},
            )
        limit = clamp_max_entries(max_entries)
        budget = max(1024, self.config.limits.federation_body_bytes - 64 * 1024)
        page, head, more = await self.store.sync_page(after, limit, budget)
        next_sequence = page[-1][0] if more else max(head, after)
        payload = join_members(
            {
                "entries": "[" + ",".join(doc for _, doc in page) + "]",
                "hasMore": "true" if more else "false",
                "headSequence": str(max(head, after)),
                "nextSequence": str(next_sequence),
            }
        )
        return build_response_text(
            self.key, request=envelope, kind="sync_response", payload_jcs=payload, now_ms=now
        )

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
        rows = {r.peer_did: r for r in await self.store.list_peers()}
        out = []
        for did in sorted(self.peers):
            out.append(await self._peer_json(did, rows.get(did)))
        return out

    async def _peer_json(self, did: str, row: PeerRow | None) -> dict[str, Any]:
        peer = self.peers[did]
        registered = await self.store.get_record(PEER_RECORD, did)
        doc = json.loads(registered.doc) if registered is not None else {}
        seen = [doc.get("registeredAtMs")]
        state = self.live().get(did) or peer_state(row, did, self.policy)
        seen.append(state.breaker.last_success_at_ms)
        last_seen = max((s for s in seen if isinstance(s, int)), default=None)
        return {
            "peerDid": did,
            "endpoint": doc.get("endpoint", peer.endpoint),
            "grpcEndpoint": doc.get("grpcEndpoint", ""),
            "agreementIds": list(peer.agreement_ids),
            "lastSeen": None if last_seen is None else rfc3339_ms(last_seen),
        }

    async def endpoint_of(self, did: str) -> str:
        """Where to reach a peer: its self-registered endpoint, else the configured one."""
        registered = await self.store.get_record(PEER_RECORD, did)
        if registered is not None:
            return str(json.loads(registered.doc)["endpoint"])
        return self.peers[did].endpoint

    async def update_self(self, principal: Principal, data: Any, idem: IdemKey | None) -> Outcome:
        """PUT /v1/federation/peers/self: a peer registers where it can be reached."""

        async def decide() -> Change:
            principal.require("federation")
            if principal.did not in self.peers:
                raise Forbidden(
                    "the signed-in principal is not a federation peer of this registry",
                    code="peer_unknown",
                    details={"peerDid": principal.did},
                )
            body = body_object(
                data, required={"endpoint"}, optional={"grpcEndpoint"}, code="peer_invalid"
            )
            endpoint = _url(body, "endpoint", required=True)
            grpc = _url(body, "grpcEndpoint", required=False)
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
            peer = self.peers[principal.did]
            result = {
                "agreementIds": list(peer.agreement_ids),
                "endpoint": endpoint,
                "grpcEndpoint": grpc,
                "lastSeen": rfc3339_ms(registered),
                "peerDid": principal.did,
            }
            return Change(
                "peer.updated",
                None,
                {"puts": [row], "result": canonicalize(result).decode("utf-8")},
                event={"peerDid": principal.did, "endpoint": endpoint},
            )

        return await self.changes.submit(idem, decide)

    # --- the operator view ----------------------------------------------------------------

    async def statuses(self, principal: Principal) -> list[dict[str, Any]]:
        """FederationPeerStatus of every configured peer (admin)."""
        principal.require("admin")
        rows = {r.peer_did: r for r in await self.store.list_peers()}
        live = self.live()
        now = self.clock_ms()
        return [
            (live.get(did) or peer_state(rows.get(did), did, self.policy)).status_json(now)
            for did in sorted(self.peers)
        ]


def _url(body: dict[str, Any], name: str, *, required: bool) -> str:
    value = body.get(name, "" if not required else None)
    if value == "" and not required:
        return ""
    if (
        not isinstance(value, str)
        or len(value) > MAX_ENDPOINT
        or not value.startswith(("http://", "https://"))
        or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in value)
        or len(value.split("://", 1)[1]) == 0
    ):
        raise Invalid(
            f"{name} must be an http(s) URL of at most {MAX_ENDPOINT} characters",
            code="peer_invalid",
            details={"field": name},
        )
    return value
