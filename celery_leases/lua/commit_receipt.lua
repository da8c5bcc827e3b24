-- commit_receipt.lua: store an init-once receipt, but only while the caller still holds the
-- exclusive lease that guards the initialisation (a holder that lost its lease must not
-- overwrite what its successor is doing).
--
-- KEYS[1] exclusive lease key of the once-lease   KEYS[2] receipt key
-- ARGV[1] holder "<token> <owner>"   ARGV[2] receipt (JSON)   ARGV[3] receipt ttl in ms (0 = none)
-- returns 1 = stored, 0 = the lease is no longer ours (nothing stored)

if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ttl)
else
  redis.call('SET', KEYS[2], ARGV[2])
end
return 1
