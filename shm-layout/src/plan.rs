//! How a segment of a given size is carved into regions.
//!
//! Everything is derived from the size the operator gives (`--shm-size`),
//! so two processes that agree on the size agree on the layout; the header
//! records the result anyway, and openers use the header.
//!
//! | region | size | derived how |
//! | --- | --- | --- |
//! | header | 4 KiB | fixed |
//! | server table | [`SERVER_SLOTS`] × 448 B | fixed |
//! | in-flight ledger | [`PROCESS_SLOTS`] × [`SERVER_SLOTS`] × 32 B | fixed (512 KiB) |
//! | process registry | [`PROCESS_SLOTS`] × 64 B | fixed |
//! | stats | [`PROCESS_SLOTS`] × [`STAT_WORDS`] × 8 B | fixed (1.5 MiB) |
//! | limits | [`LIMIT_SLOTS`] × 16 B | fixed (256 KiB): rate-limit buckets |
//! | usage | [`USAGE_SLOTS`] × 128 B | fixed (128 KiB): counts per tenant and model |
//! | completion rings | [`RING_COUNT`] × (256 B + ring bytes) | ring bytes = 1/8 of the rest / [`RING_COUNT`], rounded down to a power of two, clamped to 16 KiB ..= 4 MiB |
//! | response index | 1/64 of three quarters of half of what is left after the rings | 64-byte buckets of 4 slots |
//! | response log | the rest of those three quarters, less a page of control | byte ring; one value may take at most `max_response_fraction` of it (default 1/8) |
//! | segment index | 1/64 of the last quarter of that half | 64-byte buckets of 4 slots |
//! | segment log | the rest of that quarter, less a page of control | byte ring of token-id segments; one may take at most `max_response_fraction` of it |
//! | confirmed prefixes | 1/9 of the other half | 64-byte buckets of 4 slots: what engines said they hold (KV events) |
//! | prefix table | the rest of that half | 64-byte buckets of 4 slots |
//!
//! Every region starts on a 4 KiB boundary. For `--shm-size 256MiB` this
//! gives 6.98 M prefix slots (≈ 112 M tokens of prefix at 16 tokens a
//! block), 0.87 M confirmed slots (the blocks of about 35 engines of
//! 400 K tokens, at a table 40 % full), an 88 MiB response log with 92 K
//! index slots, a 29 MiB segment log with 30 K index slots, and 64 rings of
//! 256 KiB (`semlb shm inspect` prints the figures of any segment).

use crate::error::PlanError;

/// Page size regions are aligned to.
pub const PAGE: u64 = 4096;
/// Bytes of the header region.
pub const HEADER_BYTES: u64 = PAGE;
/// Inference-server slots in the server table (and lanes of the ledger).
pub const SERVER_SLOTS: u32 = 128;
/// Process slots in the registry (and rows of the in-flight ledger).
pub const PROCESS_SLOTS: u32 = 128;
/// Number of completion rings: one per dispatcher slot.
pub const RING_COUNT: u32 = 64;
/// Smallest segment accepted.
pub const MIN_SEGMENT_BYTES: u64 = 8 << 20;
/// Largest segment accepted.
pub const MAX_SEGMENT_BYTES: u64 = 1 << 40;
/// Default share of the response log one cached value may take.
pub const DEFAULT_MAX_RESPONSE_FRACTION: f64 = 0.125;
/// Counters per process block of the stats region.
pub const STAT_WORDS: usize = 1536;
/// Slots of the rate-limit table (4 per 64-byte bucket).
pub const LIMIT_SLOTS: u64 = 16_384;
/// Entries of the usage table (one per tenant or model).
pub const USAGE_SLOTS: u64 = 1024;

pub(crate) const SERVER_SLOT_BYTES: u64 = 448;
pub(crate) const LEDGER_CELL_BYTES: u64 = 32;
pub(crate) const PROCESS_SLOT_BYTES: u64 = 64;
pub(crate) const STAT_BLOCK_BYTES: u64 = 8 * STAT_WORDS as u64;
pub(crate) const RING_CONTROL_BYTES: u64 = 256;
pub(crate) const LOG_CONTROL_BYTES: u64 = 256;
pub(crate) const BUCKET_BYTES: u64 = 64;
pub(crate) const USAGE_ENTRY_BYTES: u64 = 128;
const MIN_RING_BYTES: u64 = 16 << 10;
pub(crate) const MAX_RING_BYTES: u64 = 4 << 20;

