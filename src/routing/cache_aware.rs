//! `cache_aware` (the default): SGLang's cache-aware routing on semlb's
//! shared tables.
//!
//! SGLang's router (`sgl-model-gateway`, `policies/cache_aware.rs`) keeps a
//! radix tree of the text it sent to each worker and routes a request to the
//! worker whose tree matches most of it, unless the load is out of balance.
//! semlb has the same information without a tree: the shm prefix table says,
//! per live server, how many leading token blocks of the prompt it holds
//! ([`shm_layout::PrefixMatch`]), and the server table counts the requests
//! in flight to each server through every dispatcher.
//!
//! # Rule
//!
//! With `load` = [`Candidate::inflight`], `min` the least load over the
//! candidates, and, for a server `w`,
//! `overloaded(w) = load(w) − min > abs(w) && load(w) > balance_rel_threshold × min`,
//! where `abs(w)` is the absolute threshold scaled to what `w` can take
//! (see [Capacity](#capacity)):
//!
//! 1. **Prompt shorter than one block** (`prompt_blocks == 0`): nothing to
//!    match; least load.
//! 2. **Prefix winner**: the candidate holding the most leading blocks
//!    *past the prompt's shared header* ([`RouteInput::useful_blocks`]: a
//!    match that ends at a system prompt many conversations open with is
//!    no evidence of where this one belongs; see
//!    [`super::shared_header`]). Entries of the match for servers that are
//!    not candidates (gone down, draining, re-registered since the lookup)
//!    are ignored; among candidates with equally many blocks the less
//!    loaded wins (fewer in-flight requests, then tokens), then the one
//!    the match lists first (the most recently refreshed). If its ratio
//!    `blocks / prompt_blocks > cache_threshold` (strictly, as in SGLang),
//!    it is not `overloaded`, and (with `weigh_queued_prefill`) the
//!    prefill work queued there beyond the least queued candidate is not
//!    more than the prefill its cache saves this request, it gets the
//!    request ([`Reason::Prefix`]).
//! 3. Otherwise least load.
//!
//! Least load is the least work queued ahead of the request
//! ([`Candidate::queued_work`]: pending prefill tokens, requests the
//! engine shows queued beyond those, 16 tokens per decoding request; with
//! `weigh_queued_prefill`, the default), then [`super::least_load`]'s
//! rule: fewest in-flight requests, then fewest in-flight prompt tokens,
//! then in turn among exact ties (a counter), so idle servers share a
//! burst. SGLang's current gateway also
//! sends cache misses to the least-loaded worker, breaking ties at random
//! (its first router sent them to the worker with the smallest tree).
//!
//! # Where this departs from SGLang
//!
//! SGLang routes *every* request by load while the system is imbalanced
//! (`max − min` over both thresholds), and judges imbalance against an
//! absolute 32 requests. Both fail a small fleet:
//!
//! * 32 is an eighth of a 256-sequence vLLM engine. With four engines and
//!   sixteen clients the spread can never reach it, so affinity always
//!   wins; and since every conversation of one application opens with the
//!   same system prompt, every conversation matched the engine that first
//!   computed it: 500 of 500 requests on one of four engines, 63 req/s
//!   where SMG served 340 (issue 38). Here the threshold is scaled to the
//!   engine's capacity, and a shared header does not count as a match.
//! * A system-wide imbalance moves conversations whose own engine is not
//!   the busy one, and loses their cache for nothing. Here only a
//!   request whose winner is itself overloaded goes by load, so the
//!   conversations of the busiest engine move first. (With shared
//!   thresholds SGLang's check fires whenever this one does for some
//!   winner: `overloaded` grows with its argument and no winner is above
//!   `max`.)
//!
//! # Queued prefill
//!
//! Requests in flight are a poor measure of an engine's load when prompts
//! are long: two requests in prefill of 12 000 tokens each hold an engine
//! for seconds, two decoding requests hardly at all. With
//! `weigh_queued_prefill` (the default) two rules follow:
//!
//! * The winner must not have more prefill work queued ahead of this
//!   request, beyond the least queued candidate, than the prefill its
//!   cache saves, nor than `queued_prefill_margin` (default 2 048 tokens):
//!   `pending_tokens(w) − min pending_tokens ≤ max(blocks × block tokens,
//!   margin)`, where pending tokens are the uncached prompt tokens of the
//!   requests the gateway sent there that have no first token yet
//!   ([`Candidate::pending_tokens`]). A conversation's next turn saves its
//!   whole history and keeps its engine; a request whose match saves a few
//!   thousand tokens does not queue behind tens of thousands. The margin is
//!   there for short prompts: work that fits in one prefill step of the
//!   engine is scheduled with the new request, while a move loses the
//!   conversation's cache for all its later turns. (Without it, measured
//!   2026-11-28 on the `hh-rlhf` replay of ~100-token prompts, a few
//!   hundred tokens queued moved conversations: 37.9 % of later turns
//!   stayed, against 51.1 % with it, and goodput was 221 against 331
//!   req/s.)
//! * The fallback (no winner, or the winner lost) is the server with the
//!   least work queued ahead of the request ([`Candidate::queued_work`],
//!   as `cost` counts it), then the fewest in flight. On the Mooncake
//!   trace (prompts of 11 000 tokens on average, engines at 83 % of their
//!   prefill capacity) both rules together took `cache_aware` from 89.4 %
//!   of requests within the TTFT objective to 98.7 % (replays of that
//!   trace move by about ±4 points; docs/results/replay-policies.md).
//! * With `fallback_weighs_own_prefill` (the default) the fallback also
//!   counts, at each server, the prefill this request would bring there:
//!   its prompt tokens past what the server holds of it, the shared
//!   header included. A new conversation, whose only match is a system
//!   prompt many conversations share, has no winner (a shared header is
//!   no evidence of where a conversation belongs), and chosen by queued
//!   work alone it went to whichever engine was least busy, so each
//!   system prompt came to be computed on every engine. Now it goes
//!   where its system prompt is warm unless the work queued there exceeds
//!   the others' by more than recomputing it (beyond the same margin), or
//!   the shared balance rule finds that engine overloaded (decoding
//!   requests weigh little as queued work, so without it the first engine
//!   to compute a long system prompt would keep taking conversations that
//!   arrive one at a time); load still spreads it, at the price of one
//!   more copy. Measured
//!   2026-11-29 (issue 38), two runs against the rule without it: on
//!   `hot-prefix` (six system prompts of ~3 750 tokens) a prefix hit rate
//!   of 86.9–87.1 % against 86.7–86.8 %, 100 % within the TTFT objective
//!   at 1.5x the rate against 98–99 %; `agents`' TTFT p99 0.10 s against
//!   0.20 s; `shared-prompt`, `burst`, `scale-out`, `chat`, `hh-rlhf` and
//!   `mooncake` within their run-to-run spread.
//!
//! `weigh_queued_prefill = false` gives SGLang's rules: the winner by
//! prefix and balance alone, the fallback by requests in flight.
//!
//! # Load
//!
//! Load is the gateway-wide count of requests in flight, not the scraped
//! engine figures ([`Candidate::load`]: `waiting`, `running`). The count is
//! exact and current — every dispatcher increments it in shm before
//! proxying and decrements it when the response ends, so a burst shows up
//! request by request — while scraped figures are one scrape interval old
//! (zero before the first scrape) and would let a burst pile onto the
//! server that looked idle at the last scrape. It is also what SGLang
//! balances on (`Worker::load()`, the router's own in-flight count). What
//! the count misses is load from clients that bypass the gateway.
//!
//! # Capacity
//!
//! The rule is [`super::balance`]'s, which the other prefix-aware
//! policies share. With `scale_to_capacity` (the default), `abs(w)` is an
//! eighth of the requests `w`'s engine runs at once, rounded up, at most
//! `balance_abs_threshold` and at least 1 (2 where the engine did not
//! report the number): SGLang's 32 of vLLM's 256 sequences, kept as a
//! proportion. What an engine runs at once is [`Candidate::admission`]:
//! the number the engine reported (llama.cpp's slots, from `/props`), else
//! the admission limit the gateway learns from the latencies it measures
//! ([`crate::routing::capacity`]; it grows while requests are not slowed by those
//! in flight), else [`crate::routing::capacity::INITIAL_LIMIT`] (8) before anything
//! is learned. So two-slot llama.cpp engines are balanced at a spread of
//! 1, a sim or vLLM engine at 2 until its latencies show no queue with
//! more than 16 in flight (5 at 40), and a 256-sequence engine at 32.
//! Without scaling, `balance_abs_threshold` as it is.
//!
//! A scaled threshold is small (2 for an engine of 16 at once), and a
//! spread of 3 is common noise at a few requests in flight per engine: an
//! agent step whose engine holds thousands of tokens of its own history
//! moved for it and paid them again. So the threshold of the winner is
//! raised by one request per `saved_tokens_per_spread` (default 512) of
//! the request's own cache there (its match past the shared header), up
//! to `balance_abs_threshold`. Measured 2026-11-29 (issue 38) on the
//! replay's `hot-prefix` (agent sessions of 2 000–10 000 tokens on six
//! system prompts), two runs each: 0 (the spread alone) kept 93–94 % of
//! later steps on their engine, a prefix hit rate of 86.1–86.2 % and 98 %
//! of requests within the TTFT objective at 1.5x the rate; 512, 96–97 %,
//! 86.7–86.8 % and 100 %; 256 the same within the spread; 1 024–4 096
//! between the two. `scale-out` (a shared-prompt conversation's own
//! history is under 1 500 tokens) and `shared-prompt`, `burst` and
//! `hh-rlhf` did not move beyond their run-to-run spread. Turning scaling
//! off altogether (SGLang's fixed 32) keeps 98.7 % and a hit rate of
//! 86.9 %, but engines added next to a loaded one then take 57 % of the
//! requests after 5 s instead of 71–74 % after 1.3 s.
//!
//! # Parameters
//!
//! [`CacheAwareParams`]: `cache_threshold = 0.3`, the default of the
//! command lines users run SGLang's router, SMG and vllm-router with;
//! `balance_abs_threshold = 32` and `balance_rel_threshold = 1.1`, SGLang's
//! library `CacheAwareConfig::default()` (its command line: 64 and 1.5).
//!
//! Why 0.3 and not the library's 0.5 (measured 2026-11-28, issue 38): on
//! the replay's `hh-rlhf` chats (~100-token prompts, a new turn often
//! more than twice the previous prompt, so a conversation's own engine
//! holds half of the prompt or less) 0.5 keeps 51 % of later turns on
//! their engine and 91 % of requests within the TTFT objective at 1.5x
//! the rate; 0.49, 58 % and 96 %; 0.3, 74 % and 100 % (vllm-router, at
//! 0.3: 79 %), the other workloads within their run-to-run spread. The
//! peers match the messages' text and semlb the rendered prompt, which
//! opens with the chat template's own text (role markers, a date line, a
//! default system prompt): whole blocks of it count as shared header
//! from the first request on ([`super::shared_header`]'s template
//! opening), so a short prompt whose only match is the template does not
//! stick to the engine that computed it.
//!
//! Choosing never allocates: a handful of passes over the candidates and
//! the (at most 8) match entries, and at most one atomic add.

