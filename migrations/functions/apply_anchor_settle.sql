-- rows: {batchId, intents: [ids the decision was made on: the batch's submitted intents],
--        outcome: "confirmed" | "dropped", blockHeight?, blockHash?, anchorTimeMs?,
--        pending: [ids back to pending], failed: [ids now failed], availableAtMs}
-- The batch's members are found through its receipts; a requeue of an intent somehow queued
-- already refreshes its row in anchor_queue instead of failing the settle.
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
