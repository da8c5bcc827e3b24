-- acquire.lua: grant leases on several resources of one slot group, all or nothing.
-- Exclusive ("x") needs no live holder at all; shared ("s") needs no exclusive holder and, with
-- a limit, fewer live shared holders than the limit. Each grant gets a fencing token that is
-- larger than every earlier token of that resource and at least the Redis clock in microseconds,
-- so tokens keep growing after the lease or counter key expired, and after Redis lost its data.
-- Every grant is recorded in the owner's registry in this same script.
--
-- KEYS[1] lifetime record of the group      KEYS[2] owner registry in the group
-- when ARGV[4] == "1" (home group): KEYS[3] owners index  KEYS[4] node's owner set  KEYS[5] node set
-- then per resource i: exclusive key, shared key, token counter key, waiter queue, ticket
--             expiry, handed tickets (see _waiters.lua)
-- ARGV[1] owner id   ARGV[2] ttl in milliseconds
-- ARGV[3] grace in milliseconds after Redis is found without the lifetime record (the
--         restart_grace setting; -1: the record is not even read): see _lifetime.lua
-- ARGV[4] "1" when the home keys are given (register the owner, refresh its liveness)
-- ARGV[5] owner liveness in milliseconds   ARGV[6] escaped node name
-- ARGV[7] token counter memory in milliseconds (the token_memory setting); "0": no counter
--         is written (one left by a caller with a memory is still read), and a shared grant
--         stays above the tokens of the live shared holders instead
-- ARGV[8] registry expiry in milliseconds: "<ms>" set, "-<ms>" set if this call made the
--         registry, "0" none (see _registry.lua, which also says what its member "~" is)
-- ARGV[9] the holding task's id, escaped, or "-" (recorded in the registry for operators),
--         then "%c<call id>": the id of this call (see _registry.py), written into the registry
--         entries of its grants only, so that a recovery after a lost reply can tell them
--         from any other grant of the owner (history events and handoff entries go without)
-- ARGV[10] the waiter's ticket, or "" (no ticket: one try, or an attempt before it waits);
--          with an order, "<id> <ttl ms> <task> <owner>" (see _waiters.lua)
-- ARGV[11] waiter channel prefix (a ticket's channel is the prefix and the ticket's id)
-- ARGV[12] "1" when PUBLISH counts receivers exactly (not on a cluster)
-- ARGV[13] ticket slack in milliseconds: a queued ticket lives the wait it is told plus this
-- ARGV[14] order life in milliseconds, or "0": none. Given only for one exclusive resource with
--          a ticket that carries an order (not on a cluster). A busy call then queues the
--          ticket for that long at most (plus the slack), for release.lua to hand the lease
--          over directly while it is valid; records the handed lease's registry entry in
--          advance, "h <id> <task> <resource>" (whatever exclusive lease of the resource the
--          owner holds: see _registry.py); and refreshes the owner's liveness (home keys
--          given) as a grant does
-- then per resource i: mode ("x" or "s"), limit (0 = none), resource name (for the registry)
-- then, with history: events kept in a resource's own stream, milliseconds a resource's
--             stream and record outlive their last event
-- then, last: events kept in the group's history stream (the history setting); "0": no
--             history, and neither the two arguments before it nor the history keys are given
-- with history, KEYS end with: the group's history stream, then per resource i its own
--             history stream and its record (a hash: transitions, ttl of the last grant)
-- returns {1, token_1, ..., token_n}  granted
--         {0, i, wait_ms}             resource i (1-based) is busy; its blocking holder runs out
--                                     in wait_ms unless renewed
--         {-1, wait_ms}               restart grace: Redis restarted or failed over (see above)
--         {2, token}                  a release handed the lease to this ticket (ARGV[14]); its
--                                     registry entry is then "x <token> <task>%c<call> ..."
--
-- A parked task's hand-on (handon.lua) reserves a lease for it: the holder "0 %parked/<task>"
-- (exclusive key or shared member) counts as free for the call of that task (ARGV[9]), which
-- takes it over whenever it is there (a shared lease with room besides included: never a
-- second place beside it) and is not queued behind a waiter there (the reservation is its
-- turn), and as a holder for every other call.
--
-- The waiter queue (see _waiters.lua): a resource free for the mode asked is still busy while
-- the live head of its queue is another waiter (first come, first served; a call without a
-- ticket never barges in), and the wait told is until that head's ticket runs out. A call
-- with a ticket that is busy on resource i queues the ticket there (keeping its place) until
-- now + wait_ms + slack, and leaves the queues of the call's other resources (queued only
-- where it is blocked now, so it never holds the head of a queue it is not waiting for); a
-- grant removes it from every queue of the call, and a shared grant wakes the next waiter if
-- that one wants a shared lease too.

