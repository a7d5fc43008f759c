"""Seed a registry database with many realistic entries, fast (benchmarks and plan tests).

Documents are generated in Python with realistic variety (names, descriptions from a vocabulary,
tags, service endpoint types, publishers, metadata, relationships, dates) and inserted in batches
through `entry_projection`, the same SQL the write path uses to fill the searchable columns.
They are not signed: discovery neither checks nor needs signatures on stored entries.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

_VOCABULARY = """
summarize translate classify extract answer search plan schedule review code test deploy
monitor triage draft email invoice contract legal medical finance travel weather music
image video audio speech vision robot support sales marketing research data sql graph
security audit compliance privacy chat assistant tutor math physics chemistry biology
"""
WORDS = _VOCABULARY.split()
SERVICE_TYPES = ["A2A", "MCP", "OpenAPI", "GraphQL", "gRPC", "WebSocket", "REST", "SSE"]
TEAMS = [f"team-{i}" for i in range(50)]


def make_doc(i: int, rng: random.Random, now: datetime) -> dict[str, Any]:
    words = rng.sample(WORDS, 6)
    publisher = f"did:key:z6MkPublisher{i % 1000:04d}"
    published = now - timedelta(minutes=rng.randrange(0, 60 * 24 * 365))
    doc: dict[str, Any] = {
        "entryDid": f"did:web:agents.example.com:seed:{i:07d}",
        "entryType": "AgentDefinition" if i % 10 else "ToolDefinition",
        "itemData": {"model": f"model-{i % 7}", "instructions": " ".join(words * 4)},
        "itemDataHash": f"{i:064x}",
        "itemSchemaUri": "https://schemas.example.com/agent/v1",
        "registryVersion": "1.0",
        "name": f"{words[0].title()} {words[1]} agent {i}",
        "description": f"An agent that can {words[0]}, {words[1]} and {words[2]} for {words[3]}.",
        "publishedAt": published.isoformat().replace("+00:00", "Z"),
        "publisherDid": publisher,
        "version": f"1.{i % 10}.0",
        "tags": sorted({words[0], words[3], f"tag-{i % 200}"}),
        "lifecycleStatus": rng.choice(["active"] * 6 + ["draft", "deprecated", "revoked"]),
        "serviceEndpoints": [
            {
                "id": "main",
                "type": SERVICE_TYPES[i % len(SERVICE_TYPES)],
                "url": f"https://svc{i}.example.com/",
            },
        ],
        "customMetadata": {"team": TEAMS[i % len(TEAMS)], "tier": i % 3},
        "signature": {"algorithm": "Ed25519", "keyId": f"{publisher}#k", "value": "A" * 86},
        "anchorState": "unanchored",
        "updatedAt": published.isoformat().replace("+00:00", "Z"),
        "sequence": i,
    }
    if i % 20 == 0:
        doc["relationships"] = [
            {"relationshipType": "dependsOn", "targetDid": f"did:web:base:{i % 100}"}
        ]
    return doc


async def seed(conn: asyncpg.Connection, count: int, *, batch: int = 5000, seed: int = 7) -> None:
    """Insert `count` entries and their log records (the next sequences) and advance the log
    head past them."""
    rng = random.Random(seed)
    now = datetime(2026, 11, 1, tzinfo=UTC)
    start = int(await conn.fetchval("SELECT seq FROM log_head")) + 1
    for first in range(start, start + count, batch):
        docs = [make_doc(i, rng, now) for i in range(first, min(first + batch, start + count))]
        await conn.execute(
            """
            WITH docs AS (SELECT t, t::jsonb AS d FROM unnest($1::text[]) AS t),
            versions AS (
                INSERT INTO entry_versions (seq, entry_did, publisher_did, lifecycle, doc)
                SELECT (d->>'sequence')::bigint, d->>'entryDid', d->>'publisherDid',
                       d->>'lifecycleStatus', t
                FROM docs
            ),
            records AS (  -- every log position is a record (the log actor reads them in order)
                INSERT INTO log (seq, kind, entry_did, data)
                SELECT (d->>'sequence')::bigint, 'entry.created', d->>'entryDid',
                       jsonb_build_object('entryType', d->>'entryType',
                                          'publisherDid', d->>'publisherDid',
                                          'lifecycleStatus', d->>'lifecycleStatus',
                                          'name', d->>'name', 'version', d->>'version')
                FROM docs
            ),
            searchable AS (
                INSERT INTO entry_search (entry_did, head_seq, publisher_did, entry_type,
                                          lifecycle, name, description, version, tags,
                                          service_types, relationships, custom_metadata,
                                          published_at, updated_at, search)
                SELECT d->>'entryDid', (d->>'sequence')::bigint, d->>'publisherDid',
                       d->>'entryType', d->>'lifecycleStatus', p.name, p.description,
                       p.version, p.tags, p.service_types, p.relationships, p.custom_metadata,
                       p.published_at, p.updated_at, p.search
                FROM docs, LATERAL entry_projection(t) AS p
            )
            INSERT INTO entries (entry_did, head_seq, created_seq, publisher_did, entry_type,
                                 lifecycle)
            SELECT d->>'entryDid', (d->>'sequence')::bigint, (d->>'sequence')::bigint,
                   d->>'publisherDid', d->>'entryType', d->>'lifecycleStatus'
            FROM docs
            """,
            [json.dumps(d, separators=(",", ":"), sort_keys=True) for d in docs],
        )
    await conn.execute("UPDATE log_head SET seq = $1", start + count - 1)
    await conn.execute("ANALYZE entries")
    await conn.execute("ANALYZE entry_search")
    await conn.execute("ANALYZE entry_versions")
