"""Federation over HTTP and PostgreSQL (spec 2.8, 2.9, 4.5, 7; design §9, §12).

* `POST /v1/federation/sync`: a signed `sync_request` of a configured peer is answered with a
  signed `sync_response` that verifies against the request; its pages (order, `maxEntries` and
  its clamp, `hasMore` / `nextSequence` / `headSequence`, tombstones, byte identity with the
  served versions, no replicas). Every refusal with its status, code and `details.reason`, in the
  documented order (envelope 401 → peer 403 → payload 400 → agreement 403 → nonce 401), and a
  refused request never burns its nonce.
* `GET /v1/federation/peers`, `PUT /v1/federation/peers/self`, `GET /v1/admin/federation/peers`.
* Replica reads: `GET /v1/entries/{did}` (and versions, one version, lineage) answer a replica
  with `Registry-Origin`, local entries win, tombstones and local deletions read 404.

The configured peers' endpoints are on 127.0.0.1:9, where nothing listens. Most tests run the
service with the federation leadership withheld (`open_quiet_harness`): its PeerActors never
start, so only the test writes the log and every peer status is what the store holds. The last
tests run live PeerActors: an unreachable peer is a quiet failed pull, and shutting down while an
actor is mid-pull (which fails today, see that test). Replicas are imported the way a PeerActor
stores them: one `peer.status` change through the writer.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import trio
import trio.testing
import trio_asyncio

from registry.breaker import Breaker
from registry.canonical import canonicalize
from registry.changes import Change, LogRecord, rfc3339_ms
from registry.config import Config, PeerConfig
from registry.envelope import build_request, format_timestamp, new_nonce, verify_envelope
from registry.errors import Unauthorized
from registry.federation import (
    PeerState,
    Quarantined,
    SyncAnswerInvalid,
    check_replica,
    read_sync_response,
)
from registry.identity import DidKeyIdentity
from registry.keys import SigningKey, b64url_encode
from registry.store.pg import open_pg_store
from registry.usecases.common import now_ms
from service.wiring import open_service
from tests.api.api_support import JSON, anon_client, create, error_of, updated
from tests.conftest import Harness, make_config, open_harness
from tests.helpers import bearer, entry_created, idem, new_did, sign_in, signed_entry

SYNC = "/v1/federation/sync"
PEERS = "/v1/federation/peers"
SELF = "/v1/federation/peers/self"
STATUS = "/v1/admin/federation/peers"
UNREACHABLE = "http://127.0.0.1:9"  # nothing listens: the harness's PeerActors just fail
WINDOW_MS = 300_000
# Members a peer or status always has; the others are omitted while they have no value
# (spec §2: "Optional fields are omitted from JSON when empty or absent").
PEER_FIELDS = {"peerDid", "endpoint", "agreementIds"}
PEER_OPTIONAL = {"grpcEndpoint", "lastSeen"}
STATUS_FIELDS = {"peerDid", "breakerState", "consecutiveFailures", "cursor", "lag", "quarantines"}
STATUS_OPTIONAL = {"latencyMs", "lastSuccessAt", "nextAttemptAt"}
TOMBSTONE_FIELDS = {"deletedAt", "entryDid", "lifecycleStatus", "sequence"}
AT = "2026-11-02T08:00:00.000Z"


# --- the federation of a test ------------------------------------------------------------------


@dataclass
class Fed:
    """A harness with four configured peers, a non-peer holding `federation`, and an admin."""

    h: Harness
    peer: SigningKey  # sync + discover, agreements alpha and beta
    other: SigningKey  # sync only, agreement default
    lurker: SigningKey  # discover only (no PeerActor: its status is what the store holds)
    bare: SigningKey  # sync, but no agreement at all
    friend: SigningKey  # `federation` through auth.federation_dids, not a configured peer
    admin: SigningKey

    @property
    def registry_did(self) -> str:
        return self.h.deps.registry_did

    def endpoint(self, key: SigningKey) -> str:
        return endpoint_of(key)


def endpoint_of(key: SigningKey) -> str:
    """The configured endpoint of a test peer (unreachable, and distinct per peer)."""
    return f"{UNREACHABLE}/{key.did[-6:]}"


def fed_config(database_url: str, tmp_path: Path, keys: dict[str, SigningKey]) -> Config:
    config = make_config(
        database_url,
        tmp_path,
        auth={"admin_dids": [keys["admin"].did], "federation_dids": [keys["friend"].did]},
    )
    peers = [
        PeerConfig(
            peer_did=keys["peer"].did,
            endpoint=endpoint_of(keys["peer"]),
            agreement_ids=["alpha", "beta"],
            kinds=["sync", "discover"],
        ),
        PeerConfig(
            peer_did=keys["other"].did,
            endpoint=endpoint_of(keys["other"]),
            agreement_ids=["default"],
            kinds=["sync"],
        ),
        PeerConfig(
            peer_did=keys["lurker"].did,
            endpoint=endpoint_of(keys["lurker"]),
            agreement_ids=["default"],
            kinds=["discover"],
        ),
        PeerConfig(
            peer_did=keys["bare"].did,
            endpoint=endpoint_of(keys["bare"]),
            agreement_ids=[],
            kinds=["sync"],
        ),
    ]
    federation = config.federation.model_copy(update={"peers": peers})
    return config.model_copy(update={"federation": federation})


def new_keys() -> dict[str, SigningKey]:
    names = ("peer", "other", "lurker", "bare", "friend", "admin")
    return {name: SigningKey.generate() for name in names}


class _NoPulls:
    """The store, except that the federation leadership is never granted: the service's
    PeerActors wait for it forever, so no pull runs in the background (the test alone writes
    the log, and statuses are what the store holds). Everything else is the store itself."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    @asynccontextmanager
    async def leadership(self, name: str) -> AsyncIterator[Any]:
        if name == "federation":
            await trio.sleep_forever()
        async with self._store.leadership(name) as leadership:
            yield leadership


async def open_quiet_harness(config: Config) -> AsyncIterator[Harness]:
    """`open_harness` with peers configured but no PeerActor pulling."""
    async with (
        trio_asyncio.open_loop(),
        open_pg_store(config.database.url) as store,
        open_service(
            config, _NoPulls(store), key=SigningKey.generate(), identity=DidKeyIdentity()
        ) as service,
        service.app.test_app() as test_app,
    ):
        yield Harness(service, test_app.test_client())


async def with_quiet_harness(config: Config, body: Callable[[Harness], Awaitable[None]]) -> None:
    """`with_harness` over `open_quiet_harness`: a failure of `body` is re-raised only once the
    harness has shut down."""
    failure: Exception | None = None
    async for h in open_quiet_harness(config):
        try:
            await body(h)
        except Exception as exc:
            failure = exc
    if failure is not None:
        raise failure


@pytest.fixture
async def fed(database_url: str, tmp_path: Path) -> AsyncIterator[Fed]:
    keys = new_keys()
    async for h in open_quiet_harness(fed_config(database_url, tmp_path, keys)):
        yield Fed(h, **keys)


@contextmanager
def clock(target: Any, at_ms: int) -> Iterator[None]:
    """The use-case `target` reads `at_ms` as the time, until the block ends."""
    saved: Callable[[], int] = target.clock_ms
    target.clock_ms = lambda: at_ms
    try:
        yield
    finally:
        target.clock_ms = saved


