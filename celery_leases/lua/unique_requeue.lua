-- unique_requeue.lua: a running task publishes itself again (self.retry, a busy retry,
-- Task.replace keep the task id): its claim goes back to the queued state for the same task
-- id, with the queue TTL, so that the next run takes it over and no duplicate gets in while
-- the retry waits. Only the running holder can do it: the key must still name its token.
--
-- KEYS[1] claim key   KEYS[2] owner registry of the running holder (the claim's group)
-- KEYS[3] queued-claims index of the group
-- ARGV[1] holder "<token> <owner>"   ARGV[2] the holder's registry entry
-- ARGV[3] task id, escaped   ARGV[4] queue ttl in milliseconds
-- ARGV[5] claim resource name (index member)
-- returns 1 = queued again for the task; 0 = that holder no longer has it (nothing changed)

if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[4])
local space = string.find(ARGV[1], ' ', 1, true)
local token = string.sub(ARGV[1], 1, space - 1)
redis.call('SET', KEYS[1], token .. ' %queued/' .. ARGV[3], 'PX', ttl)
redis.call('SREM', KEYS[2], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', string.format('%.0f', now))
redis.call('ZADD', KEYS[3], 'GT', string.format('%.0f', now + ttl), ARGV[5])
if redis.call('PTTL', KEYS[3]) < ttl then
  redis.call('PEXPIRE', KEYS[3], ttl)
end
return 1
