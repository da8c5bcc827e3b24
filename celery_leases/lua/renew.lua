-- renew.lua: extend every lease one owner holds in one slot group, in one call, and refresh
-- the owner's liveness; report the leases that are no longer held.
-- A lease is still held only if its key still names our token: an exclusive key whose value
-- is "<token> <owner>", or a shared member "<token> <owner>" whose score is still in the future.
--
-- KEYS[1] owner registry in the group
-- when ARGV[3] == "1" (home group): KEYS[2] owners index  KEYS[3] node's owner set
--                                   KEYS[4] node set
-- then per lease i: its exclusive or shared key, then its revocation mark (see revoke.lua)
-- ARGV[1] owner id   ARGV[2] registry ttl in milliseconds   ARGV[3] "1" when home keys are given
-- ARGV[4] owner liveness in milliseconds   ARGV[5] escaped node name
-- then per lease i: mode ("x" or "s"), token, ttl in milliseconds, registry entry
--             (a lease handed to its holder: "h <ticket> <task> <resource>", which a renewal
--             that finds the lease held writes with its token, "x <token> <task> <resource>",
--             so that no cleanup has to find the token from the handed tickets)
-- returns the 1-based indices of the leases that are no longer held (empty: all renewed),
--         and for each lease still held that a revocation mark covers (its token is at most
--         the mark's), {index, ms left until the mark's deadline, reason}: such a lease is
--         extended to the deadline at most, so Redis lets it run out there

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local owner = ARGV[1]
local home = ARGV[3] == '1'
local function num(x) return string.format('%.0f', x) end

local h = home and 4 or 1
local a = 5
-- tokens compared as decimal text, by length and then text (exact for any size)
local function at_most(x, y)
  return #x < #y or (#x == #y and x <= y)
end

local lost = {}
for i = 0, (#KEYS - h) / 2 - 1 do
  local key = KEYS[h + 2 * i + 1]
  local mode, token = ARGV[a + 4 * i + 1], ARGV[a + 4 * i + 2]
  local ttl = tonumber(ARGV[a + 4 * i + 3])
  local holder = token .. ' ' .. owner
  local held = false
  -- a revocation mark "<deadline ms> <token> <reason>" covering this grant caps its expiry
  local until_ms, reason
  local mark = redis.call('GET', KEYS[h + 2 * i + 2])
  if mark then
    local d, mtoken, why = string.match(mark, '^(%d+) (%d+) ?(.*)$')
    if d and at_most(token, mtoken) then
      until_ms, reason = tonumber(d), why
    end
  end
  local expiry = now + ttl  -- a revoked grant's ends at the deadline at the latest
  if until_ms and until_ms < expiry then
    expiry = until_ms
  end
  if mode == 'x' then
    if redis.call('GET', key) == holder then
      redis.call('PEXPIRE', key, until_ms and num(expiry - now) or ttl)
      held = true
    end
  else
    local score = redis.call('ZSCORE', key, holder)
    if score and tonumber(score) > now then
      redis.call('ZADD', key, 'XX', num(expiry), holder)
      if redis.call('PTTL', key) < expiry - now then
        redis.call('PEXPIRE', key, num(expiry - now))
      end
      held = true
    elseif score then
      redis.call('ZREM', key, holder)
    end
  end
  local entry = ARGV[a + 4 * i + 4]
  local rest = string.byte(entry) == 104 and string.match(entry, '^h %S+( .*)$')
  if not held then
    redis.call('SREM', KEYS[1], entry)
    if rest then
      redis.call('SREM', KEYS[1], 'x ' .. token .. rest)
    end
    lost[#lost + 1] = i + 1
  elseif rest then
    redis.call('SREM', KEYS[1], entry)
    redis.call('SADD', KEYS[1], 'x ' .. token .. rest)
  end
  if held and until_ms then
    lost[#lost + 1] = {i + 1, num(until_ms - now), reason}
  end
end

redis.call('PEXPIRE', KEYS[1], ARGV[2])
if home then
  -- an owner that a reconcile forgot while it could not renew (its leases are reported lost
  -- above) is registered again: ZADD answers 1 only for an owner new to the index, and
  -- forget_owner.lua drops an owner from the index and its node's set together
  if redis.call('ZADD', KEYS[2], 'GT', num(now + tonumber(ARGV[4])), owner) == 1 then
    redis.call('SADD', KEYS[3], owner)
    redis.call('SADD', KEYS[4], ARGV[5])
  end
end
return lost
