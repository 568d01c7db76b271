//! The server table: one fixed slot per inference server, and the in-flight
//! ledger that keeps load counters right when a dispatcher dies.
//!
//! ```text
//! ServerSlot (448 B, 64-aligned)
//! ┌ line 0 ─ state (generation:32 | check:24 | state:8) · id · address meta (len | check) · registered_ms
//! │          · horizon (generation:32 | segment second + 1:32)
//! │          · admission limit (generation:32 | f32 bits:32)
//! │          · engine slots (generation:32 | slots:32)
//! │          · engine context (generation:32 | tokens:32)
//! ├ line 1 ─ requests word (128-bit: in flight:32 | pending:32 | toggles:64)
//! │          · scraped load (128-bit)
//! │          · tokens word (128-bit: prompt tokens in flight:32 | pending:32 | toggles:64)
//! │          · KV events (generation:32 | sync:32)
//! │          · started since the scrape (64)
//! ├ lines 2-5 ─ address, up to 256 bytes
//! └ line 6 ─ role (generation:32 | bootstrap port:16 | role:8, [`ServerRole`])
//!            · pool (generation:32 | pool tag:32, [`PoolTag`])
//!            · settings (generation:32 | weight:16 | metrics:8 | cache_salt:1 | set:1, [`EngineSettings`])
//!            · KV ports (generation:32 | events port:16 | replay port:16) · 4 words reserved
//! ```
//!
//! * A slot's address and id change only while it is `Configuring`, and
//!   every (re)registration bumps the 32-bit generation. Readers load the
//!   state word, copy the fields, and re-load the state: equal generation
//!   means a consistent copy. The state word carries a 24-bit keyed check of
//!   generation and state, and the address word a 48-bit keyed check of
//!   generation, id, registration time and address, so a corrupt slot reads
//!   as absent, never as another valid server or state.
//! * [`ServerRef`] (slot + generation) names one registration. Counters are
//!   only touched through a `ServerRef` whose generation is current, and
//!   prefix-table lanes carry the low 6 bits of it ([`ServerTag`]), so a
//!   reused slot inherits neither load nor cache affinity.
//! * In-flight counts are global atomics (one load per routing decision)
//!   shadowed by a per-process ledger row. When a process dies, the
//!   supervisor calls [`ServerTable::reclaim_process`], which subtracts the
//!   dead process's row from the globals, exactly even if the process was
//!   killed between updating the globals and its row: every update flips
//!   the process's toggle bit in the global word it changes, and records
//!   its intent first ([`ledger`] has the protocol).
//! * Of the requests in flight, those without a first token yet are also
//!   counted as **pending** (requests and prompt tokens): sent by the
//!   gateway but still queued or in prefill in the engine. A dispatcher
//!   marks a request started ([`ServerTable::first_token`]) when the first
//!   body frame of its answer arrives. Pending counts live in the same
//!   ledger cells and are reclaimed the same way. Routing policies that
//!   queue at the gateway (selective pushing) and estimate TTFT (two-choice
//!   mapping) read them.
//! * A server's **admission limit** is the number of requests its engine
//!   is estimated to run at once without queueing them, learned by the
//!   response processes from the latencies the gateway sees
//!   ([`ServerTable::adjust_admission_limit`]); the holding policies use
//!   it when the engine's own queue cannot be scraped. It belongs to one
//!   registration, like the horizon.
//! * Its **engine slots**: the requests its engine says it runs at once
//!   (llama.cpp's `total_slots`), which replace the learned admission
//!   limit ([`ServerTable::set_engine_slots`]); per registration too, as
//!   is its **engine context**, the tokens of prompt and output its engine
//!   takes per request ([`ServerTable::set_engine_context`]), and how far
//!   the confirmed prefix table follows its engine's **KV cache events**
//!   ([`ServerTable::set_kv_events`]).

use crate::load_figures::LoadFigures;
use crate::mix::mix64;
use crate::plan::{PROCESS_SLOTS, SERVER_SLOTS};
use crate::sync::{AtomicU64, AtomicU128, Ordering, fence};
use crate::words::{load_bytes, store_bytes, words_for};

