-- leave.lua: a waiter leaves the waiter queues of resources of one slot group (it timed out,
-- was cancelled, failed, or is now blocked elsewhere); if it was the live head of one, the next
-- waiter there is woken. The registry entry it recorded for a handoff goes too (see
-- _waiters.lua); a lease a release handed to it meanwhile is reported instead, for the caller
-- to release (release.lua, with that entry). Idempotent: a handed ticket is kept until then.
--
-- per resource i: KEYS[3i-2] its waiter queue, KEYS[3i-1] its tickets' expiry, KEYS[3i] its
-- handed tickets (KEYS[1] to KEYS[3] for the first); then, last, the owner's registry in the
-- group
-- ARGV[1] ticket   ARGV[2] waiter channel prefix   ARGV[3] "1" when PUBLISH counts receivers
-- exactly (not on a cluster)
-- then per resource i: mode ("x" or "s"), the registry entry recorded for a handoff ("": none)
-- returns per resource i the token of a lease handed to the ticket, or 0

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ticket, prefix, trust = ARGV[1], ARGV[2], ARGV[3] == '1'
local out = {}
for i = 0, (#KEYS - 1) / 3 - 1 do
  local wkey, ekey, hkey = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  local member, entry = ARGV[2 * i + 4] .. ticket, ARGV[2 * i + 5]
  local head = queue_head(wkey, ekey, now, hkey)
  local handed = handed_to(hkey, member)
  if not handed then
    handed = 0
    if entry ~= '' then
      redis.call('SREM', KEYS[#KEYS], entry)
    end
    dequeue(wkey, ekey, member, hkey)
    if head == member then
      wake_head(wkey, ekey, now, prefix, trust, nil, '0', hkey)
    end
  end
  out[#out + 1] = handed
end
return out
