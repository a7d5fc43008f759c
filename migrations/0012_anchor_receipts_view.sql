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
