//! Property tests of the tables against simple models, on random operation
//! sequences:
//!
//! * **Prefix table vs `HashMap<key, (MRU list of ≤ 3 servers, stamp)>`.**
//!   The table may *forget* a key (a full bucket evicts its stalest entry),
//!   but a key it still has always holds exactly the model's servers, in the
//!   model's order, with the model's stamp; it never invents or resurrects a
//!   key, an insert's outcome is the one the model predicts, exactly one key
//!   is forgotten per `Evicted`, and `longest_prefix_match` equals the same
//!   computation (deepest listing per server) over the model. With few keys in a big table nothing is
//!   ever forgotten.
//! * **Response log vs `HashMap<key, latest bytes>`.** A get returns `None`
//!   or exactly the latest value put under that key — never an older one,
//!   never another key's; the value just put is always readable; the values
//!   readable at once never exceed the log's capacity; over-large values are
//!   refused without disturbing the old value. With a log large enough for
//!   the whole sequence every latest value is present.
//! * **Completion ring vs `VecDeque` with a capacity.** Records come out in
//!   FIFO order, byte for byte; a push is dropped exactly when the model
//!   (32-byte aligned records that never straddle the ring's end, the gap at
//!   the end skipped) has no room for it, so nothing accepted is ever lost
//!   or reordered; the counters agree with the model.

mod shm_support;

use std::collections::{HashMap, VecDeque};

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use shm_layout::{
    InsertOutcome, LayoutPlan, MATCH_CAPACITY, PlanOptions, Pop, PrefixTable, PushError, PutError, ResponseKey,
    ResponseLog, Segment, ServerRef, ServerTag, Stamp,
};
use shm_support::{SMALL, small_plan};

const PHI: u64 = 0x9e37_79b9_7f4a_7c15;

fn spread(i: u64) -> u64 {
    (i + 1).wrapping_mul(PHI)
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        ..ProptestConfig::default()
    }
}

// ───────────────────────────── prefix table ─────────────────────────────

#[derive(Debug, Clone)]
enum PrefixOp {
    Insert {
        key: usize,
        server: ServerRef,
        advance: u16,
    },
    Remove {
        key: usize,
        server: ServerRef,
    },
    Match {
        chain: Vec<usize>,
        dead_slot: Option<u16>,
    },
}

/// A few slots with a few generations; generation 65 has the same 6-bit tag
/// as generation 1, as a slot reused 64 times would.
fn server() -> impl Strategy<Value = ServerRef> {
    (0..5u16, prop::sample::select(vec![1u32, 2, 3, 65])).prop_map(|(slot, generation)| ServerRef { slot, generation })
}

fn prefix_op(keys: usize) -> impl Strategy<Value = PrefixOp> {
    prop_oneof![
        6 => (0..keys, server(), 0..3u16).prop_map(|(key, server, advance)| PrefixOp::Insert { key, server, advance }),
        2 => (0..keys, server()).prop_map(|(key, server)| PrefixOp::Remove { key, server }),
        2 => (prop::collection::vec(0..keys, 0..7), prop::option::of(0..5u16))
            .prop_map(|(chain, dead_slot)| PrefixOp::Match { chain, dead_slot }),
    ]
}

/// key → (servers, most recent first, at most 3; stamp of the last refresh).
#[derive(Debug, Default)]
struct PrefixModel {
    map: HashMap<u64, (Vec<ServerTag>, Stamp)>,
}

impl PrefixModel {
    /// Applies an insert; returns the outcome the table must report, or
    /// `None` for a new key (`Inserted`, or `Evicted` if its bucket was full).
    fn insert(&mut self, key: u64, tag: ServerTag, now: Stamp) -> Option<InsertOutcome> {
        match self.map.get_mut(&key) {
            Some((servers, stamp)) => {
                if servers.first() == Some(&tag) && *stamp == now {
                    return Some(InsertOutcome::Unchanged);
                }
                servers.retain(|s| s.slot() != tag.slot());
                servers.insert(0, tag);
                servers.truncate(3);
                *stamp = now;
                Some(InsertOutcome::Refreshed)
            }
            None => {
                self.map.insert(key, (vec![tag], now));
                None
            }
        }
    }

