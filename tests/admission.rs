//! The holding policies (`selective_push`, `dual_map`) in front of engines
//! that expose no metrics (`semlb __sim --no-metrics`: `/metrics` answers
//! 404, as llama.cpp without `--metrics` does), with clients that do not
//! stream: the gateway then sees no engine queue and no first token before
//! an answer is complete, and learns each server's admission limit from
//! the latencies it measures (`semlb::routing::capacity`).
//!
//! * A chat workload that does not saturate the engines: each holding
//!   policy keeps several requests in flight per engine, learns a limit
//!   above the initial one, and serves at least 90 % of `least_load`'s
//!   rate on the same engines in the same run. (The rate is the one thing
//!   here that is timed: the issue asks for it, and the failure it guards
//!   against is a factor of four, one request per engine.)
//! * An engine that runs only two requests at once: the limit comes down
//!   from 8 towards two, so requests wait at the gateway instead of in the
//!   engine's queue, and stays at or above what the engine overlaps.
//! * Engines that say how many requests they run at once (llama.cpp's
//!   `/props` `total_slots`; `semlb __sim --props`), one with fresh
//!   metrics and one without: nothing is learned, the gateway never has
//!   more in flight at either than its slots, and every request is
//!   answered.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use semlb_test_support as support;
use support::gateway::{Gateway, chat, samples, user};
use support::http::http;
use support::process::Proc;

fn unique(tag: &str) -> String {
    support::process::unique("adm", tag)
}

/// An engine without `/metrics` in real time (a decode step ~10 ms), with
/// `extra` arguments.
fn bare_engine(extra: &[&str]) -> Proc {
    let mut args = vec!["__sim", "--listen", "127.0.0.1:0", "--time-scale", "1", "--no-metrics"];
    args.extend_from_slice(extra);
    Proc::start(&args)
}

/// The gateway's learned admission limit per server.
fn limits(gw: &Gateway) -> HashMap<String, f64> {
    samples(&gw.metrics(), "semlb_server_admission_limit")
        .into_iter()
        .collect()
}

/// A system prompt all conversations share (about 300 tokens).
fn system_prompt() -> String {
    "You are the support assistant of a company that runs inference servers. Answer briefly and precisely. ".repeat(16)
}

/// What a run of the chat workload showed.
struct Run {
    /// Requests answered per second.
    rate: f64,
    /// Most requests in flight per server by the gateway's count.
    peak: HashMap<String, f64>,
}

