-- unreserve.lua: free a hand-on's reservation that its task no longer waits for: the task
-- consumed the hand-on, found another of its leases (or a rate limit) busy and parked again
-- there (park.lua, park_limit.lua). Without this the reservation would hold the resource for
-- nobody until it runs out (handon_timeout). Only the task's own placeholder is removed; the
-- resource's due index entry, if any, is made due now, so the pump hands it on to the next
-- parked task when the caller does not (it hands on at once, see _parking.defer).
--
-- KEYS[1] exclusive key   KEYS[2] shared key   KEYS[3] due index (group)
-- ARGV[1] the placeholder holder "0 %parked/<task id>"   ARGV[2] due member
-- returns 1 = the reservation was freed   0 = none stood (ran out, or never made)

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local freed = 0
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  freed = 1
end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  freed = 1
end
if freed == 1 then
  redis.call('ZADD', KEYS[3], 'XX', now, ARGV[2])
end
return freed
