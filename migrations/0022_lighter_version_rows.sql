-- Lighter rows for each entry version (issue 21: PostgreSQL CPU per create).
--
-- 1. An applied entry version's idempotency record no longer copies its ~2 KB served document:
--    its result is NULL and its sequence names the version, whose entry_versions.doc is that
--    document, byte for byte (apply_entry_version returns what it inserts at the change's
--    position, and entry versions are never rewritten). append_changes and record_refusal read
--    such a record's result from entry_versions. A record holds a refusal, a result, or (an
--    entry version) only its sequence; records written before keep their result.
-- 2. The documents that remain (entry_versions.doc) cross PostgreSQL's TOAST threshold with
--    their signature, so each one is compressed when it is written and again decompressed when
--    it is read from disk. pglz (the default) cost ~12 us per ~2 KB document against ~4 us for
--    lz4, at the same size (bench/README.md). lz4 where the server is built with it (Debian's
--    and the official images are); a server without it keeps pglz. Existing values keep the
--    method they were written with; both are read transparently.
ALTER TABLE idempotency DROP CONSTRAINT idempotency_one_outcome;
ALTER TABLE idempotency ADD CONSTRAINT idempotency_one_outcome
    CHECK ((result IS NULL OR refusal IS NULL)
           AND (result IS NOT NULL OR refusal IS NOT NULL OR sequence IS NOT NULL));
-- EXECUTE: parsed when it runs, inside the handler (SET COMPRESSION is a syntax error before
-- PostgreSQL 14, `feature_not_supported` on a server built without lz4).
DO $$
BEGIN
    EXECUTE 'ALTER TABLE entry_versions ALTER COLUMN doc SET COMPRESSION lz4';
    EXECUTE 'ALTER TABLE idempotency ALTER COLUMN result SET COMPRESSION lz4';
EXCEPTION WHEN feature_not_supported OR syntax_error THEN
    RAISE NOTICE 'lz4 is not supported by this server: documents stay compressed with pglz';
END $$;
