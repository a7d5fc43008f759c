-- The change log as the spine: one append path for every kind of change, one idempotency record.
--
-- append_changes(changes jsonb) applies a batch of changes in one transaction (group commit).
-- For each change, in order:
--   1. an Idempotency-Key that already completed answers from its record (no second effect,
--      no log record, no event); a different request under the key is idempotency_conflict;
--   2. the kind's handler (a function named by the change, e.g. apply_entry_version) checks its
--      preconditions and writes its rows, or refuses without writing anything;
--   3. an applied change takes the next log position and appends its log record (the event);
--   4. the outcome, a result text or a refusal (domain data, never an HTTP status), is recorded
--      under the Idempotency-Key in the same transaction.
-- The log head row is locked for the whole batch, so commit order is sequence order (gap-free).
-- One NOTIFY per batch wakes the log readers of every process; the log itself is the truth.
--
-- A handler is `FUNCTION apply_x(p_seq bigint, p_subject text, p_rows jsonb)
-- RETURNS TABLE (result text, refusal jsonb)`. It must write nothing when it refuses; p_seq is
-- the position the change takes if it is applied. A new kind of change adds a handler.

DROP FUNCTION entry_write_batch(text[], text[], bigint[], text[], text[], text[], text[], text[],
                                text[], text[], text[], bytea[], integer[]);
DROP FUNCTION idem_begin(text, text, text, bytea, double precision);
DROP FUNCTION idem_finish(text, text, text, bytea, integer, text);
DROP TABLE idempotency_claims;

-- Outcomes as domain data: a result (with the log position it took) or a refusal
-- {kind, code, message, details}. Records of the old shape are converted, so a retry that
-- straddles the upgrade is still answered from its record.
ALTER TABLE idempotency
    ADD COLUMN sequence bigint,
    ADD COLUMN result   text,
    ADD COLUMN refusal  jsonb;
UPDATE idempotency SET
    result = CASE WHEN status < 300 THEN response END,
    sequence = CASE WHEN status < 300 AND response LIKE '{%'
                    THEN (response::jsonb ->> 'sequence')::bigint END,
    refusal = CASE WHEN status >= 300 THEN jsonb_build_object(
        'kind', CASE status WHEN 400 THEN 'Invalid' WHEN 401 THEN 'Unauthorized'
                            WHEN 403 THEN 'Forbidden' WHEN 404 THEN 'NotFound'
                            WHEN 413 THEN 'TooLarge' WHEN 415 THEN 'UnsupportedMediaType'
                            ELSE 'Conflict' END,
        'code', response::jsonb -> 'error' ->> 'code',
        'message', response::jsonb -> 'error' ->> 'message',
        'details', coalesce(response::jsonb -> 'error' -> 'details', '{}'::jsonb)) END;
ALTER TABLE idempotency DROP COLUMN status, DROP COLUMN response;
ALTER TABLE idempotency ADD CONSTRAINT idempotency_one_outcome
    CHECK ((result IS NULL) <> (refusal IS NULL));

CREATE FUNCTION append_changes(p_changes jsonb)
RETURNS TABLE (idx integer, seq bigint, result text, refusal jsonb, replayed boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_head    bigint;
    v_start   bigint;
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
        IF h.refusal IS NULL THEN
            v_head := v_head + 1;
            INSERT INTO log (seq, kind, entry_did, data)
            VALUES (v_head, c ->> 'kind', c ->> 'subject', coalesce(c -> 'event', '{}'::jsonb));
        END IF;
        IF c ? 'idem' THEN
            INSERT INTO idempotency (scope, operation, key, fingerprint, sequence, result, refusal)
            VALUES (c #>> '{idem,scope}', c #>> '{idem,operation}', c #>> '{idem,key}', v_fp,
                    CASE WHEN h.refusal IS NULL THEN v_head END, h.result, h.refusal)
            ON CONFLICT (scope, operation, key) DO UPDATE
               SET fingerprint = EXCLUDED.fingerprint, sequence = EXCLUDED.sequence,
                   result = EXCLUDED.result, refusal = EXCLUDED.refusal, created_at = now();
        END IF;
        RETURN QUERY SELECT i, CASE WHEN h.refusal IS NULL THEN v_head END, h.result, h.refusal,
                            false;
    END LOOP;
    IF v_head > v_start THEN
        UPDATE log_head SET seq = v_head WHERE id = 1;
        PERFORM pg_notify('registry_log', v_head::text);
    END IF;
END $$;

-- Record a refusal decided before the append path (validation, authorization) unless the key
-- already has an outcome; either way answer the outcome that stands under the key. The share
-- lock on the log head orders it with append_changes, which therefore always sees it.
CREATE FUNCTION record_refusal(p_scope text, p_op text, p_key text, p_fp bytea, p_refusal jsonb)
RETURNS TABLE (fingerprint bytea, seq bigint, result text, refusal jsonb, replayed boolean)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM log_head WHERE id = 1 FOR SHARE;
    INSERT INTO idempotency AS x (scope, operation, key, fingerprint, refusal)
    VALUES (p_scope, p_op, p_key, p_fp, p_refusal)
    ON CONFLICT (scope, operation, key) DO UPDATE
       SET fingerprint = EXCLUDED.fingerprint, sequence = NULL, result = NULL,
           refusal = EXCLUDED.refusal, created_at = now()
     WHERE x.created_at <= now() - interval '24 hours';
    IF FOUND THEN
        RETURN QUERY SELECT p_fp, NULL::bigint, NULL::text, p_refusal, false;
        RETURN;
    END IF;
    RETURN QUERY SELECT x.fingerprint, x.sequence, x.result, x.refusal, true FROM idempotency x
     WHERE x.scope = p_scope AND x.operation = p_op AND x.key = p_key;
END $$;

-- Entry versions: create (expectedHead null: the DID must be new), update, transfer and delete.
-- rows: {expectedHead, publisherDid, entryType, lifecycle, prefix, suffix}; the served document
-- is prefix ‖ sequence ‖ suffix.
CREATE FUNCTION apply_entry_version(p_seq bigint, p_did text, p_rows jsonb)
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
    RETURN QUERY SELECT v_doc, NULL::jsonb;
END $$;

-- Logout: revoke one session. rows: {tokenHash} (hex). Every process drops the session from
-- its cache when the log record reaches it.
CREATE FUNCTION apply_session_revoked(p_seq bigint, p_subject text, p_rows jsonb)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE sessions SET revoked_at = now()
     WHERE token_hash = decode(p_rows ->> 'tokenHash', 'hex') AND revoked_at IS NULL;
    IF NOT FOUND THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Unauthorized',
            'code', 'session_invalid', 'message', 'session missing, expired or unknown',
            'details', '{}'::jsonb);
        RETURN;
    END IF;
    RETURN QUERY SELECT '{"loggedOut":true}'::text, NULL::jsonb;
END $$;
