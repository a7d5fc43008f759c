"""Sealed cursors: the one codec of every opaque paging cursor the registry issues.

A cursor is `base64url(tag ‖ body)` without padding, where `body` is the compact JSON of the
position and `tag` the first 16 bytes of HMAC-SHA-256 of `body` under a key derived for one
purpose from the registry's secret (`SHA-256(purpose ‖ 0x00 ‖ secret)`), so a cursor of one
kind never opens as another, and a client can neither forge nor alter one. What the position
holds, and which query it is bound to, is each caller's business (discovery, federated
discovery, an entry's anchors).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any

from registry.errors import Invalid

TAG_BYTES = 16


class SealedCursors:
    def __init__(self, secret: bytes, purpose: bytes) -> None:
        self._key = hashlib.sha256(purpose + b"\0" + secret).digest()

    def _tag(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()[:TAG_BYTES]

    def seal(self, position: Any, *, sort_keys: bool = False) -> str:
        body = json.dumps(position, separators=(",", ":"), sort_keys=sort_keys).encode()
        return base64.urlsafe_b64encode(self._tag(body) + body).rstrip(b"=").decode("ascii")

    def open(self, cursor: str, bad: Invalid) -> Any:
        """The position sealed in `cursor`; raises `bad` for anything this codec did not seal
        under its key (the caller then checks what the position holds)."""
        try:
            raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        except (ValueError, TypeError):
            raise bad from None
        # One spelling per cursor: the decoder skips characters outside the alphabet and the
        # unused bits of the last one, so an altered cursor opened as the original (and each
        # spelling missed the result cache, which keys pages by the cursor's text).
        if base64.urlsafe_b64encode(raw).rstrip(b"=") != cursor.encode("utf-8", "replace"):
            raise bad
        tag, body = raw[:TAG_BYTES], raw[TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(body)):
            raise bad
        try:
            return json.loads(body)
        except ValueError:
            raise bad from None
