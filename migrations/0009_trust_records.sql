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
