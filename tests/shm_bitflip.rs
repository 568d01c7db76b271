//! Bit-flip sweep of the shared-memory tables: corrupt bytes read as misses.
//!
//! # What it proves
//!
//! Memory shared by many processes can be scribbled on (a stray write, a
//! bug, a bad DIMM). `shm-layout` promises that corrupt bytes read as
//! misses, never as wrong bytes, and never cause a panic: every prefix and
//! index slot carries a keyed fingerprint binding key to value, every
//! response and completion record a keyed checksum, and server addresses a
//! keyed check.
//!
//! # How
//!
//! Each test body is written once and run against both backings: a heap
//! segment ([`Segment::heap`]) and a real POSIX shm segment
//! ([`Segment::create`], unique name, removed by a drop guard).
//!
//! 1. An 8 MiB segment (the smallest plan: every region exists, and scans
//!    cover it quickly) is populated with servers (some retired or
//!    re-registered), prefix chains inserted server by server (so each key
//!    has a known most-recent-first server list and stamp), cached responses
//!    of many sizes (including keys sharing one 64-bit half) and completion
//!    records in several rings at different ring positions (some wrapped),
//!    while a model records exactly what was written. A first read-back must
//!    match the model exactly.
//! 2. Random sweep: rounds of 1–4 flips (a single bit, a random byte, or a
//!    random 64-bit pattern, applied with `fetch_xor` through
//!    [`Segment::raw_words`]), half of them anywhere in the table regions
//!    (never the 4 KiB header) and half on words that were non-zero after
//!    populating (so populated entries are actually hit). After every round
//!    everything is read back: a lookup returns `None` or exactly the
//!    model's servers and stamp, in the model's order; a longest-prefix
//!    match reports no server the model does not have and no more blocks
//!    than the model; a response is `None` or the exact bytes; a server is
//!    `None` or its exact address; a ring pops only records identical to
//!    ones pushed into that ring (a consumer skips pending records of its
//!    dead producer, as documented). Eight fresh segments × 25 rounds, fixed
//!    seed.
//! 3. Targeted sweeps flip every single bit of some populated prefix slots,
//!    response records with their index slots, server slots, rate-limit
//!    slots, usage entries (a row reads as written, or is missing, or has a
//!    wrong sum: never a name that was not written), and ring records and
//!    control words, checking after each flip and restoring it.
//! 4. Every bit of the 512-byte header, and random patterns, make
//!    [`Segment::open`] fail with an error (never a panic); the rest of the
//!    header page is reserved padding that `open` ignores.
//!
//! Two limits of the format are accepted here rather than failed: a flip in
//! the key half of a 128-bit slot files the entry under `key ^ bit` (all 128
//! bits are key or value; with hashed keys nobody asks for that key, and the
//! model's keys read as misses), and a server slot's state byte is not
//! covered by its check, so a retired server may read back with its old,
//! exact address (see `server_slot_state_and_id_are_not_checked`).
//!
//! The tests at the end are minimal reproductions of defects this sweep
//! found in shm-layout (all fixed); they stay as regression tests.

use semlb_test_support as support;
use support::{Rng, mix};

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};

use shm_layout::{
    LayoutPlan, Pop, Quota, RegionKind, ResponseKey, Role, Segment, ServerRef, ServerState, ServerTag, Stamp, Tables,
    Taken, UsageCounter, UsageKind, UsageRow,
};

/// The smallest segment: every region exists, and scans and random flips cover it
/// four times faster than a 32 MiB one.
const SEGMENT_BYTES: u64 = 8 << 20;
const HEADER_BYTES: usize = 512;
const EPOCHS: u64 = 8;
const ROUNDS: u64 = 25;
const SEED: u64 = 0x5eed_b17f_11b5;

// ---------------------------------------------------------------------------
// Helpers

/// A non-zero corruption pattern: one bit, one random byte, or 64 random bits.
fn pattern(rng: &mut Rng) -> u64 {
    let p = match rng.below(4) {
        0 | 1 => 1 << rng.below(64),
        2 => (rng.next() & 0xff) << (8 * rng.below(8)),
        _ => rng.next(),
    };
    if p == 0 { 1 } else { p }
}

/// Removes a shm segment when dropped.
struct ShmGuard(String);

impl Drop for ShmGuard {
    fn drop(&mut self) {
        let _ = Segment::remove(&self.0);
    }
}

fn unique_name(what: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "semlb-bitflip-{what}-{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn plan() -> LayoutPlan {
    LayoutPlan::for_size(SEGMENT_BYTES).unwrap()
}

