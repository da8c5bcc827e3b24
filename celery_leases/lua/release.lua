-- release.lua: give back leases of one owner in one slot group, and wake their waiters: the
-- live head of a lease's waiter queue on its own channel (one waiter per release; see
-- _waiters.lua), or, with nobody queued, whoever listens on the release channel.
-- Only the holder can release: the key must still name our token. A second release of the
-- same lease is a no-op. The registry entry goes either way, so a cleanup pass can use this
-- script for leases that already ran out.
--
-- KEYS[1] owner registry in the group
-- then per lease i: its exclusive or shared key, its waiter queue, its ticket expiry
-- ARGV[1] owner id   ARGV[2] waiter channel prefix   ARGV[3] "1" when PUBLISH counts receivers
-- exactly (not on a cluster)
-- then per lease i: mode ("x" or "s"), token, registry entry, release channel
-- then, last: events kept in the group's history stream (the history setting; 0: no history,
--             and none of the history keys is given), events kept in a resource's own
--             stream, milliseconds a resource's stream outlives its last event, the event of
--             a lease released now ("released", "freed" or "forced"), and who frees ("" for
--             the holder itself; cleanup, reaper, reconcile, an operator)
-- with history, KEYS end with: the group's history stream, then per lease i its resource's
--             own history stream
-- returns per lease i: 1 = released now, 0 = was no longer held by us
--
-- History: a lease released now is written as the given event; one whose registry entry was
-- still there but which was no longer held (it ran out first) as "expired". A second run of
-- the same release (its entry is gone) writes nothing.

local now -- the Redis clock in ms, read only when needed (an exclusive release with nobody
-- queued needs none)
local function clock()
  if not now then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now
end
local owner, wprefix, trust = ARGV[1], ARGV[2], ARGV[3] == '1'
local n = (#ARGV - 8) / 4
local hist, rhist, hkeep = ARGV[#ARGV - 4], ARGV[#ARGV - 3], ARGV[#ARGV - 2]
local kind, by = ARGV[#ARGV - 1], ARGV[#ARGV]
local hk = 1 + 3 * n  -- the history keys start after hk
local out = {}
for i = 0, n - 1 do
  local key, wkey, ekey = KEYS[3 * i + 2], KEYS[3 * i + 3], KEYS[3 * i + 4]
  local mode, token = ARGV[4 * i + 4], ARGV[4 * i + 5]
  local entry, channel = ARGV[4 * i + 6], ARGV[4 * i + 7]
  local holder = token .. ' ' .. owner
  local freed = 0
  if mode == 'x' then
    if redis.call('GET', key) == holder then
      redis.call('DEL', key)
      freed = 1
    end
  else
    -- a shared member outlives its score until an acquire sweeps it out: one whose score
    -- passed had run out, and is not released now (though it goes)
    local score = redis.call('ZSCORE', key, holder)
    if score then
      redis.call('ZREM', key, holder)
      if tonumber(score) > clock() then
        freed = 1
      end
    end
  end
  local listed = redis.call('SREM', KEYS[1], entry)
  if hist ~= '0' and (freed == 1 or listed == 1) then
    local e = freed == 1 and kind or 'expired'
    redis.call('XADD', KEYS[hk + 1], 'MAXLEN', '~', hist, '*', 'e', e, 'x', entry, 'o', owner,
      'by', by)
    local rkey = KEYS[hk + i + 2]
    redis.call('XADD', rkey, 'MAXLEN', '~', rhist, '*', 'e', e, 'x', entry, 'o', owner, 'by', by)
    redis.call('PEXPIRE', rkey, hkeep)
  end
  if freed == 1 then
    -- nobody queued (the common case: one call), or nobody left to wake: the release channel
    if wake_head(wkey, ekey, clock, wprefix, trust, nil, token) == 0 then
      redis.call('PUBLISH', channel, token)
    end
  end
  out[#out + 1] = freed
end
return out
