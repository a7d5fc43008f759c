"""Every log line of a test run, watched for the secrets the run planted (issue 19).

While the suite runs, every session token the service issues, every key seed generated and
every signature made is remembered (`PLANTED`), and every log record at INFO or above of this
process (the service in the harness: access log, warnings, errors with tracebacks) is searched
for them. conftest's session fixture fails the run if one appears. Servers started as separate
processes (tests/db/proc.py) log to their own files and are not watched here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from registry import keys
from registry.usecases import sessions

PLANTED: set[str] = set()
LEAKS: list[str] = []
# Base64url or hex runs long enough to be a token (43), seed (43 / 64) or signature (86).
_CANDIDATE = re.compile(r"[A-Za-z0-9_-]{40,}")


def leaked_in(line: str) -> list[str]:
    return [c for c in _CANDIDATE.findall(line) if c in PLANTED]


class _Watch(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # a record that cannot be formatted leaks nothing here
            return
        access = getattr(record, "access", None)
        if access is not None:
            line += f" {access}"
        if leaked_in(line):
            LEAKS.append(f"{record.name}: {line[:500]}")


@contextmanager
def watching(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Plant and watch for the duration (the session)."""
    generate: Callable[[], keys.SigningKey] = keys.SigningKey.generate.__func__  # type: ignore[attr-defined]
    sign = keys.SigningKey.sign
    issue = sessions.new_session_token

    def planted_generate(cls: Any) -> keys.SigningKey:
        key = generate(cls)
        PLANTED.update({keys.b64url_encode(key.seed), key.seed.hex()})
        return key

    def planted_sign(self: keys.SigningKey, message: bytes) -> bytes:
        signature = sign(self, message)
        PLANTED.add(keys.b64url_encode(signature))
        return signature

    def planted_token() -> tuple[str, bytes]:
        token, token_hash = issue()
        PLANTED.add(token)
        return token, token_hash

    monkeypatch.setattr(keys.SigningKey, "generate", classmethod(planted_generate))
    monkeypatch.setattr(keys.SigningKey, "sign", planted_sign)
    monkeypatch.setattr(sessions, "new_session_token", planted_token)
    root = logging.getLogger()
    handler = _Watch(level=logging.INFO)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    level = root.level
    root.addHandler(handler)
    root.setLevel(min(level, logging.INFO))  # what `registry serve` logs by default
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
