//! The in-flight accounting: per server, the requests (and their prompt
//! tokens) the gateway has in flight and, of those, the pending ones (no
//! first token yet), as global counters shadowed by one ledger cell per
//! process, so that a dead process's counts can be taken back
//! ([`ServerTable::reclaim_process`]).

use super::{ServerRef, ServerTable};
use crate::sync::Ordering;

/// Clamp for counters that a crash may have left one too low.
fn clamp(v: u64) -> u64 {
    if (v as i64) < 0 { 0 } else { v }
}

impl ServerTable<'_> {
    /// Counts a request of `process` to `server` as in flight and pending.
    /// False (and nothing counted) if `server` is stale.
    pub fn begin_request(&self, process: u16, server: ServerRef, prompt_tokens: u64) -> bool {
        if !self.is_current(server) {
            return false;
        }
        let s = &self.slots[usize::from(server.slot)];
        s.inflight_requests.fetch_add(1, Ordering::Relaxed);
        s.inflight_tokens.fetch_add(prompt_tokens, Ordering::Relaxed);
        s.pending_requests.fetch_add(1, Ordering::Relaxed);
        s.pending_tokens.fetch_add(prompt_tokens, Ordering::Relaxed);
        let c = self.cell(process, server.slot);
        c.requests.fetch_add(1, Ordering::Relaxed);
        c.tokens.fetch_add(prompt_tokens, Ordering::Relaxed);
        c.pending_requests.fetch_add(1, Ordering::Relaxed);
        c.pending_tokens.fetch_add(prompt_tokens, Ordering::Relaxed);
        true
    }

    /// A request [`Self::begin_request`] counted got its first token: it is
    /// no longer pending (still in flight). Call at most once per request.
    /// Ignored if `server` is stale.
    pub fn first_token(&self, process: u16, server: ServerRef, prompt_tokens: u64) {
        if !self.is_current(server) {
            return;
        }
        let c = self.cell(process, server.slot);
        c.pending_requests.fetch_sub(1, Ordering::Relaxed);
        c.pending_tokens.fetch_sub(prompt_tokens, Ordering::Relaxed);
        let s = &self.slots[usize::from(server.slot)];
        s.pending_requests.fetch_sub(1, Ordering::Relaxed);
        s.pending_tokens.fetch_sub(prompt_tokens, Ordering::Relaxed);
    }

    /// Ends what [`Self::begin_request`] began; `started`: whether
    /// [`Self::first_token`] was called for it (if not, it stops being
    /// pending too). Ignored if `server` is stale (its counters were reset
    /// when the slot was reused).
    pub fn end_request(&self, process: u16, server: ServerRef, prompt_tokens: u64, started: bool) {
        if !started {
            self.first_token(process, server, prompt_tokens);
        }
        if !self.is_current(server) {
            return;
        }
        let c = self.cell(process, server.slot);
        c.requests.fetch_sub(1, Ordering::Relaxed);
        c.tokens.fetch_sub(prompt_tokens, Ordering::Relaxed);
        let s = &self.slots[usize::from(server.slot)];
        s.inflight_requests.fetch_sub(1, Ordering::Relaxed);
        s.inflight_tokens.fetch_sub(prompt_tokens, Ordering::Relaxed);
    }

    /// `(requests, prompt tokens)` in flight to `server` from all processes.
    pub fn inflight(&self, server: ServerRef) -> (u64, u64) {
        let s = &self.slots[usize::from(server.slot)];
        (
            clamp(s.inflight_requests.load(Ordering::Relaxed)),
            clamp(s.inflight_tokens.load(Ordering::Relaxed)),
        )
    }

    /// `(requests, prompt tokens)` pending at `server` (sent by any
    /// process, no first token yet).
    pub fn pending(&self, server: ServerRef) -> (u64, u64) {
        let s = &self.slots[usize::from(server.slot)];
        (
            clamp(s.pending_requests.load(Ordering::Relaxed)),
            clamp(s.pending_tokens.load(Ordering::Relaxed)),
        )
    }

    /// What `process` has in flight to `server` (its ledger cell).
    pub fn inflight_of(&self, process: u16, server: ServerRef) -> (u64, u64) {
        let c = self.cell(process, server.slot);
        (
            clamp(c.requests.load(Ordering::Relaxed)),
            clamp(c.tokens.load(Ordering::Relaxed)),
        )
    }

    /// Takes a dead process's in-flight counts out of every server's totals
    /// and zeroes its ledger row. Idempotent.
    pub fn reclaim_process(&self, process: u16) {
        for (i, s) in self.slots.iter().enumerate() {
            let c = self.cell(process, i as u16);
            let r = c.requests.swap(0, Ordering::AcqRel);
            let t = c.tokens.swap(0, Ordering::AcqRel);
            s.inflight_requests.fetch_sub(r, Ordering::Relaxed);
            s.inflight_tokens.fetch_sub(t, Ordering::Relaxed);
            let r = c.pending_requests.swap(0, Ordering::AcqRel);
            let t = c.pending_tokens.swap(0, Ordering::AcqRel);
            s.pending_requests.fetch_sub(r, Ordering::Relaxed);
            s.pending_tokens.fetch_sub(t, Ordering::Relaxed);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::tests::parts;
    use super::super::*;
    use crate::load_figures::LoadFigures;

    #[test]
    fn inflight_counts_and_reclaim_after_a_crash() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let a = t.register(1, "a", 0).unwrap();
        assert!(t.begin_request(3, a, 100));
        assert!(t.begin_request(3, a, 50));
        assert!(t.begin_request(4, a, 10));
        assert_eq!(t.inflight(a), (3, 160));
        assert_eq!(t.pending(a), (3, 160));
        t.first_token(3, a, 100);
        assert_eq!(t.pending(a), (2, 60), "started: no longer pending");
        assert_eq!(t.inflight(a), (3, 160), "but still in flight");
        t.end_request(4, a, 10, false);
        assert_eq!(t.inflight(a), (2, 150));
        assert_eq!(
            t.pending(a),
            (1, 50),
            "ending an unstarted request ends its pending count"
        );
        t.reclaim_process(3); // process 3 died with two requests
        assert_eq!(t.inflight(a), (0, 0));
        assert_eq!(t.pending(a), (0, 0));
        assert_eq!(t.inflight_of(3, a), (0, 0));
        t.reclaim_process(3);
        assert_eq!(t.inflight(a), (0, 0), "idempotent");
    }

    #[test]
    fn stale_refs_touch_nothing() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let a = t.register(1, "a", 0).unwrap();
        assert!(t.begin_request(0, a, 5));
        t.retire(a);
        let b = t.register(2, "b", 0).unwrap();
        assert_eq!(t.inflight(b), (0, 0), "a reused slot starts from zero");
        t.end_request(0, a, 5, false);
        assert_eq!(t.inflight(b), (0, 0));
        assert_eq!(t.pending(b), (0, 0));
        assert!(!t.begin_request(0, a, 5));
        assert!(!t.store_load(a, LoadFigures::default()));
        let f = LoadFigures {
            waiting: 1,
            running: 2,
            kv_usage_permyriad: 3,
            scraped_at_ms: 4,
            pending_at_scrape: 5,
        };
        assert!(t.store_load(b, f));
        assert_eq!(t.load(b), f);
    }
}
