"""Connections a hostile client opens and never finishes, or finishes ambiguously, on a real
socket (docs/limits.md, "Connections"). Each attack ends as documented while a bystander at
another client address gets its health answer."""

from __future__ import annotations

import json
import signal
import socket
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.db.proc import Server, run_server
from tests.hostile.conftest import SETTINGS
from tests.hostile.raw import (
    PER_CLIENT,
    connect,
    health_from,
    read_until_closed,
)


def connection_counts(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The `registry_connections_*` samples of the server's metrics, by name and labels."""
    got = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(got)
        for s in family.samples
        if s.name.startswith("registry_connections_")
    }


def test_connection_close_is_honoured(server: Server) -> None:
    for request in (
        b"GET /nope HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n",
        b"GET /nope HTTP/1.0\r\nHost: r\r\n\r\n",
    ):
        sock = connect(server.url)
        sock.sendall(request)
        data, closed = read_until_closed(sock, limit=5)
        sock.close()
        assert data.startswith(b"HTTP/1.1 404 "), data
        assert closed, "the server kept the connection open after answering"


def test_a_body_that_stops_coming_is_cut(server: Server) -> None:
    sock = connect(server.url)
    sock.sendall(
        b"POST /v1/discover HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
    )
    started = time.monotonic()
    _, closed = read_until_closed(sock, limit=8)
    sock.close()
    assert closed
    assert time.monotonic() - started < 6  # read_timeout 1.5 s, with room for a loaded machine


def test_a_head_that_trickles_is_cut_by_the_request_deadline(server: Server) -> None:
    sock = connect(server.url)
    started = time.monotonic()
    closed = False
    for byte in b"GET /v1/health HTTP/1.1\r\nHost: r\r\nX-Slow: " + b"a" * 100:
        try:
            sock.send(bytes([byte]))
        except OSError:
            closed = True
            break
        _, closed = read_until_closed(sock, limit=0.5)  # each byte well within read_timeout
        if closed:
            break
    sock.close()
    assert closed, "a request head sent a byte at a time was never cut"
    assert time.monotonic() - started < 10  # request_timeout 3 s


def test_connections_beyond_the_per_address_cap_are_refused_and_others_unaffected(
    server: Server,
) -> None:
    with ExitStack() as stack:
        held = [stack.enter_context(connect(server.url, "127.0.0.2")) for _ in range(PER_CLIENT)]
        # The held ones are counted once the server has accepted them: one answered request
        # on the last proves every earlier accept happened.
        held[-1].sendall(b"GET /v1/health HTTP/1.1\r\nHost: r\r\n\r\n")
        assert held[-1].recv(12) == b"HTTP/1.1 200"
        refused = []
        for _ in range(20):
            extra = stack.enter_context(connect(server.url, "127.0.0.2"))
            data, closed = read_until_closed(extra, limit=5)
            refused.append((data.split(b"\r\n", 1)[0], closed))
            if data:
                body = json.loads(data.split(b"\r\n\r\n", 1)[1])
                assert body["error"]["code"] == "too_many_connections"
        assert all(closed for _, closed in refused)
        assert {line for line, _ in refused} <= {b"HTTP/1.1 503 Service Unavailable", b""}
        assert any(line for line, _ in refused)
        # Another address is not affected.
        answer = health_from(server.url, "127.0.0.3")
        assert answer.status_code == 200
    # Once they are gone, the address may connect again.
    answer = health_from(server.url, "127.0.0.2")
    assert answer.status_code == 200


def test_content_length_with_transfer_encoding_is_refused_and_closes(server: Server) -> None:
    smuggled = b"GET /v1/entries/did:example:smuggled HTTP/1.1\r\nHost: r\r\n\r\n"
    body = b"0\r\n\r\n" + smuggled
    sock = connect(server.url)
    sock.sendall(
        b"POST /v1/discover HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + body
    )
    data, closed = read_until_closed(sock, limit=5)
    sock.close()
    assert closed
    assert data.count(b"HTTP/1.1 ") <= 1, "the request smuggled in the body was answered"
    if data:
        assert data.startswith(b"HTTP/1.1 400 "), data
        assert b"ambiguous_framing" in data


