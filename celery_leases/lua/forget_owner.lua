-- forget_owner.lua: drop an owner from the owners index and its node's owner set, once its
-- registries are empty. An owner whose liveness was refreshed in between (it is alive after
-- all) is kept, unless ARGV[3] is "1" (its node restarted, so that incarnation is dead).
--
-- KEYS[1] owners index   KEYS[2] node's owner set   KEYS[3] node set   (all in the home group)
-- ARGV[1] owner id   ARGV[2] escaped node name   ARGV[3] "1" to drop it even if alive
-- returns 1 = forgotten, 0 = kept because it is alive

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) > now and ARGV[3] ~= '1' then
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[2], ARGV[1])
if redis.call('SCARD', KEYS[2]) == 0 then
  redis.call('SREM', KEYS[3], ARGV[2])
end
return 1
