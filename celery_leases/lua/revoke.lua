-- revoke.lua: ask the holders of one resource to let go by a deadline (cooperative revocation).
-- Writes the resource's revocation mark "<deadline ms> <token> <reason>" (token: the newest
-- grant it covers; a later grant has a larger token and is not covered) and cuts the expiry
-- of every grant it covers to the deadline. Each holder's next renewal (renew.lua) finds the
-- mark, reports it, and extends the lease to the deadline at most: Redis lets it run out there,
-- so a waiter is granted it (with a new token) after the holder's release or the deadline,
-- never before. The mark expires at the deadline. A mark already there for the same grants
-- keeps the earlier of the two deadlines (and takes the new reason), so a second call never
-- gives more time: run twice, it leaves what running it once leaves.
--
-- Only the commands of the documented ACL user (docs/security.md): expiries are set with
-- PEXPIRE and PX, relative to the TIME read first.
--
-- KEYS[1] exclusive key   KEYS[2] shared key   KEYS[3] revocation mark
-- ARGV[1] deadline in milliseconds from now (> 0)   ARGV[2] reason (any text)
-- returns {0}  nothing held: no mark written
--         {1, ms left until the deadline, holder, holder, ...}  revoked; each holder as its
--             key names it, "<token> <owner>"

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function num(x) return string.format('%.0f', x) end
local function newer(x, y)  -- decimal tokens, by length and then text
  return #x > #y or (#x == #y and x > y)
end

local holders, newest = {}, nil
local value = redis.call('GET', KEYS[1])
if value then
  holders[1] = value
  newest = string.match(value, '^(%d+)')
end
local members = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. num(now), '+inf', 'WITHSCORES')
for j = 1, #members, 2 do
  holders[#holders + 1] = members[j]
  local token = string.match(members[j], '^(%d+)')
  if token and (not newest or newer(token, newest)) then
    newest = token
  end
end
if not newest then
  return {0}
end

local until_ms = now + tonumber(ARGV[1])
local old = redis.call('GET', KEYS[3])
if old then
  local old_until, old_token = string.match(old, '^(%d+) (%d+)')
  if old_token == newest and tonumber(old_until) < until_ms then
    until_ms = tonumber(old_until)  -- the same grants were revoked already: never more time
  end
end
if value then
  local left = redis.call('PTTL', KEYS[1])
  if left < 0 or left > until_ms - now then
    redis.call('PEXPIRE', KEYS[1], num(until_ms - now))
  end
end
for j = 1, #members, 2 do
  if tonumber(members[j + 1]) > until_ms then
    redis.call('ZADD', KEYS[2], 'XX', num(until_ms), members[j])
  end
end
redis.call('SET', KEYS[3], num(until_ms) .. ' ' .. newest .. ' ' .. ARGV[2], 'PX', num(until_ms - now))
local reply = {1, num(until_ms - now)}
for _, holder in ipairs(holders) do
  reply[#reply + 1] = holder
end
return reply
