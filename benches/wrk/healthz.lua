-- GET /healthz with the same bookkeeping as lease_pairs.lua (a response() callback per
-- answer), so the two runs of `cargo bench --bench api` cost wrk the same per request:
--
--   wrk -t2 -c32 -d10s -s benches/wrk/healthz.lua http://127.0.0.1:8090/healthz
--
-- Any answer other than 200 counts as a failure. done() prints one WRK_RESULT line.

local threads = {}

function setup(thread)
   table.insert(threads, thread)
end

ok = 0
failed = 0

function response(status, headers, body)
   if status == 200 then
      ok = ok + 1
   else
      failed = failed + 1
   end
end

function done(summary, latency, requests)
   local o, f = 0, 0
   for _, t in ipairs(threads) do
      o = o + t:get("ok")
      f = f + t:get("failed")
   end
   io.write(string.format(
      "WRK_RESULT requests=%d duration_us=%d ok=%d failed=%d " ..
      "socket_errors=%d p50_us=%d p99_us=%d max_us=%d\n",
      summary.requests, summary.duration, o, f,
      summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
      latency:percentile(50), latency:percentile(99), latency.max))
end
