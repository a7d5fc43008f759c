-- The searchable projection of one stored document.
CREATE OR REPLACE FUNCTION entry_projection(p_doc text,
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
