//! Multi-process `kill -9` torture test of the shared-memory tables.
//!
//! # What it proves
//!
//! `shm-layout` promises that a process killed with SIGKILL at *any*
//! instruction leaves every table usable by the others: no lock can be held
//! by a dead process, no torn entry is ever returned as valid, and the
//! in-flight counters a dead process leaves behind are reclaimed. This test
//! runs real processes against one real POSIX shm segment and kills them at
//! random instants, hundreds of times, while the survivors check every value
//! they read against invariants that a torn, mixed-up or lost-update entry
//! would break.
//!
//! # How
//!
//! * The parent test ([`shm_torture`]) creates a segment with a unique name
//!   (removed by a drop guard), registers six servers (some re-registered so
//!   that generations differ), claims a registry slot per child and starts
//!   the children: five killable workers (prefix-heavy, response-heavy,
//!   ring-heavy, begin/end-heavy, mixed), one killable consumer of the
//!   completion rings (which writes completions back like a responder), and
//!   one "survivor" worker that is never killed (so a hang in any reader is
//!   seen by the heartbeat watchdog rather than masked by a kill). Each
//!   producer pushes into the ring of its own registry slot, whose owner it
//!   sets.
//! * Children are re-executions of this test binary (not `fork`: the test
//!   harness is multi-threaded) running [`torture_child`] with the role, shm
//!   name, registry slot, incarnation and seed in `SEMLB_TORTURE_CHILD`.
//!   Without that variable [`torture_child`] returns at once, so in a normal
//!   run it is an empty entry-point shim that passes trivially.
//! * Every value is self-describing, so any reader can check it:
//!   - prefix key `k` may only ever hold servers from an allowed set `A(k)`
//!     (two per chain of keys, one per key), with the current generation tag,
//!     no server twice, at most three; a longest-prefix match may report a
//!     server for `n` blocks only if it is allowed for block `n`
//!     (its deepest recorded block); `entries()` may only contain keys of
//!     the test's key space. Part of the key space is packed into a few
//!     buckets, so buckets fill and evict all the time;
//!   - a cached response embeds its key id, version and length, and its body
//!     is re-derived from (key, version) and compared byte for byte; some
//!     keys share the low half of their 128-bit key; one value in eight is
//!     64–256 KiB, so the log wraps about as often as a key is rewritten and
//!     readers keep copying records that are being overwritten;
//!   - a completion record is re-derived from (ring, incarnation, sequence)
//!     and compared byte for byte, and each consumer must see every ring's
//!     records in strictly increasing (incarnation, sequence) order;
//!   - scraped load figures are derived from their timestamp (one 128-bit
//!     atomic: a torn read would not match); server addresses are exact.
//! * The parent SIGKILLs a random killable child every 2–20 ms, reaps it,
//!   marks it exited, reclaims its in-flight counts and restarts it with a
//!   new incarnation. Meanwhile a parent thread consumes the rings, skipping
//!   a pending record only when the ring's owner is dead per the registry
//!   (the documented protocol) and failing if a ring stays pending for 2 s,
//!   and a parent checker thread samples every table, scans the whole prefix
//!   table every 1.5 s, checks that no server has more requests (or
//!   tokens) pending than in flight, and drains and re-admits servers. The main thread also checks heartbeats (2 s: a hang detector,
//!   not a timing assertion).
//! * At the deadline the children stop by themselves (the deadline travels in
//!   the environment, not through the segment). The parent then reclaims
//!   every process and checks: every server's in-flight and pending counts
//!   are exactly zero (a kill between a global counter's update and its
//!   ledger cell's must lose nothing: the summary prints how many kills
//!   landed there), every ledger row is zero, every ring drains to empty
//!   with `corrupt == 0`, and every table still verifies.
//! * Any child exit that is neither our SIGKILL nor a normal exit after the
//!   deadline fails the test, with the child's stderr.
//!
//! Kills land at random instants, so a window of a few instructions (between
//! a global counter and its ledger cell, say) is hit a few times per run,
//! not every run: the begin/end-heavy worker is there to make such hits
//! likely. `SEMLB_TORTURE_SECS` sets the duration of the kill phase (default
//! 6 s; the whole test takes under 1 s more); `SEMLB_TORTURE_SEED` fixes the
//! seed of every choice (printed by every run; kill timing stays random). Run
//! with `--nocapture` to see the summary.
//!
//! The two tests at the end are minimal reproductions of completion-ring
//! defects found while writing this test (both fixed); they stay as
//! regression tests.

use semlb_test_support as support;
use support::{Rng, mix};

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::ptr::NonNull;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap, shm_open, shm_unlink};
use nix::sys::signal::{Signal, kill};
use nix::sys::stat::Mode;
use nix::unistd::Pid;
use shm_layout::{
    Completion, CompletionRecord, CompletionRing, InsertOutcome, LayoutPlan, LoadFigures, Pop, PrefixMatch,
    ProcessState, PushError, RegionKind, ResponseKey, Role, Segment, ServerRef, ServerSet, ServerState, Stamp, Tables,
};

const CHILD_ENV: &str = "SEMLB_TORTURE_CHILD";
const CHILD_TEST: &str = "torture_child";
const SEGMENT_BYTES: u64 = 32 << 20;
/// A running child whose heartbeat is older than this is hung.
const HANG_MS: u64 = 2_000;
/// A child that has not attached this long after its claim is hung.
const START_HANG_MS: u64 = 10_000;
/// A ring that stays `Pending` this long for the parent's consumer is wedged.
const WEDGE: Duration = Duration::from_secs(2);
/// Children heartbeat (and publish their counters) between operations once
/// this many milliseconds have passed: the watchdog then measures how long a
/// single operation takes.
const BEAT_MS: u64 = 20;

// ---------------------------------------------------------------------------
// Deterministic randomness

fn fill_bytes(seed: u64, out: &mut Vec<u8>, len: usize) {
    let mut r = Rng(seed);
    while out.len() < len {
        let w = r.next().to_le_bytes();
        let n = (len - out.len()).min(8);
        out.extend_from_slice(&w[..n]);
    }
}

// ---------------------------------------------------------------------------
// The world: servers, keys, values and records every process derives alike

const SERVERS: u16 = 6;
/// Extra registrations per server slot before the run: generations 1,1,3,1,70,1
/// (70 also wraps the 6-bit generation tag of prefix lanes).
const EXTRA_REGISTRATIONS: [u32; SERVERS as usize] = [0, 0, 2, 0, 69, 0];
const ADDRESS_LEN: [usize; SERVERS as usize] = [31, 57, 64, 100, 199, 256];
const CHAIN_LEN: usize = 8;
/// Chains whose keys are packed into [`HOT_BUCKETS`] buckets (4× oversubscribed).
const HOT_CHAINS: usize = 96;
const COLD_CHAINS: usize = 160;
const CHAINS: usize = HOT_CHAINS + COLD_CHAINS;
const KEYS: usize = CHAINS * CHAIN_LEN;
const HOT_BUCKETS: u64 = 48;
const RESPONSE_KEYS: u32 = 384;
/// Response keys below this come in pairs sharing the low (index) half.
const PAIRED_RESPONSE_KEYS: u32 = 64;
const MAX_TOKENS: u64 = 8192;
/// Value header: key id u32 · version u32 · total length u32.
const VALUE_HEADER: usize = 12;

fn expected_generation(slot: u16) -> u32 {
    1 + EXTRA_REGISTRATIONS[usize::from(slot)]
}

