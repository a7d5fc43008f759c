-- Idempotency in one place per layer: the rules (registry/changes.py) hold the window a completed
-- request answers for (IDEMPOTENCY_WINDOW_MS) and tell a replay from a conflict; the store only
-- records outcomes and answers the one standing under a key with the fingerprint it was recorded
-- for. append_changes and record_refusal take the window as an argument and return that
-- fingerprint (their new definitions are in functions/), so their old signatures go.
DROP FUNCTION IF EXISTS append_changes(jsonb);
DROP FUNCTION IF EXISTS record_refusal(text, text, text, bytea, jsonb);
