//! Shared headers: the leading blocks many different prompts open with (a
//! system prompt, an agent's tool definitions), told apart from the part
//! of a prompt that belongs to one conversation.
//!
//! A prefix match is evidence of where a prompt's KV cache lives. A match
//! that ends inside a conversation's own history (its earlier turns) is
//! strong evidence: only the engine that served the conversation holds
//! it. A match that ends at a **shared header** is weak evidence: every
//! conversation of the application opens with it, so once traffic spreads
//! it is warm on every engine that serves any of them, and paying its
//! prefill once more on another engine is amortised over all the
//! conversations that engine then serves. A router that follows it
//! anyway sends every new conversation to the engine that first computed
//! the system prompt (SGLang's old collapse: 500 of 500 requests on one
//! of four engines, measured in issue 38), and learning at dispatch makes
//! it worse: the first request's prefix, recorded when it is sent, pulls
//! the next concurrent first requests onto the engine that is still
//! computing it.
//!
//! # Rule
//!
//! For each new request (not a retry or another look from the gateway
//! queue), with `d` the deepest match any server has of its chain and `P`
//! its blocks: when `0 < d < P`, the prompt **diverges** from what the
//! gateway has sent after block `d` (its blocks past `d` are new), at
//! the prefix `chain[d − 1]`. A conversation's next turn diverges where
//! its own last turn ended, a point no other prompt reaches; new
//! conversations on one system prompt all diverge at its end. So:
//!
//! * each divergence is counted under its prefix in a sketch of
//!   [`CELLS`] cells (a key's fingerprint and a count in one atomic word;
//!   an idle cell is taken over, a busy one kept, so a rare prefix never
//!   borrows a hot one's count), all counts halved every
//!   [`WINDOW`] requests;
//! * the request's **shared header** is the deepest of its match depths
//!   (one per server) at which at least [`DIVERGENCES`] *other* recent
//!   prompts diverged: `d` itself for a new conversation on a system
//!   prompt, and for a conversation's later turn the depth at which the
//!   *other* engines match it (the system prompt they computed for other
//!   conversations), while its own engine matches its whole history;
//! * or, shallower than `d`, a depth two servers *besides* the deepest one
//!   hold: three engines computed that prefix, for three different
//!   requests, which is what [`DIVERGENCES`] asks of a header. This needs
//!   no count: a dispatcher that saw few of the conversations open (each
//!   keeps its own sketch, and the first questions of a chat app often
//!   share words past the system prompt, so they diverge at several
//!   depths) still knows a later turn's header from where the others
//!   match it. (Without it, a scoring policy saw the other engines' header
//!   matches as 87 % matches against the conversation's own 97 %, close
//!   enough that one request more in flight moved it: 84–89 % of later
//!   turns stayed in `tests/shared_prompt.rs`.)
//!
//! [`DIVERGENCES`] is 2, not 1: a document or long context that two or
//! three requests share (the Mooncake trace has a few of 13–51 blocks of
//! 512 tokens) is worth keeping together, while a system prompt is the
//! divergence point of nearly every new conversation (the Mooncake trace's
//! one-block header: 1 272 of 1 750 requests in its first 600 s).
//!
//! The policies then treat a match of at most the header's depth as no
//! match ([`super::RouteInput::useful_blocks`]): the request goes by load,
//! and the engine it goes to computes the header once and holds it from
//! then on. A conversation's later turns match past the header and keep
//! their engine, and the other engines' header matches do not compete
//! with it (a scoring policy saw them as 70–87 % matches, close enough to
//! its own engine's 98 % that one request more in flight there moved the
//! conversation).
//!
//! # The chat template's opening
//!
//! One header is known before any traffic: the text a chat template puts
//! before the first message (role markers, a date line, a default system
//! prompt such as Qwen2.5's "You are Qwen, created by Alibaba Cloud…").
//! Every conversation the template renders opens with it, so a match
//! that ends within it says nothing of where a conversation belongs; yet
//! at a cold start the sketch has seen no divergence there, and a short
//! prompt whose one matched block is that opening went to the engine
//! that computed it. The dispatcher finds where the first message's text
//! starts in the rendered prompt ([`crate::openai::prompt::ParsedRequest::template_bytes`]),
//! and the whole blocks before it ([`template_blocks`]) count as header
//! from the first request on.
//!
//! Each dispatcher keeps its own sketch (per process: nothing in shared
//! memory), so with `n` dispatchers up to `n × DIVERGENCES` new
//! conversations follow a new system prompt to its first engine before it
//! counts as shared. Counting and reading never lock: one atomic
//! read-modify-write per new request, two with the halving.