fn address(slot: u16, generation: u32) -> String {
    let mut a = format!(
        "http://10.0.{slot}.{}:{}/v1/{generation}/",
        generation % 250,
        8000 + slot
    );
    let want = ADDRESS_LEN[usize::from(slot)];
    assert!(a.len() <= want);
    let mut c = b'a' + slot as u8;
    while a.len() < want {
        a.push(c as char);
        c = if c == b'z' { b'a' } else { c + 1 };
    }
    a
}

/// The servers of chain `c`: two distinct slots.
fn chain_servers(c: usize) -> [u16; 2] {
    let a = (c % SERVERS as usize) as u16;
    let b = (a + 1 + ((c / SERVERS as usize) % (SERVERS as usize - 1)) as u16) % SERVERS;
    [a, b]
}

/// `A(k)`: the only servers key id `k` may ever be recorded for.
fn allowed(k: usize) -> [u16; 3] {
    let [a, b] = chain_servers(k / CHAIN_LEN);
    [a, b, (mix(k as u64 ^ 0x5151) % u64::from(SERVERS)) as u16]
}

fn response_key(rid: u32) -> ResponseKey {
    let lo_id = if rid < PAIRED_RESPONSE_KEYS { rid / 2 } else { rid };
    let lo = mix(u64::from(lo_id) ^ 0xaaaa_0000);
    let hi = mix(u64::from(rid) ^ 0xbbbb_0000_0000);
    ResponseKey((u128::from(hi) << 64) | u128::from(lo))
}

/// Length of value `(rid, version)`: mostly small, 1 in 8 between 64 and
/// 256 KiB. The large ones make the 15 MiB log wrap every few hundred puts,
/// about as often as a key is rewritten, so readers often copy records that
/// a writer is overwriting at that moment (the lapped-read path).
fn value_len(rid: u32, version: u32) -> usize {
    let h = mix((u64::from(rid) << 32) | u64::from(version));
    if h.is_multiple_of(8) {
        (64 << 10) + (h >> 8) as usize % (192 << 10)
    } else {
        VALUE_HEADER + (h >> 8) as usize % 3000
    }
}

fn value(rid: u32, version: u32, out: &mut Vec<u8>) {
    let len = value_len(rid, version);
    out.clear();
    out.extend_from_slice(&rid.to_le_bytes());
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(len as u32).to_le_bytes());
    fill_bytes(mix((u64::from(rid) << 32) ^ u64::from(version) ^ 0x7777), out, len);
}

/// Checks that `bytes` is exactly some version of the value of `rid`.
fn verify_value(rid: u32, bytes: &[u8], scratch: &mut Vec<u8>) -> Result<(), String> {
    if bytes.len() < VALUE_HEADER {
        return Err(format!(
            "response {rid}: {} bytes, shorter than a value header",
            bytes.len()
        ));
    }
    let word = |i: usize| u32::from_le_bytes(bytes[i * 4..i * 4 + 4].try_into().unwrap());
    let (id, version, len) = (word(0), word(1), word(2) as usize);
    if id != rid {
        return Err(format!("response {rid}: got the value of key {id} (version {version})"));
    }
    if len != bytes.len() || len != value_len(rid, version) {
        return Err(format!(
            "response {rid} version {version}: {} bytes, header says {len}, expected {}",
            bytes.len(),
            value_len(rid, version)
        ));
    }
    value(rid, version, scratch);
    if scratch.as_slice() != bytes {
        let at = scratch.iter().zip(bytes).position(|(a, b)| a != b).unwrap_or(0);
        return Err(format!("response {rid} version {version}: body differs at byte {at}"));
    }
    Ok(())
}

/// A version of `rid` small enough to travel in a completion record.
fn small_version(rid: u32, mut version: u32) -> u32 {
    while value_len(rid, version) > 4000 {
        version = version.wrapping_add(1);
    }
    version
}

/// Load figures derived from their timestamp.
fn figures(at: u64) -> LoadFigures {
    // The table keeps 40 bits of the timestamp: derive from what it keeps.
    let at = at & ((1 << 40) - 1);
    let h = mix(at ^ 0xf1f1);
    LoadFigures {
        waiting: (h & 0xff_ffff) as u32,
        running: ((h >> 24) & 0xff_ffff) as u32,
        kv_usage_permyriad: ((h >> 48) % 10_001) as u16,
        scraped_at_ms: at,
        pending_at_scrape: (h.rotate_left(7) & 0xff_ffff) as u32,
    }
}

struct World {
    keys: Vec<u64>,
    ids: HashMap<u64, usize>,
    servers: [ServerRef; SERVERS as usize],
}

impl World {
    /// Derives the key space for this segment and checks the servers are
    /// registered as the parent left them.
    fn new(t: &Tables<'_>) -> Result<Self, String> {
        let buckets = t.prefix.capacity() / 4;
        let span = u64::MAX / buckets;
        let mut keys = Vec::with_capacity(KEYS);
        for id in 0..KEYS {
            let h = mix(id as u64 ^ 0x1234_5678);
            let key = if id < HOT_CHAINS * CHAIN_LEN {
                // Multiply-shift bucket index: keys in [start(b), start(b) + span)
                // land in bucket b. (If the table hashed differently they would
                // merely spread out; the summary reports evictions.)
                let b = (id as u64 % HOT_BUCKETS) * (buckets / HOT_BUCKETS);
                let start = ((u128::from(b) << 64).div_ceil(u128::from(buckets))) as u64;
                start + 1 + h % (span - 2)
            } else {
                h
            };
            keys.push(key);
        }
        let ids: HashMap<u64, usize> = keys.iter().enumerate().map(|(i, k)| (*k, i)).collect();
        if ids.len() != KEYS {
            return Err("duplicate prefix keys in the key space".into());
        }
        let mut servers = [ServerRef { slot: 0, generation: 0 }; SERVERS as usize];
        for slot in 0..SERVERS {
            let (server, state) = t
                .servers
                .current(slot)
                .ok_or(format!("server slot {slot} not registered"))?;
            if server.generation != expected_generation(slot)
                || !matches!(state, ServerState::Up | ServerState::Draining)
            {
                return Err(format!("server slot {slot}: {server:?} in state {state:?}"));
            }
            servers[usize::from(slot)] = server;
        }
        Ok(Self { keys, ids, servers })
    }

    fn chain(&self, c: usize) -> &[u64] {
        &self.keys[c * CHAIN_LEN..(c + 1) * CHAIN_LEN]
    }

    /// Checks one prefix entry's servers against `A(id)`.
    fn check_servers(&self, id: usize, set: &ServerSet, what: &str) -> Result<(), String> {
        let ok = allowed(id);
        let n = set.iter().count();
        if n == 0 || n != set.len() || n > 3 {
            return Err(format!("{what}: key {id}: malformed server set {set:?}"));
        }
        let mut seen = [false; SERVERS as usize];
        for tag in set.iter() {
            let slot = tag.slot();
            if !ok.contains(&slot) {
                return Err(format!(
                    "{what}: key {id} holds server {slot}, allowed only {ok:?} ({set:?})"
                ));
            }
            let generation = self.servers[usize::from(slot)].generation;
            if u32::from(tag.gen_tag()) != generation & 0x3f {
                return Err(format!(
                    "{what}: key {id}: server {slot} with generation tag {}",
                    tag.gen_tag()
                ));
            }
            if std::mem::replace(&mut seen[usize::from(slot)], true) {
                return Err(format!("{what}: key {id}: server {slot} twice in {set:?}"));
            }
        }
        Ok(())
    }

