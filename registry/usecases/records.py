"""What the trust and ownership use-cases share: records as versioned documents.

A use-case reads a record, decides the change, and renders the record's new document; the
store's `apply_records` handler (migration 0009) writes it only if the record is still at the
version read (else `Retry`: `ChangeLog.submit` decides again on the new state). New records
claim `uniq` (e.g. one open report per reporter and entry) while they hold it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from registry.canonical import canonicalize
from registry.changes import RETRY, ChangeLog, Refusal
from registry.config import Config
from registry.did import is_did
from registry.errors import Invalid, RegistryError
from registry.models import parse_datetime
from registry.store import RecordRow, TrustStore
from registry.usecases.common import now_ms
from registry.usecases.entries import Entries

MAX_TEXT = 2000  # reasons and notes

RETRY_REFUSAL = Refusal(RETRY, "record_changed", "a concurrent change took this claim")


class RecordUseCase:
    """What every trust and ownership use-case works with: the store it reads, the change
    log it writes through, the entries (whose cache a record's change may move), the
    configuration and the clock."""

    def __init__(
        self,
        *,
        store: TrustStore,
        changes: ChangeLog,
        entries: Entries,
        config: Config,
        clock_ms: Callable[[], int] = now_ms,
    ) -> None:
        self.store = store
        self.changes = changes
        self.entries = entries
        self.config = config
        self.clock_ms = clock_ms


def new_id(prefix: str) -> str:
    """A new record id: `prefix_` and 128 random bits in hex."""
    return f"{prefix}_{secrets.token_hex(16)}"


def render(doc: dict[str, Any]) -> str:
    """A record's document as stored and served (JCS)."""
    return canonicalize(doc).decode("utf-8")


def put(
    kind: str,
    record_id: str,
    *,
    based_on: RecordRow | None,
    entry_did: str,
    owner_did: str | None,
    status: str,
    doc: dict[str, Any],
    expires_ms: int | None = None,
    uniq: str | None = None,
    exists: RegistryError | None = None,
    duplicate: Refusal | RegistryError | None = None,
    rendered: str | None = None,
) -> dict[str, Any]:
    """One record write of `apply_records`: a new record (`based_on` None) or the next version
    of `based_on`. `exists` refuses a new record whose id is taken; `duplicate` a `uniq` claim
    that another record holds. `rendered`: `render(doc)`, where the caller has it already."""
    item: dict[str, Any] = {
        "kind": kind,
        "id": record_id,
        "expectedVersion": None if based_on is None else based_on.version,
        "entryDid": entry_did,
        "ownerDid": owner_did,
        "status": status,
        "expiresAtMs": expires_ms,
        "uniq": uniq,
        "doc": render(doc) if rendered is None else rendered,
    }
    if exists is not None:
        item["exists"] = Refusal.of(exists).to_json()
    if duplicate is not None:
        refusal = duplicate if isinstance(duplicate, Refusal) else Refusal.of(duplicate)
        item["duplicate"] = refusal.to_json()
    return item


def body_object(data: Any, *, required: set[str], optional: set[str], code: str) -> dict[str, Any]:
    """A request body that is an object with exactly the named members (400 otherwise)."""
    if not isinstance(data, dict):
        raise Invalid("the body must be a JSON object", code=code)
    unknown = sorted(set(data) - required - optional)
    if unknown:
        raise Invalid(f"unknown field {unknown[0]!r}", code=code, details={"field": unknown[0]})
    missing = sorted(required - set(data))
    if missing:
        raise Invalid(f"{missing[0]} is required", code=code, details={"field": missing[0]})
    return data


def text_field(
    data: dict[str, Any], name: str, *, code: str, max_length: int = MAX_TEXT
) -> str | None:
    """An optional non-empty string member of at most `max_length` characters."""
    value = data.get(name)
    if value is None and name not in data:
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > max_length:
        raise Invalid(
            f"{name} must be a non-empty string of at most {max_length} characters",
            code=code,
            details={"field": name},
        )
    return value


def did_field(data: dict[str, Any], name: str, *, code: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not is_did(value):
        raise Invalid(f"{name} must be a DID", code=code, details={"field": name})
    return value


def time_ms(value: Any, name: str, *, code: str) -> int:
    """An RFC 3339 date-time member as milliseconds since the epoch."""
    if not isinstance(value, str):
        raise Invalid(f"{name} must be an RFC 3339 date-time", code=code, details={"field": name})
    try:
        moment = parse_datetime(value)
    except ValueError as exc:
        raise Invalid(f"{name}: {exc}", code=code, details={"field": name}) from None
    return int(moment.timestamp() * 1000)
