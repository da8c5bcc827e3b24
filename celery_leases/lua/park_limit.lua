-- park_limit.lua: park a task that a rate limit refused (on_busy="defer"), unless the limit
-- admits now and nobody is parked ahead: the check and the park are one step, as in
-- park.lua. The limit's FIFO holds its parked tasks (state "p", scored by the Redis us they
-- parked at) and its hand-ons in flight (state "h", scored by when their hand-on runs out,
-- in the future): a hand-on's cost counts as admitted until its copy starts or it runs out.
--
-- KEYS[1] limit log   KEYS[2] limit state   KEYS[3] override   KEYS[4] penalty
-- KEYS[5] the limit's parked FIFO   KEYS[6] parked states (group)
-- KEYS[7] parked messages (group)   KEYS[8] done (group)   KEYS[9] due index (group)
-- ARGV[1] task id (escaped)   ARGV[2] N   ARGV[3] period us   ARGV[4] cost
-- ARGV[5] the message (JSON)   ARGV[6] due member   ARGV[7] tombstone life in ms
-- ARGV[8] "1" when this delivery consumed the task's hand-on (park_gate.lua): parked again,
-- at the head of the FIFO (it was handed on in its turn)
-- ARGV[9] the task's tombstone "<task id>#<retries>"
-- ARGV[10] the message's generation "g<n>" (see park_gate.lua and park.lua's ARGV[11])
-- returns the replies of park.lua ({1, wait_ms} parked, {0} admit again, {2}, {3}, {4})

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local task = ARGV[1]
local early = park_check(KEYS[5], KEYS[6], KEYS[7], KEYS[8], task, now, ARGV[8] == '1',
  ARGV[9], ARGV[10])
if early then
  return early
end
local cost = tonumber(ARGV[4])
local flight = redis.call('ZCOUNT', KEYS[5], '(' .. string.format('%.0f', now_us), '+inf')
local n, period, sum, wait, gone = limit_look(KEYS[1], KEYS[2], KEYS[3], KEYS[4],
  tonumber(ARGV[2]), tonumber(ARGV[3]), cost, flight * cost, now_us)
if gone > 0 then
  redis.call('HSET', KEYS[2], 'sum', sum)
end
local ahead = redis.call('ZCARD', KEYS[5]) - flight
if (wait == 0 or wait == -1) and ahead == 0 then
  return {0} -- room now (or never: the admission says why)
end
local score = now_us
if ARGV[8] == '1' then
  local first = redis.call('ZRANGE', KEYS[5], 0, 0, 'WITHSCORES')
  if #first > 0 and tonumber(first[2]) <= now_us then
    score = tonumber(first[2]) - 1
  end
end
redis.call('ZADD', KEYS[5], 'NX', string.format('%.0f', score), task)
redis.call('HSET', KEYS[6], task, 'p')
redis.call('HSET', KEYS[7], task, ARGV[5])
-- the pump looks when the limit admits again: the exact wait (now: room, others ahead);
-- with the room held by hand-ons in flight, when they may have run out or left it
local due_ms = limit_due(KEYS[5], wait, period, now, now_us)
local known = redis.call('ZSCORE', KEYS[9], ARGV[6])
if not known or tonumber(known) > now + due_ms then
  redis.call('ZADD', KEYS[9], now + due_ms, ARGV[6])
end
park_prune(KEYS[8], now, tonumber(ARGV[7]))
return {1, due_ms}
