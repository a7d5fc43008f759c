"""The connection bounds of ws/transport.py as plain rules: admission counts per client address,
and the client's WebSocket frames parsed from their headers (and text and close payloads checked
as RFC 6455 asks, as wsproto does), however the bytes are split."""

from __future__ import annotations

import os

import pytest
import trio
from wsproto.frame_protocol import FrameProtocol, ParseFailed

from registry.ratelimit import Bucket, Rate, client_key, is_idle
from ws import transport
from ws.transport import ClientFrames, ConnectionGuard, ConnectionLimits, _FrameRefused


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
        ("::ffff:10.1.2.3", "10.1.2.3"),
        ("not-an-address", "not-an-address"),
    ],
)
def test_a_client_is_its_address_or_its_ipv6_64(host: str, key: str) -> None:
    assert client_key(host) == key


async def test_admission_counts_per_address_and_in_all() -> None:
    guard = ConnectionGuard(ConnectionLimits(max_connections=3, max_per_client=2))
    assert guard.admit("a") is None
    assert guard.admit("a") is None
    assert guard.admit("a") == "too many open connections from this address"
    assert guard.admit("b") is None
    assert guard.admit("c") == "the server has too many open connections"
    guard.release("a")
    assert guard.admit("c") is None
    assert guard.statistics() == {"open": 3, "clients": 3, "refused": 2, "failed": 0}
    for key in ("a", "b", "c"):
        guard.release(key)
    assert guard.statistics() == {"open": 0, "clients": 0, "refused": 2, "failed": 0}


