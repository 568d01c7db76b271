//! `semlb serve` in front of simulated engines for the multi-process
//! tests: [`Gateway`] (a real supervisor with dispatchers and a responder,
//! optionally from a config file), simulated engines ([`sim`], [`sim_at`],
//! [`sim_with`]), chat requests and Prometheus text helpers.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::http::{Response, http};
use super::process::Proc;

/// A simulated engine at 100x real speed.
pub fn sim() -> Proc {
    sim_at("0.01")
}

/// A simulated engine whose simulated second lasts `time_scale` real seconds.
pub fn sim_at(time_scale: &str) -> Proc {
    Proc::start(&["__sim", "--listen", "127.0.0.1:0", "--time-scale", time_scale])
}

pub struct Gateway {
    pub proc: Proc,
    pub shm: String,
    pub segment: shm_layout::Segment,
    /// Completion records the dispatchers should have pushed so far.
    expected_records: std::cell::Cell<u64>,
    /// With `--store redis`: the Redis and the namespace.
    redis: Option<(String, String)>,
    /// The config file given with `--config`, kept until the gateway stops.
    config: Option<TempFile>,
}

impl Gateway {
    pub fn start(shm: &str, backends: &[&Proc], extra: &[&str]) -> Gateway {
        Gateway::launch(shm, backends, extra, false)
    }

