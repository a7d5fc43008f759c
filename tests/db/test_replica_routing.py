"""A replica that hangs (accepts connections, never answers) costs a GET at most the replica
deadline, once: the primary answers it and the next reads, and the replica is left alone.
Also: a process starts out having seen the primary's log head (registry/store/routing.py)."""

from __future__ import annotations

from functools import partial

import pytest
import trio
import trio_asyncio

from registry.store.pg import RoutedPgStore, open_pg_store
from registry.store.routing import READ_FLOOR, REPLICA_DEADLINE_SECONDS, RETRY_SECONDS


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
                assert READ_FLOOR.get() is None  # the rest of the request reads the primary
                READ_FLOOR.set(0)
                started = trio.current_time()
                assert await store.get_entry_head("did:web:nobody.example") is None
                assert trio.current_time() - started < 1  # no second wait: it is left alone
                assert state.reads == {"primary": 2}
            finally:
                READ_FLOOR.reset(token)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("code", ["53300", "40001"])
def test_a_busy_replica_is_not_marked_down(code: str) -> None:
    # database_busy (too many connections, a recovery conflict) is this read's trouble only:
    # the mapping the routing relies on.
    from registry.store.pg import CONDITIONS

    assert CONDITIONS.get(code, CONDITIONS.get(code[:2]))[0] == "database_busy"  # type: ignore[index]
