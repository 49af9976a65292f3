-- Idempotent acquire: the request ID a crawler sent with an acquire, and a fingerprint of what
-- it asked for (selector, target and TTL, in a canonical form computed by the API).
-- A retried acquire with the same ID gets the same lease while that lease's window is open
-- (until its expires_at, which a renew moves); afterwards the ID may be used again and names
-- the newer lease. The ID stays on the row as long as the lease row is retained, so
--   SELECT * FROM leases WHERE request_id = '...' ORDER BY acquired_at;
-- shows every lease a request ID got.
ALTER TABLE leases ADD COLUMN request_id TEXT;
ALTER TABLE leases ADD COLUMN request_fingerprint TEXT
    CHECK ((request_id IS NULL) = (request_fingerprint IS NULL));

-- Rebuilding the request-ID index at open, and looking a request ID up by hand.
CREATE INDEX leases_by_request ON leases (request_id, acquired_at)
    WHERE request_id IS NOT NULL;
