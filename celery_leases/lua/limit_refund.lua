-- limit_refund.lua: take back one admission of limit.lua (its task did not run: a lease or
-- another limit of the same all-or-nothing call was refused).
--
-- KEYS[1] log ZSET   KEYS[2] state HASH
-- ARGV[1] the member limit.lua returned ("<seq>:<cost>")
-- returns 1 = taken back, 0 = no longer in the log (it left the window, or the key expired)

if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then
  return 0
end
local cost = tonumber(string.match(ARGV[1], ':(%d+)$'))
local sum = redis.call('HINCRBY', KEYS[2], 'sum', -cost)
if sum < 0 then
  redis.call('HSET', KEYS[2], 'sum', 0)
end
return 1
