-- park.lua: park a task that found a resource busy (on_busy="defer"), unless the resource has
-- room now: the busy check and the park are one step, so a release between the task's failed
-- acquire and this call is never missed (it either freed the resource, seen here, or comes
-- after the park, and hands on what is parked).
--
-- KEYS[1] exclusive key   KEYS[2] shared key   KEYS[3] the resource's parked FIFO
-- KEYS[4] parked states (group)   KEYS[5] parked messages (group)   KEYS[6] done (group)
-- KEYS[7] due index (group)
-- ARGV[1] task id (escaped)   ARGV[2] mode ("x" or "s")   ARGV[3] limit (0 = none)
-- ARGV[4] the message (JSON)   ARGV[5] due member   ARGV[6] tombstone life in ms
-- ARGV[7] "1" when this delivery consumed the task's hand-on (park_gate.lua): parked again
--         (its tombstone goes, and the record of this message as its consumer, ARGV[11])
-- ARGV[8] the task's tombstone "<task id>#<retries>" (see _parking.lua)
-- ARGV[9] "1": park even if the resource has room by its holders (the acquire was refused
--         for what this script does not see: a restart grace, the waiter queue; the task's
--         earlier park found room and its acquire was refused again), to be handed on in
--         ARGV[10] ms (the wait the acquire told) by the pump
-- ARGV[11] the message's generation "g<n>" (see park_gate.lua)
-- ARGV[12] placeholder owner prefix ("%parked/"): a task that consumed its hand-on (ARGV[7])
--          and parks again on the resource it was handed, its reservation standing (its
--          acquire was refused all the same: a restart grace, the waiter queue), frees that
--          reservation (held for nobody while it waits) and parks as with ARGV[9], to be
--          handed on after ARGV[10] ms
-- returns {1, wait_ms} parked (the resource looks free in wait_ms at the latest)
--         {0}          the resource has room and nobody is parked ahead: acquire again
--         {2}          already handed on: consumed here, acquire again (the reservation)
--         {3}          already parked: this delivery is a copy of a parked task: drop it
--         {4}          already consumed by another copy: drop it

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
local task = ARGV[1]
local early = park_check(KEYS[3], KEYS[4], KEYS[5], KEYS[6], task, now, ARGV[7] == '1',
  ARGV[8], ARGV[11])
if early then
  return early
end
local mine = false -- the task's own reservation stood here, and is freed
if ARGV[7] == '1' and ARGV[12] then
  local holder = '0 ' .. ARGV[12] .. task
  if redis.call('GET', KEYS[1]) == holder then
    redis.call('DEL', KEYS[1])
    mine = true
  end
  if redis.call('ZREM', KEYS[2], holder) == 1 then
    mine = true
  end
end
local wait = park_busy(KEYS[1], KEYS[2], ARGV[2], tonumber(ARGV[3]), now)
local ahead = redis.call('ZCARD', KEYS[3])
if wait == 0 and (ahead == 0 or mine) then
  if ARGV[9] ~= '1' and not mine then
    return {0}
  end
  wait = math.max(tonumber(ARGV[10]), 1)
end
redis.call('ZADD', KEYS[3], 'NX', now_us, task)
redis.call('HSET', KEYS[4], task, 'p')
redis.call('HSET', KEYS[5], task, ARGV[4], '%m' .. task, ARGV[2] .. ' ' .. ARGV[3])
-- the due member by resource ("%r<resource>": no escaped task id starts with "%"), for a
-- release outside a task, which knows the resource only (see _parking.hand_on_released)
redis.call('HSET', KEYS[5], '%r' .. string.match(ARGV[5], '^%S+ %S+ (.*)$'), ARGV[5])
-- look again when the holder runs out (sooner if the index says so): a holder that dies
-- without a release is noticed by the pump then
local due = now + wait
local known = redis.call('ZSCORE', KEYS[7], ARGV[5])
if not known or tonumber(known) > due then
  redis.call('ZADD', KEYS[7], due, ARGV[5])
end
park_prune(KEYS[6], now, tonumber(ARGV[6]))
return {1, wait}