local now, now_us, now_text = clock_of(redis.call('TIME'))
-- numbers are read from ARGV only where used: each tonumber costs a third of a call
local owner = ARGV[1]
local home = ARGV[4] == '1'
-- a whole number as text for a string (a token in an entry or holder: Lua's own conversion
-- keeps 14 digits only); redis.call gets numbers as they are, which Redis writes exactly
-- ("%.17g") for less than a string.format costs
local function num(x) return string.format('%.0f', x) end

if ARGV[3] ~= '-1' then
  local wait = lifetime_wait(KEYS[1], now, 0, ARGV[3], false, nil)
  if wait > 0 then
    return {-1, wait}
  end
end

local h = home and 5 or 2
local a = 14
-- the history arguments come last, the cap of the group's stream at the very end (see above)
local hist = ARGV[#ARGV]
local n = (#ARGV - a - (hist == '0' and 1 or 3)) / 3
local rhist, hkeep = ARGV[#ARGV - 2], ARGV[#ARGV - 1]  -- read only with history
local hk = h + 6 * n  -- the history keys start after hk
-- one event "<field> <value> ..." in the group's stream and in resource i's (0-based) own.
-- Made with history only, as busy() below is made only where it may be called: making a
-- closure costs the server some 2,500 to 6,500 instructions (more with more upvalues)
local event
if hist ~= '0' then
  event = function(i, kind, entry, ...)
    redis.call('XADD', KEYS[hk + 1], 'MAXLEN', '~', hist, '*', 'e', kind, 'x', entry, ...)
    local rkey = KEYS[hk + 2 * i + 2]
    redis.call('XADD', rkey, 'MAXLEN', '~', rhist, '*', 'e', kind, 'x', entry, ...)
    redis.call('PEXPIRE', rkey, hkeep)
  end
end
local memory = ARGV[7]
local sharing = {}  -- i -> true: resource i has live shared holders (read with memory "0")
local ticket, wprefix, trust, ordering = ARGV[10], ARGV[11], ARGV[12] == '1', ARGV[14] ~= '0'
-- made only where they may be called (see event above)
local task, ticket_of, handed_entry
if ordering or hist ~= '0' then
  -- the task field without the call id (history events, handoff entries)
  task = function()
    return string.match(ARGV[9], '^(.-)%%c') or ARGV[9]
  end
end
if ticket ~= '' or ordering then
  ticket_of = function(i)
    return ARGV[a + 3 * i + 1] .. ticket
  end
end
if ordering then
  -- the registry entry of a lease handed to this ticket (see ARGV[14])
  handed_entry = function()
    return 'h ' .. string.match(ticket, '^%S+') .. ' ' .. task() .. ' ' .. ARGV[a + 3]
  end
end

-- the holder a hand-on of a parked task writes to reserve a lease for it (see _parking.lua):
-- this call takes it over as if the resource were free; reserved[i]: found in exclusive key i
-- ("x") or shared key i ("s")
local reserved = {}
local function reservation()
  return '0 %parked/' .. (string.match(ARGV[9], '^(.-)%%c') or ARGV[9])
end

-- the home call: register the owner, refresh its liveness.
-- GT: a liveness only grows; a caller with a shorter one never cuts another's short.
-- ZADD answers 1 only for an owner new to the index (its first grant, or one a reconcile
-- forgot): forget_owner.lua drops an owner from the index and its node's set together, so
-- an owner found in the index is registered under its node already
local function register()
  if home and redis.call('ZADD', KEYS[3], 'GT', now + tonumber(ARGV[5]), owner) == 1 then
    redis.call('SADD', KEYS[4], owner)
    redis.call('SADD', KEYS[5], ARGV[6])
  end
end

if ordering then
  -- handed to this ticket by a release while this call was under way: that is the grant,
  -- if still held (a lost reply's recovery may have given it back)
  local hkey, member = KEYS[h + 6], ticket_of(0)
  local token = handed_to(hkey, member)
  if token then
    dequeue(KEYS[h + 4], KEYS[h + 5], member, hkey)
    if redis.call('GET', KEYS[h + 1]) == token .. ' ' .. owner then
      -- its entry from now on names its token, and this call, as a grant's does: the
      -- handed tickets no longer record it, and a lost reply's recovery finds it as its own
      redis.call('SREM', KEYS[2], handed_entry())
      record_grants(KEYS[2], {'x ' .. token .. ' ' .. ARGV[9] .. ' ' .. ARGV[a + 3]}, ARGV[8])
      return {2, token}
    end
  end
end

-- first pass: every resource must be free for the mode asked; nothing is written but the
-- removal of shared holders that already ran out
for i = 0, n - 1 do
  local xkey, skey = KEYS[h + 6 * i + 1], KEYS[h + 6 * i + 2]
  local wkey, ekey, hkey = KEYS[h + 6 * i + 4], KEYS[h + 6 * i + 5], KEYS[h + 6 * i + 6]
  -- the common case, a free resource without waiters, costs one call
  local found = redis.call('EXISTS', xkey, skey, wkey)
  if found > 0 then
    -- busy on resource i (0-based) for wait ms: queue the ticket there, and only there.
    -- Made here, where it may be needed: a closure costs the server to make (see event)
    local function busy(wait)
      if hist ~= '0' then
        local m, r = ARGV[a + 3 * i + 1], ARGV[a + 3 * i + 3]
        event(i, 'busy', m .. ' 0 ' .. task() .. ' ' .. r, 'o', owner, 'w', wait)
      end
      if ticket ~= '' then
        for j = 0, n - 1 do
          if j ~= i then
            dequeue(KEYS[h + 6 * j + 4], KEYS[h + 6 * j + 5], ticket_of(j), KEYS[h + 6 * j + 6])
          end
        end
        local life = wait
        if ordering then
          -- an order is valid until the ticket's expiry less the slack (release.lua)
          life = math.min(life, tonumber(ARGV[14]))
          record_grants(KEYS[2], {handed_entry()}, ARGV[8])
          register()
        end
        life = life + tonumber(ARGV[13])
        enqueue(KEYS[h + 6 * i + 4], KEYS[h + 6 * i + 5], ticket_of(i), now, now_us, life)
      end
      return {0, i + 1, wait}
    end
    local queued = redis.call('EXISTS', wkey) == 1
    if found > 1 or not queued then
      -- a holder key: the checks as without a queue
      local mode, limit = ARGV[a + 3 * i + 1], tonumber(ARGV[a + 3 * i + 2])
      local xttl = redis.call('PTTL', xkey)
      if xttl >= 0 and redis.call('GET', xkey) == reservation() then
        xttl, reserved[i] = -2, 'x'  -- a hand-on reserved it for this task (handon.lua): its own
      end
      if xttl >= 0 then
        return busy(xttl)
      elseif xttl == -1 then
        -- a holder without expiry can only come from outside this library: never grant over it
        return busy(tonumber(ARGV[2]))
      end
      redis.call('ZREMRANGEBYSCORE', skey, '-inf', now)
      local count = redis.call('ZCARD', skey)
      -- a hand-on's place for this task is its own whenever it is there, full or not: taken
      -- over, never granted a second place beside it
      if count > 0 and redis.call('ZSCORE', skey, reservation()) then
        count, reserved[i] = count - 1, 's'
      end
      if count > 0 and (mode == 'x' or (limit > 0 and count >= limit)) then
        local first = redis.call('ZRANGE', skey, 0, 0, 'WITHSCORES')
        return busy(math.max(tonumber(first[2]) - now, 1))
      end
      sharing[i] = count > 0
    end
    if queued and not reserved[i] then
      -- free for the mode asked, but first come, first served (a hand-on's reservation is
      -- this task's turn: it was handed the resource, as a waiter is)
      local head, expiry = queue_head(wkey, ekey, now, hkey)
      if head and (ticket == '' or head ~= ticket_of(i)) then
        return busy(math.max(expiry - now, 1))
      end
    end
  end
end

-- second pass: grant them all
local tokens = {1}
local entries = {}
for i = 0, n - 1 do
  local xkey, skey, ckey = KEYS[h + 6 * i + 1], KEYS[h + 6 * i + 2], KEYS[h + 6 * i + 3]
  local mode, resource = ARGV[a + 3 * i + 1], ARGV[a + 3 * i + 3]
  local token, text = next_token(ckey, now_us, now_text, memory)
  if memory == '0' and sharing[i] then
    -- shared holders granted beside each other need no release in between: stay above theirs
    for _, member in ipairs(redis.call('ZRANGE', skey, 0, -1)) do
      local held = tonumber(string.match(member, '^%d+') or '0')
      if held >= token then
        token, text = held + 1, nil
      end
    end
  end
  text = text or num(token)
  local holder = text .. ' ' .. owner
  if mode == 'x' then
    redis.call('SET', xkey, holder, 'PX', ARGV[2])  -- the ttl as sent: a number costs more
  else
    local ttl = tonumber(ARGV[2])
    -- the reservation goes, in whichever key the hand-on made it: a FIFO of tasks of both
    -- modes is handed on in the mode of the call that hands on (handon.lua)
    if reserved[i] == 's' then
      redis.call('ZREM', skey, reservation())
    elseif reserved[i] == 'x' and mode == 's' then
      redis.call('DEL', xkey)
    end
    redis.call('ZADD', skey, now + ttl, holder)
    if redis.call('PTTL', skey) < ttl then
      redis.call('PEXPIRE', skey, ttl)
    end
  end
  -- the registry entry: "<mode> <token> <task>%c<call> <resource>" (the resource last: it may
  -- hold spaces)
  entries[#entries + 1] = mode .. ' ' .. text .. ' ' .. ARGV[9] .. ' ' .. resource
  if hist ~= '0' then
    event(i, 'granted', mode .. ' ' .. text .. ' ' .. task() .. ' ' .. resource, 'o', owner, 'ttl',
      ARGV[2])
    local rec = KEYS[hk + 2 * i + 3]
    redis.call('HINCRBY', rec, 'transitions', 1)
    redis.call('HSET', rec, 'ttl', ARGV[2])
    redis.call('PEXPIRE', rec, hkeep)
  end
  tokens[#tokens + 1] = token
  if ticket ~= '' then
    local wkey, ekey, hkey = KEYS[h + 6 * i + 4], KEYS[h + 6 * i + 5], KEYS[h + 6 * i + 6]
    dequeue(wkey, ekey, ticket_of(i), hkey)
    if ordering then
      redis.call('SREM', KEYS[2], handed_entry())  -- granted here: no handoff is to come
    end
    if mode == 's' then
      -- the next waiter may share it too: wake it (it is refused if the limit is reached)
      wake_head(wkey, ekey, now, wprefix, trust, 's', num(token), hkey)
    end
  end
end

-- the registry outlives every lease it records, so a cleanup always finds them
record_grants(KEYS[2], entries, ARGV[8])
register()
return tokens
