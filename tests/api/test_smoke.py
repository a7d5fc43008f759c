from registry.keys import SigningKey
from tests.conftest import Harness
from tests.helpers import bearer, idem, sign_in, signed_entry


async def test_publish_and_read_back(harness: Harness) -> None:
    key = SigningKey.generate()
    token = await sign_in(harness.client, key)
    entry = signed_entry(key)
    r = await harness.client.post("/v1/entries", json=entry, headers=bearer(token, **idem()))
    assert r.status_code == 201, await r.get_data()
    created = await r.get_json()
    r = await harness.client.get(f"/v1/entries/{entry['entryDid']}")
    assert r.status_code == 200
    assert await r.get_json() == created