@contextmanager
def case(name: str) -> Iterator[None]:
    """Label a failing assertion with the case of a table it was checking."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"[{name}] {exc}") from exc


# --- envelopes ---------------------------------------------------------------------------------


def sync_request(
    f: Fed,
    key: SigningKey | None = None,
    *,
    payload: dict[str, Any] | None = None,
    at: int | None = None,
    nonce: str | None = None,
    recipient: str | None = None,
) -> dict[str, Any]:
    return build_request(
        key or f.peer,
        kind="sync_request",
        recipient_did=recipient or f.registry_did,
        payload={"fromSequence": 0, "maxEntries": 1} if payload is None else payload,
        now_ms=now_ms() if at is None else at,
        nonce=nonce,
    )


def resigned(envelope: dict[str, Any], key: SigningKey, **members: Any) -> dict[str, Any]:
    """`envelope` with `members` replaced, validly signed again by `key`."""
    unsigned = {k: v for k, v in copy.deepcopy(envelope).items() if k != "signature"}
    unsigned.update(members)
    return {**unsigned, "signature": b64url_encode(key.sign(canonicalize(unsigned)))}


def digest_of(payload: dict[str, Any]) -> str:
    return hashlib.sha256(canonicalize(payload)).hexdigest()


async def post_sync(f: Fed | Harness, body: Any) -> Any:
    h = f.h if isinstance(f, Fed) else f
    client = anon_client(h)
    if isinstance(body, bytes):
        return await client.post(SYNC, data=body, headers=JSON)
    return await client.post(SYNC, json=body)


async def refused(
    f: Fed, body: Any, status: int, code: str, reason: str | None = None
) -> dict[str, Any]:
    error = await error_of(await post_sync(f, body), status, code)
    if reason is not None:
        assert error["details"]["reason"] == reason, error
    return error


@dataclass
class Page:
    request: dict[str, Any]
    response: dict[str, Any]
    raw: str

    @property
    def payload(self) -> dict[str, Any]:
        return dict(self.response["payload"])

    @property
    def entries(self) -> list[dict[str, Any]]:
        return list(self.response["payload"]["entries"])

    @property
    def seqs(self) -> list[int]:
        return [e["sequence"] for e in self.entries]


async def answered(f: Fed | Harness, request: dict[str, Any], peer: SigningKey) -> Page:
    """POST `request`; assert 200 with a sync_response signed by this registry, bound to it."""
    h = f.h if isinstance(f, Fed) else f
    r = await post_sync(h, request)
    raw = (await r.get_data()).decode("utf-8")
    assert r.status_code == 200, raw
    assert r.headers["Content-Type"].startswith("application/json")
    response = json.loads(raw)
    assert raw == canonicalize(response).decode("utf-8")  # JCS on the wire
    verified = verify_envelope(
        response,
        recipient_did=peer.did,
        now_ms=now_ms(),
        expected_kind="sync_response",
        request=request,
    )
    assert verified.sender_did == h.deps.registry_did
    assert response["keyId"].split("#", 1)[0] == h.deps.registry_did
    assert response["recipientDid"] == peer.did
    assert response["requestDigest"] == digest_of(request)  # JCS of the complete request
    assert response["nonce"] != request["nonce"]
    payload = verified.payload
    assert set(payload) == {"entries", "hasMore", "headSequence", "nextSequence"}
    return Page(request, response, raw)


async def sync(
    f: Fed, key: SigningKey | None = None, *, from_seq: int, max_entries: int, **extra: Any
) -> Page:
    key = key or f.peer
    payload = {"fromSequence": from_seq, "maxEntries": max_entries, **extra}
    page = await answered(f, sync_request(f, key, payload=payload), key)
    check_page(page, from_seq, max_entries)
    read_sync_response(page.payload, from_seq)  # what a PeerActor accepts
    return page


def check_page(page: Page, from_seq: int, max_entries: int) -> None:
    """The invariants of every page a puller relies on."""
    p = page.payload
    seqs = page.seqs
    assert seqs == sorted(set(seqs)), seqs  # strictly ascending
    assert all(s > from_seq for s in seqs)  # fromSequence is exclusive
    assert len(seqs) <= min(max_entries, 1000)
    assert p["nextSequence"] >= from_seq
    assert p["headSequence"] >= p["nextSequence"]
    if p["hasMore"]:
        assert seqs
        assert p["nextSequence"] == seqs[-1]  # resume right after the last entry served
    else:
        assert p["nextSequence"] == p["headSequence"]  # caught up: nothing up to the head left
        assert not seqs or seqs[-1] <= p["nextSequence"]


async def follow(f: Fed, from_seq: int, max_entries: int) -> list[Page]:
    """Every page from `from_seq`, each asked from the previous page's nextSequence."""
    pages = [await sync(f, from_seq=from_seq, max_entries=max_entries)]
    while pages[-1].payload["hasMore"]:
        assert len(pages) < 100
        pages.append(
            await sync(f, from_seq=pages[-1].payload["nextSequence"], max_entries=max_entries)
        )
    return pages


async def nonce_kept(h: Harness, sender: str, nonce: str) -> int | None:
    """The expiry (ms) under which the registry keeps (sender, nonce) as used, else None."""

    async def query() -> Any:
        conn = await asyncpg.connect(h.config.database.url)
        try:
            return await conn.fetchval(
                "SELECT expires_ms FROM federation_nonces WHERE sender_did = $1 AND nonce = $2",
                sender,
                nonce,
            )
        finally:
            await conn.close()

    value = await trio_asyncio.aio_as_trio(query)()
    return None if value is None else int(value)


# --- entries and replicas ----------------------------------------------------------------------


async def publisher(h: Harness) -> tuple[SigningKey, str]:
    key = SigningKey.generate()
    return key, await sign_in(anon_client(h), key)


async def delete(h: Harness, token: str, did: str) -> dict[str, Any]:
    r = await anon_client(h).delete(f"/v1/entries/{did}", headers=bearer(token, **idem()))
    assert r.status_code == 200, await r.get_data()
    return dict(await r.get_json())


def origin_version(key: SigningKey, did: str, seq: int, **fields: Any) -> dict[str, Any]:
    """An entry version as its origin registry serves it (signed, with the managed fields)."""
    entry = signed_entry(key, did, **fields)
    entry["signature"]["created"] = AT
    entry.update(sequence=seq, anchorState="unanchored", updatedAt=AT)
    return entry


def origin_tombstone(did: str, seq: int) -> dict[str, Any]:
    return {"deletedAt": AT, "entryDid": did, "lifecycleStatus": "deleted", "sequence": seq}


def jcs(doc: dict[str, Any]) -> str:
    return canonicalize(doc).decode("utf-8")


async def import_from(
    h: Harness,
    origin: str,
    docs: list[dict[str, Any]],
    *,
    quarantined: list[Quarantined] | None = None,
    state: PeerState | None = None,
) -> int:
    """Store what a PeerActor pulled from `origin`: one `peer.status` change (compare-and-set
    on the origin's cursor), as `actors/federation.py` writes it. Returns its log position."""
    row = await h.store.get_peer(origin)
    expected = 0 if row is None else row.cursor
    replicas = [check_replica(d) for d in docs]
    quarantined = quarantined or []
    cursor = max([expected, *(r.seq for r in replicas), *(q.seq for q in quarantined)])
    state = state or PeerState(origin, cursor=cursor, head=cursor)
    change = Change(
        "peer.status",
        None,
        {
            "peerDid": origin,
            "expectedCursor": expected,
            "cursor": state.cursor,
            "status": state.to_stored(),
            "replicas": [r.row() for r in replicas],
            "quarantined": [q.row() for q in quarantined],
        },
        event=state.status_json(now_ms()),
    )
    outcome = await h.service.writer.append(change, None)
    assert outcome.refusal is None, outcome.refusal
    assert outcome.sequence is not None
    return outcome.sequence


async def get(h: Harness, path: str, **headers: str) -> Any:
    return await anon_client(h).get(path, headers=headers)


async def body_text(r: Any) -> str:
    return (await r.get_data()).decode("utf-8")


# === POST /v1/federation/sync: answers ==========================================================


async def test_sync_answers_a_configured_peer_with_a_signed_response_bound_to_its_request(
    fed: Fed,
) -> None:
    f = fed
    key, token = await publisher(f.h)
    before = await f.h.store.log_head()
    served = await create(f.h, key, token)
    page = await sync(f, from_seq=before, max_entries=10)
    assert page.response["kind"] == "sync_response"
    assert page.response["version"] == "1"
    assert page.response["algorithm"] == "Ed25519"
    assert page.response["senderDid"] == f.registry_did
    assert page.entries == [served]
    assert page.payload["hasMore"] is False
    # The response answers exactly this request: against another one it does not verify.
    other = sync_request(f, payload={"fromSequence": before, "maxEntries": 10})
    with pytest.raises(Unauthorized) as refusal:
        verify_envelope(
            page.response,
            recipient_did=f.peer.did,
            now_ms=now_ms(),
            expected_kind="sync_response",
            request=other,
        )
    assert refusal.value.code == "envelope_digest_mismatch"
    # The nonce is kept durably at least for the whole timestamp window.
    verified = verify_envelope(
        page.request, recipient_did=f.registry_did, now_ms=now_ms(), expected_kind="sync_request"
    )
    expires = await nonce_kept(f.h, f.peer.did, page.request["nonce"])
    assert expires is not None
    assert expires > verified.timestamp_ms + WINDOW_MS


async def test_sync_accepts_an_agreement_of_the_peer_or_none_when_it_has_one(fed: Fed) -> None:
    f = fed
    head = await f.h.store.log_head()
    for extra in ({}, {"agreementId": "alpha"}, {"agreementId": "beta"}):
        page = await sync(f, from_seq=head, max_entries=1, **extra)
        assert page.entries == []
    page = await sync(f, f.other, from_seq=head, max_entries=1, agreementId="default")
    assert page.entries == []