    fn check_lookup(&self, t: &Tables<'_>, id: usize) -> Result<bool, String> {
        match t.prefix.lookup(self.keys[id]) {
            Some(e) => self.check_servers(id, &e.servers, "lookup").map(|()| true),
            None => Ok(false),
        }
    }

    /// A server's match is the deepest block it is recorded for (block `i`'s
    /// hash covers blocks `0..=i`), so it must be allowed for that block.
    fn check_match(&self, c: usize, len: usize, m: &PrefixMatch) -> Result<(), String> {
        for (tag, n) in m.iter() {
            if n == 0 || n as usize > len {
                let slot = tag.slot();
                return Err(format!(
                    "match on chain {c} (len {len}): server {slot} holds {n} blocks"
                ));
            }
            let id = c * CHAIN_LEN + n as usize - 1;
            if !allowed(id).contains(&tag.slot()) {
                let (slot, ok) = (tag.slot(), allowed(id));
                return Err(format!(
                    "match on chain {c}: server {slot} matched to key {id}, allowed {ok:?}"
                ));
            }
            let generation = self.servers[usize::from(tag.slot())].generation;
            if u32::from(tag.gen_tag()) != generation & 0x3f {
                return Err(format!("match on chain {c}: stale generation tag {}", tag.gen_tag()));
            }
        }
        Ok(())
    }

    /// Scans the whole prefix table; with `quiescent`, no writer runs, so
    /// every occupied slot must decode.
    fn check_entries(&self, t: &Tables<'_>, quiescent: bool) -> Result<u64, String> {
        let mut n = 0;
        for (key, entry) in t.prefix.entries() {
            let Some(id) = self.ids.get(&key) else {
                return Err(format!("entries(): key {key:#x} is not in the key space ({entry:?})"));
            };
            self.check_servers(*id, &entry.servers, "entries()")?;
            n += 1;
        }
        let (occupancy, capacity) = (t.prefix.occupancy(), t.prefix.capacity());
        if occupancy > capacity || (quiescent && n != occupancy) {
            return Err(format!("{n} entries, occupancy {occupancy}, capacity {capacity}"));
        }
        Ok(n)
    }

    fn check_server(&self, t: &Tables<'_>, slot: u16) -> Result<(), String> {
        let info = t.servers.get(slot).ok_or(format!("server {slot} unreadable"))?;
        let want = self.servers[usize::from(slot)];
        if info.server != want || info.address != address(slot, want.generation) || info.id != u64::from(slot) + 100 {
            return Err(format!("server {slot}: read {info:?}"));
        }
        let load = t.servers.load(want);
        if load != LoadFigures::default() && load != figures(load.scraped_at_ms) {
            return Err(format!("server {slot}: torn load figures {load:?}"));
        }
        Ok(())
    }
}

/// The completion record number `seq` of incarnation `inc` of ring `ring`.
struct RecordSpec {
    chain: usize,
    prompt: usize,
    server: u16,
    response: Option<(u32, u32)>,
}

fn record_spec(ring: u16, inc: u32, seq: u32) -> RecordSpec {
    let h = mix(mix((u64::from(ring) << 32) | u64::from(inc)) ^ u64::from(seq));
    let chain = (h % CHAINS as u64) as usize;
    let rid = ((h >> 20) % u64::from(RESPONSE_KEYS)) as u32;
    RecordSpec {
        chain,
        prompt: 1 + ((h >> 12) % CHAIN_LEN as u64) as usize,
        server: chain_servers(chain)[((h >> 16) & 1) as usize],
        response: (h >> 40)
            .is_multiple_of(3)
            .then(|| (rid, small_version(rid, (h >> 44) as u32))),
    }
}

fn encode_record(w: &World, ring: u16, inc: u32, seq: u32, out: &mut Vec<u8>, scratch: &mut Vec<u8>) {
    let spec = record_spec(ring, inc, seq);
    if let Some((rid, version)) = spec.response {
        value(rid, version, scratch);
    }
    let chain = w.chain(spec.chain);
    CompletionRecord {
        server: w.servers[usize::from(spec.server)],
        prompt_tokens: seq,
        output_tokens: inc,
        prompt_blocks: &chain[..spec.prompt],
        full_blocks: chain,
        continuation: None,
        response: spec.response.map(|(rid, _)| (response_key(rid), scratch.as_slice())),
        prediction: None,
        timing: None,
    }
    .encode_into(out);
}

// ---------------------------------------------------------------------------
// Ring consumption, shared by the consumer child and the parent's thread

struct Consumer {
    /// Last `(incarnation, sequence)` popped, per ring.
    last: HashMap<u16, (u32, u32)>,
    pending_since: HashMap<u16, Instant>,
    record: Completion,
    buf: Vec<u8>,
    expect: Vec<u8>,
    scratch: Vec<u8>,
    popped: u64,
    skipped: u64,
}

enum Polled {
    Record,
    Skipped,
    Idle,
}

impl Consumer {
    fn new() -> Self {
        Self {
            last: HashMap::new(),
            pending_since: HashMap::new(),
            record: Completion::default(),
            buf: Vec::new(),
            expect: Vec::new(),
            scratch: Vec::new(),
            popped: 0,
            skipped: 0,
        }
    }

    /// One pop from ring `r`, verified; a pending record whose producer is
    /// dead per the registry is skipped. With `write_back`, the record is
    /// applied to the prefix table and response cache like a responder does.
    fn poll(&mut self, w: &World, t: &Tables<'_>, r: u16, write_back: bool) -> Result<Polled, String> {
        let ring = t.ring(usize::from(r));
        match ring.pop(&mut self.buf) {
            Pop::Record => {
                self.pending_since.remove(&r);
                self.popped += 1;
                self.verify(w, r)?;
                if write_back {
                    let server = self.record.server.expect("decoded");
                    t.prefix.insert_chain(&self.record.full_blocks, server, Stamp(0));
                    if let Some(key) = self.record.response_key {
                        t.responses.put(key, &self.record.response).map_err(|e| e.to_string())?;
                    }
                }
                Ok(Polled::Record)
            }
            Pop::Empty => {
                self.pending_since.remove(&r);
                Ok(Polled::Idle)
            }
            Pop::Pending => {
                if ring.recover(|slot, inc| t.registry.is_alive(slot, inc)) {
                    self.pending_since.remove(&r);
                    self.skipped += 1;
                    return Ok(Polled::Skipped);
                }
                self.pending_since.entry(r).or_insert_with(Instant::now);
                Ok(Polled::Idle)
            }
        }
    }

    fn verify(&mut self, w: &World, r: u16) -> Result<(), String> {
        self.record
            .decode_from(&self.buf)
            .map_err(|e| format!("ring {r}: undecodable record ({e}): {:02x?}", self.buf))?;
        let (seq, inc) = (self.record.prompt_tokens, self.record.output_tokens);
        encode_record(w, r, inc, seq, &mut self.expect, &mut self.scratch);
        if self.expect != self.buf {
            return Err(format!(
                "ring {r}: record (inc {inc}, seq {seq}) differs from what was pushed"
            ));
        }
        if let Some(prev) = self.last.insert(r, (inc, seq))
            && prev >= (inc, seq)
        {
            return Err(format!("ring {r}: record (inc {inc}, seq {seq}) popped after {prev:?}"));
        }
        Ok(())
    }

    /// Rings pending for longer than [`WEDGE`].
    fn wedged(&self) -> Option<(u16, Duration)> {
        self.pending_since
            .iter()
            .map(|(r, since)| (*r, since.elapsed()))
            .find(|(_, d)| *d > WEDGE)
    }
}