    fn remove(&mut self, key: u64, tag: ServerTag) -> bool {
        let Some((servers, _)) = self.map.get_mut(&key) else {
            return false;
        };
        let Some(i) = servers.iter().position(|s| *s == tag) else {
            return false;
        };
        servers.remove(i);
        if servers.is_empty() {
            self.map.remove(&key);
        }
        true
    }

    /// The table's documented semantics, computed on the model: walk the
    /// chain until the first key the model lacks; a live server listed for
    /// block `i` holds `i + 1` leading blocks (its deepest listing counts).
    /// At most `MATCH_CAPACITY` servers, the shallowest giving way when full.
    fn longest_prefix_match(&self, chain: &[u64], live: impl Fn(ServerTag) -> bool) -> Vec<(ServerTag, u32)> {
        let mut out: Vec<(ServerTag, u32)> = Vec::new();
        for (i, key) in chain.iter().enumerate() {
            let Some((servers, _)) = self.map.get(key) else { break };
            let depth = i as u32 + 1;
            for t in servers.iter().filter(|t| live(**t)) {
                if let Some(e) = out.iter_mut().find(|(s, _)| s == t) {
                    e.1 = depth;
                } else if out.len() < MATCH_CAPACITY {
                    out.push((*t, depth));
                } else if let Some(e) = out.iter_mut().min_by_key(|(_, n)| *n).filter(|(_, n)| *n < depth) {
                    *e = (*t, depth);
                }
            }
        }
        out
    }
}

fn sorted(mut m: Vec<(ServerTag, u32)>) -> Vec<(ServerTag, u32)> {
    m.sort_by_key(|(t, n)| (t.slot(), t.gen_tag(), *n));
    m
}

/// Compares every key of the universe with the model. A key the table lost
/// is dropped from the model (allowed only if `may_forget`); returns how
/// many were lost.
fn sync_prefix(
    table: &PrefixTable<'_>,
    model: &mut PrefixModel,
    keys: &[u64],
    may_forget: bool,
) -> Result<usize, TestCaseError> {
    let mut forgotten = 0;
    for key in keys {
        match (table.lookup(*key), model.map.get(key)) {
            (None, None) => {}
            (Some(e), Some((servers, stamp))) => {
                prop_assert_eq!(
                    &e.servers.iter().collect::<Vec<_>>(),
                    servers,
                    "servers of key {:#x}",
                    key
                );
                prop_assert_eq!(e.stamp, *stamp, "stamp of key {:#x}", key);
            }
            (None, Some(_)) => {
                prop_assert!(may_forget, "key {:#x} was forgotten by a table with room to spare", key);
                model.map.remove(key);
                forgotten += 1;
            }
            (Some(e), None) => prop_assert!(false, "key {:#x} is in the table ({:?}) but not the model", key, e),
        }
    }
    Ok(forgotten)
}