use std::sync::atomic::AtomicU64;

use serde::{Deserialize, Serialize};

use super::balance::{Balance, least_busy};
use super::least_load::{least_by, least_loaded, load_key};
use super::{Candidate, Choice, InvalidParam, Policy, RUNNING_REQUEST_TOKENS, Reason, RouteInput, best_prefix};

/// Tuning of the [`CacheAware`] policy (SGLang's `CacheAwareConfig`
/// thresholds; see the [module docs](self) for the rule).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheAwareParams {
    /// Fraction of the prompt's blocks (0.0–1.0) the best-matching server
    /// must hold, strictly more than, to get the request for its cache.
    /// 0.0 = any matched block counts; 1.0 = never route by prefix.
    /// Default 0.3 (the command lines of SGLang's router, SMG and
    /// vllm-router; SGLang's library says 0.5: see the
    /// [module docs](self#parameters) for why 0.3).
    pub cache_threshold: f64,
    /// Absolute load spread: the prefix winner is overloaded only if it
    /// has more than this many requests in flight above the least busy
    /// server. With `scale_to_capacity`, the most it is scaled to.
    /// Default 32 (SGLang's library default; its CLI uses 64).
    pub balance_abs_threshold: u64,
    /// Relative load spread (>= 1.0): the winner is overloaded only if it
    /// also has more than this multiple of the least busy server's
    /// requests in flight. Default 1.1 (SGLang's library default; its CLI
    /// uses 1.5).
    pub balance_rel_threshold: f64,
    /// Scale the absolute threshold to the winner's capacity: an eighth of
    /// the requests its engine runs at once (reported, else learned), at
    /// least 1 and at most `balance_abs_threshold` (see the
    /// [module docs](self#capacity)). Default true. (`scale_to_engine_slots`,
    /// its name before issue 38, when only reported slots scaled it, is
    /// still read.)
    #[serde(alias = "scale_to_engine_slots")]
    pub scale_to_capacity: bool,
    /// The winner loses the request when the prefill work queued there
    /// beyond the least queued candidate is more than its cache saves
    /// (see the [module docs](self#queued-prefill)). Default true.
    pub weigh_queued_prefill: bool,
    /// Queued prefill beyond the least queued candidate that never moves a
    /// request, in tokens: work that fits in one prefill step of the
    /// engine is scheduled together with the new request, while moving
    /// a conversation loses its cache for every later turn. Default 2 048
    /// (vLLM's `max_num_batched_tokens` for online serving on most GPUs).
    pub queued_prefill_margin: u64,
    /// Tokens of a conversation's own cache (the winner's match past the
    /// shared header) per request of extra load spread the winner may
    /// carry before it is overloaded: a request that would lose a long
    /// history by moving moves only on a larger spread, up to
    /// `balance_abs_threshold` (see the [module docs](self#capacity)).
    /// 0: the spread alone decides (SGLang's rule). Default 512.
    pub saved_tokens_per_spread: u64,
    /// The fallback counts, with the work queued at each server, the
    /// prefill this request would bring there: its prompt tokens past
    /// what the server holds of it, the shared header included (see the
    /// [module docs](self#queued-prefill)). A new conversation then goes
    /// where its system prompt is warm unless the work queued there
    /// exceeds the others' by more than recomputing it. Default true.
    pub fallback_weighs_own_prefill: bool,
}

