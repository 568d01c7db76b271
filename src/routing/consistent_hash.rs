//! `consistent_hash`: a session key on a ring of virtual nodes, with
//! bounded load (SkyLB-CH; vllm-router's `consistent_hash`).
//!
//! Every request of a session goes to the same server as long as that
//! server is up and not overloaded, so the session's growing prefix stays
//! in one engine's cache without the gateway having to see it first; a
//! server going down moves only its own sessions, each to the next server
//! on the ring.
//!
//! # Rule
//!
//! 1. **Key**, the first of these the request has:
//!    1. the first of `key_headers` it carries (default `x-session-id`,
//!       then `x-user-id`);
//!    2. the body's `user` field (`user_field`, default on);
//!    3. for a chat, its **opening** (`conversation_key`, default on): the
//!       messages up to and including the first user message, hashed
//!       ([`crate::openai::prompt::opening`]). Every turn of a
//!       conversation has the same opening, so the conversation stays on
//!       one server, and conversations that share a system prompt but not
//!       their first question spread over the ring;
//!    4. the **prefix hash**: the chain hash of the prompt's first
//!       `fallback_prefix_blocks` blocks (fewer if the prompt is shorter),
//!       so requests sharing that prefix share a server (completions).
//!
//!    A prompt shorter than one block without a key goes to the least
//!    loaded server.
//! 2. **Ring.** `ring::HashRing`: `virtual_nodes` points per
//!    server slot; the key goes to the first server clockwise that is a
//!    candidate (up) and not over the load bound ([`Reason::Session`]).
//! 3. **Bounded load** (`bounded_load`, default on; [`LoadBound`]): a
//!    server is skipped while taking this request would put it above
//!    `ceil((1 + load_epsilon) × (requests in flight + 1) / servers)`.
//!    Some server is always under the bound, and a session leaves its
//!    server only while that server carries more than its share.
//! 4. **Where the session's cache is.** Before the ring: the server under
//!    the bound that holds the most of the prompt past its shared header
//!    ([`super::best_prefix`]), if one holds any. The ring places a
//!    session; the prefix table keeps it where its history is cached. A
//!    session that the bound moved off its home stays where it went
//!    instead of flapping back and forth as its home's load crosses the
//!    bound (each move recomputing its history: 86–89 % of later turns
//!    stayed in `tests/shared_prompt.rs` without this, issue 38), and one
//!    whose home was down keeps its new server when the home returns. A
//!    new conversation has nothing of its own cached, so the ring places
//!    it (a shared system prompt does not count: [`RouteInput::useful_blocks`]).

use std::sync::atomic::AtomicU64;

use serde::{Deserialize, Serialize};

use super::least_load::least_loaded;
use super::load_bound::LoadBound;
use super::ring::HashRing;
use super::{Candidate, Choice, InvalidParam, Policy, Reason, RouteInput, SessionSource, best_prefix, in_range};

/// Tuning of the [`ConsistentHash`] policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsistentHashParams {
    /// Request headers carrying the session key, tried in order (names are
    /// case-insensitive). Default `["x-session-id", "x-user-id"]`.
    pub key_headers: Vec<String>,
    /// Then the body's `user` field (OpenAI's end-user id). Default true.
    pub user_field: bool,
    /// Then, for a chat, its opening: the messages up to and including the
    /// first user message, so each conversation has its own key even when
    /// many share a system prompt. Default true.
    pub conversation_key: bool,
    /// Without a session key: hash this many leading blocks of the prompt.
    /// Default 8 (128 tokens at 16-token blocks); 1 to 65 536.
    pub fallback_prefix_blocks: u32,
    /// Points per server on the ring. Default 100; 1 to 10 000.
    pub virtual_nodes: u32,
    /// Skip servers above the load bound. Default true.
    pub bounded_load: bool,
    /// The bound's slack ε: at most `(1 + ε)` × the average load. Default
    /// 0.25; 0.0 to 100.0.
    pub load_epsilon: f64,
}

impl Default for ConsistentHashParams {
    fn default() -> Self {
        Self {
            key_headers: vec!["x-session-id".into(), "x-user-id".into()],
            user_field: true,
            conversation_key: true,
            fallback_prefix_blocks: 8,
            virtual_nodes: 100,
            bounded_load: true,
            load_epsilon: 0.25,
        }
    }
}

