-- _limit.lua: the window rule of a rate limit, put into limit.lua, park_limit.lua and
-- handon_limit.lua (see _scripts.py). "N per period" holds in ANY window of the period's
-- length: the log keeps each admission still inside the window (scored by the Redis time
-- it was admitted at, in microseconds) and the state keeps their cost sum.

-- Prune what left the window, and say when `cost` is admitted, with `held` cost promised
-- to tasks handed on and not started yet (parked tasks: they count as admitted).
-- returns n, period (the rate in force: an override's, else the declared one), sum (the
-- cost in the window), wait (us until the cost can be admitted: 0 now; -1 never, the cost
-- is above N; -2 not before the hand-ons in flight start or run out), gone (entries pruned)
local function limit_look(log, state, over_key, pen_key, n, period, cost, held, now)
  local over = redis.call('HMGET', over_key, 'n', 'p')
  if over[1] and over[2] then
    n, period = tonumber(over[1]), tonumber(over[2])
  end
  if cost > n then
    return n, period, 0, -1, 0
  end
  -- an admission at s still counts while now - s < period
  local floor = now - period
  local sum = tonumber(redis.call('HGET', state, 'sum') or '0')
  local gone = redis.call('ZRANGEBYSCORE', log, '-inf', floor)
  if #gone > 0 then
    for _, member in ipairs(gone) do
      sum = sum - tonumber(string.match(member, ':(%d+)$'))
    end
    redis.call('ZREMRANGEBYSCORE', log, '-inf', floor)
  end
  if sum < 0 or (sum > 0 and redis.call('ZCARD', log) == 0) then
    sum = 0 -- the log went (evicted): the sum cannot count what it no longer holds
  end
  local wait = 0
  local penalty = tonumber(redis.call('GET', pen_key) or '0')
  if penalty > now then
    wait = penalty - now
  end
  if sum + held + cost > n then
    -- the oldest entries leave first; each costs at least 1, so the first `need` suffice
    -- (when the log holds that much: else the hand-ons in flight hold the room)
    local need = sum + held + cost - n
    local oldest = redis.call('ZRANGE', log, 0, need - 1, 'WITHSCORES')
    local freed = 0
    local found = false
    for i = 1, #oldest, 2 do
      freed = freed + tonumber(string.match(oldest[i], ':(%d+)$'))
      if freed >= need then
        local at = tonumber(oldest[i + 1]) + period - now
        if at > wait then
          wait = at
        end
        found = true
        break
      end
    end
    if not found then
      wait = -2
    end
  end
  return n, period, sum, wait, #gone
end

-- ms until a limit's parked tasks are looked at again, after limit_look's `wait`: the
-- exact wait, or with the room held by hand-ons in flight (-2) the sooner of their first
-- running out and a period (a copy that starts is admitted then, and its admission leaves
-- the window a period later at the soonest)
local function limit_due(fifo, wait, period, now, now_us)
  if wait >= 0 then
    return math.ceil(wait / 1000)
  end
  if wait == -1 then
    return 0
  end
  local due = math.ceil(period / 1000)
  local first = redis.call('ZRANGEBYSCORE', fifo, '(' .. string.format('%.0f', now_us), '+inf',
    'WITHSCORES', 'LIMIT', 0, 1)
  if #first > 0 then
    local ends = math.ceil((tonumber(first[2]) - now_us) / 1000)
    if ends < due then
      due = ends
    end
  end
  return math.max(due, 0)
end
