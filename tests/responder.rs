//! The responder loop ([`semlb::responder::event_loop::ResponderLoop`]) driven
//! directly, on a real shm segment: a completion record pushed into a
//! dispatcher's ring while the loop runs is applied (its prefix chain is in
//! the prefix table, its response in the response cache, its counters in
//! the process's stats block), and the loop returns once its shutdown flag
//! is set, draining its rings once more first.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use semlb::responder::event_loop::ResponderLoop;
use semlb::responder::{Responder, ResponderStats};
use semlb::response_cache::fresh_body;
use semlb_tokenizer::Tokenizer;
use shm_layout::{CompletionRecord, LayoutPlan, ResponseKey, Role, Segment, ServerRef};

use semlb_test_support as support;

/// How long a condition the loop should bring about may take.
const DEADLINE: Duration = Duration::from_secs(10);
/// The registry slots of the dispatcher and the responder.
const DISPATCHER: u16 = 1;
const RESPONDER: u16 = 2;
/// The dispatcher's ring.
const RING: usize = 0;

/// A shm segment under a unique name, removed on drop.
struct Shm {
    segment: Arc<Segment>,
    name: String,
}

impl Shm {
    fn new(tag: &str) -> Shm {
        let name = support::process::unique("responder", tag);
        let segment = Segment::create(&name, &LayoutPlan::for_size(8 << 20).unwrap()).expect("create the shm segment");
        Shm {
            segment: Arc::new(segment),
            name,
        }
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        let _ = Segment::remove(&self.name);
    }
}

/// Spread like real chain hashes (small integers would share a bucket).
fn h(i: u64) -> u64 {
    i.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// A backend, a dispatcher owning [`RING`] and a responder, registered as
/// the supervisor registers them; returns the backend and the responder's
/// incarnation.
fn register(segment: &Segment) -> (ServerRef, u32) {
    let t = segment.tables();
    let now = segment.clock().now_ms();
    let server = t.servers.register(1, "http://127.0.0.1:9", now).unwrap();
    let dispatcher = t.registry.claim(DISPATCHER, Role::Dispatcher, now);
    assert!(t.registry.attach(DISPATCHER, dispatcher, std::process::id(), now));
    t.ring(RING).set_owner(DISPATCHER, dispatcher);
    let responder = t.registry.claim(RESPONDER, Role::Responder, now);
    assert!(t.registry.attach(RESPONDER, responder, std::process::id(), now));
    (server, responder)
}

/// Pushes a completion record into [`RING`] as a dispatcher does: the
/// prompt's chain `prompt`, prompt + answer `full`, and the response
/// `body` under `key`.
fn push(segment: &Segment, server: ServerRef, prompt: &[u64], full: &[u64], key: ResponseKey, body: &[u8]) {
    let record = CompletionRecord {
        server,
        prompt_tokens: 16 * prompt.len() as u32,
        output_tokens: 16 * (full.len() - prompt.len()) as u32,
        prompt_blocks: prompt,
        full_blocks: full,
        continuation: None,
        response: Some((key, body)),
        prediction: None,
        timing: None,
    };
    let mut buf = Vec::with_capacity(record.encoded_len());
    record.encode_into(&mut buf);
    segment.tables().ring(RING).push(&buf).expect("room in the ring");
}

/// Runs the loop over [`RING`] on a thread of its own; its counters come
/// back over the channel when it returns.
fn start(segment: Arc<Segment>, incarnation: u32, shutdown: Arc<AtomicBool>) -> mpsc::Receiver<ResponderStats> {
    let (done, returned) = mpsc::channel();
    std::thread::spawn(move || {
        let responder = Responder::new(segment.tables(), Tokenizer::bundled());
        let stats = ResponderLoop::new(&segment, responder, vec![RING], RESPONDER, incarnation).run(&shutdown);
        let _ = done.send(stats);
    });
    returned
}

/// Whether the prefix table matches all of `full` on `server`, and the
/// response cache holds `body` under `key`.
fn learned(segment: &Segment, server: ServerRef, full: &[u64], key: ResponseKey, body: &[u8]) -> bool {
    let t = segment.tables();
    let matched = t.prefix.longest_prefix_match(full, |s| t.servers.is_live(s)).best();
    let now_ms = segment.clock().now_ms();
    let cached = t
        .responses
        .get(key)
        .is_some_and(|entry| fresh_body(&entry, now_ms, 60_000) == Some(body));
    matched == Some((server.tag(), full.len() as u32)) && cached
}

#[test]
fn a_running_loop_applies_a_pushed_record_and_returns_when_shut_down() {
    let shm = Shm::new("running");
    let segment = &shm.segment;
    let (server, incarnation) = register(segment);
    let shutdown = Arc::new(AtomicBool::new(false));
    let returned = start(segment.clone(), incarnation, shutdown.clone());

    let (prompt, full) = ([h(1), h(2)], [h(1), h(2), h(3), h(4)]);
    let (key, body) = (ResponseKey(0x5eed), &b"{\"answer\":\"hello\"}"[..]);
    push(segment, server, &prompt, &full, key, body);
    // Applied by the running loop: the flag is not set yet.
    let deadline = Instant::now() + DEADLINE;
    while !learned(segment, server, &full, key, body) {
        assert!(
            Instant::now() < deadline,
            "the loop did not apply the record within {DEADLINE:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        returned.try_recv().is_err(),
        "the loop returned before its shutdown was set"
    );

    shutdown.store(true, Ordering::Relaxed);
    let stats = returned
        .recv_timeout(DEADLINE)
        .expect("the loop did not return within 10 s of its shutdown");
    assert_eq!(
        stats,
        ResponderStats {
            records: 1,
            blocks: 4,
            responses_stored: 1,
            ..Default::default()
        }
    );
    // Its counters went to its slot's stats block, for `/metrics`.
    assert_eq!(semlb::metrics::responder_records(&segment.tables()), 1);
}

#[test]
fn a_shut_down_loop_drains_its_rings_once_more_and_returns() {
    let shm = Shm::new("stopped");
    let segment = &shm.segment;
    let (server, incarnation) = register(segment);
    let (prompt, full) = ([h(11), h(12)], [h(11), h(12), h(13)]);
    let (key, body) = (ResponseKey(0xfeed), &b"{\"answer\":\"bye\"}"[..]);
    push(segment, server, &prompt, &full, key, body);
    let shutdown = Arc::new(AtomicBool::new(true));

    let stats = start(segment.clone(), incarnation, shutdown)
        .recv_timeout(DEADLINE)
        .expect("a loop started shut down did not return");
    assert_eq!(stats.records, 1);
    assert!(
        learned(segment, server, &full, key, body),
        "the last look at the rings applied the record"
    );
}
