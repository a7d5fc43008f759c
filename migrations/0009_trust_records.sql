-- Trust and ownership records (attestations, reports, bonds, transfer offers) on the one
-- append path.
--
-- A record is a versioned document: the use-case (Python, registry/trust.py and friends) reads
-- it, decides the change and renders the new document; the handler `apply_records` writes it
-- only if the record is still at the version the decision was made on (compare-and-set under
-- the log lock). When it is not, the handler answers the refusal kind `Retry`: nothing is
-- written, nothing is recorded under the Idempotency-Key, and the use-case decides again
-- against the new state (so a concurrent change ends in the right answer, never a spurious
-- one). `uniq` holds a record's uniqueness claim while it applies (one open report per reporter
-- and entry, one open offer per entry, one attestation per credential and entry).
--
-- A change may also append further log records right after its own (`also`): accepting a
-- transfer is one entry version (entry.transferred, whose position is the entry's sequence)
-- followed by transfer.accepted, both in the same transaction.

CREATE TABLE records (
    kind        text        NOT NULL,  -- attestation | report | bond | offer
    id          text        NOT NULL,
    entry_did   text        NOT NULL,
    owner_did   text,                  -- issuer, reporter, bond publisher, offer owner
    status      text        NOT NULL,
    version     integer     NOT NULL,  -- 1 when created, +1 on every change
    expires_at  timestamptz,
    uniq        text,
    created_seq bigint      NOT NULL,
    updated_seq bigint      NOT NULL,
    doc         text        NOT NULL,  -- the record as served (JSON)
    PRIMARY KEY (kind, id)
);
CREATE UNIQUE INDEX records_uniq ON records (kind, uniq) WHERE uniq IS NOT NULL;
CREATE INDEX records_by_entry ON records (kind, entry_did, created_seq);
CREATE INDEX records_by_status ON records (kind, status, created_seq);

-- rows: {puts: [put...], requireEntry?: did, entry?: <apply_entry_version rows>, result?: text}
-- put: {kind, id, expectedVersion (null: a new record), entryDid, ownerDid, status, expiresAtMs,
--       uniq, doc, exists: refusal (a new record whose id exists), duplicate: refusal (uniq taken)}
-- The result is `result`, else the entry version's document.
CREATE FUNCTION apply_records(p_seq bigint, p_subject text, p_rows jsonb)
RETURNS TABLE (result text, refusal jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    p         jsonb;
    v_version integer;
    h         record;
    v_result  text := p_rows ->> 'result';
    v_ids     text[] := ARRAY(SELECT x ->> 'kind' || ' ' || (x ->> 'id')
                              FROM jsonb_array_elements(p_rows -> 'puts') AS x);
BEGIN
    IF p_rows ? 'requireEntry' AND NOT EXISTS (
        SELECT 1 FROM entries e
         WHERE e.entry_did = p_rows ->> 'requireEntry' AND e.lifecycle <> 'deleted') THEN
        RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'NotFound',
            'code', 'entry_not_found', 'message', 'entry not found',
            'details', jsonb_build_object('entryDid', p_rows ->> 'requireEntry'));
        RETURN;
    END IF;
    -- Every check first: a refusal writes nothing.
    FOR p IN SELECT value FROM jsonb_array_elements(p_rows -> 'puts') LOOP
        SELECT r.version INTO v_version FROM records r
         WHERE r.kind = p ->> 'kind' AND r.id = p ->> 'id' FOR UPDATE;
        IF p ->> 'expectedVersion' IS NULL THEN
            IF FOUND THEN
                RETURN QUERY SELECT NULL::text, p -> 'exists';
                RETURN;
            END IF;
        ELSIF NOT FOUND OR v_version <> (p ->> 'expectedVersion')::integer THEN
            RETURN QUERY SELECT NULL::text, jsonb_build_object('kind', 'Retry',
                'code', 'record_changed', 'message', 'the record changed meanwhile',
                'details', jsonb_build_object('kind', p ->> 'kind', 'id', p ->> 'id'));
            RETURN;
        END IF;
        IF p ->> 'uniq' IS NOT NULL AND EXISTS (
            SELECT 1 FROM records r
             WHERE r.kind = p ->> 'kind' AND r.uniq = p ->> 'uniq'
               AND NOT (r.kind || ' ' || r.id = ANY (v_ids))) THEN
            RETURN QUERY SELECT NULL::text, p -> 'duplicate';
            RETURN;
        END IF;
    END LOOP;
    IF p_rows ? 'entry' THEN
        SELECT * INTO h FROM apply_entry_version(p_seq, p_subject, p_rows -> 'entry');
        IF h.refusal IS NOT NULL THEN
            RETURN QUERY SELECT NULL::text, h.refusal;
            RETURN;
        END IF;
        v_result := coalesce(v_result, h.result);
    END IF;
    FOR p IN SELECT value FROM jsonb_array_elements(p_rows -> 'puts') LOOP
        INSERT INTO records AS r (kind, id, entry_did, owner_did, status, version, expires_at,
                                  uniq, created_seq, updated_seq, doc)
        VALUES (p ->> 'kind', p ->> 'id', p ->> 'entryDid', p ->> 'ownerDid', p ->> 'status', 1,
                to_timestamp((p ->> 'expiresAtMs')::bigint / 1000.0), p ->> 'uniq', p_seq, p_seq,
                p ->> 'doc')
        ON CONFLICT (kind, id) DO UPDATE
           SET status = EXCLUDED.status, version = r.version + 1,
               expires_at = EXCLUDED.expires_at, uniq = EXCLUDED.uniq,
               updated_seq = p_seq, doc = EXCLUDED.doc;
    END LOOP;
    RETURN QUERY SELECT v_result, NULL::jsonb;
END $$;

-- append_changes of 0008, plus: a change's `also` records (each its own position, right after
-- the change's), and a handler's `Retry` refusal is not recorded under the key (the use-case
-- decides again).
CREATE OR REPLACE FUNCTION append_changes(p_changes jsonb)
RETURNS TABLE (idx integer, seq bigint, result text, refusal jsonb, replayed boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_head    bigint;
    v_start   bigint;
    v_seq     bigint;
    c         jsonb;
    a         jsonb;
    i         integer := 0;
    r         record;
    h         record;
    v_fp      bytea;
BEGIN
    UPDATE log_head SET seq = log_head.seq WHERE id = 1 RETURNING log_head.seq INTO v_head;
    v_start := v_head;
    FOR c IN SELECT value FROM jsonb_array_elements(p_changes) LOOP
        i := i + 1;
        IF c ? 'idem' THEN
            v_fp := decode(c #>> '{idem,fingerprint}', 'hex');
            SELECT x.fingerprint, x.sequence, x.result, x.refusal INTO r FROM idempotency x
             WHERE x.scope = c #>> '{idem,scope}' AND x.operation = c #>> '{idem,operation}'
               AND x.key = c #>> '{idem,key}' AND x.created_at > now() - interval '24 hours';
            IF FOUND THEN
                IF r.fingerprint <> v_fp THEN
                    RETURN QUERY SELECT i, NULL::bigint, NULL::text, jsonb_build_object(
                        'kind', 'Conflict', 'code', 'idempotency_conflict',
                        'message', 'this Idempotency-Key was already used for a different request',
                        'details', '{}'::jsonb), false;
                ELSE
                    RETURN QUERY SELECT i, r.sequence, r.result, r.refusal, true;
                END IF;
                CONTINUE;
            END IF;
        END IF;
        EXECUTE format('SELECT result, refusal FROM %I($1, $2, $3)', c ->> 'handler')
           INTO h USING v_head + 1, c ->> 'subject', c -> 'rows';
        v_seq := NULL;
        IF h.refusal IS NULL THEN
            v_head := v_head + 1;
            v_seq := v_head;
            INSERT INTO log (seq, kind, entry_did, data)
            VALUES (v_head, c ->> 'kind', c ->> 'subject', coalesce(c -> 'event', '{}'::jsonb));
            FOR a IN SELECT value FROM jsonb_array_elements(coalesce(c -> 'also', '[]')) LOOP
                v_head := v_head + 1;
                INSERT INTO log (seq, kind, entry_did, data)
                VALUES (v_head, a ->> 'kind', a ->> 'subject', coalesce(a -> 'event', '{}'::jsonb));
            END LOOP;
        END IF;
        IF c ? 'idem' AND (h.refusal IS NULL OR h.refusal ->> 'kind' <> 'Retry') THEN
            INSERT INTO idempotency (scope, operation, key, fingerprint, sequence, result, refusal)
            VALUES (c #>> '{idem,scope}', c #>> '{idem,operation}', c #>> '{idem,key}', v_fp,
                    v_seq, h.result, h.refusal)
            ON CONFLICT (scope, operation, key) DO UPDATE
               SET fingerprint = EXCLUDED.fingerprint, sequence = EXCLUDED.sequence,
                   result = EXCLUDED.result, refusal = EXCLUDED.refusal, created_at = now();
        END IF;
        RETURN QUERY SELECT i, v_seq, h.result, h.refusal, false;
    END LOOP;
    IF v_head > v_start THEN
        UPDATE log_head SET seq = v_head WHERE id = 1;
        PERFORM pg_notify('registry_log', v_head::text);
    END IF;
END $$;
