"""Trust records: attestations, reports and bonds (spec 2.4-2.6, 4.3; design §8, §12).

Every change is a record write through the one append path (`registry.usecases.records`),
with its event: attestation.created|revoked, report.created|resolved, bond.provisioned|
slashed|released.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from registry import trust
from registry.canonical import canonicalize, sha256_hex, with_member
from registry.changes import Also, Change, ChangeLog, Decided, IdemKey, Outcome
from registry.config import Config
from registry.errors import Conflict, Forbidden, Invalid, NotFound
from registry.store import RecordRow, TrustStore
from registry.usecases.common import Principal, now_ms, page_size, parse_sequence, rfc3339
from registry.usecases.entries import Entries
from registry.usecases.records import (
    RecordUseCase,
    body_object,
    did_field,
    new_id,
    put,
    render,
    text_field,
)
from registry.vc import verify_credential

REPORT_OPEN = "reported"


def _cursor(cursor: str | None) -> int | None:
    if cursor is None:
        return None
    after = parse_sequence(cursor)
    if after is None:
        raise Invalid("cursor must be echoed from a previous page", code="invalid_cursor")
    return after


async def _page(
    store: TrustStore,
    kind: str,
    config: Config,
    *,
    limit: int | None,
    cursor: str | None,
    entry_did: str | None = None,
    status: str | None = None,
) -> tuple[list[RecordRow], str | None]:
    size = page_size(config.limits, limit)
    rows, cut = await store.list_records_page(
        kind,
        entry_did=entry_did,
        status=status,
        after_seq=_cursor(cursor),
        limit=size + 1,
        page_bytes=config.limits.trust_page_bytes,
    )
    more = cut or len(rows) > size
    rows = rows[:size]
    return rows, (str(rows[-1].created_seq) if more else None)


def page_json(name: str, rows: list[RecordRow], cursor: str | None, **extra: Any) -> str:
    """`{**extra, name: [docs], cursor?, hasMore}` with the stored documents as they are."""
    head = canonicalize(extra).decode()[:-1] if extra else "{"
    body = ('"' + name + '":[') + ",".join(r.doc for r in rows) + "]"
    tail = ',"hasMore":' + ("true" if cursor else "false")
    if cursor:
        tail = ',"cursor":' + json.dumps(cursor) + tail
    return head + ("," if extra else "") + body + tail + "}"


# --- attestations ------------------------------------------------------------------------


class Attestations(RecordUseCase):
    async def create(self, principal: Principal, data: Any, idem: IdemKey | None) -> Outcome:
        async def decide() -> Decided[str]:
            principal.require("attest")
            body = body_object(
                data,
                required={"attestation", "entryDid"},
                optional=set(),
                code="attestation_invalid",
            )
            entry_did = did_field(body, "entryDid", code="attestation_invalid")
            now = self.clock_ms()
            credential = body["attestation"]
            verified = verify_credential(credential, now=datetime.fromtimestamp(now / 1000, UTC))
            if verified.issuer_did != principal.did:
                raise Forbidden(
                    "the credential's issuer is not the signed-in principal",
                    code="issuer_mismatch",
                    details={"issuerDid": verified.issuer_did, "principal": principal.did},
                )
            if verified.subject_id != entry_did:
                raise Invalid(
                    "credentialSubject.id is not entryDid",
                    code="subject_mismatch",
                    details={"field": "attestation.credentialSubject.id"},
                )
            await self.entries.live_head(entry_did)
            attestation_id = new_id("att")
            doc: dict[str, Any] = {
                "acceptedAt": rfc3339(now),
                "attestationId": attestation_id,
                "credential": credential,
                "entryDid": entry_did,
                "issuerDid": principal.did,
            }
            if verified.valid_from is not None:
                doc["issuedAt"] = _iso(verified.valid_from)
            expires_ms = None
            if verified.valid_until is not None:
                doc["expiresAt"] = _iso(verified.valid_until)
                expires_ms = int(verified.valid_until.timestamp() * 1000)
            # The credential (up to 64 KiB of any JSON) canonicalised once, for its digest and
            # spliced into the record's text (hostile review: each pass over 64 KiB of floats
            # cost ~23 ms of CPU, and a create made four).
            credential_text = canonicalize(credential).decode("utf-8")
            digest = sha256_hex(credential_text.encode("utf-8"))
            rest = render({k: v for k, v in doc.items() if k != "credential"})
            text = with_member(rest, "credential", credential_text)
            change = Change(
                "attestation.created",
                entry_did,
                rows={
                    "requireEntry": entry_did,
                    "puts": [
                        put(
                            "attestation",
                            attestation_id,
                            based_on=None,
                            entry_did=entry_did,
                            owner_did=principal.did,
                            status="active",
                            doc=doc,
                            expires_ms=expires_ms,
                            uniq=f"{entry_did} {digest}",
                            rendered=text,
                            duplicate=Conflict(
                                "this credential is already attested on this entry",
                                code="attestation_exists",
                                details={"entryDid": entry_did},
                            ),
                        )
                    ],
                    "result": text,
                },
                event={"attestationId": attestation_id, "issuerDid": principal.did},
            )
            return Decided(change, entry_did)

        outcome, subject = await self.changes.submit_seen(idem, decide)
        if subject is not None and outcome.refusal is None and not outcome.replayed:
            self.entries.caches.wrote(subject)  # read your write: GET shows it
        return outcome

    async def revoke(
        self, principal: Principal, attestation_id: str, idem: IdemKey | None
    ) -> Outcome:
        async def decide() -> Decided[str]:
            row = await self.get_row(attestation_id)
            if row.owner_did != principal.did:
                raise Forbidden(
                    "only the attestation's issuer may revoke it", code="issuer_mismatch"
                )
            if row.status == "revoked":
                raise Conflict(
                    "the attestation is already revoked",
                    code="attestation_revoked",
                    details={"attestationId": attestation_id},
                )
            doc = json.loads(row.doc)
            doc["revokedAt"] = rfc3339(self.clock_ms())
            change = Change(
                "attestation.revoked",
                row.entry_did,
                rows={
                    "puts": [
                        put(
                            "attestation",
                            attestation_id,
                            based_on=row,
                            entry_did=row.entry_did,
                            owner_did=row.owner_did,
                            status="revoked",
                            doc=doc,
                            expires_ms=row.expires_ms,
                            # Still claimed: a revoked credential cannot be attested again.
                            uniq=f"{row.entry_did} {sha256_hex(canonicalize(doc['credential']))}",
                        )
                    ],
                    "result": render(doc),
                },
                event={"attestationId": attestation_id, "issuerDid": principal.did},
            )
            return Decided(change, row.entry_did)

        outcome, subject = await self.changes.submit_seen(idem, decide)
        if subject is not None and outcome.refusal is None and not outcome.replayed:
            self.entries.caches.wrote(subject)
        return outcome

    async def get_row(self, attestation_id: str) -> RecordRow:
        row = await self.store.get_record("attestation", attestation_id)
        if row is None:
            raise NotFound(
                "attestation not found",
                code="attestation_not_found",
                details={"attestationId": attestation_id},
            )
        return row

    async def list_for(self, entry_did: str, *, limit: int | None, cursor: str | None) -> str:
        """Every attestation of the entry (revoked ones with `revokedAt`), oldest first."""
        await self.entries.live_head(entry_did)
        rows, next_cursor = await _page(
            self.store, "attestation", self.config, limit=limit, cursor=cursor, entry_did=entry_did
        )
        return page_json("attestations", rows, next_cursor, entryDid=entry_did)


def _iso(moment: datetime) -> str:
    return rfc3339(int(moment.timestamp() * 1000))


# --- bonds -------------------------------------------------------------------------------


class Bonds(RecordUseCase):
    def __init__(
        self,
        *,
        registry_did: str,
        shares: trust.Shares | None = None,
        store: TrustStore,
        changes: ChangeLog,
        entries: Entries,
        config: Config,
        clock_ms: Callable[[], int] = now_ms,
    ) -> None:
        super().__init__(
            store=store, changes=changes, entries=entries, config=config, clock_ms=clock_ms
        )
        self.registry_did = registry_did  # the registry a bond is held by (its documents say)
        self.shares = shares or trust.Shares()

    async def provision(self, principal: Principal, data: Any, idem: IdemKey | None) -> Outcome:
        async def decide() -> Change:
            principal.require("admin")
            code = "bond_invalid"
            body = body_object(
                data,
                required={"amount", "bondId", "currency", "entryDid", "publisherDid"},
                optional={"status"},
                code=code,
            )
            bond_id = body["bondId"]
            if not isinstance(bond_id, str) or not trust.RECORD_ID.fullmatch(bond_id):
                raise Invalid(
                    "bondId must be 1-128 characters of A-Z a-z 0-9 . _ : -, and not . or ..",
                    code=code,
                    details={"field": "bondId"},
                )
            amount = trust.parse_amount(body["amount"], "amount")
            currency = body["currency"]
            if not isinstance(currency, str) or not trust.CURRENCY.fullmatch(currency):
                raise Invalid(
                    "currency must match ^[A-Z0-9]{2,10}$", code=code, details={"field": "currency"}
                )
            if body.get("status", "active") != "active":
                raise Invalid(
                    "a bond is provisioned active", code=code, details={"field": "status"}
                )
            entry_did = did_field(body, "entryDid", code=code)
            publisher = did_field(body, "publisherDid", code=code)
            head = await self.entries.live_head(entry_did)
            if head.publisher_did != publisher:
                raise Invalid(
                    "publisherDid is not the entry's publisher",
                    code="bond_publisher_mismatch",
                    details={"field": "publisherDid", "publisherDid": head.publisher_did},
                )
            doc = {
                "amount": body["amount"],
                "bondId": bond_id,
                "createdAt": rfc3339(self.clock_ms()),
                "currency": currency,
                "entryDid": entry_did,
                "publisherDid": publisher,
                "registryDid": self.registry_did,
                "remainingAmount": trust.format_amount(amount),
                "slashHistory": [],
                "status": "active",
            }
            return Change(
                "bond.provisioned",
                entry_did,
                rows={
                    "requireEntry": entry_did,
                    # The publisher checked is the head's that was read: a transfer committed
                    # since would leave the bond naming the previous one.
                    "requireHead": head.head_seq,
                    "puts": [
                        put(
                            "bond",
                            bond_id,
                            based_on=None,
                            entry_did=entry_did,
                            owner_did=publisher,
                            status="active",
                            doc=doc,
                            exists=Conflict(
                                "a bond with this bondId exists",
                                code="bond_exists",
                                details={"bondId": bond_id},
                            ),
                        )
                    ],
                    "result": render(doc),
                },
                event={"bondId": bond_id, "amount": body["amount"], "currency": currency},
            )

        return await self.changes.submit(idem, decide)

    async def get(self, bond_id: str) -> str:
        return (await self.get_row(bond_id)).doc

    async def get_row(self, bond_id: str) -> RecordRow:
        row = await self.store.get_record("bond", bond_id)
        if row is None:
            raise NotFound("bond not found", code="bond_not_found", details={"bondId": bond_id})
        return row

    async def slash(
        self, principal: Principal, bond_id: str, data: Any, idem: IdemKey | None
    ) -> Outcome:
        async def decide() -> Change:
            principal.require("admin")
            body = body_object(
                data,
                required={"amount", "reason", "reporterDid"},
                optional=set(),
                code="slash_invalid",
            )
            amount = trust.parse_amount(body["amount"], "amount")
            reason = text_field(body, "reason", code="slash_invalid")
            assert reason is not None
            reporter = did_field(body, "reporterDid", code="slash_invalid")
            put_item, event = await self.slash_put(bond_id, amount, reason, reporter)
            return Change(
                "bond.slashed",
                put_item["entryDid"],
                rows={"puts": [put_item], "result": put_item["doc"]},
                event=event,
            )

        return await self.changes.submit(idem, decide)

    async def slash_put(
        self, bond_id: str, amount: Decimal, reason: str, reporter: str
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The bond's next version with the slash appended, and the bond.slashed event."""
        row = await self.get_row(bond_id)
        if row.status not in ("active", "slashed"):
            raise Conflict(
                f"the bond is {row.status}; only an active or slashed bond can be slashed",
                code="bond_not_active",
                details={"bondId": bond_id, "status": row.status},
            )
        doc = json.loads(row.doc)
        left = Decimal(doc["remainingAmount"])
        if amount > left:
            raise Conflict(
                "the slash exceeds what remains of the bond",
                code="slash_exceeds_bond",
                details={"bondId": bond_id, "remainingAmount": doc["remainingAmount"]},
            )
        split = trust.split_slash(amount, self.shares)
        entry = {
            "amount": trust.format_amount(amount),
            "distribution": split.to_json(),
            "reason": reason,
            "reporterDid": reporter,
            "timestamp": rfc3339(self.clock_ms()),
        }
        now_left = trust.remaining(left, [amount])
        doc["slashHistory"].append(entry)
        doc["remainingAmount"] = trust.format_amount(now_left)
        doc["status"] = "exhausted" if now_left == 0 else "slashed"
        put_item = put(
            "bond",
            bond_id,
            based_on=row,
            entry_did=row.entry_did,
            owner_did=row.owner_did,
            status=doc["status"],
            doc=doc,
        )
        event = {"bondId": bond_id, **entry, "status": doc["status"]}
        return put_item, event

    async def release(self, principal: Principal, bond_id: str, idem: IdemKey | None) -> Outcome:
        async def decide() -> Change:
            principal.require("admin")
            row = await self.get_row(bond_id)
            if row.status not in ("active", "slashed"):
                raise Conflict(
                    f"the bond is {row.status}; only an active or slashed bond can be released",
                    code="bond_not_active",
                    details={"bondId": bond_id, "status": row.status},
                )
            doc = json.loads(row.doc)
            doc["status"] = "released"
            doc["releasedAt"] = rfc3339(self.clock_ms())
            return Change(
                "bond.released",
                row.entry_did,
                rows={
                    "puts": [
                        put(
                            "bond",
                            bond_id,
                            based_on=row,
                            entry_did=row.entry_did,
                            owner_did=row.owner_did,
                            status="released",
                            doc=doc,
                        )
                    ],
                    "result": render(doc),
                },
                event={"bondId": bond_id, "remainingAmount": doc["remainingAmount"]},
            )

        return await self.changes.submit(idem, decide)


