-- Entry versions: create (expectedHead null: the DID must be new), update, transfer and delete.
-- rows: {expectedHead, publisherDid, entryType, lifecycle, prefix, suffix, anchor?}; the served
-- document is prefix ‖ sequence ‖ suffix. The version records its anchor intent in the same
-- transaction (rows.anchor: {operation, itemDataHash}; intent id `ai_<sequence>`).
-- p_staged: what stage_entry_version derived from the rows before the log head was locked
-- (append_changes), with a create's entry_search row already inserted (p_staged.inserted);
-- without it (a nested call) the handler derives it itself. The position-free searchable
-- projection is entry_search's (migration 0021); entries holds the head.
CREATE OR REPLACE FUNCTION apply_entry_version(p_seq bigint, p_did text, p_rows jsonb,
                                               p_staged entry_staged DEFAULT NULL)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_expected  bigint := (p_rows ->> 'expectedHead')::bigint;
    v_publisher text := p_rows ->> 'publisherDid';
    v_type      text := p_rows ->> 'entryType';
    v_lifecycle text := p_rows ->> 'lifecycle';
    v_head      bigint;
    v_origin    text;
    v_doc       text;
    p           entry_staged := p_staged;
BEGIN
    SELECT e.head_seq INTO v_head FROM entries e WHERE e.entry_did = p_did;
    IF v_expected IS NULL AND FOUND THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Conflict',
            'code', 'entry_exists', 'message', 'an entry with this DID exists or existed',
            'details', jsonb_build_object('entryDid', p_did));
        RETURN;
    ELSIF v_expected IS NULL THEN
        -- One name, one entry: a DID held as another registry's replica is its origin's to
        -- write (checked here, under the log head, so no import can slip in between).
        SELECT r.origin_did INTO v_origin FROM replica_versions r WHERE r.entry_did = p_did
         ORDER BY r.synced_seq DESC, r.origin_seq DESC LIMIT 1;
        IF FOUND THEN
            RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Conflict',
                'code', 'entry_is_replica', 'message',
                'this DID is another registry''s entry (a replica here); write it at its origin',
                'details', jsonb_build_object('entryDid', p_did, 'origin', v_origin));
            RETURN;
        END IF;
    ELSIF v_expected IS NOT NULL AND NOT FOUND THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'NotFound',
            'code', 'entry_not_found', 'message', 'entry not found',
            'details', jsonb_build_object('entryDid', p_did));
        RETURN;
    ELSIF v_expected IS NOT NULL AND v_head <> v_expected AND v_lifecycle = 'deleted' THEN
        -- A delete has no precondition (docs/api.md): the entry moved since it was decided,
        -- so it is decided again on the new head (deleted meanwhile: 404 then).
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Retry',
            'code', 'entry_changed', 'message', 'the entry changed meanwhile',
            'details', jsonb_build_object('entryDid', p_did));
        RETURN;
    ELSIF v_expected IS NOT NULL AND v_head <> v_expected THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Conflict',
            'code', 'sequence_conflict',
            'message', 'the entry changed since the version this request is based on',
            'details', jsonb_build_object('latestSequence', v_head));
        RETURN;
    END IF;
    IF p.prefix IS NULL THEN
        -- A nested call (apply_records: a transfer) writes a version of an existing entry. A
        -- create must come staged from append_changes, whose rows of new DIDs are inserted
        -- before the log head in one order: one inserted under the lock could wait on another
        -- batch's staged row while that batch waits for the lock.
        IF v_expected IS NULL THEN
            RAISE EXCEPTION 'apply_entry_version: a create of % must be staged by append_changes',
                p_did;
        END IF;
        p := stage_entry_version(p_rows);
    END IF;
    v_doc := p.prefix || p_seq::text || p.suffix;
    IF v_lifecycle = 'deleted' THEN
        -- A tombstone keeps the projection it had (discovery never lists it).
        UPDATE entries e SET head_seq = p_seq, lifecycle = v_lifecycle WHERE e.entry_did = p_did;
        UPDATE entry_search s SET head_seq = p_seq, lifecycle = v_lifecycle
         WHERE s.entry_did = p_did;
    ELSIF v_expected IS NULL THEN
        INSERT INTO entries (entry_did, head_seq, created_seq, publisher_did, entry_type,
                             lifecycle)
        VALUES (p_did, p_seq, p_seq, v_publisher, v_type, v_lifecycle);
        -- Its entry_search row was inserted when append_changes staged it, unless a change
        -- before it in the batch staged the same DID and was not applied (which deleted that
        -- row): then it is inserted here, a DID no other batch can be inserting (this batch
        -- held it until then).
        IF p.inserted IS NOT TRUE AND NOT insert_entry_search(p_did, p_rows, p) THEN
            RAISE EXCEPTION 'apply_entry_version: % has a searchable row but no entry', p_did;
        END IF;
        UPDATE entry_search s SET head_seq = p_seq WHERE s.entry_did = p_did;
    ELSE
        UPDATE entries e SET head_seq = p_seq, publisher_did = v_publisher,
               entry_type = v_type, lifecycle = v_lifecycle
         WHERE e.entry_did = p_did;
        UPDATE entry_search s SET head_seq = p_seq, publisher_did = v_publisher,
               entry_type = v_type, lifecycle = v_lifecycle, name = p.name,
               description = p.description, version = p.version, tags = p.tags,
               service_types = p.service_types, relationships = p.relationships,
               custom_metadata = p.custom_metadata, published_at = p.published_at,
               updated_at = p.updated_at, search = p.search
         WHERE s.entry_did = p_did;
    END IF;
    INSERT INTO entry_versions (seq, entry_did, publisher_did, lifecycle, doc, version)
    VALUES (p_seq, p_did, v_publisher, v_lifecycle, v_doc, p.version);
    IF p_rows ? 'anchor' THEN
        INSERT INTO anchor_intents (intent_id, entry_did, sequence, operation, item_data_hash)
        VALUES ('ai_' || p_seq, p_did, p_seq, p_rows #>> '{anchor,operation}',
                p_rows #>> '{anchor,itemDataHash}');
        INSERT INTO anchor_queue (sequence, intent_id, available_at)
        VALUES (p_seq, 'ai_' || p_seq, now());
    END IF;
    RETURN QUERY SELECT v_doc, NULL::jsonb;
END $$;
