//! `dual_map`: two hash candidates per prompt prefix, chosen between by
//! cache match and an estimated TTFT against an SLO, with hotspot
//! rebalancing through the gateway queue (after DualMap, 2025: "Enabling
//! Both Cache Affinity and Load Balancing for Distributed LLM Serving").
//!
//! Hashing a prefix to one server gives affinity but piles a hot prefix
//! onto that server; picking freely balances load but scatters the cache.
//! Two independent hashes give every prefix two homes: the prefix's cache
//! lives on at most two servers and its load can use both (the "power of
//! two choices", Mitzenmacher 2001).
//!
//! # Rule
//!
//! 1. **Adaptive prefix length.** The hashed prefix is the prompt's first
//!    `L` blocks (`chain[L - 1]` names exactly that prefix). `L` runs over
//!    the multiples of `min_prefix_blocks` up to `max_prefix_blocks` and the
//!    prompt's length (a prompt shorter than `min_prefix_blocks` is hashed
//!    whole), and is the *shortest* such length whose prefix is not hot
//!    and that goes past the prompt's known shared header
//!    ([`RouteInput::header_blocks`], detected from how prompts diverge,
//!    [`super::shared_header`]), else the longest. (The sketch needs
//!    [`MIN_HOT_REQUESTS`] requests per dispatcher before a system prompt
//!    is hot; sixteen conversations starting at once were all hashed by
//!    it until then, two engines taking 14 of them. With `hot_share =
//!    1.0`, DualMap's fixed-length hashing, the header is not skipped
//!    either.) Every length of a new request is counted, not only
//!    those up to the chosen one: a shared system prompt of `h` blocks is
//!    then hot at every length after its first few requests, and the
//!    hashed length goes straight past it. (Counting only up to the chosen
//!    length, it crept past the header one step per few requests, each
//!    conversation's hashed prefix and two homes changing turn by turn on
//!    the way: 52–59 % of later turns stayed on their engine in
//!    `tests/shared_prompt.rs`, issue 38.) Steps of `min_prefix_blocks` rather than doublings:
//!    the first cold length past a hot shared prefix is then the same for
//!    every turn of a conversation long enough to reach it, so a session
//!    keeps its two homes while the shared prefix spreads. Only the lengths
//!    up to the chosen one are counted. A
//!    prefix is hot when its share of the recent requests of this
//!    dispatcher exceeds `hot_share` (default 0 = one server's share,
//!    `1 / servers`) and it had at least [`MIN_HOT_REQUESTS`] of them (so
//!    the first few requests of a gateway are not all hot). So a cold prompt is hashed by a short prefix (its
//!    relatives group with it), while requests under a hot shared prefix
//!    (a long system prompt) are hashed by a longer one and spread, each
//!    conversation still keeping its own two homes. Counts are kept in a
//!    4 096-cell sketch per dispatcher, halved every `window` requests.
//! 2. **Two candidates** on two independent hash rings
//!    (`ring::HashRing`, so adding or removing a server moves few
//!    keys): candidate 1 on ring 1, candidate 2 the first other server on
//!    ring 2.
//! 3. **Estimated TTFT** of a candidate `c`:
//!    `(pending prefill tokens at c + this prompt's tokens not cached at c)
//!    / prefill_tokens_per_sec`, where pending prefill tokens are the
//!    uncached prompt tokens of the requests the gateway sent to `c` that
//!    have no first token yet ([`Candidate::pending_tokens`]), and "cached"
//!    is what the prefix table says `c` holds of this prompt.
//! 4. **Choice.** The candidate holding more of the prompt (ties: the lower
//!    estimate, then candidate 1: [`Reason::HashCandidate`]; but a
//!    candidate the shared balance rule finds overloaded, [`super::balance`],
//!    comes after one it does not, whatever they hold: after a scale-out a
//!    conversation whose two homes are its loaded old engine and a new one
//!    moves to the new one, issue 38), unless its
//!    estimate breaks `ttft_slo_ms` and the other's is lower: then the other
//!    ([`Reason::Slo`]). **The conversation's engine first:** when a
//!    server that is not full holds more of the prompt past its shared
//!    header than either candidate (a conversation whose earlier turns
//!    were hashed by another prefix length: its first turns came before
//!    the system prompt was hot, or a server was added to the rings
//!    since) and the shared balance rule does not find it overloaded
//!    ([`super::balance`]), it gets the request ([`Reason::Prefix`]), unless its
//!    estimate breaks `ttft_slo_ms` and the chosen candidate's is lower
//!    (the rule between the two candidates, with the holder as the one
//!    holding more). (Not "unless its estimate is higher": a holder with
//!    some work pending would then lose the conversation to a cold engine
//!    that must prefill its whole history, whenever that history is
//!    shorter than the work pending.)
//!    Where the two hash homes and
//!    the cache already agree, this changes nothing; where they do not,
//!    moving would only recompute the conversation's history elsewhere.
//! 5. **Hotspot rebalancing.** If the chosen server is full (its
//!    [pending estimate](Candidate::pending_estimate) is above
//!    `max_pending`), the request goes to the other candidate if that one is
//!    not full and its estimate is lower ([`Reason::Rebalanced`]); else it
//!    waits in the gateway queue ([`Policy::holds_requests`]). Each time the
//!    queue is looked at again this rule runs again with fresh load, so a
//!    request queued for an overloaded candidate moves to its other one as
//!    soon as that lowers its estimated TTFT. A request that has waited
//!    `ttft_slo_ms` ([`RouteInput::waited_ms`]) has missed the objective
//!    anyway: it goes to the least loaded server that is not full
//!    ([`Reason::LeastLoad`]), so two homes that are stuck, or each busy
//!    with one long answer in its only slot, do not hold it until the
//!    queue's `max_wait_ms` (a 503) while other servers are free.
//!
//! A prompt shorter than one block has no prefix to hash: the least
//! loaded server that is not full.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use super::balance::{Balance, least_busy};
use super::least_load::least_loaded_where;
use super::ring::HashRing;
use super::{Candidate, Choice, InvalidParam, Policy, Reason, RouteInput, best_prefix, in_range, in_range_f64};

