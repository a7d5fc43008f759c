"""One `registry serve` process for the hostile-client tests (package scope), on the test
database, with short timeouts and small caps so that each attack ends within a test's deadline.
The attacks go over raw sockets: client libraries fix the framing for you."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.db.proc import Server, run_server
from tests.hostile.raw import PER_CLIENT

SETTINGS = {
    "REGISTRY_SERVER__MAX_CONNECTIONS_PER_CLIENT": str(PER_CLIENT),
    "REGISTRY_SERVER__REQUEST_TIMEOUT_SECONDS": "3",
    "REGISTRY_SERVER__READ_TIMEOUT_SECONDS": "1.5",
    "REGISTRY_SERVER__SEND_TIMEOUT_SECONDS": "2",
    "REGISTRY_SERVER__KEEP_ALIVE_TIMEOUT_SECONDS": "5",
    "REGISTRY_EVENTS__MAX_CONNECTIONS_PER_CLIENT": "8",
    "REGISTRY_EVENTS__REPLAYS_PER_MINUTE": "6",
    # The budgets these tests count are this process's whole: other tests start servers on the
    # same database, and a shared limit is divided by the processes counted (every 10 s).
    "REGISTRY_LIMITS__SHARED": "false",
    # What the attacks leave in the metrics is read without a session.
    "REGISTRY_METRICS__OPEN": "true",
}


@pytest.fixture(scope="package")
def server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(
        tmp_path_factory.mktemp("hostile-server"), database_url=database_url, extra_env=SETTINGS
    ) as server:
        yield server
        log = server.output()
    assert "Traceback" not in log, log
