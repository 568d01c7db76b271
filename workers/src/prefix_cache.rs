//! A block-based KV cache with automatic prefix caching, modelled on vLLM V1
//! (design: <https://docs.vllm.ai/en/latest/design/prefix_caching.html>;
//! code: `vllm/v1/core/kv_cache_manager.py` and `block_pool.py`).
//!
//! # The model
//!
//! The cache holds [`PrefixCache::num_blocks`] blocks of `block_size` tokens.
//! A request's tokens (prompt, then output) fill blocks in order.
//!
//! * **Chained block hashes.** A *full* block is named by
//!   `hash_i = seahash(hash_{i-1} as 8 LE bytes ++ the block's token ids as LE u32)`,
//!   with `hash_{-1} = 0` ([`block_hashes`]). The hash of block `i` thus
//!   names the whole prefix up to the end of block `i`, so two requests
//!   share block `i` only if they agree on every token before it. Only full
//!   blocks get a hash and can be shared; a partial last block is private to
//!   its request.
//! * **Reference counts and an LRU.** Every block is either *free* (no
//!   hash, unused), *referenced* (held by one or more running requests;
//!   pinned, never evicted) or *cached and unreferenced* (has a hash, no
//!   request holds it; its KV is kept for future hits, but it can be evicted).
//!   Cached unreferenced blocks sit in an LRU list (an intrusive doubly linked
//!   list, O(1) per operation); a `HashMap` maps each hash to its block.
//! * **Lookup** ([`PrefixCache::lookup`]) counts the leading full prompt
//!   blocks whose hashes are cached. As in vLLM, the last prompt token is
//!   always recomputed (its logits are needed to sample the first output
//!   token), so the hit is capped at `floor((prompt_len - 1) / block_size)`
//!   blocks: a prompt of exactly two cached blocks hits one.
//! * **Allocation** ([`PrefixCache::allocate`]) reserves
//!   `ceil((prompt_len + output_len) / block_size)` blocks for the whole
//!   request up front: the hit blocks are reused (their count goes up; an
//!   unreferenced one leaves the LRU), the rest are taken from the free
//!   blocks first, then by evicting the least recently used cached blocks.
//!   If free + evictable blocks do not cover the request, nothing is
//!   allocated and the caller keeps the request waiting. As vLLM does in
//!   `allocate_slots`, the full prompt blocks are registered under their
//!   hashes right away, so a request admitted later (even in the same step,
//!   which vLLM also allows: within each layer the KV of the whole batch is
//!   written before attention reads it) shares them while the first one is
//!   still running.
//! * **Release** ([`PrefixCache::release`]) registers the full blocks of the
//!   tokens whose KV was computed (prompt and generated tokens), so the next
//!   turn of a conversation, whose prompt is the previous prompt + answer +
//!   new message, hits the answer too; then every block is unpinned. Blocks
//!   that drop to zero references go to the most-recently-used end of the
//!   LRU if they have a hash, to the free pool if not. Like vLLM's
//!   `KVCacheManager.free`, blocks are released in reverse order so that a
//!   request's tail blocks are evicted before its head blocks (a chain
//!   without its head is useless; without its tail it still serves shorter
//!   prefixes). If a block's hash is already cached by another block, the
//!   cache keeps one copy and the duplicate returns to the free pool.
//! * **Usage** ([`PrefixCache::usage`]) is referenced blocks / all blocks,
//!   vLLM's `kv_cache_usage_perc`: cached blocks nobody holds count as free.
//!
//! # Simplifications (against vLLM)
//!
//! * A request reserves blocks for its whole output at admission, so there
//!   is never preemption. vLLM allocates decode blocks one at a time and,
//!   when it runs out, preempts the newest running request (which frees its
//!   blocks and later recomputes). With whole-output reservation, KV-bound
//!   admission is slightly more conservative than vLLM's.
//! * Unhashed free blocks are used before any cached block is evicted
//!   (vLLM keeps one free queue in which freed blocks, cached or not, are
//!   appended in release order), so this cache keeps prefixes slightly
//!   longer.
//! * Generated blocks are registered when the request ends rather than as
//!   each fills; no other request can tell the difference, because no prompt
//!   can contain an answer that has not been returned yet.
//! * The hash is seahash with a fixed seed (vLLM: SHA-256 or Python's `hash`
//!   with a per-process random seed). The only extra key is a request's
//!   root ([`chained_hashes`]): a LoRA adapter's, so that its blocks are
//!   apart from the base model's (vLLM also keys multimodal hashes and
//!   `cache_salt`).

use std::collections::HashMap;

/// The chained hash naming a full block and everything before it.
pub type BlockHash = u64;

/// Block id meaning "none" in the LRU links.
const NIL: usize = usize::MAX;

/// The chained hashes of the full blocks of `tokens`, in order (a trailing
/// partial block has none).
///
/// `hash_i = seahash(hash_{i-1} LE ++ tokens of block i as LE u32)`, with
/// `hash_{-1} = 0`. Because of the chaining, the hashes of a prefix of
/// `tokens` are a prefix of the hashes of `tokens`.
///
/// # Panics
///
/// If `block_size` is 0.
pub fn block_hashes(tokens: impl IntoIterator<Item = u32>, block_size: u32) -> Vec<BlockHash> {
    chained_hashes(0, tokens, block_size)
}

