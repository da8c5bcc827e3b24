-- beat_claim.lua: claim one due run of a beat entry, so that one replica sends it.
-- A run is identified by a number that only grows: the due time in ms (crontab, identical
-- on every replica) or the index of the Redis-time bucket of the interval. The claim is won
-- by the first replica that presents a run newer than the last one claimed; every later or
-- older claim of that run loses, whatever the replicas' clocks say.
--
-- KEYS[1] claim key of the entry
-- ARGV[1] due run id, or "" to use the current Redis-time bucket
-- ARGV[2] bucket length in ms (when ARGV[1] is "")   ARGV[3] claim key ttl in ms
-- ARGV[4] claimant (replica) name
-- returns {won (1 or 0), run id, Redis time in ms, winner of the run ('' if not known)}

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due
if ARGV[1] == '' then
  due = math.floor(now / tonumber(ARGV[2]))
else
  due = tonumber(ARGV[1])
end
local last, winner = -1, ''
local current = redis.call('GET', KEYS[1])
if current then
  local space = string.find(current, ' ', 1, true)
  last = tonumber(string.sub(current, 1, space - 1))
  winner = string.sub(current, space + 1)
end
local id = string.format('%.0f', due)
if due > last then
  redis.call('SET', KEYS[1], id .. ' ' .. ARGV[4], 'PX', ARGV[3])
  return {1, id, string.format('%.0f', now), ARGV[4]}
end
-- the key holds the winner of the last claimed run only: of an older run, it is not known
if due < last then
  winner = ''
end
return {0, id, string.format('%.0f', now), winner}
