"""Anchors: the intents and receipts of an entry, and admin retry / abandon (spec 2.2, 2.3,
4.3; design §8, §12).

`GET /v1/anchors/{did}` lists the entry's intents ascending by (sequence, createdAt, intentId),
each with its receipts (one per batch it was part of); a confirmed receipt carries the
`MerkleProof` of the intent's leaf, and the intent then carries its `anchor` (the spec's
`AnchorRecord`). The cursor is opaque: the last position, authenticated with the registry's key
and bound to the entry, so a client can neither forge a position nor reuse it for another entry.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import trio

from registry.anchoring import control, entry_state, tree_of
from registry.canonical import canonicalize
from registry.changes import Change, ChangeLog, Decided, IdemKey, Outcome, rfc3339_ms
from registry.config import Config
from registry.cursors import SealedCursors
from registry.errors import Invalid, NotFound
from registry.merkle import (
    Direction,
    MerkleTree,
    leaf_hash,
    proof_from_slices,
    proof_offsets,
    verify_proof,
)
from registry.store import AnchorStore, IntentRow, Receipt
from registry.usecases.common import Principal, page_size
from registry.usecases.entries import Entries

log = logging.getLogger(__name__)

# The proofs read from stored trees, by (batch id, leaf index): their wire form.
Proofs = dict[tuple[int, int], dict[str, Any]]

# Matched with `fullmatch`: `$` would also match before a final newline, which the base64
# decoder then skips, so a valid cursor plus "\n" would pass (spec 4.3: ^[A-Za-z0-9_-]+$).
CURSOR = re.compile(r"[A-Za-z0-9_-]{1,2048}")
# Merkle trees of recent batches, for the proofs of batches submitted before their trees were
# stored (migration 0025; since then a proof is sliced out of the stored tree, not built): at
# most this many trees, and this many leaves in all (a tree of 100,000 leaves, the largest
# batch, holds ~25 MB of hex strings).
TREES_KEPT = 64
TREE_LEAVES_KEPT = 400_000
# Larger trees are built in a worker thread: building one costs ~15-30 µs a leaf (the leaf
# hashes), seconds for the largest batch, which must not stall the event loop serving everyone.
TREE_INLINE_LEAVES = 2_048


# How long an intent may wait for a batch before deep health says the backlog is degraded (the
# RegistryAnchoringBacklog alert's bound, deploy/registry-alerts.yml).
BACKLOG_SECONDS = 600


class Anchors:
    def __init__(
        self,
        *,
        store: AnchorStore,
        changes: ChangeLog,
        entries: Entries,
        config: Config,
        secret: bytes,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.changes = changes
        self.entries = entries
        self.config = config
        self._cursors = SealedCursors(secret, b"registry anchors cursor")
        self._trees: OrderedDict[int, MerkleTree] = OrderedDict()
        self._tree_leaves = 0  # leaves of the trees kept
        self._building: dict[int, trio.Event] = {}  # trees being built, by batch id
        self.on_change = on_change  # an intent went back to pending: wake the supervisor

    # --- reads -----------------------------------------------------------------------------

    async def health(self) -> str:
        """The deep health check of the anchoring backlog (design §11): `ok`, or how long the
        oldest pending intent has waited when that is over BACKLOG_SECONDS (the
        RegistryAnchoringBacklog alert's bound)."""
        if not self.config.anchoring.enabled:
            return "ok"
        o = await self.store.anchoring_overview(0)
        if o.oldest_pending_ms is None:
            return "ok"
        waited = (self.entries.clock_ms() - o.oldest_pending_ms) // 1000
        if waited <= BACKLOG_SECONDS:
            return "ok"
        return f"degraded: the oldest of {o.pending} pending intents has waited {waited}s"

    async def overview(self, principal: Principal, *, recent: int = 5) -> dict[str, Any]:
        """The backlog, the batches in flight and the latest batches (admin)."""
        principal.require("admin")
        o = await self.store.anchoring_overview(recent)
        body: dict[str, Any] = {
            "enabled": self.config.anchoring.enabled,
            "pending": o.pending,
            "batchesInFlight": o.in_flight,
            "recentBatches": [
                {
                    "batchId": b.batch_id,
                    "state": b.state,
                    "intents": b.intents,
                    **({"transactionId": b.transaction_id} if b.transaction_id else {}),
                    **({"blockHeight": b.block_height} if b.block_height is not None else {}),
                    **({"anchorTime": rfc3339_ms(b.anchor_time_ms)} if b.anchor_time_ms else {}),
                }
                for b in o.recent
            ],
        }
        if o.oldest_pending_ms is not None:
            body["oldestPendingAt"] = rfc3339_ms(o.oldest_pending_ms)
        return body

    async def list(self, did: str, *, limit: int | None, cursor: str | None) -> str:
        head = await self.entries.live_head(did)
        size = page_size(self.config.limits, limit)
        after = None if cursor is None else self._decode(did, cursor)
        rows = await self.store.anchor_intents_of(did, after=after, limit=size + 1)
        more = len(rows) > size
        rows = rows[:size]
        proofs = await self._stored_proofs(rows)
        body: dict[str, Any] = {
            "anchorState": entry_state(head.anchor_state),
            "entryDid": did,
            "hasMore": more,
            "records": [await self.record(r, proofs) for r in rows],
        }
        if more:
            last = rows[-1]
            body["cursor"] = self._encode(did, (last.sequence, last.created_ms, last.intent_id))
        return canonicalize(body).decode("utf-8")

    async def record(self, row: IntentRow, proofs: Proofs) -> dict[str, Any]:
        """The spec's anchor intent record (2.3), with the AnchorRecord (2.2) once anchored;
        `proofs`: those read from stored trees (`_stored_proofs`)."""
        out: dict[str, Any] = {
            "attempts": row.attempts,
            "availableAt": rfc3339_ms(row.available_ms),
            "createdAt": rfc3339_ms(row.created_ms),
            "entryDid": row.entry_did,
            "intentId": row.intent_id,
            "operation": row.operation,
            "receipts": [await self._receipt(r, proofs) for r in row.receipts],
            "sequence": row.sequence,
            "state": row.state,
            "updatedAt": rfc3339_ms(row.updated_ms),
        }
        current = row.receipts[-1] if row.receipts else None
        if current is not None and current.transaction_id is not None:
            out["transactionId"] = current.transaction_id
        confirmed = [r for r in out["receipts"] if r["state"] == "confirmed"]
        if row.state == "confirmed" and confirmed:
            receipt = confirmed[-1]
            out["anchor"] = {
                "anchorTime": receipt["anchorTime"],
                "blockHeight": receipt["blockHeight"],
                "entryDid": row.entry_did,
                "itemDataHash": row.item_data_hash,
                "proof": receipt["proof"],
                "txHash": receipt["transactionId"],
            }
        return out

    async def _stored_proofs(self, rows: Sequence[IntentRow]) -> Proofs:
        """The proofs of the confirmed receipts of `rows` whose batch's tree is stored, sliced
        out of it in one round trip (the leaf and a sibling per level: registry/merkle.py
        `proof_offsets`). Each must lead from the intent's own leaf to the batch's root; one
        that does not (never expected) is left out, and served from the batch's members."""
        plans: list[tuple[IntentRow, Receipt, list[Direction]]] = []
        wanted: list[tuple[int, int]] = []
        for row in rows:
            for r in row.receipts:
                if r.state != "confirmed" or r.leaves is None or r.root is None:
                    continue
                if not 0 <= r.leaf_index < r.leaves:
                    log.error(
                        "receipt of batch %s: leaf %s of %s", r.batch_id, r.leaf_index, r.leaves
                    )
                    continue
                leaf, steps = proof_offsets(r.leaves, r.leaf_index)
                plans.append((row, r, [side for _, side in steps]))
                wanted.append((r.batch_id, leaf))
                wanted.extend((r.batch_id, offset) for offset, _ in steps)
        if not wanted:
            return {}
        nodes = iter(await self.store.anchor_tree_slices(wanted))
        proofs: Proofs = {}
        for row, r, sides in plans:
            leaf_node = next(nodes)
            path = [(next(nodes), side) for side in sides]
            try:
                proof = proof_from_slices(r.root or "", leaf_node, path)
            except ValueError:  # a slice past the stored tree's end
                proof = None
            expected = leaf_hash(row.entry_did, row.sequence, row.item_data_hash)
            if proof is not None and verify_proof(proof, expected):
                proofs[r.batch_id, r.leaf_index] = proof.to_json()
            else:
                log.error("stored tree of batch %s: no proof of leaf %s", r.batch_id, r.leaf_index)
        return proofs

    async def _receipt(self, r: Receipt, proofs: Proofs) -> dict[str, Any]:
        receipt: dict[str, Any] = {
            "observedAt": rfc3339_ms(r.observed_ms if r.observed_ms is not None else r.created_ms),
            "proof": None,
            "receiptKey": f"batch-{r.batch_id}",
            "state": "submitted" if r.state == "claimed" else r.state,
        }
        # Spec 2.3 types both (integer, string) and omits what is absent (spec 2): a batch
        # claimed but not yet sent has no transaction, one not yet in a block no height.
        if r.block_height is not None:
            receipt["blockHeight"] = r.block_height
        if r.transaction_id is not None:
            receipt["transactionId"] = r.transaction_id
        if r.state == "confirmed":
            stored = proofs.get((r.batch_id, r.leaf_index))
            if stored is not None:
                receipt["proof"] = stored
            else:  # a batch submitted before its tree was stored (migration 0025)
                tree = await self._tree(r.batch_id)
                receipt["proof"] = tree.proof(r.leaf_index).to_json()
            if r.anchor_time_ms is not None:
                receipt["anchorTime"] = rfc3339_ms(r.anchor_time_ms)
        return receipt

    async def _tree(self, batch_id: int) -> MerkleTree:
        """The batch's Merkle tree, kept for the next reads; concurrent reads of a batch that is
        not kept build it once (if that build fails or is cancelled, they build it themselves)."""
        while True:
            tree = self._trees.get(batch_id)
            if tree is not None:
                self._trees.move_to_end(batch_id)
                return tree
            building = self._building.get(batch_id)
            if building is None:
                break
            await building.wait()
        done = self._building[batch_id] = trio.Event()
        try:
            members = await self.store.anchor_batch_members(batch_id)
            if len(members) <= TREE_INLINE_LEAVES:
                tree = tree_of(members)
            else:
                tree = await trio.to_thread.run_sync(tree_of, members)
            self._keep(batch_id, tree)
        finally:
            del self._building[batch_id]
            done.set()
        return tree

    def _keep(self, batch_id: int, tree: MerkleTree) -> None:
        self._trees[batch_id] = tree
        self._tree_leaves += len(tree)
        while len(self._trees) > 1 and (
            len(self._trees) > TREES_KEPT or self._tree_leaves > TREE_LEAVES_KEPT
        ):
            _, dropped = self._trees.popitem(last=False)
            self._tree_leaves -= len(dropped)

    # --- admin control -------------------------------------------------------------------

    async def retry(self, principal: Principal, intent_id: str, idem: IdemKey | None) -> Outcome:
        return await self._control(principal, intent_id, "retry", idem)

    async def abandon(self, principal: Principal, intent_id: str, idem: IdemKey | None) -> Outcome:
        return await self._control(principal, intent_id, "abandon", idem)

    async def _control(
        self, principal: Principal, intent_id: str, action: str, idem: IdemKey | None
    ) -> Outcome:
        async def decide() -> Decided[str]:  # seen: the entry whose anchorState it moves
            principal.require("admin")
            row = await self.store.get_anchor_intent(intent_id)
            if row is None:
                raise NotFound(
                    "anchor intent not found",
                    code="intent_not_found",
                    details={"intentId": intent_id},
                )
            to = control(intent_id, row.state, action)
            change = Change(
                "anchor.updated",
                row.entry_did,
                {"intentId": intent_id, "from": row.state, "to": to},
                event={
                    "intentId": intent_id,
                    "sequence": row.sequence,
                    "state": to,
                    "anchorState": entry_state(to),
                    "by": principal.did,
                },
            )
            return Decided(change, row.entry_did)

        outcome, subject = await self.changes.submit_seen(idem, decide)
        if outcome.refusal is None and not outcome.replayed and subject is not None:
            self.entries.caches.wrote(subject)  # read your write: GET shows the anchorState
            self.on_change()
        return outcome

    # --- the cursor ------------------------------------------------------------------------

    def _encode(self, did: str, position: tuple[int, int, str]) -> str:
        return self._cursors.seal([did, *position])

    def _decode(self, did: str, cursor: str) -> tuple[int, int, str]:
        bad = Invalid("cursor is not one this server issued for this entry", code="invalid_cursor")
        if not CURSOR.fullmatch(cursor):
            raise bad
        data = self._cursors.open(cursor, bad)
        if not (isinstance(data, list) and len(data) == 4 and data[0] == did):
            raise bad
        return int(data[1]), int(data[2]), str(data[3])
