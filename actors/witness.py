"""A PeerActor's witness: it keeps the peer's log honest (issue 20, docs/transparency.md).

Before it pulls, a PeerActor asks its `PeerWitness` for the peer's newest signed checkpoint
(`GET /v1/log/checkpoint`, public). The witness checks its signature with the peer's key (its
did:key), and that it extends the checkpoint it accepted last (kept in the store across
restarts): the same root for the same size, and an RFC 9162 consistency proof
(`GET /v1/log/proof/consistency`) from the old size to the new one. It then keeps the new
checkpoint and sends the peer its cosignature (c2sp.org/tlog-cosignature, under this registry's
DID) in a signed `cosignature_request` to `POST /v1/federation/cosignature`; the peer serves it
as an extra signature line of that checkpoint.

The PeerActor imports only versions inside the tree it accepted (`within_checkpoint`). A
checkpoint that contradicts the accepted one is a fork: the evidence (both checkpoints, the
failing proof) is kept in the store, the peer's status says `log_inconsistent` (a `peer.status`
change: the admin event), and nothing more is imported from it. A peer that serves no log (404:
an older release) is pulled from as before; a check that fails for the network is skipped and
tried again before the next pull.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import trio

from registry.canonical import MAX_SAFE_INTEGER, parse_strict
from registry.did import public_key_from_did_key
from registry.envelope import build_request, verify_envelope
from registry.errors import RegistryError
from registry.keys import SigningKey
from registry.store import FederationStore, WitnessRow
from registry.transparency import Fork, Witnessed, cosign, judge, note_body, open_checkpoint

log = logging.getLogger(__name__)

CHECKPOINT_PATH = "/v1/log/checkpoint"
CONSISTENCY_PATH = "/v1/log/proof/consistency"
COSIGNATURE_PATH = "/v1/federation/cosignature"


class Answer(Protocol):
    @property
    def status(self) -> int: ...
    @property
    def body(self) -> bytes: ...


@dataclass(frozen=True)
class WitnessDeps:
    store: FederationStore
    key: SigningKey
    clock_ms: Callable[[], int]
    endpoint_of: Callable[[str], Awaitable[str]]
    get: Callable[[str], Awaitable[Answer]]
    post: Callable[[str, bytes], Awaitable[Answer]]


class WitnessSkipped(Exception):
    """This round's check could not be made (the network, an unexpected answer)."""


@dataclass
class PeerWitness:
    """The witnessing of one peer, owned by its PeerActor."""

    did: str
    accepted: Witnessed | None = None
    fork: dict[str, object] | None = None
    unsupported: bool = False  # the peer serves no log (an older release)
    cosigned: int = -1  # the tree size last cosigned and delivered
    checked_at: float = field(default=float("-inf"))

    @classmethod
    def of(cls, did: str, row: WitnessRow | None) -> PeerWitness:
        if row is None:
            return cls(did)
        return cls(did, accepted=row.accepted, fork=row.fork)

    def due(self, cursor: int, poll_seconds: float) -> bool:
        """Whether to check the peer's log before this pull: when the accepted tree holds
        nothing past the cursor, or a poll interval went by."""
        if self.unsupported or self.fork is not None:
            return False
        if self.accepted is None or cursor >= self.accepted.size:
            return True
        return trio.current_time() - self.checked_at >= poll_seconds

    def import_limit(self) -> int | None:
        """The largest sequence a pull may import (None: no limit, the peer has no log)."""
        if self.unsupported:
            return None
        return 0 if self.accepted is None else self.accepted.size

    async def check(self, deps: WitnessDeps) -> Fork | None:
        """One round: the peer's checkpoint judged, kept and cosigned; the fork, if it is one.
        Raises WitnessSkipped when the round could not be made."""
        self.checked_at = trio.current_time()
        base = (await deps.endpoint_of(self.did)).rstrip("/")
        got = await deps.get(base + CHECKPOINT_PATH)
        if got.status == 404 and self.accepted is None and b"checkpoint_not_found" not in got.body:
            # no such route: an older release (a new log has no checkpoint for a moment)
            self.unsupported = True
            log.info(
                "federation: %s serves no verifiable log; pulling without witnessing", self.did
            )
            return None
        if got.status != 200:
            raise WitnessSkipped(f"checkpoint answered {got.status}")
        note = got.body.decode("utf-8", errors="replace")
        if "\x00" in note:  # no store keeps it (and no honest log writes one)
            raise WitnessSkipped("the checkpoint holds U+0000")
        try:
            origin = None if self.accepted is None else self.accepted.origin
            checkpoint = open_checkpoint(note, public_key_from_did_key(self.did), origin)
        except ValueError as exc:
            raise WitnessSkipped(f"the checkpoint does not hold: {exc}") from None
        if checkpoint.size > MAX_SAFE_INTEGER:
            # I-JSON, as a sync answer's sequences: the size goes into the peer's status, and
            # so into a log record, which JCS (the checkpointer's leaf) cannot write beyond it.
            raise WitnessSkipped(f"the checkpoint's tree size {checkpoint.size} exceeds 2^53-1")
        proof = None
        if self.accepted is not None and checkpoint.size > self.accepted.size > 0:
            url = f"{base}{CONSISTENCY_PATH}?from={self.accepted.size}&to={checkpoint.size}"
            answer = await deps.get(url)
            if answer.status != 200:
                raise WitnessSkipped(f"the consistency proof answered {answer.status}")
            try:
                # I-JSON, as a sync answer is read: JSON nested too deep is `Invalid` here,
                # where `json.loads` raised RecursionError (a bug to the supervisor: the end).
                proof = [
                    base64.b64decode(p, validate=True) for p in parse_strict(answer.body)["proof"]
                ]
            except (ValueError, KeyError, TypeError, RegistryError) as exc:
                raise WitnessSkipped(f"the consistency proof is malformed: {exc}") from None
        elif self.accepted is not None and checkpoint.size > self.accepted.size:
            proof = []  # from the empty tree: nothing to prove
        verdict = judge(self.accepted, note, checkpoint, proof)
        if isinstance(verdict, Fork):
            await deps.store.record_fork(self.did, verdict)
            self.fork = {"reason": verdict.reason, "detail": verdict.detail, **verdict.evidence}
            log.error("federation: %s's log is inconsistent: %s", self.did, verdict.detail)
            return verdict
        if verdict is not self.accepted:
            await deps.store.accept_peer_checkpoint(self.did, verdict)
            self.accepted = verdict
        if verdict.size != self.cosigned:
            await self._cosign(deps, base, verdict)
        return None

    async def _cosign(self, deps: WitnessDeps, base: str, accepted: Witnessed) -> None:
        body = note_body(accepted.note)
        now = deps.clock_ms()
        line = cosign(body, deps.key.did, deps.key, now // 1000)
        request = build_request(
            deps.key,
            kind="cosignature_request",
            recipient_did=self.did,
            payload={"treeSize": accepted.size, "cosignature": line},
            now_ms=now,
        )
        raw = json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode()
        answer = await deps.post(base + COSIGNATURE_PATH, raw)
        if answer.status != 200:
            raise WitnessSkipped(
                f"the cosignature was refused: {answer.status} {answer.body[:200]!r}"
            )
        try:
            verify_envelope(
                parse_strict(answer.body),
                recipient_did=deps.key.did,
                now_ms=deps.clock_ms(),
                expected_kind="cosignature_response",
                request=dict(request),
                raw=answer.body,
            )
        except (ValueError, RegistryError) as exc:
            raise WitnessSkipped(f"the cosignature's answer does not hold: {exc}") from None
        self.cosigned = accepted.size
