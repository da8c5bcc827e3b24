-- limit_penalize.lua: admit nobody under a limit for a while (e.g. after an HTTP 429).
-- A penalty never shortens one in force: the later end wins.
--
-- KEYS[1] penalty STRING (Redis us until which nobody is admitted)
-- KEYS[2] the slot group's index ZSET of limits (scored by when they go idle, us)
-- ARGV[1] penalty in microseconds   ARGV[2] the limit's name
-- returns the microseconds the penalty in force still lasts (this one, or a longer one)

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local untl = now + tonumber(ARGV[1])
local old = tonumber(redis.call('GET', KEYS[1]) or '0')
if old > untl then
  untl = old
end
redis.call('SET', KEYS[1], string.format('%d', untl), 'PX', math.floor((untl - now) / 1000) + 1)
local idle = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[2]) or '0')
if untl > idle then
  redis.call('ZADD', KEYS[2], untl, ARGV[2])
end
local ttl_ms = math.floor((untl - now) / 1000) + 1
if redis.call('PTTL', KEYS[2]) < ttl_ms then
  redis.call('PEXPIRE', KEYS[2], ttl_ms)
end
return untl - now
