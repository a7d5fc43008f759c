-- rows: {puts: [put...], requireEntry?: did, requireHead?: sequence, entry?: <apply_entry_version
--        rows>, result?: text}
-- put: {kind, id, expectedVersion (null: a new record), entryDid, ownerDid, status, expiresAtMs,
--       uniq, doc, exists: refusal (a new record whose id exists), duplicate: refusal (uniq taken)}
-- The result is `result`, else the entry version's document. `requireHead`: the decision read
-- the entry at that head sequence (an offer names it); if it moved since, `Retry`.
CREATE OR REPLACE FUNCTION apply_records(p_seq bigint, p_subject text, p_rows jsonb)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    p         jsonb;
    v_version integer;
    h         record;
    v_result  text := p_rows ->> 'result';
    v_ids     text[] := ARRAY(SELECT x ->> 'kind' || ' ' || (x ->> 'id')
                              FROM jsonb_array_elements(p_rows -> 'puts') AS x);
BEGIN
    IF p_rows ? 'requireEntry' AND NOT EXISTS (
        SELECT 1 FROM entries e
         WHERE e.entry_did = p_rows ->> 'requireEntry' AND e.lifecycle <> 'deleted') THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'NotFound',
            'code', 'entry_not_found', 'message', 'entry not found',
            'details', jsonb_build_object('entryDid', p_rows ->> 'requireEntry'));
        RETURN;
    END IF;
    IF p_rows ? 'requireHead' AND NOT EXISTS (
        SELECT 1 FROM entries e
         WHERE e.entry_did = p_rows ->> 'requireEntry'
           AND e.head_seq = (p_rows ->> 'requireHead')::bigint) THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Retry',
            'code', 'entry_changed', 'message', 'the entry changed meanwhile',
            'details', jsonb_build_object('entryDid', p_rows ->> 'requireEntry'));
        RETURN;
    END IF;
    -- Every check first: a refusal writes nothing.
    FOR p IN SELECT value FROM jsonb_array_elements(p_rows -> 'puts') LOOP
        SELECT r.version INTO v_version FROM records r
         WHERE r.kind = p ->> 'kind' AND r.id = p ->> 'id' FOR UPDATE;
        IF p ->> 'expectedVersion' IS NULL THEN
            IF FOUND THEN
                RETURN QUERY SELECT NULL::text, p -> 'exists';
                RETURN;
            END IF;
        ELSIF NOT FOUND OR v_version <> (p ->> 'expectedVersion')::integer THEN
            RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Retry',
                'code', 'record_changed', 'message', 'the record changed meanwhile',
                'details', jsonb_build_object('kind', p ->> 'kind', 'id', p ->> 'id'));
            RETURN;
        END IF;
        IF p ->> 'uniq' IS NOT NULL AND EXISTS (
            SELECT 1 FROM records r
             WHERE r.kind = p ->> 'kind' AND r.uniq = p ->> 'uniq'
               AND NOT (r.kind || ' ' || r.id = ANY (v_ids))) THEN
            RETURN QUERY SELECT NULL::text, p -> 'duplicate';
            RETURN;
        END IF;
    END LOOP;
    IF p_rows ? 'entry' THEN
        SELECT * INTO h FROM apply_entry_version(p_seq, p_subject, p_rows -> 'entry');
        IF h.refusal ->> 'code' = 'sequence_conflict' THEN
            -- The decision read the entry at the version's base, which has moved since (an
            -- owner's update or delete): decided again, it answers what it would have one
            -- after the other (a transfer: entry_changed).
            RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Retry',
                'code', 'entry_changed', 'message', 'the entry changed meanwhile',
                'details', jsonb_build_object('entryDid', p_subject));
            RETURN;
        END IF;
        IF h.refusal IS NOT NULL THEN
            RETURN QUERY SELECT NULL::text, h.refusal;
            RETURN;
        END IF;
        v_result := coalesce(v_result, h.result);
    END IF;
    FOR p IN SELECT value FROM jsonb_array_elements(p_rows -> 'puts') LOOP
        INSERT INTO records AS r (kind, id, entry_did, owner_did, status, version, expires_at,
                                  uniq, created_seq, updated_seq, doc)
        VALUES (p ->> 'kind', p ->> 'id', p ->> 'entryDid', p ->> 'ownerDid', p ->> 'status', 1,
                to_timestamp((p ->> 'expiresAtMs')::bigint / 1000.0), p ->> 'uniq', p_seq, p_seq,
                p ->> 'doc')
        ON CONFLICT (kind, id) DO UPDATE
           SET status = EXCLUDED.status, version = r.version + 1,
               expires_at = EXCLUDED.expires_at, uniq = EXCLUDED.uniq,
               updated_seq = p_seq, doc = EXCLUDED.doc, lapsed = false;
    END LOOP;
    RETURN QUERY SELECT v_result, NULL::jsonb;
END $$;
