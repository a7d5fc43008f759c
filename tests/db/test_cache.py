"""The caches follow the log: a change committed by another process (another pool) invalidates
them, and losing the LISTEN connection turns caching off instead of serving stale data.

Each "process" is a whole service (`service.wiring.open_service`, as `registry serve` wires it)
over its own pool on the one test database."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import trio
import trio.testing
import trio_asyncio

from registry.caches import FollowedCache, Served
from registry.changes import Outcome
from registry.discovery import parse_discover_request
from registry.errors import Unauthorized, Unavailable
from registry.identity import DidKeyIdentity
from registry.keys import SigningKey
from registry.signin import build_response
from registry.store import SessionRecord
from registry.store.pg import Notifications, PgStore, open_pg_store
from registry.usecases.common import Principal
from service.wiring import Service, open_service
from tests.conftest import make_config
from tests.helpers import bearer, idem, next_version, sign_in, signed_entry

WAIT_SECONDS = 10  # for one change to reach the other process


def _principal(key: SigningKey) -> Principal:
    session = SessionRecord(key.did, key.did, key.did, "key", ("entries.write",), 2**62)
    return Principal(key.did, session.capabilities, session, b"")


@asynccontextmanager
async def two_processes(
    database_url: str, tmp_path: Path, key: SigningKey
) -> AsyncIterator[tuple[Service, Service]]:
    """Two services on the database through separate pools, as two processes would be:
    (the first, the second). Inside, the caches of both follow the log live."""
    config = make_config(database_url, tmp_path)
    async with (
        trio_asyncio.open_loop(),
        open_pg_store(database_url) as store,
        open_pg_store(database_url) as other_store,
        open_service(config, store, key=key, identity=DidKeyIdentity()) as mine,
        open_service(config, other_store, key=key, identity=DidKeyIdentity()) as other,
    ):
        assert mine.caches.enabled
        assert other.caches.enabled
        yield mine, other


async def eventually(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition` until it holds; fail after WAIT_SECONDS."""
    try:
        with trio.fail_after(WAIT_SECONDS):
            while True:
                if condition():
                    return
                await trio.sleep(0.01)
    except trio.TooSlowError:
        raise AssertionError(f"not within {WAIT_SECONDS}s: {what}") from None


def _pg(store: Any) -> PgStore:
    assert isinstance(store, PgStore)
    return store


def record_invalidations(cache: FollowedCache[str, Served]) -> list[str]:
    """The keys `cache` is told to drop from now on, in order (the cache keeper's doing, for
    changes made in another process)."""
    dropped: list[str] = []
    plain = cache.invalidate

    def invalidate(key: str) -> None:
        plain(key)
        dropped.append(key)

    cache.invalidate = invalidate  # type: ignore[method-assign]
    return dropped


@contextmanager
def log_reads_held(store: PgStore) -> Iterator[None]:
    """Hold back every read of the log through `store` while inside: the log actor of its
    service sees no new record, so its cache keeper applies none (released on exit)."""
    release = trio.Event()
    plain = store.log_after

    async def held(after_seq: int, limit: int) -> Any:
        await release.wait()
        return await plain(after_seq, limit)

    store.log_after = held  # type: ignore[method-assign]
    try:
        yield
    finally:
        del store.log_after  # the class's method again
        release.set()


async def applied_elsewhere(
    mine: Service, dropped: list[str], did: str, write: Awaitable[Outcome]
) -> int:
    """Run a write of `did` in the other process; wait until `mine`'s cache keeper has applied
    it (told its entry cache to drop `did`: `dropped` is `record_invalidations`'s list)."""
    seen = len(dropped)  # before the write: our keeper may apply it before the write returns
    outcome = await write
    assert outcome.refusal is None
    assert outcome.sequence is not None
    await eventually(lambda: len(dropped) > seen, f"our keeper applies {outcome.sequence}")
    assert dropped[seen:] == [did]
    assert mine.logs.statistics().head >= outcome.sequence
    assert mine.caches.enabled
    return outcome.sequence


