-- A batch of entry creations in bulk (append_changes, under the log head): one statement writes
-- every create's rows, positions p_head + 1 .. p_head + n in the batch's order, with the rows and
-- the outcome apply_entry_version and append_changes write for one create (the entries row, the
-- searchable row's head_seq, the version with its document, the anchor intent and its queue row,
-- the log record, the outcome under the Idempotency-Key). Under the lock it replaces n calls of
-- the handler and n rounds of append_changes's loop (statements each planned, executed and their
-- results passed back) by one: what is left is the rows and their indexes.
--
-- The caller (append_changes) has checked what the handler would check one create at a time,
-- for the whole batch: every change is a create (no expectedHead, not a tombstone, no `also`)
-- whose searchable row was inserted when it was staged; no two name one DID or one key; under
-- the lock, no DID has an entry or a replica and no key completed within the window. So none
-- would be refused or replayed, and their rows do not depend on one another.
-- tests/db/test_bulk_creates.py keeps this path's rows equal to the handler's.
CREATE OR REPLACE FUNCTION apply_entry_creates(p_head bigint, p_changes jsonb,
                                               p_staged entry_staged[])
RETURNS TABLE (idx integer, seq bigint, result text, refusal jsonb, replayed boolean,
               fingerprint bytea)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH c AS MATERIALIZED (
        SELECT t.n::integer AS i, p_head + t.n AS s, t.c ->> 'subject' AS did, t.c -> 'rows' AS r,
               t.c -> 'idem' AS idem, t.c ->> 'kind' AS kind,
               coalesce(t.c -> 'event', '{}'::jsonb) AS event,
               (p_staged[t.n]).prefix || (p_head + t.n)::text || (p_staged[t.n]).suffix AS doc,
               (p_staged[t.n]).version AS version
          FROM jsonb_array_elements(p_changes) WITH ORDINALITY AS t(c, n)
    ), new_entries AS (
        INSERT INTO entries (entry_did, head_seq, created_seq, publisher_did, entry_type,
                             lifecycle)
        SELECT c.did, c.s, c.s, c.r ->> 'publisherDid', c.r ->> 'entryType',
               c.r ->> 'lifecycle'
          FROM c
    ), heads AS (
        -- The rows by their key (ANY: a plan cached while the table is small must not scan
        -- it whole to hash-join it with the batch).
        UPDATE entry_search x SET head_seq = c.s FROM c
         WHERE x.entry_did = ANY (ARRAY(SELECT c.did FROM c)) AND x.entry_did = c.did
    ), versions AS (
        INSERT INTO entry_versions (seq, entry_did, publisher_did, lifecycle, doc, version)
        SELECT c.s, c.did, c.r ->> 'publisherDid', c.r ->> 'lifecycle', c.doc, c.version FROM c
    ), intents AS (
        INSERT INTO anchor_intents (intent_id, entry_did, sequence, operation, item_data_hash)
        SELECT 'ai_' || c.s, c.did, c.s, c.r #>> '{anchor,operation}',
               c.r #>> '{anchor,itemDataHash}'
          FROM c WHERE c.r ? 'anchor'
    ), queued AS (
        INSERT INTO anchor_queue (sequence, intent_id, available_at)
        SELECT c.s, 'ai_' || c.s, now() FROM c WHERE c.r ? 'anchor'
    ), records AS (
        INSERT INTO log (seq, kind, entry_did, data) SELECT c.s, c.kind, c.did, c.event FROM c
    ), outcomes AS (
        -- An entry version's outcome is its document, named by its sequence (migration 0022).
        INSERT INTO idempotency (scope, operation, key, fingerprint, sequence, result, refusal)
        SELECT c.idem ->> 'scope', c.idem ->> 'operation', c.idem ->> 'key',
               decode(c.idem ->> 'fingerprint', 'hex'), c.s, NULL, NULL
          FROM c WHERE c.idem IS NOT NULL
        ON CONFLICT (scope, operation, key) DO UPDATE
           SET fingerprint = EXCLUDED.fingerprint, sequence = EXCLUDED.sequence,
               result = EXCLUDED.result, refusal = EXCLUDED.refusal, created_at = now()
    )
    SELECT c.i, c.s, c.doc, NULL::jsonb, false, NULL::bytea FROM c ORDER BY c.i;
END $$;
