//! The engines' own KV cache events (vLLM's publisher, issue 20): what an
//! engine says it holds, applied to the prefix table as confirmed entries.
//!
//! The prefix table is an estimate built from what the gateway sent; an
//! engine that publishes KV events (`--kv-events-config`) says exactly
//! which blocks it stored and evicted. This module reads those events.
//!
//! | module | concept |
//! | --- | --- |
//! | [`wire`] | vLLM's wire format: the PUB message's frames and the msgpack batch, in every layout vLLM's releases have used |
//! | [`engine_blocks`] | one engine's block hashes mapped to the gateway's chain hashes, computed from the token ids its events carry |
//! | [`follower`] | one engine's batches applied in sequence to the confirmed prefix table, and how far the table follows the engine |
//! | [`subscriber`] | the response processes' subscriptions to the engines' ZeroMQ sockets, replays and restarts |
//! | [`zmtp`] | the client half of ZeroMQ's wire protocol (a SUB and a DEALER connection), so a closed engine is seen at once |
//!
//! The format is pinned by test vectors made with msgspec (`testdata/`).
//! Every backend with `kv_events` is followed, whatever its role in
//! disaggregated serving: a prefill engine's events say which prompt
//! blocks it computed, a decode engine's which it pulled and decoded, and
//! the `precise` prefix source ([`crate::prefix::precise`]) routes each
//! leg on them (`tests/pd.rs`).

pub mod engine_blocks;
pub mod follower;
pub mod subscriber;
pub mod wire;
pub mod zmtp;
