-- Hardening after review (issues 10 and 11).
--
-- Federation: one origin per replicated entry. A replica of an entry DID that another peer
-- already replicated here is quarantined (`entry_from_other_origin`), never imported: otherwise
-- any peer could hide another origin's entry with a tombstone, or roll it back by replaying an
-- older version its publisher once signed, and be served in its place. The first origin to
-- bring a DID keeps it.
--
-- Anchoring: belt and braces on the queue's invariant (an intent is in anchor_queue exactly
-- while it is pending): a claim moves only intents still pending, and a requeue of an intent
-- somehow queued already refreshes its row instead of failing the settle.

-- rows: as in 0011. The result is the peer's status object, with its quarantine count.
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

-- rows: {batchSize, availableAtMs}: as in 0013, moving only intents still pending.
CREATE OR REPLACE FUNCTION apply_anchor_claim(p_seq bigint, p_subject text, p_rows jsonb)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_ids    text[];
    v_result text;
BEGIN
    WITH picked AS (
        DELETE FROM anchor_queue q
         WHERE q.sequence IN (
               SELECT x.sequence FROM anchor_queue x
                WHERE x.available_at
                      <= to_timestamp((p_rows ->> 'availableAtMs')::bigint / 1000.0)
                ORDER BY x.sequence LIMIT (p_rows ->> 'batchSize')::integer)
        RETURNING q.intent_id, q.sequence
    )
    SELECT coalesce(array_agg(intent_id ORDER BY sequence), '{}') INTO v_ids FROM picked;
    IF cardinality(v_ids) = 0 THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'NotFound',
            'code', 'nothing_pending', 'message', 'no anchor intent is pending',
            'details', '{}'::jsonb);
        RETURN;
    END IF;
    WITH claimed AS (
        UPDATE anchor_intents i
           SET state = 'submitted', attempts = i.attempts + 1, batch_id = p_seq,
               leaf_index = (p.n - 1)::integer, updated_at = now()
          FROM unnest(v_ids) WITH ORDINALITY AS p(intent_id, n)
         WHERE i.intent_id = p.intent_id AND i.state = 'pending'
        RETURNING i.intent_id, i.entry_did, i.sequence, i.item_data_hash, i.attempts,
                  i.leaf_index
    )
    SELECT json_agg(json_build_array(c.intent_id, c.entry_did, c.sequence, c.item_data_hash,
                                     c.attempts) ORDER BY c.leaf_index)::text
      INTO v_result FROM claimed c;
    INSERT INTO anchor_batches (batch_id, state) VALUES (p_seq, 'claimed');
    INSERT INTO anchor_receipts (intent_id, batch_id, leaf_index)
    SELECT p.intent_id, p_seq, (p.n - 1)::integer
      FROM unnest(v_ids) WITH ORDINALITY AS p(intent_id, n);
    RETURN QUERY SELECT v_result, NULL::jsonb;
END $$;

-- rows: as in 0010; a requeue refreshes a queued row instead of failing.
CREATE OR REPLACE FUNCTION apply_anchor_settle(p_seq bigint, p_subject text, p_rows jsonb)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_batch     bigint := (p_rows ->> 'batchId')::bigint;
    v_ids       text[] := ARRAY(SELECT jsonb_array_elements_text(p_rows -> 'intents'));
    v_pending   text[] := ARRAY(SELECT jsonb_array_elements_text(p_rows -> 'pending'));
    v_available timestamptz := to_timestamp((p_rows ->> 'availableAtMs')::bigint / 1000.0);
BEGIN
    -- Compare-and-set: the batch's submitted intents are exactly `intents` (sorted arrays).
    IF ARRAY(SELECT i.intent_id COLLATE "C"
               FROM anchor_receipts r JOIN anchor_intents i USING (intent_id)
              WHERE r.batch_id = v_batch AND i.batch_id = v_batch AND i.state = 'submitted'
              ORDER BY 1)
       IS DISTINCT FROM ARRAY(SELECT u.id COLLATE "C" FROM unnest(v_ids) AS u(id) ORDER BY 1)
    THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Retry',
            'code', 'intents_changed', 'message', 'the batch''s intents changed meanwhile',
            'details', jsonb_build_object('batchId', v_batch));
        RETURN;
    END IF;
    IF p_rows ->> 'outcome' = 'confirmed' THEN
        UPDATE anchor_batches SET state = 'confirmed',
               block_height = (p_rows ->> 'blockHeight')::bigint,
               block_hash = p_rows ->> 'blockHash',
               anchor_time = to_timestamp((p_rows ->> 'anchorTimeMs')::bigint / 1000.0),
               observed_at = now()
         WHERE batch_id = v_batch;
        UPDATE anchor_intents i SET state = 'confirmed', updated_at = now()
          FROM unnest(v_ids) AS u(id)
         WHERE i.intent_id = u.id;
    ELSE
        UPDATE anchor_batches SET state = 'dropped', observed_at = now()
         WHERE batch_id = v_batch;
        UPDATE anchor_intents SET state = 'pending', updated_at = now(), available_at = v_available
         WHERE intent_id = ANY (v_pending);
        INSERT INTO anchor_queue (sequence, intent_id, available_at)
        SELECT i.sequence, i.intent_id, v_available FROM anchor_intents i
         WHERE i.intent_id = ANY (v_pending)
        ON CONFLICT (sequence) DO UPDATE SET available_at = EXCLUDED.available_at;
        UPDATE anchor_intents SET state = 'failed', updated_at = now()
         WHERE intent_id = ANY (ARRAY(SELECT jsonb_array_elements_text(p_rows -> 'failed')));
    END IF;
    RETURN QUERY SELECT '{}'::text, NULL::jsonb;
END $$;
