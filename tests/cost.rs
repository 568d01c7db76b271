//! The `cost` policy tunes its weight between cache and load from the TTFT
//! its requests see (`semlb::routing::weight_bandit`): through the gateway
//! binary and simulated engine processes over HTTP, on a workload built so
//! that the right direction is known, started from the wrong end of the
//! grid. **Load matters**: two engines that run one request at a time
//! (`--max-num-seqs 1`), conversations on a shared system prompt with
//! short histories. A cache-heavy weight (1/16) keeps sending every
//! conversation to the engine that holds the system prompt and its
//! history, where requests queue behind each other; a recompute costs
//! little. The weight must rise. (The policy's load bound, on by default,
//! caps such a pile-up whatever the weight; it is off here so that the
//! weight alone decides. So is the shared-header rule,
//! `[policy.prefix] shared_headers`: it counts a system prompt that
//! several conversations diverge from as no match at all, which spreads
//! the groups' first turns whatever the weight and leaves the tuner no
//! contest to learn from; with it on, this run ends at 1/16, measured
//! 2026-11-28, and that is the right outcome there: nothing piles up.)
//!
//! Clients stream, as most do, and send their next turn the instant an
//! answer ends. The gateway runs one dispatcher, so one tuner sees every
//! request; `explore = 0.5` and epochs of 16 requests so that a
//! test-sized run (1 280 requests) tries every arm often enough
//! (production keeps the defaults 0.05 and 32). Nothing here is timed: the
//! assertion is on the weight the gateway publishes.
//!
//! The opposite contest, **cache matters** (conversations on their own
//! ~9 800-token documents on engines with a large batch and cache: from 16
//! the weight must fall, since moving a conversation recomputes its document),
//! was a test here too until `tests/cost_tuner.rs` replaced it. Here it was
//! flaky (quarantined from 2026-11-25: a failure in 13 runs alone, 2 in 2
//! inside `.ci/run`): what the tuner compares are TTFTs measured in the
//! machine's time, which carry the noise of whatever else the cores run, so
//! no run can be repeated and one outcome cannot be told from chance.
//! `tests/cost_tuner.rs` runs the gateway's routing loop (the same policy,
//! shm tables and the simulator's scheduler) on tokio's paused clock
//! instead, where a seed's run is the same on any machine. Its runs showed
//! why one run could not settle it: the tuner left weight 16 within this
//! test's 2 560 requests in 24 runs of 30, by its draws alone, and with no
//! routing choice at all (one engine) it left it in 6 of 30 all the same.
//! So it asserts over ten seeds that most fall.

use std::sync::{Arc, Barrier};

use serde_json::{Value, json};

use semlb_test_support as support;
use support::gateway::{Gateway, chat, samples, stream_text, user};
use support::process::Proc;

fn unique(tag: &str) -> String {
    support::process::unique("cost", tag)
}

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

/// A gateway with one dispatcher routing with `cost` from
/// `initial_weight`, exploring half the time, without the load bound
/// (here only the weight may spread or keep conversations; the bound
/// would move them off an engine with more than its share whatever the
/// weight, and has its own tests in `routing::load_bound`) and without
/// the shared-header rule (which would spread the groups' first turns
/// whatever the weight; its own tests are in `routing::shared_header` and
/// `tests/shared_prompt.rs`).
fn gateway(tag: &str, engines: &[&Proc], initial_weight: f64) -> Gateway {
    let config = format!(
        "[policy]\nkind = \"cost\"\n[policy.cost]\ninitial_weight = {initial_weight}\nexplore = 0.5\nepoch_requests = 16\nbounded_load = false\n[policy.prefix]\nshared_headers = false\n"
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
    let serial = ["--max-num-seqs", "1"];
    let engines = [engine("0.1", &serial), engine("0.1", &serial)];
    let refs: Vec<&Proc> = engines.iter().collect();
    let gw = gateway("load", &refs, 1.0 / 16.0);
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