/// [`block_hashes`] with `hash_{-1} = root`: a request's extra key (0: none;
/// see [`crate::config::EngineConfig::cache_root`]), so that requests with
/// different roots share no block.
///
/// # Panics
///
/// If `block_size` is 0.
pub fn chained_hashes(root: u64, tokens: impl IntoIterator<Item = u32>, block_size: u32) -> Vec<BlockHash> {
    assert!(block_size > 0, "block_size must be at least 1");
    let block_size = block_size as usize;
    let tokens = tokens.into_iter();
    let mut hashes = Vec::with_capacity(tokens.size_hint().0 / block_size);
    let mut buf = Vec::with_capacity(8 + 4 * block_size);
    let mut prev: BlockHash = root;
    buf.extend_from_slice(&prev.to_le_bytes());
    let mut filled = 0;
    for token in tokens {
        buf.extend_from_slice(&token.to_le_bytes());
        filled += 1;
        if filled == block_size {
            prev = seahash::hash(&buf);
            hashes.push(prev);
            buf.clear();
            buf.extend_from_slice(&prev.to_le_bytes());
            filled = 0;
        }
    }
    hashes
}

/// Blocks needed to hold `tokens` tokens: `ceil(tokens / block_size)`.
///
/// # Panics
///
/// If `block_size` is 0.
pub fn blocks_for(tokens: u64, block_size: u32) -> u64 {
    tokens.div_ceil(u64::from(block_size))
}

/// Metadata of one physical block.
#[derive(Debug, Clone)]
struct Block {
    /// The hash it is registered under in `PrefixCache::cached`, if any.
    hash: Option<BlockHash>,
    /// Running requests holding it.
    refs: u32,
    /// LRU neighbours (towards the least / most recently used end); `NIL`
    /// when not in the LRU or at an end.
    prev: usize,
    next: usize,
}

/// The blocks held by one admitted request, in token order. Hand it back to
/// [`PrefixCache::release`] when the request ends (it is deliberately not
/// `Clone`, so it cannot be released twice).
#[derive(Debug)]
pub struct Allocation {
    blocks: Vec<usize>,
    cached_blocks: usize,
}

impl Allocation {
    /// Leading blocks that came from the prefix cache (prefill skipped them).
    pub fn cached_blocks(&self) -> usize {
        self.cached_blocks
    }

    /// Blocks held (prompt and reserved output).
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The physical block ids, in token order.
    pub fn block_ids(&self) -> &[usize] {
        &self.blocks
    }
}

/// What the cache did to its blocks, as an engine publishing KV cache
/// events (vLLM's `BlockStored`, `BlockRemoved`, `AllBlocksCleared`) tells
/// it; recorded only once [`PrefixCache::record_events`] is called.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Blocks `first..first + hashes.len()` of the request just allocated
    /// or released were registered under `hashes`; `parent` is the hash of
    /// its block `first - 1`, if any. (The caller holds the request's
    /// tokens: block `i` is tokens `i * block_size..(i + 1) * block_size`.)
    Stored {
        /// The request's first block stored.
        first: usize,
        /// The stored blocks' hashes, in order.
        hashes: Vec<BlockHash>,
        /// The hash of the block before the first.
        parent: Option<BlockHash>,
    },
    /// Blocks evicted, by hash.
    Removed(Vec<BlockHash>),
    /// Every block forgotten ([`PrefixCache::reset`]).
    Cleared,
}

/// The KV cache: blocks, their hashes, reference counts and the LRU of
/// cached unreferenced blocks. See the [module docs](self) for the model.
#[derive(Debug)]
pub struct PrefixCache {
    block_size: u32,
    /// Blocks in the cache.
    capacity: usize,
    /// Metadata of the blocks used so far (created lazily, so a huge
    /// capacity costs nothing until it is used); `len() <= capacity`.
    blocks: Vec<Block>,
    /// Created blocks with no hash and no references.
    free: Vec<usize>,
    /// Hash → the block registered under it.
    cached: HashMap<BlockHash, usize>,
    /// Least recently used end of the LRU (evicted first).
    lru_head: usize,
    /// Most recently used end of the LRU.
    lru_tail: usize,
    /// Blocks in the LRU (cached and unreferenced).
    lru_len: usize,
    /// Blocks with at least one reference.
    referenced: usize,
    /// The events not yet taken, when recording ([`CacheEvent`]).
    events: Option<Vec<CacheEvent>>,
}

impl PrefixCache {
    /// An empty cache of `num_blocks` blocks of `block_size` tokens.
    ///
    /// # Panics
    ///
    /// If `block_size` is 0.
    pub fn new(block_size: u32, num_blocks: u64) -> Self {
        assert!(block_size > 0, "block_size must be at least 1");
        Self {
            block_size,
            capacity: usize::try_from(num_blocks).unwrap_or(usize::MAX),
            blocks: Vec::new(),
            free: Vec::new(),
            cached: HashMap::new(),
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            referenced: 0,
            events: None,
        }
    }

