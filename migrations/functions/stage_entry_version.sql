-- What an entry version (apply_entry_version's rows) derives from its document without its
-- position: the halves around the sequence, and the searchable projection (entry_projection)
-- of the document, which reads no `sequence` (so a placeholder stands for it). Called by
-- append_changes for every change of the batch before it locks the log head; a tombstone
-- (lifecycle `deleted`) has no projection.
CREATE OR REPLACE FUNCTION stage_entry_version(p_rows jsonb)
RETURNS entry_staged
LANGUAGE plpgsql STABLE AS $$
DECLARE
    s entry_staged;
    p record;
BEGIN
    s.prefix := p_rows ->> 'prefix';
    s.suffix := p_rows ->> 'suffix';
    IF p_rows ->> 'lifecycle' <> 'deleted' THEN
        SELECT * INTO p FROM entry_projection(s.prefix || '0' || s.suffix);
        s.name := p.name;
        s.description := p.description;
        s.version := p.version;
        s.tags := p.tags;
        s.service_types := p.service_types;
        s.relationships := p.relationships;
        s.custom_metadata := p.custom_metadata;
        s.published_at := p.published_at;
        s.updated_at := p.updated_at;
        s.search := p.search;
    END IF;
    RETURN s;
END $$;
