//! Health of the inference servers, end to end: a real `semlb serve`
//! (supervisor, dispatchers, responder) in front of simulated engines
//! (`semlb __sim` processes, and one in-process `semlb-sim` with fault
//! injection), the test reading the shm server table read-only
//! (`shm_layout::Segment::open`) to see what the gateway decided.
//!
//! Shown here: an engine killed with SIGKILL is set `Down` by the active
//! checks while every request keeps succeeding on the others, and a new
//! engine on the same port is set `Up` again and gets requests; an engine
//! answering 500 to every inference request (its `/health` fine) is ejected
//! by the passive checks of the dispatcher after exactly
//! `unhealthy_threshold` failed requests, with no client error, long before
//! any active check; the engines' `vllm:num_requests_running` and
//! `vllm:kv_cache_usage_perc` reach the server table as load figures with a
//! recent `scraped_at_ms` under load, and go back to zero after it. Every
//! wait polls a condition with a deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use shm_layout::{EngineContext, LoadFigures, ServerState};

use semlb_test_support as support;
use support::gateway::{Gateway, answered_by_gateway, sim_on, sim_with};
use support::http::Response;
use support::process::Stderr;

const PATIENCE: Duration = Duration::from_secs(30);

fn unique(tag: &str) -> String {
    support::process::unique("health", tag)
}

/// Polls `f` until it holds, failing after [`PATIENCE`].
fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

// A configuration file with `text` (the backends come as flags).
use support::TempFile as ConfigFile;

/// `semlb serve` with `config`, 1 responder, `--backend http://ADDR` for
/// each of `backends`, and `extra` flags (2 dispatchers unless given), its
/// stderr captured.
fn gateway(tag: &str, config: &ConfigFile, backends: &[&str], extra: &[&str]) -> Gateway {
    let mut builder = Gateway::builder()
        .shm(&unique(tag))
        .tag(tag)
        .args(&["--config", config.path()])
        .args(extra)
        .stderr(Stderr::CaptureEcho);
    for b in backends {
        builder = builder.backend(b);
    }
    builder.start()
}

/// What the tests read of a gateway: the server table and its clock, and
/// requests that must succeed.
trait Observe {
    /// The state and load of the server registered for `addr` (`host:port`).
    fn server(&self, addr: &str) -> (ServerState, LoadFigures);
    /// The state of the server registered for `addr`.
    fn state(&self, addr: &str) -> ServerState {
        self.server(addr).0
    }
    /// The segment's clock.
    fn now_ms(&self) -> u64;
    /// Prefix-table entries that list the server registered for `addr`.
    fn entries(&self, addr: &str) -> usize;
    /// A completion request with a prompt of its own; must be answered 200.
    /// Returns the engine that answered (`host:port`).
    fn complete(&self, i: usize) -> String;
}

impl Observe for Gateway {
    fn server(&self, addr: &str) -> (ServerState, LoadFigures) {
        let url = format!("http://{addr}");
        let info = self
            .segment
            .tables()
            .servers
            .servers()
            .find(|s| s.address == url)
            .unwrap_or_else(|| panic!("{url} is not in the server table"));
        (info.state, info.load)
    }

    fn now_ms(&self) -> u64 {
        self.segment.clock().now_ms()
    }

    fn entries(&self, addr: &str) -> usize {
        let url = format!("http://{addr}");
        let tables = self.segment.tables();
        let info = tables.servers.servers().find(|s| s.address == url).expect("registered");
        let tag = info.server.tag();
        tables.prefix.entries().filter(|(_, e)| e.servers.contains(tag)).count()
    }

    fn complete(&self, i: usize) -> String {
        let body = json!({"model": "semlb-sim", "prompt": format!("health check request number {i}"), "max_tokens": 4});
        let r = http(&self.proc.addr, "POST", "/v1/completions", Some(&body)).expect("request");
        assert_eq!(r.status, 200, "request {i}: {}", String::from_utf8_lossy(&r.body));
        let backend = r.header("x-semlb-backend").expect("x-semlb-backend").to_owned();
        backend.trim_start_matches("http://").to_owned()
    }
}

/// One request with no extra headers ([`support::http::http`]).
fn http(addr: &str, method: &str, path: &str, body: Option<&Value>) -> Result<Response, String> {
    support::http::http(addr, method, path, body, &[])
}