async def test_change_from_another_process_invalidates_the_cached_entry(
    database_url: str, tmp_path: Path
) -> None:
    key = SigningKey.generate()
    with trio.fail_after(30):
        async with two_processes(database_url, tmp_path, key) as (mine, other):
            entries, cache = mine.deps.entries, mine.caches.entries
            dropped = record_invalidations(cache)
            entry = signed_entry(key)
            did = entry["entryDid"]
            write = other.deps.entries.create(_principal(key), entry, None)
            created = await applied_elsewhere(mine, dropped, did, write)
            assert (await entries.get(did)).sequence == created
            assert cache.get(did) is not None  # served from memory from now on
            assert (await entries.get(did)).sequence == created

            updated = signed_entry(key, did, version="2.0.0", sequence=created)
            write = other.deps.entries.update(_principal(key), did, updated, None)
            new = await applied_elsewhere(mine, dropped, did, write)
            assert new > created
            assert cache.get(did) is None
            assert (await entries.get(did)).sequence == new
            assert cache.get(did) is not None


async def test_lost_listener_disables_caching_until_it_follows_the_log_again(
    database_url: str, tmp_path: Path
) -> None:
    """Losing the LISTEN connection turns caching off (and clears it) instead of serving stale
    data; reconnected, the keeper applies what it missed and caches again."""
    key = SigningKey.generate()
    with trio.fail_after(60):
        async with two_processes(database_url, tmp_path, key) as (mine, other):
            entries, cache = mine.deps.entries, mine.caches.entries
            dropped = record_invalidations(cache)
            entry = signed_entry(key)
            did = entry["entryDid"]
            write = other.deps.entries.create(_principal(key), entry, None)
            created = await applied_elsewhere(mine, dropped, did, write)
            assert (await entries.get(did)).sequence == created
            assert cache.get(did) is not None

            # Lose the LISTEN connections; keep this process from reconnecting until released.
            store = _pg(mine.store)
            plain_listen = store.listen_log
            reconnect = trio.Event()

            @asynccontextmanager
            async def listen_after_release() -> AsyncIterator[Notifications]:
                await reconnect.wait()
                async with plain_listen() as wakeups:
                    yield wakeups

            store.listen_log = listen_after_release  # type: ignore[method-assign]
            conn = await trio_asyncio.aio_as_trio(asyncpg.connect)(database_url)
            try:
                killed = await trio_asyncio.aio_as_trio(conn.fetchval)(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE query LIKE 'LISTEN%' AND datname = current_database()"
                )
            finally:
                await trio_asyncio.aio_as_trio(conn.close)()
            assert killed >= 1
            await eventually(lambda: not mine.caches.enabled, "a lost listener disables caching")
            assert not mine.logs.statistics().connected
            assert len(cache) == 0  # cleared, not kept for later
            assert cache.get(did) is None

            # While it cannot follow the log, a change from the other process is read at once
            # from the database, and nothing is cached.
            updated = signed_entry(key, did, version="2.0.0", sequence=created)
            missed = await other.deps.entries.update(_principal(key), did, updated, None)
            assert missed.sequence is not None
            assert (await entries.get(did)).sequence == missed.sequence
            assert cache.get(did) is None
            assert len(cache) == 0

            # Once reconnected it applies what it missed, caches again and follows changes again.
            seen = len(dropped)
            reconnect.set()
            await eventually(lambda: mine.caches.enabled, "caching resumes once live again")
            await eventually(lambda: len(dropped) > seen, "the missed change is applied")
            assert dropped[seen:] == [did]
            assert mine.logs.statistics().connected
            assert (await entries.get(did)).sequence == missed.sequence
            assert cache.get(did) is not None
            latest = signed_entry(key, did, version="3.0.0", sequence=missed.sequence)
            write = other.deps.entries.update(_principal(key), did, latest, None)
            last = await applied_elsewhere(mine, dropped, did, write)
            assert cache.get(did) is None
            assert (await entries.get(did)).sequence == last


async def test_logout_in_another_process_revokes_a_cached_session(
    database_url: str, tmp_path: Path
) -> None:
    key = SigningKey.generate()
    with trio.fail_after(30):
        async with two_processes(database_url, tmp_path, key) as (mine, other):
            challenge = await other.deps.sessions.challenge({"audience": "cache-test"})
            _body, token = await other.deps.sessions.verify(
                {
                    "audience": "cache-test",
                    "challenge": challenge,
                    "response": build_response(challenge, key),
                }
            )
            principal = await mine.deps.sessions.authenticate(token)
            sessions = mine.caches.sessions
            assert sessions.get(principal.token_hash) is not None  # cached
            await mine.deps.sessions.authenticate(token)  # still good, from memory

            other_principal = await other.deps.sessions.authenticate(token)
            outcome = await other.deps.sessions.logout(other_principal, None)
            assert outcome.refusal is None
            await eventually(
                lambda: sessions.get(principal.token_hash) is None,
                "the other's logout drops the cached session",
            )
            assert mine.caches.enabled
            with pytest.raises(Unauthorized):
                await mine.deps.sessions.authenticate(token)


