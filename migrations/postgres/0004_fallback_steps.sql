-- Which step of a gateway fallback chain served a lease: see the SQLite migration
-- 0007_fallback_steps.sql.
ALTER TABLE lease_events ADD COLUMN fallback_step BIGINT
    CHECK (fallback_step IS NULL OR (kind = 'acquired' AND fallback_step >= 1));

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
       tenant,
       fallback_step
FROM lease_events
ORDER BY seq;