def test_a_websocket_handshake_with_content_length_and_transfer_encoding_is_refused(
    server: Server,
) -> None:
    """docs/limits.md, "Request framing": a handshake is a request too. It was upgraded (101),
    and what a proxy framing by the length takes for a request in the body went to the socket."""
    handshake = (
        b"GET /v1/events HTTP/1.1\r\nHost: r\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    sock = connect(server.url, "127.0.3.9")
    sock.sendall(handshake)
    data, closed = read_until_closed(sock, limit=5)
    sock.close()
    assert data.startswith(b"HTTP/1.1 400 "), data
    assert b"ambiguous_framing" in data
    assert closed
    # With its body in the same packet, Hypercorn refuses it before the app can (bytes before
    # the answer): a 400 either way, and no traceback (the package fixture reads the log).
    sock = connect(server.url, "127.0.3.9")
    sock.sendall(handshake + b"0\r\n\r\n")
    data, closed = read_until_closed(sock, limit=5)
    sock.close()
    assert data.startswith(b"HTTP/1.1 400 "), data
    assert closed


def test_malformed_or_conflicting_lengths_are_refused_and_close(server: Server) -> None:
    for lengths in (b"Content-Length: 2\r\nContent-Length: 3\r\n", b"Content-Length: +2\r\n"):
        sock = connect(server.url)
        sock.sendall(b"POST /v1/discover HTTP/1.1\r\nHost: r\r\n" + lengths + b"\r\n{}")
        data, closed = read_until_closed(sock, limit=5)
        sock.close()
        assert data.startswith(b"HTTP/1.1 400 "), data
        assert closed


def test_an_integer_literal_of_thousands_of_digits_is_a_400(server: Server) -> None:
    body = b'{"limit": ' + b"9" * 5000 + b"}"
    sock = connect(server.url)
    sock.sendall(
        b"POST /v1/discover HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    data, _ = read_until_closed(sock, limit=5)
    sock.close()
    assert data.startswith(b"HTTP/1.1 400 "), data
    error = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "invalid_json"
    assert error["details"]["rule"] == "unsafe_integer"


def test_a_flood_of_connections_from_one_address_leaves_health_fast_for_another(
    server: Server,
) -> None:
    """1,000 connect-and-hold attempts from one address: most are refused at once, the file
    table never fills, and a bystander's health checks all answer."""
    socks: list[socket.socket] = []
    try:
        for _ in range(1000):
            try:
                socks.append(connect(server.url, "127.0.0.4", timeout=2))
            except OSError:
                continue
        answers = [health_from(server.url, "127.0.0.5") for _ in range(10)]
        assert [a.status_code for a in answers] == [200] * 10
    finally:
        for sock in socks:
            sock.close()


def test_a_request_waiting_on_100_continue_is_still_cut(server: Server) -> None:
    sock = connect(server.url)
    sock.sendall(
        b"POST /v1/discover HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10\r\nExpect: 100-continue\r\n\r\n"
    )
    started = time.monotonic()
    data, closed = read_until_closed(sock, limit=12)
    sock.close()
    assert closed, "a body announced after 100 Continue and never sent held the connection"
    assert time.monotonic() - started < 10  # request_timeout 3 s
    assert data.count(b"HTTP/1.1 ") <= 1  # the 100 Continue, at most


def test_a_partial_request_behind_an_answered_one_is_cut(server: Server) -> None:
    sock = connect(server.url)
    sock.sendall(
        b"GET /v1/health HTTP/1.1\r\nHost: r\r\n\r\n"
        b"POST /v1/discover HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
    )
    started = time.monotonic()
    data, closed = read_until_closed(sock, limit=15)
    sock.close()
    assert data.startswith(b"HTTP/1.1 200 ")
    assert closed, "a partial request pipelined behind an answered one held the connection"
    # Held to the request's deadlines from when Hypercorn began it (read_timeout 1.5 s here),
    # not to the keep-alive timeout (5 s) as a connection between requests is.
    assert time.monotonic() - started < 4


def test_an_idle_keep_alive_connection_lasts_the_keep_alive_timeout(server: Server) -> None:
    """Not the read timeout (1.5 s here): a pool that reuses an idle connection must find it
    open for `keep_alive_timeout` (5 s here) after the last answer."""
    sock = connect(server.url)
    sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: r\r\n\r\n")
    assert sock.recv(12) == b"HTTP/1.1 200"
    _, closed = read_until_closed(sock, limit=3)  # past the read timeout
    assert not closed
    sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: r\r\n\r\n")  # reused: answered
    data, _ = read_until_closed(sock, limit=1)
    assert b"HTTP/1.1 200" in data
    started = time.monotonic()
    _, closed = read_until_closed(sock, limit=12)
    sock.close()
    assert closed
    assert 3 < time.monotonic() - started < 10


def test_shutdown_closes_idle_connections_at_once_and_a_busy_one_after_its_answer(
    database_url: str, tmp_path: Path
) -> None:
    """SIGTERM: an idle keep-alive connection is closed at once, not after the keep-alive
    timeout (60 s here) or the graceful timeout (30 s here); one whose request is still
    arriving (its body, or the head of its second request) gets its answer, then is closed; the
    process exits soon after."""
    settings = {
        **SETTINGS,
        "REGISTRY_SERVER__KEEP_ALIVE_TIMEOUT_SECONDS": "60",
        "REGISTRY_SERVER__READ_TIMEOUT_SECONDS": "30",
        "REGISTRY_SERVER__REQUEST_TIMEOUT_SECONDS": "60",
        "REGISTRY_SERVER__GRACEFUL_TIMEOUT_SECONDS": "30",
    }
    with run_server(tmp_path, database_url=database_url, extra_env=settings) as server:
        idle = connect(server.url)
        idle.sendall(b"GET /v1/health HTTP/1.1\r\nHost: r\r\n\r\n")
        data, _ = read_until_closed(idle, limit=1)
        assert data.startswith(b"HTTP/1.1 200 ")
        body = b'{"limit": 1}'
        busy = connect(server.url)
        busy.sendall(
            b"POST /v1/discover HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:5])
        )
        second = connect(server.url)
        second.sendall(b"GET /v1/health HTTP/1.1\r\nHost: r\r\n\r\n")
        data, _ = read_until_closed(second, limit=1)
        assert data.startswith(b"HTTP/1.1 200 ")
        second.sendall(b"GET /v1/health HTTP/1.1\r\nHo")  # the next request's first bytes
        read_until_closed(busy, limit=0.5)  # the heads are in
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        _, closed = read_until_closed(idle, limit=10)
        assert closed, "an idle connection was kept open through the shutdown"
        assert time.monotonic() - started < 10
        _, closed = read_until_closed(busy, limit=1)
        assert not closed, "a connection with a request under way was closed before its answer"
        busy.sendall(body[5:])
        data, closed = read_until_closed(busy, limit=10)
        assert data.startswith(b"HTTP/1.1 200 "), data
        assert closed
        second.sendall(b"st: r\r\n\r\n")
        data, closed = read_until_closed(second, limit=10)
        assert data.startswith(b"HTTP/1.1 200 "), data
        assert closed
        assert server.proc.wait(timeout=20) == 0
        assert time.monotonic() - started < 20
        idle.close()
        busy.close()
        second.close()


def test_each_request_of_a_kept_alive_connection_is_answered_for_its_own_head(
    server: Server,
) -> None:
    """The app reads each request's head from that request's ASGI scope (api/headers.py):
    nothing of one request (its X-Request-Id, its unread body) carries into the next on the
    same connection."""
    sock = connect(server.url)
    sock.sendall(
        b"GET /v1/health HTTP/1.1\r\nHost: r\r\nX-Request-Id: mine-1\r\n\r\n"
        b"GET /v1/health HTTP/1.1\r\nHost: r\r\n\r\n"
        b"POST /v1/nope HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n"
    )
    data, closed = read_until_closed(sock, limit=10)
    sock.close()
    answers = [a for a in data.split(b"HTTP/1.1 ")[1:]]
    assert [a[:3] for a in answers] == [b"200", b"200", b"404"], data
    heads = [dict(_header_lines(a)) for a in answers]
    assert heads[0]["x-request-id"] == "mine-1"
    assert heads[1]["x-request-id"] not in ("", "mine-1")
    assert "connection" not in heads[1]
    assert heads[2]["connection"] == "close"  # its chunked body was never read
    assert closed


def _header_lines(answer: bytes) -> list[tuple[str, str]]:
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")[1:]
    return [(n.strip().lower(), v.strip()) for n, _, v in (line.partition(":") for line in head)]


def test_connections_refused_or_cut_are_counted_in_the_metrics(server: Server) -> None:
    """A connection refused over a cap, or cut because its request stopped coming, never
    reaches the app: it left no request in the metrics and no access line, so an operator
    could not see a flood or a slow-loris at all (only a refusal's log line, once every 10 s)."""
    before = connection_counts(server)
    cut = ("registry_connections_cut_total", (("reason", "request"),))
    refused = ("registry_connections_refused_total", ())
    assert ("registry_connections_open", ()) in before
    sock = connect(server.url, "127.0.0.4")
    sock.sendall(b"POST /v1/discover HTTP/1.1\r\nHost: r\r\nContent-Length: 10\r\n\r\n{")
    _, closed = read_until_closed(sock, limit=8)
    sock.close()
    assert closed
    with ExitStack() as stack:
        held = [stack.enter_context(connect(server.url, "127.0.0.4")) for _ in range(PER_CLIENT)]
        held[-1].sendall(b"GET /v1/health HTTP/1.1\r\nHost: r\r\n\r\n")
        assert held[-1].recv(12) == b"HTTP/1.1 200"
        extra = stack.enter_context(connect(server.url, "127.0.0.4"))
        assert read_until_closed(extra, limit=5)[1]
        after = connection_counts(server)
        assert after[("registry_connections_open", ())] >= PER_CLIENT
    assert after[cut] - before.get(cut, 0) == 1
    assert after[refused] - before.get(refused, 0) >= 1


_GET = b"GET /nope HTTP/1.1\r\nHost: r\r\n"
# ~50 KB: within one of Hypercorn's reads (64 KiB), so h11's bound of an incomplete head never
# sees it incomplete.
_FIELDS_5000 = b"".join(b"X-%d: a\r\n" % i for i in range(5_000))


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(_GET + _FIELDS_5000 + b"\r\n", id="5,000 fields"),
        pytest.param(_GET + b"X-Big: " + b"a" * 40_000 + b"\r\n\r\n", id="one field of 40 KB"),
        pytest.param(_GET + b"\r\n" + _GET + _FIELDS_5000 + b"\r\n", id="behind a small request"),
        pytest.param(
            _GET + b"".join(b"X-%d: a\r\n" % i for i in range(100)) + b"\r\n", id="101 fields"
        ),
    ],
)
def test_a_request_head_over_16_kib_or_100_fields_is_refused_431_however_it_arrives(
    server: Server, sent: bytes
) -> None:
    """h11 bounds a head only while it is still arriving: one sent whole (or pipelined behind
    another request) was parsed at any size, ~40 ms of CPU for 12,000 fields on a path that
    spends no budget. Now 431 before it is parsed, and the connection closed."""
    sock = connect(server.url)
    sock.sendall(sent)
    data, closed = read_until_closed(sock, limit=5)
    sock.close()
    assert data[data.rfind(b"HTTP/1.1 ") :].startswith(b"HTTP/1.1 431 "), data[:300]
    assert closed
    assert data.count(b"HTTP/1.1 ") == sent.count(b"GET ")  # (the small one's 404 first)


