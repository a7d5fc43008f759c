"""Events: the kinds a subscriber may see, the subscribe request and its filter (design §10).

Pure: the WebSocket edge (`ws/events.py`) parses client messages with these models and asks
`Filter.admits` for each log record; the log actor delivers every record in order.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from registry.changes import CHANGE_KINDS, LogRecord
from registry.models import WireModel

PUBLIC_KINDS = frozenset(k for k, kind in CHANGE_KINDS.items() if kind.audience == "public")
ADMIN_KINDS = frozenset(k for k, kind in CHANGE_KINDS.items() if kind.audience == "admin")
KINDS = PUBLIC_KINDS | ADMIN_KINDS

MAX_FILTER_ITEMS = 100
MAX_SEQUENCE = 2**63 - 1

FilterText = Annotated[str, Field(min_length=1, max_length=2048)]


class SubscribeRequest(WireModel):
    """`{"type": "subscribe", "fromSequence"?, "kinds"?, "entryTypes"?, "entryDids"?}`.

    `fromSequence` is exclusive (0: the whole log); absent, the stream starts at the log's
    head when the subscription is made (live only). Each filter list is "any of"; the lists
    combine with "and"; an absent list admits everything."""

    type: Literal["subscribe"]
    from_sequence: Annotated[int, Field(ge=0, le=MAX_SEQUENCE)] | None = Field(
        default=None, alias="fromSequence"
    )
    kinds: Annotated[list[str], Field(min_length=1, max_length=MAX_FILTER_ITEMS)] | None = None
    entry_types: (
        Annotated[list[FilterText], Field(min_length=1, max_length=MAX_FILTER_ITEMS)] | None
    ) = Field(default=None, alias="entryTypes")
    entry_dids: (
        Annotated[list[FilterText], Field(min_length=1, max_length=MAX_FILTER_ITEMS)] | None
    ) = Field(default=None, alias="entryDids")
    # Opt-in: the events already queued for this subscriber go out together, as one
    # {"type": "events", "events": [...]} frame (fewer frames when it is behind).
    batch: bool = False

    @field_validator("kinds")
    @classmethod
    def _known(cls, kinds: list[str] | None) -> list[str] | None:
        if kinds is None:  # (null: as absent)
            return None
        unknown = sorted(set(kinds) - KINDS)
        if unknown:
            raise ValueError(f"unknown event kind(s) {unknown}; known: {sorted(KINDS)}")
        return kinds


class AuthMessage(WireModel):
    """`{"type": "auth", "token": "<session token>"}`: authenticate an open socket."""

    type: Literal["auth"]
    token: Annotated[str, Field(min_length=1, max_length=512)]


class Filter:
    """What one subscription admits."""

    def __init__(self, request: SubscribeRequest, *, admin: bool) -> None:
        allowed = KINDS if admin else PUBLIC_KINDS
        self.kinds = frozenset(request.kinds) & allowed if request.kinds else allowed
        self.entry_types = frozenset(request.entry_types or ())
        self.entry_dids = frozenset(request.entry_dids or ())
        self.key = (self.kinds, self.entry_types, self.entry_dids)  # equal filters, equal keys

    @staticmethod
    def forbidden_kinds(request: SubscribeRequest, *, admin: bool) -> list[str]:
        """The admin-only kinds asked for by a subscriber who is not an admin."""
        return [] if admin else sorted(set(request.kinds or ()) & ADMIN_KINDS)

    def admits(self, record: LogRecord) -> bool:
        if record.kind not in self.kinds:
            return False
        if self.entry_dids and record.entry_did not in self.entry_dids:
            return False
        return not self.entry_types or record.data.get("entryType") in self.entry_types
