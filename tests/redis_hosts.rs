//! Two gateway hosts sharing one Redis (`--store redis`, one namespace):
//! two supervisors with segments of their own, one `redis-server`, the
//! same engines listed in different orders (so each backend has another
//! slot on each host).
//!
//! Shown here: a conversation's turn 1 through gateway A and turn 2 through
//! gateway B lands on turn 1's engine, routed by prefix (the chains are
//! rooted in the namespace's seed and servers are named by ids of their
//! addresses, not by slots), and back through A again; a deterministic
//! answer cached through A is a hit through B that reaches no engine; the
//! requests one host has in flight count on the other (`least_load`
//! through B avoids the engines A keeps busy). With separate namespaces
//! (the control) B knows nothing of A's conversations.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use semlb::metrics::responder_records;
use semlb_test_support as support;
use support::gateway::{Gateway, chat, engine_counter, routed, sim, sim_at, stream_text, user};
use support::http::http;
use support::process::Proc;
use support::redis::RedisServer;

fn unique(tag: &str) -> String {
    support::process::unique("hosts", tag)
}

fn gateway(tag: &str, engines: &[&Proc], redis: &str, namespace: &str, extra: &[&str]) -> Gateway {
    Gateway::builder()
        .shm(&unique(tag))
        .tag(tag)
        .backends(engines)
        .redis(redis, namespace)
        .args(extra)
        .start()
}

/// One streamed turn through `gw`: the answer's text, engine and route.
fn turn(gw: &Gateway, messages: &[Value]) -> (String, String, String) {
    let extra = json!({"stream": true, "max_tokens": 32});
    let r = chat(gw.addr(), messages, extra, &[("api-key", "agent")]);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let (text, done) = stream_text(&r);
    assert!(done, "a whole stream");
    let (backend, route) = routed(&r);
    (text, backend, route)
}

/// Six conversations: turn 1 through `first`, turn 2 through `second`,
/// turn 3 through `first` again; (engine, route) of each turn.
fn conversations(first: &Gateway, second: &Gateway) -> Vec<[(String, String); 3]> {
    (0..6)
        .map(|i| {
            let mut messages = vec![
                json!({"role": "system", "content": format!("You are the assistant of project {i}.")}),
                user(&format!("Conversation {i}: describe subsystem {} in detail.", i * 11)),
            ];
            let mut turns = Vec::new();
            for (t, gw) in [first, second, first].into_iter().enumerate() {
                let (text, backend, route) = turn(gw, &messages);
                messages.push(json!({"role": "assistant", "content": text}));
                messages.push(user(&format!("And step {}?", t + 2)));
                turns.push((backend, route));
            }
            turns.try_into().expect("three turns")
        })
        .collect()
}

#[test]
fn two_gateways_on_one_redis_share_conversations_and_answers() {
    let Some(redis) = RedisServer::start() else { return };
    let url = redis.url();
    let engines = [sim(), sim(), sim()];
    let a_order: Vec<&Proc> = engines.iter().collect();
    let b_order: Vec<&Proc> = [2, 0, 1].iter().map(|&i| &engines[i]).collect();
    let a = gateway("a", &a_order, &url, "shared", &[]);
    let b = gateway("b", &b_order, &url, "shared", &[]);
    let slot_of = |gw: &Gateway, engine: &Proc| {
        gw.segment
            .tables()
            .servers
            .servers()
            .find(|s| s.address.ends_with(&engine.addr))
            .map(|s| s.server.slot)
    };
    assert_ne!(
        slot_of(&a, &engines[0]),
        slot_of(&b, &engines[0]),
        "the hosts number the engine differently"
    );

    for turns in conversations(&a, &b) {
        let engine = &turns[0].0;
        assert!(
            turns[1..].iter().all(|(e, route)| e == engine && route == "prefix"),
            "turns 2 (through B) and 3 (through A) follow turn 1's engine by prefix: {turns:?}"
        );
    }

    // A deterministic answer cached through A is a hit through B.
    let question = [user("What is the speed of light in vacuum? Answer briefly.")];
    let deterministic = json!({"temperature": 0});
    let alice = [("api-key", "sk-alice")];
    let first = chat(a.addr(), &question, deterministic.clone(), &alice);
    assert_eq!(first.header("x-semlb-cache"), Some("miss"));
    a.written_back(responder_records);
    let refs: Vec<&Proc> = engines.iter().collect();
    let served = engine_counter(&refs, "vllm:request_success_total");
    let hit = chat(b.addr(), &question, deterministic, &alice);
    assert_eq!(hit.header("x-semlb-cache"), Some("hit"));
    assert_eq!(hit.json()["choices"], first.json()["choices"]);
    assert_eq!(
        engine_counter(&refs, "vllm:request_success_total"),
        served,
        "no engine was asked"
    );
}

