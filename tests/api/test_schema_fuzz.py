"""Schema fuzzing: Schemathesis against `GET /v1/openapi.json`, every operation, every check.

The service runs as in the other API tests (its own database, an admin DID configured), served by
Hypercorn on a loopback port inside this test's Trio loop. The Schemathesis CLI runs against it as
a subprocess, twice at once, with all checks:

* with an admin session (signed in as `tests.helpers.sign_in` does, so that admin operations get
  past their checks): every phase (examples, coverage, fuzzing, stateful);
* anonymously: every operation fuzzed (a secured one answers 401 before anything else, and a
  public one as in the session run).

Examples per operation are bounded (`_CONFIG`): the test takes about 45 s on two idle cores. It must
report nothing.

What the document cannot say is listed here, with why (`BEYOND_THE_SCHEMA`): a schema-valid
request may still be refused with these codes, so `positive_data_acceptance` is replaced by
`positive_data_acceptance_within_the_schema`, which lets exactly these through. Every other
check is Schemathesis's own.

This module is also the runs' hooks module (`SCHEMATHESIS_HOOKS`): the session run's auth
provider (a fresh session for each logout, which revokes the one it is sent with), unique
`Idempotency-Key`s (a reused key answers before the body is looked at), signatures for
schema-valid entries (so that they are published, not refused for a hash no generator can
guess), and DIDs with `%` escaped in paths (as a client does).

Repeat or widen a run: `REGISTRY_FUZZ_SEED` (the seed is in the output),
`REGISTRY_FUZZ_EXAMPLES` (examples per operation), `REGISTRY_FUZZ_SCENARIOS` (stateful).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from registry.did import is_did
from registry.entries import sign_entry
from registry.keys import SigningKey, b64url_decode, b64url_encode

if TYPE_CHECKING:
    import trio

    from tests.conftest import Harness

HOOKS_MODULE = __name__
SEED = int(os.environ.get("REGISTRY_FUZZ_SEED", "20261123"))
EXAMPLES = int(os.environ.get("REGISTRY_FUZZ_EXAMPLES", "8"))
STATEFUL = int(os.environ.get("REGISTRY_FUZZ_SCENARIOS", "15"))
REPO = Path(__file__).resolve().parents[2]
RUN_DEADLINE_S = 300  # each run (under a minute as configured)

# Refusals of schema-valid requests that depend on what no JSON Schema can say: operation →
# error codes, or `code@field` for one field's (each also said in the document's descriptions).
BEYOND_THE_SCHEMA: dict[str, frozenset[str]] = {
    # The RegistryQL grammar (the schema bounds the text; the parser says where it fails).
    "POST /v1/discover/registryql": frozenset({"invalid_registryql", "invalid_cursor"}),
    # Cursors are opaque, HMAC-bound to the query (or entry) they came from.
    "POST /v1/discover": frozenset({"invalid_cursor", "query_too_complex"}),
    "GET /v1/anchors/{did}": frozenset({"invalid_cursor"}),
    # Signatures, hashes and proofs.
    "POST /v1/attestations": frozenset({"credential_invalid", "proof_invalid", "subject_mismatch"}),
    "POST /v1/transfers/offers": frozenset(
        {
            "signature_invalid",
            "signature_key_mismatch",
            "invalid_expiry",  # a time window
            # The 34-byte value under the did:key digits (the pattern bounds them loosely), or
            # the owner's own DID.
            "offer_invalid@recipientDid",
        }
    ),
    "POST /v1/transfers/offers/{offer_id}/accept": frozenset(
        {
            "item_data_hash_mismatch",
            "signature_invalid",
            "signature_key_mismatch",
            "signature_key_invalid",
            "entry_invalid@entry.entryDid",  # not the offered entry
            "transfer_field_changed",
        }
    ),
    # Another resource: the entry's publisher.
    "POST /v1/admin/bonds": frozenset({"bond_publisher_mismatch"}),
    # Two sizes in order: a sequence within its tree, a prefix no larger than the tree.
    "GET /v1/log/proof/inclusion": frozenset({"invalid_sequence"}),
    "GET /v1/log/proof/consistency": frozenset({"invalid_tree_size"}),
}


def _error_of(response: Any) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def refused_beyond_the_schema(label: str, body: Any, response: Any) -> bool:
    """Whether a 400 to a schema-valid request is one of the refusals the schema cannot
    express (`BEYOND_THE_SCHEMA`), or the known mismatch below."""
    if response.status_code != 400:
        return False
    error = _error_of(response)
    code = error.get("code")
    field = (error.get("details") or {}).get("field")
    allowed = BEYOND_THE_SCHEMA.get(label, frozenset())
    if code in allowed or f"{code}@{field}" in allowed:
        return True
    # JSON Schema cannot tell 1e22 (taken) from 10000000000000000000000 (refused: the I-JSON rule
    # of `registry.canonical`); the document says so where it admits such numbers.
    if code == "invalid_json" and (error.get("details") or {}).get("rule") == "unsafe_integer":
        return _has_a_long_integer(body)
    return False


def _has_a_long_integer(value: Any) -> bool:
    """Whether `value` holds an integer beyond ±(2^53−1) that is sent as digits alone."""
    if isinstance(value, dict):
        return any(_has_a_long_integer(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_a_long_integer(v) for v in value)
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53 - 1


# --- the hooks (loaded by the Schemathesis CLI as SCHEMATHESIS_HOOKS) --------------------------


def _sign_in_over_http(base_url: str, key: SigningKey) -> str:
    """`tests.helpers.sign_in`, over HTTP: a fresh session of `key`."""
    import requests

    from registry.signin import build_response

    with requests.Session() as http:
        answer = http.post(f"{base_url}/v1/auth/siws/challenge", json={"audience": "fuzz"})
        answer.raise_for_status()
        challenge = answer.json()["challenge"]
        answer = http.post(
            f"{base_url}/v1/auth/siws/verify",
            json={
                "audience": "fuzz",
                "challenge": challenge,
                "response": build_response(challenge, key),
            },
        )
        answer.raise_for_status()
        return str(answer.json()["sessionToken"])


_IDEMPOTENCY_KEY = re.compile(r"[!-~]{1,255}")


def _register_hooks() -> None:
    import schemathesis
    from schemathesis.openapi.checks import RejectedPositiveData
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    base_url = os.environ["REGISTRY_FUZZ_URL"]
    seed = os.environ.get("REGISTRY_FUZZ_KEY")
    key = SigningKey(b64url_decode(seed)) if seed else None
    token = os.environ.get("REGISTRY_FUZZ_TOKEN")
    published: dict[str, str] = {}  # a DID as a link hands it on → the DID

    @schemathesis.check
    def positive_data_acceptance_within_the_schema(
        ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
    ) -> bool | None:
        """`positive_data_acceptance`, but for the refusals of `BEYOND_THE_SCHEMA`."""
        try:
            return positive_data_acceptance(ctx, response, case)
        except RejectedPositiveData:
            if refused_beyond_the_schema(case.operation.label, case.body, response):
                return None
            raise

    @schemathesis.hook
    def before_call(context: Any, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
        headers = case.headers
        if headers is not None:
            value = headers.get("Idempotency-Key")
            if isinstance(value, str) and _IDEMPOTENCY_KEY.fullmatch(value):
                headers["Idempotency-Key"] = uuid.uuid4().hex
        meta = case.meta
        positive = meta is not None and meta.generation.mode.is_positive
        label = case.operation.label
        body = case.body
        if key is not None and positive and isinstance(body, dict) and "itemData" in body:
            if label == "PUT /v1/entries/{did}" and isinstance(body.get("entryDid"), str):
                # The path names the entry the body is a version of (400 when they differ).
                case.path_parameters = {**(case.path_parameters or {}), "did": body["entryDid"]}
            if label in ("POST /v1/entries", "PUT /v1/entries/{did}"):
                case.body = sign_entry(body, key)
        did = (case.path_parameters or {}).get("did")
        if isinstance(did, str):
            # A DID may hold `%XX`. Schemathesis takes such a path value as already escaped
            # (and one from a link arrives decoded and escaped again, lossily): a client
            # escapes the `%` of a DID it puts in a path.
            did = published.get(did, did)
            if "%" in did and is_did(did):
                path = {**(case.path_parameters or {}), "did": quote(did, safe=":")}
                case.path_parameters = path

    @schemathesis.hook
    def after_call(context: Any, case: schemathesis.Case, response: schemathesis.Response) -> None:
        if 200 <= response.status_code < 300:
            try:
                body = response.json()
            except ValueError:
                return
            did = body.get("entryDid") if isinstance(body, dict) else None
            if isinstance(did, str) and "%" in did:
                published[quote(unquote(did), safe="")] = did

    if key is None or token is None:
        return

    @schemathesis.auth(refresh_interval=None, retry_on=[])
    class AdminSession:
        """The admin's session; a logout gets one of its own (it revokes what it is sent)."""

        def get(self, case: schemathesis.Case, ctx: Any) -> str:
            assert key is not None
            assert token is not None
            if case.operation.label == "POST /v1/auth/logout":
                return _sign_in_over_http(base_url, key)
            return token

        def set(self, case: schemathesis.Case, data: str, ctx: Any) -> None:
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


