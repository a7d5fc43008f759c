"""One WebSocket connection of the event stream (`ws.events.Connection`) over a fake socket, the
log actor and the in-memory store, in virtual time: heartbeats, the idle close, malformed
messages, refused requests, slow and dead consumers, resubscribing, filters, and the closes
that report a resume point."""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import pytest
import trio
import trio.testing

from actors.log import LogHandle, run_log
from registry.changes import Change, LogRecord
from registry.config import EventsConfig
from registry.errors import Unauthorized
from registry.store import SessionRecord
from registry.store.memory import MemoryStore
from registry.usecases.common import Principal
from registry.usecases.entries import entry_change
from ws.events import Connection, EventDeps, EventSink

AGENT = "AgentDefinition"
TOOL = "ToolDefinition"
_names = itertools.count()


def new_did() -> str:
    return f"did:web:agents.example:{next(_names)}"


def version(
    kind: str, did: str, head: int | None, entry_type: str = AGENT, lifecycle: str = "active"
) -> Change:
    return entry_change(
        kind,
        did=did,
        expected_head=head,
        publisher="did:web:publisher.example",
        entry_type=entry_type,
        lifecycle=lifecycle,
        prefix=f'{{"entryDid":"{did}","sequence":',
        suffix="}",
        event={"name": "agent", "version": "1"},
    )


async def fill(store: MemoryStore, count: int) -> int:
    """Append `count` new entries, one change each; the new head."""
    for _ in range(count):
        await store.append([(version("entry.created", new_did(), None), None)])
    return await store.log_head()


async def append_transaction(store: MemoryStore, count: int) -> None:
    """One transaction of `count` new entries (one read of the log carries them all)."""
    await store.append([(version("entry.created", new_did(), None), None) for _ in range(count)])


# --- the fake socket and the connection under test -------------------------------------------


class FakeSocket:
    """The server's side of a WebSocket over memory channels; the test plays the client.

    `stall()` makes the server's sends block (a client that stopped reading) until `resume()`;
    `pace` makes each send take that long (a client that reads slowly but steadily)."""

    def __init__(self) -> None:
        self._to_server, self._from_client = trio.open_memory_channel[str | bytes](64)
        self._to_client, self._from_server = trio.open_memory_channel[str](4096)
        self.close_frame: tuple[int, str] | None = None
        self._stall: trio.Event | None = None
        self.pace = 0.0

    async def receive(self) -> str | bytes:
        return await self._from_client.receive()

    async def send(self, data: str) -> None:
        if self._stall is not None:
            await self._stall.wait()
        if self.pace:
            await trio.sleep(self.pace)
        await self._to_client.send(data)

    async def close(self, code: int, reason: str = "") -> None:
        await trio.lowlevel.checkpoint()
        self.close_frame = (code, reason)

    # --- the client's side ---------------------------------------------------------------

    async def put(self, message: dict[str, Any] | str | bytes) -> None:
        await self._to_server.send(json.dumps(message) if isinstance(message, dict) else message)

    async def get(self) -> dict[str, Any]:
        return dict(json.loads(await self._from_server.receive()))

    def pending(self) -> list[dict[str, Any]]:
        """The messages sent and not yet read, without waiting."""
        out = []
        while True:
            try:
                out.append(json.loads(self._from_server.receive_nowait()))
            except trio.WouldBlock:
                return out

    def stall(self) -> None:
        self._stall = trio.Event()

    def resume(self) -> None:
        assert self._stall is not None
        self._stall.set()
        self._stall = None


def principal(did: str, *capabilities: str) -> Principal:
    session = SessionRecord(did, did, did, "web", capabilities, 2**62)
    return Principal(did, capabilities, session, b"hash")


class StubSessions:
    """`Sessions.authenticate` for two tokens."""

    TOKENS: ClassVar[dict[str, Principal]] = {
        "admin-token": principal("did:web:admin.example", "admin"),
        "user-token": principal("did:web:user.example", "entries.write"),
    }

    def __init__(self) -> None:
        self.revoked: set[bytes] = set()  # token hashes whose session has ended

    async def authenticate(self, token: str, *, lookups: Any = None) -> Principal:
        await trio.lowlevel.checkpoint()
        if token not in self.TOKENS:
            raise Unauthorized("session missing, expired or unknown", code="session_invalid")
        return self.TOKENS[token]

    async def recheck(self, principal: Principal) -> Principal:
        await trio.lowlevel.checkpoint()
        if principal.token_hash in self.revoked:
            raise Unauthorized("session missing, expired or unknown", code="session_invalid")
        return principal


