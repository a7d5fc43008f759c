-- Peers as witnesses of each other's logs (issue 20, docs/transparency.md).
--
-- peer_checkpoints: the newest checkpoint this registry accepted from each peer, which the next
-- one must extend (a consistency proof), and, once the peer's log contradicted it, the fork's
-- evidence: that peer is quarantined (nothing more is imported from it) until an operator
-- clears `fork`. Written outside the append path: witnessing is this registry's view of another
-- log, and a log record per witnessed checkpoint would make two idle peers witness each other's
-- new records forever.
--
-- log_cosignatures: the cosignatures peers sent for this registry's own checkpoints
-- (c2sp.org/tlog-cosignature), served as extra signature lines of the checkpoint they sign.

CREATE TABLE peer_checkpoints (
    peer_did   text        PRIMARY KEY,
    origin     text        NOT NULL,
    tree_size  bigint      NOT NULL CHECK (tree_size >= 0),
    root       bytea       NOT NULL CHECK (octet_length(root) = 32),
    note       text        NOT NULL,
    fork       jsonb,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE log_cosignatures (
    tree_size  bigint      NOT NULL REFERENCES log_checkpoints (tree_size) ON DELETE CASCADE,
    witness    text        NOT NULL,
    line       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tree_size, witness)
);