mod facts;
mod ledger;
mod pool;
mod role;
mod settings;

pub use facts::{EngineContext, KvEventsSync};
pub use ledger::{MAX_CHARGED_TOKENS, Reclaimed};
pub use pool::{MemberKey, PoolTag};
pub use role::{Disaggregation, ServerRole};
pub use settings::EngineSettings;

/// Longest server address stored (bytes of UTF-8).
pub const MAX_ADDRESS_BYTES: usize = 256;

/// Seconds a server's horizon applies ([`ServerTable::raise_horizon`]):
/// well inside the prefix table's 16-bit stamps' 18 hours, so ages compare
/// correctly; entries older than that were left to age out anyway.
pub const HORIZON_SPAN_S: u64 = 8 * 3600;

/// One registration of one server: its slot and the slot's generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ServerRef {
    /// Slot index in the server table.
    pub slot: u16,
    /// Registration generation of that slot.
    pub generation: u32,
}

impl ServerRef {
    /// The 16-bit form stored in prefix-table lanes.
    pub fn tag(self) -> ServerTag {
        debug_assert!(u32::from(self.slot) < SERVER_SLOTS);
        ServerTag(((self.generation as u16 & 0x3f) << 10) | (self.slot + 1))
    }
}

/// A server as the prefix table stores it: slot and generation modulo 64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ServerTag(u16);

impl ServerTag {
    pub(crate) fn from_lane(lane: u16) -> Option<Self> {
        (lane & 0x3ff != 0).then_some(Self(lane))
    }

    pub(crate) fn lane(self) -> u16 {
        self.0
    }

    /// Server-table slot.
    pub fn slot(self) -> u16 {
        (self.0 & 0x3ff) - 1
    }

    /// Low 6 bits of the registration generation.
    pub fn gen_tag(self) -> u8 {
        (self.0 >> 10) as u8
    }
}

/// Administrative state of a server slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ServerState {
    /// Unused.
    Free = 0,
    /// Being (re)registered; readers ignore it.
    Configuring = 1,
    /// Taking requests.
    Up = 2,
    /// Finishing its requests, taking no new ones.
    Draining = 3,
    /// Failing health checks.
    Down = 4,
}

impl ServerState {
    /// Lower-case name, as `semlb shm inspect` and `semlb status` print it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Free => "free",
            Self::Configuring => "configuring",
            Self::Up => "up",
            Self::Draining => "draining",
            Self::Down => "down",
        }
    }

    fn from_bits(b: u8) -> Option<Self> {
        Some(match b {
            0 => Self::Free,
            1 => Self::Configuring,
            2 => Self::Up,
            3 => Self::Draining,
            4 => Self::Down,
            _ => return None,
        })
    }
}

/// A consistent copy of one server slot.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerInfo {
    /// Which registration this is.
    pub server: ServerRef,
    /// Its state.
    pub state: ServerState,
    /// Operator-facing id (e.g. a hash of its configured name).
    pub id: u64,
    /// Base URL or `host:port`.
    pub address: String,
    /// When registered, segment milliseconds.
    pub registered_ms: u64,
    /// Requests the gateway has in flight to it.
    pub inflight_requests: u64,
    /// Prompt tokens of those requests.
    pub inflight_tokens: u64,
    /// Last scraped load.
    pub load: LoadFigures,
    /// Its horizon, a segment second, if it has one
    /// ([`ServerTable::raise_horizon`]).
    pub horizon_s: Option<u32>,
    /// Its learned admission limit, if one was learned
    /// ([`ServerTable::adjust_admission_limit`]).
    pub admission_limit: Option<f32>,
    /// The requests its engine says it runs at once, if it said
    /// ([`ServerTable::set_engine_slots`]).
    pub engine_slots: Option<u32>,
    /// The tokens its engine takes per request, if it said
    /// ([`ServerTable::set_engine_context`]).
    pub engine_context: Option<EngineContext>,
    /// How far the confirmed prefix table follows its engine's KV cache
    /// events, if it publishes them ([`ServerTable::set_kv_events`]).
    pub kv_events: Option<KvEventsSync>,
    /// Its part in disaggregated serving ([`ServerTable::set_disaggregation`]).
    pub disaggregation: Disaggregation,
}

