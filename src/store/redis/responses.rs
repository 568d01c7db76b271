//! Cached responses (`{ns}:r:<key>`): sealed with a checksum so that a
//! value changed in Redis is a miss, read and written one round trip each.

use std::time::Duration;

use super::connection::{RedisStore, millis};
use super::error::StoreError;

/// Bytes of the checksum a cached response carries in Redis.
const CHECKSUM_BYTES: usize = 8;

/// A cached response as Redis stores it: an XXH3-64 of the body, then the
/// body, so that a value changed in Redis (by another writer of the
/// namespace, a bit flip, a truncation) is found out on read.
pub(crate) fn sealed(body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(CHECKSUM_BYTES + body.len());
    v.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(body).to_le_bytes());
    v.extend_from_slice(body);
    v
}

/// The body of a [`sealed`] value whose checksum holds; `None` otherwise
/// (a miss: the entry is not trusted).
pub(crate) fn unsealed(mut value: Vec<u8>) -> Option<Vec<u8>> {
    let sum: [u8; CHECKSUM_BYTES] = value.get(..CHECKSUM_BYTES)?.try_into().ok()?;
    if u64::from_le_bytes(sum) != xxhash_rust::xxh3::xxh3_64(&value[CHECKSUM_BYTES..]) {
        return None;
    }
    value.drain(..CHECKSUM_BYTES);
    Some(value)
}

impl RedisStore {
    /// The cached response for `key`, if present and not expired. One round trip.
    pub fn get_response(&mut self, key: u128) -> Result<Option<Vec<u8>>, StoreError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.response_key(key));
        let value: Option<Vec<u8>> = self.query("get_response", &cmd)?;
        Ok(value.and_then(unsealed))
    }

    /// Caches `value` under `key` for `ttl` (at least 1 ms). One round trip.
    pub fn put_response(&mut self, key: u128, value: &[u8], ttl: Duration) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.response_key(key))
            .arg(sealed(value))
            .arg("PX")
            .arg(millis(ttl));
        self.query::<()>("put_response", &cmd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_response_reads_back_and_a_changed_one_does_not() {
        let body = br#"{"id":"cmpl-1","choices":[]}"#;
        let v = sealed(body);
        assert_eq!(unsealed(v.clone()).as_deref(), Some(&body[..]));
        for i in 0..v.len() {
            let mut flipped = v.clone();
            flipped[i] ^= 0x10;
            assert_eq!(unsealed(flipped), None, "a flip at byte {i}");
        }
        assert_eq!(unsealed(v[..v.len() - 1].to_vec()), None, "truncated");
        assert_eq!(unsealed(body[..7].to_vec()), None, "shorter than a checksum");
        assert_eq!(unsealed(sealed(b"")), Some(Vec::new()));
    }
}
