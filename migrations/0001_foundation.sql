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
