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

-- rows: {peerDid, expectedCursor, cursor, status (object),
--        replicas: [{seq, entryDid, lifecycle, doc}], quarantined: [{seq, entryDid, code, reason,
--        doc}]}
-- The result is the peer's status object (with its quarantine count) as JSON text.
CREATE FUNCTION apply_peer_sync(p_seq bigint, p_subject text, p_rows jsonb)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_peer    text := p_rows ->> 'peerDid';
    v_cursor  bigint;
    v_added   bigint;
    v_total   bigint;
BEGIN
    SELECT p.cursor INTO v_cursor FROM federation_peers p WHERE p.peer_did = v_peer FOR UPDATE;
    IF coalesce(v_cursor, 0) <> (p_rows ->> 'expectedCursor')::bigint THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Conflict',
            'code', 'peer_cursor_moved', 'message', 'the peer''s cursor moved meanwhile',
            'details', jsonb_build_object('peerDid', v_peer, 'cursor', coalesce(v_cursor, 0)));
        RETURN;
    END IF;
    INSERT INTO replica_versions (origin_did, origin_seq, entry_did, lifecycle, doc, synced_seq)
    SELECT v_peer, (x ->> 'seq')::bigint, x ->> 'entryDid', x ->> 'lifecycle', x ->> 'doc', p_seq
      FROM jsonb_array_elements(coalesce(p_rows -> 'replicas', '[]')) AS x
    ON CONFLICT (origin_did, origin_seq) DO NOTHING;
    INSERT INTO replica_quarantine (origin_did, origin_seq, entry_did, code, reason, doc,
                                    synced_seq)
    SELECT v_peer, (x ->> 'seq')::bigint, x ->> 'entryDid', x ->> 'code', x ->> 'reason',
           x ->> 'doc', p_seq
      FROM jsonb_array_elements(coalesce(p_rows -> 'quarantined', '[]')) AS x
    ON CONFLICT (origin_did, origin_seq) DO NOTHING;
    GET DIAGNOSTICS v_added = ROW_COUNT;
    INSERT INTO federation_peers AS f (peer_did, cursor, status, quarantines, updated_seq)
    VALUES (v_peer, (p_rows ->> 'cursor')::bigint, p_rows -> 'status', v_added, p_seq)
    ON CONFLICT (peer_did) DO UPDATE
       SET cursor = EXCLUDED.cursor, status = EXCLUDED.status,
           quarantines = f.quarantines + v_added, updated_seq = p_seq
    RETURNING f.quarantines INTO v_total;
    RETURN QUERY SELECT (p_rows -> 'status' || jsonb_build_object('quarantines', v_total))::text,
                        NULL::jsonb;
END $$;
