"""Bonds and reports over HTTP and PostgreSQL (spec 2.5, 2.6, 4.3, 5; design §6, §8, §10, §12).

Provisioning (every refusal with its code), slashing with the exact split of design §12, the
bond's states, release, reports with one open report per reporter and entry, and the admin's
list and resolution (a resolution that slashes writes both or neither).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from registry.keys import SigningKey
from tests.api.api_support import JSON, RFC3339, anon_client, create, error_of, with_harness
from tests.conftest import Harness, make_config, open_harness
from tests.helpers import bearer, idem, sign_in

SHARES = ("harmedPartiesShare", "reporterShare", "treasuryShare")


@dataclass
class World:
    h: Harness
    admin: SigningKey
    admin_t: str
    owner: SigningKey
    owner_t: str
    reporter: SigningKey
    reporter_t: str
    other: SigningKey
    other_t: str
    entry: dict[str, Any]

    @property
    def did(self) -> str:
        return str(self.entry["entryDid"])


@pytest.fixture
async def world(database_url: str, tmp_path: Path) -> AsyncIterator[World]:
    admin = SigningKey.generate()
    config = make_config(database_url, tmp_path, auth={"admin_dids": [admin.did]})
    async for h in open_harness(config):
        owner, reporter, other = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
        admin_t, owner_t, reporter_t, other_t = [
            await sign_in(h.client, k) for k in (admin, owner, reporter, other)
        ]
        entry = await create(h, owner, owner_t)
        yield World(h, admin, admin_t, owner, owner_t, reporter, reporter_t, other, other_t, entry)


async def post(w: World, path: str, token: str | None, body: Any = None, key: str = "") -> Any:
    headers = {"Idempotency-Key": key or str(uuid.uuid4())}
    if token is None:
        return await anon_client(w.h).post(path, json=body, headers=headers)
    if body is None:
        return await w.h.client.post(path, headers=bearer(token, **headers))
    return await w.h.client.post(path, json=body, headers=bearer(token, **headers))


def bond_body(w: World, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "amount": "100.00",
        "bondId": f"bond-{uuid.uuid4().hex[:12]}",
        "currency": "USD",
        "entryDid": w.did,
        "publisherDid": w.owner.did,
        "status": "active",
    }
    body.update(fields)
    return body


async def provision(w: World, **fields: Any) -> dict[str, Any]:
    r = await post(w, "/v1/admin/bonds", w.admin_t, bond_body(w, **fields))
    assert r.status_code == 201, await r.get_data()
    return dict(await r.get_json())


async def get_bond(w: World, bond_id: str) -> dict[str, Any]:
    r = await w.h.client.get(f"/v1/bonds/{bond_id}")
    assert r.status_code == 200, await r.get_data()
    return dict(await r.get_json())


def slash_body(w: World, amount: str, reason: str = "misbehaved") -> dict[str, Any]:
    return {"amount": amount, "reason": reason, "reporterDid": w.reporter.did}


async def slash(w: World, bond_id: str, amount: str, token: str | None = None) -> Any:
    return await post(
        w, f"/v1/admin/bonds/{bond_id}/slash", token or w.admin_t, slash_body(w, amount)
    )


async def report(
    w: World, token: str | None = None, entry_did: str | None = None, reason: str = "spam"
) -> Any:
    body = {"entryDid": entry_did or w.did, "reason": reason}
    return await post(w, "/v1/report", token or w.reporter_t, body)


async def reported(w: World, token: str | None = None) -> dict[str, Any]:
    r = await report(w, token)
    assert r.status_code == 201, await r.get_data()
    return dict(await r.get_json())


async def resolve(w: World, report_id: str, body: Any, token: str | None = None) -> Any:
    return await post(w, f"/v1/admin/reports/{report_id}/resolve", token or w.admin_t, body)


async def all_reports(w: World, status: str | None = None, limit: int = 3) -> list[dict[str, Any]]:
    """Every report the admin list shows (for `status`), page by page, cursors echoed."""
    seen: list[dict[str, Any]] = []
    cursor: str | None = None
    for _ in range(1000):
        params = [f"limit={limit}"]
        if status is not None:
            params.append(f"status={status}")
        if cursor is not None:
            params.append(f"cursor={cursor}")
        r = await w.h.client.get("/v1/admin/reports?" + "&".join(params), headers=bearer(w.admin_t))
        assert r.status_code == 200, await r.get_data()
        page = await r.get_json()
        assert len(page["reports"]) <= limit
        seen += page["reports"]
        if not page["hasMore"]:
            assert "cursor" not in page
            return seen
        cursor = page["cursor"]
    raise AssertionError("the report list never ended")


async def report_status(w: World, report_id: str) -> str:
    found = [r for r in await all_reports(w, limit=100) if r["reportId"] == report_id]
    assert len(found) == 1, found
    return str(found[0]["status"])


async def kinds_after(w: World, after: int) -> list[tuple[int, str]]:
    return [(r.seq, r.kind) for r in await w.h.store.log_after(after, 1000) if r.entry_did == w.did]


# --- provision ---------------------------------------------------------------------------------


async def test_admin_provisions_a_bond_that_reads_back_in_full(world: World) -> None:
    w = world
    health = await (await w.h.client.get("/v1/health")).get_json()
    before = await w.h.store.log_head()
    body = bond_body(w, amount="250.50", currency="EUR")
    r = await post(w, "/v1/admin/bonds", w.admin_t, body)
    assert r.status_code == 201, await r.get_data()
    bond = await r.get_json()
    assert {k: bond[k] for k in body} == body
    assert bond["registryDid"] == health["registryDid"]
    assert bond["registryDid"].startswith("did:key:z")
    assert bond["slashHistory"] == []
    assert bond["remainingAmount"] == "250.50"
    assert RFC3339.match(bond["createdAt"])
    assert await get_bond(w, body["bondId"]) == bond
    assert await kinds_after(w, before) == [(before + 1, "bond.provisioned")]


async def test_a_bond_may_be_provisioned_without_a_status(world: World) -> None:
    w = world
    body = bond_body(w)
    del body["status"]
    r = await post(w, "/v1/admin/bonds", w.admin_t, body)
    assert r.status_code == 201, await r.get_data()
    assert (await r.get_json())["status"] == "active"


async def test_the_largest_amount_is_accepted_exactly(world: World) -> None:
    w = world
    amount = "9" * 30 + "." + "9" * 18
    bond = await provision(w, amount=amount)
    assert bond["amount"] == amount
    assert bond["remainingAmount"] == amount


@pytest.mark.parametrize(
    "amount",
    [
        "1e5",
        "-1",
        "0",
        "0.00",
        "1.2.3",
        "1" + "0" * 30,
        "1." + "0" * 19,
        "01",
        ".5",
        "5.",
        " 5",
        "",
        "1,000",
        "NaN",
        100,
        1.5,
        None,
    ],
)
async def test_provision_rejects_an_invalid_amount(world: World, amount: Any) -> None:
    w = world
    body = bond_body(w, amount=amount)
    r = await post(w, "/v1/admin/bonds", w.admin_t, body)
    error = await error_of(r, 400, "invalid_amount")
    assert error["details"]["field"] == "amount"
    r = await w.h.client.get(f"/v1/bonds/{body['bondId']}")
    await error_of(r, 404, "bond_not_found")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"currency": "usd"}, "currency"),
        ({"currency": "U"}, "currency"),
        ({"currency": "ABCDEFGHIJK"}, "currency"),
        ({"currency": 840}, "currency"),
        ({"currency": "USD\n"}, "currency"),
        ({"bondId": ""}, "bondId"),
        ({"bondId": "has space"}, "bondId"),
        ({"bondId": "x" * 129}, "bondId"),
        ({"bondId": "a/b"}, "bondId"),
        ({"bondId": 7}, "bondId"),
        ({"bondId": "bond-1\n"}, "bondId"),
        # A dot segment: /v1/bonds/.. is /v1 to every client that normalises the URL (RFC 3986
        # §5.2.4: httpx, browsers, curl), so such a bond could not be read, slashed or released.
        ({"bondId": "."}, "bondId"),
        ({"bondId": ".."}, "bondId"),
        ({"status": "slashed"}, "status"),
        ({"status": "released"}, "status"),
        ({"entryDid": "not a did"}, "entryDid"),
        ({"publisherDid": "nobody"}, "publisherDid"),
        ({"note": "extra"}, "note"),
    ],
)
async def test_provision_rejects_an_invalid_field(
    world: World, fields: dict[str, Any], field: str
) -> None:
    w = world
    r = await post(w, "/v1/admin/bonds", w.admin_t, bond_body(w, **fields))
    error = await error_of(r, 400, "bond_invalid")
    assert error["details"]["field"] == field


@pytest.mark.parametrize("bond_id", ["...", ".a", "a..", ":", "-"])
async def test_a_bond_id_of_dots_but_no_dot_segment_is_taken(world: World, bond_id: str) -> None:
    w = world
    await provision(w, bondId=bond_id)
    assert (await get_bond(w, bond_id))["bondId"] == bond_id


@pytest.mark.parametrize("missing", ["amount", "bondId", "currency", "entryDid", "publisherDid"])
async def test_provision_rejects_a_missing_field(world: World, missing: str) -> None:
    w = world
    body = bond_body(w)
    del body[missing]
    r = await post(w, "/v1/admin/bonds", w.admin_t, body)
    error = await error_of(r, 400, "bond_invalid")
    assert error["details"]["field"] == missing


async def test_provision_rejects_a_body_that_is_not_an_object_or_not_json(world: World) -> None:
    w = world
    r = await post(w, "/v1/admin/bonds", w.admin_t, ["a", "list"])
    await error_of(r, 400, "bond_invalid")
    r = await w.h.client.post(
        "/v1/admin/bonds", data=b"{", headers=bearer(w.admin_t, **idem(**JSON))
    )
    await error_of(r, 400, "invalid_json")


async def test_provision_for_someone_other_than_the_entrys_publisher_is_400(
    world: World,
) -> None:
    w = world
    r = await post(w, "/v1/admin/bonds", w.admin_t, bond_body(w, publisherDid=w.other.did))
    error = await error_of(r, 400, "bond_publisher_mismatch")
    assert error["details"]["publisherDid"] == w.owner.did


async def test_provision_without_a_session_is_401(world: World) -> None:
    r = await post(world, "/v1/admin/bonds", None, bond_body(world))
    await error_of(r, 401, "session_missing")


async def test_provision_by_a_non_admin_is_403(world: World) -> None:
    w = world
    body = bond_body(w)
    for token in (w.owner_t, w.other_t):
        r = await post(w, "/v1/admin/bonds", token, body)
        error = await error_of(r, 403, "capability_missing")
        assert error["details"]["capability"] == "admin"
    r = await w.h.client.get(f"/v1/bonds/{body['bondId']}")
    await error_of(r, 404, "bond_not_found")


async def test_provision_for_an_unknown_entry_is_404(world: World) -> None:
    w = world
    body = bond_body(w, entryDid="did:web:agents.example.com:no-such-entry")
    r = await post(w, "/v1/admin/bonds", w.admin_t, body)
    await error_of(r, 404, "entry_not_found")


async def test_a_second_bond_with_the_same_id_is_409(world: World) -> None:
    w = world
    first = await provision(w)
    r = await post(w, "/v1/admin/bonds", w.admin_t, bond_body(w, bondId=first["bondId"]))
    error = await error_of(r, 409, "bond_exists")
    assert error["details"]["bondId"] == first["bondId"]
    assert await get_bond(w, first["bondId"]) == first


async def test_provision_replays_its_key_and_refuses_it_for_another_body(world: World) -> None:
    w = world
    key = f"bond-{uuid.uuid4()}"
    body = bond_body(w)
    first = await post(w, "/v1/admin/bonds", w.admin_t, body, key=key)
    assert first.status_code == 201, await first.get_data()
    head = await w.h.store.log_head()
    again = await post(w, "/v1/admin/bonds", w.admin_t, body, key=key)
    assert again.status_code == 201, await again.get_data()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert await again.get_data() == await first.get_data()
    assert await w.h.store.log_head() == head
    other = bond_body(w)
    r = await post(w, "/v1/admin/bonds", w.admin_t, other, key=key)
    await error_of(r, 409, "idempotency_conflict")
    r = await w.h.client.get(f"/v1/bonds/{other['bondId']}")
    await error_of(r, 404, "bond_not_found")


async def test_provision_without_an_idempotency_key_is_400(world: World) -> None:
    w = world
    r = await w.h.client.post("/v1/admin/bonds", json=bond_body(w), headers=bearer(w.admin_t))
    await error_of(r, 400, "idempotency_key_required")


async def test_get_unknown_bond_is_404(world: World) -> None:
    r = await world.h.client.get("/v1/bonds/no-such-bond")
    await error_of(r, 404, "bond_not_found")


# --- slash -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("amount", "harmed", "reporter", "treasury"),
    [
        ("33.10", "16.55", "9.93", "6.62"),
        ("0.01", "0.00", "0.00", "0.01"),
        ("1", "0", "0", "1"),
        ("10", "5", "3", "2"),
        ("100.005", "50.002", "30.001", "20.002"),
        ("0.999", "0.499", "0.299", "0.201"),
    ],
)
async def test_slash_splits_the_amount_exactly_at_its_own_scale(
    world: World, amount: str, harmed: str, reporter: str, treasury: str
) -> None:
    w = world
    bond = await provision(w, amount="1000.000")
    r = await slash(w, bond["bondId"], amount)
    assert r.status_code == 200, await r.get_data()
    slashed = await r.get_json()
    item = slashed["slashHistory"][-1]
    assert item["amount"] == amount
    assert item["distribution"] == {
        "harmedPartiesShare": harmed,
        "reporterShare": reporter,
        "treasuryShare": treasury,
    }
    assert sum(Decimal(item["distribution"][k]) for k in SHARES) == Decimal(amount)
    assert Decimal(slashed["remainingAmount"]) == Decimal("1000.000") - Decimal(amount)
    assert await get_bond(w, bond["bondId"]) == slashed


async def test_slashes_accumulate_until_the_bond_is_exhausted(world: World) -> None:
    w = world
    bond = await provision(w, amount="100.00")
    before = await w.h.store.log_head()
    r = await slash(w, bond["bondId"], "33.10")
    assert r.status_code == 200, await r.get_data()
    one = await r.get_json()
    assert one["status"] == "slashed"
    assert one["remainingAmount"] == "66.90"
    assert one["amount"] == "100.00"
    [item] = one["slashHistory"]
    assert item["reason"] == "misbehaved"
    assert item["reporterDid"] == w.reporter.did
    assert RFC3339.match(item["timestamp"])
    assert set(item) == {"amount", "distribution", "reason", "reporterDid", "timestamp"}

    r = await slash(w, bond["bondId"], "60.00")
    two = await r.get_json()
    assert r.status_code == 200, two
    assert two["status"] == "slashed"
    assert two["remainingAmount"] == "6.90"
    assert [s["amount"] for s in two["slashHistory"]] == ["33.10", "60.00"]
    assert two["slashHistory"][0] == item

    r = await slash(w, bond["bondId"], "6.90")
    three = await r.get_json()
    assert r.status_code == 200, three
    assert three["status"] == "exhausted"
    assert Decimal(three["remainingAmount"]) == 0
    assert len(three["slashHistory"]) == 3
    assert await get_bond(w, bond["bondId"]) == three
    assert await kinds_after(w, before) == [
        (before + 1, "bond.slashed"),
        (before + 2, "bond.slashed"),
        (before + 3, "bond.slashed"),
    ]

    r = await slash(w, bond["bondId"], "0.01")
    error = await error_of(r, 409, "bond_not_active")
    assert error["details"]["status"] == "exhausted"


async def test_a_slash_beyond_the_remainder_is_409_and_changes_nothing(world: World) -> None:
    w = world
    bond = await provision(w, amount="50.00")
    r = await slash(w, bond["bondId"], "20.00")
    assert r.status_code == 200, await r.get_data()
    current = await r.get_json()
    r = await slash(w, bond["bondId"], "30.01")
    error = await error_of(r, 409, "slash_exceeds_bond")
    assert error["details"]["remainingAmount"] == "30.00"
    assert await get_bond(w, bond["bondId"]) == current
    r = await slash(w, bond["bondId"], "30.00")  # exactly the remainder is fine
    assert r.status_code == 200, await r.get_data()
    assert (await r.get_json())["status"] == "exhausted"


async def test_slash_of_a_released_bond_is_409(world: World) -> None:
    w = world
    bond = await provision(w)
    r = await post(w, f"/v1/admin/bonds/{bond['bondId']}/release", w.admin_t)
    assert r.status_code == 200, await r.get_data()
    r = await slash(w, bond["bondId"], "1.00")
    error = await error_of(r, 409, "bond_not_active")
    assert error["details"]["status"] == "released"


async def test_slash_by_a_non_admin_is_403_and_without_a_session_401(world: World) -> None:
    w = world
    bond = await provision(w)
    r = await slash(w, bond["bondId"], "1.00", token=w.reporter_t)
    await error_of(r, 403, "capability_missing")
    r = await post(w, f"/v1/admin/bonds/{bond['bondId']}/slash", None, slash_body(w, "1.00"))
    await error_of(r, 401, "session_missing")
    assert await get_bond(w, bond["bondId"]) == bond


async def test_slash_of_an_unknown_bond_is_404(world: World) -> None:
    r = await slash(world, "no-such-bond", "1.00")
    await error_of(r, 404, "bond_not_found")


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"amount": "1.00", "reporterDid": "did:web:example.com"}, "slash_invalid"),
        ({"amount": "1.00", "reason": "", "reporterDid": "did:web:example.com"}, "slash_invalid"),
        ({"amount": "1.00", "reason": "x", "reporterDid": "me"}, "slash_invalid"),
        (
            {"amount": "1.00", "reason": "x", "reporterDid": "did:web:e.com", "y": 1},
            "slash_invalid",
        ),
        ({"amount": "0", "reason": "x", "reporterDid": "did:web:example.com"}, "invalid_amount"),
        ({"amount": 1, "reason": "x", "reporterDid": "did:web:example.com"}, "invalid_amount"),
    ],
)
async def test_slash_with_an_invalid_body_is_400(
    world: World, body: dict[str, Any], code: str
) -> None:
    w = world
    bond = await provision(w)
    r = await post(w, f"/v1/admin/bonds/{bond['bondId']}/slash", w.admin_t, body)
    await error_of(r, 400, code)
    assert await get_bond(w, bond["bondId"]) == bond


async def test_concurrent_slashes_never_take_more_than_the_bond(world: World) -> None:
    w = world
    bond = await provision(w, amount="100.00")
    responses: list[Any] = []

    async def one() -> None:
        responses.append(await slash(w, bond["bondId"], "30.00"))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(one)
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 200, 409, 409], [await r.get_data() for r in responses]
    for r in responses:
        if r.status_code == 409:
            await error_of(r, 409, "slash_exceeds_bond")
    final = await get_bond(w, bond["bondId"])
    assert final["remainingAmount"] == "10.00"
    assert final["status"] == "slashed"
    assert [s["amount"] for s in final["slashHistory"]] == ["30.00"] * 3
    remainders = sorted(
        [(await r.get_json())["remainingAmount"] for r in responses if r.status_code == 200],
        key=Decimal,
    )
    assert remainders == ["10.00", "40.00", "70.00"]


async def test_more_concurrent_slashes_than_decisions_all_take_effect(world: World) -> None:
    # Twelve slashes released at once, each fitting: one after the other all twelve succeed.
    # Each lost the race to the others in turn, and those that lost eight times answered 503
    # write_contended (four of them), though nothing refused them.
    w = world
    bond = await provision(w, amount="100.00")
    responses: list[Any] = []
    go = trio.Event()

    async def one() -> None:
        await go.wait()
        responses.append(await slash(w, bond["bondId"], "5.00"))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(12):
                nursery.start_soon(one)
            await trio.testing.wait_all_tasks_blocked()
            go.set()
    assert [r.status_code for r in responses] == [200] * 12, [
        await r.get_data() for r in responses if r.status_code != 200
    ]
    final = await get_bond(w, bond["bondId"])
    assert final["remainingAmount"] == "40.00"
    assert [s["amount"] for s in final["slashHistory"]] == ["5.00"] * 12
    remainders = sorted([(await r.get_json())["remainingAmount"] for r in responses], key=Decimal)
    assert remainders == [f"{100 - 5 * n}.00" for n in range(12, 0, -1)]


# --- release -----------------------------------------------------------------------------------


async def test_admin_releases_a_bond_once(world: World) -> None:
    w = world
    bond = await provision(w)
    r = await slash(w, bond["bondId"], "10.00")
    assert r.status_code == 200, await r.get_data()
    before = await w.h.store.log_head()
    r = await post(w, f"/v1/admin/bonds/{bond['bondId']}/release", w.admin_t)
    assert r.status_code == 200, await r.get_data()
    released = await r.get_json()
    assert released["status"] == "released"
    assert released["remainingAmount"] == "90.00"
    assert RFC3339.match(released["releasedAt"])
    assert await get_bond(w, bond["bondId"]) == released
    assert await kinds_after(w, before) == [(before + 1, "bond.released")]
    r = await post(w, f"/v1/admin/bonds/{bond['bondId']}/release", w.admin_t)
    error = await error_of(r, 409, "bond_not_active")
    assert error["details"]["status"] == "released"


async def test_an_exhausted_bond_cannot_be_released(world: World) -> None:
    w = world
    bond = await provision(w, amount="5")
    assert (await slash(w, bond["bondId"], "5")).status_code == 200
    r = await post(w, f"/v1/admin/bonds/{bond['bondId']}/release", w.admin_t)
    await error_of(r, 409, "bond_not_active")


async def test_release_needs_an_admin_and_a_known_bond(world: World) -> None:
    w = world
    bond = await provision(w)
    r = await post(w, f"/v1/admin/bonds/{bond['bondId']}/release", w.owner_t)
    await error_of(r, 403, "capability_missing")
    r = await post(w, f"/v1/admin/bonds/{bond['bondId']}/release", None)
    await error_of(r, 401, "session_missing")
    r = await post(w, "/v1/admin/bonds/no-such-bond/release", w.admin_t)
    await error_of(r, 404, "bond_not_found")
    assert (await get_bond(w, bond["bondId"]))["status"] == "active"


# --- reports -----------------------------------------------------------------------------------


async def test_a_principal_reports_an_entry(world: World) -> None:
    w = world
    before = await w.h.store.log_head()
    r = await report(w, reason="it phishes")
    assert r.status_code == 201, await r.get_data()
    body = await r.get_json()
    assert set(body) == {"entryDid", "status", "reportId"}
    assert body["entryDid"] == w.did
    assert body["status"] == "reported"
    records = [x for x in await w.h.store.log_after(before, 100) if x.entry_did == w.did]
    assert [(x.seq, x.kind) for x in records] == [(before + 1, "report.created")]
    listed = [
        x for x in await all_reports(w, "reported", limit=100) if x["reportId"] == body["reportId"]
    ]
    assert len(listed) == 1
    assert listed[0]["reason"] == "it phishes"
    assert listed[0]["reporterDid"] == w.reporter.did  # derived from the session
    assert listed[0]["entryDid"] == w.did


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"entryDid": "<did>"}, id="reason-missing"),
        pytest.param({"entryDid": "<did>", "reason": ""}, id="reason-empty"),
        pytest.param({"entryDid": "<did>", "reason": "   "}, id="reason-blank"),
        pytest.param({"entryDid": "<did>", "reason": None}, id="reason-null"),
        pytest.param({"entryDid": "<did>", "reason": 5}, id="reason-number"),
        pytest.param({"entryDid": "<did>", "reason": "x" * 2001}, id="reason-too-long"),
        pytest.param({"reason": "spam"}, id="entry-missing"),
        pytest.param({"entryDid": "nope", "reason": "spam"}, id="entry-not-a-did"),
        pytest.param({"entryDid": "<did>", "reason": "spam", "reporterDid": "x"}, id="unknown"),
    ],
)
async def test_an_invalid_report_is_400(world: World, body: dict[str, Any]) -> None:
    w = world
    body = {k: (w.did if v == "<did>" else v) for k, v in body.items()}
    r = await post(w, "/v1/report", w.reporter_t, body)
    await error_of(r, 400, "report_invalid")
    await reported(w)  # nothing was claimed: a valid report still goes through


async def test_a_report_that_is_not_json_is_400(world: World) -> None:
    w = world
    r = await w.h.client.post(
        "/v1/report", data=b"nope", headers=bearer(w.reporter_t, **idem(**JSON))
    )
    await error_of(r, 400, "invalid_json")


async def test_a_report_without_a_session_is_401(world: World) -> None:
    r = await post(world, "/v1/report", None, {"entryDid": world.did, "reason": "spam"})
    await error_of(r, 401, "session_missing")


async def test_a_report_on_an_unknown_entry_is_404(world: World) -> None:
    r = await report(world, entry_did="did:web:agents.example.com:ghost")
    await error_of(r, 404, "entry_not_found")


async def test_without_the_report_capability_a_report_is_403(
    database_url: str, tmp_path: Path
) -> None:
    config = make_config(
        database_url, tmp_path, auth={"default_capabilities": ["entries.write", "attest"]}
    )

    async def body(h: Harness) -> None:
        key = SigningKey.generate()
        token = await sign_in(h.client, key)
        entry = await create(h, key, token)
        r = await h.client.post(
            "/v1/report",
            json={"entryDid": entry["entryDid"], "reason": "spam"},
            headers=bearer(token, **idem()),
        )
        error = await error_of(r, 403, "capability_missing")
        assert error["details"]["capability"] == "report"

    await with_harness(config, body)


async def test_one_open_report_per_reporter_and_entry(world: World) -> None:
    w = world
    first = await reported(w)
    r = await report(w, reason="still spam")
    error = await error_of(r, 409, "report_exists")
    assert error["details"]["entryDid"] == w.did
    # Another reporter may report the same entry; the same reporter another entry.
    await reported(w, token=w.other_t)
    other_entry = await create(w.h, w.owner, w.owner_t)
    r = await report(w, entry_did=other_entry["entryDid"])
    assert r.status_code == 201, await r.get_data()
    # Once resolved, the reporter may report the entry again.
    r = await resolve(w, first["reportId"], {"decision": "dismiss"})
    assert r.status_code == 200, await r.get_data()
    again = await reported(w)
    assert again["reportId"] != first["reportId"]


async def test_two_reports_by_one_reporter_at_once_open_one(world: World) -> None:
    w = world
    responses: list[Any] = []

    async def one() -> None:
        responses.append(await report(w))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            nursery.start_soon(one)
    assert sorted(r.status_code for r in responses) == [201, 409]
    await error_of(next(r for r in responses if r.status_code == 409), 409, "report_exists")
    mine = [
        r
        for r in await all_reports(w, "reported", limit=100)
        if r["entryDid"] == w.did and r["reporterDid"] == w.reporter.did
    ]
    assert len(mine) == 1


async def test_report_without_an_idempotency_key_is_400(world: World) -> None:
    w = world
    r = await w.h.client.post(
        "/v1/report", json={"entryDid": w.did, "reason": "x"}, headers=bearer(w.reporter_t)
    )
    await error_of(r, 400, "idempotency_key_required")


# --- admin list --------------------------------------------------------------------------------


async def test_admin_lists_reports_by_status_page_by_page(world: World) -> None:
    w = world
    reporters = [SigningKey.generate() for _ in range(5)]
    ids: list[str] = []
    for key in reporters:
        token = await sign_in(w.h.client, key)
        ids.append((await reported(w, token=token))["reportId"])
    dismissed, upheld = ids[1], ids[3]
    assert (await resolve(w, dismissed, {"decision": "dismiss"})).status_code == 200
    assert (await resolve(w, upheld, {"decision": "uphold"})).status_code == 200

    def mine(reports: list[dict[str, Any]]) -> list[str]:
        found = [r["reportId"] for r in reports if r["reportId"] in ids]
        assert len(found) == len(set(found)), "a report was listed twice"
        return found

    everything = await all_reports(w, limit=2)
    assert mine(everything) == ids  # oldest first
    open_ = await all_reports(w, "reported", limit=2)
    assert all(r["status"] == "reported" for r in open_)
    assert mine(open_) == [ids[0], ids[2], ids[4]]
    closed = await all_reports(w, "dismissed", limit=2)
    assert all(r["status"] == "dismissed" for r in closed)
    assert mine(closed) == [dismissed]
    held = await all_reports(w, "upheld", limit=2)
    assert all(r["status"] == "upheld" for r in held)
    assert mine(held) == [upheld]


async def test_the_report_list_is_for_admins_only(world: World) -> None:
    w = world
    r = await w.h.client.get("/v1/admin/reports", headers=bearer(w.reporter_t))
    await error_of(r, 403, "capability_missing")
    r = await anon_client(w.h).get("/v1/admin/reports")
    await error_of(r, 401, "session_missing")


@pytest.mark.parametrize(
    ("query", "code"),
    [
        ("status=open", "invalid_status"),
        ("status=REPORTED", "invalid_status"),
        ("cursor=abc", "invalid_cursor"),
        ("limit=0", "invalid_limit"),
    ],
)
async def test_the_report_list_rejects_bad_parameters(world: World, query: str, code: str) -> None:
    w = world
    r = await w.h.client.get(f"/v1/admin/reports?{query}", headers=bearer(w.admin_t))
    await error_of(r, 400, code)


# --- resolve -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("decision", "status"), [("dismiss", "dismissed"), ("uphold", "upheld")])
async def test_admin_resolves_a_report(world: World, decision: str, status: str) -> None:
    w = world
    rep = await reported(w)
    before = await w.h.store.log_head()
    r = await resolve(w, rep["reportId"], {"decision": decision, "note": "looked at it"})
    assert r.status_code == 200, await r.get_data()
    resolved = await r.get_json()
    assert resolved["status"] == status
    assert resolved["reportId"] == rep["reportId"]
    assert resolved["reporterDid"] == w.reporter.did
    assert resolved["resolution"] == {
        "decision": decision,
        "resolvedBy": w.admin.did,
        "note": "looked at it",
    }
    assert RFC3339.match(resolved["resolvedAt"])
    assert await report_status(w, rep["reportId"]) == status
    assert await kinds_after(w, before) == [(before + 1, "report.resolved")]
    r = await resolve(w, rep["reportId"], {"decision": "dismiss"})
    error = await error_of(r, 409, "report_resolved")
    assert error["details"]["status"] == status


async def test_upholding_with_a_slash_slashes_the_bond_for_the_reporter(world: World) -> None:
    w = world
    bond = await provision(w, amount="100.00")
    rep = await reported(w)
    before = await w.h.store.log_head()
    body = {"decision": "uphold", "slash": {"bondId": bond["bondId"], "amount": "33.10"}}
    r = await resolve(w, rep["reportId"], body)
    assert r.status_code == 200, await r.get_data()
    resolved = await r.get_json()
    assert resolved["status"] == "upheld"
    assert resolved["resolution"]["slash"] == {"amount": "33.10", "bondId": bond["bondId"]}
    got = await get_bond(w, bond["bondId"])
    assert got["status"] == "slashed"
    assert got["remainingAmount"] == "66.90"
    [item] = got["slashHistory"]
    assert item["reporterDid"] == w.reporter.did
    assert item["reason"] == "spam"
    assert item["distribution"] == {
        "harmedPartiesShare": "16.55",
        "reporterShare": "9.93",
        "treasuryShare": "6.62",
    }
    assert await kinds_after(w, before) == [
        (before + 1, "report.resolved"),
        (before + 2, "bond.slashed"),
    ]


async def test_a_resolution_slashing_beyond_the_bond_writes_nothing(world: World) -> None:
    w = world
    bond = await provision(w, amount="10.00")
    rep = await reported(w)
    before = await w.h.store.log_head()
    body = {"decision": "uphold", "slash": {"bondId": bond["bondId"], "amount": "10.01"}}
    r = await resolve(w, rep["reportId"], body)
    await error_of(r, 409, "slash_exceeds_bond")
    assert await report_status(w, rep["reportId"]) == "reported"
    assert await get_bond(w, bond["bondId"]) == bond
    assert await kinds_after(w, before) == []
    # The report can still be resolved.
    body["slash"]["amount"] = "10.00"
    r = await resolve(w, rep["reportId"], body)
    assert r.status_code == 200, await r.get_data()
    assert (await get_bond(w, bond["bondId"]))["status"] == "exhausted"


async def test_a_resolution_may_only_slash_the_reported_entrys_bond(world: World) -> None:
    w = world
    elsewhere = await create(w.h, w.owner, w.owner_t)
    foreign = await provision(w, entryDid=elsewhere["entryDid"])
    rep = await reported(w)
    body = {"decision": "uphold", "slash": {"bondId": foreign["bondId"], "amount": "1.00"}}
    r = await resolve(w, rep["reportId"], body)
    error = await error_of(r, 400, "resolution_invalid")
    assert error["details"]["field"] == "slash.bondId"
    assert await report_status(w, rep["reportId"]) == "reported"
    assert await get_bond(w, foreign["bondId"]) == foreign


@pytest.mark.parametrize("state", ["unknown", "released"])
async def test_a_resolution_slashing_an_unusable_bond_leaves_the_report_open(
    world: World, state: str
) -> None:
    w = world
    bond_id = "no-such-bond"
    if state == "released":
        bond_id = (await provision(w))["bondId"]
        assert (await post(w, f"/v1/admin/bonds/{bond_id}/release", w.admin_t)).status_code == 200
    rep = await reported(w)
    body = {"decision": "uphold", "slash": {"bondId": bond_id, "amount": "1.00"}}
    r = await resolve(w, rep["reportId"], body)
    if state == "unknown":
        await error_of(r, 404, "bond_not_found")
    else:
        await error_of(r, 409, "bond_not_active")
    assert await report_status(w, rep["reportId"]) == "reported"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"decision": "dismiss", "slash": {"bondId": "b", "amount": "1.00"}}, "slash"),
        ({"decision": "approve"}, "decision"),
        ({}, "decision"),
        ({"decision": "uphold", "why": "x"}, "why"),
        ({"decision": "uphold", "note": ""}, "note"),
        ({"decision": "uphold", "slash": {"amount": "1.00"}}, "bondId"),
        ({"decision": "uphold", "slash": {"bondId": "b", "amount": "1", "x": 1}}, "x"),
    ],
)
async def test_an_invalid_resolution_is_400(world: World, body: dict[str, Any], field: str) -> None:
    w = world
    rep = await reported(w)
    r = await resolve(w, rep["reportId"], body)
    error = await error_of(r, 400, "resolution_invalid")
    assert error["details"]["field"] == field
    assert await report_status(w, rep["reportId"]) == "reported"


async def test_a_resolution_slashing_an_invalid_amount_is_400(world: World) -> None:
    w = world
    bond = await provision(w)
    rep = await reported(w)
    body = {"decision": "uphold", "slash": {"bondId": bond["bondId"], "amount": "-3"}}
    r = await resolve(w, rep["reportId"], body)
    error = await error_of(r, 400, "invalid_amount")
    assert error["details"]["field"] == "slash.amount"
    assert await report_status(w, rep["reportId"]) == "reported"


async def test_resolving_an_unknown_report_is_404(world: World) -> None:
    r = await resolve(world, "rep_nothing", {"decision": "dismiss"})
    await error_of(r, 404, "report_not_found")


async def test_resolving_needs_an_admin(world: World) -> None:
    w = world
    rep = await reported(w)
    r = await resolve(w, rep["reportId"], {"decision": "dismiss"}, token=w.owner_t)
    await error_of(r, 403, "capability_missing")
    r = await post(w, f"/v1/admin/reports/{rep['reportId']}/resolve", None, {"decision": "dismiss"})
    await error_of(r, 401, "session_missing")
    assert await report_status(w, rep["reportId"]) == "reported"
