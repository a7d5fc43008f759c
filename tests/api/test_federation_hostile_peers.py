"""Peers that answer with what no honest peer sends (review of the puller and of federated
discovery): a page whose entries verify but hold text no store can keep, a discover answer that
says it has more without giving any, and a source that pages past offset 10,000."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio_asyncio

from actors.federation import HttpTransport, PeerAnswer
from registry.config import PeerConfig
from registry.envelope import (
    build_response,
    format_timestamp,
    new_nonce,
    response_digest,
    verify_envelope,
)
from registry.errors import Invalid
from registry.federation import check_replica
from registry.identity import DidKeyIdentity
from registry.keys import SigningKey, b64url_encode
from registry.store.pg import open_pg_store
from registry.usecases.common import now_ms
from service.wiring import open_service
from tests.api.api_support import anon_client
from tests.api.test_federation import (
    Fed,
    fed_config,
    new_keys,
    open_quiet_harness,
    origin_version,
    with_quiet_harness,
)
from tests.conftest import Harness, make_config
from tests.helpers import bearer, idem, new_did, sign_in, signed_entry

FEDERATED = "/v1/discover/federated"


def raw_signed(key: SigningKey, request: dict[str, Any], kind: str, payload_text: str) -> bytes:
    """An answer to `request` whose bytes (less `signature`) are what `key` signed: ASCII JSON
    with sorted members, as a peer may send it (the receiver checks the bytes it got first),
    with `payload_text` spliced in as it is."""
    members = {
        "algorithm": "Ed25519",
        "keyId": key.key_id,
        "kind": kind,
        "nonce": new_nonce(),
        "recipientDid": request["senderDid"],
        "requestDigest": response_digest(request),
        "senderDid": key.did,
        "timestamp": format_timestamp(now_ms()),
        "version": "1",
    }
    head = json.dumps(members, sort_keys=True, separators=(",", ":"))
    unsigned = head[:-1] + ',"payload":' + payload_text + "}"
    signature = b64url_encode(key.sign(unsigned.encode("ascii")))
    return (unsigned[:-1] + ',"signature":"' + signature + '"}').encode("ascii")


def with_lone_surrogate(entry: dict[str, Any]) -> str:
    """`entry` as JSON text whose `updatedAt` (outside the publisher's signature) starts with
    an escaped lone surrogate: valid JSON, no UTF-8 form."""
    text = json.dumps(entry, sort_keys=True, separators=(",", ":"))
    return text.replace('"updatedAt":"', '"updatedAt":"\\ud800')


def test_a_replica_whose_unsigned_members_have_no_utf8_form_is_refused() -> None:
    served = origin_version(SigningKey.generate(), new_did(), 1)
    with pytest.raises(Invalid) as refused:
        check_replica(json.loads(with_lone_surrogate(served)))
    assert refused.value.code == "entry_invalid"


@pytest.mark.parametrize("poisoned", [False, True], ids=["clean", "lone_surrogate"])
async def test_a_page_no_store_can_keep_fails_the_pull_and_the_service_goes_on(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, poisoned: bool
) -> None:
    """The peer's page verifies (it signed the bytes it sent), but one of its entries holds a
    lone surrogate outside the publisher's signature: it used to reach the store, which refused
    the batch (`Invalid`), and the process ended (the supervisor restarts only on outages)."""
    peer = SigningKey.generate()
    served = origin_version(SigningKey.generate(), new_did(), 1)
    entry_text = (
        with_lone_surrogate(served)
        if poisoned
        else json.dumps(served, sort_keys=True, separators=(",", ":"))
    )
    payload = '{"entries":[' + entry_text + '],"hasMore":false,"headSequence":1,"nextSequence":1}'
    pulls: list[int] = []
    pulled_twice = trio.Event()

    async def post(self: Any, url: str, body: bytes) -> PeerAnswer:
        request = json.loads(body)
        pulls.append(request["payload"]["fromSequence"])
        if len(pulls) >= 2:
            pulled_twice.set()
        return PeerAnswer(200, raw_signed(peer, request, "sync_response", payload))

    async def get(self: Any, url: str) -> PeerAnswer:
        return PeerAnswer(404, b'{"error":{"code":"not_found"}}')  # no log: not witnessed

    monkeypatch.setattr(HttpTransport, "post", post)
    monkeypatch.setattr(HttpTransport, "get", get)
    config = make_config(database_url, tmp_path, federation={"poll_seconds": 0.1})
    peers = [
        PeerConfig(
            peer_did=peer.did,
            endpoint="http://127.0.0.1:9/p",
            agreement_ids=["default"],
            kinds=["sync"],
        )
    ]
    config = config.model_copy(
        update={"federation": config.federation.model_copy(update={"peers": peers})}
    )
    async with (
        trio_asyncio.open_loop(),
        open_pg_store(config.database.url) as store,
        open_service(config, store, key=SigningKey.generate(), identity=DidKeyIdentity()) as svc,
    ):
        with trio.fail_after(30):
            await pulled_twice.wait()  # the actor pulls again: nothing ended the process
        state = svc.deps.federation.live()[peer.did]
        held = await store.replica_head(served["entryDid"])
    if poisoned:  # a failed pull, counted; nothing stored, nothing skipped
        assert state.breaker.consecutive_failures >= 1
        assert state.cursor == 0
        assert held is None
    else:
        assert state.cursor == 1
        assert held is not None


def peer_answering(
    f: Fed, answer: Callable[[dict[str, Any]], dict[str, Any]]
) -> Callable[[str, bytes], Any]:
    """A `call` where `f.peer` answers `answer(query)` as its signed discover_response and every
    other discover peer is unreachable."""

    async def call(url: str, body: bytes) -> tuple[int, bytes]:
        request = json.loads(body)
        if request["recipientDid"] != f.peer.did:
            raise OSError("unreachable")
        verify_envelope(
            request, recipient_did=f.peer.did, now_ms=now_ms(), expected_kind="discover_request"
        )
        response = build_response(
            f.peer,
            request=request,
            kind="discover_response",
            payload=answer(request["payload"]["query"]),
            now_ms=now_ms(),
        )
        return 200, json.dumps(response).encode()

    return call


async def federated(f: Fed, token: str, body: dict[str, Any]) -> tuple[int, Any]:
    r = await anon_client(f.h).post(FEDERATED, json=body, headers=bearer(token))
    return r.status_code, await r.get_json()


def peer_report(body: dict[str, Any], did: str) -> dict[str, Any]:
    return next(p for p in body["federation"]["peers"] if p["peerDid"] == did)


async def test_a_discover_answer_with_an_entry_no_client_can_read_leaves_the_peer_out(
    fed: Fed,
) -> None:
    """Was a 500: the entry passed the checks and its text could not be encoded."""
    f = fed
    served = origin_version(SigningKey.generate(), new_did(), 1)

    async def call(url: str, body: bytes) -> tuple[int, bytes]:
        request = json.loads(body)
        if request["recipientDid"] != f.peer.did:
            raise OSError("unreachable")
        payload = '{"entries":[' + with_lone_surrogate(served) + '],"hasMore":false,"totalCount":1}'
        return 200, raw_signed(f.peer, request, "discover_response", payload)

    f.h.deps.federation.call = call
    token = await sign_in(anon_client(f.h), f.admin)
    status, body = await federated(f, token, {"entryType": "*"})
    assert status == 200, body
    assert peer_report(body, f.peer.did)["status"] == "failed"
    assert body["federation"]["partial"] is True


async def test_a_peer_saying_it_has_more_without_entries_cannot_make_paging_endless(
    fed: Fed,
) -> None:
    f = fed
    f.h.deps.federation.call = peer_answering(
        f, lambda q: {"entries": [], "hasMore": True, "totalCount": 5}
    )
    token = await sign_in(anon_client(f.h), f.admin)
    status, body = await federated(f, token, {"entryType": "NoSuchType-" + new_did()[-8:]})
    assert status == 200, body
    assert peer_report(body, f.peer.did) == {
        "peerDid": f.peer.did,
        "status": "failed",
        "reason": "bad_answer",
    }
    assert body["hasMore"] is False


async def open_fed(database_url: str, tmp_path: Path, **limits: Any) -> AsyncIterator[Fed]:
    keys = new_keys()
    config = fed_config(database_url, tmp_path, keys)
    config = config.model_copy(update={"limits": config.limits.model_copy(update=limits)})
    async for h in open_quiet_harness(config):
        yield Fed(h, **keys)


@pytest.fixture
async def fed(database_url: str, tmp_path: Path) -> AsyncIterator[Fed]:
    async for f in open_fed(database_url, tmp_path):
        yield f


@pytest.fixture
async def big_fed(database_url: str, tmp_path: Path) -> AsyncIterator[Fed]:
    async for f in open_fed(database_url, tmp_path, max_page_size=1000):
        yield f


async def test_a_source_paged_past_offset_10000_ends_and_every_cursor_issued_is_taken(
    big_fed: Fed,
) -> None:
    """A peer with 50,000 matches, pages of 1,000: page 11 is asked at offset 10,000, the
    bound, and its cursor named offset 11,000, which the next page refused as a cursor this
    server never issued (400). The source now ends there."""
    f = big_fed
    entry = origin_version(SigningKey.generate(), new_did(), 7)
    asked: list[int] = []

    def answer(q: dict[str, Any]) -> dict[str, Any]:
        asked.append(q["offset"])
        return {"entries": [entry] * q["limit"], "hasMore": True, "totalCount": 50_000}

    f.h.deps.federation.call = peer_answering(f, answer)
    token = await sign_in(anon_client(f.h), f.admin)
    query: dict[str, Any] = {"entryType": "*", "limit": 1000, "text": "zzqq" + new_did()[-8:]}
    pages = 0
    while True:
        status, body = await federated(f, token, query)
        assert status == 200, (pages, body)
        pages += 1
        if not body["hasMore"]:
            break
        assert pages < 20, "paging does not end"
        query = {**query, "cursor": body["cursor"]}
    assert asked == [1000 * n for n in range(11)]  # up to the bound, each offset once
    assert pages == 11
    assert peer_report(body, f.peer.did)["status"] == "ok"


async def test_a_federated_cursor_over_many_peers_is_accepted_back(
    database_url: str, tmp_path: Path
) -> None:
    """The cursor names every peer that failed (none is asked again on later pages): with 120
    of them it was ~9,600 characters, over the 4,096 the registry took back, and paging ended
    400 invalid_cursor on the registry's own cursor."""
    peers = [
        PeerConfig(
            peer_did=SigningKey.generate().did,
            endpoint="http://127.0.0.1:9/p",
            agreement_ids=["default"],
            kinds=["discover"],
        )
        for _ in range(120)
    ]
    config = make_config(database_url, tmp_path)
    config = config.model_copy(
        update={"federation": config.federation.model_copy(update={"peers": peers})}
    )
    publisher = SigningKey.generate()

    async def unreachable(url: str, body: bytes) -> tuple[int, bytes]:
        raise OSError("unreachable")

    async def body(h: Harness) -> None:
        h.deps.federation.call = unreachable
        token = await sign_in(anon_client(h), publisher)
        published = set()
        for _ in range(3):
            entry = signed_entry(publisher)
            r = await h.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
            assert r.status_code == 201, await r.get_data()
            published.add(entry["entryDid"])
        seen: list[str] = []
        # (other tests' entries may share the database: this publisher's alone)
        query: dict[str, Any] = {"entryType": "*", "publisherDid": publisher.did, "limit": 1}
        for _ in range(3):
            r = await anon_client(h).post(FEDERATED, json=query, headers=bearer(token))
            page = await r.get_json()
            assert r.status_code == 200, page
            assert page["federation"]["partial"] is True
            seen += [e["entryDid"] for e in page["entries"]]
            if not page["hasMore"]:
                break
            assert len(page["cursor"]) > 4096  # what the registry took back before
            query = {**query, "cursor": page["cursor"]}
        assert sorted(seen) == sorted(published)
        assert not page["hasMore"]

    await with_quiet_harness(config, body)


async def test_the_openapi_document_bounds_a_federated_cursor_only_by_the_body(
    database_url: str, tmp_path: Path
) -> None:
    # docs/federation.md: the cursor grows with the peers (~80 characters each) and has no
    # bound but the body's. FederatedQuery, a copy of DiscoverRequest, kept its 8,192: the
    # registry's own cursor over 120 peers (~9,600, the test above) was schema-invalid.
    async def body(h: Harness) -> None:
        r = await anon_client(h).get("/v1/openapi.json")
        schemas = (await r.get_json())["components"]["schemas"]
        cursor = schemas["FederatedQuery"]["properties"]["cursor"]
        [text] = [a for a in cursor["anyOf"] if a.get("type") == "string"]
        assert "maxLength" not in text
        assert text["minLength"] == 1

    await with_quiet_harness(make_config(database_url, tmp_path), body)
