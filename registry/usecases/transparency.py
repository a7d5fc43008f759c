"""The verifiable log's reads (issue 20, docs/transparency.md): records, checkpoints, proofs.

Proofs are answered from the stored tiles of the tree (registry/transparency.py): a dry run
names the tiles a proof reads, the full ones (immutable) come from a small LRU cache, the rest
in one query; the roots of complete subtrees computed on the way are remembered (`NodeMemo`:
final once complete, so valid for every tree size), and a proof whose nodes are all known reads
no tile at all. A proof is given for any tree size up to the newest checkpoint's: a client checks
it against a checkpoint, and sizes past the newest have none yet.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from registry.errors import Invalid, NotFound
from registry.store import EntryStore, FederationStore, TransparencyStore
from registry.transparency import (
    HASH_SIZE,
    TILE_WIDTH,
    NodeMemo,
    StoredCheckpoint,
    TileKey,
    TileReader,
    consistency_path,
    inclusion_path,
    log_record,
)

T = TypeVar("T")

MAX_RECORDS = 1000  # per page of /v1/log/records
DEFAULT_RECORDS = 100
FULL_TILE = HASH_SIZE * TILE_WIDTH


class TransparencyStoreAndEntries(TransparencyStore, FederationStore, EntryStore, Protocol):
    """The ports the reads use (a Protocol: any store with both)."""


async def stored_checkpoint(store: TransparencyStore, size: int) -> StoredCheckpoint:
    """The checkpoint of `size` the registry issued; NotFound if it issued none of that size."""
    found = await store.checkpoint_of_size(size)
    if found is None:
        raise NotFound(
            f"no checkpoint of tree size {size} is stored",
            code="checkpoint_not_found",
            details={"treeSize": size},
        )
    return found


def b64(hashes: list[bytes]) -> list[str]:
    return [base64.b64encode(h).decode() for h in hashes]


class Transparency:
    def __init__(
        self,
        store: TransparencyStoreAndEntries,
        *,
        cached_tiles: int = 1024,
        page_bytes: int | None = None,
    ) -> None:
        self.store = store
        # A page of records ends once the entry versions it hashed hold this many bytes.
        self._page_bytes = page_bytes
        self._tiles: OrderedDict[TileKey, bytes] = OrderedDict()
        self._capacity = cached_tiles
        self._nodes = NodeMemo()
        self._checkpointed = 0  # the largest checkpoint size seen stored

    # --- records --------------------------------------------------------------------------

    async def records(self, start: int, limit: int | None) -> dict[str, Any]:
        if start < 1:
            raise Invalid("from must be a sequence, 1 or more", code="invalid_from")
        if limit is not None and limit < 1:
            raise Invalid("limit must be 1 or more", code="invalid_limit")
        size = min(limit or DEFAULT_RECORDS, MAX_RECORDS)
        rows, ended = await self.store.log_records_within(start - 1, size + 1, self._page_bytes)
        shown = rows[:size]
        return {
            "records": [log_record(record, digest) for record, digest in shown],
            "hasMore": ended or len(rows) > size,
            "next": shown[-1][0].seq + 1 if shown else start,
        }

    # --- checkpoints ----------------------------------------------------------------------

    async def latest(self) -> StoredCheckpoint:
        latest = await self.store.latest_checkpoint()
        if latest is None:
            raise NotFound(
                "no checkpoint has been issued yet", code="checkpoint_not_found", details={}
            )
        self._checkpointed = max(self._checkpointed, latest.size)
        return latest

    async def checkpoint(self, size: int | None) -> StoredCheckpoint:
        if size is None:
            return await self.latest()
        if size < 0:
            raise Invalid("treeSize must be 0 or more", code="invalid_tree_size")
        return await stored_checkpoint(self.store, size)

    async def served_note(self, checkpoint: StoredCheckpoint) -> str:
        """The checkpoint as served: the registry's signed note, then one signature line per
        witness that cosigned it (c2sp.org/tlog-cosignature)."""
        return checkpoint.note + "".join(await self.store.cosignatures(checkpoint.size))

    # --- proofs ---------------------------------------------------------------------------

    async def _within(self, size: int, name: str) -> None:
        if size <= self._checkpointed:  # checkpoints only grow: no need to ask again
            return
        latest = await self.latest()
        if size > latest.size:
            raise NotFound(
                f"{name} {size} is beyond the newest checkpoint's tree size {latest.size}",
                code="tree_size_unknown",
                details={name: size, "checkpointSize": latest.size},
            )

    async def inclusion(self, sequence: int, tree_size: int | None) -> dict[str, Any]:
        if tree_size is None:
            tree_size = (await self.latest()).size
        elif tree_size < 1:
            raise Invalid("treeSize must be 1 or more", code="invalid_tree_size")
        if not 1 <= sequence <= tree_size:
            raise Invalid(
                f"sequence {sequence} is not in a tree of {tree_size} records",
                code="invalid_sequence",
                details={"sequence": sequence, "treeSize": tree_size},
            )
        await self._within(tree_size, "treeSize")
        proof = await self._read(
            tree_size, lambda r: inclusion_path(sequence - 1, tree_size, r.mth)
        )
        return {"leafIndex": sequence - 1, "treeSize": tree_size, "proof": b64(proof)}

    async def consistency(self, first: int, second: int) -> dict[str, Any]:
        if not 1 <= first <= second:
            raise Invalid(
                "from and to must be tree sizes with 1 <= from <= to",
                code="invalid_tree_size",
                details={"from": first, "to": second},
            )
        await self._within(second, "to")
        proof = await self._read(second, lambda r: consistency_path(first, second, r.mth))
        return {"from": first, "to": second, "proof": b64(proof)}

    async def version_bundle(self, did: str, sequence: int) -> dict[str, Any]:
        """What a client needs to check one entry version offline: the newest checkpoint, the
        version's record and its inclusion proof against that checkpoint. An entry deleted
        (or unknown) is 404 `entry_not_found`, as its versions are; its records stay in the
        log (`GET /v1/log/records`)."""
        head = await self.store.get_entry_head(did, attestations=0)
        if head is None or head.lifecycle == "deleted":
            raise NotFound("entry not found", code="entry_not_found", details={"entryDid": did})
        if await self.store.get_version(did, sequence) is None:
            raise NotFound("no such version of this entry", code="version_not_found")
        latest = await self.latest()
        if latest.size < sequence:
            raise NotFound(
                f"version {sequence} is not in a checkpoint yet (newest: {latest.size});"
                " checkpoints follow the log within seconds",
                code="not_yet_checkpointed",
                details={"sequence": sequence, "checkpointSize": latest.size},
            )
        ((record, digest),) = await self.store.log_records(sequence - 1, 1)
        proof = await self._read(
            latest.size, lambda r: inclusion_path(sequence - 1, latest.size, r.mth)
        )
        return {
            "checkpoint": await self.served_note(latest),
            "record": log_record(record, digest),
            "proof": {"leafIndex": sequence - 1, "treeSize": latest.size, "proof": b64(proof)},
        }

    async def _read(self, size: int, compute: Callable[[TileReader], T]) -> T:
        needed = TileReader.needed_for(size, compute, memo=self._nodes)
        tiles: dict[TileKey, bytes] = {}
        for key in needed:
            if key in self._tiles:
                self._tiles.move_to_end(key)
                tiles[key] = self._tiles[key]
        fetched = await self.store.tree_tiles(needed - tiles.keys())
        for key, data in fetched.items():
            if len(data) == FULL_TILE:  # immutable: worth keeping
                self._tiles[key] = data
                if len(self._tiles) > self._capacity:
                    self._tiles.popitem(last=False)
        tiles.update(fetched)
        return compute(TileReader(size, tiles.__getitem__, memo=self._nodes))
