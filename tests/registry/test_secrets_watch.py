"""The watch over the run's log lines (tests/secrets_watch.py) finds what it must."""

from __future__ import annotations

import logging

from registry.keys import SigningKey, b64url_encode
from registry.usecases import sessions
from tests import secrets_watch


def test_a_planted_secret_in_a_log_line_is_found_and_nothing_else() -> None:
    key = SigningKey.generate()  # planted by the session's watch
    token, _ = sessions.new_session_token()
    signature = b64url_encode(key.sign(b"message"))
    before = len(secrets_watch.LEAKS)
    log = logging.getLogger("registry.test")
    log.info("a line with nothing secret: %s", "x" * 60)
    assert len(secrets_watch.LEAKS) == before
    for secret in (token, b64url_encode(key.seed), key.seed.hex(), signature):
        log.info("oops: %s", secret)
    assert len(secrets_watch.LEAKS) == before + 4
    del secrets_watch.LEAKS[before:]  # planted here on purpose: not a leak of the service
