-- Milliseconds since the epoch (what the store port reads times as).
CREATE OR REPLACE FUNCTION epoch_ms(timestamptz) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE AS $$ SELECT (extract(epoch FROM $1) * 1000)::bigint $$;
