-- Idempotency folded into entry_write: the success path of an entry change is one round trip.
--
-- entry_write first answers a request whose Idempotency-Key already completed (replay, or
-- idempotency_conflict for a different request), then takes the log head. A duplicate that
-- committed while this one waited for the head raises idempotency_retry (RG425): nothing is
-- written, and the caller calls again, which then replays.

DROP FUNCTION entry_write(text, text, bigint, text, text, text, text, text, text, text, text, bytea, integer);

CREATE FUNCTION entry_write(
    p_kind text, p_did text, p_expected_head bigint, p_publisher text, p_entry_type text,
    p_lifecycle text, p_prefix text, p_suffix text,
    p_scope text, p_op text, p_key text, p_fp bytea, p_status integer)
RETURNS TABLE (seq bigint, doc text, replay_status integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_seq  bigint;
    v_doc  text;
    v_head bigint;
    p      record;
    r      record;
BEGIN
    -- A completed request under this key is answered from its record, without a second effect.
    IF p_key IS NOT NULL THEN
        SELECT i.fingerprint, i.status, i.response INTO r FROM idempotency i
         WHERE i.scope = p_scope AND i.operation = p_op AND i.key = p_key
           AND i.created_at > now() - interval '24 hours';
        IF FOUND THEN
            IF r.fingerprint <> p_fp THEN
                RAISE EXCEPTION 'idempotency_conflict' USING ERRCODE = 'RG409';
            END IF;
            RETURN QUERY SELECT NULL::bigint, r.response, r.status;
            RETURN;
        END IF;
    END IF;
    UPDATE log_head SET seq = log_head.seq + 1 WHERE id = 1 RETURNING log_head.seq INTO v_seq;
    -- Writers are serialised from here: a duplicate that committed while we waited is visible.
    IF p_key IS NOT NULL AND EXISTS (
        SELECT 1 FROM idempotency i WHERE i.scope = p_scope AND i.operation = p_op
           AND i.key = p_key AND i.created_at > now() - interval '24 hours') THEN
        RAISE EXCEPTION 'idempotency_retry' USING ERRCODE = 'RG425';
    END IF;
    SELECT e.head_seq INTO v_head FROM entries e WHERE e.entry_did = p_did;
    IF p_expected_head IS NULL AND FOUND THEN
        RAISE EXCEPTION 'entry_exists' USING ERRCODE = 'RG409';
    ELSIF p_expected_head IS NOT NULL AND NOT FOUND THEN
        RAISE EXCEPTION 'entry_not_found' USING ERRCODE = 'RG404';
    ELSIF p_expected_head IS NOT NULL AND v_head <> p_expected_head THEN
        RAISE EXCEPTION 'sequence_conflict' USING ERRCODE = 'RG409';
    END IF;
    v_doc := p_prefix || v_seq::text || p_suffix;
    IF p_lifecycle = 'deleted' THEN
        SELECT NULL::text AS name INTO p;  -- a tombstone keeps the last searchable projection
    ELSE
        SELECT * INTO p FROM entry_projection(v_doc);
    END IF;
    IF p_expected_head IS NULL THEN
        INSERT INTO entries (entry_did, head_seq, created_seq, publisher_did, entry_type, lifecycle,
                             doc, name, description, version, tags, service_types, relationships,
                             custom_metadata, published_at, updated_at, search)
        VALUES (p_did, v_seq, v_seq, p_publisher, p_entry_type, p_lifecycle, v_doc,
                p.name, p.description, p.version, p.tags, p.service_types, p.relationships,
                p.custom_metadata, p.published_at, p.updated_at, p.search);
    ELSIF p_lifecycle = 'deleted' THEN
        UPDATE entries e SET head_seq = v_seq, lifecycle = p_lifecycle, doc = v_doc,
               updated_at = now()
         WHERE e.entry_did = p_did;
    ELSE
        UPDATE entries e SET head_seq = v_seq, publisher_did = p_publisher,
               entry_type = p_entry_type, lifecycle = p_lifecycle, doc = v_doc,
               name = p.name, description = p.description, version = p.version, tags = p.tags,
               service_types = p.service_types, relationships = p.relationships,
               custom_metadata = p.custom_metadata, published_at = p.published_at,
               updated_at = p.updated_at, search = p.search
         WHERE e.entry_did = p_did;
    END IF;
    INSERT INTO entry_versions (seq, entry_did, publisher_did, lifecycle, doc)
    VALUES (v_seq, p_did, p_publisher, p_lifecycle, v_doc);
    INSERT INTO log (seq, kind, entry_did, data)
    VALUES (v_seq, p_kind, p_did, jsonb_build_object(
        'entryType', p_entry_type, 'publisherDid', p_publisher, 'lifecycleStatus', p_lifecycle));
    PERFORM pg_notify('registry_log', v_seq::text || ' ' || p_did);
    IF p_key IS NOT NULL THEN
        INSERT INTO idempotency (scope, operation, key, fingerprint, status, response)
        VALUES (p_scope, p_op, p_key, p_fp, p_status, v_doc)
        ON CONFLICT (scope, operation, key) DO UPDATE
           SET fingerprint = EXCLUDED.fingerprint, status = EXCLUDED.status,
               response = EXCLUDED.response, created_at = now()
         WHERE idempotency.created_at <= now() - interval '24 hours';
        IF NOT FOUND THEN
            RAISE EXCEPTION 'idempotency_conflict' USING ERRCODE = 'RG409';
        END IF;
        DELETE FROM idempotency_claims c WHERE c.scope = p_scope AND c.operation = p_op AND c.key = p_key;
    END IF;
    RETURN QUERY SELECT v_seq, v_doc, NULL::integer;
END $$;

