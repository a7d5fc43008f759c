"""Sign-in (design §5: challenge, rendered message, every response check) and configuration
(design §11: TOML file < REGISTRY_<SECTION>__<KEY> environment < command-line overrides)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from registry.canonical import canonicalize
from registry.config import Config, ConfigError, load_config
from registry.did import b58encode
from registry.errors import Unauthorized
from registry.keys import SigningKey, b64url_decode, b64url_encode
from registry.models import SignInResponse
from registry.signin import (
    CHALLENGE_TTL_MS,
    build_response,
    capabilities_for,
    check_response,
    hash_token,
    new_challenge,
    new_session_token,
    render_message,
)

SIGNER = SigningKey(
    bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
)
OTHER = SigningKey(
    bytes.fromhex("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb")
)
REGISTRY_DID = "did:key:z6MkwSD8dBdqcXQzKJZQFPy2hh2izzxskndKCjdmC2dBpfME"
ISSUED_AT = 1_790_000_000_000

CHALLENGE: dict[str, Any] = {
    "version": 1,
    "kind": "siws",
    "audience": "registry-cli",
    "origin": "http://registry.test",
    "chainId": "registry:local",
    "nonce": "00112233445566778899aabbccddeeff",
    "requestId": "0123456789abcdef",
    "issuedAtMs": ISSUED_AT,
    "expiresAtMs": ISSUED_AT + CHALLENGE_TTL_MS,
    "hmrDid": REGISTRY_DID,
    "rootDid": REGISTRY_DID,
}


# --- challenge and message ----------------------------------------------------------------------


def test_new_challenge_has_every_field_of_design_5() -> None:
    challenge = new_challenge(
        audience="registry-cli",
        origin="http://registry.test",
        chain_id="registry:local",
        registry_did=REGISTRY_DID,
        root_did="did:key:z6MktwupdmLXVVqTzCw4i46r4uGyosGXRnR3XjN4Zq7oMMsw",
        now_ms=ISSUED_AT,
    )
    assert challenge.keys() == CHALLENGE.keys()
    assert challenge["version"] == 1
    assert challenge["kind"] == "siws"
    assert challenge["audience"] == "registry-cli"
    assert challenge["origin"] == "http://registry.test"
    assert challenge["chainId"] == "registry:local"
    assert challenge["issuedAtMs"] == ISSUED_AT
    assert challenge["expiresAtMs"] == ISSUED_AT + 5 * 60 * 1000
    assert challenge["hmrDid"] == REGISTRY_DID
    assert challenge["rootDid"] == "did:key:z6MktwupdmLXVVqTzCw4i46r4uGyosGXRnR3XjN4Zq7oMMsw"
    assert len(bytes.fromhex(challenge["nonce"])) == 16  # 128-bit
    assert challenge["requestId"]


def test_every_challenge_has_a_fresh_nonce_and_request_id() -> None:
    made = [
        new_challenge(
            audience="a",
            origin="o",
            chain_id="c",
            registry_did=REGISTRY_DID,
            root_did=REGISTRY_DID,
            now_ms=0,
        )
        for _ in range(50)
    ]
    assert len({c["nonce"] for c in made}) == 50
    assert len({c["requestId"] for c in made}) == 50


def test_message_is_the_documented_template() -> None:
    assert render_message(CHALLENGE, SIGNER.did) == (
        "http://registry.test wants you to sign in to registry "
        "did:key:z6MkwSD8dBdqcXQzKJZQFPy2hh2izzxskndKCjdmC2dBpfME\n"
        "Signer: did:key:z6MktwupdmLXVVqTzCw4i46r4uGyosGXRnR3XjN4Zq7oMMsw\n"
        "Audience: registry-cli\n"
        "Chain ID: registry:local\n"
        "Nonce: 00112233445566778899aabbccddeeff\n"
        "Request ID: 0123456789abcdef\n"
        "Issued At (ms): 1790000000000\n"
        "Expires At (ms): 1790000300000\n"
        "Root: did:key:z6MkwSD8dBdqcXQzKJZQFPy2hh2izzxskndKCjdmC2dBpfME\n"
        "Version: 1"
    )


def test_build_response_fields() -> None:
    response = build_response(CHALLENGE, SIGNER)
    message = render_message(CHALLENGE, SIGNER.did)
    assert response == {
        "kind": "siws",
        "chainId": "registry:local",
        "origin": "http://registry.test",
        "message": message,
        "digest": hashlib.sha256(message.encode()).hexdigest(),
        "transcript": b64url_encode(canonicalize(CHALLENGE)),
        "signature": b64url_encode(SIGNER.sign(message.encode())),
        "signerDid": SIGNER.did,
        "signerPublicKey": b58encode(SIGNER.public_key),
    }
    assert json.loads(b64url_decode(response["transcript"])) == CHALLENGE


# --- check_response -----------------------------------------------------------------------------


@dataclass
class Attempt:
    """Everything check_response sees; a tampering mutates one part of it."""

    submitted: dict[str, Any]
    audience: str
    response: dict[str, str]
    now_ms: int

    def check(self) -> Any:
        return check_response(
            stored=CHALLENGE,
            submitted_challenge=self.submitted,
            audience=self.audience,
            response=SignInResponse.model_validate(self.response),
            now_ms=self.now_ms,
        )


def honest(key: SigningKey = SIGNER) -> Attempt:
    return Attempt(
        submitted=copy.deepcopy(CHALLENGE),
        audience="registry-cli",
        response=build_response(CHALLENGE, key),
        now_ms=ISSUED_AT + 1_000,
    )


@pytest.mark.parametrize("now_ms", [ISSUED_AT, ISSUED_AT + 1_000, ISSUED_AT + CHALLENGE_TTL_MS - 1])
def test_honest_response_verifies_until_the_challenge_expires(now_ms: int) -> None:
    attempt = honest()
    attempt.now_ms = now_ms
    signer = attempt.check()
    assert signer.did == SIGNER.did
    assert signer.public_key == SIGNER.public_key


@pytest.mark.parametrize(
    "form",
    [
        pytest.param(b58encode(SIGNER.public_key), id="raw-base58btc"),
        pytest.param("z" + b58encode(b"\xed\x01" + SIGNER.public_key), id="multibase-multicodec"),
    ],
)
def test_signer_public_key_is_accepted_raw_or_as_multibase(form: str) -> None:
    attempt = honest()
    attempt.response["signerPublicKey"] = form
    assert attempt.check().public_key == SIGNER.public_key


def _set(field: str, value: Any) -> Callable[[Attempt], None]:
    return lambda attempt: attempt.response.__setitem__(field, value)


def _as_other_signer_keeping_the_signature(attempt: Attempt) -> None:
    """An attacker re-renders everything for its own DID but reuses the victim's signature."""
    stolen = attempt.response["signature"]
    attempt.response = build_response(CHALLENGE, OTHER)
    attempt.response["signature"] = stolen


