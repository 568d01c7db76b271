//! The segment header: the first 512 bytes of every segment (its fields;
//! the rest of the header page is reserved).
//!
//! It is written once by the creator, with the `state` word stored last
//! (`Release`); openers load `state` first (`Acquire`) and then trust the
//! rest only after checking magic, version, size, checksum and region
//! bounds. The field offsets are frozen by compile-time asserts below; any
//! change to them must bump [`LAYOUT_VERSION`].

use std::mem::{offset_of, size_of};

use crate::plan::{
    BUCKET_BYTES, HEADER_BYTES, LEDGER_CELL_BYTES, LOG_CONTROL_BYTES, LayoutPlan, MAX_RING_BYTES, PAGE,
    PROCESS_SLOT_BYTES, PROCESS_SLOTS, REGION_COUNT, RING_CONTROL_BYTES, RING_COUNT, Region, RegionKind,
    SERVER_SLOT_BYTES, SERVER_SLOTS, STAT_BLOCK_BYTES, STAT_WORDS, USAGE_ENTRY_BYTES, USAGE_SLOTS,
};
// The header is only ever used in a real segment, never in a loom model,
// so it takes std atomics directly (and its size asserts hold under loom).
use std::sync::atomic::{AtomicU64, Ordering};

/// `b"SEMLBSHM"` read as a little-endian `u64`.
pub const MAGIC: u64 = u64::from_le_bytes(*b"SEMLBSHM");
/// Version of the layout described in the crate docs. Bump on any change.
pub const LAYOUT_VERSION: u64 = 16;
/// `state` while the creator initialises the segment (the zero of a new object).
pub const STATE_INITIALISING: u64 = 0;
/// `state` once the segment may be used (`b"READY\0\0\0"`).
pub const STATE_READY: u64 = u64::from_le_bytes(*b"READY\0\0\0");

/// One region descriptor as stored: 4 words.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct RawRegion {
    offset: AtomicU64,
    bytes: AtomicU64,
    count: AtomicU64,
    param: AtomicU64,
}

/// The header as stored at offset 0.
#[repr(C, align(64))]
#[derive(Debug)]
pub(crate) struct RawHeader {
    magic: AtomicU64,
    layout_version: AtomicU64,
    segment_bytes: AtomicU64,
    state: AtomicU64,
    created_unix_ms: AtomicU64,
    created_monotonic_ns: AtomicU64,
    creator_pid: AtomicU64,
    header_checksum: AtomicU64,
    seed: [AtomicU64; 4],
    regions: [RawRegion; REGION_COUNT],
}

// The layout freeze: these numbers are the documented field table.
const _: () = assert!(size_of::<RawRegion>() == 32);
// 512 bytes of fields, a multiple of the 64-byte alignment.
const _: () = assert!(offset_of!(RawHeader, regions) + size_of::<[RawRegion; REGION_COUNT]>() == 512);
const _: () = assert!(size_of::<RawHeader>() == 512);
const _: () = assert!(size_of::<RawHeader>() as u64 <= HEADER_BYTES);
const _: () = assert!(offset_of!(RawHeader, magic) == 0);
const _: () = assert!(offset_of!(RawHeader, layout_version) == 8);
const _: () = assert!(offset_of!(RawHeader, segment_bytes) == 16);
const _: () = assert!(offset_of!(RawHeader, state) == 24);
const _: () = assert!(offset_of!(RawHeader, created_unix_ms) == 32);
const _: () = assert!(offset_of!(RawHeader, created_monotonic_ns) == 40);
const _: () = assert!(offset_of!(RawHeader, creator_pid) == 48);
const _: () = assert!(offset_of!(RawHeader, header_checksum) == 56);
const _: () = assert!(offset_of!(RawHeader, seed) == 64);
const _: () = assert!(offset_of!(RawHeader, regions) == 96);

