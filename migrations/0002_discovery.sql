-- Discovery: searchable columns of each entry's head version, and the indexes the filters use.
--
-- The columns are derived from the stored document inside entry_write, in the same statement
-- that stores it, so they can never disagree with what is served.

CREATE EXTENSION IF NOT EXISTS pg_trgm;

ALTER TABLE entries
    ADD COLUMN name            text        NOT NULL DEFAULT '',
    ADD COLUMN description     text        NOT NULL DEFAULT '',
    ADD COLUMN version         text        NOT NULL DEFAULT '',
    ADD COLUMN tags            text[]      NOT NULL DEFAULT '{}',
    ADD COLUMN service_types   text[]      NOT NULL DEFAULT '{}',
    ADD COLUMN relationships   jsonb       NOT NULL DEFAULT '[]',
    ADD COLUMN custom_metadata jsonb       NOT NULL DEFAULT '{}',
    ADD COLUMN published_at    timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN search          tsvector    NOT NULL DEFAULT ''::tsvector;

-- The searchable projection of one stored document.
CREATE FUNCTION entry_projection(p_doc text,
    OUT name text, OUT description text, OUT version text, OUT tags text[],
    OUT service_types text[], OUT relationships jsonb, OUT custom_metadata jsonb,
    OUT published_at timestamptz, OUT updated_at timestamptz, OUT search tsvector)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    j jsonb := p_doc::jsonb;
BEGIN
    name := coalesce(j->>'name', '');
    description := coalesce(j->>'description', '');
    version := coalesce(j->>'version', '');
    tags := coalesce(ARRAY(SELECT jsonb_array_elements_text(
        CASE WHEN jsonb_typeof(j->'tags') = 'array' THEN j->'tags' ELSE '[]' END)), '{}');
    service_types := coalesce(ARRAY(SELECT DISTINCT e->>'type' FROM jsonb_array_elements(
        CASE WHEN jsonb_typeof(j->'serviceEndpoints') = 'array' THEN j->'serviceEndpoints'
             ELSE '[]' END) e WHERE e->>'type' IS NOT NULL), '{}');
    relationships := CASE WHEN jsonb_typeof(j->'relationships') = 'array'
                          THEN j->'relationships' ELSE '[]' END;
    custom_metadata := CASE WHEN jsonb_typeof(j->'customMetadata') = 'object'
                            THEN j->'customMetadata' ELSE '{}' END;
    published_at := coalesce((j->>'publishedAt')::timestamptz, now());
    updated_at := coalesce((j->>'updatedAt')::timestamptz, now());
    search := setweight(to_tsvector('english', name), 'A')
           || setweight(to_tsvector('english', array_to_string(tags, ' ')), 'A')
           || setweight(to_tsvector('english', description), 'B');
END $$;

UPDATE entries e SET
    name = p.name, description = p.description, version = p.version, tags = p.tags,
    service_types = p.service_types, relationships = p.relationships,
    custom_metadata = p.custom_metadata, published_at = p.published_at,
    updated_at = p.updated_at, search = p.search
FROM entries x, LATERAL entry_projection(x.doc) p
WHERE e.entry_did = x.entry_did AND x.lifecycle <> 'deleted';

CREATE OR REPLACE FUNCTION entry_write(
    p_kind text, p_did text, p_expected_head bigint, p_publisher text, p_entry_type text,
    p_lifecycle text, p_prefix text, p_suffix text,
    p_scope text, p_op text, p_key text, p_fp bytea, p_status integer)
RETURNS TABLE (seq bigint, doc text)
LANGUAGE plpgsql AS $$
DECLARE
    v_seq  bigint;
    v_doc  text;
    v_head bigint;
    p      record;
BEGIN
    UPDATE log_head SET seq = log_head.seq + 1 WHERE id = 1 RETURNING log_head.seq INTO v_seq;
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
    RETURN QUERY SELECT v_seq, v_doc;
END $$;

-- Every filter of RegistryQuery has an index; orderings have a btree matching (key, entry_did).
CREATE INDEX entries_live_seq        ON entries (head_seq DESC) WHERE lifecycle <> 'deleted';
CREATE INDEX entries_type_seq        ON entries (entry_type, head_seq DESC) WHERE lifecycle <> 'deleted';
CREATE INDEX entries_publisher_seq   ON entries (publisher_did, head_seq DESC);
CREATE INDEX entries_published       ON entries (published_at, entry_did);
CREATE INDEX entries_updated         ON entries (updated_at, entry_did);
CREATE INDEX entries_name            ON entries ((name COLLATE "C"), entry_did);
CREATE INDEX entries_version         ON entries (version);
CREATE INDEX entries_tags            ON entries USING gin (tags);
CREATE INDEX entries_service_types   ON entries USING gin (service_types);
CREATE INDEX entries_relationships   ON entries USING gin (relationships jsonb_path_ops);
CREATE INDEX entries_custom_metadata ON entries USING gin (custom_metadata jsonb_path_ops);
CREATE INDEX entries_search          ON entries USING gin (search);
CREATE INDEX entries_name_trgm       ON entries USING gin (lower(name) gin_trgm_ops);
CREATE INDEX entries_description_trgm ON entries USING gin (lower(description) gin_trgm_ops);