/// Why a server could not be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// Every slot is taken.
    #[error("the server table is full ({SERVER_SLOTS} servers)")]
    Full,
    /// The address is longer than [`MAX_ADDRESS_BYTES`].
    #[error("server address of {len} bytes is longer than {MAX_ADDRESS_BYTES}")]
    AddressTooLong {
        /// Its length.
        len: usize,
    },
}

#[repr(C, align(64))]
#[derive(Debug)]
pub(crate) struct ServerSlot {
    state: AtomicU64,
    id: AtomicU64,
    address_meta: AtomicU64,
    registered_ms: AtomicU64,
    horizon: AtomicU64,
    admission: AtomicU64,
    engine_slots: AtomicU64,
    engine_context: AtomicU64,
    requests: AtomicU128,
    load: AtomicU128,
    tokens: AtomicU128,
    kv_events: AtomicU64,
    started_since_scrape: AtomicU64,
    address: [AtomicU64; MAX_ADDRESS_BYTES / 8],
    role: AtomicU64,
    pool: AtomicU64,
    settings: AtomicU64,
    kv_ports: AtomicU64,
    _reserved: [AtomicU64; 4],
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<ServerSlot>() as u64 == crate::plan::SERVER_SLOT_BYTES);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(ServerSlot, horizon) == 32);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(ServerSlot, admission) == 40);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(ServerSlot, engine_slots) == 48);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(ServerSlot, engine_context) == 56);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(ServerSlot, requests) == 64);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(ServerSlot, load) == 80);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(ServerSlot, tokens) == 96);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(ServerSlot, kv_events) == 112);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(ServerSlot, started_since_scrape) == 120);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(ServerSlot, address) == 128);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(ServerSlot, role) == 384);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(ServerSlot, settings) == 400);

/// One ledger cell: what one process has in flight to one server, how
/// much of it is still pending (no first token yet), and the op it is
/// applying (see [`ledger`]).
#[repr(C, align(32))]
#[derive(Debug)]
pub(crate) struct LedgerCell {
    counts: AtomicU128,
    intent: AtomicU64,
    _unused: u64,
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<LedgerCell>() as u64 == crate::plan::LEDGER_CELL_BYTES);

