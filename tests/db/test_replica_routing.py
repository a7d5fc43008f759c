"""A replica that hangs (accepts connections, never answers) costs a GET at most the replica
deadline, once: the primary answers it and the next reads, and the replica is left alone.
Also: a process starts out having seen the primary's log head (registry/store/routing.py)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import trio
import trio_asyncio

from registry.caches import FollowedCache
from registry.identity import DidKeyIdentity
from registry.keys import SigningKey
from registry.store.pg import RoutedPgStore, open_pg_store
from registry.store.routing import ON_PRIMARY, READ_FLOOR, REPLICA_DEADLINE_SECONDS, RETRY_SECONDS
from service.wiring import open_service
from tests.conftest import make_config
from tests.db.proc import databases, query
from tests.helpers import entry_created


async def hold_forever(stream: trio.SocketStream) -> None:
    async with stream:
        await trio.sleep_forever()


async def test_a_hanging_replica_is_left_for_the_primary(database_url: str) -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, hold_forever, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        hanging = f"postgresql://postgres@127.0.0.1:{port}/registry"
        async with (
            trio_asyncio.open_loop(),
            open_pg_store(database_url, read_dsn=hanging, read_poll_seconds=0.05) as store,
        ):
            assert isinstance(store, RoutedPgStore)
            state = store.replica_state
            assert state.seen == await store.log_head() >= 0  # where its log actor starts
            assert state.replayed == -1  # the start-up read of its head did not answer
            # As if it had answered: a GET's read tries it, and the primary answers in time.
            state.replayed, state.down_until = state.seen, 0.0
            token = READ_FLOOR.set(0)
            try:
                started = trio.current_time()
                assert await store.get_entry_head("did:web:nobody.example") is None
                took = trio.current_time() - started
                assert REPLICA_DEADLINE_SECONDS <= took < REPLICA_DEADLINE_SECONDS + 5
                assert state.failures == 1
                assert state.reads["primary"] == 1
                assert state.down_until >= trio.current_time() + RETRY_SECONDS - 1
                assert ON_PRIMARY.get()  # the rest of the request reads the primary
                ON_PRIMARY.set(False)
                started = trio.current_time()
                assert await store.get_entry_head("did:web:nobody.example") is None
                assert trio.current_time() - started < 1  # no second wait: it is left alone
                assert state.reads == {"primary": 2}
            finally:
                READ_FLOOR.reset(token)
        nursery.cancel_scope.cancel()


async def test_a_get_the_primary_answered_keeps_its_floor_for_the_caches(
    database_url: str,
) -> None:
    """docs/replicas.md: the caches answer no request whose Registry-Min-Sequence is past what
    the log actor has read. Once the primary answered a GET's read in the replica's place, the
    rest of the request was sent to the primary by dropping its floor (READ_FLOOR None), which
    the caches read as "no floor": its later lookups were answered from what the change the
    client named may have replaced."""
    async with (
        trio_asyncio.open_loop(),
        open_pg_store(database_url, read_dsn=database_url, read_poll_seconds=10) as store,
    ):
        assert isinstance(store, RoutedPgStore)
        state = store.replica_state
        cache: FollowedCache[str, str] = FollowedCache()
        cache.enabled = True
        cache.followed = state.seen
        cache.put("did:web:cached.example", "what the named change replaced", cache.epoch)
        floor = max(state.seen, state.replayed) + 1  # a sequence no one here has read yet
        token = READ_FLOOR.set(floor)
        try:
            assert await store.get_entry_head("did:web:nobody.example") is None
            assert state.reads == {"primary": 1}  # the replica lags the floor
            assert cache.get("did:web:cached.example") is None  # nor may the caches answer
            state.replayed = floor  # caught up meanwhile: the request still reads the primary
            assert await store.get_entry_head("did:web:nobody.example") is None
            assert state.reads == {"primary": 2}
        finally:
            READ_FLOOR.reset(token)


@pytest.mark.parametrize("code", ["53300", "40001"])
def test_a_busy_replica_is_not_marked_down(code: str) -> None:
    # database_busy (too many connections, a recovery conflict) is this read's trouble only:
    # the mapping the routing relies on.
    from registry.store.pg import CONDITIONS

    assert CONDITIONS.get(code, CONDITIONS.get(code[:2]))[0] == "database_busy"  # type: ignore[index]


@pytest.fixture
def primary_and_copy(database_url: str) -> Iterator[tuple[str, str]]:
    """A fresh primary, and the URL of a copy of it the test makes (`_copy`): a replica whose
    replay stands where the primary stood then. Dropped at the end."""
    with databases(database_url) as new_database:
        primary = new_database()
        parts = urlsplit(primary)
        copy = urlunsplit(parts._replace(path=parts.path + "_copy"))
        try:
            yield primary, copy
        finally:
            query(_admin(primary), f'DROP DATABASE IF EXISTS "{_name(copy)}" WITH (FORCE)')


def _admin(url: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/postgres"))


def _name(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


async def _copy(primary: str, copy: str) -> None:
    sql = f'CREATE DATABASE "{_name(copy)}" TEMPLATE "{_name(primary)}"'
    await trio.to_thread.run_sync(query, _admin(primary), sql)


async def test_once_the_primary_answers_a_get_the_rest_of_it_reads_the_primary(
    primary_and_copy: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/replicas.md, "One request, one state". A GET whose first read the primary answered
    because the replica lagged, and whose next read came after the log actor's poll found the
    replica caught up with what the process had seen, read an entry's head on the primary and
    its versions on the replica, which had not replayed the entry yet (another process wrote
    it): 200 with no versions for an entry that has one, a state that never was."""
    primary, replica = primary_and_copy
    async with trio_asyncio.open_loop():
        async with open_pg_store(primary) as other:  # another process writes
            await other.append([(entry_created(), None)])
            seen = await other.log_head()
        await _copy(primary, replica)  # the replica has replayed that much
        config = make_config(
            primary,
            tmp_path,
            # The log actor polls once at its start: nothing but the test moves the state.
            database={"read_url": replica, "read_poll_seconds": 10},
            transparency={"enabled": False},
        )
        async with (
            open_pg_store(primary, read_dsn=replica, read_poll_seconds=10) as store,
            open_service(config, store, key=SigningKey.generate(), identity=DidKeyIdentity()) as s,
            s.app.test_app() as app,
        ):
            assert isinstance(store, RoutedPgStore)
            state = store.replica_state
            assert state.seen == state.replayed == seen
            async with open_pg_store(primary) as other:
                created = entry_created()
                await other.append([(created, None)])
            state.replayed = seen - 1  # as the last poll found it: one record behind
            head_of = store.get_entry_head

            async def then_the_poll(*args: Any, **kwargs: Any) -> Any:
                head = await head_of(*args, **kwargs)
                await store.refresh_replica()  # the log actor's poll comes in between
                assert state.replayed == seen
                return head

            monkeypatch.setattr(store, "get_entry_head", then_the_poll)
            before = state.reads.copy()
            r = await app.test_client().get(f"/v1/entries/{created.subject}/versions")
            assert r.status_code == 200, await r.get_data()
            body = await r.get_json()
            assert len(body["versions"]) == 1, body
            # The head, the versions and their anchor states.
            assert state.reads - before == {"primary": 3}, state.reads