    /// [`Gateway::start`], optionally capturing the supervisor's stderr.
    /// `--dispatchers` in `extra` replaces the default of 2.
    pub fn launch(shm: &str, backends: &[&Proc], extra: &[&str], capture_stderr: bool) -> Gateway {
        let mut args = vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--shm-name",
            shm,
            "--shm-size",
            "32MiB",
        ];
        if !extra.contains(&"--dispatchers") {
            args.extend(["--dispatchers", "2"]);
        }
        args.extend(["--responders", "1"]);
        let urls: Vec<String> = backends.iter().map(|b| format!("http://{}", b.addr)).collect();
        for u in &urls {
            args.extend(["--backend", u.as_str()]);
        }
        args.extend(extra);
        let redis = match (
            extra.iter().position(|a| *a == "--redis-url"),
            extra.iter().position(|a| *a == "--redis-namespace"),
        ) {
            (Some(u), Some(n)) => Some((extra[u + 1].to_owned(), extra[n + 1].to_owned())),
            _ => None,
        };
        let proc = Proc::spawn(&args, capture_stderr);
        let segment = shm_layout::Segment::open(shm).expect("the supervisor created the segment");
        let gw = Gateway {
            proc,
            shm: shm.to_owned(),
            segment,
            expected_records: std::cell::Cell::new(0),
            redis,
            config: None,
        };
        gw.wait_ready();
        gw
    }

    /// [`Gateway::start`] with `config` (TOML) written to a temp file of
    /// its own and passed with `--config`; `extra` flags still override it.
    pub fn with_config(shm: &str, backends: &[&Proc], config: &str, extra: &[&str]) -> Gateway {
        let file = TempFile::new("config", config);
        let mut args = vec!["--config", file.path()];
        args.extend(extra);
        let mut gw = Gateway::start(shm, backends, &args);
        gw.config = Some(file);
        gw
    }

    /// The gateway's listener address.
    pub fn addr(&self) -> &str {
        &self.proc.addr
    }

    /// The gateway's `/metrics` text.
    pub fn metrics(&self) -> String {
        let r = http(&self.proc.addr, "GET", "/metrics", None, &[]).expect("gateway metrics");
        assert_eq!(r.status, 200, "/metrics: {}", String::from_utf8_lossy(&r.body));
        String::from_utf8_lossy(&r.body).into_owned()
    }

    /// Counts one more answered request whose record the dispatcher pushes,
    /// then waits until every pushed record was applied by the response
    /// process (pushed >= expected and no ring holds anything): the state a
    /// client's next turn should find.
    pub fn written_back(&self) {
        self.expected_records.set(self.expected_records.get() + 1);
        let t = self.segment.tables();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (pushed, used) = (0..t.ring_count())
                .map(|i| t.ring(i).stats())
                .fold((0, 0), |(p, u), s| (p + s.pushed, u + s.used));
            // Popped from the rings is not yet written: the responders count
            // a record once its write is done.
            let applied = semlb::metrics::responder_records(&t);
            if pushed >= self.expected_records.get()
                && used == 0
                && applied >= self.expected_records.get()
                && self.redis_written()
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "records not written back: pushed {pushed}, in rings {used} bytes"
            );
            std::thread::yield_now();
        }
    }

    /// With Redis: whether Redis counts every expected record as written
    /// (`{ns}:written`, bumped by each write-back pipeline). Without: true.
    fn redis_written(&self) -> bool {
        let Some((url, ns)) = &self.redis else { return true };
        let written: Option<u64> = redis::Client::open(url.as_str())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)))
            .and_then(|mut c| redis::cmd("GET").arg(format!("{ns}:written")).query(&mut c))
            .ok()
            .flatten();
        written.is_some_and(|n| n >= self.expected_records.get())
    }

    /// Until a request goes through (the dispatchers are up).
    pub fn wait_ready(&self) {
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

pub fn chat(addr: &str, messages: &[Value], extra: Value, headers: &[(&str, &str)]) -> Response {
    let mut body = json!({"model": "semlb-sim", "messages": messages, "max_tokens": 24});
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    http(addr, "POST", "/v1/chat/completions", Some(&body), headers).expect("request")
}

pub fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

/// Sum of a counter over the engines' /metrics.
pub fn engine_counter(engines: &[&Proc], name: &str) -> f64 {
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

/// A file removed when dropped.
pub struct TempFile(std::path::PathBuf);

impl TempFile {
    pub fn new(tag: &str, contents: &str) -> TempFile {
        let path = std::env::temp_dir().join(format!("{}.toml", super::process::unique("gw", tag)));
        std::fs::write(&path, contents).expect("write a temp file");
        TempFile(path)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().expect("a UTF-8 temp path")
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The value of the sample `series` (name and labels exactly as exposed,
/// e.g. `semlb_queue_requests_total{outcome="routed"}`) in a Prometheus
/// text; `None` when absent.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.rsplit_once(' ').filter(|(k, _)| *k == series))
        .and_then(|(_, v)| v.parse().ok())
}

/// Every sample of the family `name` as (labels, value), labels as in the
/// text without braces (`server="http://..."`).
pub fn samples(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let labels = match series.split_once('{') {
                Some((n, rest)) if n == name => rest.strip_suffix('}')?.to_owned(),
                None if series == name => String::new(),
                _ => return None,
            };
            Some((labels, value.parse().ok()?))
        })
        .collect()
}

/// Waits until `cond` holds, polling every 20 ms; panics after `within`
/// with `what` and the last value `cond` saw.
pub fn wait_for<T: std::fmt::Debug>(what: &str, within: Duration, mut probe: impl FnMut() -> (bool, T)) -> T {
    let deadline = Instant::now() + within;
    loop {
        let (ok, seen) = probe();
        if ok {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; last seen: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The routed backend and route reason of an answer.
pub fn routed(r: &Response) -> (String, String) {
    (
        r.header("x-semlb-backend").unwrap_or_default().to_owned(),
        r.header("x-semlb-route").unwrap_or_default().to_owned(),
    )
}

/// A streamed answer's text and whether it ended with `data: [DONE]`.
pub fn stream_text(r: &Response) -> (String, bool) {
    let body = String::from_utf8_lossy(&r.body);
    let mut text = String::new();
    let mut done = false;
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data.trim() == "[DONE]" {
            done = true;
            continue;
        }
        if let Ok(v) = serde_json::from_str::<Value>(data)
            && let Some(t) = v["choices"][0]["delta"]["content"].as_str()
        {
            text.push_str(t);
        }
    }
    (text, done)
}
