"""What every use-case shares: the caller, the clock, paging."""

from __future__ import annotations

import time
from dataclasses import dataclass

from registry.changes import rfc3339_ms
from registry.config import LimitsConfig
from registry.errors import Forbidden, Invalid
from registry.store import SessionRecord

rfc3339 = rfc3339_ms


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class Principal:
    """Who is calling: a session's identity and capabilities."""

    did: str
    capabilities: tuple[str, ...]
    session: SessionRecord
    token_hash: bytes

    def require(self, capability: str) -> None:
        if capability not in self.capabilities:
            raise Forbidden(
                f"this session lacks the {capability!r} capability",
                code="capability_missing",
                details={"capability": capability},
            )

    @property
    def admin(self) -> bool:
        return "admin" in self.capabilities


def page_size(limits: LimitsConfig, limit: int | None) -> int:
    """`limit` clamped to the maximum page size; the default when absent (design §7)."""
    if limit is None:
        return limits.default_page_size
    if limit < 1:
        raise Invalid("limit must be at least 1", code="invalid_limit")
    return min(limit, limits.max_page_size)


MAX_SEQUENCE = 2**63 - 1


def parse_sequence(text: str) -> int | None:
    """A registry sequence from text (`^[1-9][0-9]*$`, at most int64); None when it is not one."""
    if not text.isascii() or not text.isdigit() or text.startswith("0") or len(text) > 19:
        return None
    value = int(text)
    return value if value <= MAX_SEQUENCE else None
