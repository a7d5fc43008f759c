"""Use-cases: publish, update, delete and read entries; sign in; sessions.

Pure decisions live in `registry.entries` and `registry.signin`; this module sequences them around
the store. It knows nothing of HTTP: callers pass parsed JSON and a principal, and get domain
values or `registry.errors` back.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

import trio

from registry import entries as entry_rules
from registry.canonical import canonicalize
from registry.config import Config
from registry.discovery import CursorCodec
from registry.errors import Conflict, Forbidden, Invalid, NotFound, Unauthorized
from registry.identity import IdentityResolver
from registry.keys import SigningKey
from registry.matching import Facts, facts_of, match_texts_in, may_match
from registry.models import ChallengeRequest, VerifyRequest, validate_model
from registry.query import RegistryQuery
from registry.signin import (
    capabilities_for,
    check_response,
    hash_token,
    new_challenge,
    new_session_token,
    signer_public_key_text,
)
from registry.store import EntryHead, EntryWrite, IdemKey, SessionRecord, Store
from registry.store.discover import COUNT_CAP, compile_discover

log = logging.getLogger(__name__)

WriteEntry = Callable[[EntryWrite, IdemKey | None], Awaitable[tuple[int | None, str, int | None]]]


def rfc3339(ms: int) -> str:
    return (
        datetime.fromtimestamp(ms / 1000, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class Principal:
    """Who is calling: a session's identity and capabilities."""

    did: str
    capabilities: tuple[str, ...]
    session: SessionRecord
    token_hash: bytes

    def require(self, capability: str) -> None:
        if capability not in self.capabilities:
            raise Forbidden(
                f"this session lacks the {capability!r} capability",
                code="capability_missing",
                details={"capability": capability},
            )


@dataclass(frozen=True)
class Served:
    """A served entry version: its sequence and exact JSON text.

    `replayed` is the recorded HTTP status when the request's Idempotency-Key had already
    completed: then `doc` is the recorded response and nothing was written.
    """

    sequence: int
    doc: str
    replayed: int | None = None


K = TypeVar("K")
V = TypeVar("V")


class FollowedCache(Generic[K, V]):
    """An in-process cache kept true by the log follower (LISTEN/NOTIFY from every process).

    Readers fill it only if no invalidation happened while they read (`epoch`), so a change that
    commits during a lookup can never be overwritten by the older value. It is on only while the
    follower is connected. All access is from the one Trio thread, with no `await` between a
    check and its use. Bounded: the least recently used item goes when it is full.
    """

    def __init__(self, capacity: int = 50_000) -> None:
        self._items: OrderedDict[K, V] = OrderedDict()
        self._capacity = capacity
        self.epoch = 0
        self.enabled = False

    def get(self, key: K) -> V | None:
        if not self.enabled:
            return None
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V, epoch: int) -> None:
        if not self.enabled or epoch != self.epoch:
            return
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def invalidate(self, key: K) -> None:
        self.epoch += 1
        self._items.pop(key, None)

    def touch(self) -> None:
        """A change committed: reads in flight may predate it, so their fills are dropped."""
        self.epoch += 1

    def invalidate_where(self, stale: Callable[[K, V], bool]) -> None:
        self.epoch += 1
        for key in [k for k, v in self._items.items() if stale(k, v)]:
            del self._items[key]

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self.epoch += 1
        self._items.clear()

    def statistics(self) -> dict[str, int]:
        return {"size": len(self._items), "epoch": self.epoch, "enabled": int(self.enabled)}


class ResultCache(FollowedCache[str, tuple[RegistryQuery, str]]):
    """Discovery pages by query. An entry change drops only the pages whose query the entry may
    match before or after it (`registry.matching`): any other page is provably unchanged."""

    def entry_changed(self, versions: Sequence[Facts | None]) -> None:
        """`versions`: the facts of the entry's stored documents just before and after the
        change (a new entry has only the latter)."""
        self.invalidate_where(lambda _key, page: any(may_match(page[0], f) for f in versions))

    def entry_changed_as_told(
        self, versions: list[tuple[str, list[str]]] | None, texts: list[str]
    ) -> bool:
        """`entry_changed` for `versions` as `Store.change_versions` reads them (each document
        with those of the asked MATCH `texts` it matches); False, dropping nothing, if there
        are none."""
        if not versions:
            return False
        self.entry_changed([facts_of(doc, asked=texts, matched=m) for doc, m in versions])
        return True

    def match_texts(self) -> set[str]:
        """The MATCH texts of the cached queries (the database decides those per change)."""
        return {t for query, _ in self._items.values() for t in match_texts_in(query.where)}


