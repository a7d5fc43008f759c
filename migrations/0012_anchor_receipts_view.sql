-- Anchor receipts without a row per claimed intent (issue 10, throughput).
--
-- An intent's current batch is already on its row (anchor_intents.batch_id, leaf_index): a claim
-- writing a receipt row for each of its members as well cost about a third of the claim (100,000
-- rows and their two indexes per 100,000 intents). Now `anchor_past_receipts` keeps only the
-- batches an intent has left: a claim records an intent's previous batch there when it takes it
-- into a new one (a dropped or re-orged batch, or an admin retry after an abandon), which the
-- common path never does. `anchor_receipts` becomes a view of both, with the same columns, so
-- every reader is unchanged; the two parts never overlap (a past receipt is never the current
-- batch), hence UNION ALL, which keeps the (batch_id, leaf_index) index order of each.

ALTER TABLE anchor_receipts RENAME TO anchor_past_receipts;
ALTER INDEX anchor_receipts_by_batch RENAME TO anchor_past_receipts_by_batch;
ALTER INDEX anchor_receipts_pkey RENAME TO anchor_past_receipts_pkey;
DELETE FROM anchor_past_receipts p USING anchor_intents i
 WHERE p.intent_id = i.intent_id AND p.batch_id = i.batch_id;

CREATE VIEW anchor_receipts AS
    SELECT intent_id, batch_id, leaf_index FROM anchor_intents WHERE batch_id IS NOT NULL
    UNION ALL
    SELECT intent_id, batch_id, leaf_index FROM anchor_past_receipts;

CREATE OR REPLACE FUNCTION apply_anchor_claim(p_seq bigint, p_subject text, p_rows jsonb)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_ids     text[];
    v_batches bigint[];
    v_leaves  integer[];
    v_result  text;
BEGIN
    SELECT coalesce(array_agg(p.intent_id ORDER BY p.sequence), '{}'),
           coalesce(array_agg(p.batch_id ORDER BY p.sequence), '{}'),
           coalesce(array_agg(p.leaf_index ORDER BY p.sequence), '{}')
      INTO v_ids, v_batches, v_leaves
      FROM (SELECT x.intent_id, x.sequence, x.batch_id, x.leaf_index FROM anchor_intents x
             WHERE x.state = 'pending'
               AND x.available_at <= to_timestamp((p_rows ->> 'availableAtMs')::bigint / 1000.0)
             ORDER BY x.sequence LIMIT (p_rows ->> 'batchSize')::integer) AS p;
    IF cardinality(v_ids) = 0 THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'NotFound',
            'code', 'nothing_pending', 'message', 'no anchor intent is pending',
            'details', '{}'::jsonb);
        RETURN;
    END IF;
    -- The batches the members leave (none on the common path: fresh intents have none).
    INSERT INTO anchor_past_receipts (intent_id, batch_id, leaf_index)
    SELECT p.intent_id, p.batch_id, p.leaf_index
      FROM unnest(v_ids, v_batches, v_leaves) AS p(intent_id, batch_id, leaf_index)
     WHERE p.batch_id IS NOT NULL
    ON CONFLICT DO NOTHING;
    WITH claimed AS (
        UPDATE anchor_intents i
           SET state = 'submitted', attempts = i.attempts + 1, batch_id = p_seq,
               leaf_index = (p.n - 1)::integer, updated_at = now()
          FROM unnest(v_ids) WITH ORDINALITY AS p(intent_id, n)
         WHERE i.intent_id = p.intent_id
        RETURNING i.intent_id, i.entry_did, i.sequence, i.item_data_hash, i.attempts,
                  i.leaf_index
    )
    SELECT json_agg(json_build_array(c.intent_id, c.entry_did, c.sequence, c.item_data_hash,
                                     c.attempts) ORDER BY c.leaf_index)::text
      INTO v_result FROM claimed c;
    INSERT INTO anchor_batches (batch_id, state) VALUES (p_seq, 'claimed');
    RETURN QUERY SELECT v_result, NULL::jsonb;
END $$;