/// Runs `body` on a fresh heap segment and on a fresh shm segment.
fn on_both_backings(what: &str, body: impl Fn(&Segment, &str)) {
    let heap = Segment::heap(&plan());
    body(&heap, "heap");
    let name = unique_name(what);
    let _guard = ShmGuard(name.clone());
    let shm = Segment::create(&name, &plan()).expect("create the shm segment");
    body(&shm, "shm");
}

/// A fresh segment of the given backing.
fn fresh(backing: &str, guards: &mut Vec<ShmGuard>) -> Segment {
    if backing == "heap" {
        return Segment::heap(&plan());
    }
    let name = unique_name("epoch");
    guards.push(ShmGuard(name.clone()));
    Segment::create(&name, &plan()).expect("create the shm segment")
}

fn flip(seg: &Segment, word: usize, pattern: u64) {
    seg.raw_words()[word].fetch_xor(pattern, Ordering::Relaxed);
}

/// Word range `[start, end)` of a region.
fn region_words(seg: &Segment, kind: RegionKind) -> std::ops::Range<usize> {
    let r = seg.header().region(kind);
    (r.offset / 8) as usize..((r.offset + r.bytes) / 8) as usize
}

/// Every word of the table regions (from the first region to the end of the last).
fn table_words(seg: &Segment) -> std::ops::Range<usize> {
    region_words(seg, RegionKind::Servers).start..region_words(seg, RegionKind::Prefix).end
}

/// Byte offset of ring `i`'s control block.
fn ring_base(seg: &Segment, i: usize) -> u64 {
    let r = seg.header().region(RegionKind::Rings);
    r.offset + i as u64 * (256 + r.param)
}

/// Ring control words (byte offsets in the 256-byte control block, see
/// completion_ring.rs): tail, head, owner.
const RING_TAIL: u64 = 0;
const RING_HEAD: u64 = 64;
const RING_OWNER: u64 = 128;

// ---------------------------------------------------------------------------
// Populating, with a model of what was written

struct Sizes {
    chains: usize,
    chain_len: usize,
    responses: usize,
    large_responses: usize,
    rings: usize,
    records: usize,
    /// Largest small response (large ones are 16-48 KiB).
    max_response: usize,
    max_record: usize,
}

const FULL: Sizes = Sizes {
    chains: 250,
    chain_len: 8,
    responses: 250,
    large_responses: 2,
    rings: 6,
    records: 24,
    max_response: 3000,
    max_record: 700,
};

struct ServerModel {
    slot: u16,
    /// The current registration, if any.
    live: Option<(ServerRef, String)>,
    /// A retired registration whose bytes are still in the slot: the state
    /// word is not covered by the keyed check, so a flip of its state bits
    /// may bring it back (see `server_slot_state_and_id_are_not_checked`).
    retired: Option<(ServerRef, String)>,
}

struct Model {
    servers: Vec<ServerModel>,
    chains: Vec<Vec<u64>>,
    /// Per key: servers, most recent first, and the stamp of the last refresh.
    prefix: HashMap<u64, (Vec<ServerTag>, Stamp)>,
    /// Key, value, and whether the value was still indexed after populating
    /// (a full index bucket evicts its oldest slot: a legitimate miss).
    responses: Vec<(ResponseKey, Vec<u8>, bool)>,
    /// Per ring: every record ever pushed into it.
    rings: Vec<(usize, HashSet<Vec<u8>>)>,
    /// Rate-limit buckets: key and the units left at [`LIMIT_NOW`].
    limits: Vec<(u64, u64)>,
    /// The usage table's rows.
    usage: Vec<UsageRow>,
}

/// The rate limits' quota and the instant they are read at (fixed, so the
/// buckets do not refill while a test runs).
const LIMIT_QUOTA: Quota = Quota::per_minute(1000);
const LIMIT_NOW: u64 = 3_600_000_000_000;

fn address(rng: &mut Rng, len: usize) -> String {
    let mut a = String::from("http://");
    while a.len() < len {
        a.push((b'a' + rng.below(26) as u8) as char);
    }
    a.truncate(len);
    a
}

