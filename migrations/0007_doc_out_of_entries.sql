-- The served document leaves the entries row: it is read from entry_versions at head_seq.
--
-- entries keeps only what discovery filters and orders by (about 520 bytes a row instead of
-- 1,650 on the bench's documents), so the scans and counts of broad filters touch about a third
-- of the pages, and the table and its indexes stay in shared buffers far longer. Every version's
-- document was already in entry_versions (the head included), so nothing is copied.

ALTER TABLE entries DROP COLUMN doc;
-- Rewrite the table now, so the dropped column's space is given back at once.
CLUSTER entries USING entries_pkey;
