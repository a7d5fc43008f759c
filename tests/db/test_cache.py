"""The entry head cache follows the log: a change committed by another process (another pool)
invalidates it, and losing the LISTEN connection turns caching off instead of serving stale data."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import trio
import trio_asyncio

from api.server import follow_log
from registry.errors import Unauthorized, Unavailable
from registry.identity import DidKeyIdentity
from registry.keys import SigningKey
from registry.service import Principal, Registry
from registry.signin import build_response
from registry.store import SessionRecord
from registry.store.pg import PgStore, open_pg_store
from tests.conftest import make_config
from tests.helpers import signed_entry


def _principal(key: SigningKey) -> Principal:
    session = SessionRecord(key.did, key.did, key.did, "key", ("entries.write",), 2**62)
    return Principal(key.did, session.capabilities, session, b"")


@asynccontextmanager
async def two_processes(
    database_url: str, tmp_path: Path, key: SigningKey
) -> AsyncIterator[tuple[PgStore, Registry, Registry]]:
    """Two registries on the database through separate pools, as two processes would be:
    (the store of the first, the first, the second)."""
    config = make_config(database_url, tmp_path)
    async with (
        trio_asyncio.open_loop(),
        open_pg_store(database_url) as store,
        open_pg_store(database_url) as other_store,
    ):
        mine = Registry(store=store, config=config, key=key, identity=DidKeyIdentity())
        other = Registry(store=other_store, config=config, key=key, identity=DidKeyIdentity())
        yield store, mine, other


async def test_change_from_another_process_invalidates_and_lost_listener_disables(
    database_url: str, tmp_path: Path
) -> None:
    key = SigningKey.generate()
    with trio.fail_after(30):
        async with two_processes(database_url, tmp_path, key) as (store, mine, other):
            entry = signed_entry(key)
            did = entry["entryDid"]
            created = await other.create_entry(_principal(key), entry, None)

            invalidated = trio.Event()
            plain_invalidate = mine.cache.invalidate

            def spy(changed: str) -> None:
                plain_invalidate(changed)
                if changed == did:
                    invalidated.set()

            mine.cache.invalidate = spy  # type: ignore[method-assign]
            failure: list[BaseException] = []

            async def follower(task_status: trio.TaskStatus[None]) -> None:
                try:
                    await follow_log(store, mine.cache, task_status=task_status)
                except Unavailable as exc:
                    failure.append(exc)

            async with trio.open_nursery() as nursery:
                await nursery.start(follower)
                assert mine.cache.enabled, failure
                assert (await mine.get_entry(did)).sequence == created.sequence
                assert mine.cache.get(did) is not None  # served from memory from now on

                updated = signed_entry(key, did, version="2.0.0", sequence=created.sequence)
                new = await other.update_entry(_principal(key), did, updated, None)
                await invalidated.wait()
                assert (await mine.get_entry(did)).sequence == new.sequence

                conn = await trio_asyncio.aio_as_trio(asyncpg.connect)(database_url)
                try:
                    await trio_asyncio.aio_as_trio(conn.execute)(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE query LIKE 'LISTEN%' AND datname = current_database()"
                    )
                finally:
                    await trio_asyncio.aio_as_trio(conn.close)()
            assert failure, "the follower must fail when its connection is lost"
            assert not mine.cache.enabled
            assert mine.cache.get(did) is None


async def test_logout_in_another_process_revokes_a_cached_session(
    database_url: str, tmp_path: Path
) -> None:
    key = SigningKey.generate()
    with trio.fail_after(30):
        async with two_processes(database_url, tmp_path, key) as (store, mine, other):
            challenge = await other.challenge({"audience": "cache-test"})
            _body, token = await other.verify(
                {
                    "audience": "cache-test",
                    "challenge": challenge,
                    "response": build_response(challenge, key),
                }
            )
            revoked = trio.Event()
            plain_invalidate = mine.sessions.invalidate

            def spy(token_hash: bytes) -> None:
                plain_invalidate(token_hash)
                revoked.set()

            mine.sessions.invalidate = spy  # type: ignore[method-assign]
            async with trio.open_nursery() as nursery:
                await nursery.start(follow_log, store, mine.cache, mine.sessions)
                principal = await mine.authenticate(token)
                assert mine.sessions.get(principal.token_hash) is not None  # cached
                await other.logout(await other.authenticate(token))
                await revoked.wait()
                with pytest.raises(Unauthorized):
                    await mine.authenticate(token)
                nursery.cancel_scope.cancel()


async def test_a_change_drops_exactly_the_discovery_pages_it_can_move(
    database_url: str, tmp_path: Path
) -> None:
    """Pages are dropped by the changes whose entry matches their query before or after, from
    any process (via the log follower) and at once for this process's own writes; the others
    stay cached."""
    from registry.discovery import parse_discover_request

    key = SigningKey.generate()
    tag, elsewhere = f"cache-{key.did[-8:]}", f"other-{key.did[-8:]}"
    with trio.fail_after(30):
        async with two_processes(database_url, tmp_path, key) as (store, mine, other):
            ours = parse_discover_request({"tags": [tag]})
            theirs = parse_discover_request({"tags": [elsewhere]})
            # Full text is decided by the database for the follower: the entries written here
            # are named "Helpful agent" (tests.helpers.entry_template).
            named = parse_discover_request({"text": "agent", "tags": [tag]})
            unrelated = parse_discover_request({"text": "xylophone"})
            handled: set[int] = set()  # sequences whose change our follower has handled
            progress = trio.Event()
            plain = mine.results.entry_changed

            def spy(versions: Any) -> None:
                nonlocal progress
                plain(versions)
                handled.add(versions[-1].sequence)
                progress.set()
                progress = trio.Event()

            mine.results.entry_changed = spy  # type: ignore[method-assign]

            async def settle(change: Any) -> Any:
                """Run a change in the other process; wait until our follower handled it."""
                result = await change
                while result.sequence not in handled:
                    await progress.wait()
                return result

            async with trio.open_nursery() as nursery:
                await nursery.start(follow_log, store, mine.cache, mine.sessions, mine.results)
                assert json.loads(await mine.discover(ours))["totalCount"] == 0
                assert json.loads(await mine.discover(theirs))["totalCount"] == 0
                assert json.loads(await mine.discover(named))["totalCount"] == 0
                await mine.discover(unrelated)
                assert mine.results.get(repr(ours)) is not None  # cached

                entry = signed_entry(key, tags=[tag])
                created = await settle(other.create_entry(_principal(key), entry, None))
                assert mine.results.get(repr(ours)) is None  # it may move this page
                assert mine.results.get(repr(named)) is None  # it matches "agent"
                assert mine.results.get(repr(theirs)) is not None  # provably not this one
                assert mine.results.get(repr(unrelated)) is not None  # nor "xylophone"
                assert json.loads(await mine.discover(ours))["totalCount"] == 1
                assert json.loads(await mine.discover(named))["totalCount"] == 1

                # This process's own write drops the page at once, before any notification,
                # asking the database about the cached full-text queries.
                await mine.create_entry(_principal(key), signed_entry(key, tags=[tag]), None)
                assert mine.results.get(repr(ours)) is None
                assert mine.results.get(repr(named)) is None
                assert mine.results.get(repr(unrelated)) is not None
                assert json.loads(await mine.discover(ours))["totalCount"] == 2
                assert mine.results.get(repr(theirs)) is not None

                # If that question fails, the write is still answered and every page it might
                # move is dropped (full text: maybe).
                class Failing:
                    def __getattr__(self, name: str) -> Any:
                        return getattr(store, name)

                    async def change_versions(self, *_args: Any) -> Any:
                        raise Unavailable("down", code="database_unavailable")

                mine.store = Failing()  # type: ignore[assignment]
                await mine.create_entry(_principal(key), signed_entry(key, tags=["zz"]), None)
                mine.store = store
                assert mine.results.get(repr(unrelated)) is None
                assert mine.results.get(repr(theirs)) is not None  # decided without it

                # An entry leaving the results (its tags change) drops the page too.
                moved = signed_entry(
                    key, entry["entryDid"], tags=[elsewhere], sequence=created.sequence
                )
                await settle(other.update_entry(_principal(key), entry["entryDid"], moved, None))
                assert mine.results.get(repr(ours)) is None
                assert mine.results.get(repr(theirs)) is None  # and it entered this one
                assert json.loads(await mine.discover(ours))["totalCount"] == 1
                assert json.loads(await mine.discover(theirs))["totalCount"] == 1
                nursery.cancel_scope.cancel()


async def test_change_versions_reads_every_change_of_a_batch_in_one_query(
    database_url: str, tmp_path: Path
) -> None:
    """For each (sequence, DID): the version replaced and the one written (only the latter for a
    new entry), oldest first, each with the asked full-text queries it matches."""
    key = SigningKey.generate()
    with trio.fail_after(30):
        async with two_processes(database_url, tmp_path, key) as (store, mine, _other):
            first = signed_entry(key, tags=["alpha"])
            created = await mine.create_entry(_principal(key), first, None)
            other = await mine.create_entry(_principal(key), signed_entry(key), None)
            moved = signed_entry(
                key, first["entryDid"], tags=["xylophone"], sequence=created.sequence
            )
            updated = await mine.update_entry(_principal(key), first["entryDid"], moved, None)
            changes = [
                (updated.sequence, first["entryDid"]),
                (other.sequence, _did(other.doc)),
            ]
            found = await store.change_versions(changes, ["xylophone", "helpful", "zebra"])
            assert [json.loads(d)["sequence"] for d, _ in found[updated.sequence]] == [
                created.sequence,
                updated.sequence,
            ]
            assert [m for _, m in found[updated.sequence]] == [
                ["helpful"],
                ["xylophone", "helpful"],
            ]
            assert [json.loads(d)["sequence"] for d, _ in found[other.sequence]] == [other.sequence]


def _did(doc: str) -> str:
    return str(json.loads(doc)["entryDid"])


async def test_concurrent_misses_of_one_query_are_computed_once(
    database_url: str, tmp_path: Path
) -> None:
    """While one request computes a page, the others asking for it wait for its answer."""
    import trio.testing

    from registry.discovery import parse_discover_request

    key = SigningKey.generate()
    with trio.fail_after(30):
        async with two_processes(database_url, tmp_path, key) as (store, mine, _other):
            query = parse_discover_request({"tags": [f"herd-{key.did[-8:]}"]})
            computing = trio.Event()
            release = trio.Event()
            calls = 0

            class Gated:
                def __getattr__(self, name: str) -> Any:
                    return getattr(store, name)

                async def discover(self, plan: Any) -> Any:
                    nonlocal calls
                    calls += 1
                    computing.set()
                    await release.wait()
                    return await store.discover(plan)

            mine.store = Gated()  # type: ignore[assignment]
            answers: list[tuple[str, bool]] = []

            async def ask() -> None:
                answers.append(await mine.discover_page(query))

            async with trio.open_nursery() as nursery:
                await nursery.start(follow_log, store, mine.cache, mine.sessions, mine.results)
                async with trio.open_nursery() as askers:
                    askers.start_soon(ask)
                    await computing.wait()
                    for _ in range(4):
                        askers.start_soon(ask)
                    await trio.testing.wait_all_tasks_blocked()
                    assert mine._computing[repr(query)].statistics().tasks_waiting == 4
                    release.set()
                nursery.cancel_scope.cancel()
            assert calls == 1
            assert sorted(hit for _, hit in answers) == [False, True, True, True, True]
            assert len({body for body, _ in answers}) == 1


async def test_a_waiter_computes_the_page_itself_when_the_first_request_is_cancelled(
    database_url: str, tmp_path: Path
) -> None:
    import trio.testing

    from registry.discovery import parse_discover_request

    key = SigningKey.generate()
    with trio.fail_after(30):
        async with two_processes(database_url, tmp_path, key) as (store, mine, _other):
            query = parse_discover_request({"tags": [f"herd-{key.did[-8:]}"]})
            first_called = trio.Event()
            calls = 0

            class StuckOnce:
                def __getattr__(self, name: str) -> Any:
                    return getattr(store, name)

                async def discover(self, plan: Any) -> Any:
                    nonlocal calls
                    calls += 1
                    if calls == 1:
                        first_called.set()
                        await trio.sleep_forever()
                    return await store.discover(plan)

            mine.store = StuckOnce()  # type: ignore[assignment]
            answers: list[tuple[str, bool]] = []

            async def ask() -> None:
                answers.append(await mine.discover_page(query))

            async with trio.open_nursery() as nursery:
                await nursery.start(follow_log, store, mine.cache, mine.sessions, mine.results)
                async with trio.open_nursery() as askers:
                    first = trio.CancelScope()
                    askers.start_soon(_run_in, first, ask)
                    await first_called.wait()
                    askers.start_soon(ask)
                    await trio.testing.wait_all_tasks_blocked()
                    first.cancel()
                nursery.cancel_scope.cancel()
            assert calls == 2
            assert [hit for _, hit in answers] == [False]
            assert json.loads(answers[0][0])["totalCount"] == 0
            assert repr(query) not in mine._computing


async def _run_in(scope: trio.CancelScope, fn: Any) -> None:
    with scope:
        await fn()
