-- _waiters.lua: the waiter queue of a resource, put into acquire.lua, release.lua and
-- leave.lua (see _scripts.py). A waiter's ticket is a member "<mode><ticket>" of two ZSETs in
-- the resource's slot group: the queue (scored by the Redis clock in microseconds when it
-- first queued: first come, first served) and the tickets' expiry (Redis ms), so the ticket of
-- a waiter that died is pruned instead of holding its place forever.
--
-- A waiter that wants one exclusive lease carries its order in its ticket, "<id> <ttl ms>
-- <task> <owner>" (a plain ticket is "<id>"), so that a release can grant it the lease
-- directly (release.lua). A handoff takes the ticket out of the queue and puts it in the
-- resource's handed ZSET, scored by the token handed, for as long as the ticket's expiry
-- lasts: an attempt of that ticket still under way learns of the handoff there (acquire.lua),
-- and so does its leave (leave.lua). Only ZSET commands: the documented ACL stays as it was.

-- take member out of the queue (and out of the handed ZSET hkey, when given)
local function dequeue(wkey, ekey, member, hkey)
  redis.call('ZREM', wkey, member)
  redis.call('ZREM', ekey, member)
  if hkey then
    redis.call('ZREM', hkey, member)
  end
end

-- drop the tickets of ekey that ran out by now (handed ones too), up to 64 at a time
local function prune(wkey, ekey, now, hkey)
  local expired = redis.call('ZRANGEBYSCORE', ekey, '-inf', now, 'LIMIT', 0, 64)
  if #expired > 0 then
    redis.call('ZREM', wkey, unpack(expired))
    redis.call('ZREM', ekey, unpack(expired))
    if hkey then
      redis.call('ZREM', hkey, unpack(expired))
    end
  end
end

-- the live head of the queue and its expiry, or nil. Two calls when the head is live; a head
-- that ran out is dropped, with every other ticket that ran out (up to 64 at a time). now: the
-- Redis clock in ms, or a function that reads it (called only if there is a head).
local function queue_head(wkey, ekey, now, hkey)
  for _ = 1, 8 do
    local head = redis.call('ZRANGE', wkey, 0, 0)[1]
    if not head then
      return nil
    end
    if type(now) == 'function' then
      now = now()
    end
    -- no expiry (half written) counts as run out: it cannot hold the queue
    local expiry = tonumber(redis.call('ZSCORE', ekey, head) or '0')
    if expiry > now then
      return head, expiry
    end
    dequeue(wkey, ekey, head, hkey)
    prune(wkey, ekey, now, hkey)
  end
  return nil
end

-- the token a release handed to ticket member (as text: a ZSET score reads back as a float),
-- or false
local function handed_to(hkey, member)
  local score = redis.call('ZSCORE', hkey, member)
  return score and string.format('%.0f', tonumber(score))
end

-- the channel of the waiter of ticket member (mode, then the ticket's id)
local function channel_of(prefix, member)
  return prefix .. string.match(member, '^.(%S+)')
end

-- wake the queue's live head on its own channel; 0 when the queue is empty. only: wake the
-- head only if its mode is this one. trust: PUBLISH's count of receivers is exact (not on a
-- cluster), so a head nobody listens for is gone: it is dropped and the next one woken.
-- offer (release.lua's handoff, or nil): offer(head, expiry, wkey, ekey, hkey, ...) first,
-- with the arguments after it; true: the head was handed the lease (nothing more to do),
-- false: nobody listens for it, nil: wake it.
local function wake_head(wkey, ekey, now, prefix, trust, only, payload, hkey, offer, ...)
  for _ = 1, 8 do
    local head, expiry = queue_head(wkey, ekey, now, hkey)
    if not head then
      return 0
    end
    if only and string.sub(head, 1, 1) ~= only then
      return 1
    end
    local offered = nil
    if offer then
      offered = offer(head, expiry, wkey, ekey, hkey, ...)
    end
    if offered then
      return 1
    elseif offered == nil then
      if redis.call('PUBLISH', channel_of(prefix, head), payload) > 0 or not trust then
        return 1
      end
    end
    dequeue(wkey, ekey, head, hkey)
  end
  return 1
end

-- queue (or keep queued: NX keeps the place) member until now + life ms
local function enqueue(wkey, ekey, member, now, now_us, life)
  redis.call('ZADD', wkey, 'NX', string.format('%.0f', now_us), member)
  redis.call('ZADD', ekey, string.format('%.0f', now + life), member)
  if redis.call('PTTL', wkey) < life then
    redis.call('PEXPIRE', wkey, life)
    redis.call('PEXPIRE', ekey, life)
  end
end