async def test_sync_pages_in_ascending_sequence_without_gap_or_duplicate(fed: Fed) -> None:
    f = fed
    key, token = await publisher(f.h)
    before = await f.h.store.log_head()
    a = await create(f.h, key, token, name="agent a")
    b = await create(f.h, key, token, name="agent b")
    c = await create(f.h, key, token, name="agent c")
    a2 = await updated(f.h, key, token, a["entryDid"], a["sequence"], name="agent a, v2")
    gone = await delete(f.h, token, b["entryDid"])
    expected = [a["sequence"], b["sequence"], c["sequence"], a2["sequence"], gone["sequence"]]
    assert expected == sorted(expected)

    pages = await follow(f, before, 2)
    assert [p.seqs for p in pages] == [expected[0:2], expected[2:4], expected[4:]]
    assert [p.payload["hasMore"] for p in pages] == [True, True, False]
    for previous, page in itertools.pairwise(pages):
        assert page.request["payload"]["fromSequence"] == previous.payload["nextSequence"]
    last = pages[-1].payload
    assert last["nextSequence"] >= gone["sequence"]
    served = [e for p in pages for e in p.entries]
    assert served[:4] == [a, b, c, a2]

    # One page as large as all of them is the same list.
    whole = await sync(f, from_seq=before, max_entries=1000)
    assert whole.entries == served
    assert whole.payload["hasMore"] is False

    # From the middle: exclusive of fromSequence.
    middle = await sync(f, from_seq=b["sequence"], max_entries=1000)
    assert middle.seqs == expected[2:]

    # Caught up: nothing more, and nextSequence never goes back.
    rest = await sync(f, from_seq=last["nextSequence"], max_entries=1000)
    assert rest.entries == []
    assert rest.payload["hasMore"] is False
    assert rest.payload["nextSequence"] >= last["nextSequence"]

    # Beyond the head (a puller whose origin went back, e.g. restored from an older backup):
    # nothing, nextSequence is not below what was asked, and headSequence is the real head,
    # so the puller refuses the page (a failure an operator sees) instead of waiting silently.
    beyond = last["headSequence"] + 1000
    request = sync_request(f, payload={"fromSequence": beyond, "maxEntries": 5})
    far = (await answered(f, request, f.peer)).payload
    assert far["entries"] == []
    assert far["hasMore"] is False
    assert far["nextSequence"] >= beyond
    assert far["headSequence"] == last["headSequence"]
    with pytest.raises(SyncAnswerInvalid):
        read_sync_response(far, beyond)


async def test_sync_serves_the_tombstone_of_a_deleted_entry(fed: Fed) -> None:
    f = fed
    key, token = await publisher(f.h)
    entry = await create(f.h, key, token)
    before = await f.h.store.log_head()
    gone = await delete(f.h, token, entry["entryDid"])
    page = await sync(f, from_seq=before, max_entries=10)
    assert len(page.entries) == 1
    tombstone = page.entries[0]
    assert set(tombstone) == TOMBSTONE_FIELDS
    assert tombstone["entryDid"] == entry["entryDid"]
    assert tombstone["lifecycleStatus"] == "deleted"
    assert tombstone["sequence"] == gone["sequence"]
    assert isinstance(tombstone["deletedAt"], str)
    # A puller can import it as the origin's tombstone.
    assert check_replica(tombstone).lifecycle == "deleted"


async def test_sync_entries_are_byte_identical_to_the_served_versions(fed: Fed) -> None:
    f = fed
    key, token = await publisher(f.h)
    before = await f.h.store.log_head()
    a = await create(f.h, key, token, description="é ü 漢字 \u2028 emoji 😀", tags=["b", "a"])
    a2 = await updated(
        f.h, key, token, a["entryDid"], a["sequence"], itemData={"n": 1.5, "z": [1e21, -0.0]}
    )
    c = await create(f.h, key, token, customMetadata={"z": 1, "a": {"y": None, "b": True}})
    page = await sync(f, from_seq=before, max_entries=100)
    assert page.seqs == [a["sequence"], a2["sequence"], c["sequence"]]
    for entry in page.entries:
        r = await get(f.h, f"/v1/entries/{entry['entryDid']}/versions/{entry['sequence']}")
        text = await body_text(r)
        assert r.status_code == 200, text
        assert jcs(entry) == text  # the same bytes, in JCS
        assert text in page.raw  # verbatim inside the signed response
        check_replica(entry)  # and a puller verifies it (hash, publisher signature)


async def test_sync_clamps_max_entries_at_1000(fed: Fed) -> None:
    f = fed
    before = await f.h.store.log_head()
    changes = [entry_created(entry_type="FederationClampStub") for _ in range(1001)]
    outcomes = await f.h.store.append([(c, None) for c in changes])
    seqs = [o.sequence for o in outcomes]
    assert all(o.refusal is None for o in outcomes)

    for asked in (1001, 5000, 2**53 - 1):
        page = await sync(f, from_seq=before, max_entries=asked)
        assert page.seqs == seqs[:1000]
        assert page.payload["hasMore"] is True
        assert page.payload["nextSequence"] == seqs[999]
    page = await sync(f, from_seq=before, max_entries=1000)
    assert page.seqs == seqs[:1000]
    rest = await sync(f, from_seq=page.payload["nextSequence"], max_entries=1000)
    assert rest.seqs == seqs[1000:]
    assert rest.payload["hasMore"] is False


async def test_sync_never_serves_replicas(fed: Fed) -> None:
    f = fed
    key, token = await publisher(f.h)
    before = await f.h.store.log_head()
    origin = SigningKey.generate().did
    did = new_did()
    pulled = await import_from(f.h, origin, [origin_version(key, did, 7)])
    local = await create(f.h, key, token)
    assert (await get(f.h, f"/v1/entries/{did}")).status_code == 200  # the replica is readable
    page = await sync(f, from_seq=before, max_entries=1000)
    assert page.entries == [local]
    assert page.payload["nextSequence"] > pulled  # the pull's position is passed, not served


async def test_sync_pages_stay_about_the_body_limit_and_the_limit_is_admitted_exactly(
    database_url: str, tmp_path: Path
) -> None:
    keys = new_keys()
    base = fed_config(database_url, tmp_path, keys)
    limit = 1024
    config = base.model_copy(
        update={"limits": base.limits.model_copy(update={"federation_body_bytes": limit})}
    )

    async def body(h: Harness) -> None:
        f = Fed(h, **keys)
        key, token = await publisher(h)
        before = await h.store.log_head()
        made = [await create(h, key, token, description="x" * 700) for _ in range(3)]
        assert all(len(jcs(e)) > limit for e in made)
        # Each document alone is over the budget: one per page, however many were asked.
        pages = await follow(f, before, 100)
        assert [p.entries for p in pages] == [[e] for e in made]

        # The body limit itself: exactly `limit` bytes is admitted, one more is 413.
        request = sync_request(f, payload={"fromSequence": before, "maxEntries": 1})
        text = json.dumps(request, separators=(",", ":")).encode()
        assert len(text) < limit
        padded = text + b" " * (limit - len(text))
        r = await post_sync(h, padded)
        assert r.status_code == 200, await r.get_data()
        again = sync_request(f, payload={"fromSequence": before, "maxEntries": 1})
        text = json.dumps(again, separators=(",", ":")).encode()
        error = await error_of(
            await post_sync(h, text + b" " * (limit + 1 - len(text))), 413, "body_too_large"
        )
        assert error["details"]["limitBytes"] == limit
        # Not even read: the nonce of the refused body is still unused.
        assert await nonce_kept(h, f.peer.did, again["nonce"]) is None
        await answered(h, again, f.peer)

    await with_quiet_harness(config, body)


async def test_sync_over_the_default_body_limit_is_413(fed: Fed) -> None:
    limit = fed.h.config.limits.federation_body_bytes
    assert limit == 4 * 1024 * 1024
    request = sync_request(fed)
    text = json.dumps(request, separators=(",", ":")).encode()
    error = await error_of(
        await post_sync(fed, text + b" " * (limit + 1 - len(text))), 413, "body_too_large"
    )
    assert error["details"]["limitBytes"] == limit
    await answered(fed, request, fed.peer)  # and the nonce was not burnt


# === POST /v1/federation/sync: refusals =========================================================


def _flip(text: str) -> str:
    return ("B" if text[0] == "A" else "A") + text[1:]


