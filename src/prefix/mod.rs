//! Prompt prefixes as the routing tables know them: token ids hashed into
//! the chain of block hashes the prefix table is keyed by ([`blocks`]),
//! and conversations that continue on the server that answered them
//! ([`continuation`]: prompt end keys, the credit for an answer not yet
//! written back), and the `precise` prefix source ([`precise`]), which
//! matches what the engines confirmed through their KV events (followed by
//! [`crate::kv_events`], which writes the confirmed table this reads).
//!
//! | module | concern |
//! | --- | --- |
//! | [`blocks`] | token ids → the chain of block hashes the shm prefix table is keyed by |
//! | [`continuation`] | conversations that continue on the server that answered them |
//! | [`precise`] | the `precise` prefix source: a lookup's match per server from the confirmed table or the estimate |

pub mod blocks;
pub mod continuation;
pub mod precise;