def _flipped_signature(attempt: Attempt) -> None:
    raw = bytearray(b64url_decode(attempt.response["signature"]))
    raw[0] ^= 0x80
    attempt.response["signature"] = b64url_encode(bytes(raw))


TAMPERINGS: list[Any] = [
    pytest.param(
        lambda a: a.submitted.__setitem__("nonce", "ff" * 16),
        "challenge does not match the one issued",
        id="challenge-nonce-altered",
    ),
    pytest.param(
        lambda a: a.submitted.__setitem__("expiresAtMs", ISSUED_AT + 10 * CHALLENGE_TTL_MS),
        "challenge does not match the one issued",
        id="challenge-expiry-extended",
    ),
    pytest.param(
        lambda a: a.submitted.__setitem__("extra", 1),
        "challenge does not match the one issued",
        id="challenge-extra-field",
    ),
    pytest.param(
        lambda a: a.submitted.pop("rootDid"),
        "challenge does not match the one issued",
        id="challenge-field-dropped",
    ),
    pytest.param(
        lambda a: setattr(a, "audience", "another-app"),
        "audience does not match the challenge",
        id="audience",
    ),
    pytest.param(
        _set("chainId", "registry:other"),
        "chainId or origin does not match the challenge",
        id="chainId",
    ),
    pytest.param(
        _set("origin", "http://evil.test"),
        "chainId or origin does not match the challenge",
        id="origin",
    ),
    pytest.param(
        lambda a: setattr(a, "now_ms", CHALLENGE["expiresAtMs"]),
        "challenge expired",
        id="expired-at-expiry",
    ),
    pytest.param(
        lambda a: setattr(a, "now_ms", CHALLENGE["expiresAtMs"] + 3_600_000),
        "challenge expired",
        id="expired-an-hour-ago",
    ),
    pytest.param(
        _set("signerDid", "did:web:example.com"),
        "signerDid is not an Ed25519 did:key",
        id="signerDid-not-did-key",
    ),
    pytest.param(
        _set("signerDid", OTHER.did),
        "signerPublicKey is not the key of signerDid",
        id="signerDid-of-another-key",
    ),
    pytest.param(
        _set("signerPublicKey", b58encode(OTHER.public_key)),
        "signerPublicKey is not the key of signerDid",
        id="signerPublicKey-of-another-key",
    ),
    pytest.param(
        _set("signerPublicKey", "0OIl"),
        "signerPublicKey is not the key of signerDid",
        id="signerPublicKey-not-base58",
    ),
    pytest.param(
        lambda a: a.response.update(
            signerDid=OTHER.did, signerPublicKey=b58encode(OTHER.public_key)
        ),
        "message is not the rendered template",
        id="signer-swapped-message-kept",
    ),
    pytest.param(
        lambda a: a.response.__setitem__("message", a.response["message"] + "\n"),
        "message is not the rendered template",
        id="message",
    ),
    pytest.param(
        _set("digest", "0" * 64),
        "digest is not the SHA-256 of the message",
        id="digest",
    ),
    pytest.param(
        lambda a: a.response.__setitem__(
            "transcript", b64url_encode(canonicalize(dict(CHALLENGE, nonce="ff" * 16)))
        ),
        "transcript is not base64url of JCS(challenge)",
        id="transcript-of-another-challenge",
    ),
    pytest.param(
        lambda a: a.response.__setitem__(
            "transcript", b64url_encode(json.dumps(CHALLENGE).encode())
        ),
        "transcript is not base64url of JCS(challenge)",
        id="transcript-not-canonical",
    ),
    pytest.param(
        _set("signature", "not base64url!"),
        "signature is not base64url",
        id="signature-not-base64url",
    ),
    pytest.param(_flipped_signature, "signature does not verify", id="signature-bit-flipped"),
    pytest.param(
        lambda a: a.response.__setitem__(
            "signature", b64url_encode(b64url_decode(a.response["signature"])[:63])
        ),
        "signature does not verify",
        id="signature-truncated",
    ),
    pytest.param(
        lambda a: a.response.__setitem__(
            "signature", b64url_encode(OTHER.sign(a.response["message"].encode()))
        ),
        "signature does not verify",
        id="signature-by-another-key",
    ),
    pytest.param(
        _as_other_signer_keeping_the_signature,
        "signature does not verify",
        id="signature-reused-by-another-signer",
    ),
]