fn populate(seg: &Segment, rng: &mut Rng, sizes: &Sizes) -> Model {
    let t = seg.tables();
    let now = seg.clock().now_ms();

    // Servers: twelve with addresses of many lengths; slot 3 retired and
    // re-registered (generation 2), slot 7 retired.
    let mut servers = Vec::new();
    for (i, len) in [0usize, 1, 7, 8, 9, 63, 64, 65, 128, 200, 255, 256]
        .into_iter()
        .enumerate()
    {
        let a = address(rng, len);
        let s = t.servers.register(1000 + i as u64, &a, now).unwrap();
        assert_eq!(s.slot, i as u16);
        servers.push(ServerModel {
            slot: s.slot,
            live: Some((s, a)),
            retired: None,
        });
    }
    for slot in [3usize, 7] {
        let (s, a) = servers[slot].live.take().unwrap();
        assert!(t.servers.retire(s));
        servers[slot].retired = Some((s, a));
    }
    let a = address(rng, 40);
    let s = t.servers.register(2000, &a, now).unwrap();
    assert_eq!(s, ServerRef { slot: 3, generation: 2 });
    servers[3].live = Some((s, a));
    let live: Vec<ServerRef> = servers.iter().filter_map(|m| m.live.as_ref().map(|l| l.0)).collect();

    // Prefix chains: each gets 1-4 servers, each holding a random leading part.
    let mut chains = Vec::new();
    let mut prefix: HashMap<u64, (Vec<ServerTag>, Stamp)> = HashMap::new();
    for _ in 0..sizes.chains {
        let chain: Vec<u64> = (0..sizes.chain_len).map(|_| rng.next()).collect();
        for _ in 0..1 + rng.below(4) {
            let server = live[rng.index(live.len())];
            let len = 1 + rng.index(chain.len());
            let stamp = Stamp(rng.below(100) as u16);
            t.prefix.insert_chain(&chain[..len], server, stamp);
            for key in &chain[..len] {
                let (list, last) = prefix.entry(*key).or_default();
                list.retain(|tag| tag.slot() != server.slot);
                list.insert(0, server.tag());
                list.truncate(3);
                *last = stamp;
            }
        }
        chains.push(chain);
    }

    // Responses: small and large values; keys 0/1, 2/3... share a low half,
    // keys 0/2 share a high half; some keys written twice.
    let mut responses = Vec::new();
    for i in 0..sizes.responses {
        let lo = if i < 8 { mix(i as u64 / 2) } else { rng.next() };
        let hi = if i < 8 { mix(100 + (i as u64 % 2)) } else { rng.next() };
        let key = ResponseKey((u128::from(hi) << 64) | u128::from(lo));
        let len = if i < sizes.large_responses {
            (16 << 10) + rng.index(32 << 10)
        } else {
            rng.index(sizes.max_response)
        };
        if i % 17 == 0 {
            let older = rng.bytes(len / 2 + 1);
            t.responses.put(key, &older).unwrap();
        }
        let value = rng.bytes(len);
        t.responses.put(key, &value).unwrap();
        responses.push((key, value, true));
    }
    for (key, _, indexed) in &mut responses {
        *indexed = t.responses.get(*key).is_some();
    }
    let evicted = responses.iter().filter(|r| !r.2).count();
    assert!(
        evicted * 20 < responses.len(),
        "{evicted} of {} responses evicted",
        responses.len()
    );

    // Rings: owned by processes that have exited; advanced to different
    // positions (some wrapped) before the records that stay are pushed.
    let mut rings = Vec::new();
    let mut out = Vec::new();
    for i in 0..sizes.rings {
        let ring = t.ring(i);
        let slot = 20 + i as u16;
        let inc = t.registry.claim(slot, Role::Dispatcher, now);
        assert!(t.registry.mark_exited(slot, inc));
        ring.set_owner(slot, inc);
        let mut pushed = HashSet::new();
        for n in 0..i * 53 + sizes.records {
            let mut rec = vec![i as u8, n as u8, (n >> 8) as u8];
            let len = rng.index(sizes.max_record);
            rec.extend(rng.bytes(len));
            ring.push(&rec).unwrap();
            pushed.insert(rec);
            if n < i * 53 {
                assert_eq!(ring.pop(&mut out), Pop::Record);
            }
        }
        rings.push((i, pushed));
    }

    // Rate-limit buckets, each partly used.
    let limits: Vec<(u64, u64)> = (0..40u64)
        .map(|i| {
            let key = rng.next() | 1;
            let used = 1 + i * 20;
            assert!(matches!(
                t.limits.take(key, LIMIT_QUOTA, used, LIMIT_NOW),
                Taken::Allowed(_)
            ));
            (key, 1000 - used)
        })
        .collect();

    // Usage of a few tenants and models.
    for i in 0..24u64 {
        let (kind, name) = if i % 3 == 0 {
            (UsageKind::Model, format!("model-{i}"))
        } else {
            (UsageKind::Tenant, format!("tenant-{i}"))
        };
        assert!(t.usage.add(
            kind,
            &name,
            &[
                (UsageCounter::Requests, i + 1),
                (UsageCounter::PromptTokens, 100 * i + 7)
            ]
        ));
    }
    let usage = t.usage.rows();
    assert_eq!(usage.len(), 24);

    let model = Model {
        servers,
        chains,
        prefix,
        responses,
        rings,
        limits,
        usage,
    };
    // Before any corruption, everything reads back exactly.
    assert_eq!(check(&t, &model, true), Ok(()), "fresh segment differs from the model");
    model
}

