-- leave.lua: a waiter leaves the waiter queues of resources of one slot group (it timed out,
-- was cancelled, failed, or is now blocked elsewhere); if it was the live head of one, the next
-- waiter there is woken. Idempotent.
--
-- per resource i: KEYS[2i-1] its waiter queue, KEYS[2i] its tickets' expiry (KEYS[1], KEYS[2]
-- for the first)
-- ARGV[1] ticket   ARGV[2] waiter channel prefix   ARGV[3] "1" when PUBLISH counts receivers
-- exactly (not on a cluster)
-- then per resource i: mode ("x" or "s")
-- returns the number of queues it was removed from

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ticket, prefix, trust = ARGV[1], ARGV[2], ARGV[3] == '1'
local removed = 0
for i = 0, #KEYS / 2 - 1 do
  local wkey, ekey = KEYS[2 * i + 1], KEYS[2 * i + 2]
  local member = ARGV[i + 4] .. ticket
  local head = queue_head(wkey, ekey, now)
  if redis.call('ZREM', wkey, member) > 0 then
    removed = removed + 1
  end
  redis.call('ZREM', ekey, member)
  if head == member then
    wake_head(wkey, ekey, now, prefix, trust, nil, '0')
  end
end
return removed
