-- One write path: a single entry change is a batch of one (entry_write_batch).
DROP FUNCTION IF EXISTS entry_write(text, text, bigint, text, text, text, text, text, text, text, text, bytea, integer);
