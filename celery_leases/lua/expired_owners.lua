-- expired_owners.lua: list owners whose liveness ran out, by the Redis clock.
--
-- KEYS[1] owners index (home group)
-- ARGV[1] how many owners at most
-- returns {owner_1, expiry_ms_1, owner_2, expiry_ms_2, ...}, oldest expiry first (the Redis time
--         each owner's liveness ran out)

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now),
  'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[1]))
