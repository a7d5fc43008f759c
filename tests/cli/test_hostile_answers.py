"""The client commands against a server that answers what no registry does (a small HTTP server
in a thread): a cursor that does not move on, answers of the wrong shape, an answer without end.
Each ends with one line that blames the server at --url, status 1, within the deadline."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import trio
from trio_websocket import WebSocketRequest, serve_websocket

from cli.watch import Watcher, WatchError, WatchOptions
from registry.keys import SigningKey, write_key_file
from registry.signin import new_challenge
from tests.cli.cli_support import Cli

DID = "did:web:hostile.example"
DEADLINE = 30


@dataclass
class Answers:
    """What the server answers, by path: a status and a body (bytes, or chunks sent until the
    client goes away)."""

    by_path: dict[str, Callable[[], tuple[int, bytes | Iterable[bytes]]]] = field(
        default_factory=dict
    )
    asked: list[str] = field(default_factory=list)

    def json(self, path: str, value: Any, status: int = 200) -> None:
        self.by_path[path] = lambda: (status, json.dumps(value).encode())


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[tuple[Answers, Cli]]:
    answers = Answers()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            path = urlsplit(self.path).path
            answers.asked.append(self.path)
            status, body = answers.by_path.get(path, lambda: (404, b"{}"))()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            if isinstance(body, bytes):
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.end_headers()  # no length: the body ends when the connection does
            try:
                for chunk in body:
                    self.wfile.write(chunk)
            except OSError:  # the client went away
                pass

        do_GET = do_POST = do_PUT = do_DELETE = _answer

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    cli = Cli(tmp_path, f"http://127.0.0.1:{httpd.server_address[1]}")
    write_key_file(tmp_path / "me.key", SigningKey.generate())
    try:
        yield answers, cli
    finally:
        httpd.shutdown()
        httpd.server_close()


def _blames_the_server(cli: Cli, line: str) -> None:
    assert line.startswith(f"registry: {cli.url} answered "), line
    assert line.endswith("which is not a registry answer; check --url"), line


@pytest.mark.parametrize("cursor", [None, "7"])
def test_versions_stops_at_a_page_whose_cursor_came_before(
    fake: tuple[Answers, Cli], cursor: str | None
) -> None:
    """A server answering every page with the same cursor (and hasMore) was followed forever:
    `registry versions` printed nothing, its memory grew, and it never ended."""
    answers, cli = fake
    version = {"entryDid": DID, "sequence": 7, "version": "1.0.0", "name": "x"}
    page = {"entryDid": DID, "versions": [version], "cursor": "7", "hasMore": True}
    answers.json(f"/v1/entries/{DID}/versions", page)
    ran = cli("versions", DID, *(() if cursor is None else ("--cursor", cursor)))
    _blames_the_server(cli, ran.error_line())
    assert "cursor '7' again" in ran.stderr
    assert len(answers.asked) <= 2


def test_verify_anchor_stops_at_a_page_whose_cursor_came_before(fake: tuple[Answers, Cli]) -> None:
    answers, cli = fake
    page = {"records": [], "cursor": "abc", "hasMore": True}
    answers.json(f"/v1/anchors/{DID}", page)
    ran = cli("verify-anchor", DID)
    _blames_the_server(cli, ran.error_line())
    assert len(answers.asked) == 2


SHAPES = [
    pytest.param(b"[]", "HTTP 200 with JSON that is not an object", id="array"),
    pytest.param(b"{}", "HTTP 200 without", id="empty-object"),
    pytest.param(b'{"sequence": NaN}', "HTTP 200, which", id="nan"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, "HTTP 200, which", id="too-deep"),
]


@pytest.mark.parametrize(("body", "says"), SHAPES)
@pytest.mark.parametrize(
    "command",
    [["get", DID], ["update", "entry.json", "--key", "me.key"], ["login", "--key", "me.key"]],
)
def test_an_answer_of_another_shape_blames_the_server(
    fake: tuple[Answers, Cli], body: bytes, says: str, command: list[str]
) -> None:
    """A success answer that is not the registry's (another JSON API at --url, a broken
    proxy) ended as `unexpected error: KeyError ... (a bug; ...)`, blaming the command."""
    answers, cli = fake
    cli.write("entry.json", {"entryDid": DID, "itemData": {}})
    for path in (f"/v1/entries/{DID}", "/v1/auth/siws/challenge"):
        answers.by_path[path] = lambda: (200, body)
    line = cli(*command).error_line()
    _blames_the_server(cli, line)
    assert f"answered {says}" in line, line


@pytest.mark.parametrize(
    ("command", "path", "value", "says"),
    [
        (["versions", DID], f"/v1/entries/{DID}/versions", {"versions": [1]}, "versions are not"),
        (["versions", DID], f"/v1/entries/{DID}/versions", {"hasMore": False}, "without versions"),
        (["verify-anchor", DID], f"/v1/anchors/{DID}", {"records": "x"}, "records are not"),
        (["peers"], "/v1/federation/peers", [None], "peers are not objects"),
        (["peers"], "/v1/federation/peers", {"peers": []}, "not an array"),
    ],
)
def test_a_page_of_another_shape_blames_the_server(
    fake: tuple[Answers, Cli], command: list[str], path: str, value: Any, says: str
) -> None:
    answers, cli = fake
    answers.json(path, value)
    line = cli(*command).error_line()
    _blames_the_server(cli, line)
    assert says in line, line


@pytest.mark.parametrize(
    "error",
    [
        {"code": 5, "message": "x"},
        {"code": "read_rate_limited", "message": "x", "details": {"retryAfterSeconds": "soon"}},
        {"code": "read_rate_limited", "message": "x", "details": [1]},
    ],
)
def test_an_error_answer_of_another_shape_is_one_line(
    fake: tuple[Answers, Cli], error: dict[str, Any]
) -> None:
    answers, cli = fake
    answers.json(f"/v1/entries/{DID}", {"error": error}, status=429)
    line = cli("get", DID).error_line()
    assert "unexpected error" not in line, line


def test_watch_against_a_server_that_is_no_event_stream(fake: tuple[Answers, Cli]) -> None:
    """An HTTP answer to the WebSocket upgrade (a 404 from a server without /v1/events) was
    retried forever, each attempt a line with the raw response headers."""
    answers, cli = fake
    answers.json("/v1/health", {"status": "ok"})
    line = cli("watch", "--max-events", "1").error_line()
    assert line == (
        f"registry: watch: {cli.url.replace('http', 'ws')}/v1/events answered HTTP 404 to the"
        " upgrade, which is not a registry's event stream; check --url"
    )


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        (["not json"], "a message that is not JSON"),
        (["[1, 2]"], "not a JSON object"),
        (['{"type": "subscribed"}'], "a subscription without a sequence"),
        (['{"type": "subscribed", "fromSequence": 0}', '{"type": "event"}'], "without a sequence"),
        (['{"type": "error", "error": "no"}'], "None: None"),
    ],
)
async def test_watch_ends_at_a_message_no_registry_sends(messages: list[str], says: str) -> None:
    """Each ended the watch with `unexpected error: JSONDecodeError ... (a bug; ...)` (or a
    KeyError, AttributeError)."""

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.get_message()  # the subscription
        for message in messages:
            await ws.send_message(message)
        await trio.sleep_forever()  # until the client goes

    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(partial(serve_websocket, handler, "127.0.0.1", 0, None))
            url = f"http://127.0.0.1:{server.port}"
            notes: list[str] = []
            with pytest.raises(WatchError, match=re.escape(says)):
                await Watcher(WatchOptions(url=url), lambda line: None, note=notes.append).run()
            assert notes == []  # not retried
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("command", "path", "value"),
    [
        (["peers"], "/v1/federation/peers", [{"peerDid": "did:key:z6Mk"}]),
        (
            ["peers"],
            "/v1/federation/peers",
            [{"peerDid": 7, "endpoint": "x", "agreementIds": [], "lastSeen": None}],
        ),
        (["peers", "--status"], "/v1/admin/federation/peers", [{"peerDid": "did:key:z6Mk"}]),
        (["status"], "/v1/admin/overview", {"peers": [{"peerDid": "did:key:z6Mk"}]}),
        (["status"], "/v1/admin/overview", {"anchoring": {"enabled": True, "recentBatches": [1]}}),
    ],
)
def test_a_table_of_an_answer_that_lacks_its_members_blames_the_server(
    fake: tuple[Answers, Cli], command: list[str], path: str, value: Any
) -> None:
    """Rows or an overview without the members the table shows ended as `unexpected error:
    KeyError ... (a bug; ...)`."""
    answers, cli = fake
    session = {"url": cli.url, "did": "did:key:z6Mk", "sessionToken": "t", "savedAtMs": 1}
    session["expiresAtMs"] = 2**52
    cli.session_file.write_text(json.dumps({"sessions": [session]}))
    answers.json(path, value)
    line = cli(*command).error_line()
    _blames_the_server(cli, line)
    assert "that cannot be shown" in line, line


@pytest.mark.parametrize("expires", ["tomorrow", 1e300, None])
def test_login_with_a_session_that_cannot_be_read_blames_the_server(
    fake: tuple[Answers, Cli], expires: Any
) -> None:
    """A sign-in answer whose expiresAtMs is no time ended `login` as `unexpected error:
    TypeError ... (a bug; ...)`, after the session had been saved; now nothing is saved."""
    answers, cli = fake
    challenge = new_challenge(
        audience="registry-client",
        origin=cli.url or "",
        chain_id="registry:local",
        registry_did=SigningKey.generate().did,
        root_did="",
        now_ms=1,
    )
    answers.json("/v1/auth/siws/challenge", {"challenge": challenge})
    answers.json("/v1/auth/siws/verify", {"sessionToken": "t", "expiresAtMs": expires})
    line = cli("login", "--key", "me.key").error_line()
    _blames_the_server(cli, line)
    assert "a session that cannot be shown" in line, line
    assert not cli.session_file.exists()


@pytest.mark.parametrize(
    "challenge", [{"nonce": "n"}, "a challenge", {"origin": "x", "signerDid": "y"}, {"v": 0.5}]
)
def test_a_challenge_that_cannot_be_signed_blames_the_server(
    fake: tuple[Answers, Cli], challenge: Any
) -> None:
    answers, cli = fake
    answers.json("/v1/auth/siws/challenge", {"challenge": challenge})
    line = cli("login", "--key", "me.key").error_line()
    _blames_the_server(cli, line)
    assert "a challenge that cannot be signed" in line, line
