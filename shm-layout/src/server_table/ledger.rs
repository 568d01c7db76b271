//! The in-flight accounting: per server, the requests (and their prompt
//! tokens) the gateway has in flight and, of those, the pending ones (no
//! first token yet), as global counters shadowed by one ledger cell per
//! process, so that a dead process's counts can be taken back
//! ([`ServerTable::reclaim_process`]), even when it was killed halfway
//! through changing them.
//!
//! # Words
//!
//! ```text
//! server slot, line 1 (global, every process changes them by CAS):
//!   requests word  (128) │ requests:32 │ pending requests:32 │ toggles:64 │
//!   tokens word    (128) │ tokens:32   │ pending tokens:32   │ toggles:64 │
//!
//! ledger cell (process × server, only that process writes it):
//!   counts (128) │ requests:31 │ pending:31 │ toggle R:1 │ toggle T:1 │ tokens:32 │ pending tokens:32 │
//!   intent (64)  │ op:8 │ tokens:32 │ (unused) │
//! ```
//!
//! # Why a kill mid-update loses nothing
//!
//! A step of a request ([`Op`]) changes both global words and the cell of
//! its process, in four stores: it writes its **intent** (op and tokens)
//! into the cell, applies the op to the requests word, then to the tokens
//! word, then stores the cell's new counts. Each global CAS also flips the
//! process's **toggle bit** (bit `process % 64` of the word's upper half),
//! and the cell's store records the bits it saw. So when the supervisor
//! reclaims a dead process, for each global word: the bit in the word
//! differs from the bit in the cell exactly when the process died after
//! applying its op to that word and before storing the cell, and then the
//! intent says what the op was. The dead process's share of a word is its
//! cell's counts, plus the op where the bits differ; that is subtracted and
//! the cell zeroed. Every store is one atomic instruction, so there is no
//! fifth state.
//!
//! The reclaim is itself safe to kill and run again (the supervisor that
//! runs it may die, and its successor reclaims the same rows). Per cell it
//! first stores the dead process's whole share (the interrupted op folded
//! in) as the cell's counts, with the toggle bits the words have now, then
//! a [`Op::Reclaim`] intent; each subtraction from a global word flips the
//! dead process's toggle bit, as an op would; the zeroed cell comes last.
//! A second reclaim then reads, where a bit differs under that intent,
//! that the word's part is already subtracted, and subtracts only the rest
//! (subtracting the cell's counts again took live processes' requests).
//!
//! Only one live process may own a toggle bit: processes that count
//! requests must have distinct slots modulo 64. The supervisor numbers its
//! dispatchers 1 to 64 (at most 64) and the response processes, which count
//! nothing, after them.
//!
//! Counters saturate at zero, so a decrement that races a re-registration
//! ([`ServerTable::register`] zeroes the counters) cannot wrap. A begin
//! that would take the requests past 2³¹ − 1 is refused; token counts
//! saturate at 2³² − 1 and one request is charged at most
//! [`MAX_CHARGED_TOKENS`].

use super::{ServerRef, ServerTable};
use crate::sync::{AtomicU128, Ordering};

/// Most prompt tokens one request is charged in the in-flight counters.
pub const MAX_CHARGED_TOKENS: u64 = 1 << 24;

/// Largest request count a word or cell holds.
const MAX_REQUESTS: u64 = (1 << 31) - 1;
const MASK31: u64 = (1 << 31) - 1;
const MASK32: u64 = u32::MAX as u64;

/// One step of a request's life, as the counters see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Op {
    /// Sent: in flight and pending.
    Begin = 1,
    /// First token: no longer pending.
    FirstToken = 2,
    /// Ended after its first token.
    EndStarted = 3,
    /// Ended before any token: no longer in flight nor pending.
    EndPending = 4,
    /// Not a step of a request: a reclaim of the process is under way
    /// and the cell holds what it has yet to subtract (see the module docs).
    Reclaim = 5,
}

impl Op {
    /// `(requests, pending)` change of the op, in units (of requests, or
    /// of the request's tokens).
    fn signs(self) -> (i64, i64) {
        match self {
            Self::Begin => (1, 1),
            Self::FirstToken => (0, -1),
            Self::EndStarted => (-1, 0),
            Self::EndPending => (-1, -1),
            Self::Reclaim => (0, 0),
        }
    }

    fn from_bits(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::Begin,
            2 => Self::FirstToken,
            3 => Self::EndStarted,
            4 => Self::EndPending,
            5 => Self::Reclaim,
            _ => return None,
        })
    }
}