// ---------------------------------------------------------------------------
// Reading back

/// Checks every table against the model. `exact`: no corruption happened,
/// so nothing may be missing either.
fn check(t: &Tables<'_>, m: &Model, exact: bool) -> Result<(), String> {
    for (key, want) in &m.prefix {
        match t.prefix.lookup(*key) {
            None if !exact => {}
            None => return Err(format!("prefix {key:#x}: missing")),
            Some(e) => {
                let got: Vec<ServerTag> = e.servers.iter().collect();
                if (&got, e.stamp) != (&want.0, want.1) {
                    return Err(format!("prefix {key:#x}: read {got:?} {:?}, model {want:?}", e.stamp));
                }
            }
        }
    }
    for chain in &m.chains {
        let got = t.prefix.longest_prefix_match(chain, |_| true);
        // The model's match: scanning up to the first key without an entry,
        // each server's deepest block. Corruption can only end the scan
        // earlier, never add a server or a block.
        let mut want: Vec<(ServerTag, u32)> = Vec::new();
        for (i, key) in chain.iter().enumerate() {
            let Some((list, _)) = m.prefix.get(key) else { break };
            for tag in list {
                match want.iter_mut().find(|(t, _)| t == tag) {
                    Some(w) => w.1 = i as u32 + 1,
                    None => want.push((*tag, i as u32 + 1)),
                }
            }
        }
        for (tag, n) in got.iter() {
            let model_n = want.iter().find(|(t, _)| *t == tag).map_or(0, |w| w.1);
            if n > model_n || (exact && n != model_n) {
                let first = chain[0];
                return Err(format!("match of chain {first:#x}: {tag:?} holds {n}, model {model_n}"));
            }
        }
        if exact && got.iter().count() != want.len() {
            let first = chain[0];
            return Err(format!("match of chain {first:#x}: {got:?}, model {want:?}"));
        }
    }
    let mut buf = Vec::new();
    for (key, want, indexed) in &m.responses {
        match t.responses.get_into(*key, &mut buf) {
            None if !exact || !indexed => {}
            None => return Err(format!("response {:#x}: missing", key.0)),
            Some(got) if got == want.as_slice() => {}
            Some(got) => {
                return Err(format!(
                    "response {:#x}: {} bytes read, {} written",
                    key.0,
                    got.len(),
                    want.len()
                ));
            }
        }
    }
    // A bucket reads as it is, or (corrupt) as full: never emptier.
    for (key, left) in &m.limits {
        let got = t.limits.peek(*key, LIMIT_QUOTA, LIMIT_NOW).remaining;
        if got < *left || (exact && got != *left) || got > LIMIT_QUOTA.limit {
            return Err(format!("limit {key:#x}: {got} left, model {left}"));
        }
    }
    // Usage rows read as written, or (corrupt) are missing or have one
    // wrong sum: never a name or kind that was not written.
    let rows = t.usage.rows();
    if exact && rows != m.usage {
        return Err(format!("usage: {rows:?}, model {:?}", m.usage));
    }
    for r in &rows {
        if !m.usage.iter().any(|w| w.kind == r.kind && w.name == r.name) {
            return Err(format!("usage: a row never written: {r:?}"));
        }
    }
    for s in &m.servers {
        let got = t.servers.get(s.slot).map(|i| (i.server, i.address));
        let ok = match (&got, &s.live) {
            (None, None) => true,
            (None, Some(_)) => !exact,
            (Some(g), live) => live.as_ref() == Some(g) || (!exact && s.retired.as_ref() == Some(g)),
        };
        if !ok {
            return Err(format!("server {}: read {got:?}, model {:?}", s.slot, s.live));
        }
    }
    Ok(())
}

/// Pops up to `max` records from each ring as a responder would; every
/// record must be one that was pushed into that ring. Returns the number of
/// records popped.
fn consume(t: &Tables<'_>, m: &Model, max: usize) -> Result<usize, String> {
    let mut popped = 0;
    for (i, pushed) in &m.rings {
        popped += consume_ring(t, *i, pushed, max)?;
    }
    Ok(popped)
}

