//! Priorities and fair share in the gateway queue, end to end: one
//! simulated engine in real time behind `selective_push` with
//! `max_outstanding = 1`, so it runs one request at a time and the rest
//! wait at the gateway (one dispatcher: one queue, whose order is the
//! thing tested). Clients behave as agents do: each sends its next
//! streamed request the instant the last one ends, with its key in
//! `api-key` (which names its tenant).
//!
//! * Fair share: six clients of one tenant flood the engine while one
//!   client of another sends a steady trickle. The trickle's requests wait
//!   at the gateway for at most about one of the flood's, while the
//!   flood's wait behind each other: the trickle's median wait is under
//!   half the flood's. The control, in the same test: with `fair_share =
//!   false` (oldest first) the trickle waits as long as everyone.
//! * Settlement: two tenants flood with equally short answers, one asking
//!   for 200 times the output it gets (`max_tokens`). Charged for what it
//!   got, it gets about half the answers (at least a third is asserted;
//!   charged for what it asked, it would get almost none).
//! * Priority: a flood of batch requests (`x-semlb-priority: batch`)
//!   does not hold back an interactive client: its requests wait under
//!   half as long as the batch ones.
//! * The engines' other endpoints (embeddings) wait in the queue too while
//!   the engine is full.
//!
//! The waits are the gateway's `x-semlb-queue-ms`; the comparisons are
//! between clients of one run, so a slow machine slows both sides.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use semlb_test_support as support;
use serde_json::json;
use support::gateway::{Gateway, chat, sim_at, user};
use support::process::Proc;

/// Streamed answers of this many tokens: about 0.1 s each on an engine in
/// real time.
const MAX_TOKENS: u64 = 10;

fn gateway(engine: &Proc, fair_share: bool, tag: &str) -> Gateway {
    Gateway::builder()
        .tag(tag)
        .dispatchers(1)
        .backends(&[engine])
        .config(&format!(
            "[policy]\nkind = \"selective_push\"\n[policy.selective_push]\nmode = \"max_outstanding\"\nmax_outstanding = 1\n[policy.queue]\nfair_share = {fair_share}\n"
        ))
        .start()
}

/// One streamed request; its wait in the gateway queue (ms).
fn ask(addr: &str, headers: &[(&str, &str)], text: &str) -> u64 {
    let r = chat(
        addr,
        &[user(text)],
        json!({"stream": true, "max_tokens": MAX_TOKENS, "temperature": 0.8}),
        headers,
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.header("x-semlb-queue-ms").map_or(0, |v| v.parse().unwrap())
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

/// Six flooding clients (`flood` headers) and one trickling client
/// (`trickle` headers, `TRICKLE` requests one after another); the median
/// queue waits of (flood, trickle).
fn contend(addr: &str, flood: &[(&str, &str)], trickle: &[(&str, &str)]) -> (u64, u64) {
    const TRICKLE: usize = 8;
    let done = AtomicBool::new(false);
    let flood_waits = Mutex::new(Vec::new());
    let mut trickle_waits = Vec::new();
    std::thread::scope(|s| {
        for c in 0..6 {
            let (done, waits) = (&done, &flood_waits);
            s.spawn(move || {
                let mut i = 0;
                while !done.load(Relaxed) {
                    let wait = ask(addr, flood, &format!("Flood {c}-{i}: list every prime below 1000."));
                    waits.lock().unwrap().push(wait);
                    i += 1;
                }
            });
        }
        // Let the flood fill the queue first.
        while flood_waits.lock().unwrap().len() < 6 {
            std::thread::yield_now();
        }
        for i in 0..TRICKLE {
            trickle_waits.push(ask(addr, trickle, &format!("Trickle {i}: what time is it in Tokyo?")));
        }
        done.store(true, Relaxed);
    });
    let flood = median(flood_waits.into_inner().unwrap());
    let trickle = median(trickle_waits);
    (flood, trickle)
}

#[test]
fn a_trickle_is_served_at_its_pace_while_another_tenant_floods() {
    let engine = sim_at("1");
    for fair_share in [true, false] {
        let gw = gateway(&engine, fair_share, "fair");
        let (flood, trickle) = contend(gw.addr(), &[("api-key", "flood-team")], &[("api-key", "trickle-team")]);
        eprintln!("fair_share = {fair_share}: median queue wait: flood {flood} ms, trickle {trickle} ms");
        assert!(flood > 0, "the flood waited at the gateway");
        if fair_share {
            assert!(
                2 * trickle < flood,
                "fair share: the trickle waited {trickle} ms, the flood {flood} ms"
            );
        } else {
            assert!(
                2 * trickle >= flood,
                "oldest first: the trickle waits with everyone ({trickle} ms, flood {flood} ms)"
            );
        }
    }
}

#[test]
fn a_tenant_is_charged_for_the_output_it_got_not_the_output_it_asked_for() {
    // Two tenants flood with three clients each, every answer 10 tokens
    // long; one asks for 2 000 (max_tokens) each time. Charged up front
    // only, it would look 100 times as served and get almost nothing;
    // settled with the answers' lengths, the two share the engine.
    let engine = sim_at("1");
    let gw = gateway(&engine, true, "settle");
    let addr = gw.addr();
    let answered = Mutex::new(Vec::new());
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        for c in 0..6 {
            let (done, answered) = (&done, &answered);
            s.spawn(move || {
                let greedy = c % 2 == 0;
                let (key, max_tokens) = if greedy {
                    ("greedy-team", 2000)
                } else {
                    ("exact-team", MAX_TOKENS)
                };
                let mut i = 0;
                while !done.load(Relaxed) {
                    let r = chat(
                        addr,
                        &[user(&format!("Client {c}, request {i}: summarise the news."))],
                        json!({"stream": true, "max_tokens": max_tokens, "temperature": 0.8}),
                        &[("api-key", key), ("x-semlb-output-tokens", "10")],
                    );
                    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
                    let body = String::from_utf8_lossy(&r.body);
                    let finish = if body.contains("\"finish_reason\":\"stop\"") {
                        "stop"
                    } else {
                        "length"
                    };
                    let mut answered = answered.lock().unwrap();
                    answered.push((greedy, finish));
                    if answered.len() >= 48 {
                        done.store(true, Relaxed);
                    }
                    i += 1;
                }
            });
        }
    });
    let answered = answered.into_inner().unwrap();
    // The first six went out before the queue had anything to order.
    let ordered = &answered[6..];
    let greedy = ordered.iter().filter(|(g, _)| *g).count();
    eprintln!("answered after the first six: greedy {greedy} of {}", ordered.len());
    assert!(
        answered.iter().all(|(g, finish)| !*g || *finish == "stop"),
        "the greedy tenant's answers are shorter than it asked for"
    );
    assert!(
        3 * greedy >= ordered.len(),
        "the greedy tenant got {greedy} of {} answers: charged for what it asked, not what it got",
        ordered.len()
    );
}