class Registry:
    """The service's use-cases over a `Store`."""

    def __init__(
        self,
        *,
        store: Store,
        config: Config,
        key: SigningKey,
        identity: IdentityResolver,
        clock_ms: Callable[[], int] = now_ms,
        write_entry: WriteEntry | None = None,
    ) -> None:
        self.store = store
        # Entry changes go through the group-commit writer when one runs (actors.writer).
        self.write_entry: WriteEntry = write_entry or store.write_entry
        self.config = config
        self.key = key
        self.identity = identity
        self.clock_ms = clock_ms
        self.cursors = CursorCodec(key.seed)
        self.cache: FollowedCache[str, Served] = FollowedCache()  # entry DID → head
        self.sessions: FollowedCache[bytes, SessionRecord] = FollowedCache()  # token hash
        # Discovery pages by query, dropped by the changes that can move them.
        self.results = ResultCache(max(1, config.limits.discover_cache_entries))
        self._computing: dict[str, trio.Event] = {}  # discovery pages being computed

    @property
    def did(self) -> str:
        return self.key.did

    # --- entries ------------------------------------------------------------------------

    async def create_entry(self, principal: Principal, data: Any, idem: IdemKey | None) -> Served:
        principal.require("entries.write")
        entry = entry_rules.check_entry(data)
        self._check_publisher(principal, entry.publisher)
        if entry.lifecycle not in entry_rules.CREATE_STATES:
            raise Invalid(
                "a new entry starts as draft or active",
                code="entry_invalid",
                details={"field": "lifecycleStatus"},
            )
        return await self._write(
            "entry.created", entry, expected_head=None, status=201, idem=idem, previous=None
        )

    async def update_entry(
        self, principal: Principal, did: str, data: Any, idem: IdemKey | None
    ) -> Served:
        principal.require("entries.write")
        entry = entry_rules.check_entry(data)
        if entry.did != did:
            raise Invalid(
                "entryDid in the body is not the DID in the path",
                code="entry_invalid",
                details={"field": "entryDid"},
            )
        if entry.based_on is None:
            raise Invalid(
                "an update carries the sequence of the version it is based on",
                code="sequence_required",
                details={"field": "sequence"},
            )
        head = await self._live_head(did)
        self._check_publisher(principal, entry.publisher)
        if head.publisher_did != principal.did:
            raise Forbidden("only the entry's publisher may update it", code="publisher_mismatch")
        if entry.based_on != head.head_seq:
            raise Conflict(
                "the entry changed since the version this update is based on",
                code="sequence_conflict",
                details={"latestSequence": head.head_seq},
            )
        entry_rules.check_move(head.lifecycle, entry.lifecycle)
        return await self._write(
            "entry.updated",
            entry,
            expected_head=head.head_seq,
            status=200,
            idem=idem,
            previous=head.doc,
        )

    async def delete_entry(self, principal: Principal, did: str, idem: IdemKey | None) -> Served:
        """Write a tombstone version; afterwards the DID reads as 404 and is never reused."""
        head = await self._live_head(did)
        if head.publisher_did != principal.did and "admin" not in principal.capabilities:
            raise Forbidden("only the entry's publisher may delete it", code="publisher_mismatch")
        if "admin" not in principal.capabilities:
            principal.require("entries.write")
        at = rfc3339(self.clock_ms())
        prefix = (
            '{"deletedAt":'
            + _json_str(at)
            + ',"entryDid":'
            + _json_str(did)
            + ',"lifecycleStatus":"deleted","sequence":'
        )
        write = EntryWrite(
            kind="entry.deleted",
            entry_did=did,
            expected_head=head.head_seq,
            publisher_did=head.publisher_did,
            entry_type=_entry_type(head.doc),
            lifecycle="deleted",
            prefix=prefix,
            suffix="}",
            status=200,
        )
        return await self._written(did, head.doc, *await self.write_entry(write, idem))

    async def get_entry(self, did: str) -> Served:
        cached = self.cache.get(did)
        if cached is not None:
            return cached
        epoch = self.cache.epoch
        head = await self._live_head(did)
        served = Served(head.head_seq, head.doc)
        self.cache.put(did, served, epoch)
        return served

    async def list_versions(
        self, did: str, *, limit: int | None, cursor: str | None
    ) -> tuple[list[str], str | None, bool, int]:
        await self._live_head(did)
        size = self.page_size(limit)
        before = None
        if cursor is not None:
            before = parse_sequence(cursor)
            if before is None:
                raise Invalid(
                    "cursor must be a sequence from a previous page", code="invalid_cursor"
                )
        docs, total = await self.store.list_versions(did, before, size + 1)
        has_more = len(docs) > size
        docs = docs[:size]
        next_cursor = str(_sequence_of(docs[-1])) if has_more and docs else None
        return docs, next_cursor, has_more, total

    async def get_version(self, did: str, sequence: int) -> str:
        await self._live_head(did)
        doc = await self.store.get_version(did, sequence)
        if doc is None:
            raise NotFound("no such version of this entry", code="version_not_found")
        return doc

    def page_size(self, limit: int | None) -> int:
        if limit is None:
            return self.config.limits.default_page_size
        if limit < 1:
            raise Invalid("limit must be at least 1", code="invalid_limit")
        return min(limit, self.config.limits.max_page_size)

    async def _live_head(self, did: str) -> EntryHead:
        head = await self.store.get_entry_head(did)
        if head is None or head.lifecycle == "deleted":
            raise NotFound("entry not found", code="entry_not_found", details={"entryDid": did})
        return head

    @staticmethod
    def _check_publisher(principal: Principal, publisher: str) -> None:
        if publisher != principal.did:
            raise Forbidden(
                "publisherDid is not the signed-in principal",
                code="publisher_mismatch",
                details={"publisherDid": publisher, "principal": principal.did},
            )

    async def _write(
        self,
        kind: str,
        entry: entry_rules.CheckedEntry,
        *,
        expected_head: int | None,
        status: int,
        idem: IdemKey | None,
        previous: str | None,
    ) -> Served:
        """Write a version of `entry`; `previous` is the head it replaces (None: a new entry)."""
        at = rfc3339(self.clock_ms())
        form = entry_rules.stored_form(
            entry.doc, updated_at=at, signature_created=at, members=entry.members
        )
        write = EntryWrite(
            kind=kind,
            entry_did=entry.did,
            expected_head=expected_head,
            publisher_did=entry.publisher,
            entry_type=entry.model.entry_type,
            lifecycle=entry.lifecycle,
            prefix=form.prefix,
            suffix=form.suffix,
            status=status,
        )
        return await self._written(entry.did, previous, *await self.write_entry(write, idem))

    async def _written(
        self, did: str, previous: str | None, seq: int | None, doc: str, replayed: int | None
    ) -> Served:
        """The answer to an entry write, once this process's caches have let go of what it
        changed, so the writer reads its own write (the log follower does the same for every
        process when the notification arrives)."""
        if seq is None:
            assert replayed is not None
            return Served(0, doc, replayed)
        self.cache.invalidate(did)
        versions = [doc] if previous is None else [previous, doc]
        texts = sorted(self.results.match_texts())
        decided = False
        try:
            if texts:
                # Cached full-text pages: the database says which texts the versions match.
                self.results.touch()
                found = await self.store.change_versions([(seq, did)], texts)
                decided = self.results.entry_changed_as_told(found.get(seq), texts)
        except Exception:  # the write has committed: answer it whatever this check meets
            log.warning("full-text check of a change failed; its pages are dropped", exc_info=True)
        finally:
            if not decided:  # also when cancelled: no await here
                self.results.entry_changed([facts_of(v) for v in versions])
        return Served(seq, doc)

    # --- discovery ----------------------------------------------------------------------

    async def discover(self, query: RegistryQuery) -> str:
        """One page of results as JSON text: {entries, cursor?, hasMore, totalCount}."""
        body, _ = await self.discover_page(query)
        return body

    async def discover_page(self, query: RegistryQuery) -> tuple[str, bool]:
        """`discover`'s page, and whether it came from the result cache.

        Concurrent misses of one query are computed once: the others wait for that answer (a
        popular page dropped by a change would otherwise be recomputed by every request that
        arrives meanwhile), and compute it themselves only if it could not be cached."""
        caching = self.config.limits.discover_cache_entries > 0
        key = repr(query)
        if caching:
            cached = self.results.get(key)
            if cached is not None:
                return cached[1], True
            pending = self._computing.get(key)
            if pending is not None:
                await pending.wait()
                cached = self.results.get(key)
                if cached is not None:
                    return cached[1], True
        epoch = self.results.epoch
        leading = caching and key not in self._computing
        if leading:
            done = self._computing[key] = trio.Event()
        try:
            body = await self._discover(query)
            if caching:
                self.results.put(key, (query, body), epoch)
        finally:
            if leading:
                del self._computing[key]
                done.set()
        return body, False

    async def _discover(self, query: RegistryQuery) -> str:
        size = self.page_size(query.limit)
        after = self.cursors.decode(query, query.cursor) if query.cursor else None
        plan = compile_discover(query, limit=size, after=after)
        rows, total = await self.store.discover(plan)
        has_more = len(rows) > size
        rows = rows[:size]
        body = '{"entries":[' + ",".join(doc for doc, _ in rows) + "]"
        if has_more:
            body += ',"cursor":' + _json_str(self.cursors.encode(query, rows[-1][1]))
        body += f',"hasMore":{"true" if has_more else "false"}'
        body += f',"totalCount":{min(total, COUNT_CAP)}'
        if total > COUNT_CAP:  # counted up to the cap: "at least COUNT_CAP"
            body += ',"totalCountExact":false'
        return body + "}"

    # --- sign-in and sessions -----------------------------------------------------------

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
                admin_dids=auth.admin_dids,
                federation_dids=auth.federation_dids,
            ),
            expires_at_ms=expires,
        )
        token, token_hash = new_session_token()
        if not await self.store.open_session(nonce, token_hash, session):
            raise Unauthorized(
                "sign-in verification failed: challenge already used",
                code="signin_failed",
                details={"reason": "challenge already used"},
            )
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

    async def authenticate(self, token: str) -> Principal:
        token_hash = hash_token(token)
        session = self.sessions.get(token_hash)
        if session is None:
            epoch = self.sessions.epoch
            session = await self.store.get_session(token_hash)
            if session is not None:
                self.sessions.put(token_hash, session, epoch)
        if session is None or session.expires_at_ms <= self.clock_ms():
            raise Unauthorized("session missing, expired or unknown", code="session_invalid")
        return Principal(session.principal, session.capabilities, session, token_hash)

    async def logout(self, principal: Principal) -> None:
        await self.store.revoke_session(principal.token_hash)  # notifies every process
        self.sessions.invalidate(principal.token_hash)


def session_body(principal: Principal) -> dict[str, Any]:
    s = principal.session
    return {
        "expiresAtMs": s.expires_at_ms,
        "hmrDid": s.hmr_did,
        "rootDid": s.root_did,
        "rootKind": s.root_kind,
        "signerDid": s.principal,
        "capabilities": list(s.capabilities),
    }


MAX_SEQUENCE = 2**63 - 1


def parse_sequence(text: str) -> int | None:
    """A registry sequence from text (`^[1-9][0-9]*$`, at most int64); None when it is not one."""
    if not text.isascii() or not text.isdigit() or text.startswith("0") or len(text) > 19:
        return None
    value = int(text)
    return value if value <= MAX_SEQUENCE else None


def _json_str(text: str) -> str:
    return canonicalize(text).decode()


def _entry_type(doc: str) -> str:
    return str(json.loads(doc).get("entryType", ""))


def _sequence_of(doc: str) -> int:
    return int(json.loads(doc)["sequence"])
