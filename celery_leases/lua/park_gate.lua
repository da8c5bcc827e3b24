-- park_gate.lua: a delivery of a task that may be parked, before it takes its leases. A task
-- handed on is consumed here, once: the first delivery of its task id to get here runs (the
-- published copy, or a redelivery of the original that parked it), and every later one is
-- told so. A newcomer (a delivery of a task that is not parked) is told when tasks are parked
-- on the resource and not yet handed on: it parks behind them rather than take a place that a
-- release freed before its hand-on (t0 A releases R, with T parked on it; t1 newcomer N finds
-- R free and takes it; t2 A's hand-on finds R full: N overtook T). The same on a rate limit:
-- a newcomer that finds tasks in the limit's FIFO (parked, or handed on and not started: their
-- room is promised) parks behind them (park_limit.lua admits it again if the window has room
-- beyond the hand-ons in flight and nobody is parked ahead).
--
-- KEYS[1] parked states (group)   KEYS[2] parked messages (group)   KEYS[3] done (group)
-- KEYS[4...] the task's FIFOs in the group, in the task's order: its leases' (ARGV[6] of
-- them), then its rate limits' (a task may be parked on any of them)
-- ARGV[1] task id (escaped)   ARGV[2] tombstone life in ms
-- ARGV[3] the task's tombstone "<task id>#<retries>" (see _parking.lua)
-- ARGV[4] the message's generation "g<n>" (its lease_parked header, 0 for the original): the
--         consumer of a hand-on is recorded as the tombstone "@" it, so that this message,
--         delivered again (its gate's reply was lost and it was requeued, or its worker died
--         before the ack), is told it consumed the hand-on: no other message has both its
--         retries and its generation, but a hand-on published twice (a stale one
--         republished): so only a redelivered message is told (ARGV[5] "1"), as a fresh copy
--         of a consumed hand-on is dropped
-- ARGV[6] how many of KEYS[4...] are leases' FIFOs (the rest are rate limits')
-- returns 0 = not parked (go on)   1 = the hand-on, consumed now, or by this message before
--         (go on: the lease is reserved)
--         2 = parked: this delivery is a copy of a parked task (drop it)
--         3 = consumed already (drop it, unless it is a redelivered copy)
--         4 + k = not parked, but others are in the FIFO KEYS[4 + k] (of the first such
--         FIFO in the task's order): park behind them

local task = ARGV[1]
local state = redis.call('HGET', KEYS[1], task)
if state == 'p' then
  -- written again, so that a WAIT after this call (min_replicas) covers the park itself: a
  -- redelivery of a park the replicas did not confirm is dropped only once they have it
  redis.call('HSET', KEYS[1], task, 'p')
  return 2
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if state == 'h' then
  park_forget(KEYS[4], KEYS[1], KEYS[2], task)
  for i = 5, #KEYS do
    redis.call('ZREM', KEYS[i], task)
  end
  redis.call('ZADD', KEYS[3], now, ARGV[3], now, ARGV[3] .. '@' .. ARGV[4])
  park_prune(KEYS[3], now, tonumber(ARGV[2]))
  return 1
end
if redis.call('ZSCORE', KEYS[3], ARGV[3]) then
  if ARGV[5] == '1' and redis.call('ZSCORE', KEYS[3], ARGV[3] .. '@' .. ARGV[4]) then
    return 1
  end
  return 3
end
local leases = tonumber(ARGV[6])
for i = 4, #KEYS do
  if i - 4 < leases then
    for _, other in ipairs(redis.call('ZRANGE', KEYS[i], 0, 31)) do
      if redis.call('HGET', KEYS[1], other) == 'p' then
        return i
      end
    end
  elseif redis.call('EXISTS', KEYS[i]) == 1 then
    return i
  end
end
return 0
