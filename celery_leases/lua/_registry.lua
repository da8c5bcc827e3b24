-- _registry.lua: the owner registry's expiry, put into acquire.lua and unique_handover.lua
-- (see _scripts.py), the two scripts that record grants in a registry.
--
-- A registry must outlive every lease it records, so a cleanup always finds them. The caller
-- sends the expiry in ms as text: "<ms>" to set it; "-<ms>" to set it only if this call made
-- the registry (the caller believes it lives that long, but the release of the owner's last
-- entry in the group emptied it, so Redis deleted it and its expiry with it); "0": nothing to
-- set. made: how many entries this call added (the registry has no more when it made it).

local function keep_registry(key, expiry, made)
  if string.byte(expiry) ~= 45 then  -- not "-": set it, or "0"
    if expiry ~= '0' then
      redis.call('PEXPIRE', key, expiry)
    end
  elseif redis.call('SCARD', key) == made then
    -- t0 a release takes the owner's last entry: the set goes, and its expiry; t1 a grant's
    -- SADD makes it anew, without one, and a crash of the owner would leave it for good
    redis.call('PEXPIRE', key, string.sub(expiry, 2))
  end
end
