-- Unmet demand of ProxyPools, as in the SQLite ledger's migration 0005: one row per (pool,
-- bucket), `pool` the pool's `namespace/name`, `bucket_start_ms` the start of a 10 s bucket
-- aligned to the Unix epoch (ms, UTC, from the operator's clock, never the database's),
-- `requests` the refusals counted in it by every replica. Only upserted (INSERT ... ON
-- CONFLICT, adding 1 per pool per refusal) and deleted by the sweep once a bucket ended 10
-- minutes ago. No index beyond the key: some 60 rows per pool.
CREATE TABLE pool_demand (
    pool            TEXT   NOT NULL,
    bucket_start_ms BIGINT NOT NULL,
    requests        BIGINT NOT NULL CHECK (requests > 0),
    PRIMARY KEY (pool, bucket_start_ms)
);
