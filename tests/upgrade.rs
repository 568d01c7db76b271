//! Zero-downtime binary upgrade, as a client and systemd see it: the
//! gateway runs from an installed copy of the binary, a new binary is
//! installed over it (a new file renamed into place, as `install` does),
//! and SIGUSR2 makes the supervisor start it as its successor, hand it the
//! listening socket and the segment, tell systemd `MAINPID=`, and drain.
//!
//! Shown here: agents sending 2400 requests back to back on keep-alive
//! connections (every other one streamed) across the upgrade get every
//! answer; streams that started before it finish whole; the old supervisor
//! exits 0, the successor runs the new file and is the segment's
//! supervisor, and pings the watchdog. A successor that cannot start is a
//! failed upgrade: logged, and the old supervisor serves on.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

use semlb_test_support as support;
use shm_layout::{ProcessState, Role, Segment};
use support::TempDir;
use support::gateway::{Gateway, sim_at, stream_text, user};
use support::http::{Response, http};
use support::keepalive::KeepAlive;
use support::notify::NotifySocket;
use support::process::{Proc, ProcBuilder, Stderr, exe};
use support::segment::requests_in_flight;

fn unique(tag: &str) -> String {
    support::process::unique("upg", tag)
}

/// Removes the segment when dropped (a supervisor leaves it at exit).
struct RemoveSegment(String);

impl Drop for RemoveSegment {
    fn drop(&mut self) {
        let _ = Segment::remove(&self.0);
    }
}

/// `semlb serve` from the binary at `program`, on segment `shm`, in front
/// of `engines`, notifying `socket`.
fn serve_from(program: &std::path::Path, shm: &str, engines: &[&Proc], socket: &NotifySocket) -> Proc {
    let args = Gateway::builder().backends(engines).serve_args(shm);
    ProcBuilder::new(&args)
        .program(program)
        .env("NOTIFY_SOCKET", socket.env())
        .env("WATCHDOG_USEC", "2000000")
        .stderr(Stderr::CaptureEcho)
        .start()
}

/// Installs a copy of the test's semlb binary at `path` the way `install`
/// does: a new file, renamed over the old one.
fn install(path: &std::path::Path) {
    let fresh = path.with_extension("new");
    std::fs::copy(exe(), &fresh).expect("copy the binary");
    std::fs::rename(&fresh, path).expect("rename it into place");
}

/// The running supervisor's pid in the segment's registry.
fn registered_supervisor(segment: &Segment) -> Option<u32> {
    segment
        .tables()
        .registry
        .processes()
        .find(|p| p.role == Some(Role::Supervisor) && p.state == ProcessState::Running)
        .map(|p| p.pid)
}

/// A long stream, started now on its own connection.
fn long_stream(addr: &str, i: usize) -> std::thread::JoinHandle<(Response, Instant)> {
    let addr = addr.to_owned();
    std::thread::spawn(move || {
        let body = json!({
            "model": "semlb-sim",
            "messages": [user(&format!("Stream {i}: tell me a long story."))],
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_tokens": 6000,
            "ignore_eos": true,
        });
        let r = http(&addr, "POST", "/v1/chat/completions", Some(&body), &[]).expect("the stream");
        (r, Instant::now())
    })
}

/// What one agent saw.
#[derive(Debug, Default)]
struct AgentRun {
    answered: usize,
    failures: Vec<String>,
    connections: usize,
}

/// An agent: `requests` chat requests back to back on a keep-alive
/// connection, every other one streamed; counts answers in `done`.
fn agent(addr: &str, i: usize, requests: usize, done: Arc<AtomicUsize>) -> std::thread::JoinHandle<AgentRun> {
    let addr = addr.to_owned();
    std::thread::spawn(move || {
        let mut client = KeepAlive::new(&addr);
        let mut run = AgentRun::default();
        for n in 0..requests {
            let streamed = n % 2 == 1;
            let body = json!({
                "model": "semlb-sim",
                "messages": [user(&format!("Agent {i}, step {n}: what next?"))],
                "max_tokens": 8,
                "stream": streamed,
            });
            let answer = client.post("/v1/chat/completions", &body.to_string(), &[("api-key", "sk-agent")]);
            match answer {
                Ok(a)
                    if a.status == 200 && (!streamed || String::from_utf8_lossy(&a.body).contains("data: [DONE]")) =>
                {
                    run.answered += 1;
                }
                Ok(a) => run
                    .failures
                    .push(format!("step {n}: {} {}", a.status, String::from_utf8_lossy(&a.body))),
                Err(e) => run.failures.push(format!("step {n}: {e}")),
            }
            done.fetch_add(1, Ordering::Relaxed);
        }
        run.connections = client.connections;
        run
    })
}

