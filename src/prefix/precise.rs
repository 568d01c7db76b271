//! The precise prefix source (`[policy.prefix] source = "precise"`): a
//! lookup's match per server from what that server's engine confirmed,
//! where the gateway follows its KV cache events, and from the gateway's
//! estimate elsewhere.
//!
//! | the server's events ([`KvEventsSync`]) | its match |
//! | --- | --- |
//! | none (no `kv_events`, or not subscribed now) | the estimate, as with `source = "estimate"` |
//! | `Complete` | the confirmed table; and the estimate's entries younger than `confirm_window_secs`, which the engine has not had time to confirm (a prompt just sent, or an answer just written back) |
//! | `Partial` (events were lost) | the deeper of the confirmed table and the estimate: neither is the whole truth |
//!
//! So an eviction the engine reported takes the server out of a match at
//! once, where the estimate would keep it until its entries aged or an
//! answer's `cached_tokens` came up short; and blocks the gateway never
//! sent (a prompt that reached the engine another way, another host's
//! traffic) count as soon as the engine says it holds them.

use shm_layout::{KvEventsSync, PrefixMatch, ServerRef, ServerTable, ServerTag, Stamp, Tables};

/// How old (seconds) `tag`'s entries in the **estimate** may be to count,
/// at segment second `now_s`: its horizon's limit
/// ([`ServerTable::entry_max_age`]), and with the precise source, at most
/// `window` for an engine whose events the table follows completely.
/// `None`: the server is not live.
#[inline]
pub fn estimate_max_age(servers: &ServerTable<'_>, tag: ServerTag, now_s: u64, precise: Option<u16>) -> Option<u16> {
    let age = servers.entry_max_age(tag, now_s)?;
    Some(match precise {
        Some(window) if servers.kv_events_of(tag) == Some(KvEventsSync::Complete) => age.min(window),
        _ => age,
    })
}

/// The confirmed table's match of `chain` among the live servers whose
/// events are followed, less `exclude`.
pub fn confirmed_match(tables: &Tables<'_>, now: Stamp, chain: &[u64], exclude: &[ServerRef]) -> PrefixMatch {
    tables.confirmed.longest_prefix_match_within(chain, now, |t| {
        (tables.servers.kv_events_of(t).is_some() && !exclude.iter().any(|s| s.tag() == t)).then_some(u16::MAX)
    })
}

/// `estimate` with each server's confirmed depth where deeper.
pub fn merge(mut estimate: PrefixMatch, confirmed: &PrefixMatch) -> PrefixMatch {
    for (server, blocks) in confirmed.iter() {
        estimate.add(server, blocks);
    }
    estimate
}

/// An estimate made elsewhere (Redis), which says when each server last
/// refreshed its deepest entry: with the precise source, a server whose
/// events the table follows completely keeps its entry only if that
/// refresh is within `window` seconds of `now` (unknown: dropped).
pub fn recent_only(estimate: &PrefixMatch, servers: &ServerTable<'_>, now: Stamp, window: u16) -> PrefixMatch {
    let mut kept = PrefixMatch::default();
    for (server, blocks) in estimate.iter() {
        let complete = servers.kv_events_of(server) == Some(KvEventsSync::Complete);
        let refreshed = estimate.refreshed(server);
        if !complete || refreshed.is_some_and(|r| r.age(now) <= window) {
            kept.add_refreshed(server, blocks, refreshed);
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use shm_layout::{LayoutPlan, Segment};

    use super::*;

    #[test]
    fn each_server_is_matched_by_what_its_events_allow() {
        let seg = Segment::heap(&LayoutPlan::for_size(16 << 20).unwrap());
        let t = seg.tables();
        let plain = t.servers.register(1, "http://plain", 0).unwrap();
        let complete = t.servers.register(2, "http://complete", 0).unwrap();
        let partial = t.servers.register(3, "http://partial", 0).unwrap();
        assert!(t.servers.set_kv_events(complete, Some(KvEventsSync::Complete)));
        assert!(t.servers.set_kv_events(partial, Some(KvEventsSync::Partial)));
        // Spread keys, as chain hashes are (small ones share a bucket).
        let chain: Vec<u64> = (1..=8u64).map(|i| seahash::hash(&i.to_le_bytes())).collect();
        // The estimate, written at second 100, lists all three for 6 blocks.
        for s in [plain, complete, partial] {
            t.prefix.insert_chain(&chain[..6], s, Stamp(100));
        }
        // The engines confirm: `complete` holds 2 blocks, `partial` 8,
        // `plain` publishes nothing (its confirmed entries would not count).
        t.confirmed.insert_chain(&chain[..2], complete, Stamp(100));
        t.confirmed.insert_chain(&chain, partial, Stamp(100));
        t.confirmed.insert_chain(&chain, plain, Stamp(100));
        let lookup = |now_s: u64, precise: Option<u16>| {
            let now = Stamp(now_s as u16);
            let estimate = t
                .prefix
                .longest_prefix_match_within(&chain, now, |s| estimate_max_age(&t.servers, s, now_s, precise));
            match precise {
                Some(_) => merge(estimate, &confirmed_match(&t, now, &chain, &[])),
                None => estimate,
            }
        };
        let depths = |m: PrefixMatch| [plain, complete, partial].map(|s| m.blocks_for(s.tag()));
        assert_eq!(depths(lookup(130, None)), [6, 6, 6], "the estimate alone");
        assert_eq!(
            depths(lookup(130, Some(2))),
            [6, 2, 8],
            "30 s later: the engines' word where they give it"
        );
        assert_eq!(
            depths(lookup(101, Some(2))),
            [6, 6, 8],
            "within the window the gateway's own entries still count"
        );
        // Excluded servers are left out of the confirmed match too.
        let now = Stamp(130);
        assert!(confirmed_match(&t, now, &chain, &[partial, complete]).blocks_for(partial.tag()) == 0);
        // An estimate from elsewhere: the complete engine's kept only when
        // its refresh is known and recent.
        let mut remote = PrefixMatch::default();
        remote.add_refreshed(plain.tag(), 6, None);
        remote.add_refreshed(complete.tag(), 6, Some(Stamp(100)));
        remote.add_refreshed(partial.tag(), 6, None);
        assert_eq!(depths(recent_only(&remote, &t.servers, Stamp(130), 2)), [6, 0, 6]);
        assert_eq!(depths(recent_only(&remote, &t.servers, Stamp(101), 2)), [6, 6, 6]);
    }
}
