-- Lease ledger on PostgreSQL (and what speaks its protocol): the same tables, columns and
-- views as the SQLite ledger after its migration 0004, so the same queries read either.
-- Every time is a BIGINT of milliseconds since the Unix epoch (UTC), written from the
-- operator's clock, never from the database's; the views render them as ISO 8601 text.
--
-- The SQL keeps to a subset CockroachDB and YugabyteDB also serve: plain tables and indexes,
-- CHECK constraints, INSERT ... ON CONFLICT, SELECT ... FOR UPDATE, no advisory locks, no
-- triggers, no stored procedures.

-- Active and retained leases. A lease counts towards its proxy's capacity while
-- state = 'active' AND expires_at > now; expired and released leases are kept for the
-- cooldown window so that late reports still find them.
CREATE TABLE leases (
    id                  TEXT    NOT NULL PRIMARY KEY,
    proxy_namespace     TEXT    NOT NULL,
    proxy_name          TEXT    NOT NULL,
    proxy_uid           TEXT    NOT NULL,
    target              TEXT,
    state               TEXT    NOT NULL CHECK (state IN ('active', 'released', 'expired')),
    acquired_at         BIGINT  NOT NULL,
    expires_at          BIGINT  NOT NULL,
    ttl_ms              BIGINT  NOT NULL CHECK (ttl_ms > 0),
    released_at         BIGINT,
    request_id          TEXT,
    request_fingerprint TEXT,
    release_reason      TEXT    CHECK (release_reason IS NULL OR state = 'released'),
    client              TEXT,
    CHECK ((request_id IS NULL) = (request_fingerprint IS NULL))
);

-- Capacity per proxy (acquire, counts) and the expiry sweep read only active rows.
CREATE INDEX leases_active ON leases (proxy_uid, expires_at) WHERE state = 'active';
CREATE INDEX leases_active_by_expiry ON leases (expires_at) WHERE state = 'active';
-- The per-target limits count the active leases naming a target.
CREATE INDEX leases_active_by_target ON leases (target, expires_at) WHERE state = 'active';
-- Pruning of retained (released or expired) leases.
CREATE INDEX leases_retained_by_expiry ON leases (expires_at) WHERE state <> 'active';
-- Looking a request ID up by hand.
CREATE INDEX leases_by_request ON leases (request_id, acquired_at) WHERE request_id IS NOT NULL;

-- The request ID an acquire carried, while the window of the lease it got is open (until
-- that lease's expires_at, which a renew moves). One row per request ID: an acquire with an
-- ID whose window closed takes the row over, so a request ID replays across replicas and is
-- free again once its lease expired.
CREATE TABLE acquire_requests (
    request_id  TEXT   NOT NULL PRIMARY KEY,
    lease_id    TEXT   NOT NULL,
    fingerprint TEXT   NOT NULL,
    expires_at  BIGINT NOT NULL
);
CREATE INDEX acquire_requests_by_lease ON acquire_requests (lease_id);
CREATE INDEX acquire_requests_by_expiry ON acquire_requests (expires_at);

-- One row per proxy that was ever leased, locked (SELECT ... FOR UPDATE through an upsert)
-- by an acquire between choosing the proxy and inserting its lease, so acquires racing for
-- one proxy on any number of replicas are decided one after another.
CREATE TABLE proxy_locks (
    proxy_uid TEXT   NOT NULL PRIMARY KEY,
    acquires  BIGINT NOT NULL
);

-- The same per target, locked first by acquires naming a target while a fleet-wide
-- per-target limit (--max-leases-per-target) is set.
CREATE TABLE target_locks (
    target   TEXT   NOT NULL PRIMARY KEY,
    acquires BIGINT NOT NULL
);

-- A (proxy, target) pair that acquires naming the target skip until `until`.
CREATE TABLE cooldowns (
    proxy_uid       TEXT   NOT NULL,
    target          TEXT   NOT NULL,
    proxy_namespace TEXT   NOT NULL,
    proxy_name      TEXT   NOT NULL,
    until           BIGINT NOT NULL,
    result          TEXT   NOT NULL CHECK (result IN ('rate_limited', 'blocked')),
    lease_id        TEXT   NOT NULL,
    PRIMARY KEY (proxy_uid, target)
);
CREATE INDEX cooldowns_by_target ON cooldowns (target, until);
CREATE INDEX cooldowns_by_until ON cooldowns (until);

-- Append-only history of every lease operation; rows are only inserted, and deleted by the
-- retention sweep. The proxy identity is copied so history outlives the lease row.
CREATE TABLE lease_events (
    seq             BIGSERIAL NOT NULL PRIMARY KEY,
    at              BIGINT    NOT NULL,
    lease_id        TEXT      NOT NULL,
    kind            TEXT      NOT NULL
                    CHECK (kind IN ('acquired', 'renewed', 'released', 'expired', 'reported')),
    proxy_namespace TEXT      NOT NULL,
    proxy_name      TEXT      NOT NULL,
    proxy_uid       TEXT      NOT NULL,
    target          TEXT,
    result          TEXT      CHECK (result IN ('ok', 'rate_limited', 'blocked', 'error')),
    expires_at      BIGINT,
    reason          TEXT      CHECK (reason IS NULL OR kind = 'released'),
    client          TEXT      CHECK (client IS NULL OR kind = 'acquired'),
    cooldown_ms     BIGINT    CHECK (cooldown_ms IS NULL OR (kind = 'reported' AND cooldown_ms > 0)),
    CHECK ((kind = 'reported') = (result IS NOT NULL))
);
CREATE INDEX lease_events_by_lease ON lease_events (lease_id, seq);
CREATE INDEX lease_events_by_at ON lease_events (at);
CREATE INDEX lease_events_reports ON lease_events (target, at) WHERE kind = 'reported';

-- Leases that count towards capacity right now.
CREATE VIEW active_leases AS
SELECT id,
       proxy_namespace || '/' || proxy_name AS proxy,
       proxy_uid,
       target,
       to_char(to_timestamp(acquired_at / 1000.0) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS acquired,
       to_char(to_timestamp(expires_at / 1000.0) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS expires,
       ttl_ms / 1000.0 AS ttl_seconds
FROM leases
WHERE state = 'active'
  AND expires_at > (extract(epoch FROM now()) * 1000)::BIGINT;

-- Active lease count per proxy.
CREATE VIEW active_leases_per_proxy AS
SELECT min(proxy) AS proxy, proxy_uid, count(*) AS leases, min(expires) AS next_expiry
FROM active_leases
GROUP BY proxy_uid
ORDER BY leases DESC, proxy;

-- Cooldowns still in force.
CREATE VIEW active_cooldowns AS
SELECT proxy_namespace || '/' || proxy_name AS proxy,
       proxy_uid,
       target,
       result,
       to_char(to_timestamp(until / 1000.0) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS until,
       lease_id
FROM cooldowns
WHERE until > (extract(epoch FROM now()) * 1000)::BIGINT;

-- The history in order, with readable times, the release reason, the cooldown a report
-- started and the crawler that took the lease.
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
       client
FROM lease_events
ORDER BY seq;