fn consume_ring(t: &Tables<'_>, i: usize, pushed: &HashSet<Vec<u8>>, max: usize) -> Result<usize, String> {
    let ring = t.ring(i);
    let mut out = Vec::new();
    let mut popped = 0;
    for _ in 0..max {
        match ring.pop(&mut out) {
            Pop::Record if pushed.contains(&out) => popped += 1,
            Pop::Record => return Err(format!("ring {i}: popped {} bytes never pushed", out.len())),
            Pop::Empty => break,
            Pop::Pending => {
                // A corrupt owner word may name a slot beyond the registry:
                // `is_alive` says no (see
                // `corrupt_ring_owner_does_not_panic_the_consumer`).
                if !ring.recover(|slot, inc| t.registry.is_alive(slot, inc)) {
                    break;
                }
            }
        }
    }
    Ok(popped)
}

/// Words that are non-zero in the table regions: where the data is.
fn populated_words(seg: &Segment) -> Vec<usize> {
    let words = seg.raw_words();
    table_words(seg)
        .filter(|i| words[*i].load(Ordering::Relaxed) != 0)
        .collect()
}

// ---------------------------------------------------------------------------
// The random sweep

fn random_sweep(backing: &str) {
    let mut rng = Rng(SEED ^ backing.len() as u64);
    let mut guards = Vec::new();
    let (mut flips, mut popped) = (0u64, 0usize);
    for epoch in 0..EPOCHS {
        let seg = fresh(backing, &mut guards);
        let t = seg.tables();
        let model = populate(&seg, &mut rng, &FULL);
        let populated = populated_words(&seg);
        let all = table_words(&seg);
        for round in 0..ROUNDS {
            for _ in 0..1 + rng.below(4) {
                let word = if rng.below(2) == 0 {
                    populated[rng.index(populated.len())]
                } else {
                    all.start + rng.index(all.len())
                };
                flip(&seg, word, pattern(&mut rng));
                flips += 1;
            }
            let at = format!("{backing}, epoch {epoch}, round {round}");
            check(&t, &model, false).unwrap_or_else(|e| panic!("{at}: {e}"));
            popped += consume(&t, &model, 1).unwrap_or_else(|e| panic!("{at}: {e}"));
        }
        // A full scan: every decodable entry of a model key is exact.
        for (key, entry) in t.prefix.entries() {
            if let Some(want) = model.prefix.get(&key) {
                let got: Vec<ServerTag> = entry.servers.iter().collect();
                assert_eq!(
                    (&got, entry.stamp),
                    (&want.0, want.1),
                    "{backing}, epoch {epoch}: entries() {key:#x}"
                );
            }
        }
        assert!(t.prefix.occupancy() <= t.prefix.capacity());
        popped += consume(&t, &model, 10_000).unwrap_or_else(|e| panic!("{backing}, epoch {epoch}: {e}"));
    }
    eprintln!("bitflip {backing}: {flips} flips over {EPOCHS} segments, {popped} ring records popped and verified");
}

#[test]
fn random_flips_read_as_misses_heap() {
    random_sweep("heap");
}

#[test]
fn random_flips_read_as_misses_shm() {
    random_sweep("shm");
}

// ---------------------------------------------------------------------------
// Targeted sweeps: every bit of a few populated entries

const SMALL: Sizes = Sizes {
    chains: 3,
    chain_len: 4,
    responses: 6,
    large_responses: 0,
    rings: 3,
    records: 3,
    max_response: 40,
    max_record: 100,
};

/// Flips every bit of each word in `words`, one at a time, checking the
/// tables after each flip, and restores it.
fn every_bit(seg: &Segment, m: &Model, words: &[usize], what: &str, backing: &str) {
    let t = seg.tables();
    for &w in words {
        for bit in 0..64 {
            flip(seg, w, 1 << bit);
            check(&t, m, false).unwrap_or_else(|e| panic!("{backing}: {what}, word {w} bit {bit}: {e}"));
            flip(seg, w, 1 << bit);
        }
    }
    assert_eq!(
        check(&t, m, true),
        Ok(()),
        "{backing}: {what}: restored segment differs"
    );
    eprintln!("bitflip {backing}: every bit of {} {what} words flipped", words.len());
}

