-- New pending intents enter anchor_queue (the statement trigger of anchor_intents, 0013).
-- Migration 0020 dropped the trigger (apply_entry_version queues its intent itself); the
-- function stays because migration 0013 creates the trigger on a new database.
CREATE OR REPLACE FUNCTION anchor_queue_new_intents() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO anchor_queue (sequence, intent_id, available_at)
    SELECT n.sequence, n.intent_id, n.available_at FROM new_intents n WHERE n.state = 'pending';
    RETURN NULL;
END $$;
