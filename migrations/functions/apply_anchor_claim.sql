-- rows: {batchSize, availableAtMs}. Result: the batch's members in leaf order,
-- [[intentId, entryDid, sequence, itemDataHash, attempts], ...]; refuses `nothing_pending` (never
-- recorded: the supervisor's changes carry no Idempotency-Key).
--
-- Members come from anchor_queue (sequence order, available ones), and only intents still
-- pending move. Set-based and plan-proof: the members are picked once, updated through their
-- primary key, and the receipts and the result come from that pick and the UPDATE's RETURNING
-- (no second read of the batch), so a generic plan (a session without plan_cache_mode =
-- force_custom_plan) stays O(batch), never a scan of every intent.
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
