"""One `registry serve` process for the CLI tests (package scope), on the test database.

Its `limits.max_page_size` is 2 (below the default page size, which is lowered to it: the
service starts), so listing a handful of versions crosses pages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.cli_support import Cli
from tests.db.proc import Server, run_server


@pytest.fixture(scope="package")
def server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(
        tmp_path_factory.mktemp("cli-server"),
        database_url=database_url,
        extra_env={"REGISTRY_LIMITS__MAX_PAGE_SIZE": "2"},
    ) as server:
        yield server


@pytest.fixture
def cli(server: Server, tmp_path: Path) -> Cli:
    """The command with --url defaulting (through REGISTRY_URL) to the module's server."""
    return Cli(tmp_path, server.url)
