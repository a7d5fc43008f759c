"""Fixtures of the process tests: clusters of peered `registry serve` nodes
(tests/db/test_federation_process.py's `Cluster`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.db.proc import databases
from tests.db.test_federation_process import Cluster


@pytest.fixture(scope="module")
def shared_cluster(
    database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Three nodes for the module (starting them is most of a test's time). Each test publishes
    its own entries; a test that stops a node restarts it, and `cluster3` restarts any left
    down."""
    with databases(database_url) as new_database:
        cluster = Cluster(tmp_path_factory.mktemp("federation"), new_database, "abc")
        try:
            yield cluster
        finally:
            cluster.close()


@pytest.fixture
def cluster3(shared_cluster: Cluster) -> Cluster:
    shared_cluster.heal()
    return shared_cluster


@pytest.fixture
def cluster2(database_url: str, tmp_path: Path) -> Iterator[Cluster]:
    """Two nodes of their own (not started)."""
    with databases(database_url) as new_database:
        cluster = Cluster(tmp_path, new_database, "ab")
        try:
            yield cluster
        finally:
            cluster.close()