// ---------------------------------------------------------------------------
// Per-process operation counters, in a small shm object of their own

#[derive(Clone, Copy)]
#[repr(usize)]
enum Op {
    PrefixInsert,
    PrefixEvict,
    PrefixChain,
    PrefixLookup,
    PrefixHit,
    PrefixMatch,
    PrefixRemove,
    ResponsePut,
    ResponseGet,
    ResponseHit,
    RingPush,
    RingFull,
    RingPop,
    RingSkip,
    ServerBegin,
    ServerFirstToken,
    ServerEnd,
    ServerRead,
}

const OPS: usize = 18;
const OP_NAMES: [&str; OPS] = [
    "prefix.insert",
    "prefix.evicted",
    "prefix.insert_chain",
    "prefix.lookup",
    "prefix.hit",
    "prefix.lpm",
    "prefix.remove",
    "responses.put",
    "responses.get",
    "responses.hit",
    "ring.push",
    "ring.full",
    "ring.pop",
    "ring.skip",
    "servers.begin",
    "servers.first_token",
    "servers.end",
    "servers.read",
];
const BOARD_SLOTS: usize = 8;
const BOARD_BYTES: usize = BOARD_SLOTS * OPS * 8;

/// `BOARD_SLOTS × OPS` shared counters; children add their local counts.
struct Board {
    ptr: NonNull<AtomicU64>,
}

impl Board {
    fn map(name: &str, create: bool) -> Self {
        let flags = if create {
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR
        } else {
            OFlag::O_RDWR
        };
        let fd: OwnedFd = shm_open(format!("/{name}").as_str(), flags, Mode::from_bits_truncate(0o600))
            .unwrap_or_else(|e| panic!("shm_open {name}: {e}"));
        if create {
            nix::unistd::ftruncate(&fd, BOARD_BYTES as i64).expect("ftruncate the board");
        }
        // SAFETY: a fresh shared mapping of the whole object; nothing else
        // is mapped at the address the kernel picks.
        let ptr = unsafe {
            mmap(
                None,
                BOARD_BYTES.try_into().expect("non-zero"),
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &fd,
                0,
            )
        }
        .expect("mmap the board");
        Self { ptr: ptr.cast() }
    }

    fn counters(&self) -> &[AtomicU64] {
        // SAFETY: the mapping is BOARD_BYTES long, page aligned, lives as long
        // as `self`, and is only accessed through atomics.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), BOARD_SLOTS * OPS) }
    }

    fn add(&self, slot: u16, local: &mut [u64; OPS]) {
        let row = &self.counters()[usize::from(slot) * OPS..][..OPS];
        for (c, n) in row.iter().zip(local.iter_mut()) {
            if *n > 0 {
                c.fetch_add(std::mem::take(n), Ordering::Relaxed);
            }
        }
    }

    fn get(&self, slot: u16, op: usize) -> u64 {
        self.counters()[usize::from(slot) * OPS + op].load(Ordering::Relaxed)
    }
}

impl Drop for Board {
    fn drop(&mut self) {
        // SAFETY: mapped in `map` with this length; no reference outlives self.
        let _ = unsafe { munmap(self.ptr.cast(), BOARD_BYTES) };
    }
}

// ---------------------------------------------------------------------------
// Children

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Job {
    Prefix,
    Responses,
    Rings,
    Servers,
    Mixed,
    Consumer,
}

impl Job {
    fn name(self) -> &'static str {
        match self {
            Job::Prefix => "prefix",
            Job::Responses => "responses",
            Job::Rings => "rings",
            Job::Servers => "servers",
            Job::Mixed => "mixed",
            Job::Consumer => "consumer",
        }
    }

    fn role(self) -> Role {
        if self == Job::Consumer {
            Role::Responder
        } else {
            Role::Dispatcher
        }
    }

    fn parse(s: &str) -> Self {
        match s {
            "prefix" => Job::Prefix,
            "responses" => Job::Responses,
            "rings" => Job::Rings,
            "servers" => Job::Servers,
            "mixed" => Job::Mixed,
            "consumer" => Job::Consumer,
            _ => panic!("unknown job {s}"),
        }
    }

    /// Weights of (prefix, responses, ring push, servers, ring pops).
    fn weights(self) -> [u64; 5] {
        match self {
            Job::Prefix => [80, 5, 5, 10, 0],
            Job::Responses => [5, 75, 10, 10, 0],
            Job::Rings => [5, 5, 60, 30, 0],
            // Mostly begin/end: kills often land between a global counter
            // and its ledger cell.
            Job::Servers => [0, 0, 0, 100, 0],
            Job::Mixed => [30, 30, 20, 20, 0],
            Job::Consumer => [10, 10, 0, 0, 80],
        }
    }
}

/// Registry slots: 0 is the parent; these are the children.
const PLAN: [(u16, Job, bool); 7] = [
    (1, Job::Prefix, true),
    (2, Job::Responses, true),
    (3, Job::Rings, true),
    (4, Job::Servers, true),
    (5, Job::Mixed, true),
    (6, Job::Consumer, true),
    (7, Job::Mixed, false),
];

/// The rings produced into: those of every child that pushes.
fn producer_rings() -> impl Iterator<Item = u16> {
    PLAN.iter().filter(|(_, j, _)| j.weights()[2] > 0).map(|(s, _, _)| *s)
}

struct ChildArgs {
    name: String,
    board: String,
    slot: u16,
    inc: u32,
    job: Job,
    seed: u64,
    stop_ms: u64,
}

impl ChildArgs {
    fn encode(&self) -> String {
        format!(
            "name={};board={};slot={};inc={};job={};seed={};stop_ms={}",
            self.name,
            self.board,
            self.slot,
            self.inc,
            self.job.name(),
            self.seed,
            self.stop_ms
        )
    }

    fn decode(s: &str) -> Self {
        let f: HashMap<&str, &str> = s.split(';').filter_map(|kv| kv.split_once('=')).collect();
        let num = |k: &str| f[k].parse::<u64>().unwrap_or_else(|e| panic!("{k}: {e}"));
        Self {
            name: f["name"].to_owned(),
            board: f["board"].to_owned(),
            slot: num("slot") as u16,
            inc: num("inc") as u32,
            job: Job::parse(f["job"]),
            seed: num("seed"),
            stop_ms: num("stop_ms"),
        }
    }
}

/// Child entry point. Without `SEMLB_TORTURE_CHILD` (every normal test run)
/// this shim returns at once; the parent runs it in re-executed copies of
/// this binary.
#[test]
fn torture_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let args = ChildArgs::decode(&spec);
    if let Err(e) = child_main(&args) {
        panic!("VIOLATION in child slot {} ({}): {e}", args.slot, args.job.name());
    }
}

struct Worker<'a> {
    t: Tables<'a>,
    w: World,
    a: &'a ChildArgs,
    rng: Rng,
    ring: CompletionRing<'a>,
    seq: u32,
    inflight: Vec<(ServerRef, u64, bool)>,
    counts: [u64; OPS],
    buf: Vec<u8>,
    scratch: Vec<u8>,
}

