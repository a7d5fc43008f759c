-- A peer's pull (design §9, kind `peer.status`).
-- rows: {peerDid, expectedCursor, cursor, status (object),
--        replicas: [{seq, entryDid, lifecycle, doc}], quarantined: [{seq, entryDid, code, reason,
--        doc}]}
-- A replica of an entry DID that another origin already brought is quarantined
-- (`entry_from_other_origin`): the first origin to bring a DID keeps it.
-- The result is the peer's status object (with its quarantine count) as JSON text.
CREATE OR REPLACE FUNCTION apply_peer_sync(p_seq bigint, p_subject text, p_rows jsonb)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_peer    text := p_rows ->> 'peerDid';
    v_cursor  bigint;
    v_added   bigint;
    v_foreign bigint;
    v_total   bigint;
    v_foreign_dids text[];
BEGIN
    SELECT p.cursor INTO v_cursor FROM federation_peers p WHERE p.peer_did = v_peer FOR UPDATE;
    IF coalesce(v_cursor, 0) <> (p_rows ->> 'expectedCursor')::bigint THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Conflict',
            'code', 'peer_cursor_moved', 'message', 'the peer''s cursor moved meanwhile',
            'details', jsonb_build_object('peerDid', v_peer, 'cursor', coalesce(v_cursor, 0)));
        RETURN;
    END IF;
    -- DIDs of this page that another origin already brought here.
    v_foreign_dids := ARRAY(
        SELECT DISTINCT x ->> 'entryDid'
          FROM jsonb_array_elements(coalesce(p_rows -> 'replicas', '[]')) AS x
         WHERE EXISTS (SELECT 1 FROM replica_versions r
                        WHERE r.entry_did = x ->> 'entryDid' AND r.origin_did <> v_peer));
    INSERT INTO replica_versions (origin_did, origin_seq, entry_did, lifecycle, doc, synced_seq)
    SELECT v_peer, (x ->> 'seq')::bigint, x ->> 'entryDid', x ->> 'lifecycle', x ->> 'doc', p_seq
      FROM jsonb_array_elements(coalesce(p_rows -> 'replicas', '[]')) AS x
     WHERE NOT (x ->> 'entryDid' = ANY (v_foreign_dids))
    ON CONFLICT (origin_did, origin_seq) DO NOTHING;
    INSERT INTO replica_quarantine (origin_did, origin_seq, entry_did, code, reason, doc,
                                    synced_seq)
    SELECT v_peer, (x ->> 'seq')::bigint, x ->> 'entryDid', 'entry_from_other_origin',
           'another peer already replicates this entry here: one origin per entry',
           x ->> 'doc', p_seq
      FROM jsonb_array_elements(coalesce(p_rows -> 'replicas', '[]')) AS x
     WHERE x ->> 'entryDid' = ANY (v_foreign_dids)
    ON CONFLICT (origin_did, origin_seq) DO NOTHING;
    GET DIAGNOSTICS v_foreign = ROW_COUNT;
    INSERT INTO replica_quarantine (origin_did, origin_seq, entry_did, code, reason, doc,
                                    synced_seq)
    SELECT v_peer, (x ->> 'seq')::bigint, x ->> 'entryDid', x ->> 'code', x ->> 'reason',
           x ->> 'doc', p_seq
      FROM jsonb_array_elements(coalesce(p_rows -> 'quarantined', '[]')) AS x
    ON CONFLICT (origin_did, origin_seq) DO NOTHING;
    GET DIAGNOSTICS v_added = ROW_COUNT;
    v_added := v_added + v_foreign;
    INSERT INTO federation_peers AS f (peer_did, cursor, status, quarantines, updated_seq)
    VALUES (v_peer, (p_rows ->> 'cursor')::bigint, p_rows -> 'status', v_added, p_seq)
    ON CONFLICT (peer_did) DO UPDATE
       SET cursor = EXCLUDED.cursor, status = EXCLUDED.status,
           quarantines = f.quarantines + v_added, updated_seq = p_seq
    RETURNING f.quarantines INTO v_total;
    RETURN QUERY SELECT (p_rows -> 'status' || jsonb_build_object('quarantines', v_total))::text,
                        NULL::jsonb;
END $$;
