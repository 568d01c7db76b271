//! `semlb serve` as operators run it: a real supervisor with dispatcher and
//! response processes in front of simulated engines (`semlb __sim`, each a
//! real process on loopback), driven over real HTTP.
//!
//! Shown here: a multi-turn conversation stays on one engine and its
//! `cached_tokens` grow turn by turn while distinct conversations spread;
//! `cache_aware` beats `round_robin` on the engines' own prefix-cache hit
//! rate; a repeated deterministic request is answered from the response
//! cache (also as a stream) without reaching an engine, and not across
//! tenants; `kill -9` of a dispatcher is survived (the supervisor restarts
//! it, the gateway keeps serving); SIGTERM stops everything and removes the
//! segment; a second supervisor on the same segment is refused.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

const EXE: &str = env!("CARGO_BIN_EXE_semlb");

fn unique(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("semlb-gw-{tag}-{}-{nanos}", std::process::id())
}

/// A child process that prints `... http://ADDR` as its first stdout line.
struct Proc {
    child: Child,
    addr: String,
}

impl Proc {
    fn start(args: &[&str]) -> Proc {
        let mut child = Command::new(EXE)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn semlb");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("first line");
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        let addr = line.trim().rsplit("http://").next().unwrap_or_default().to_owned();
        assert!(addr.contains(':'), "no address in {line:?}");
        Proc { child, addr }
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    /// SIGTERM and wait (bounded), SIGKILL if needed; the exit status.
    fn stop(&mut self) -> Option<i32> {
        let _ = kill(self.pid(), Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.stop();
        }
    }
}

fn sim() -> Proc {
    Proc::start(&["__sim", "--listen", "127.0.0.1:0", "--time-scale", "0.01"])
}

struct Gateway {
    proc: Proc,
    shm: String,
    segment: shm_layout::Segment,
    /// Completion records the dispatchers should have pushed so far.
    expected_records: std::cell::Cell<u64>,
}

impl Gateway {
    fn start(shm: &str, backends: &[&Proc], extra: &[&str]) -> Gateway {
        let mut args = vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--shm-name",
            shm,
            "--shm-size",
            "32MiB",
        ];
        args.extend(["--dispatchers", "2", "--responders", "1"]);
        let urls: Vec<String> = backends.iter().map(|b| format!("http://{}", b.addr)).collect();
        for u in &urls {
            args.extend(["--backend", u.as_str()]);
        }
        args.extend(extra);
        let proc = Proc::start(&args);
        let segment = shm_layout::Segment::open(shm).expect("the supervisor created the segment");
        let gw = Gateway {
            proc,
            shm: shm.to_owned(),
            segment,
            expected_records: std::cell::Cell::new(0),
        };
        gw.wait_ready();
        gw
    }

    /// Counts one more answered request whose record the dispatcher pushes,
    /// then waits until every pushed record was applied by the response
    /// process (pushed >= expected and no ring holds anything): the state a
    /// client's next turn should find.
    fn written_back(&self) {
        self.expected_records.set(self.expected_records.get() + 1);
        let t = self.segment.tables();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (pushed, used) = (0..t.ring_count())
                .map(|i| t.ring(i).stats())
                .fold((0, 0), |(p, u), s| (p + s.pushed, u + s.used));
            if pushed >= self.expected_records.get() && used == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "records not written back: pushed {pushed}, in rings {used} bytes"
            );
            std::thread::yield_now();
        }
    }

    /// Until a request goes through (the dispatchers are up).
    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if http(&self.proc.addr, "GET", "/health", None, &[]).map(|r| r.status) == Ok(200) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the gateway did not become ready");
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.proc.stop();
        let _ = shm_layout::Segment::remove(&self.shm);
    }
}

#[derive(Debug)]
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
}