/// Active checks: `kill -9` of an engine sets it `Down` while requests keep
/// succeeding on the others; an engine started again on the same port is
/// set `Up` again after `healthy_threshold` checks, with the prefix
/// entries of the engine that died forgotten, and gets requests.
/// Passive checks are off here, so only the active checker can decide.
#[test]
fn a_killed_engine_is_marked_down_and_a_new_one_on_its_port_readmitted() {
    let config = ConfigFile::new(
        "active",
        "[health]\ninterval_ms = 100\ntimeout_ms = 100\nunhealthy_threshold = 2\nhealthy_threshold = 2\npassive = false\n",
    );
    let mut engines = [
        sim_on("127.0.0.1:0", "0.01"),
        sim_on("127.0.0.1:0", "0.01"),
        sim_on("127.0.0.1:0", "0.01"),
    ];
    let addrs: Vec<String> = engines.iter().map(|e| e.addr.clone()).collect();
    let gw = gateway(
        "active",
        &config,
        &addrs.iter().map(String::as_str).collect::<Vec<_>>(),
        &["--policy", "round_robin"],
    );
    assert!(addrs.iter().all(|a| gw.state(a) == ServerState::Up));
    let dead = addrs[0].clone();
    // What the gateway learned of the engine before it died.
    for i in 0..6 {
        gw.complete(1000 + i);
    }
    let learned = gw.entries(&dead);
    assert!(learned > 0, "the prompts sent there are in the prefix table");

    engines[0].kill9();
    // Requests keep succeeding (a request sent to the dead engine is
    // retried on another) until the checker has taken it out.
    let mut i = 0;
    wait_until("the killed engine is Down", || {
        let answered_by = gw.complete(i);
        assert_ne!(answered_by, dead, "a killed engine cannot answer");
        i += 1;
        gw.state(&dead) == ServerState::Down
    });
    assert!(addrs[1..].iter().all(|a| gw.state(a) == ServerState::Up));
    // The state is in the segment before the checker logs it: wait for the line.
    gw.proc.wait_stderr(
        0,
        &format!("backend http://{dead} is down: 2 health checks in a row failed"),
        PATIENCE,
    );
    for _ in 0..6 {
        assert_ne!(gw.complete(i), dead);
        i += 1;
    }

    // A new engine on the same port.
    let _revived = sim_on(&dead, "0.01");
    wait_until("the new engine on the port is Up", || {
        gw.state(&dead) == ServerState::Up
    });
    gw.proc.wait_stderr(
        0,
        &format!("backend http://{dead} is up again: 2 health checks in a row passed"),
        PATIENCE,
    );
    // An engine back from the dead starts with an empty cache: what the
    // table said of its predecessor is forgotten.
    assert_eq!(gw.entries(&dead), 0, "of {learned} entries, some were kept");
    // Round robin over three live engines: it gets one request in three.
    let answered: Vec<String> = (0..6).map(|k| gw.complete(i + k)).collect();
    assert!(
        answered.iter().filter(|a| **a == dead).count() >= 1,
        "the re-admitted engine gets requests again: {answered:?}"
    );
}

/// An engine restarted between two scrapes, too quickly for any health
/// check to see it down: its prompt-token counter goes back, and the
/// gateway forgets what the table said of the engine that died.
#[test]
fn an_engine_restarted_between_scrapes_is_forgotten() {
    let config = ConfigFile::new(
        "restart",
        "[health]\ninterval_ms = 600000\ntimeout_ms = 200\nscrape_interval_ms = 50\npassive = false\n",
    );
    let mut engines = [sim_on("127.0.0.1:0", "0.01"), sim_on("127.0.0.1:0", "0.01")];
    let addrs: Vec<String> = engines.iter().map(|e| e.addr.clone()).collect();
    let gw = gateway(
        "restart",
        &config,
        &addrs.iter().map(String::as_str).collect::<Vec<_>>(),
        &["--policy", "round_robin"],
    );
    let restarted = addrs[0].clone();
    for i in 0..8 {
        gw.complete(i);
    }
    let learned = gw.entries(&restarted);
    assert!(learned > 0, "the prompts sent there are in the prefix table");
    // A scrape has seen its counter since those requests.
    let answered = gw.now_ms();
    wait_until("a scrape after the requests", || {
        gw.server(&restarted).1.scraped_at_ms > answered
    });
    let line = gw.proc.stderr_text().len();
    engines[0].kill9();
    let _new = sim_on(&restarted, "0.01");
    gw.proc.wait_stderr(
        line,
        &format!("backend http://{restarted}: its prompt-token counter went back"),
        PATIENCE,
    );
    assert_eq!(gw.state(&restarted), ServerState::Up, "no health check saw it down");
    assert_eq!(gw.entries(&restarted), 0, "of {learned} entries, some were kept");
    assert!(gw.entries(&addrs[1]) > 0, "the other engine's entries are kept");
}