# (name, how the request is tampered without re-signing, code, reason)
TAMPERED: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]], str, str]] = [
    (
        "signature",
        lambda e: {**e, "signature": _flip(e["signature"])},
        "envelope_signature_invalid",
        "signature_mismatch",
    ),
    (
        "signature-not-base64url",
        lambda e: {**e, "signature": e["signature"][:-2] + "=="},
        "envelope_signature_invalid",
        "signature_not_base64url",
    ),
    (
        "signature-truncated",
        lambda e: {**e, "signature": e["signature"][:40]},
        "envelope_signature_invalid",
        "signature_mismatch",
    ),
    (
        "timestamp",
        lambda e: {**e, "timestamp": format_timestamp(now_ms() - 1000)},
        "envelope_signature_invalid",
        "signature_mismatch",
    ),
    (
        "nonce",
        lambda e: {**e, "nonce": new_nonce()},
        "envelope_signature_invalid",
        "signature_mismatch",
    ),
    (
        "payload",
        lambda e: {**e, "payload": {**e["payload"], "maxEntries": 2}},
        "envelope_digest_mismatch",
        "digest_mismatch",
    ),
    (
        "payload-and-digest",
        lambda e: {
            **e,
            "payload": {**e["payload"], "maxEntries": 2},
            "requestDigest": digest_of({**e["payload"], "maxEntries": 2}),
        },
        "envelope_signature_invalid",
        "signature_mismatch",
    ),
    (
        "requestDigest",
        lambda e: {**e, "requestDigest": "0" * 64},
        "envelope_digest_mismatch",
        "digest_mismatch",
    ),
    (
        "version",
        lambda e: {**e, "version": "2"},
        "envelope_version_unsupported",
        "version_unsupported",
    ),
    (
        "algorithm",
        lambda e: {**e, "algorithm": "ES256"},
        "envelope_algorithm_unsupported",
        "algorithm_unsupported",
    ),
    (
        "kind",
        lambda e: {**e, "kind": "discover_request"},
        "envelope_kind_unexpected",
        "kind_unexpected",
    ),
    (
        "kind-response",
        lambda e: {**e, "kind": "sync_response"},
        "envelope_kind_unexpected",
        "kind_unexpected",
    ),
    (
        "senderDid",
        lambda e: {**e, "senderDid": SigningKey.generate().did},
        "envelope_controller_mismatch",
        "controller_not_sender",
    ),
    (
        "keyId-not-did-key",
        lambda e: {**e, "keyId": e["senderDid"]},
        "envelope_controller_mismatch",
        "key_id_not_did_key",
    ),
    (
        "recipientDid",
        lambda e: {**e, "recipientDid": SigningKey.generate().did},
        "envelope_wrong_recipient",
        "wrong_recipient",
    ),
    (
        "nonce-too-short",
        lambda e: {**e, "nonce": b64url_encode(b"x" * 8)},
        "envelope_nonce_invalid",
        "nonce_too_short",
    ),
    (
        "nonce-padded",
        lambda e: {**e, "nonce": e["nonce"] + "=="},
        "envelope_nonce_invalid",
        "nonce_not_base64url",
    ),
    (
        "timestamp-not-rfc3339",
        lambda e: {**e, "timestamp": "yesterday"},
        "envelope_timestamp_invalid",
        "timestamp_not_rfc3339",
    ),
    (
        "extra-member",
        lambda e: {**e, "hint": "x"},
        "envelope_invalid",
        "unknown_members",
    ),
    (
        "missing-signature",
        lambda e: {k: v for k, v in e.items() if k != "signature"},
        "envelope_invalid",
        "missing_members",
    ),
    (
        "missing-payload",
        lambda e: {k: v for k, v in e.items() if k != "payload"},
        "envelope_invalid",
        "missing_members",
    ),
    (
        "nonce-not-a-string",
        lambda e: {**e, "nonce": 12345},
        "envelope_invalid",
        "wrong_type",
    ),
    (
        "payload-not-an-object",
        lambda e: {**e, "payload": [e["payload"]]},
        "envelope_invalid",
        "wrong_type",
    ),
]


async def test_a_tampered_envelope_is_401_with_its_code_and_burns_no_nonce(fed: Fed) -> None:
    for name, tamper, code, reason in TAMPERED:
        with case(name):
            request = sync_request(fed)
            await refused(fed, tamper(copy.deepcopy(request)), 401, code, reason)
            assert await nonce_kept(fed.h, fed.peer.did, request["nonce"]) is None
            await answered(fed, request, fed.peer)  # the genuine one, same nonce, still works


# (name, members changed and validly signed again by the peer, code, reason)
RESIGNED: list[tuple[str, dict[str, Any], str, str]] = [
    ("version", {"version": "2"}, "envelope_version_unsupported", "version_unsupported"),
    (
        "algorithm",
        {"algorithm": "EdDSA"},
        "envelope_algorithm_unsupported",
        "algorithm_unsupported",
    ),
    ("kind", {"kind": "discover_request"}, "envelope_kind_unexpected", "kind_unexpected"),
    ("unknown-kind", {"kind": "gossip"}, "envelope_kind_unexpected", "kind_unexpected"),
    ("recipient", {"recipientDid": "did:key:z6Mkw"}, "envelope_wrong_recipient", "wrong_recipient"),
]


async def test_a_validly_signed_but_unacceptable_envelope_is_401(fed: Fed) -> None:
    for name, members, code, reason in RESIGNED:
        with case(name):
            request = sync_request(fed)
            await refused(fed, resigned(request, fed.peer, **members), 401, code, reason)
            await answered(fed, request, fed.peer)


async def test_a_request_for_another_registry_is_401_wrong_recipient(fed: Fed) -> None:
    elsewhere = SigningKey.generate().did
    request = sync_request(fed, recipient=elsewhere)
    await refused(fed, request, 401, "envelope_wrong_recipient", "wrong_recipient")
    assert await nonce_kept(fed.h, fed.peer.did, request["nonce"]) is None


async def test_a_key_not_controlled_by_the_sender_is_401_controller_mismatch(fed: Fed) -> None:
    f = fed
    mallory = SigningKey.generate()
    # Mallory names the peer as sender but signs with her own key (and says so in keyId).
    claimed = resigned(sync_request(f, mallory), mallory, senderDid=f.peer.did)
    await refused(f, claimed, 401, "envelope_controller_mismatch", "controller_not_sender")
    # With the peer's key id but her signature: the signature does not verify.
    forged = resigned(sync_request(f, mallory), mallory, senderDid=f.peer.did, keyId=f.peer.key_id)
    await refused(f, forged, 401, "envelope_signature_invalid", "signature_mismatch")
    assert await nonce_kept(f.h, f.peer.did, forged["nonce"]) is None


async def test_the_timestamp_window_is_300_seconds_either_way(fed: Fed) -> None:
    now = now_ms()
    cases = [
        (-WINDOW_MS, None),
        (-WINDOW_MS - 1, "envelope_stale"),
        (-10 * WINDOW_MS, "envelope_stale"),
        (WINDOW_MS, None),
        (WINDOW_MS + 1, "envelope_from_future"),
        (10 * WINDOW_MS, "envelope_from_future"),
    ]
    with clock(fed.h.deps.federation, now):
        for offset_ms, code in cases:
            with case(f"{offset_ms:+d} ms"):
                request = sync_request(fed, at=now + offset_ms)
                if code is None:
                    await answered(fed, request, fed.peer)
                    continue
                reason = "timestamp_too_old" if code == "envelope_stale" else "timestamp_in_future"
                await refused(fed, request, 401, code, reason)
                assert await nonce_kept(fed.h, fed.peer.did, request["nonce"]) is None
                # The same nonce in a fresh envelope is accepted.
                fresh = sync_request(fed, at=now, nonce=request["nonce"])
                await answered(fed, fresh, fed.peer)


async def test_a_replayed_envelope_is_401_nonce_replayed_after_the_first_succeeded(
    fed: Fed,
) -> None:
    f = fed
    request = sync_request(f)
    await answered(f, request, f.peer)
    await refused(f, request, 401, "envelope_nonce_replayed", "nonce_replayed")
    await refused(f, request, 401, "envelope_nonce_replayed", "nonce_replayed")
    # A new, validly signed request reusing the nonce is a replay too.
    reuse = sync_request(f, payload={"fromSequence": 1, "maxEntries": 5}, nonce=request["nonce"])
    await refused(f, reuse, 401, "envelope_nonce_replayed", "nonce_replayed")
    # Nonces are single use per sender: another peer may happen to pick the same one.
    theirs = sync_request(f, f.other, nonce=request["nonce"])
    await answered(f, theirs, f.other)


async def test_a_missing_or_unreadable_envelope_is_401(fed: Fed) -> None:
    cases = [
        (b"", "not_json"),
        (b"not json at all", "not_json"),
        (b'{"version": "1",', "not_json"),
        (b'{"a": 1, "a": 2}', "not_json"),
        (b"[]", "not_an_object"),
        (b"null", "not_an_object"),
        (b'"envelope"', "not_an_object"),
        (b"{}", "missing_members"),
    ]
    for body, reason in cases:
        with case(repr(body)):
            await refused(fed, body, 401, "envelope_invalid", reason)


async def test_an_unknown_sender_with_a_valid_signature_is_403_peer_unknown(fed: Fed) -> None:
    f = fed
    stranger = SigningKey.generate()
    request = sync_request(f, stranger)
    error = await refused(f, request, 403, "peer_unknown")
    assert error["details"]["peerDid"] == stranger.did
    assert await nonce_kept(f.h, stranger.did, request["nonce"]) is None
    # The peer check comes before the payload's: a bad payload of a stranger is still 403.
    bad = sync_request(f, stranger, payload={"fromSequence": -1, "maxEntries": 1})
    await refused(f, bad, 403, "peer_unknown")
    # The envelope's checks come first: a stale envelope of a stranger is 401.
    stale = sync_request(f, stranger, at=now_ms() - 2 * WINDOW_MS)
    await refused(f, stale, 401, "envelope_stale", "timestamp_too_old")


async def test_a_peer_without_the_sync_kind_is_403_peer_capability_missing(fed: Fed) -> None:
    f = fed
    request = sync_request(f, f.lurker)
    error = await refused(f, request, 403, "peer_capability_missing")
    assert error["details"]["peerDid"] == f.lurker.did
    assert error["details"]["capability"] == "sync"
    assert await nonce_kept(f.h, f.lurker.did, request["nonce"]) is None


