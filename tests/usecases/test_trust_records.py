"""Transfers, attestations, bonds and reports over the in-memory store, on Trio's virtual clock.

What a client relies on (design §6, §8, §12): an offer reads `expired` from its `expiresAt` on,
for every operation, and a new offer may then replace it; concurrent slashes of one bond are
decided again on the state the winner left (compare-and-set), never overdrawing it; a refused
change writes nothing; an idempotent replay answers the recorded outcome and appends nothing;
every change is its kinds' log records at the next gap-free sequences.

Wired as service/wiring.py wires the use-cases, but with the store's own append under the
ChangeLog (no writer actor), so that the store's `latency` knob interleaves concurrent calls.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from registry.changes import Change, ChangeLog, IdemKey, LogRecord, Outcome, rfc3339_ms
from registry.coherence import Caches
from registry.config import load_config
from registry.errors import Conflict, Invalid, RegistryError
from registry.keys import SigningKey
from registry.store import INLINE_ATTESTATIONS, SessionRecord
from registry.store.memory import MemoryStore
from registry.trust import sign_offer
from registry.usecases.common import Principal
from registry.usecases.entries import Entries
from registry.usecases.transfers import Transfers
from registry.usecases.trust import Attestations, Bonds, Reports
from registry.vc import issue_credential
from tests.helpers import signed_entry

EPOCH_MS = 1_790_000_000_000
DAY_MS = 24 * 3600 * 1000


def clock_ms() -> int:
    """Virtual milliseconds since the epoch (rounded: the virtual clock is a float)."""
    return EPOCH_MS + round(trio.current_time() * 1000)


async def until_ms(moment: int) -> None:
    """Let virtual time run to exactly `moment` (autojump: instant)."""
    await trio.sleep_until((moment - EPOCH_MS) / 1000)
    assert clock_ms() == moment


@dataclass(frozen=True)
class Party:
    key: SigningKey
    principal: Principal

    @property
    def did(self) -> str:
        return self.key.did


def party(*capabilities: str) -> Party:
    key = SigningKey.generate()
    session = SessionRecord(
        principal=key.did,
        hmr_did=key.did,
        root_did=key.did,
        root_kind="did:key",
        capabilities=capabilities,
        expires_at_ms=EPOCH_MS + 365 * DAY_MS,
    )
    token_hash = hashlib.sha256(key.seed).digest()
    return Party(key, Principal(key.did, capabilities, session, token_hash))


def idem(who: Party, operation: str, key: str, body: Any = None) -> IdemKey:
    fingerprint = hashlib.sha256(repr((operation, body)).encode()).digest()
    return IdemKey(who.did, operation, key, fingerprint)


@dataclass
class World:
    store: MemoryStore
    entries: Entries
    transfers: Transfers
    attestations: Attestations
    bonds: Bonds
    reports: Reports
    admin: Party


@pytest.fixture(name="w")
async def world(autojump_clock: trio.testing.MockClock) -> World:
    # pytest-trio runs a test on a clock only when the test itself requests it.
    assert trio.lowlevel.current_clock() is autojump_clock, "request autojump_clock in the test"
    store = MemoryStore(clock_ms=clock_ms)

    async def append(change: Change, key: IdemKey | None) -> Outcome:
        (outcome,) = await store.append([(change, key)])
        return outcome

    changes = ChangeLog(append, store)
    config = load_config(
        None,
        environ={},
        overrides={"server": {"data_dir": str(Path("/nonexistent")), "public_origin": "http://t"}},
    )
    entries = Entries(
        store=store,
        changes=changes,
        config=config,
        caches=Caches(discover_capacity=10),
        clock_ms=clock_ms,
    )
    bonds = Bonds(
        store=store,
        changes=changes,
        entries=entries,
        config=config,
        registry_did=SigningKey.generate().did,
        clock_ms=clock_ms,
    )
    common: dict[str, Any] = {
        "store": store,
        "changes": changes,
        "entries": entries,
        "config": config,
        "clock_ms": clock_ms,
    }
    return World(
        store=store,
        entries=entries,
        transfers=Transfers(**common),
        attestations=Attestations(**common),
        bonds=bonds,
        reports=Reports(bonds=bonds, **common),
        admin=party("admin"),
    )


# --- builders and checks -----------------------------------------------------------------


async def publish(w: World, owner: Party) -> tuple[str, int]:
    """A new entry of `owner`: its DID and sequence."""
    created = await w.entries.create(owner.principal, signed_entry(owner.key), None)
    doc = json.loads(created.unwrap())
    return doc["entryDid"], doc["sequence"]


def offer_body(
    owner: Party, did: str, seq: int, recipient: Party, expires_at: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "entryDid": did,
        "entrySequence": seq,
        "recipientDid": recipient.did,
        "ownerSignature": sign_offer(
            owner.key,
            entry_did=did,
            entry_sequence=seq,
            recipient_did=recipient.did,
            expires_at=expires_at,
        ),
    }
    if expires_at is not None:
        body["expiresAt"] = expires_at
    return body


async def offer(
    w: World, owner: Party, did: str, seq: int, recipient: Party, expires_at: str | None = None
) -> dict[str, Any]:
    body = offer_body(owner, did, seq, recipient, expires_at)
    created = await w.transfers.create(owner.principal, body, idem(owner, "offer", did, body))
    return dict(json.loads(created.unwrap()))


async def offer_status(w: World, offer_id: str) -> str:
    return str(json.loads(await w.transfers.get(offer_id))["status"])


def accept_body(recipient: Party, did: str, seq: int) -> dict[str, Any]:
    return {"entry": signed_entry(recipient.key, did, sequence=seq)}


async def provision(w: World, owner: Party, did: str, bond_id: str, amount: str) -> dict[str, Any]:
    body = {
        "amount": amount,
        "bondId": bond_id,
        "currency": "USD",
        "entryDid": did,
        "publisherDid": owner.did,
    }
    provisioned = await w.bonds.provision(w.admin.principal, body, idem(w.admin, "bond", bond_id))
    return dict(json.loads(provisioned.unwrap()))


def slash_body(amount: str, reporter: Party) -> dict[str, str]:
    return {"amount": amount, "reason": "harmed users", "reporterDid": reporter.did}


def refused(outcome: Outcome, error: type[RegistryError], code: str) -> dict[str, Any]:
    """The outcome is a refusal with this error class (so HTTP status) and code: its details."""
    assert outcome.refusal is not None, outcome
    assert (outcome.refusal.code, type(outcome.refusal.error())) == (code, error)
    return dict(outcome.refusal.details)


async def log_since(w: World, head: int) -> list[LogRecord]:
    return await w.store.log_after(head, 1000)


async def assert_log_gap_free(w: World) -> None:
    records = await w.store.log_after(0, 10_000)
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    assert await w.store.log_head() == len(records)


# --- offers and their expiry -------------------------------------------------------------


async def test_an_offer_reads_expired_from_expires_at_on_for_every_operation(
    autojump_clock: trio.testing.MockClock, w: World
) -> None:
    owner, recipient = party("entries.write"), party("entries.write")
    did, seq = await publish(w, owner)
    made = await offer(w, owner, did, seq, recipient)
    expires = made["createdAt"], made["expiresAt"]
    assert expires == (rfc3339_ms(clock_ms()), rfc3339_ms(clock_ms() + 7 * DAY_MS))  # default
    offer_id, expires_ms = made["offerId"], clock_ms() + 7 * DAY_MS

    await until_ms(expires_ms - 1)
    assert await offer_status(w, offer_id) == "offered"
    await until_ms(expires_ms)
    assert await offer_status(w, offer_id) == "expired"

    head = await w.store.log_head()
    body = accept_body(recipient, did, seq)
    accepted = await w.transfers.accept(
        recipient.principal, offer_id, body, idem(recipient, "accept", "a1", body)
    )
    details = refused(accepted, Conflict, "offer_expired")
    assert details == {"offerId": offer_id, "expiresAt": made["expiresAt"]}
    declined = await w.transfers.decline(
        recipient.principal, offer_id, None, idem(recipient, "decline", "d1")
    )
    refused(declined, Conflict, "offer_expired")
    cancelled = await w.transfers.cancel(owner.principal, offer_id, idem(owner, "cancel", "c1"))
    refused(cancelled, Conflict, "offer_expired")

    await until_ms(expires_ms + 40 * DAY_MS)  # expired stays expired
    assert await offer_status(w, offer_id) == "expired"
    assert await log_since(w, head) == []  # the refusals wrote nothing
    assert (await w.entries.get(did)).sequence == seq  # the entry did not change hands


async def test_an_offer_with_its_own_expiry_can_be_accepted_until_the_last_millisecond(
    autojump_clock: trio.testing.MockClock,
    w: World,
) -> None:
    owner, recipient = party("entries.write"), party("entries.write")
    did, seq = await publish(w, owner)
    expires_ms = clock_ms() + 3600 * 1000
    made = await offer(w, owner, did, seq, recipient, expires_at=rfc3339_ms(expires_ms))
    assert made["expiresAt"] == rfc3339_ms(expires_ms)  # as the owner signed it

    await until_ms(expires_ms - 1)
    head = await w.store.log_head()
    body = accept_body(recipient, did, seq)
    accepted = await w.transfers.accept(
        recipient.principal, made["offerId"], body, idem(recipient, "accept", "a1", body)
    )
    entry = json.loads(accepted.unwrap())
    assert (entry["publisherDid"], entry["sequence"]) == (recipient.did, head + 1)
    records = await log_since(w, head)
    assert [(r.seq, r.kind, r.entry_did) for r in records] == [
        (head + 1, "entry.transferred", did),
        (head + 2, "transfer.accepted", did),
    ]
    assert records[0].data["previousPublisherDid"] == owner.did
    assert records[1].data == {
        "offerId": made["offerId"],
        "ownerDid": owner.did,
        "recipientDid": recipient.did,
    }
    served = await w.entries.get(did)
    assert served.sequence == head + 1
    assert json.loads(served.doc)["publisherDid"] == recipient.did

    await until_ms(expires_ms + DAY_MS)  # a decided offer never reads as expired
    assert await offer_status(w, made["offerId"]) == "accepted"


async def test_a_new_offer_replaces_an_expired_one(
    autojump_clock: trio.testing.MockClock, w: World
) -> None:
    owner = party("entries.write")
    first_to, second_to = party("entries.write"), party("entries.write")
    did, seq = await publish(w, owner)
    first = await offer(w, owner, did, seq, first_to)

    # While the first is open, a second offer of the entry is refused.
    body = offer_body(owner, did, seq, second_to)
    early = await w.transfers.create(owner.principal, body, idem(owner, "offer", "early", body))
    assert refused(early, Conflict, "offer_exists") == {"offerId": first["offerId"]}

    await until_ms(clock_ms() + 7 * DAY_MS)
    head = await w.store.log_head()
    second = await offer(w, owner, did, seq, second_to)
    assert second["status"] == "offered"
    (record,) = await log_since(w, head)
    assert (record.seq, record.kind, record.data["offerId"]) == (
        head + 1,
        "transfer.offered",
        second["offerId"],
    )

    # The replaced offer is now stored as expired; only the new one is open.
    stored = await w.store.get_record("offer", first["offerId"])
    assert stored is not None
    assert (stored.status, json.loads(stored.doc)["status"]) == ("expired", "expired")
    assert await offer_status(w, first["offerId"]) == "expired"
    assert await offer_status(w, second["offerId"]) == "offered"
    still_open = await w.store.list_records("offer", entry_did=did, status="offered")
    assert [row.id for row in still_open] == [second["offerId"]]

    # The first recipient can no longer take it; the second can.
    late = accept_body(first_to, did, seq)
    refused_late = await w.transfers.accept(
        first_to.principal, first["offerId"], late, idem(first_to, "accept", "x", late)
    )
    assert refused(refused_late, Conflict, "offer_expired") == {
        "offerId": first["offerId"],
        "expiresAt": first["expiresAt"],
    }
    taken = accept_body(second_to, did, seq)
    accepted = await w.transfers.accept(
        second_to.principal, second["offerId"], taken, idem(second_to, "accept", "y", taken)
    )
    assert json.loads(accepted.unwrap())["publisherDid"] == second_to.did
    await assert_log_gap_free(w)


async def test_concurrent_offers_of_one_entry_leave_exactly_one_open(
    autojump_clock: trio.testing.MockClock, w: World
) -> None:
    owner = party("entries.write")
    recipients = [party("entries.write") for _ in range(3)]
    did, seq = await publish(w, owner)
    head = await w.store.log_head()
    w.store.latency = 1.0
    outcomes: list[Outcome] = []

    async def make(recipient: Party) -> None:
        body = offer_body(owner, did, seq, recipient)
        key = idem(owner, "offer", recipient.did, body)
        outcomes.append(await w.transfers.create(owner.principal, body, key))

    async with trio.open_nursery() as nursery:
        for recipient in recipients:
            nursery.start_soon(make, recipient)
    w.store.latency = 0.0

    (made,) = [json.loads(o.unwrap()) for o in outcomes if o.refusal is None]
    for o in outcomes:
        if o.refusal is not None:  # the winner's claim sent them round again
            assert refused(o, Conflict, "offer_exists") == {"offerId": made["offerId"]}
    (record,) = await log_since(w, head)
    assert (record.kind, record.data["offerId"]) == ("transfer.offered", made["offerId"])
    still_open = await w.store.list_records("offer", entry_did=did, status="offered")
    assert [row.id for row in still_open] == [made["offerId"]]


async def test_concurrent_decisions_on_one_offer_apply_exactly_one(
    autojump_clock: trio.testing.MockClock, w: World
) -> None:
    owner, recipient = party("entries.write"), party("entries.write")
    did, seq = await publish(w, owner)
    offer_id = (await offer(w, owner, did, seq, recipient))["offerId"]
    head = await w.store.log_head()
    body = accept_body(recipient, did, seq)
    decisions: dict[str, Callable[[], Awaitable[Outcome]]] = {
        "accepted": lambda: w.transfers.accept(
            recipient.principal, offer_id, body, idem(recipient, "accept", "a", body)
        ),
        "declined": lambda: w.transfers.decline(
            recipient.principal, offer_id, None, idem(recipient, "decline", "d")
        ),
        "cancelled": lambda: w.transfers.cancel(
            owner.principal, offer_id, idem(owner, "cancel", "c")
        ),
    }
    # Accepting reads the offer and then the entry: started a call earlier, it appends at the
    # same moment as the others (t=3), so any of the three may win.
    head_start = {"accepted": 0.0, "declined": 1.0, "cancelled": 1.0}
    w.store.latency = 1.0
    outcomes: dict[str, Outcome] = {}

    async def decide(status: str) -> None:
        await trio.sleep(head_start[status])
        outcomes[status] = await decisions[status]()

    async with trio.open_nursery() as nursery:
        for status in decisions:
            nursery.start_soon(decide, status)
    w.store.latency = 0.0

    (winner,) = [status for status, o in outcomes.items() if o.refusal is None]
    for status, o in outcomes.items():
        if status != winner:
            assert refused(o, Conflict, "offer_decided")["status"] == winner
    assert await offer_status(w, offer_id) == winner
    kinds = [r.kind for r in await log_since(w, head)]
    publisher = json.loads((await w.entries.get(did)).doc)["publisherDid"]
    if winner == "accepted":
        assert (kinds, publisher) == (["entry.transferred", "transfer.accepted"], recipient.did)
    else:
        assert (kinds, publisher) == ([f"transfer.{winner}"], owner.did)
    await assert_log_gap_free(w)


# --- bonds: compare-and-set under concurrency --------------------------------------------


@pytest.mark.parametrize(
    ("amounts", "winners", "elapsed"),
    [
        # Each store call takes 1 s. All read version 1 at t=1 and append at t=2: one wins,
        # the others are told Retry, read again (t=3) and append (t=4) or are refused (the
        # refusal recorded at t=4); a third contender goes round once more.
        (("30.00", "50.00"), 2, 4.0),
        (("60.00", "70.00"), 1, 4.0),
        (("40.00", "40.00", "40.00"), 2, 6.0),
        (("100.00", "0.01"), 1, 4.0),
    ],
)
async def test_concurrent_slashes_are_decided_again_on_the_winners_state(
    autojump_clock: trio.testing.MockClock,
    w: World,
    amounts: tuple[str, ...],
    winners: int,
    elapsed: float,
) -> None:
    owner, reporter = party("entries.write"), party("report")
    did, _ = await publish(w, owner)
    await provision(w, owner, did, "bond-1", "100.00")
    head = await w.store.log_head()
    w.store.latency = 1.0
    outcomes: dict[int, Outcome] = {}

    async def slash(i: int) -> None:
        body = slash_body(amounts[i], reporter)
        key = idem(w.admin, "slash", f"s{i}", body)
        outcomes[i] = await w.bonds.slash(w.admin.principal, "bond-1", body, key)

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(len(amounts)):
            nursery.start_soon(slash, i)
    assert trio.current_time() - start == elapsed
    w.store.latency = 0.0

    won = sorted((o.sequence, amounts[i]) for i, o in outcomes.items() if o.refusal is None)
    assert len(won) == winners
    assert [seq for seq, _ in won] == list(range(head + 1, head + 1 + winners))
    bond = json.loads(await w.bonds.get("bond-1"))
    left = Decimal("100.00") - sum((Decimal(a) for _, a in won), Decimal(0))
    assert [s["amount"] for s in bond["slashHistory"]] == [a for _, a in won]
    assert bond["remainingAmount"] == str(left)
    assert bond["status"] == ("exhausted" if left == 0 else "slashed")
    for i, o in outcomes.items():
        if o.refusal is None:
            continue
        # Refused on what remained when it was decided again, not on the state it first read.
        if left == 0:
            assert refused(o, Conflict, "bond_not_active")["status"] == "exhausted"
        else:
            details = refused(o, Conflict, "slash_exceeds_bond")
            assert Decimal(amounts[i]) > Decimal(details["remainingAmount"]) >= left
        # The refusal is recorded under its key: a retry is answered with it.
        body = slash_body(amounts[i], reporter)
        replay = await w.bonds.slash(
            w.admin.principal, "bond-1", body, idem(w.admin, "slash", f"s{i}", body)
        )
        assert (replay.replayed, replay.refusal) == (True, o.refusal)
    records = await log_since(w, head)
    assert [(r.kind, r.data["amount"]) for r in records] == [("bond.slashed", a) for _, a in won]
    assert records[-1].data["status"] == bond["status"]
    # Each winner's answer is the bond as its own slash left it.
    for i, o in outcomes.items():
        if o.refusal is None:
            mine = json.loads(o.unwrap())
            assert mine["slashHistory"][-1]["amount"] == amounts[i]
    await assert_log_gap_free(w)


async def test_slashing_to_zero_exhausts_the_bond_and_splits_each_slash_exactly(
    autojump_clock: trio.testing.MockClock, w: World
) -> None:
    owner, reporter = party("entries.write"), party("report")
    did, _ = await publish(w, owner)
    await provision(w, owner, did, "bond-1", "33.10")
    head = await w.store.log_head()
    first = await w.bonds.slash(
        w.admin.principal,
        "bond-1",
        slash_body("33.10", reporter),
        idem(w.admin, "slash", "s1"),
    )
    bond = json.loads(first.unwrap())
    assert (bond["status"], bond["remainingAmount"]) == ("exhausted", "0.00")
    (history,) = bond["slashHistory"]
    assert history["distribution"] == {
        "harmedPartiesShare": "16.55",
        "reporterShare": "9.93",
        "treasuryShare": "6.62",
    }
    assert (history["reporterDid"], history["timestamp"]) == (reporter.did, rfc3339_ms(clock_ms()))
    (record,) = await log_since(w, head)
    assert record.data["distribution"] == history["distribution"]
    assert record.data["status"] == "exhausted"

    again = await w.bonds.slash(
        w.admin.principal, "bond-1", slash_body("0.01", reporter), idem(w.admin, "slash", "s2")
    )
    refused(again, Conflict, "bond_not_active")
    released = await w.bonds.release(w.admin.principal, "bond-1", idem(w.admin, "release", "r"))
    refused(released, Conflict, "bond_not_active")
    assert await w.store.log_head() == head + 1


# --- reports -----------------------------------------------------------------------------


async def test_a_resolution_whose_slash_exceeds_the_bond_writes_nothing(
    autojump_clock: trio.testing.MockClock, w: World
) -> None:
    owner, reporter = party("entries.write"), party("report")
    did, _ = await publish(w, owner)
    created = await w.reports.create(
        reporter.principal, {"entryDid": did, "reason": "spam"}, idem(reporter, "report", "r")
    )
    report_id = json.loads(created.unwrap())["reportId"]
    await provision(w, owner, did, "bond-1", "10.00")
    bond_before = await w.bonds.get("bond-1")
    report_before = await w.store.get_record("report", report_id)
    head = await w.store.log_head()

    body = {"decision": "uphold", "slash": {"amount": "10.01", "bondId": "bond-1"}}
    key = idem(w.admin, "resolve", "too-much", body)
    outcome = await w.reports.resolve(w.admin.principal, report_id, body, key)
    details = refused(outcome, Conflict, "slash_exceeds_bond")
    assert details["remainingAmount"] == "10.00"
    assert await w.store.log_head() == head
    assert await w.bonds.get("bond-1") == bond_before
    assert await w.store.get_record("report", report_id) == report_before
    listed = json.loads(
        await w.reports.list(w.admin.principal, status="reported", limit=None, cursor=None)
    )
    assert [(r["reportId"], r["status"]) for r in listed["reports"]] == [(report_id, "reported")]
    replay = await w.reports.resolve(w.admin.principal, report_id, body, key)
    assert replay.replayed
    assert replay.refusal == outcome.refusal

    # Within the bond the same report resolves: the report, then the slash, one change.
    body = {
        "decision": "uphold",
        "note": "confirmed",
        "slash": {"amount": "10", "bondId": "bond-1"},
    }
    upheld = await w.reports.resolve(
        w.admin.principal, report_id, body, idem(w.admin, "resolve", "ok", body)
    )
    report = json.loads(upheld.unwrap())
    assert report["status"] == "upheld"
    assert report["resolution"] == {
        "decision": "uphold",
        "note": "confirmed",
        "resolvedBy": w.admin.did,
        "slash": {"amount": "10", "bondId": "bond-1"},
    }
    records = await log_since(w, head)
    assert [(r.seq, r.kind) for r in records] == [
        (head + 1, "report.resolved"),
        (head + 2, "bond.slashed"),
    ]
    assert records[0].data == {"reportId": report_id, "status": "upheld"}
    bond = json.loads(await w.bonds.get("bond-1"))
    assert (bond["status"], bond["remainingAmount"]) == ("exhausted", "0.00")
    (history,) = bond["slashHistory"]
    assert (history["reporterDid"], history["reason"]) == (reporter.did, "spam")
    await assert_log_gap_free(w)


async def test_one_open_report_per_reporter_and_entry(
    autojump_clock: trio.testing.MockClock, w: World
) -> None:
    owner, reporter = party("entries.write"), party("report")
    did, _ = await publish(w, owner)
    body = {"entryDid": did, "reason": "spam"}
    first = await w.reports.create(reporter.principal, body, idem(reporter, "report", "1"))
    second = await w.reports.create(reporter.principal, body, idem(reporter, "report", "2"))
    assert refused(second, Conflict, "report_exists") == {"entryDid": did}
    report_id = json.loads(first.unwrap())["reportId"]
    dismissed = await w.reports.resolve(
        w.admin.principal, report_id, {"decision": "dismiss"}, idem(w.admin, "resolve", "d")
    )
    assert json.loads(dismissed.unwrap())["status"] == "dismissed"
    third = await w.reports.create(reporter.principal, body, idem(reporter, "report", "3"))
    assert json.loads(third.unwrap())["status"] == "reported"  # the claim was released
    await assert_log_gap_free(w)


# --- every mutation: its log kinds, and an idempotent replay ------------------------------


@dataclass
class Scenario:
    """A mutation ready to run (twice, under one key) and the log kinds it appends."""

    run: Callable[[], Awaitable[Outcome]]
    kinds: list[str]


async def offer_created(w: World) -> Scenario:
    owner, recipient = party("entries.write"), party("entries.write")
    did, seq = await publish(w, owner)
    body = offer_body(owner, did, seq, recipient)
    key = idem(owner, "offer", "k", body)
    return Scenario(lambda: w.transfers.create(owner.principal, body, key), ["transfer.offered"])


async def offer_declined(w: World) -> Scenario:
    owner, recipient = party("entries.write"), party("entries.write")
    did, seq = await publish(w, owner)
    offer_id = (await offer(w, owner, did, seq, recipient))["offerId"]
    body = {"reason": "not now"}
    key = idem(recipient, "decline", "k", body)
    return Scenario(
        lambda: w.transfers.decline(recipient.principal, offer_id, body, key),
        ["transfer.declined"],
    )


async def offer_cancelled(w: World) -> Scenario:
    owner, recipient = party("entries.write"), party("entries.write")
    did, seq = await publish(w, owner)
    offer_id = (await offer(w, owner, did, seq, recipient))["offerId"]
    key = idem(owner, "cancel", "k")
    return Scenario(
        lambda: w.transfers.cancel(owner.principal, offer_id, key), ["transfer.cancelled"]
    )


async def offer_accepted(w: World) -> Scenario:
    owner, recipient = party("entries.write"), party("entries.write")
    did, seq = await publish(w, owner)
    offer_id = (await offer(w, owner, did, seq, recipient))["offerId"]
    body = accept_body(recipient, did, seq)
    key = idem(recipient, "accept", "k", body)
    return Scenario(
        lambda: w.transfers.accept(recipient.principal, offer_id, body, key),
        ["entry.transferred", "transfer.accepted"],
    )


def credential(issuer: Party, did: str) -> dict[str, Any]:
    now = datetime.fromtimestamp(clock_ms() / 1000, UTC)
    return issue_credential(
        issuer.key, subject_id=did, valid_until=now + timedelta(days=30), created=now
    )


async def attestation_created(w: World) -> Scenario:
    owner, issuer = party("entries.write"), party("attest")
    did, _ = await publish(w, owner)
    body = {"attestation": credential(issuer, did), "entryDid": did}
    key = idem(issuer, "attest", "k", body)
    return Scenario(
        lambda: w.attestations.create(issuer.principal, body, key), ["attestation.created"]
    )


async def attestation_revoked(w: World) -> Scenario:
    owner, issuer = party("entries.write"), party("attest")
    did, _ = await publish(w, owner)
    body = {"attestation": credential(issuer, did), "entryDid": did}
    made = await w.attestations.create(issuer.principal, body, idem(issuer, "attest", "a"))
    attestation_id = json.loads(made.unwrap())["attestationId"]
    key = idem(issuer, "revoke", "k")
    return Scenario(
        lambda: w.attestations.revoke(issuer.principal, attestation_id, key),
        ["attestation.revoked"],
    )


async def report_created(w: World) -> Scenario:
    owner, reporter = party("entries.write"), party("report")
    did, _ = await publish(w, owner)
    body = {"entryDid": did, "reason": "spam"}
    key = idem(reporter, "report", "k", body)
    return Scenario(lambda: w.reports.create(reporter.principal, body, key), ["report.created"])


async def report_resolved(w: World) -> Scenario:
    owner, reporter = party("entries.write"), party("report")
    did, _ = await publish(w, owner)
    made = await w.reports.create(
        reporter.principal, {"entryDid": did, "reason": "spam"}, idem(reporter, "report", "r")
    )
    report_id = json.loads(made.unwrap())["reportId"]
    await provision(w, owner, did, "bond-1", "100.00")
    body = {"decision": "uphold", "slash": {"amount": "25.00", "bondId": "bond-1"}}
    key = idem(w.admin, "resolve", "k", body)
    return Scenario(
        lambda: w.reports.resolve(w.admin.principal, report_id, body, key),
        ["report.resolved", "bond.slashed"],
    )


async def bond_provisioned(w: World) -> Scenario:
    owner = party("entries.write")
    did, _ = await publish(w, owner)
    body = {
        "amount": "100.00",
        "bondId": "bond-1",
        "currency": "USDC",
        "entryDid": did,
        "publisherDid": owner.did,
        "status": "active",
    }
    key = idem(w.admin, "bond", "k", body)
    return Scenario(lambda: w.bonds.provision(w.admin.principal, body, key), ["bond.provisioned"])


async def bond_slashed(w: World) -> Scenario:
    owner, reporter = party("entries.write"), party("report")
    did, _ = await publish(w, owner)
    await provision(w, owner, did, "bond-1", "100.00")
    body = slash_body("60.00", reporter)  # a second 60.00 would exceed what remains
    key = idem(w.admin, "slash", "k", body)
    return Scenario(lambda: w.bonds.slash(w.admin.principal, "bond-1", body, key), ["bond.slashed"])


async def bond_released(w: World) -> Scenario:
    owner = party("entries.write")
    did, _ = await publish(w, owner)
    await provision(w, owner, did, "bond-1", "100.00")
    key = idem(w.admin, "release", "k")
    return Scenario(lambda: w.bonds.release(w.admin.principal, "bond-1", key), ["bond.released"])


SCENARIOS = [
    offer_created,
    offer_declined,
    offer_cancelled,
    offer_accepted,
    attestation_created,
    attestation_revoked,
    report_created,
    report_resolved,
    bond_provisioned,
    bond_slashed,
    bond_released,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
async def test_each_mutation_appends_its_kinds_and_a_replay_appends_nothing(
    autojump_clock: trio.testing.MockClock,
    w: World,
    scenario: Callable[[World], Awaitable[Scenario]],
) -> None:
    mutation = await scenario(w)
    head = await w.store.log_head()
    first = await mutation.run()
    assert first.refusal is None, first.refusal
    assert (first.sequence, first.replayed) == (head + 1, False)
    records = await log_since(w, head)
    assert [(r.seq, r.kind) for r in records] == [
        (head + 1 + i, kind) for i, kind in enumerate(mutation.kinds)
    ]
    await assert_log_gap_free(w)

    await trio.sleep(23 * 3600)  # within the 24 h an idempotency record answers for
    again = await mutation.run()  # the state moved on: only the record can answer this
    assert again.replayed
    assert (again.sequence, again.result, again.refusal) == (first.sequence, first.result, None)
    assert await w.store.log_head() == head + len(mutation.kinds)


async def test_a_key_reused_for_another_request_is_an_idempotency_conflict(
    autojump_clock: trio.testing.MockClock, w: World
) -> None:
    owner, reporter = party("entries.write"), party("report")
    did, _ = await publish(w, owner)
    await provision(w, owner, did, "bond-1", "100.00")
    body = slash_body("10.00", reporter)
    first = await w.bonds.slash(
        w.admin.principal, "bond-1", body, idem(w.admin, "slash", "k", body)
    )
    head = await w.store.log_head()
    other = slash_body("20.00", reporter)
    conflict = await w.bonds.slash(
        w.admin.principal, "bond-1", other, idem(w.admin, "slash", "k", other)
    )
    refused(conflict, Conflict, "idempotency_conflict")
    assert await w.store.log_head() == head == first.sequence
    assert json.loads(await w.bonds.get("bond-1"))["remainingAmount"] == "90.00"


# --- amounts as stored -------------------------------------------------------------------


@pytest.mark.parametrize("field", ["amount", "currency", "bondId"])
async def test_a_bond_with_a_trailing_newline_in_a_field_is_refused(
    autojump_clock: trio.testing.MockClock, w: World, field: str
) -> None:
    owner = party("entries.write")
    did, _ = await publish(w, owner)
    body = {
        "amount": "100.00",
        "bondId": "bond-1",
        "currency": "USD",
        "entryDid": did,
        "publisherDid": owner.did,
    }
    body[field] += "\n"
    head = await w.store.log_head()
    outcome = await w.bonds.provision(w.admin.principal, body, idem(w.admin, "bond", "k"))
    assert outcome.refusal is not None, outcome.result
    code = "invalid_amount" if field == "amount" else "bond_invalid"
    assert refused(outcome, Invalid, code) == {"field": field}
    assert await w.store.log_head() == head


async def attest_for(w: World, did: str, *, hours: int) -> str:
    """A new issuer's attestation of `did`, valid for `hours` from now: its id."""
    issuer = party("attest")
    now = datetime.fromtimestamp(clock_ms() / 1000, UTC)
    vc = issue_credential(
        issuer.key, subject_id=did, valid_until=now + timedelta(hours=hours), created=now
    )
    made = await w.attestations.create(issuer.principal, {"attestation": vc, "entryDid": did}, None)
    return str(json.loads(made.unwrap())["attestationId"])


