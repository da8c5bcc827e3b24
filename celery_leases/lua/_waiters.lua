-- _waiters.lua: the waiter queue of a resource, put into acquire.lua, release.lua and
-- leave.lua (see _scripts.py). A waiter's ticket is a member "<mode><ticket>" of two ZSETs in
-- the resource's slot group: the queue (scored by the Redis clock in microseconds when it
-- first queued: first come, first served) and the tickets' expiry (Redis ms), so the ticket of
-- a waiter that died is pruned instead of holding its place forever.

-- the live head of the queue and its expiry, or nil. Two calls when the head is live; a head
-- that ran out is dropped, with every other ticket that ran out (up to 64 at a time). now: the
-- Redis clock in ms, or a function that reads it (called only if there is a head).
local function queue_head(wkey, ekey, now)
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
    redis.call('ZREM', wkey, head)
    redis.call('ZREM', ekey, head)
    local expired = redis.call('ZRANGEBYSCORE', ekey, '-inf', now, 'LIMIT', 0, 64)
    if #expired > 0 then
      redis.call('ZREM', wkey, unpack(expired))
      redis.call('ZREM', ekey, unpack(expired))
    end
  end
  return nil
end

-- wake the queue's live head on its own channel (prefix .. ticket); 0 when the queue is
-- empty. only: wake the head only if its mode is this one. trust: PUBLISH's count of
-- receivers is exact (not on a cluster), so a head nobody listens for is gone: it is dropped
-- and the next one woken.
local function wake_head(wkey, ekey, now, prefix, trust, only, payload)
  for _ = 1, 8 do
    local head = queue_head(wkey, ekey, now)
    if not head then
      return 0
    end
    if only and string.sub(head, 1, 1) ~= only then
      return 1
    end
    if redis.call('PUBLISH', prefix .. string.sub(head, 2), payload) > 0 or not trust then
      return 1
    end
    redis.call('ZREM', wkey, head)
    redis.call('ZREM', ekey, head)
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

local function dequeue(wkey, ekey, member)
  redis.call('ZREM', wkey, member)
  redis.call('ZREM', ekey, member)
end