/// Tuning of the [`DualMap`] policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DualMapParams {
    /// Shortest hashed prefix, in blocks, and the step by which a hot one
    /// is extended. Default 4 (64 tokens at 16-token blocks); 1 to 65 536.
    pub min_prefix_blocks: u32,
    /// Longest hashed prefix, in blocks. Default 4096; at least
    /// `min_prefix_blocks`.
    pub max_prefix_blocks: u32,
    /// Share of recent requests above which a prefix is hot and the hashed
    /// prefix is extended past it. Default 0.0 = `1 / servers`; 0.0 to 1.0.
    pub hot_share: f64,
    /// Requests between halvings of the hotness counts. Default 1024; 16 to
    /// 1 000 000.
    pub window: u64,
    /// The TTFT objective, in milliseconds. Default 2000; 1 to 3 600 000.
    pub ttft_slo_ms: u64,
    /// The engines' prefill speed, in tokens per second, for the TTFT
    /// estimate. Default 10 000 (an 8B model on an A100, and the
    /// simulator's default); above 0.
    pub prefill_tokens_per_sec: f64,
    /// A candidate is full above this many pending requests. Default 0.
    pub max_pending: u64,
    /// Points per server on each ring. Default 100; 1 to 10 000.
    pub virtual_nodes: u32,
}

impl Default for DualMapParams {
    fn default() -> Self {
        Self {
            min_prefix_blocks: 4,
            max_prefix_blocks: 4096,
            hot_share: 0.0,
            window: 1024,
            ttft_slo_ms: 2000,
            prefill_tokens_per_sec: 10_000.0,
            max_pending: 0,
            virtual_nodes: 100,
        }
    }
}

impl DualMapParams {
    /// Checks the ranges; the error names the field, its value and the reason.
    pub fn validate(&self) -> Result<(), InvalidParam> {
        in_range(
            "min_prefix_blocks",
            u64::from(self.min_prefix_blocks),
            1,
            65_536,
            "blocks of the shortest hashed prefix",
        )?;
        in_range(
            "max_prefix_blocks",
            u64::from(self.max_prefix_blocks),
            u64::from(self.min_prefix_blocks),
            1 << 24,
            "blocks of the longest hashed prefix, at least min_prefix_blocks",
        )?;
        in_range_f64(
            "hot_share",
            self.hot_share,
            0.0,
            1.0,
            "a share of requests; 0 = 1/servers",
        )?;
        in_range("window", self.window, 16, 1_000_000, "requests between halvings")?;
        in_range("ttft_slo_ms", self.ttft_slo_ms, 1, 3_600_000, "milliseconds")?;
        in_range_f64(
            "prefill_tokens_per_sec",
            self.prefill_tokens_per_sec,
            f64::MIN_POSITIVE,
            1e12,
            "tokens per second, above 0",
        )?;
        in_range("max_pending", self.max_pending, 0, 1_000_000, "pending requests")?;
        in_range(
            "virtual_nodes",
            u64::from(self.virtual_nodes),
            1,
            10_000,
            "points per server on a ring",
        )
    }
}