def test_a_head_of_100_fields_and_near_16_kib_is_served(server: Server) -> None:
    fields = b"".join(b"X-%02d: %s\r\n" % (i, b"a" * 150) for i in range(99))
    head = b"GET /v1/health HTTP/1.1\r\nHost: r\r\n" + fields + b"\r\n"
    assert 15_000 < len(head) <= 16 * 1024
    sock = connect(server.url)
    sock.sendall(head)
    answer = sock.recv(12)
    sock.close()
    assert answer == b"HTTP/1.1 200"


def test_empty_lines_before_a_request_line_are_ignored(server: Server) -> None:
    """RFC 9112 §2.2: a server ignores at least one empty line before a request line (a client
    may send one after a POST's body). h11 answered the pipelined second request 400."""
    health = b"GET /v1/health HTTP/1.1\r\nHost: r\r\n\r\n"
    sock = connect(server.url)
    sock.sendall(b"\r\n" + health + b"\r\n\r\n" + health[:10])
    sock.sendall(health[10:])
    deadline = time.monotonic() + 10
    data = b""
    while data.count(b"HTTP/1.1 ") < 2 and time.monotonic() < deadline:
        data += sock.recv(65536)
    sock.close()
    assert data.count(b"HTTP/1.1 200 ") == 2, data


