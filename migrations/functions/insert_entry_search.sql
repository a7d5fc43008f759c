-- The searchable row of a new entry (entry_search), from what stage_entry_version derived;
-- true when inserted, false when the DID already has one (an entry, a tombstone, or a create
-- of another transaction that committed first: a create still in flight elsewhere is waited
-- for). append_changes calls it for every create of a batch before it locks the log head, so
-- the row's eleven indexes are written outside the critical section; apply_entry_version calls
-- it under the lock only for a create whose row was not staged.
CREATE OR REPLACE FUNCTION insert_entry_search(p_did text, p entry_staged)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO entry_search (entry_did, name, description, version, tags, service_types,
                              relationships, custom_metadata, published_at, updated_at, search)
    VALUES (p_did, p.name, p.description, p.version, p.tags, p.service_types, p.relationships,
            p.custom_metadata, p.published_at, p.updated_at, p.search)
    ON CONFLICT (entry_did) DO NOTHING;
    RETURN FOUND;
END $$;
