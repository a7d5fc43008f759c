"""What each change makes stale (registry/coherence.py, the one owner of cache coherence)."""

from __future__ import annotations

import tracemalloc

import pytest

from registry.caches import Served
from registry.canonical import canonicalize
from registry.changes import CHANGE_KINDS, LogRecord
from registry.coherence import Caches
from registry.store import SessionRecord

DID = "did:web:agent.test"
TOKEN = bytes(range(32))


def filled() -> Caches:
    caches = Caches(discover_capacity=10)
    caches.set_live(True)
    caches.entries.put(DID, Served(1, "{}"), caches.entries.epoch)
    session = SessionRecord("did:key:zP", "did:key:zP", "did:key:zP", "did", ("x",), 0)
    caches.sessions.put(TOKEN, session, caches.sessions.epoch)
    return caches


# The kinds that change what an entry serves: its versions, its attestations, its anchor state.
SERVED = {k for k in CHANGE_KINDS if k.startswith(("entry.", "attestation."))} | {"anchor.updated"}


@pytest.mark.parametrize("kind", sorted(CHANGE_KINDS))
def test_a_record_drops_the_head_of_its_entry_exactly_when_it_changes_what_it_serves(
    kind: str,
) -> None:
    caches = filled()
    caches.observe([LogRecord(2, kind, DID, 0, {})])
    assert (caches.entries.get(DID) is None) == (kind in SERVED)
    assert caches.sessions.get(TOKEN) is not None


def test_a_revoked_session_is_dropped_and_a_malformed_record_is_harmless() -> None:
    caches = filled()
    caches.observe([LogRecord(2, "session.revoked", None, 0, {"tokenHash": "zz"})])
    assert caches.sessions.get(TOKEN) is not None
    caches.observe([LogRecord(3, "session.revoked", None, 0, {"tokenHash": TOKEN.hex()})])
    assert caches.sessions.get(TOKEN) is None
    assert caches.entries.get(DID) is not None


def test_a_local_write_drops_its_entry_and_nothing_is_cached_while_not_live() -> None:
    caches = filled()
    caches.wrote(DID)
    assert caches.entries.get(DID) is None
    caches.set_live(False)
    caches.entries.put(DID, Served(1, "{}"), caches.entries.epoch)
    assert caches.entries.get(DID) is None


def test_a_cached_entry_weighs_what_it_holds_its_served_text_included() -> None:
    """`limits.cache_mib` bounds what the entry cache holds: an entry that shows attestations
    keeps the text served with them too (`Served.at`), about as much again."""
    caches = Caches(max_bytes=64 << 20)
    caches.set_live(True)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for n in range(40):
        doc = canonicalize({"entryDid": f"did:web:e{n}", "pad": "x" * 50_000}).decode()
        shown = tuple(
            (None, canonicalize({"attestationId": f"a{n}-{k}", "pad": "y" * 30_000}).decode())
            for k in range(5)
        )
        served = Served(n + 1, doc, shown)
        caches.entries.put(f"did:web:e{n}", served, caches.entries.epoch)
        served.at(0)  # as a GET does
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert held <= caches.entries.bytes * 1.1, (held, caches.entries.bytes)
