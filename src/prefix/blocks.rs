//! Token ids → the chain of block hashes the shm prefix table is keyed by.
//!
//! A prompt's tokens are cut into blocks of `block_size` tokens (default
//! 16, vLLM's KV block size, so a gateway block is exactly a block the engine
//! can reuse). Block `i`'s hash covers blocks `0..=i`:
//!
//! ```text
//! h[-1] = root                      (per model and segment: chains of different
//!                                    models never meet, and the segment's
//!                                    random seed keeps hashes unguessable)
//! h[i]  = seahash(h[i-1] LE ‖ tokens of block i as LE u32)
//! ```
//!
//! Only full blocks are hashed: a partial last block is not reusable on the
//! engine either. Hashing is incremental ([`BlockHasher::extend`]): the
//! chain of prompt + answer continues the prompt's chain, which is what
//! lets the next turn of a conversation match the server that produced
//! this turn's answer.

/// Tokens per block unless configured.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Hashes token blocks into chains for one model on one segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    root: u64,
    block_size: usize,
}

impl BlockHasher {
    /// A hasher whose chains start from `root` (see [`Self::root_for`]).
    ///
    /// # Panics
    /// If `block_size` is 0 (the configuration rejects it earlier).
    pub fn new(root: u64, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be at least 1");
        Self { root, block_size }
    }

    /// The chain root for `model` under a segment's `seed`.
    pub fn root_for(model: &str, seed: u64) -> u64 {
        seahash::hash_seeded(
            model.as_bytes(),
            seed,
            seed.rotate_left(17),
            0x5345_4d4c_4220_726f,
            0x6f74_2d76_3100_0000,
        )
    }

    /// `root` salted with `tenant`'s salt ([`TenantSalt`]): the root of
    /// the chains of a tenant whose prefixes are kept apart.
    pub fn salted_root(root: u64, salt: &TenantSalt) -> u64 {
        seahash::hash_seeded(&root.to_le_bytes(), salt.key, !salt.key, 0x7361_6c74, 0x726f_6f74)
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The chain's root (the hash before the first block).
    pub fn root(&self) -> u64 {
        self.root
    }

    /// Full blocks in `tokens` tokens.
    pub fn full_blocks(&self, tokens: usize) -> usize {
        tokens / self.block_size
    }

    /// The chain of `tokens`' full blocks, written into `out` (cleared first).
    pub fn chain(&self, tokens: &[u32], out: &mut Vec<u64>) {
        out.clear();
        self.extend(tokens, out);
    }

    /// Continues `out`, the chain of a prefix of `tokens`, to all of
    /// `tokens`' full blocks: blocks `out.len()..` are hashed from the last
    /// hash in `out`. `tokens` must start with the tokens `out` was made from.
    pub fn extend(&self, tokens: &[u32], out: &mut Vec<u64>) {
        let done = (out.len() * self.block_size).min(tokens.len());
        self.append(&tokens[done..], out);
    }

    /// Appends to `out` the full blocks of `tokens`, the tokens that follow
    /// the last full block `out` is the chain of (from the root if `out` is
    /// empty).
    pub fn append(&self, tokens: &[u32], out: &mut Vec<u64>) {
        let mut prev = out.last().copied().unwrap_or(self.root);
        let mut buf = [0u8; 8 + 4 * 64];
        for block in tokens.chunks_exact(self.block_size) {
            prev = if self.block_size <= 64 {
                buf[..8].copy_from_slice(&prev.to_le_bytes());
                for (dst, t) in buf[8..].chunks_exact_mut(4).zip(block) {
                    dst.copy_from_slice(&t.to_le_bytes());
                }
                seahash::hash(&buf[..8 + 4 * self.block_size])
            } else {
                let mut bytes = Vec::with_capacity(8 + 4 * self.block_size);
                bytes.extend_from_slice(&prev.to_le_bytes());
                block.iter().for_each(|t| bytes.extend_from_slice(&t.to_le_bytes()));
                seahash::hash(&bytes)
            };
            out.push(prev);
        }
    }
}

/// Seeds of [`BlockHasher::end_key`]: another seahash function than the
/// blocks' (whose seeds are seahash's defaults), so an end key never equals
/// a block hash.
const END_KEY_SEEDS: [u64; 4] = [
    0x7365_6d6c_622d_656e,
    0x642d_6f66_2d70_726f,
    0x6d70_7420_0000_0001,
    0x9e37_79b9_7f4a_7c15,
];

impl BlockHasher {
    /// The key of "a prompt ended here": `prev` is the hash of the last
    /// full block before the end (the root if none) and `rest` the tokens
    /// after it (fewer than a block). A dispatcher records it for the server
    /// it sends a prompt to, so the next turn of the conversation, which
    /// extends this prompt, can tell that the server also holds the answer
    /// it generated after it ([`crate::prefix::continuation`]).
    pub fn end_key(prev: u64, rest: &[u32]) -> u64 {
        let mut buf = [0u8; 8 + 4 * 64];
        let [k1, k2, k3, k4] = END_KEY_SEEDS;
        if rest.len() <= 64 {
            buf[..8].copy_from_slice(&prev.to_le_bytes());
            for (dst, t) in buf[8..].chunks_exact_mut(4).zip(rest) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            seahash::hash_seeded(&buf[..8 + 4 * rest.len()], k1, k2, k3, k4)
        } else {
            let mut bytes = Vec::with_capacity(8 + 4 * rest.len());
            bytes.extend_from_slice(&prev.to_le_bytes());
            rest.iter().for_each(|t| bytes.extend_from_slice(&t.to_le_bytes()));
            seahash::hash_seeded(&bytes, k1, k2, k3, k4)
        }
    }

