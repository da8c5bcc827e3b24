-- lifetime_check.lua: the restart check of _lifetime.lua on the lifetime record of every slot
-- group given; run by the client on each new connection before any other command.
--
-- KEYS[1..n] the lifetime records (on a Redis Cluster: one, KEYS[1], and a call per group)
-- ARGV[1] grace in ms after a restart that kept the record (snapshot, AOF, failover)
-- ARGV[2] grace in ms after Redis is found without the record (restart_grace)
-- returns {the longest wait in ms (0: grants may go ahead), 1 if INFO answered (0: refused,
--         and only a missing record can be seen)}

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local kept_ms, empty_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local wait, known = 0, {}
for i = 1, #KEYS do
  wait = math.max(wait, lifetime_wait(KEYS[i], now, kept_ms, empty_ms, true, known))
end
return {wait, known.identity and 1 or 0}
