"""One name, one entry (docs/lifecycle.md): DIDs in one normal form, replicas written only at
their origin, a version string that names one content forever, and a version's registry-managed
fields the same wherever it is read."""

from __future__ import annotations

import pytest

from registry.keys import SigningKey
from tests.api.api_support import anon_client, create, error_of, update
from tests.api.test_federation import import_from, origin_version, publisher
from tests.conftest import Harness
from tests.helpers import bearer, idem, new_did, signed_entry


@pytest.mark.parametrize(
    "did",
    ["did:example:eqX%2Dx", "did:example:eqX%2dx", "did:example:a%2fb", "did:example:%41bc"],
)
async def test_a_did_not_in_normal_form_is_refused(harness: Harness, did: str) -> None:
    key, token = await publisher(harness)
    r = await harness.client.post(
        "/v1/entries", json=signed_entry(key, did), headers=bearer(token, **idem())
    )
    error = await error_of(r, 400, "entry_invalid")
    assert "normal form" in error["message"]


async def test_spellings_of_one_did_are_one_entry(harness: Harness) -> None:
    key, token = await publisher(harness)
    did = f"did:example:eq{new_did()[-8:]}-x"
    await create(harness, key, token, did)
    for spelling in (did.replace("-", "%2D"), did.replace("-", "%2d")):
        r = await harness.client.post(
            "/v1/entries", json=signed_entry(key, spelling), headers=bearer(token, **idem())
        )
        assert r.status_code == 400


async def test_a_replica_cannot_be_created_or_updated_here(harness: Harness) -> None:
    h = harness
    origin = SigningKey.generate().did
    key, token = await publisher(h)
    did = new_did()
    remote = origin_version(key, did, 7)
    await import_from(h, origin, [remote])
    r = await h.client.post(
        "/v1/entries", json=signed_entry(key, did), headers=bearer(token, **idem())
    )
    error = await error_of(r, 409, "entry_is_replica")
    assert error["details"] == {"entryDid": did, "origin": origin}
    r = await update(h, key, token, did, 7)
    error = await error_of(r, 409, "entry_is_replica")
    assert error["details"]["origin"] == origin
    r = await anon_client(h).delete(f"/v1/entries/{did}", headers=bearer(token, **idem()))
    await error_of(r, 409, "entry_is_replica")
    r = await h.client.get(f"/v1/entries/{did}")
    assert r.headers["Registry-Origin"] == origin  # still the origin's, untouched


async def test_an_update_identical_to_the_head_is_refused(harness: Harness) -> None:
    key, token = await publisher(harness)
    created = await create(harness, key, token, version="1.0.0")
    r = await update(harness, key, token, created["entryDid"], created["sequence"], version="1.0.0")
    error = await error_of(r, 409, "version_unchanged")
    assert error["details"] == {"latestSequence": created["sequence"]}


async def test_a_version_string_names_one_content_forever(harness: Harness) -> None:
    h = harness
    key, token = await publisher(h)
    created = await create(h, key, token, version="1.0.0")
    did = created["entryDid"]
    r = await update(h, key, token, did, created["sequence"], version="1.0.0", name="Other")
    error = await error_of(r, 409, "version_exists")
    assert error["details"] == {"version": "1.0.0", "sequence": created["sequence"]}
    # A lifecycle move keeps the version string: the content it names is the same.
    r = await update(
        h, key, token, did, created["sequence"], version="1.0.0", lifecycleStatus="active"
    )
    assert r.status_code == 200, await r.get_data()
    active = await r.get_json()
    r = await update(
        h,
        key,
        token,
        did,
        active["sequence"],
        version="1.1.0",
        name="Other",
        lifecycleStatus="active",
    )
    assert r.status_code == 200, await r.get_data()
    newer = await r.get_json()
    # Going back to 1.0.0 with other content is refused too; 1.1.0 with its own content is not.
    r = await update(
        h,
        key,
        token,
        did,
        newer["sequence"],
        version="1.0.0",
        name="Third",
        lifecycleStatus="active",
    )
    await error_of(r, 409, "version_exists")


async def test_the_version_label_is_read_from_its_column_and_from_older_rows(
    harness: Harness,
) -> None:
    """The label check reads each version's `version` column (migration 0023) instead of
    parsing every earlier document; versions written before it (NULL there) are still found."""
    import trio_asyncio

    h = harness
    key, token = await publisher(h)
    created = await create(h, key, token, version="1.0.0")
    did = created["entryDid"]
    run = trio_asyncio.aio_as_trio
    pool = h.store._pool  # type: ignore[attr-defined]
    labels = await run(pool.fetch)("SELECT version FROM entry_versions WHERE entry_did = $1", did)
    assert [r["version"] for r in labels] == ["1.0.0"]
    await run(pool.execute)("UPDATE entry_versions SET version = NULL WHERE entry_did = $1", did)
    r = await update(h, key, token, did, created["sequence"], version="1.0.0", name="Other")
    await error_of(r, 409, "version_exists")  # found by its document, as before
    r = await update(h, key, token, did, created["sequence"], version="2.0.0", name="Other")
    assert r.status_code == 200, await r.get_data()
    labels = await run(pool.fetch)(
        "SELECT version FROM entry_versions WHERE entry_did = $1 ORDER BY seq", did
    )
    assert [r["version"] for r in labels] == [None, "2.0.0"]