/// A plain copy of the header, as read from a segment.
#[derive(Debug, Clone, PartialEq)]
pub struct HeaderInfo {
    /// Must be [`MAGIC`].
    pub magic: u64,
    /// Must be [`LAYOUT_VERSION`].
    pub layout_version: u64,
    /// Total bytes of the segment.
    pub segment_bytes: u64,
    /// [`STATE_READY`] once usable.
    pub state: u64,
    /// Wall-clock creation time, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// `CLOCK_MONOTONIC` at creation, ns: the origin of every stamp in the tables.
    pub created_monotonic_ns: u64,
    /// Pid of the creating process.
    pub creator_pid: u64,
    /// Checksum of every field but `state` and itself.
    pub header_checksum: u64,
    /// Random per-segment seed keying slot fingerprints and record checksums.
    pub seed: [u64; 4],
    /// Region placements, indexed by [`RegionKind`].
    pub regions: [Region; REGION_COUNT],
}

/// What the creator knows when it writes the header.
pub(crate) struct HeaderInit {
    pub created_unix_ms: u64,
    pub created_monotonic_ns: u64,
    pub creator_pid: u64,
    pub seed: [u64; 4],
}

impl HeaderInfo {
    fn from_plan(plan: &LayoutPlan, init: &HeaderInit) -> Self {
        let mut info = HeaderInfo {
            magic: MAGIC,
            layout_version: LAYOUT_VERSION,
            segment_bytes: plan.segment_bytes(),
            state: STATE_INITIALISING,
            created_unix_ms: init.created_unix_ms,
            created_monotonic_ns: init.created_monotonic_ns,
            creator_pid: init.creator_pid,
            header_checksum: 0,
            seed: init.seed,
            regions: *plan.regions(),
        };
        info.header_checksum = info.checksum();
        info
    }

    /// Checksum over every field except `state` and `header_checksum`.
    pub fn checksum(&self) -> u64 {
        let mut words = Vec::with_capacity(12 + 4 * REGION_COUNT);
        words.extend_from_slice(&[
            self.magic,
            self.layout_version,
            self.segment_bytes,
            self.created_unix_ms,
            self.created_monotonic_ns,
            self.creator_pid,
        ]);
        words.extend_from_slice(&self.seed);
        for r in &self.regions {
            words.extend_from_slice(&[r.offset, r.bytes, r.count, r.param]);
        }
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        seahash::hash(&bytes)
    }

    /// One region's placement.
    pub fn region(&self, kind: RegionKind) -> Region {
        self.regions[kind as usize]
    }

    /// Checks that the regions fit the segment, do not overlap, and hold
    /// what their counts say, so that attaching the tables cannot go out of
    /// bounds whatever bytes the header holds.
    pub(crate) fn check_regions(&self) -> Result<(), RegionError> {
        let mut end = HEADER_BYTES;
        for kind in RegionKind::ALL {
            let r = self.region(kind);
            let name = kind.name();
            if !r.offset.is_multiple_of(PAGE) || r.offset < end {
                return Err(RegionError::Misplaced { name, offset: r.offset });
            }
            let Some(r_end) = r.offset.checked_add(r.bytes).filter(|e| *e <= self.segment_bytes) else {
                return Err(RegionError::PastTheEnd {
                    name,
                    bytes: r.bytes,
                    offset: r.offset,
                });
            };
            end = r_end;
            let need = match kind {
                RegionKind::Servers => fixed(r, u64::from(SERVER_SLOTS), SERVER_SLOT_BYTES),
                RegionKind::Ledger => {
                    if r.param != u64::from(SERVER_SLOTS) {
                        return Err(RegionError::LedgerRow { name, cells: r.param });
                    }
                    fixed(r, u64::from(SERVER_SLOTS * PROCESS_SLOTS), LEDGER_CELL_BYTES)
                }
                RegionKind::Registry => fixed(r, u64::from(PROCESS_SLOTS), PROCESS_SLOT_BYTES),
                RegionKind::Stats => {
                    if r.param != STAT_WORDS as u64 {
                        return Err(RegionError::StatBlock { name, words: r.param });
                    }
                    fixed(r, u64::from(PROCESS_SLOTS), STAT_BLOCK_BYTES)
                }
                RegionKind::Rings => {
                    if !r.param.is_power_of_two() || !(4096..=MAX_RING_BYTES).contains(&r.param) {
                        return Err(RegionError::RingSize { name, bytes: r.param });
                    }
                    fixed(r, u64::from(RING_COUNT), RING_CONTROL_BYTES + r.param)
                }
                RegionKind::Usage => fixed(r, USAGE_SLOTS, USAGE_ENTRY_BYTES),
                RegionKind::ResponseIndex
                | RegionKind::SegmentIndex
                | RegionKind::Prefix
                | RegionKind::Confirmed
                | RegionKind::Limits => r.count.checked_mul(BUCKET_BYTES),
                RegionKind::ResponseLog | RegionKind::SegmentLog => {
                    if !r.count.is_multiple_of(8) || r.param == 0 || r.param > r.count / 2 || !r.param.is_multiple_of(8)
                    {
                        return Err(RegionError::LogShape {
                            name,
                            bytes: r.count,
                            max_value: r.param,
                        });
                    }
                    LOG_CONTROL_BYTES.checked_add(r.count)
                }
            };
            match need {
                Some(n) if n <= r.bytes && r.count > 0 => {}
                _ => {
                    return Err(RegionError::TooSmall {
                        name,
                        bytes: r.bytes,
                        count: r.count,
                    });
                }
            }
        }
        Ok(())
    }
}