def _h2_get(server: Server, fields: int) -> list[Any]:
    """GET /v1/health over HTTP/2 with prior knowledge, carrying `fields` extra header fields,
    without ever acknowledging the server's SETTINGS: the h2 events that came back."""
    import h2.config
    import h2.connection

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    headers = [
        (":method", "GET"),
        (":path", "/v1/health"),
        (":scheme", "http"),
        (":authority", "r"),
    ]
    headers += [(f"x-{i}", "a") for i in range(fields)]
    conn.send_headers(1, headers, end_stream=True)
    with connect(server.url) as sock:
        sock.sendall(conn.data_to_send())  # the SETTINGS ACK is never sent
        data, _ = read_until_closed(sock, limit=5)
    return list(conn.receive_data(data))


def test_an_http2_header_list_over_16_kib_ends_the_connection_before_any_acknowledgement(
    server: Server,
) -> None:
    """h2 applies its advertised header list size only once the client acknowledges SETTINGS:
    a client that never did could send 64 KiB (~2,000 fields), past the bound an HTTP/1.1
    head has. Now Hypercorn's h2_max_header_list_size (16 KiB) holds from the first frame."""
    import h2.events

    small = _h2_get(server, 10)
    assert any(isinstance(e, h2.events.ResponseReceived) for e in small), small
    big = _h2_get(server, 1_000)  # ~1,000 × 37 bytes as h2 counts them: 37 KB
    assert not any(isinstance(e, h2.events.ResponseReceived) for e in big), big
    assert any(isinstance(e, h2.events.ConnectionTerminated) for e in big), big
