//! Affinity: a request that must, or should, go where an earlier one went.
//!
//! - A Responses API request with `previous_response_id` **must** reach
//!   the engine that stored that response: any other answers 404. When
//!   an answer with `store` on passes through, its dispatcher records the
//!   response's id for the engine that gave it, before the client has the
//!   answer's end ([`Affinity::Stored`]).
//! - An **agent session** (a conversation key the client sends: a header
//!   such as `x-session-id`, or a body field such as `prompt_cache_key`
//!   or Anthropic's `metadata.user_id`; see [`crate::config::SessionsConfig`])
//!   should stay on its engine while the load rule allows
//!   ([`Affinity::Session`]).
//!
//! Both live in the prefix table, under keys of their own domain (a
//! tenant's keys never match another tenant's: the tenant's salt is
//! hashed in), so they are in the segment with the shm store and in
//! Redis with the Redis store, shared by every dispatcher, and survive a
//! hot restart with the segment. A key lists the servers it was recorded
//! for ([`crate::store::Lookup::affine`]).
//!
//! How routing uses them ([`apply`]):
//!
//! | affinity | its servers among the candidates | none of them |
//! | --- | --- | --- |
//! | stored response | the only candidates | the request is answered 404 by the gateway, or, when it carries its whole conversation, sent without `previous_response_id` to any engine |
//! | session | credited with the whole prompt and a block more (deeper than any engine's own match): a prefix-aware policy keeps the session there unless its load rule moves it | the policy routes as usual |
//!
//! A session has one engine: when the policy moves it, its dispatcher
//! records the new engine and takes the old one off the key, so the next
//! turn follows it there instead of going back.

use shm_layout::{PrefixMatch, ServerTag};

use crate::routing::Candidate;

/// Key domains: no affinity key equals a block hash or another domain's
/// key (the block chain is seeded differently).
const STORED_DOMAIN: u64 = 0x7265_7370_6f6e_7365; // "response"
const SESSION_DOMAIN: u64 = 0x7365_7373_696f_6e73; // "sessions"

/// Where a request wants to go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Affinity {
    /// The engine that stored the response it continues (its key).
    Stored(u64),
    /// Its session's engine (its key).
    Session(u64),
}

impl Affinity {
    /// The key in the prefix table.
    pub fn key(self) -> u64 {
        match self {
            Affinity::Stored(k) | Affinity::Session(k) => k,
        }
    }
}

/// The key of the stored response `id` for the tenant salted `salt` (0:
/// no tenants).
pub fn stored_key(salt: u64, id: &str) -> u64 {
    domain_key(STORED_DOMAIN, salt, id.as_bytes())
}

/// The key of the session `value` for the tenant salted `salt`.
pub fn session_key(salt: u64, value: &[u8]) -> u64 {
    domain_key(SESSION_DOMAIN, salt, value)
}

fn domain_key(domain: u64, salt: u64, value: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut h = seahash::SeaHasher::new();
    h.write_u64(domain);
    h.write_u64(salt);
    h.write(value);
    h.finish().max(1)
}

/// What [`apply`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// No affinity.
    None,
    /// The candidates are the stored response's engines.
    Pinned,
    /// No live candidate stored the response.
    Missing,
    /// The session's engine is credited with the whole prompt and a block.
    Credited,
    /// The session has no live engine among the candidates (new, or its
    /// engine is gone): the policy routes as usual.
    Unplaced,
}

/// Applies `affinity` to a routing decision: `affine` are the servers its
/// key lists, `candidates` the live servers, `prefix` the match the policy
/// routes on, for a prompt of `chain_blocks` full blocks.
pub fn apply(
    affinity: Option<Affinity>,
    affine: &[ServerTag],
    candidates: &mut Vec<Candidate>,
    prefix: &mut PrefixMatch,
    chain_blocks: u32,
) -> Applied {
    let listed = |c: &Candidate| affine.contains(&c.server.tag());
    match affinity {
        None => Applied::None,
        Some(Affinity::Stored(_)) => {
            if candidates.iter().any(listed) {
                candidates.retain(listed);
                Applied::Pinned
            } else {
                Applied::Missing
            }
        }
        Some(Affinity::Session(_)) => {
            let mut credited = false;
            for c in candidates.iter().filter(|c| listed(c)) {
                // One block past the whole prompt: deeper than any other
                // engine's match, even one that holds all of it (sessions
                // sharing their prompts). `add` keeps the deeper of two.
                prefix.add(c.server.tag(), chain_blocks.saturating_add(1));
                credited = true;
            }
            if credited { Applied::Credited } else { Applied::Unplaced }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::test_support::{Fixture, cand};

    #[test]
    fn keys_are_per_tenant_and_per_domain() {
        assert_ne!(stored_key(0, "resp_1"), stored_key(1, "resp_1"));
        assert_ne!(stored_key(0, "abc"), session_key(0, b"abc"));
        assert_eq!(session_key(7, b"s"), session_key(7, b"s"));
    }

    #[test]
    fn a_stored_response_pins_and_a_session_is_credited() {
        let f = Fixture::new(2);
        let (a, b) = (cand(f.s[0], 0, 0), cand(f.s[1], 0, 0));
        let mut candidates = vec![a, b];
        let mut prefix = PrefixMatch::default();
        let pinned = apply(
            Some(Affinity::Stored(9)),
            &[b.server.tag()],
            &mut candidates,
            &mut prefix,
            4,
        );
        assert_eq!(
            (pinned, candidates.len(), candidates[0].server),
            (Applied::Pinned, 1, b.server)
        );
        let mut candidates = vec![a];
        let missing = apply(
            Some(Affinity::Stored(9)),
            &[b.server.tag()],
            &mut candidates,
            &mut prefix,
            4,
        );
        assert_eq!((missing, candidates.len()), (Applied::Missing, 1));
        let mut candidates = vec![a, b];
        let mut prefix = PrefixMatch::default();
        prefix.add(a.server.tag(), 3);
        prefix.add(b.server.tag(), 1);
        let credited = apply(
            Some(Affinity::Session(5)),
            &[b.server.tag()],
            &mut candidates,
            &mut prefix,
            4,
        );
        assert_eq!(credited, Applied::Credited);
        assert_eq!(
            (prefix.blocks_for(a.server.tag()), prefix.blocks_for(b.server.tag())),
            (3, 5)
        );
        let unplaced = apply(Some(Affinity::Session(5)), &[], &mut candidates, &mut prefix, 4);
        assert_eq!(unplaced, Applied::Unplaced);
    }
}
