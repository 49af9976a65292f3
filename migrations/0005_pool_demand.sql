-- Unmet demand of ProxyPools: requests refused (for capacity, or because no member was Ready)
-- that a member of the pool would have served, so the leader scales pools from every
-- replica's refusals. One row per (pool, bucket): `pool` is the pool's `namespace/name`,
-- `bucket_start_ms` the start of a 10 s bucket aligned to the Unix epoch (ms, UTC, from the
-- operator's clock), `requests` the refusals counted in it. Only upserted (adding 1 per pool
-- per refusal) and deleted by the sweep once a bucket ended 10 minutes ago:
--   SELECT pool, SUM(requests) FROM pool_demand
--   WHERE bucket_start_ms >= (unixepoch('now') - 60) * 1000 GROUP BY pool;
-- No index beyond the key: the table holds some 60 rows per pool (10 minutes of buckets),
-- which the reads and the sweep scan.
CREATE TABLE pool_demand (
    pool            TEXT    NOT NULL,
    bucket_start_ms INTEGER NOT NULL,
    requests        INTEGER NOT NULL CHECK (requests > 0),
    PRIMARY KEY (pool, bucket_start_ms)
) WITHOUT ROWID;
