-- _registry.lua: recording grants in an owner registry, put into acquire.lua and
-- unique_handover.lua (see _scripts.py), the two scripts that grant.
--
-- A registry must outlive every lease it records, so a cleanup always finds them. Besides
-- its entries it holds the member "~" (no entry: entries start with a mode), which keeps the
-- set, and its expiry, through the releases of all the owner's leases: without it the last
-- release empties the set, Redis deletes it with its expiry, and the next grant made it anew
-- without one (a crash of the owner then left it for good). "~" is added with the entries,
-- in the same SADD, whose count tells a registry made now (or one a cleanup emptied) at no
-- extra call.
--
-- The caller sends the expiry in ms as text: "<ms>" to set it; "-<ms>" to set it only if
-- this call made the registry (the caller believes it lives that long); "0": nothing to set.

local function record_grants(key, entries, expiry)
  local added = redis.call('SADD', key, '~', unpack(entries))
  if string.byte(expiry) ~= 45 then  -- not "-": set it, or "0"
    if expiry ~= '0' then
      redis.call('PEXPIRE', key, expiry)
    end
  elseif added > #entries then
    redis.call('PEXPIRE', key, string.sub(expiry, 2))
  end
end
