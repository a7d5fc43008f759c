-- Bounded GIN pending lists on the discovery indexes.
--
-- With fastupdate (PostgreSQL's default), a GIN index queues new keys in a pending list that
-- every search scans linearly, until the list passes gin_pending_list_limit (default 4 MB) or a
-- vacuum merges it. Under steady writes the list grew with the table between autovacuums
-- (which run after inserts of 20 % of it): discovery's p99 rose 1.75x over a 30-minute soak
-- (bench/README.md). 64 kB (the least PostgreSQL allows) keeps the batching that makes inserts cheap and bounds what a
-- search scans to a few hundred rows' keys.
ALTER INDEX entries_tags SET (gin_pending_list_limit = 64);
ALTER INDEX entries_service_types SET (gin_pending_list_limit = 64);
ALTER INDEX entries_relationships SET (gin_pending_list_limit = 64);
ALTER INDEX entries_custom_metadata SET (gin_pending_list_limit = 64);
ALTER INDEX entries_search SET (gin_pending_list_limit = 64);
ALTER INDEX entries_name_trgm SET (gin_pending_list_limit = 64);
ALTER INDEX entries_description_trgm SET (gin_pending_list_limit = 64);

SELECT gin_clean_pending_list(i::regclass)
FROM unnest(ARRAY['entries_tags', 'entries_service_types', 'entries_relationships',
                  'entries_custom_metadata', 'entries_search', 'entries_name_trgm',
                  'entries_description_trgm']) AS i;
