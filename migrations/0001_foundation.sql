-- Foundation: the global log, entries and their versions, idempotency, sign-in.
--
-- The registry sequence: every accepted change updates the single log_head row inside its own
-- transaction. The row lock serialises writers from that update to their commit, so commit order
-- equals sequence order and a reader never sees N+1 while N is still invisible (design §2).
-- A write that fails after taking a number raises, which rolls the number back: no gaps.

CREATE TABLE log_head (
    id  smallint PRIMARY KEY CHECK (id = 1),
    seq bigint   NOT NULL
);
INSERT INTO log_head VALUES (1, 0);

CREATE TABLE log (
    seq       bigint      PRIMARY KEY,
    kind      text        NOT NULL,
    entry_did text,
    at        timestamptz NOT NULL DEFAULT now(),
    data      jsonb       NOT NULL DEFAULT '{}'::jsonb
);

-- One row per entry DID: the head version, served without a join.
CREATE TABLE entries (
    entry_did     text        PRIMARY KEY,
    head_seq      bigint      NOT NULL,
    created_seq   bigint      NOT NULL,
    publisher_did text        NOT NULL,
    entry_type    text        NOT NULL,
    lifecycle     text        NOT NULL,
    doc           text        NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE entry_versions (
    seq           bigint      PRIMARY KEY,
    entry_did     text        NOT NULL,
    publisher_did text        NOT NULL,
    lifecycle     text        NOT NULL,
    doc           text        NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX entry_versions_by_did ON entry_versions (entry_did, seq DESC);

-- Completed idempotent requests (design §6), written in the transaction of their effect.
CREATE TABLE idempotency (
    scope       text        NOT NULL,
    operation   text        NOT NULL,
    key         text        NOT NULL,
    fingerprint bytea       NOT NULL,
    status      integer     NOT NULL,
    response    text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, operation, key)
);
CREATE INDEX idempotency_by_age ON idempotency (created_at);

-- Requests in flight. UNLOGGED: a claim is a lease, not a fact; a transaction that writes only
-- unlogged tables commits without a WAL flush, and a crash simply forgets the leases.
CREATE UNLOGGED TABLE idempotency_claims (
    scope        text        NOT NULL,
    operation    text        NOT NULL,
    key          text        NOT NULL,
    fingerprint  bytea       NOT NULL,
    locked_until timestamptz NOT NULL,
    PRIMARY KEY (scope, operation, key)
);

CREATE TABLE challenges (
    nonce      text        PRIMARY KEY,
    challenge  jsonb       NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE INDEX challenges_by_expiry ON challenges (expires_at);

CREATE TABLE sessions (
    token_hash   bytea       PRIMARY KEY,
    principal    text        NOT NULL,
    hmr_did      text        NOT NULL,
    root_did     text        NOT NULL,
    root_kind    text        NOT NULL,
    capabilities text[]      NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    revoked_at   timestamptz
);
CREATE INDEX sessions_by_expiry ON sessions (expires_at);

-- idem_begin: one round trip that either replays a completed request, claims the key, or
-- reports the first request still running. Touches only the unlogged claims table.
CREATE FUNCTION idem_begin(p_scope text, p_op text, p_key text, p_fp bytea, p_lease_s double precision)
RETURNS TABLE (outcome text, fingerprint bytea, status integer, response text)
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    SELECT i.fingerprint, i.status, i.response INTO r FROM idempotency i
     WHERE i.scope = p_scope AND i.operation = p_op AND i.key = p_key
       AND i.created_at > now() - interval '24 hours';
    IF FOUND THEN
        RETURN QUERY SELECT 'done'::text, r.fingerprint, r.status, r.response;
        RETURN;
    END IF;
    INSERT INTO idempotency_claims AS c (scope, operation, key, fingerprint, locked_until)
    VALUES (p_scope, p_op, p_key, p_fp, now() + make_interval(secs => p_lease_s))
    ON CONFLICT (scope, operation, key) DO UPDATE
       SET fingerprint = EXCLUDED.fingerprint, locked_until = EXCLUDED.locked_until
     WHERE c.locked_until < now();
    IF FOUND THEN
        RETURN QUERY SELECT 'claimed'::text, p_fp, NULL::integer, NULL::text;
        RETURN;
    END IF;
    RETURN QUERY SELECT 'running'::text, c.fingerprint, NULL::integer, NULL::text
      FROM idempotency_claims c
     WHERE c.scope = p_scope AND c.operation = p_op AND c.key = p_key;
END $$;

-- idem_finish: record the outcome of a claimed request (an error outcome; success outcomes are
-- recorded by the write functions in their own transaction). NULL status just drops the claim.
CREATE FUNCTION idem_finish(p_scope text, p_op text, p_key text, p_fp bytea, p_status integer, p_response text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF p_status IS NOT NULL THEN
        INSERT INTO idempotency (scope, operation, key, fingerprint, status, response)
        VALUES (p_scope, p_op, p_key, p_fp, p_status, p_response)
        ON CONFLICT (scope, operation, key) DO UPDATE
           SET fingerprint = EXCLUDED.fingerprint, status = EXCLUDED.status,
               response = EXCLUDED.response, created_at = now()
         WHERE idempotency.created_at <= now() - interval '24 hours';
    END IF;
    DELETE FROM idempotency_claims c WHERE c.scope = p_scope AND c.operation = p_op AND c.key = p_key;
END $$;

-- entry_write: create (p_expected_head IS NULL), update or delete one entry in one transaction:
-- sequence, head, version, log record and the idempotency record of the request.
-- Raises RG409 with a code in the message on conflicts; nothing is written then.
CREATE FUNCTION entry_write(
    p_kind text, p_did text, p_expected_head bigint, p_publisher text, p_entry_type text,
    p_lifecycle text, p_prefix text, p_suffix text,
    p_scope text, p_op text, p_key text, p_fp bytea, p_status integer)
RETURNS TABLE (seq bigint, doc text)
LANGUAGE plpgsql AS $$
DECLARE
    v_seq  bigint;
    v_doc  text;
    v_head bigint;
BEGIN
    -- Take the log head first: from here on, writers are serialised, so the checks below see
    -- every committed change.
    UPDATE log_head SET seq = log_head.seq + 1 WHERE id = 1 RETURNING log_head.seq INTO v_seq;
    SELECT e.head_seq INTO v_head FROM entries e WHERE e.entry_did = p_did;
    IF p_expected_head IS NULL AND FOUND THEN
        RAISE EXCEPTION 'entry_exists' USING ERRCODE = 'RG409';
    ELSIF p_expected_head IS NOT NULL AND NOT FOUND THEN
        RAISE EXCEPTION 'entry_not_found' USING ERRCODE = 'RG404';
    ELSIF p_expected_head IS NOT NULL AND v_head <> p_expected_head THEN
        RAISE EXCEPTION 'sequence_conflict' USING ERRCODE = 'RG409';
    END IF;
    v_doc := p_prefix || v_seq::text || p_suffix;
    IF p_expected_head IS NULL THEN
        INSERT INTO entries (entry_did, head_seq, created_seq, publisher_did, entry_type, lifecycle, doc)
        VALUES (p_did, v_seq, v_seq, p_publisher, p_entry_type, p_lifecycle, v_doc);
    ELSE
        UPDATE entries e SET head_seq = v_seq, publisher_did = p_publisher, entry_type = p_entry_type,
               lifecycle = p_lifecycle, doc = v_doc, updated_at = now()
         WHERE e.entry_did = p_did;
    END IF;
    INSERT INTO entry_versions (seq, entry_did, publisher_did, lifecycle, doc)
    VALUES (v_seq, p_did, p_publisher, p_lifecycle, v_doc);
    INSERT INTO log (seq, kind, entry_did, data)
    VALUES (v_seq, p_kind, p_did, jsonb_build_object(
        'entryType', p_entry_type, 'publisherDid', p_publisher, 'lifecycleStatus', p_lifecycle));
    PERFORM pg_notify('registry_log', v_seq::text || ' ' || p_did);
    IF p_key IS NOT NULL THEN
        INSERT INTO idempotency (scope, operation, key, fingerprint, status, response)
        VALUES (p_scope, p_op, p_key, p_fp, p_status, v_doc)
        ON CONFLICT (scope, operation, key) DO UPDATE
           SET fingerprint = EXCLUDED.fingerprint, status = EXCLUDED.status,
               response = EXCLUDED.response, created_at = now()
         WHERE idempotency.created_at <= now() - interval '24 hours';
        IF NOT FOUND THEN
            RAISE EXCEPTION 'idempotency_conflict' USING ERRCODE = 'RG409';
        END IF;
        DELETE FROM idempotency_claims c WHERE c.scope = p_scope AND c.operation = p_op AND c.key = p_key;
    END IF;
    RETURN QUERY SELECT v_seq, v_doc;
END $$;
