"""Sign-in and sessions (spec 4.6, design §5): challenge, verify, authenticate, logout."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from registry.caches import FollowedCache
from registry.changes import Change, ChangeLog, IdemKey, Outcome
from registry.config import Config
from registry.errors import Invalid, Unauthorized
from registry.identity import IdentityResolver
from registry.keys import SigningKey
from registry.models import ChallengeRequest, VerifyRequest, validate_model
from registry.signin import (
    capabilities_for,
    check_response,
    hash_token,
    new_challenge,
    new_session_token,
    signer_public_key_text,
)
from registry.store import SessionRecord, SessionStore
from registry.usecases.common import Principal, now_ms


class LookupBudget(Protocol):
    """What a session lookup in the database spends (`actors.ratelimiter.SessionLookups`)."""

    def take(self) -> None:
        """Before a lookup: take one, or raise to refuse it."""

    def give_back(self) -> None:
        """After a lookup that found a live session."""


class Sessions:
    def __init__(
        self,
        *,
        store: SessionStore,
        changes: ChangeLog,
        config: Config,
        key: SigningKey,
        identity: IdentityResolver,
        cache: FollowedCache[bytes, SessionRecord],
        clock_ms: Callable[[], int] = now_ms,
        peer_dids: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        self.store = store
        # Federation peers' registry DIDs (granted `federation`); a reload may change them.
        self.peer_dids = peer_dids or (lambda: [p.peer_did for p in config.federation.peers])
        self.changes = changes
        self.config = config
        self.key = key
        self.identity = identity
        self.sessions = cache  # token hash → session
        self.clock_ms = clock_ms
        # Granted `admin` at sign-in and held while listed; a reload (SIGHUP) may change them.
        self.admin_dids = tuple(config.auth.admin_dids)

    @property
    def did(self) -> str:
        return self.key.did

    async def challenge(self, data: Any) -> dict[str, Any]:
        request = validate_model(ChallengeRequest, data, code="invalid_challenge_request")
        auth = self.config.auth
        challenge = new_challenge(
            audience=request.audience,
            origin=self.config.server.public_origin,
            chain_id=auth.chain_id,
            registry_did=self.did,
            root_did=auth.root_did or self.did,
            now_ms=self.clock_ms(),
        )
        await self.store.put_challenge(challenge["nonce"], challenge, challenge["expiresAtMs"])
        return challenge

    async def verify(self, data: Any) -> tuple[dict[str, Any], str]:
        """Check a signed response, open a session. Returns (response body, token)."""
        try:
            request = validate_model(VerifyRequest, data, code="signin_failed")
        except Invalid as exc:  # the spec's verify answers 401 for every failed verification
            raise Unauthorized(
                f"sign-in verification failed: {exc.message}",
                code="signin_failed",
                details=exc.details,
            ) from None
        nonce = request.challenge.nonce
        stored = await self.store.get_challenge(nonce)
        if stored is None:
            raise Unauthorized(
                "sign-in verification failed: unknown or already used challenge",
                code="signin_failed",
                details={"reason": "unknown or already used challenge"},
            )
        signer = check_response(
            stored=stored,
            submitted_challenge=data["challenge"],
            audience=request.audience,
            response=request.response,
            now_ms=self.clock_ms(),
        )
        identity = await self.identity.resolve(signer.did)
        auth = self.config.auth
        expires = self.clock_ms() + auth.session_ttl_seconds * 1000
        session = SessionRecord(
            principal=signer.did,
            hmr_did=identity.hmr_did,
            root_did=identity.root_did,
            root_kind=identity.root_kind,
            capabilities=capabilities_for(
                signer.did,
                defaults=auth.default_capabilities,
                admin_dids=list(self.admin_dids),
                federation_dids=[*auth.federation_dids, *self.peer_dids()],
            ),
            expires_at_ms=expires,
        )
        token, token_hash = new_session_token()
        epoch = self.sessions.epoch
        if not await self.store.open_session(nonce, token_hash, session):
            raise Unauthorized(
                "sign-in verification failed: challenge already used",
                code="signin_failed",
                details={"reason": "challenge already used"},
            )
        # This process knows the session it opened: its first use needs no lookup (nor a token
        # of the address's failed-lookups budget, docs/limits.md "Session tokens").
        self.sessions.put(token_hash, session, epoch)
        body = {
            "expiresAtMs": expires,
            "hmrDid": identity.hmr_did,
            "rootDid": identity.root_did,
            "rootKind": identity.root_kind,
            "sessionExpiresAtMs": expires,
            "sessionToken": token,
            "signerPublicKey": signer_public_key_text(signer.public_key),
            "signerDid": signer.did,
            "capabilities": list(session.capabilities),
        }
        return body, token

    async def authenticate(self, token: str, *, lookups: LookupBudget | None = None) -> Principal:
        """The principal of `token`'s session (`Unauthorized` when there is none, or it has
        expired). A session not in this process's cache is looked up in the database, within
        `lookups` when given: it takes one before the lookup (and may refuse it by raising), and
        has it back when the lookup finds a live session."""
        return await self.recheck_hash(hash_token(token), lookups)

    async def recheck(self, principal: Principal) -> Principal:
        """The principal's session as it stands now (`Unauthorized` once it has expired or been
        revoked): for a long-lived caller, e.g. an event subscription."""
        return await self.recheck_hash(principal.token_hash)

    async def recheck_hash(
        self, token_hash: bytes, lookups: LookupBudget | None = None
    ) -> Principal:
        session = self.sessions.get(token_hash)
        if session is None:
            if lookups is not None:
                lookups.take()
            epoch = self.sessions.epoch
            # Spent unless the lookup finds a live session: a lookup that fails (the database
            # timed out: it may well have run the query) or whose client hangs up has been made.
            session = await self.store.get_session(token_hash)
            if session is not None:
                if lookups is not None and session.expires_at_ms > self.clock_ms():
                    lookups.give_back()  # a live session: the lookup was no guess
                self.sessions.put(token_hash, session, epoch)
        if session is None or session.expires_at_ms <= self.clock_ms():
            raise Unauthorized("session missing, expired or unknown", code="session_invalid")
        capabilities = session.capabilities
        if "admin" in capabilities and session.principal not in self.admin_dids:
            # Granted at sign-in, held only while the DID is listed: a DID taken out of
            # `auth.admin_dids` (reload or restart) loses admin at once, in every session.
            capabilities = tuple(c for c in capabilities if c != "admin")
        return Principal(session.principal, capabilities, session, token_hash)

    async def logout(self, principal: Principal, idem: IdemKey | None) -> Outcome:
        """Revoke the caller's session: a `session.revoked` change (internal: it is never
        published), which every process's cache keeper applies when the log reaches it."""
        token_hash = principal.token_hash.hex()

        async def decide() -> Change:
            return Change(
                "session.revoked", None, {"tokenHash": token_hash}, {"tokenHash": token_hash}
            )

        outcome = await self.changes.submit(idem, decide)
        self.sessions.invalidate(principal.token_hash)
        return outcome


def session_body(principal: Principal) -> dict[str, Any]:
    s = principal.session
    return {
        "expiresAtMs": s.expires_at_ms,
        "hmrDid": s.hmr_did,
        "rootDid": s.root_did,
        "rootKind": s.root_kind,
        "signerDid": s.principal,
        "capabilities": list(principal.capabilities),
    }