    /// The end key of a whole prompt: `tokens`, whose chain is `chain`.
    pub fn prompt_end_key(&self, tokens: &[u32], chain: &[u64]) -> u64 {
        let done = (chain.len() * self.block_size).min(tokens.len());
        Self::end_key(chain.last().copied().unwrap_or(self.root), &tokens[done..])
    }
}

/// The salt of a tenant whose prompts' prefixes are kept apart from other
/// tenants' (`isolate_prefixes`, [`crate::tenancy::auth`]): derived from its name
/// and the chain seed (the segment's, or the Redis namespace's, so every
/// host sharing a namespace salts alike), so it is stable and cannot be
/// guessed by a client without the seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantSalt {
    /// What its chains' root is salted with ([`BlockHasher::salted_root`]).
    pub key: u64,
    /// What engines get as vLLM's `cache_salt` (32 hex digits).
    pub engine: String,
}

impl TenantSalt {
    /// The salt of `tenant` under chain seed `seed`.
    pub fn new(tenant: &str, seed: u64) -> Self {
        let wide = xxhash_rust::xxh3::xxh3_128_with_seed(tenant.as_bytes(), seed ^ 0x5341_4c54);
        Self {
            key: (wide as u64) | 1,
            engine: format!("{wide:032x}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hasher() -> BlockHasher {
        BlockHasher::new(BlockHasher::root_for("qwen3-8b", 42), 16)
    }

    #[test]
    fn salted_roots_are_apart_by_tenant_and_seed_and_stable() {
        let root = BlockHasher::root_for("m", 7);
        let a = TenantSalt::new("a", 7);
        assert_eq!(a, TenantSalt::new("a", 7), "stable");
        assert_eq!(a.engine.len(), 32);
        let roots = [
            root,
            BlockHasher::salted_root(root, &a),
            BlockHasher::salted_root(root, &TenantSalt::new("b", 7)),
            BlockHasher::salted_root(root, &TenantSalt::new("a", 8)),
        ];
        let distinct: std::collections::HashSet<u64> = roots.into_iter().collect();
        assert_eq!(distinct.len(), 4);
        assert_ne!(a.engine, TenantSalt::new("b", 7).engine);
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        let h = hasher();
        let mut out = Vec::new();
        h.chain(&(0..15).collect::<Vec<u32>>(), &mut out);
        assert!(out.is_empty());
        h.chain(&(0..47).collect::<Vec<u32>>(), &mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(h.full_blocks(47), 2);
    }

    #[test]
    fn each_hash_covers_its_whole_prefix() {
        let h = hasher();
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[3] = 999; // differs in block 0 only
        let (mut ca, mut cb) = (Vec::new(), Vec::new());
        h.chain(&a, &mut ca);
        h.chain(&b, &mut cb);
        assert!(
            ca.iter().zip(&cb).all(|(x, y)| x != y),
            "a change in block 0 changes every later hash"
        );
        let mut c = a.clone();
        c[40] = 999; // block 2
        let mut cc = Vec::new();
        h.chain(&c, &mut cc);
        assert_eq!(ca[..2], cc[..2]);
        assert_ne!(ca[2], cc[2]);
        assert_ne!(ca[3], cc[3]);
    }

    #[test]
    fn appending_the_tail_and_more_equals_hashing_the_whole() {
        let h = hasher();
        let all: Vec<u32> = (0..100).collect();
        let mut whole = Vec::new();
        h.chain(&all, &mut whole);
        for split in [0, 5, 16, 31, 32, 47, 100] {
            let mut out = Vec::new();
            h.chain(&all[..split], &mut out);
            let tail = h.full_blocks(split) * h.block_size();
            h.append(&all[tail..], &mut out);
            assert_eq!(out, whole, "split at {split}");
        }
        assert_eq!(h.root(), BlockHasher::root_for("qwen3-8b", 42));
    }

    #[test]
    fn extending_equals_hashing_the_whole() {
        let h = hasher();
        let prompt: Vec<u32> = (0..100).map(|i| i * 7).collect();
        let mut whole: Vec<u32> = prompt.clone();
        whole.extend(500..560);
        let mut inc = Vec::new();
        h.chain(&prompt, &mut inc);
        assert_eq!(inc.len(), 6);
        h.extend(&whole, &mut inc);
        let mut all = Vec::new();
        h.chain(&whole, &mut all);
        assert_eq!(inc, all);
        assert_eq!(all.len(), 10);
    }

    #[test]
    fn models_and_segments_do_not_share_chains() {
        let tokens: Vec<u32> = (0..32).collect();
        let mut a = Vec::new();
        let mut b = Vec::new();
        let mut c = Vec::new();
        BlockHasher::new(BlockHasher::root_for("m1", 1), 16).chain(&tokens, &mut a);
        BlockHasher::new(BlockHasher::root_for("m2", 1), 16).chain(&tokens, &mut b);
        BlockHasher::new(BlockHasher::root_for("m1", 2), 16).chain(&tokens, &mut c);
        assert_ne!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn large_blocks_hash_like_small_ones_would() {
        // The >64-token path must be the same function as the buffered one.
        let tokens: Vec<u32> = (0..200).collect();
        let h = BlockHasher::new(7, 100);
        let mut out = Vec::new();
        h.chain(&tokens, &mut out);
        let mut manual = Vec::new();
        let mut prev = 7u64;
        for block in tokens.chunks_exact(100) {
            let mut bytes = prev.to_le_bytes().to_vec();
            block.iter().for_each(|t| bytes.extend_from_slice(&t.to_le_bytes()));
            prev = seahash::hash(&bytes);
            manual.push(prev);
        }
        assert_eq!(out, manual);
    }

    #[test]
    fn end_keys_name_the_exact_prompt_and_never_a_block() {
        let h = hasher();
        let tokens: Vec<u32> = (0..40).collect();
        let mut chain = Vec::new();
        h.chain(&tokens, &mut chain);
        let end = h.prompt_end_key(&tokens, &chain);
        assert_eq!(end, BlockHasher::end_key(chain[1], &tokens[32..]));
        // One token more or less, or another token, is another end.
        let mut chain39 = Vec::new();
        h.chain(&tokens[..39], &mut chain39);
        assert_ne!(end, h.prompt_end_key(&tokens[..39], &chain39));
        let mut other = tokens.clone();
        other[35] = 7;
        assert_ne!(end, h.prompt_end_key(&other, &chain));
        // A block-aligned prompt ends right after its last block hash.
        let mut chain32 = Vec::new();
        h.chain(&tokens[..32], &mut chain32);
        assert_eq!(
            h.prompt_end_key(&tokens[..32], &chain32),
            BlockHasher::end_key(chain[1], &[])
        );
        // With a whole block as `rest` it is still not the block's hash.
        let mut full = vec![chain[0]];
        h.append(&tokens[16..32], &mut full);
        assert_ne!(BlockHasher::end_key(chain[0], &tokens[16..32]), full[1]);
        assert_eq!(h.prompt_end_key(&[], &[]), BlockHasher::end_key(h.root(), &[]));
    }
}
