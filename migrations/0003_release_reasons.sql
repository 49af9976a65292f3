-- Release reasons: why the operator ended a lease that its crawler did not give back.
-- When the operator force-deletes a lost machine, or finds it stopped or gone, it ends every
-- active lease on that proxy at once (state 'released') and records a short machine code such
-- as 'machine_lost', 'machine_stopped' or 'machine_gone'. Leases a crawler released keep a NULL
-- reason, so
--   SELECT * FROM leases WHERE release_reason IS NOT NULL ORDER BY released_at;
-- lists the leases the operator ended. The reason is only ever set on released leases and on
-- their 'released' history event; existing rows keep NULL.
ALTER TABLE leases ADD COLUMN release_reason TEXT
    CHECK (release_reason IS NULL OR state = 'released');
ALTER TABLE lease_events ADD COLUMN reason TEXT
    CHECK (reason IS NULL OR kind = 'released');

-- The history in order, with readable times, now with the release reason.
DROP VIEW lease_history;
CREATE VIEW lease_history AS
SELECT seq,
       strftime('%Y-%m-%dT%H:%M:%fZ', at / 1000.0, 'unixepoch') AS at,
       lease_id,
       kind,
       proxy_namespace || '/' || proxy_name AS proxy,
       proxy_uid,
       target,
       result,
       strftime('%Y-%m-%dT%H:%M:%fZ', expires_at / 1000.0, 'unixepoch') AS expires,
       reason
FROM lease_events
ORDER BY seq;
