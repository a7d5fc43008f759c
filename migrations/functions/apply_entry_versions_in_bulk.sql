-- A batch of entry versions in bulk (append_changes, under the log head): one statement writes
-- every change's rows, positions p_head + 1 .. p_head + n in the batch's order, with the rows and
-- the outcome apply_entry_version and append_changes write for one version (a create's entries
-- row, an update's or a tombstone's new head on it, the searchable row as the handler sets it,
-- the version with its document, the anchor intent and its queue row, the log record, the
-- outcome under the Idempotency-Key). Under the lock it replaces n calls of the handler and n
-- rounds of append_changes's loop (statements each planned, executed and their results passed
-- back) by a few, each run only where the batch has its kind of version (a statement opens
-- every index of the tables it writes, whether it writes a row or not): what is left is the
-- rows and their indexes.
--
-- The caller (append_changes) has checked what the handler would check one change at a time,
-- for the whole batch: every change is an entry version without `also`, no two name one DID or
-- one key, and a create (no expectedHead) is not a tombstone and comes with the searchable row
-- it staged; under the lock, no key completed within the window, no create's DID has an entry
-- or a replica, and every other change's expectedHead is its entry's head. So none would be
-- refused or replayed, and no change's rows depend on another's.
-- tests/db/test_bulk_versions.py keeps this path's rows equal to the handler's.
CREATE OR REPLACE FUNCTION apply_entry_versions_in_bulk(p_head bigint, p_changes jsonb,
                                                        p_staged entry_staged[])
RETURNS TABLE (idx integer, seq bigint, result text, refusal jsonb, replayed boolean,
               fingerprint bytea)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_creates    boolean;
    v_updates    boolean;
    v_tombstones boolean;
BEGIN
    SELECT bool_or(t.c #>> '{rows,expectedHead}' IS NULL),
           bool_or(t.c #>> '{rows,expectedHead}' IS NOT NULL
                   AND t.c #>> '{rows,lifecycle}' <> 'deleted'),
           bool_or(t.c #>> '{rows,expectedHead}' IS NOT NULL
                   AND t.c #>> '{rows,lifecycle}' = 'deleted')
      INTO v_creates, v_updates, v_tombstones
      FROM jsonb_array_elements(p_changes) AS t(c);
    -- The rows are found by their key (ANY: a plan cached while a table is small must not scan
    -- it whole to hash-join it with the batch).
    IF v_creates THEN
        WITH c AS MATERIALIZED (
            SELECT p_head + t.n AS s, t.c ->> 'subject' AS did, t.c -> 'rows' AS r
              FROM jsonb_array_elements(p_changes) WITH ORDINALITY AS t(c, n)
             WHERE t.c #>> '{rows,expectedHead}' IS NULL
        ), new_entries AS (
            INSERT INTO entries (entry_did, head_seq, created_seq, publisher_did, entry_type,
                                 lifecycle)
            SELECT c.did, c.s, c.s, c.r ->> 'publisherDid', c.r ->> 'entryType',
                   c.r ->> 'lifecycle'
              FROM c
        )
        UPDATE entry_search x SET head_seq = c.s FROM c
         WHERE x.entry_did = ANY (ARRAY(SELECT c.did FROM c)) AND x.entry_did = c.did;
    END IF;
    IF v_updates THEN
        WITH c AS MATERIALIZED (
            SELECT p_head + t.n AS s, t.c ->> 'subject' AS did, t.c -> 'rows' AS r,
                   p_staged[t.n] AS p
              FROM jsonb_array_elements(p_changes) WITH ORDINALITY AS t(c, n)
             WHERE t.c #>> '{rows,expectedHead}' IS NOT NULL
               AND t.c #>> '{rows,lifecycle}' <> 'deleted'
        ), new_heads AS (
            UPDATE entries e
               SET head_seq = c.s, publisher_did = c.r ->> 'publisherDid',
                   entry_type = c.r ->> 'entryType', lifecycle = c.r ->> 'lifecycle'
              FROM c
             WHERE e.entry_did = ANY (ARRAY(SELECT c.did FROM c)) AND e.entry_did = c.did
        )
        UPDATE entry_search x
           SET head_seq = c.s, publisher_did = c.r ->> 'publisherDid',
               entry_type = c.r ->> 'entryType', lifecycle = c.r ->> 'lifecycle',
               name = (c.p).name, description = (c.p).description, version = (c.p).version,
               tags = (c.p).tags, service_types = (c.p).service_types,
               relationships = (c.p).relationships, custom_metadata = (c.p).custom_metadata,
               published_at = (c.p).published_at, updated_at = (c.p).updated_at,
               search = (c.p).search
          FROM c
         WHERE x.entry_did = ANY (ARRAY(SELECT c.did FROM c)) AND x.entry_did = c.did;
    END IF;
    IF v_tombstones THEN
        -- A tombstone keeps its publisher, its type and the projection it had (discovery
        -- never lists it).
        WITH c AS MATERIALIZED (
            SELECT p_head + t.n AS s, t.c ->> 'subject' AS did, t.c #>> '{rows,lifecycle}' AS l
              FROM jsonb_array_elements(p_changes) WITH ORDINALITY AS t(c, n)
             WHERE t.c #>> '{rows,expectedHead}' IS NOT NULL
               AND t.c #>> '{rows,lifecycle}' = 'deleted'
        ), new_heads AS (
            UPDATE entries e SET head_seq = c.s, lifecycle = c.l FROM c
             WHERE e.entry_did = ANY (ARRAY(SELECT c.did FROM c)) AND e.entry_did = c.did
        )
        UPDATE entry_search x SET head_seq = c.s, lifecycle = c.l FROM c
         WHERE x.entry_did = ANY (ARRAY(SELECT c.did FROM c)) AND x.entry_did = c.did;
    END IF;
    -- What every version writes: the version, its anchor intent, the log record, the outcome.
    RETURN QUERY
    WITH c AS MATERIALIZED (
        SELECT t.n::integer AS i, p_head + t.n AS s, t.c ->> 'subject' AS did, t.c -> 'rows' AS r,
               t.c -> 'idem' AS idem, t.c ->> 'kind' AS kind,
               coalesce(t.c -> 'event', '{}'::jsonb) AS event,
               (p_staged[t.n]).prefix || (p_head + t.n)::text || (p_staged[t.n]).suffix AS doc,
               (p_staged[t.n]).version AS version
          FROM jsonb_array_elements(p_changes) WITH ORDINALITY AS t(c, n)
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