fn child_main(a: &ChildArgs) -> Result<(), String> {
    let seg = Segment::open(&a.name).map_err(|e| format!("open: {e}"))?;
    let board = Board::map(&a.board, false);
    let t = seg.tables();
    let clock = seg.clock();
    if !t.registry.attach(a.slot, a.inc, std::process::id(), clock.now_ms()) {
        return Err(format!("attach refused: {:?}", t.registry.get(a.slot)));
    }
    let w = World::new(&t)?;
    for s in w.servers {
        if t.servers.inflight_of(a.slot, s) != (0, 0) {
            return Err(format!(
                "ledger row not reclaimed: {:?}",
                t.servers.inflight_of(a.slot, s)
            ));
        }
    }
    let ring = t.ring(usize::from(a.slot));
    if a.job != Job::Consumer {
        ring.set_owner(a.slot, a.inc);
    }
    let mut k = Worker {
        t,
        w,
        a,
        rng: Rng(mix(a.seed ^ (u64::from(a.slot) << 40) ^ u64::from(a.inc))),
        ring,
        seq: 0,
        inflight: Vec::new(),
        counts: [0; OPS],
        buf: Vec::new(),
        scratch: Vec::new(),
    };
    let mut consumer = Consumer::new();
    let weights = a.job.weights();
    let total: u64 = weights.iter().sum();
    let mut last_beat = clock.now_ms();
    loop {
        let now = clock.now_ms();
        if now >= a.stop_ms {
            break;
        }
        if now >= last_beat + BEAT_MS {
            last_beat = now;
            if !k.t.registry.heartbeat(a.slot, a.inc, now) {
                return Err(format!("heartbeat refused: {:?}", k.t.registry.get(a.slot)));
            }
            board.add(a.slot, &mut k.counts);
        }
        let mut pick = k.rng.below(total);
        let mut kind = 0;
        while pick >= weights[kind] {
            pick -= weights[kind];
            kind += 1;
        }
        match kind {
            0 => k.prefix_op()?,
            1 => k.response_op()?,
            2 => k.push_op()?,
            3 => k.server_op()?,
            _ => {
                for r in producer_rings() {
                    match consumer.poll(&k.w, &k.t, r, true)? {
                        Polled::Record => k.counts[Op::RingPop as usize] += 1,
                        Polled::Skipped => k.counts[Op::RingSkip as usize] += 1,
                        Polled::Idle => {}
                    }
                }
            }
        }
    }
    for (s, tokens, started) in std::mem::take(&mut k.inflight) {
        k.t.servers.end_request(a.slot, s, tokens, started);
    }
    board.add(a.slot, &mut k.counts);
    Ok(())
}

