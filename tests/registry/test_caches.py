"""FollowedCache's bounds: a count, and bytes where its values are weighed."""

from __future__ import annotations

import pytest

from registry.caches import FollowedCache


def test_a_cache_with_a_byte_bound_drops_the_least_recently_used_to_stay_within_it() -> None:
    cache: FollowedCache[str, str] = FollowedCache(capacity=100, max_bytes=10, weigh=len)
    cache.enabled = True
    for key, value in (("a", "1234"), ("b", "1234"), ("c", "12")):
        cache.put(key, value, cache.epoch)
    assert cache.bytes == 10
    assert cache.get("a") == "1234"  # now the most recently used
    cache.put("d", "123", cache.epoch)  # 13 bytes: "b" goes, the least recently used
    assert (cache.get("b"), cache.bytes) == (None, 9)
    cache.put("a", "1", cache.epoch)  # replaced: its old weight goes with it
    assert cache.bytes == 6
    cache.invalidate("c")
    assert cache.bytes == 4
    cache.put("huge", "x" * 50, cache.epoch)  # alone over the bound: nothing stays
    assert (len(cache), cache.bytes) == (0, 0)


def test_a_served_version_parses_its_lineage_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # GET /lineage reads it from the cached version: a document may be 1 MiB.
    from registry import caches

    served = caches.Served(3, '{"entryDid":"did:web:a.example","lineageReference":{"x":[1]}}')
    parsed: list[str] = []
    real = caches.json.loads

    def counting(text: str) -> object:
        parsed.append(text)
        return real(text)

    monkeypatch.setattr(caches.json, "loads", counting)
    assert served.lineage == {"x": [1]}
    assert served.lineage == {"x": [1]}
    assert len(parsed) == 1
    assert caches.Served(4, '{"entryDid":"did:web:a.example"}').lineage is None


def test_attestations_are_spliced_into_the_served_text_as_canonicalising_the_whole_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What `GET /v1/entries/{did}` serves: the version with `verifiableAttestations` (the
    unexpired ones), byte for byte the JCS of the whole, without canonicalising the credentials
    again (hostile review: 50 of 64 KiB of floats, 0.84 s of CPU a GET); kept while the same
    ones are shown."""
    import json

    from registry import caches
    from registry.canonical import canonicalize

    entry = {"entryDid": "did:web:a.example", "name": "x", "version": "1.0.0", "zeta": [1.5]}
    claims = {"audited": True, "scores": [1e-7] * 2000, "note": "\u20ac\U0001f600"}
    records = [
        {"attestationId": f"at_{n}", "credential": {"claims": claims, "n": n}} for n in range(3)
    ]
    texts = [canonicalize(r).decode() for r in records]
    served = caches.Served(
        7,
        canonicalize(entry).decode(),
        ((None, texts[0]), (2_000, texts[1]), (None, texts[2])),
    )
    expected = canonicalize({**entry, "verifiableAttestations": records}).decode()
    calls = []

    def counted(value: object) -> bytes:
        calls.append(value)
        return canonicalize(value)  # type: ignore[arg-type]

    monkeypatch.setattr("registry.canonical.canonicalize", counted)
    assert served.at(1_000) == expected
    assert all(len(json.dumps(value)) < 100 for value in calls)  # the members after it only
    assert served.at(1_500) is served.at(1_000)  # kept
    without_second = canonicalize(
        {**entry, "verifiableAttestations": [records[0], records[2]]}
    ).decode()
    assert served.at(2_000) == without_second  # the second expired
    assert caches.Served(8, canonicalize(entry).decode()).at(0) == canonicalize(entry).decode()