/// The regions of a segment, in address order. The discriminant is the
/// region's index in the header's region table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum RegionKind {
    /// Inference-server slots.
    Servers = 0,
    /// Per-process, per-server in-flight counts (crash accounting).
    Ledger = 1,
    /// Process registry.
    Registry = 2,
    /// Per-process counter blocks (metrics).
    Stats = 3,
    /// Completion rings.
    Rings = 4,
    /// Response-cache index buckets.
    ResponseIndex = 5,
    /// Response-cache record log.
    ResponseLog = 6,
    /// Prefix-table buckets.
    Prefix = 7,
    /// Token-segment store index buckets.
    SegmentIndex = 8,
    /// Token-segment store record log.
    SegmentLog = 9,
    /// Rate-limit buckets ([`crate::limit_table`]).
    Limits = 10,
    /// Usage per tenant and model ([`crate::usage_table`]).
    Usage = 11,
    /// Prefix-table buckets of the engines' confirmed blocks (their KV
    /// cache events), apart from the gateway's estimate in [`Self::Prefix`].
    Confirmed = 12,
}

/// Number of regions.
pub const REGION_COUNT: usize = 13;

impl RegionKind {
    /// All regions in address order.
    pub const ALL: [RegionKind; REGION_COUNT] = [
        RegionKind::Servers,
        RegionKind::Ledger,
        RegionKind::Registry,
        RegionKind::Stats,
        RegionKind::Limits,
        RegionKind::Usage,
        RegionKind::Rings,
        RegionKind::ResponseIndex,
        RegionKind::ResponseLog,
        RegionKind::SegmentIndex,
        RegionKind::SegmentLog,
        RegionKind::Confirmed,
        RegionKind::Prefix,
    ];

    /// Human name, as `semlb shm inspect` prints it.
    pub const fn name(self) -> &'static str {
        match self {
            RegionKind::Servers => "servers",
            RegionKind::Ledger => "in-flight ledger",
            RegionKind::Registry => "process registry",
            RegionKind::Stats => "stats",
            RegionKind::Rings => "completion rings",
            RegionKind::ResponseIndex => "response index",
            RegionKind::ResponseLog => "response log",
            RegionKind::Prefix => "prefix table",
            RegionKind::SegmentIndex => "segment index",
            RegionKind::SegmentLog => "segment log",
            RegionKind::Limits => "rate limits",
            RegionKind::Usage => "usage",
            RegionKind::Confirmed => "confirmed prefixes",
        }
    }
}

/// One region: where it is, how big, how many elements, and one parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Region {
    /// Byte offset from the segment start (multiple of [`PAGE`]).
    pub offset: u64,
    /// Bytes reserved for the region.
    pub bytes: u64,
    /// Element count: slots, buckets, rings or log bytes.
    pub count: u64,
    /// Region-specific: ring bytes (rings), max value bytes (response and
    /// segment logs), server slots per ledger row (ledger), counters per
    /// block (stats); 0 otherwise.
    pub param: u64,
}

/// The full layout for one segment size. Only [`LayoutPlan::new`] makes
/// one, so every plan in existence is valid (the fields are private on
/// purpose: a hand-made plan could describe regions past the segment's end).
#[derive(Debug, Clone, PartialEq)]
pub struct LayoutPlan {
    segment_bytes: u64,
    regions: [Region; REGION_COUNT],
}

/// Options beyond the size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanOptions {
    /// Largest share of the response log one value may take; larger values
    /// are refused, never truncated.
    pub max_response_fraction: f64,
}

impl Default for PlanOptions {
    fn default() -> Self {
        Self {
            max_response_fraction: DEFAULT_MAX_RESPONSE_FRACTION,
        }
    }
}

const fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

const fn align_down(x: u64, a: u64) -> u64 {
    x / a * a
}

