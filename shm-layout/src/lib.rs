//! # shm-layout
//!
//! The shared-memory format of semlb and the lock-free, crash-safe tables
//! that live in it: the "token sequence info cache" every dispatcher reads
//! and every response process writes, with no IPC and no locks.
//!
//! # Usage
//!
//! ```
//! use shm_layout::{LayoutPlan, Segment, ServerState};
//!
//! let plan = LayoutPlan::for_size(16 << 20).unwrap();
//! // `Segment::create("semlb-demo", &plan)` in the supervisor and
//! // `Segment::open("semlb-demo")` in its children; a heap segment has the
//! // same format and tables.
//! let seg = Segment::heap(&plan);
//! let t = seg.tables();
//! let server = t.servers.register(1, "http://127.0.0.1:8000", seg.clock().now_ms()).unwrap();
//! let chain = [0xa1, 0xb2, 0xc3]; // chained block hashes of a prompt
//! t.prefix.insert_chain(&chain, server, seg.clock().stamp());
//! let m = t.prefix.longest_prefix_match(&chain, |s| t.servers.is_live(s));
//! assert_eq!(m.best(), Some((server.tag(), 3)));
//! assert_eq!(t.servers.current(server.slot), Some((server, ServerState::Up)));
//! ```
//!
//! # Layout
//!
//! ```text
//!  offset 0                                                     segment_bytes
//!  ┌────────┬─────────┬────────┬──────────┬──────────┬─────────┬─────────┬────────────┬──────────┬──────────────┬─────────┬─────────────┬──────────────┬──────────────┐
//!  │ header │ servers │ ledger │ registry │  stats   │ limits  │  usage  │ rings × 64 │ response │ response log │ segment │ segment log │  confirmed   │ prefix table │
//!  │ 4 KiB  │ 128×448B│ 512 KiB│ 128×64 B │128×12 KiB│ 256 KiB │ 128 KiB │ ctl + ring │  index   │ ctl + ring   │  index  │ ctl + ring  │ 64 B buckets │ 64 B buckets │
//!  └────────┴─────────┴────────┴──────────┴──────────┴─────────┴─────────┴────────────┴──────────┴──────────────┴─────────┴─────────────┴──────────────┴──────────────┘
//!   every region starts on a 4 KiB boundary; sizes derive from the segment
//!   size (see [`plan`]) and are recorded in the header's region table
//! ```
//!
//! ## Header (512 bytes at offset 0; frozen by compile-time asserts)
//!
//! | offset | field | meaning |
//! | ---: | --- | --- |
//! | 0 | `magic` | `b"SEMLBSHM"` as a little-endian u64 |
//! | 8 | `layout_version` | [`LAYOUT_VERSION`]; bumped on any layout change |
//! | 16 | `segment_bytes` | total size; must equal the shm object's size |
//! | 24 | `state` | 0 while initialising, [`STATE_READY`] once usable; **written last** |
//! | 32 | `created_unix_ms` | wall-clock creation time |
//! | 40 | `created_monotonic_ns` | `CLOCK_MONOTONIC` at creation: origin of all stamps |
//! | 48 | `creator_pid` | pid of the creating supervisor |
//! | 56 | `header_checksum` | seahash of every field but `state` and itself |
//! | 64 | `seed[4]` | random per segment; keys slot fingerprints and record checksums |
//! | 96 | `regions[13]` | per region, in [`RegionKind`] order: `offset`, `bytes`, `count`, `param` (4 × u64) |
//!
//! ## Regions
//!
//! | region | element | `count` | `param` | module |
//! | --- | --- | --- | --- | --- |
//! | servers | 448 B server slot | 128 | – | [`server_table`] |
//! | ledger | 32 B cell (counts and toggle bits in 128 bits, then the intent of the op under way) per process × server | 128 × 128 | 128 | [`server_table`] |
//! | registry | 64 B process slot | 128 | – | [`registry`] |
//! | stats | 12 KiB block of [`STAT_WORDS`] `u64` counters per process slot | 128 | 1536 (words per block) | [`stats`] |
//! | limits | 64 B bucket of 4 × 128-bit slots (a GCRA token bucket each: its `tat` bound to its key) | 4 096 | – | [`limit_table`] |
//! | usage | 128 B entry: keyed hash of (kind, name), kind and length, name, 7 counters | 1 024 | – | [`usage_table`] |
//! | rings | 256 B control + `param` bytes | 64 | ring bytes | [`completion_ring`] |
//! | response index | 64 B bucket of 4 × 128-bit slots | buckets | – | [`response_log`] |
//! | response log | 256 B control + `count` bytes | log bytes | max value bytes | [`response_log`] |
//! | segment index | 64 B bucket of 4 × 128-bit slots | buckets | – | [`response_log`] (a second keyed log: token segments) |
//! | segment log | 256 B control + `count` bytes | log bytes | max value bytes | [`response_log`] |
//! | confirmed prefixes | 64 B bucket of 4 × 128-bit slots | buckets | – | [`prefix_table`] (a second table: the blocks engines said they hold, from their KV cache events) |
//! | prefix table | 64 B bucket of 4 × 128-bit slots | buckets | – | [`prefix_table`] |
//!
//! # Why it survives `kill -9` at any instruction
//!
//! No table has a lock. Fixed-size entries (prefix and index slots, load
//! figures) are single 128-bit words replaced by one compare-and-swap, and
//! each carries a keyed fingerprint binding key to value, so a torn or
//! bit-flipped slot reads as a miss. Variable-size records (responses,
//! completions) go to append-only rings with an ever-growing position: a
//! record is trusted only if its commit word, key, length, keyed checksum
//! and position (not lapped) all check out after it was copied out. A dead
//! writer leaves dead space, not a broken table. Counters a dead process
//! leaves behind (in-flight requests) are reclaimed from its ledger row.
//! Metrics counters live in the stats region, one block per process
//! slot that only that process adds to; they are summed when exported and
//! never reset, so they stay monotonic across a process's restarts. The
//! tests prove this with a multi-process SIGKILL torture test, a
//! bit-flip sweep and property tests against a model.
//!
//! # Modules
//!
//! [`plan`] sizes the regions, [`header`] freezes the header, [`segment`]
//! creates and opens segments and hands out [`Tables`], [`ownership`]
//! decides who may use one (the supervisor's owner lock, its children's
//! member locks) and lets a starting supervisor adopt the segment an
//! earlier one left ([`Segment::claim`]); the tables are
//! [`prefix_table`], [`response_log`], [`server_table`] (with its
//! [`load_figures`]), [`limit_table`], [`completion_ring`]
//! (carrying [`completion`] records), [`registry`] and [`stats`]. `bucket`, `mix`,
//! `words` and `sync` are the private building blocks.

