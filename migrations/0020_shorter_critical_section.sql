-- The critical section, shorter (issue 21; docs/architecture.md): a new entry version's anchor
-- intent enters anchor_queue by apply_entry_version's own INSERT, under the log head, instead
-- of through the statement trigger of migration 0013 (its transition table and its call were
-- ~25 µs of the ~40 µs an intent cost under the lock; bench/append_cpu.py with
-- pg_stat_statements). apply_entry_version is the only writer of new intents. The trigger's
-- function stays defined (functions/anchor_queue_new_intents.sql): migration 0013 requires it
-- on a database built from scratch.
DROP TRIGGER anchor_queue_new_intents ON anchor_intents;