fn run_prefix(keys: &[u64], ops: &[PrefixOp], start: Stamp, may_forget: bool) -> Result<(), TestCaseError> {
    let seg = Segment::heap(&small_plan());
    let table = seg.tables().prefix;
    let mut model = PrefixModel::default();
    let mut now = start;
    for op in ops {
        match op {
            PrefixOp::Insert { key, server, advance } => {
                now = Stamp(now.0.wrapping_add(*advance));
                let (key, tag) = (keys[*key], server.tag());
                let expected = model.insert(key, tag, now);
                let outcome = table.insert(key, *server, now);
                match expected {
                    Some(e) => prop_assert_eq!(outcome, e, "insert of present key {:#x}", key),
                    None if may_forget => prop_assert!(
                        matches!(outcome, InsertOutcome::Inserted | InsertOutcome::Evicted),
                        "insert of new key {:#x}: {:?}",
                        key,
                        outcome
                    ),
                    None => prop_assert_eq!(outcome, InsertOutcome::Inserted, "insert of new key {:#x}", key),
                }
                prop_assert!(
                    table.lookup(key).is_some(),
                    "key {:#x} gone right after its insert",
                    key
                );
                let forgotten = sync_prefix(&table, &mut model, keys, may_forget)?;
                let evicted = usize::from(outcome == InsertOutcome::Evicted);
                prop_assert_eq!(forgotten, evicted, "keys lost by {:?}", outcome);
            }
            PrefixOp::Remove { key, server } => {
                let key = keys[*key];
                prop_assert_eq!(
                    table.remove(key, server.tag()),
                    model.remove(key, server.tag()),
                    "remove"
                );
                prop_assert_eq!(
                    sync_prefix(&table, &mut model, keys, may_forget)?,
                    0,
                    "remove lost keys"
                );
            }
            PrefixOp::Match { chain, dead_slot } => {
                let chain: Vec<u64> = chain.iter().map(|i| keys[*i]).collect();
                let live = |t: ServerTag| Some(t.slot()) != *dead_slot;
                let got = table.longest_prefix_match(&chain, live);
                let want = model.longest_prefix_match(&chain, live);
                prop_assert_eq!(sorted(got.iter().collect()), sorted(want.clone()), "chain {:x?}", chain);
                prop_assert_eq!(got.is_empty(), want.is_empty());
                match got.best() {
                    Some((t, n)) => {
                        prop_assert_eq!(Some(n), want.iter().map(|(_, n)| *n).max());
                        prop_assert_eq!(got.blocks_for(t), n);
                    }
                    None => prop_assert!(want.is_empty()),
                }
            }
        }
    }
    // One full scan (slow in debug builds): no slot holds anything but the
    // model's entries.
    let mut found: Vec<u64> = table.entries().map(|(k, _)| k).collect();
    found.sort_unstable();
    let mut want: Vec<u64> = model.map.keys().copied().collect();
    want.sort_unstable();
    prop_assert_eq!(found, want, "keys found by a full scan");
    Ok(())
}

/// 24 well-spread keys in a table of ~200 K slots: nothing is ever evicted.
fn roomy_prefix_keys() -> Vec<u64> {
    (0..24).map(spread).collect()
}

/// Small integers: the table indexes buckets by the high bits of the key,
/// so these all compete for one 4-slot bucket and evictions are constant.
fn crowded_prefix_keys() -> Vec<u64> {
    (1..=12).collect()
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn prefix_table_matches_the_model_exactly_when_roomy(
        ops in prop::collection::vec(prefix_op(24), 1..120),
        start in any::<u16>(),
    ) {
        run_prefix(&roomy_prefix_keys(), &ops, Stamp(start), false)?;
    }

    #[test]
    fn prefix_table_forgets_but_never_lies_when_crowded(
        ops in prop::collection::vec(prefix_op(12), 1..120),
        start in any::<u16>(),
    ) {
        run_prefix(&crowded_prefix_keys(), &ops, Stamp(start), true)?;
    }
}

// ───────────────────────────── response log ─────────────────────────────

#[derive(Debug, Clone)]
enum LogOp {
    Put { key: usize, len: usize },
    Get { key: usize },
}

/// A value unique to `seq` (for lengths of 8 and more; shorter values of
/// different puts may coincide, which only weakens the check). Filled a
/// word at a time: debug builds are slow enough per byte.
fn value(seq: u64, len: usize) -> Vec<u8> {
    let x = spread(seq);
    let mut v = vec![0u8; len];
    for (i, chunk) in v.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&(x ^ (i as u64).wrapping_mul(PHI << 1)).to_le_bytes()[..chunk.len()]);
    }
    v
}

