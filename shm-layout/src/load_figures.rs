//! The load figures a health checker scraped from a server's metrics
//! endpoint, as the server table keeps them: one 128-bit word per server
//! slot, replaced whole by one atomic store, so a reader never sees half of
//! a scrape.
//!
//! ```text
//!  high 64 bits                              low 64 bits
//! ┌────────────────────┬───────────────────┐┌────────┬────────────┬────────────┐
//! │ pending_at_scrape:24│ scraped_at_ms:40  ││ kv:16  │ running:24 │ waiting:24 │
//! └────────────────────┴───────────────────┘└────────┴────────────┴────────────┘
//! ```
//!
//! | field | bits | meaning |
//! | --- | --- | --- |
//! | `waiting` | 24 | requests queued in the engine (saturating) |
//! | `running` | 24 | requests in its running batch (saturating) |
//! | `kv_usage_permyriad` | 16 | KV-cache usage in 0.01 % (0..=10000); `0xffff`: the engine reports none ([`LoadFigures::KV_USAGE_ABSENT`]) |
//! | `scraped_at_ms` | 40 | segment milliseconds of the scrape; 0: never |
//! | `pending_at_scrape` | 24 | the gateway's requests sent without a first token at the scrape (saturating) |

/// Load figures scraped from a server's metrics endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadFigures {
    /// Requests queued in the engine (saturates at 2^24 - 1).
    pub waiting: u32,
    /// Requests in the running batch (saturates at 2^24 - 1).
    pub running: u32,
    /// KV-cache usage in units of 0.01 % (10000 = full);
    /// [`LoadFigures::KV_USAGE_ABSENT`] when the engine does not report it
    /// (see [`kv_usage`](Self::kv_usage)).
    pub kv_usage_permyriad: u16,
    /// When scraped, in segment milliseconds; 0 = never (40 bits stored:
    /// 34 years).
    pub scraped_at_ms: u64,
    /// The gateway's pending requests to the server (sent, no first token
    /// yet) when the scrape was taken, so that readers can correct
    /// `waiting` by what the gateway sent and saw start since (saturates
    /// at 2^24 - 1).
    pub pending_at_scrape: u32,
}

impl LoadFigures {
    const MAX24: u32 = (1 << 24) - 1;
    const MAX40: u64 = (1 << 40) - 1;

    /// `kv_usage_permyriad` of an engine whose metrics have no KV-cache
    /// usage gauge (llama.cpp's `llama-server` has none): unknown, not 0 %.
    pub const KV_USAGE_ABSENT: u16 = u16::MAX;

    /// The KV-cache usage, 0 to 1; `None` when the engine does not report
    /// it.
    pub fn kv_usage(&self) -> Option<f64> {
        (self.kv_usage_permyriad != Self::KV_USAGE_ABSENT).then(|| f64::from(self.kv_usage_permyriad.min(10_000)) / 1e4)
    }

    pub(crate) fn pack(self) -> u128 {
        let lo = u64::from(self.waiting.min(Self::MAX24))
            | (u64::from(self.running.min(Self::MAX24)) << 24)
            | (u64::from(self.kv_usage_permyriad) << 48);
        let hi = self.scraped_at_ms.min(Self::MAX40) | (u64::from(self.pending_at_scrape.min(Self::MAX24)) << 40);
        (u128::from(hi) << 64) | u128::from(lo)
    }

    pub(crate) fn unpack(v: u128) -> Self {
        let lo = v as u64;
        let hi = (v >> 64) as u64;
        Self {
            waiting: (lo & u64::from(Self::MAX24)) as u32,
            running: ((lo >> 24) & u64::from(Self::MAX24)) as u32,
            kv_usage_permyriad: (lo >> 48) as u16,
            scraped_at_ms: hi & Self::MAX40,
            pending_at_scrape: (hi >> 40) as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_figures_pack_and_saturate() {
        let f = LoadFigures {
            waiting: 3,
            running: 70_000,
            kv_usage_permyriad: 9_999,
            scraped_at_ms: (1 << 40) - 1,
            pending_at_scrape: 12,
        };
        assert_eq!(LoadFigures::unpack(f.pack()), f);
        let big = LoadFigures {
            waiting: u32::MAX,
            pending_at_scrape: u32::MAX,
            ..f
        };
        assert_eq!(LoadFigures::unpack(big.pack()).waiting, (1 << 24) - 1);
        assert_eq!(LoadFigures::unpack(big.pack()).pending_at_scrape, (1 << 24) - 1);
    }

    #[test]
    fn an_absent_kv_usage_survives_packing_and_reads_as_none() {
        let f = LoadFigures {
            kv_usage_permyriad: LoadFigures::KV_USAGE_ABSENT,
            scraped_at_ms: 5,
            ..LoadFigures::default()
        };
        let back = LoadFigures::unpack(f.pack());
        assert_eq!(back, f);
        assert_eq!(back.kv_usage(), None);
        assert_eq!(
            LoadFigures {
                kv_usage_permyriad: 2_500,
                ..f
            }
            .kv_usage(),
            Some(0.25)
        );
    }
}