#[test]
fn every_bit_of_limit_slots() {
    on_both_backings("limits", |seg, backing| {
        let m = populate(seg, &mut Rng(SEED), &SMALL);
        let words: Vec<usize> = populated_words(seg)
            .into_iter()
            .filter(|w| region_words(seg, RegionKind::Limits).contains(w))
            .collect();
        assert_eq!(words.len(), 2 * m.limits.len(), "two words per slot");
        every_bit(seg, &m, &words, "limit slot", backing);
    });
}

#[test]
fn every_bit_of_usage_entries() {
    on_both_backings("usage", |seg, backing| {
        let m = populate(seg, &mut Rng(SEED), &SMALL);
        let words: Vec<usize> = populated_words(seg)
            .into_iter()
            .filter(|w| region_words(seg, RegionKind::Usage).contains(w))
            .collect();
        assert!(
            words.len() >= 4 * m.usage.len(),
            "key, meta, name and counters of each entry"
        );
        every_bit(seg, &m, &words, "usage entry", backing);
    });
}

#[test]
fn every_bit_of_prefix_slots() {
    on_both_backings("prefix", |seg, backing| {
        let sizes = Sizes { chains: 12, ..SMALL };
        let m = populate(seg, &mut Rng(SEED), &sizes);
        let words: Vec<usize> = populated_words(seg)
            .into_iter()
            .filter(|w| region_words(seg, RegionKind::Prefix).contains(w))
            .collect();
        assert_eq!(words.len(), 2 * m.prefix.len(), "two words per slot");
        every_bit(seg, &m, &words, "prefix slot", backing);
    });
}

#[test]
fn every_bit_of_response_records_and_index_slots() {
    on_both_backings("responses", |seg, backing| {
        let m = populate(seg, &mut Rng(SEED), &SMALL);
        let log = region_words(seg, RegionKind::ResponseLog);
        let index = region_words(seg, RegionKind::ResponseIndex);
        // The log's control block (its first 32 words: tail and counters)
        // and every record and index slot.
        let words: Vec<usize> = populated_words(seg)
            .into_iter()
            .filter(|w| log.contains(w) || index.contains(w))
            .collect();
        assert!(words.len() > 6 * 6, "{} populated words", words.len());
        every_bit(seg, &m, &words, "response log or index", backing);
    });
}

#[test]
fn every_bit_of_server_slots() {
    on_both_backings("servers", |seg, backing| {
        let m = populate(seg, &mut Rng(SEED), &SMALL);
        let servers = region_words(seg, RegionKind::Servers);
        // State, id, address meta, registered time and the address words of
        // every slot (in-flight counters and load figures are plain numbers).
        let words: Vec<usize> = (0..12)
            .flat_map(|slot| {
                let base = servers.start + slot * 48;
                (base..base + 4).chain(base + 16..base + 48)
            })
            .collect();
        let t = seg.tables();
        for &w in &words {
            for bit in 0..64 {
                flip(seg, w, 1 << bit);
                for s in &m.servers {
                    let got = t.servers.get(s.slot).map(|i| (i.server, i.address));
                    // The address (what routing uses) is checked; see
                    // `server_slot_state_and_id_are_not_checked` for the rest.
                    let ok = got.is_none() || got == s.live || got == s.retired;
                    assert!(ok, "{backing}: word {w} bit {bit}: server {} read {got:?}", s.slot);
                }
                flip(seg, w, 1 << bit);
            }
        }
        assert_eq!(check(&t, &m, true), Ok(()));
        eprintln!(
            "bitflip {backing}: every bit of {} server-slot words flipped",
            words.len()
        );
    });
}

