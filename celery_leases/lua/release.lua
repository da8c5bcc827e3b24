-- release.lua: give back leases of one owner in one slot group, and pass each on: an exclusive
-- lease to the live head of its waiter queue directly when that waiter left an order (a
-- handoff, see below), else a wake-up for the live head of the queue on its own channel (one
-- waiter per release; see _waiters.lua), or, with nobody queued, for whoever listens on the
-- release channel.
-- Only the holder can release: the key must still name our token. A second release of the
-- same lease is a no-op. The registry entry goes either way, so a cleanup pass can use this
-- script for leases that already ran out.
--
-- KEYS[1] owner registry in the group   KEYS[2] lifetime record of the group
-- then per lease i: its exclusive or shared key, its waiter queue, its ticket expiry, its
--             handed tickets, its token counter
-- ARGV[1] owner id   ARGV[2] waiter channel prefix   ARGV[3] "1" when PUBLISH counts receivers
-- exactly (not on a cluster)   ARGV[4] restart grace in ms, as acquire.lua's ARGV[3]
-- ARGV[5] token counter memory in ms, as acquire.lua's ARGV[7]
-- ARGV[6] ticket slack in ms, as acquire.lua's ARGV[13]
-- ARGV[7] spare from: Redis time in us ("0": none). A cleanup pass gives the time it looked at
--         the owner (or earlier): a lease whose token is that or more was granted after it
--         (a token is at least the Redis clock in us at its grant), to an owner alive again,
--         and is spared, its entry kept, whatever the entries say
-- then per lease i: mode ("x" or "s"), token ("0" with a handed lease's entry
--             "h <ticket> ...", as read from a registry: the lease that a release handed to
--             that very ticket, if the handed tickets still record it, and nothing else),
--             registry entry, release channel, and for a lease handed to its holder, the
--             ticket it was handed to ("" else: see _waiters.lua)
-- then, with history: events kept in a resource's own stream, milliseconds a resource's
--             stream outlives its last event, the event of a lease released now
--             ("released", "freed" or "forced"), and who frees ("" for the holder itself;
--             cleanup, reaper, reconcile, an operator)
-- then, last: events kept in the group's history stream (the history setting); "0": no
--             history, and neither the four arguments before it nor the history keys are given
-- with history, KEYS end with: the group's history stream, then per lease i its resource's
--             own history stream and record
-- returns per lease i: 1 = released now, 0 = was no longer held by us, 2 = spared (ARGV[7])
--
-- History: a lease released now is written as the given event; one whose registry entry was
-- still there but which was no longer held (it ran out first) as "expired". A second run of
-- the same release (its entry is gone) writes nothing. A handoff is written as a grant.
--
-- The handoff. An exclusive lease released now goes to the live head of its queue when that
-- head is an exclusive waiter with an order (_waiters.lua) that is still valid (its expiry,
-- less the slack, is to come), Redis is out of its restart grace (as acquire.lua checks) and
-- PUBLISH counts receivers exactly: a new token (as acquire.lua makes it), the lease key set
-- for the waiter's owner with the order's ttl, the ticket moved from the queue to the handed
-- ZSET, and "h<token>" published on the waiter's channel. A waiter that nobody listens for
-- any more gets nothing: it is dropped and the next head tried. The waiter recorded the
-- lease's registry entry ("h <ticket> ...") and refreshed its liveness when it queued with the
-- order, so the lease is found by every cleanup; such an entry frees only the lease the
-- handed ZSET records for its ticket (see ARGV[7] and the token "0" above).

local now, now_us, now_text -- the Redis clock, read only when needed (an exclusive release
-- with nobody queued needs none)
local function clock()
  if not now then
    now, now_us, now_text = clock_of(redis.call('TIME'))
  end
  return now
