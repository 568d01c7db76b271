//! Hot restart: a supervisor that starts on the segment an earlier one left
//! adopts it with its tables, as clients see it through real HTTP and SSE.
//!
//! Shown here: after SIGTERM and a start on the same segment name, the next
//! turn of every conversation goes to the engine of its first turn, routed
//! by prefix, and a deterministic request asked before the restart is a
//! response-cache hit that reaches no engine; with `keep_segment = false`
//! neither happens (the control). A gateway killed with SIGKILL (the
//! supervisor and every child, streams in flight) is adopted by the next
//! start, which reclaims the in-flight counts the dead processes left. A
//! segment of another layout version is replaced, with the log line saying
//! why. Ownership is a lock, not a pid: a segment whose header and registry
//! name a live process (as a reused pid would) does not block a start,
//! while a running supervisor blocks a second one and `semlb shm remove`.

use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

use semlb::metrics::responder_records;
use semlb_test_support as support;
use shm_layout::{LAYOUT_VERSION, LayoutPlan, ProcessState, Role, Segment};
use support::gateway::{Gateway, chat, engine_counter, routed, sim, sim_at, stream_text, user};
use support::http::http;
use support::process::{Proc, Stderr, exe};
use support::segment::requests_in_flight;

fn unique(tag: &str) -> String {
    support::process::unique("hot", tag)
}

/// A gateway on segment `shm` in front of `engines`, its stderr captured,
/// with `config` (TOML) if given.
fn gateway(shm: &str, engines: &[&Proc], config: Option<&str>) -> Gateway {
    let mut builder = Gateway::builder()
        .shm(shm)
        .tag("hot-restart")
        .backends(engines)
        .stderr(Stderr::CaptureEcho);
    if let Some(toml) = config {
        builder = builder.config(toml);
    }
    builder.start()
}

/// The streamed first turn of conversation `i`: the next turn's messages
/// and the engine that answered.
fn first_turn(addr: &str, i: usize) -> (Vec<Value>, String) {
    let mut messages = vec![
        json!({"role": "system", "content": format!("You are the assistant of team {i}; answer in detail.")}),
        user(&format!(
            "Conversation {i}: explain how topic {} works, step by step.",
            i * 13
        )),
    ];
    let r = chat(addr, &messages, streamed(), &[("api-key", "agent")]);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let (text, done) = stream_text(&r);
    assert!(done, "a whole stream");
    messages.push(json!({"role": "assistant", "content": text}));
    messages.push(user("Go on, and give an example."));
    (messages, routed(&r).0)
}

fn streamed() -> Value {
    json!({"stream": true, "max_tokens": 48})
}

/// What a restart kept, as clients see it.
#[derive(Debug)]
struct AfterRestart {
    /// Per conversation: (same engine as turn 1, route of turn 2).
    turns: Vec<(bool, String)>,
    /// `x-semlb-cache` of the repeated deterministic request.
    cache: String,
    /// Engine requests the repeat caused.
    engine_calls: f64,
    /// The restarted supervisor's log.
    log: String,
}

