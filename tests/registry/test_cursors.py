"""The one cursor codec: positions round-trip, and nothing else opens."""

from __future__ import annotations

import base64

import pytest

from registry.cursors import SealedCursors
from registry.errors import Invalid

BAD = Invalid("not ours", code="invalid_cursor")


def test_a_sealed_position_opens_as_itself() -> None:
    cursors = SealedCursors(b"secret", b"registry test cursor")
    for position in ([1, "a", None], {"v": 1, "k": [2.5, "z"]}, "x"):
        assert cursors.open(cursors.seal(position), BAD) == position


def test_the_wire_form_is_unpadded_base64url_of_a_16_byte_tag_and_compact_json() -> None:
    cursor = SealedCursors(b"secret", b"p").seal({"b": 1, "a": [1, 2]}, sort_keys=True)
    assert "=" not in cursor
    raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
    assert raw[16:] == b'{"a":[1,2],"b":1}'


@pytest.mark.parametrize(
    "other",
    [
        SealedCursors(b"secret", b"registry other cursor"),  # another purpose
        SealedCursors(b"another secret", b"registry test cursor"),  # another registry
    ],
)
def test_a_cursor_of_another_purpose_or_secret_does_not_open(other: SealedCursors) -> None:
    cursors = SealedCursors(b"secret", b"registry test cursor")
    with pytest.raises(Invalid):
        cursors.open(other.seal([1]), BAD)


def test_an_altered_or_invented_cursor_does_not_open() -> None:
    cursors = SealedCursors(b"secret", b"registry test cursor")
    cursor = cursors.seal({"k": [1]})
    raw = bytearray(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    raw[-2] ^= 1  # one bit of the body
    altered = base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()
    for bad in (altered, "", "!!!", "a", cursor[:-3], "AAAA" * 10):
        with pytest.raises(Invalid) as raised:
            cursors.open(bad, BAD)
        assert raised.value is BAD


def test_a_cursor_has_one_spelling() -> None:
    """The decoder skips what is outside the alphabet, padding, and the unused bits of the last
    character: each of these spelled the same position and opened (a 200 for an altered cursor,
    and a result-cache miss per spelling)."""
    cursors = SealedCursors(b"secret", b"registry test cursor")
    for position in ({"k": [1]}, {"k": [12]}, {"k": [123]}):  # the three lengths mod 4
        cursor = cursors.seal(position)
        assert cursors.open(cursor, BAD) == position
        last = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
        other_bits = [
            cursor[:-1] + c
            for c in last
            if c != cursor[-1]
            and base64.urlsafe_b64decode(cursor[:-1] + c + "=" * (-len(cursor) % 4))
            == base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        ]
        respelled = [
            cursor[:10] + "!!!!" + cursor[10:],
            cursor + "=" * (-len(cursor) % 4 or 4),
            " " + cursor,
            cursor[:5] + "\n" + cursor[5:],
            *other_bits,
        ]
        for spelling in respelled:
            with pytest.raises(Invalid) as raised:
                cursors.open(spelling, BAD)
            assert raised.value is BAD, spelling


def test_the_longest_discovery_cursor_issued_is_accepted_back() -> None:
    """Every sort value at its longest (a name of 256 astral characters, escaped in JSON, a DID
    of 2,048 characters, both times, a rank): the cursor still fits what a request may carry."""
    from datetime import UTC, datetime

    from registry.discovery import MAX_CURSOR_CHARS, CursorCodec, DiscoverRequest
    from registry.registryql import parse_registryql

    query = parse_registryql(
        "DISCOVER * WHERE MATCH 'x'"
        " ORDER BY relevance DESC, publishedAt DESC, updatedAt DESC, name DESC"
    )
    moment = datetime(2026, 1, 1, 23, 59, 59, 999999, tzinfo=UTC)
    did = "did:web:" + "%41" * 680
    assert len(did) == 2048
    position = [1.2345678e-20, moment, moment, "\U0001f600" * 256, did]
    cursor = CursorCodec(b"k" * 32).encode(query, position)
    assert len(cursor) <= MAX_CURSOR_CHARS
    assert DiscoverRequest.model_validate({"cursor": cursor}).cursor == cursor
