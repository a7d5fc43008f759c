"""Ed25519 signing keys and their key files.

Key file: JSON `{"type": "Ed25519", "did": "did:key:z…", "seed": base64url(32-byte seed)}`,
written with mode 0600.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nacl.exceptions
import nacl.signing

from registry.did import did_key_from_public_key, key_id_for


def b64url_encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    """Strict base64url without padding; `ValueError` on anything else."""
    if not isinstance(text, str) or "=" in text or not text.isascii():
        raise ValueError("not unpadded base64url")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as exc:
        raise ValueError("not unpadded base64url") from exc
    if b64url_encode(raw) != text:
        raise ValueError("not canonical base64url")
    return raw


@dataclass(frozen=True)
class SigningKey:
    """An Ed25519 private key with its did:key identity."""

    seed: bytes

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(bytes(nacl.signing.SigningKey.generate()))

    @property
    def _nacl(self) -> nacl.signing.SigningKey:
        return nacl.signing.SigningKey(self.seed)

    @property
    def public_key(self) -> bytes:
        return bytes(self._nacl.verify_key)

    @property
    def did(self) -> str:
        return did_key_from_public_key(self.public_key)

    @property
    def key_id(self) -> str:
        return key_id_for(self.did)

    def sign(self, message: bytes) -> bytes:
        return bytes(self._nacl.sign(message).signature)

    def to_json(self) -> dict[str, str]:
        return {"type": "Ed25519", "did": self.did, "seed": b64url_encode(self.seed)}


def verify(public_key: bytes, message: bytes, signature: bytes) -> bool:
    try:
        nacl.signing.VerifyKey(public_key).verify(message, signature)
    except (nacl.exceptions.BadSignatureError, ValueError, TypeError):
        return False
    return True


class KeyFileError(Exception):
    """A key file is missing, unreadable or malformed."""


def write_key_file(path: Path, key: SigningKey) -> None:
    """Write a key file with mode 0600, refusing to overwrite an existing one.

    The file appears whole or not at all: written and synced under a temporary name, then
    linked to `path` (which fails if it exists). Created in place, it was there empty while it
    was written, so a crash or a full disk left an empty key file (which the next start, or
    `keygen`, refused), and a second process starting at the same moment read it half-written.
    """
    text = json.dumps(key.to_json()) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)  # mode 0600
    try:
        _write_synced(fd, text)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: create it in place
            _write_synced(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), text)
    finally:
        os.unlink(tmp)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the new name survives a crash too
    finally:
        os.close(directory)


def _write_synced(fd: int, text: str) -> None:
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def read_key_file(path: Path) -> SigningKey:
    try:
        data = json.loads(path.read_text())
        if data.get("type") != "Ed25519":
            raise KeyFileError(f"{path}: type must be Ed25519")
        seed = b64url_decode(data["seed"])
        if len(seed) != 32:
            raise KeyFileError(f"{path}: seed must be 32 bytes")
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise KeyFileError(f"{path}: {exc}") from exc
    key = SigningKey(seed)
    if data.get("did") not in (None, key.did):
        raise KeyFileError(f"{path}: did does not match the seed")
    return key


def load_or_create_key(path: Path) -> tuple[SigningKey, bool]:
    """The key at `path`, created on first use. Returns (key, created)."""
    try:
        return read_key_file(path), False
    except KeyFileError:
        if path.exists():
            raise
    key = SigningKey.generate()
    try:
        write_key_file(path, key)
    except FileExistsError:  # another process created it first
        return read_key_file(path), False
    return key, True
