-- Tenants (`--tenants-file`), as in the SQLite ledger's migration 0006: the tenant of each
-- lease and history row (`default` for rows from before: the tenant of the token file and
-- DISCOVERY_TOKEN), the gateway session a lease serves, request IDs per tenant, and one row
-- per tenant with a quota that acquires lock, so replicas decide a tenant's quota one after
-- another.
ALTER TABLE leases ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default';
ALTER TABLE leases ADD COLUMN session TEXT;
ALTER TABLE lease_events ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default';
-- The quotas count a tenant's active leases.
CREATE INDEX leases_active_by_tenant ON leases (tenant, expires_at) WHERE state = 'active';

-- Request IDs are per tenant: one tenant replaying another's ID is a new acquire, never the
-- other's lease. The table is rebuilt with the tenant in its key.
CREATE TABLE acquire_requests_by_tenant (
    tenant      TEXT   NOT NULL,
    request_id  TEXT   NOT NULL,
    lease_id    TEXT   NOT NULL,
    fingerprint TEXT   NOT NULL,
    expires_at  BIGINT NOT NULL,
    PRIMARY KEY (tenant, request_id)
);
INSERT INTO acquire_requests_by_tenant (tenant, request_id, lease_id, fingerprint, expires_at)
SELECT 'default', request_id, lease_id, fingerprint, expires_at FROM acquire_requests;
DROP TABLE acquire_requests;
ALTER TABLE acquire_requests_by_tenant RENAME TO acquire_requests;
CREATE INDEX acquire_requests_by_lease ON acquire_requests (lease_id);
CREATE INDEX acquire_requests_by_expiry ON acquire_requests (expires_at);

-- One row per tenant with a quota that ever acquired: locked (through an upsert) by every
-- batch granting that tenant a lease, before any proxy row, and holding its token bucket
-- (`tokens` as of `refilled_at`, ms; a new row starts full).
CREATE TABLE tenant_quotas (
    tenant      TEXT             NOT NULL PRIMARY KEY,
    tokens      DOUBLE PRECISION NOT NULL,
    refilled_at BIGINT           NOT NULL,
    acquires    BIGINT           NOT NULL
);

DROP VIEW active_leases_per_proxy;
DROP VIEW active_leases;
CREATE VIEW active_leases AS
SELECT id,
       proxy_namespace || '/' || proxy_name AS proxy,
       proxy_uid,
       target,
       to_char(to_timestamp(acquired_at / 1000.0) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS acquired,
       to_char(to_timestamp(expires_at / 1000.0) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS expires,
       ttl_ms / 1000.0 AS ttl_seconds,
       tenant,
       session
FROM leases
WHERE state = 'active'
  AND expires_at > (extract(epoch FROM now()) * 1000)::BIGINT;

CREATE VIEW active_leases_per_proxy AS
SELECT min(proxy) AS proxy, proxy_uid, count(*) AS leases, min(expires) AS next_expiry
FROM active_leases
GROUP BY proxy_uid
ORDER BY leases DESC, proxy;

DROP VIEW lease_history;
CREATE VIEW lease_history AS
SELECT seq,
       to_char(to_timestamp(at / 1000.0) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS at,
       lease_id,
       kind,
       proxy_namespace || '/' || proxy_name AS proxy,
       proxy_uid,
       target,
       result,
       to_char(to_timestamp(expires_at / 1000.0) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS expires,
       reason,
       cooldown_ms / 1000.0 AS cooldown_seconds,
       client,
       tenant
FROM lease_events
ORDER BY seq;
