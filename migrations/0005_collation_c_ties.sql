-- Ties in discovery order are broken by entry_did in byte order (COLLATE "C"), the same on
-- every deployment whatever the database's default collation; the paging indexes follow.

DROP INDEX entries_published;
DROP INDEX entries_updated;
DROP INDEX entries_name;
CREATE INDEX entries_published ON entries (published_at, (entry_did COLLATE "C"));
CREATE INDEX entries_updated   ON entries (updated_at, (entry_did COLLATE "C"));
CREATE INDEX entries_name      ON entries ((name COLLATE "C"), (entry_did COLLATE "C"));
