//! The two clocks a Redis store converts between: Unix milliseconds (the
//! prefix stamps and horizons in Redis, shared by every host) and the
//! host's segment clock (its prefix [`Stamp`]s, whole seconds since the
//! segment was created).

use shm_layout::Stamp;

/// Milliseconds since the Unix epoch: the prefix stamps written to Redis
/// (shared by every host, unlike a segment's clock).
pub(super) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A Redis prefix stamp (Unix ms) as the segment's prefix [`Stamp`] (whole
/// seconds since the segment was created, rounded down), given the two
/// clocks' readings now; `None` for a stamp from before the segment (a
/// horizon there would be later than the stamp).
pub(super) fn segment_stamp(stamp_ms: u64, segment_now_ms: u64, unix_now_ms: u64) -> Option<Stamp> {
    let segment_ms = segment_now_ms.checked_sub(unix_now_ms.saturating_sub(stamp_ms))?;
    Some(Stamp((segment_ms / 1000) as u16))
}

/// Segment second `at_s` as Unix ms, given the two clocks' readings now
/// (never later than the Unix time of any stamp in that second).
pub(super) fn unix_at(at_s: u32, segment_now_ms: u64, unix_now_ms: u64) -> u64 {
    unix_now_ms.saturating_sub(segment_now_ms.saturating_sub(u64::from(at_s) * 1000))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// without ever putting a horizon after the stamp it came from.
    #[test]
    fn stamps_convert_between_the_clocks_conservatively() {
        // The segment was created at Unix 1_000_000 ms; it is now 75.5 s old.
        let (segment_now, unix_now) = (75_500, 1_075_500);
        assert_eq!(segment_stamp(1_070_999, segment_now, unix_now), Some(Stamp(70)));
        assert_eq!(segment_stamp(1_000_000, segment_now, unix_now), Some(Stamp(0)));
        assert_eq!(
            segment_stamp(999_999, segment_now, unix_now),
            None,
            "older than the segment"
        );
        assert_eq!(unix_at(70, segment_now, unix_now), 1_070_000);
        for stamp in [1_000_000, 1_000_999, 1_070_999, 1_075_500] {
            let s = segment_stamp(stamp, segment_now, unix_now).unwrap();
            assert!(unix_at(u32::from(s.0), segment_now, unix_now) <= stamp);
        }
    }
}