    /// Records what happens to the blocks from now on, for
    /// [`take_events`](Self::take_events).
    pub fn record_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The events recorded since the last call, in order (none unless
    /// [`record_events`](Self::record_events) was called). Take them after
    /// each [`allocate`](Self::allocate) and [`release`](Self::release):
    /// a `Stored` event's block numbers are that request's.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Records that blocks `first..` of a request were stored under
    /// `stored`, the request's hashes being `hashes`.
    fn record_stored(&mut self, hashes: &[BlockHash], first: usize, stored: &[BlockHash]) {
        if let Some(events) = &mut self.events
            && !stored.is_empty()
        {
            events.push(CacheEvent::Stored {
                first,
                hashes: stored.to_vec(),
                parent: first.checked_sub(1).map(|i| hashes[i]),
            });
        }
    }

    /// Registers blocks `range` of a request (its `blocks` and `hashes`),
    /// recording each run of newly registered ones.
    fn register_run(&mut self, blocks: &[usize], hashes: &[BlockHash], range: std::ops::Range<usize>) {
        let mut run_start = range.start;
        for i in range.clone() {
            if !self.register(blocks[i], hashes[i]) {
                self.record_stored(hashes, run_start, &hashes[run_start..i]);
                run_start = i + 1;
            }
        }
        self.record_stored(hashes, run_start, &hashes[run_start..range.end]);
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Blocks in the cache.
    pub fn num_blocks(&self) -> u64 {
        self.capacity as u64
    }

    /// Blocks held by running requests.
    pub fn referenced_blocks(&self) -> u64 {
        self.referenced as u64
    }

    /// Blocks with no hash and no references.
    pub fn free_blocks(&self) -> u64 {
        self.free_count() as u64
    }

    /// Cached blocks no request holds (the LRU; evicted when blocks run out).
    pub fn evictable_blocks(&self) -> u64 {
        self.lru_len as u64
    }

    /// Blocks registered under a hash (referenced or not).
    pub fn cached_blocks(&self) -> u64 {
        self.cached.len() as u64
    }

    /// Forgets every cached block, as vLLM's `reset_prefix_cache` does:
    /// only when no request holds a block (vLLM refuses otherwise, and so
    /// does this: false, nothing changed).
    pub fn reset(&mut self) -> bool {
        if self.referenced > 0 {
            return false;
        }
        for (b, block) in self.blocks.iter_mut().enumerate() {
            if block.hash.take().is_some() {
                block.prev = NIL;
                block.next = NIL;
                self.free.push(b);
            }
        }
        self.cached.clear();
        (self.lru_head, self.lru_tail, self.lru_len) = (NIL, NIL, 0);
        if let Some(events) = &mut self.events {
            events.push(CacheEvent::Cleared);
        }
        true
    }

    /// Whether a block is registered under `hash`.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.cached.contains_key(&hash)
    }

    /// Fraction of blocks held by running requests (vLLM's
    /// `kv_cache_usage_perc`; cached unreferenced blocks count as free).
    pub fn usage(&self) -> f64 {
        if self.capacity == 0 {
            0.0
        } else {
            self.referenced as f64 / self.capacity as f64
        }
    }

    /// Leading full prompt blocks found in the cache, capped at
    /// `floor((prompt_len - 1) / block_size)` so that the last prompt token
    /// is always recomputed.
    ///
    /// `hashes` are the request's [`block_hashes`] (of the prompt, or of
    /// prompt + output: only the prompt's are looked at).
    pub fn lookup(&self, hashes: &[BlockHash], prompt_len: usize) -> usize {
        let limit = (prompt_len.saturating_sub(1) / self.block_size as usize).min(hashes.len());
        hashes[..limit]
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Reserves the blocks of a request of `total_len` tokens (prompt +
    /// output) whose prompt is `prompt_len` tokens: the cached prefix found
    /// by [`lookup`](Self::lookup) is reused and the other blocks come from
    /// the free pool, then from evicting LRU blocks. Registers the full
    /// prompt blocks under their hashes. `None` (and nothing changed) if
    /// free + evictable blocks do not suffice.
    ///
    /// `hashes` are the request's [`block_hashes`] (at least the prompt's).
    pub fn allocate(&mut self, hashes: &[BlockHash], prompt_len: usize, total_len: usize) -> Option<Allocation> {
        let needed = total_len.div_ceil(self.block_size as usize);
        let hit = self.lookup(hashes, prompt_len).min(needed);
        let mut blocks = Vec::with_capacity(needed);
        blocks.extend(hashes[..hit].iter().filter_map(|h| self.cached.get(h).copied()));
        debug_assert_eq!(blocks.len(), hit);
        // Hit blocks in the LRU stop being evictable once reused.
        let reused_evictable = blocks.iter().filter(|&&b| self.blocks[b].refs == 0).count();
        let available = self.free_count() + (self.lru_len - reused_evictable);
        if needed - hit > available {
            return None;
        }
        for &b in &blocks {
            self.pin(b);
        }
        for _ in hit..needed {
            let b = self.take_block();
            self.pin(b);
            blocks.push(b);
        }
        let full_prompt_blocks = (prompt_len / self.block_size as usize).min(hashes.len()).min(needed);
        self.register_run(&blocks, hashes, hit..full_prompt_blocks.max(hit));
        Some(Allocation {
            blocks,
            cached_blocks: hit,
        })
    }

    /// Ends a request: registers the full blocks of its first
    /// `computed_tokens` tokens (the ones whose KV was computed: prompt and
    /// generated tokens; an aborted request passes only what it computed),
    /// then unpins all its blocks, tail first. Unreferenced blocks with a
    /// hash go to the most recently used end of the LRU, the others to the
    /// free pool; a block whose hash another block already holds stays
    /// unregistered and is freed (one copy is kept).
    ///
    /// `hashes` are the request's [`block_hashes`] of prompt + output.
    pub fn release(&mut self, allocation: Allocation, hashes: &[BlockHash], computed_tokens: usize) {
        let full = (computed_tokens / self.block_size as usize)
            .min(hashes.len())
            .min(allocation.blocks.len());
        self.register_run(&allocation.blocks, hashes, 0..full);
        for &b in allocation.blocks.iter().rev() {
            self.unpin(b);
        }
    }

    /// [`release`](Self::release), except that the first `keep` blocks
    /// stay pinned: they come back as an allocation of their own, to hand
    /// to [`release`](Self::release) later (with no computed tokens: they
    /// are registered now). This is vLLM's delayed free of a prefill's
    /// prompt blocks, held until a remote decode has read them.
    pub fn release_keeping(
        &mut self,
        allocation: Allocation,
        hashes: &[BlockHash],
        computed_tokens: usize,
        keep: usize,
    ) -> Allocation {
        let full = (computed_tokens / self.block_size as usize)
            .min(hashes.len())
            .min(allocation.blocks.len());
        self.register_run(&allocation.blocks, hashes, 0..full);
        let keep = keep.min(allocation.blocks.len());
        for &b in allocation.blocks[keep..].iter().rev() {
            self.unpin(b);
        }
        Allocation {
            cached_blocks: allocation.cached_blocks.min(keep),
            blocks: allocation.blocks[..keep].to_vec(),
        }
    }

    fn free_count(&self) -> usize {
        self.free.len() + (self.capacity - self.blocks.len())
    }

    /// A block with no hash and no references: a free one, else a new one,
    /// else the LRU head, evicted. The caller checked that one exists.
    fn take_block(&mut self) -> usize {
        if let Some(b) = self.free.pop() {
            return b;
        }
        if self.blocks.len() < self.capacity {
            self.blocks.push(Block {
                hash: None,
                refs: 0,
                prev: NIL,
                next: NIL,
            });
            return self.blocks.len() - 1;
        }
        let b = self.lru_head;
        assert_ne!(
            b, NIL,
            "take_block: no free or evictable block (the caller checks availability)"
        );
        self.lru_unlink(b);
        if let Some(h) = self.blocks[b].hash.take() {
            self.cached.remove(&h);
            if let Some(events) = &mut self.events {
                match events.last_mut() {
                    Some(CacheEvent::Removed(hashes)) => hashes.push(h),
                    _ => events.push(CacheEvent::Removed(vec![h])),
                }
            }
        }
        b
    }

    /// Registers block `b` under `h` unless it already has a hash or
    /// another block holds `h`; whether it was newly registered.
    fn register(&mut self, b: usize, h: BlockHash) -> bool {
        if self.blocks[b].hash.is_some() {
            return false;
        }
        if let std::collections::hash_map::Entry::Vacant(slot) = self.cached.entry(h) {
            slot.insert(b);
            self.blocks[b].hash = Some(h);
            return true;
        }
        false
    }

    fn pin(&mut self, b: usize) {
        if self.blocks[b].refs == 0 {
            if self.blocks[b].hash.is_some() {
                self.lru_unlink(b);
            }
            self.referenced += 1;
        }
        self.blocks[b].refs += 1;
    }

    fn unpin(&mut self, b: usize) {
        debug_assert!(self.blocks[b].refs > 0, "unpin of an unreferenced block");
        self.blocks[b].refs -= 1;
        if self.blocks[b].refs == 0 {
            self.referenced -= 1;
            if self.blocks[b].hash.is_some() {
                self.lru_push_back(b);
            } else {
                self.free.push(b);
            }
        }
    }

    fn lru_unlink(&mut self, b: usize) {
        let Block { prev, next, .. } = self.blocks[b];
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.blocks[prev].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.blocks[next].prev = prev;
        }
        self.blocks[b].prev = NIL;
        self.blocks[b].next = NIL;
        self.lru_len -= 1;
    }

    fn lru_push_back(&mut self, b: usize) {
        self.blocks[b].prev = self.lru_tail;
        self.blocks[b].next = NIL;
        if self.lru_tail == NIL {
            self.lru_head = b;
        } else {
            let tail = self.lru_tail;
            self.blocks[tail].next = b;
        }
        self.lru_tail = b;
        self.lru_len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: u32 = 4;

    /// Distinct tokens `base..base+n`.
    fn toks(base: u32, n: u32) -> Vec<u32> {
        (base..base + n).collect()
    }

    fn hashes(tokens: &[u32]) -> Vec<BlockHash> {
        block_hashes(tokens.iter().copied(), BS)
    }

    fn concat(a: &[u32], b: &[u32]) -> Vec<u32> {
        a.iter().chain(b).copied().collect()
    }

    /// Allocates and releases a request (prompt + output computed in full,
    /// as the engine does at the end: all but the last output token).
    fn run(cache: &mut PrefixCache, prompt: &[u32], output: &[u32]) -> usize {
        let all = concat(prompt, output);
        let h = hashes(&all);
        let a = cache.allocate(&h, prompt.len(), all.len()).expect("fits");
        let hit = a.cached_blocks();
        cache.release(a, &h, all.len() - 1);
        cache.check();
        hit
    }

    impl PrefixCache {
        /// Checks every structural invariant (O(n), tests only).
        fn check(&self) {
            let mut lru = Vec::new();
            let mut b = self.lru_head;
            let mut prev = NIL;
            while b != NIL {
                assert_eq!(self.blocks[b].prev, prev, "LRU back link of {b}");
                lru.push(b);
                prev = b;
                b = self.blocks[b].next;
            }
            assert_eq!(self.lru_tail, prev, "LRU tail");
            assert_eq!(lru.len(), self.lru_len, "LRU length");
            for &b in &lru {
                assert_eq!(self.blocks[b].refs, 0, "LRU block {b} is referenced");
                assert!(self.blocks[b].hash.is_some(), "LRU block {b} has no hash");
            }
            for &b in &self.free {
                assert_eq!(self.blocks[b].refs, 0, "free block {b} is referenced");
                assert!(self.blocks[b].hash.is_none(), "free block {b} has a hash");
            }
            for (h, &b) in &self.cached {
                assert_eq!(self.blocks[b].hash, Some(*h), "map entry of block {b}");
            }
            let hashed = self.blocks.iter().filter(|b| b.hash.is_some()).count();
            assert_eq!(hashed, self.cached.len(), "hashed blocks vs map");
            let referenced = self.blocks.iter().filter(|b| b.refs > 0).count();
            assert_eq!(referenced, self.referenced, "referenced count");
            assert_eq!(
                self.free.len() + self.lru_len + self.referenced,
                self.blocks.len(),
                "block partition"
            );
            assert!(self.blocks.len() <= self.capacity);
        }
    }

    #[test]
    fn hashes_cover_full_blocks_only_and_chain() {
        let t = toks(0, 10);
        let h = hashes(&t);
        assert_eq!(h.len(), 2, "10 tokens = 2 full blocks of 4 + a partial one");
        assert_eq!(hashes(&t[..8]), h, "the partial block does not change the full ones");
        assert_eq!(hashes(&t[..4]), h[..1], "a prefix's hashes are a prefix");
        assert_eq!(hashes(&t), h, "deterministic");
        // The same block content after a different prefix has a different hash.
        let a = hashes(&[1, 2, 3, 4, 9, 9, 9, 9]);
        let b = hashes(&[5, 6, 7, 8, 9, 9, 9, 9]);
        assert_ne!(a[1], b[1]);
        // The first block is the seahash of the zero seed + its tokens.
        let mut bytes = 0u64.to_le_bytes().to_vec();
        for x in &t[..4] {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        assert_eq!(h[0], seahash::hash(&bytes));
        assert!(hashes(&t[..3]).is_empty());
        assert_eq!(blocks_for(0, 4), 0);
        assert_eq!(blocks_for(8, 4), 2);
        assert_eq!(blocks_for(9, 4), 3);
    }

    #[test]
    fn empty_cache_misses_and_allocation_reserves_prompt_and_output() {
        let mut c = PrefixCache::new(BS, 10);
        let prompt = toks(0, 9);
        let all = concat(&prompt, &toks(100, 6));
        let h = hashes(&all);
        assert_eq!(c.lookup(&h, prompt.len()), 0);
        let a = c.allocate(&h, prompt.len(), all.len()).expect("fits");
        assert_eq!(a.num_blocks(), 4, "ceil(15 / 4)");
        assert_eq!(a.cached_blocks(), 0);
        assert_eq!(c.referenced_blocks(), 4);
        assert!((c.usage() - 0.4).abs() < 1e-12);
        // The two full prompt blocks are registered at admission; nothing else.
        assert_eq!(c.cached_blocks(), 2);
        assert!(c.contains(h[0]) && c.contains(h[1]) && !c.contains(h[2]));
        c.check();
        c.release(a, &h, all.len() - 1);
        c.check();
        assert_eq!(c.referenced_blocks(), 0);
        assert_eq!(c.usage(), 0.0, "cached but unreferenced blocks count as free");
        // 14 computed tokens = 3 full blocks registered; the partial 4th is freed.
        assert_eq!(c.cached_blocks(), 3);
        assert_eq!(c.evictable_blocks(), 3);
        assert_eq!(c.free_blocks(), 7);
    }

    #[test]
    fn repeated_prompt_hits_its_full_blocks() {
        let mut c = PrefixCache::new(BS, 16);
        let prompt = toks(0, 10);
        assert_eq!(run(&mut c, &prompt, &toks(100, 3)), 0);
        assert_eq!(run(&mut c, &prompt, &toks(200, 3)), 2, "two full prompt blocks");
        // A prompt sharing only the first block hits one block.
        let mut other = prompt.clone();
        other[5] = 999;
        let h = hashes(&other);
        assert_eq!(c.lookup(&h, other.len()), 1);
    }

    #[test]
    fn the_last_prompt_token_is_always_recomputed() {
        let mut c = PrefixCache::new(BS, 16);
        let prompt = toks(0, 8); // exactly two blocks
        run(&mut c, &prompt, &toks(100, 4));
        let h = hashes(&prompt);
        assert!(c.contains(h[0]) && c.contains(h[1]));
        assert_eq!(c.lookup(&h, 8), 1, "floor((8 - 1) / 4) = 1");
        let longer = concat(&prompt, &[7]);
        assert_eq!(c.lookup(&hashes(&longer), 9), 2, "floor((9 - 1) / 4) = 2");
        assert_eq!(c.lookup(&h, 1), 0);
        assert_eq!(c.lookup(&[], 0), 0);
        // Allocating the 8-token prompt again recomputes block 2 into a new
        // block; its hash is already cached, so the new block stays private
        // (one copy kept) and goes back to the free pool afterwards.
        let cached_before = c.cached_blocks();
        let a = c.allocate(&h, 8, 9).expect("fits");
        assert_eq!(a.cached_blocks(), 1);
        assert_ne!(a.block_ids()[1], c.cached[&h[1]], "block 2 is a fresh copy");
        c.check();
        c.release(a, &h, 8);
        c.check();
        assert_eq!(c.cached_blocks(), cached_before);
    }

    #[test]
    fn a_second_turn_hits_the_first_turns_prompt_and_answer() {
        let mut c = PrefixCache::new(BS, 64);
        let prompt1 = toks(0, 10);
        let answer1 = toks(100, 11);
        assert_eq!(run(&mut c, &prompt1, &answer1), 0);
        // Turn 2: the whole first turn, then a new message.
        let prompt2 = concat(&concat(&prompt1, &answer1), &toks(500, 7));
        let h2 = hashes(&prompt2);
        // First turn computed 10 + 11 - 1 = 20 tokens = 5 full blocks, which
        // cover the prompt and most of the answer.
        assert_eq!(c.lookup(&h2, prompt2.len()), 5);
        assert_eq!(run(&mut c, &prompt2, &toks(900, 2)), 5);
        // A third turn hits all of turn 2 (its prompt is 28 tokens = 7 blocks).
        let prompt3 = concat(&concat(&prompt2, &toks(900, 2)), &toks(700, 4));
        assert_eq!(c.lookup(&hashes(&prompt3), prompt3.len()), 7);
    }

    #[test]
    fn concurrent_requests_share_prompt_blocks_registered_at_admission() {
        let mut c = PrefixCache::new(BS, 16);
        let prompt = toks(0, 9);
        let all = concat(&prompt, &toks(100, 3));
        let h = hashes(&all);
        let a = c.allocate(&h, 9, 12).expect("fits");
        let b = c.allocate(&h, 9, 12).expect("fits");
        assert_eq!(b.cached_blocks(), 2, "B reuses the prompt blocks A registered");
        assert_eq!(a.block_ids()[..2], b.block_ids()[..2]);
        assert_eq!(c.referenced_blocks(), 2 + 2, "2 shared + 1 private each");
        c.check();
        // A and B computed the same third block (same prompt, same output):
        // the first release registers it, the second one's copy is a
        // duplicate and is freed.
        c.release(a, &h, 12);
        c.check();
        assert_eq!(c.cached_blocks(), 3);
        c.release(b, &h, 12);
        c.check();
        assert_eq!(c.cached_blocks(), 3, "one copy of each hash");
        assert_eq!(c.referenced_blocks(), 0);
        assert_eq!(c.evictable_blocks(), 3);
        assert_eq!(c.free_blocks(), 16 - 3);
    }

    #[test]
    fn a_reset_forgets_every_cached_block_but_not_while_one_is_held() {
        let mut c = PrefixCache::new(BS, 8);
        let t = toks(0, 12);
        let h = hashes(&t);
        let a = c.allocate(&h, t.len(), t.len()).expect("fits");
        assert!(!c.reset(), "a block is held");
        c.release(a, &h, t.len());
        assert_eq!(c.lookup(&h, 13), 3);
        assert!(c.reset());
        assert_eq!((c.lookup(&h, 13), c.cached_blocks(), c.evictable_blocks()), (0, 0, 0));
        // All eight blocks can be used again.
        let u = toks(100, 32);
        let hu = hashes(&u);
        let a = c.allocate(&hu, u.len(), u.len()).expect("every block is free");
        c.release(a, &hu, u.len());
        assert_eq!(c.lookup(&hu, 33), 8);
    }

    #[test]
    fn eviction_takes_least_recently_used_blocks_tail_first() {
        let mut c = PrefixCache::new(BS, 6);
        // Allocates and releases `t` as a fully computed prompt.
        let hold = |c: &mut PrefixCache, t: &[u32]| {
            let h = hashes(t);
            let a = c.allocate(&h, t.len(), t.len()).expect("fits");
            c.release(a, &h, t.len());
            c.check();
            h
        };
        let ha = hold(&mut c, &toks(0, 8)); // blocks A0 A1
        let hb = hold(&mut c, &toks(100, 8)); // blocks B0 B1
        // LRU (oldest first): A1 A0 B1 B0; 2 blocks never used.
        assert_eq!((c.evictable_blocks(), c.free_blocks()), (4, 2));
        // Touch A: a 9-token prompt hits A0 A1 and takes 1 free block, which
        // is private (partial) and returns to the free pool.
        let a9 = concat(&toks(0, 8), &[7]);
        let h9 = hashes(&a9);
        let alloc = c.allocate(&h9, 9, 9).expect("fits");
        assert_eq!(alloc.cached_blocks(), 2);
        c.release(alloc, &h9, 9);
        c.check();
        // LRU: B1 B0 A1 A0. X needs 3 blocks: 2 free + evict B's tail.
        let hx = hold(&mut c, &toks(200, 12));
        assert!(!c.contains(hb[1]), "B's tail was the least recently used");
        assert!(c.contains(hb[0]) && c.contains(ha[0]) && c.contains(ha[1]));
        // LRU: B0 A1 A0 X2 X1 X0.
        hold(&mut c, &toks(300, 4));
        assert!(!c.contains(hb[0]));
        // LRU: A1 A0 X2 X1 X0 Y0: A's tail goes before its head.
        hold(&mut c, &toks(400, 4));
        assert!(!c.contains(ha[1]) && c.contains(ha[0]));
        assert!(hx.iter().all(|&h| c.contains(h)));
        assert_eq!(c.cached_blocks(), 6);
    }

    #[test]
    fn recorded_events_say_what_was_stored_evicted_and_cleared() {
        let mut c = PrefixCache::new(BS, 6);
        let hold = |c: &mut PrefixCache, t: &[u32], output: usize| {
            let h = hashes(t);
            let prompt = t.len() - output;
            let a = c.allocate(&h, prompt, t.len()).expect("fits");
            let at_admission = c.take_events();
            c.release(a, &h, t.len());
            (h, at_admission, c.take_events())
        };
        assert_eq!(hold(&mut c, &toks(0, 8), 0).1, [], "nothing recorded before asked");
        c.record_events();
        // A 9-token prompt: blocks 0 and 1 are cached already, block 2 is a
        // partial one; 3 output tokens fill it, stored at release.
        let a = concat(&toks(0, 9), &toks(50, 3));
        let (ha, at_admission, at_release) = hold(&mut c, &a, 3);
        assert_eq!(at_admission, []);
        assert_eq!(
            at_release,
            [CacheEvent::Stored {
                first: 2,
                hashes: vec![ha[2]],
                parent: Some(ha[1]),
            }]
        );
        // A new 12-token prompt takes the 3 free blocks (none evicted) and
        // stores all three at admission, from the root.
        let (hb, at_admission, at_release) = hold(&mut c, &toks(100, 12), 0);
        assert_eq!(
            at_admission,
            [CacheEvent::Stored {
                first: 0,
                hashes: hb.clone(),
                parent: None,
            }]
        );
        assert_eq!(at_release, [], "stored already");
        // Another evicts the three least recently used, tail first: one
        // Removed event, before the store.
        let (hc, at_admission, _) = hold(&mut c, &toks(200, 12), 0);
        assert_eq!(
            at_admission,
            [
                CacheEvent::Removed(vec![ha[2], ha[1], ha[0]]),
                CacheEvent::Stored {
                    first: 0,
                    hashes: hc.clone(),
                    parent: None,
                },
            ]
        );
        // Each Stored and Removed event leaves the cache as it says.
        assert!(hb.iter().chain(&hc).all(|h| c.contains(*h)));
        assert!(!ha.iter().any(|h| c.contains(*h)));
        assert!(c.reset());
        assert_eq!(c.take_events(), [CacheEvent::Cleared]);
        assert_eq!(c.take_events(), [], "taken");
    }

    #[test]
    fn referenced_blocks_are_pinned_and_failed_allocation_changes_nothing() {
        let mut c = PrefixCache::new(BS, 4);
        let a = toks(0, 12);
        let ha = hashes(&a);
        let held = c.allocate(&ha, 12, 12).expect("3 of 4 blocks");
        let b = toks(100, 5);
        let hb = hashes(&b);
        assert!(c.allocate(&hb, 5, 5).is_none(), "needs 2, only 1 free, none evictable");
        c.check();
        assert_eq!(c.referenced_blocks(), 3);
        assert_eq!(c.free_blocks(), 1);
        assert!(
            c.contains(ha[0]) && c.contains(ha[1]) && c.contains(ha[2]),
            "pinned blocks stay"
        );
        c.release(held, &ha, 12);
        c.check();
        // Now A's 3 blocks are evictable: B fits by evicting one of them.
        let alloc = c.allocate(&hb, 5, 5).expect("fits now");
        assert_eq!(
            c.cached_blocks(),
            2 + 1,
            "one A block evicted, B's full block registered"
        );
        c.release(alloc, &hb, 5);
        c.check();
    }

    #[test]
    fn reused_hit_blocks_do_not_count_as_evictable_for_the_same_request() {
        let mut c = PrefixCache::new(BS, 4);
        let p = toks(0, 9);
        run(&mut c, &p, &[1]); // 2 blocks cached, 2 free
        let all = concat(&p, &toks(50, 11)); // 20 tokens = 5 blocks > 4
        assert!(c.allocate(&hashes(&all), 9, 20).is_none());
        let all = concat(&p, &toks(50, 7)); // 16 tokens = 4 blocks: 2 hit + 2 free
        let h = hashes(&all);
        let a = c.allocate(&h, 9, 16).expect("fits");
        assert_eq!(a.cached_blocks(), 2);
        assert_eq!(c.usage(), 1.0);
        c.check();
        c.release(a, &h, 15);
        c.check();
    }

    #[test]
    fn aborted_request_registers_only_computed_blocks() {
        let mut c = PrefixCache::new(BS, 16);
        let prompt = toks(0, 8);
        let all = concat(&prompt, &toks(100, 8));
        let h = hashes(&all);
        assert_eq!(h.len(), 4);
        let a = c.allocate(&h, 8, 16).expect("fits");
        // Aborted after prefill and 1 output token: 8 tokens computed.
        c.release(a, &h, 8);
        c.check();
        assert!(c.contains(h[0]) && c.contains(h[1]));
        assert!(
            !c.contains(h[2]) && !c.contains(h[3]),
            "output blocks were never computed"
        );
        assert_eq!(c.cached_blocks(), 2);
        assert_eq!(c.free_blocks(), 14);
    }

    #[test]
    fn kept_prompt_blocks_stay_pinned_until_released() {
        // A prefill leg: 10 prompt tokens (3 blocks, the last partial) and
        // 1 output token; its 3 prompt blocks are held for a remote reader.
        let mut c = PrefixCache::new(BS, 4);
        let all = toks(0, 11);
        let h = hashes(&all);
        let a = c.allocate(&h, 10, 11).expect("fits");
        assert_eq!(a.num_blocks(), 3);
        let held = c.release_keeping(a, &h, 10, 3);
        c.check();
        assert_eq!(held.num_blocks(), 3);
        assert_eq!(c.referenced_blocks(), 3, "the prompt's blocks are pinned");
        assert!(c.contains(h[0]) && c.contains(h[1]), "and registered");
        // Pinned blocks are not evictable: a 2-block request does not fit.
        let other = hashes(&toks(100, 8));
        assert!(c.allocate(&other, 7, 8).is_none());
        c.release(held, &h, 0);
        c.check();
        assert_eq!(c.referenced_blocks(), 0);
        assert_eq!(c.evictable_blocks(), 2, "the full prompt blocks stay cached");
        let a = c.allocate(&other, 7, 8).expect("fits once released");
        c.release(a, &other, 7);
        c.check();
    }

    #[test]
    fn partial_blocks_are_private() {
        let mut c = PrefixCache::new(BS, 8);
        let prompt = toks(0, 6);
        run(&mut c, &prompt, &[50]); // 6 computed tokens: 1 full block
        assert_eq!(c.cached_blocks(), 1);
        let longer = concat(&prompt, &[50, 51, 52]);
        assert_eq!(
            c.lookup(&hashes(&longer), longer.len()),
            1,
            "block 2 was partial, so not cached"
        );
    }

    #[test]
    fn huge_capacity_is_lazy() {
        let mut c = PrefixCache::new(16, 1 << 40);
        assert_eq!(c.num_blocks(), 1 << 40);
        assert_eq!(c.free_blocks(), 1 << 40);
        let t = toks(0, 100);
        let h = block_hashes(t.iter().copied(), 16);
        let a = c.allocate(&h, 100, 100).expect("fits");
        assert_eq!(a.num_blocks(), 7);
        assert_eq!(c.blocks.len(), 7);
        c.release(a, &h, 100);
        c.check();
        assert_eq!(c.cached_blocks(), 6);
    }

    #[test]
    fn churn_keeps_invariants() {
        // A deterministic mix of shared prefixes, holds and releases.
        let mut c = PrefixCache::new(BS, 24);
        let mut held: Vec<(Allocation, Vec<BlockHash>, usize)> = Vec::new();
        let mut x: u32 = 12345;
        for i in 0..2000u32 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            if x.is_multiple_of(3) && !held.is_empty() {
                let (a, h, computed) = held.remove(x as usize % held.len());
                c.release(a, &h, computed);
            } else {
                let prefix = (x % 5) * 1000; // 5 shared prefixes
                let len = 1 + (x >> 8) % 20;
                let mut t = toks(prefix, len.min(12));
                t.extend(toks(50_000 + i * 40, len.saturating_sub(12)));
                let h = hashes(&t);
                let prompt_len = (t.len() / 2).max(1);
                if let Some(a) = c.allocate(&h, prompt_len, t.len()) {
                    let computed = (x as usize >> 3) % (t.len() + 1);
                    held.push((a, h, computed.max(prompt_len)));
                }
            }
            c.check();
        }
        for (a, h, computed) in held.drain(..) {
            c.release(a, &h, computed);
        }
        c.check();
        assert_eq!(c.referenced_blocks(), 0);
    }
}
