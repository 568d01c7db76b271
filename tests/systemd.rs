//! `semlb serve` as systemd runs it: the unit file passes `systemd-analyze
//! verify` (and its offline security rating), and a real supervisor with a
//! notification socket owned by the test says `READY=1` once the gateway
//! serves, pings `WATCHDOG=1` while its children are healthy (and stops
//! while a dispatcher is hung), `RELOADING=1` then `READY=1` around a
//! SIGHUP, and `STOPPING=1` on SIGTERM. A SIGHUP reload of the
//! configuration file adds a backend (it gets requests), drains and
//! removes another (it gets none and leaves the server table; a request in
//! flight to it finishes first, untouched), switches the
//! routing policy of the dispatchers, and rejects a broken file while the
//! gateway keeps serving with the running configuration.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;

use semlb_test_support as support;
use support::gateway::{Gateway, sim};

use support::TempDir;
use support::notify::NotifySocket;
use support::process::{Proc, exe};

fn unique(tag: &str) -> String {
    support::process::unique("sd", tag)
}

#[derive(Debug)]
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 request with `Connection: close`; the status and headers.
fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> Result<Response, String> {
    let payload = body.unwrap_or_default();
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{payload}",
        payload.len()
    );
    s.write_all(request.as_bytes()).map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw);
    let head = text.split("\r\n\r\n").next().ok_or("no head")?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no status in {text:?}"))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    Ok(Response { status, headers })
}

/// A sampled (never cached) chat request; the backend that answered it.
fn chat(gateway: &str, text: &str) -> String {
    let body = json!({
        "model": "semlb-sim",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "temperature": 0.8,
    })
    .to_string();
    let r = http(gateway, "POST", "/v1/chat/completions", Some(&body)).expect("chat");
    assert_eq!(r.status, 200, "{r:?}");
    r.header("x-semlb-backend").expect("x-semlb-backend").to_owned()
}

/// The addresses in the segment's server table.
fn servers(segment: &shm_layout::Segment) -> Vec<String> {
    segment.tables().servers.servers().map(|s| s.address).collect()
}

