-- release.lua: give back leases of one owner in one slot group, and wake their waiters.
-- Only the holder can release: the key must still name our token. A second release of the
-- same lease is a no-op. The registry entry goes either way, so a cleanup pass can use this
-- script for leases that already ran out.
--
-- KEYS[1] owner registry in the group
-- then per lease i: its exclusive or shared key
-- ARGV[1] owner id
-- then per lease i: mode ("x" or "s"), token, registry entry, release channel
-- returns per lease i: 1 = released now, 0 = was no longer held by us

local now -- the Redis clock in ms, read only for a shared lease (an exclusive one needs none)
local owner = ARGV[1]
local out = {}
for i = 0, #KEYS - 2 do
  local key = KEYS[i + 2]
  local mode, token = ARGV[4 * i + 2], ARGV[4 * i + 3]
  local entry, channel = ARGV[4 * i + 4], ARGV[4 * i + 5]
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
    if score and not now then
      local t = redis.call('TIME')
      now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    if score then
      redis.call('ZREM', key, holder)
      if tonumber(score) > now then
        freed = 1
      end
    end
  end
  redis.call('SREM', KEYS[1], entry)
  if freed == 1 then
    redis.call('PUBLISH', channel, token)
  end
  out[#out + 1] = freed
end
return out
