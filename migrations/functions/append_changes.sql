-- The one append path (design §2): append_changes(changes jsonb) applies a batch of changes in
-- one transaction (group commit). For each change, in order:
--   1. an Idempotency-Key that already completed within the last p_window_ms answers from its
--      record (no second effect, no log record, no event): the row is `replayed` and carries
--      the fingerprint recorded under the key, and the caller's rules tell a replay from an
--      idempotency conflict (registry/changes.py `standing_outcome`);
--   2. the kind's handler (a function named by the change, e.g. apply_entry_version) checks its
--      preconditions and writes its rows, or refuses without writing anything;
--   3. an applied change takes the next log position and appends its log record (the event),
--      then its `also` records (each its own position, right after the change's, inserted in
--      one statement: a batch of anchor confirmations appends one per intent);
--   4. the outcome, a result text or a refusal (domain data, never an HTTP status), is recorded
--      under the Idempotency-Key in the same transaction (an entry version's result, its
--      document, by its sequence: entry_versions holds it); a handler's `Retry` refusal is not
--      recorded (the use-case decides again against the new state).
-- The log head row is locked from the first handler to the commit, so commit order is sequence
-- order (gap-free). What does not depend on a position is done before it is locked: the JSON
-- of the batch is parsed (an argument), each entry version is staged (stage_entry_version:
-- its document's halves and searchable projection, the full-text vector included), and each
-- create's searchable row is inserted (insert_entry_search: entry_search and its indexes).
-- A batch of two or more entry versions of which, under the lock, none would be refused or
-- replayed is applied a table at a time instead of change by change
-- (apply_entry_versions_in_bulk: the same rows and outcomes). One NOTIFY per batch wakes the log readers of every process; the log
-- itself is the truth.
--
-- A handler is `FUNCTION apply_x(p_seq bigint, p_subject text, p_rows jsonb)
-- RETURNS TABLE (result text, refusal jsonb)`. It must write nothing when it refuses; p_seq is
-- the position the change takes if it is applied. A new kind of change adds a handler, its row in
-- registry/changes.py CHANGE_KINDS and its branch in the CASE below (a test keeps them in step).
CREATE OR REPLACE FUNCTION append_changes(p_changes jsonb, p_window_ms bigint)
RETURNS TABLE (idx integer, seq bigint, result text, refusal jsonb, replayed boolean,
               fingerprint bytea)
LANGUAGE plpgsql
-- Plans cached per session (the pool's sessions force custom plans, for discovery): planning
-- every statement of the batch and its handlers on every call was a third of the backend's CPU
-- per append (bench/append_cpu.py). Every statement here reads by a key, so a plan made while
-- a table is still empty must not be a scan that stays cached as the table grows.
SET plan_cache_mode = auto
SET enable_seqscan = off
AS $$
DECLARE
    v_head    bigint;
    v_start   bigint;
    v_seq     bigint;
    c         jsonb;
    i         integer := 0;
    r         record;
    h         record;
    v_fp      bytea;
    v_staged  entry_staged[] := '{}';
    s         entry_staged;
    j         integer;
    -- One change is cheaper on its own (bench/append_cpu.py --batch 1).
    v_bulk    boolean := jsonb_array_length(p_changes) > 1;
BEGIN
    -- Outside the critical section: what each change derives without its position.
    FOR c IN SELECT value FROM jsonb_array_elements(p_changes) LOOP
        i := i + 1;
        IF c ->> 'handler' = 'apply_entry_version' THEN
            v_staged[i] := stage_entry_version(c -> 'rows');
        END IF;
    END LOOP;
    -- Each create's searchable row (entry_search and its fourteen indexes), in DID order: two
    -- batches creating the same DIDs wait for one another in one order, never in a cycle, and
    -- never while holding the log head. A change that is then not applied deletes its row.
    FOR j IN SELECT t.n FROM jsonb_array_elements(p_changes) WITH ORDINALITY AS t(c, n)
              WHERE t.c ->> 'handler' = 'apply_entry_version'
                AND t.c #>> '{rows,expectedHead}' IS NULL
                AND t.c #>> '{rows,lifecycle}' <> 'deleted'
              ORDER BY t.c ->> 'subject' COLLATE "C", t.n LOOP
        s := v_staged[j];
        s.inserted := insert_entry_search(p_changes -> (j - 1) ->> 'subject',
                                          p_changes -> (j - 1) -> 'rows', s);
        v_staged[j] := s;
    END LOOP;
    -- A batch of entry versions only (no `also`), of distinct DIDs and keys, each create with
    -- the searchable row it staged (never a tombstone's: none is inserted for one): it may be
    -- applied in bulk (apply_entry_versions_in_bulk) if, under the lock, none would be refused
    -- or replayed.
    IF v_bulk THEN
        SELECT count(DISTINCT t.c ->> 'subject') = count(*)
               AND count(DISTINCT CASE WHEN t.c ? 'idem' THEN ARRAY[t.c #>> '{idem,scope}',
                         t.c #>> '{idem,operation}', t.c #>> '{idem,key}'] END)
                   = count(*) FILTER (WHERE t.c ? 'idem')
               AND bool_and(coalesce(t.c ->> 'handler' = 'apply_entry_version'
                                     AND NOT t.c ? 'also'
                                     AND (t.c #>> '{rows,expectedHead}' IS NOT NULL
                                          OR (v_staged[t.n]).inserted), false))
          INTO v_bulk
          FROM jsonb_array_elements(p_changes) WITH ORDINALITY AS t(c, n);
    END IF;
    i := 0;
    -- The critical section: from here to the commit, one batch at a time.
    SELECT log_head.seq INTO v_head FROM log_head WHERE id = 1 FOR UPDATE;
    v_start := v_head;
    IF v_bulk THEN
        -- One lookup by key per change (LATERAL ... LIMIT 1: a plan cached while the tables
        -- are small must not hash a whole table).
        PERFORM 1 FROM jsonb_array_elements(p_changes) AS t(c)
          CROSS JOIN LATERAL (
                (SELECT 1 FROM idempotency x
                  WHERE x.scope = t.c #>> '{idem,scope}'
                    AND x.operation = t.c #>> '{idem,operation}' AND x.key = t.c #>> '{idem,key}'
                    AND x.created_at > now() - p_window_ms * interval '1 millisecond' LIMIT 1)
                UNION ALL
                -- a create's DID is taken; another version's entry moved on or is gone
                SELECT 1 WHERE (SELECT e.head_seq FROM entries e
                                 WHERE e.entry_did = t.c ->> 'subject')
                               IS DISTINCT FROM (t.c #>> '{rows,expectedHead}')::bigint
                UNION ALL
                (SELECT 1 FROM replica_versions rv
                  WHERE rv.entry_did = t.c ->> 'subject' AND t.c #>> '{rows,expectedHead}' IS NULL
                  LIMIT 1)
          ) AS refused
         LIMIT 1;
        v_bulk := NOT FOUND;
    END IF;
    IF v_bulk THEN
        RETURN QUERY SELECT * FROM apply_entry_versions_in_bulk(v_head, p_changes, v_staged);
        v_head := v_head + jsonb_array_length(p_changes);
    END IF;
    -- Otherwise change by change, in the batch's order.
    FOR c IN SELECT value FROM jsonb_array_elements(p_changes) WHERE NOT v_bulk LOOP
        i := i + 1;
        IF c ? 'idem' THEN
            v_fp := decode(c #>> '{idem,fingerprint}', 'hex');
            SELECT x.fingerprint, x.sequence, x.result, x.refusal INTO r FROM idempotency x
             WHERE x.scope = c #>> '{idem,scope}' AND x.operation = c #>> '{idem,operation}'
               AND x.key = c #>> '{idem,key}'
               AND x.created_at > now() - p_window_ms * interval '1 millisecond';
            IF FOUND THEN
                IF (v_staged[i]).inserted THEN
                    DELETE FROM entry_search x WHERE x.entry_did = c ->> 'subject';
                END IF;
                RETURN QUERY SELECT i, r.sequence,
                                    recorded_result(r.result, r.refusal, r.sequence),
                                    r.refusal, true, r.fingerprint;
                CONTINUE;
            END IF;
        END IF;
        -- A static call per handler: its plan is cached for the session (a dynamic EXECUTE
        -- was planned on every change: 520 -> 436 us of backend CPU per single-change append).
        CASE c ->> 'handler'
            WHEN 'apply_anchor_claim' THEN
                SELECT x.result, x.refusal INTO h
                  FROM apply_anchor_claim(v_head + 1, c ->> 'subject', c -> 'rows') AS x;
            WHEN 'apply_anchor_control' THEN
                SELECT x.result, x.refusal INTO h
                  FROM apply_anchor_control(v_head + 1, c ->> 'subject', c -> 'rows') AS x;
            WHEN 'apply_anchor_settle' THEN
                SELECT x.result, x.refusal INTO h
                  FROM apply_anchor_settle(v_head + 1, c ->> 'subject', c -> 'rows') AS x;
            WHEN 'apply_entry_version' THEN
                SELECT x.result, x.refusal INTO h
                  FROM apply_entry_version(v_head + 1, c ->> 'subject', c -> 'rows',
                                           v_staged[i]) AS x;
            WHEN 'apply_peer_sync' THEN
                SELECT x.result, x.refusal INTO h
                  FROM apply_peer_sync(v_head + 1, c ->> 'subject', c -> 'rows') AS x;
            WHEN 'apply_records' THEN
                SELECT x.result, x.refusal INTO h
                  FROM apply_records(v_head + 1, c ->> 'subject', c -> 'rows') AS x;
            WHEN 'apply_session_revoked' THEN
                SELECT x.result, x.refusal INTO h
                  FROM apply_session_revoked(v_head + 1, c ->> 'subject', c -> 'rows') AS x;
            ELSE
                RAISE EXCEPTION 'append_changes: no handler %', c ->> 'handler';
        END CASE;
        IF c ? 'idem' AND h.result IS NULL AND h.refusal IS NULL THEN
            -- A keyed change's record holds its result or its refusal; a record with neither
            -- stands for an entry version's document (below), so nothing else may look so.
            RAISE EXCEPTION 'append_changes: % answered neither a result nor a refusal',
                c ->> 'handler';
        END IF;
        v_seq := NULL;
        IF h.refusal IS NOT NULL AND (v_staged[i]).inserted THEN
            DELETE FROM entry_search x WHERE x.entry_did = c ->> 'subject';
        END IF;
        IF h.refusal IS NULL THEN
            v_head := v_head + 1;
            v_seq := v_head;
            INSERT INTO log (seq, kind, entry_did, data)
            VALUES (v_head, c ->> 'kind', c ->> 'subject', coalesce(c -> 'event', '{}'::jsonb));
            IF c ? 'also' THEN
                INSERT INTO log (seq, kind, entry_did, data)
                SELECT v_head + t.n, t.a ->> 'kind', t.a ->> 'subject',
                       coalesce(t.a -> 'event', '{}'::jsonb)
                  FROM jsonb_array_elements(c -> 'also') WITH ORDINALITY AS t(a, n);
                v_head := v_head + jsonb_array_length(c -> 'also');
            END IF;
        END IF;
        IF c ? 'idem' AND (h.refusal IS NULL OR h.refusal ->> 'kind' <> 'Retry') THEN
            -- An applied entry version's result is its document, entry_versions.doc at v_seq:
            -- the record names it by its sequence instead of holding a copy (migration 0022;
            -- recorded_result reads it back).
            INSERT INTO idempotency (scope, operation, key, fingerprint, sequence, result, refusal)
            VALUES (c #>> '{idem,scope}', c #>> '{idem,operation}', c #>> '{idem,key}', v_fp,
                    v_seq,
                    CASE WHEN h.refusal IS NULL AND c ->> 'handler' = 'apply_entry_version'
                         THEN NULL ELSE h.result END,
                    h.refusal)
            ON CONFLICT (scope, operation, key) DO UPDATE
               SET fingerprint = EXCLUDED.fingerprint, sequence = EXCLUDED.sequence,
                   result = EXCLUDED.result, refusal = EXCLUDED.refusal, created_at = now();
        END IF;
        RETURN QUERY SELECT i, v_seq, h.result, h.refusal, false, NULL::bytea;
    END LOOP;
    IF v_head > v_start THEN
        UPDATE log_head SET seq = v_head WHERE id = 1;
        PERFORM pg_notify('registry_log', v_head::text);
    END IF;
END $$;
