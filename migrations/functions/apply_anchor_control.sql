-- Admin retry and abandon. rows: {intentId, from: state read, to: "pending" | "abandoned"}.
-- The queue follows: a retried intent enters anchor_queue, an abandoned pending one leaves it.
CREATE OR REPLACE FUNCTION apply_anchor_control(p_seq bigint, p_subject text, p_rows jsonb)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_sequence bigint;
BEGIN
    UPDATE anchor_intents
       SET state = p_rows ->> 'to', updated_at = now(),
           attempts = CASE WHEN p_rows ->> 'to' = 'pending' THEN 0 ELSE attempts END,
           available_at = CASE WHEN p_rows ->> 'to' = 'pending' THEN now() ELSE available_at END
     WHERE intent_id = p_rows ->> 'intentId' AND state = p_rows ->> 'from'
    RETURNING sequence INTO v_sequence;
    IF NOT FOUND THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Retry',
            'code', 'intent_changed', 'message', 'the intent changed meanwhile',
            'details', jsonb_build_object('intentId', p_rows ->> 'intentId'));
        RETURN;
    END IF;
    IF p_rows ->> 'to' = 'pending' THEN
        INSERT INTO anchor_queue (sequence, intent_id, available_at)
        VALUES (v_sequence, p_rows ->> 'intentId', now())
        ON CONFLICT (sequence) DO UPDATE SET available_at = EXCLUDED.available_at;
    ELSE
        DELETE FROM anchor_queue WHERE sequence = v_sequence;
    END IF;
    -- The answer's text as every other body is written: compact, members in JCS order (a
    -- jsonb's text has spaces and jsonb's own order).
    RETURN QUERY SELECT '{"intentId":' || to_json(p_rows ->> 'intentId')::text
                        || ',"state":' || to_json(p_rows ->> 'to')::text || '}', NULL::jsonb;
END $$;
