-- The served document leaves the entries row: it is read from entry_versions at head_seq.
--
-- entries keeps only what discovery filters and orders by (about 520 bytes a row instead of
-- 1,650 on the bench's documents), so the scans and counts of broad filters touch about a third
-- of the pages, and the table and its indexes stay in shared buffers far longer. Every version's
-- document was already in entry_versions (the head included), so nothing is copied.

CREATE OR REPLACE FUNCTION entry_write_batch(
    p_kind text[], p_did text[], p_expected_head bigint[], p_publisher text[],
    p_entry_type text[], p_lifecycle text[], p_prefix text[], p_suffix text[],
    p_scope text[], p_op text[], p_key text[], p_fp bytea[], p_status integer[])
RETURNS TABLE (idx integer, seq bigint, doc text, replay_status integer, error text)
LANGUAGE plpgsql AS $$
DECLARE
    v_seq  bigint;
    v_doc  text;
    v_head bigint;
    v_live boolean;
    p      record;
    r      record;
    i      integer;
BEGIN
    -- The log head is locked for the whole batch: writers (and batches) are serialised.
    UPDATE log_head SET seq = log_head.seq WHERE id = 1 RETURNING log_head.seq INTO v_seq;
    FOR i IN 1 .. coalesce(array_length(p_did, 1), 0) LOOP
        IF p_key[i] IS NOT NULL THEN
            SELECT x.fingerprint, x.status, x.response INTO r FROM idempotency x
             WHERE x.scope = p_scope[i] AND x.operation = p_op[i] AND x.key = p_key[i]
               AND x.created_at > now() - interval '24 hours';
            IF FOUND THEN
                IF r.fingerprint <> p_fp[i] THEN
                    RETURN QUERY SELECT i, NULL::bigint, NULL::text, NULL::integer, 'idempotency_conflict'::text;
                ELSE
                    RETURN QUERY SELECT i, NULL::bigint, r.response, r.status, NULL::text;
                END IF;
                CONTINUE;
            END IF;
        END IF;
        SELECT e.head_seq INTO v_head FROM entries e WHERE e.entry_did = p_did[i];
        v_live := FOUND;
        IF p_expected_head[i] IS NULL AND v_live THEN
            RETURN QUERY SELECT i, NULL::bigint, NULL::text, NULL::integer, 'entry_exists'::text;
            CONTINUE;
        ELSIF p_expected_head[i] IS NOT NULL AND NOT v_live THEN
            RETURN QUERY SELECT i, NULL::bigint, NULL::text, NULL::integer, 'entry_not_found'::text;
            CONTINUE;
        ELSIF p_expected_head[i] IS NOT NULL AND v_head <> p_expected_head[i] THEN
            RETURN QUERY SELECT i, NULL::bigint, NULL::text, NULL::integer, 'sequence_conflict'::text;
            CONTINUE;
        END IF;
        v_seq := v_seq + 1;
        v_doc := p_prefix[i] || v_seq::text || p_suffix[i];
        IF p_lifecycle[i] = 'deleted' THEN
            UPDATE entries e SET head_seq = v_seq, lifecycle = p_lifecycle[i],
                   updated_at = now()
             WHERE e.entry_did = p_did[i];
        ELSE
            SELECT * INTO p FROM entry_projection(v_doc);
            IF p_expected_head[i] IS NULL THEN
                INSERT INTO entries (entry_did, head_seq, created_seq, publisher_did, entry_type,
                                     lifecycle, name, description, version, tags,
                                     service_types, relationships, custom_metadata, published_at,
                                     updated_at, search)
                VALUES (p_did[i], v_seq, v_seq, p_publisher[i], p_entry_type[i], p_lifecycle[i],
                        p.name, p.description, p.version, p.tags, p.service_types,
                        p.relationships, p.custom_metadata, p.published_at, p.updated_at,
                        p.search);
            ELSE
                UPDATE entries e SET head_seq = v_seq, publisher_did = p_publisher[i],
                       entry_type = p_entry_type[i], lifecycle = p_lifecycle[i],
                       name = p.name, description = p.description, version = p.version,
                       tags = p.tags, service_types = p.service_types,
                       relationships = p.relationships, custom_metadata = p.custom_metadata,
                       published_at = p.published_at, updated_at = p.updated_at,
                       search = p.search
                 WHERE e.entry_did = p_did[i];
            END IF;
        END IF;
        INSERT INTO entry_versions (seq, entry_did, publisher_did, lifecycle, doc)
        VALUES (v_seq, p_did[i], p_publisher[i], p_lifecycle[i], v_doc);
        INSERT INTO log (seq, kind, entry_did, data)
        VALUES (v_seq, p_kind[i], p_did[i], jsonb_build_object(
            'entryType', p_entry_type[i], 'publisherDid', p_publisher[i],
            'lifecycleStatus', p_lifecycle[i]));
        PERFORM pg_notify('registry_log', v_seq::text || ' ' || p_did[i]);
        IF p_key[i] IS NOT NULL THEN
            INSERT INTO idempotency (scope, operation, key, fingerprint, status, response)
            VALUES (p_scope[i], p_op[i], p_key[i], p_fp[i], p_status[i], v_doc)
            ON CONFLICT (scope, operation, key) DO UPDATE
               SET fingerprint = EXCLUDED.fingerprint, status = EXCLUDED.status,
                   response = EXCLUDED.response, created_at = now();
        END IF;
        RETURN QUERY SELECT i, v_seq, v_doc, NULL::integer, NULL::text;
    END LOOP;
    UPDATE log_head SET seq = v_seq WHERE id = 1;
END $$;

ALTER TABLE entries DROP COLUMN doc;
-- Rewrite the table now, so the dropped column's space is given back at once.
CLUSTER entries USING entries_pkey;