/// One HTTP/1.1 request with `Connection: close`; chunked bodies decoded.
fn http(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    headers: &[(&str, &str)],
) -> Result<Response, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let payload = body.map(|b| b.to_string()).unwrap_or_default();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        payload.len()
    );
    if body.is_some() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(&payload);
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or("no header end")?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or("status")?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        let mut out = Vec::new();
        let mut rest = &body[..];
        while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
            let size =
                usize::from_str_radix(String::from_utf8_lossy(&rest[..eol]).trim(), 16).map_err(|e| e.to_string())?;
            if size == 0 {
                break;
            }
            out.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
            rest = &rest[eol + 2 + size + 2..];
        }
        body = out;
    }
    Ok(Response { status, headers, body })
}

fn chat(addr: &str, messages: &[Value], extra: Value, headers: &[(&str, &str)]) -> Response {
    let mut body = json!({"model": "semlb-sim", "messages": messages, "max_tokens": 24});
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    http(addr, "POST", "/v1/chat/completions", Some(&body), headers).expect("request")
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

/// Sum of a counter over the engines' /metrics.
fn engine_counter(engines: &[&Proc], name: &str) -> f64 {
    engines
        .iter()
        .map(|e| {
            let r = http(&e.addr, "GET", "/metrics", None, &[]).expect("metrics");
            String::from_utf8_lossy(&r.body)
                .lines()
                .filter(|l| l.starts_with(name))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>()
        })
        .sum()
}

fn long_topic(i: usize) -> String {
    format!("Conversation {i}: please explain, with many details and examples, topic number {i} about caches, queues, routers and batching in large language model serving systems. ")
        .repeat(3)
}

/// A conversation of `turns` turns; returns (backend, cached_tokens) per turn.
fn converse(gw: &Gateway, i: usize, turns: usize, extra: Value) -> Vec<(String, u64)> {
    let addr = &gw.proc.addr;
    let mut messages = vec![
        json!({"role": "system", "content": "You are a helpful assistant."}),
        user(&long_topic(i)),
    ];
    let mut out = Vec::new();
    for t in 0..turns {
        let r = chat(addr, &messages, extra.clone(), &[]);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v = r.json();
        let answer = v["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        out.push((r.header("x-semlb-backend").unwrap_or_default().to_owned(), cached));
        messages.push(json!({"role": "assistant", "content": answer}));
        messages.push(user(&format!("Turn {t}: tell me more about part {t}.")));
        gw.written_back();
    }
    out
}

#[test]
fn conversations_stick_to_one_engine_and_spread_across_engines() {
    let engines = [sim(), sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let gw = Gateway::start(&unique("sticky"), &refs, &[]);
    let turns = converse(&gw, 0, 5, json!({}));
    let first = &turns[0].0;
    assert!(
        turns.iter().all(|(b, _)| b == first),
        "the conversation moved: {turns:?}"
    );
    for w in turns.windows(2) {
        assert!(w[1].1 > w[0].1, "cached_tokens must grow turn by turn: {turns:?}");
    }
    let mut used = std::collections::HashSet::new();
    for i in 1..13 {
        used.insert(converse(&gw, i, 1, json!({}))[0].0.clone());
    }
    assert_eq!(
        used.len(),
        3,
        "distinct conversations spread over all engines: {used:?}"
    );
}

#[test]
fn cache_aware_beats_round_robin_on_the_engines_hit_rate() {
    let hit_rate = |policy: &str| {
        let engines = [sim(), sim(), sim()];
        let refs: Vec<&Proc> = engines.iter().collect();
        let gw = Gateway::start(&unique(policy), &refs, &["--policy", policy]);
        for i in 0..6 {
            converse(&gw, 100 + i, 4, json!({}));
        }
        let hits = engine_counter(&refs, "vllm:prefix_cache_hits_total");
        let queries = engine_counter(&refs, "vllm:prefix_cache_queries_total");
        hits / queries
    };
    let aware = hit_rate("cache_aware");
    let rr = hit_rate("round_robin");
    eprintln!("prefix-cache hit rate: cache_aware {aware:.3}, round_robin {rr:.3}");
    assert!(aware > rr + 0.2, "cache_aware {aware:.3} vs round_robin {rr:.3}");
}

#[test]
fn repeated_deterministic_requests_come_from_the_response_cache() {
    let engines = [sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let gw = Gateway::start(&unique("cache"), &refs, &[]);
    let msgs = [user("What is the capital of France? Answer briefly.")];
    let det = json!({"temperature": 0});
    let alice = [("Authorization", "Bearer sk-alice")];
    let first = chat(&gw.proc.addr, &msgs, det.clone(), &alice);
    assert_eq!(first.status, 200);
    assert_eq!(first.header("x-semlb-cache"), Some("miss"));
    gw.written_back();
    let served = engine_counter(&refs, "vllm:request_success_total");
    let hit = chat(&gw.proc.addr, &msgs, det.clone(), &alice);
    assert_eq!(hit.header("x-semlb-cache"), Some("hit"));
    assert_eq!(
        hit.json()["choices"],
        first.json()["choices"],
        "the cached body is the first answer"
    );
    let engine_calls_before = engine_counter(&refs, "vllm:request_success_total");
    let streamed = chat(&gw.proc.addr, &msgs, json!({"temperature": 0, "stream": true}), &alice);
    assert_eq!(streamed.header("x-semlb-cache"), Some("hit"));
    let text = String::from_utf8_lossy(&streamed.body);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert_eq!(
        engine_counter(&refs, "vllm:request_success_total"),
        engine_calls_before,
        "no engine was asked"
    );
    assert!(engine_calls_before >= served);
    let bob = chat(&gw.proc.addr, &msgs, det, &[("Authorization", "Bearer sk-bob")]);
    assert_eq!(bob.status, 200);
    assert_eq!(bob.header("x-semlb-cache"), Some("miss"), "tenants never share answers");
}

#[test]
fn a_killed_dispatcher_is_restarted_and_the_gateway_keeps_serving() {
    let engines = [sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let shm = unique("kill");
    let gw = Gateway::start(&shm, &refs, &[]);
    let seg = shm_layout::Segment::open(&shm).expect("segment");
    let dispatchers = |seg: &shm_layout::Segment| -> Vec<u32> {
        seg.tables()
            .registry
            .processes()
            .filter(|p| p.role == Some(shm_layout::Role::Dispatcher) && p.state == shm_layout::ProcessState::Running)
            .map(|p| p.pid)
            .collect()
    };
    let before = dispatchers(&seg);
    assert_eq!(before.len(), 2);
    kill(Pid::from_raw(before[0] as i32), Signal::SIGKILL).unwrap();
    // Keep serving meanwhile: every request succeeds (the other dispatcher,
    // then the restarted one, accept on the shared socket).
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut ok = 0;
    loop {
        let r = chat(&gw.proc.addr, &[user(&format!("ping {ok}"))], json!({}), &[]);
        assert_eq!(r.status, 200);
        ok += 1;
        let now = dispatchers(&seg);
        if now.len() == 2 && !now.contains(&before[0]) {
            break;
        }
        assert!(Instant::now() < deadline, "the dispatcher was not restarted: {now:?}");
    }
    let info = seg.tables().registry.processes().find(|p| p.slot == 1).unwrap();
    assert!(info.restarts >= 1);
    assert!(seg.tables().prefix.occupancy() <= seg.tables().prefix.capacity());
    assert!(ok > 0);
}

#[test]
fn sigterm_stops_everything_and_a_second_supervisor_is_refused() {
    let engines = [sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let shm = unique("term");
    let mut gw = Gateway::start(&shm, &refs, &[]);
    let second = Command::new(EXE)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--shm-name",
            &shm,
            "--shm-size",
            "32MiB",
        ])
        .args(["--backend", &format!("http://{}", engines[0].addr)])
        .output()
        .unwrap();
    assert!(!second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("in use by a running semlb supervisor"));
    assert_eq!(gw.proc.stop(), Some(0), "graceful stop exits 0");
    assert!(
        !std::path::Path::new(&format!("/dev/shm/{shm}")).exists(),
        "the segment is removed"
    );
}