def frame(
    payload: bytes, opcode: int = 0x1, *, final: bool = True, declared: int | None = None
) -> bytes:
    """A client frame, masked as a client masks it."""
    size = len(payload) if declared is None else declared
    first = (0x80 if final else 0) | opcode
    if size < 126:
        head = bytes((first, 0x80 | size))
    elif size < 1 << 16:
        head = bytes((first, 0xFE)) + size.to_bytes(2, "big")
    else:
        head = bytes((first, 0xFF)) + size.to_bytes(8, "big")
    mask = os.urandom(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


LIMITS = ConnectionLimits(max_ws_message=1000, ws_control_per_minute=3)


def feed_split(frames: ClientFrames, data: bytes, step: int, now: float = 0.0) -> None:
    for i in range(0, len(data), step):
        frames.feed(data[i : i + step], now)


@pytest.mark.parametrize("step", [1, 2, 3, 7, 13, 100_000])
def test_messages_within_the_limit_pass_however_the_bytes_are_split(step: int) -> None:
    stream = (
        frame(b"x" * 1000)
        + frame(b"y" * 125)
        + frame(b"z" * 126)
        + frame(b"a" * 500, final=False)
        + frame(b"b" * 500, opcode=0x0)
        + frame(b"", opcode=0xA)
        + frame(b"q" * 1000, opcode=0x2)
    )
    feed_split(ClientFrames(LIMITS), stream, step)


@pytest.mark.parametrize("step", [1, 5, 100_000])
def test_a_message_over_the_limit_is_refused_from_its_header(step: int) -> None:
    frames = ClientFrames(LIMITS)
    data = frame(b"", declared=16_000_000)  # the header alone: no payload was sent
    with pytest.raises(_FrameRefused) as refused:
        feed_split(frames, data, step)
    assert refused.value.code == 1009


def test_fragments_are_counted_together() -> None:
    frames = ClientFrames(LIMITS)
    frames.feed(frame(b"a" * 600, final=False), 0.0)
    frames.feed(frame(b"", opcode=0x9), 0.0)  # a ping between fragments is its own
    with pytest.raises(_FrameRefused) as refused:
        frames.feed(frame(b"", opcode=0x0, declared=401), 0.0)
    assert refused.value.code == 1009


def test_pings_beyond_the_budget_are_refused_and_it_refills() -> None:
    frames = ClientFrames(LIMITS)
    for _ in range(3):
        frames.feed(frame(b"p", opcode=0x9), 0.0)
    with pytest.raises(_FrameRefused) as refused:
        frames.feed(frame(b"p", opcode=0x9), 1.0)
    assert refused.value.code == 1008
    later = ClientFrames(LIMITS)
    for second in range(0, 200, 20):  # one every 20 s: within 3 a minute
        later.feed(frame(b"p", opcode=0x9), float(second))


def unfinished(data: bytes) -> bytes:
    """`data`, a frame, with its FIN bit cleared."""
    return bytes((data[0] & 0x7F,)) + data[1:]


def wsproto_refusal(data: bytes) -> int | None:
    """The close code Hypercorn's parser (wsproto) refuses the client's bytes with, if any."""
    parser = FrameProtocol(client=False, extensions=[])
    parser.receive_bytes(data)
    try:
        list(parser.received_frames())
    except ParseFailed as failed:
        return int(failed.code)
    return None


TEXT = "é€😀 ünïcödé".encode()
ALLOWED = (
    unfinished(frame(TEXT[:1]))
    + frame(b"p", opcode=0x9)  # a ping between fragments is its own
    + unfinished(frame(TEXT[1:5], opcode=0x0))
    + unfinished(frame(b"", opcode=0x0))
    + frame(TEXT[5:], opcode=0x0)
    + frame(TEXT)
    + frame(b"", opcode=0x1)
    + frame(b"\xff\xfe", opcode=0x2)  # binary: no rule on its bytes (the app refuses it)
    + frame(b"\x03\xe8bye \xc3\xa9", opcode=0x8)
)


@pytest.mark.parametrize("step", [1, 2, 3, 5, 100_000])
def test_utf_8_split_across_fragments_and_reads_passes(step: int) -> None:
    """A character may be cut anywhere: between fragments, between reads, or both."""
    assert wsproto_refusal(ALLOWED) is None
    feed_split(ClientFrames(LIMITS), ALLOWED, step)


REFUSED = {
    "invalid UTF-8 in a text frame": (frame(b'{"x":"\xff"}'), 1007),
    "a character cut by the message's end": (
        unfinished(frame(b"\xe2\x82")) + frame(b"", opcode=0x0),
        1007,
    ),
    "invalid UTF-8 across fragments": (
        unfinished(frame(b'{"x":"\xc3')) + frame(b'\x28"}', opcode=0x0),
        1007,
    ),
    "a close reason that is not UTF-8": (frame(b"\x03\xe8\xff", opcode=0x8), 1007),
    "a close code no client may send": (frame(b"\x00\x01", opcode=0x8), 1002),
    "a local-only close code": (frame(b"\x03\xed", opcode=0x8), 1002),
    "a close frame of 1 byte": (frame(b"\x03", opcode=0x8), 1002),
    "a reserved opcode": (frame(b"{}", opcode=0x3), 1002),
    "a reserved control opcode": (frame(b"", opcode=0xB), 1002),
    "an unmasked frame": (bytes((0x81, 0x02)) + b"{}", 1002),
    "an empty unmasked frame": (bytes((0x81, 0x00)), 1002),
    "an empty unmasked ping": (bytes((0x89, 0x00)), 1002),
    "a fragmented ping": (unfinished(frame(b"p", opcode=0x9)), 1002),
    "a control frame over 125 bytes": (frame(b"p" * 126, opcode=0xA), 1002),
    "a length not in its shortest form": (bytes((0x81, 0xFE, 0, 5)) + bytes(9), 1002),
    "a continuation with no message": (frame(b"x", opcode=0x0), 1002),
    "a new message inside a fragmented one": (unfinished(frame(b"x")) + frame(b"y"), 1002),
}


@pytest.mark.parametrize("step", [1, 3, 100_000])
@pytest.mark.parametrize(("data", "code"), REFUSED.values(), ids=REFUSED.keys())
def test_a_frame_rfc_6455_does_not_allow_is_refused_with_its_close_code(
    data: bytes, code: int, step: int
) -> None:
    """What wsproto would refuse with no close frame sent (Hypercorn just closes the
    connection) is refused here first: 1007 for text that is not UTF-8, 1002 for the rest."""
    assert wsproto_refusal(data) == code
    with pytest.raises(_FrameRefused) as refused:
        feed_split(ClientFrames(LIMITS), data, step)
    assert refused.value.code == code


async def test_the_guard_logs_refusals_at_most_every_ten_seconds(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    guard = ConnectionGuard(ConnectionLimits(max_connections=1, max_per_client=1))
    assert guard.admit("a") is None
    for _ in range(100):
        guard.admit("a")
    await trio.sleep(10)
    guard.admit("a")
    warnings = [r for r in caplog.records if r.name == "ws.transport"]
    assert len(warnings) == 2
    assert "101 refused so far" in warnings[-1].getMessage()


async def test_new_connections_from_one_address_are_admitted_by_a_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A flood of short connections (each closed after its answer, so never many open at once)
    is refused past `connections_per_minute_per_client`, and the budget refills."""
    guard = ConnectionGuard(ConnectionLimits(connections_per_minute_per_client=60))
    admitted = 0
    for _ in range(100):
        if guard.admit("a") is None:
            admitted += 1
            guard.release("a")
    assert admitted == 60
    assert guard.admit("a") == "too many new connections from this address"
    assert guard.admit("b") is None  # another address has its own
    await trio.sleep(1)  # one a second comes back
    assert guard.admit("a") is None


async def test_addresses_seen_at_once_past_the_bound_do_not_make_every_admission_sweep(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New-connection buckets past `MAX_BUCKETS` are swept of the full ones; where none is full
    (every address opened a connection within the minute), sweeping again at each admission
    walked them all for every new connection (IPv6 clients pick a new /64 at will). The next
    sweep waits until their number has doubled; full ones are still forgotten."""
    monkeypatch.setattr(transport, "MAX_BUCKETS", 10)
    looked_at = 0

    def counted(bucket: Bucket, rate: Rate, now: float) -> bool:
        nonlocal looked_at
        looked_at += 1
        return is_idle(bucket, rate, now)

    monkeypatch.setattr(transport, "is_idle", counted)
    guard = ConnectionGuard(ConnectionLimits())
    for n in range(1000):
        assert guard.admit(f"client-{n}") is None
        guard.release(f"client-{n}")
    assert looked_at < 3000  # (each admission sweeping: ~500,000)
    await trio.sleep(60)  # every bucket refilled: the next sweep forgets them
    for n in range(1000, 3000):
        assert guard.admit(f"client-{n}") is None
        guard.release(f"client-{n}")
    assert "client-0" not in guard._opened