use std::sync::atomic::{AtomicU64, Ordering};

/// Cells of the sketch.
pub const CELLS: usize = 4096;

/// Requests between halvings of the counts.
pub const WINDOW: u64 = 1024;

/// Earlier divergences at a prefix (other prompts) that make it a shared
/// header.
pub const DIVERGENCES: u32 = 2;

/// Bits of a cell holding the count (the rest hold the key's fingerprint).
const COUNT_BITS: u32 = 16;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

/// Recent divergence counts per prefix.
#[derive(Debug)]
pub struct SharedHeaders {
    cells: Box<[AtomicU64]>,
    /// Requests counted since the start (drives the halving).
    seen: AtomicU64,
}

impl Default for SharedHeaders {
    fn default() -> Self {
        Self::new()
    }
}

impl SharedHeaders {
    /// An empty sketch.
    pub fn new() -> Self {
        Self {
            cells: (0..CELLS).map(|_| AtomicU64::new(0)).collect(),
            seen: AtomicU64::new(0),
        }
    }

    /// [`observe`](Self::observe) with the depths of a prefix table match.
    pub fn observe_match(&self, chain: &[u64], matched: &shm_layout::PrefixMatch, repeat: bool) -> u32 {
        let mut depths = [0u32; shm_layout::MATCH_CAPACITY];
        for (depth, (_, blocks)) in depths.iter_mut().zip(matched.iter()) {
            *depth = blocks;
        }
        self.observe(chain, &depths, repeat)
    }

    /// The shared header of a request whose chain is `chain` and whose
    /// matches on the servers are `depths` (blocks, one per server): its
    /// depth in blocks, or 0 when it opens with none the sketch knows.
    /// Counts the request's divergence (after its deepest match) unless it
    /// is a `repeat` (the same request asked about again).
    ///
    /// The header is the deepest match depth that is a known divergence
    /// point: the deepest itself when other prompts diverged there too (a
    /// new conversation on a system prompt), or a shallower one (a
    /// conversation's later turn: its own engine matches its history,
    /// the other engines the system prompt they computed for other
    /// conversations; those matches are the header, and count as none).
    pub fn observe(&self, chain: &[u64], depths: &[u32], repeat: bool) -> u32 {
        let deepest = depths.iter().copied().max().unwrap_or(0);
        let d = deepest as usize;
        let mut header = 0;
        if d > 0 && d < chain.len() {
            let key = chain[d - 1];
            // A repeat was counted on its first look: the others are the rest.
            let earlier = if repeat {
                self.count(key).saturating_sub(1)
            } else {
                self.bump(key)
            };
            if earlier >= DIVERGENCES {
                header = deepest;
            }
        }
        if !repeat {
            self.tick();
        }
        if header == 0 {
            // Shallower matches: a known divergence point, or a prefix two
            // servers besides the deepest one hold (three engines computed
            // it, for three different requests).
            let mut sorted = [0u32; shm_layout::MATCH_CAPACITY];
            let n = depths.len().min(sorted.len());
            sorted[..n].copy_from_slice(&depths[..n]);
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            if sorted[2] < deepest {
                header = sorted[2];
            }
            for &depth in depths {
                let at = depth as usize;
                if depth > header && at > 0 && at < d && self.count(chain[at - 1]) >= DIVERGENCES {
                    header = depth;
                }
            }
        }
        header
    }

    /// The cell of `key`, and the fingerprint it is stored under there
    /// (never 0: 0 marks an empty cell).
    fn slot(&self, key: u64) -> (&AtomicU64, u64) {
        let cell = &self.cells[(key as usize) % CELLS];
        let fingerprint = (key >> COUNT_BITS) | 1;
        (cell, fingerprint)
    }

