-- handon_takeover.lua: take over the hand-ons a dead owner recorded (handon.lua) and did not
-- publish: each entry leaves the owner's registry, and the message of a task still handed on
-- whose reservation still stands is returned for the cleaning process to publish; its
-- reservation is extended to a full hand-on timeout, so the copy finds it. A task no longer
-- handed on (its copy consumed the hand-on, it was unparked, its reservation ran out) gives
-- "". A copy published twice (the owner did publish before it died) still runs once: the
-- first copy consumes the hand-on, the other finds it consumed (park_gate.lua).
--
-- A rate limit's hand-on (handon_limit.lua, mode "r") reserves no lease: it is the task's
-- entry in the limit's FIFO, scored by when it runs out (it counts as admitted until then);
-- it is extended the same way, so the copy keeps its turn.
--
-- KEYS[1] the owner's registry (group)   KEYS[2] parked states (group)
-- KEYS[3] parked messages (group)   then per entry i: its resource's exclusive and shared keys
-- (for a rate limit: the limit's parked FIFO, twice)
-- ARGV[1] placeholder owner prefix ("%parked/")   ARGV[2] hand-on timeout in ms
-- then per entry i: the registry entry, its task id (escaped), its mode ("x", "s" or "r")
-- returns per entry i: the message to publish, or "" (nothing to publish)

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local timeout = tonumber(ARGV[2])
local out = {}
for i = 1, (#ARGV - 2) / 3 do
  local entry, task, mode = ARGV[3 * i], ARGV[3 * i + 1], ARGV[3 * i + 2]
  local xkey, skey = KEYS[2 * i + 2], KEYS[2 * i + 3]
  local msg = ''
  if redis.call('SREM', KEYS[1], entry) == 1 and redis.call('HGET', KEYS[2], task) == 'h' then
    local holder = '0 ' .. ARGV[1] .. task
    if mode == 'r' then
      local score = redis.call('ZSCORE', xkey, task)
      if score and tonumber(score) > now_us then
        if tonumber(score) < now_us + timeout * 1000 then
          redis.call('ZADD', xkey, 'XX', string.format('%.0f', now_us + timeout * 1000), task)
        end
        msg = redis.call('HGET', KEYS[3], task) or ''
      end
    elseif mode == 'x' then
      if redis.call('GET', xkey) == holder then
        if redis.call('PTTL', xkey) < timeout then
          redis.call('PEXPIRE', xkey, timeout)
        end
        msg = redis.call('HGET', KEYS[3], task) or ''
      end
    else
      local score = redis.call('ZSCORE', skey, holder)
      if score and tonumber(score) > now then
        if tonumber(score) < now + timeout then
          redis.call('ZADD', skey, 'XX', now + timeout, holder)
        end
        if redis.call('PTTL', skey) < timeout then
          redis.call('PEXPIRE', skey, timeout)
        end
        msg = redis.call('HGET', KEYS[3], task) or ''
      end
    end
  end
  out[i] = msg
end
return out
