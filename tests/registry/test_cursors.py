"""Discovery cursors: opaque, authenticated, bound to their query and to the ranking they were
issued under."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any

import pytest

from registry.discovery import (
    CURSOR_VERSION,
    CursorCodec,
    parse_discover_request,
    query_fingerprint,
)
from registry.errors import Invalid

SECRET = b"\x01" * 32


def _forge(query: Any, version: int, position: list[Any]) -> str:
    """A cursor as a server with this secret would have issued it under `version`."""
    key = hashlib.sha256(b"registry discover cursor\0" + SECRET).digest()
    body = json.dumps(
        {"v": version, "q": query_fingerprint(query), "k": position}, separators=(",", ":")
    ).encode()
    tag = hmac.new(key, body, hashlib.sha256).digest()[:16]
    return base64.urlsafe_b64encode(tag + body).rstrip(b"=").decode("ascii")


def test_a_cursor_round_trips_for_its_query_only() -> None:
    codec = CursorCodec(SECRET)
    query = parse_discover_request({"tags": ["a"]})
    cursor = codec.encode(query, [42])
    assert codec.decode(query, cursor) == [42]
    with pytest.raises(Invalid) as error:
        codec.decode(parse_discover_request({"tags": ["b"]}), cursor)
    assert error.value.code == "invalid_cursor"
    with pytest.raises(Invalid):
        CursorCodec(b"\x02" * 32).decode(query, cursor)  # another registry's
    assert _forge(query, CURSOR_VERSION, [42]) == cursor


def test_version_1_cursors_are_refused_only_where_the_rank_changed() -> None:
    """Version 1 ranked by ts_rank_cd: its rank values would misplace the next page of a
    relevance ordering; its other orderings are unchanged and still page."""
    codec = CursorCodec(SECRET)
    ranked = parse_discover_request({"text": "invoice"})
    with pytest.raises(Invalid) as error:
        codec.decode(ranked, _forge(ranked, 1, [0.5, "did:web:x"]))
    assert error.value.code == "invalid_cursor"
    by_name = parse_discover_request({"orderBy": "name"})
    assert codec.decode(by_name, _forge(by_name, 1, ["a", "did:web:x"])) == ["a", "did:web:x"]
    with pytest.raises(Invalid):
        codec.decode(by_name, _forge(by_name, 99, ["a", "did:web:x"]))