async def test_an_agreement_not_among_the_peers_is_403_and_burns_no_nonce(fed: Fed) -> None:
    f = fed
    payload = {"fromSequence": 0, "maxEntries": 1}
    request = sync_request(f, payload={**payload, "agreementId": "default"})
    # Another peer's agreement is not this peer's.
    error = await refused(f, request, 403, "agreement_unknown")
    assert error["details"]["peerDid"] == f.peer.did
    assert await nonce_kept(f.h, f.peer.did, request["nonce"]) is None
    corrected = sync_request(f, payload={**payload, "agreementId": "alpha"}, nonce=request["nonce"])
    await answered(f, corrected, f.peer)


async def test_a_peer_with_no_agreement_is_403_agreement_unknown(fed: Fed) -> None:
    f = fed
    for extra in ({}, {"agreementId": "default"}, {"agreementId": "alpha"}):
        request = sync_request(f, f.bare, payload={"fromSequence": 0, "maxEntries": 1, **extra})
        error = await refused(f, request, 403, "agreement_unknown")
        assert error["details"]["peerDid"] == f.bare.did
        assert await nonce_kept(f.h, f.bare.did, request["nonce"]) is None


async def test_a_malformed_agreement_id_is_400_for_discover_as_for_sync(fed: Fed) -> None:
    # docs/federation.md: discover runs the checks of sync. An empty or overlong id is a
    # malformed request (400), not an agreement this registry does not know (403).
    f = fed
    for agreement in ("", "a" * 256):
        sync = sync_request(
            f, payload={"fromSequence": 0, "maxEntries": 1, "agreementId": agreement}
        )
        assert (await refused(f, sync, 400, "sync_request_invalid"))["details"]["field"] == (
            "agreementId"
        )
        discover = build_request(
            f.peer,
            kind="discover_request",
            recipient_did=f.registry_did,
            payload={"query": {"entryType": "*"}, "agreementId": agreement},
            now_ms=now_ms(),
        )
        r = await anon_client(f.h).post("/v1/federation/discover", json=discover)
        error = await error_of(r, 400, "discover_request_invalid")
        assert error["details"]["field"] == "agreementId"


# (name, payload, reason)
BAD_PAYLOADS: list[tuple[str, dict[str, Any], str]] = [
    ("negative-from", {"fromSequence": -1, "maxEntries": 1}, "out_of_range"),
    ("zero-max", {"fromSequence": 0, "maxEntries": 0}, "out_of_range"),
    ("negative-max", {"fromSequence": 0, "maxEntries": -5}, "out_of_range"),
    ("extra-member", {"fromSequence": 0, "maxEntries": 1, "kinds": ["x"]}, "unknown_members"),
    ("missing-max", {"fromSequence": 0}, "missing_members"),
    ("missing-from", {"maxEntries": 1}, "missing_members"),
    ("empty", {}, "missing_members"),
    ("from-string", {"fromSequence": "0", "maxEntries": 1}, "wrong_type"),
    ("from-boolean", {"fromSequence": False, "maxEntries": 1}, "wrong_type"),
    ("max-fraction", {"fromSequence": 0, "maxEntries": 1.5}, "wrong_type"),
    ("max-null", {"fromSequence": 0, "maxEntries": None}, "wrong_type"),
    ("agreement-empty", {"fromSequence": 0, "maxEntries": 1, "agreementId": ""}, "wrong_type"),
    ("agreement-number", {"fromSequence": 0, "maxEntries": 1, "agreementId": 7}, "wrong_type"),
]


async def test_a_malformed_payload_is_400_sync_request_invalid_and_burns_no_nonce(
    fed: Fed,
) -> None:
    f = fed
    for name, payload, reason in BAD_PAYLOADS:
        with case(name):
            request = sync_request(f, payload=payload)
            await refused(f, request, 400, "sync_request_invalid", reason)
            assert await nonce_kept(f.h, f.peer.did, request["nonce"]) is None
            corrected = sync_request(f, nonce=request["nonce"])
            await answered(f, corrected, f.peer)


# === GET /v1/federation/peers ===================================================================


def configured_peer(f: Fed, key: SigningKey, agreements: list[str]) -> dict[str, Any]:
    return {
        "peerDid": key.did,
        "endpoint": f.endpoint(key),
        "agreementIds": agreements,
    }


async def test_peers_lists_every_configured_peer_anonymously_in_peer_did_order(fed: Fed) -> None:
    f = fed
    r = await get(f.h, PEERS)
    assert r.status_code == 200, await r.get_data()
    peers = await r.get_json()
    expected = sorted(
        [
            configured_peer(f, f.peer, ["alpha", "beta"]),
            configured_peer(f, f.other, ["default"]),
            configured_peer(f, f.lurker, ["default"]),
            configured_peer(f, f.bare, []),
        ],
        key=lambda p: p["peerDid"],
    )
    assert peers == expected
    assert all(PEER_FIELDS <= set(p) <= PEER_FIELDS | PEER_OPTIONAL for p in peers)
    assert f.friend.did not in {p["peerDid"] for p in peers}  # a capability is not a peer


async def test_peers_list_is_empty_without_configured_peers(harness: Harness) -> None:
    r = await get(harness, PEERS)
    assert r.status_code == 200
    assert await r.get_json() == []


# === PUT /v1/federation/peers/self ==============================================================


async def put_self(f: Fed, token: str | None, body: Any, *, key: str | None = None) -> Any:
    headers: dict[str, str] = {}
    if key is not None:
        headers["Idempotency-Key"] = key
    if token is not None:
        headers = bearer(token, **headers)
    return await anon_client(f.h).put(SELF, json=body, headers=headers)


async def peer_listed(f: Fed, did: str) -> dict[str, Any]:
    r = await get(f.h, PEERS)
    assert r.status_code == 200
    (peer,) = [p for p in await r.get_json() if p["peerDid"] == did]
    return dict(peer)


async def test_update_self_needs_a_session(fed: Fed) -> None:
    r = await put_self(fed, None, {"endpoint": "https://peer.example.com:8443"}, key="k1")
    await error_of(r, 401, "session_missing")
    r = await put_self(fed, "not-a-token", {"endpoint": "https://peer.example.com:8443"}, key="k1")
    await error_of(r, 401, "session_invalid")


async def test_update_self_needs_the_federation_capability_of_a_configured_peer(
    fed: Fed,
) -> None:
    f = fed
    nobody = SigningKey.generate()
    r = await put_self(
        f, await sign_in(anon_client(f.h), nobody), {"endpoint": UNREACHABLE}, key="a"
    )
    error = await error_of(r, 403, "capability_missing")
    assert error["details"]["capability"] == "federation"
    # An admin is not a peer either.
    r = await put_self(
        f, await sign_in(anon_client(f.h), f.admin), {"endpoint": UNREACHABLE}, key="b"
    )
    await error_of(r, 403, "capability_missing")
    # The capability alone (auth.federation_dids) does not make a configured peer.
    r = await put_self(
        f, await sign_in(anon_client(f.h), f.friend), {"endpoint": UNREACHABLE}, key="c"
    )
    error = await error_of(r, 403, "peer_unknown")
    assert error["details"]["peerDid"] == f.friend.did
    assert f.friend.did not in {p["peerDid"] for p in await (await get(f.h, PEERS)).get_json()}


async def test_update_self_needs_an_idempotency_key(fed: Fed) -> None:
    f = fed
    token = await sign_in(anon_client(f.h), f.peer)
    r = await put_self(f, token, {"endpoint": "https://peer.example.com:8443"})
    await error_of(r, 400, "idempotency_key_required")
    assert (await peer_listed(f, f.peer.did))["endpoint"] == f.endpoint(f.peer)


async def test_a_peer_updates_its_endpoint_and_the_list_shows_it(fed: Fed) -> None:
    f = fed
    token = await sign_in(anon_client(f.h), f.peer)
    before = await f.h.store.log_head()
    started = now_ms()
    body = {
        "endpoint": "https://peer.example.com:8443/registry",
        "grpcEndpoint": "https://grpc.example.com:7",
    }
    r = await put_self(f, token, body, key="move-1")
    raw = await r.get_data()
    assert r.status_code == 200, raw
    assert "Idempotent-Replayed" not in r.headers
    peer = json.loads(raw)
    assert set(peer) == PEER_FIELDS | PEER_OPTIONAL
    assert peer["peerDid"] == f.peer.did
    assert peer["endpoint"] == body["endpoint"]
    assert peer["grpcEndpoint"] == body["grpcEndpoint"]
    assert peer["agreementIds"] == ["alpha", "beta"]
    seen = peer["lastSeen"]
    assert rfc3339_ms(started - 1000) <= seen <= rfc3339_ms(now_ms() + 1000)
    assert await peer_listed(f, f.peer.did) == peer
    # The other peers are untouched.
    assert (await peer_listed(f, f.other.did))["endpoint"] == f.endpoint(f.other)

    # The same key and body: the same answer again, marked replayed, and no second change.
    r = await put_self(f, token, body, key="move-1")
    assert r.status_code == 200
    assert r.headers.get("Idempotent-Replayed") == "true"
    assert await r.get_data() == raw
    # The same key with another body: 409, nothing changed.
    r = await put_self(f, token, {"endpoint": "https://peer.example.com:9443"}, key="move-1")
    await error_of(r, 409, "idempotency_conflict")
    assert await peer_listed(f, f.peer.did) == peer
    kinds = [rec.kind for rec in await f.h.store.log_after(before, 1000)]
    assert kinds.count("peer.updated") == 1

    # A new key moves it again; without grpcEndpoint it is cleared.
    r = await put_self(f, token, {"endpoint": "https://peer.example.com:10"}, key="move-2")
    assert r.status_code == 200, await r.get_data()
    moved = await r.get_json()
    assert moved["endpoint"] == "https://peer.example.com:10"
    assert "grpcEndpoint" not in moved
    assert await peer_listed(f, f.peer.did) == moved


