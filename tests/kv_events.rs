//! The engines' KV cache events, end to end: simulated engines publishing
//! them as vLLM does (ZeroMQ PUB with a replay socket, msgpack batches),
//! `semlb serve` subscribing from its response process, the confirmed
//! prefix table in the segment, and the `precise` prefix source routing on
//! it.
//!
//! Shown here:
//! * blocks an engine stores appear as confirmed entries for its server,
//!   blocks it evicts disappear, and a cleared cache empties the server's
//!   entries, while the gateway's estimate keeps what it sent;
//! * a response process SIGKILLed while the engine keeps publishing is
//!   restarted, and its subscription catches up from the engine's replay;
//! * a restarted engine (its sequence starting over) leaves no entry of the
//!   old cache;
//! * routing follows what the engines confirm where the estimate is wrong:
//!   a prompt an engine evicted, and one that reached another engine
//!   without passing through the gateway, go to the engine that holds them
//!   (with `source = "estimate"`, the same requests go where the gateway
//!   sent them before, and find nothing cached).
//!
//! Waiting on the table (`wait_for`) is waiting on the thing under test:
//! the events are applied asynchronously, and the tests read what a
//! dispatcher would read.

use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Value, json};

use semlb::prefix::blocks::BlockHasher;
use semlb_test_support as support;
use shm_layout::{KvEventsSync, ServerRef};
use support::gateway::{Gateway, kv_backend_table, kv_endpoints, routed, sim_with_events, wait_for};
use support::http::{Response, http};
use support::process::Proc;

const PATIENCE: Duration = Duration::from_secs(20);

fn unique(tag: &str) -> String {
    support::process::unique("kvev", tag)
}

/// `[policy.prefix] confirm_window_secs` of these gateways.
const CONFIRM_WINDOW_S: u64 = 1;

/// A gateway in front of `engines` with the prefix `source`.
fn gateway(tag: &str, engines: &[&Proc], source: &str) -> Gateway {
    let backends: String = engines
        .iter()
        .map(|e| kv_backend_table(e).expect("the engine publishes KV events"))
        .collect();
    let config = format!(
        "{backends}[health]\nscrape_interval_ms = 50\n[policy]\nkind = \"cache_aware\"\n[policy.prefix]\nsource = \"{source}\"\nconfirm_window_secs = {CONFIRM_WINDOW_S}\n"
    );
    Gateway::builder()
        .shm(&unique(tag))
        .tag(tag)
        .dispatchers(1)
        .config(&config)
        .start()
}

/// `engine`'s current registration.
fn server(gw: &Gateway, engine: &Proc) -> ServerRef {
    gw.listed(engine)
        .map(|s| s.server)
        .unwrap_or_else(|| panic!("{} is not registered", engine.addr))
}

/// How far the confirmed table follows `engine` now.
fn sync(gw: &Gateway, engine: &Proc) -> Option<KvEventsSync> {
    gw.segment.tables().servers.kv_events(server(gw, engine))
}

/// Waits until the gateway follows every engine's events completely.
fn followed(gw: &Gateway, engines: &[&Proc]) {
    wait_for("the engines' events followed from their start", PATIENCE, || {
        let states: Vec<_> = engines.iter().map(|e| sync(gw, e)).collect();
        (states.iter().all(|s| *s == Some(KvEventsSync::Complete)), states)
    });
}

/// The chain the gateway hashes `ids` to (model `semlb-sim`, its segment's seed).
fn chain(gw: &Gateway, ids: &[u32]) -> Vec<u64> {
    let hasher = BlockHasher::new(BlockHasher::root_for("semlb-sim", gw.segment.header().seed[0]), 16);
    let mut out = Vec::new();
    hasher.chain(ids, &mut out);
    out
}

/// Blocks of `chain` the confirmed table (`confirmed`) or the estimate
/// lists `engine` for.
fn depth(gw: &Gateway, engine: &Proc, chain: &[u64], confirmed: bool) -> u32 {
    let t = gw.segment.tables();
    let tag = server(gw, engine).tag();
    let table = if confirmed { t.confirmed } else { t.prefix };
    table.longest_prefix_match(chain, |s| s == tag).blocks_for(tag)
}

/// Confirmed entries that list `engine`.
fn entries_of(gw: &Gateway, engine: &Proc) -> usize {
    let tag = server(gw, engine).tag();
    gw.segment
        .tables()
        .confirmed
        .entries()
        .filter(|(_, e)| e.servers.contains(tag))
        .count()
}

/// A prompt of `blocks` full blocks plus 5 tokens, of its own (`seed`).
fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..blocks as u32 * 16 + 5).map(|i| 1000 + seed * 7919 + i).collect()
}