#[test]
fn every_bit_of_ring_records_and_positions() {
    on_both_backings("rings", |seg, backing| {
        let mut rng = Rng(SEED);
        let m = populate(seg, &mut rng, &SMALL);
        let t = seg.tables();
        let cap = seg.header().region(RegionKind::Rings).param;
        let mut flipped = 0;
        for (i, pushed) in &m.rings {
            let base = ring_base(seg, *i);
            let ring_words = (base / 8) as usize..((base + 256 + cap) / 8) as usize;
            let saved: Vec<u64> = ring_words
                .clone()
                .map(|w| seg.raw_words()[w].load(Ordering::Relaxed))
                .collect();
            // Consuming writes only the control block: restore it, and
            // flip back a flipped data word.
            let restore = |flipped: usize, pattern: u64| {
                for (w, v) in ring_words.clone().zip(&saved).take(256 / 8) {
                    seg.raw_words()[w].store(*v, Ordering::Relaxed);
                }
                if flipped >= ring_words.start + 256 / 8 {
                    flip(seg, flipped, pattern);
                }
            };
            // Head and tail, then every word of the records not yet popped.
            let mut words = vec![((base + RING_TAIL) / 8) as usize, ((base + RING_HEAD) / 8) as usize];
            let head = saved[(RING_HEAD / 8) as usize];
            let tail = saved[(RING_TAIL / 8) as usize];
            let data = ((base + 256) / 8) as usize;
            words.extend((head..tail).step_by(8).map(|p| data + ((p % cap) / 8) as usize));
            flipped += words.len();
            for &w in &words {
                for bit in 0..64 {
                    flip(seg, w, 1 << bit);
                    consume_ring(&t, *i, pushed, 100)
                        .unwrap_or_else(|e| panic!("{backing}: ring {i} word {w} bit {bit}: {e}"));
                    restore(w, 1 << bit);
                }
            }
            // Pairs of adjacent bits too: they move a position by 24 bytes,
            // which single flips of a 32-byte aligned position never do.
            for &w in &words[..2] {
                for bit in 0..63 {
                    flip(seg, w, 3 << bit);
                    consume_ring(&t, *i, pushed, 100)
                        .unwrap_or_else(|e| panic!("{backing}: ring {i} word {w} bits {bit}+1: {e}"));
                    restore(w, 3 << bit);
                }
            }
        }
        assert_eq!(consume(&t, &m, 100), Ok(m.rings.len() * SMALL.records));
        eprintln!("bitflip {backing}: every bit of {flipped} ring words flipped");
    });
}

// ---------------------------------------------------------------------------
// The header

#[test]
fn corrupt_header_fails_open_with_an_error() {
    let name = unique_name("header");
    let _guard = ShmGuard(name.clone());
    let seg = Segment::create(&name, &plan()).unwrap();
    let t = seg.tables();
    let server = t.servers.register(1, "http://10.0.0.1:8000", 0).unwrap();
    t.prefix.insert(42, server, Stamp(1));
    drop(Segment::open(&name).expect("an intact segment opens"));
    let mut rng = Rng(SEED);
    let mut errors: HashMap<String, u64> = HashMap::new();
    let mut attempt = |word: usize, pattern: u64| {
        flip(&seg, word, pattern);
        match Segment::open(&name) {
            Ok(_) => panic!("open accepted a header with word {word} ^ {pattern:#x}"),
            Err(e) => {
                let kind = format!("{e:?}");
                *errors
                    .entry(kind[..kind.find([' ', '{']).unwrap_or(kind.len())].to_owned())
                    .or_default() += 1;
            }
        }
        flip(&seg, word, pattern);
    };
    for word in 0..HEADER_BYTES / 8 {
        for bit in 0..64 {
            attempt(word, 1 << bit);
        }
    }
    for _ in 0..500 {
        attempt(rng.index(HEADER_BYTES / 8), pattern(&mut rng));
    }
    eprintln!("header corruption refused as {errors:?}");
    // The rest of the header page is reserved: flips there are ignored.
    for word in HEADER_BYTES / 8..4096 / 8 {
        flip(&seg, word, pattern(&mut rng));
    }
    let again = Segment::open(&name).expect("reserved header bytes are ignored");
    assert_eq!(again.header(), seg.header());
    let entry = again.tables().prefix.lookup(42).expect("the table survived");
    assert_eq!(entry.servers.iter().next(), Some(server.tag()));
}

// ---------------------------------------------------------------------------
// Minimal reproductions of shm-layout defects found by this sweep

/// `Registry::is_alive(slot, _)` indexes its slots without a bounds check,
/// and `CompletionRing::owner()` returns whatever 16 bits the owner word
/// holds: one flipped bit of a ring's control block makes the documented
/// consumer protocol (`pop` → `Pending` → `is_alive(ring.owner())`) panic,
/// so a responder crash-loops on a corrupt ring.
#[test]
fn corrupt_ring_owner_does_not_panic_the_consumer() {
    on_both_backings("owner", |seg, _| {
        let t = seg.tables();
        let ring = t.ring(0);
        let inc = t.registry.claim(1, Role::Dispatcher, 0);
        ring.set_owner(1, inc);
        ring.push(b"in flight").unwrap();
        // The producer died between reserving and committing.
        let data = ((ring_base(seg, 0) + 256) / 8) as usize;
        seg.raw_words()[data].store(0, Ordering::Relaxed);
        assert!(t.registry.mark_exited(1, inc));
        flip(seg, ((ring_base(seg, 0) + RING_OWNER) / 8) as usize, 1 << 9);
        let mut out = Vec::new();
        assert_eq!(ring.pop(&mut out), Pop::Pending);
        let (slot, inc) = ring.owner();
        assert!(
            !t.registry.is_alive(slot, inc),
            "a slot beyond the registry is not alive"
        );
        assert!(ring.recover(|slot, inc| t.registry.is_alive(slot, inc)));
        assert_eq!(ring.pop(&mut out), Pop::Empty);
    });
}