async def test_the_in_memory_store_serves_the_oldest_unexpired_attestations_as_postgresql_does(
    w: World, autojump_clock: trio.testing.MockClock
) -> None:
    did, _ = await publish(w, party("entries.write"))
    first = await attest_for(w, did, hours=1)
    rest = [await attest_for(w, did, hours=720) for _ in range(INLINE_ATTESTATIONS + 1)]
    head = await w.store.get_entry_head(did)
    assert head is not None
    served = [json.loads(doc)["attestationId"] for _, doc in head.attestations]
    assert served == [first, *rest][:INLINE_ATTESTATIONS]
    await until_ms(clock_ms() + 2 * 3600 * 1000)  # the first has expired
    head = await w.store.get_entry_head(did)
    assert head is not None
    assert [json.loads(doc)["attestationId"] for _, doc in head.attestations] == rest[:-1]


async def test_a_cached_entry_serves_what_a_fresh_read_does_once_an_attestation_expires(
    w: World, autojump_clock: trio.testing.MockClock
) -> None:
    # An entry serves INLINE_ATTESTATIONS of them; when a cached one expires, the database may
    # hold another to serve in its place, and an expiry writes nothing that drops the cache.
    w.entries.caches.set_live(True)
    did, _ = await publish(w, party("entries.write"))

    def shown(served: Any) -> int:
        return len(json.loads(served.at(clock_ms())).get("verifiableAttestations", []))

    await attest_for(w, did, hours=1)
    for _ in range(INLINE_ATTESTATIONS):
        await attest_for(w, did, hours=720)
    assert shown(await w.entries.read(did)) == INLINE_ATTESTATIONS
    assert w.entries.cache.get(did) is not None  # cached
    await until_ms(clock_ms() + 2 * 3600 * 1000)  # the first has expired
    assert shown(await w.entries.read(did)) == INLINE_ATTESTATIONS  # the 51st moved up