/// The intent word: `op:8 | tokens:32 << 8`.
fn intent(op: Op, tokens: u64) -> u64 {
    op as u64 | tokens << 8
}

fn split_intent(word: u64) -> Option<(Op, u64)> {
    Some((Op::from_bits(word as u8)?, (word >> 8) & MASK32))
}

/// `(requests or tokens, pending)` of a global word.
fn pair(word: u128) -> (u64, u64) {
    (word as u64 & MASK32, (word >> 32) as u64 & MASK32)
}

fn toggle(word: u128, process: u16) -> bool {
    word >> (64 + process % 64) & 1 == 1
}

/// `a + d` clamped to `0..=max`; `None` if `check` and it would pass `max`.
fn add(a: u64, d: i64, max: u64, check: bool) -> Option<u64> {
    let v = (a as i64).saturating_add(d).max(0) as u64;
    if v > max {
        return if check { None } else { Some(max) };
    }
    Some(v)
}

/// A process's share of one server's counters: its cell's counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Share {
    requests: u64,
    pending: u64,
    tokens: u64,
    pending_tokens: u64,
    /// The process's toggle bit in the requests and tokens words, as its
    /// last op left them.
    toggle_requests: bool,
    toggle_tokens: bool,
}

impl Share {
    fn pack(self) -> u128 {
        let low = self.requests
            | self.pending << 31
            | u64::from(self.toggle_requests) << 62
            | u64::from(self.toggle_tokens) << 63;
        let high = self.tokens | self.pending_tokens << 32;
        u128::from(low) | u128::from(high) << 64
    }

    fn unpack(w: u128) -> Self {
        let (low, high) = (w as u64, (w >> 64) as u64);
        Self {
            requests: low & MASK31,
            pending: low >> 31 & MASK31,
            tokens: high & MASK32,
            pending_tokens: high >> 32,
            toggle_requests: low >> 62 & 1 == 1,
            toggle_tokens: low >> 63 == 1,
        }
    }

    /// The share after `op` of a request of `tokens`.
    fn after(self, op: Op, tokens: u64) -> Self {
        let (r, p) = op.signs();
        let t = tokens as i64;
        Self {
            requests: add(self.requests, r, MASK31, false).unwrap_or(0),
            pending: add(self.pending, p, MASK31, false).unwrap_or(0),
            tokens: add(self.tokens, r * t, MASK32, false).unwrap_or(0),
            pending_tokens: add(self.pending_tokens, p * t, MASK32, false).unwrap_or(0),
            ..self
        }
    }
}

/// What [`ServerTable::reclaim_process`] took back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reclaimed {
    /// Requests the dead process had in flight, all servers together.
    pub requests: u64,
    /// Servers whose counters it was changing when it died (its op was
    /// applied to a global word but not yet to its ledger cell).
    pub interrupted: u32,
}

/// How many of an op's four stores to make; all of them but in tests,
/// which stop short to play a process killed at each point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) enum Stores {
    Intent,
    Requests,
    Tokens,
    All,
}

