-- Bytes through the gateway, per UTC hour, tenant, proxy and target.
--
-- Each gateway process adds up what it relays in memory and adds it to these rows about once
-- a second (and when it stops), never one write per request. `hour_ms` is the start of the
-- UTC hour (ms since the Unix epoch, from the operator's clock), `pool` the proxy's
-- ProxyPool ('' for none), `target` the host of the requests, `up` the bytes to the target
-- and `down` the bytes to the crawler. Rows are deleted by the sweep once their hour ended
-- before the history retention (`--history-retention`), and pruned with the history under
-- the size bound, never today's.
--   SELECT tenant, SUM(up + down) FROM traffic_hours
--   WHERE hour_ms >= (unixepoch('now', 'start of day') * 1000) GROUP BY tenant;
CREATE TABLE traffic_hours (
    hour_ms   INTEGER NOT NULL,
    tenant    TEXT    NOT NULL,
    namespace TEXT    NOT NULL,
    name      TEXT    NOT NULL,
    pool      TEXT    NOT NULL DEFAULT '',
    target    TEXT    NOT NULL,
    up        INTEGER NOT NULL CHECK (up >= 0),
    down      INTEGER NOT NULL CHECK (down >= 0),
    PRIMARY KEY (hour_ms, tenant, namespace, name, pool, target)
) WITHOUT ROWID;
-- A tenant's bytes today (the budgets, rebuilt at open) without scanning every tenant's.
CREATE INDEX traffic_hours_by_tenant ON traffic_hours (tenant, hour_ms);

-- The rows with readable times, for sqlite3.
CREATE VIEW traffic AS
SELECT strftime('%Y-%m-%dT%H:%M:%SZ', hour_ms / 1000, 'unixepoch') AS hour,
       date(hour_ms / 1000, 'unixepoch') AS day,
       tenant,
       namespace || '/' || name AS proxy,
       NULLIF(pool, '') AS pool,
       target,
       up,
       down,
       up + down AS bytes
FROM traffic_hours;
