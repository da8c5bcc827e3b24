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
-- INFO costs about 6 to 15 us of server time, so the scripts that grant call it only when the
-- record is missing; a kept record is compared with the server's identity by
-- lifetime_check.lua, which the client runs on every new connection before anything else
-- (every restart and every failover drops every connection, so the check always runs first
-- in a new lifetime).

-- the server's identity, or nil when INFO is refused (an ACL without +info), and its role;
-- read once per script call
local lifetime_known, lifetime_id, lifetime_role = false, nil, 'master'
local function lifetime_identity()
  if lifetime_known then
    return lifetime_id, lifetime_role
  end
  lifetime_known = true
  local server = redis.pcall('INFO', 'server')
  local repl = redis.pcall('INFO', 'replication')
  if type(server) ~= 'string' or type(repl) ~= 'string' then
    return nil, 'master'
  end
  local run_id = string.match(server, 'run_id:(%x+)') or '-'
  local replid = string.match(repl, 'master_replid:(%x+)') or '-'
  lifetime_id = run_id .. '/' .. replid
  lifetime_role = string.match(repl, 'role:(%a+)') or 'master'
  return lifetime_id, lifetime_role
end

-- ms to wait before anything may be granted in the group of record key `key`; writes the
-- record when it is missing or from another lifetime
local function lifetime_check(key, now, kept_ms, empty_ms)
  local record = redis.call('GET', key)
  local identity, role = lifetime_identity()
  if role ~= 'master' then
    return 0  -- a replica takes no grants; its record comes from its master
  end
  local until_ms
  if not record then
    until_ms = now + empty_ms
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

-- the hot path: one GET while the record is there
local function lifetime_wait(key, now, empty_ms)
  local record = redis.call('GET', key)
  if not record then
    return lifetime_check(key, now, 0, empty_ms)
  end
  local until_ms = tonumber(string.match(record, '^%d+')) or 0
  return math.max(until_ms - now, 0)
end

