-- expired_owners.lua: list owners whose liveness ran out, by the Redis clock.
--
-- KEYS[1] owners index (home group)
-- ARGV[1] how many owners at most
-- returns the owner ids, oldest expiry first

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now),
  'LIMIT', 0, tonumber(ARGV[1]))