async def test_a_discover_only_peer_may_register_its_endpoint_too(fed: Fed) -> None:
    f = fed
    token = await sign_in(anon_client(f.h), f.lurker)
    endpoint = "https://peer.example.com:8443/" + "p" * (
        2048 - len("https://peer.example.com:8443/")
    )
    assert len(endpoint) == 2048  # the longest admitted
    r = await put_self(f, token, {"endpoint": endpoint}, key="long")
    assert r.status_code == 200, await r.get_data()
    assert (await peer_listed(f, f.lurker.did))["endpoint"] == endpoint


# (name, body, field named in details or None)
BAD_ENDPOINTS: list[tuple[str, Any, str | None]] = [
    ("ftp", {"endpoint": "ftp://127.0.0.1/"}, "endpoint"),
    ("no-scheme", {"endpoint": "127.0.0.1:8080"}, "endpoint"),
    ("javascript", {"endpoint": "javascript:alert(1)"}, "endpoint"),
    ("scheme-only", {"endpoint": "https://"}, "endpoint"),
    ("empty", {"endpoint": ""}, "endpoint"),
    ("too-long", {"endpoint": "https://peer.example.com/" + "p" * 2031}, "endpoint"),
    ("space", {"endpoint": "https://peer.example.com/a b"}, "endpoint"),
    ("newline", {"endpoint": "https://peer.example.com/\nHost: evil"}, "endpoint"),
    ("control", {"endpoint": "https://peer.example.com/\x01"}, "endpoint"),
    ("delete", {"endpoint": "https://peer.example.com/\x7f"}, "endpoint"),
    ("tab", {"endpoint": "https://peer.example.com/\t"}, "endpoint"),
    ("number", {"endpoint": 8080}, "endpoint"),
    ("null", {"endpoint": None}, "endpoint"),
    ("unparseable-host", {"endpoint": "http://[::1"}, "endpoint"),
    ("label-too-long", {"endpoint": "http://" + "a" * 70 + ".example"}, "endpoint"),
    # IDNA 2003 (Python's codec) encodes it; IDNA 2008, with which trio resolves names, does
    # not: taken, it made the PeerActor's next pull raise IDNAError, which ended the process.
    ("idna2008-disallowed", {"endpoint": "https://\u2603.example"}, "endpoint"),
    ("missing", {}, "endpoint"),
    (
        "unknown-member",
        {"endpoint": "https://p.example", "peerDid": "did:key:z6Mk"},
        "peerDid",
    ),
    (
        "bad-grpc",
        {"endpoint": "https://peer.example.com", "grpcEndpoint": "grpc://x"},
        "grpcEndpoint",
    ),
    ("null-grpc", {"endpoint": "https://peer.example.com", "grpcEndpoint": None}, "grpcEndpoint"),
    ("array", [{"endpoint": "https://peer.example.com"}], None),
    ("string", "https://peer.example.com", None),
]


async def test_a_bad_endpoint_is_400_peer_invalid_and_changes_nothing(fed: Fed) -> None:
    f = fed
    token = await sign_in(anon_client(f.h), f.peer)
    for name, body, field in BAD_ENDPOINTS:
        with case(name):
            r = await put_self(f, token, body, key=f"bad-{name}")
            error = await error_of(r, 400, "peer_invalid")
            if field is not None:
                assert error["details"]["field"] == field
    assert await peer_listed(f, f.peer.did) == configured_peer(f, f.peer, ["alpha", "beta"])


async def test_a_refused_update_is_recorded_under_its_key(fed: Fed) -> None:
    f = fed
    token = await sign_in(anon_client(f.h), f.peer)
    bad = {"endpoint": "ftp://127.0.0.1/"}
    await error_of(await put_self(f, token, bad, key="once"), 400, "peer_invalid")
    r = await put_self(f, token, bad, key="once")
    await error_of(r, 400, "peer_invalid")
    assert r.headers.get("Idempotent-Replayed") == "true"
    r = await put_self(f, token, {"endpoint": "https://peer.example.com:8443"}, key="once")
    await error_of(r, 409, "idempotency_conflict")
    assert (await peer_listed(f, f.peer.did))["endpoint"] == f.endpoint(f.peer)
    # Another principal's key is another record.
    other = await sign_in(anon_client(f.h), f.other)
    r = await put_self(f, other, {"endpoint": "https://peer.example.com:8443"}, key="once")
    assert r.status_code == 200, await r.get_data()


# === GET /v1/admin/federation/peers =============================================================


async def statuses(f: Fed, token: str) -> list[dict[str, Any]]:
    r = await anon_client(f.h).get(STATUS, headers=bearer(token))
    assert r.status_code == 200, await r.get_data()
    return list(await r.get_json())


async def test_peer_status_needs_an_admin_session(fed: Fed) -> None:
    f = fed
    await error_of(await anon_client(f.h).get(STATUS), 401, "session_missing")
    r = await anon_client(f.h).get(STATUS, headers=bearer("no-such-token"))
    await error_of(r, 401, "session_invalid")
    for key in (SigningKey.generate(), f.peer, f.friend):
        token = await sign_in(anon_client(f.h), key)
        r = await anon_client(f.h).get(STATUS, headers=bearer(token))
        error = await error_of(r, 403, "capability_missing")
        assert error["details"]["capability"] == "admin"


async def test_an_admin_sees_the_status_of_every_configured_peer(fed: Fed) -> None:
    f = fed
    token = await sign_in(anon_client(f.h), f.admin)
    listed = await statuses(f, token)
    assert [s["peerDid"] for s in listed] == sorted(
        k.did for k in (f.peer, f.other, f.lurker, f.bare)
    )
    for status in listed:
        assert STATUS_FIELDS <= set(status) <= STATUS_FIELDS | STATUS_OPTIONAL
        assert status["breakerState"] in {"closed", "open", "half_open"}
        for name in ("consecutiveFailures", "cursor", "lag", "quarantines"):
            assert isinstance(status[name], int)
            assert status[name] >= 0
        assert isinstance(status.get("latencyMs", 0), int)
        for name in ("lastSuccessAt", "nextAttemptAt"):
            assert isinstance(status.get(name, ""), str)
    # The discover-only peer was never pulled from: a fresh status.
    (lurker,) = [s for s in listed if s["peerDid"] == f.lurker.did]
    assert lurker == {
        "peerDid": f.lurker.did,
        "breakerState": "closed",
        "consecutiveFailures": 0,
        "cursor": 0,
        "lag": 0,
        "quarantines": 0,
    }


async def test_peer_status_reports_the_stored_cursor_lag_latency_and_quarantines(
    fed: Fed,
) -> None:
    f = fed
    token = await sign_in(anon_client(f.h), f.admin)
    did = f.lurker.did  # no PeerActor: the status is what the store holds
    key = SigningKey.generate()
    pulled_at = now_ms() - 60_000
    breaker = Breaker().on_success(pulled_at, 42.4)
    good = [origin_version(key, new_did(), 3), origin_version(key, new_did(), 5)]
    bad_doc = {**origin_version(key, new_did(), 6), "name": "altered after signing"}
    quarantined = [
        Quarantined(6, bad_doc["entryDid"], "signature_invalid", "no", jcs(bad_doc)),
        Quarantined(7, None, "entry_invalid", "no", "{}"),
    ]
    state = PeerState(did, cursor=7, head=10, breaker=breaker)
    await import_from(f.h, did, good, quarantined=quarantined, state=state)
    (status,) = [s for s in await statuses(f, token) if s["peerDid"] == did]
    assert status == {
        "peerDid": did,
        "breakerState": "closed",
        "consecutiveFailures": 0,
        "cursor": 7,
        "lag": 3,
        "latencyMs": 42,
        "lastSuccessAt": rfc3339_ms(pulled_at),
        "quarantines": 2,
    }
    # The last successful pull is when the peer was last seen.
    assert (await peer_listed(f, did))["lastSeen"] == rfc3339_ms(pulled_at)
    # Quarantined entries are never served.
    assert (await get(f.h, f"/v1/entries/{bad_doc['entryDid']}")).status_code == 404
    assert (await get(f.h, f"/v1/entries/{good[0]['entryDid']}")).status_code == 200

    # Five failures in a row open the breaker; its cooldown passed, it reads half-open.
    failed_at = now_ms()
    broken = breaker
    for _ in range(5):
        broken = broken.on_failure(failed_at, 0.5)
    assert broken.state == "open"
    state = PeerState(did, cursor=7, head=10, breaker=broken)
    await import_from(f.h, did, [], state=state)
    with clock(f.h.deps.federation, failed_at):
        (status,) = [s for s in await statuses(f, token) if s["peerDid"] == did]
    assert status["breakerState"] == "open"
    assert status["consecutiveFailures"] == 5
    assert status["nextAttemptAt"] == rfc3339_ms(broken.next_attempt_at_ms)
    assert status["quarantines"] == 2
    with clock(f.h.deps.federation, broken.next_attempt_at_ms):
        (status,) = [s for s in await statuses(f, token) if s["peerDid"] == did]
    assert status["breakerState"] == "half_open"