async def test_a_change_drops_exactly_the_discovery_pages_it_can_move(
    database_url: str, tmp_path: Path
) -> None:
    """Pages are dropped by the changes whose entry matches their query before or after, from
    any process (via the cache keeper) and at once for this process's own writes; the others
    stay cached."""
    key = SigningKey.generate()
    tag, elsewhere = f"cache-{key.did[-8:]}", f"other-{key.did[-8:]}"
    with trio.fail_after(60):
        async with two_processes(database_url, tmp_path, key) as (mine, other):
            discovery, results = mine.deps.discovery, mine.caches.results
            ours = parse_discover_request({"tags": [tag]})
            theirs = parse_discover_request({"tags": [elsewhere]})
            # Full text is decided by the database for the keeper: the entries written here
            # are named "Helpful agent" (tests.helpers.entry_template).
            named = parse_discover_request({"text": "agent", "tags": [tag]})
            unrelated = parse_discover_request({"text": "xylophone"})

            def cached(query: Any) -> bool:
                return results.get(repr(query)) is not None

            async def total(query: Any) -> int:
                return int(json.loads(await discovery.discover(query))["totalCount"])

            async def settle(change: Awaitable[Outcome], *dropped: Any) -> Outcome:
                """Run a change in the other process; wait until our keeper has dropped the
                pages in `dropped` (it drops every page of one change at once)."""
                outcome = await change
                assert outcome.refusal is None
                await eventually(
                    lambda: not any(cached(q) for q in dropped),
                    f"the other's change at {outcome.sequence} drops {dropped}",
                )
                assert mine.caches.enabled
                return outcome

            assert await total(ours) == 0
            assert await total(theirs) == 0
            assert await total(named) == 0
            await discovery.discover(unrelated)
            assert all(cached(q) for q in (ours, theirs, named, unrelated))

            entry = signed_entry(key, tags=[tag])
            created = await settle(
                other.deps.entries.create(_principal(key), entry, None), ours, named
            )
            assert not cached(ours)  # it may move this page
            assert not cached(named)  # it matches "agent"
            assert cached(theirs)  # provably not this one
            assert cached(unrelated)  # nor "xylophone"
            assert await total(ours) == 1
            assert await total(named) == 1
            assert cached(ours)

            with log_reads_held(_pg(mine.store)):
                # This process's own write drops the page at once, before its keeper sees the
                # change, asking the database about the cached full-text queries.
                await mine.deps.entries.create(_principal(key), signed_entry(key, tags=[tag]), None)
                assert not cached(ours)
                assert not cached(named)
                assert cached(unrelated)
                assert cached(theirs)
                assert await total(ours) == 2
                assert cached(ours)

                # If that question fails, the write is still answered and every page it might
                # move is dropped (full text: maybe).
                store = mine.deps.entries.store

                class Failing:
                    def __getattr__(self, name: str) -> Any:
                        return getattr(store, name)

                    async def change_versions(self, *_args: Any) -> Any:
                        raise Unavailable("down", code="database_unavailable")

                mine.deps.entries.store = Failing()
                try:
                    written = await mine.deps.entries.create(
                        _principal(key), signed_entry(key, tags=["zz"]), None
                    )
                finally:
                    mine.deps.entries.store = store
                assert written.refusal is None
                assert written.sequence is not None
                assert not cached(unrelated)
                assert cached(theirs)  # decided without it
                assert cached(ours)  # "zz" only: provably not this one either

            # An entry leaving the results (its tags change) drops the page too.
            moved = signed_entry(
                key,
                entry["entryDid"],
                tags=[elsewhere],
                sequence=created.sequence,
                version=next_version(),
            )
            await settle(
                other.deps.entries.update(_principal(key), entry["entryDid"], moved, None),
                ours,
                theirs,  # and it entered this one
            )
            assert await total(ours) == 1
            assert await total(theirs) == 1