class Client:
    """A connection under test and the fake socket it serves."""

    def __init__(self, deps: EventDeps) -> None:
        self.sock = FakeSocket()
        self.connection = Connection(self.sock, deps)
        self.ended_at: float | None = None

    async def run(self) -> None:
        await self.connection.run()
        self.ended_at = trio.current_time()

    async def subscribe(self, **fields: Any) -> int:
        await self.sock.put({"type": "subscribe", **fields})
        answer = await self.sock.get()
        assert answer["type"] == "subscribed", answer
        return int(answer["fromSequence"])

    async def events(self, count: int) -> list[int]:
        """The sequences of the next `count` messages, all events."""
        out = []
        for _ in range(count):
            message = await self.sock.get()
            assert message["type"] == "event", message
            out.append(message["sequence"])
        return out

    async def until_heartbeat(self) -> tuple[list[int], int]:
        """The sequences of the events before the next heartbeat, and its resume point."""
        out = []
        while (message := await self.sock.get())["type"] == "event":
            out.append(message["sequence"])
        assert message["type"] == "heartbeat", message
        return out, message["lastSequence"]


@dataclass
class Events:
    store: MemoryStore
    logs: LogHandle
    deps: EventDeps
    nursery: trio.Nursery

    def connect(self) -> Client:
        client = Client(self.deps)
        self.nursery.start_soon(client.run)
        return client


@asynccontextmanager
async def open_events(*, queue_size: int = 1024, **config: Any) -> AsyncIterator[Events]:
    """The log actor over a fresh store, and event dependencies configured with `config`."""
    store = MemoryStore()
    async with trio.open_nursery() as nursery:
        logs: LogHandle = await nursery.start(partial(run_log, store, queue_size=queue_size))
        sessions: Any = StubSessions()  # the one method a connection uses
        deps = EventDeps(logs=logs, sessions=sessions, config=EventsConfig(**config))
        yield Events(store, logs, deps, nursery)
        nursery.cancel_scope.cancel()


def reason(client: Client) -> dict[str, Any]:
    assert client.sock.close_frame is not None
    return dict(json.loads(client.sock.close_frame[1]))


# --- heartbeats and idleness -----------------------------------------------------------------


async def test_a_heartbeat_follows_each_quiet_heartbeat_seconds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_events(heartbeat_seconds=20, idle_seconds=60) as events:
        await fill(events.store, 2)
        client = events.connect()
        origin = trio.current_time()
        assert await client.subscribe() == 2  # live from the head
        beats = []
        for _ in range(4):  # past idle_seconds: a subscribed socket is not idle
            assert await client.sock.get() == {"type": "heartbeat", "lastSequence": 2}
            beats.append(trio.current_time() - origin)
        assert beats == [20, 40, 60, 80]
        await trio.sleep_until(origin + 95)
        await fill(events.store, 1)
        assert await client.events(1) == [3]
        assert await client.sock.get() == {"type": "heartbeat", "lastSequence": 3}
        assert trio.current_time() == origin + 115  # quiet is counted from the last event
        assert client.ended_at is None


async def test_a_socket_without_subscription_is_closed_after_idle_seconds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_events(idle_seconds=60) as events:
        origin = trio.current_time()
        idle = events.connect()
        pinging = events.connect()
        unsubscribed = events.connect()
        await trio.sleep_until(origin + 30)
        await pinging.sock.put({"type": "ping"})
        assert await pinging.sock.get() == {"type": "pong"}
        await unsubscribed.subscribe()
        await trio.sleep_until(origin + 100)
        await unsubscribed.sock.put({"type": "unsubscribe"})
        while (answer := await unsubscribed.sock.get())["type"] == "heartbeat":
            pass
        assert answer == {"type": "unsubscribed", "lastSequence": 0}
        await trio.sleep_until(origin + 200)
    assert idle.sock.close_frame == (4408, "idle: no subscription for 60s")
    assert pinging.sock.close_frame == (4408, "idle: no subscription for 60s")
    assert unsubscribed.sock.close_frame == (4408, "idle: no subscription for 60s")
    assert idle.ended_at == origin + 60
    assert pinging.ended_at == origin + 90  # a message restarts the idle timer
    assert unsubscribed.ended_at == origin + 160


# --- malformed and refused messages ---------------------------------------------------------

MALFORMED: dict[str, tuple[str | bytes, str]] = {
    "binary frame": (b'{"type":"ping"}', "binary frames are not accepted; send JSON text"),
    "not JSON": ("subscribe please", "message is not JSON"),
    "JSON, not an object": ('["ping"]', "expected a JSON object"),
    "null": ("null", "expected a JSON object"),
    "no type": ('{"kinds":["entry.created"]}', "expected a JSON object"),
    "unknown type": ('{"type":"shout"}', "expected a JSON object"),
    "too large": (json.dumps({"type": "ping", "pad": "x" * 20_000}), "message too large"),
    "nested too deep for the parser": ("[" * 10_000, "message is not JSON"),
}


@pytest.mark.parametrize(("message", "why"), MALFORMED.values(), ids=MALFORMED.keys())
async def test_a_malformed_message_closes_the_socket_with_4400(
    autojump_clock: trio.testing.MockClock, message: str | bytes, why: str
) -> None:
    async with open_events() as events:
        client = events.connect()
        await client.subscribe(fromSequence=0)
        await client.sock.put(message)
        await trio.testing.wait_all_tasks_blocked()
        assert client.ended_at is not None
    assert client.sock.close_frame is not None
    code, text = client.sock.close_frame
    assert (code, text[: len(why)]) == (4400, why)


