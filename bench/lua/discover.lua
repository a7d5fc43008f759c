-- wrk script for bench/discover.py. Configured through the environment (wrk's done() runs in the
-- main Lua state, which never sees the script arguments):
--
--   BENCH_REQUESTS  file, one request a line: "GET <path>" or "POST <path> <JSON body>"
--                   (the body is the rest of the line and may hold spaces). Every thread loads
--                   the whole file and sends its lines round-robin, thread i starting at line
--                   i * (lines / threads), so a file of the variants of one query shape (or the
--                   shuffled mix of every shape) is replayed in a steady rotation.
--   BENCH_OUT       file that done() writes the results to (same format as bench/lua/entries.lua,
--                   read by bench.entries.parse_wrk_output, plus "errbody" and "cache" lines)
--
-- Every response's status is counted, so anything but 2xx shows up in the report; the first
-- non-2xx body of each thread is kept (one line, truncated) to say what went wrong. The X-Cache
-- header of discovery answers is counted too (hit or miss: the result cache as the server saw it).

local threads = {}
local started = 0

function setup(thread)
   thread:set("tid", started)
   started = started + 1
   threads[#threads + 1] = thread
end

function init(args)
   statuses = {}
   cache_hits = 0
   cache_misses = 0
   errbody = nil
   local lines = {}
   for line in io.lines(os.getenv("BENCH_REQUESTS")) do
      if #line > 0 then
         lines[#lines + 1] = line
      end
   end
   pool = {}
   local json = { ["Content-Type"] = "application/json", ["Accept"] = "application/json" }
   for _, line in ipairs(lines) do
      local first = string.find(line, " ", 1, true)
      local method = string.sub(line, 1, first - 1)
      local rest = string.sub(line, first + 1)
      if method == "GET" then
         pool[#pool + 1] = wrk.format("GET", rest)
      else
         local second = string.find(rest, " ", 1, true)
         local path = string.sub(rest, 1, second - 1)
         pool[#pool + 1] = wrk.format(method, path, json, string.sub(rest, second + 1))
      end
   end
   pool_size = #pool
   -- Spread the threads over the file (wrk -t1 is the default: start at the first line).
   local nthreads = tonumber(os.getenv("BENCH_THREADS") or "1")
   next_index = math.floor(tid * pool_size / nthreads)
end

function request()
   next_index = next_index + 1
   if next_index > pool_size then
      next_index = 1
   end
   return pool[next_index]
end

function response(status, headers, body)
   statuses[status] = (statuses[status] or 0) + 1
   local cache = headers["x-cache"] or headers["X-Cache"]
   if cache == "hit" then
      cache_hits = cache_hits + 1
   elseif cache == "miss" then
      cache_misses = cache_misses + 1
   end
   if (status < 200 or status > 299) and errbody == nil then
      errbody = string.format("%d %s", status, string.sub(string.gsub(body or "", "%s+", " "), 1, 300))
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
      for status, count in pairs(thread:get("statuses")) do
         out:write(string.format("status %d - %d %d\n", tid, status, count))
      end
      out:write(string.format("cache %d %d %d\n", tid, thread:get("cache_hits"), thread:get("cache_misses")))
      local body = thread:get("errbody")
      if body then
         out:write(string.format("errbody %d %s\n", tid, body))
      end
   end
   for _, p in ipairs({ 50, 75, 90, 99, 99.9 }) do
      out:write(string.format("latency_us p%g %d\n", p, latency:percentile(p)))
   end
   out:write(string.format("latency_us mean %d\n", latency.mean))
   out:write(string.format("latency_us max %d\n", latency.max))
   out:close()
end