impl LayoutPlan {
    /// The layout for `segment_bytes` with default options.
    pub fn for_size(segment_bytes: u64) -> Result<Self, PlanError> {
        Self::new(segment_bytes, PlanOptions::default())
    }

    /// The layout for `segment_bytes`.
    pub fn new(segment_bytes: u64, options: PlanOptions) -> Result<Self, PlanError> {
        if segment_bytes < MIN_SEGMENT_BYTES {
            return Err(PlanError::TooSmall {
                requested: segment_bytes,
                min: MIN_SEGMENT_BYTES,
            });
        }
        if segment_bytes > MAX_SEGMENT_BYTES {
            return Err(PlanError::TooLarge {
                requested: segment_bytes,
                max: MAX_SEGMENT_BYTES,
            });
        }
        let f = options.max_response_fraction;
        if !(f > 0.0 && f <= 0.5) {
            return Err(PlanError::BadResponseFraction { value: f });
        }
        let size = align_down(segment_bytes, PAGE);
        let mut regions = [Region::default(); REGION_COUNT];
        let mut cursor = HEADER_BYTES;
        let mut place = |kind: RegionKind, bytes: u64, count: u64, param: u64| {
            regions[kind as usize] = Region {
                offset: cursor,
                bytes,
                count,
                param,
            };
            cursor += align_up(bytes, PAGE);
            cursor
        };
        let servers = u64::from(SERVER_SLOTS);
        let processes = u64::from(PROCESS_SLOTS);
        place(RegionKind::Servers, servers * SERVER_SLOT_BYTES, servers, 0);
        place(
            RegionKind::Ledger,
            processes * servers * LEDGER_CELL_BYTES,
            processes * servers,
            servers,
        );
        place(RegionKind::Registry, processes * PROCESS_SLOT_BYTES, processes, 0);
        place(
            RegionKind::Stats,
            processes * STAT_BLOCK_BYTES,
            processes,
            STAT_WORDS as u64,
        );
        let limit_buckets = LIMIT_SLOTS / crate::bucket::WAYS as u64;
        place(RegionKind::Limits, limit_buckets * BUCKET_BYTES, limit_buckets, 0);
        let fixed_end = place(RegionKind::Usage, USAGE_SLOTS * USAGE_ENTRY_BYTES, USAGE_SLOTS, 0);

        let rings = u64::from(RING_COUNT);
        let per_ring = ((size - fixed_end) / 8 / rings).clamp(MIN_RING_BYTES, MAX_RING_BYTES);
        let ring_bytes = 1u64 << (63 - per_ring.leading_zeros());
        let rings_end = place(
            RegionKind::Rings,
            rings * (RING_CONTROL_BYTES + ring_bytes),
            rings,
            ring_bytes,
        );

        // Half of the rest for the two keyed logs: three quarters for
        // responses, a quarter for token segments.
        let logs_share = align_down((size - rings_end) / 2, PAGE);
        let segment_share = align_down(logs_share / 4, PAGE);
        let mut keyed_log = |index: RegionKind, log: RegionKind, share: u64| {
            let index_bytes = align_down(share / 64, PAGE).max(PAGE);
            place(index, index_bytes, index_bytes / BUCKET_BYTES, 0);
            let log_bytes = align_down(share - index_bytes - PAGE, PAGE);
            let max_value = align_down((log_bytes as f64 * f) as u64, 8);
            place(log, LOG_CONTROL_BYTES + log_bytes, log_bytes, max_value)
        };
        keyed_log(
            RegionKind::ResponseIndex,
            RegionKind::ResponseLog,
            logs_share - segment_share,
        );
        let log_end = keyed_log(RegionKind::SegmentIndex, RegionKind::SegmentLog, segment_share);

        let confirmed_bytes = align_down((size - log_end) / 9, PAGE).max(PAGE);
        let confirmed_end = place(
            RegionKind::Confirmed,
            confirmed_bytes,
            confirmed_bytes / BUCKET_BYTES,
            0,
        );
        let prefix_bytes = align_down(size - confirmed_end, PAGE);
        let cursor = place(RegionKind::Prefix, prefix_bytes, prefix_bytes / BUCKET_BYTES, 0);
        debug_assert!(cursor <= size);
        Ok(Self {
            segment_bytes: size,
            regions,
        })
    }

