//! The Lua scripts the Redis store runs server-side (see
//! [`super::client`] for the data model they work on): each is one round
//! trip that would otherwise be several, and runs atomically.

/// Insert: for each key, set the server's stamp, cap the entry at
/// `ARGV[4]` servers by evicting the stalest other one, renew the TTL.
pub(crate) const INSERT_SCRIPT: &str = r#"
local server = ARGV[1]
local now = ARGV[2]
local ttl = ARGV[3]
local lanes = tonumber(ARGV[4])
for _, key in ipairs(KEYS) do
  redis.call('HSET', key, server, now)
  if redis.call('HLEN', key) > lanes then
    local f = redis.call('HGETALL', key)
    local victim, vstamp = nil, nil
    for j = 1, #f, 2 do
      if f[j] ~= server then
        local s = tonumber(f[j + 1]) or -1
        if vstamp == nil or s < vstamp or (s == vstamp and f[j] < victim) then
          victim, vstamp = f[j], s
        end
      end
    end
    if victim then redis.call('HDEL', key, victim) end
  end
  redis.call('PEXPIRE', key, ttl)
end
return #KEYS
"#;

/// Longest-prefix match: `KEYS[1]` is the horizon hash, the other keys
/// the chain's; walk them in chain order, stop at the first missing one,
/// skip a server's fields stamped before its horizon, return `server id,
/// depth, stamp` triples (deepest depth per server, and that field's
/// stamp).
pub(crate) const LPM_SCRIPT: &str = r#"
local horizon = {}
local h = redis.call('HGETALL', KEYS[1])
for j = 1, #h, 2 do horizon[h[j]] = tonumber(h[j + 1]) end
local depth = {}
local stamp = {}
local order = {}
for i = 2, #KEYS do
  local f = redis.call('HGETALL', KEYS[i])
  if #f == 0 then break end
  for j = 1, #f, 2 do
    local n = f[j]
    local s = tonumber(f[j + 1]) or 0
    local limit = horizon[n]
    if limit == nil or s >= limit then
      if depth[n] == nil then order[#order + 1] = n end
      depth[n] = i - 1
      stamp[n] = s
    end
  end
end
local out = {}
for _, n in ipairs(order) do
  out[#out + 1] = n
  out[#out + 1] = depth[n]
  out[#out + 1] = stamp[n]
end
return out
"#;

/// Raise: set `ARGV[1]`'s horizon to `ARGV[2]` if that is later, renew
/// the hash's expiry (`ARGV[3]` ms); 1 if it moved.
pub(crate) const RAISE_SCRIPT: &str = r#"
local now = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') or 0
local moved = 0
if tonumber(ARGV[2]) > now then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  moved = 1
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return moved
"#;

/// Publish: replace one owner's counts (`ARGV[3..]` field/value pairs),
/// renew its lease of `ARGV[2]` ms, list it in the owner set.
pub(crate) const PUBLISH_SCRIPT: &str = r#"
local lease = tonumber(ARGV[2])
redis.call('DEL', KEYS[1])
if #ARGV > 2 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 3))
  redis.call('PEXPIRE', KEYS[1], lease)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now + lease, ARGV[1])
redis.call('PEXPIRE', KEYS[2], 86400000)
return 1
"#;

/// Sum: forget owners whose lease ended, sum the others' counts (hash
/// `ARGV[1] .. owner`), return `field, total` pairs.
pub(crate) const SUM_SCRIPT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local total = {}
local order = {}
for _, owner in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local f = redis.call('HGETALL', ARGV[1] .. owner)
  for j = 1, #f, 2 do
    local n = tonumber(f[j + 1]) or 0
    if total[f[j]] == nil then order[#order + 1] = f[j]; total[f[j]] = 0 end
    total[f[j]] = total[f[j]] + n
  end
end
local out = {}
for _, k in ipairs(order) do
  out[#out + 1] = k
  out[#out + 1] = total[k]
end
return out
"#;

/// Rate limits (GCRA, as [`shm_layout::limit_table`]): `KEYS` are a
/// request's buckets, `ARGV[1]` is `take` (all or none), `charge` (room
/// or not, into debt up to 60 periods: `DEBT_PERIODS`) or `refund` (give
/// back, never fuller than full), then `limit, period (µs), units` per
/// key. A bucket is its `tat` in Redis's clock (µs), expiring when full
/// again. Returns `{0, ahead...}` (µs each bucket is from full, after the
/// charge), `{-1, i}` (key `i` is charged more than it ever holds) or
/// `{-2, i, retry, ahead}` (key `i` has no room: retry in `retry` µs;
/// nothing was charged).
pub(crate) const LIMIT_SCRIPT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local mode = ARGV[1]
local new = {}
local out = {0}
for i, key in ipairs(KEYS) do
  local limit = tonumber(ARGV[3 * i - 1])
  local period = tonumber(ARGV[3 * i])
  local n = tonumber(ARGV[3 * i + 1])
  local horizon = 61 * period
  local tat = tonumber(redis.call('GET', key)) or now
  if tat < now or tat > now + horizon then tat = now end
  local cost = math.ceil(n * period / limit)
  local ahead
  if mode == 'refund' then
    ahead = math.max(tat - cost, now) - now
  else
    ahead = tat + cost - now
  end
  if mode == 'take' then
    if n > limit then return {-1, i} end
    if ahead > period then return {-2, i, ahead - period, tat - now} end
  elseif ahead > horizon then
    ahead = horizon
  end
  new[i] = now + ahead
  out[#out + 1] = ahead
end
for i, key in ipairs(KEYS) do
  if new[i] > now then
    redis.call('SET', key, string.format('%d', new[i]), 'PX', math.ceil((new[i] - now) / 1000) + 1)
  elseif mode == 'refund' then
    redis.call('DEL', key)
  end
end
return out
"#;
