-- Proxies' exit addresses, from their exit checks (`spec.exitCheck`).
-- Times are INTEGER milliseconds since the Unix epoch (UTC), like every other table.
--
-- `proxy_exits` holds the exit each proxy was last seen with, one row per proxy UID:
-- `changed_at` is when that exit was first seen, `confirmed_at` when a check last confirmed it
-- (refreshed at most about twice per history retention, so a stable exit costs no write per
-- check). The sweep deletes rows not confirmed within the history retention (their proxy is
-- gone). `exit_changes` is the history: one row when a proxy's exit is first seen
-- (`previous_ip` NULL) and one each time it changes — never one per check. Pruned after the
-- history retention, like `lease_events`:
--   SELECT * FROM exit_history WHERE proxy = 'crawl/gcp-eu-1';
CREATE TABLE proxy_exits (
    proxy_uid       TEXT    NOT NULL PRIMARY KEY,
    exit_ip         TEXT    NOT NULL,
    changed_at      INTEGER NOT NULL,
    confirmed_at    INTEGER NOT NULL
) STRICT, WITHOUT ROWID;

CREATE INDEX proxy_exits_by_confirmation ON proxy_exits (confirmed_at);

CREATE TABLE exit_changes (
    seq             INTEGER NOT NULL PRIMARY KEY,
    at              INTEGER NOT NULL,
    proxy_namespace TEXT    NOT NULL,
    proxy_name      TEXT    NOT NULL,
    proxy_uid       TEXT    NOT NULL,
    previous_ip     TEXT,
    exit_ip         TEXT    NOT NULL,
    country         TEXT,
    asn             INTEGER
) STRICT;

CREATE INDEX exit_changes_by_proxy ON exit_changes (proxy_namespace, proxy_name, seq);
CREATE INDEX exit_changes_by_time ON exit_changes (at);

CREATE VIEW exit_history AS
SELECT seq,
       strftime('%Y-%m-%dT%H:%M:%fZ', at / 1000.0, 'unixepoch') AS at,
       proxy_namespace || '/' || proxy_name AS proxy,
       proxy_uid,
       previous_ip,
       exit_ip,
       country,
       asn
FROM exit_changes
ORDER BY seq;