/// Polls `condition` every 20 ms until it holds; panics with `what` after `within`.
fn until(within: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_unit_file_verifies() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd/semlb.service");
    let text = std::fs::read_to_string(&unit).expect("systemd/semlb.service");
    for key in [
        "Type=notify",
        "NotifyAccess=main",
        "ExecStart=/usr/local/bin/semlb serve --config /etc/semlb/semlb.toml",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "Restart=on-failure",
        "WatchdogSec=",
        "User=semlb",
        "LimitNOFILE=1048576",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=",
    ] {
        assert!(text.lines().any(|l| l.starts_with(key)), "the unit lacks {key}");
    }
    if Command::new("systemd-analyze").arg("--version").output().is_err() {
        eprintln!("SKIPPED: systemd-analyze is not installed (apt-get install systemd); the unit was not verified");
        return;
    }
    // verify wants ExecStart's binary to exist: point it at the built one.
    let dir = TempDir::new("unit");
    let local = dir.0.join("semlb.service");
    std::fs::write(
        &local,
        text.replace("ExecStart=/usr/local/bin/semlb ", &format!("ExecStart={} ", exe())),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&local)
        .output()
        .expect("systemd-analyze verify");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("systemd-analyze verify: {}{stderr}", out.status);
    assert!(out.status.success(), "systemd-analyze verify failed: {stderr}");
    // It exits 0 on unknown keys and bad values, but says so.
    let complaints: Vec<&str> = stderr.lines().filter(|l| l.contains("semlb.service")).collect();
    assert!(
        complaints.is_empty(),
        "systemd-analyze verify complains: {complaints:#?}"
    );
    // The sandbox: the offline rating must stay "OK" (2.0 or below).
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--threshold=20", "--no-pager"])
        .arg(&local)
        .output()
        .expect("systemd-analyze security");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let verdict = stdout
        .lines()
        .find(|l| l.contains("Overall exposure"))
        .unwrap_or_default();
    eprintln!("systemd-analyze security: {verdict}");
    assert!(
        out.status.success(),
        "exposure above 2.0: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn notifies_ready_watchdog_reloading_and_stopping() {
    let dir = TempDir::new("notify");
    let socket = NotifySocket::bind(&dir.0);
    let engine = sim();
    let shm = unique("notify");
    let args = Gateway::builder().backends(&[&engine]).serve_args(&shm);
    let mut gw = Proc::spawn_env(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        true,
        &[("NOTIFY_SOCKET", &socket.env()), ("WATCHDOG_USEC", "2000000")],
    );
    // READY=1 means serving: the very next request is answered.
    let ready = socket.wait_for(0, "READY=1", Duration::from_secs(30));
    assert_eq!(http(&gw.addr, "GET", "/health", None).map(|r| r.status), Ok(200));
    let first = &socket.all()[ready];
    assert!(
        first.contains("STATUS=") && first.contains("2/2 dispatchers, 1/1 responders up"),
        "{first:?}"
    );
    assert!(
        socket.all()[..ready].iter().all(|m| !m.contains("WATCHDOG=1")),
        "pings before READY=1"
    );
    assert!(chat(&gw.addr, "Hello there, how are you?").ends_with(&engine.addr));

    // Pings at half of WATCHDOG_USEC (1 s), repeatedly.
    let mut at = ready;
    let started = Instant::now();
    for _ in 0..3 {
        at = socket.wait_for(at + 1, "WATCHDOG=1", Duration::from_secs(3));
    }
    assert!(started.elapsed() < Duration::from_secs(5), "pings too slow");

    // A hung dispatcher (stopped: no heartbeats) stops the pings; they
    // resume once it runs again.
    let segment = shm_layout::Segment::open(&shm).expect("segment");
    let dispatcher = segment
        .tables()
        .registry
        .processes()
        .find(|p| p.role == Some(shm_layout::Role::Dispatcher) && p.state == shm_layout::ProcessState::Running)
        .expect("a running dispatcher");
    let dispatcher = Pid::from_raw(dispatcher.pid as i32);
    kill(dispatcher, Signal::SIGSTOP).unwrap();
    let unhealthy = socket.wait_for_containing(at + 1, "STATUS=", "1/2 dispatchers", Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(2500)); // two ping intervals without a ping
    let quiet = socket.all();
    kill(dispatcher, Signal::SIGCONT).unwrap();
    assert!(
        quiet[unhealthy..].iter().all(|m| !m.contains("WATCHDOG=1")),
        "pinged while a dispatcher was hung: {:#?}",
        &quiet[unhealthy..]
    );
    let healthy = socket.wait_for_containing(unhealthy + 1, "STATUS=", "2/2 dispatchers", Duration::from_secs(10));
    at = socket.wait_for(healthy, "WATCHDOG=1", Duration::from_secs(3));

    // SIGHUP: RELOADING=1 (with MONOTONIC_USEC), then READY=1; still serving.
    let before = socket.len();
    gw.signal(Signal::SIGHUP);
    let reloaded = socket.wait_reload(before.max(at));
    assert!(chat(&gw.addr, "And after the reload?").ends_with(&engine.addr));
    socket.wait_for(reloaded + 1, "WATCHDOG=1", Duration::from_secs(3));

    // SIGTERM: STOPPING=1, then the process exits 0.
    let before = socket.len();
    gw.signal(Signal::SIGTERM);
    let stopping = socket.wait_for(before, "STOPPING=1", Duration::from_secs(10));
    let status = gw.wait_exit(Duration::from_secs(20)).expect("the supervisor exits");
    assert_eq!(status.code(), Some(0));
    let all = socket.all();
    assert!(
        all[stopping + 1..]
            .iter()
            .all(|m| !m.contains("READY=1") && !m.contains("WATCHDOG=1")),
        "READY/WATCHDOG after STOPPING=1: {:#?}",
        &all[stopping..]
    );
    assert!(
        !gw.stderr_text().contains("cannot notify systemd"),
        "children must not notify"
    );
    assert!(
        Path::new("/dev/shm").join(&shm).exists(),
        "the segment is left for the next start (keep_segment)"
    );
    let _ = shm_layout::Segment::remove(&shm);
}

/// `semlb serve --config FILE` with `[[backend]]`s and a policy.
fn write_config(path: &Path, shm: &str, backends: &[&Proc], policy: &str, extra: &str) {
    let mut text = format!(
        "listen = \"127.0.0.1:0\"\ndispatchers = 1\nresponders = 1\nshm_name = \"{shm}\"\nshm_size = \"32MiB\"\nkeep_segment = false\ndrain_timeout_secs = 5\n{extra}\n"
    );
    for b in backends {
        text.push_str(&format!("[[backend]]\nurl = \"http://{}\"\n", b.addr));
    }
    text.push_str(&format!("[policy]\nkind = \"{policy}\"\n"));
    // Written whole and renamed, as an editor or a config manager would.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[test]
fn sighup_reloads_backends_and_policy_and_rejects_a_broken_file() {
    let dir = TempDir::new("reload");
    let socket = NotifySocket::bind(&dir.0);
    let (a, b, c) = (sim(), sim(), sim());
    let shm = unique("reload");
    let config = dir.0.join("semlb.toml");
    write_config(&config, &shm, &[&a, &b], "cache_aware", "");
    let config_arg = config.display().to_string();
    let gw = Proc::spawn_env(
        &["serve", "--config", &config_arg],
        true,
        &[("NOTIFY_SOCKET", &socket.env())],
    );
    let mut at = socket.wait_for(0, "READY=1", Duration::from_secs(30));
    let segment = shm_layout::Segment::open(&shm).expect("segment");
    let written_back = |n: u64| {
        let t = segment.tables();
        until(Duration::from_secs(10), "the write-back", || {
            let s = t.ring(0).stats();
            s.pushed >= n && s.used == 0
        });
    };
    let name = |backend: &str| -> &'static str {
        [(&a, "a"), (&b, "b"), (&c, "c")]
            .into_iter()
            .find(|(p, _)| backend.ends_with(&p.addr))
            .map(|(_, n)| n)
            .unwrap_or_else(|| panic!("{backend} is no engine"))
    };
    let prompt = "Tell me everything about prefix caches in large language model serving, in detail, please.";

    // cache_aware: once its prefix is learned, a prompt sticks to its engine.
    let home = name(&chat(&gw.addr, prompt));
    written_back(1);
    let sticky: Vec<&str> = (0..4).map(|_| name(&chat(&gw.addr, prompt))).collect();
    assert!(
        sticky.iter().all(|n| *n == home),
        "cache_aware moved: {home} then {sticky:?}"
    );

    // Policy → round_robin: the same prompt now alternates.
    let log = gw.stderr_text().len();
    write_config(&config, &shm, &[&a, &b], "round_robin", "");
    gw.signal(Signal::SIGHUP);
    at = socket.wait_reload(at + 1);
    gw.wait_stderr(log, "routing policy now round_robin", Duration::from_secs(10));
    let turns: Vec<&str> = (0..6).map(|_| name(&chat(&gw.addr, prompt))).collect();
    assert!(
        turns.windows(2).all(|w| w[0] != w[1]),
        "round_robin does not alternate: {turns:?}"
    );

    // Add c: registered at once, and routed to.
    write_config(&config, &shm, &[&a, &b, &c], "round_robin", "");
    gw.signal(Signal::SIGHUP);
    at = socket.wait_reload(at + 1);
    let c_address = format!("http://{}", c.addr);
    assert!(servers(&segment).contains(&c_address), "{:?}", servers(&segment));
    let turns: Vec<&str> = (0..6).map(|_| name(&chat(&gw.addr, prompt))).collect();
    for n in ["a", "b", "c"] {
        assert_eq!(turns.iter().filter(|t| **t == n).count(), 2, "{turns:?}");
    }

    // Remove b: it drains (nothing in flight), leaves the table, gets nothing.
    write_config(&config, &shm, &[&a, &c], "round_robin", "");
    gw.signal(Signal::SIGHUP);
    at = socket.wait_reload(at + 1);
    let b_address = format!("http://{}", b.addr);
    until(Duration::from_secs(10), "b to leave the server table", || {
        !servers(&segment).contains(&b_address)
    });
    let turns: Vec<&str> = (0..6).map(|_| name(&chat(&gw.addr, prompt))).collect();
    assert!(!turns.contains(&"b"), "b still gets requests: {turns:?}");
    assert!(turns.contains(&"a") && turns.contains(&"c"), "{turns:?}");
    assert!(
        gw.stderr_text()
            .contains(&format!("backend {b_address} drained and removed")),
        "no drain logged"
    );

    // A file that does not validate, then one that does not parse: rejected,
    // logged naming the key, shown in STATUS=, and the gateway keeps serving
    // a and c in turn.
    for (broken, key) in [
        ("dispatchers = 0", "dispatchers"),
        ("[policy\nkind = \"random\"", "TOML"),
    ] {
        let log = gw.stderr_text().len();
        let text = std::fs::read_to_string(&config).unwrap();
        let text = if key == "dispatchers" {
            text.replace("dispatchers = 1", broken)
        } else {
            format!("{text}\n{broken}\n")
        };
        std::fs::write(&config, text).unwrap();
        gw.signal(Signal::SIGHUP);
        at = socket.wait_reload(at + 1);
        assert!(
            socket.all()[at].contains("last reload failed"),
            "STATUS= does not say the reload failed: {:?}",
            socket.all()[at]
        );
        let log_text = gw.wait_stderr(log, "reload rejected", Duration::from_secs(10));
        let line = log_text[log..].lines().find(|l| l.contains("reload rejected")).unwrap();
        assert!(line.contains(key), "the error does not name {key}: {line}");
        let turns: Vec<&str> = (0..4).map(|_| name(&chat(&gw.addr, prompt))).collect();
        assert!(
            turns.windows(2).all(|w| w[0] != w[1]) && !turns.contains(&"b"),
            "{turns:?}"
        );
    }
    assert_eq!(servers(&segment).len(), 2, "{:?}", servers(&segment));

    // A good file again clears the failure from STATUS=.
    write_config(&config, &shm, &[&a, &c], "round_robin", "");
    gw.signal(Signal::SIGHUP);
    at = socket.wait_reload(at + 1);
    assert!(!socket.all()[at].contains("reload failed"), "{:?}", socket.all()[at]);
}

#[test]
fn a_removed_backend_finishes_its_requests_before_it_leaves() {
    let dir = TempDir::new("drain");
    let socket = NotifySocket::bind(&dir.0);
    let fast = sim();
    // A real-speed engine: 400 tokens take about 4 s.
    let slow = Proc::start(&["__sim", "--listen", "127.0.0.1:0", "--time-scale", "1"]);
    let shm = unique("drain");
    let config = dir.0.join("semlb.toml");
    write_config(&config, &shm, &[&fast, &slow], "round_robin", "");
    let config_arg = config.display().to_string();
    let gw = Proc::spawn_env(
        &["serve", "--config", &config_arg],
        true,
        &[("NOTIFY_SOCKET", &socket.env())],
    );
    let at = socket.wait_for(0, "READY=1", Duration::from_secs(30));
    let segment = shm_layout::Segment::open(&shm).expect("segment");
    let slow_address = format!("http://{}", slow.addr);
    let slow_info = || segment.tables().servers.servers().find(|s| s.address == slow_address);
    // Round robin: the first request goes to the first backend, the next
    // (a long one) to the slow one.
    assert!(chat(&gw.addr, "warm up").ends_with(&fast.addr));
    let addr = gw.addr.clone();
    let long = std::thread::spawn(move || {
        let body = json!({
            "model": "semlb-sim",
            "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 400,
            "temperature": 0.8,
        })
        .to_string();
        http(&addr, "POST", "/v1/chat/completions", Some(&body))
    });
    until(Duration::from_secs(10), "the long request to be in flight", || {
        slow_info().is_some_and(|s| s.inflight_requests > 0)
    });
    write_config(&config, &shm, &[&fast], "round_robin", "");
    gw.signal(Signal::SIGHUP);
    socket.wait_reload(at + 1);
    let info = slow_info().expect("still registered while its request runs");
    assert_eq!(info.state, shm_layout::ServerState::Draining);
    for i in 0..4 {
        assert!(chat(&gw.addr, &format!("new request {i}")).ends_with(&fast.addr));
    }
    let answer = long.join().unwrap().expect("the long request");
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.header("x-semlb-backend"), Some(slow_address.as_str()));
    until(Duration::from_secs(10), "the drained backend to leave", || {
        slow_info().is_none()
    });
}
