-- unique_handover.lua: the worker that starts a task takes over the task's unique claim.
-- Only a claim queued for THIS task id is taken over (or a free key, when the claim's queue
-- TTL ran out or the task was published without one); a claim queued for another task id, or
-- held by a running task (this task id included: a redelivered message whose first run still
-- holds it), is left alone. The taken claim is an ordinary exclusive lease of this owner from
-- then on: recorded in its registry, renewed by its heartbeat, released by release.lua (by the
-- task's finalizer, or by the cleanup of a dead owner).
--
-- KEYS[1] lifetime record of the group   KEYS[2] owner registry in the group   KEYS[3] claim key
-- KEYS[4] token counter of the claim resource   KEYS[5] queued-claims index of the group
-- ARGV[1] owner id   ARGV[2] lease ttl in milliseconds
-- ARGV[3] grace in milliseconds after Redis is found without the lifetime record (the
--         restart_grace setting; -1: the record is not even read): see _lifetime.lua
-- ARGV[4] token counter memory in milliseconds ("0": none is written, one left is still read,
--         and the token stays above the queued claim's)
-- ARGV[5] registry expiry in milliseconds: "<ms>" set, "-<ms>" set if this call made the
--         registry, "0" none (see _registry.lua)
-- ARGV[6] task id, escaped   ARGV[7] claim resource name
-- ARGV[8] the call's id ("" none), written into the registry entry as acquire.lua does
-- KEYS[6] replaced task ids of the claim resource (unique_mode="replace", unique_claim.lua)
-- KEYS[7] parked FIFO of the claim resource   KEYS[8] parked states (group)
-- KEYS[9] parked messages (group)   KEYS[10] consumed hand-ons (group)
-- ARGV[9] "" or (unique_mode="keep_last") the message's tombstone "<task id>#<retries>": a
--         follow-up handed on to this task ("0 %parked/<task>", handon.lua) is taken over and
--         consumed here, at once; a later copy of a consumed one never runs
-- ARGV[10] how long a consumed hand-on's tombstone is kept, in milliseconds
-- ARGV[11] "1" if the broker redelivered this message: a copy of a consumed follow-up is
--          then a run that started and died (acks_late), not a second copy, and it runs
-- returns {1, token}          taken: it was queued for this task, or free
--         {0, holder, pttl}   held by another: "<token> <owner>" ("%queued/<task>" while
--                             queued), pttl ms until it runs out unless renewed (-1: never)
--         {-1, wait_ms}       restart grace: Redis restarted or failed over (see above)
--         {-2}                this task's claim was replaced by a later send, or (keep_last)
--                             this is a copy of a follow-up that ran already: it never runs

local now, now_us, now_text = clock_of(redis.call('TIME'))
local owner, grace = ARGV[1], tonumber(ARGV[3])
local function num(x) return string.format('%.0f', x) end

if grace >= 0 then
  local wait = lifetime_wait(KEYS[1], now, 0, grace, false, nil)
  if wait > 0 then
    return {-1, wait}
  end
end

local gone = redis.call('ZSCORE', KEYS[6], ARGV[6])
if gone and tonumber(gone) > now then
  return {-2}
end

local current = redis.call('GET', KEYS[3])
local handed = ARGV[9] and ARGV[9] ~= '' and current == '0 %parked/' .. ARGV[6]
if ARGV[9] and ARGV[9] ~= '' and not handed and ARGV[11] ~= '1'
    and redis.call('ZSCORE', KEYS[10], ARGV[9]) then
  return {-2}
end
if current and not handed then
  local space = string.find(current, ' ', 1, true)
  if not space or string.sub(current, space + 1) ~= '%queued/' .. ARGV[6] then
    return {0, current, redis.call('PTTL', KEYS[3])}
  end
end
if handed then
  park_forget(KEYS[7], KEYS[8], KEYS[9], ARGV[6])
  redis.call('ZADD', KEYS[10], now, ARGV[9])
  park_prune(KEYS[10], now, tonumber(ARGV[10]))
elseif redis.call('ZSCORE', KEYS[7], ARGV[6]) then
  -- (keep_last) the arguments a later send gave this copy while it was queued, parked in
  -- case it was never published (unique_claim.lua): it runs, with them; forgotten
  park_forget(KEYS[7], KEYS[8], KEYS[9], ARGV[6])
end

local token = next_token(KEYS[4], now_us, now_text, ARGV[4])
if ARGV[4] == '0' then
  -- the queued claim's token, "<token> %queued/<task>": no counter holds it
  local queued = current and tonumber(string.match(current, '^%d+') or '0') or 0
  token = math.max(token, queued + 1)
end
local text = num(token)
redis.call('SET', KEYS[3], text .. ' ' .. owner, 'PX', ARGV[2])
-- the registry entry, as acquire.lua writes it: "x <token> <task>%c<call> <resource>"
local task = ARGV[6]
if ARGV[8] and ARGV[8] ~= '' then
  task = task .. '%c' .. ARGV[8]
end
record_grants(KEYS[2], {'x ' .. text .. ' ' .. task .. ' ' .. ARGV[7]}, ARGV[5])
redis.call('ZREM', KEYS[5], ARGV[7])
return {1, token}
