-- unique_claim.lua: claim a unique key for a task that is about to be published (queued state).
-- The claim is the exclusive lease key of the key's claim resource; while queued it holds
-- "<token> %queued/<task id>" with the queue TTL and is in no owner's registry (the producer
-- may exit right after publishing: only the TTL bounds a claim whose task never starts). The
-- worker that starts the task takes it over (unique_handover.lua). "%q" can never begin an
-- owner id: owner ids start with an escaped node name, in which "%" is always "%XX" (hex).
--
-- KEYS[1] claim key (the exclusive lease key of the claim resource)
-- KEYS[2] token counter of the claim resource   KEYS[3] queued-claims index of the slot group
-- ARGV[1] task id, escaped   ARGV[2] queue ttl in milliseconds
-- ARGV[3] token counter memory in milliseconds ("0": none is written, one left is still read)
-- ARGV[4] claim resource name (index member)
-- ARGV[5] "" to claim; a token to confirm the claim "<token> %queued/<task id>" (below)
-- KEYS[4] throttle window key of the claim resource: the escaped task id of the last accepted
--         send, while its unique_window lasts   KEYS[5] replaced task ids of the claim resource
--         (ZSET scored by when they are forgotten, Redis ms): their messages never run
-- ARGV[6] unique_window in milliseconds ("0": no throttle window)
-- ARGV[7] "r" (unique_mode="replace"): a claim queued for another task id is taken from it
-- ARGV[8] how long a replaced task id is remembered, in milliseconds (its queue ttl)
-- KEYS[6] parked FIFO of the claim resource   KEYS[7] parked states (group)
-- KEYS[8] parked messages (group)   KEYS[9] park due index (group)
-- KEYS[10] newest arguments of the claim resource's runs (HASH: escaped task id -> message)
-- ARGV[7] "k" (unique_mode="keep_last"): a send while the key is taken gives its arguments
--         to the run that will carry them (see below), instead of being refused
-- ARGV[9] (keep_last) the send as a parked message (JSON, _parking.py's format)
-- ARGV[10] (keep_last) the claim resource's due member in the park due index
-- ARGV[7] "d" (unique_mode="debounce"): as "k", and a send while the key is free is parked
--         too; the follow-up is handed on (handon.lua) no sooner than ARGV[11] ms after the
--         last send and no later than ARGV[12] ms after the first one of its burst: the field
--         "%d<claim resource>" of the parked messages holds "<not before ms> <deadline ms>"
-- KEYS[11] revocation mark of the claim resource (revoke.lua's "<deadline ms> <token> <reason>")
-- ARGV[13] (on_duplicate="cancel", with ARGV[7] "" or "r") ms from now until a running copy's
--          claim is force-released ("0" or absent: no cancel): a send that finds a copy
--          running writes the revocation mark for its grant (renew.lua tells the holder:
--          LeaseRevoked), cuts the claim's expiry to the deadline, and parks as the one
--          follow-up (as keep_last's, ARGV[9] and ARGV[10]), handed on when the claim is freed:
--          by its release, or by the pump at the deadline at the latest; a send while that
--          follow-up waits gives it its arguments. A copy queued: as without ARGV[13]
-- ARGV[14] (cancel) the revocation's reason
--
-- A producer claims with a short ttl (the unique_confirm_window setting: the claim is
-- pending) and, once its message is published, confirms it with the queue ttl. A claim whose
-- producer died or whose publish failed (its reply lost, say, so it cannot give it back) so
-- frees itself within the window, never blocking its key for the queue ttl.
--
-- returns, to a claim:
--          {1, token}          claimed for this task
--          {2, token}          already queued for this same task id (a re-publish): its TTL
--                              is raised to ARGV[2] if it was shorter
--          {0, holder, pttl}   held by another: holder "<token> <owner>" (owner
--                              "%queued/<task>" while queued), pttl ms until it runs out unless
--                              renewed (-1: never)
--          {3, task, pttl}     throttled: the window of the send of (escaped) task id "task"
--                              lasts pttl ms more; nothing changed
--          {1, token, task}    (replace) claimed for this task, taken from the claim queued for
--                              (escaped) task id "task", now remembered as replaced
--          {4, task}           (keep_last) not sent: (escaped) task id "task" will run with
--                              this send's arguments: the copy queued (or handed on), or the
--                              follow-up parked behind the running copy (this task id when
--                              this send parked it); (cancel) the same, for a follow-up. A
--                              copy queued gets them parked too, as its own follow-up (it
--                              may never be published; its run forgets them)
--          {5, holder, ms}     (cancel) not sent: the running copy "<token> <owner>" is
--                              revoked (its claim runs out in ms at the latest) and this send
--                              is parked as its follow-up
-- returns, to a confirm:
--          {1, token}          the claim is still queued for this task with this token: its
--                              TTL is raised to ARGV[2] if it was shorter
--          {0, holder, pttl}   it is not (a worker took it over, it was released or ran out,
--                              another task claimed the key): nothing changed, nothing written
--                              (a confirm never brings a claim back); holder "" when free

local now, now_us, now_text = clock_of(redis.call('TIME'))
local function num(x) return string.format('%.0f', x) end
local mine = '%queued/' .. ARGV[1]
local ttl = tonumber(ARGV[2])

-- the index lists queued claims by expiry, for operators (celery leases ls); it expires with
-- its last entry
local function index(expiry)
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', num(now))
  redis.call('ZADD', KEYS[3], 'GT', num(expiry), ARGV[4])
  if redis.call('PTTL', KEYS[3]) < expiry - now then
    redis.call('PEXPIRE', KEYS[3], num(expiry - now))
  end
end

local window = tonumber(ARGV[6] or '0')
local current = redis.call('GET', KEYS[1])
if ARGV[5] ~= '' then
  -- the window counts from the publish (first, so a worker that took the claim over before
  -- this confirm leaves the window its full length)
  if window > 0 and redis.call('GET', KEYS[4]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[4], window)
  end
  if current ~= ARGV[5] .. ' ' .. mine then
    return {0, current or '', current and redis.call('PTTL', KEYS[1]) or -2}
  end
  local pttl = redis.call('PTTL', KEYS[1])
  if pttl >= 0 and pttl < ttl then
    redis.call('PEXPIRE', KEYS[1], ttl)
    index(now + ttl)
  end
  return {1, ARGV[5]}
end
if window > 0 then
  local last = redis.call('GET', KEYS[4])
  if last and last ~= ARGV[1] then
    return {3, last, redis.call('PTTL', KEYS[4])}
  end
end
-- the newest arguments of a run that will carry them (read by the run once it took the claim)
local function newest(task)
  redis.call('HSET', KEYS[10], task, ARGV[9])
  local forget = tonumber(ARGV[8])
  if redis.call('PTTL', KEYS[10]) < forget then
    redis.call('PEXPIRE', KEYS[10], forget)
  end
end
-- the follow-up parked (or handed on) behind the holder, if any
local function parked_follow()
  local follow = redis.call('ZRANGE', KEYS[6], 0, 0)[1]
  if follow and not redis.call('HGET', KEYS[7], follow) then
    redis.call('ZREM', KEYS[6], follow)  -- consumed or unparked meanwhile
    follow = nil
  end
  return follow
end
-- park this send as the follow-up (as task id "task", this send's own by default), looked
-- at again when the holder runs out
local function park(task)
  task = task or ARGV[1]
  redis.call('ZADD', KEYS[6], 'NX', string.format('%.0f', now_us), task)
  redis.call('HSET', KEYS[7], task, 'p')
  redis.call('HSET', KEYS[8], task, ARGV[9])
  redis.call('HSET', KEYS[8], '%r' .. ARGV[4], ARGV[10])
  local pttl = redis.call('PTTL', KEYS[1])
  local due = now + (pttl >= 0 and math.max(pttl, 1) or 1000)
  local known = redis.call('ZSCORE', KEYS[9], ARGV[10])
  if not known or tonumber(known) > due then
    redis.call('ZADD', KEYS[9], num(due), ARGV[10])
  end
end
local who = nil  -- the claim's holder ("%queued/<task>", "%parked/<task>" or an owner id)
if current then
  local space = string.find(current, ' ', 1, true)
  who = space and string.sub(current, space + 1) or ''
end

-- cancel: a copy running is revoked as revoke.lua revokes a grant, and this send follows it
local cancel = tonumber(ARGV[13] or '0')
if cancel > 0 then
  local follow = parked_follow()
  if who and string.sub(who, 1, 8) == '%parked/' then
    newest(string.sub(who, 9))  -- the follow-up, handed on, not started: it takes them
    return {4, string.sub(who, 9)}
  end
  if follow and who ~= mine then
    redis.call('HSET', KEYS[8], follow, ARGV[9])
    newest(follow)
    return {4, follow}
  end
  local token = current and string.match(current, '^(%d+) ')
  if token and who ~= mine and string.sub(who, 1, 8) ~= '%queued/' then
    local until_ms = now + cancel
    local old = redis.call('GET', KEYS[11])
    if old then
      local old_until, old_token = string.match(old, '^(%d+) (%d+)')
      if old_token == token and tonumber(old_until) < until_ms then
        until_ms = tonumber(old_until)  -- revoked already: never more time
      end
    end
    local left = redis.call('PTTL', KEYS[1])
    if left < 0 or left > until_ms - now then
      redis.call('PEXPIRE', KEYS[1], num(until_ms - now))
    end
    redis.call('SET', KEYS[11], num(until_ms) .. ' ' .. token .. ' ' .. ARGV[14],
      'PX', num(until_ms - now))
    park()
    return {5, current, num(until_ms - now)}
  end
end

-- keep_last: at most one copy queued or running, and one follow-up parked behind a running
-- one (handed on by its release, or by the park pump once it died); the newest arguments win
if ARGV[7] == 'k' or ARGV[7] == 'd' then
  local debounce = ARGV[7] == 'd'
  local function quiet(fresh)
    if not debounce then
      return
    end
    local old = not fresh and redis.call('HGET', KEYS[8], '%d' .. ARGV[4])
    local deadline = old and tonumber(string.match(old, ' (%d+)$')) or now + tonumber(ARGV[12])
    local due = math.min(now + tonumber(ARGV[11]), deadline)
    redis.call('HSET', KEYS[8], '%d' .. ARGV[4], num(due) .. ' ' .. num(deadline))
    redis.call('ZADD', KEYS[9], num(due), ARGV[10])
  end
  local follow = parked_follow()
  if who and who ~= mine then
    local kind = string.sub(who, 1, 8)
    if kind == '%queued/' or kind == '%parked/' then
      local task = string.sub(who, 9)
      newest(task)
      -- the copy queued may never be published (its producer died before its publish, the
      -- publish failed, its claim reply was lost): these arguments are parked too, as that
      -- copy's follow-up under its task id, handed on by the pump once its claim is gone; the
      -- copy's run forgets it when it takes the claim (unique_handover.lua). Not for a copy
      -- parked elsewhere (on_busy="defer" on its lease): its message is kept in Redis already
      if kind == '%queued/' and (redis.call('ZSCORE', KEYS[6], task)
          or redis.call('HEXISTS', KEYS[7], task) == 0) then
        park(task)
      end
      return {4, task}
    end
  end
  if follow and who ~= mine then
    redis.call('HSET', KEYS[8], follow, ARGV[9])
    newest(follow)
    quiet(false)
    return {4, follow}
  end
  if (who and who ~= mine) or (debounce and not who) then
    park()
    quiet(true)
    return {4, ARGV[1]}
  end
end

local replaced = nil
if current then
  local space = string.find(current, ' ', 1, true)
  local pttl = redis.call('PTTL', KEYS[1])
  if space and string.sub(current, space + 1) == mine then
    if pttl >= 0 and pttl < ttl then
      redis.call('PEXPIRE', KEYS[1], ttl)
      pttl = ttl
    end
    if pttl >= 0 then
      index(now + pttl)
    end
    return {2, string.sub(current, 1, space - 1)}
  end
  if ARGV[7] ~= 'r' or not space or string.sub(current, space + 1, space + 8) ~= '%queued/' then
    return {0, current, pttl}
  end
  -- replace: the queued task's message will find its id here and not run
  replaced = string.sub(current, space + 9)
  local forget = tonumber(ARGV[8])
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', num(now))
  redis.call('ZADD', KEYS[5], num(now + forget), replaced)
  if redis.call('PTTL', KEYS[5]) < forget then
    redis.call('PEXPIRE', KEYS[5], forget)
  end
end

-- a fencing token as acquire.lua makes them: above every earlier one, at least the clock in us
local token, text = next_token(KEYS[2], now_us, now_text, ARGV[3])
redis.call('SET', KEYS[1], (text or num(token)) .. ' ' .. mine, 'PX', ttl)
index(now + ttl)
if window > 0 then
  redis.call('SET', KEYS[4], ARGV[1], 'PX', math.min(ttl, window))
end
if replaced then
  return {1, token, replaced}
end
return {1, token}
