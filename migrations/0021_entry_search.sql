-- The searchable projection leaves `entries` for a table of its own, written before the log
-- head is locked (issue 21; docs/architecture.md, "The critical section").
--
-- `entries` keeps the head of each entry (sequences, publisher, type, lifecycle) with the
-- orderings by sequence. `entry_search` is what discovery reads: the projection of each entry's
-- head version (entry_projection), its publisher, type, lifecycle and head sequence, with the
-- indexes of every filter and of the other orderings: seven GIN indexes (tags, service types,
-- relationships, custom metadata, the full-text vector, two trigram indexes) and six btrees.
-- Inserting one entries row with them all cost ~100 µs under the log head (pg_stat_statements,
-- bench/append_cpu.py). A create now inserts its entry_search row before the lock
-- (append_changes, with head_seq 0), and under the lock the narrow entries row and the
-- row's head_seq, which no index of entry_search names: a heap-only (HOT) update, which needs
-- room on the row's page. A batch inserts its rows side by side and updates each in the same
-- transaction, before any older version can be pruned: with half of each page left free every
-- update was heap-only (bench/entries.py, 5,819 of 5,819); with a quarter, 41 % (the others
-- wrote every index again, under the lock).
--
-- Every entries row has one entry_search row with the same head_seq, publisher, type and
-- lifecycle (a tombstone keeps the projection it had).
CREATE TABLE entry_search (
    entry_did       text        PRIMARY KEY,
    head_seq        bigint      NOT NULL DEFAULT 0,
    publisher_did   text        NOT NULL,
    entry_type      text        NOT NULL,
    lifecycle       text        NOT NULL,
    name            text        NOT NULL DEFAULT '',
    description     text        NOT NULL DEFAULT '',
    version         text        NOT NULL DEFAULT '',
    tags            text[]      NOT NULL DEFAULT '{}',
    service_types   text[]      NOT NULL DEFAULT '{}',
    relationships   jsonb       NOT NULL DEFAULT '[]',
    custom_metadata jsonb       NOT NULL DEFAULT '{}',
    published_at    timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    search          tsvector    NOT NULL DEFAULT ''::tsvector
) WITH (fillfactor = 50);
INSERT INTO entry_search (entry_did, head_seq, publisher_did, entry_type, lifecycle, name,
                          description, version, tags, service_types, relationships,
                          custom_metadata, published_at, updated_at, search)
SELECT entry_did, head_seq, publisher_did, entry_type, lifecycle, name, description, version,
       tags, service_types, relationships, custom_metadata, published_at, updated_at, search
  FROM entries ORDER BY entry_did;

DROP INDEX entries_published, entries_updated, entries_name, entries_version, entries_tags,
    entries_service_types, entries_relationships, entries_custom_metadata, entries_search,
    entries_name_trgm, entries_description_trgm;
ALTER TABLE entries
    DROP COLUMN name, DROP COLUMN description, DROP COLUMN version, DROP COLUMN tags,
    DROP COLUMN service_types, DROP COLUMN relationships, DROP COLUMN custom_metadata,
    DROP COLUMN published_at, DROP COLUMN updated_at, DROP COLUMN search;
CLUSTER entries USING entries_pkey;  -- rewritten narrow (dropped columns keep their bytes)

CREATE INDEX entry_search_published ON entry_search (published_at, (entry_did COLLATE "C"));
CREATE INDEX entry_search_updated   ON entry_search (updated_at, (entry_did COLLATE "C"));
CREATE INDEX entry_search_name      ON entry_search ((name COLLATE "C"), (entry_did COLLATE "C"));
CREATE INDEX entry_search_version   ON entry_search (version);
CREATE INDEX entry_search_publisher ON entry_search (publisher_did);
CREATE INDEX entry_search_type      ON entry_search (entry_type);
-- GIN pending lists bounded as in migration 0015.
CREATE INDEX entry_search_tags ON entry_search USING gin (tags)
    WITH (gin_pending_list_limit = 64);
CREATE INDEX entry_search_service_types ON entry_search USING gin (service_types)
    WITH (gin_pending_list_limit = 64);
CREATE INDEX entry_search_relationships ON entry_search USING gin (relationships jsonb_path_ops)
    WITH (gin_pending_list_limit = 64);
CREATE INDEX entry_search_custom_metadata ON entry_search
    USING gin (custom_metadata jsonb_path_ops) WITH (gin_pending_list_limit = 64);
CREATE INDEX entry_search_search ON entry_search USING gin (search)
    WITH (gin_pending_list_limit = 64);
CREATE INDEX entry_search_name_trgm ON entry_search USING gin (lower(name) gin_trgm_ops)
    WITH (gin_pending_list_limit = 64);
CREATE INDEX entry_search_description_trgm ON entry_search
    USING gin (lower(description) gin_trgm_ops) WITH (gin_pending_list_limit = 64);

-- Whether the create's entry_search row was inserted when it was staged (append_changes):
-- a change that is then not applied deletes it.
ALTER TYPE entry_staged ADD ATTRIBUTE inserted boolean;
ANALYZE entry_search;
ANALYZE entries;
