//! `GET /metrics` of a real gateway: `semlb serve` with two dispatchers
//! and a responder in front of two simulated engines (`semlb __sim`), all
//! real processes. Requests go through whichever dispatcher accepts them;
//! the scrape (answered by either) must show the sums over both: requests
//! by endpoint and code, cache misses then hits on repeats, completion
//! records, upstream outcomes per server, histograms whose counts match.
//! The whole output is validated with a Prometheus text-format parser
//! (the `prometheus-parse` crate) and checked for HELP/TYPE on every
//! family.

use std::time::{Duration, Instant};

use serde_json::json;

use semlb_test_support as support;
use support::gateway::{Gateway, sim};
use support::http::{Response, http};
use support::process::unique;

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
    let shm = unique("metrics", "sum");
    let _shm = Shm(shm.clone());
    let urls: Vec<String> = engines.iter().map(|e| format!("http://{}", e.addr)).collect();
    let gw = Gateway::start(&shm, &[&engines[0], &engines[1]], &[]);
    let segment = shm_layout::Segment::open(&shm).expect("segment");

    // Distinct prompts (misses), then each repeated once the responder has
    // stored the answers (hits), plus a 404, a 405 and /v1/models.
    const N: usize = 12;
    for i in 0..N {
        let r = chat(gw.addr(), &format!("question number {i}: what is {i} + {i}?"));
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
        let r = chat(gw.addr(), &format!("question number {i}: what is {i} + {i}?"));
        assert_eq!(r.header("x-semlb-cache"), Some("hit"));
    }
    assert_eq!(http(gw.addr(), "GET", "/nope", None, &[]).unwrap().status, 404);
    assert_eq!(http(gw.addr(), "POST", "/metrics", None, &[]).unwrap().status, 405);
    assert_eq!(http(gw.addr(), "GET", "/v1/models", None, &[]).unwrap().status, 200);

    let (text, s) = scrape(gw.addr());
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

/// With `--metrics-listen`, the supervisor serves `/metrics` on that
/// address (the same families, summed over the dispatchers), and the
/// gateway's own listener answers `/metrics` with 404.
#[test]
fn metrics_on_a_listener_of_their_own() {
    let engines = [sim()];
    let shm = unique("metrics", "own");
    let _shm = Shm(shm.clone());
    let port = support::redis::free_port();
    let metrics = format!("127.0.0.1:{port}");
    let gw = Gateway::start(&shm, &[&engines[0]], &["--metrics-listen", &metrics]);
    for i in 0..3 {
        assert_eq!(chat(gw.addr(), &format!("question {i}")).status, 200);
    }
    let public = http(gw.addr(), "GET", "/metrics", None, &[]).expect("public /metrics");
    assert_eq!(public.status, 404, "the public listener must not serve /metrics");
    let (text, s) = scrape(&metrics);
    assert_eq!(
        value(
            &s,
            "semlb_requests_total",
            &[("endpoint", "chat_completions"), ("code", "200")]
        ),
        3.0,
        "{text}"
    );
    assert_eq!(http(&metrics, "GET", "/v1/models", None, &[]).unwrap().status, 404);
    assert_eq!(http(&metrics, "POST", "/metrics", None, &[]).unwrap().status, 405);
}
