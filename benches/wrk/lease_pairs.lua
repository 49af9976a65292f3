-- Acquire+release pairs against the lease API, for `cargo bench --bench api`:
--
--   wrk -t2 -c32 -d10s -s benches/wrk/lease_pairs.lua http://127.0.0.1:8090 -- TOKEN [BODY]
--
-- Every connection asks for a lease (POST /v1/leases with BODY, default
-- {"ttlSeconds":60}) and gives back the one it got (DELETE /v1/leases/{leaseID}), so acquires
-- and releases alternate. Any answer other than 201 to an acquire or 204 to a release counts
-- as a failure. done() prints one WRK_RESULT line the bench parses.

local threads = {}

function setup(thread)
   table.insert(threads, thread)
end

-- Per wrk thread (each has its own Lua state; done() reads them with thread:get).
acquired = 0
released = 0
failed = 0
first_failure = ""

local pending = {}
local acquire_request
local auth

function init(args)
   auth = { ["Authorization"] = "Bearer " .. (args[1] or "") }
   local body = args[2] or '{"ttlSeconds":60}'
   acquire_request = wrk.format("POST", "/v1/leases", {
      ["Authorization"] = auth["Authorization"],
      ["Content-Type"] = "application/json",
   }, body)
end

function request()
   local id = table.remove(pending)
   if id then
      return wrk.format("DELETE", "/v1/leases/" .. id, auth)
   end
   return acquire_request
end

local function failure(status, body)
   failed = failed + 1
   if first_failure == "" then
      first_failure = status .. " " .. string.sub(body or "", 1, 200)
   end
end

function response(status, headers, body)
   if status == 201 then
      local id = string.match(body, '"leaseID":"([^"]+)"')
      if id then
         acquired = acquired + 1
         table.insert(pending, id)
      else
         failure(status, body)
      end
   elseif status == 204 then
      released = released + 1
   else
      failure(status, body)
   end
end

function done(summary, latency, requests)
   local a, r, f, first = 0, 0, 0, ""
   for _, t in ipairs(threads) do
      a = a + t:get("acquired")
      r = r + t:get("released")
      f = f + t:get("failed")
      if first == "" then
         first = t:get("first_failure")
      end
   end
   io.write(string.format(
      "WRK_RESULT requests=%d duration_us=%d acquired=%d released=%d failed=%d " ..
      "socket_errors=%d p50_us=%d p99_us=%d max_us=%d\n",
      summary.requests, summary.duration, a, r, f,
      summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
      latency:percentile(50), latency:percentile(99), latency.max))
   if first ~= "" then
      io.write("WRK_FIRST_FAILURE " .. string.gsub(first, "\n", " ") .. "\n")
   end
end