async def test_change_versions_reads_every_change_of_a_batch_in_one_query(
    database_url: str, tmp_path: Path
) -> None:
    """For each (sequence, DID): the version replaced and the one written (only the latter for a
    new entry), oldest first, each with the asked full-text queries it matches."""
    key = SigningKey.generate()
    with trio.fail_after(30):
        async with two_processes(database_url, tmp_path, key) as (mine, _other):
            entries = mine.deps.entries
            first = signed_entry(key, tags=["alpha"])
            created = await entries.create(_principal(key), first, None)
            other = await entries.create(_principal(key), signed_entry(key), None)
            moved = signed_entry(
                key,
                first["entryDid"],
                tags=["xylophone"],
                sequence=created.sequence,
                version=next_version(),
            )
            updated = await entries.update(_principal(key), first["entryDid"], moved, None)
            assert created.sequence is not None
            assert other.sequence is not None
            assert updated.sequence is not None
            changes = [
                (updated.sequence, first["entryDid"]),
                (other.sequence, _did(other.unwrap())),
            ]
            found = await mine.store.change_versions(changes, ["xylophone", "helpful", "zebra"])
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
    key = SigningKey.generate()
    with trio.fail_after(30):
        async with two_processes(database_url, tmp_path, key) as (mine, _other):
            discovery = mine.deps.discovery
            store = discovery.store
            query = parse_discover_request({"tags": [f"herd-{key.did[-8:]}"]})
            computing = trio.Event()
            release = trio.Event()
            calls = 0

            class Gated:
                def __getattr__(self, name: str) -> Any:
                    return getattr(store, name)

                async def discover(self, *args: Any, **kwargs: Any) -> Any:
                    nonlocal calls
                    calls += 1
                    computing.set()
                    await release.wait()
                    return await store.discover(*args, **kwargs)

            discovery.store = Gated()
            answers: list[tuple[str, bool]] = []

            async def ask() -> None:
                answers.append(await discovery.discover_page(query))

            async with trio.open_nursery() as askers:
                askers.start_soon(ask)
                await computing.wait()
                for _ in range(4):
                    askers.start_soon(ask)
                await trio.testing.wait_all_tasks_blocked()
                assert discovery._computing[repr(query)].statistics().tasks_waiting == 4
                release.set()
            assert calls == 1
            assert sorted(hit for _, hit in answers) == [False, True, True, True, True]
            assert len({body for body, _ in answers}) == 1


async def test_a_waiter_computes_the_page_itself_when_the_first_request_is_cancelled(
    database_url: str, tmp_path: Path
) -> None:
    key = SigningKey.generate()
    with trio.fail_after(30):
        async with two_processes(database_url, tmp_path, key) as (mine, _other):
            discovery = mine.deps.discovery
            store = discovery.store
            query = parse_discover_request({"tags": [f"herd-{key.did[-8:]}"]})
            first_called = trio.Event()
            calls = 0

            class StuckOnce:
                def __getattr__(self, name: str) -> Any:
                    return getattr(store, name)

                async def discover(self, *args: Any, **kwargs: Any) -> Any:
                    nonlocal calls
                    calls += 1
                    if calls == 1:
                        first_called.set()
                        await trio.sleep_forever()
                    return await store.discover(*args, **kwargs)

            discovery.store = StuckOnce()
            answers: list[tuple[str, bool]] = []

            async def ask() -> None:
                answers.append(await discovery.discover_page(query))

            async with trio.open_nursery() as askers:
                first = trio.CancelScope()
                askers.start_soon(_run_in, first, ask)
                await first_called.wait()
                askers.start_soon(ask)
                await trio.testing.wait_all_tasks_blocked()
                first.cancel()
            assert calls == 2
            assert [hit for _, hit in answers] == [False]
            assert json.loads(answers[0][0])["totalCount"] == 0
            assert repr(query) not in discovery._computing


async def _run_in(scope: trio.CancelScope, fn: Any) -> None:
    with scope:
        await fn()


async def published_and_followed(
    client: Any, token: str, key: SigningKey, follower: Any
) -> tuple[str, int]:
    """A new entry of `key` published through `client`, once `follower`'s log actor has read
    it: its DID and sequence."""
    entry = signed_entry(key)
    r = await client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    assert r.status_code == 201, await r.get_data()
    created = int(r.headers["Registry-Sequence"])
    await eventually(lambda: follower.logs.statistics().head >= created, "the other follows")
    return entry["entryDid"], created


