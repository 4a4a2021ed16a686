//! The one-key Lua scripts that give Redis memcached's semantics where its own commands differ:
//! a fenced write (`cas`) compares the stored stamp (`item.rs`) before writing; counters keep
//! memcached's rules (a missing counter is not created, `decr` stops at 0, `incr` wraps at
//! 2^64), where `INCRBY` would create the key, go negative and fail past i64.
//!
//! Each touches only `KEYS[1]` (cluster-safe without hash tags). They are sent as `EVALSHA`;
//! a server that does not know one (restarted, `SCRIPT FLUSH`) answers `NOSCRIPT` without
//! running anything, and the call is sent again as `EVAL` with the source.

use sha1::{Digest, Sha1};

/// A script: its source and SHA-1 (what `EVALSHA` names it by).
#[derive(Debug)]
pub(crate) struct Script {
    pub(crate) source: &'static str,
    pub(crate) sha: String,
}

impl Script {
    fn new(source: &'static str) -> Script {
        Script {
            source,
            sha: Script::sha_of(source),
        }
    }

    /// The SHA-1 `EVALSHA` names `source` by.
    pub(crate) fn sha_of(source: &str) -> String {
        hex::encode(Sha1::digest(source.as_bytes()))
    }
}

/// `KEYS[1]`; `ARGV[1]` the fence (tag and expected stamp, 9 bytes; or, against a value another
/// client wrote, 16 hex digits of its SHA-1 with the top bit cleared), `ARGV[2]` the new stored
/// bytes, `ARGV[3]` `""` / `"PX"` / `"EXAT"` and `ARGV[4]` its number, `ARGV[5]` `"1"` to answer
/// the stored bytes after the write too. Answers `STORED`, `EXISTS` (another version) or
/// `NOT_FOUND`, or `{outcome, bytes or nil}`.
const CAS: &str = r"
local cur = redis.call('GET', KEYS[1])
local outcome = 'STORED'
if not cur then
  outcome = 'NOT_FOUND'
else
  -- As item.rs decodes: the tag, and a stamp that is neither 0 nor has the top bit set.
  local ours = string.len(cur) >= 13 and string.byte(cur, 1) == 161
    and string.byte(cur, 2) < 128 and string.sub(cur, 2, 9) ~= string.rep(string.char(0), 8)
  local seen = ''
  if ours then seen = string.sub(cur, 1, 9) end
  if string.len(ARGV[1]) == 16 then
    local h = redis.sha1hex(cur)
    seen = string.format('%x', tonumber(string.sub(h, 1, 1), 16) % 8) .. string.sub(h, 2, 16)
    if ours then seen = '' end
  end
  if seen ~= ARGV[1] then outcome = 'EXISTS' end
end
if outcome == 'STORED' then
  if ARGV[3] == '' then
    redis.call('SET', KEYS[1], ARGV[2])
  else
    redis.call('SET', KEYS[1], ARGV[2], ARGV[3], ARGV[4])
  end
end
if ARGV[5] == '1' then
  return {outcome, redis.call('GET', KEYS[1])}
end
return outcome
";

/// `KEYS[1]`; `ARGV[1]` the delta (decimal, < 2^64), `ARGV[2]` `"+"` or `"-"`, `ARGV[3]` the new
/// stamp (8 bytes). A missing key answers nil (not created); bytes that are not a newcache item
/// holding decimal digits answer the error `NOTCOUNTER`. The new value keeps the item's flags
/// and expiry (`KEEPTTL`), gets the new stamp, and is answered as decimal digits. Arithmetic is on
/// decimal strings: Lua's numbers are doubles, exact only to 2^53.
const ARITH: &str = r"
local cur = redis.call('GET', KEYS[1])
if not cur then
  return false
end
if string.len(cur) < 14 or string.byte(cur, 1) ~= 161 then
  return redis.error_reply('NOTCOUNTER not a counter newcache wrote')
end
local digits = string.sub(cur, 14)
if string.len(digits) > 20 or not string.find(digits, '^%d+$') then
  return redis.error_reply('NOTCOUNTER not a counter newcache wrote')
end
local function trim(s)
  local t = string.gsub(s, '^0+', '')
  if t == '' then return '0' end
  return t
end
local function less(a, b)
  if string.len(a) ~= string.len(b) then return string.len(a) < string.len(b) end
  return a < b
end
local function add(a, b)
  local out, carry, i, j = {}, 0, string.len(a), string.len(b)
  while i > 0 or j > 0 or carry > 0 do
    local s = carry
    if i > 0 then s = s + string.byte(a, i) - 48; i = i - 1 end
    if j > 0 then s = s + string.byte(b, j) - 48; j = j - 1 end
    table.insert(out, 1, string.char(48 + s % 10))
    carry = math.floor(s / 10)
  end
  return trim(table.concat(out))
end
local function sub(a, b)
  local out, borrow, i, j = {}, 0, string.len(a), string.len(b)
  while i > 0 do
    local s = string.byte(a, i) - 48 - borrow
    if j > 0 then s = s - (string.byte(b, j) - 48); j = j - 1 end
    if s < 0 then s = s + 10; borrow = 1 else borrow = 0 end
    table.insert(out, 1, string.char(48 + s))
    i = i - 1
  end
  return trim(table.concat(out))
end
local n, d = trim(digits), trim(ARGV[1])
local wrap = '18446744073709551616'
if not less(n, wrap) then
  return redis.error_reply('NOTCOUNTER not a counter newcache wrote')
end
local r
if ARGV[2] == '+' then
  r = add(n, d)
  if not less(r, wrap) then r = sub(r, wrap) end
elseif less(n, d) then
  r = '0'
else
  r = sub(n, d)
end
redis.call('SET', KEYS[1], string.sub(cur, 1, 1) .. ARGV[3] .. string.sub(cur, 10, 13) .. r, 'KEEPTTL')
return r
";

/// The scripts, hashed once.
#[derive(Debug)]
pub(crate) struct Scripts {
    pub(crate) cas: Script,
    pub(crate) arith: Script,
}

impl Scripts {
    pub(crate) fn new() -> Scripts {
        Scripts {
            cas: Script::new(CAS),
            arith: Script::new(ARITH),
        }
    }
}
