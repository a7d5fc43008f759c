-- Attestations past their expiry leave the read path of their entry (hostile review).
--
-- An entry's head (get_entry_head: `GET /v1/entries/{did}` after each change, and the
-- existence check of its attestation, version and anchor routes) inlines its oldest unrevoked,
-- unexpired attestations. The scan walked every active attestation of the entry in creation
-- order and dropped the expired ones one by one: ~0.75 ms of database time per 1,000 of them,
-- and any signed-in key may attest any entry with a credential valid for two seconds. Expiry
-- writes nothing, so the walk only grew.
--
-- `lapsed` is set by the janitor (PgStore.lapse_attestations, every 5 s) on an active attestation
-- whose expires_at has passed by the database's clock; time does not go back, so a lapsed
-- attestation is never shown again. The head reads the partial index of active attestations
-- not lapsed, so it walks at most those that expired since the janitor's last pass. The flag
-- is not served and changes no document, list or event: an attestation listed with its
-- expiresAt reads the same before and after. A change of the record (a revocation) clears it;
-- the next pass sets it again if it still applies.
ALTER TABLE records ADD COLUMN lapsed boolean NOT NULL DEFAULT false;
UPDATE records SET lapsed = true
 WHERE kind = 'attestation' AND status = 'active' AND expires_at <= now();
CREATE INDEX records_live_attestations ON records (entry_did, created_seq)
    WHERE kind = 'attestation' AND status = 'active' AND NOT lapsed;
CREATE INDEX records_lapsing_attestations ON records (expires_at)
    WHERE kind = 'attestation' AND status = 'active' AND NOT lapsed AND expires_at IS NOT NULL;
