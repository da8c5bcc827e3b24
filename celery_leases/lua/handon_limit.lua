-- handon_limit.lua: hand a rate limit's parked FIFO on while the limit has room: the head's
-- task is marked handed on (scored by when its hand-on runs out) and its message returned
-- for the caller to publish. Nothing is admitted here: the copy is admitted when it starts
-- (limit.lua), so "at most N in any window" stays exact; a hand-on in flight counts as
-- admitted for the room of the next hand-ons, so the room is not handed on twice. A copy
-- that is refused all the same (another caller took the room) parks again at the head
-- (park_limit.lua). A hand-on not claimed in time goes back to the end of the FIFO.
-- Called by the park pump, for its due index, until it hands on nothing.
--
-- The hand-on is recorded in the caller's owner registry, "p <Redis us> <task> r 0 <name>"
-- (as handon.lua records a lease's, mode "r": a rate limit), until the caller has published
-- it: a cleanup of a caller that died in between takes it over (handon_takeover.lua).
--
-- KEYS[1] limit log   KEYS[2] limit state   KEYS[3] override   KEYS[4] penalty
-- KEYS[5] the limit's parked FIFO   KEYS[6] parked states (group)
-- KEYS[7] parked messages (group)   KEYS[8] due index (group)
-- KEYS[9] the caller's owner registry (group)
-- ARGV[1] N   ARGV[2] period us   ARGV[3] cost   ARGV[4] hand-on timeout in ms
-- ARGV[5] due member   ARGV[6] ms the registry must live at least (see handon.lua)
-- returns {1, task id (escaped), message, registry entry}  handed on: publish it, then
--                                                         remove the entry
--         {0, due ms}                      nothing to hand on now; due ms: when the due
--                                          index looks again (0: never, the FIFO is empty)

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_text = string.format('%.0f', now_us)
local cost, timeout = tonumber(ARGV[3]), tonumber(ARGV[4])

-- the entries scored up to now: parked tasks, and hand-ons that ran out (parked again, last)
local function head_of()
  for _, task in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now_text, 'LIMIT', 0, 32)) do
    local state = redis.call('HGET', KEYS[6], task)
    if state == 'p' then
      return task
    elseif state == 'h' then
      redis.call('HSET', KEYS[6], task, 'p')
      redis.call('ZADD', KEYS[5], now_text, task)
    else
      redis.call('ZREM', KEYS[5], task) -- a task unparked or consumed meanwhile
    end
  end
  return nil
end

local head = head_of()
if not head then
  head = head_of() -- the hand-ons that ran out were put last: the head may be one of them
end
local flight = redis.call('ZCOUNT', KEYS[5], '(' .. now_text, '+inf')
if not head then
  if redis.call('ZCARD', KEYS[5]) == 0 then
    redis.call('ZREM', KEYS[8], ARGV[5])
    return {0, 0}
  end
  local later = limit_due(KEYS[5], -2, timeout * 1000, now, now_us)
  redis.call('ZADD', KEYS[8], now + later, ARGV[5])
  return {0, later}
end
local n, period, sum, wait, gone = limit_look(KEYS[1], KEYS[2], KEYS[3], KEYS[4],
  tonumber(ARGV[1]), tonumber(ARGV[2]), cost, flight * cost, now_us)
if gone > 0 then
  redis.call('HSET', KEYS[2], 'sum', sum)
end
if wait ~= 0 and wait ~= -1 then -- -1: never admitted; handed on, its copy says why
  local due_ms = limit_due(KEYS[5], wait, period, now, now_us)
  redis.call('ZADD', KEYS[8], now + due_ms, ARGV[5])
  return {0, due_ms}
end
redis.call('HSET', KEYS[6], head, 'h')
redis.call('ZADD', KEYS[5], string.format('%.0f', now_us + timeout * 1000), head)
redis.call('ZADD', KEYS[8], now, ARGV[5]) -- there may be room for more
local name = string.match(ARGV[5], '^%S+ %S+ (.*)$')
local entry = 'p ' .. now_text .. ' ' .. head .. ' r 0 ' .. name
park_record(KEYS[9], entry, tonumber(ARGV[6]))
return {1, head, redis.call('HGET', KEYS[7], head) or '', entry}