if os.environ.get("SCHEMATHESIS_HOOKS") == HOOKS_MODULE:
    _register_hooks()


# --- the test ----------------------------------------------------------------------------------

# Both runs: every check (positive_data_acceptance as above), a fixed seed, no example database.
_CONFIG = """
seed = {seed}
workers = 1
request-timeout = 20
color = false

[generation]
max-examples = {examples}
database = "none"

[checks]
positive_data_acceptance.enabled = false
{extra}
"""
# Anonymous: every operation, fuzzed. A secured one answers 401 before it reads anything else,
# and a public one behaves as in the session run, which covers both fully; with no session
# nothing can be created, so there is no state to explore.
_ANONYMOUS = """
[phases]
examples.enabled = false
coverage.enabled = false
stateful.enabled = false

[[operations]]
include-by = "/security/0/bearer == []"
generation.max-examples = 2
"""
# The admin session: all phases. Coverage (boundary values of every constraint) of the entry
# bodies is positive only (their refusals are one validator's, which fuzzing's negative cases
# reach); an accept finds no offer (404) before it reads the entry, so it is only fuzzed.
_ADMIN = """
[phases.stateful]
max-steps = 8
generation.max-examples = {stateful}

[[operations]]
include-operation-id = ["create_entry", "update_entry"]
phases.coverage.generation.mode = "positive"

[[operations]]
include-operation-id = "accept_transfer_offer"
phases.coverage.enabled = false
"""