/// Record bytes in the log: five header words and the value in words.
fn record_bytes(len: usize) -> u64 {
    40 + len.div_ceil(8) as u64 * 8
}

struct LogModel {
    latest: HashMap<usize, Vec<u8>>,
    older: HashMap<usize, Vec<Vec<u8>>>,
    puts: u64,
    refused: u64,
}

/// Checks `get(key)` against the model; returns whether it was a hit.
fn check_get(log: &ResponseLog<'_>, model: &LogModel, keys: &[ResponseKey], k: usize) -> Result<bool, TestCaseError> {
    let Some(got) = log.get(keys[k]) else {
        return Ok(false);
    };
    let Some(latest) = model.latest.get(&k) else {
        return Err(TestCaseError::fail(format!(
            "key {k} was never put but get returned {} bytes",
            got.len()
        )));
    };
    if got != *latest {
        let older = model.older.get(&k).is_some_and(|o| o.contains(&got));
        let other = model.latest.iter().any(|(j, v)| *j != k && *v == got);
        return Err(TestCaseError::fail(format!(
            "key {k}: get returned {} bytes that are not the latest value ({} bytes); \
             an older value of this key: {older}; another key's value: {other}",
            got.len(),
            latest.len()
        )));
    }
    Ok(true)
}

/// Runs `ops`; with `roomy` every latest value must stay readable.
fn run_log(plan: &LayoutPlan, keys: &[ResponseKey], ops: &[LogOp], roomy: bool) -> Result<(), TestCaseError> {
    let seg = Segment::heap(plan);
    let log = seg.tables().responses;
    let cap = log.stats().capacity;
    let mut model = LogModel {
        latest: HashMap::new(),
        older: HashMap::new(),
        puts: 0,
        refused: 0,
    };
    for (seq, op) in ops.iter().enumerate() {
        match *op {
            LogOp::Put { key, len } => {
                let v = value(seq as u64, len);
                match log.put(keys[key], &v) {
                    Ok(()) => {
                        prop_assert!(len <= log.max_value(), "accepted {} > {}", len, log.max_value());
                        model.puts += 1;
                        if let Some(old) = model.latest.insert(key, v) {
                            model.older.entry(key).or_default().push(old);
                        }
                        prop_assert!(
                            check_get(&log, &model, keys, key)?,
                            "key {} unreadable right after its put",
                            key
                        );
                    }
                    Err(PutError::TooLarge { len: l, max }) => {
                        prop_assert_eq!((l, max), (len, log.max_value()));
                        prop_assert!(len > max, "refused {} <= {}", len, max);
                        model.refused += 1;
                    }
                }
            }
            LogOp::Get { key } => {
                let hit = check_get(&log, &model, keys, key)?;
                if roomy && model.latest.contains_key(&key) {
                    prop_assert!(hit, "key {} lost in a log with room for everything", key);
                }
            }
        }
    }
    let mut live_bytes = 0;
    for k in 0..keys.len() {
        if check_get(&log, &model, keys, k)? {
            live_bytes += record_bytes(model.latest[&k].len());
        } else {
            prop_assert!(
                !roomy || !model.latest.contains_key(&k),
                "key {} lost in a roomy log",
                k
            );
        }
    }
    prop_assert!(
        live_bytes <= cap,
        "{} bytes readable from a {}-byte log",
        live_bytes,
        cap
    );
    let s = log.stats();
    prop_assert_eq!((s.records, s.refused, s.unindexed), (model.puts, model.refused, 0));
    Ok(())
}

/// Keys with distinct, well-spread low halves (the index is keyed by the
/// low half), some with a high half too.
fn roomy_log_keys() -> Vec<ResponseKey> {
    (0..12u64)
        .map(|i| ResponseKey(u128::from(spread(i)) | u128::from(i % 3) << 64))
        .collect()
}