#[test]
fn batch_requests_do_not_hold_back_interactive_ones() {
    let engine = sim_at("1");
    let gw = gateway(&engine, true, "priority");
    let (batch, interactive) = contend(
        gw.addr(),
        &[("api-key", "team"), ("x-semlb-priority", "batch")],
        &[("api-key", "team")],
    );
    eprintln!("median queue wait: batch {batch} ms, interactive {interactive} ms");
    assert!(batch > 0, "the batch requests waited at the gateway");
    assert!(
        2 * interactive < batch,
        "interactive waited {interactive} ms, batch {batch} ms"
    );
}

/// The engines' other endpoints wait in the gateway queue too (issue 39:
/// the passthrough was a side door around it). While a long chat holds
/// the engine's one place (`max_outstanding = 1`), an embeddings request
/// is not sent to it: it waits at the gateway until the chat ends, and its
/// answer says how long (`x-semlb-queue-ms`). Before, it went straight to
/// the engine, beside the chat.
#[test]
fn embeddings_wait_in_the_gateway_queue_while_the_engine_is_full() {
    let engine = sim_at("1");
    let gw = gateway(&engine, true, "passthrough-queue");
    let addr = gw.addr().to_owned();
    let started = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        let long = s.spawn(|| {
            let body = json!({
                "model": "semlb-sim",
                "messages": [user("Tell a long story.")],
                "max_tokens": 60,
                "ignore_eos": true,
                "stream": true,
            });
            // The chat's first bytes are the signal that it runs.
            use std::io::{Read, Write};
            let body = body.to_string();
            let mut stream = std::net::TcpStream::connect(&addr).unwrap();
            write!(
                stream,
                "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            let mut buf = [0u8; 4096];
            let n = stream.read(&mut buf).unwrap();
            assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
            started.wait();
            let mut rest = Vec::new();
            stream.read_to_end(&mut rest).unwrap();
        });
        started.wait();
        let embedding = json!({"model": "semlb-sim", "input": "a sentence to embed"});
        let r = support::http::http(&addr, "POST", "/v1/embeddings", Some(&embedding), &[]).unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let waited: u64 = r
            .header("x-semlb-queue-ms")
            .expect("the embeddings request waited in the gateway queue")
            .parse()
            .unwrap();
        eprintln!("embeddings waited {waited} ms behind a 60-token chat");
        assert!(waited > 100, "waited only {waited} ms: sent beside the running chat");
        long.join().unwrap();
    });
}