impl ServerTable<'_> {
    /// Counts a request of `process` to `server` as in flight and pending.
    /// False (and nothing counted) if `server` is stale, or holds 2³¹ − 1
    /// requests already.
    pub fn begin_request(&self, process: u16, server: ServerRef, prompt_tokens: u64) -> bool {
        self.is_current(server) && self.apply(process, server.slot, Op::Begin, prompt_tokens, Stores::All)
    }

    /// A request [`Self::begin_request`] counted got its first token: it is
    /// no longer pending (still in flight). Call at most once per request.
    /// Ignored if `server` is stale.
    pub fn first_token(&self, process: u16, server: ServerRef, prompt_tokens: u64) {
        if self.is_current(server) {
            self.apply(process, server.slot, Op::FirstToken, prompt_tokens, Stores::All);
            self.count_started(server);
        }
    }

    /// Ends what [`Self::begin_request`] began; `started`: whether
    /// [`Self::first_token`] was called for it (if not, it stops being
    /// pending too). Ignored if `server` is stale (its counters were reset
    /// when the slot was reused).
    pub fn end_request(&self, process: u16, server: ServerRef, prompt_tokens: u64, started: bool) {
        if self.is_current(server) {
            let op = if started { Op::EndStarted } else { Op::EndPending };
            self.apply(process, server.slot, op, prompt_tokens, Stores::All);
            if !started {
                self.count_started(server);
            }
        }
    }

    /// One more request left `server`'s pending ones since the scrape
    /// ([`ServerTable::started_since_scrape`]). Not in the ledger: a
    /// count of events, reset at every scrape, with nothing to take back
    /// when a process dies.
    fn count_started(&self, server: ServerRef) {
        self.slots[usize::from(server.slot)]
            .started_since_scrape
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Applies `op` of `process`'s request of `prompt_tokens` to `slot`'s
    /// counters and the process's cell, making `stores` of the four stores
    /// (see the module docs). False if a begin would overflow.
    pub(crate) fn apply(&self, process: u16, slot: u16, op: Op, prompt_tokens: u64, stores: Stores) -> bool {
        let tokens = prompt_tokens.min(MAX_CHARGED_TOKENS);
        let cell = self.cell(process, slot);
        let s = &self.slots[usize::from(slot)];
        let (r, p) = op.signs();
        let t = tokens as i64;
        let share = Share::unpack(cell.counts.load(Ordering::Relaxed));
        cell.intent.store(intent(op, tokens), Ordering::Release);
        if stores == Stores::Intent {
            return true;
        }
        let Some(requests) = Self::change(&s.requests, (r, p), MAX_REQUESTS, op == Op::Begin, Some(process)) else {
            return false;
        };
        if stores == Stores::Requests {
            return true;
        }
        let tokens_word = Self::change(&s.tokens, (r * t, p * t), MASK32, false, Some(process))
            .expect("an unchecked change always applies");
        if stores == Stores::Tokens {
            return true;
        }
        let next = Share {
            toggle_requests: toggle(requests, process),
            toggle_tokens: toggle(tokens_word, process),
            ..share.after(op, tokens)
        };
        cell.counts.store(next.pack(), Ordering::Release);
        true
    }

    /// Adds `(d0, d1)` to the two counters of a global word (clamped to
    /// `0..=max`; `None`, and nothing changed, if `check` and one would pass
    /// `max`), flipping `flip`'s toggle bit. Returns the new word.
    fn change(word: &AtomicU128, (d0, d1): (i64, i64), max: u64, check: bool, flip: Option<u16>) -> Option<u128> {
        let bit = flip.map_or(0, |p| 1u128 << (64 + p % 64));
        let mut cur = word.load(Ordering::Relaxed);
        loop {
            let (a, b) = pair(cur);
            let a = add(a, d0, max, check)?;
            let b = add(b, d1, max, check)?;
            let next = (cur >> 64 << 64 ^ bit) | u128::from(a) | u128::from(b) << 32;
            match word.compare_exchange(cur, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Some(next),
                Err(now) => cur = now,
            }
        }
    }

    /// `(requests, prompt tokens)` in flight to `server` from all processes.
    pub fn inflight(&self, server: ServerRef) -> (u64, u64) {
        let s = &self.slots[usize::from(server.slot)];
        (
            pair(s.requests.load(Ordering::Relaxed)).0,
            pair(s.tokens.load(Ordering::Relaxed)).0,
        )
    }

    /// `(requests, prompt tokens)` pending at `server` (sent by any
    /// process, no first token yet).
    pub fn pending(&self, server: ServerRef) -> (u64, u64) {
        let s = &self.slots[usize::from(server.slot)];
        (
            pair(s.requests.load(Ordering::Relaxed)).1,
            pair(s.tokens.load(Ordering::Relaxed)).1,
        )
    }

    /// Both of the above, from one load of each word: `((requests, prompt
    /// tokens) in flight, (requests, prompt tokens) pending)`.
    pub fn inflight_and_pending(&self, server: ServerRef) -> ((u64, u64), (u64, u64)) {
        let s = &self.slots[usize::from(server.slot)];
        let (r, p) = pair(s.requests.load(Ordering::Relaxed));
        let (t, pt) = pair(s.tokens.load(Ordering::Relaxed));
        ((r, t), (p, pt))
    }

    /// What `process` has in flight to `server` (its ledger cell).
    pub fn inflight_of(&self, process: u16, server: ServerRef) -> (u64, u64) {
        let share = Share::unpack(self.cell(process, server.slot).counts.load(Ordering::Relaxed));
        (share.requests, share.tokens)
    }

    /// Takes a dead process's in-flight counts out of every server's totals
    /// (including an op it was killed in the middle of) and zeroes its
    /// ledger row. Idempotent, and safe to kill part way: run again (by
    /// another process), it subtracts only what the killed run had not.
    /// Only for a process that is dead: a live one would go on changing its
    /// row. One reclaim of a row at a time.
    pub fn reclaim_process(&self, process: u16) -> Reclaimed {
        let mut out = Reclaimed::default();
        for (slot, s) in self.slots.iter().enumerate() {
            let cell = self.cell(process, slot as u16);
            let share = Share::unpack(cell.counts.load(Ordering::Acquire));
            let requests = s.requests.load(Ordering::Acquire);
            let tokens = s.tokens.load(Ordering::Acquire);
            let mid_requests = toggle(requests, process) != share.toggle_requests;
            let mid_tokens = toggle(tokens, process) != share.toggle_tokens;
            if share == Share::default() && !mid_requests && !mid_tokens {
                continue;
            }
            // What is left to subtract from each word: the cell's counts,
            // plus the op the process applied to the word but not to the
            // cell; or nothing, where an earlier reclaim already did.
            let (mut r, mut p) = (share.requests as i64, share.pending as i64);
            let (mut t, mut pt) = (share.tokens as i64, share.pending_tokens as i64);
            match split_intent(cell.intent.load(Ordering::Acquire)) {
                Some((Op::Reclaim, _)) => {
                    if mid_requests {
                        (r, p) = (0, 0);
                    }
                    if mid_tokens {
                        (t, pt) = (0, 0);
                    }
                }
                Some((op, n)) if mid_requests || mid_tokens => {
                    out.interrupted += 1;
                    let (dr, dp) = op.signs();
                    if mid_requests {
                        (r, p) = (r + dr, p + dp);
                    }
                    if mid_tokens {
                        (t, pt) = (t + dr * n as i64, pt + dp * n as i64);
                    }
                }
                _ => {}
            }
            let (r, p, t, pt) = (r.max(0) as u64, p.max(0) as u64, t.max(0) as u64, pt.max(0) as u64);
            out.requests += r;
            // The cell now says exactly what is left, its bits those of
            // the words (a kill from here on finds no op mid-way) ...
            let left = Share {
                requests: r.min(MASK31),
                pending: p.min(MASK31),
                tokens: t.min(MASK32),
                pending_tokens: pt.min(MASK32),
                toggle_requests: toggle(requests, process),
                toggle_tokens: toggle(tokens, process),
            };
            cell.counts.store(left.pack(), Ordering::Release);
            // ... and that a reclaim is under way: from here on a bit that
            // differs means that word's part was subtracted.
            cell.intent.store(intent(Op::Reclaim, 0), Ordering::Release);
            let minus = |a: u64| -(a as i64);
            let requests = Self::change(
                &s.requests,
                (minus(left.requests), minus(left.pending)),
                MAX_REQUESTS,
                false,
                Some(process),
            );
            let tokens = Self::change(
                &s.tokens,
                (minus(left.tokens), minus(left.pending_tokens)),
                MASK32,
                false,
                Some(process),
            );
            let zero = Share {
                toggle_requests: requests.is_some_and(|w| toggle(w, process)),
                toggle_tokens: tokens.is_some_and(|w| toggle(w, process)),
                ..Share::default()
            };
            cell.counts.store(zero.pack(), Ordering::Release);
        }
        out
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::tests::parts;
    use super::super::*;
    use super::{Op, Reclaimed, Share, Stores};
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
        assert_eq!(t.inflight_and_pending(a), ((3, 160), (2, 60)));
        assert_eq!(t.inflight(a), (3, 160), "but still in flight");
        t.end_request(4, a, 10, false);
        assert_eq!(t.inflight(a), (2, 150));
        assert_eq!(
            t.pending(a),
            (1, 50),
            "ending an unstarted request ends its pending count"
        );
        let r = t.reclaim_process(3); // process 3 died with two requests
        assert_eq!(
            r,
            Reclaimed {
                requests: 2,
                interrupted: 0
            }
        );
        assert_eq!(t.inflight(a), (0, 0));
        assert_eq!(t.pending(a), (0, 0));
        assert_eq!(t.inflight_of(3, a), (0, 0));
        assert_eq!(t.reclaim_process(3), Reclaimed::default(), "idempotent");
        assert_eq!(t.inflight(a), (0, 0));
        assert!(t.begin_request(3, a, 7), "the slot's next process counts afresh");
        assert_eq!(t.inflight(a), (1, 7));
    }

    /// A process killed after each of an op's stores, for every op, with
    /// other processes' requests in flight around it: reclaiming it leaves
    /// exactly the others' counts.
    #[test]
    fn requests_leaving_the_pending_ones_are_counted_from_each_scrape() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let a = t.register(1, "a", 0).unwrap();
        for _ in 0..4 {
            assert!(t.begin_request(3, a, 10));
        }
        t.first_token(3, a, 10);
        t.end_request(3, a, 10, false);
        assert_eq!(t.started_since_scrape(a), 2, "a first token, and an end before one");
        t.end_request(3, a, 10, true);
        assert_eq!(
            t.started_since_scrape(a),
            2,
            "ending after the first token is no second start"
        );
        assert!(t.store_load(
            a,
            LoadFigures {
                waiting: 1,
                ..LoadFigures::default()
            }
        ));
        assert_eq!(t.started_since_scrape(a), 0, "a scrape starts the count again");
        t.first_token(4, a, 10);
        assert_eq!(t.started_since_scrape(a), 1);
        // A new registration of the slot starts from zero.
        assert!(t.retire(a));
        let b = t.register(2, "b", 0).unwrap();
        assert_eq!(b.slot, a.slot);
        assert_eq!(t.started_since_scrape(b), 0);
        t.first_token(4, a, 10);
        assert_eq!(
            t.started_since_scrape(b),
            0,
            "the old registration's requests count nowhere"
        );
    }

    #[test]
    fn a_kill_between_any_two_stores_is_reclaimed_exactly() {
        let stops = [Stores::Intent, Stores::Requests, Stores::Tokens, Stores::All];
        let ops = [Op::Begin, Op::FirstToken, Op::EndStarted, Op::EndPending];
        for op in ops {
            for stop in stops {
                for history in 0..3u64 {
                    let (s, l) = parts();
                    let t = ServerTable::new(&s, &l, 1);
                    let a = t.register(1, "a", 0).unwrap();
                    // Other processes, one of them sharing the dying one's
                    // toggle bit's neighbour, and one of the dying
                    // process's own earlier requests to flip its bits.
                    assert!(t.begin_request(2, a, 1000));
                    assert!(t.begin_request(6, a, 300));
                    t.first_token(6, a, 300);
                    for _ in 0..history {
                        assert!(t.begin_request(5, a, 11));
                    }
                    // The dying process's request, brought to where `op` applies.
                    let setup: &[Op] = match op {
                        Op::Begin => &[],
                        Op::FirstToken | Op::EndPending => &[Op::Begin],
                        Op::EndStarted => &[Op::Begin, Op::FirstToken],
                        Op::Reclaim => unreachable!("not a step of a request"),
                    };
                    for step in setup {
                        assert!(t.apply(5, a.slot, *step, 40, Stores::All));
                    }
                    assert!(t.apply(5, a.slot, op, 40, stop));
                    let r = t.reclaim_process(5);
                    let applied = stop >= Stores::Requests && stop < Stores::All;
                    assert_eq!(r.interrupted, u32::from(applied), "{op:?} stopped after {stop:?}");
                    assert_eq!(
                        t.inflight(a),
                        (2, 1300),
                        "{op:?} stopped after {stop:?}, history {history}"
                    );
                    assert_eq!(
                        t.pending(a),
                        (1, 1000),
                        "{op:?} stopped after {stop:?}, history {history}"
                    );
                    assert_eq!(t.reclaim_process(5), Reclaimed::default());
                    t.end_request(2, a, 1000, false);
                    t.end_request(6, a, 300, true);
                    assert_eq!((t.inflight(a), t.pending(a)), ((0, 0), (0, 0)));
                }
            }
        }
    }

    #[test]
    fn cells_pack_every_field() {
        let s = Share {
            requests: (1 << 31) - 1,
            pending: 5,
            tokens: u64::from(u32::MAX),
            pending_tokens: 9,
            toggle_requests: true,
            toggle_tokens: false,
        };
        assert_eq!(Share::unpack(s.pack()), s);
        let s = Share {
            toggle_tokens: true,
            toggle_requests: false,
            ..s
        };
        assert_eq!(Share::unpack(s.pack()), s);
    }

    #[test]
    fn counters_clamp_and_refuse_instead_of_wrapping() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let a = t.register(1, "a", 0).unwrap();
        t.end_request(1, a, 5, false); // never begun
        assert_eq!((t.inflight(a), t.pending(a)), ((0, 0), (0, 0)));
        assert!(t.begin_request(1, a, u64::MAX));
        assert_eq!(
            t.inflight(a),
            (1, super::MAX_CHARGED_TOKENS),
            "one request's charge is capped"
        );
        s[0].requests
            .store(super::MAX_REQUESTS as u128, crate::sync::Ordering::Relaxed);
        assert!(!t.begin_request(1, a, 1), "a full counter refuses");
        assert_eq!(t.inflight(a).0, super::MAX_REQUESTS);
    }

    #[test]
    fn stale_refs_touch_nothing() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let a = t.register(1, "a", 0).unwrap();
        assert!(t.begin_request(0, a, 5));
        assert!(t.retire(a));
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