#![deny(unsafe_op_in_unsafe_fn)]
// Under loom only the table code is compiled (no segment), so some
// constructors have no caller there.
#![cfg_attr(loom, allow(dead_code))]

mod bucket;
pub mod completion;
pub mod completion_ring;
pub mod error;
pub mod header;
pub mod limit_table;
pub mod load_figures;
#[cfg(all(test, loom))]
mod loom_models;
mod mix;
#[cfg(not(loom))]
pub mod ownership;
pub mod plan;
pub mod prefix_table;
pub mod registry;
pub mod response_log;
#[cfg(not(loom))]
pub mod segment;
pub mod server_table;
pub mod stats;
mod sync;
pub mod usage_table;
mod words;

pub use completion::{Completion, CompletionRecord, Continuation, ContinuationRef, DecodeError, Prediction, Timing};
pub use completion_ring::{CompletionRing, Pop, PushError, RingStats};
pub use error::{ClaimError, CreateError, NameError, OpenError, PlanError, RemoveError};
pub use header::{HeaderInfo, LAYOUT_VERSION, MAGIC, STATE_READY};
pub use limit_table::{BucketState, LimitTable, Quota, Taken};
pub use load_figures::LoadFigures;
#[cfg(not(loom))]
pub use ownership::{Claim, Claimed, Membership, Ownership};
pub use plan::{LIMIT_SLOTS, LayoutPlan, PlanOptions, Region, RegionKind, SERVER_SLOTS, STAT_WORDS, USAGE_SLOTS};
pub use prefix_table::{InsertOutcome, MATCH_CAPACITY, PrefixEntry, PrefixMatch, PrefixTable, ServerSet, Stamp};
pub use registry::{ProcessInfo, ProcessState, Registry, Role, SUPERVISOR_SLOT};
pub use response_log::{PutError, ResponseKey, ResponseLog, ResponseLogStats};
#[cfg(not(loom))]
pub use segment::{Segment, SegmentClock, Tables, shm_path};
pub use server_table::{
    Disaggregation, EngineContext, EngineSettings, HORIZON_SPAN_S, KvEventsSync, MAX_CHARGED_TOKENS, MemberKey,
    PoolTag, Reclaimed, RegisterError, ServerInfo, ServerRef, ServerRole, ServerState, ServerTable, ServerTag,
};
pub use stats::Stats;
pub use usage_table::{USAGE_COUNTERS, UsageCounter, UsageKind, UsageRow, UsageTable};
