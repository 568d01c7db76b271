//! One engine's blocks under the gateway's names: the engine's block
//! hashes mapped to the gateway's chain hashes ([`crate::prefix::blocks`]).
//!
//! The engine names a block by its own hash (Python's `hash` or sha256 of
//! its parent's hash, its tokens and extra keys), which the gateway cannot
//! compute. But every `BlockStored` carries the blocks' token ids and the
//! parent's hash, so the gateway computes its own chain from them:
//!
//! ```text
//! parent None        → our chain starts at the pool's root
//! parent P (known)   → our chain continues from ours(P)
//! ours(block i)      = seahash(ours(block i-1) ‖ tokens of block i)
//! ```
//!
//! and remembers `engine hash → our hash`, so a later `BlockStored`
//! continuing that block, and a `BlockRemoved` naming it, are understood.
//! The chain is the one a prompt of the same tokens gets at dispatch, so
//! the table's entries line up with lookups, provided the block sizes
//! agree (checked for every event: [`Skip::BlockSize`]).
//!
//! A `BlockStored` whose parent was never seen (events lost, or stored
//! before the gateway subscribed) cannot be placed in a chain: it is
//! skipped ([`Skip::UnknownParent`]) until a replay or the engine's next
//! store of that prefix from its start.

use std::collections::HashMap;

use super::wire::{BlockRemoved, BlockStored, EngineHash};
use crate::prefix::blocks::BlockHasher;

/// Why a `BlockStored` was not mapped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Skip {
    /// The engine's blocks are not the gateway's size: its hashes could
    /// never match a lookup (configure `block_size` as the engine's).
    #[error("the engine's blocks hold {engine} tokens, the gateway's {gateway}")]
    BlockSize {
        /// The engine's block size.
        engine: u32,
        /// The gateway's.
        gateway: usize,
    },
    /// Its parent block is not known (events were lost or came before the
    /// subscription).
    #[error("its parent block is not known")]
    UnknownParent,
    /// Its blocks carry extra keys (a `cache_salt`, multimodal inputs): the
    /// engine's hash covers more than the tokens, which a gateway chain of
    /// those tokens would not (a salted tenant's blocks would otherwise
    /// match everyone's prompts of the same text).
    #[error("its blocks carry extra keys (a cache salt or multimodal inputs)")]
    ExtraKeys,
    /// Its token ids are not its blocks' (`block_size` × blocks).
    #[error("{tokens} token ids for {blocks} blocks of {block_size}")]
    Tokens {
        /// Token ids carried.
        tokens: usize,
        /// Blocks named.
        blocks: usize,
        /// Tokens per block.
        block_size: u32,
    },
}

/// The mapping of one engine (see the module docs).
#[derive(Debug, Default)]
pub struct EngineBlocks {
    ours: HashMap<EngineHash, u64>,
}

impl EngineBlocks {
    /// An engine of which nothing is known.
    pub fn new() -> Self {
        Self::default()
    }

    /// Blocks mapped now.
    pub fn len(&self) -> usize {
        self.ours.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.ours.is_empty()
    }

    /// Our hash of the engine's block `hash`, if mapped.
    pub fn ours(&self, hash: &EngineHash) -> Option<u64> {
        self.ours.get(hash).copied()
    }

    /// Maps a `BlockStored`'s blocks, hashed with `hasher` (the pool the
    /// blocks belong to: its root and block size): our hashes, in order.
    pub fn stored(&mut self, event: &BlockStored, hasher: &BlockHasher) -> Result<Vec<u64>, Skip> {
        if event.extra_keys {
            return Err(Skip::ExtraKeys);
        }
        let block_size = hasher.block_size();
        if event.block_size as usize != block_size {
            return Err(Skip::BlockSize {
                engine: event.block_size,
                gateway: block_size,
            });
        }
        if event.token_ids.len() != event.block_hashes.len() * block_size {
            return Err(Skip::Tokens {
                tokens: event.token_ids.len(),
                blocks: event.block_hashes.len(),
                block_size: event.block_size,
            });
        }
        let mut chain = Vec::with_capacity(event.block_hashes.len() + 1);
        if let Some(parent) = &event.parent {
            chain.push(self.ours(parent).ok_or(Skip::UnknownParent)?);
        }
        let start = chain.len();
        hasher.append(&event.token_ids, &mut chain);
        let ours = chain.split_off(start);
        for (engine, our) in event.block_hashes.iter().zip(&ours) {
            self.ours.insert(engine.clone(), *our);
        }
        Ok(ours)
    }

