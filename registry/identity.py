"""Identity lookup port: maps a verified signer to (rootDid, rootKind, hmrDid) (design §5).

The built-in resolver maps a did:key signer to itself (`rootKind` "key"). An HTTP resolver
(`api.identity.HttpIdentityResolver`) plugs into the same port; its failure is a 502.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Identity:
    root_did: str
    root_kind: str
    hmr_did: str


class IdentityResolver(Protocol):
    async def resolve(self, signer_did: str) -> Identity:
        """Raise `registry.errors.UpstreamFailed` when the lookup cannot be made."""
        ...


class DidKeyIdentity:
    """Built-in: every did:key signer is its own root."""

    async def resolve(self, signer_did: str) -> Identity:
        return Identity(root_did=signer_did, root_kind="key", hmr_did=signer_did)
