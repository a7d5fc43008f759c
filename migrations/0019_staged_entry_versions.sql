-- The append path's short critical section (docs/architecture.md): what an entry version
-- derives from its document without its position (the document's two halves and its
-- searchable projection, with the full-text vector) is computed before the log head is locked,
-- by stage_entry_version, and handed to apply_entry_version as one `entry_staged` value.
-- apply_entry_version takes it as a fourth argument (functions/), so its old signature goes.
CREATE TYPE entry_staged AS (
    prefix          text,
    suffix          text,
    name            text,
    description     text,
    version         text,
    tags            text[],
    service_types   text[],
    relationships   jsonb,
    custom_metadata jsonb,
    published_at    timestamptz,
    updated_at      timestamptz,
    search          tsvector
);
DROP FUNCTION IF EXISTS apply_entry_version(bigint, text, jsonb);