def _command(url: str, config: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "run",
        f"{url}/v1/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",
        "--output-truncate",
        "false",
    ]


async def test_schema_fuzzing_finds_nothing(database_url: str, tmp_path: Path) -> None:
    from tests.api.api_support import with_harness
    from tests.conftest import make_config

    admin = SigningKey.generate()
    results: dict[str, tuple[int, str, float]] = {}
    async with _own_database(database_url) as url:
        config = make_config(url, tmp_path, auth={"admin_dids": [admin.did]})
        await with_harness(config, lambda h: _fuzz(h, admin, tmp_path, results))
    for name, (code, output, seconds) in sorted(results.items()):
        print(f"--- {name} run: exit {code} in {seconds:.0f}s (seed {SEED})\n{output}")
    failed = {name: out for name, (code, out, _) in results.items() if code != 0}
    assert not failed, "\n\n".join(f"=== {n} run ===\n{o}" for n, o in failed.items())


async def _fuzz(
    h: Harness, admin: SigningKey, tmp_path: Path, results: dict[str, tuple[int, str, float]]
) -> None:
    """Serve the harness's app over HTTP and run both fuzzing runs against it."""
    import time

    import hypercorn.trio
    import trio
    from hypercorn.config import Config as HyperConfig

    from tests.helpers import sign_in

    hyper = HyperConfig()
    hyper.bind = ["127.0.0.1:0"]
    hyper.accesslog = None
    stop = trio.Event()

    async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
        await hypercorn.trio.serve(
            h.service.app, hyper, shutdown_trigger=stop.wait, task_status=task_status
        )

    async def run(base_url: str, name: str, env: dict[str, str], extra: str) -> None:
        config_file = tmp_path / f"{name}.toml"
        config_file.write_text(_CONFIG.format(seed=SEED, examples=EXAMPLES, extra=extra))
        started = time.monotonic()
        with trio.fail_after(RUN_DEADLINE_S):
            done = await trio.run_process(
                _command(base_url, config_file),
                capture_stdout=True,
                stderr=subprocess.STDOUT,
                check=False,
                cwd=tmp_path,
                env={
                    **os.environ,
                    "PYTHONPATH": str(REPO),
                    "SCHEMATHESIS_HOOKS": HOOKS_MODULE,
                    "REGISTRY_FUZZ_URL": base_url,
                    "NO_COLOR": "1",
                    **env,
                },
            )
        output = done.stdout.decode("utf-8", "replace")
        results[name] = (done.returncode, output, time.monotonic() - started)

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(serve)
        base_url = binds[0]
        token = await sign_in(h.client, admin)
        try:
            async with trio.open_nursery() as runs:
                runs.start_soon(run, base_url, "anonymous", {}, _ANONYMOUS)
                session = {
                    "REGISTRY_FUZZ_KEY": b64url_encode(admin.seed),
                    "REGISTRY_FUZZ_TOKEN": token,
                }
                runs.start_soon(run, base_url, "admin", session, _ADMIN.format(stateful=STATEFUL))
        finally:
            stop.set()


