-- Each batch's Merkle tree stored when its root is submitted (hostile review).
--
-- `GET /v1/anchors/{did}` serves a proof with every confirmed receipt. It was built on read from
-- the batch's tree: every member of the batch read and hashed again (up to 100,000), once per
-- batch not among the 64 trees a process kept, so a page of 100 intents in 100 batches rebuilt
-- them all on every request (~465 ms of CPU at batches of 256). The anchoring leader has the
-- tree when it submits the root; it now stores it in the same transaction: every level's node
-- hashes, 32 bytes each, the leaves first (`MerkleTree.packed_levels`, 2n nodes: 16 KiB for 256
-- leaves, 6.4 MB for 100,000). A proof is then the leaf and one sibling per level, read as
-- slices at offsets that follow from the leaf count (registry/merkle.py `proof_offsets`).
-- Stored EXTERNAL (uncompressed; hashes do not compress) so that PostgreSQL reads a slice
-- without reading the whole value. Batches submitted before this migration have no tree here
-- and are served from their members as before.
CREATE TABLE anchor_trees (
    batch_id bigint  PRIMARY KEY,
    leaves   integer NOT NULL CHECK (leaves >= 1),
    levels   bytea   NOT NULL
);
ALTER TABLE anchor_trees ALTER COLUMN levels SET STORAGE EXTERNAL;
