//! Test fixtures for the routing policies: servers registered in a real
//! (heap) segment, prefix matches taken from its real prefix table.

use shm_layout::{LayoutPlan, LoadFigures, PrefixMatch, Segment, ServerRef};

use super::{Candidate, Choice, Reason, RouteInput};

/// A heap segment with `n` registered (`Up`) servers.
pub(crate) struct Fixture {
    pub(crate) seg: Segment,
    /// The servers, in registration (= slot) order.
    pub(crate) s: Vec<ServerRef>,
}

impl Fixture {
    pub(crate) fn new(n: usize) -> Self {
        let seg = Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap());
        let s = (0..n)
            .map(|i| {
                seg.tables()
                    .servers
                    .register(i as u64 + 1, &format!("http://10.0.0.{i}:8000"), seg.clock().now_ms())
                    .unwrap()
            })
            .collect();
        Self { seg, s }
    }

    /// A block chain of `len` hashes, distinct per `seed` (never 0).
    pub(crate) fn chain(seed: u64, len: usize) -> Vec<u64> {
        (0..len as u64)
            .map(|i| (seed << 32 | (i + 1)).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
            .collect()
    }

    /// Records that server `i` holds `chain` (a responder's write-back).
    pub(crate) fn hold(&self, i: usize, chain: &[u64]) {
        self.seg
            .tables()
            .prefix
            .insert_chain(chain, self.s[i], self.seg.clock().stamp());
    }

    /// The live longest-prefix match of `chain`, as a dispatcher takes it.
    pub(crate) fn matched(&self, chain: &[u64]) -> PrefixMatch {
        let t = self.seg.tables();
        t.prefix.longest_prefix_match(chain, |tag| t.servers.is_live(tag))
    }
}

/// A candidate with the given in-flight requests and tokens.
pub(crate) fn cand(server: ServerRef, inflight: u64, inflight_tokens: u64) -> Candidate {
    Candidate {
        server,
        inflight,
        inflight_tokens,
        pending: 0,
        pending_tokens: 0,
        load: LoadFigures::default(),
        admission: crate::routing::capacity::INITIAL_LIMIT,
        admission_reported: false,
        started_since_scrape: 0,
        weight: 1,
    }
}

/// A route input.
pub(crate) fn input<'a>(prompt_blocks: u32, prefix: &'a PrefixMatch, candidates: &'a [Candidate]) -> RouteInput<'a> {
    RouteInput {
        prompt_blocks,
        ..RouteInput::new(&[], prompt_blocks * 16, 16, prefix, candidates)
    }
}

/// A route input for `chain` (16-token blocks, `prompt_tokens` tokens).
pub(crate) fn input_for<'a>(
    chain: &'a [u64],
    prompt_tokens: u32,
    prefix: &'a PrefixMatch,
    candidates: &'a [Candidate],
) -> RouteInput<'a> {
    RouteInput::new(chain, prompt_tokens, 16, prefix, candidates)
}

/// A choice.
pub(crate) fn choice(server: ServerRef, reason: Reason) -> Choice {
    Choice { server, reason }
}