@pytest.mark.parametrize(("tamper", "reason"), TAMPERINGS)
def test_tampered_sign_in_fails_with_the_specific_reason(
    tamper: Callable[[Attempt], None], reason: str
) -> None:
    attempt = honest()
    tamper(attempt)
    with pytest.raises(Unauthorized) as caught:
        attempt.check()
    assert caught.value.status == 401
    assert caught.value.code == "signin_failed"
    assert caught.value.details == {"reason": reason}
    assert reason in caught.value.message


# --- sessions and capabilities ------------------------------------------------------------------


def test_session_tokens_are_opaque_256_bit_and_stored_as_a_hash() -> None:
    token, digest = new_session_token()
    assert len(b64url_decode(token)) == 32
    assert digest == hashlib.sha256(token.encode()).digest() == hash_token(token)
    assert new_session_token()[0] != token


def test_capabilities_add_federation_and_admin_to_the_defaults() -> None:
    defaults = ["entries.write", "report", "attest", "discover.federated"]
    assert capabilities_for("did:a", defaults=defaults, admin_dids=[], federation_dids=[]) == (
        "entries.write",
        "report",
        "attest",
        "discover.federated",
    )
    assert capabilities_for(
        "did:a", defaults=["report", "report"], admin_dids=["did:a"], federation_dids=["did:a"]
    ) == ("report", "federation", "admin")


# --- configuration ------------------------------------------------------------------------------

ADMIN = "did:key:z6MktwupdmLXVVqTzCw4i46r4uGyosGXRnR3XjN4Zq7oMMsw"
PEER = "did:key:z6MkiaMbhXHNA4eJVCCj8dbzKzTgYDKf6crKgHVHid1F1WCT"

