"""Transfer offers: create, read, accept, decline, cancel (spec 2.7, 3, 4.2; design §8, §12).

An offer is `offered` until it is accepted, declined or cancelled, or until `expiresAt`
passes: from then on it reads as `expired` for every operation (it is stored as such when a
new offer of the same entry replaces it). Accepting is one change: the recipient-signed entry
becomes the entry's next version (entry.transferred, whose position is its new sequence) and
the offer becomes `accepted`, followed in the same transaction by transfer.accepted.
"""

from __future__ import annotations

import json
from typing import Any

from registry import entries as entry_rules
from registry import trust
from registry.canonical import MAX_SAFE_INTEGER
from registry.changes import Also, Change, Decided, IdemKey, Outcome
from registry.did import public_key_from_did_key
from registry.errors import Conflict, Forbidden, Invalid, NotFound
from registry.store import RecordRow
from registry.usecases.common import Principal, rfc3339
from registry.usecases.records import (
    RETRY_REFUSAL,
    RecordUseCase,
    body_object,
    did_field,
    new_id,
    put,
    render,
    text_field,
    time_ms,
)

DAY_MS = 24 * 3600 * 1000
DEFAULT_TTL_MS = 7 * DAY_MS
MAX_TTL_MS = 30 * DAY_MS
OPEN = "offered"


