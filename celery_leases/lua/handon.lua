-- handon.lua: hand the resource on to the head of its parked FIFO if it has room: reserve the
-- lease for that task (the placeholder holder "0 %parked/<task id>", for the hand-on timeout),
-- mark it handed on and return its message for the caller to publish. Called by the process
-- that released the lease and by the pump (its due index); any number of callers at once hand
-- on each free place once. A hand-on whose reservation ran out unclaimed goes back to the end
-- of the FIFO, parked again (its copy was lost or is late: a late copy finds it parked and is
-- dropped; it is published again in its turn).
--
-- The hand-on is recorded in the caller's owner registry, "p <Redis us> <task> <mode> <limit>
-- <resource>" (the head's own mode and limit; see _registry.py), until the caller has
-- published it (it removes the entry then): a cleanup of a caller that died in between takes
-- the hand-on over (handon_takeover.lua).
--
-- A debounced claim resource (unique_mode="debounce", unique_claim.lua) is not handed on
-- before the "<not before ms> ..." of the messages' field "%d<resource>", cleared here when
-- it is handed on.
--
-- KEYS[1] exclusive key   KEYS[2] shared key   KEYS[3] the resource's parked FIFO
-- KEYS[4] parked states (group)   KEYS[5] parked messages (group)   KEYS[6] due index (group)
-- KEYS[7] the caller's owner registry (group)
-- ARGV[1] mode   ARGV[2] limit (0 = none)   ARGV[3] hand-on timeout in ms   ARGV[4] due member
-- (ARGV[1] and ARGV[2] are the caller's: the head's own, recorded by park.lua, come first, so
-- a FIFO of tasks of both modes hands each on in the mode it asked for)
-- ARGV[5] placeholder owner prefix ("%parked/")
-- ARGV[6] ms the registry must live at least (it is made with this expiry, or extended to it)
-- returns {1, task id (escaped), message, registry entry}  handed on: publish it, then remove
--                                                         the entry
--         {0, due ms}                      nothing to hand on now (full, or nobody parked);
--                                          due ms: when the due index looks again (0: never)

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local mode, limit, timeout = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
-- the mode and limit a parked task asked for (park.lua), else the caller's
local function want_of(task)
  local rec = redis.call('HGET', KEYS[5], '%m' .. task)
  if rec then
    local m, l = string.match(rec, '^(%S+) (%S+)$')
    return m, tonumber(l)
  end
  return ARGV[1], tonumber(ARGV[2])
end

-- the tasks handed on whose reservation is gone without being claimed: parked again, last
local function reserved(task)
  local holder = '0 ' .. ARGV[5] .. task
  if want_of(task) == 'x' then
    return redis.call('GET', KEYS[1]) == holder
  end
  local score = redis.call('ZSCORE', KEYS[2], holder)
  return score and tonumber(score) > now
end

local head, msg = nil, nil
local bump = 0
for _, task in ipairs(redis.call('ZRANGE', KEYS[3], 0, 31)) do
  local state = redis.call('HGET', KEYS[4], task)
  if state == 'h' then
    if not reserved(task) then
      bump = bump + 1
      redis.call('ZADD', KEYS[3], string.format('%.0f', now_us + bump), task)
      redis.call('HSET', KEYS[4], task, 'p')
    end
  elseif state == 'p' then
    if not head then
      head = task
    end
  else
    redis.call('ZREM', KEYS[3], task)  -- a task unparked or consumed meanwhile
  end
end
if bump > 0 then
  -- the head may have moved: read it again
  head = nil
  for _, task in ipairs(redis.call('ZRANGE', KEYS[3], 0, 31)) do
    if redis.call('HGET', KEYS[4], task) == 'p' then
      head = task
      break
    end
  end
end
if not head then
  if redis.call('ZCARD', KEYS[3]) == 0 then
    redis.call('ZREM', KEYS[6], ARGV[4])
    redis.call('HDEL', KEYS[5], '%r' .. string.match(ARGV[4], '^%S+ %S+ (.*)$'))
    return {0, 0}
  end
  -- only hand-ons under way: look again when their reservations run out
  redis.call('ZADD', KEYS[6], now + timeout, ARGV[4])
  return {0, timeout}
end
mode, limit = want_of(head)
local wait = park_busy(KEYS[1], KEYS[2], mode, limit, now)
local resource = string.match(ARGV[4], '^%S+ %S+ (.*)$')
local quiet = redis.call('HGET', KEYS[5], '%d' .. resource)
quiet = quiet and tonumber(string.match(quiet, '^(%d+)')) or 0
if quiet > now then
  wait = math.max(wait, quiet - now)
end
if wait > 0 then
  redis.call('ZADD', KEYS[6], now + wait, ARGV[4])
  return {0, wait}
end
redis.call('HDEL', KEYS[5], '%d' .. resource)
msg = redis.call('HGET', KEYS[5], head)
local holder = '0 ' .. ARGV[5] .. head
if mode == 'x' then
  redis.call('SET', KEYS[1], holder, 'PX', timeout)
else
  redis.call('ZADD', KEYS[2], now + timeout, holder)
  if redis.call('PTTL', KEYS[2]) < timeout then
    redis.call('PEXPIRE', KEYS[2], timeout)
  end
end
redis.call('HSET', KEYS[4], head, 'h')
-- the record a cleanup of the caller reads; with the registry's keeper "~" (_registry.lua)
-- in the head's own mode and limit (want_of), which a takeover checks its reservation by
local entry = 'p ' .. string.format('%.0f', now_us) .. ' ' .. head .. ' ' .. mode .. ' '
  .. string.format('%d', limit) .. ' ' .. resource
park_record(KEYS[7], entry, tonumber(ARGV[6]))
-- look again when the reservation runs out (or at once, when there may be room for more)
local again = timeout
if mode == 's' and limit ~= 1 then
  again = 0
end
redis.call('ZADD', KEYS[6], now + again, ARGV[4])
return {1, head, msg or '', entry}
