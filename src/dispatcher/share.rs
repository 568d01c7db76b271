//! A tenant's bounded share of the tables every tenant shares (the prefix
//! table and the response cache): with more than one tenant in the keys
//! file, one tenant may fill at most `auth.tenant_share_percent` of the
//! prefix table's slots (in blocks of its prompts learned) and of the
//! response cache's entries (answers stored) in ten minutes. Past it, its
//! new prompts are still routed (by the prefixes already known, and load)
//! but neither learned nor cached, so a tenant flooding unique prompts
//! cannot evict every other tenant's entries.
//!
//! The budgets are two GCRA buckets per tenant in this host's rate-limit
//! table ([`shm_layout::limit_table`]), taken without waiting (in Redis
//! mode too: the tables they guard are this host's segment's, or evicted
//! by Redis's own policy).

use shm_layout::Quota;

use super::Dispatcher;
use crate::tenancy::auth::Caller;

/// The period a share is counted over.
const PERIOD_NS: u64 = 600_000_000_000;

/// What a request may add to the shared tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Within {
    /// Its prompt's blocks may be learned (at dispatch and when its answer
    /// is written back).
    pub learn: bool,
    /// Its answer may be stored in the response cache.
    pub cache: bool,
}

impl Within {
    /// No bound applies.
    pub const ALL: Within = Within {
        learn: true,
        cache: true,
    };
}

/// What `caller`'s request of `blocks` prompt blocks (whose answer would
/// be stored when `caches`) may add, its share's buckets charged for it.
pub(super) fn within(dispatcher: &Dispatcher, caller: Option<&Caller>, blocks: u64, caches: bool) -> Within {
    let percent = u64::from(dispatcher.config().auth.tenant_share_percent);
    let Some(caller) = caller else { return Within::ALL };
    if percent >= 100 || dispatcher.keys().is_none_or(|k| k.tenants() < 2) {
        return Within::ALL;
    }
    let tables = dispatcher.segment().tables();
    let now = dispatcher.segment().clock().now_ns();
    let take = |what: &[u8], capacity: u64, n: u64| {
        let limit = (capacity * percent / 100).max(1);
        let quota = Quota {
            limit,
            period_ns: PERIOD_NS,
        };
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(b"tenant share\0");
        h.update(what);
        h.update(caller.tenant.as_bytes());
        matches!(
            tables.limits.take(h.digest(), quota, n, now),
            shm_layout::Taken::Allowed(_)
        )
    };
    Within {
        // Its blocks and its prompt's end key.
        learn: take(b"prefix", tables.prefix.capacity(), blocks + 1),
        cache: !caches || take(b"cache", tables.responses.index_capacity(), 1),
    }
}
