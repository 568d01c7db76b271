//! Whole-table reads for inspection and metrics: the occupied slots,
//! counted ([`PrefixTable::occupancy`]) or estimated from a sample
//! ([`PrefixTable::occupancy_estimate`]), and every entry
//! ([`PrefixTable::entries`]).

use super::PrefixTable;
use super::entry::{PrefixEntry, unpack_value};

impl<'a> PrefixTable<'a> {
    /// Occupied slots (a full scan: for `semlb shm inspect` and tests, not
    /// for the request path).
    pub fn occupancy(&self) -> u64 {
        self.buckets
            .iter()
            .map(|b| b.load().iter().filter(|s| **s != 0).count() as u64)
            .sum()
    }

    /// Occupied slots, estimated from a sample of buckets: passes of
    /// `pass` buckets evenly spaced over the table, each pass offset by one
    /// from the last, until `enough` occupied slots were seen or every
    /// bucket was read (then the count is exact). Keys hash uniformly over
    /// the buckets, so the sample's fill is the table's; a table nearly
    /// empty is read further, up to all of it. What `/metrics` shows: a
    /// full scan reads the whole table (125 MiB at the default size) on
    /// every scrape.
    pub fn occupancy_estimate(&self, pass: usize, enough: u64) -> u64 {
        let n = self.buckets.len();
        let stride = (n / pass.max(1)).max(1);
        let (mut seen, mut full) = (0u64, 0u64);
        for offset in 0..stride {
            for b in self.buckets[offset..].iter().step_by(stride) {
                seen += 1;
                full += b.load().iter().filter(|s| **s != 0).count() as u64;
            }
            if full >= enough {
                break;
            }
            if offset == 0 && full.saturating_mul(16) < enough {
                // Nearly empty: one sequential scan reads it faster than
                // strided passes would.
                return self.occupancy();
            }
        }
        if seen as usize >= n {
            return full;
        }
        (full as f64 * n as f64 / seen as f64).round() as u64
    }

    /// Scans every slot and returns the decodable `(key, entry)` pairs
    /// whose servers are well formed. For tests and inspection.
    pub fn entries(&self) -> impl Iterator<Item = (u64, PrefixEntry)> + 'a {
        let codec = self.codec;
        self.buckets.iter().flat_map(move |b| {
            b.load()
                .into_iter()
                .filter_map(move |s| codec.unpack(s).map(|(k, v)| (k, unpack_value(v))))
        })
    }
}
