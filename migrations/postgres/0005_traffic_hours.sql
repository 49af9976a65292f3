-- Bytes through the gateway, per UTC hour, tenant, proxy and target: see the SQLite migration
-- 0008_traffic_hours.sql. Every replica adds what it relayed to these rows about once a
-- second, as upserts in one transaction (rows in key order, so replicas never deadlock).
CREATE TABLE traffic_hours (
    hour_ms   BIGINT NOT NULL,
    tenant    TEXT   NOT NULL,
    namespace TEXT   NOT NULL,
    name      TEXT   NOT NULL,
    pool      TEXT   NOT NULL DEFAULT '',
    target    TEXT   NOT NULL,
    up        BIGINT NOT NULL CHECK (up >= 0),
    down      BIGINT NOT NULL CHECK (down >= 0),
    PRIMARY KEY (hour_ms, tenant, namespace, name, pool, target)
);
-- A tenant's bytes today (its `bytesPerDay` budget, read under its `tenant_quotas` row).
CREATE INDEX traffic_hours_by_tenant ON traffic_hours (tenant, hour_ms);

CREATE VIEW traffic AS
SELECT to_char(to_timestamp(hour_ms / 1000.0) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"') AS hour,
       to_char(to_timestamp(hour_ms / 1000.0) AT TIME ZONE 'UTC', 'YYYY-MM-DD') AS day,
       tenant,
       namespace || '/' || name AS proxy,
       NULLIF(pool, '') AS pool,
       target,
       up,
       down,
       up + down AS bytes
FROM traffic_hours;