/// Small low halves (one index bucket for all: index evictions), and pairs
/// sharing a low half with different high halves (one index slot per pair).
fn crowded_log_keys() -> Vec<ResponseKey> {
    let mut keys: Vec<ResponseKey> = (1..=7u128).map(ResponseKey).collect();
    keys.push(ResponseKey(1 | 1 << 64));
    keys.push(ResponseKey(2 | 5 << 100));
    keys.push(ResponseKey(u128::MAX));
    keys
}

fn log_op(keys: usize, len: impl Strategy<Value = usize>) -> impl Strategy<Value = LogOp> {
    prop_oneof![
        3 => (0..keys, len).prop_map(|(key, len)| LogOp::Put { key, len }),
        2 => (0..keys).prop_map(|key| LogOp::Get { key }),
    ]
}

/// A plan whose response log takes values of up to half of it, so a few
/// puts lap the ~3 MiB log.
fn lapping_plan() -> LayoutPlan {
    LayoutPlan::new(
        SMALL,
        PlanOptions {
            max_response_fraction: 0.5,
        },
    )
    .unwrap()
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn response_log_keeps_every_latest_value_when_roomy(
        ops in prop::collection::vec(log_op(12, prop_oneof![
            8 => 0..2048usize,
            1 => Just(usize::MAX), // replaced by max_value + 1 below: refused
        ]), 1..80),
    ) {
        let plan = small_plan();
        let max = Segment::heap(&plan).tables().responses.max_value();
        let ops: Vec<LogOp> = ops
            .into_iter()
            .map(|op| match op {
                LogOp::Put { key, len: usize::MAX } => LogOp::Put { key, len: max + 1 },
                op => op,
            })
            .collect();
        run_log(&plan, &roomy_log_keys(), &ops, true)?;
    }
}

proptest! {
    // Each case moves megabytes through the log; debug builds make that the
    // slowest property here, hence fewer cases.
    #![proptest_config(config(16))]

    #[test]
    fn response_log_never_returns_a_stale_value_when_lapping(
        ops in prop::collection::vec(log_op(10, prop_oneof![
            3 => 0..300usize,
            2 => 1_000..40_000usize,
            2 => 150_000..900_000usize,
        ]), 1..32),
    ) {
        // Two 1.25 MiB puts of one key (the second replaces the first) bring
        // the ~3.3 MiB log close to its first lap, so the random part laps
        // it in most cases.
        let mut all = vec![LogOp::Put { key: 9, len: 5 << 18 }; 2];
        all.extend(ops);
        run_log(&lapping_plan(), &crowded_log_keys(), &all, false)?;
    }
}

// ──────────────────────────── completion ring ───────────────────────────

#[derive(Debug, Clone)]
enum RingOp {
    Push { len: usize },
    Pop,
}

fn ring_op() -> impl Strategy<Value = RingOp> {
    prop_oneof![
        5 => prop_oneof![
            4 => 0..64usize,
            4 => 64..1_500usize,
            2 => 1_500..=4_064usize, // 4064 = max_record of a 16 KiB ring
            1 => 4_065..4_200usize,
        ].prop_map(|len| RingOp::Push { len }),
        3 => Just(RingOp::Pop),
    ]
}

/// The ring as a queue of `(logical position, bytes)` between `head` and
/// `tail`, laid out by the documented rule.
struct RingModel {
    queue: VecDeque<(u64, Vec<u8>)>,
    head: u64,
    tail: u64,
    cap: u64,
}

fn ring_record_size(len: usize) -> u64 {
    (32 + len as u64).div_ceil(32) * 32
}

impl RingModel {
    /// Where a record of `len` bytes would start, if it fits.
    fn place(&self, len: usize) -> Option<u64> {
        let size = ring_record_size(len);
        let gap = if self.tail % self.cap + size > self.cap {
            self.cap - self.tail % self.cap
        } else {
            0
        };
        (self.tail + gap + size - self.head <= self.cap).then_some(self.tail + gap)
    }
}

