-- _parking.lua: parked tasks (on_busy="defer"), put into park.lua, handon.lua, park_gate.lua
-- and unpark.lua (see _scripts.py). A task parked on a resource is a member of the resource's
-- parked FIFO (a ZSET scored by the Redis clock in microseconds when it parked); its state
-- ("p" parked, "h" handed on: its message was given to a releaser or a pump to publish) and
-- its message live in two hashes of the resource's slot group, by task id; a task whose
-- hand-on a copy consumed is a tombstone "<task id>#<retries>" in the group's done ZSET
-- (scored by Redis ms): later copies of that message are dropped, while a retry of the task
-- (self.retry, on_backend_error: the same id, one retry more) is a new message and runs.
-- A hand-on reserves the capacity for the task: the lease itself, held by the placeholder
-- owner "%parked/<task id>" with token 0 for the hand-on timeout, which acquire.lua lets that
-- task (and nobody else) take over.

-- the capacity rule of acquire.lua's first pass, for a lease of mode with limit (0: none):
-- 0 when the resource has room now, else the ms until its blocking holder runs out
local function park_busy(xkey, skey, mode, limit, now)
  local xttl = redis.call('PTTL', xkey)
  if xttl >= 0 then
    return math.max(xttl, 1)
  elseif xttl == -1 then
    return 1000
  end
  redis.call('ZREMRANGEBYSCORE', skey, '-inf', string.format('%.0f', now))
  local count = redis.call('ZCARD', skey)
  if count > 0 and (mode == 'x' or (limit > 0 and count >= limit)) then
    local first = redis.call('ZRANGE', skey, 0, 0, 'WITHSCORES')
    return math.max(tonumber(first[2]) - now, 1)
  end
  return 0
end

-- drop tombstones older than keep ms (up to 64 at a time)
local function park_prune(done, now, keep)
  local old = redis.call('ZRANGEBYSCORE', done, '-inf', string.format('%.0f', now - keep),
    'LIMIT', 0, 64)
  if #old > 0 then
    redis.call('ZREM', done, unpack(old))
  end
end

-- the task leaves its FIFO and both hashes (its message, and its mode and limit "%m<task>")
local function park_forget(queue, state, msgs, task)
  redis.call('ZREM', queue, task)
  redis.call('HDEL', state, task)
  redis.call('HDEL', msgs, task, '%m' .. task)
end

-- record a hand-on in the caller's owner registry (with the registry's keeper "~", see
-- _registry.lua), made with the expiry life ms or extended to it: a cleanup of the caller
-- takes it over (handon_takeover.lua) until the caller removes it, once it published
local function park_record(registry, entry, life)
  local made = redis.call('SADD', registry, '~', entry) == 2
  local pttl = redis.call('PTTL', registry)
  if made or (pttl >= 0 and pttl < life) then
    redis.call('PEXPIRE', registry, life)
  end
end

-- the checks park.lua and park_limit.lua open with, for the task's delivery: its state in the
-- group (handed on: consumed here, {2}; parked: a copy, {3}), then its tombstone "mark" (a
-- delivery that consumed its hand-on, consumed = true, parks again: the tombstone goes, and
-- the record "<mark>@<gen>" of this message as its consumer, see park_gate.lua; any other
-- delivery of a consumed hand-on, {4}); nil: go on and park
local function park_check(queue, state, msgs, done, task, now, consumed, mark, gen)
  local s = redis.call('HGET', state, task)
  if s == 'h' then
    park_forget(queue, state, msgs, task)
    redis.call('ZADD', done, now, mark)
    return {2}
  elseif s == 'p' then
    redis.call('HSET', state, task, 'p')  -- the WAIT after the call covers the park itself
    return {3}
  end
  if consumed then
    redis.call('ZREM', done, mark, mark .. '@' .. (gen or ''))
  elseif redis.call('ZSCORE', done, mark) then
    return {4}
  end
  return nil
end
