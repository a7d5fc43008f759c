"""Builders shared by the tests: keys, signed entries, sign-in."""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import uuid
from typing import Any

import pytest

from registry.changes import Change
from registry.entries import sign_entry
from registry.keys import SigningKey
from registry.signin import build_response
from registry.usecases.entries import entry_change


def new_did() -> str:
    return f"did:web:agents.example.com:{secrets.token_hex(8)}"


_VERSIONS = itertools.count(1)


def next_version() -> str:
    """A `version` string no entry of the tests has used: an update that changes content must
    name it anew (a version string names one content forever)."""
    return f"1.{next(_VERSIONS)}.0"


def entry_template(did: str | None = None, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "entryDid": did or new_did(),
        "entryType": "AgentDefinition",
        "itemData": {"model": "m-1", "instructions": "be helpful", "temperature": 0.5},
        "itemSchemaUri": "https://schemas.example.com/agent/v1",
        "registryVersion": "1.0",
        "name": "Helpful agent",
        "publishedAt": "2026-11-01T12:00:00Z",
        "version": "1.0.0",
        "tags": ["demo", "helpful"],
    }
    base.update(fields)
    return base


def signed_entry(key: SigningKey, did: str | None = None, **fields: Any) -> dict[str, Any]:
    return sign_entry(entry_template(did, **fields), key)


def idem(**extra: str) -> dict[str, str]:
    return {"Idempotency-Key": str(uuid.uuid4()), **extra}


async def sign_in(client: Any, key: SigningKey, audience: str = "tests") -> str:
    response = await client.post("/v1/auth/siws/challenge", json={"audience": audience})
    assert response.status_code == 200, await response.get_data()
    challenge = (await response.get_json())["challenge"]
    response = await client.post(
        "/v1/auth/siws/verify",
        json={
            "audience": audience,
            "challenge": challenge,
            "response": build_response(challenge, key),
        },
    )
    assert response.status_code == 200, await response.get_data()
    return str((await response.get_json())["sessionToken"])


def bearer(token: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **extra}


def entry_created(did: str | None = None, *, entry_type: str = "AgentDefinition") -> Change:
    """A minimal `entry.created` change for tests below the HTTP layer (the document is a stub:
    the store writes it as given)."""
    did = did or new_did()
    return entry_change(
        "entry.created",
        did=did,
        expected_head=None,
        publisher="did:web:publisher.example",
        entry_type=entry_type,
        lifecycle="active",
        prefix=f'{{"entryDid":"{did}","sequence":',
        suffix="}",
    )


def system_tool(name: str, package: str) -> str:
    """The path of a system tool a test runs. Missing, the test is skipped on a developer's
    machine (the README's test command installs no system package) and fails in CI, whose
    .ci/run installs it and sets CI_REQUIRE_TOOLS=1."""
    path = shutil.which(name)
    if path is None:
        reason = f"{name} is not installed (Debian package {package}; .ci/run installs it)"
        if os.environ.get("CI_REQUIRE_TOOLS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path