async def test_the_overview_shows_each_peer_with_its_quarantined_entries_and_the_anchoring(
    fed: Fed,
) -> None:
    f = fed
    token = await sign_in(anon_client(f.h), f.admin)
    did = f.lurker.did
    key = SigningKey.generate()
    bad_doc = {**origin_version(key, new_did(), 6), "name": "altered after signing"}
    quarantined = [
        Quarantined(6, bad_doc["entryDid"], "signature_invalid", "the signature fails", "{}"),
        Quarantined(7, None, "entry_invalid", "not an entry", "{}"),
    ]
    state = PeerState(did, cursor=7, head=7)
    await import_from(
        f.h, did, [origin_version(key, new_did(), 3)], quarantined=quarantined, state=state
    )
    r = await anon_client(f.h).get("/v1/admin/overview", headers=bearer(token))
    assert r.status_code == 200
    body = await r.get_json()
    assert body["registryDid"] == f.h.deps.registry_did
    assert body["logHead"] == await f.h.store.log_head()
    assert body["checks"]["database"] == "ok"
    (peer,) = [p for p in body["peers"] if p["peerDid"] == did]
    assert peer["quarantines"] == 2
    assert peer["quarantined"] == [
        {"sequence": 7, "entryDid": None, "code": "entry_invalid", "reason": "not an entry"},
        {
            "sequence": 6,
            "entryDid": bad_doc["entryDid"],
            "code": "signature_invalid",
            "reason": "the signature fails",
        },
    ]
    anchoring = body["anchoring"]
    assert anchoring["enabled"] is False
    assert {"pending", "batchesInFlight", "recentBatches"} <= set(anchoring)
    # An ordinary session is refused.
    other = await sign_in(anon_client(f.h), SigningKey.generate())
    r = await anon_client(f.h).get("/v1/admin/overview", headers=bearer(other))
    await error_of(r, 403, "capability_missing")


# === replica reads (design §12) =================================================================


async def test_a_replica_is_served_with_its_origin_when_no_local_entry_has_the_did(
    harness: Harness,
) -> None:
    h = harness
    origin = SigningKey.generate().did
    key = SigningKey.generate()
    did = new_did()
    v3 = origin_version(key, did, 3, lineageReference={"parent": "did:web:up.example"})
    v9 = origin_version(key, did, 9, name="the newer one", lifecycleStatus="active")
    await import_from(h, origin, [v3, v9])

    r = await get(h, f"/v1/entries/{did}")
    assert r.status_code == 200, await r.get_data()
    assert r.headers["Registry-Origin"] == origin
    assert await body_text(r) == jcs(v9)  # exactly as the origin served it
    etag = r.headers["ETag"]
    # docs/api.md: the origin's sequence and 8 hex digits of SHA-256 of the origin's DID.
    assert etag == f'"r9-{hashlib.sha256(origin.encode()).hexdigest()[:8]}"'
    r = await get(h, f"/v1/entries/{did}", **{"If-None-Match": etag})
    assert r.status_code == 304
    assert r.headers["Registry-Origin"] == origin

    r = await get(h, f"/v1/entries/{did}/versions")
    assert r.status_code == 200, await r.get_data()
    assert r.headers["Registry-Origin"] == origin
    listed = await r.get_json()
    assert listed["entryDid"] == did
    assert listed["versions"] == [v9, v3]  # newest first
    assert listed["totalCount"] == 2
    assert listed["hasMore"] is False

    r = await get(h, f"/v1/entries/{did}/versions?limit=1")
    first = await r.get_json()
    assert r.headers["Registry-Origin"] == origin
    assert first["versions"] == [v9]
    assert first["hasMore"] is True
    r = await get(h, f"/v1/entries/{did}/versions?limit=1&cursor={first['cursor']}")
    second = await r.get_json()
    assert second["versions"] == [v3]
    assert second["hasMore"] is False

    for version in (v3, v9):
        r = await get(h, f"/v1/entries/{did}/versions/{version['sequence']}")
        assert r.status_code == 200, await r.get_data()
        assert r.headers["Registry-Origin"] == origin
        assert await body_text(r) == jcs(version)
    r = await get(h, f"/v1/entries/{did}/versions/5")
    await error_of(r, 404, "version_not_found")
    # A replica is not in this registry's log: no proof bundle here (docs/transparency.md).
    r = await get(h, f"/v1/entries/{did}/versions/9/proof")
    await error_of(r, 404, "entry_not_found")

    r = await get(h, f"/v1/entries/{did}/lineage")
    assert r.status_code == 200
    assert r.headers["Registry-Origin"] == origin
    assert await r.get_json() == {"entryDid": did, "lineage": None}


async def test_a_local_entry_wins_over_a_replica_of_the_same_did(harness: Harness) -> None:
    h = harness
    key, token = await publisher(h)
    local = await create(h, key, token, name="the local one")
    did = local["entryDid"]
    origin = SigningKey.generate().did
    remote = origin_version(key, did, local["sequence"] + 100_000, name="the remote one")
    await import_from(h, origin, [remote])

    r = await get(h, f"/v1/entries/{did}")
    assert r.status_code == 200
    assert "Registry-Origin" not in r.headers
    assert await r.get_json() == local
    r = await get(h, f"/v1/entries/{did}/versions")
    assert "Registry-Origin" not in r.headers
    assert (await r.get_json())["versions"] == [local]
    r = await get(h, f"/v1/entries/{did}/versions/{local['sequence']}")
    assert "Registry-Origin" not in r.headers
    assert await r.get_json() == local
    r = await get(h, f"/v1/entries/{did}/versions/{remote['sequence']}")
    await error_of(r, 404, "version_not_found")
    assert "Registry-Origin" not in r.headers


async def test_a_replica_whose_latest_version_is_a_tombstone_reads_404(harness: Harness) -> None:
    h = harness
    origin = SigningKey.generate().did
    key = SigningKey.generate()
    did = new_did()
    await import_from(h, origin, [origin_version(key, did, 4)])
    assert (await get(h, f"/v1/entries/{did}")).status_code == 200
    await import_from(h, origin, [origin_tombstone(did, 8)])
    for path in (
        f"/v1/entries/{did}",
        f"/v1/entries/{did}/versions",
        f"/v1/entries/{did}/versions/4",
        f"/v1/entries/{did}/versions/8",
        f"/v1/entries/{did}/lineage",
    ):
        r = await get(h, path)
        await error_of(r, 404, "entry_not_found")
        assert "Registry-Origin" not in r.headers


async def test_one_origin_per_entry_another_peer_cannot_hide_or_roll_it_back(
    harness: Harness,
) -> None:
    """Peer A brings entry X first. Peer B then serves a tombstone of X, and an older version
    its publisher once signed: both are quarantined (`entry_from_other_origin`), X is still
    served from A, and B's quarantine count says so."""
    h = harness
    a, b = SigningKey.generate().did, SigningKey.generate().did
    key = SigningKey.generate()
    did = new_did()
    old = origin_version(key, did, 3)
    await import_from(h, a, [origin_version(key, did, 4)])
    await import_from(h, b, [old, origin_tombstone(did, 9)])
    r = await get(h, f"/v1/entries/{did}")
    assert r.status_code == 200
    assert r.headers["Registry-Origin"] == a
    assert (await r.get_json())["sequence"] == 4
    row = await h.store.get_peer(b)
    assert row is not None
    assert row.quarantines == 2

    async def codes() -> list[str]:
        conn = await asyncpg.connect(h.config.database.url)
        try:
            rows = await conn.fetch(
                "SELECT code FROM replica_quarantine WHERE origin_did = $1 ORDER BY origin_seq", b
            )
        finally:
            await conn.close()
        return [r["code"] for r in rows]

    assert await trio_asyncio.aio_as_trio(codes)() == ["entry_from_other_origin"] * 2


