"""Rate limits shared by the processes serving from one database (limits.shared)."""

from __future__ import annotations

from pathlib import Path

from registry.store.pg import open_pg_store
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