REFUSED: dict[str, tuple[str | None, dict[str, Any], str]] = {
    # the socket's session token, the message, the error code of the answer
    "unknown kind": (None, {"type": "subscribe", "kinds": ["entry.exploded"]}, "invalid_message"),
    "admin-only kind": (
        None,
        {"type": "subscribe", "kinds": ["peer.status"]},
        "capability_missing",
    ),
    "admin-only kind as a user": (
        "user-token",
        {"type": "subscribe", "kinds": ["entry.created", "peer.status"]},
        "capability_missing",
    ),
    "unknown member": (None, {"type": "subscribe", "from": 3}, "invalid_message"),
    "negative position": (None, {"type": "subscribe", "fromSequence": -1}, "invalid_message"),
    "position as text": (None, {"type": "subscribe", "fromSequence": "3"}, "invalid_message"),
    "empty filter": (None, {"type": "subscribe", "entryDids": []}, "invalid_message"),
    "unknown session": (None, {"type": "auth", "token": "stolen"}, "session_invalid"),
    "auth without token": (None, {"type": "auth"}, "invalid_message"),
}


@pytest.mark.parametrize(("token", "message", "code"), REFUSED.values(), ids=REFUSED.keys())
async def test_a_refused_request_is_answered_and_the_socket_stays_open(
    autojump_clock: trio.testing.MockClock, token: str | None, message: dict[str, Any], code: str
) -> None:
    async with open_events(idle_seconds=60) as events:
        await fill(events.store, 3)
        client = events.connect()
        if token is not None:
            await client.sock.put({"type": "auth", "token": token})
            assert (await client.sock.get())["admin"] is False
        await client.subscribe(fromSequence=1)
        assert await client.events(2) == [2, 3]
        await client.sock.put(message)
        answer = await client.sock.get()
        assert answer["type"] == "error"
        assert answer["error"]["code"] == code
        # Still open, and the subscription in place goes on.
        await fill(events.store, 1)
        assert await client.events(1) == [4]
        await client.sock.put({"type": "ping"})
        assert await client.sock.get() == {"type": "pong"}
        assert client.ended_at is None
        assert client.sock.close_frame is None