end
local owner, wprefix, trust = ARGV[1], ARGV[2], ARGV[3] == '1'
local a = 7
-- the history arguments come last, the cap of the group's stream at the very end (see above)
local hist = ARGV[#ARGV]
local n = (#ARGV - a - (hist == '0' and 1 or 5)) / 5
local spare = ARGV[7] ~= '0' and tonumber(ARGV[7])
-- read only with history
local rhist, hkeep, kind, by = ARGV[#ARGV - 4], ARGV[#ARGV - 3], ARGV[#ARGV - 2], ARGV[#ARGV - 1]
local hk = 2 + 5 * n  -- the history keys start after hk
local event  -- with history only (see acquire.lua's event)
if hist ~= '0' then
  event = function(i, e, entry, who, ...)
    redis.call('XADD', KEYS[hk + 1], 'MAXLEN', '~', hist, '*', 'e', e, 'x', entry, 'o', who, ...)
    local rkey = KEYS[hk + 2 * i + 2]
    redis.call('XADD', rkey, 'MAXLEN', '~', rhist, '*', 'e', e, 'x', entry, 'o', who, ...)
    redis.call('PEXPIRE', rkey, hkeep)
  end
end

-- the handoff, for wake_head: hand lease i, the exclusive lease of key (just released), to
-- the live head of its queue if that head carries a valid order; true if handed, false if
-- nobody listens for the head, nil if the head is to be woken instead
local function offer(head, expiry, wkey, ekey, hkey, i, key, ckey, entry)
  local id, ttl, task, to = string.match(head, '^x(%S+) (%d+) (%S+) (.+)$')
  if not id or expiry - tonumber(ARGV[6]) <= now then
    return nil  -- no order, or a stale one: the waiter is woken and asks itself
  end
  if ARGV[4] ~= '-1' and lifetime_wait(KEYS[2], now, 0, ARGV[4], false, nil) > 0 then
    return nil
  end
  local token, text = next_token(ckey, now_us, now_text, ARGV[5])
  text = text or string.format('%.0f', token)
  if redis.call('PUBLISH', wprefix .. id, 'h' .. text) == 0 then
    return false
  end
  redis.call('SET', key, text .. ' ' .. to, 'PX', ttl)
  redis.call('ZREM', wkey, head)  -- its expiry stays, and says how long it is kept here
  redis.call('ZADD', hkey, text, head)
  if redis.call('PTTL', hkey) < expiry - now then
    redis.call('PEXPIRE', hkey, expiry - now)
  end
  prune(wkey, ekey, now, hkey)  -- handed tickets whose holders never came back for them
  if hist ~= '0' then
    local resource = string.match(entry, '^%S+ %S+ %S+ (.*)$')
    event(i, 'granted', 'x ' .. text .. ' ' .. task .. ' ' .. resource, to, 'ttl', ttl)
    local rec = KEYS[hk + 2 * i + 3]
    redis.call('HINCRBY', rec, 'transitions', 1)
    redis.call('HSET', rec, 'ttl', ttl)
    redis.call('PEXPIRE', rec, hkeep)
  end
  return true
end

local out = {}
for i = 0, n - 1 do
  local key, wkey, ekey = KEYS[5 * i + 3], KEYS[5 * i + 4], KEYS[5 * i + 5]
  local hkey, ckey = KEYS[5 * i + 6], KEYS[5 * i + 7]
  local mode, token = ARGV[a + 5 * i + 1], ARGV[a + 5 * i + 2]
  local entry, channel, handed = ARGV[a + 5 * i + 3], ARGV[a + 5 * i + 4], ARGV[a + 5 * i + 5]
  local freed = 0
  if token == '0' and string.byte(entry) == 104 then
    -- a handed lease's entry, read from a registry: only the lease a release handed to that
    -- ticket, as the handed tickets record it (never "whatever lease the owner holds": the
    -- entry may have outlived the wait, and the owner hold a lease granted to it since)
    local prefix = 'x' .. string.match(entry, '^h (%S+)') .. ' '
    local handed_ = redis.call('ZRANGE', hkey, 0, -1, 'WITHSCORES')
    for j = 1, #handed_, 2 do
      if string.sub(handed_[j], 1, #prefix) == prefix then
        token = string.format('%.0f', tonumber(handed_[j + 1]))
      end
    end
  end
  if spare and tonumber(token) >= spare then
    freed = 2  -- granted after the pass looked at the owner: neither freed nor unlisted
  elseif mode == 'x' then
    if redis.call('GET', key) == token .. ' ' .. owner then
      redis.call('DEL', key)
      freed = 1
    end
  else
    -- a shared member outlives its score until an acquire sweeps it out: one whose score
    -- passed had run out, and is not released now (though it goes)
    local holder = token .. ' ' .. owner
    local score = redis.call('ZSCORE', key, holder)
    if score then
      redis.call('ZREM', key, holder)
      if tonumber(score) > clock() then
        freed = 1
      end
    end
  end
  local listed = 0
  if freed ~= 2 then
    listed = redis.call('SREM', KEYS[1], entry)
  end
  if handed ~= '' then
    -- a lease handed to its holder: its ticket goes from the handed ZSET (see _waiters.lua),
    -- and its entry in either form (renew.lua writes it with its token at the first renewal)
    redis.call('ZREM', ekey, handed)
    redis.call('ZREM', hkey, handed)
    local rest = listed == 0 and string.match(entry, '^h %S+( .*)$')
    if rest then  -- not found as given: written with its token by a renewal
      listed = redis.call('SREM', KEYS[1], 'x ' .. token .. rest)
    end
  end
  if hist ~= '0' and (freed == 1 or listed > 0) then
    local shown = entry
    if string.byte(entry) == 104 then  -- a handed lease's entry "h <ticket> <task> <resource>"
      shown = 'x ' .. token .. ' ' .. string.match(entry, '^h %S+ (.*)$')
    end
    event(i, freed == 1 and kind or 'expired', shown, owner, 'by', by)
  end
  if freed == 1 then
    -- an exclusive lease goes to the head of the queue directly where it may (off a cluster);
    -- nobody queued (the common case: one call), or nobody left to wake: the release channel
    local hand = mode == 'x' and trust and offer or nil
    if wake_head(wkey, ekey, clock, wprefix, trust, nil, token, hkey, hand, i, key, ckey,
        entry) == 0 then
      redis.call('PUBLISH', channel, token)
    end
  end
  out[#out + 1] = freed
end
return out