class Transfers(RecordUseCase):
    # --- reads ---------------------------------------------------------------------------

    async def get(self, offer_id: str) -> str:
        row = await self._row(offer_id)
        return render(self._as_of(row, self.clock_ms()))

    async def _row(self, offer_id: str) -> RecordRow:
        row = await self.store.get_record("offer", offer_id)
        if row is None:
            raise NotFound("offer not found", code="offer_not_found", details={"offerId": offer_id})
        return row

    @staticmethod
    def _as_of(row: RecordRow, now: int) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(row.doc)
        if _expired(row, now):
            doc["status"] = "expired"
        return doc

    # --- create --------------------------------------------------------------------------

    async def create(self, principal: Principal, data: Any, idem: IdemKey | None) -> Outcome:
        async def decide() -> Change:
            principal.require("entries.write")
            code = "offer_invalid"
            body = body_object(
                data,
                # Design §8 lists the body without `entrySequence` (its signature covers it):
                # absent (or null, as `expiresAt`), it is the entry's latest sequence.
                required={"entryDid", "recipientDid", "ownerSignature"},
                optional={"entrySequence", "expiresAt"},
                code=code,
            )
            entry_did = did_field(body, "entryDid", code=code)
            recipient = did_field(body, "recipientDid", code=code)
            try:
                public_key_from_did_key(recipient)
            except ValueError:
                raise Invalid(
                    "recipientDid must be an Ed25519 did:key (the recipient signs in with it)",
                    code=code,
                    details={"field": "recipientDid"},
                ) from None
            if recipient == principal.did:
                raise Invalid(
                    "an entry cannot be offered to its own publisher",
                    code=code,
                    details={"field": "recipientDid"},
                )
            sequence = body.get("entrySequence")
            if type(sequence) is float and sequence.is_integer():
                sequence = int(sequence)  # 2.0 is the integer 2 (JSON Schema, and the entries)
            if sequence is not None and (
                type(sequence) is not int or not 1 <= sequence <= MAX_SAFE_INTEGER
            ):
                # 1e308 is a whole number too, but no sequence (I-JSON, design §3).
                raise Invalid(
                    "entrySequence must be a positive integer (at most 2^53-1)",
                    code=code,
                    details={"field": "entrySequence"},
                )
            now = self.clock_ms()
            expires_at: str | None = body.get("expiresAt")
            if expires_at is None:
                expires_ms = now + DEFAULT_TTL_MS
            else:
                expires_ms = time_ms(expires_at, "expiresAt", code="invalid_expiry")
                if not now < expires_ms <= now + MAX_TTL_MS:
                    raise Invalid(
                        "expiresAt must be in the future and at most 30 days away",
                        code="invalid_expiry",
                        details={"field": "expiresAt"},
                    )
            head = await self.entries.live_head(entry_did)
            if head.publisher_did != principal.did:
                raise Forbidden("only the entry's publisher may offer it", code="owner_mismatch")
            if head.lifecycle == "revoked":
                raise Conflict(
                    "a revoked entry cannot be transferred",
                    code="lifecycle_conflict",
                    details={"from": "revoked"},
                )
            if sequence is None:
                sequence = head.head_seq
            elif sequence != head.head_seq:
                raise Conflict(
                    "entrySequence is not the entry's latest sequence",
                    code="sequence_conflict",
                    details={"latestSequence": head.head_seq},
                )
            message = trust.offer_signing_bytes(entry_did, sequence, recipient, expires_at)
            signature = trust.check_offer_signature(body["ownerSignature"], principal.did, message)
            signature.setdefault("created", rfc3339(now))
            puts: list[dict[str, Any]] = []
            for row in await self.store.list_records(
                "offer", entry_did=entry_did, status=OPEN, limit=100
            ):
                if not _expired(row, now):
                    raise Conflict(
                        "the entry has an open offer; cancel it first",
                        code="offer_exists",
                        details={"offerId": row.id},
                    )
                doc = self._as_of(row, now)  # expired: stored as such, its claim released
                puts.append(_offer_put(row.id, row, doc, uniq=None))
            offer_id = new_id("off")
            doc = {
                "createdAt": rfc3339(now),
                "entryDid": entry_did,
                "entrySequence": sequence,
                "expiresAt": expires_at if expires_at is not None else rfc3339(expires_ms),
                "offerId": offer_id,
                "ownerDid": principal.did,
                "ownerSignature": signature,
                "recipientDid": recipient,
                "status": OPEN,
            }
            puts.append(_offer_put(offer_id, None, doc, uniq=entry_did, expires_ms=expires_ms))
            return Change(
                "transfer.offered",
                entry_did,
                # Under the log lock the head must still be the one read: an update (or a
                # transfer) committed since would leave the offer naming a stale sequence.
                rows={
                    "requireEntry": entry_did,
                    "requireHead": head.head_seq,
                    "puts": puts,
                    "result": render(doc),
                },
                event={
                    "offerId": offer_id,
                    "ownerDid": principal.did,
                    "recipientDid": recipient,
                    "entrySequence": sequence,
                    "expiresAt": doc["expiresAt"],
                },
            )

        return await self.changes.submit(idem, decide)

    # --- decide ----------------------------------------------------------------------------

    async def _open(self, offer_id: str, principal: Principal, *, party: str) -> RecordRow:
        """The offer, if `principal` is its `party` (recipient or owner) and it is undecided
        and unexpired."""
        principal.require("entries.write")
        row = await self._row(offer_id)
        doc = json.loads(row.doc)
        who = doc["recipientDid"] if party == "recipient" else doc["ownerDid"]
        if principal.did != who:
            raise Forbidden(
                f"only the offer's {party} may do this",
                code=f"{party}_mismatch",
                details={"offerId": offer_id},
            )
        if row.status == "expired" or _expired(row, self.clock_ms()):
            # Expired: whether it only reads so, or was stored so when a newer offer replaced it.
            raise Conflict(
                "the offer has expired",
                code="offer_expired",
                details={"offerId": offer_id, "expiresAt": doc["expiresAt"]},
            )
        if row.status != OPEN:
            raise Conflict(
                f"the offer is already {row.status}",
                code="offer_decided",
                details={"offerId": offer_id, "status": row.status},
            )
        return row

    async def decline(
        self, principal: Principal, offer_id: str, data: Any, idem: IdemKey | None
    ) -> Outcome:
        async def decide() -> Change:
            body = body_object(
                {} if data is None else data,
                required=set(),
                optional={"reason"},
                code="decline_invalid",
            )
            reason = text_field(body, "reason", code="decline_invalid")
            row = await self._open(offer_id, principal, party="recipient")
            extra = {} if reason is None else {"declineReason": reason}
            return self._decided(row, "declined", "transfer.declined", extra)

        return await self.changes.submit(idem, decide)

    async def cancel(self, principal: Principal, offer_id: str, idem: IdemKey | None) -> Outcome:
        async def decide() -> Change:
            row = await self._open(offer_id, principal, party="owner")
            return self._decided(row, "cancelled", "transfer.cancelled", {})

        return await self.changes.submit(idem, decide)

    def _decided(self, row: RecordRow, status: str, kind: str, extra: dict[str, Any]) -> Change:
        doc = json.loads(row.doc)
        doc.update(extra)
        doc["status"] = status
        doc["decidedAt"] = rfc3339(self.clock_ms())
        return Change(
            kind,
            row.entry_did,
            rows={"puts": [_offer_put(row.id, row, doc, uniq=None)], "result": render(doc)},
            event={
                "offerId": row.id,
                "ownerDid": doc["ownerDid"],
                "recipientDid": doc["recipientDid"],
            },
        )

    # --- accept ----------------------------------------------------------------------------

    async def accept(
        self, principal: Principal, offer_id: str, data: Any, idem: IdemKey | None
    ) -> Outcome:
        """Spec 4.2 rules: (a) every publisher-authored field of the offered snapshot kept,
        (b) publisherDid (and so the signing key's controller) the recipient, (c) based on the
        offered sequence, which is still the entry's latest, (d) no verifiableAttestations,
        (e) signed by the recipient over the complete publisher payload."""

        async def decide() -> Decided[tuple[str, str]]:
            row = await self._open(offer_id, principal, party="recipient")
            offer = json.loads(row.doc)
            body = body_object(data, required={"entry"}, optional=set(), code="entry_invalid")
            submitted = body["entry"]
            if isinstance(submitted, dict) and "verifiableAttestations" in submitted:
                raise Invalid(
                    "a transferred entry must omit verifiableAttestations (rule d)",
                    code="attestations_not_allowed",
                    details={"field": "entry.verifiableAttestations"},
                )
            entry = entry_rules.check_entry(submitted)  # (e): the signature by publisherDid
            if entry.did != row.entry_did:
                raise Invalid(
                    "entry.entryDid is not the offered entry",
                    code="entry_invalid",
                    details={"field": "entry.entryDid"},
                )
            if entry.publisher != principal.did:  # (b)
                raise Forbidden(
                    "entry.publisherDid must be the recipient (rule b)",
                    code="publisher_mismatch",
                    details={"publisherDid": entry.publisher, "principal": principal.did},
                )
            if entry.based_on is None:
                raise Invalid(
                    "the entry carries the sequence of the offered version",
                    code="sequence_required",
                    details={"field": "entry.sequence"},
                )
            expected = int(offer["entrySequence"])
            if entry.based_on != expected:  # (c)
                raise Conflict(
                    "entry.sequence is not the offered snapshot's sequence (rule c)",
                    code="sequence_conflict",
                    details={"offeredSequence": expected},
                )
            # Not `live_head`: an entry deleted since the offer has changed since it (its
            # tombstone is a version), which is 409 entry_changed, not 404.
            head = await self.entries.store.get_entry_head(row.entry_did, attestations=0)
            if head is None or head.head_seq != expected or head.lifecycle == "deleted":
                # The head may have moved because this very offer was accepted (or the offer
                # otherwise decided) after it was read: then that is the answer, not
                # entry_changed. The offer is read again, after the head.
                await self._open(offer_id, principal, party="recipient")
                raise Conflict(
                    "the entry changed since the offer was made",
                    code="entry_changed",
                    details={
                        "offeredSequence": expected,
                        "latestSequence": None if head is None else head.head_seq,
                    },
                )
            changed = trust.changed_field(json.loads(head.doc), submitted)  # (a)
            if changed is not None:
                raise Invalid(
                    f"{changed} differs from the offered snapshot (rule a)",
                    code="transfer_field_changed",
                    details={"field": f"entry.{changed}"},
                )
            version = self.entries.version_change(
                "entry.transferred", entry, expected_head=expected
            )
            doc = dict(offer, status="accepted", decidedAt=rfc3339(self.clock_ms()))
            change = Change(
                "entry.transferred",
                row.entry_did,
                rows={"puts": [_offer_put(row.id, row, doc, uniq=None)], "entry": version.rows},
                event={
                    **version.event,
                    "offerId": row.id,
                    "previousPublisherDid": offer["ownerDid"],
                },
                also=(
                    Also(
                        "transfer.accepted",
                        row.entry_did,
                        {
                            "offerId": row.id,
                            "ownerDid": offer["ownerDid"],
                            "recipientDid": offer["recipientDid"],
                        },
                    ),
                ),
            )
            return Decided(change, (row.entry_did, head.doc))

        outcome, seen = await self.changes.submit_seen(idem, decide)
        if seen is None:
            return outcome
        did, previous = seen  # the entry, and the version the transfer replaced
        return await self.entries.written(outcome, did, previous=previous)


def _expired(row: RecordRow, now: int) -> bool:
    return row.status == OPEN and row.expires_ms is not None and row.expires_ms <= now


def _offer_put(
    offer_id: str,
    row: RecordRow | None,
    doc: dict[str, Any],
    *,
    uniq: str | None,
    expires_ms: int | None = None,
) -> dict[str, Any]:
    return put(
        "offer",
        offer_id,
        based_on=row,
        entry_did=doc["entryDid"],
        owner_did=doc["ownerDid"],
        status=doc["status"],
        doc=doc,
        expires_ms=expires_ms if row is None else row.expires_ms,
        uniq=uniq,
        duplicate=RETRY_REFUSAL,  # a concurrent offer took the entry: decided again
    )