/// Requests a prefix needs among the recent ones to count as hot.
pub const MIN_HOT_REQUESTS: u32 = 8;

/// Cells of the hotness sketch.
const SKETCH_CELLS: usize = 4096;

/// Recent request counts per prefix hash, halved every `window` requests.
#[derive(Debug)]
struct Hotness {
    cells: Box<[AtomicU32]>,
    /// Requests counted (decayed like the cells).
    total: AtomicU64,
    /// Requests since the start (drives the halving).
    seen: AtomicU64,
}

impl Hotness {
    fn new() -> Self {
        Self {
            cells: (0..SKETCH_CELLS).map(|_| AtomicU32::new(0)).collect(),
            total: AtomicU64::new(0),
            seen: AtomicU64::new(0),
        }
    }

    fn cell(&self, key: u64) -> &AtomicU32 {
        &self.cells[(key >> 52) as usize % SKETCH_CELLS]
    }

    /// Counts one request under `key` and returns the new count.
    fn bump(&self, key: u64) -> u32 {
        self.cell(key).fetch_add(1, Ordering::Relaxed).saturating_add(1)
    }

    /// The count under `key`.
    fn count(&self, key: u64) -> u32 {
        self.cell(key).load(Ordering::Relaxed)
    }

    /// Ends counting one request; every `window` requests, halves all counts.
    fn finish(&self, window: u64) {
        self.total.fetch_add(1, Ordering::Relaxed);
        if (self.seen.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(window) {
            for c in self.cells.iter() {
                let v = c.load(Ordering::Relaxed);
                c.store(v / 2, Ordering::Relaxed);
            }
            let t = self.total.load(Ordering::Relaxed);
            self.total.store(t / 2, Ordering::Relaxed);
        }
    }
}

/// DualMap's two-choice prefix mapping.
#[derive(Debug)]
pub struct DualMap {
    params: DualMapParams,
    rings: [HashRing; 2],
    hotness: Hotness,
    turn: AtomicU64,
}

/// Seeds of the two rings.
const RING_SEEDS: [u64; 2] = [0xd0a1_0001, 0xd0a1_0002];

impl DualMap {
    /// A policy with `params` (validated first).
    pub fn new(params: DualMapParams) -> Self {
        Self {
            rings: RING_SEEDS.map(|seed| HashRing::new(params.virtual_nodes, seed)),
            hotness: Hotness::new(),
            params,
            turn: AtomicU64::new(0),
        }
    }

    /// The hashed prefix length in blocks for `chain` whose first
    /// `header` blocks are a known shared header (see rule 1), counting
    /// this request into the hotness sketch unless it is a `repeat`. 0 for
    /// an empty chain.
    fn prefix_blocks(&self, chain: &[u64], header: u32, servers: usize, repeat: bool) -> usize {
        if chain.is_empty() {
            return 0;
        }
        let share = if self.params.hot_share > 0.0 {
            self.params.hot_share
        } else {
            1.0 / servers.max(1) as f64
        };
        let recent = self.hotness.total.load(Ordering::Relaxed) + u64::from(!repeat);
        let threshold = (share * recent as f64).max(f64::from(MIN_HOT_REQUESTS - 1));
        let longest = chain.len().min(self.params.max_prefix_blocks as usize);
        let step = self.params.min_prefix_blocks as usize;
        let mut chosen = None;
        // The first length past the shared header: inside it, every
        // length is hot as soon as the sketch has seen enough of it. (Not
        // with `hot_share = 1.0`: no prefix is ever hot, DualMap's own
        // fixed-length hashing.)
        let skip = if self.params.hot_share < 1.0 {
            (header as usize / step) * step
        } else {
            0
        };
        let mut level = (skip + step).min(longest);
        loop {
            let count = if repeat {
                self.hotness.count(chain[level - 1])
            } else {
                self.hotness.bump(chain[level - 1])
            };
            if chosen.is_none() && (f64::from(count) <= threshold || level == longest) {
                chosen = Some(level);
                if repeat {
                    break;
                }
            }
            if level == longest {
                break;
            }
            level = (level + step).min(longest);
        }
        if !repeat {
            self.hotness.finish(self.params.window);
        }
        chosen.unwrap_or(longest)
    }

