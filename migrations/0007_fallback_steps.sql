-- Which step of a gateway fallback chain served a lease (rented exits).
--
-- A rule's `action: fallback` or a proxy URL's `fallback=` names a chain of selectors (own
-- proxies first, a vendor next): each acquire walks it until a step has a proxy that can take
-- the lease. `fallback_step` on the `acquired` event says which step that was (1: the first);
-- NULL when the acquire named no chain.
--   SELECT fallback_step, COUNT(*) FROM lease_events
--   WHERE kind = 'acquired' AND fallback_step IS NOT NULL GROUP BY fallback_step;
ALTER TABLE lease_events ADD COLUMN fallback_step INTEGER
    CHECK (fallback_step IS NULL OR (kind = 'acquired' AND fallback_step >= 1));

DROP VIEW lease_history;
CREATE VIEW lease_history AS
SELECT seq,
       strftime('%Y-%m-%dT%H:%M:%fZ', at / 1000.0, 'unixepoch') AS at,
       lease_id,
       kind,
       proxy_namespace || '/' || proxy_name AS proxy,
       proxy_uid,
       target,
       result,
       strftime('%Y-%m-%dT%H:%M:%fZ', expires_at / 1000.0, 'unixepoch') AS expires,
       reason,
       cooldown_ms / 1000.0 AS cooldown_seconds,
       client,
       tenant,
       fallback_step
FROM lease_events
ORDER BY seq;
