-- The result an idempotency record answers: the one it holds, or, for an applied entry version
-- (whose record holds only its sequence, migration 0022), the version's document, which
-- entry_versions keeps for good. append_changes and record_refusal answer replays with it.
CREATE OR REPLACE FUNCTION recorded_result(p_result text, p_refusal jsonb, p_sequence bigint)
RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN p_result IS NULL AND p_refusal IS NULL
                THEN (SELECT v.doc FROM entry_versions v WHERE v.seq = p_sequence)
                ELSE p_result END
$$;
