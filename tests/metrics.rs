//! `GET /metrics` of a real gateway: `semlb serve` with two dispatchers
//! and a responder in front of two simulated engines (`semlb __sim`), all
//! real processes. Requests go through whichever dispatcher accepts them;
//! the scrape (answered by either) must show the sums over both: requests
//! by endpoint and code, cache misses then hits on repeats, completion
//! records, upstream outcomes per server, histograms whose counts match.
//! The whole output is validated with a Prometheus text-format parser
//! (the `prometheus-parse` crate) and checked for HELP/TYPE on every
//! family.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

mod support;

const EXE: &str = env!("CARGO_BIN_EXE_semlb");

fn unique(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("semlb-metrics-{tag}-{}-{nanos}", std::process::id())
}

/// A child process that prints `... http://ADDR` as its first stdout line.
struct Proc {
    child: Child,
    addr: String,
    /// Its stderr (and its children's) as far as read, when captured.
    #[allow(dead_code)] // Keeps the echoing thread's buffer alive.
    stderr: Option<Arc<Mutex<String>>>,
}

impl Proc {
    fn start(args: &[&str]) -> Proc {
        Proc::spawn(args, false)
    }

    /// Like [`Proc::start`]; with `capture_stderr`, stderr is collected in
    /// [`Proc::stderr`] (and still echoed to the test's stderr).
    fn spawn(args: &[&str], capture_stderr: bool) -> Proc {
        let mut child = Command::new(EXE)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(if capture_stderr {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .spawn()
            .expect("spawn semlb");
        let stderr = child.stderr.take().map(|err| {
            let text = Arc::new(Mutex::new(String::new()));
            let sink = text.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    eprintln!("{line}");
                    let mut t = sink.lock().unwrap();
                    t.push_str(&line);
                    t.push('\n');
                }
            });
            text
        });
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("first line");
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        let addr = line.trim().rsplit("http://").next().unwrap_or_default().to_owned();
        assert!(addr.contains(':'), "no address in {line:?}");
        Proc { child, addr, stderr }
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    /// Its exit status, waiting at most `within`; `None` if still running.
    fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM and wait (bounded), SIGKILL if needed; the exit status. A
    /// process that already exited (and was reaped) is not signalled again.
    fn stop(&mut self) -> Option<i32> {
        if let Ok(Some(status)) = self.child.try_wait() {
            return status.code();
        }
        let _ = kill(self.pid(), Signal::SIGTERM);
        if let Some(status) = self.wait_exit(Duration::from_secs(20)) {
            return status.code();
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
}

/// One HTTP/1.1 request with `Connection: close`; chunked bodies decoded.
fn http(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    headers: &[(&str, &str)],
) -> Result<Response, String> {
    let payload = body.map(|b| b.to_string());
    http_bytes(addr, method, path, payload.as_deref().map(str::as_bytes), headers)
}

/// [`http`] with the body as raw bytes (sent as `application/json`, valid or not).
fn http_bytes(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &[(&str, &str)],
) -> Result<Response, String> {
    let payload = body.unwrap_or_default();
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
    let mut req = req.into_bytes();
    req.extend_from_slice(payload);
    exchange(addr, &req)
}

/// Sends `request` (a whole HTTP/1.1 request, which should ask for
/// `Connection: close`) and reads the answer until the server closes.
///
/// A server may answer before it has read the whole request (413) and
/// close with unread bytes in its socket, which resets the connection: a
/// write error is then ignored, and a reset after a complete head ends the
/// answer instead of failing it.
fn exchange(addr: &str, request: &[u8]) -> Result<Response, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    let written = s.write_all(request);
    let mut raw = Vec::new();
    let read = s.read_to_end(&mut raw);
    let has_head = raw.windows(4).any(|w| w == b"\r\n\r\n");
    match read {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset && has_head => {}
        Err(e) => return Err(format!("{e} (write: {written:?})")),
    }
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

fn sim() -> Proc {
    Proc::start(&["__sim", "--listen", "127.0.0.1:0", "--time-scale", "0.01"])
}

struct Shm(String);

impl Drop for Shm {
    fn drop(&mut self) {
        let _ = shm_layout::Segment::remove(&self.0);
    }
}

fn chat(addr: &str, text: &str) -> Response {
    let body = json!({"model": "semlb-sim", "messages": [{"role": "user", "content": text}],
        "max_tokens": 16, "temperature": 0});
    http(addr, "POST", "/v1/chat/completions", Some(&body), &[]).expect("request")
}

fn scrape(addr: &str) -> (String, prometheus_parse::Scrape) {
    let r = http(addr, "GET", "/metrics", None, &[]).expect("scrape");
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .unwrap_or_default()
            .starts_with("text/plain; version=0.0.4")
    );
    let text = String::from_utf8(r.body).expect("UTF-8");
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    let parsed = prometheus_parse::Scrape::parse(lines).unwrap_or_else(|e| panic!("{e}:\n{text}"));
    (text, parsed)
}

/// The value of the sample `name` whose labels include `labels`, summed.
fn value(s: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    s.samples
        .iter()
        .filter(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
        .map(|x| match &x.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => *v,
            prometheus_parse::Value::Histogram(h) => h.iter().map(|c| c.count).fold(0.0, f64::max),
            prometheus_parse::Value::Summary(_) => 0.0,
        })
        .sum()
}

#[test]
fn metrics_sum_over_dispatchers_and_parse() {
    let engines = [sim(), sim()];
    let shm = unique("sum");
    let _shm = Shm(shm.clone());
    let mut args = vec![
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--shm-name",
        &shm,
        "--shm-size",
        "32MiB",
        "--dispatchers",
        "2",
        "--responders",
        "1",
    ];
    let urls: Vec<String> = engines.iter().map(|e| format!("http://{}", e.addr)).collect();
    for u in &urls {
        args.extend(["--backend", u.as_str()]);
    }
    let gw = Proc::start(&args);
    let deadline = Instant::now() + Duration::from_secs(30);
    while http(&gw.addr, "GET", "/health", None, &[]).map(|r| r.status) != Ok(200) {
        assert!(Instant::now() < deadline, "the gateway did not become ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let segment = shm_layout::Segment::open(&shm).expect("segment");

    // Distinct prompts (misses), then each repeated once the responder has
    // stored the answers (hits), plus a 404, a 405 and /v1/models.
    const N: usize = 12;
    for i in 0..N {
        let r = chat(&gw.addr, &format!("question number {i}: what is {i} + {i}?"));
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-semlb-cache"), Some("miss"));
    }
    let t = segment.tables();
    let deadline = Instant::now() + Duration::from_secs(10);
    while t.responses.stats().records < N as u64 {
        assert!(Instant::now() < deadline, "answers not stored");
        std::thread::sleep(Duration::from_millis(20));
    }
    for i in 0..N {
        let r = chat(&gw.addr, &format!("question number {i}: what is {i} + {i}?"));
        assert_eq!(r.header("x-semlb-cache"), Some("hit"));
    }
    assert_eq!(http(&gw.addr, "GET", "/nope", None, &[]).unwrap().status, 404);
    assert_eq!(http(&gw.addr, "POST", "/metrics", None, &[]).unwrap().status, 405);
    assert_eq!(http(&gw.addr, "GET", "/v1/models", None, &[]).unwrap().status, 200);

    let (text, s) = scrape(&gw.addr);
    let chat_200 = value(
        &s,
        "semlb_requests_total",
        &[("endpoint", "chat_completions"), ("code", "200")],
    );
    assert_eq!(chat_200, (2 * N) as f64, "{text}");
    assert_eq!(
        value(&s, "semlb_requests_total", &[("endpoint", "other"), ("code", "404")]),
        1.0
    );
    assert_eq!(
        value(&s, "semlb_requests_total", &[("endpoint", "other"), ("code", "405")]),
        1.0
    );
    assert_eq!(
        value(&s, "semlb_requests_total", &[("endpoint", "models"), ("code", "200")]),
        1.0
    );
    assert_eq!(value(&s, "semlb_response_cache_total", &[("result", "miss")]), N as f64);
    assert_eq!(value(&s, "semlb_response_cache_total", &[("result", "hit")]), N as f64);
    assert_eq!(
        value(&s, "semlb_completion_records_total", &[("result", "pushed")]),
        N as f64
    );
    assert_eq!(value(&s, "semlb_responder_records_total", &[]), N as f64);
    assert_eq!(
        value(&s, "semlb_upstream_requests_total", &[("outcome", "ok")]),
        N as f64
    );
    assert_eq!(value(&s, "semlb_upstream_requests_total", &[("outcome", "error")]), 0.0);
    for u in &urls {
        assert_eq!(value(&s, "semlb_server_up", &[("server", u)]), 1.0, "{u}");
        assert_eq!(value(&s, "semlb_server_state", &[("server", u), ("state", "up")]), 1.0);
    }
    assert!(value(&s, "semlb_prefix_table_entries", &[]) > 0.0);
    // Histograms: one TTFT per relayed answer, one duration per inference request.
    assert!(text.contains(&format!("semlb_ttft_seconds_count {N}\n")), "{text}");
    assert!(text.contains(&format!("semlb_request_duration_seconds_count {}\n", 2 * N)));
    assert!(text.contains(&format!("semlb_dispatch_seconds_count{{stage=\"route\"}} {N}\n")));
    assert!(text.contains(&format!("semlb_dispatch_seconds_count{{stage=\"total\"}} {}\n", 2 * N)));
    assert!(text.contains(&format!("semlb_prefix_match_ratio_count {N}\n")));

    // The sum is over both dispatchers' blocks: what each counted.
    let dispatchers: Vec<u16> = t
        .registry
        .processes()
        .filter(|p| p.role == Some(shm_layout::Role::Dispatcher))
        .map(|p| p.slot)
        .collect();
    assert_eq!(dispatchers.len(), 2);
    let per: Vec<u64> = dispatchers
        .iter()
        .map(|slot| semlb::metrics::Metrics::new(t.stats, *slot).cache_count(semlb::metrics::CacheResult::Hit))
        .collect();
    assert_eq!(per.iter().sum::<u64>(), N as u64, "hits per dispatcher: {per:?}");
    eprintln!("cache hits per dispatcher: {per:?}");

    // Every family has HELP and TYPE; every sample belongs to a typed family.
    let types: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap())
        .collect();
    let helps = text.lines().filter(|l| l.starts_with("# HELP ")).count();
    assert_eq!(types.len(), helps);
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let name = line.split(['{', ' ']).next().unwrap();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suf| name.strip_suffix(suf).filter(|f| types.contains(f)));
        assert!(types.contains(&name) || family.is_some(), "untyped sample {line}");
    }
}