/// A head that is not 32-byte aligned (two flipped bits) points inside a
/// record, where the header words may lie past the ring's end: the skip of
/// abandoned records (now `CompletionRing::recover`) used to index out of
/// bounds there. `pop` and `recover` now treat a misaligned head as
/// corruption and discard what is pending.
#[test]
fn corrupt_ring_head_does_not_panic_recover() {
    on_both_backings("head", |seg, _| {
        let t = seg.tables();
        let ring = t.ring(0);
        let cap = ring.stats().capacity;
        let mut out = Vec::new();
        // Move head and tail to the last 32 bytes of the ring.
        for _ in 0..cap / 32 - 1 {
            ring.push(b"").unwrap();
            assert_eq!(ring.pop(&mut out), Pop::Record);
        }
        ring.push(b"").unwrap();
        // head = cap - 32, flipped to cap - 8: a position inside a record.
        flip(seg, ((ring_base(seg, 0) + RING_HEAD) / 8) as usize, 0b11000);
        // `pop` treats a misaligned head as corruption and discards what is
        // pending (it used to report `Pending` and leave it to `recover`).
        assert_ne!(ring.pop(&mut out), Pop::Record);
        flip(seg, ((ring_base(seg, 0) + RING_HEAD) / 8) as usize, 0b11000);
        // The owner (never set: slot 0, incarnation 0) is not alive.
        assert!(!t.registry.is_alive(0, 0));
        ring.recover(|slot, inc| t.registry.is_alive(slot, inc));
        assert_ne!(ring.pop(&mut out), Pop::Record);
    });
}

/// `CompletionRing::push` computes `t + gap + size - h`, which overflows if
/// `head` is ahead of `tail`: a panic in debug builds, a spurious `Full` (a
/// dropped record) in release. Loading `head` first (the fix for the
/// multi-producer race in `shm_torture.rs`) keeps that from happening
/// between live processes, but one flipped bit of either word still makes
/// every later push of that ring panic.
#[test]
fn push_after_corrupt_ring_positions_does_not_panic() {
    on_both_backings("push", |seg, _| {
        let t = seg.tables();
        let ring = t.ring(0);
        let mut out = Vec::new();
        ring.push(&[7; 100]).unwrap();
        assert_eq!(ring.pop(&mut out), Pop::Record);
        // tail 160 -> 32: now below head.
        flip(seg, ((ring_base(seg, 0) + RING_TAIL) / 8) as usize, 128);
        let _ = ring.push(b"after");
        assert_ne!(ring.pop(&mut out), Pop::Record);
    });
}

/// A server slot's keyed check covers the address bytes and generation but
/// not the state byte, the id or the registration time: one flipped bit
/// brings a retired server back as `Up` (routable), takes a live one
/// `Down`, or changes its id, and `get()` returns that as valid.
#[test]
fn server_slot_state_and_id_are_not_checked() {
    on_both_backings("state", |seg, _| {
        let t = seg.tables();
        let a = t.servers.register(11, "http://10.0.0.1:8000", 5).unwrap();
        let b = t.servers.register(12, "http://10.0.0.2:8000", 6).unwrap();
        assert!(t.servers.retire(b));
        let servers = region_words(seg, RegionKind::Servers).start;
        // Slot b: state Free (0) -> Up (2).
        flip(seg, servers + 48 * usize::from(b.slot), 2);
        assert_eq!(
            t.servers.get(b.slot).map(|i| i.state),
            None,
            "a retired server came back"
        );
        flip(seg, servers + 48 * usize::from(b.slot), 2);
        // Slot a: id 11 -> 15.
        flip(seg, servers + 48 * usize::from(a.slot) + 1, 4);
        assert!(
            t.servers.get(a.slot).is_none_or(|i| i.id == 11),
            "a wrong id read as valid"
        );
        // Slot a: state Up (2) -> Down (4) is read as valid too.
        flip(seg, servers + 48 * usize::from(a.slot), 6);
        assert!(
            t.servers.get(a.slot).is_none_or(|i| i.state == ServerState::Up),
            "a wrong state read as valid"
        );
    });
}