    /// Estimated TTFT at `c` in milliseconds (rule 3).
    fn estimate_ms(&self, input: &RouteInput<'_>, c: &Candidate) -> f64 {
        let cached = u64::from(input.useful_blocks(c.server.tag())) * u64::from(input.block_tokens);
        let uncached = u64::from(input.prompt_tokens).saturating_sub(cached);
        (c.pending_tokens + uncached) as f64 * 1000.0 / self.params.prefill_tokens_per_sec
    }

    fn full(&self, c: &Candidate) -> bool {
        c.pending_estimate() > self.params.max_pending
    }

    /// The two candidates of the prefix `key` (the second may be absent).
    fn candidates<'c>(&self, key: u64, candidates: &'c [Candidate]) -> Option<(&'c Candidate, Option<&'c Candidate>)> {
        let first = self.rings[0].walk(key, candidates, |_| true)?;
        let second = self.rings[1].walk(key, candidates, |c| c.server != first.server);
        Some((first, second))
    }

    /// The least loaded server that is not full ([`Reason::LeastLoad`]).
    fn least_loaded_free(&self, candidates: &[Candidate]) -> Option<Choice> {
        least_loaded_where(candidates, |c| !self.full(c), &self.turn).map(|c| Choice {
            server: c.server,
            reason: Reason::LeastLoad,
        })
    }
}

