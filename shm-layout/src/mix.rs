//! Hashing helpers shared by the tables: a 64-bit finaliser for slot
//! fingerprints and keyed checksums (XXH3) for variable-length records.
//!
//! Both are keyed with the segment's random seed (written at creation), so
//! nobody outside the gateway host can craft a record or a slot that passes
//! the checks.

/// Murmur3's 64-bit finaliser: a bijective mixer with full avalanche. Used
/// to bind a slot's key half to its value half (`key ^ mix64(value ^ seed)`):
/// flipping any bit of either half makes the key comparison fail.
#[inline]
pub(crate) const fn mix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^= x >> 33;
    x
}

/// A keyed checksum over a record: the segment seed, the record's identity
/// words (position, key, length) and its payload bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Checksum {
    seed: [u64; 4],
}

impl Checksum {
    pub(crate) const fn new(seed: [u64; 4]) -> Self {
        Self { seed }
    }

    /// Checksum of `ident` words and `payload` bytes: the identity words and
    /// the segment seed are folded into a 64-bit seed for XXH3 (about 16
    /// bytes a cycle; seahash, used for token-block hashes, is 2-3x slower
    /// on 4 KiB payloads). An integrity check against accidents and blind
    /// forgery (the seed never leaves the host), not a cryptographic MAC.
    pub(crate) fn of(&self, ident: &[u64], payload: &[u8]) -> u64 {
        let mut seed = mix64(self.seed[0] ^ mix64(self.seed[1] ^ mix64(self.seed[3])));
        for w in ident {
            seed = mix64(seed ^ w).wrapping_add(self.seed[2]);
        }
        // Never 0: a zeroed (never written) record must not pass.
        xxhash_rust::xxh3::xxh3_64_with_seed(payload, seed) | 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix64_is_not_identity_and_avalanches() {
        assert_eq!(mix64(0), 0, "murmur fmix maps 0 to 0; callers key it with the seed");
        let a = mix64(1);
        let b = mix64(1 | 1 << 40);
        assert!((a ^ b).count_ones() > 16);
    }

    #[test]
    fn checksum_depends_on_every_input() {
        let c = Checksum::new([1, 2, 3, 4]);
        let base = c.of(&[7, 8], b"hello");
        assert_ne!(base, c.of(&[7, 9], b"hello"));
        assert_ne!(base, c.of(&[7, 8], b"hellp"));
        assert_ne!(base, Checksum::new([1, 2, 3, 5]).of(&[7, 8], b"hello"));
        assert_ne!(c.of(&[], b""), 0);
    }
}
