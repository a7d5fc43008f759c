-- Logout: revoke one session. rows: {tokenHash} (hex). Every process drops the session from
-- its cache when the log record reaches it.
CREATE OR REPLACE FUNCTION apply_session_revoked(p_seq bigint, p_subject text, p_rows jsonb)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE sessions SET revoked_at = now()
     WHERE token_hash = decode(p_rows ->> 'tokenHash', 'hex') AND revoked_at IS NULL;
    IF NOT FOUND THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Unauthorized',
            'code', 'session_invalid', 'message', 'session missing, expired or unknown',
            'details', '{}'::jsonb);
        RETURN;
    END IF;
    RETURN QUERY SELECT '{"loggedOut":true}'::text, NULL::jsonb;
END $$;
