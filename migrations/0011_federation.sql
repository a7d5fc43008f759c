-- Federation (design §9): durable envelope nonces, each peer's sync state, and the replicas and
-- quarantines its PeerActor imported.
--
-- A peer's pull is a change of the one append path (kind `peer.status`, handler
-- apply_peer_sync): in one transaction it stores the verified entries as replica versions of
-- that origin, the refused ones in quarantine with their reason, and the peer's new cursor and
-- status; its log record is the admin-only `peer.status` event. The cursor is compare-and-set:
-- a pull decided on a cursor that moved meanwhile is refused (`peer_cursor_moved`) and writes
-- nothing, so a replica is never imported twice nor a position skipped.
--
-- Replicas are not local entries: they take no entry sequence, never reach discovery of the
-- local log, and are never served to another peer by sync (only local entry versions are), so
-- changes do not loop between peers.

-- Single-use nonces of received envelopes, kept until the timestamp window refuses a replay.
CREATE TABLE federation_nonces (
    sender_did text   NOT NULL,
    nonce      text   NOT NULL,
    expires_ms bigint NOT NULL,
    PRIMARY KEY (sender_did, nonce)
);
CREATE INDEX federation_nonces_expiry ON federation_nonces (expires_ms);

-- One row per peer the registry has pulled from (created by its first recorded status).
CREATE TABLE federation_peers (
    peer_did    text   PRIMARY KEY,
    cursor      bigint NOT NULL,          -- the peer's log position imported up to (inclusive)
    status      jsonb  NOT NULL,          -- breaker, latency, head, last success (PeerState)
    quarantines bigint NOT NULL DEFAULT 0,
    updated_seq bigint NOT NULL
);

-- Every verified entry version a peer served: its document exactly as the origin serves it.
CREATE TABLE replica_versions (
    origin_did text   NOT NULL,
    origin_seq bigint NOT NULL,           -- the version's `sequence` at its origin
    entry_did  text   NOT NULL,
    lifecycle  text   NOT NULL,           -- deleted: the origin's tombstone
    doc        text   NOT NULL,
    synced_seq bigint NOT NULL,           -- the local log position of the pull
    PRIMARY KEY (origin_did, origin_seq)
);
CREATE INDEX replica_versions_by_did ON replica_versions (entry_did, origin_did, origin_seq DESC);

-- Entries a peer served that failed verification: never imported, kept with the reason.
CREATE TABLE replica_quarantine (
    origin_did text   NOT NULL,
    origin_seq bigint NOT NULL,
    entry_did  text,
    code       text   NOT NULL,
    reason     text   NOT NULL,
    doc        text   NOT NULL,
    synced_seq bigint NOT NULL,
    PRIMARY KEY (origin_did, origin_seq)
);
