-- GET through a forward proxy: wrk connects to the proxy (the URL on its command line) and
-- sends the absolute-form request a proxy client sends (wrk has no proxy mode), with an
-- optional Proxy-Authorization value:
--
--   wrk -t2 -c32 -d10s -s benches/wrk/proxy_get.lua http://PROXY -- http://TARGET/ip 'Basic ...'
--
-- Any answer other than 200 counts as a failure (the first one is printed). done() prints one
-- WRK_RESULT line, as healthz.lua does.

local threads = {}

function setup(thread)
   table.insert(threads, thread)
end

function init(args)
   local target = args[1]
   local headers = { Host = target:match("^http://([^/]+)") }
   if args[2] and args[2] ~= "" then
      headers["Proxy-Authorization"] = args[2]
   end
   prepared = wrk.format("GET", target, headers)
end

function request()
   return prepared
end

ok = 0
failed = 0
first_failure = nil

function response(status, headers, body)
   if status == 200 then
      ok = ok + 1
   else
      failed = failed + 1
      if first_failure == nil then
         first_failure = status .. " " .. (body or "")
      end
   end
end

function done(summary, latency, requests)
   local o, f, first = 0, 0, nil
   for _, t in ipairs(threads) do
      o = o + t:get("ok")
      f = f + t:get("failed")
      first = first or t:get("first_failure")
   end
   if first then
      io.write("WRK_FIRST_FAILURE " .. first .. "\n")
   end
   io.write(string.format(
      "WRK_RESULT requests=%d duration_us=%d ok=%d failed=%d " ..
      "socket_errors=%d p50_us=%d p99_us=%d max_us=%d\n",
      summary.requests, summary.duration, o, f,
      summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
      latency:percentile(50), latency:percentile(99), latency.max))
end
