//! Host-local routing state: what this host's segment knows, whichever
//! store holds the shared tables.
//!
//! Both stores, the gateway queue and the route step read the servers the
//! same way, through a [`LocalState`]:
//!
//! | what | where it comes from |
//! | --- | --- |
//! | the live servers ([`LocalState::candidates`]) | the segment's server table: state `Up`, of the request's model pool, minus the servers a request excludes |
//! | their load ([`LocalState::candidate`]) | this host's in-flight and pending counts (every process's ledger row summed) and the scraped engine figures, zeroed when older than `health.stale_after_ms` ([`crate::health::fresh_load`]) |
//! | this process's ledger row ([`LocalState::begin`], [`first_token`](LocalState::first_token), [`end`](LocalState::end)) | the segment's in-flight ledger, reclaimed by the supervisor when the process dies |
//!
//! This is the one place where scraped figures are checked for freshness:
//! here the segment's clock is at hand, and the bound comes from the caller
//! (the dispatcher's configuration). [`crate::routing::live_candidates`]
//! stays a plain read of the table (no clock, no configuration), as the
//! benchmarks, `/health` and `/v1/models` use it.
//!
//! The segment's rate-limit table is here too ([`LocalState::take_limits`],
//! [`LocalState::charge_limits`]): the shm store's limits, and the Redis
//! store's while Redis cannot be reached (limits per host then, not per
//! namespace).
//!
//! The shm store answers a lookup with these candidates and the segment's
//! prefix table and response cache ([`super::shm`]); the Redis store with
//! these candidates, raised to the counts every host published, and
//! Redis's prefix entries and responses ([`super::redis`]).

use std::sync::Arc;

use shm_layout::{Segment, ServerRef};

use crate::health::fresh_load;
use crate::routing::{Candidate, candidate, live_candidates};
use crate::routing::{Leg, Members};
use crate::tenancy::rate_limit::{self, Charge, Verdict};

/// One process's view of the host-local state: the segment, and its row
/// of the in-flight ledger.
#[derive(Debug, Clone)]
pub struct LocalState {
    segment: Arc<Segment>,
    /// The process's registry slot: its row in the in-flight ledger.
    process: u16,
}

impl LocalState {
    /// The state seen by the process in registry slot `process`.
    pub fn new(segment: Arc<Segment>, process: u16) -> Self {
        Self { segment, process }
    }

    /// The segment.
    pub fn segment(&self) -> &Arc<Segment> {
        &self.segment
    }

    /// Takes a request's rate-limit `charges` from the segment's limit
    /// table, all or none ([`rate_limit::take`]).
    pub fn take_limits(&self, charges: &[Charge]) -> Verdict {
        rate_limit::take(&self.segment.tables().limits, charges, self.segment.clock().now_ns())
    }

    /// Charges `charges` to the segment's limit table, room or not.
    pub fn charge_limits(&self, charges: &[Charge]) {
        rate_limit::charge(&self.segment.tables().limits, charges, self.segment.clock().now_ns());
    }

    /// Gives `charges` back to the segment's limit table.
    pub fn refund_limits(&self, charges: &[Charge]) {
        rate_limit::refund(&self.segment.tables().limits, charges, self.segment.clock().now_ns());
    }

    /// Fills `out` with the live servers of `members` not in `exclude`,
    /// with this host's counts and their scraped figures when at most
    /// `stale_after_ms` old (else zeros).
    pub fn candidates(
        &self,
        exclude: &[ServerRef],
        members: &Members,
        leg: Leg,
        stale_after_ms: u64,
        out: &mut Vec<Candidate>,
    ) {
        let tables = self.segment.tables();
        live_candidates(&tables, out);
        out.retain(|c| !exclude.contains(&c.server) && leg.admits(tables.servers.role_of(c.server)));
        if !members.is_every() {
            out.retain(|c| members.admits(tables.servers.membership(c.server.slot)));
        }
        let now_ms = self.segment.clock().now_ms();
        for c in out.iter_mut() {
            c.load = fresh_load(c.load, now_ms, stale_after_ms).unwrap_or_default();
        }
    }

    /// `server` as a policy sees it, read now: this host's counts and its
    /// scraped figures when fresh (a holding policy checks its choice again
    /// with this once the request is counted).
    pub fn candidate(&self, server: ServerRef, stale_after_ms: u64) -> Candidate {
        let mut c = candidate(&self.segment.tables().servers, server);
        let now_ms = self.segment.clock().now_ms();
        c.load = fresh_load(c.load, now_ms, stale_after_ms).unwrap_or_default();
        c
    }

    /// Counts a request of `prompt_tokens` tokens in flight (and pending)
    /// to `server` in this process's ledger row; false if the registration
    /// is stale (then nothing is counted).
    pub fn begin(&self, server: ServerRef, prompt_tokens: u64) -> bool {
        self.segment
            .tables()
            .servers
            .begin_request(self.process, server, prompt_tokens)
    }

    /// A request counted with [`begin`](Self::begin) got its first token:
    /// no longer pending.
    pub fn first_token(&self, server: ServerRef, prompt_tokens: u64) {
        self.segment
            .tables()
            .servers
            .first_token(self.process, server, prompt_tokens);
    }

    /// Ends a request counted with [`begin`](Self::begin); `started`:
    /// whether [`first_token`](Self::first_token) was called for it.
    pub fn end(&self, server: ServerRef, prompt_tokens: u64, started: bool) {
        self.segment
            .tables()
            .servers
            .end_request(self.process, server, prompt_tokens, started);
    }
}

#[cfg(test)]
mod tests {
    use shm_layout::{Disaggregation, LayoutPlan, ServerRole};

    use super::*;

    /// A prefill engine of a disaggregated fleet is never a candidate for
    /// a request of its own, and a decode engine never for a prefill leg.
    #[test]
    fn candidates_are_of_the_role_their_leg_needs() {
        let segment = Arc::new(Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap()));
        let servers = segment.tables().servers;
        let register = |id, role| {
            servers
                .register_as(id, &format!("http://e{id}:8000"), 0, Disaggregation::of(role))
                .unwrap()
        };
        let both = register(1, ServerRole::Both);
        let prefill = register(2, ServerRole::Prefill);
        let decode = register(3, ServerRole::Decode);
        let local = LocalState::new(segment.clone(), 0);
        let of = |leg| {
            let mut out = Vec::new();
            local.candidates(&[], Members::all(), leg, u64::MAX, &mut out);
            out.iter().map(|c| c.server).collect::<Vec<_>>()
        };
        assert_eq!(of(Leg::Request), [both, decode]);
        assert_eq!(of(Leg::Prefill), [both, prefill]);
        assert_eq!(of(Leg::Whole), [both]);
        // A role changed at runtime counts at once.
        assert!(servers.set_disaggregation(decode, Disaggregation::of(ServerRole::Both)));
        assert_eq!(of(Leg::Prefill), [both, prefill, decode]);
    }
}