    /// The recent divergences counted under `key`.
    fn count(&self, key: u64) -> u32 {
        let (cell, fingerprint) = self.slot(key);
        let v = cell.load(Ordering::Relaxed);
        if v >> COUNT_BITS == fingerprint {
            (v & COUNT_MASK) as u32
        } else {
            0
        }
    }

    /// Counts one divergence under `key`; returns the count before it.
    /// A cell held by another key is taken over only when its count is at
    /// most 1 (a key seen once, or decayed): a hot prefix keeps its cell.
    fn bump(&self, key: u64) -> u32 {
        let (cell, fingerprint) = self.slot(key);
        let mut v = cell.load(Ordering::Relaxed);
        loop {
            let (next, before) = if v >> COUNT_BITS == fingerprint {
                let n = v & COUNT_MASK;
                ((fingerprint << COUNT_BITS) | (n + 1).min(COUNT_MASK), n as u32)
            } else if v & COUNT_MASK <= 1 {
                ((fingerprint << COUNT_BITS) | 1, 0)
            } else {
                return 0;
            };
            match cell.compare_exchange_weak(v, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return before,
                Err(now) => v = now,
            }
        }
    }

    /// Ends counting one request; every [`WINDOW`] requests, halves every
    /// count (a racing bump may be lost: the sketch is an estimate).
    fn tick(&self) {
        if (self.seen.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(WINDOW) {
            for cell in self.cells.iter() {
                let v = cell.load(Ordering::Relaxed);
                if v != 0 {
                    let halved = (v & !COUNT_MASK) | ((v & COUNT_MASK) / 2);
                    let _ = cell.compare_exchange(v, halved, Ordering::Relaxed, Ordering::Relaxed);
                }
            }
        }
    }
}

/// Whole blocks of `block_size` tokens at the start of a prompt whose
/// tokens are `prompt` that lie within its opening, tokenized alone as
/// `opening`: the leading tokens the two share (the opening's last token
/// may merge with the text after it in the whole prompt, and then counts
/// as not shared), in whole blocks.
pub fn template_blocks(prompt: &[u32], opening: &[u32], block_size: usize) -> u32 {
    let shared = prompt.iter().zip(opening).take_while(|(a, b)| a == b).count();
    u32::try_from(shared / block_size.max(1)).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_opening_counts_in_whole_blocks_of_the_tokens_it_shares_with_the_prompt() {
        let prompt: Vec<u32> = (0..40).collect();
        // 33 shared tokens: two whole blocks of 16.
        assert_eq!(template_blocks(&prompt, &prompt[..33], 16), 2);
        // The opening's last token merged with the message's first in the
        // whole prompt: 31 shared, one block.
        let mut merged = prompt[..32].to_vec();
        merged[31] = 999;
        assert_eq!(template_blocks(&prompt, &merged, 16), 1);
        assert_eq!(template_blocks(&prompt, &[], 16), 0);
        assert_eq!(template_blocks(&prompt[..10], &prompt[..10], 16), 0);
    }

    /// A chain: `header` blocks shared by every conversation, then
    /// `own` blocks of conversation `c`.
    fn chain(header: usize, c: u64, own: usize) -> Vec<u64> {
        (0..header as u64)
            .map(|i| 0x5eed_0000 + i)
            .chain((0..own as u64).map(|i| (c << 20) + i + 1))
            .collect()
    }

    #[test]
    fn a_prefix_many_prompts_diverge_at_is_a_header_after_the_third() {
        let h = SharedHeaders::new();
        let depths: Vec<u32> = (0..5).map(|c| h.observe(&chain(50, c, 3), &[50], false)).collect();
        // The first two conversations to diverge there follow the match;
        // from the third on, the match is a shared header.
        assert_eq!(depths, [0, 0, 50, 50, 50]);
    }

    #[test]
    fn a_conversation_that_continues_its_own_history_is_never_a_header() {
        let h = SharedHeaders::new();
        // Turn t of one conversation matches everything up to its last
        // turn's end, a different point each time.
        for t in 1..20usize {
            let c = chain(50, 7, t * 4 + 3);
            assert_eq!(h.observe(&c, &[50 + t as u32 * 4], false), 0, "turn {t}");
        }
    }

    #[test]
    fn a_whole_match_or_none_is_not_a_divergence_and_repeats_do_not_count() {
        let h = SharedHeaders::new();
        let c = chain(10, 1, 2);
        assert_eq!(h.observe(&c, &[0], false), 0);
        assert_eq!(h.observe(&c, &[12], false), 0);
        // Asked about again (a retry, the queue): read, not counted.
        for _ in 0..10 {
            assert_eq!(h.observe(&chain(10, 2, 2), &[10], true), 0);
        }
        assert_eq!(h.observe(&chain(10, 3, 2), &[10], false), 0);
        assert_eq!(h.observe(&chain(10, 4, 2), &[10], false), 0);
        // Asked again, the fourth still counts two others before it.
        assert_eq!(h.observe(&chain(10, 4, 2), &[10], true), 0);
        assert_eq!(h.observe(&chain(10, 5, 2), &[10], false), 10);
        assert_eq!(h.observe(&chain(10, 5, 2), &[10], true), 10);
    }

    #[test]
    fn a_later_turn_sees_the_other_engines_header_matches_as_the_header() {
        let h = SharedHeaders::new();
        for c in 0..4 {
            h.observe(&chain(50, c, 3), &[50], false);
        }
        // Conversation 9's third turn: its own engine holds 58 blocks, two
        // others the system prompt they computed for other conversations.
        let turn = chain(50, 9, 12);
        assert_eq!(h.observe(&turn, &[58, 50, 50], false), 50);
        // A prompt whose shallower match is not a known header.
        let other = chain(30, 9, 30);
        assert_eq!(h.observe(&other, &[58, 30], false), 0);
        // Two servers besides the deepest one hold 30 blocks of it: three
        // engines computed them, a header whatever the counts.
        // (Asked again as repeats: its own divergence was counted once.)
        assert_eq!(h.observe(&other, &[58, 30, 0, 30], true), 30);
        assert_eq!(h.observe(&other, &[58, 30, 40], true), 30);
        // Several at the deepest depth: nothing shallower is implied.
        assert_eq!(h.observe(&other, &[58, 58, 58], true), 0);
        // No match at all.
        assert_eq!(h.observe(&other, &[], false), 0);
    }

    #[test]
    fn counts_fade_when_the_header_stops_being_used() {
        let h = SharedHeaders::new();
        for c in 0..4 {
            h.observe(&chain(8, c, 2), &[8], false);
        }
        assert_eq!(h.count(chain(8, 0, 2)[7]), 4);
        // Two windows of other traffic: 4 → 2 → 1.
        for i in 0..2 * WINDOW {
            h.observe(&[i], &[0], false);
        }
        assert_eq!(h.count(chain(8, 0, 2)[7]), 1);
        assert_eq!(h.observe(&chain(8, 9, 2), &[8], false), 0);
    }

    #[test]
    fn a_rare_prefix_never_borrows_a_hot_ones_count() {
        let h = SharedHeaders::new();
        let hot = 0x1234_5678_9abc_def0u64;
        // Another key in the same cell, with another fingerprint.
        let rare = hot.wrapping_add(CELLS as u64 * 7919);
        assert_eq!(hot as usize % CELLS, rare as usize % CELLS);
        for _ in 0..5 {
            h.bump(hot);
        }
        assert_eq!(h.bump(rare), 0);
        assert_eq!(h.count(rare), 0);
        assert_eq!(h.count(hot), 5);
        // A cell whose key was seen once is taken over.
        let once = 0x0fed_cba9_8765_4321u64;
        let other = once.wrapping_add(CELLS as u64 * 104_729);
        h.bump(once);
        assert_eq!(h.bump(other), 0);
        assert_eq!(h.count(other), 1);
        assert_eq!(h.count(once), 0);
    }
}
