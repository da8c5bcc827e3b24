-- limit.lua: admit `cost` under a sliding-window rate limit, or say exactly when it could be.
-- "N per period" holds in ANY window of the period's length: the log keeps each admission
-- still inside the window (scored by the Redis time it was admitted, in microseconds) and
-- the state keeps their cost sum. An admission at `now` is allowed when the cost of the
-- admissions after `now - period` plus `cost` is at most N. A refusal returns the exact wait
-- until enough cost has left the window (or the penalty ends), so a retry then is admitted
-- unless another caller took the room first.
-- Entries that left the window are pruned at each call (each one once: amortised O(1) per
-- admission); the log holds at most N entries; log and state expire one period after the
-- last admission, so an idle limit leaves no key behind.
--
-- KEYS[1] log ZSET (members "<seq>:<cost>")   KEYS[2] state HASH (sum, seq, n, p)
-- KEYS[3] override HASH (n, p)   KEYS[4] penalty STRING (Redis us until which nobody is
-- admitted)   KEYS[5] the slot group's index ZSET of limits (scored by when they go idle, us)
-- ARGV[1] N   ARGV[2] period in microseconds   ARGV[3] cost   ARGV[4] the limit's name
-- ARGV[5] "1" admit when there is room, "0" only look (prunes the log, admits nothing)
-- returns {1, member, N, period_us, now_us} admitted (member: what limit_refund.lua takes back)
--         {0, wait_us, N, period_us, now_us} refused (or looked, with wait 0 if it would be
--                                            admitted now)
--         {-1, N, period_us} cost is more than N (an override made it so): never admitted

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[3])
local n, period, sum, wait, gone = limit_look(KEYS[1], KEYS[2], KEYS[3], KEYS[4],
  tonumber(ARGV[1]), tonumber(ARGV[2]), cost, 0, now)
if wait == -1 then
  return {-1, n, period}
end
if wait > 0 or ARGV[5] ~= '1' then
  if gone > 0 then
    redis.call('HSET', KEYS[2], 'sum', sum)
  end
  return {0, wait, n, period, now}
end

local seq = redis.call('HINCRBY', KEYS[2], 'seq', 1)
local member = seq .. ':' .. cost
redis.call('ZADD', KEYS[1], now, member)
redis.call('HSET', KEYS[2], 'sum', sum + cost, 'n', ARGV[1], 'p', ARGV[2])
local ttl_ms = math.floor(period / 1000) + 1
redis.call('PEXPIRE', KEYS[1], ttl_ms)
redis.call('PEXPIRE', KEYS[2], ttl_ms)
-- the index lists limits that may hold state: pruned here, so it stays bounded by them
redis.call('ZADD', KEYS[5], now + period, ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', '(' .. string.format('%d', now))
if redis.call('PTTL', KEYS[5]) < ttl_ms then
  redis.call('PEXPIRE', KEYS[5], ttl_ms) -- gone once every limit of the group is idle
end
return {1, member, n, period, now}
