-- beat_claim.lua: claim one due run of a beat entry, so that one replica sends it.
-- A run is identified by a number that only grows: the due time in ms (crontab, identical
-- on every replica) or the index of the Redis-time bucket of the interval. The claim is won
-- by the first replica that presents a run newer than the last one claimed; every later or
-- older claim of that run loses, whatever the replicas' clocks say. The claim is judged on
-- the Redis clock:
-- - an interval run is refused as early while less than half a bucket has passed since the
--   last run was claimed (two replicas whose first looks straddle a bucket boundary would
--   otherwise send two runs a moment apart);
-- - a crontab run due more than the tolerance ahead of the Redis clock is refused as future
--   (a replica whose clock runs ahead must not claim, and so block, runs not yet due); it may
--   be claimed from its due time on.
-- The key holds "<run id> <Redis ms of the claim> <replica>" (an older "<run id> <replica>"
-- is still read).
-- After an outage (the key records a last run, and a run newer than it and older than the
-- one presented was due: nobody claimed it), the catch-up window decides (ARGV[6]): the run
-- presented is claimed, and sent, only when the latest missed due time is at most the window
-- before the Redis clock; else it is recorded as skipped ("<run id> <ms> skipped:<replica>"),
-- so that no replica sends it. An interval's runs are due at the middle of their buckets;
-- the one skipped is the bucket of the latest missed middle, recorded with the end of that
-- bucket as its Redis ms. A crontab run whose next run is also due (ARGV[7] <= now) is not claimed:
-- the caller presents the latest due run instead, with ARGV[8] = "latest".
--
-- KEYS[1] claim key of the entry
-- ARGV[1] due run id, or "" to use the current Redis-time bucket
-- ARGV[2] bucket length in ms (when ARGV[1] is "")   ARGV[3] claim key ttl in ms
-- ARGV[4] claimant (replica) name
-- ARGV[5] crontab: ms a due run may be ahead of the Redis clock and still be claimed
-- ARGV[6] catch-up window in ms, "none" (a missed run is skipped) or "" (missed runs are not
--         looked for: the run is claimed as any other)
-- ARGV[7] crontab: the due time (ms) of the run after this one, or ""
-- ARGV[8] crontab: "latest" when this run is the latest due one after an outage, or ""
-- returns {won (1), lost (0), early (2), future (3), skipped (4: missed, outside the
--          window) or missed (5: crontab, present the latest due run), run id, Redis time
--          in ms, winner of the run ('' if not known), Redis ms from which it may be claimed
--          (early and future; else ''), "1" when won as a catch-up run (else '')}

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due, every
if ARGV[1] == '' then
  every = tonumber(ARGV[2])
  due = math.floor(now / every)
else
  due = tonumber(ARGV[1])
end
local last, last_ms, winner = -1, nil, ''
local current = redis.call('GET', KEYS[1])
if current then
  local run, ms, who = string.match(current, '^(%-?%d+) (%d+) (.*)$')
  if run then
    last, last_ms, winner = tonumber(run), tonumber(ms), who
  else
    run, who = string.match(current, '^(%-?%d+) (.*)$')
    if run then
      last, winner = tonumber(run), who
    end
  end
end
local id = string.format('%.0f', due)
local at = string.format('%.0f', now)
local policy = ARGV[6] or ''
if due > last and policy ~= '' and current then
  -- an outage: a run newer than the last claimed one was due and never claimed. The latest
  -- missed due time: an interval's runs are due at the middle of their buckets (when the
  -- replicas look); the latest middle at or before now, of bucket s, was missed
  local latest, s = nil, nil
  if every ~= nil then
    if due > last + 1 then
      s = math.floor(now / every - 0.5)
      latest = (s + 0.5) * every
    end
  elseif (ARGV[8] or '') == 'latest' then
    latest = due
  elseif (ARGV[7] or '') ~= '' and tonumber(ARGV[7]) <= now then
    return {5, id, at, '', ''}
  end
  if latest ~= nil then
    local window = tonumber(policy)
    if window ~= nil and now - latest <= window then
      redis.call('SET', KEYS[1], id .. ' ' .. at .. ' ' .. ARGV[4], 'PX', ARGV[3])
      return {1, id, at, ARGV[4], '', '1'}
    end
    if s == nil then
      redis.call('SET', KEYS[1], id .. ' ' .. at .. ' skipped:' .. ARGV[4], 'PX', ARGV[3])
      return {4, id, at, '', ''}
    end
    -- the interval run of bucket s is recorded as skipped, with the end of bucket s as its
    -- Redis ms: the early rule then refuses bucket s + 1 until its middle, its due time (a
    -- replica that starts later must not send it at once)
    local sid = string.format('%.0f', s)
    local sat = string.format('%.0f', (s + 1) * every)
    redis.call('SET', KEYS[1], sid .. ' ' .. sat .. ' skipped:' .. ARGV[4], 'PX', ARGV[3])
    return {4, sid, at, '', string.format('%.0f', (s + 1.5) * every)}
  end
end
if due > last then
  if every == nil then
    local tolerance = tonumber(ARGV[5] or '0') or 0
    if due > now + tolerance then
      return {3, id, at, '', id}
    end
  elseif last_ms ~= nil and (now - last_ms) * 2 < every then
    return {2, id, at, winner, string.format('%.0f', math.ceil(last_ms + every / 2))}
  end
  redis.call('SET', KEYS[1], id .. ' ' .. at .. ' ' .. ARGV[4], 'PX', ARGV[3])
  return {1, id, at, ARGV[4], ''}
end
-- the key holds the winner of the last claimed run only: of an older run, it is not known
if due < last then
  winner = ''
end
return {0, id, at, winner, ''}
