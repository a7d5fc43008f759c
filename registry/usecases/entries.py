"""Entries: publish, update, delete and read (spec 4.1, design §4).

A write is decided here (structure, signature, publisher, lifecycle, the version it is based on)
and appended through the one write path as an `entry.*` change whose rows the store's entry
handler writes (`apply_entry_version`): {expectedHead, publisherDid, entryType, lifecycle,
prefix, suffix}, the served document being prefix ‖ sequence ‖ suffix. The handler re-checks
the head under the log lock, so a concurrent change still ends in a clean 409.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from registry import entries as entry_rules
from registry.anchoring import with_anchor_state
from registry.caches import Served
from registry.canonical import canonicalize
from registry.changes import Change, ChangeLog, Decided, IdemKey, Outcome
from registry.coherence import Caches
from registry.config import Config
from registry.entries import publisher_payload
from registry.errors import Conflict, Forbidden, Invalid, NotFound
from registry.store import INLINE_ATTESTATIONS, EntryHead, EntryStore, ReplicaVersion
from registry.usecases.common import Principal, now_ms, page_size, parse_sequence, rfc3339

log = logging.getLogger(__name__)


def entry_change(
    kind: str,
    *,
    did: str,
    expected_head: int | None,
    publisher: str,
    entry_type: str,
    lifecycle: str,
    prefix: str,
    suffix: str,
    event: dict[str, Any] | None = None,
    item_data_hash: str | None = None,
) -> Change:
    """An `entry.*` change: one new version of `did` (the rows of the entry handler). With
    `item_data_hash`, the version also records its anchor intent (operation from `kind`)."""
    data = {"entryType": entry_type, "publisherDid": publisher, "lifecycleStatus": lifecycle}
    data.update(event or {})
    rows: dict[str, Any] = {
        "expectedHead": expected_head,
        "publisherDid": publisher,
        "entryType": entry_type,
        "lifecycle": lifecycle,
        "prefix": prefix,
        "suffix": suffix,
    }
    if item_data_hash is not None:
        rows["anchor"] = {"operation": OPERATIONS[kind], "itemDataHash": item_data_hash}
    return Change(kind=kind, subject=did, rows=rows, event=data)


def version_change(
    kind: str,
    entry: entry_rules.CheckedEntry,
    *,
    expected_head: int | None,
    at: str,
    anchoring: bool,
) -> Change:
    """The change that writes a checked entry as a new version at `at` (its stored form, its
    event and, while anchoring is on, its anchor intent)."""
    form = entry_rules.stored_form(
        entry.doc,
        updated_at=at,
        signature_created=at,
        members=entry.members,
        anchor_state="pending" if anchoring else "unanchored",
    )
    return entry_change(
        kind,
        did=entry.did,
        expected_head=expected_head,
        publisher=entry.publisher,
        entry_type=entry.model.entry_type,
        lifecycle=entry.lifecycle,
        prefix=form.prefix,
        suffix=form.suffix,
        event={"name": entry.model.name, "version": entry.model.version},
        item_data_hash=entry.model.item_data_hash if anchoring else None,
    )


# The anchor intent operation of each kind of entry version (spec 2.3).
OPERATIONS = {
    "entry.created": "create",
    "entry.updated": "update",
    "entry.transferred": "transfer",
    "entry.deleted": "delete",
}


# A new local entry's DID: its row in the name ordering's B-tree index (entry_search_name:
# name, then DID) must fit PostgreSQL's 2,704 bytes beside the widest name (256 characters, up to
# 1 KiB); a 2,048-character DID did not (SQLSTATE 54000). DIDs up to MAX_DID_LENGTH (2,048) stay
# valid everywhere else: entries stored before, a peer's, a record naming one.
MAX_NEW_ENTRY_DID_LENGTH = 1536


class Entries:
    def __init__(
        self,
        *,
        store: EntryStore,
        changes: ChangeLog,
        config: Config,
        caches: Caches,
        clock_ms: Callable[[], int] = now_ms,
    ) -> None:
        self.store = store
        self.changes = changes
        self.config = config
        self.caches = caches  # what a write makes stale is theirs to drop (registry/coherence.py)
        self.cache = caches.entries  # entry DID → head
        self.clock_ms = clock_ms
        # Every version records its anchor intent while anchoring is on (design §8).
        self.anchoring = config.anchoring.enabled

    # --- writes -------------------------------------------------------------------------

    async def create(
        self,
        principal: Principal,
        data: Any,
        idem: IdemKey | None,
        *,
        members: dict[str, str] | None = None,
    ) -> Outcome:
        """`members`: the JCS text of each member of `data` where the caller made them
        (`canonical.canonical_members`: the API's fingerprint did); made here otherwise."""

        async def decide() -> Decided[str]:
            principal.require("entries.write")
            entry = entry_rules.check_entry(data, members)
            _check_publisher(principal, entry.publisher)
            if entry.lifecycle not in entry_rules.CREATE_STATES:
                raise Invalid(
                    "a new entry starts as draft or active",
                    code="entry_invalid",
                    details={"field": "lifecycleStatus"},
                )
            if len(entry.did) > MAX_NEW_ENTRY_DID_LENGTH:
                reason = f"a new entry's DID is at most {MAX_NEW_ENTRY_DID_LENGTH} characters"
                raise Invalid(
                    f"entryDid: {reason}",
                    code="entry_invalid",
                    details={"errors": [{"field": "entryDid", "reason": reason}]},
                )
            # A DID held as another registry's replica is refused by the append path
            # (`entry_is_replica`, under the log head: no import slips in between).
            change = self.version_change("entry.created", entry, expected_head=None)
            return Decided(change, entry.did)

        outcome, did = await self.changes.submit_seen(idem, decide)
        return await self.written(outcome, did or "", previous=None)

    async def update(
        self,
        principal: Principal,
        did: str,
        data: Any,
        idem: IdemKey | None,
        *,
        members: dict[str, str] | None = None,
    ) -> Outcome:
        """`members`: as for `create`."""

        async def decide() -> Decided[str]:
            principal.require("entries.write")
            entry = entry_rules.check_entry(data, members)
            if entry.did != did:
                raise Invalid(
                    "entryDid in the body is not the DID in the path",
                    code="entry_invalid",
                    details={"field": "entryDid"},
                )
            if entry.based_on is None:
                raise Invalid(
                    "an update carries the sequence of the version it is based on",
                    code="sequence_required",
                    details={"field": "sequence"},
                )
            head = await self.local_head(did, deleted=entry.lifecycle)
            _check_publisher(principal, entry.publisher)
            if head.publisher_did != principal.did:
                raise Forbidden(
                    "only the entry's publisher may update it", code="publisher_mismatch"
                )
            if entry.based_on != head.head_seq:
                raise Conflict(
                    "the entry changed since the version this update is based on",
                    code="sequence_conflict",
                    details={"latestSequence": head.head_seq},
                )
            entry_rules.check_move(head.lifecycle, entry.lifecycle)
            await self._check_version_label(entry, head)
            change = self.version_change("entry.updated", entry, expected_head=head.head_seq)
            return Decided(change, head.doc)

        outcome, previous = await self.changes.submit_seen(idem, decide)
        return await self.written(outcome, did, previous=previous)

    async def delete(self, principal: Principal, did: str, idem: IdemKey | None) -> Outcome:
        """Write a tombstone version; afterwards the DID reads as 404 and is never reused."""

        async def decide() -> Decided[str]:
            head = await self.local_head(did)
            if head.publisher_did != principal.did and not principal.admin:
                raise Forbidden(
                    "only the entry's publisher may delete it", code="publisher_mismatch"
                )
            if not principal.admin:
                principal.require("entries.write")
            at = rfc3339(self.clock_ms())
            prefix = (
                '{"deletedAt":'
                + _json_str(at)
                + ',"entryDid":'
                + _json_str(did)
                + ',"lifecycleStatus":"deleted","sequence":'
            )
            change = entry_change(
                "entry.deleted",
                did=did,
                expected_head=head.head_seq,
                publisher=head.publisher_did,
                entry_type=_entry_type(head.doc),
                lifecycle="deleted",
                prefix=prefix,
                suffix="}",
                item_data_hash=_item_data_hash(head.doc) if self.anchoring else None,
            )
            return Decided(change, head.doc)

        outcome, previous = await self.changes.submit_seen(idem, decide)
        return await self.written(outcome, did, previous=previous)

    def version_change(
        self, kind: str, entry: entry_rules.CheckedEntry, *, expected_head: int | None
    ) -> Change:
        return version_change(
            kind,
            entry,
            expected_head=expected_head,
            at=rfc3339(self.clock_ms()),
            anchoring=self.anchoring,
        )

    async def written(self, outcome: Outcome, did: str, *, previous: str | None) -> Outcome:
        """The outcome of an entry write, once this process's caches have let go of what it
        changed, so the writer reads its own write (the cache keeper does the same for every
        process when the log record reaches it)."""
        if outcome.refusal is not None or outcome.sequence is None:
            return outcome
        if outcome.replayed:
            # A retry another process (or this one, long ago) wrote: acknowledged here now, so
            # read back here too, though this process's log actor may not have read it yet.
            self.caches.wrote(did)
            return outcome
        seq, doc = outcome.sequence, outcome.unwrap()
        versions = [doc] if previous is None else [previous, doc]
        await self.caches.entry_written(seq, did, versions, self.store)
        return outcome

    # --- reads --------------------------------------------------------------------------

    async def get(self, did: str) -> Served:
        cached = self.cache.get(did)
        if cached is not None and not _short_of_attestations(cached, self.clock_ms()):
            return cached
        epoch = self.cache.epoch
        head = await self.live_head(did, attestations=True)
        doc = with_anchor_state(head.doc, head.anchor_state)
        served = Served(head.head_seq, doc, head.attestations, stored=doc is head.doc)
        self.cache.put(did, served, epoch)
        return served

    # --- reads that fall back to replicas (design §12) -------------------------------------

    async def replica(self, did: str) -> ReplicaVersion | None:
        """The live replica of `did` synced from a peer, if no local entry has that DID (a
        deleted local entry wins too: its DID is never served from elsewhere)."""
        if await self.store.get_entry_head(did, attestations=0) is not None:
            return None
        found = await self.store.replica_head(did)
        return None if found is None or found.lifecycle == "deleted" else found

    async def read(self, did: str) -> Served:
        """GET /v1/entries/{did}: the local entry, else its replica (with its `origin`)."""
        try:
            return await self.get(did)
        except NotFound:
            found = await self.replica(did)
            if found is None:
                raise
            return Served(found.origin_seq, found.doc, origin=found.origin_did)

    async def read_versions(
        self, did: str, *, limit: int | None, cursor: str | None
    ) -> tuple[list[str], str | None, bool, int, str | None]:
        """`list_versions`, else the replica's versions; the last item is the origin."""
        try:
            return (*await self.list_versions(did, limit=limit, cursor=cursor), None)
        except NotFound:
            found = await self.replica(did)
            if found is None:
                raise
        size = page_size(self.config.limits, limit)
        before = self._before(cursor)
        rows, total = await self.store.replica_versions(
            did, found.origin_did, before, size + 1, self.config.limits.versions_page_bytes
        )
        docs, has_more = _page_of(rows, size)
        next_cursor = str(_sequence_of(docs[-1])) if has_more and docs else None
        return docs, next_cursor, has_more, total, found.origin_did

    async def read_version(self, did: str, sequence: int) -> tuple[str, str | None]:
        """`get_version`, else the replica's version of that origin sequence, with the origin."""
        try:
            return await self.get_version(did, sequence), None
        except NotFound as exc:
            if exc.code == "version_not_found":
                raise
            found = await self.replica(did)
            if found is None:
                raise
        doc = await self.store.replica_version(did, found.origin_did, sequence)
        if doc is None:
            raise NotFound("no such version of this entry", code="version_not_found")
        return doc, found.origin_did

    @staticmethod
    def _before(cursor: str | None) -> int | None:
        if cursor is None:
            return None
        before = parse_sequence(cursor)
        if before is None:
            raise Invalid("cursor must be a sequence from a previous page", code="invalid_cursor")
        return before

    async def list_versions(
        self, did: str, *, limit: int | None, cursor: str | None
    ) -> tuple[list[str], str | None, bool, int]:
        await self.live_head(did)
        size = page_size(self.config.limits, limit)
        before = None
        if cursor is not None:
            before = parse_sequence(cursor)
            if before is None:
                raise Invalid(
                    "cursor must be a sequence from a previous page", code="invalid_cursor"
                )
        rows, total = await self.store.list_versions(
            did, before, size + 1, self.config.limits.versions_page_bytes
        )
        docs, has_more = _page_of(rows, size)
        docs = await self._with_anchor_states(did, docs)
        next_cursor = str(_sequence_of(docs[-1])) if has_more and docs else None
        return docs, next_cursor, has_more, total

    async def get_version(self, did: str, sequence: int) -> str:
        await self.live_head(did)
        doc = await self.store.get_version(did, sequence)
        if doc is None:
            raise NotFound("no such version of this entry", code="version_not_found")
        (shown,) = await self._with_anchor_states(did, [doc])
        return shown

    async def _with_anchor_states(self, did: str, docs: list[str]) -> list[str]:
        """Versions as the entry read shows them: `anchorState` of each version's intent now
        (the stored version says what it was when written)."""
        if not docs:
            return docs
        states = await self.store.anchor_states(did, [_sequence_of(doc) for doc in docs])
        return [with_anchor_state(doc, states.get(_sequence_of(doc))) for doc in docs]

    async def _refuse_replica(self, did: str) -> None:
        """One name, one entry: a DID this registry holds as another registry's replica is
        that registry's to write (409 with the origin to go to)."""
        found = await self.store.replica_head(did)
        if found is not None:
            raise Conflict(
                "this DID is another registry's entry (a replica here); write it at its origin",
                code="entry_is_replica",
                details={"entryDid": did, "origin": found.origin_did},
            )

    async def local_head(self, did: str, *, deleted: str | None = None) -> EntryHead:
        """`live_head`, where a write must name the local entry: a replica's DID answers 409
        with its origin rather than 404. With `deleted` (the lifecycle an update moves to), a
        deleted entry is a lifecycle move the table does not allow (design §4: updating a
        deleted entry is 409 lifecycle_conflict), not 404."""
        try:
            return await self.live_head(did)
        except NotFound:
            if deleted is not None:
                gone = await self.store.get_entry_head(did)
                if gone is not None:  # deleted (live_head answers every other head)
                    entry_rules.check_move(gone.lifecycle, deleted)
            await self._refuse_replica(did)
            raise

    async def _check_version_label(self, entry: entry_rules.CheckedEntry, head: EntryHead) -> None:
        """A version string names one content forever (docs/lifecycle.md): an update that
        changes nothing the publisher signs is refused, and so is one that gives an earlier
        version's `version` to other content (lifecycle moves and transfers keep it)."""
        submitted = publisher_payload(entry.doc)
        if canonicalize(submitted) == canonicalize(publisher_payload(json.loads(head.doc))):
            raise Conflict(
                "the update is identical to the current version",
                code="version_unchanged",
                details={"latestSequence": head.head_seq},
            )
        label = entry.model.version
        if label is None:
            return
        earlier = await self.store.version_labelled(entry.did, label)
        if earlier is not None and _content(submitted) != _content(
            publisher_payload(json.loads(earlier[1]))
        ):
            raise Conflict(
                f"version {label!r} already names other content of this entry;"
                " give this content a new version",
                code="version_exists",
                details={"version": label, "sequence": earlier[0]},
            )

    async def live_head(self, did: str, *, attestations: bool = False) -> EntryHead:
        """The head of a live entry (404 otherwise); with its shown `attestations` only where
        they are served (an existence check of a route would read up to 50 credentials of up
        to 64 KiB each, on anonymous routes)."""
        head = await self.store.get_entry_head(
            did, attestations=INLINE_ATTESTATIONS if attestations else 0
        )
        if head is None or head.lifecycle == "deleted":
            raise NotFound("entry not found", code="entry_not_found", details={"entryDid": did})
        return head


def _page_of(rows: list[str | None], size: int) -> tuple[list[str], bool]:
    """The page of `size` versions (the store read one more) and whether more follow: a page
    ends early at the first version left out for `limits.versions_page_bytes` (None)."""
    page: list[str] = []
    for doc in rows[:size]:
        if doc is None:
            return page, True
        page.append(doc)
    return page, len(rows) > size


# What a version string names: the publisher's payload but its status and owner.
_NOT_CONTENT = frozenset({"lifecycleStatus", "publisherDid"})


def _content(payload: dict[str, Any]) -> bytes:
    return canonicalize({k: v for k, v in payload.items() if k not in _NOT_CONTENT})


def _check_publisher(principal: Principal, publisher: str) -> None:
    if publisher != principal.did:
        raise Forbidden(
            "publisherDid is not the signed-in principal",
            code="publisher_mismatch",
            details={"publisherDid": publisher, "principal": principal.did},
        )


def _json_str(text: str) -> str:
    return canonicalize(text).decode()


def _entry_type(doc: str) -> str:
    return str(json.loads(doc).get("entryType", ""))


def _item_data_hash(doc: str) -> str:
    return str(json.loads(doc)["itemDataHash"])


def _sequence_of(doc: str) -> int:
    return int(json.loads(doc)["sequence"])


def _short_of_attestations(served: Served, now_ms: int) -> bool:
    """Whether a cached head holds as many attestations as a read returns and one of them has
    expired: the database may hold another to serve in its place (an expiry writes nothing to
    the log, so no change drops the cached head)."""
    return len(served.attestations) >= INLINE_ATTESTATIONS and any(
        expires is not None and expires <= now_ms for expires, _ in served.attestations
    )
