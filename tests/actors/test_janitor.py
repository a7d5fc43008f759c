"""The janitor's two loops on the virtual clock over a fake store: the hourly purge, and the
lapse pass every few seconds that vacuums `records` once enough attestations have lapsed."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from actors.janitor import VACUUM_AFTER, run_janitor


class FakeStore:
    """Counts the janitor's calls; each lapse pass marks the next number of `lapses`."""

    def __init__(self, lapses: list[int]) -> None:
        self.lapses = lapses
        self.calls: list[tuple[float, str]] = []

    async def purge_expired(self) -> dict[str, int]:
        self.calls.append((trio.current_time(), "purge"))
        return {}

    async def lapse_attestations(self) -> int:
        self.calls.append((trio.current_time(), "lapse"))
        return self.lapses.pop(0) if self.lapses else 0

    async def vacuum_records(self) -> None:
        self.calls.append((trio.current_time(), "vacuum"))


async def _run_for(store: FakeStore, seconds: float) -> None:
    with trio.move_on_after(seconds):
        await run_janitor(store)  # type: ignore[arg-type]


async def test_purges_hourly_and_lapses_every_five_seconds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FakeStore([])
    start = trio.current_time()
    await _run_for(store, 3600 + 1)
    purges = [t - start for t, what in store.calls if what == "purge"]
    lapses = [t - start for t, what in store.calls if what == "lapse"]
    assert purges == [0, 3600]
    assert lapses == [5.0 * n for n in range(721)]
    assert not [what for _, what in store.calls if what == "vacuum"]


@pytest.mark.parametrize(
    ("lapses", "vacuums_after"),
    [
        ([VACUUM_AFTER], [0]),  # enough at once: vacuumed right after that pass
        ([VACUUM_AFTER - 1, 0, 1, 5], [2]),  # the total reaches it on the third pass
        ([VACUUM_AFTER - 1], []),  # never enough: the index walk is bounded by the rest
        ([VACUUM_AFTER, VACUUM_AFTER // 2, VACUUM_AFTER // 2], [0, 2]),  # counted afresh
    ],
)
async def test_vacuums_records_once_enough_attestations_lapsed(
    autojump_clock: trio.testing.MockClock, lapses: list[int], vacuums_after: list[int]
) -> None:
    store = FakeStore(list(lapses))
    await _run_for(store, 5 * len(lapses) + 1)
    passes = [what for _, what in store.calls if what != "purge"]
    # The n-th lapse pass is followed by a vacuum exactly for the n in vacuums_after.
    after: list[int] = []
    count = -1
    for what in passes:
        if what == "lapse":
            count += 1
        else:
            after.append(count)
    assert after == vacuums_after
