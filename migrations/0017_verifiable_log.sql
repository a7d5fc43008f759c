-- The verifiable log (issue 20, docs/transparency.md): an RFC 9162 Merkle tree over every log
-- record, stored as tiles, and the signed checkpoints the registry issued.
--
-- A tile (level, idx) holds the concatenated 32-byte hashes of up to 256 consecutive nodes at
-- height 8·level (level 0: the leaf hashes). Complete subtrees never change, so a full tile is
-- written once; only the rightmost tile of each level is rewritten as the tree grows. The
-- hashes are random bytes: EXTERNAL storage skips the compression attempt. About 32.1 bytes
-- per record.
--
-- One writer (the `transparency` leadership) extends the tree and writes the new tiles and the
-- checkpoint of the new size in one transaction: a checkpoint is served only once every tile
-- of its tree is stored, and a crash loses no checkpoint that was ever served.

CREATE TABLE log_tiles (
    level  smallint NOT NULL CHECK (level >= 0),
    idx    bigint   NOT NULL CHECK (idx >= 0),
    hashes bytea    NOT NULL CHECK (octet_length(hashes) BETWEEN 32 AND 8192
                                    AND octet_length(hashes) % 32 = 0),
    PRIMARY KEY (level, idx)
);
ALTER TABLE log_tiles ALTER COLUMN hashes SET STORAGE EXTERNAL;

CREATE TABLE log_checkpoints (
    tree_size  bigint      PRIMARY KEY CHECK (tree_size >= 0),
    root       bytea       NOT NULL CHECK (octet_length(root) = 32),
    note       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