    /// Total segment bytes (the requested size rounded down to a page).
    pub fn segment_bytes(&self) -> u64 {
        self.segment_bytes
    }

    /// Every region, indexed by [`RegionKind`].
    pub fn regions(&self) -> &[Region; REGION_COUNT] {
        &self.regions
    }

    /// One region's placement.
    pub fn region(&self, kind: RegionKind) -> Region {
        self.regions[kind as usize]
    }

    /// Prefix-table slots (4 per bucket).
    pub fn prefix_slots(&self) -> u64 {
        self.region(RegionKind::Prefix).count * crate::bucket::WAYS as u64
    }

    /// Confirmed-prefix slots (4 per bucket).
    pub fn confirmed_slots(&self) -> u64 {
        self.region(RegionKind::Confirmed).count * crate::bucket::WAYS as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_ordered_aligned_and_inside() {
        for size in [MIN_SEGMENT_BYTES, 64 << 20, 256 << 20, (1 << 30) + 12345, 16 << 30] {
            let plan = LayoutPlan::for_size(size).unwrap();
            let mut end = HEADER_BYTES;
            for kind in RegionKind::ALL {
                let r = plan.region(kind);
                assert_eq!(r.offset % PAGE, 0, "{kind:?} at {size}");
                assert!(r.offset >= end, "{kind:?} overlaps at {size}");
                assert!(r.count > 0, "{kind:?} empty at {size}");
                end = r.offset + r.bytes;
            }
            assert!(end <= plan.segment_bytes);
            for kind in [RegionKind::ResponseLog, RegionKind::SegmentLog] {
                let log = plan.region(kind);
                assert!(log.param > 0 && log.param <= log.count / 8, "{kind:?} at {size}");
            }
            let (responses, segments) = (
                plan.region(RegionKind::ResponseLog).count,
                plan.region(RegionKind::SegmentLog).count,
            );
            assert!(
                segments * 2 < responses && segments * 4 > responses,
                "{segments} {responses}"
            );
        }
    }

    #[test]
    fn stats_region_is_fixed_and_the_smallest_segment_still_plans() {
        let small = LayoutPlan::for_size(MIN_SEGMENT_BYTES).unwrap();
        let big = LayoutPlan::for_size(16 << 30).unwrap();
        let s = small.region(RegionKind::Stats);
        assert_eq!(
            s,
            Region {
                offset: s.offset,
                ..big.region(RegionKind::Stats)
            }
        );
        assert_eq!((s.bytes, s.count, s.param), (3 << 19, 128, 1536));
        assert!(small.prefix_slots() > 50_000, "{} prefix slots", small.prefix_slots());
    }

    #[test]
    fn sizes_scale_with_the_segment() {
        let small = LayoutPlan::for_size(64 << 20).unwrap();
        let big = LayoutPlan::for_size(256 << 20).unwrap();
        assert!(big.prefix_slots() > 3 * small.prefix_slots());
        assert!(big.confirmed_slots() > 3 * small.confirmed_slots());
        // The estimate keeps eight ninths, the confirmed blocks one.
        let ratio = big.prefix_slots() as f64 / big.confirmed_slots() as f64;
        assert!((7.9..8.1).contains(&ratio), "{ratio}");
        assert_eq!(big.region(RegionKind::Rings).param, 256 << 10);
    }

    #[test]
    fn rejects_bad_sizes_and_fractions() {
        assert!(matches!(LayoutPlan::for_size(1 << 20), Err(PlanError::TooSmall { .. })));
        assert!(matches!(
            LayoutPlan::for_size(u64::MAX),
            Err(PlanError::TooLarge { .. })
        ));
        let bad = PlanOptions {
            max_response_fraction: 0.9,
        };
        assert!(matches!(
            LayoutPlan::new(64 << 20, bad),
            Err(PlanError::BadResponseFraction { .. })
        ));
        let nan = PlanOptions {
            max_response_fraction: f64::NAN,
        };
        assert!(LayoutPlan::new(64 << 20, nan).is_err());
    }
}
