//! What engines report corrects the routing state: `semlb serve` in front
//! of simulated engines that report `usage.prompt_tokens_details.cached_tokens`
//! as vLLM does, over real HTTP.
//!
//! Shown here: the gateway counts, per server, the prompt tokens it
//! predicted an engine held and those the engine reported cached, and
//! `semlb status` shows the accuracy; after an engine's prefix cache is
//! flushed (`POST /reset_prefix_cache`, as on vLLM), two of its reports of
//! nothing cached make the gateway forget it in every prefix entry, so the
//! next conversation that lived there is routed on load, not sent back on
//! the strength of entries the engine no longer backs, and the metrics show
//! the mismatch; and when an engine's small cache evicts, one report of a
//! clear shortfall sets aside the server's entries older than the evicted
//! prefix, and only those.

use std::collections::HashMap;

use serde_json::{Value, json};

use semlb_test_support as support;
use support::gateway::{Gateway, chat, routed, sample, sim, sim_with, user};
use support::http::http;
use support::process::{Proc, exe};

fn unique(tag: &str) -> String {
    support::process::unique("feedback", tag)
}

/// A conversation of its own: a long first message (about 20 blocks).
fn opening(i: usize) -> Vec<Value> {
    let text = format!("Conversation {i}: a question about shard {i} of the cluster and its replicas. ").repeat(12);
    vec![user(&text)]
}

/// One non-streamed turn: (backend, route, cached_tokens reported).
fn turn(gw: &Gateway, messages: &[Value]) -> (String, String, u64) {
    let r = chat(gw.addr(), messages, json!({"max_tokens": 8}), &[]);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("the engine reports cached_tokens");
    let (backend, route) = routed(&r);
    (backend, route, cached)
}

#[test]
fn a_flushed_engine_is_forgotten_once_it_reports_its_loss() {
    let engines = [sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let gw = Gateway::builder()
        .shm(&unique("flush"))
        .backends(&refs)
        .dispatchers(2)
        .start();
    // Six conversations; each one's second turn lands where its first did.
    let mut homes: HashMap<String, Vec<usize>> = HashMap::new();
    let mut conversations: Vec<Vec<Value>> = Vec::new();
    for i in 0..6 {
        let mut messages = opening(i);
        let (home, _, _) = turn(&gw, &messages);
        messages.push(json!({"role": "assistant", "content": "Noted."}));
        messages.push(user("Go on."));
        let (again, route, cached) = turn(&gw, &messages);
        assert_eq!((&again, route.as_str()), (&home, "prefix"), "conversation {i}");
        assert!(cached > 0, "conversation {i}: its engine reused the first turn");
        homes.entry(home).or_default().push(i);
        conversations.push(messages);
    }
    // An engine holding at least three of them (six over two engines).
    let (flushed, on_it) = homes
        .iter()
        .max_by_key(|(_, c)| c.len())
        .map(|(b, c)| (b.clone(), c.clone()))
        .unwrap();
    assert!(on_it.len() >= 3, "{homes:?}");
    // The figures so far, once the response process has counted all twelve
    // answers (the counters are its; nothing is routed meanwhile).
    let metrics = support::gateway::wait_for("the twelve answers counted", std::time::Duration::from_secs(10), || {
        let m = gw.metrics();
        (sample(&m, "semlb_responder_records_total") == Some(12.0), m)
    });
    let series = |name: &str| format!("{name}{{server=\"{flushed}\"}}");
    let predicted_before = sample(&metrics, &series("semlb_prefix_predicted_tokens_total")).unwrap();
    let confirmed_before = sample(&metrics, &series("semlb_prefix_confirmed_tokens_total")).unwrap();
    assert!(predicted_before > 0.0 && confirmed_before > 0.0, "{metrics}");

    let engine = flushed.trim_start_matches("http://");
    let reset = http(engine, "POST", "/reset_prefix_cache", None, &[]).expect("reset");
    assert_eq!(reset.status, 200, "{}", String::from_utf8_lossy(&reset.body));

    // The next turns of two of its conversations still go there (the
    // table does not know yet) and find nothing cached; each is the
    // engine's report of the loss.
    for &i in &on_it[..2] {
        let mut messages = conversations[i].clone();
        messages.push(json!({"role": "assistant", "content": "Sure."}));
        messages.push(user("And then?"));
        let (backend, route, cached) = turn(&gw, &messages);
        assert_eq!(
            (backend.as_str(), route.as_str(), cached),
            (flushed.as_str(), "prefix", 0)
        );
    }
    // The second report is written back before the next request is routed
    // only if the response process was quick; wait for what a client
    // cannot see, the forgetting, through the metrics it exposes.
    let metrics = support::gateway::wait_for(
        "the flushed engine forgotten",
        std::time::Duration::from_secs(10),
        || {
            let m = gw.metrics();
            (sample(&m, "semlb_prefix_servers_forgotten_total") == Some(1.0), m)
        },
    );
    let shortfalls = sample(&metrics, &series("semlb_prefix_shortfalls_total")).unwrap();
    assert!(shortfalls >= 2.0, "{metrics}");
    let predicted = sample(&metrics, &series("semlb_prefix_predicted_tokens_total")).unwrap();
    let confirmed = sample(&metrics, &series("semlb_prefix_confirmed_tokens_total")).unwrap();
    assert!(
        predicted > predicted_before && confirmed == confirmed_before,
        "{metrics}"
    );

    // A third conversation that lived there: no entry sends it back; it is
    // routed on load like a new prompt.
    let i = on_it[2];
    let mut messages = conversations[i].clone();
    messages.push(json!({"role": "assistant", "content": "Right."}));
    messages.push(user("Anything else?"));
    let (_, route, _) = turn(&gw, &messages);
    assert_eq!(route, "least_load", "conversation {i} was sent on a forgotten entry");

    // `semlb status` shows the accuracy per server.
    let out = std::process::Command::new(exe())
        .args(["status", "--once", "--shm-name", &gw.shm])
        .output()
        .expect("semlb status");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("PREDICTED"), "{text}");
    let line = text
        .lines()
        .find(|l| l.contains(&flushed))
        .expect("the flushed server's line");
    let accuracy = format!("{:.1} %", 100.0 * confirmed / predicted);
    assert!(line.contains(&accuracy), "{accuracy} in {line}");
}