/// A completion of token ids at `addr` (a gateway, or an engine directly).
fn complete(addr: &str, ids: &[u32]) -> Response {
    let body: Value = json!({"model": "semlb-sim", "prompt": ids, "max_tokens": 2});
    let r = http(addr, "POST", "/v1/completions", Some(&body), &[]).expect("completion");
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r
}

fn cached_tokens(r: &Response) -> u64 {
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

#[test]
fn stored_evicted_and_cleared_blocks_follow_the_engine() {
    // 64 blocks of KV: a few direct prompts of 20 blocks evict the first.
    let engine = sim_with_events("0.01", 10_000, &["--kv-capacity-tokens", "1024"]);
    let gw = gateway("follow", &[&engine], "precise");
    followed(&gw, &[&engine]);

    let p = prompt(1, 10);
    let c = chain(&gw, &p);
    complete(gw.addr(), &p);
    let confirmed = wait_for("the engine's stored blocks confirmed", PATIENCE, || {
        let d = depth(&gw, &engine, &c, true);
        (d == 10, d)
    });
    assert_eq!(confirmed, 10);
    assert_eq!(depth(&gw, &engine, &c, false), 10, "the estimate has them too");

    // Other prompts sent straight to the engine evict p's blocks.
    for i in 0..4 {
        complete(&engine.addr, &prompt(100 + i, 20));
    }
    wait_for("the evicted blocks gone from the confirmed table", PATIENCE, || {
        let d = depth(&gw, &engine, &c, true);
        (d == 0, d)
    });
    assert_eq!(
        depth(&gw, &engine, &c, false),
        10,
        "the estimate still lists what the engine evicted: that is what the events correct"
    );
    let direct = chain(&gw, &prompt(103, 20));
    assert_eq!(
        depth(&gw, &engine, &direct, true),
        20,
        "blocks the gateway never sent are confirmed too"
    );

    // A cleared cache empties the server's confirmed entries.
    let r = http(&engine.addr, "POST", "/reset_prefix_cache", None, &[]).unwrap();
    assert_eq!(r.status, 200);
    wait_for("a cleared engine's entries gone", PATIENCE, || {
        let n = entries_of(&gw, &engine);
        (n == 0, n)
    });
    assert_eq!(sync(&gw, &engine), Some(KvEventsSync::Complete));
    let m = gw.metrics();
    let stored = support::gateway::sample(&m, "semlb_kv_event_blocks_stored_total").unwrap();
    let removed = support::gateway::sample(&m, "semlb_kv_event_blocks_removed_total").unwrap();
    let cleared = support::gateway::sample(&m, "semlb_kv_event_cleared_total").unwrap();
    assert!(
        stored >= 90.0 && removed >= 10.0 && cleared >= 1.0,
        "{stored} {removed} {cleared}"
    );
    assert!(
        support::gateway::sample(&m, "semlb_kv_event_lag_seconds_count").unwrap() > 0.0,
        "the lag from event to table is measured"
    );
}

#[test]
fn an_engine_with_other_blocks_is_named_once_and_its_events_skipped() {
    let engine = sim_with_events("0.01", 10_000, &["--block-size", "32"]);
    let gw = Gateway::builder()
        .shm(&unique("blocks"))
        .tag("blocks")
        .dispatchers(1)
        .config(&format!(
            "{}[policy.prefix]\nsource = \"precise\"\n",
            kv_backend_table(&engine).unwrap()
        ))
        .stderr(support::process::Stderr::CaptureEcho)
        .start();
    followed(&gw, &[&engine]);
    for i in 0..3 {
        complete(gw.addr(), &prompt(300 + i, 4));
    }
    let skipped = wait_for("the events skipped", PATIENCE, || {
        let n = support::gateway::sample(&gw.metrics(), "semlb_kv_event_skipped_total").unwrap_or(0.0);
        (n >= 3.0, n)
    });
    assert!(skipped >= 3.0);
    assert_eq!(
        entries_of(&gw, &engine),
        0,
        "nothing confirmed under the wrong block size"
    );
    let log = gw.proc.stderr_text();
    assert_eq!(
        log.matches("the engine's blocks hold 32 tokens, the gateway's 16")
            .count(),
        1,
        "said once: {log}"
    );
}

#[test]
fn a_killed_subscriber_catches_up_from_the_replay() {
    let engine = sim_with_events("0.01", 10_000, &[]);
    let gw = gateway("replay", &[&engine], "precise");
    followed(&gw, &[&engine]);
    let before = prompt(2, 6);
    complete(gw.addr(), &before);
    let c = chain(&gw, &before);
    wait_for("the first prompt confirmed", PATIENCE, || {
        let d = depth(&gw, &engine, &c, true);
        (d == 6, d)
    });

    // SIGSTOP the response process, let the engine publish, SIGKILL it.
    let responder = gw
        .running(shm_layout::Role::Responder)
        .pop()
        .expect("a running responder");
    let pid = nix::unistd::Pid::from_raw(responder.pid as i32);
    nix::sys::signal::kill(pid, Signal::SIGSTOP).unwrap();
    let missed = prompt(3, 8);
    complete(&engine.addr, &missed);
    nix::sys::signal::kill(pid, Signal::SIGKILL).unwrap();

    // Its successor subscribes again, and the replay from 0 brings back
    // both prompts, the one published while nobody listened included.
    let missed_chain = chain(&gw, &missed);
    let depths = wait_for("the missed prompt confirmed after the restart", PATIENCE, || {
        let d = (depth(&gw, &engine, &c, true), depth(&gw, &engine, &missed_chain, true));
        (d == (6, 8) && sync(&gw, &engine) == Some(KvEventsSync::Complete), d)
    });
    assert_eq!(depths, (6, 8));
}

#[test]
fn a_restarted_engine_leaves_nothing_of_its_old_cache() {
    let engine = sim_with_events("0.01", 10_000, &[]);
    let gw = gateway("restart", &[&engine], "precise");
    followed(&gw, &[&engine]);
    let old = prompt(4, 6);
    complete(gw.addr(), &old);
    let c = chain(&gw, &old);
    wait_for("the prompt confirmed", PATIENCE, || {
        let d = depth(&gw, &engine, &c, true);
        (d == 6, d)
    });
    // The same engine address and sockets, a new process: an empty cache.
    let (listen, ports) = (engine.addr.clone(), kv_endpoints(&engine.line).unwrap());
    drop(engine);
    let config = format!(
        r#"{{"enable_kv_cache_events": true, "endpoint": "{}", "replay_endpoint": "{}"}}"#,
        ports.events, ports.replay
    );
    let engine = support::gateway::sim_with("0.01", &["--listen", &listen, "--kv-events-config", &config]);
    let fresh = prompt(5, 3);
    let fresh_chain = chain(&gw, &fresh);
    // Sent until the subscription has reconnected and confirms it.
    wait_for("the new engine's blocks confirmed, the old ones gone", PATIENCE, || {
        complete(&engine.addr, &fresh);
        let d = (depth(&gw, &engine, &c, true), depth(&gw, &engine, &fresh_chain, true));
        (d == (0, 3), d)
    });
    assert_eq!(sync(&gw, &engine), Some(KvEventsSync::Complete));
}

/// A gateway in front of two engines, `source` as its prefix source, where
/// the estimate is wrong twice: (1) a prompt the gateway sent to one engine
/// was then evicted there and reached the other directly; (2) a prompt
/// reached an engine without passing through the gateway. Returns, for
/// each case, the (engine that holds it, engine the gateway chose, cached
/// tokens reported, route).
fn where_the_estimate_is_wrong(source: &str) -> Vec<(String, String, u64, String)> {
    let small = ["--kv-capacity-tokens", "1024"];
    let a = sim_with_events("0.01", 10_000, &small);
    let b = sim_with_events("0.01", 10_000, &small);
    let gw = gateway(&format!("route-{source}"), &[&a, &b], source);
    followed(&gw, &[&a, &b]);
    let name = |addr: &str| if addr == a.addr { "a" } else { "b" }.to_owned();
    let engine_of = |addr: &str| if addr == a.addr { &a } else { &b };

    // (1) Sent through the gateway, evicted there, then held by the other.
    let p = prompt(7, 10);
    let c = chain(&gw, &p);
    let first = complete(gw.addr(), &p);
    let (home, _) = routed(&first);
    let home = home.trim_start_matches("http://").to_owned();
    let other = if home == a.addr { &b } else { &a };
    wait_for("the first turn confirmed", PATIENCE, || {
        let d = depth(&gw, engine_of(&home), &c, true);
        (d == 10, d)
    });
    let sent_s = gw.segment.clock().now_ms() / 1000;
    for i in 0..4 {
        complete(&home, &prompt(200 + i, 20));
    }
    complete(&other.addr, &p);
    wait_for("the eviction and the other engine's blocks confirmed", PATIENCE, || {
        let d = (depth(&gw, engine_of(&home), &c, true), depth(&gw, other, &c, true));
        (d == (0, 10), d)
    });
    // The gateway's own entries (its record at dispatch, the answer's
    // write-back) count for the confirm window; the rule under test is
    // what comes after it (stamps are whole seconds: one more).
    wait_for("the confirm window over", PATIENCE, || {
        let now_s = gw.segment.clock().now_ms() / 1000;
        (now_s > sent_s + CONFIRM_WINDOW_S + 1, now_s)
    });
    let mut out = Vec::new();
    let r = complete(gw.addr(), &p);
    let (chosen, route) = routed(&r);
    out.push((
        name(&other.addr),
        name(chosen.trim_start_matches("http://")),
        cached_tokens(&r),
        route,
    ));

    // (2) A prompt only the engine has seen.
    let q = prompt(8, 12);
    let qc = chain(&gw, &q);
    complete(&a.addr, &q);
    wait_for("the direct prompt confirmed", PATIENCE, || {
        let d = depth(&gw, &a, &qc, true);
        (d == 12, d)
    });
    let r = complete(gw.addr(), &q);
    let (chosen, route) = routed(&r);
    out.push((
        "a".to_owned(),
        name(chosen.trim_start_matches("http://")),
        cached_tokens(&r),
        route,
    ));
    out
}

#[test]
fn routing_follows_what_the_engines_confirm_where_the_estimate_is_wrong() {
    let precise = where_the_estimate_is_wrong("precise");
    for (holder, chosen, cached, route) in &precise {
        assert_eq!((chosen, route.as_str()), (holder, "prefix"), "{precise:?}");
        assert!(*cached >= 10 * 16, "the engine found the prompt cached: {precise:?}");
    }
    // The control: the estimate sends the evicted prompt back where it
    // went before (by prefix, finding nothing), and knows nothing of the
    // direct one.
    let estimate = where_the_estimate_is_wrong("estimate");
    let (holder, chosen, cached, route) = &estimate[0];
    assert_ne!(chosen, holder, "{estimate:?}");
    assert_eq!((route.as_str(), *cached), ("prefix", 0), "{estimate:?}");
    assert_ne!(estimate[1].3, "prefix", "{estimate:?}");
}

/// Engines the gateway finds or is given at run time are followed too:
/// an endpoints file's entry naming its engine's events endpoints, and an
/// engine the admin API adds with `kv_events`; a prompt sent straight to
/// each engine is confirmed for it, and an events endpoint on another
/// host than the engine's is refused (a registration carries ports on
/// the engine's own host).
#[test]
fn discovered_and_added_engines_are_followed() {
    const TOKEN: &str = "kv-events-admin-token-0123456789";
    let found = sim_with_events("0.01", 10_000, &[]);
    let added = sim_with_events("0.01", 10_000, &[]);
    let at = |e: &Proc| kv_endpoints(&e.line).expect("the engine publishes KV events");
    let dir = support::TempDir::new("kvev-discovered");
    let file = dir.0.join("endpoints.yaml");
    std::fs::write(
        &file,
        format!(
            "- url: http://{}\n  kv_events: {}\n  kv_events_replay: {}\n",
            found.addr,
            at(&found).events,
            at(&found).replay
        ),
    )
    .unwrap();
    let gw = Gateway::builder()
        .shm(&unique("discovered"))
        .tag("kvev-discovered")
        .dispatchers(1)
        .admin(TOKEN)
        .config(&format!(
            "[discovery]\nkind = \"file\"\npath = {:?}\npoll_ms = 20\n[policy.prefix]\nsource = \"precise\"\n",
            file.to_str().unwrap()
        ))
        .start();
    wait_for("the file's engine registered", PATIENCE, || {
        let listed = gw.listed(&found).is_some();
        (listed, listed)
    });
    let body = |events: &str| {
        format!(
            "{{\"url\": \"http://{}\", \"kv_events\": \"{events}\", \"kv_events_replay\": \"{}\"}}",
            added.addr,
            at(&added).replay
        )
    };
    let elsewhere = at(&added).events.replace("127.0.0.1", "127.0.0.2");
    let r = gw.admin("POST", "/admin/servers", Some(&body(&elsewhere)));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("invalid_kv_events"), "{}", r.text());
    let r = gw.admin("POST", "/admin/servers", Some(&body(&at(&added).events)));
    assert_eq!(r.status, 201, "{}", r.text());
    followed(&gw, &[&found, &added]);
    for (i, engine) in [&found, &added].into_iter().enumerate() {
        let p = prompt(200 + i as u32, 10);
        let c = chain(&gw, &p);
        complete(&engine.addr, &p);
        let d = wait_for("blocks stored on the engine confirmed", PATIENCE, || {
            let d = depth(&gw, engine, &c, true);
            (d == 10, d)
        });
        assert_eq!(d, 10, "{}", engine.addr);
    }
}