    /// Forgets a `BlockRemoved`'s blocks: our hashes of those that were
    /// mapped.
    pub fn removed(&mut self, event: &BlockRemoved) -> Vec<u64> {
        event.block_hashes.iter().filter_map(|h| self.ours.remove(h)).collect()
    }

    /// `AllBlocksCleared`, an engine restart or a gap: forgets every block.
    pub fn clear(&mut self) {
        self.ours.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[i128], parent: Option<i128>, tokens: &[u32], block_size: u32) -> BlockStored {
        BlockStored {
            block_hashes: hashes.iter().map(|h| EngineHash::Int(*h)).collect(),
            parent: parent.map(EngineHash::Int),
            token_ids: tokens.to_vec(),
            block_size,
            lora_id: None,
            lora_name: None,
            medium: Some("GPU".into()),
            group: None,
            extra_keys: false,
        }
    }

    #[test]
    fn stored_blocks_get_the_chain_a_prompt_of_their_tokens_gets() {
        let hasher = BlockHasher::new(BlockHasher::root_for("llama", 42), 4);
        let prompt: Vec<u32> = (0..14).collect();
        let mut at_dispatch = Vec::new();
        hasher.chain(&prompt, &mut at_dispatch);
        assert_eq!(at_dispatch.len(), 3);

        // The engine stores the first two blocks, then the third as their child.
        let mut engine = EngineBlocks::new();
        let first = engine
            .stored(&stored(&[-7, 8], None, &prompt[..8], 4), &hasher)
            .unwrap();
        assert_eq!(first, at_dispatch[..2]);
        let third = engine
            .stored(&stored(&[9], Some(8), &prompt[8..12], 4), &hasher)
            .unwrap();
        assert_eq!(third, at_dispatch[2..]);
        assert_eq!(engine.ours(&EngineHash::Int(9)), Some(at_dispatch[2]));

        // Removed: forgotten, ours reported; unknown ones ignored.
        let removed = BlockRemoved {
            block_hashes: vec![EngineHash::Int(9), EngineHash::Int(1234)],
            medium: None,
            group: None,
        };
        assert_eq!(engine.removed(&removed), [at_dispatch[2]]);
        assert_eq!(engine.len(), 2);
        // Its child can no longer be placed.
        assert_eq!(
            engine.stored(&stored(&[10], Some(9), &prompt[8..12], 4), &hasher),
            Err(Skip::UnknownParent)
        );
        engine.clear();
        assert!(engine.is_empty());
    }

    #[test]
    fn other_block_sizes_and_wrong_token_counts_are_skipped() {
        let hasher = BlockHasher::new(1, 16);
        let mut engine = EngineBlocks::new();
        let tokens: Vec<u32> = (0..32).collect();
        assert_eq!(
            engine.stored(&stored(&[1, 2], None, &tokens, 8), &hasher),
            Err(Skip::BlockSize { engine: 8, gateway: 16 })
        );
        assert_eq!(
            engine.stored(&stored(&[1, 2], None, &tokens[..31], 16), &hasher),
            Err(Skip::Tokens {
                tokens: 31,
                blocks: 2,
                block_size: 16
            })
        );
        let mut salted = stored(&[1, 2], None, &tokens, 16);
        salted.extra_keys = true;
        assert_eq!(engine.stored(&salted, &hasher), Err(Skip::ExtraKeys));
        assert!(engine.is_empty(), "nothing mapped from a skipped event");
        // Bytes hashes map like integers.
        let mut sha = stored(&[], None, &tokens[..16], 16);
        sha.block_hashes = vec![EngineHash::Bytes(vec![7; 32].into())];
        let ours = engine.stored(&sha, &hasher).unwrap();
        assert_eq!(engine.ours(&EngineHash::Bytes(vec![7; 32].into())), Some(ours[0]));
    }
}