impl Default for CacheAwareParams {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 32,
            balance_rel_threshold: 1.1,
            scale_to_capacity: true,
            weigh_queued_prefill: true,
            queued_prefill_margin: QUEUED_PREFILL_MARGIN,
            saved_tokens_per_spread: SAVED_TOKENS_PER_SPREAD,
            fallback_weighs_own_prefill: true,
        }
    }
}

impl CacheAwareParams {
    /// Checks the ranges; the error names the field, its value and the
    /// reason (`cache_threshold = 1.5: must be ...`).
    pub fn validate(&self) -> Result<(), InvalidParam> {
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return Err(InvalidParam::new(
                "cache_threshold",
                self.cache_threshold,
                "must be between 0.0 and 1.0 (the fraction of the prompt's blocks a server must hold)",
            ));
        }
        if !(self.balance_rel_threshold.is_finite() && self.balance_rel_threshold >= 1.0) {
            return Err(InvalidParam::new(
                "balance_rel_threshold",
                self.balance_rel_threshold,
                "must be a finite number >= 1.0 (a ratio of the busiest to the least busy server's load)",
            ));
        }
        Ok(())
    }

    /// Its thresholds as the shared [`Balance`] rule.
    #[inline]
    pub fn balance(&self) -> Balance {
        Balance {
            abs: self.balance_abs_threshold,
            rel: self.balance_rel_threshold,
            scale_to_capacity: self.scale_to_capacity,
        }
    }

    /// Whether the prefix winner `winner` is overloaded against the least
    /// busy of `candidates` when the request holds `own_tokens` of its own
    /// cache there (its match past the shared header): the balance rule
    /// with the absolute threshold raised by one request per
    /// `saved_tokens_per_spread` of them.
    #[inline]
    pub fn winner_overloaded(&self, winner: &Candidate, candidates: &[Candidate], own_tokens: u64) -> bool {
        let extra = own_tokens.checked_div(self.saved_tokens_per_spread).unwrap_or(0);
        self.balance().overloaded_with(winner, least_busy(candidates), extra)
    }
}

impl CacheAwareParams {
    /// [`winner_overloaded`](Self::winner_overloaded) for the engine of the
    /// request's agent session ([`RouteInput::session_engine`]): the
    /// threshold raised to at least half what the engine runs at once (up
    /// to `balance_abs_threshold`). A client that names its session asks
    /// to keep it together; the spread of a few requests that sessions
    /// taking turns make on engines of 16 at once (an eighth: 2) moved a
    /// third of 20 agents' later steps (measured 2026-12-07, issue 43).
    #[inline]
    pub fn session_overloaded(&self, winner: &Candidate, candidates: &[Candidate], own_tokens: u64) -> bool {
        let extra = own_tokens.checked_div(self.saved_tokens_per_spread).unwrap_or(0);
        let half = u64::from(winner.admission.div_ceil(2));
        self.balance()
            .overloaded_with(winner, least_busy(candidates), extra.max(half))
    }
}

/// The default [`CacheAwareParams::queued_prefill_margin`].
pub const QUEUED_PREFILL_MARGIN: u64 = 2048;

/// The default [`CacheAwareParams::saved_tokens_per_spread`] (measured:
/// see the [module docs](self#capacity)).
pub const SAVED_TOKENS_PER_SPREAD: u64 = 512;

/// SGLang-style cache-aware routing: the server holding the longest prefix
/// of the prompt, unless load is out of balance.
#[derive(Debug)]
pub struct CacheAware {
    params: CacheAwareParams,
    /// Rotates among servers tied for least load.
    turn: AtomicU64,
}

impl CacheAware {
    /// A policy with `params` (check them with [`CacheAwareParams::validate`]
    /// first; out-of-range values do not panic but make little sense).
    pub fn new(params: CacheAwareParams) -> Self {
        Self {
            params,
            turn: AtomicU64::new(0),
        }
    }

    /// Its parameters.
    pub fn params(&self) -> &CacheAwareParams {
        &self.params
    }

