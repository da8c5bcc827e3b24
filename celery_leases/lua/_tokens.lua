-- _tokens.lua: the fencing token of a grant, put into acquire.lua, unique_claim.lua and
-- unique_handover.lua (see _scripts.py), so that the three make tokens alike.
--
-- A token is above every earlier token of the resource and at least the Redis clock in
-- microseconds (now_us). The resource's counter key remembers the last one for memory ms
-- (the token_memory setting), which covers grants that run ahead of the clock and small steps
-- back of the server clock. With memory "0" no counter is written: one left by a caller with
-- a memory still counts, and the caller adds what else it must stay above (a shared holder,
-- a queued claim). One call in the common case, which also returns the token's text.

-- The Redis clock of a TIME reply: in ms, in us, and the us as text, put together from the
-- reply's two strings (string.format costs a script about as much as a call, tonumber a third
-- of one: each runs once here).
local function clock_of(t)
  local s, us = tonumber(t[1]), tonumber(t[2])
  local text = t[1] .. string.sub('00000' .. t[2], -6)  -- TIME's us has no leading zeros
  return s * 1000 + math.floor(us / 1000), s * 1000000 + us, text
end

-- The token and its text (nil when it is not now_text: the caller formats it).
local function next_token(ckey, now_us, now_text, memory)
  if memory ~= '0' then
    local last = redis.call('SET', ckey, now_text, 'PX', memory, 'GET')
    last = last and tonumber(last) or 0
    if last < now_us then
      return now_us, now_text
    end
    -- granted twice in one microsecond, or the server clock stepped back: stay above
    redis.call('SET', ckey, string.format('%.0f', last + 1), 'PX', memory)
    return last + 1
  end
  local token = math.max(now_us, tonumber(redis.call('GET', ckey) or '0') + 1)
  return token, token == now_us and now_text or nil
end
