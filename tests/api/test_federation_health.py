"""The deep health check of the federation peers (design §11)."""

from __future__ import annotations

from pathlib import Path

from registry.breaker import Breaker
from registry.changes import Change
from registry.config import Config
from registry.federation import PeerState
from registry.keys import SigningKey
from tests.conftest import Harness, make_config, open_harness
from tests.helpers import bearer, sign_in


def one_peer_config(database_url: str, tmp_path: Path, admin: str, peer: str) -> Config:
    return make_config(
        database_url,
        tmp_path,
        auth={"admin_dids": [admin]},
        # discover only: no PeerActor, so the stored status is the one that counts
        federation={
            "peers": [{"peer_did": peer, "endpoint": "http://127.0.0.1:9", "kinds": ["discover"]}]
        },
    )


async def store_status(h: Harness, state: PeerState) -> None:
    """Store `state` as the peer's status, as its actor would."""
    change = Change(
        "peer.status",
        None,
        {
            "peerDid": state.peer_did,
            "expectedCursor": 0,
            "cursor": 0,
            "status": state.to_stored(),
            "replicas": [],
            "quarantined": [],
        },
        event=state.status_json(h.deps.federation.clock_ms()),
    )
    assert (await h.store.append([(change, None)]))[0].refusal is None


async def federation_check(h: Harness, token: str) -> tuple[str, str]:
    r = await h.client.get("/v1/health/deep", headers=bearer(token))
    assert r.status_code == 200
    body = await r.get_json()
    return body["status"], body["checks"]["federation"]


async def test_deep_health_is_degraded_while_a_peer_breaker_is_open(
    database_url: str, tmp_path: Path
) -> None:
    admin, peer = SigningKey.generate(), SigningKey.generate()
    async for h in open_harness(one_peer_config(database_url, tmp_path, admin.did, peer.did)):
        token = await sign_in(h.client, admin)
        assert await federation_check(h, token) == ("ok", "ok")
        now = h.deps.federation.clock_ms()
        opened = Breaker(state="open", consecutive_failures=5, next_attempt_at_ms=now + 60_000)
        await store_status(h, PeerState(peer.did, breaker=opened))
        assert await federation_check(h, token) == (
            "degraded",
            "degraded: 1 of 1 peers unreachable (breaker open)",
        )


async def test_deep_health_is_degraded_while_a_peer_log_is_forked(
    database_url: str, tmp_path: Path
) -> None:
    # A forked peer's breaker stays closed (it answers), yet nothing more is imported from it:
    # the operator must hear of it from deep health, not only from the peers' view.
    admin, peer = SigningKey.generate(), SigningKey.generate()
    async for h in open_harness(one_peer_config(database_url, tmp_path, admin.did, peer.did)):
        token = await sign_in(h.client, admin)
        forked = PeerState(peer.did, log_fork="size 7 does not extend the accepted size 9")
        await store_status(h, forked)
        assert await federation_check(h, token) == (
            "degraded",
            "degraded: 1 of 1 peers quarantined (log forked)",
        )