# --- reports -----------------------------------------------------------------------------


class Reports(RecordUseCase):
    def __init__(
        self,
        *,
        bonds: Bonds,  # a resolved report may slash the entry's bond
        store: TrustStore,
        changes: ChangeLog,
        entries: Entries,
        config: Config,
        clock_ms: Callable[[], int] = now_ms,
    ) -> None:
        super().__init__(
            store=store, changes=changes, entries=entries, config=config, clock_ms=clock_ms
        )
        self.bonds = bonds

    async def create(self, principal: Principal, data: Any, idem: IdemKey | None) -> Outcome:
        async def decide() -> Change:
            principal.require("report")
            body = body_object(
                data, required={"entryDid", "reason"}, optional=set(), code="report_invalid"
            )
            entry_did = did_field(body, "entryDid", code="report_invalid")
            reason = text_field(body, "reason", code="report_invalid")
            await self.entries.live_head(entry_did)
            report_id = new_id("rep")
            doc = {
                "createdAt": rfc3339(self.clock_ms()),
                "entryDid": entry_did,
                "reason": reason,
                "reportId": report_id,
                "reporterDid": principal.did,
                "status": REPORT_OPEN,
            }
            uniq = f"{principal.did} {entry_did}"
            return Change(
                "report.created",
                entry_did,
                rows={
                    "requireEntry": entry_did,
                    "puts": [
                        put(
                            "report",
                            report_id,
                            based_on=None,
                            entry_did=entry_did,
                            owner_did=principal.did,
                            status=REPORT_OPEN,
                            doc=doc,
                            uniq=uniq,
                            duplicate=Conflict(
                                "you already have an open report on this entry",
                                code="report_exists",
                                details={"entryDid": entry_did},
                            ),
                        )
                    ],
                    "result": render(
                        {"entryDid": entry_did, "reportId": report_id, "status": REPORT_OPEN}
                    ),
                },
                event={"reportId": report_id},
            )

        return await self.changes.submit(idem, decide)

    async def list(
        self, principal: Principal, *, status: str | None, limit: int | None, cursor: str | None
    ) -> str:
        principal.require("admin")
        if status is not None and status not in (REPORT_OPEN, "dismissed", "upheld"):
            raise Invalid("status must be reported, dismissed or upheld", code="invalid_status")
        rows, next_cursor = await _page(
            self.store, "report", self.config, limit=limit, cursor=cursor, status=status
        )
        return page_json("reports", rows, next_cursor)

    async def resolve(
        self, principal: Principal, report_id: str, data: Any, idem: IdemKey | None
    ) -> Outcome:
        async def decide() -> Change:
            principal.require("admin")
            code = "resolution_invalid"
            body = body_object(data, required={"decision"}, optional={"note", "slash"}, code=code)
            decision = body["decision"]
            if decision not in ("dismiss", "uphold"):
                raise Invalid(
                    "decision must be dismiss or uphold", code=code, details={"field": "decision"}
                )
            note = text_field(body, "note", code=code)
            slash = body.get("slash")
            if slash is not None and decision != "uphold":
                raise Invalid(
                    "only an upheld report can slash a bond", code=code, details={"field": "slash"}
                )
            row = await self.store.get_record("report", report_id)
            if row is None:
                raise NotFound(
                    "report not found", code="report_not_found", details={"reportId": report_id}
                )
            if row.status != REPORT_OPEN:
                raise Conflict(
                    f"the report is already {row.status}",
                    code="report_resolved",
                    details={"reportId": report_id, "status": row.status},
                )
            doc = json.loads(row.doc)
            status = "upheld" if decision == "uphold" else "dismissed"
            resolution: dict[str, Any] = {"decision": decision, "resolvedBy": principal.did}
            if note is not None:
                resolution["note"] = note
            puts: list[dict[str, Any]] = []
            also: tuple[Also, ...] = ()
            if slash is not None:
                slash_body = body_object(
                    slash, required={"amount", "bondId"}, optional=set(), code=code
                )
                amount = trust.parse_amount(slash_body["amount"], "slash.amount")
                bond_id = slash_body["bondId"]
                if not isinstance(bond_id, str):
                    raise Invalid("slash.bondId must be a string", code=code)
                bond_put, event = await self.bonds.slash_put(
                    bond_id, amount, str(doc["reason"]), str(row.owner_did)
                )
                if bond_put["entryDid"] != row.entry_did:
                    raise Invalid(
                        "the bond is not the reported entry's",
                        code=code,
                        details={"field": "slash.bondId"},
                    )
                puts.append(bond_put)
                also = (Also("bond.slashed", bond_put["entryDid"], event),)
                resolution["slash"] = {"amount": trust.format_amount(amount), "bondId": bond_id}
            doc["status"] = status
            doc["resolvedAt"] = rfc3339(self.clock_ms())
            doc["resolution"] = resolution
            puts.insert(
                0,
                put(
                    "report",
                    report_id,
                    based_on=row,
                    entry_did=row.entry_did,
                    owner_did=row.owner_did,
                    status=status,
                    doc=doc,
                    uniq=None,
                ),
            )
            return Change(
                "report.resolved",
                row.entry_did,
                rows={"puts": puts, "result": render(doc)},
                event={"reportId": report_id, "status": status},
                also=also,
            )

        return await self.changes.submit(idem, decide)
