"""The stories (tests/docs/stories.py) run once per test session, side by side in worker
threads (they mostly wait on their own processes), started as soon as the tests that need them
are collected; every example of a story compares with the same outputs."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.docs.markdown import Marker
from tests.docs.running import DEADLINE, Databases
from tests.docs.stories import STORIES, Context, Outputs

NEEDED = pytest.StashKey[set[str]]()
# Stories run on the test's own thread: the in-process app (Trio, trio-asyncio), and one that
# takes no time. The others start longest first.
ON_MAIN_THREAD = frozenset({"app", "usage"})
LONGEST_FIRST = ("cli", "embedded", "cli-errors", "worked", "discovery", "events", "anchoring")
WORKERS = 4


class Stories:
    def __init__(self, databases: Databases, database_url: str, tmp: Path) -> None:
        self._databases = databases
        self._database_url = database_url
        self._tmp = tmp
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="docs-story")
        self._started: dict[str, Future[Outputs]] = {}

    def _run(self, name: str) -> Outputs:
        directory = self._tmp / name
        directory.mkdir()
        return STORIES[name](Context(self._databases, self._database_url, directory))

    def start(self, names: Iterable[str]) -> None:
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        for name in sorted(set(names), key=lambda n: rank.get(n, len(rank))):
            if name in STORIES and name not in self._started:
                future: Future[Outputs] = Future()
                if name in ON_MAIN_THREAD:
                    self._started[name] = future
                else:
                    self._started[name] = self._pool.submit(self._run, name)

    def outputs(self, name: str) -> Outputs:
        if name not in STORIES:
            raise AssertionError(f"no story {name!r} (tests/docs/stories.py has {sorted(STORIES)})")
        self.start([name])
        future = self._started[name]
        if name in ON_MAIN_THREAD and not future.done():
            try:
                future.set_result(self._run(name))
            except Exception as exc:
                future.set_exception(exc)
        try:
            return future.result(timeout=4 * DEADLINE)
        except Exception as exc:
            raise AssertionError(f"the story {name!r} failed: {exc!r}") from exc

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needed: set[str] = set()
    for item in items:
        marker = getattr(getattr(item, "callspec", None), "params", {}).get("marker")
        if isinstance(marker, Marker):
            needed.add(marker.story)
    config.stash[NEEDED] = needed


@pytest.fixture(scope="package")
def stories(
    database_url: str, tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[Stories]:
    runs = Stories(Databases(database_url), database_url, tmp_path_factory.mktemp("docs"))
    needed: set[str] = pytestconfig.stash.get(NEEDED, set())
    runs.start(needed)
    try:
        yield runs
    finally:
        runs.close()
