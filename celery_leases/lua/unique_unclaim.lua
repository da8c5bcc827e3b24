-- unique_unclaim.lua: give back a queued claim whose task will not run: its publish failed,
-- or a worker discarded the message (revoked or expired before it started). Only a claim
-- still queued for that task id (and, when given, that token) goes; a claim taken over by a
-- worker, or claimed since by another task, is never touched (never a plain DEL).
--
-- KEYS[1] claim key   KEYS[2] queued-claims index of the group
-- ARGV[1] task id, escaped   ARGV[2] token, or "" for any token of that task
-- ARGV[3] claim resource name (index member)   ARGV[4] release channel of the claim resource
-- KEYS[3] throttle window key of the claim resource: dropped too if it names the task
-- KEYS[4] replaced task ids of the claim resource   ARGV[5] "" or the escaped task id this
--         task's claim replaced (unique_mode="replace"): it may run again, its claim is gone
-- returns 1 = released; 0 = not queued for that task (nothing changed)

local current = redis.call('GET', KEYS[1])
if not current then
  return 0
end
local space = string.find(current, ' ', 1, true)
if not space or string.sub(current, space + 1) ~= '%queued/' .. ARGV[1] then
  return 0
end
local token = string.sub(current, 1, space - 1)
if ARGV[2] ~= '' and token ~= ARGV[2] then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[3])
if KEYS[3] and redis.call('GET', KEYS[3]) == ARGV[1] then
  redis.call('DEL', KEYS[3])
end
if KEYS[4] and ARGV[5] and ARGV[5] ~= '' then
  redis.call('ZREM', KEYS[4], ARGV[5])
end
redis.call('PUBLISH', ARGV[4], token)
return 1
