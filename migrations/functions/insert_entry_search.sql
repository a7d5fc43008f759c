-- The searchable row of a new entry (entry_search), from its rows (publisher, type,
-- lifecycle) and what stage_entry_version derived; its head_seq is 0 until the handler sets
-- it under the log head (a heap-only update: no index names it). True when inserted, false
-- when the DID already has one (an entry, a tombstone, or a create of another transaction that
-- committed first: a create still in flight elsewhere is waited for). append_changes calls it
-- for every create of a batch before it locks the log head, so the row's indexes are written
-- outside the critical section; apply_entry_version calls it under the lock only for a create
-- whose row was not staged.
CREATE OR REPLACE FUNCTION insert_entry_search(p_did text, p_rows jsonb, p entry_staged)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO entry_search (entry_did, publisher_did, entry_type, lifecycle, name,
                              description, version, tags, service_types, relationships,
                              custom_metadata, published_at, updated_at, search)
    VALUES (p_did, p_rows ->> 'publisherDid', p_rows ->> 'entryType', p_rows ->> 'lifecycle',
            p.name, p.description, p.version, p.tags, p.service_types, p.relationships,
            p.custom_metadata, p.published_at, p.updated_at, p.search)
    ON CONFLICT (entry_did) DO NOTHING;
    RETURN FOUND;
END $$;
