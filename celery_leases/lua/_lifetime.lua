-- _lifetime.lua: the restart check, put in front of every script that grants (acquire.lua,
-- unique_handover.lua) and of lifetime_check.lua, so that it is written once.
--
-- The lifetime record of a slot group, "<grace_until_ms> <server identity>", says which
-- server lifetime wrote it and until when nothing may be granted in the group. The identity
-- is the run id (new on every start of redis-server) and the master replication id (new on
-- every promotion of a replica, and on every promotion of a demoted master). A record found
-- with another identity was restored from an RDB snapshot or an AOF, or replicated from a
-- master whose last writes this server never received: the grants made after it may be gone
-- while their holders still count them held, so nothing is granted for kept_ms. A missing
-- record is a new Redis or one that came back empty: the server cannot tell them apart, so
-- that grace (empty_ms) is the restart_grace setting, 0 by default.
--
-- INFO server and INFO replication add 6 to 10 us of server time to a grant (measured), so
-- the scripts that grant call them only when the record is missing; a kept record is compared
-- with the server's identity by lifetime_check.lua, which the client runs on every new
-- connection before anything else (every restart and every failover drops every connection,
-- so the check always runs first in a new lifetime).

-- One function, so that a call defines one closure: on the hot path (the record is there and
-- `check` is false) it is one GET. Returns the ms to wait before anything may be granted in
-- the group of record `key`. With `check`, or when the record is missing, the record is
-- compared with the server's identity and rewritten when it is missing or from another
-- lifetime; `known` (a table, or nil) keeps the identity read by INFO for the next call of
-- the same script (known.identity is nil when INFO is refused: an ACL without +info).
local function lifetime_wait(key, now, kept_ms, empty_ms, check, known)
  local record = redis.call('GET', key)
  if record and not check then
    return math.max((tonumber(string.match(record, '^%d+')) or 0) - now, 0)
  end
  known = known or {}
  if known.role == nil then
    known.role = 'master'
    local server = redis.pcall('INFO', 'server')
    local repl = redis.pcall('INFO', 'replication')
    if type(server) == 'string' and type(repl) == 'string' then
      known.role = string.match(repl, 'role:(%a+)') or 'master'
      known.identity = (string.match(server, 'run_id:(%x+)') or '-') .. '/' ..
        (string.match(repl, 'master_replid:(%x+)') or '-')
    end
  end
  if known.role ~= 'master' then
    return 0  -- a replica takes no grants; its records come from its master
  end
  local identity = known.identity
  local until_ms
  if not record then
    until_ms = now + tonumber(empty_ms)  -- a number, or its text as a script got it
  else
    local old_until, old_identity = string.match(record, '^(%d+) (%S+)$')
    old_until = tonumber(old_until) or 0
    if identity == nil or old_identity == identity then
      return math.max(old_until - now, 0)
    end
    until_ms = math.max(old_until, now + kept_ms)
  end
  redis.call('SET', key, string.format('%.0f', until_ms) .. ' ' .. (identity or '-'))
  return math.max(until_ms - now, 0)
end
