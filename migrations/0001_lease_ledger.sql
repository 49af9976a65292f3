-- Lease ledger: leases, cooldowns and the append-only lease history.
-- Every time is an INTEGER of milliseconds since the Unix epoch (UTC); the views render them
-- as ISO 8601 text for people reading the file with sqlite3.

-- Active and retained leases. A lease counts towards its proxy's capacity while
-- state = 'active' AND expires_at > now; expired and released leases are kept for the
-- cooldown window so that late reports still find them.
CREATE TABLE leases (
    id              TEXT    NOT NULL PRIMARY KEY,
    proxy_namespace TEXT    NOT NULL,
    proxy_name      TEXT    NOT NULL,
    proxy_uid       TEXT    NOT NULL,
    target          TEXT,
    state           TEXT    NOT NULL CHECK (state IN ('active', 'released', 'expired')),
    acquired_at     INTEGER NOT NULL,
    expires_at      INTEGER NOT NULL,
    ttl_ms          INTEGER NOT NULL CHECK (ttl_ms > 0),
    released_at     INTEGER
) STRICT, WITHOUT ROWID;

-- Capacity per proxy (acquire, metrics) and the expiry sweep read only active rows. `state`
-- is repeated in the columns so the capacity query is answered from the index alone.
CREATE INDEX leases_active ON leases (expires_at, proxy_uid, state) WHERE state = 'active';
-- Pruning of retained (released or expired) leases.
CREATE INDEX leases_retained_by_expiry ON leases (expires_at) WHERE state <> 'active';

-- A (proxy, target) pair that acquires naming the target skip until `until`.
CREATE TABLE cooldowns (
    proxy_uid       TEXT    NOT NULL,
    target          TEXT    NOT NULL,
    proxy_namespace TEXT    NOT NULL,
    proxy_name      TEXT    NOT NULL,
    until           INTEGER NOT NULL,
    result          TEXT    NOT NULL CHECK (result IN ('rate_limited', 'blocked')),
    lease_id        TEXT    NOT NULL,
    PRIMARY KEY (proxy_uid, target)
) STRICT, WITHOUT ROWID;

-- Acquire looks cooldowns up by target; the sweep prunes them by end time.
CREATE INDEX cooldowns_by_target ON cooldowns (target, until);
CREATE INDEX cooldowns_by_until ON cooldowns (until);

-- Append-only history of every lease operation. Rows are only ever inserted, and deleted by
-- the retention sweep; the proxy identity is copied so history outlives the lease row.
CREATE TABLE lease_events (
    seq             INTEGER NOT NULL PRIMARY KEY,
    at              INTEGER NOT NULL,
    lease_id        TEXT    NOT NULL,
    kind            TEXT    NOT NULL
                    CHECK (kind IN ('acquired', 'renewed', 'released', 'expired', 'reported')),
    proxy_namespace TEXT    NOT NULL,
    proxy_name      TEXT    NOT NULL,
    proxy_uid       TEXT    NOT NULL,
    target          TEXT,
    result          TEXT    CHECK (result IN ('ok', 'rate_limited', 'blocked', 'error')),
    expires_at      INTEGER,
    CHECK ((kind = 'reported') = (result IS NOT NULL))
) STRICT;

CREATE TRIGGER lease_events_append_only BEFORE UPDATE ON lease_events
BEGIN
    SELECT RAISE(ABORT, 'lease_events is append-only');
END;

-- History of one lease, and reports per target over time. The retention sweep needs no
-- index: it deletes from the start of the table in `seq` order.
CREATE INDEX lease_events_by_lease ON lease_events (lease_id, seq);
CREATE INDEX lease_events_reports ON lease_events (target, at) WHERE kind = 'reported';

-- Leases that count towards capacity right now.
CREATE VIEW active_leases AS
SELECT id,
       proxy_namespace || '/' || proxy_name AS proxy,
       proxy_uid,
       target,
       strftime('%Y-%m-%dT%H:%M:%fZ', acquired_at / 1000.0, 'unixepoch') AS acquired,
       strftime('%Y-%m-%dT%H:%M:%fZ', expires_at / 1000.0, 'unixepoch') AS expires,
       ttl_ms / 1000.0 AS ttl_seconds
FROM leases
WHERE state = 'active'
  AND expires_at > CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER);

-- Active lease count per proxy.
CREATE VIEW active_leases_per_proxy AS
SELECT proxy, proxy_uid, COUNT(*) AS leases, MIN(expires) AS next_expiry
FROM active_leases
GROUP BY proxy_uid
ORDER BY leases DESC, proxy;

-- Cooldowns still in force.
CREATE VIEW active_cooldowns AS
SELECT proxy_namespace || '/' || proxy_name AS proxy,
       proxy_uid,
       target,
       result,
       strftime('%Y-%m-%dT%H:%M:%fZ', until / 1000.0, 'unixepoch') AS until,
       lease_id
FROM cooldowns
WHERE until > CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER);

-- The history in order, with readable times.
CREATE VIEW lease_history AS
SELECT seq,
       strftime('%Y-%m-%dT%H:%M:%fZ', at / 1000.0, 'unixepoch') AS at,
       lease_id,
       kind,
       proxy_namespace || '/' || proxy_name AS proxy,
       proxy_uid,
       target,
       result,
       strftime('%Y-%m-%dT%H:%M:%fZ', expires_at / 1000.0, 'unixepoch') AS expires
FROM lease_events
ORDER BY seq;
