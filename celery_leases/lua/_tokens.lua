-- _tokens.lua: the fencing token of a grant, put into acquire.lua, unique_claim.lua and
-- unique_handover.lua (see _scripts.py), so that the three make tokens alike.
--
-- A token is above every earlier token of the resource and at least the Redis clock in
-- microseconds (now_us). The resource's counter key remembers the last one for memory ms
-- (the token_memory setting), which covers grants that run ahead of the clock and small steps
-- back of the server clock. With memory "0" no counter is written: one left by a caller with
-- a memory still counts, and the caller adds what else it must stay above (a shared holder,
-- a queued claim). One call in the common case, which also returns the token's text (formatting
-- it costs a script about as much as a call).
local function next_token(ckey, now_us, memory)
  if memory ~= '0' then
    local text = string.format('%.0f', now_us)
    local last = tonumber(redis.call('SET', ckey, text, 'PX', memory, 'GET') or '0')
    if last < now_us then
      return now_us, text
    end
    -- granted twice in one microsecond, or the server clock stepped back: stay above
    redis.call('SET', ckey, string.format('%.0f', last + 1), 'PX', memory)
    return last + 1
  end
  return math.max(now_us, tonumber(redis.call('GET', ckey) or '0') + 1)
end
