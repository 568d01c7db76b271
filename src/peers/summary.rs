//! The load summary a gateway serves its peers (`GET /semlb/peer/load`).
//!
//! Compact and cheap: it is read from the segment's server table and a few
//! stats words (no table scan), by whichever dispatcher the poll reaches,
//! and is the same whichever that is.
//!
//! ```json
//! {"region":"eu-west","servers":4,"free":1,"spare":3,"pending":5,
//!  "inflight":19,"queue":0,"models":["qwen3"],"warm_s":240}
//! ```

use serde::{Deserialize, Serialize};

use shm_layout::ServerTable;

use crate::routing::Candidate;

/// One gateway's load as its peers see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadSummary {
    /// Its region.
    pub region: String,
    /// Its live servers.
    pub servers: u32,
    /// Live servers that take one more request now: those its holding
    /// policy would send one to (not full), else those with no request
    /// estimated to wait in their engine ([`Candidate::pending_estimate`]).
    pub free: u32,
    /// Requests its servers could still admit: the sum over live servers
    /// of their admission limit less what they run.
    pub spare: u64,
    /// Requests sent to its servers and not started yet.
    pub pending: u64,
    /// Requests in flight to its servers.
    pub inflight: u64,
    /// Requests waiting in its gateway queues.
    pub queue: u64,
    /// The model names it serves (its pools' names and aliases); empty:
    /// any (no `[[model]]` pools).
    pub models: Vec<String>,
    /// How long its engines keep what they cached (s): the shortest time
    /// since any of its live engines was seen to evict (the server's
    /// horizon, `shm_layout::ServerTable::entry_max_age`). `None`: none was
    /// seen to evict. A conversation forwarded there is warm while its
    /// last turn there is younger ([`super::affinity`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_s: Option<u32>,
}

impl LoadSummary {
    /// The summary of `region` with live servers `candidates` (those
    /// `free` says take one more now), `queue` requests waiting and pools
    /// serving `models`.
    pub fn of(
        region: &str,
        candidates: &[Candidate],
        free: impl Fn(&Candidate) -> bool,
        queue: u64,
        models: Vec<String>,
    ) -> Self {
        let mut s = Self {
            region: region.to_owned(),
            servers: u32::try_from(candidates.len()).unwrap_or(u32::MAX),
            free: 0,
            spare: 0,
            pending: 0,
            inflight: 0,
            queue,
            models,
            warm_s: None,
        };
        for c in candidates {
            if free(c) {
                s.free += 1;
            }
            s.spare += u64::from(c.admission).saturating_sub(c.inflight);
            s.pending += c.pending;
            s.inflight += c.inflight;
        }
        s
    }

    /// Whether it serves `model`.
    pub fn serves(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == model)
    }
}

/// How long the engines of `candidates` keep what they cached, at
/// segment second `now_s` ([`LoadSummary::warm_s`]): the shortest time
/// since one of them was seen to evict (its horizon); `None` if none was.
pub fn warm_s(servers: &ServerTable<'_>, candidates: &[Candidate], now_s: u64) -> Option<u32> {
    candidates
        .iter()
        .filter_map(|c| servers.entry_max_age(c.server.tag(), now_s))
        .filter(|age| *age < u16::MAX)
        .min()
        .map(u32::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::test_support::{Fixture, cand};

    #[test]
    fn free_servers_are_those_with_nothing_waiting() {
        let f = Fixture::new(2);
        let mut busy = cand(f.s[0], 3, 300);
        busy.admission = 2;
        let idle = cand(f.s[1], 0, 0);
        let nothing_waiting = |c: &Candidate| c.pending_estimate() == 0;
        let s = LoadSummary::of("a", &[busy, idle], nothing_waiting, 4, vec![]);
        assert_eq!(s.servers, 2);
        assert_eq!(s.free, 1, "{s:?}");
        assert_eq!(s.inflight, 3);
        assert_eq!(s.queue, 4);
        assert!(s.serves("anything"));
        let s = LoadSummary::of("a", &[idle], nothing_waiting, 0, vec!["m".into()]);
        assert!(s.serves("m") && !s.serves("n"));
        let json = serde_json::to_string(&s).unwrap();
        assert!(!json.contains("warm_s"), "said only when known: {json}");
        assert_eq!(serde_json::from_str::<LoadSummary>(&json).unwrap(), s);
        let evicting = LoadSummary { warm_s: Some(40), ..s };
        let json = serde_json::to_string(&evicting).unwrap();
        assert_eq!(serde_json::from_str::<LoadSummary>(&json).unwrap(), evicting);
    }

    #[test]
    fn warm_is_the_shortest_time_since_an_engine_evicted() {
        let f = Fixture::new(2);
        let servers = &f.seg.tables().servers;
        let both = [cand(f.s[0], 0, 0), cand(f.s[1], 0, 0)];
        assert_eq!(warm_s(servers, &both, 100), None, "nothing evicted");
        assert!(servers.raise_horizon(f.s[0], 40));
        assert_eq!(warm_s(servers, &both, 100), Some(60));
        assert!(servers.raise_horizon(f.s[1], 90));
        assert_eq!(warm_s(servers, &both, 100), Some(10));
        assert_eq!(warm_s(servers, &both[..1], 100), Some(60), "only live candidates count");
    }
}