impl ConsistentHashParams {
    /// Checks the ranges; the error names the field, its value and the reason.
    pub fn validate(&self) -> Result<(), InvalidParam> {
        for h in &self.key_headers {
            if http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                return Err(InvalidParam::new(
                    "key_headers",
                    format!("{h:?}"),
                    "not a valid header name",
                ));
            }
        }
        in_range(
            "fallback_prefix_blocks",
            u64::from(self.fallback_prefix_blocks),
            1,
            65_536,
            "leading blocks hashed without a session key",
        )?;
        in_range(
            "virtual_nodes",
            u64::from(self.virtual_nodes),
            1,
            10_000,
            "points per server on the ring",
        )?;
        LoadBound::check_epsilon(self.load_epsilon)
    }
}

/// Session-key consistent hashing with bounded load.
#[derive(Debug)]
pub struct ConsistentHash {
    params: ConsistentHashParams,
    source: SessionSource,
    ring: HashRing,
    /// Rotates among servers tied for least load (short prompts, no key).
    turn: AtomicU64,
}

/// The seed of the ring's point placement.
const RING_SEED: u64 = 0x5e55_1011;

impl ConsistentHash {
    /// A policy with `params` (validated first).
    pub fn new(params: ConsistentHashParams) -> Self {
        let source = SessionSource {
            headers: params.key_headers.iter().map(|h| h.to_ascii_lowercase()).collect(),
            user_field: params.user_field,
            opening: params.conversation_key,
        };
        Self {
            ring: HashRing::new(params.virtual_nodes, RING_SEED),
            source,
            params,
            turn: AtomicU64::new(0),
        }
    }

    /// The ring key of a request: its session, else its prefix hash.
    fn key(&self, input: &RouteInput<'_>) -> Option<u64> {
        input.session.or_else(|| {
            let n = (self.params.fallback_prefix_blocks as usize).min(input.chain.len());
            n.checked_sub(1).map(|i| input.chain[i])
        })
    }
}

