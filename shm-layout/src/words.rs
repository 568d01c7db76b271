//! Copying bytes into and out of shared memory through atomic words.
//!
//! Another process may write the same memory while we read it (a reader then
//! discards the copy after validating it). In Rust such a race is only
//! defined if both sides use atomics, so byte payloads are stored as
//! little-endian `u64` words and copied word by word with `Relaxed`
//! operations; the tables add the fences and validation around the copy.

use crate::sync::{AtomicU64, Ordering};

/// Number of 8-byte words needed for `len` bytes.
#[inline]
pub(crate) const fn words_for(len: usize) -> usize {
    len.div_ceil(8)
}

/// Writes `bytes` into `dst` (which must hold `words_for(bytes.len())` words),
/// zero-padding the last word.
pub(crate) fn store_bytes(dst: &[AtomicU64], bytes: &[u8]) {
    debug_assert!(dst.len() >= words_for(bytes.len()));
    let mut chunks = bytes.chunks_exact(8);
    for (w, c) in dst.iter().zip(&mut chunks) {
        w.store(
            u64::from_le_bytes(c.try_into().expect("8-byte chunk")),
            Ordering::Relaxed,
        );
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut last = [0u8; 8];
        last[..rest.len()].copy_from_slice(rest);
        dst[bytes.len() / 8].store(u64::from_le_bytes(last), Ordering::Relaxed);
    }
}

/// Copies `len` bytes out of `src` into `out` (replacing its contents).
pub(crate) fn load_bytes(src: &[AtomicU64], len: usize, out: &mut Vec<u8>) {
    debug_assert!(src.len() >= words_for(len));
    out.clear();
    out.resize(len, 0);
    let mut chunks = out.chunks_exact_mut(8);
    for (dst, w) in (&mut chunks).zip(src) {
        dst.copy_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let n = rest.len();
        rest.copy_from_slice(&src[len / 8].load(Ordering::Relaxed).to_le_bytes()[..n]);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_length() {
        let words: Vec<AtomicU64> = (0..8).map(|_| AtomicU64::new(u64::MAX)).collect();
        let mut out = Vec::new();
        for len in 0..=64 {
            let bytes: Vec<u8> = (0..len as u8).map(|b| b.wrapping_mul(37)).collect();
            store_bytes(&words, &bytes);
            load_bytes(&words, len, &mut out);
            assert_eq!(out, bytes);
        }
    }
}
