-- Discovery: searchable columns of each entry's head version, and the indexes the filters use.
--
-- The columns are derived from the stored document (functions/entry_projection.sql) in the
-- statement that stores it, so they can never disagree with what is served. Entries stored
-- before this migration are projected here.
--
-- requires: entry_projection

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

UPDATE entries e SET
    name = p.name, description = p.description, version = p.version, tags = p.tags,
    service_types = p.service_types, relationships = p.relationships,
    custom_metadata = p.custom_metadata, published_at = p.published_at,
    updated_at = p.updated_at, search = p.search
FROM entries x, LATERAL entry_projection(x.doc) p
WHERE e.entry_did = x.entry_did AND x.lifecycle <> 'deleted';

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
