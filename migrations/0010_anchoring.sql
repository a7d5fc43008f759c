-- Anchoring (design §8, spec 2.2, 2.3): durable anchor intents, batches and their receipts.
--
-- Every entry version records its anchor intent in the transaction that writes it (rows.anchor
-- of apply_entry_version: {operation, itemDataHash}); intent id `ai_<sequence>`. The anchoring
-- supervisor (one per database, elected by an advisory lock) moves intents through changes of
-- the one append path (their definitions are in functions/):
--   apply_anchor_claim      pending (available) → submitted, as a new batch (batch id = the
--                           claim's log position; leaf order = sequence order)
--   apply_anchor_settle     a batch's submitted intents → confirmed (final on the chain), or
--                           → pending again (dropped / re-orged transaction, with a backoff) or
--                           → failed (attempts exhausted)
--   apply_anchor_control    admin retry (failed|abandoned → pending) and abandon
--                           (pending|submitted|failed → abandoned)
-- Each is compare-and-set on the intents' states (`Retry` when they moved). The batch's root
-- and transaction id are bookkeeping (record_anchor_submission), not intent state changes.

CREATE TABLE anchor_batches (
    batch_id       bigint      PRIMARY KEY,   -- the log position of its claim
    root           text,                      -- Merkle root, once computed
    transaction_id text,                      -- on the chain, once submitted
    state          text        NOT NULL,      -- claimed | submitted | confirmed | dropped
    block_height   bigint,
    block_hash     text,
    anchor_time    timestamptz,
    created_at     timestamptz NOT NULL DEFAULT now(),
    observed_at    timestamptz
);

CREATE TABLE anchor_intents (
    intent_id      text        PRIMARY KEY,
    entry_did      text        NOT NULL,
    sequence       bigint      NOT NULL UNIQUE,
    operation      text        NOT NULL,      -- create | update | transfer | delete
    item_data_hash text        NOT NULL,
    state          text        NOT NULL DEFAULT 'pending',
    attempts       integer     NOT NULL DEFAULT 0,
    available_at   timestamptz NOT NULL DEFAULT now(),
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    batch_id       bigint,                    -- its current batch
    leaf_index     integer
);
CREATE INDEX anchor_intents_pending ON anchor_intents (sequence) WHERE state = 'pending';
CREATE INDEX anchor_intents_by_entry ON anchor_intents (entry_did, sequence, created_at, intent_id);
CREATE INDEX anchor_intents_by_batch ON anchor_intents (batch_id, leaf_index);

-- Every batch an intent was part of: its receipts.
CREATE TABLE anchor_receipts (
    intent_id  text    NOT NULL,
    batch_id   bigint  NOT NULL,
    leaf_index integer NOT NULL,
    PRIMARY KEY (intent_id, batch_id)
);
CREATE INDEX anchor_receipts_by_batch ON anchor_receipts (batch_id, leaf_index);
