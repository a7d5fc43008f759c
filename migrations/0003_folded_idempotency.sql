-- Idempotency folded into entry_write: the success path of an entry change is one round trip.
--
-- entry_write first answers a request whose Idempotency-Key already completed (replay, or
-- idempotency_conflict for a different request), then takes the log head. A duplicate that
-- committed while this one waited for the head raises idempotency_retry (RG425): nothing is
-- written, and the caller calls again, which then replays.

-- (entry_write was a function of releases before 0008; 0006 drops it.)