impl Worker<'_> {
    fn count(&mut self, op: Op) {
        self.counts[op as usize] += 1;
    }

    fn stamp(&mut self) -> Stamp {
        // Spread stamps so that eviction picks varied victims.
        Stamp(self.rng.below(64) as u16)
    }

    fn prefix_op(&mut self) -> Result<(), String> {
        let c = self.rng.index(CHAINS);
        let id = c * CHAIN_LEN + self.rng.index(CHAIN_LEN);
        match self.rng.below(10) {
            0..=1 => {
                let slot = allowed(id)[self.rng.index(3)];
                let stamp = self.stamp();
                let outcome = self
                    .t
                    .prefix
                    .insert(self.w.keys[id], self.w.servers[usize::from(slot)], stamp);
                self.count(Op::PrefixInsert);
                if outcome == InsertOutcome::Evicted {
                    self.count(Op::PrefixEvict);
                }
            }
            2 => {
                let slot = chain_servers(c)[self.rng.index(2)];
                let len = 1 + self.rng.index(CHAIN_LEN);
                let stamp = self.stamp();
                self.t
                    .prefix
                    .insert_chain(&self.w.chain(c)[..len], self.w.servers[usize::from(slot)], stamp);
                self.count(Op::PrefixChain);
            }
            3..=5 => {
                if self.w.check_lookup(&self.t, id)? {
                    self.count(Op::PrefixHit);
                }
                self.count(Op::PrefixLookup);
            }
            6..=8 => {
                let len = 1 + self.rng.index(CHAIN_LEN);
                let chain = &self.w.chain(c)[..len];
                let m = if self.rng.one_in(2) {
                    self.t.prefix.longest_prefix_match(chain, |s| self.t.servers.is_live(s))
                } else {
                    self.t.prefix.longest_prefix_match(chain, |_| true)
                };
                self.w.check_match(c, len, &m)?;
                self.count(Op::PrefixMatch);
            }
            _ => {
                let slot = allowed(id)[self.rng.index(3)];
                self.t
                    .prefix
                    .remove(self.w.keys[id], self.w.servers[usize::from(slot)].tag());
                self.count(Op::PrefixRemove);
            }
        }
        Ok(())
    }

    fn response_op(&mut self) -> Result<(), String> {
        let rid = self.rng.below(u64::from(RESPONSE_KEYS)) as u32;
        if self.rng.one_in(3) {
            let version = self.rng.next() as u32;
            value(rid, version, &mut self.buf);
            self.t
                .responses
                .put(response_key(rid), &self.buf)
                .map_err(|e| format!("put: {e}"))?;
            self.count(Op::ResponsePut);
        } else {
            if let Some(bytes) = self.t.responses.get_into(response_key(rid), &mut self.buf) {
                verify_value(rid, bytes, &mut self.scratch)?;
                self.count(Op::ResponseHit);
            }
            self.count(Op::ResponseGet);
        }
        Ok(())
    }

    fn push_op(&mut self) -> Result<(), String> {
        encode_record(
            &self.w,
            self.a.slot,
            self.a.inc,
            self.seq,
            &mut self.buf,
            &mut self.scratch,
        );
        self.seq += 1;
        match self.ring.push(&self.buf) {
            Ok(()) => self.count(Op::RingPush),
            Err(PushError::Full) => self.count(Op::RingFull),
            Err(e) => return Err(format!("push of {} bytes: {e}", self.buf.len())),
        }
        Ok(())
    }

    fn server_op(&mut self) -> Result<(), String> {
        let slot = self.rng.below(u64::from(SERVERS)) as u16;
        let server = self.w.servers[usize::from(slot)];
        // The servers job only begins, starts and ends requests.
        let kinds = if self.a.job == Job::Servers { 3 } else { 5 };
        let unstarted = self.inflight.iter().position(|r| !r.2);
        match self.rng.below(kinds) {
            0 if self.inflight.len() < 8 => {
                let tokens = self.rng.below(MAX_TOKENS + 1);
                if !self.t.servers.begin_request(self.a.slot, server, tokens) {
                    return Err(format!("begin_request refused for current server {server:?}"));
                }
                self.inflight.push((server, tokens, false));
                self.count(Op::ServerBegin);
            }
            1 if unstarted.is_some() => {
                let r = &mut self.inflight[unstarted.unwrap_or_default()];
                self.t.servers.first_token(self.a.slot, r.0, r.1);
                r.2 = true;
                self.count(Op::ServerFirstToken);
            }
            0..=2 if !self.inflight.is_empty() => {
                let i = self.rng.index(self.inflight.len());
                let (s, tokens, started) = self.inflight.swap_remove(i);
                self.t.servers.end_request(self.a.slot, s, tokens, started);
                self.count(Op::ServerEnd);
            }
            3 => {
                let at = (self.rng.next() >> 1) | 1;
                if !self.t.servers.store_load(server, figures(at)) {
                    return Err(format!("store_load refused for current server {server:?}"));
                }
            }
            _ => {
                self.w.check_server(&self.t, slot)?;
                self.t.servers.is_live(server.tag());
                self.count(Op::ServerRead);
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Parent

/// Removes the shm objects when the test ends, however it ends.
struct ShmGuard {
    names: Vec<String>,
}

impl Drop for ShmGuard {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = shm_unlink(format!("/{n}").as_str());
        }
    }
}

struct Running {
    child: Child,
    inc: u32,
    started: Instant,
}

/// Every child process, killed and reaped on drop if still running.
struct Children {
    exe: std::path::PathBuf,
    running: HashMap<u16, Running>,
}

impl Drop for Children {
    fn drop(&mut self) {
        for r in self.running.values_mut() {
            let _ = kill(Pid::from_raw(r.child.id() as i32), Signal::SIGKILL);
            let _ = r.child.wait();
        }
    }
}

impl Children {
    fn spawn(&mut self, args: &ChildArgs) {
        let child = Command::new(&self.exe)
            .args([
                "--exact",
                CHILD_TEST,
                "--nocapture",
                "--test-threads=1",
                "--include-ignored",
                "-q",
            ])
            .env(CHILD_ENV, args.encode())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn a child");
        self.running.insert(
            args.slot,
            Running {
                child,
                inc: args.inc,
                started: Instant::now(),
            },
        );
    }
}

/// Accounts for a child we SIGKILLed: checks that our signal is what ended
/// it, marks it exited and reclaims its in-flight counts.
/// `finished`: the deadline has passed, so a child may also have ended
/// normally just before our signal arrived.
fn reap_killed(
    t: &Tables<'_>,
    slot: u16,
    r: &mut Running,
    status: std::process::ExitStatus,
    finished: bool,
) -> Result<u32, String> {
    if status.signal() != Some(Signal::SIGKILL as i32) && !(finished && status.success()) {
        return Err(format!(
            "child slot {slot} (incarnation {}) ended with {status} before our SIGKILL:\n{}",
            r.inc,
            stderr_of(&mut r.child)
        ));
    }
    if !t.registry.mark_exited(slot, r.inc) {
        return Err(format!(
            "mark_exited({slot}, {}) refused: {:?}",
            r.inc,
            t.registry.get(slot)
        ));
    }
    Ok(t.servers.reclaim_process(slot).interrupted)
}

fn stderr_of(child: &mut Child) -> String {
    let mut s = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

/// Sets its flag when dropped.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

struct Failures(Mutex<Vec<String>>, AtomicBool);

impl Failures {
    fn add(&self, s: String) {
        eprintln!("FAILURE: {s}");
        self.0.lock().unwrap().push(s);
        self.1.store(true, Ordering::Relaxed);
    }
    fn any(&self) -> bool {
        self.1.load(Ordering::Relaxed)
    }
}

/// Checks a sample of every table from a process that is never killed.
fn parent_sample(w: &World, t: &Tables<'_>, rng: &mut Rng, scratch: &mut Vec<u8>) -> Result<(), String> {
    for _ in 0..200 {
        w.check_lookup(t, rng.index(KEYS))?;
    }
    for _ in 0..50 {
        let c = rng.index(CHAINS);
        let len = 1 + rng.index(CHAIN_LEN);
        w.check_match(c, len, &t.prefix.longest_prefix_match(&w.chain(c)[..len], |_| true))?;
    }
    let mut buf = Vec::new();
    for _ in 0..50 {
        let rid = rng.below(u64::from(RESPONSE_KEYS)) as u32;
        if let Some(bytes) = t.responses.get_into(response_key(rid), &mut buf) {
            verify_value(rid, bytes, scratch)?;
        }
    }
    for slot in 0..SERVERS {
        w.check_server(t, slot)?;
        // Requests and their pending part share one atomic word (as do
        // their tokens), and every op keeps pending <= in flight. Read each
        // word once: two loads would let a begin land between them.
        let server = w.servers[usize::from(slot)];
        let (inflight, pending) = t.servers.inflight_and_pending(server);
        if pending.0 > inflight.0 || pending.1 > inflight.1 {
            return Err(format!(
                "server {slot}: {pending:?} requests / tokens pending of {inflight:?} in flight"
            ));
        }
    }
    Ok(())
}

#[test]
fn shm_torture() {
    let secs: f64 = std::env::var("SEMLB_TORTURE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6.0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let seed: u64 = std::env::var("SEMLB_TORTURE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(nanos);
    let name = format!("semlb-torture-{}-{nanos}", std::process::id());
    let board_name = format!("{name}-board");
    let _guard = ShmGuard {
        names: vec![name.clone(), board_name.clone()],
    };
    eprintln!("shm_torture: segment /{name}, {secs} s, seed {seed} (SEMLB_TORTURE_SEED)");

    let seg = Segment::create(&name, &LayoutPlan::for_size(SEGMENT_BYTES).unwrap()).expect("create the segment");
    let board = Board::map(&board_name, true);
    let t = seg.tables();
    let clock = seg.clock();

    // Servers, some re-registered so generations differ (and one wraps its tag).
    for slot in 0..SERVERS {
        let mut generation = 1;
        let mut server = t
            .servers
            .register(u64::from(slot) + 100, &address(slot, generation), clock.now_ms())
            .unwrap();
        for _ in 0..EXTRA_REGISTRATIONS[usize::from(slot)] {
            assert!(t.servers.retire(server));
            generation += 1;
            server = t
                .servers
                .register(u64::from(slot) + 100, &address(slot, generation), clock.now_ms())
                .unwrap();
        }
        assert_eq!(server, ServerRef { slot, generation });
    }
    let w = World::new(&t).expect("world");
    let me = t.registry.claim(0, Role::Supervisor, clock.now_ms());
    assert!(t.registry.attach(0, me, std::process::id(), clock.now_ms()));

    let stop_ms = clock.now_ms() + (secs * 1000.0) as u64;
    let mut children = Children {
        exe: std::env::current_exe().expect("current_exe"),
        running: HashMap::new(),
    };
    let args = |slot: u16, inc: u32, job: Job| ChildArgs {
        name: name.clone(),
        board: board_name.clone(),
        slot,
        inc,
        job,
        seed,
        stop_ms,
    };
    for (slot, job, _) in PLAN {
        let inc = t.registry.claim(slot, job.role(), clock.now_ms());
        children.spawn(&args(slot, inc, job));
    }

    let failures = Failures(Mutex::new(Vec::new()), AtomicBool::new(false));
    let consumer_done = AtomicBool::new(false);
    let reaped = AtomicBool::new(false);
    let mut kills = 0u64;
    // Kills that landed between an in-flight update of a global counter
    // and of the process's ledger cell.
    let mut interrupted = 0u64;
    let mut kills_attached = 0u64;
    let mut restarts: HashMap<u16, u64> = HashMap::new();
    let mut rng = Rng(seed);
    let mut scratch = Vec::new();
    let started = Instant::now();

    let (mut parent_consumer, scans) = std::thread::scope(|scope| {
        // Stops the helper threads however this closure ends (a panic here
        // would otherwise leave the scope waiting for them forever).
        let _stop_threads = StopOnDrop(&consumer_done);
        // The parent's own consumer: never killed, so it also checks that no
        // ring stays wedged.
        let consumer = scope.spawn(|| {
            let mut c = Consumer::new();
            while !consumer_done.load(Ordering::Relaxed) && !failures.any() {
                let mut progress = false;
                for r in producer_rings() {
                    match c.poll(&w, &t, r, false) {
                        Ok(Polled::Idle) => {}
                        Ok(_) => progress = true,
                        Err(e) => failures.add(format!("parent consumer: {e}")),
                    }
                }
                if let Some((r, d)) = c.wedged() {
                    let ring = t.ring(usize::from(r));
                    let (slot, inc) = ring.owner();
                    failures.add(format!(
                        "ring {r} has been Pending for {d:?}: owner (slot {slot}, incarnation {inc}) alive={}, \
                         registry {:?}, ring {:?}",
                        t.registry.is_alive(slot, inc),
                        t.registry.get(slot),
                        ring.stats()
                    ));
                }
                if !progress {
                    // Pacing, not synchronisation: leave the CPU to the workers.
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
            c
        });

        // The parent's checker: a reader that is never killed samples every
        // table, scans the whole prefix table now and then, and drains and
        // re-admits servers so that `is_live` changes under the readers.
        let checker = scope.spawn(|| {
            let mut rng = Rng(mix(seed ^ 0xc4ec));
            let mut scratch = Vec::new();
            let mut scans = 0u64;
            let mut last_scan = Instant::now();
            while !consumer_done.load(Ordering::Relaxed) && !failures.any() {
                if let Err(e) = parent_sample(&w, &t, &mut rng, &mut scratch) {
                    failures.add(format!("parent check: {e}"));
                }
                let s = w.servers[rng.index(SERVERS as usize)];
                let state = if rng.one_in(2) {
                    ServerState::Draining
                } else {
                    ServerState::Up
                };
                if !t.servers.set_state(s, state) {
                    failures.add(format!("set_state({s:?}, {state:?}) refused"));
                }
                if last_scan.elapsed() > Duration::from_millis(1500) {
                    last_scan = Instant::now();
                    scans += 1;
                    if let Err(e) = w.check_entries(&t, false) {
                        failures.add(format!("parent scan: {e}"));
                    }
                }
                // Pacing, not synchronisation.
                std::thread::sleep(Duration::from_millis(50));
            }
            scans
        });

        // Killed children not reaped yet, with the time of the kill.
        let mut dying: Vec<(u16, Running, Instant)> = Vec::new();
        while clock.now_ms() < stop_ms && !failures.any() {
            // The workload: a kill every 2-20 ms.
            std::thread::sleep(Duration::from_micros(2_000 + rng.below(18_000)));

            // Reap the killed children, account for them, restart them.
            let mut i = 0;
            while i < dying.len() {
                let status = dying[i].1.child.try_wait().expect("try_wait");
                let Some(status) = status else {
                    if dying[i].2.elapsed() > Duration::from_secs(10) {
                        failures.add(format!("child slot {} still alive 10 s after SIGKILL", dying[i].0));
                    }
                    i += 1;
                    continue;
                };
                let (slot, mut r, _) = dying.swap_remove(i);
                match reap_killed(&t, slot, &mut r, status, clock.now_ms() >= stop_ms) {
                    Ok(n) => interrupted += u64::from(n),
                    Err(e) => failures.add(e),
                }
                let job = PLAN.iter().find(|p| p.0 == slot).unwrap().1;
                let inc = t.registry.claim(slot, job.role(), clock.now_ms());
                *restarts.entry(slot).or_default() += 1;
                children.spawn(&args(slot, inc, job));
            }

            // Unexpected exits.
            for (slot, r) in children.running.iter_mut() {
                // A normal exit is expected once the deadline has passed (the
                // child saw it first; the clock is shared).
                if let Ok(Some(status)) = r.child.try_wait()
                    && !(status.success() && clock.now_ms() >= stop_ms)
                {
                    failures.add(format!(
                        "child slot {slot} (incarnation {}) exited on its own with {status} after {:?}:\n{}",
                        r.inc,
                        r.started.elapsed(),
                        stderr_of(&mut r.child)
                    ));
                }
            }
            if failures.any() {
                break;
            }

            // Hang watchdog.
            let now = clock.now_ms();
            for (slot, r) in &children.running {
                let info = t.registry.get(*slot).expect("slot in range");
                let stale = match info.state {
                    ProcessState::Running => now.saturating_sub(info.heartbeat_ms) > HANG_MS,
                    ProcessState::Starting => now.saturating_sub(info.started_ms) > START_HANG_MS,
                    _ => true,
                };
                if stale || info.incarnation != r.inc {
                    failures.add(format!("child slot {slot} looks hung (now {now} ms): {info:?}"));
                }
            }

            // Kill a random killable child that is alive; it is reaped above
            // on a later round.
            if clock.now_ms() >= stop_ms {
                break;
            }
            let victims: Vec<u16> = PLAN
                .iter()
                .filter(|p| p.2 && children.running.contains_key(&p.0))
                .map(|p| p.0)
                .collect();
            if victims.is_empty() {
                continue;
            }
            let slot = victims[rng.index(victims.len())];
            let r = children.running.remove(&slot).expect("running");
            if t.registry.get(slot).is_some_and(|i| i.state == ProcessState::Running) {
                kills_attached += 1;
            }
            kill(Pid::from_raw(r.child.id() as i32), Signal::SIGKILL).expect("kill");
            kills += 1;
            dying.push((slot, r, Instant::now()));
        }

        // Stop: the children leave by themselves at `stop_ms` (or now, after
        // a failure). Wait for each, with a watchdog that kills what is still
        // running after 30 s.
        let aborted = failures.any();
        if aborted {
            for r in children.running.values() {
                let _ = kill(Pid::from_raw(r.child.id() as i32), Signal::SIGKILL);
            }
        }
        let pids: Vec<(u16, i32)> = children
            .running
            .iter()
            .map(|(s, r)| (*s, r.child.id() as i32))
            .chain(dying.iter().map(|(s, r, _)| (*s, r.child.id() as i32)))
            .collect();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (reaped_ref, failures_ref) = (&reaped, &failures);
        let watchdog = scope.spawn(move || {
            if rx.recv_timeout(Duration::from_secs(30)).is_err() && !reaped_ref.load(Ordering::Relaxed) {
                for (slot, pid) in &pids {
                    failures_ref.add(format!("child slot {slot} did not stop at the deadline"));
                    let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
                }
            }
        });
        for (slot, mut r, _) in dying.drain(..) {
            let status = r.child.wait().expect("wait");
            match reap_killed(&t, slot, &mut r, status, clock.now_ms() >= stop_ms) {
                Ok(n) => interrupted += u64::from(n),
                Err(e) => failures.add(e),
            }
        }
        for (slot, mut r) in children.running.drain() {
            let status = r.child.wait().expect("wait");
            if !status.success() && !aborted {
                failures.add(format!(
                    "child slot {slot} (incarnation {}) ended with {status}:\n{}",
                    r.inc,
                    stderr_of(&mut r.child)
                ));
            }
            t.registry.mark_exited(slot, r.inc);
        }
        reaped.store(true, Ordering::Relaxed);
        drop(tx);
        watchdog.join().unwrap();
        consumer_done.store(true, Ordering::Relaxed);
        (consumer.join().unwrap(), checker.join().unwrap())
    });
    let run = started.elapsed();

    // Final checks: every process is gone; reclaim them all.
    for (slot, _, _) in PLAN {
        let info = t.registry.get(slot).expect("slot in range");
        assert_eq!(info.state, ProcessState::Exited, "slot {slot}: {info:?}");
        assert_eq!(info.restarts, restarts.get(&slot).copied().unwrap_or(0), "slot {slot}");
        t.servers.reclaim_process(slot);
    }
    for (i, s) in w.servers.iter().enumerate() {
        let (inflight, pending) = t.servers.inflight_and_pending(*s);
        if (inflight, pending) != ((0, 0), (0, 0)) {
            failures.add(format!(
                "server {i}: {inflight:?} requests / tokens in flight and {pending:?} pending after reclaiming \
                 {kills} kills ({interrupted} mid-update) and every process"
            ));
        }
        for (slot, _, _) in PLAN {
            if t.servers.inflight_of(slot, *s) != (0, 0) {
                failures.add(format!("ledger ({slot}, {i}) not zero after reclaim"));
            }
        }
    }

    // Every ring drains: all producers are dead, so every pending record
    // must be skippable.
    for r in producer_rings() {
        let ring = t.ring(usize::from(r));
        let mut drained = false;
        for _ in 0..1_000_000 {
            match parent_consumer.poll(&w, &t, r, false) {
                Ok(Polled::Idle) if ring.stats().used == 0 => {
                    drained = true;
                    break;
                }
                Ok(Polled::Idle) => {
                    failures.add(format!("ring {r}: Pending and not skippable with every producer dead"));
                    break;
                }
                Ok(_) => {}
                Err(e) => {
                    failures.add(format!("final drain: {e}"));
                    break;
                }
            }
        }
        let s = ring.stats();
        if !drained || s.corrupt != 0 {
            failures.add(format!("ring {r}: drained={drained}, {s:?}"));
        }
    }
    match w.check_entries(&t, false) {
        Ok(n) => eprintln!("shm_torture: prefix table holds {n} entries"),
        Err(e) => failures.add(format!("final scan: {e}")),
    }
    for id in 0..KEYS {
        if let Err(e) = w.check_lookup(&t, id) {
            failures.add(format!("final lookup: {e}"));
        }
    }
    for c in 0..CHAINS {
        if let Err(e) = w.check_match(c, CHAIN_LEN, &t.prefix.longest_prefix_match(w.chain(c), |_| true)) {
            failures.add(format!("final match: {e}"));
        }
    }
    let mut hits = 0;
    let mut buf = Vec::new();
    for rid in 0..RESPONSE_KEYS {
        if let Some(bytes) = t.responses.get_into(response_key(rid), &mut buf) {
            hits += 1;
            if let Err(e) = verify_value(rid, bytes, &mut scratch) {
                failures.add(format!("final get: {e}"));
            }
        }
    }
    for slot in 0..SERVERS {
        if let Err(e) = w.check_server(&t, slot) {
            failures.add(format!("final server check: {e}"));
        }
    }

    // Summary.
    eprintln!(
        "shm_torture: {run:.1?}, {kills} kills ({kills_attached} after the child attached), restarts per slot {:?}, {scans} full scans",
        {
            let mut v: Vec<_> = restarts.iter().map(|(s, n)| (*s, *n)).collect();
            v.sort();
            v
        }
    );
    for (slot, job, killable) in PLAN {
        let ops: Vec<String> = (0..OPS)
            .filter(|op| board.get(slot, *op) > 0)
            .map(|op| format!("{} {}", OP_NAMES[op], board.get(slot, op)))
            .collect();
        eprintln!(
            "  slot {slot} {:9}{}: {}",
            job.name(),
            if killable { "" } else { " (never killed)" },
            ops.join(", ")
        );
    }
    eprintln!(
        "  parent consumer: {} popped, {} skipped",
        parent_consumer.popped, parent_consumer.skipped
    );
    for r in producer_rings() {
        eprintln!("  ring {r}: {:?}", t.ring(usize::from(r)).stats());
    }
    eprintln!(
        "  responses: {:?}, {hits}/{RESPONSE_KEYS} keys readable at the end",
        t.responses.stats()
    );
    eprintln!(
        "  prefix: occupancy {} of {}",
        t.prefix.occupancy(),
        t.prefix.capacity()
    );
    eprintln!("  in-flight counters: {interrupted} kills landed mid-update");

    let failures = failures.0.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} failure(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(kills > 0, "no kills happened");
}

// ---------------------------------------------------------------------------
// Minimal reproductions of shm-layout defects found while writing this test

/// Word index of byte `byte` of ring `i`'s data (after its control block).
fn ring_data_word(seg: &Segment, i: usize, byte: u64) -> usize {
    let r = seg.header().region(RegionKind::Rings);
    ((r.offset + i as u64 * (256 + r.param) + 256 + byte) / 8) as usize
}

/// A ring names one owner, `(registry slot, incarnation)`, but a pending
/// reservation belongs to whichever incarnation made it. When a producer is
/// killed between reserving and committing and the supervisor restarts it
/// into the same registry slot before the responder reaches the hole,
/// `owner()` names the new, live incarnation. The ring used to stay
/// `Pending` for as long as the new incarnation lived (everything behind the
/// hole piling up until pushes were dropped); `set_owner` now records the
/// tail at take-over and `recover` skips any reservation below it.
#[test]
fn restarted_producer_does_not_wedge_its_ring() {
    let seg = Segment::heap(&LayoutPlan::for_size(SEGMENT_BYTES).unwrap());
    let t = seg.tables();
    let ring = t.ring(1);
    let first = t.registry.claim(1, Role::Dispatcher, 0);
    assert!(t.registry.attach(1, first, 1001, 0));
    ring.set_owner(1, first);
    ring.push(b"first").unwrap();
    ring.push(b"torn!").unwrap();
    // That second push was SIGKILLed after its reservation, before its
    // commit word (the record at position 64) was written.
    seg.raw_words()[ring_data_word(&seg, 1, 64)].store(0, Ordering::Relaxed);
    // The supervisor reaps it and restarts it into the same slot.
    assert!(t.registry.mark_exited(1, first));
    t.servers.reclaim_process(1);
    let second = t.registry.claim(1, Role::Dispatcher, 1);
    assert!(t.registry.attach(1, second, 1002, 1));
    ring.set_owner(1, second);
    ring.push(b"after restart").unwrap();
    // The responder gets to the ring now, and follows the documented protocol.
    let mut got = Vec::new();
    let mut out = Vec::new();
    for _ in 0..100 {
        match ring.pop(&mut out) {
            Pop::Record => got.push(String::from_utf8_lossy(&out).into_owned()),
            Pop::Empty => break,
            Pop::Pending => {
                ring.recover(|slot, inc| t.registry.is_alive(slot, inc));
            }
        }
    }
    assert_eq!(got, ["first", "after restart"], "ring stats {:?}", ring.stats());
}

/// Several producers push into one ring (documented: "any thread of that
/// dispatcher may push") while it is consumed. `push` computes
/// `t + gap + size - h`; it used to load `tail` before `head`, so other
/// producers and the consumer could move `head` past the `t` it had loaded
/// and the subtraction overflowed: a panic in debug builds (within
/// milliseconds here), a spurious `Full` in release. Found by this test and
/// fixed by loading `head` first; kept as a regression test.
#[test]
fn ring_multi_producer_push_does_not_overflow() {
    let seg = Segment::heap(&LayoutPlan::for_size(SEGMENT_BYTES).unwrap());
    let t = seg.tables();
    let ring = t.ring(0);
    let stop = AtomicBool::new(false);
    let deadline = Instant::now() + Duration::from_secs(2);
    std::thread::scope(|s| {
        let producers: Vec<_> = (0..2u8)
            .map(|p| {
                let stop = &stop;
                s.spawn(move || {
                    let big = [p; 1000];
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) && n < 2_000_000 {
                        let _ = ring.push(if n.is_multiple_of(2) { &big[..] } else { &big[..8] });
                        n += 1;
                    }
                })
            })
            .collect();
        let mut out = Vec::new();
        while Instant::now() < deadline && !producers.iter().any(|p| p.is_finished()) {
            ring.pop(&mut out);
        }
        stop.store(true, Ordering::Relaxed);
        for p in producers {
            assert!(p.join().is_ok(), "a producer panicked in push");
        }
    });
}