impl Policy for DualMap {
    fn name(&self) -> &'static str {
        "dual_map"
    }

    fn choose(&self, input: &RouteInput<'_>) -> Option<Choice> {
        let blocks = self.prefix_blocks(input.chain, input.header_blocks, input.candidates.len(), input.repeat);
        if blocks == 0 {
            return self.least_loaded_free(input.candidates);
        }
        let (first, second) = self.candidates(input.chain[blocks - 1], input.candidates)?;
        let held = |c: &Candidate| input.useful_blocks(c.server.tag());
        // (candidate, which, estimated TTFT in ms)
        let mut preferred = (first, 1u8, self.estimate_ms(input, first));
        let mut other = second.map(|c| (c, 2u8, self.estimate_ms(input, c)));
        // Preferred: not out of balance, then more blocks held, then the
        // lower estimate, then candidate 1.
        let least = least_busy(input.candidates);
        let balanced = |c: &Candidate| !Balance::DEFAULT.overloaded(c, least);
        if let Some(o) = other {
            let key = |c: &(&Candidate, u8, f64)| (balanced(c.0), held(c.0));
            if key(&o) > key(&preferred) || (key(&o) == key(&preferred) && o.2 < preferred.2) {
                other = Some(preferred);
                preferred = o;
            }
        }
        let (mut pick, mut reason) = (
            preferred,
            Reason::HashCandidate {
                candidate: preferred.1,
                blocks: held(preferred.0),
            },
        );
        let mut alternative = other;
        if let Some(o) = other
            && preferred.2 > self.params.ttft_slo_ms as f64
            && o.2 < preferred.2
        {
            (pick, reason, alternative) = (o, Reason::Slo, Some(preferred));
        }
        // The conversation's engine, when neither home holds as much of it,
        // unless its estimate breaks the SLO where the pick's does not.
        let homes_hold = held(first).max(second.map_or(0, held));
        let keeps = |c: &Candidate| !self.full(c) && balanced(c);
        if let Some((holder, blocks)) = best_prefix(input, keeps)
            && blocks > homes_hold
            && (self.estimate_ms(input, holder) <= self.params.ttft_slo_ms as f64
                || self.estimate_ms(input, holder) < pick.2)
        {
            return Some(Choice {
                server: holder.server,
                reason: Reason::Prefix { blocks },
            });
        }
        if !self.full(pick.0) {
            return Some(Choice {
                server: pick.0.server,
                reason,
            });
        }
        match alternative {
            Some(o) if !self.full(o.0) && o.2 < pick.2 => Some(Choice {
                server: o.0.server,
                reason: Reason::Rebalanced,
            }),
            _ if input.waited_ms >= self.params.ttft_slo_ms => self.least_loaded_free(input.candidates),
            _ => None,
        }
    }

    fn holds_requests(&self) -> bool {
        true
    }

    fn admits(&self, counted: &Candidate) -> bool {
        // Never sent to a full candidate: it was free before this request.
        counted.pending_estimate() <= self.params.max_pending + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::test_support::{Fixture, cand, input_for};
    use shm_layout::PrefixMatch;

    fn params() -> DualMapParams {
        DualMapParams {
            min_prefix_blocks: 2,
            ..DualMapParams::default()
        }
    }

    /// The two candidates of `chain` (as the policy would hash it cold).
    fn pair(p: &DualMap, chain: &[u64], cands: &[Candidate]) -> (ServerPair, ServerPair) {
        let (a, b) = p.candidates(chain[1], cands).unwrap();
        (a.server, b.unwrap().server)
    }

    type ServerPair = shm_layout::ServerRef;

    /// Idle candidates of `f`, a 6-block chain from `seed`, and its two
    /// homes `(a, b)`, with `a` holding the whole chain.
    fn held_by_first_home(f: &Fixture, p: &DualMap, seed: u64) -> (Vec<Candidate>, Vec<u64>, ServerPair, ServerPair) {
        let idle: Vec<Candidate> = f.s.iter().map(|&s| cand(s, 0, 0)).collect();
        let chain = Fixture::chain(seed, 6);
        let (a, b) = pair(p, &chain, &idle);
        let slot = f.s.iter().position(|&x| x == a).unwrap();
        f.hold(slot, &chain);
        (idle, chain, a, b)
    }

    #[test]
    fn a_cold_prompt_goes_to_the_candidate_holding_more_of_it() {
        let f = Fixture::new(6);
        let cands: Vec<Candidate> = f.s.iter().map(|&s| cand(s, 0, 0)).collect();
        let p = DualMap::new(params());
        let chain = Fixture::chain(1, 6);
        let (a, b) = pair(&p, &chain, &cands);
        assert_ne!(a, b);
        let slot = |s: ServerPair| f.s.iter().position(|&x| x == s).unwrap();
        f.hold(slot(b), &chain[..4]);
        let m = f.matched(&chain);
        let c = p.choose(&input_for(&chain, 96, &m, &cands)).unwrap();
        assert_eq!(
            c,
            Choice {
                server: b,
                reason: Reason::HashCandidate {
                    candidate: 2,
                    blocks: 4
                }
            }
        );
        // Nothing cached: candidate 1 (equal estimates).
        let none = PrefixMatch::default();
        let c = p.choose(&input_for(&chain, 96, &none, &cands)).unwrap();
        assert_eq!(c.server, a);
    }

    #[test]
    fn a_broken_slo_sends_the_request_to_the_other_candidate() {
        let f = Fixture::new(6);
        let p = DualMap::new(DualMapParams {
            ttft_slo_ms: 100,
            max_pending: 100,
            ..params()
        });
        let (idle, chain, a, b) = held_by_first_home(&f, &p, 2);
        let m = f.matched(&chain);
        // a holds everything but has 2 000 pending prompt tokens: 200 ms > 100 ms; b: 96 tokens = 9.6 ms.
        let cands: Vec<Candidate> = idle
            .iter()
            .map(|&c| Candidate {
                pending: u64::from(c.server == a),
                pending_tokens: if c.server == a { 2000 } else { 0 },
                ..c
            })
            .collect();
        let c = p.choose(&input_for(&chain, 96, &m, &cands)).unwrap();
        assert_eq!(
            c,
            Choice {
                server: b,
                reason: Reason::Slo
            }
        );
        // Within the SLO it stays with the cache.
        let relaxed = DualMap::new(DualMapParams {
            ttft_slo_ms: 1000,
            max_pending: 100,
            ..params()
        });
        assert_eq!(relaxed.choose(&input_for(&chain, 96, &m, &cands)).unwrap().server, a);
    }

    #[test]
    fn an_overloaded_home_gives_the_conversation_to_its_other_home() {
        // A conversation on its home `a`, the other home `b` cold: `a` keeps
        // it while the spread is within the balance threshold (2 for an
        // engine that reported no capacity), and gives it up beyond.
        let f = Fixture::new(4);
        let p = DualMap::new(params());
        let (_, chain, a, b) = held_by_first_home(&f, &p, 3);
        let m = f.matched(&chain);
        let loaded =
            |n: u64| -> Vec<Candidate> { f.s.iter().map(|&s| cand(s, if s == a { n } else { 0 }, 0)).collect() };
        let within = loaded(2);
        assert_eq!(p.choose(&input_for(&chain, 96, &m, &within)).unwrap().server, a);
        let beyond = loaded(3);
        let c = p.choose(&input_for(&chain, 96, &m, &beyond)).unwrap();
        assert_eq!(c.server, b, "{c:?}");
        assert_eq!(
            c.reason,
            Reason::HashCandidate {
                candidate: 2,
                blocks: 0
            }
        );
    }

    #[test]
    fn a_full_candidate_waits_or_rebalances_to_the_other_when_that_is_faster() {
        let f = Fixture::new(6);
        let p = DualMap::new(params());
        assert!(p.holds_requests());
        let (idle, chain, a, b) = held_by_first_home(&f, &p, 3);
        let m = f.matched(&chain);
        let with = |pending_a: u64, tokens_a: u64, pending_b: u64, tokens_b: u64| -> Vec<Candidate> {
            idle.iter()
                .map(|&c| match c.server {
                    // Engines without metrics that run one request at a
                    // time (learned admission limit 1).
                    s if s == a => Candidate {
                        inflight: pending_a,
                        pending: pending_a,
                        pending_tokens: tokens_a,
                        admission: 1,
                        ..c
                    },
                    s if s == b => Candidate {
                        inflight: pending_b,
                        pending: pending_b,
                        pending_tokens: tokens_b,
                        admission: 1,
                        ..c
                    },
                    _ => c,
                })
                .collect()
        };
        // a is full (one request in prefill, 500 tokens = 50 ms); b is free
        // but must prefill all 96 tokens (9.6 ms): rebalanced to b.
        let cands = with(1, 500, 0, 0);
        assert_eq!(
            p.choose(&input_for(&chain, 96, &m, &cands)),
            Some(Choice {
                server: b,
                reason: Reason::Rebalanced
            })
        );
        // a is full with a tiny pending prompt (1 token): b would be slower: wait for a.
        let cands = with(1, 1, 0, 0);
        assert_eq!(p.choose(&input_for(&chain, 96, &m, &cands)), None);
        // Both full: wait. Other servers being free does not matter...
        let cands = with(1, 500, 1, 500);
        assert_eq!(p.choose(&input_for(&chain, 96, &m, &cands)), None);
        // ...until the request has waited the TTFT objective: then the
        // least loaded free server.
        let waited = |ms| RouteInput {
            waited_ms: ms,
            ..input_for(&chain, 96, &m, &cands)
        };
        assert_eq!(p.choose(&waited(p.params.ttft_slo_ms - 1)), None);
        let moved = p.choose(&waited(p.params.ttft_slo_ms)).expect("a free server");
        assert_eq!(moved.reason, Reason::LeastLoad);
        assert!(moved.server != a && moved.server != b, "{moved:?}");
    }

    #[test]
    fn a_hot_prefix_is_hashed_longer_and_spreads_while_a_cold_one_keeps_its_pair() {
        let f = Fixture::new(8);
        let cands: Vec<Candidate> = f.s.iter().map(|&s| cand(s, 0, 0)).collect();
        let p = DualMap::new(DualMapParams {
            min_prefix_blocks: 2,
            window: 64,
            ..DualMapParams::default()
        });
        let none = PrefixMatch::default();
        let system = Fixture::chain(7, 4); // a shared 4-block prefix
        let mut used = std::collections::HashSet::new();
        for conversation in 0..200u64 {
            // Each conversation: the system prompt's hashes, then its own blocks.
            let mut chain = system.clone();
            chain.extend(Fixture::chain(1000 + conversation, 4).iter().map(|h| h ^ system[3]));
            used.insert(p.choose(&input_for(&chain, 128, &none, &cands)).unwrap().server);
        }
        assert!(
            used.len() > 2,
            "a hot prefix spreads beyond its two candidates: {}",
            used.len()
        );
        // Without adaptation (hot_share 1.0: never hot) it keeps to its pair.
        let fixed = DualMap::new(DualMapParams {
            min_prefix_blocks: 4,
            hot_share: 1.0,
            ..DualMapParams::default()
        });
        let mut used = std::collections::HashSet::new();
        let mut load: Vec<Candidate> = cands.clone();
        for conversation in 0..50u64 {
            let mut chain = system.clone();
            chain.extend(Fixture::chain(1000 + conversation, 4));
            let c = fixed.choose(&input_for(&chain, 128, &none, &load)).unwrap();
            used.insert(c.server);
            // Each request stays in prefill: its server fills and the next goes to the other candidate.
            for x in &mut load {
                if x.server == c.server {
                    x.pending_tokens += 128;
                }
            }
            if used.len() == 2 {
                for x in &mut load {
                    x.pending_tokens = 0;
                }
            }
        }
        assert_eq!(
            used.len(),
            2,
            "a fixed-length hot prefix uses exactly its two candidates"
        );
    }

    #[test]
    fn a_session_under_a_hot_prefix_keeps_its_hashed_length_from_turn_to_turn() {
        let p = DualMap::new(DualMapParams {
            min_prefix_blocks: 4,
            ..DualMapParams::default()
        });
        let system = Fixture::chain(5, 10); // 10 shared blocks
        let conversation = |c: u64, blocks: usize| -> Vec<u64> {
            let mut chain = system.clone();
            chain.extend(Fixture::chain(100 + c, blocks).iter().map(|h| h ^ system[9]));
            chain
        };
        for c in 0..40 {
            p.prefix_blocks(&conversation(c, 6), 0, 4, false);
        }
        // Levels 4 and 8 are inside the hot system prompt; 12 is the first
        // with the conversation's own blocks, whatever its length.
        for turn_blocks in [6, 10, 20, 40] {
            assert_eq!(p.prefix_blocks(&conversation(999, turn_blocks), 0, 4, false), 12);
        }
        // A cold prompt: the shortest length.
        assert_eq!(p.prefix_blocks(&Fixture::chain(77, 30), 0, 4, false), 4);
        // A known shared header of 9 blocks: the first length past it,
        // hot or not (the header's own lengths were never counted here).
        let fresh = DualMap::new(DualMapParams {
            min_prefix_blocks: 4,
            ..DualMapParams::default()
        });
        assert_eq!(fresh.prefix_blocks(&Fixture::chain(78, 30), 9, 4, false), 12);
        assert_eq!(fresh.prefix_blocks(&Fixture::chain(79, 30), 8, 4, false), 12);
        assert_eq!(fresh.prefix_blocks(&Fixture::chain(80, 10), 9, 4, false), 10);
    }

    #[test]
    fn looking_again_at_a_queued_request_does_not_make_its_prefix_hot() {
        let p = DualMap::new(DualMapParams {
            min_prefix_blocks: 2,
            window: 64,
            ..DualMapParams::default()
        });
        let chain = Fixture::chain(11, 8);
        assert_eq!(p.prefix_blocks(&chain, 0, 4, false), 2, "cold: the shortest prefix");
        for _ in 0..1000 {
            assert_eq!(p.prefix_blocks(&chain, 0, 4, true), 2);
        }
        // Counted requests do make it hot: 21 > max(1/4 of the 21 recent, 7).
        for _ in 0..20 {
            p.prefix_blocks(&chain, 0, 4, false);
        }
        assert!(p.prefix_blocks(&chain, 0, 4, true) > 2);
    }

    #[test]
    fn parameters_are_checked() {
        assert_eq!(DualMapParams::default().validate(), Ok(()));
        let bad = DualMapParams {
            max_prefix_blocks: 1,
            min_prefix_blocks: 4,
            ..DualMapParams::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .starts_with("max_prefix_blocks = 1")
        );
        let bad = DualMapParams {
            prefill_tokens_per_sec: 0.0,
            ..DualMapParams::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .starts_with("prefill_tokens_per_sec = 0")
        );
    }
}