/// SIGKILLs a successor (not a child of the test) if the test ends
/// before stopping it.
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.0 as i32), Signal::SIGKILL);
    }
}

/// Waits (bounded) until `pid`, no child of this process, is gone.
fn wait_gone(pid: u32, within: Duration) {
    let deadline = Instant::now() + within;
    while kill(Pid::from_raw(pid as i32), None).is_ok() {
        assert!(Instant::now() < deadline, "pid {pid} still runs after {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_upgrade_under_load_fails_no_request_and_finishes_every_stream() {
    let dir = TempDir::new("upgrade");
    let installed = dir.0.join("semlb");
    install(&installed);
    let socket = NotifySocket::bind(&dir.0);
    let engines = [sim_at("0.05"), sim_at("0.05")];
    let refs: Vec<&Proc> = engines.iter().collect();
    let shm = unique("load");
    let _segment_removed = RemoveSegment(shm.clone());
    let mut old = serve_from(&installed, &shm, &refs, &socket);
    socket.wait_for(0, "READY=1", Duration::from_secs(30));
    let segment = Segment::open(&shm).unwrap();
    let old_pid = old.pid().as_raw() as u32;
    assert_eq!(registered_supervisor(&segment), Some(old_pid));

    let streams: Vec<_> = (0..3).map(|i| long_stream(&old.addr, i)).collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    while requests_in_flight(&segment) < 3 {
        assert!(Instant::now() < deadline, "the streams did not start");
        std::thread::yield_now();
    }
    let done = Arc::new(AtomicUsize::new(0));
    let agents: Vec<_> = (0..4).map(|i| agent(&old.addr, i, 600, done.clone())).collect();
    while done.load(Ordering::Relaxed) < 200 {
        std::thread::yield_now();
    }

    // The upgrade: a new binary in place, then SIGUSR2, with the streams
    // still running.
    assert!(
        streams.iter().all(|s| !s.is_finished()),
        "the streams ended before the upgrade"
    );
    install(&installed);
    let before = socket.len();
    let upgraded_at = Instant::now();
    kill(old.pid(), Signal::SIGUSR2).unwrap();
    let handed = socket.wait_for_containing(before, "MAINPID=", "", Duration::from_secs(60));
    let new_pid: u32 = socket.all()[handed]
        .lines()
        .find_map(|l| l.strip_prefix("MAINPID="))
        .and_then(|p| p.parse().ok())
        .expect("MAINPID=<pid>");
    let _successor = KillOnDrop(new_pid);
    let status = old
        .wait_exit(Duration::from_secs(60))
        .expect("the old supervisor exits");
    eprintln!(
        "upgrade: handed over to pid {new_pid} and the old supervisor exited {status} {:?} after SIGUSR2; {} answers by then",
        upgraded_at.elapsed(),
        done.load(Ordering::Relaxed)
    );
    assert_eq!(status.code(), Some(0), "the old supervisor drains and exits 0");
    assert_ne!(new_pid, old_pid);
    assert_eq!(
        std::fs::read_link(format!("/proc/{new_pid}/exe")).unwrap(),
        installed,
        "the successor runs the binary installed now"
    );
    assert_eq!(registered_supervisor(&segment), Some(new_pid));
    // The successor is the main process now: it pings the watchdog.
    socket.wait_for(handed + 1, "WATCHDOG=1", Duration::from_secs(5));

    let runs: Vec<AgentRun> = agents.into_iter().map(|a| a.join().expect("agent")).collect();
    eprintln!("agents: {runs:?}");
    let answered: usize = runs.iter().map(|r| r.answered).sum();
    let failures: Vec<&String> = runs.iter().flat_map(|r| &r.failures).collect();
    assert!(failures.is_empty(), "failed requests across the upgrade: {failures:#?}");
    assert_eq!(answered, 2400);
    assert!(
        runs.iter().any(|r| r.connections > 1),
        "the agents were moved to new connections (the old dispatchers drained)"
    );
    for (i, s) in streams.into_iter().enumerate() {
        let (r, ended) = s.join().expect("stream");
        assert_eq!(r.status, 200, "stream {i}");
        let (text, done) = stream_text(&r);
        assert!(done && !text.is_empty(), "stream {i} ends with [DONE]");
        let body = String::from_utf8_lossy(&r.body);
        let tokens = body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find_map(|v| v["usage"]["completion_tokens"].as_u64());
        assert_eq!(tokens, Some(6000), "stream {i} is whole");
        eprintln!(
            "stream {i}: 6000 tokens, ended {:?} after SIGUSR2",
            ended.saturating_duration_since(upgraded_at)
        );
    }

    // Every completion record is written back, those the old dispatchers
    // pushed while draining and those of the successor's own dispatchers
    // (on rings the old ones did not use).
    let t = segment.tables();
    let deadline = Instant::now() + Duration::from_secs(10);
    while (0..t.ring_count()).any(|r| t.ring(r).stats().used > 0) {
        assert!(
            Instant::now() < deadline,
            "completion records left unwritten in the rings"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let stats: Vec<_> = (0..t.ring_count())
        .map(|r| t.ring(r).stats())
        .filter(|s| s.pushed > 0)
        .collect();
    // (A ring that is full drops a record and counts it: a debug build's
    // responder can fall behind this load.)
    let produced: u64 = stats.iter().map(|s| s.pushed + s.dropped).sum();
    assert!(produced >= 2400, "{produced} records: {stats:#?}");
    assert!(
        stats.len() >= 2,
        "both supervisors' dispatchers pushed records: {stats:#?}"
    );

    // The successor serves on the same address, and stops on SIGTERM.
    let r = http(
        &old.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat_body("After?")),
        &[],
    )
    .unwrap();
    assert_eq!(r.status, 200);
    kill(Pid::from_raw(new_pid as i32), Signal::SIGTERM).unwrap();
    wait_gone(new_pid, Duration::from_secs(40));
}

fn chat_body(text: &str) -> Value {
    json!({"model": "semlb-sim", "messages": [user(text)], "max_tokens": 8})
}

#[test]
fn a_successor_that_cannot_start_leaves_the_gateway_serving() {
    let dir = TempDir::new("upgrade-fails");
    let installed = dir.0.join("semlb");
    install(&installed);
    let socket = NotifySocket::bind(&dir.0);
    let engines = [sim_at("0.05")];
    let refs: Vec<&Proc> = engines.iter().collect();
    let shm = unique("fails");
    let _segment_removed = RemoveSegment(shm.clone());
    let mut old = serve_from(&installed, &shm, &refs, &socket);
    socket.wait_for(0, "READY=1", Duration::from_secs(30));

    // A broken "new binary".
    let fresh = installed.with_extension("new");
    std::fs::write(&fresh, "#!/bin/sh\necho broken >&2\nexit 3\n").unwrap();
    std::fs::set_permissions(&fresh, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::rename(&fresh, &installed).unwrap();
    let before = socket.len();
    kill(old.pid(), Signal::SIGUSR2).unwrap();
    let said = old.wait_stderr(0, "upgrade failed", Duration::from_secs(30));
    assert!(said.contains("before it was ready"), "{said}");
    assert!(old.running(), "the old supervisor serves on");
    assert!(
        socket.all()[before..].iter().all(|m| !m.contains("MAINPID=")),
        "no hand-over was announced"
    );
    let r = http(
        &old.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat_body("Still?")),
        &[],
    )
    .unwrap();
    assert_eq!(r.status, 200);
}