CONFIG_TOML = f"""
[server]
host = "0.0.0.0"
port = 9000
public_origin = "https://registry.example.com"
data_dir = "/var/lib/registry"

[database]
url = "postgresql://registry@db.example.com/registry"

[auth]
admin_dids = ["{ADMIN}"]
session_ttl_seconds = 3600
chain_id = "registry:test"

[limits]
read_per_minute = 10
write_per_minute = 2

[anchoring]
enabled = false
block_interval_seconds = 0.5

[[federation.peers]]
peer_did = "{PEER}"
endpoint = "http://127.0.0.1:8081"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "registry.toml"
    path.write_text(text)
    return path


def config_error(
    path: Path | None = None,
    environ: dict[str, str] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ=environ or {}, overrides=overrides)
    return str(caught.value)


def test_defaults_are_the_configuration_contract() -> None:
    config = load_config(None, environ={})
    assert isinstance(config, Config)
    assert config.server.host == "127.0.0.1"
    assert config.server.port == 8080
    assert config.server.public_origin == "http://127.0.0.1:8080"
    assert config.server.data_dir == Path(".registry")
    assert config.server.key_file == ""
    assert config.server.key_path == Path(".registry") / "registry.key"
    assert config.database.url == ""
    assert config.auth.admin_dids == []
    assert config.auth.session_ttl_seconds == 43200
    assert config.auth.chain_id == "registry:local"
    assert config.auth.identity_resolver_url == ""
    assert config.auth.default_capabilities == [
        "entries.write",
        "report",
        "attest",
        "discover.federated",
    ]
    assert (
        config.limits.read_per_minute,
        config.limits.write_per_minute,
        config.limits.query_per_minute,
        config.limits.max_page_size,
    ) == (1200, 120, 300, 100)
    assert config.anchoring.enabled is True
    assert config.anchoring.batch_size == 256
    assert config.anchoring.block_interval_seconds == 2.0
    assert config.anchoring.finality_depth == 3
    assert config.anchoring.max_attempts == 5
    assert config.federation.peers == []


def test_toml_file_values(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, CONFIG_TOML), environ={})
    assert config.server.host == "0.0.0.0"
    assert config.server.port == 9000
    assert config.server.public_origin == "https://registry.example.com"
    assert config.server.key_path == Path("/var/lib/registry/registry.key")
    assert config.database.url == "postgresql://registry@db.example.com/registry"
    assert config.auth.admin_dids == [ADMIN]
    assert config.auth.session_ttl_seconds == 3600
    assert config.auth.chain_id == "registry:test"
    assert config.limits.read_per_minute == 10
    assert config.limits.write_per_minute == 2
    assert config.limits.query_per_minute == 300  # untouched keys keep their defaults
    assert config.anchoring.enabled is False
    assert config.anchoring.block_interval_seconds == 0.5
    [peer] = config.federation.peers
    assert peer.peer_did == PEER
    assert peer.endpoint == "http://127.0.0.1:8081"
    assert peer.agreement_ids == ["default"]
    assert peer.kinds == ["sync", "discover"]


def test_config_file_named_by_registry_config_variable(tmp_path: Path) -> None:
    path = write(tmp_path, CONFIG_TOML)
    assert load_config(None, environ={"REGISTRY_CONFIG": str(path)}).server.port == 9000


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    environ = {
        "REGISTRY_SERVER__PORT": "9100",
        "REGISTRY_DATABASE__URL": "postgresql://other@127.0.0.1/registry",
        "REGISTRY_ANCHORING__ENABLED": "true",
        "UNRELATED": "ignored",
    }
    config = load_config(write(tmp_path, CONFIG_TOML), environ=environ)
    assert config.server.port == 9100
    assert config.server.host == "0.0.0.0"  # from the file
    assert config.database.url == "postgresql://other@127.0.0.1/registry"
    assert config.anchoring.enabled is True


def test_an_empty_environment_value_is_an_empty_string(tmp_path: Path) -> None:
    """`REGISTRY_DATABASE__URL=` (the embedded default, e.g. in a systemd EnvironmentFile) was
    refused as `not valid JSON (Expecting value)`: an empty value was taken for JSON."""
    environ = {"REGISTRY_DATABASE__URL": "", "REGISTRY_AUTH__ROOT_DID": ""}
    config = load_config(write(tmp_path, CONFIG_TOML), environ=environ)
    assert (config.database.url, config.auth.root_did) == ("", "")


def test_environment_lists_are_json(tmp_path: Path) -> None:
    environ = {
        "REGISTRY_AUTH__ADMIN_DIDS": json.dumps([ADMIN, PEER]),
        "REGISTRY_FEDERATION__PEERS": json.dumps(
            [{"peer_did": PEER, "endpoint": "http://peer.test", "kinds": ["sync"]}]
        ),
    }
    config = load_config(write(tmp_path, CONFIG_TOML), environ=environ)
    assert config.auth.admin_dids == [ADMIN, PEER]
    [peer] = config.federation.peers
    assert (peer.endpoint, peer.kinds, peer.agreement_ids) == (
        "http://peer.test",
        ["sync"],
        ["default"],
    )


def test_overrides_beat_environment_which_beats_file(tmp_path: Path) -> None:
    path = write(tmp_path, CONFIG_TOML)
    environ = {"REGISTRY_SERVER__PORT": "9100", "REGISTRY_SERVER__HOST": "10.0.0.1"}
    config = load_config(
        path, environ=environ, overrides={"server": {"port": 9200, "data_dir": "/srv/reg"}}
    )
    assert config.server.port == 9200  # flag
    assert config.server.host == "10.0.0.1"  # environment
    assert config.server.public_origin == "https://registry.example.com"  # file
    assert config.server.data_dir == Path("/srv/reg")


def test_an_unset_flag_does_not_clear_lower_layers(tmp_path: Path) -> None:
    config = load_config(
        write(tmp_path, CONFIG_TOML),
        environ={"REGISTRY_SERVER__PORT": "9100"},
        overrides={"server": {"port": None, "host": None}},
    )
    assert (config.server.port, config.server.host) == (9100, "0.0.0.0")


def test_environment_is_read_only_from_the_mapping_given(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("REGISTRY_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("REGISTRY_SERVER__PORT", "9999")
    assert load_config(None, environ={}).server.port == 8080
    assert load_config(None).server.port == 9999


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[server]\nbogus = 1\n", "server.bogus"),
        ("[limits]\nreads_per_minute = 5\n", "limits.reads_per_minute"),
        ("[server]\nport = 70000\n", "server.port"),
        ("[server]\nport = -1\n", "server.port"),
        ('[server]\nport = "http"\n', "server.port"),
        ('[auth]\nadmin_dids = ["did:web:example.com"]\n', "auth.admin_dids"),
        (f'[auth]\nadmin_dids = ["{ADMIN}", "nope"]\n', "auth.admin_dids"),
        (f'[auth]\nadmin_dids = "{ADMIN}"\n', "auth.admin_dids"),
        ('[database]\nurl = "mysql://x"\n', "database.url"),
        ('[[federation.peers]]\npeer_did = "did:web:x"\nendpoint = "http://x"\n', "peer_did"),
        (f'[[federation.peers]]\npeer_did = "{PEER}"\n', "endpoint"),
        ("[limits]\nwrite_per_minute = 0\n", "limits.write_per_minute"),
    ],
)
def test_invalid_file_value_names_the_key(tmp_path: Path, toml: str, key: str) -> None:
    message = config_error(write(tmp_path, toml))
    assert key in message


@pytest.mark.parametrize(
    ("environ", "key"),
    [
        ({"REGISTRY_SERVER__PORT": "70000"}, "server.port"),
        ({"REGISTRY_SERVER__PORT": "eighty"}, "server.port"),
        ({"REGISTRY_SERVER__COLOUR": "blue"}, "server.colour"),
        ({"REGISTRY_NOSUCH__KEY": "1"}, "REGISTRY_NOSUCH__KEY"),
        ({"REGISTRY_AUTH__ADMIN_DIDS": '["did:web:example.com"]'}, "auth.admin_dids"),
        ({"REGISTRY_AUTH__ADMIN_DIDS": '["unterminated'}, "REGISTRY_AUTH__ADMIN_DIDS"),
    ],
)
def test_invalid_environment_value_names_the_key(environ: dict[str, str], key: str) -> None:
    assert key in config_error(environ=environ)


def test_invalid_flag_value_names_the_key() -> None:
    assert "server.port" in config_error(overrides={"server": {"port": 65536}})


def test_unreadable_or_malformed_file_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    assert str(missing) in config_error(missing)
    broken = write(tmp_path, "[server\nport = 1\n")
    assert str(broken) in config_error(broken)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[server]\nhost = "caf\xe9"\n')
    assert (
        config_error(latin1)
        == f"{latin1}: not UTF-8 text (byte 20); save it as UTF-8, as TOML requires"
    )
