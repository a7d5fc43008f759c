"""The deep health check of the federation peers (design §11)."""

from __future__ import annotations

from pathlib import Path

from registry.breaker import Breaker
from registry.changes import Change
from registry.federation import PeerState
from registry.keys import SigningKey
from tests.conftest import Harness, make_config, open_harness
from tests.helpers import bearer, sign_in


async def test_deep_health_is_degraded_while_a_peer_breaker_is_open(
    database_url: str, tmp_path: Path
) -> None:
    admin, peer = SigningKey.generate(), SigningKey.generate()
    config = make_config(
        database_url,
        tmp_path,
        auth={"admin_dids": [admin.did]},
        # discover only: no PeerActor, so the stored status is the one that counts
        federation={
            "peers": [
                {"peer_did": peer.did, "endpoint": "http://127.0.0.1:9", "kinds": ["discover"]}
            ]
        },
    )
    async for h in open_harness(config):
        token = await sign_in(h.client, admin)

        async def federation_check(h: Harness = h, token: str = token) -> tuple[str, str]:
            r = await h.client.get("/v1/health/deep", headers=bearer(token))
            assert r.status_code == 200
            body = await r.get_json()
            return body["status"], body["checks"]["federation"]

        assert await federation_check() == ("ok", "ok")
        now = h.deps.federation.clock_ms()
        opened = Breaker(state="open", consecutive_failures=5, next_attempt_at_ms=now + 60_000)
        state = PeerState(peer.did, breaker=opened)
        change = Change(
            "peer.status",
            None,
            {
                "peerDid": peer.did,
                "expectedCursor": 0,
                "cursor": 0,
                "status": state.to_stored(),
                "replicas": [],
                "quarantined": [],
            },
            event=state.status_json(now),
        )
        assert (await h.store.append([(change, None)]))[0].refusal is None
        assert await federation_check() == (
            "degraded",
            "degraded: 1 of 1 peers unreachable (breaker open)",
        )


async def test_deep_health_is_degraded_while_a_peer_log_is_forked(
    database_url: str, tmp_path: Path
) -> None:
    # A forked peer's breaker stays closed (it answers), yet nothing more is imported from it:
    # the operator must hear of it from deep health, not only from the peers' view.
    admin, peer = SigningKey.generate(), SigningKey.generate()
    config = make_config(
        database_url,
        tmp_path,
        auth={"admin_dids": [admin.did]},
        federation={
            "peers": [
                {"peer_did": peer.did, "endpoint": "http://127.0.0.1:9", "kinds": ["discover"]}
            ]
        },
    )
    async for h in open_harness(config):
        token = await sign_in(h.client, admin)
        now = h.deps.federation.clock_ms()
        state = PeerState(peer.did, log_fork="size 7 does not extend the accepted size 9")
        change = Change(
            "peer.status",
            None,
            {
                "peerDid": peer.did,
                "expectedCursor": 0,
                "cursor": 0,
                "status": state.to_stored(),
                "replicas": [],
                "quarantined": [],
            },
            event=state.status_json(now),
        )
        assert (await h.store.append([(change, None)]))[0].refusal is None
        r = await h.client.get("/v1/health/deep", headers=bearer(token))
        body = await r.get_json()
        assert (body["status"], body["checks"]["federation"]) == (
            "degraded",
            "degraded: 1 of 1 peers quarantined (log forked)",
        )
