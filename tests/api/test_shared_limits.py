"""Rate limits shared by the processes serving from one database (limits.shared)."""

from __future__ import annotations

from pathlib import Path

import trio_asyncio

from registry.identity import DidKeyIdentity
from registry.keys import SigningKey
from registry.store.pg import RoutedPgStore, open_pg_store
from service.wiring import open_service
from tests.api.api_support import anon_client, with_harness
from tests.conftest import Harness, make_config


async def test_processes_on_one_database_count_each_other_and_share_the_limits(
    database_url: str, tmp_path: Path
) -> None:
    config = make_config(database_url, tmp_path, limits={"read_per_minute": 1000})

    async def body(h: Harness) -> None:
        # Counted as the service started: it alone (the test's session database).
        assert h.service.limiter.processes == 1
        r = await anon_client(h).get("/v1/health")
        assert r.headers["RateLimit-Limit"] == "1000"
        async with open_pg_store(database_url) as other:  # another process's pool
            assert await h.store.live_processes() == 2
            assert await other.live_processes() == 2
            # What the sharing task does at its next count (tests/actors/test_ratelimiter.py).
            h.service.limiter.share(await h.store.live_processes())
            r = await anon_client(h).get("/v1/health")
            assert r.headers["RateLimit-Limit"] == "500"
        assert await h.store.live_processes() == 1

    await with_harness(config, body)


async def test_a_process_whose_read_url_names_its_primary_counts_once(
    database_url: str, tmp_path: Path
) -> None:
    """docs/replicas.md: after a failover, `url` names the promoted replica, which may still be
    `read_url` too. The replica pool's connections then reach the same database: they are the
    same process, not a second one that would halve every limit."""
    config = make_config(
        database_url,
        tmp_path,
        database={"read_url": database_url},
        limits={"read_per_minute": 1000},
    )
    async with (
        trio_asyncio.open_loop(),
        open_pg_store(database_url, read_dsn=database_url) as store,
        open_service(config, store, key=SigningKey.generate(), identity=DidKeyIdentity()) as s,
        s.app.test_app() as app,
    ):
        assert isinstance(store, RoutedPgStore)
        assert store.replica_pool_statistics()["open"] >= 1  # its head was read there
        assert await store.live_processes() == 1
        assert s.limiter.processes == 1
        r = await app.test_client().get("/v1/health")
        assert r.headers["RateLimit-Limit"] == "1000"