async def test_a_page_of_records_ends_before_the_first_past_its_bytes(
    autojump_clock: trio.testing.MockClock, w: World
) -> None:
    """The memory store's `list_records_page` as PostgreSQL's (tests/api/test_attestations.py):
    a record comes while its predecessors on the page hold fewer than `page_bytes` bytes; the
    first always comes."""
    owner = party("entries.write")
    did, _ = await publish(w, owner)
    for i in range(4):
        reporter = party("report")
        body = {"entryDid": did, "reason": "spam"}
        made = await w.reports.create(reporter.principal, body, idem(reporter, "r", str(i)))
        assert made.refusal is None
    rows = await w.store.list_records("report", limit=10)
    sizes = [len(r.doc.encode()) for r in rows]
    ids = [r.id for r in rows]

    async def page(page_bytes: int) -> tuple[list[str], bool]:
        found, cut = await w.store.list_records_page("report", limit=10, page_bytes=page_bytes)
        return [r.id for r in found], cut

    assert await page(1) == (ids[:1], True)
    assert await page(sizes[0] + sizes[1]) == (ids[:2], True)
    assert await page(sizes[0] + sizes[1] + 1) == (ids[:3], True)
    assert await page(sum(sizes)) == (ids, False)


async def test_an_offer_racing_an_owner_update_never_names_a_stale_sequence(
    autojump_clock: trio.testing.MockClock, w: World
) -> None:
    # The in-memory twin of apply_records' `requireHead`: the offer reads the head, the owner's
    # update appends, then the offer appends; it is decided again, and is stale.
    owner, recipient = party("entries.write"), party("entries.write")
    did, seq = await publish(w, owner)
    head = await w.store.log_head()
    read, go = trio.Event(), trio.Event()
    entries = w.transfers.entries

    class Paused:
        def __getattr__(self, name: str) -> Any:
            return getattr(entries, name)

        async def live_head(self, did: str, **kw: Any) -> Any:
            found = await entries.live_head(did, **kw)
            read.set()
            await go.wait()
            return found

    w.transfers.entries = Paused()  # type: ignore[assignment]
    refusals: list[Conflict] = []

    async def make() -> None:
        body = offer_body(owner, did, seq, recipient)
        with pytest.raises(Conflict) as refusal:  # no Idempotency-Key: raised, not recorded
            await w.transfers.create(owner.principal, body, None)
        refusals.append(refusal.value)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(make)
        await read.wait()
        entry = signed_entry(owner.key, did, sequence=seq, version="raced")
        updated = json.loads((await w.entries.update(owner.principal, did, entry, None)).unwrap())
        go.set()

    (refusal,) = refusals
    assert (refusal.code, refusal.details) == (
        "sequence_conflict",
        {"latestSequence": updated["sequence"]},
    )
    assert [r.kind for r in await log_since(w, head)] == ["entry.updated"]
    await assert_log_gap_free(w)