/// An in-process `semlb-sim` with fault injection.
struct FaultySim {
    addr: String,
    sim: Arc<semlb_workers::server::Sim>,
    runtime: Option<tokio::runtime::Runtime>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl FaultySim {
    fn start(faults: semlb_workers::faults::FaultConfig) -> FaultySim {
        use semlb_workers::config::EngineConfig;
        use semlb_workers::server::Sim;

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (addr, sim) = runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let config = EngineConfig {
                model_name: "semlb-sim".into(),
                time_scale: 0.01,
                ..EngineConfig::default()
            };
            let sim = Arc::new(Sim::bundled(config, faults));
            tokio::spawn(semlb_workers::server::serve(listener, sim.clone(), async move {
                let _ = stopped.await;
            }));
            (addr, sim)
        });
        FaultySim {
            addr,
            sim,
            runtime: Some(runtime),
            stop: Some(stop),
        }
    }
}

impl Drop for FaultySim {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

/// Passive checks: an engine answering 500 to every inference request (and
/// 200 to `/health`, so active checks would never take it out) is ejected
/// by the dispatcher after exactly `unhealthy_threshold` failed requests,
/// every one of them retried on a good engine (no client error); it then
/// gets no more requests. The active check interval is 10 minutes, so the
/// checker neither ejects nor re-admits it during the test.
#[test]
fn an_engine_answering_5xx_is_ejected_by_the_dispatcher() {
    let faulty = FaultySim::start(semlb_workers::faults::FaultConfig {
        fail_rate: 1.0,
        ..Default::default()
    });
    let good = [sim_on("127.0.0.1:0", "0.01"), sim_on("127.0.0.1:0", "0.01")];
    let config = ConfigFile::new(
        "passive",
        "[health]\ninterval_ms = 600000\nunhealthy_threshold = 3\nhealthy_threshold = 2\npassive = true\n",
    );
    let gw = gateway(
        "passive",
        &config,
        &[faulty.addr.as_str(), good[0].addr.as_str(), good[1].addr.as_str()],
        // One dispatcher: one passive counter, so exactly 3 failures eject.
        &["--dispatchers", "1", "--policy", "round_robin"],
    );
    assert_eq!(gw.state(&faulty.addr), ServerState::Up);
    let mut i = 0;
    wait_until("the failing engine is Down", || {
        assert_ne!(gw.complete(i), faulty.addr, "the failing engine never answers");
        i += 1;
        gw.state(&faulty.addr) == ServerState::Down
    });
    assert_eq!(
        faulty.sim.faults().admitted(),
        3,
        "ejected after exactly 3 failed requests"
    );
    gw.proc.wait_stderr(
        0,
        &format!(
            "backend http://{} is down: 3 requests in a row failed (last: http://{} answered 500",
            faulty.addr, faulty.addr
        ),
        PATIENCE,
    );
    for _ in 0..9 {
        assert_ne!(gw.complete(i), faulty.addr);
        i += 1;
    }
    assert_eq!(
        faulty.sim.faults().admitted(),
        3,
        "no request reaches an ejected engine"
    );
    assert_eq!(gw.state(&faulty.addr), ServerState::Down, "held until checks pass");
    assert!(good.iter().all(|g| gw.state(&g.addr) == ServerState::Up));
}

/// Load scraping: under load the engines' running requests and KV-cache
/// usage appear in the server table with a recent `scraped_at_ms`, and
/// drop back to zero running once the load is gone.
#[test]
fn engine_load_is_scraped_into_the_server_table() {
    let config = ConfigFile::new(
        "scrape",
        "[health]\nscrape_interval_ms = 50\ntimeout_ms = 500\nstale_after_ms = 1000\n",
    );
    let engines = [sim_on("127.0.0.1:0", "0.2"), sim_on("127.0.0.1:0", "0.2")];
    let addrs: Vec<&str> = engines.iter().map(|e| e.addr.as_str()).collect();
    let gw = gateway("scrape", &config, &addrs, &["--policy", "round_robin"]);
    // Idle: scraped, nothing running.
    for a in &addrs {
        wait_until("an idle engine is scraped", || gw.server(a).1.scraped_at_ms > 0);
        let f = gw.server(a).1;
        assert_eq!((f.waiting, f.running), (0, 0), "{a}: {f:?}");
    }

    // Load: 8 long generations at once.
    let gateway_addr = gw.proc.addr.clone();
    let clients: Vec<_> = (0..8)
        .map(|k| {
            let addr = gateway_addr.clone();
            std::thread::spawn(move || {
                let body = json!({
                    "model": "semlb-sim",
                    "prompt": format!("a long story number {k} about scraping metrics"),
                    "max_tokens": 200,
                    "ignore_eos": true,
                });
                http(&addr, "POST", "/v1/completions", Some(&body)).map(|r| r.status)
            })
        })
        .collect();
    let mut seen: Vec<(String, LoadFigures, u64)> = Vec::new();
    wait_until("running requests appear in the server table", || {
        let now = gw.now_ms();
        for a in &addrs {
            let f = gw.server(a).1;
            if f.running > 0 {
                seen.push((a.to_string(), f, now));
            }
        }
        seen.len() >= 2
    });
    for (a, f, now) in &seen {
        assert!(
            now.saturating_sub(f.scraped_at_ms) <= 1000,
            "{a}: scraped at {} ms, now {now} ms",
            f.scraped_at_ms
        );
        assert!(f.kv_usage_permyriad > 0, "{a}: running requests hold KV blocks: {f:?}");
        assert!(f.running <= 8, "{a}: {f:?}");
    }
    for c in clients {
        assert_eq!(c.join().unwrap(), Ok(200));
    }
    // Idle again: the next scrapes say so.
    for a in &addrs {
        let after = gw.now_ms();
        wait_until("the load is gone", || {
            let f = gw.server(a).1;
            f.scraped_at_ms > after && f.running == 0 && f.waiting == 0
        });
    }
    let log = gw.proc.stderr_text();
    assert!(
        addrs
            .iter()
            .all(|a| log.contains(&format!("backend http://{a}: load from its vllm metrics"))),
        "{log}"
    );
}

/// The engines' context (`/v1/models`' `max_model_len`, here 300 tokens)
/// reaches the server table, and a request no engine can take, its prompt
/// alone or with the output it asks for, is answered by the gateway with
/// the engines' 400 `context_length_exceeded`, never reaching an engine
/// (no `x-semlb-backend`), whether streamed or not; one that fits is
/// served. With `limits.check_context = false` the same request reaches an
/// engine, which refuses it itself.
#[test]
fn a_request_no_engine_can_take_gets_the_engines_400_from_the_gateway() {
    let engine = || sim_with("0.01", &["--max-model-len", "300"]);
    let engines = [engine(), engine()];
    let addrs: Vec<&str> = engines.iter().map(|e| e.addr.as_str()).collect();
    let config = ConfigFile::new("context", "[health]\nscrape_interval_ms = 50\n");
    let gw = gateway("context", &config, &addrs, &[]);
    let said = EngineContext {
        tokens: 300,
        counts_output: true,
    };
    for a in &addrs {
        let url = format!("http://{a}");
        wait_until("the engine's context is known", || {
            gw.segment
                .tables()
                .servers
                .servers()
                .any(|s| s.address == url && s.engine_context == Some(said))
        });
    }
    // About one token per word, with both tokenizers (the bundled one).
    let prompt = |words: usize| "word ".repeat(words);
    let ask = |addr: &str, body: Value| http(addr, "POST", "/v1/completions", Some(&body)).expect("request");
    let fits = ask(
        &gw.proc.addr,
        json!({"model": "semlb-sim", "prompt": prompt(200), "max_tokens": 20}),
    );
    assert_eq!(fits.status, 200, "{}", String::from_utf8_lossy(&fits.body));
    assert!(fits.header("x-semlb-backend").is_some());
    for (what, body) in [
        (
            "prompt and output",
            json!({"model": "semlb-sim", "prompt": prompt(200), "max_tokens": 200}),
        ),
        ("the prompt alone", json!({"model": "semlb-sim", "prompt": prompt(400)})),
        (
            "streamed",
            json!({"model": "semlb-sim", "prompt": prompt(400), "stream": true}),
        ),
    ] {
        let error = answered_by_gateway(&ask(&gw.proc.addr, body), 400, what);
        assert_eq!(error["error"]["code"], "context_length_exceeded", "{what}: {error}");
        assert_eq!(error["error"]["type"], "invalid_request_error", "{what}");
        assert_eq!(error["error"]["param"], "prompt", "{what}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("maximum context length is 300 tokens"),
            "{what}: {message}"
        );
    }
    // Without the check, the engine refuses it itself.
    let unchecked = ConfigFile::new("no-context", "[limits]\ncheck_context = false\n");
    let plain = gateway("no-context", &unchecked, &addrs, &[]);
    let engine_said = ask(
        &plain.proc.addr,
        json!({"model": "semlb-sim", "prompt": prompt(200), "max_tokens": 200}),
    );
    assert_eq!(
        engine_said.status,
        400,
        "{}",
        String::from_utf8_lossy(&engine_said.body)
    );
    assert!(engine_said.header("x-semlb-backend").is_some(), "forwarded");
}