proptest! {
    #![proptest_config(config(128))]

    #[test]
    fn completion_ring_is_a_bounded_fifo(
        ring_index in 0..64usize,
        ops in prop::collection::vec(ring_op(), 1..200),
    ) {
        let seg = Segment::heap(&small_plan());
        let ring = seg.tables().ring(ring_index);
        let cap = ring.stats().capacity;
        let max = ring.max_record();
        prop_assert_eq!((cap, max), (16 << 10, 4064));
        let mut model = RingModel { queue: VecDeque::new(), head: 0, tail: 0, cap };
        let (mut pushed, mut dropped) = (0u64, 0u64);
        let mut out = Vec::new();
        for (seq, op) in ops.iter().enumerate() {
            match *op {
                RingOp::Push { len } => {
                    let rec = value(seq as u64, len);
                    let result = ring.push(&rec);
                    if len > max {
                        prop_assert_eq!(result, Err(PushError::TooLarge { len, max }));
                        dropped += 1;
                    } else if let Some(pos) = model.place(len) {
                        prop_assert_eq!(result, Ok(()), "push of {} B with {} B used", len, model.tail - model.head);
                        model.tail = pos + ring_record_size(len);
                        model.queue.push_back((pos, rec));
                        pushed += 1;
                    } else {
                        prop_assert_eq!(result, Err(PushError::Full), "push of {} B with {} B used", len, model.tail - model.head);
                        dropped += 1;
                    }
                }
                RingOp::Pop => match model.queue.pop_front() {
                    Some((pos, rec)) => {
                        prop_assert_eq!(ring.pop(&mut out), Pop::Record);
                        prop_assert_eq!(&out, &rec, "record at {} ({} B)", pos, rec.len());
                        model.head = pos + ring_record_size(rec.len());
                    }
                    None => prop_assert_eq!(ring.pop(&mut out), Pop::Empty),
                },
            }
            let s = ring.stats();
            prop_assert_eq!((s.pushed, s.dropped, s.used), (pushed, dropped, model.tail - model.head));
            prop_assert_eq!((s.skipped, s.corrupt), (0, 0));
            prop_assert!(s.used <= cap);
        }
        // Drain: whatever was accepted comes out, in order.
        while let Some((_, rec)) = model.queue.pop_front() {
            prop_assert_eq!(ring.pop(&mut out), Pop::Record);
            prop_assert_eq!(&out, &rec);
        }
        prop_assert_eq!(ring.pop(&mut out), Pop::Empty);
    }
}

// ───────────────────────────── stats region ─────────────────────────────

proptest! {
    #![proptest_config(config(64))]

    /// Stats vs a `HashMap<(process, index), u64>`: every `get` is the
    /// model's value, every `sum` the model's column sum, and sums never
    /// decrease (counters are monotonic).
    #[test]
    fn stats_match_a_map_of_counters(
        ops in prop::collection::vec((0u16..130, prop_oneof![0usize..8, Just(shm_layout::STAT_WORDS - 1)], 0u64..1000), 1..200),
    ) {
        let seg = Segment::heap(&small_plan());
        let stats = seg.tables().stats;
        let mut model: HashMap<(u16, usize), u64> = HashMap::new();
        let mut last_sums: HashMap<usize, u64> = HashMap::new();
        for (process, index, delta) in ops {
            stats.add(process, index, delta);
            if usize::from(process) < stats.processes() {
                *model.entry((process, index)).or_default() += delta;
            }
            prop_assert_eq!(stats.get(process, index), model.get(&(process, index)).copied().unwrap_or(0));
            let want: u64 = model.iter().filter(|((_, i), _)| *i == index).map(|(_, v)| v).sum();
            let sum = stats.sum(index);
            prop_assert_eq!(sum, want);
            prop_assert!(sum >= last_sums.get(&index).copied().unwrap_or(0));
            last_sums.insert(index, sum);
        }
        let all = stats.sum_all();
        for ((_, index), _) in model.iter() {
            prop_assert_eq!(all[*index], stats.sum(*index));
        }
    }
}
