-- Tenants (`--tenants-file`): the tenant that holds each lease and wrote each history row, and
-- the gateway session a lease serves, so quotas are counted where capacity is decided and a
-- lease's renew, report and release stay within its tenant. Rows from before belong to
-- `default`, the tenant of the token file and DISCOVERY_TOKEN.
ALTER TABLE leases ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default';
-- The name of the gateway session a lease serves; NULL for every other lease. The sessions
-- quota counts the leases that have one.
ALTER TABLE leases ADD COLUMN session TEXT;
ALTER TABLE lease_events ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default';

-- The views gain the tenant (and the active leases their session).
DROP VIEW active_leases_per_proxy;
DROP VIEW active_leases;
CREATE VIEW active_leases AS
SELECT id,
       proxy_namespace || '/' || proxy_name AS proxy,
       proxy_uid,
       target,
       strftime('%Y-%m-%dT%H:%M:%fZ', acquired_at / 1000.0, 'unixepoch') AS acquired,
       strftime('%Y-%m-%dT%H:%M:%fZ', expires_at / 1000.0, 'unixepoch') AS expires,
       ttl_ms / 1000.0 AS ttl_seconds,
       tenant,
       session
FROM leases
WHERE state = 'active'
  AND expires_at > CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER);

CREATE VIEW active_leases_per_proxy AS
SELECT proxy, proxy_uid, COUNT(*) AS leases, MIN(expires) AS next_expiry
FROM active_leases
GROUP BY proxy_uid
ORDER BY leases DESC, proxy;

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
       tenant
FROM lease_events
ORDER BY seq;