#[cfg(test)]
impl ServerSlot {
    pub(crate) fn new() -> Self {
        Self {
            state: AtomicU64::new(0),
            id: AtomicU64::new(0),
            address_meta: AtomicU64::new(0),
            registered_ms: AtomicU64::new(0),
            horizon: AtomicU64::new(0),
            admission: AtomicU64::new(0),
            engine_slots: AtomicU64::new(0),
            engine_context: AtomicU64::new(0),
            requests: AtomicU128::new(0),
            load: AtomicU128::new(0),
            tokens: AtomicU128::new(0),
            kv_events: AtomicU64::new(0),
            started_since_scrape: AtomicU64::new(0),
            address: std::array::from_fn(|_| AtomicU64::new(0)),
            role: AtomicU64::new(0),
            pool: AtomicU64::new(0),
            settings: AtomicU64::new(0),
            kv_ports: AtomicU64::new(0),
            _reserved: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

#[cfg(test)]
impl LedgerCell {
    pub(crate) fn new() -> Self {
        Self {
            counts: AtomicU128::new(0),
            intent: AtomicU64::new(0),
            _unused: 0,
        }
    }
}

/// The server table and its ledger.
#[derive(Debug, Clone, Copy)]
pub struct ServerTable<'a> {
    slots: &'a [ServerSlot],
    ledger: &'a [LedgerCell],
    seed: u64,
}

impl<'a> ServerTable<'a> {
    pub(crate) fn new(slots: &'a [ServerSlot], ledger: &'a [LedgerCell], seed: u64) -> Self {
        assert_eq!(ledger.len(), slots.len() * PROCESS_SLOTS as usize);
        Self { slots, ledger, seed }
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The state word: `generation:32 | check:24 | state:8`, the check keyed
    /// with the segment seed so a flipped bit makes the slot unreadable
    /// (never a different, valid-looking state).
    fn state_word(&self, generation: u32, state: ServerState) -> u64 {
        let gs = (u64::from(generation) << 8) | state as u64;
        let check = mix64(self.seed ^ 0x5354_4154_4500_0000 ^ gs) >> 40;
        (u64::from(generation) << 32) | (check << 8) | state as u64
    }

    /// `(generation, state)` of a state word; the state is `None` if the
    /// word fails its check (a corrupt or never-written slot).
    fn split_state(&self, word: u64) -> (u32, Option<ServerState>) {
        let generation = (word >> 32) as u32;
        let state = ServerState::from_bits(word as u8).filter(|s| self.state_word(generation, *s) == word);
        (generation, state)
    }

    /// Keyed check over everything a registration writes once: generation,
    /// id, registration time and address.
    fn address_check(&self, generation: u32, id: u64, registered_ms: u64, bytes: &[u8]) -> u64 {
        let mut h = mix64(self.seed ^ u64::from(generation) ^ (bytes.len() as u64) << 40);
        h = mix64(h ^ id).wrapping_add(mix64(h ^ registered_ms));
        for c in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            h = mix64(h ^ u64::from_le_bytes(w)).rotate_left(17);
        }
        h >> 16
    }

    fn cell(&self, process: u16, slot: u16) -> &'a LedgerCell {
        &self.ledger[usize::from(process) * self.slots.len() + usize::from(slot)]
    }

    /// Registers a server that prefills and decodes (see
    /// [`register_as`](Self::register_as)).
    pub fn register(&self, id: u64, address: &str, now_ms: u64) -> Result<ServerRef, RegisterError> {
        self.register_as(id, address, now_ms, Disaggregation::default())
    }

    /// Registers a server of role `pd` in the first free slot, with a new
    /// generation. One process (the supervisor) registers servers; a slot
    /// left `Configuring` by a registrant that died is taken by the next
    /// registration.
    pub fn register_as(
        &self,
        id: u64,
        address: &str,
        now_ms: u64,
        pd: Disaggregation,
    ) -> Result<ServerRef, RegisterError> {
        self.register_in(id, address, now_ms, pd, PoolTag::NONE, EngineSettings::default())
    }

    /// Registers a server of role `pd` in the model pool `pool` (servers
    /// found by discovery, which a pool does not list by id: see
    /// [`PoolTag`]), its engine's `settings` known before any request
    /// sees it; otherwise as [`register_as`](Self::register_as).
    pub fn register_in(
        &self,
        id: u64,
        address: &str,
        now_ms: u64,
        pd: Disaggregation,
        pool: PoolTag,
        settings: EngineSettings,
    ) -> Result<ServerRef, RegisterError> {
        let bytes = address.as_bytes();
        if bytes.len() > MAX_ADDRESS_BYTES {
            return Err(RegisterError::AddressTooLong { len: bytes.len() });
        }
        for (i, slot) in self.slots.iter().enumerate() {
            let word = slot.state.load(Ordering::Acquire);
            let (generation, state) = self.split_state(word);
            if !matches!(state, Some(ServerState::Free | ServerState::Configuring) | None) {
                continue;
            }
            let generation = generation.wrapping_add(1);
            let claim = self.state_word(generation, ServerState::Configuring);
            if slot
                .state
                .compare_exchange(word, claim, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            let server = ServerRef {
                slot: i as u16,
                generation,
            };
            self.zero_counters(server.slot);
            slot.load.store(0, Ordering::Relaxed);
            slot.started_since_scrape.store(0, Ordering::Relaxed);
            slot.id.store(id, Ordering::Relaxed);
            slot.registered_ms.store(now_ms, Ordering::Relaxed);
            store_bytes(&slot.address[..words_for(bytes.len())], bytes);
            let meta = bytes.len() as u64 | (self.address_check(generation, id, now_ms, bytes) << 16);
            slot.address_meta.store(meta, Ordering::Relaxed);
            slot.role
                .store((u64::from(generation) << 32) | u64::from(pd.pack()), Ordering::Relaxed);
            slot.pool
                .store((u64::from(generation) << 32) | u64::from(pool.0), Ordering::Relaxed);
            slot.settings.store(
                (u64::from(generation) << 32) | u64::from(settings.pack()),
                Ordering::Relaxed,
            );
            slot.kv_ports.store(
                (u64::from(generation) << 32) | u64::from(settings.pack_ports()),
                Ordering::Relaxed,
            );
            slot.state
                .store(self.state_word(generation, ServerState::Up), Ordering::Release);
            return Ok(server);
        }
        Err(RegisterError::Full)
    }

    fn zero_counters(&self, slot: u16) {
        let s = &self.slots[usize::from(slot)];
        s.requests.store(0, Ordering::Relaxed);
        s.tokens.store(0, Ordering::Relaxed);
        for p in 0..PROCESS_SLOTS as u16 {
            self.cell(p, slot).counts.store(0, Ordering::Relaxed);
        }
    }

    /// Changes the state of a current registration (not to `Free` or
    /// `Configuring`: see [`Self::retire`]). False if `server` is stale.
    pub fn set_state(&self, server: ServerRef, state: ServerState) -> bool {
        if matches!(state, ServerState::Free | ServerState::Configuring) {
            return false;
        }
        let slot = &self.slots[usize::from(server.slot)];
        let word = slot.state.load(Ordering::Acquire);
        match self.split_state(word) {
            (g, Some(ServerState::Up | ServerState::Draining | ServerState::Down)) if g == server.generation => slot
                .state
                .compare_exchange(word, self.state_word(g, state), Ordering::AcqRel, Ordering::Acquire)
                .is_ok(),
            _ => false,
        }
    }

    /// Changes the state of a current registration from `from` to `to`
    /// atomically: false (and nothing changed) if `server` is stale, its
    /// state is not `from`, or `to` is `Free` or `Configuring`. Health
    /// checks use it so that they never overwrite a state someone else set
    /// meanwhile (an operator's `Draining`).
    pub fn transition(&self, server: ServerRef, from: ServerState, to: ServerState) -> bool {
        if matches!(to, ServerState::Free | ServerState::Configuring) {
            return false;
        }
        let slot = &self.slots[usize::from(server.slot)];
        let expected = self.state_word(server.generation, from);
        slot.state
            .compare_exchange(
                expected,
                self.state_word(server.generation, to),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    /// Frees the slot of a current registration. False if `server` is stale.
    pub fn retire(&self, server: ServerRef) -> bool {
        let slot = &self.slots[usize::from(server.slot)];
        let word = slot.state.load(Ordering::Acquire);
        match self.split_state(word) {
            (g, Some(s)) if g == server.generation && s != ServerState::Free => slot
                .state
                .compare_exchange(
                    word,
                    self.state_word(g, ServerState::Free),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok(),
            _ => false,
        }
    }

    /// The current registration of `slot`, if it is registered.
    pub fn current(&self, slot: u16) -> Option<(ServerRef, ServerState)> {
        let word = self.slots.get(usize::from(slot))?.state.load(Ordering::Acquire);
        // A slot never registered holds 0, which never passes the check:
        // skip computing it (most of the table, on every routing decision).
        if word == 0 {
            return None;
        }
        let (generation, state) = self.split_state(word);
        match state? {
            ServerState::Free | ServerState::Configuring => None,
            s => Some((ServerRef { slot, generation }, s)),
        }
    }

    /// The operator-facing id of `slot`'s current registration (any state
    /// but free or being configured).
    pub fn id_of(&self, slot: u16) -> Option<u64> {
        let (server, _) = self.current(slot)?;
        let id = self.slots[usize::from(slot)].id.load(Ordering::Acquire);
        // The registration must still be the one the id was read for.
        self.is_current(server).then_some(id)
    }

    /// Whether the tagged server is registered, `Up`, and of that generation:
    /// the filter for [`crate::PrefixTable::longest_prefix_match`].
    #[inline]
    pub fn is_live(&self, tag: ServerTag) -> bool {
        self.live(tag).is_some()
    }

    /// The registration the tag names, if it is `Up`.
    #[inline]
    fn live(&self, tag: ServerTag) -> Option<ServerRef> {
        self.current(tag.slot())
            .filter(|(s, st)| *st == ServerState::Up && (s.generation & 0x3f) as u8 == tag.gen_tag())
            .map(|(s, _)| s)
    }

    /// A consistent copy of `slot`, or `None` if free, being configured, or
    /// failing its address check.
    pub fn get(&self, slot: u16) -> Option<ServerInfo> {
        let s = self.slots.get(usize::from(slot))?;
        for _ in 0..4 {
            let before = s.state.load(Ordering::Acquire);
            let (generation, state) = self.split_state(before);
            let state = state?;
            if matches!(state, ServerState::Free | ServerState::Configuring) {
                return None;
            }
            let meta = s.address_meta.load(Ordering::Relaxed);
            let len = (meta & 0xffff) as usize;
            if len > MAX_ADDRESS_BYTES {
                return None;
            }
            let mut bytes = Vec::with_capacity(len);
            load_bytes(&s.address, len, &mut bytes);
            let id = s.id.load(Ordering::Relaxed);
            let registered_ms = s.registered_ms.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            let after = s.state.load(Ordering::Relaxed);
            if self.split_state(after).0 != generation {
                continue;
            }
            if meta >> 16 != self.address_check(generation, id, registered_ms, &bytes) {
                return None;
            }
            let address = String::from_utf8(bytes).ok()?;
            let server = ServerRef { slot, generation };
            let (inflight_requests, inflight_tokens) = self.inflight(server);
            return Some(ServerInfo {
                server,
                state: self.split_state(after).1.unwrap_or(state),
                id,
                address,
                registered_ms,
                inflight_requests,
                inflight_tokens,
                load: self.load(server),
                horizon_s: self.horizon(server),
                admission_limit: self.admission_limit(server),
                engine_slots: self.engine_slots(server),
                engine_context: self.engine_context(server),
                kv_events: self.kv_events(server),
                disaggregation: self.disaggregation(server),
            });
        }
        None
    }

    /// Every registered server.
    pub fn servers(&self) -> impl Iterator<Item = ServerInfo> + '_ {
        (0..self.slots.len() as u16).filter_map(|i| self.get(i))
    }

    fn is_current(&self, server: ServerRef) -> bool {
        self.current(server.slot)
            .is_some_and(|(s, _)| s.generation == server.generation)
    }

    /// Stores freshly scraped figures and restarts the count of requests
    /// that stopped being pending since ([`Self::started_since_scrape`]).
    /// False if `server` is stale.
    ///
    /// The two stores are not one atomic step: a request that starts
    /// between them is not counted, and a reader between them sees the new
    /// figures with the old count. Either errs by the few requests of a
    /// microsecond in how fast the engine's queue is taken to drain.
    pub fn store_load(&self, server: ServerRef, figures: LoadFigures) -> bool {
        if !self.is_current(server) {
            return false;
        }
        let slot = &self.slots[usize::from(server.slot)];
        slot.load.store(figures.pack(), Ordering::Release);
        slot.started_since_scrape.store(0, Ordering::Release);
        true
    }

    /// Requests to `server` that stopped being pending (first token, or
    /// ended without one) since its figures were last stored
    /// ([`Self::store_load`]); since its registration if never. What the
    /// gateway has seen of the engine's queue at the scrape draining.
    pub fn started_since_scrape(&self, server: ServerRef) -> u64 {
        self.slots[usize::from(server.slot)]
            .started_since_scrape
            .load(Ordering::Acquire)
    }

    /// The last scraped figures of `server`'s slot.
    pub fn load(&self, server: ServerRef) -> LoadFigures {
        LoadFigures::unpack(self.slots[usize::from(server.slot)].load.load(Ordering::Acquire))
    }
}

#[cfg(all(test, not(loom)))]
pub(super) mod tests {
    use super::*;

    pub(super) fn parts() -> (Vec<ServerSlot>, Vec<LedgerCell>) {
        let n = SERVER_SLOTS as usize;
        (
            (0..n).map(|_| ServerSlot::new()).collect(),
            (0..n * PROCESS_SLOTS as usize).map(|_| LedgerCell::new()).collect(),
        )
    }

    #[test]
    fn tags_round_trip() {
        for slot in [0u16, 1, 127] {
            for generation in [0u32, 1, 63, 64, 1000] {
                let t = ServerRef { slot, generation }.tag();
                assert_eq!(t.slot(), slot);
                assert_eq!(t.gen_tag(), (generation % 64) as u8);
                assert_eq!(ServerTag::from_lane(t.lane()), Some(t));
            }
        }
        assert_eq!(ServerTag::from_lane(0), None);
    }

    #[test]
    fn register_get_retire_reuse_bumps_generation() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let a = t.register(11, "http://10.0.0.1:8000", 5).unwrap();
        let b = t.register(12, "http://10.0.0.2:8000", 6).unwrap();
        assert_ne!(a.slot, b.slot);
        let info = t.get(a.slot).unwrap();
        assert_eq!(
            (info.id, info.address.as_str(), info.state),
            (11, "http://10.0.0.1:8000", ServerState::Up)
        );
        assert!(t.is_live(a.tag()));
        assert!(t.set_state(a, ServerState::Down));
        assert!(!t.is_live(a.tag()));
        assert!(t.retire(a));
        assert!(t.get(a.slot).is_none());
        let a2 = t.register(13, "http://10.0.0.3:8000", 7).unwrap();
        assert_eq!(a2.slot, a.slot);
        assert_eq!(a2.generation, a.generation + 1);
        assert!(!t.is_live(a.tag()), "old generation is not live");
        assert!(!t.set_state(a, ServerState::Up), "stale ref refused");
        assert_eq!(t.servers().count(), 2);
    }

    #[test]
    fn transitions_only_from_the_expected_state() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let a = t.register(1, "a", 0).unwrap();
        assert!(t.transition(a, ServerState::Up, ServerState::Down));
        assert!(!t.transition(a, ServerState::Up, ServerState::Down), "no longer Up");
        assert!(t.set_state(a, ServerState::Draining));
        assert!(!t.transition(a, ServerState::Down, ServerState::Up), "Draining is kept");
        assert_eq!(t.current(a.slot), Some((a, ServerState::Draining)));
        assert!(!t.transition(a, ServerState::Draining, ServerState::Free));
        assert!(!t.transition(a, ServerState::Draining, ServerState::Configuring));
        assert!(t.transition(a, ServerState::Draining, ServerState::Up));
        t.retire(a);
        let b = t.register(2, "b", 0).unwrap();
        assert!(
            !t.transition(a, ServerState::Up, ServerState::Down),
            "stale ref refused"
        );
        assert_eq!(t.current(b.slot), Some((b, ServerState::Up)));
    }

    #[test]
    fn long_addresses_and_full_tables_are_refused() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let long = "x".repeat(MAX_ADDRESS_BYTES + 1);
        assert_eq!(
            t.register(0, &long, 0),
            Err(RegisterError::AddressTooLong {
                len: MAX_ADDRESS_BYTES + 1
            })
        );
        for i in 0..SERVER_SLOTS {
            t.register(u64::from(i), &"y".repeat(MAX_ADDRESS_BYTES), 0).unwrap();
        }
        assert_eq!(t.register(0, "z", 0), Err(RegisterError::Full));
        assert_eq!(t.get(5).unwrap().address.len(), MAX_ADDRESS_BYTES);
    }
}