impl Policy for ConsistentHash {
    fn name(&self) -> &'static str {
        "consistent_hash"
    }

    fn choose(&self, input: &RouteInput<'_>) -> Option<Choice> {
        let candidates = input.candidates;
        let Some(key) = self.key(input) else {
            return least_loaded(candidates, &self.turn).map(|c| Choice {
                server: c.server,
                reason: Reason::LeastLoad,
            });
        };
        let bound = self
            .params
            .bounded_load
            .then(|| LoadBound::over(candidates, self.params.load_epsilon));
        let admits = |c: &Candidate| bound.is_none_or(|b| b.admits(c));
        if let Some((holder, _)) = best_prefix(input, admits) {
            return Some(Choice {
                server: holder.server,
                reason: Reason::Session,
            });
        }
        self.ring
            .walk(key, candidates, admits)
            .or_else(|| least_loaded(candidates, &self.turn))
            .map(|c| Choice {
                server: c.server,
                reason: Reason::Session,
            })
    }

    fn session_source(&self) -> Option<&SessionSource> {
        Some(&self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::Candidate;
    use crate::routing::test_support::{Fixture, cand, input_for};
    use shm_layout::PrefixMatch;

    fn with_session<'a>(mut i: RouteInput<'a>, session: u64) -> RouteInput<'a> {
        i.session = Some(session);
        i
    }

    #[test]
    fn a_session_stays_on_one_server_and_moves_only_when_it_goes_down() {
        let f = Fixture::new(4);
        let m = PrefixMatch::default();
        let p = ConsistentHash::new(ConsistentHashParams::default());
        let all: Vec<Candidate> = f.s.iter().map(|&s| cand(s, 0, 0)).collect();
        let mut homes = Vec::new();
        for session in 0..64u64 {
            let chain = Fixture::chain(session, 3);
            let first = p
                .choose(&with_session(input_for(&chain, 48, &m, &all), session))
                .unwrap();
            assert_eq!(first.reason, Reason::Session);
            for turn in 1..4 {
                // Later turns: other prompts, same session, same server.
                let chain = Fixture::chain(session * 100 + turn, 5);
                let again = p
                    .choose(&with_session(input_for(&chain, 80, &m, &all), session))
                    .unwrap();
                assert_eq!(again.server, first.server);
            }
            homes.push(first.server);
        }
        let used: std::collections::HashSet<_> = homes.iter().collect();
        assert_eq!(used.len(), 4, "64 sessions use every server");
        // Server 1 goes down: its sessions move, the others stay.
        let up: Vec<Candidate> = all.iter().copied().filter(|c| c.server != f.s[1]).collect();
        for (session, home) in homes.iter().enumerate() {
            let chain = Fixture::chain(session as u64, 3);
            let now = p
                .choose(&with_session(input_for(&chain, 48, &m, &up), session as u64))
                .unwrap();
            if *home == f.s[1] {
                assert_ne!(now.server, f.s[1]);
            } else {
                assert_eq!(now.server, *home, "session {session} did not move");
            }
        }
    }

    #[test]
    fn without_a_session_the_prefix_hash_is_the_key() {
        let f = Fixture::new(4);
        let m = PrefixMatch::default();
        let p = ConsistentHash::new(ConsistentHashParams {
            fallback_prefix_blocks: 2,
            ..ConsistentHashParams::default()
        });
        let all: Vec<Candidate> = f.s.iter().map(|&s| cand(s, 0, 0)).collect();
        let shared = Fixture::chain(9, 2);
        let target = p.choose(&input_for(&shared, 32, &m, &all)).unwrap().server;
        for tail in 0..10 {
            // Same first two blocks, different rest: same server.
            let mut chain = shared.clone();
            chain.extend(Fixture::chain(1000 + tail, 3));
            assert_eq!(p.choose(&input_for(&chain, 80, &m, &all)).unwrap().server, target);
        }
        // Shorter than a block and no session: least load.
        let loaded: Vec<Candidate> = f.s.iter().enumerate().map(|(i, &s)| cand(s, 4 - i as u64, 0)).collect();
        let c = p.choose(&input_for(&[], 5, &m, &loaded)).unwrap();
        assert_eq!((c.server, c.reason), (f.s[3], Reason::LeastLoad));
    }

    #[test]
    fn an_overloaded_home_is_skipped_under_bounded_load_only() {
        let f = Fixture::new(3);
        let m = PrefixMatch::default();
        let bounded = ConsistentHash::new(ConsistentHashParams::default());
        let idle: Vec<Candidate> = f.s.iter().map(|&s| cand(s, 0, 0)).collect();
        let chain = Fixture::chain(5, 2);
        let home = bounded
            .choose(&with_session(input_for(&chain, 32, &m, &idle), 77))
            .unwrap()
            .server;
        // The home carries 10 of 12 requests: bound = ceil(1.25 × 13 / 3) = 6.
        let busy: Vec<Candidate> =
            f.s.iter()
                .map(|&s| cand(s, if s == home { 10 } else { 1 }, 0))
                .collect();
        let moved = bounded
            .choose(&with_session(input_for(&chain, 32, &m, &busy), 77))
            .unwrap();
        assert_ne!(moved.server, home);
        let unbounded = ConsistentHash::new(ConsistentHashParams {
            bounded_load: false,
            ..ConsistentHashParams::default()
        });
        let stays = unbounded
            .choose(&with_session(input_for(&chain, 32, &m, &busy), 77))
            .unwrap();
        assert_eq!(stays.server, home);
    }

    #[test]
    fn parameters_are_checked_and_the_session_source_follows_them() {
        assert_eq!(ConsistentHashParams::default().validate(), Ok(()));
        let bad = ConsistentHashParams {
            key_headers: vec!["bad header".into()],
            ..ConsistentHashParams::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("not a valid header name")
        );
        let bad = ConsistentHashParams {
            load_epsilon: -1.0,
            ..ConsistentHashParams::default()
        };
        assert!(bad.validate().unwrap_err().to_string().starts_with("load_epsilon = -1"));
        let p = ConsistentHash::new(ConsistentHashParams {
            key_headers: vec!["X-Tenant".into()],
            user_field: false,
            conversation_key: false,
            ..ConsistentHashParams::default()
        });
        assert_eq!(
            p.session_source(),
            Some(&SessionSource {
                headers: vec!["x-tenant".into()],
                user_field: false,
                opening: false,
            })
        );
    }
}