async def test_admin_only_kinds_after_authenticating_as_an_admin(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_events() as events:
        client = events.connect()
        await client.sock.put({"type": "auth", "token": "admin-token"})
        assert await client.sock.get() == {
            "type": "authenticated",
            "principal": "did:web:admin.example",
            "admin": True,
        }
        assert await client.subscribe(kinds=["peer.status"]) == 0


# --- slow and dead consumers -----------------------------------------------------------------


async def test_a_slow_consumer_on_the_ordinary_path_catches_up_from_the_log_and_loses_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The ordinary path (this harness's socket) has no kernel buffer to take a burst: a
    # subscriber that falls `queue_size` events behind is not closed (the fast path closes it
    # with 4429, tests/ws/test_fast_path.py) but sends what waits and reads on from the log.
    async with open_events(queue_size=2) as events:
        await fill(events.store, 3)
        slow, steady = events.connect(), events.connect()
        for client in (slow, steady):
            await client.subscribe(fromSequence=0)
            assert await client.events(3) == [1, 2, 3]
        await trio.testing.wait_all_tasks_blocked()  # both live
        slow.sock.stall()
        for _ in range(6):  # 4 is being sent to `slow`; 5 and 6 fill its queue; 7 overflows
            await fill(events.store, 1)
            await trio.testing.wait_all_tasks_blocked()
        assert events.logs.statistics().dropped_slow == 1
        await trio.sleep(5)  # slow, but not dead (send_timeout_seconds is 30)
        slow.sock.resume()
        with trio.fail_after(60):  # closed, it would wait for good
            assert await slow.events(6) == [4, 5, 6, 7, 8, 9]
        await trio.testing.wait_all_tasks_blocked()
        # Live again: the next event comes from the log actor as to the steady subscriber.
        await fill(events.store, 1)
        assert await slow.events(1) == [10]
        assert await steady.events(7) == [4, 5, 6, 7, 8, 9, 10]
        assert slow.sock.close_frame is None
        assert steady.sock.close_frame is None
        assert slow.ended_at is None


async def test_a_prompt_reader_on_the_ordinary_path_takes_a_burst_larger_than_its_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The log read back to back (500 records a read) outruns the subscription's own task
    # here: a reader that takes every message at once was closed with 4429 all the same.
    async with open_events(queue_size=4) as events:
        client = events.connect()
        await client.subscribe()
        await trio.testing.wait_all_tasks_blocked()
        await append_transaction(events.store, 1200)
        with trio.fail_after(60):  # closed, it would wait for good
            assert await client.events(1200) == list(range(1, 1201))
            await append_transaction(events.store, 3)
            assert await client.events(3) == [1201, 1202, 1203]
        assert client.sock.close_frame is None


async def test_a_client_that_takes_no_data_is_dropped_without_a_close_frame(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_events(send_timeout_seconds=30) as events:
        await fill(events.store, 1)
        client = events.connect()
        await client.subscribe(fromSequence=0)
        assert await client.events(1) == [1]
        client.sock.stall()
        await fill(events.store, 1)
        stalled = trio.current_time()
        await trio.sleep(100)
    # The watchdog checks every quarter of the timeout: dropped within 30 to 37.5 s.
    assert client.ended_at is not None
    assert stalled + 30 <= client.ended_at <= stalled + 37.5
    assert client.sock.close_frame is None


async def test_a_client_that_reads_slowly_but_steadily_is_not_dropped_on_the_ordinary_path(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`send_timeout_seconds` drops a client that takes no data: the ordinary path timed the
    whole of what waited (a burst, a page of a catch-up), so a client taking a message every
    0.1 s was dropped 30 s into a burst of 500, though it never stopped reading."""
    async with open_events(send_timeout_seconds=30) as events:
        client = events.connect()
        await client.subscribe()
        await trio.testing.wait_all_tasks_blocked()  # live
        client.sock.pace = 0.1
        await append_transaction(events.store, 500)
        with trio.fail_after(100):  # dropped, it would wait for good
            assert await client.events(500) == list(range(1, 501))
        assert client.ended_at is None


async def test_a_log_that_cannot_be_read_closes_with_1011_and_the_resume_point(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_events(queue_size=2) as events:  # three records behind: from the store
        await fill(events.store, 3)
        client = events.connect()
        await trio.testing.wait_all_tasks_blocked()  # the log actor has read: it waits
        events.store.fail_reads = True  # for an instant, or the log actor would fail too
        await client.subscribe(fromSequence=0)
        await trio.testing.wait_all_tasks_blocked()
        events.store.fail_reads = False
        assert client.ended_at == trio.current_time()
    assert client.sock.close_frame is not None
    assert client.sock.close_frame[0] == 1011
    assert reason(client) == {"code": "unavailable", "lastSequence": 0}


@pytest.mark.parametrize("told_by", ["a new subscription", "a heartbeat"])
async def test_the_recovery_is_logged_once_the_log_actor_has_read_again(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, told_by: str
) -> None:
    """A failure to read the log is logged once. A subscription the log actor takes is not
    proof that the database is back (an idle actor has not tried it): the recovery is logged
    once the actor has read again, by the next subscription it takes, or at the next heartbeat
    of one it took."""
    caplog.set_level(logging.INFO, logger="ws.events")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "ws.events"]

    async with open_events(queue_size=2) as events:
        await fill(events.store, 3)
        await trio.testing.wait_all_tasks_blocked()  # the log actor has read: it waits
        events.store.fail_reads = True
        # Three behind (more than the queue): a replay from the store, which fails; at the
        # head: the actor takes it, reading nothing.
        for start in (0, 3, 0, 3):
            await events.connect().subscribe(fromSequence=start)
            await trio.testing.wait_all_tasks_blocked()
        assert lines() == ["event subscriptions: database_unavailable"]
        events.store.fail_reads = False
        await fill(events.store, 1)  # the actor reads it
        await trio.testing.wait_all_tasks_blocked()
        if told_by == "a new subscription":
            resumed = events.connect()
            assert await resumed.subscribe(fromSequence=3) == 3  # from the actor's records
            assert await resumed.events(1) == [4]
            back = 0.0
        else:
            assert lines() == ["event subscriptions: database_unavailable"]
            back = events.deps.config.heartbeat_seconds  # after the delivery of 4, at 0
            await trio.sleep(back + 1)
    assert lines() == [
        "event subscriptions: database_unavailable",
        f"event subscriptions: back after {back:.1f}s of database_unavailable (2 failures)",
    ]


async def test_records_handed_over_before_the_log_actor_restarts_are_sent_once(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The actor hands a resume its records from the ring into the socket's outbox; when its
    LISTEN connection is lost before they are sent, they go out first and the replay that
    follows starts after them (no duplicate)."""
    handed_over = trio.Event()
    replay = Connection._replay

    async def replay_then_hold(self: Connection, sink: EventSink) -> None:
        await replay(self, sink)
        if not handed_over.is_set():  # the first attach: hold on until the actor drops it
            handed_over.set()
            while sink.ended is None:
                await trio.lowlevel.checkpoint()

    monkeypatch.setattr(Connection, "_replay", replay_then_hold)
    async with open_events() as events:
        await fill(events.store, 3)
        await trio.testing.wait_all_tasks_blocked()
        client = events.connect()
        assert await client.subscribe(fromSequence=1) == 1
        await handed_over.wait()  # 2 and 3 wait in the outbox
        events.store.break_listeners()
        await fill(events.store, 1)
        assert await client.until_heartbeat() == ([2, 3, 4], 4)


async def test_an_unsubscribe_right_after_subscribing_reports_where_it_started(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Whether or not the subscription has begun to send, `unsubscribed` reports a position it
    covers: its `fromSequence`, or the last event it sent."""
    async with open_events() as events:
        await fill(events.store, 3)
        client = events.connect()
        await client.sock.put({"type": "subscribe", "fromSequence": 1})
        await client.sock.put({"type": "unsubscribe"})
        sent: list[int] = []
        while (message := await client.sock.get())["type"] != "unsubscribed":
            if message["type"] == "event":
                sent.append(message["sequence"])
        assert sent == [2, 3][: len(sent)]
        assert message["lastSequence"] == (sent[-1] if sent else 1)


async def test_a_new_subscription_starts_where_it_asked_after_the_old_ones_events_go(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Events of the subscription being replaced that still wait for the socket go out before
    `subscribed`; the new one then starts at its own `fromSequence`, not where they ended."""
    async with open_events() as events:
        client = events.connect()
        assert await client.subscribe() == 0
        client.sock.stall()  # the client stops reading
        await fill(events.store, 3)
        await trio.testing.wait_all_tasks_blocked()  # the three wait for the socket
        await client.sock.put({"type": "subscribe", "fromSequence": 0})
        await trio.testing.wait_all_tasks_blocked()
        client.sock.resume()
        assert await client.events(3) == [1, 2, 3]  # the old subscription's
        assert await client.sock.get() == {"type": "subscribed", "fromSequence": 0}
        assert await client.until_heartbeat() == ([1, 2, 3], 3)


async def test_a_subscription_waiting_for_a_busy_log_actor_is_closed_when_it_loses_the_log(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A subscription asks the actor to take it while the actor is in a read. If the actor
    then loses the database, the subscription is not left waiting for it to come back (no
    heartbeat, no close, for the whole outage): it replays, fails, and is closed with 1011."""
    async with open_events() as events:
        await fill(events.store, 3)
        await trio.testing.wait_all_tasks_blocked()
        events.store.latency = 5.0  # each call now takes 5 s: the actor's next read too
        events.nursery.start_soon(fill, events.store, 1)  # commits at 5, read from 5 to 10
        await trio.sleep(6)
        client = events.connect()
        assert await client.subscribe(fromSequence=3) == 3  # its attach waits for the read
        await trio.testing.wait_all_tasks_blocked()
        events.store.fail_reads = True
        events.store.break_listeners()
        lost = trio.current_time()
        await trio.sleep(1)
        assert client.ended_at == lost
    assert client.sock.close_frame is not None
    assert client.sock.close_frame[0] == 1011
    assert reason(client) == {"code": "unavailable", "lastSequence": 3}


async def test_a_subscription_the_log_actor_can_serve_reads_no_page_of_the_store(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """From the head, or resuming within the actor's recent records and the queue's bound, the
    actor takes the subscription at once; only one further behind reads the log's pages (a
    burst of subscriptions would otherwise queue on the store's replay slots)."""
    async with open_events(queue_size=2) as events:
        await fill(events.store, 3)
        await trio.testing.wait_all_tasks_blocked()  # the log actor has read the three
        pages: list[int] = []
        read = events.logs.read

        async def counted(after: int) -> Sequence[LogRecord]:
            pages.append(after)
            return await read(after)

        events.logs.read = counted  # type: ignore[method-assign]
        at_head, behind, far = events.connect(), events.connect(), events.connect()
        assert await at_head.subscribe() == 3
        assert await behind.subscribe(fromSequence=1) == 1
        assert await behind.events(2) == [2, 3]
        assert pages == []
        assert await far.subscribe(fromSequence=0) == 0  # three behind, the queue holds two
        assert await far.events(3) == [1, 2, 3]
        assert pages == [0]
        await fill(events.store, 2)
        for client in (at_head, behind, far):
            assert await client.events(2) == [4, 5]
        assert pages == [0]


async def test_a_stopping_server_closes_with_1001_and_the_resume_point(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_events() as events:
        await fill(events.store, 3)
        client, idle = events.connect(), events.connect()
        await client.subscribe(fromSequence=0, kinds=["entry.updated"])
        _, last = await client.until_heartbeat()
        assert last == 3
        events.deps.stopping.set()
        await trio.testing.wait_all_tasks_blocked()
    assert client.sock.close_frame is not None
    assert client.sock.close_frame[0] == 1001
    assert reason(client) == {"code": "server_stopping", "lastSequence": 3}
    assert reason(idle) == {"code": "server_stopping", "lastSequence": None}


# --- subscriptions ---------------------------------------------------------------------------


async def test_unsubscribing_while_an_event_is_on_its_way_loses_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The forwarder is stopped while it waits to send event 1 to a client that is not
    # reading: event 1 keeps its place and goes before `unsubscribed`, whose resume point
    # counts exactly what was sent (events 2 and 3 too, if they were handed over already).
    async with open_events() as events:
        client = events.connect()
        assert await client.subscribe(fromSequence=0) == 0
        client.sock.stall()
        await fill(events.store, 3)
        await trio.testing.wait_all_tasks_blocked()  # the forwarder waits to send event 1
        await client.sock.put({"type": "unsubscribe"})
        await trio.testing.wait_all_tasks_blocked()
        client.sock.resume()
        sent = []
        while (message := await client.sock.get())["type"] == "event":
            sent.append(message["sequence"])
        assert message["type"] == "unsubscribed"
        assert sent[:1] == [1]
        assert sent == list(range(1, message["lastSequence"] + 1))
        assert await client.subscribe(fromSequence=message["lastSequence"]) == sent[-1]
        await fill(events.store, 1)
        assert await client.events(4 - sent[-1]) == list(range(sent[-1] + 1, 5))


async def test_unsubscribe_and_resubscribe_on_one_socket(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_events() as events:
        await fill(events.store, 2)
        client = events.connect()
        assert await client.subscribe(fromSequence=0) == 0
        assert await client.events(2) == [1, 2]
        await client.sock.put({"type": "unsubscribe"})
        assert await client.sock.get() == {"type": "unsubscribed", "lastSequence": 2}
        await fill(events.store, 2)
        await trio.sleep(30)
        assert client.sock.pending() == []  # nothing while unsubscribed, not even heartbeats
        assert await client.subscribe(fromSequence=2) == 2
        assert await client.events(2) == [3, 4]
        assert await client.subscribe() == 4  # replaces it, live from the head
        await fill(events.store, 1)
        assert await client.events(1) == [5]
        assert await client.sock.get() == {"type": "heartbeat", "lastSequence": 5}
        await client.sock.put({"type": "unsubscribe"})
        assert await client.sock.get() == {"type": "unsubscribed", "lastSequence": 5}
        await client.sock.put({"type": "unsubscribe"})  # twice is harmless
        assert await client.sock.get() == {"type": "unsubscribed", "lastSequence": 5}


@dataclass(frozen=True)
class Log:
    """The log of the filter tests: who is which sequence."""

    a: str
    b: str
    c: str


async def write_filter_log(store: MemoryStore) -> Log:
    """1 create a (agent), 2 create b (tool), 3 update a, 4 delete b, 5 a logout (internal),
    6 create c (agent)."""
    log = Log(new_did(), new_did(), new_did())
    await store.put_challenge("nonce", {}, 2**62)
    assert await store.open_session("nonce", b"token", principal("did:web:me").session)
    changes = [
        version("entry.created", log.a, None),
        version("entry.created", log.b, None, entry_type=TOOL),
        version("entry.updated", log.a, 1),
        version("entry.deleted", log.b, 2, entry_type=TOOL, lifecycle="deleted"),
        Change("session.revoked", None, {"tokenHash": b"token".hex()}, {}),
        version("entry.created", log.c, None),
    ]
    outcomes = await store.append([(change, None) for change in changes])
    assert [o.sequence for o in outcomes] == [1, 2, 3, 4, 5, 6]
    return log


FILTERS: dict[str, tuple[dict[str, Any], list[int]]] = {
    "everything public": ({}, [1, 2, 3, 4, 6]),
    "by kind": ({"kinds": ["entry.created"]}, [1, 2, 6]),
    "by kinds": ({"kinds": ["entry.updated", "entry.deleted"]}, [3, 4]),
    "by entry": ({"entryDids": ["a"]}, [1, 3]),
    "by entries": ({"entryDids": ["b", "c"]}, [2, 4, 6]),
    "by type": ({"entryTypes": [TOOL]}, [2, 4]),
    "kind and type": ({"kinds": ["entry.created"], "entryTypes": [AGENT]}, [1, 6]),
    "kind and entry, nothing": ({"kinds": ["entry.updated"], "entryDids": ["b"]}, []),
    "no such type": ({"entryTypes": ["Nothing"]}, []),
}


@pytest.mark.parametrize(("fields", "expected"), FILTERS.values(), ids=FILTERS.keys())
async def test_filters_select_events_and_the_resume_point_covers_the_rest(
    autojump_clock: trio.testing.MockClock, fields: dict[str, Any], expected: list[int]
) -> None:
    async with open_events() as events:
        log = await write_filter_log(events.store)
        if "entryDids" in fields:
            fields = {**fields, "entryDids": [getattr(log, n) for n in fields["entryDids"]]}
        client = events.connect()
        await client.subscribe(fromSequence=0, **fields)
        got, last = await client.until_heartbeat()
        assert got == expected
        assert last == 6  # the filtered-out and internal records are covered
        await client.sock.put({"type": "unsubscribe"})
        assert await client.sock.get() == {"type": "unsubscribed", "lastSequence": 6}


async def test_an_event_message_is_the_log_record_as_sent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_events() as events:
        log = await write_filter_log(events.store)
        client = events.connect()
        await client.subscribe(fromSequence=0, entryDids=[log.a])
        first = await client.sock.get()
        [record] = await events.store.log_after(0, 1)
        assert first == json.loads(record.event_json)
        assert first["entryDid"] == log.a
        assert first["data"] == {
            "entryType": AGENT,
            "publisherDid": "did:web:publisher.example",
            "lifecycleStatus": "active",
            "name": "agent",
            "version": "1",
        }


async def test_batch_mode_sends_what_is_queued_in_one_frame_and_loses_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_events() as events:
        client = events.connect()
        await client.subscribe(fromSequence=0, batch=True, entryTypes=[AGENT])
        # One transaction of five changes (one a ToolDefinition): the log actor queues all
        # five at once, so they leave together; the filtered one only moves the resume point.
        dids = [new_did() for _ in range(5)]
        await events.store.append(
            [
                (version("entry.created", did, None, TOOL if n == 2 else AGENT), None)
                for n, did in enumerate(dids)
            ]
        )
        frame = await client.sock.get()
        assert frame["type"] == "events"
        assert [e["sequence"] for e in frame["events"]] == [1, 2, 4, 5]
        assert all(e["type"] == "event" and e["kind"] == "entry.created" for e in frame["events"])
        await events.store.append([(version("entry.created", new_did(), None), None)])
        single = await client.sock.get()
        assert [e["sequence"] for e in single["events"]] == [6]
        await client.sock.put({"type": "unsubscribe"})
        assert (await client.sock.get()) == {"type": "unsubscribed", "lastSequence": 6}


async def test_batch_mode_bounds_the_events_waiting_not_the_frames(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`queue_size` counts events whatever the framing: in batch mode a frame carries up to 256
    of them, and a stalled reader may not hold more than `queue_size` events waiting (the
    ordinary path counted frames, so it could hold 256 times as many)."""
    async with open_events(queue_size=300) as events:
        client = events.connect()
        await client.subscribe(batch=True)
        client.sock.stall()
        await fill(events.store, 1)  # 1 is on its way to a client that reads nothing
        await trio.testing.wait_all_tasks_blocked()
        await append_transaction(events.store, 300)  # 2-301: two frames, of 256 and 44
        await trio.testing.wait_all_tasks_blocked()
        assert client.connection.waiting == 300
        assert events.logs.statistics().dropped_slow == 0
        await fill(events.store, 1)  # 302: one event more than the queue holds
        await trio.testing.wait_all_tasks_blocked()
        assert events.logs.statistics().dropped_slow == 1
        client.sock.resume()
        with trio.fail_after(60):  # closed, it would wait for good
            frames = [await client.sock.get() for _ in range(4)]
        # What waited, then the event past the bound, read on from the log (not closed).
        assert [len(frame["events"]) for frame in frames] == [1, 256, 44, 1]
        assert frames[-1]["events"][0]["sequence"] == 302
        await trio.testing.wait_all_tasks_blocked()
        assert client.connection.waiting == 0
        assert client.sock.close_frame is None


async def test_a_flood_of_client_messages_is_closed_with_4429(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_events(messages_per_minute=10) as events:
        client = events.connect()
        for _ in range(10):  # the burst is allowed
            await client.sock.put({"type": "ping"})
            assert await client.sock.get() == {"type": "pong"}
        await client.sock.put({"type": "ping"})
        await trio.testing.wait_all_tasks_blocked()
        assert client.sock.close_frame is not None
        assert client.sock.close_frame[0] == 4429
        assert reason(client) == {"code": "too_many_messages", "lastSequence": None}
    # A steady client within its rate is never closed: one message every 6 s is 10 a minute.
    async with open_events(messages_per_minute=10) as events:
        client = events.connect()
        await client.subscribe()
        for _ in range(30):
            await trio.sleep(6)
            await client.sock.put({"type": "ping"})
            assert (await client.sock.get())["type"] in ("pong", "heartbeat")
        assert client.sock.close_frame is None


# --- admin-only kinds follow the session ------------------------------------------------------


def peer_status(peer: str = "did:key:z6MkPeer") -> Change:
    return Change(
        "peer.status",
        None,
        {
            "peerDid": peer,
            "expectedCursor": 0,
            "cursor": 0,
            "status": {"breaker": None, "head": None},
            "replicas": [],
            "quarantined": [],
        },
        {"peerDid": peer},
    )


async def test_admin_only_events_stop_with_4401_once_the_admin_session_is_revoked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A logout is in the log (internal `session.revoked`): the next admin-only event closes
    the socket with 4401 and the resume point, in log order, in whichever process serves it."""
    async with open_events() as events:
        admin = StubSessions.TOKENS["admin-token"]
        await events.store.put_challenge("n", {}, 2**62)
        assert await events.store.open_session("n", admin.token_hash, admin.session)
        client = events.connect()
        await client.sock.put({"type": "auth", "token": "admin-token"})
        assert (await client.sock.get())["admin"] is True
        assert await client.subscribe(kinds=["peer.status"], fromSequence=0) == 0
        await events.store.append([(peer_status(), None)])
        assert await client.events(1) == [1]
        revoke = {"tokenHash": admin.token_hash.hex()}
        await events.store.append([(Change("session.revoked", None, revoke, revoke), None)])
        await events.store.append([(peer_status(), None)])
        await trio.testing.wait_all_tasks_blocked()
        assert client.sock.close_frame is not None
        assert client.sock.close_frame[0] == 4401
        assert client.sock.pending() == []  # the event after the logout was not sent
        assert reason(client) == {"code": "session_invalid", "lastSequence": 2}


async def test_admin_only_events_stop_with_4401_once_the_admin_session_has_expired(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_events() as events:
        client = events.connect()
        await client.sock.put({"type": "auth", "token": "admin-token"})
        assert (await client.sock.get())["admin"] is True
        assert await client.subscribe(kinds=["peer.status"], fromSequence=0) == 0
        await events.store.append([(peer_status(), None)])
        assert await client.events(1) == [1]
        events.deps.clock_ms = lambda: 2**62  # the session's expiry
        await events.store.append([(peer_status(), None)])
        await trio.testing.wait_all_tasks_blocked()
        assert reason(client) == {"code": "session_invalid", "lastSequence": 1}


async def test_a_subscription_made_after_the_admin_session_ended_gets_no_admin_kinds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Authenticated as an admin, then the session ends (a logout before this subscription's
    start, which its stream never sees): subscribing re-checks the session, so admin-only kinds
    are refused and a subscription to everything carries none."""
    async with open_events() as events:
        client = events.connect()
        await client.sock.put({"type": "auth", "token": "admin-token"})
        assert (await client.sock.get())["admin"] is True
        events.deps.sessions.revoked.add(StubSessions.TOKENS["admin-token"].token_hash)
        await client.sock.put({"type": "subscribe", "kinds": ["peer.status"]})
        answer = await client.sock.get()
        assert answer["type"] == "error"
        assert answer["error"]["code"] == "capability_missing"
        assert await client.subscribe(fromSequence=0) == 0
        await events.store.append([(peer_status(), None)])
        await events.store.append([(version("entry.created", new_did(), None), None)])
        assert await client.events(1) == [2]  # the entry event; the peer.status one is filtered


async def test_a_logout_in_a_batch_that_overflowed_does_not_end_the_admin_events_before_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The ordinary path reads on from the log after an overflow. The batch refused as `slow`
    (nothing of it handed over) must leave no trace: a logout in it was noted all the same, so
    the re-read closed the socket 4401 before the admin-only events that precede the logout."""
    async with open_events(queue_size=2) as events:
        admin = StubSessions.TOKENS["admin-token"]
        await events.store.put_challenge("n", {}, 2**62)
        assert await events.store.open_session("n", admin.token_hash, admin.session)
        client = events.connect()
        await client.sock.put({"type": "auth", "token": "admin-token"})
        assert (await client.sock.get())["admin"] is True
        assert await client.subscribe(kinds=["peer.status"], fromSequence=0) == 0
        await events.store.append([(peer_status(), None)])
        assert await client.events(1) == [1]
        client.sock.stall()
        await events.store.append([(peer_status(), None)])  # 2 is being sent
        await trio.testing.wait_all_tasks_blocked()
        revoke = {"tokenHash": admin.token_hash.hex()}
        # 3, 4 and 5 overflow the queue (2): the batch is refused whole, the logout (6) in it.
        await events.store.append(
            [(peer_status(), None)] * 3 + [(Change("session.revoked", None, revoke, revoke), None)]
        )
        await trio.testing.wait_all_tasks_blocked()
        assert events.logs.statistics().dropped_slow == 1
        client.sock.resume()
        with trio.fail_after(60):
            assert await client.events(4) == [2, 3, 4, 5]  # all before the logout
        await events.store.append([(peer_status(), None)])  # the first after it: 4401
        await trio.testing.wait_all_tasks_blocked()
        assert reason(client) == {"code": "session_invalid", "lastSequence": 6}


async def test_the_messages_sent_metric_counts_each_event_once_on_the_ordinary_path(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`registry_event_messages_sent_total` counts events handed to sockets (docs/operations.md)
    as the fast path does: the ordinary path counted each event when the sink queued it and its
    message again when it went out (twice an event, or events plus frames in batch mode)."""
    async with open_events() as events:
        single, batched = events.connect(), events.connect()
        await single.subscribe()
        await batched.subscribe(batch=True)
        await trio.testing.wait_all_tasks_blocked()  # both live
        await append_transaction(events.store, 3)
        assert await single.events(3) == [1, 2, 3]
        frame = await batched.sock.get()
        assert [e["sequence"] for e in frame["events"]] == [1, 2, 3]
        await trio.testing.wait_all_tasks_blocked()
        assert events.deps.messages_sent == 6
