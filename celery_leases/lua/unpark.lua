-- unpark.lua: cancel a parked task (celery leases unpark): it leaves its FIFO and both hashes,
-- and becomes a tombstone, so that a copy already published is dropped when it arrives.
--
-- KEYS[1] parked states (group)   KEYS[2] parked messages (group)   KEYS[3] done (group)
-- KEYS[4] the resource's parked FIFO
-- ARGV[1] task id (escaped)   ARGV[2] tombstone life in ms   ARGV[3] its tombstone
-- returns 1 = cancelled; 0 = not parked (nothing changed)

local task = ARGV[1]
if not redis.call('HGET', KEYS[1], task) then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
park_forget(KEYS[4], KEYS[1], KEYS[2], task)
redis.call('ZADD', KEYS[3], now, ARGV[3])
park_prune(KEYS[3], now, tonumber(ARGV[2]))
return 1
