//! The value of one slot: the servers that hold a prefix ([`ServerSet`],
//! their lanes packed 16 bits each) and its recency [`Stamp`], in the high
//! 64 bits of the slot (the diagram in the [module docs](super)).

use super::LANES;
use crate::server_table::ServerTag;

/// A coarse recency stamp: seconds since the segment was created, modulo
/// 2^16. Compared with wrapping arithmetic, so ages up to 18 hours order
/// correctly; an older entry may look fresh, which only affects which entry
/// a full bucket evicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Stamp(pub u16);

impl Stamp {
    /// How long ago `self` was, seen from `now`.
    #[inline]
    pub fn age(self, now: Stamp) -> u16 {
        now.0.wrapping_sub(self.0)
    }
}

/// The servers of one entry, most recently refreshed first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ServerSet {
    lanes: [u16; LANES],
}

impl ServerSet {
    pub(super) fn from_value(value: u64) -> Self {
        Self {
            lanes: std::array::from_fn(|i| (value >> (16 * i)) as u16),
        }
    }

    pub(super) fn bits(self) -> u64 {
        self.lanes
            .iter()
            .enumerate()
            .map(|(i, l)| u64::from(*l) << (16 * i))
            .sum()
    }

    /// The servers, most recent first.
    pub fn iter(&self) -> impl Iterator<Item = ServerTag> + '_ {
        self.lanes.iter().filter_map(|l| ServerTag::from_lane(*l))
    }

    /// Number of servers.
    pub fn len(&self) -> usize {
        self.lanes.iter().filter(|l| **l != 0).count()
    }

    /// True if no server is recorded.
    pub fn is_empty(&self) -> bool {
        self.lanes[0] == 0
    }

    /// Whether `tag` (same slot and generation) is in the set.
    pub fn contains(&self, tag: ServerTag) -> bool {
        self.lanes.contains(&tag.lane())
    }

    /// `tag` moved (or added) to the front; other lanes of the same server
    /// slot (older generations) dropped; the least recent falls off if full.
    pub(super) fn with_front(self, tag: ServerTag) -> Self {
        let mut lanes = [0u16; LANES];
        lanes[0] = tag.lane();
        let mut n = 1;
        for l in self.lanes {
            match ServerTag::from_lane(l) {
                Some(t) if t.slot() != tag.slot() && n < LANES => {
                    lanes[n] = l;
                    n += 1;
                }
                _ => {}
            }
        }
        Self { lanes }
    }

    /// The set without any lane of `tag`'s server slot.
    pub(super) fn without(self, tag: ServerTag) -> Self {
        let mut lanes = [0u16; LANES];
        for (dst, l) in lanes
            .iter_mut()
            .zip(self.lanes.iter().filter(|l| **l != 0 && **l != tag.lane()))
        {
            *dst = *l;
        }
        Self { lanes }
    }
}

/// One entry as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixEntry {
    /// Servers that hold the prefix, most recent first.
    pub servers: ServerSet,
    /// When the entry was last refreshed.
    pub stamp: Stamp,
}

/// The high 64 bits of a slot: `servers`' lanes, then `stamp` on top.
pub(super) fn pack_value(servers: ServerSet, stamp: Stamp) -> u64 {
    servers.bits() | (u64::from(stamp.0) << 48)
}

/// The entry a slot's high 64 bits hold.
pub(super) fn unpack_value(value: u64) -> PrefixEntry {
    PrefixEntry {
        servers: ServerSet::from_value(value & 0xffff_ffff_ffff),
        stamp: Stamp((value >> 48) as u16),
    }
}