class _own_database:
    """A database of its own on the test server (the fuzzer writes a lot); the session's
    database when one cannot be created there."""

    def __init__(self, database_url: str) -> None:
        self.admin_url = database_url
        self.url = database_url
        self.name: str | None = None

    async def __aenter__(self) -> str:
        import secrets

        import trio

        from registry.store.migrate import load_migrations

        self.name = f"registry_fuzz_{secrets.token_hex(4)}"
        try:
            await trio.to_thread.run_sync(self._admin, f"CREATE DATABASE {self.name}")
        except Exception:
            self.name = None
            return self.url
        self.url = urlunsplit(urlsplit(self.admin_url)._replace(path="/" + self.name))
        await trio.to_thread.run_sync(_migrate, self.url, load_migrations())
        return self.url

    async def __aexit__(self, *exc: object) -> None:
        import trio

        if self.name is not None:
            await trio.to_thread.run_sync(
                self._admin, f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)"
            )

    def _admin(self, sql: str) -> None:
        import asyncio

        import asyncpg

        async def go() -> None:
            conn = await asyncpg.connect(self.admin_url)
            try:
                await conn.execute(sql)
            finally:
                await conn.close()

        asyncio.run(go())


def _migrate(url: str, migrations: Any) -> None:
    import asyncio

    from registry.store.migrate import _migrate as migrate

    asyncio.run(migrate(url, migrations))


# --- what the fuzzing found, pinned ------------------------------------------------------------


def test_the_document_says_what_fuzzing_found_it_did_not() -> None:
    """The findings of issue 8, as the document now says them."""
    from api.app import route_table
    from api.openapi import openapi_document

    doc = openapi_document(route_table())
    paths, schemas = doc["paths"], doc["components"]["schemas"]
    # 400s it did not list
    assert "400" in paths["/v1/entries/{did}/versions/{sequence}"]["get"]["responses"]
    assert "400" in paths["/v1/auth/siws/verify"]["post"]["responses"]
    # requests it called valid that the service refuses
    for path in ("/v1/entries/{did}/versions", "/v1/admin/reports", "/v1/anchors/{did}"):
        item = next(iter(paths[path].values()))
        limit = next(p for p in item["parameters"] if p["name"] == "limit")
        assert limit["schema"]["format"] == "int64", path  # spec 4.1; any is clamped
    publisher = schemas["DiscoverRequest"]["properties"]["publisherDid"]["anyOf"][0]
    assert not re.search(publisher["pattern"], "")
    assert schemas["RegistryQLRequest"]["properties"]["query"]["minLength"] == 1
    audience = schemas["ChallengeRequest"]["properties"]["audience"]
    assert not re.search(audience["pattern"], "a\nNonce: forged")
    # unknown members are refused, and the document says so
    for name in ("DiscoverRequest", "RegistryQLRequest", "NewRegistryEntry", "BondRequest"):
        assert schemas[name]["additionalProperties"] is False, name


async def test_what_fuzzing_found_answers_as_documented(harness: Harness) -> None:
    from tests.api.api_support import anon_client, error_of

    client = anon_client(harness)
    r = await client.post("/v1/auth/siws/verify")
    await error_of(r, 400, "invalid_json")
    r = await client.get(f"/v1/entries/did:web:x/versions?limit={2**63}")  # beyond int64
    await error_of(r, 400, "invalid_limit")
    r = await client.get(f"/v1/entries/did:web:x/versions?limit={2**53 - 1}")
    await error_of(r, 404, "entry_not_found")
    # A date rounding past the last microsecond Python holds was a 500.
    r = await client.post("/v1/discover", json={"publishedAfter": "9999-12-31T23:59:59.9999999Z"})
    await error_of(r, 400, "invalid_query")
    # An offset PostgreSQL cannot store is refused as the document says (it was the database's).
    r = await client.post("/v1/discover", json={"updatedBefore": "2026-01-01T00:00:00+16:00"})
    await error_of(r, 400, "invalid_query")
    # A whole number is an integer however it is written (JSON Schema, JCS).
    r = await client.post("/v1/discover", json={"limit": 5.0, "offset": 0.0})
    assert r.status_code == 200, await r.get_data()


async def test_an_answer_sent_before_the_body_is_read_closes_the_connection(
    harness: Harness,
) -> None:
    """Hypercorn cannot reuse such a connection: a client that sent its next request on it
    waited forever (fuzzing's unsupported methods with a body, on a kept-alive connection)."""
    from tests.api.api_support import anon_client

    client = anon_client(harness)
    for method, path in (("PATCH", "/v1/entries"), ("POST", "/v1/nowhere"), ("GET", "/v1/health")):
        r = await client.open(path, method=method, data=b"{}", headers={"Content-Length": "2"})
        assert r.headers.get("Connection") == "close", (method, path, r.status_code)
    r = await client.post("/v1/discover", json={})
    assert r.status_code == 200
    assert "Connection" not in r.headers
    r = await client.get("/v1/health")
    assert "Connection" not in r.headers