    /// The fallback: the fewest requests in flight (SGLang's), or with
    /// `weigh_queued_prefill` the least work queued ahead of the request
    /// first (see the [module docs](self#queued-prefill)).
    fn least_load(&self, input: &RouteInput<'_>) -> Option<Choice> {
        let candidates = input.candidates;
        let chosen = if self.params.weigh_queued_prefill {
            let prompt = u64::from(input.prompt_tokens);
            let weigh_own = self.params.fallback_weighs_own_prefill;
            let own = |c: &Candidate| {
                if weigh_own {
                    super::uncached_tokens(
                        input.prompt_tokens,
                        input.prefix.blocks_for(c.server.tag()),
                        input.block_tokens,
                    )
                } else {
                    0
                }
            };
            // A warm system prompt draws new conversations only while the
            // balance rule lets it: decoding requests weigh little as
            // queued work, and an engine first to compute a long system
            // prompt would otherwise keep taking conversations that
            // arrive one at a time.
            let least = if weigh_own { least_busy(candidates) } else { None };
            let eligible = |c: &Candidate| !weigh_own || !self.params.balance().overloaded(c, least);
            let queued = |c: &Candidate| c.per_weight(c.queued_work(prompt, RUNNING_REQUEST_TOKENS) + own(c));
            let band = candidates.iter().filter(|c| eligible(c)).map(queued).min().unwrap_or(0)
                + self.params.queued_prefill_margin.saturating_mul(super::LOAD_UNIT);
            least_by(candidates, load_key, |c| eligible(c) && queued(c) <= band, &self.turn)
        } else {
            least_loaded(candidates, &self.turn)
        };
        chosen.map(|c| Choice {
            server: c.server,
            reason: Reason::LeastLoad,
        })
    }
}

impl Default for CacheAware {
    fn default() -> Self {
        Self::new(CacheAwareParams::default())
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn choose(&self, input: &RouteInput<'_>) -> Option<Choice> {
        let candidates = input.candidates;
        if candidates.is_empty() || input.prompt_blocks == 0 {
            return self.least_load(input);
        }
        if let Some((winner, blocks)) = best_prefix(input, |_| true) {
            let ratio = f64::from(blocks) / f64::from(input.prompt_blocks);
            let own = u64::from(blocks.saturating_sub(input.header_blocks)) * u64::from(input.block_tokens);
            let overloaded = if input.session_engine == Some(winner.server.tag()) {
                self.params.session_overloaded(winner, candidates, own)
            } else {
                self.params.winner_overloaded(winner, candidates, own)
            };
            let queued_too_long = self.params.weigh_queued_prefill && {
                let least_queued = candidates.iter().map(|c| c.pending_tokens).min().unwrap_or(0);
                let saved = u64::from(blocks) * u64::from(input.block_tokens);
                winner.pending_tokens.saturating_sub(least_queued) > saved.max(self.params.queued_prefill_margin)
            };
            if ratio > self.params.cache_threshold && !overloaded && !queued_too_long {
                return Some(Choice {
                    server: winner.server,
                    reason: Reason::Prefix { blocks },
                });
            }
        }
        self.least_load(input)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::test_support::{self, Fixture, choice, input, input_for};
    use shm_layout::{PrefixMatch, ServerRef};

    fn params(cache_threshold: f64, abs: u64, rel: f64) -> CacheAwareParams {
        CacheAwareParams {
            cache_threshold,
            balance_abs_threshold: abs,
            balance_rel_threshold: rel,
            scale_to_capacity: true,
            weigh_queued_prefill: true,
            queued_prefill_margin: QUEUED_PREFILL_MARGIN,
            saved_tokens_per_spread: 0,
            fallback_weighs_own_prefill: false,
        }
    }

    /// A candidate whose engine runs 256 requests at once (vLLM's
    /// default): the scaled threshold is SGLang's 32, so the tests of
    /// the threshold arithmetic see the configured one.
    fn cand(server: ServerRef, inflight: u64, inflight_tokens: u64) -> Candidate {
        with_capacity(test_support::cand(server, inflight, inflight_tokens), 256)
    }

    /// `c` whose engine runs `n` at once (learned).
    fn with_capacity(c: Candidate, n: u32) -> Candidate {
        Candidate { admission: n, ..c }
    }

    fn prefix(blocks: u32) -> Reason {
        Reason::Prefix { blocks }
    }

    #[test]
    fn defaults_are_the_peers_threshold_and_sglangs_library_balance() {
        let p = CacheAwareParams::default();
        assert_eq!(
            (p.cache_threshold, p.balance_abs_threshold, p.balance_rel_threshold),
            (0.3, 32, 1.1)
        );
        assert!(p.scale_to_capacity);
        assert_eq!(p.saved_tokens_per_spread, 512);
        assert!(p.fallback_weighs_own_prefill);
        assert_eq!(p.validate(), Ok(()));
        assert_eq!(CacheAware::default().params(), &p);
    }

    #[test]
    fn empty_candidates_choose_nothing() {
        let f = Fixture::new(1);
        let chain = Fixture::chain(1, 4);
        f.hold(0, &chain);
        let m = f.matched(&chain);
        assert_eq!(CacheAware::default().choose(&input(4, &m, &[])), None);
    }

    #[test]
    fn prefix_above_threshold_wins_over_lower_load() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(1, 10);
        f.hold(1, &chain[..6]);
        let m = f.matched(&chain);
        // s[1] is the busiest, but within the balance thresholds.
        let cands = [cand(f.s[0], 2, 0), cand(f.s[1], 9, 0), cand(f.s[2], 4, 0)];
        let c = CacheAware::default().choose(&input(10, &m, &cands)).unwrap();
        assert_eq!(c, choice(f.s[1], prefix(6)));
    }

    #[test]
    fn prefix_below_threshold_goes_to_least_load() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(2, 10);
        f.hold(1, &chain[..2]);
        let m = f.matched(&chain);
        let cands = [cand(f.s[0], 2, 0), cand(f.s[1], 1, 0), cand(f.s[2], 0, 0)];
        let c = CacheAware::default().choose(&input(10, &m, &cands)).unwrap();
        assert_eq!(c, choice(f.s[2], Reason::LeastLoad));
    }