/// `clients` conversations of `turns` non-streamed turns each, all sent
/// closed-loop (a client sends its next turn the moment its answer ends)
/// and started together, against `gw`. Every answer must be a 200.
fn chat_workload(gw: &Gateway, clients: usize, turns: usize) -> Run {
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (stop, addr) = (stop.clone(), gw.addr().to_owned());
        std::thread::spawn(move || {
            let mut peak: HashMap<String, f64> = HashMap::new();
            while !stop.load(Ordering::Relaxed) {
                if let Ok(r) = http(&addr, "GET", "/metrics", None, &[]) {
                    for (server, n) in samples(&String::from_utf8_lossy(&r.body), "semlb_server_inflight_requests") {
                        let max = peak.entry(server).or_insert(0.0);
                        *max = n.max(*max);
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            peak
        })
    };
    let barrier = Arc::new(Barrier::new(clients + 1));
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let (barrier, addr) = (barrier.clone(), gw.addr().to_owned());
            std::thread::spawn(move || {
                let mut messages: Vec<Value> = vec![json!({"role": "system", "content": system_prompt()})];
                barrier.wait();
                for t in 0..turns {
                    messages.push(user(&format!("Client {c}, question {t}: why is my request slow?")));
                    let r = chat(&addr, &messages, json!({"max_tokens": 24}), &[]);
                    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
                    let answer = r.json()["choices"][0]["message"]["content"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned();
                    messages.push(json!({"role": "assistant", "content": answer}));
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for t in threads {
        t.join().expect("client");
    }
    let secs = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    Run {
        rate: (clients * turns) as f64 / secs,
        peak: sampler.join().expect("sampler"),
    }
}

const CLIENTS: usize = 20;
const TURNS: usize = 6;

/// Two engines without metrics, twenty conversations (ten per engine: more
/// than the initial limit of 8), non-streamed. `least_load` sends every
/// request at once; each holding policy must keep several in flight per
/// engine, learn a limit above 8, and serve at least 90 % of
/// `least_load`'s rate.
#[test]
fn holding_policies_learn_what_engines_without_metrics_can_take() {
    let engines = [bare_engine(&[]), bare_engine(&[])];
    let refs: Vec<&Proc> = engines.iter().collect();
    let mut rates = Vec::new();
    for policy in ["least_load", "selective_push", "dual_map"] {
        let config = format!("[policy]\nkind = \"{policy}\"\n");
        let gw = Gateway::with_config(&unique(policy), &refs, &config, &[]);
        let run = chat_workload(&gw, CLIENTS, TURNS);
        let learned = limits(&gw);
        eprintln!(
            "{policy}: {:.1} req/s, peak in flight {:?}, limits {learned:?}",
            run.rate, run.peak
        );
        if policy != "least_load" {
            assert_eq!(run.peak.len(), 2, "{policy}: {:?}", run.peak);
            for (server, peak) in &run.peak {
                assert!(*peak >= 3.0, "{policy} kept only {peak} in flight at {server}");
            }
            assert!(
                learned.values().any(|l| *l > 8.0),
                "{policy} learned no limit above the initial 8: {learned:?}"
            );
        }
        rates.push((policy, run.rate));
    }
    let least_load = rates[0].1;
    for (policy, rate) in &rates[1..] {
        assert!(
            *rate >= 0.9 * least_load,
            "{policy} served {rate:.1} req/s, under 90 % of least_load's {least_load:.1}: {rates:?}"
        );
    }
}

/// One engine without metrics that runs only two requests at once
/// (`--max-num-seqs 2`; the rest wait in its queue), ten conversations of
/// twelve turns, `selective_push`: the learned limit comes down from 8
/// towards 2, so most requests wait at the gateway, not in the engine; it
/// does not fall below the 2 the engine runs at once, and every request
/// is answered.
#[test]
fn the_limit_comes_down_to_an_engine_that_queues() {
    let engine = bare_engine(&["--max-num-seqs", "2"]);
    let config = "[policy]\nkind = \"selective_push\"\n";
    let gw = Gateway::with_config(&unique("queues"), &[&engine], config, &[]);
    let run = chat_workload(&gw, 10, 12);
    let learned = limits(&gw);
    eprintln!(
        "{:.1} req/s, peak in flight {:?}, limits {learned:?}",
        run.rate, run.peak
    );
    let limit = *learned.values().next().expect("a limit");
    assert!(
        (2.0..6.0).contains(&limit),
        "learned {limit} for an engine that runs 2 at once (from 8)"
    );
}

/// Two engines that run two requests at once and say so in `/props`, one
/// scraped (its queue reads empty between scrapes) and one without
/// metrics; ten non-streamed conversations, `selective_push`. Once the
/// gateway has read their slots, it never has more than two in flight at
/// either: the rest wait at the gateway, from the first request on, with
/// nothing to learn first.
#[test]
fn engines_that_say_their_slots_never_get_more() {
    let scraped = Proc::start(&[
        "__sim",
        "--listen",
        "127.0.0.1:0",
        "--time-scale",
        "1",
        "--max-num-seqs",
        "2",
        "--props",
    ]);
    let bare = bare_engine(&["--max-num-seqs", "2", "--props"]);
    let config = "[policy]\nkind = \"selective_push\"\n";
    let gw = Gateway::builder()
        .shm(&unique("slots"))
        .backends(&[&scraped, &bare])
        .config(config)
        .admin("slots-admin-token")
        .start();
    let deadline = Instant::now() + Duration::from_secs(20);
    while limits(&gw).values().filter(|l| **l == 2.0).count() < 2 {
        assert!(
            Instant::now() < deadline,
            "the gateway did not read both engines' slots: {:?}",
            limits(&gw)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for server in gw.admin_servers() {
        assert_eq!(server["engine_slots"], 2, "{server}");
    }
    let run = chat_workload(&gw, 10, 4);
    eprintln!(
        "{:.1} req/s, peak in flight {:?}, limits {:?}",
        run.rate,
        run.peak,
        limits(&gw)
    );
    assert_eq!(run.peak.len(), 2, "{:?}", run.peak);
    for (server, peak) in &run.peak {
        assert!(*peak <= 2.0, "{peak} in flight at {server}, which runs 2 at once");
        assert!(*peak >= 1.0, "nothing went to {server}");
    }
    assert!(
        limits(&gw).values().all(|l| *l == 2.0),
        "the slots stay the limit, nothing learned over them: {:?}",
        limits(&gw)
    );
}