async def test_registry_min_sequence_is_not_answered_from_a_cache_behind_it(
    database_url: str, tmp_path: Path
) -> None:
    """docs/api.md: a GET with `Registry-Min-Sequence: N` reflects sequence N. A process whose
    log actor has not read N yet (its caches are dropped by the log) answers from the database,
    not from a cache that may hold what N replaced: the entry, its ETag (no 304 for the old
    tag), and a session a logout at N revoked."""
    key = SigningKey.generate()
    with trio.fail_after(60):
        async with two_processes(database_url, tmp_path, key) as (mine, other):
            writer, reader = other.app.test_client(), mine.app.test_client()
            token = await sign_in(writer, key)
            reader_token = await sign_in(reader, key)
            did, created = await published_and_followed(writer, token, key, mine)
            path = f"/v1/entries/{did}"
            floor = {"Registry-Min-Sequence": str(created)}
            r = await reader.get(path, headers=floor)
            assert r.status_code == 200
            assert r.headers["ETag"] == f'"s{created}"'
            assert mine.caches.entries.get(did) is not None  # cached on the reader
            r = await reader.get("/v1/auth/session", headers=bearer(reader_token))
            assert r.status_code == 200
            assert len(mine.caches.sessions) == 1  # cached on the reader too

            with log_reads_held(_pg(mine.store)):  # the reader's log actor reads nothing new
                updated = signed_entry(key, did, version=next_version(), sequence=created)
                r = await writer.put(path, json=updated, headers=bearer(token, **idem()))
                assert r.status_code == 200, await r.get_data()
                new = int(r.headers["Registry-Sequence"])
                r = await writer.post("/v1/auth/logout", headers=bearer(reader_token, **idem()))
                assert r.status_code == 200, await r.get_data()
                logout = int(r.headers["Registry-Sequence"])

                # Without the header the reader may still serve what it cached.
                r = await reader.get(path)
                assert (await r.get_json())["sequence"] == created
                # With it, never.
                floor = {"Registry-Min-Sequence": str(new)}
                r = await reader.get(path, headers=floor)
                assert r.status_code == 200
                assert (await r.get_json())["sequence"] == new
                assert r.headers["ETag"] == f'"s{new}"'
                old_tag = {"If-None-Match": f'"s{created}"', **floor}
                r = await reader.get(path, headers=old_tag)
                assert r.status_code == 200
                assert r.headers["ETag"] == f'"s{new}"'
                r = await reader.get(
                    "/v1/auth/session",
                    headers=bearer(reader_token, **{"Registry-Min-Sequence": str(logout)}),
                )
                assert r.status_code == 401, await r.get_data()


async def test_a_replayed_write_is_read_back_through_the_process_that_replayed_it(
    database_url: str, tmp_path: Path
) -> None:
    """docs/replicas.md, read your writes on one process: a retry answered from its key's
    record by another process than the one that wrote (`Idempotent-Replayed`) is the client's
    write acknowledged there, so that process's next GET shows it, whether or not its log actor
    has read the change yet."""
    key = SigningKey.generate()
    with trio.fail_after(60):
        async with two_processes(database_url, tmp_path, key) as (mine, other):
            first, retry = other.app.test_client(), mine.app.test_client()
            token = await sign_in(first, key)
            did, created = await published_and_followed(first, token, key, mine)
            path = f"/v1/entries/{did}"
            r = await retry.get(path)
            assert (await r.get_json())["sequence"] == created
            assert mine.caches.entries.get(did) is not None  # cached where the retry goes

            with log_reads_held(_pg(mine.store)):
                updated = signed_entry(key, did, version=next_version(), sequence=created)
                key_of_update = idem()
                r = await first.put(path, json=updated, headers=bearer(token, **key_of_update))
                assert r.status_code == 200, await r.get_data()
                new = int(r.headers["Registry-Sequence"])
                # Its answer was lost; the client retries, and another process answers.
                r = await retry.put(path, json=updated, headers=bearer(token, **key_of_update))
                assert r.status_code == 200, await r.get_data()
                assert r.headers["Idempotent-Replayed"] == "true"
                assert int(r.headers["Registry-Sequence"]) == new
                r = await retry.get(path)
                assert r.status_code == 200
                assert (await r.get_json())["sequence"] == new
                assert r.headers["ETag"] == f'"s{new}"'