/// Warms 6 conversations and a deterministic request, SIGTERMs the
/// supervisor, starts another on the same segment name (with `config`),
/// and sends the next turns and the repeat.
fn restart(tag: &str, config: Option<&str>) -> AfterRestart {
    let engines = [sim(), sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let shm = unique(tag);
    let question = [user("What is the boiling point of water at sea level? Answer briefly.")];
    let deterministic = json!({"temperature": 0});
    let alice = [("api-key", "sk-alice")];

    let gw = gateway(&shm, &refs, config);
    let conversations: Vec<_> = (0..6).map(|i| first_turn(gw.addr(), i)).collect();
    let first = chat(gw.addr(), &question, deterministic.clone(), &alice);
    assert_eq!(first.status, 200);
    assert_eq!(first.header("x-semlb-cache"), Some("miss"));
    // The restart is what is under test, not the write-back's timing: wait
    // until all 7 answers are written back before stopping.
    for _ in 0..7 {
        gw.written_back(responder_records);
    }
    assert_eq!(gw.stop_keeping_segment(), Some(0), "a graceful stop exits 0");

    let gw = gateway(&shm, &refs, config);
    let turns = conversations
        .iter()
        .map(|(messages, backend)| {
            let r = chat(gw.addr(), messages, streamed(), &[("api-key", "agent")]);
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            assert!(stream_text(&r).1, "a whole stream");
            let (now, route) = routed(&r);
            (now == *backend, route)
        })
        .collect();
    let before = engine_counter(&refs, "vllm:request_success_total");
    let repeat = chat(gw.addr(), &question, deterministic, &alice);
    assert_eq!(repeat.status, 200);
    let cache = repeat.header("x-semlb-cache").unwrap_or_default().to_owned();
    if cache == "hit" {
        assert_eq!(
            repeat.json()["choices"],
            first.json()["choices"],
            "the answer from before"
        );
    }
    AfterRestart {
        turns,
        cache,
        engine_calls: engine_counter(&refs, "vllm:request_success_total") - before,
        log: gw.proc.stderr_text(),
    }
}

#[test]
fn a_restarted_gateway_routes_by_prefix_and_answers_from_the_cache_it_had() {
    let after = restart("keep", None);
    assert!(after.log.contains("adopted shm segment"), "{}", after.log);
    assert!(
        after.turns.iter().all(|(same, route)| *same && route == "prefix"),
        "every next turn goes to its engine by prefix: {:?}",
        after.turns
    );
    assert_eq!(after.cache, "hit");
    assert_eq!(after.engine_calls, 0.0, "no engine was asked");
}

#[test]
fn without_keep_segment_a_restart_starts_empty() {
    let after = restart("nokeep", Some("keep_segment = false\n"));
    assert!(after.log.contains("created shm segment"), "{}", after.log);
    assert!(
        after.turns.iter().all(|(_, route)| route != "prefix"),
        "nothing is known of the conversations: {:?}",
        after.turns
    );
    assert_eq!(after.cache, "miss");
    assert_eq!(after.engine_calls, 1.0);
}

#[test]
fn a_killed_gateway_is_adopted_and_the_counts_its_processes_left_are_reclaimed() {
    // Slow engines: the streams are still running when everything dies.
    let engines = [sim_at("1.0"), sim_at("1.0")];
    let refs: Vec<&Proc> = engines.iter().collect();
    let shm = unique("kill");
    let mut gw = gateway(&shm, &refs, None);
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let addr = gw.addr().to_owned();
            std::thread::spawn(move || {
                let body = json!({
                    "model": "semlb-sim",
                    "messages": [user(&format!("Stream {i}: a long story, please."))],
                    "stream": true,
                    "max_tokens": 2000,
                    "ignore_eos": true,
                });
                // Cut off when the gateway dies: an error, not a panic.
                let _ = http(&addr, "POST", "/v1/chat/completions", Some(&body), &[]);
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    while requests_in_flight(&gw.segment) < 4 {
        assert!(Instant::now() < deadline, "the streams did not start");
        std::thread::yield_now();
    }
    // Every process of the gateway at once, as the OOM killer or a power
    // cut of the cgroup would.
    let children: Vec<u32> = gw
        .segment
        .tables()
        .registry
        .processes()
        .filter(|p| p.state == ProcessState::Running && p.role != Some(Role::Supervisor))
        .map(|p| p.pid)
        .collect();
    gw.proc.kill9();
    for pid in &children {
        let _ = kill(Pid::from_raw(*pid as i32), Signal::SIGKILL);
    }
    for c in clients {
        c.join().expect("client");
    }
    assert_eq!(
        requests_in_flight(&gw.segment),
        4,
        "nobody took the dead processes' counts back yet"
    );
    gw.stop_keeping_segment();

    let gw = gateway(&shm, &refs, None);
    let log = gw.proc.stderr_text();
    assert!(log.contains("adopted shm segment"), "{log}");
    assert!(log.contains("4 requests they had in flight reclaimed"), "{log}");
    assert_eq!(requests_in_flight(&gw.segment), 0);
    let r = chat(gw.addr(), &[user("Still there?")], json!({"max_tokens": 8}), &[]);
    assert_eq!(r.status, 200);
}

#[test]
fn a_segment_of_another_layout_version_is_replaced_with_a_log_line() {
    let engines = [sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let shm = unique("layout");
    // A segment as an older semlb left it: the layout version is the
    // header's second word.
    drop(Segment::create(&shm, &LayoutPlan::for_size(32 << 20).unwrap()).unwrap());
    let file = format!("/dev/shm/{shm}");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[8..16].copy_from_slice(&(LAYOUT_VERSION - 1).to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();

    let gw = gateway(&shm, &refs, None);
    let log = gw.proc.stderr_text();
    let said = format!(
        "has layout version {}, this semlb expects {LAYOUT_VERSION}; the tables start empty",
        LAYOUT_VERSION - 1
    );
    assert!(
        log.lines()
            .any(|l| l.contains("replacing shm segment") && l.contains(&said)),
        "{log}"
    );
    assert_eq!(gw.segment.header().layout_version, LAYOUT_VERSION);
    let r = chat(gw.addr(), &[user("Hello?")], json!({"max_tokens": 8}), &[]);
    assert_eq!(r.status, 200);
}

#[test]
fn ownership_is_a_lock_not_a_pid() {
    let engines = [sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let shm = unique("pid");
    // This (live) test process creates the segment and registers itself as
    // its supervisor, as a pid reused after a crash would look, and holds
    // no lock.
    {
        let segment = Segment::create(&shm, &LayoutPlan::for_size(32 << 20).unwrap()).unwrap();
        let t = segment.tables();
        let me = t.registry.claim(0, Role::Supervisor, 0);
        t.registry.attach(0, me, std::process::id(), 0);
    }
    let gw = gateway(&shm, &refs, None);
    assert!(gw.proc.stderr_text().contains("adopted shm segment"));

    // A running supervisor's lock refuses a second one and a removal.
    let second = Command::new(exe())
        .args(Gateway::builder().backends(&refs).serve_args(&shm))
        .output()
        .unwrap();
    assert!(!second.status.success());
    let said = String::from_utf8_lossy(&second.stderr);
    assert!(
        said.contains(&format!(
            "is in use by a running semlb supervisor (pid {})",
            gw.proc.pid()
        )),
        "{said}"
    );
    let remove = Command::new(exe())
        .args(["shm", "remove", "--shm-name", &shm])
        .output()
        .unwrap();
    assert!(!remove.status.success());
    assert!(String::from_utf8_lossy(&remove.stderr).contains("in use by a running semlb supervisor"));
    assert!(std::path::Path::new(&format!("/dev/shm/{shm}")).exists());
}
