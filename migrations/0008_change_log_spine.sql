-- The change log as the spine: one append path for every kind of change, one idempotency record.
--
-- The path is functions/append_changes.sql (its header says how a batch of changes is applied)
-- and one handler function per kind (functions/apply_*.sql). The write functions of earlier
-- releases go; idempotency records take the shape of domain outcomes.

DROP FUNCTION IF EXISTS entry_write_batch(text[], text[], bigint[], text[], text[], text[], text[], text[],
                                text[], text[], text[], bytea[], integer[]);
DROP FUNCTION IF EXISTS idem_begin(text, text, text, bytea, double precision);
DROP FUNCTION IF EXISTS idem_finish(text, text, text, bytea, integer, text);
DROP TABLE idempotency_claims;

-- Outcomes as domain data: a result (with the log position it took) or a refusal
-- {kind, code, message, details}. Records of the old shape are converted, so a retry that
-- straddles the upgrade is still answered from its record.
ALTER TABLE idempotency
    ADD COLUMN sequence bigint,
    ADD COLUMN result   text,
    ADD COLUMN refusal  jsonb;
UPDATE idempotency SET
    result = CASE WHEN status < 300 THEN response END,
    sequence = CASE WHEN status < 300 AND response LIKE '{%'
                    THEN (response::jsonb ->> 'sequence')::bigint END,
    refusal = CASE WHEN status >= 300 THEN jsonb_build_object(
        'kind', CASE status WHEN 400 THEN 'Invalid' WHEN 401 THEN 'Unauthorized'
                            WHEN 403 THEN 'Forbidden' WHEN 404 THEN 'NotFound'
                            WHEN 413 THEN 'TooLarge' WHEN 415 THEN 'UnsupportedMediaType'
                            ELSE 'Conflict' END,
        'code', response::jsonb -> 'error' ->> 'code',
        'message', response::jsonb -> 'error' ->> 'message',
        'details', coalesce(response::jsonb -> 'error' -> 'details', '{}'::jsonb)) END;
ALTER TABLE idempotency DROP COLUMN status, DROP COLUMN response;
ALTER TABLE idempotency ADD CONSTRAINT idempotency_one_outcome
    CHECK ((result IS NULL) <> (refusal IS NULL));
