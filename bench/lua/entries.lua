-- wrk script for bench/entries.py. Configured through the environment (wrk's done() runs in the
-- main Lua state, which never sees the script arguments):
--
--   BENCH_MODE   "static": every request is `GET $BENCH_PATH`
--                "create": replay pre-signed `POST /v1/entries` bodies from $BENCH_POOL
--   BENCH_PATH   path of the static GET
--   BENCH_POOL   file, one request a line: "<Idempotency-Key> <JSON body>"
--   BENCH_TOKEN  session token (Authorization: Bearer) for "create"
--   BENCH_PORTS  comma-separated ports on 127.0.0.1; thread i connects to port i mod n
--                (several server processes, load split across them, one wrk run)
--   BENCH_THREADS  wrk's -t (how many slices the pool is cut into)
--   BENCH_OUT    file that done() writes the results to (parsed by bench/entries.py)
--
-- Each thread takes its own slice of the pool (line i goes to thread i mod nthreads) and never
-- sends a line twice: if it runs out it starts over and counts the overrun, which the Python
-- side reports as an invalid run (those requests would be idempotent replays, not creates).

local threads = {}
local started = 0

local function split_ports(text)
   local ports = {}
   for port in string.gmatch(text or "", "[^,]+") do
      ports[#ports + 1] = port
   end
   return ports
end

function setup(thread)
   local ports = split_ports(os.getenv("BENCH_PORTS"))
   if #ports > 0 then
      local port = ports[(started % #ports) + 1]
      thread.addr = wrk.lookup("127.0.0.1", port)[1]
      thread:set("port", port)
   end
   thread:set("tid", started)
   started = started + 1
   threads[#threads + 1] = thread
end

function init(args)
   mode = os.getenv("BENCH_MODE") or "static"
   statuses = {}
   overrun = 0
   replayed = 0
   if mode == "static" then
      static_request = wrk.format("GET", os.getenv("BENCH_PATH"))
      return
   end
   -- wrk runs setup() and init() of a thread before the next thread is set up, so the thread
   -- count comes from the environment, not from counting setup() calls.
   local nthreads = tonumber(os.getenv("BENCH_THREADS"))
   local token = os.getenv("BENCH_TOKEN")
   pool = {}
   local i = 0
   for line in io.lines(os.getenv("BENCH_POOL")) do
      if i % nthreads == tid then
         local space = string.find(line, " ", 1, true)
         local headers = {
            ["Content-Type"] = "application/json",
            ["Authorization"] = "Bearer " .. token,
            ["Idempotency-Key"] = string.sub(line, 1, space - 1),
         }
         pool[#pool + 1] = wrk.format("POST", "/v1/entries", headers, string.sub(line, space + 1))
      end
      i = i + 1
   end
   pool_size = #pool
   next_index = 0
end

function request()
   if mode == "static" then
      return static_request
   end
   next_index = next_index + 1
   if next_index > pool_size then
      overrun = overrun + 1
      next_index = 1
   end
   return pool[next_index]
end

function response(status, headers, body)
   statuses[status] = (statuses[status] or 0) + 1
   if headers["Idempotent-Replayed"] then
      replayed = replayed + 1
   end
end

function done(summary, latency, requests)
   local out = assert(io.open(os.getenv("BENCH_OUT"), "w"))
   out:write(string.format("requests %d\n", summary.requests))
   out:write(string.format("duration_us %d\n", summary.duration))
   out:write(string.format("bytes %d\n", summary.bytes))
   local e = summary.errors
   out:write(string.format("errors %d %d %d %d %d\n", e.connect, e.read, e.write, e.status, e.timeout))
   for _, thread in ipairs(threads) do
      local tid = thread:get("tid")
      local port = thread:get("port") or "-"
      for status, count in pairs(thread:get("statuses")) do
         out:write(string.format("status %d %s %d %d\n", tid, port, status, count))
      end
      out:write(string.format("overrun %d %d\n", tid, thread:get("overrun") or 0))
      out:write(string.format("replayed %d %d\n", tid, thread:get("replayed") or 0))
      out:write(string.format("pool %d %d\n", tid, thread:get("pool_size") or 0))
   end
   -- wrk's histogram is global (every thread, every server of a multi-port run): its percentiles
   -- need no merging. (Debian's wrk 4.1.0 does not expose the raw histogram buckets to Lua.)
   for _, p in ipairs({ 50, 75, 90, 99, 99.9 }) do
      out:write(string.format("latency_us p%g %d\n", p, latency:percentile(p)))
   end
   out:write(string.format("latency_us mean %d\n", latency.mean))
   out:write(string.format("latency_us max %d\n", latency.max))
   out:close()
end
