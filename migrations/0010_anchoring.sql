-- Anchoring (design §8, spec 2.2, 2.3): durable anchor intents, batches and their receipts.
--
-- Every entry version records its anchor intent in the transaction that writes it (rows.anchor
-- of apply_entry_version: {operation, itemDataHash}); intent id `ai_<sequence>`. The anchoring
-- supervisor (one per database, elected by an advisory lock) moves intents through changes of
-- the one append path:
--   apply_anchor_claim      pending (available) → submitted, as a new batch (batch id = the
--                           claim's log position; leaf order = sequence order)
--   apply_anchor_settle     a batch's submitted intents → confirmed (final on the chain), or
--                           → pending again (dropped / re-orged transaction, with a backoff) or
--                           → failed (attempts exhausted)
--   apply_anchor_control    admin retry (failed|abandoned → pending) and abandon
--                           (pending|submitted|failed → abandoned)
-- Each is compare-and-set on the intents' states (`Retry` when they moved). The batch's root
-- and transaction id are bookkeeping (record_anchor_submission), not intent state changes.

-- Milliseconds since the epoch (what the store port reads times as).
CREATE FUNCTION epoch_ms(timestamptz) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE AS $$ SELECT (extract(epoch FROM $1) * 1000)::bigint $$;

CREATE TABLE anchor_batches (
    batch_id       bigint      PRIMARY KEY,   -- the log position of its claim
    root           text,                      -- Merkle root, once computed
    transaction_id text,                      -- on the chain, once submitted
    state          text        NOT NULL,      -- claimed | submitted | confirmed | dropped
    block_height   bigint,
    block_hash     text,
    anchor_time    timestamptz,
    created_at     timestamptz NOT NULL DEFAULT now(),
    observed_at    timestamptz
);

CREATE TABLE anchor_intents (
    intent_id      text        PRIMARY KEY,
    entry_did      text        NOT NULL,
    sequence       bigint      NOT NULL UNIQUE,
    operation      text        NOT NULL,      -- create | update | transfer | delete
    item_data_hash text        NOT NULL,
    state          text        NOT NULL DEFAULT 'pending',
    attempts       integer     NOT NULL DEFAULT 0,
    available_at   timestamptz NOT NULL DEFAULT now(),
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    batch_id       bigint,                    -- its current batch
    leaf_index     integer
);
CREATE INDEX anchor_intents_pending ON anchor_intents (sequence) WHERE state = 'pending';
CREATE INDEX anchor_intents_by_entry ON anchor_intents (entry_did, sequence, created_at, intent_id);
CREATE INDEX anchor_intents_by_batch ON anchor_intents (batch_id, leaf_index);

-- Every batch an intent was part of: its receipts.
CREATE TABLE anchor_receipts (
    intent_id  text    NOT NULL,
    batch_id   bigint  NOT NULL,
    leaf_index integer NOT NULL,
    PRIMARY KEY (intent_id, batch_id)
);
CREATE INDEX anchor_receipts_by_batch ON anchor_receipts (batch_id, leaf_index);

CREATE OR REPLACE FUNCTION apply_entry_version(p_seq bigint, p_did text, p_rows jsonb)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_expected  bigint := (p_rows ->> 'expectedHead')::bigint;
    v_publisher text := p_rows ->> 'publisherDid';
    v_type      text := p_rows ->> 'entryType';
    v_lifecycle text := p_rows ->> 'lifecycle';
    v_head      bigint;
    v_doc       text;
    p           record;
BEGIN
    SELECT e.head_seq INTO v_head FROM entries e WHERE e.entry_did = p_did;
    IF v_expected IS NULL AND FOUND THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Conflict',
            'code', 'entry_exists', 'message', 'an entry with this DID exists or existed',
            'details', jsonb_build_object('entryDid', p_did));
        RETURN;
    ELSIF v_expected IS NOT NULL AND NOT FOUND THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'NotFound',
            'code', 'entry_not_found', 'message', 'entry not found',
            'details', jsonb_build_object('entryDid', p_did));
        RETURN;
    ELSIF v_expected IS NOT NULL AND v_head <> v_expected THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Conflict',
            'code', 'sequence_conflict',
            'message', 'the entry changed since the version this request is based on',
            'details', jsonb_build_object('latestSequence', v_head));
        RETURN;
    END IF;
    v_doc := (p_rows ->> 'prefix') || p_seq::text || (p_rows ->> 'suffix');
    IF v_lifecycle = 'deleted' THEN
        UPDATE entries e SET head_seq = p_seq, lifecycle = v_lifecycle, updated_at = now()
         WHERE e.entry_did = p_did;
    ELSE
        SELECT * INTO p FROM entry_projection(v_doc);
        IF v_expected IS NULL THEN
            INSERT INTO entries (entry_did, head_seq, created_seq, publisher_did, entry_type,
                                 lifecycle, name, description, version, tags, service_types,
                                 relationships, custom_metadata, published_at, updated_at,
                                 search)
            VALUES (p_did, p_seq, p_seq, v_publisher, v_type, v_lifecycle, p.name,
                    p.description, p.version, p.tags, p.service_types, p.relationships,
                    p.custom_metadata, p.published_at, p.updated_at, p.search);
        ELSE
            UPDATE entries e SET head_seq = p_seq, publisher_did = v_publisher,
                   entry_type = v_type, lifecycle = v_lifecycle, name = p.name,
                   description = p.description, version = p.version, tags = p.tags,
                   service_types = p.service_types, relationships = p.relationships,
                   custom_metadata = p.custom_metadata, published_at = p.published_at,
                   updated_at = p.updated_at, search = p.search
             WHERE e.entry_did = p_did;
        END IF;
    END IF;
    INSERT INTO entry_versions (seq, entry_did, publisher_did, lifecycle, doc)
    VALUES (p_seq, p_did, v_publisher, v_lifecycle, v_doc);
    IF p_rows ? 'anchor' THEN
        INSERT INTO anchor_intents (intent_id, entry_did, sequence, operation, item_data_hash)
        VALUES ('ai_' || p_seq, p_did, p_seq, p_rows #>> '{anchor,operation}',
                p_rows #>> '{anchor,itemDataHash}');
    END IF;
    RETURN QUERY SELECT v_doc, NULL::jsonb;
END $$;

-- append_changes of 0009 with the `also` records inserted in one statement (a batch of anchor
-- confirmations appends one per intent).
CREATE OR REPLACE FUNCTION append_changes(p_changes jsonb)
RETURNS TABLE (idx integer, seq bigint, result text, refusal jsonb, replayed boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_head    bigint;
    v_start   bigint;
    v_seq     bigint;
    c         jsonb;
    i         integer := 0;
    r         record;
    h         record;
    v_fp      bytea;
BEGIN
    UPDATE log_head SET seq = log_head.seq WHERE id = 1 RETURNING log_head.seq INTO v_head;
    v_start := v_head;
    FOR c IN SELECT value FROM jsonb_array_elements(p_changes) LOOP
        i := i + 1;
        IF c ? 'idem' THEN
            v_fp := decode(c #>> '{idem,fingerprint}', 'hex');
            SELECT x.fingerprint, x.sequence, x.result, x.refusal INTO r FROM idempotency x
             WHERE x.scope = c #>> '{idem,scope}' AND x.operation = c #>> '{idem,operation}'
               AND x.key = c #>> '{idem,key}' AND x.created_at > now() - interval '24 hours';
            IF FOUND THEN
                IF r.fingerprint <> v_fp THEN
                    RETURN QUERY SELECT i, NULL::bigint, NULL::text, jsonb_build_object(
                        'kind', 'Conflict', 'code', 'idempotency_conflict',
                        'message', 'this Idempotency-Key was already used for a different request',
                        'details', '{}'::jsonb), false;
                ELSE
                    RETURN QUERY SELECT i, r.sequence, r.result, r.refusal, true;
                END IF;
                CONTINUE;
            END IF;
        END IF;
        EXECUTE format('SELECT result, refusal FROM %I($1, $2, $3)', c ->> 'handler')
           INTO h USING v_head + 1, c ->> 'subject', c -> 'rows';
        v_seq := NULL;
        IF h.refusal IS NULL THEN
            v_head := v_head + 1;
            v_seq := v_head;
            INSERT INTO log (seq, kind, entry_did, data)
            VALUES (v_head, c ->> 'kind', c ->> 'subject', coalesce(c -> 'event', '{}'::jsonb));
            IF c ? 'also' THEN
                INSERT INTO log (seq, kind, entry_did, data)
                SELECT v_head + t.n, t.a ->> 'kind', t.a ->> 'subject',
                       coalesce(t.a -> 'event', '{}'::jsonb)
                  FROM jsonb_array_elements(c -> 'also') WITH ORDINALITY AS t(a, n);
                v_head := v_head + jsonb_array_length(c -> 'also');
            END IF;
        END IF;
        IF c ? 'idem' AND (h.refusal IS NULL OR h.refusal ->> 'kind' <> 'Retry') THEN
            INSERT INTO idempotency (scope, operation, key, fingerprint, sequence, result, refusal)
            VALUES (c #>> '{idem,scope}', c #>> '{idem,operation}', c #>> '{idem,key}', v_fp,
                    v_seq, h.result, h.refusal)
            ON CONFLICT (scope, operation, key) DO UPDATE
               SET fingerprint = EXCLUDED.fingerprint, sequence = EXCLUDED.sequence,
                   result = EXCLUDED.result, refusal = EXCLUDED.refusal, created_at = now();
        END IF;
        RETURN QUERY SELECT i, v_seq, h.result, h.refusal, false;
    END LOOP;
    IF v_head > v_start THEN
        UPDATE log_head SET seq = v_head WHERE id = 1;
        PERFORM pg_notify('registry_log', v_head::text);
    END IF;
END $$;


-- rows: {batchSize, availableAtMs}. Result: the batch's members in leaf order,
-- [[intentId, entryDid, sequence, itemDataHash, attempts], ...]; refuses `nothing_pending` (never recorded:
-- the supervisor's changes carry no Idempotency-Key).
--
-- Set-based and plan-proof: the members are picked once (the pending index, in sequence order),
-- updated through their primary key, and the receipts and the result come from that pick and the
-- UPDATE's RETURNING (no second read of the batch). Written so that a generic plan (a session
-- without plan_cache_mode = force_custom_plan) stays O(batch), never a scan of every intent.
CREATE FUNCTION apply_anchor_claim(p_seq bigint, p_subject text, p_rows jsonb)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_ids    text[];
    v_result text;
BEGIN
    v_ids := ARRAY(
        SELECT x.intent_id FROM anchor_intents x
         WHERE x.state = 'pending'
           AND x.available_at <= to_timestamp((p_rows ->> 'availableAtMs')::bigint / 1000.0)
         ORDER BY x.sequence LIMIT (p_rows ->> 'batchSize')::integer);
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
         WHERE i.intent_id = p.intent_id
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

-- rows: {batchId, intents: [ids the decision was made on: the batch's submitted intents],
--        outcome: "confirmed" | "dropped", blockHeight?, blockHash?, anchorTimeMs?,
--        pending: [ids back to pending], failed: [ids now failed], availableAtMs}
CREATE FUNCTION apply_anchor_settle(p_seq bigint, p_subject text, p_rows jsonb)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_batch  bigint := (p_rows ->> 'batchId')::bigint;
    v_ids    text[] := ARRAY(SELECT jsonb_array_elements_text(p_rows -> 'intents'));
BEGIN
    -- Compare-and-set: the batch's submitted intents are exactly `intents`. As sorted arrays
    -- (O(n log n) whatever the plan: `NOT (intent_id = ANY (v_ids))` is hashed only in a custom
    -- plan, and a generic plan made it O(n²), over a minute for a batch of 100,000).
    IF ARRAY(SELECT intent_id COLLATE "C" FROM anchor_intents
              WHERE batch_id = v_batch AND state = 'submitted' ORDER BY 1)
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
        UPDATE anchor_intents SET state = 'confirmed', updated_at = now()
         WHERE batch_id = v_batch AND state = 'submitted';
    ELSE
        UPDATE anchor_batches SET state = 'dropped', observed_at = now()
         WHERE batch_id = v_batch;
        UPDATE anchor_intents SET state = 'pending', updated_at = now(),
               available_at = to_timestamp((p_rows ->> 'availableAtMs')::bigint / 1000.0)
         WHERE intent_id = ANY (ARRAY(SELECT jsonb_array_elements_text(p_rows -> 'pending')));
        UPDATE anchor_intents SET state = 'failed', updated_at = now()
         WHERE intent_id = ANY (ARRAY(SELECT jsonb_array_elements_text(p_rows -> 'failed')));
    END IF;
    RETURN QUERY SELECT '{}'::text, NULL::jsonb;
END $$;

-- Admin retry and abandon. rows: {intentId, from: state read, to: "pending" | "abandoned"}.
CREATE FUNCTION apply_anchor_control(p_seq bigint, p_subject text, p_rows jsonb)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE anchor_intents
       SET state = p_rows ->> 'to', updated_at = now(),
           attempts = CASE WHEN p_rows ->> 'to' = 'pending' THEN 0 ELSE attempts END,
           available_at = CASE WHEN p_rows ->> 'to' = 'pending' THEN now() ELSE available_at END
     WHERE intent_id = p_rows ->> 'intentId' AND state = p_rows ->> 'from';
    IF NOT FOUND THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Retry',
            'code', 'intent_changed', 'message', 'the intent changed meanwhile',
            'details', jsonb_build_object('intentId', p_rows ->> 'intentId'));
        RETURN;
    END IF;
    RETURN QUERY SELECT jsonb_build_object('intentId', p_rows ->> 'intentId',
                                           'state', p_rows ->> 'to')::text, NULL::jsonb;
END $$;
