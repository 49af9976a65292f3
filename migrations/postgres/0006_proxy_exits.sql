-- Proxies' exit addresses, from their exit checks: see the SQLite migration
-- 0009_proxy_exits.sql. `proxy_exits` is locked row by row (`SELECT … FOR UPDATE`) when a
-- check's exit is recorded, so replicas that see the same change record it once.
CREATE TABLE proxy_exits (
    proxy_uid       TEXT   NOT NULL PRIMARY KEY,
    exit_ip         TEXT   NOT NULL,
    changed_at      BIGINT NOT NULL,
    confirmed_at    BIGINT NOT NULL
);

CREATE INDEX proxy_exits_by_confirmation ON proxy_exits (confirmed_at);

CREATE TABLE exit_changes (
    seq             BIGSERIAL NOT NULL PRIMARY KEY,
    at              BIGINT NOT NULL,
    proxy_namespace TEXT   NOT NULL,
    proxy_name      TEXT   NOT NULL,
    proxy_uid       TEXT   NOT NULL,
    previous_ip     TEXT,
    exit_ip         TEXT   NOT NULL,
    country         TEXT,
    asn             BIGINT
);

CREATE INDEX exit_changes_by_proxy ON exit_changes (proxy_namespace, proxy_name, seq);
CREATE INDEX exit_changes_by_time ON exit_changes (at);

CREATE VIEW exit_history AS
SELECT seq,
       to_char(to_timestamp(at / 1000.0) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS at,
       proxy_namespace || '/' || proxy_name AS proxy,
       proxy_uid,
       previous_ip,
       exit_ip,
       country,
       asn
FROM exit_changes
ORDER BY seq;