/// Why a header's region table is refused ([`HeaderInfo::check_regions`]);
/// an open reports it as the segment's corruption. `name` is the region's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RegionError {
    /// Not page-aligned, or overlapping the region before it.
    #[error("{name} region at offset {offset} is misplaced")]
    Misplaced { name: &'static str, offset: u64 },
    /// Its end is past the segment's (or overflows).
    #[error("{name} region ({bytes} bytes at {offset}) runs past the segment")]
    PastTheEnd {
        name: &'static str,
        bytes: u64,
        offset: u64,
    },
    /// The ledger's rows are not one cell per server slot.
    #[error("{name} rows have {cells} cells, expected {SERVER_SLOTS}")]
    LedgerRow { name: &'static str, cells: u64 },
    /// The stats blocks are not [`STAT_WORDS`] words.
    #[error("{name} blocks have {words} words, expected {STAT_WORDS}")]
    StatBlock { name: &'static str, words: u64 },
    /// A ring's size is not a power of two in 4 KiB ..= 4 MiB.
    #[error("{name}: ring size {bytes} is not a power of two in 4 KiB ..= 4 MiB")]
    RingSize { name: &'static str, bytes: u64 },
    /// A log's size or its largest value is not one this layout writes.
    #[error("{name}: log of {bytes} bytes with values up to {max_value}")]
    LogShape {
        name: &'static str,
        bytes: u64,
        max_value: u64,
    },
    /// The region cannot hold its elements (or holds none).
    #[error("{name} region of {bytes} bytes cannot hold {count} elements")]
    TooSmall { name: &'static str, bytes: u64, count: u64 },
}

/// `count * elem` if `count` is the fixed count this layout version uses
/// (`None`, i.e. corrupt, on a wrong count or an overflow).
fn fixed(r: Region, expected: u64, elem: u64) -> Option<u64> {
    (r.count == expected).then(|| expected.checked_mul(elem)).flatten()
}

impl RawHeader {
    /// Writes every field but `state`; the caller publishes with [`Self::publish`]
    /// once the regions are initialised.
    pub(crate) fn write(&self, plan: &LayoutPlan, init: &HeaderInit) {
        let info = HeaderInfo::from_plan(plan, init);
        let r = Ordering::Relaxed;
        self.magic.store(info.magic, r);
        self.layout_version.store(info.layout_version, r);
        self.segment_bytes.store(info.segment_bytes, r);
        self.created_unix_ms.store(info.created_unix_ms, r);
        self.created_monotonic_ns.store(info.created_monotonic_ns, r);
        self.creator_pid.store(info.creator_pid, r);
        for (dst, v) in self.seed.iter().zip(info.seed) {
            dst.store(v, r);
        }
        for (dst, v) in self.regions.iter().zip(info.regions) {
            dst.offset.store(v.offset, r);
            dst.bytes.store(v.bytes, r);
            dst.count.store(v.count, r);
            dst.param.store(v.param, r);
        }
        self.header_checksum.store(info.header_checksum, r);
    }

    /// Marks the segment ready: the last write of the creator.
    pub(crate) fn publish(&self) {
        self.state.store(STATE_READY, Ordering::Release);
    }

    /// Reads the header, `state` first.
    pub(crate) fn read(&self) -> HeaderInfo {
        let state = self.state.load(Ordering::Acquire);
        let r = Ordering::Relaxed;
        let mut regions = [Region::default(); REGION_COUNT];
        for (dst, src) in regions.iter_mut().zip(&self.regions) {
            *dst = Region {
                offset: src.offset.load(r),
                bytes: src.bytes.load(r),
                count: src.count.load(r),
                param: src.param.load(r),
            };
        }
        HeaderInfo {
            magic: self.magic.load(r),
            layout_version: self.layout_version.load(r),
            segment_bytes: self.segment_bytes.load(r),
            state,
            created_unix_ms: self.created_unix_ms.load(r),
            created_monotonic_ns: self.created_monotonic_ns.load(r),
            creator_pid: self.creator_pid.load(r),
            header_checksum: self.header_checksum.load(r),
            seed: std::array::from_fn(|i| self.seed[i].load(r)),
            regions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> HeaderInfo {
        let plan = LayoutPlan::for_size(64 << 20).unwrap();
        let init = HeaderInit {
            created_unix_ms: 1,
            created_monotonic_ns: 2,
            creator_pid: 3,
            seed: [4, 5, 6, 7],
        };
        HeaderInfo::from_plan(&plan, &init)
    }

    #[test]
    fn plan_regions_pass_the_open_checks() {
        assert_eq!(info().check_regions(), Ok(()));
    }

    #[test]
    fn checksum_covers_regions_and_seed() {
        let a = info();
        let mut b = a.clone();
        b.regions[3].param += 1;
        assert_ne!(a.checksum(), b.checksum());
        let mut c = a.clone();
        c.seed[0] ^= 1;
        assert_ne!(a.checksum(), c.checksum());
        let mut d = a.clone();
        d.state = STATE_READY;
        assert_eq!(a.checksum(), d.checksum(), "state is not covered");
    }

    #[test]
    fn impossible_regions_are_rejected() {
        let mut a = info();
        a.regions[RegionKind::Prefix as usize].bytes = u64::MAX;
        assert!(a.check_regions().is_err());
        let mut b = info();
        b.regions[RegionKind::Rings as usize].offset = 0;
        assert!(b.check_regions().is_err());
        let mut c = info();
        c.regions[RegionKind::Prefix as usize].count *= 2;
        assert!(c.check_regions().is_err());
    }

    #[test]
    fn a_refused_region_says_which_and_why() {
        let message = |info: HeaderInfo| info.check_regions().unwrap_err().to_string();
        let mut a = info();
        a.regions[RegionKind::Rings as usize].offset = 0;
        assert_eq!(message(a), "completion rings region at offset 0 is misplaced");
        let mut b = info();
        let prefix = b.region(RegionKind::Prefix);
        b.regions[RegionKind::Prefix as usize].bytes = u64::MAX;
        assert_eq!(
            message(b),
            format!(
                "prefix table region ({} bytes at {}) runs past the segment",
                u64::MAX,
                prefix.offset
            )
        );
        let mut c = info();
        c.regions[RegionKind::Ledger as usize].param = 7;
        assert_eq!(
            message(c),
            format!("in-flight ledger rows have 7 cells, expected {SERVER_SLOTS}")
        );
        let mut d = info();
        d.regions[RegionKind::Prefix as usize].count *= 2;
        assert_eq!(
            message(d),
            format!(
                "prefix table region of {} bytes cannot hold {} elements",
                prefix.bytes,
                prefix.count * 2
            )
        );
    }
}