#[test]
fn without_a_shared_namespace_the_other_host_knows_nothing() {
    let Some(redis) = RedisServer::start() else { return };
    let url = redis.url();
    let engines = [sim(), sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let a = gateway("sep-a", &refs, &url, "host-a", &[]);
    let b = gateway("sep-b", &refs, &url, "host-b", &[]);
    for turns in conversations(&a, &b) {
        assert_ne!(turns[1].1, "prefix", "B has no prefix of A's conversation: {turns:?}");
    }
}

/// Requests in flight summed over every owner's published hash.
fn published_inflight(redis: &RedisServer, namespace: &str) -> i64 {
    let mut c = redis.raw();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{namespace}:if:*"))
        .query(&mut c)
        .unwrap_or_default();
    keys.iter()
        .flat_map(|k| {
            let fields: Vec<(String, i64)> = redis::cmd("HGETALL").arg(k).query(&mut c).unwrap_or_default();
            fields
        })
        .filter(|(f, _)| f.starts_with("req:"))
        .map(|(_, n)| n)
        .sum()
}

#[test]
fn one_hosts_requests_in_flight_count_on_the_other() {
    let Some(redis) = RedisServer::start() else { return };
    let url = redis.url();
    // Slow engines: the streams through A are still running.
    let engines = [sim_at("1.0"), sim_at("1.0"), sim_at("1.0")];
    let a_order: Vec<&Proc> = engines.iter().collect();
    let b_order: Vec<&Proc> = [1, 2, 0].iter().map(|&i| &engines[i]).collect();
    let least_load = ["--policy", "least_load"];
    let a = gateway("load-a", &a_order, &url, "load", &least_load);
    let b = gateway("load-b", &b_order, &url, "load", &least_load);
    let inflight_on_a = || support::segment::requests_in_flight(&a.segment);
    let streams: Vec<_> = (0..2u64)
        .map(|i| {
            let addr = a.addr().to_owned();
            // One at a time, so that A's least_load sees the first.
            let deadline = Instant::now() + Duration::from_secs(20);
            while inflight_on_a() < i {
                assert!(Instant::now() < deadline, "stream {i} did not start");
                std::thread::yield_now();
            }
            std::thread::spawn(move || {
                let body = json!({
                    "model": "semlb-sim",
                    "messages": [user(&format!("Long story {i}, please."))],
                    "stream": true,
                    "max_tokens": 400,
                    "ignore_eos": true,
                });
                let r = http(&addr, "POST", "/v1/chat/completions", Some(&body), &[]).expect("the stream");
                r.header("x-semlb-backend").unwrap_or_default().to_owned()
            })
        })
        .collect();
    // What B reads is what A published: wait for the publication itself.
    let deadline = Instant::now() + Duration::from_secs(20);
    while published_inflight(&redis, "load") < 2 {
        assert!(Instant::now() < deadline, "A never published its 2 requests in flight");
        std::thread::sleep(Duration::from_millis(5));
    }
    let busy: Vec<String> = a
        .segment
        .tables()
        .servers
        .servers()
        .filter(|s| s.inflight_requests > 0)
        .map(|s| s.address)
        .collect();
    assert_eq!(busy.len(), 2, "least_load spread A's two streams: {busy:?}");
    let r = chat(b.addr(), &[user("A quick one.")], json!({"max_tokens": 4}), &[]);
    assert_eq!(r.status, 200);
    let (chosen, _) = routed(&r);
    assert!(
        !busy.contains(&chosen),
        "B sent its request to {chosen}, which A keeps busy ({busy:?})"
    );
    for s in streams {
        s.join().expect("stream");
    }
}