async def test_an_accept_overtaken_by_an_owner_update_is_entry_changed(
    autojump_clock: trio.testing.MockClock, w: World
) -> None:
    # The in-memory twin of apply_records turning the transfer version's sequence_conflict into
    # Retry: the accept reads the head, the owner's update appends, then the accept appends; it
    # is decided again, and answers what it would after the update.
    owner, recipient = party("entries.write"), party("entries.write")
    did, seq = await publish(w, owner)
    offer_id = (await offer(w, owner, did, seq, recipient))["offerId"]
    head = await w.store.log_head()
    read, go = trio.Event(), trio.Event()
    entries, store = w.transfers.entries, w.store

    class PausedStore:
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        async def get_entry_head(self, did: str, **kw: Any) -> Any:
            found = await store.get_entry_head(did, **kw)
            read.set()
            await go.wait()
            return found

    class ReadThrough:
        store = PausedStore()

        def __getattr__(self, name: str) -> Any:
            return getattr(entries, name)

    w.transfers.entries = ReadThrough()  # type: ignore[assignment]
    outcomes: list[Outcome] = []

    async def take() -> None:
        body = accept_body(recipient, did, seq)
        key = idem(recipient, "accept", "a", body)
        outcomes.append(await w.transfers.accept(recipient.principal, offer_id, body, key))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take)
        await read.wait()
        entry = signed_entry(owner.key, did, sequence=seq, version="raced")
        updated = json.loads((await w.entries.update(owner.principal, did, entry, None)).unwrap())
        go.set()

    (outcome,) = outcomes
    assert refused(outcome, Conflict, "entry_changed") == {
        "offeredSequence": seq,
        "latestSequence": updated["sequence"],
    }
    assert await offer_status(w, offer_id) == "offered"
    assert [r.kind for r in await log_since(w, head)] == ["entry.updated"]
    await assert_log_gap_free(w)