/// A streamed request without `stream_options`: the gateway asks the
/// engine for the usage on the client's behalf and keeps it from the
/// client, whose stream has no usage at all, while the engine's cached
/// tokens are counted as for any other answer: for a short stream, kept
/// whole for the response process, and for a long one (300 tokens, past
/// the 16 KiB the dispatcher keeps as it came), read as it passes.
#[test]
fn streams_report_their_cached_tokens_without_the_client_seeing_usage() {
    let engines = [sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let gw = Gateway::builder().shm(&unique("usage")).backends(&refs).start();
    let series = format!(
        "semlb_prefix_confirmed_tokens_total{{server=\"http://{}\"}}",
        engines[0].addr
    );
    let mut confirmed_before = 0.0;
    for (k, max_tokens) in [8, 300].into_iter().enumerate() {
        let mut messages = opening(40 + k);
        for turn in 0..2 {
            let r = chat(
                gw.addr(),
                &messages,
                json!({"stream": true, "max_tokens": max_tokens}),
                &[],
            );
            assert_eq!(r.status, 200);
            let body = String::from_utf8_lossy(&r.body).into_owned();
            let events = support::sse::events(&body);
            assert!(events.last().is_some_and(|e| e == "[DONE]"), "{body}");
            let mut text = String::new();
            for e in &events[..events.len() - 1] {
                let chunk: Value = serde_json::from_str(e).expect("a JSON chunk");
                assert!(
                    chunk.get("usage").is_none(),
                    "turn {turn}: usage the client did not ask for: {e}"
                );
                let choices = chunk["choices"].as_array().expect("choices");
                assert!(
                    !choices.is_empty(),
                    "turn {turn}: a usage chunk reached the client: {e}"
                );
                text.push_str(choices[0]["delta"]["content"].as_str().unwrap_or_default());
            }
            assert!(!text.is_empty(), "{body}");
            if max_tokens > 100 {
                assert!(body.len() > 16 << 10, "a long stream: {} bytes", body.len());
            }
            messages.push(json!({"role": "assistant", "content": text}));
            messages.push(user("Go on."));
        }
        // What the engine reported reached the response process: the
        // second turn found its first turn cached, as predicted.
        let records = 2.0 * (k + 1) as f64;
        let metrics = support::gateway::wait_for("the answers counted", std::time::Duration::from_secs(10), || {
            let m = gw.metrics();
            (sample(&m, "semlb_responder_records_total") == Some(records), m)
        });
        let confirmed = sample(&metrics, &series).unwrap_or(0.0);
        assert!(
            confirmed >= confirmed_before + 16.0,
            "{max_tokens} tokens: {series} = {confirmed}, {confirmed_before} before\n{metrics}"
        );
        confirmed_before = confirmed;
    }
}

/// Prompt tokens of one engine's KV cache in [`an_eviction_sets_the_servers_older_entries_aside`]:
/// three of its prompts and a bit (each about 220 tokens, 14 blocks).
const SMALL_CACHE_TOKENS: &str = "768";

/// An engine whose cache evicts: the table keeps listing the prompts it
/// evicted, until one of them comes back and the engine reports clearly
/// fewer cached tokens than listed. Then the server's entries last
/// refreshed before the evicted one are set aside (engines evict least
/// recently used blocks first), while those refreshed since still count.
/// The prefix table's stamps are seconds, so the prompts are a second
/// apart; the same steps on a gateway with `learn_from_reports = false`
/// show the stale entry that is otherwise followed, and with `--store
/// redis` the same happens through the horizon Redis keeps.
#[test]
fn an_eviction_sets_the_servers_older_entries_aside() {
    let small = || sim_with("0.01", &["--kv-capacity-tokens", SMALL_CACHE_TOKENS]);
    // Learning from reports on shm, off, and on with `--store redis`
    // (when `redis-server` is installed).
    let redis = support::redis::RedisServer::start();
    let url = redis.as_ref().map(|r| r.url());
    let variants: Vec<(bool, Option<&str>)> = [(true, None), (false, None)]
        .into_iter()
        .chain(url.as_deref().map(|u| (true, Some(u))))
        .collect();
    let (engines, gateways): (Vec<Proc>, Vec<Gateway>) = variants
        .iter()
        .enumerate()
        .map(|(k, (learn, redis))| {
            let engine = small();
            let mut builder = Gateway::builder()
                .shm(&unique(&format!("evict-{k}")))
                .backends(&[&engine])
                .config(&format!("learn_from_reports = {learn}\n"))
                .admin("feedback-admin-token-0123");
            if let Some(url) = redis {
                builder = builder.redis(url, "evict");
            }
            (engine, builder.start())
        })
        .unzip();
    let records = |gw: &Gateway, n: f64| {
        support::gateway::wait_for("the answers written back", std::time::Duration::from_secs(10), || {
            let m = gw.metrics();
            (sample(&m, "semlb_responder_records_total") == Some(n), m)
        })
    };
    // Three conversations a second apart (each written back before the
    // clock moves on), then two more prompts that push the first two out
    // of the engine's cache.
    let mut sent = 0.0;
    let mut conversations: Vec<Vec<Value>> = Vec::new();
    for i in 0..5 {
        if i == 1 || i == 2 {
            std::thread::sleep(std::time::Duration::from_millis(1100));
        }
        let messages = opening(60 + i);
        for gw in &gateways {
            let (_, route, _) = turn(gw, &messages);
            assert_eq!(route, "least_load", "prompt {i} is new");
        }
        sent += 1.0;
        for gw in &gateways {
            records(gw, sent);
        }
        conversations.push(messages);
    }
    let next = |i: usize| {
        let mut m = conversations[i].clone();
        m.push(json!({"role": "assistant", "content": "Noted."}));
        m.push(user("Go on."));
        m
    };
    // The second conversation comes back: still listed, evicted.
    for gw in &gateways {
        let (_, route, cached) = turn(gw, &next(1));
        assert_eq!(route, "prefix");
        assert!(cached < 128, "the engine evicted most of it: {cached} cached");
    }
    sent += 1.0;
    for (k, (gw, (learn, redis))) in gateways.iter().zip(&variants).enumerate() {
        let store = if redis.is_some() { "redis" } else { "shm" };
        let metrics = records(gw, sent);
        let series = format!("semlb_prefix_demotions_total{{server=\"http://{}\"}}", engines[k].addr);
        let demotions = if *learn { 1.0 } else { 0.0 };
        assert_eq!(
            sample(&metrics, &series),
            Some(demotions),
            "{store}, learning {learn}\n{metrics}"
        );
        if redis.is_none() {
            // The admin API shows the horizon the server table keeps.
            let entry = gw.admin_server(&format!("http://{}", engines[k].addr)).expect("listed");
            assert_eq!(entry["horizon_age_s"].is_u64(), *learn, "{entry}");
        }
        // The first conversation, refreshed a second before the evicted
        // one: set aside, routed as a new prompt; followed when only
        // counted.
        let (_, route, cached) = turn(gw, &next(0));
        if *learn {
            assert_eq!(
                route, "least_load",
                "{store}: an entry older than the eviction was followed"
            );
            // The third, refreshed after the evicted one, still counts.
            let (_, route, _) = turn(gw, &next(2));
            assert_eq!(route, "prefix", "{store}");
        } else {
            assert_eq!((route.as_str(), cached < 128), ("prefix", true), "stale and followed");
        }
    }
}