    #[test]
    fn prefix_exactly_at_threshold_is_not_enough() {
        let f = Fixture::new(2);
        let chain = Fixture::chain(3, 10);
        f.hold(0, &chain[..3]);
        let m = f.matched(&chain);
        let cands = [cand(f.s[0], 1, 0), cand(f.s[1], 0, 0)];
        let p = CacheAware::default();
        // 3 / 10 == 0.3: not strictly above.
        assert_eq!(
            p.choose(&input(10, &m, &cands)).unwrap(),
            choice(f.s[1], Reason::LeastLoad)
        );
        // One more block is.
        f.hold(0, &chain[..4]);
        let m = f.matched(&chain);
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[0], prefix(4)));
    }

    #[test]
    fn a_long_own_history_moves_only_on_a_larger_spread() {
        let f = Fixture::new(2);
        let chain = Fixture::chain(7, 30);
        f.hold(0, &chain[..24]);
        let m = f.matched(&chain);
        // Engines of 16 at once: a spread above 2 is too much.
        let at = |s: usize, inflight: u64| with_capacity(test_support::cand(f.s[s], inflight, 0), 16);
        let keeping = |per: u64| {
            CacheAware::new(CacheAwareParams {
                saved_tokens_per_spread: per,
                ..CacheAwareParams::default()
            })
        };
        let three_above = [at(0, 5), at(1, 2)];
        assert_eq!(
            keeping(0).choose(&input(30, &m, &three_above)).unwrap().reason,
            Reason::LeastLoad
        );
        // 4 of its 24 blocks are the shared header: 20 × 16 = 320 tokens
        // of its own, two requests more at 160 tokens each.
        let mut header = input(30, &m, &three_above);
        header.header_blocks = 4;
        assert_eq!(keeping(160).choose(&header).unwrap(), choice(f.s[0], prefix(24)));
        let five_above = [at(0, 7), at(1, 2)];
        header.candidates = &five_above;
        assert_eq!(keeping(160).choose(&header).unwrap().reason, Reason::LeastLoad);
        // Never beyond balance_abs_threshold.
        let capped = CacheAware::new(CacheAwareParams {
            saved_tokens_per_spread: 1,
            balance_abs_threshold: 3,
            ..CacheAwareParams::default()
        });
        let four_above = [at(0, 6), at(1, 2)];
        header.candidates = &four_above;
        assert_eq!(capped.choose(&header).unwrap().reason, Reason::LeastLoad);
        header.candidates = &three_above;
        assert_eq!(capped.choose(&header).unwrap(), choice(f.s[0], prefix(24)));
    }

    #[test]
    fn the_fallback_can_weigh_the_prefill_each_server_would_do_for_the_request() {
        let f = Fixture::new(3);
        // A new conversation of 200 blocks whose first 160 (2 560 tokens)
        // are a shared system prompt, warm on server 1 only.
        let chain = Fixture::chain(7, 200);
        f.hold(1, &chain[..160]);
        let m = f.matched(&chain);
        let idle = [cand(f.s[0], 0, 0), cand(f.s[1], 0, 0), cand(f.s[2], 0, 0)];
        let mut first_turn = input_for(&chain, 3200, &m, &idle);
        first_turn.header_blocks = 160;
        let weighing = CacheAware::default();
        // The match is only the header, so no winner: the fallback, where
        // server 1 would prefill 640 tokens and the others 3 200.
        for _ in 0..3 {
            assert_eq!(weighing.choose(&first_turn).unwrap(), choice(f.s[1], Reason::LeastLoad));
        }
        // Without: idle servers take turns.
        let by_load = CacheAware::new(CacheAwareParams {
            fallback_weighs_own_prefill: false,
            ..CacheAwareParams::default()
        });
        let mut seen: Vec<ServerRef> = (0..3).map(|_| by_load.choose(&first_turn).unwrap().server).collect();
        seen.sort_by_key(|s| s.slot);
        seen.dedup();
        assert_eq!(seen.len(), 3);
        // Server 1 with 5 000 tokens of prefill queued: 5 640 against 3 200,
        // more than the 2 048-token margin apart: the others.
        let busy = [
            cand(f.s[0], 0, 0),
            Candidate {
                pending: 1,
                pending_tokens: 5000,
                ..cand(f.s[1], 1, 5000)
            },
            cand(f.s[2], 0, 0),
        ];
        first_turn.candidates = &busy;
        for _ in 0..3 {
            assert_ne!(weighing.choose(&first_turn).unwrap().server, f.s[1]);
        }
        // Server 1 with nothing queued but more conversations decoding
        // than the balance rule allows (engines of 16 at once: a spread
        // above 2): the others, though it would prefill the least.
        let of_16 = |inflight: [u64; 3]| {
            inflight
                .iter()
                .zip(&f.s)
                .map(|(&n, &s)| with_capacity(test_support::cand(s, n, 0), 16))
                .collect::<Vec<_>>()
        };
        let crowded = of_16([1, 4, 1]);
        first_turn.candidates = &crowded;
        for _ in 0..3 {
            assert_ne!(weighing.choose(&first_turn).unwrap().server, f.s[1]);
        }
        // At a spread of 2 it still may.
        let within = of_16([1, 3, 1]);
        first_turn.candidates = &within;
        assert_eq!(weighing.choose(&first_turn).unwrap(), choice(f.s[1], Reason::LeastLoad));
    }

    #[test]
    fn threshold_extremes() {
        let f = Fixture::new(2);
        let chain = Fixture::chain(4, 10);
        f.hold(0, &chain[..1]);
        let m = f.matched(&chain);
        let cands = [cand(f.s[0], 1, 0), cand(f.s[1], 0, 0)];
        // 0.0: any matched block routes by prefix.
        let zero = CacheAware::new(params(0.0, 32, 1.1));
        assert_eq!(zero.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[0], prefix(1)));
        // 1.0: even a full match does not.
        f.hold(0, &chain);
        let m = f.matched(&chain);
        let one = CacheAware::new(params(1.0, 32, 1.1));
        assert_eq!(one.choose(&input(10, &m, &cands)).unwrap().reason, Reason::LeastLoad);
        assert_eq!(
            CacheAware::default().choose(&input(10, &m, &cands)).unwrap().reason,
            prefix(10)
        );
    }

    #[test]
    fn deepest_match_among_several_servers_wins() {
        let f = Fixture::new(4);
        let chain = Fixture::chain(5, 12);
        f.hold(0, &chain[..3]);
        f.hold(2, &chain[..11]);
        f.hold(3, &chain[..8]);
        let m = f.matched(&chain);
        let cands: Vec<_> = f.s.iter().map(|s| cand(*s, 0, 0)).collect();
        let c = CacheAware::default().choose(&input(12, &m, &cands)).unwrap();
        assert_eq!(c, choice(f.s[2], prefix(11)));
    }

    #[test]
    fn equal_matches_prefer_the_less_loaded_holder() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(6, 8);
        f.hold(0, &chain);
        f.hold(1, &chain);
        let m = f.matched(&chain);
        assert_eq!(m.iter().count(), 2);
        let p = CacheAware::default();
        let cands = [cand(f.s[0], 5, 0), cand(f.s[1], 3, 0), cand(f.s[2], 0, 0)];
        assert_eq!(p.choose(&input(8, &m, &cands)).unwrap(), choice(f.s[1], prefix(8)));
        let cands = [cand(f.s[0], 3, 10), cand(f.s[1], 3, 20), cand(f.s[2], 0, 0)];
        assert_eq!(p.choose(&input(8, &m, &cands)).unwrap(), choice(f.s[0], prefix(8)));
    }

    #[test]
    fn imbalance_needs_both_conditions() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(7, 10);
        f.hold(0, &chain);
        let m = f.matched(&chain);
        // Thresholds abs 10, rel 2.0. The prefix holder s[0] is the busiest.
        let p = CacheAware::new(params(0.5, 10, 2.0));
        let route = |loads: [u64; 3]| {
            let cands: Vec<_> = (0..3).map(|i| cand(f.s[i], loads[i], 0)).collect();
            p.choose(&input(10, &m, &cands)).unwrap()
        };
        // Absolute spread 50 > 10, but 150 <= 2.0 × 100: balanced, prefix.
        assert_eq!(route([150, 100, 120]), choice(f.s[0], prefix(10)));
        // 8 > 2.0 × 1, but spread 7 <= 10: balanced, prefix.
        assert_eq!(route([8, 1, 3]), choice(f.s[0], prefix(10)));
        // Both: 30 - 5 > 10 and 30 > 10: least load.
        assert_eq!(route([30, 5, 12]), choice(f.s[1], Reason::LeastLoad));
        // Exactly at the thresholds is balanced (both are strict).
        // Spread exactly 10:
        assert_eq!(route([20, 10, 10]), choice(f.s[0], prefix(10)));
        // spread 11 > 10 but exactly 2.0 × 11:
        assert_eq!(route([22, 11, 15]), choice(f.s[0], prefix(10)));
        // one more request tips both.
        assert_eq!(route([23, 11, 15]), choice(f.s[1], Reason::LeastLoad));
        assert_eq!(route([11, 0, 5]), choice(f.s[1], Reason::LeastLoad));
        assert_eq!(route([10, 0, 5]), choice(f.s[0], prefix(10)));
    }

    #[test]
    fn imbalance_is_judged_at_the_winner_not_the_whole_system() {
        // Unlike SGLang, a busy server elsewhere does not move a
        // conversation off its own, lightly loaded engine.
        let f = Fixture::new(3);
        let chain = Fixture::chain(8, 10);
        f.hold(1, &chain);
        let m = f.matched(&chain);
        let p = CacheAware::new(params(0.5, 10, 2.0));
        let cands = [cand(f.s[0], 40, 0), cand(f.s[1], 3, 0), cand(f.s[2], 2, 0)];
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[1], prefix(10)));
        // The busy server's own conversations go by load.
        f.hold(0, &chain);
        let m = f.matched(&chain);
        let cands = [cand(f.s[0], 40, 0), cand(f.s[1], 41, 0), cand(f.s[2], 2, 0)];
        assert_eq!(
            p.choose(&input(10, &m, &cands)).unwrap(),
            choice(f.s[2], Reason::LeastLoad)
        );
    }

    #[test]
    fn overloaded_winner_goes_to_least_load() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(9, 10);
        f.hold(2, &chain);
        let m = f.matched(&chain);
        let p = CacheAware::new(params(0.5, 4, 1.5));
        // The winner is 6 above the least loaded and 2× it: overloaded.
        assert!(p.params().balance().beyond(12, 6, 4));
        let cands = [cand(f.s[0], 6, 0), cand(f.s[1], 7, 0), cand(f.s[2], 12, 0)];
        assert_eq!(
            p.choose(&input(10, &m, &cands)).unwrap(),
            choice(f.s[0], Reason::LeastLoad)
        );
        // One request fewer and it is within the absolute threshold.
        assert!(!p.params().balance().beyond(10, 6, 4));
        let cands = [cand(f.s[0], 6, 0), cand(f.s[1], 7, 0), cand(f.s[2], 10, 0)];
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[2], prefix(10)));
        // Above by more than abs but not rel × min: not overloaded.
        let p = CacheAware::new(params(0.5, 4, 3.0));
        let cands = [cand(f.s[0], 6, 0), cand(f.s[1], 7, 0), cand(f.s[2], 17, 0)];
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[2], prefix(10)));
    }

    #[test]
    fn the_absolute_threshold_is_an_eighth_of_what_the_winner_runs_at_once() {
        let f = Fixture::new(4);
        let chain = Fixture::chain(10, 10);
        f.hold(0, &chain);
        let m = f.matched(&chain);
        let p = CacheAware::default();
        let slots = |c: Candidate, n: u32| Candidate {
            admission: n,
            admission_reported: true,
            started_since_scrape: 0,
            ..c
        };
        // Two-slot llama.cpp engines: the threshold is 1, so the holder 2
        // above the idlest (and above 1.1 × it) is overloaded.
        let cands = [slots(cand(f.s[0], 3, 0), 2), slots(cand(f.s[1], 1, 0), 2)];
        assert_eq!(p.params().balance().abs_threshold(&cands[0]), 1);
        assert_eq!(
            p.choose(&input(10, &m, &cands[..2])).unwrap(),
            choice(f.s[1], Reason::LeastLoad)
        );
        // 1 above is within it.
        let cands = [slots(cand(f.s[0], 2, 0), 2), slots(cand(f.s[1], 1, 0), 2)];
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[0], prefix(10)));
        // Engines that report nothing: the learned limit scales it the
        // same way (four engines and sixteen clients, issue 38: 32 would
        // never be reached, so the holder would take everything).
        let four = |loads: [u64; 4], limit: u32| -> Vec<Candidate> {
            (0..4)
                .map(|i| with_capacity(cand(f.s[i], loads[i], 0), limit))
                .collect()
        };
        let cands = four([7, 3, 3, 3], 16);
        assert_eq!(p.params().balance().abs_threshold(&cands[0]), 2);
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap().reason, Reason::LeastLoad);
        let cands = four([5, 3, 4, 4], 16);
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[0], prefix(10)));
        // Before anything is learned (8 at once), an engine that said
        // nothing is given 2: a spread of 2 is noise, 3 is not.
        let cands = four([5, 3, 4, 4], crate::routing::capacity::INITIAL_LIMIT);
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[0], prefix(10)));
        let cands = four([6, 3, 4, 4], crate::routing::capacity::INITIAL_LIMIT);
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap().reason, Reason::LeastLoad);
        // An eighth of the winner's capacity, rounded up, never above the
        // configured threshold.
        for (n, abs) in [(1, 2), (8, 2), (9, 2), (32, 4), (40, 5), (256, 32), (4096, 32)] {
            assert_eq!(
                p.params()
                    .balance()
                    .abs_threshold(&with_capacity(cand(f.s[0], 0, 0), n)),
                abs,
                "{n}"
            );
        }
        // Without scaling, the configured threshold as it is.
        let off = CacheAwareParams {
            scale_to_capacity: false,
            ..CacheAwareParams::default()
        };
        assert_eq!(off.balance().abs_threshold(&with_capacity(cand(f.s[0], 0, 0), 2)), 32);
        let cands = four([7, 3, 3, 3], 16);
        assert_eq!(
            CacheAware::new(off).choose(&input(10, &m, &cands)).unwrap(),
            choice(f.s[0], prefix(10))
        );
    }

    #[test]
    fn a_winner_with_more_prefill_queued_than_its_cache_saves_goes_by_load() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(30, 40);
        f.hold(0, &chain[..20]); // 320 tokens saved at s[0]
        let m = f.matched(&chain);
        let queued = |c: Candidate, tokens: u64| Candidate {
            pending: 1,
            pending_tokens: tokens,
            ..c
        };
        // No margin: the saved tokens alone decide.
        let p = CacheAware::new(CacheAwareParams {
            queued_prefill_margin: 0,
            ..params(0.4, 32, 1.1)
        });
        // 300 tokens queued there beyond the least queued: less than it
        // saves, the cache wins.
        let cands = [
            queued(cand(f.s[0], 1, 0), 400),
            queued(cand(f.s[1], 1, 0), 100),
            queued(cand(f.s[2], 1, 0), 100),
        ];
        assert_eq!(p.choose(&input(40, &m, &cands)).unwrap(), choice(f.s[0], prefix(20)));
        // 400 beyond: more than it saves, by load.
        let cands = [queued(cand(f.s[0], 1, 0), 400), cand(f.s[1], 1, 0), cand(f.s[2], 1, 0)];
        assert_eq!(p.choose(&input(40, &m, &cands)).unwrap().reason, Reason::LeastLoad);
        // The default margin: 400 tokens fit in one prefill step of the
        // engine, the cache wins; 2 400 do not.
        let p = CacheAware::new(params(0.4, 32, 1.1));
        assert_eq!(p.choose(&input(40, &m, &cands)).unwrap(), choice(f.s[0], prefix(20)));
        let far = [queued(cand(f.s[0], 1, 0), 2400), cand(f.s[1], 1, 0), cand(f.s[2], 1, 0)];
        assert_eq!(p.choose(&input(40, &m, &far)).unwrap().reason, Reason::LeastLoad);
        // Off: the cache wins.
        let off = CacheAware::new(CacheAwareParams {
            weigh_queued_prefill: false,
            queued_prefill_margin: QUEUED_PREFILL_MARGIN,
            ..params(0.4, 32, 1.1)
        });
        assert_eq!(off.choose(&input(40, &m, &cands)).unwrap(), choice(f.s[0], prefix(20)));
    }

    #[test]
    fn the_fallback_is_the_fewest_in_flight_within_a_prefill_step_of_the_least_queued() {
        let f = Fixture::new(3);
        let m = PrefixMatch::default();
        let pending = |c: Candidate, n: u64, tokens: u64| Candidate {
            pending: n,
            pending_tokens: tokens,
            ..c
        };
        // s[0]: 3 decoding (48 tokens of work); s[1]: 1 in flight, a
        // 12 000-token prompt not started; s[2]: 4 decoding (64).
        let cands = [
            cand(f.s[0], 3, 0),
            pending(cand(f.s[1], 1, 12_000), 1, 12_000),
            cand(f.s[2], 4, 0),
        ];
        let p = CacheAware::default();
        // s[1] is more than a prefill step (2 048) beyond the least queued:
        // out; of the others the fewest in flight.
        assert_eq!(
            p.choose(&input(40, &m, &cands)).unwrap(),
            choice(f.s[0], Reason::LeastLoad)
        );
        // 1 500 tokens pending there: within the step, fewest in flight.
        let near = [cands[0], pending(cand(f.s[1], 1, 1_500), 1, 1_500), cands[2]];
        assert_eq!(
            p.choose(&input(40, &m, &near)).unwrap(),
            choice(f.s[1], Reason::LeastLoad)
        );
        // SGLang's rule (off): the fewest in flight.
        let off = CacheAware::new(CacheAwareParams {
            weigh_queued_prefill: false,
            ..CacheAwareParams::default()
        });
        assert_eq!(
            off.choose(&input(40, &m, &cands)).unwrap(),
            choice(f.s[1], Reason::LeastLoad)
        );
    }

    #[test]
    fn the_old_key_scale_to_engine_slots_is_still_read() {
        let p: CacheAwareParams = serde_json::from_str(r#"{"scale_to_engine_slots": false}"#).unwrap();
        assert!(!p.scale_to_capacity);
    }

    #[test]
    fn a_match_that_ends_at_the_shared_header_goes_by_load() {
        let f = Fixture::new(3);
        // 40 blocks of system prompt shared by every conversation, then a
        // conversation's own 4.
        let chain = Fixture::chain(20, 44);
        f.hold(0, &chain[..40]);
        let m = f.matched(&chain);
        let cands = [cand(f.s[0], 1, 0), cand(f.s[1], 0, 0), cand(f.s[2], 0, 0)];
        let p = CacheAware::default();
        let mut with_header = input(44, &m, &cands);
        // Unknown as shared: the system prompt's holder, by prefix.
        assert_eq!(p.choose(&with_header).unwrap(), choice(f.s[0], prefix(40)));
        // Known as shared: by load.
        with_header.header_blocks = 40;
        assert_eq!(p.choose(&with_header).unwrap().reason, Reason::LeastLoad);
        // A conversation that went past it keeps its engine.
        f.hold(2, &chain[..43]);
        let m = f.matched(&chain);
        let mut later = input(44, &m, &cands);
        later.header_blocks = 40;
        assert_eq!(p.choose(&later).unwrap(), choice(f.s[2], prefix(43)));
    }

    #[test]
    fn an_overloaded_winner_implies_sglangs_imbalanced_system() {
        // Documented property: at one threshold, SGLang's system check
        // fires whenever the winner's does.
        let p = params(0.5, 7, 1.3);
        for min in 0..40u64 {
            for winner in min..80 {
                for max in winner..90 {
                    if p.balance().beyond(winner, min, 7) {
                        assert!(p.balance().beyond(max, min, 7), "min {min} winner {winner} max {max}");
                    }
                }
            }
        }
    }

    #[test]
    fn ties_in_least_load_rotate() {
        let f = Fixture::new(4);
        let p = CacheAware::default();
        let m = PrefixMatch::default();
        let cands: Vec<_> = f.s.iter().map(|s| cand(*s, 0, 0)).collect();
        let mut counts = [0; 4];
        for _ in 0..40 {
            let c = p.choose(&input(3, &m, &cands)).unwrap();
            assert_eq!(c.reason, Reason::LeastLoad);
            counts[f.s.iter().position(|s| *s == c.server).unwrap()] += 1;
        }
        assert_eq!(counts, [10; 4]);
        // Tokens break a tie in requests before the rotation does.
        let cands = [
            cand(f.s[0], 1, 50),
            cand(f.s[1], 1, 40),
            cand(f.s[2], 1, 60),
            cand(f.s[3], 2, 0),
        ];
        for _ in 0..4 {
            assert_eq!(p.choose(&input(3, &m, &cands)).unwrap().server, f.s[1]);
        }
    }

    #[test]
    fn short_prompt_uses_least_load() {
        let f = Fixture::new(2);
        let chain = Fixture::chain(10, 2);
        f.hold(0, &chain);
        // A (stale) match against a zero-block prompt must not route by prefix
        // nor divide by zero.
        let m = f.matched(&chain);
        let cands = [cand(f.s[0], 3, 0), cand(f.s[1], 1, 0)];
        let c = CacheAware::new(params(0.0, 32, 1.1))
            .choose(&input(0, &m, &cands))
            .unwrap();
        assert_eq!(c, choice(f.s[1], Reason::LeastLoad));
    }

    #[test]
    fn no_match_uses_least_load() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(11, 6);
        f.hold(0, &Fixture::chain(12, 6));
        let m = f.matched(&chain);
        assert!(m.is_empty());
        let cands = [cand(f.s[0], 3, 0), cand(f.s[1], 2, 0), cand(f.s[2], 5, 0)];
        let c = CacheAware::default().choose(&input(6, &m, &cands)).unwrap();
        assert_eq!(c, choice(f.s[1], Reason::LeastLoad));
    }

    #[test]
    fn entries_for_servers_not_among_the_candidates_are_ignored() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(13, 10);
        f.hold(0, &chain); // deepest, but not a candidate (went down after the lookup)
        f.hold(1, &chain[..7]);
        let m = f.matched(&chain);
        assert_eq!(m.best(), Some((f.s[0].tag(), 10)));
        let cands = [cand(f.s[1], 2, 0), cand(f.s[2], 0, 0)];
        let p = CacheAware::default();
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[1], prefix(7)));
        // With only the absent server holding enough, least load.
        let cands = [cand(f.s[2], 0, 0)];
        assert_eq!(
            p.choose(&input(10, &m, &cands)).unwrap(),
            choice(f.s[2], Reason::LeastLoad)
        );
    }

    #[test]
    fn a_re_registered_slot_does_not_inherit_the_match() {
        let f = Fixture::new(2);
        let chain = Fixture::chain(14, 10);
        f.hold(0, &chain);
        // Match computed while the old registration was live...
        let m = f.matched(&chain);
        // ...then the slot is retired and re-registered (new generation).
        let t = f.seg.tables();
        assert!(t.servers.retire(f.s[0]));
        let again = t.servers.register(99, "http://again", 0).unwrap();
        assert_eq!(again.slot, f.s[0].slot);
        assert_ne!(again.tag(), f.s[0].tag());
        let cands = [cand(again, 5, 0), cand(f.s[1], 0, 0)];
        let c = CacheAware::default().choose(&input(10, &m, &cands)).unwrap();
        assert_eq!(c, choice(f.s[1], Reason::LeastLoad));
        // A fresh lookup filters the dead lane out altogether.
        assert!(f.matched(&chain).is_empty());
    }

    #[test]
    fn down_servers_drop_out_of_the_live_match() {
        let f = Fixture::new(2);
        let chain = Fixture::chain(15, 10);
        f.hold(0, &chain);
        f.hold(1, &chain[..6]);
        let t = f.seg.tables();
        assert!(t.servers.set_state(f.s[0], shm_layout::ServerState::Down));
        let m = f.matched(&chain);
        let mut cands = Vec::new();
        crate::routing::live_candidates(&t, &mut cands);
        assert_eq!(cands.iter().map(|c| c.server).collect::<Vec<_>>(), [f.s[1]]);
        let c = CacheAware::default().choose(&input(10, &m, &cands)).unwrap();
        assert_eq!(c, choice(f.s[1], prefix(6)));
    }
}
