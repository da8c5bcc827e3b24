-- fenced_write.lua: apply a write only if its fencing token is at least the last accepted one.
-- The fence record keeps the highest token accepted for one data key. A write with a smaller
-- token is refused and changes nothing; an equal token is accepted, so one holder can write
-- several times; a missing record accepts any token (the first write). Both keys share one
-- hash tag, so the script runs on a Redis Cluster.
-- Tokens are compared as decimal strings, by length and then text: exact for any size, where
-- Lua's numbers (doubles) would round tokens above 2^53.
-- Each accepted write gives the data and the record the same absolute expiry (PEXPIREAT from
-- one TIME), or none, so the record never runs out before the data it guards: a record gone
-- while its data stayed would accept the next stale write as a first one.
--
-- KEYS[1] data key   KEYS[2] fence record (STRING: the last accepted token)
-- ARGV[1] token (decimal digits, no leading zeros)   ARGV[2] ttl in milliseconds (0 = none)
-- ARGV[3] "set" (ARGV[4] the value) or "hset" (ARGV[4], ARGV[5], ... field, value pairs)
-- returns {1, token}  applied
--         {0, last}   refused: a newer token was accepted for this key (last, as a string)

local token = ARGV[1]
local last = redis.call('GET', KEYS[2])
if last and (#last > #token or (#last == #token and last > token)) then
  return {0, last}
end
if ARGV[3] == 'set' then
  redis.call('SET', KEYS[1], ARGV[4])
else
  -- in slices: unpack() of thousands of arguments overflows Lua's C stack
  for i = 4, #ARGV, 200 do
    redis.call('HSET', KEYS[1], unpack(ARGV, i, math.min(i + 199, #ARGV)))
  end
end
redis.call('SET', KEYS[2], token)
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  local t = redis.call('TIME')
  local at = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
  redis.call('PEXPIREAT', KEYS[1], at)
  redis.call('PEXPIREAT', KEYS[2], at)
else
  -- SET above cleared the data's expiry; HSET keeps it, so clear it here (each accepted write
  -- sets the expiry, as SET does), and the record's SET cleared the record's
  redis.call('PERSIST', KEYS[1])
end
return {1, token}
