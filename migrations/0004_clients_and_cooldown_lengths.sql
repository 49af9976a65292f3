-- Who holds a lease, and how long each report cooled its (proxy, target) down.
--
-- `leases.client` names the crawler that took the lease when it said (the gateway records the
-- name in front of the options of its Proxy-Authorization user, e.g. `crawler` in
-- `crawler;session=s1;geo=eu`); NULL otherwise. Free text, shown to people reading the file:
--   SELECT client, COUNT(*) FROM leases GROUP BY client;
ALTER TABLE leases ADD COLUMN client TEXT;
-- The same name on the lease's `acquired` event, so the history says who took each lease for
-- as long as it is kept (the lease rows go sooner).
ALTER TABLE lease_events ADD COLUMN client TEXT
    CHECK (client IS NULL OR kind = 'acquired');

-- A `rate_limited` or `blocked` report may say how long the target asked to be left alone
-- (the API's `retryAfterSeconds`, or a target's `Retry-After` seen by the gateway); the
-- cooldown it started lasts that long, bounded by --max-lease-cooldown, else
-- --lease-cooldown. `cooldown_ms` is the length applied, NULL on every other row.
ALTER TABLE lease_events ADD COLUMN cooldown_ms INTEGER
    CHECK (cooldown_ms IS NULL OR (kind = 'reported' AND cooldown_ms > 0));

-- The history in order, with readable times, now with the cooldown a report started and the
-- crawler that took the lease.
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
       client
FROM lease_events
ORDER BY seq;