async def test_a_locally_deleted_entry_reads_404_even_with_a_replica(harness: Harness) -> None:
    h = harness
    key, token = await publisher(h)
    local = await create(h, key, token)
    did = local["entryDid"]
    await delete(h, token, did)
    origin = SigningKey.generate().did
    remote = origin_version(key, did, 12)
    await import_from(h, origin, [remote])
    for path in (
        f"/v1/entries/{did}",
        f"/v1/entries/{did}/versions",
        f"/v1/entries/{did}/versions/12",
        f"/v1/entries/{did}/versions/{local['sequence']}",
        f"/v1/entries/{did}/lineage",
    ):
        r = await get(h, path)
        await error_of(r, 404, "entry_not_found")
        assert "Registry-Origin" not in r.headers
    # And its DID stays burnt for a local create.
    r = await anon_client(h).post(
        "/v1/entries", json=signed_entry(key, did), headers=bearer(token, **idem())
    )
    assert r.status_code == 409


async def test_replicas_never_reach_local_discovery(harness: Harness) -> None:
    h = harness
    origin = SigningKey.generate().did
    tag = "fed-" + new_did().rsplit(":", 1)[-1]
    replica = origin_version(SigningKey.generate(), new_did(), 3, tags=[tag])
    await import_from(h, origin, [replica])
    assert (await get(h, f"/v1/entries/{replica['entryDid']}")).status_code == 200
    r = await anon_client(h).post("/v1/discover", json={"tags": [tag]})
    assert r.status_code == 200, await r.get_data()
    result = await r.get_json()
    assert result["entries"] == []
    assert result["totalCount"] == 0


# === more of the sync endpoint ==================================================================


async def test_the_same_envelope_sent_twice_at_once_is_answered_once(fed: Fed) -> None:
    f = fed
    request = sync_request(f)
    statuses: list[int] = []

    async def send() -> None:
        r = await post_sync(f, request)
        if r.status_code != 200:
            await error_of(r, 401, "envelope_nonce_replayed")
        statuses.append(r.status_code)

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(send)
    assert sorted(statuses) == [200, 401, 401, 401]


async def test_sync_is_rate_limited_as_a_write(database_url: str, tmp_path: Path) -> None:
    keys = new_keys()
    base = fed_config(database_url, tmp_path, keys)
    config = base.model_copy(
        update={"limits": base.limits.model_copy(update={"write_per_minute": 2})}
    )

    async def body(h: Harness) -> None:
        f = Fed(h, **keys)
        for _ in range(2):
            await answered(h, sync_request(f), f.peer)
        request = sync_request(f)
        r = await post_sync(h, request)
        await error_of(r, 429, "write_rate_limited")
        assert int(r.headers["Retry-After"]) >= 1
        assert await nonce_kept(h, f.peer.did, request["nonce"]) is None

    await with_quiet_harness(config, body)


# === the service's own PeerActors ==============================================================


async def test_an_unreachable_peer_is_a_quiet_failed_pull_in_its_status(
    database_url: str, tmp_path: Path
) -> None:
    """With a live PeerActor (the real leadership): a peer nobody answers for is a failed
    pull, recorded as a `peer.status` change and shown to the admin; nothing else happens."""
    keys = new_keys()
    base = fed_config(database_url, tmp_path, keys)
    (peer,) = [p for p in base.federation.peers if p.peer_did == keys["peer"].did]
    config = base.model_copy(
        update={"federation": base.federation.model_copy(update={"peers": [peer]})}
    )
    found: list[LogRecord] = []
    async for h in open_harness(config):
        f = Fed(h, **keys)
        # Nothing else writes here: the actor's first records are among the last few.
        after = max(0, await h.store.log_head() - 100)
        with trio.fail_after(15):
            async with h.service.logs.subscribe(after, queue_size=100_000) as events:
                while not found:
                    record = await events.receive()
                    if record.kind == "peer.status" and record.data["peerDid"] == f.peer.did:
                        found.append(record)
        # The actor now waits out its backoff (at least 0.5 s): nothing runs under the checks.
        assert found[0].data["consecutiveFailures"] >= 1
        assert found[0].data["cursor"] == 0
        assert "lastSuccessAt" not in found[0].data
        token = await sign_in(anon_client(h), f.admin)
        (status,) = await statuses(f, token)
        assert status["peerDid"] == f.peer.did
        assert status["breakerState"] == "closed"  # fewer than 5 failures
        assert status["consecutiveFailures"] >= 1
        assert status["cursor"] == 0
        assert "lastSuccessAt" not in status
        assert "nextAttemptAt" in status
        assert "lastSeen" not in await peer_listed(f, f.peer.did)
        # Serving sync to that peer is unaffected.
        await answered(h, sync_request(f), f.peer)
    assert found


class _EndpointAnsweredAtShutdown:
    """The store, except that the PeerActor's lookup of its peer's endpoint is answered only
    once the service has begun shutting down and everything else has run as far as it can: what
    happens whenever a database round trip completes as the service is cancelled (trio-asyncio
    then returns the result, and the cancellation is only seen at the task's next checkpoint)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.looking = trio.Event()
        self.stopping = trio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def get_record(self, kind: str, record_id: str) -> Any:
        found = await self._store.get_record(kind, record_id)
        if kind == "peer" and not self.looking.is_set():
            self.looking.set()
            with trio.CancelScope(shield=True):
                await self.stopping.wait()
                await trio.testing.wait_all_tasks_blocked()
        return found


async def test_the_service_shuts_down_cleanly_while_a_peer_actor_is_mid_pull(
    database_url: str, tmp_path: Path
) -> None:
    """Shutdown must not fail because a PeerActor was between two steps of a pull.

    Today it does: the peers' shared HTTP client is closed by a sibling task of the actors
    (`service/wiring.py`, `_close_at_exit`) while an actor may still take one more step, and
    `HttpTransport.post` then raises `RuntimeError: Cannot send a request, as the client has
    been closed` (not an `httpx.HTTPError`, so not `PeerUnreachable`, not a known failure):
    it escapes the supervisor and the service's nursery. Seen intermittently at every kind of
    harness shutdown with live PeerActors; made deterministic here."""
    keys = new_keys()
    config = fed_config(database_url, tmp_path, keys)
    failure: Exception | None = None
    staged: _EndpointAnsweredAtShutdown | None = None
    try:
        async with (
            trio_asyncio.open_loop(),
            open_pg_store(config.database.url) as store,
        ):
            staged = _EndpointAnsweredAtShutdown(store)
            async with open_service(
                config, staged, key=SigningKey.generate(), identity=DidKeyIdentity()
            ):
                with trio.fail_after(15):
                    await staged.looking.wait()  # an actor is looking up where its peer is
                staged.stopping.set()
    except Exception as exc:
        failure = exc
    assert staged is not None
    assert staged.looking.is_set()
    assert failure is None, f"shutting down raised {leaves(failure)}"


def leaves(exc: BaseException) -> list[str]:
    """The exceptions inside (nested) exception groups, as `Type: message`."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [f"{type(exc).__name__}: {exc}"]


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://10.0.0.7:8080/redir",  # not named by the configuration
        "https://169.254.169.254/latest",
        "https://2130706433/",  # 127.0.0.1 spelled as one number
        "https://user:secret@peer.example.com/",  # user information would be listed publicly
        "http://peer.example.com/",  # http is not allowed by default
    ],
)
async def test_a_peer_cannot_point_the_registry_at_internal_addresses(
    fed: Fed, endpoint: str
) -> None:
    f = fed
    token = await sign_in(anon_client(f.h), f.peer)
    r = await put_self(f, token, {"endpoint": endpoint}, key=f"bad-{endpoint}")
    error = await error_of(r, 400, "peer_endpoint_refused")
    assert error["details"] == {"field": "endpoint"}
    listed = await peer_listed(f, f.peer.did)
    assert listed["endpoint"] == f.endpoint(f.peer)
    assert "secret" not in json.dumps(listed)
    r = await put_self(f, token, {"endpoint": "https://peer.example.com/r"}, key="good")
    assert r.status_code == 200, await r.get_data()


async def test_the_peer_list_answers_while_a_reload_removes_a_peer(
    fed: Fed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The list reads each peer's registration from the store: a reload (SIGHUP) that removed
    a peer while it did so made `self.peers[did]` a KeyError, a 500. The list is the peers as
    configured when the request came."""
    f = fed
    handle = f.h.service.federation
    before = list(handle.peers)
    store = f.h.deps.federation.store
    get_record = store.get_record

    async def reloaded_meanwhile(*args: Any, **kwargs: Any) -> Any:
        handle.reconfigure(before[1:])
        return await get_record(*args, **kwargs)

    monkeypatch.setattr(store, "get_record", reloaded_meanwhile)
    r = await anon_client(f.h).get(PEERS)
    assert r.status_code == 200, await r.get_data()
    listed = [p["peerDid"] for p in await r.get_json()]
    assert listed == sorted(p.peer_did for p in before)
