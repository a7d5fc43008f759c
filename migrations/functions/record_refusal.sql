-- Record a refusal decided before the append path (validation, authorization) unless the key
-- already has an outcome of the last p_window_ms; either way answer the outcome that stands
-- under the key, with the fingerprint it was recorded for (`replayed` when it was there before:
-- the caller's rules tell a replay from an idempotency conflict). The share
-- lock on the log head orders it with append_changes, which therefore always sees it.
CREATE OR REPLACE FUNCTION record_refusal(p_scope text, p_op text, p_key text, p_fp bytea,
                                          p_refusal jsonb, p_window_ms bigint)
RETURNS TABLE (fingerprint bytea, seq bigint, result text, refusal jsonb, replayed boolean)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM log_head WHERE id = 1 FOR SHARE;
    INSERT INTO idempotency AS x (scope, operation, key, fingerprint, refusal)
    VALUES (p_scope, p_op, p_key, p_fp, p_refusal)
    ON CONFLICT (scope, operation, key) DO UPDATE
       SET fingerprint = EXCLUDED.fingerprint, sequence = NULL, result = NULL,
           refusal = EXCLUDED.refusal, created_at = now()
     WHERE x.created_at <= now() - p_window_ms * interval '1 millisecond';
    IF FOUND THEN
        RETURN QUERY SELECT p_fp, NULL::bigint, NULL::text, p_refusal, false;
        RETURN;
    END IF;
    RETURN QUERY SELECT x.fingerprint, x.sequence,
                        recorded_result(x.result, x.refusal, x.sequence), x.refusal, true
                   FROM idempotency x
     WHERE x.scope = p_scope AND x.operation = p_op AND x.key = p_key;
END $$;
