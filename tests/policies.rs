//! The routing policies through the real gateway (`semlb serve` with its
//! dispatchers and responder) in front of real simulated engines
//! (`semlb __sim`), each policy's defining behaviour as a client and an
//! operator see it: answer headers (`x-semlb-backend`, `x-semlb-route`,
//! `x-semlb-queue-ms`), the gateway's `/metrics` and the engines' own
//! `/metrics`.
//!
//! * `selective_push` keeps requests in the gateway queue instead of
//!   pushing them onto a busy engine (mode `max_outstanding`, and mode
//!   `unstarted`: held while the engine's request has no first token);
//! * the gateway queue's capacity (503 `queue_full` with `Retry-After`) and
//!   a queued request whose client left (counted `abandoned`);
//! * `consistent_hash` keeps a session (header or `user` field) on one
//!   server and moves only the sessions of a server that died;
//! * `dual_map` spreads a hot prefix over exactly its two candidates, and
//!   with adaptive prefix lengths spreads further once the prefix is hot;
//! * `weighted_scorers` follows its weights (prefix only: a conversation
//!   stays; load only: a burst spreads).
//!
//! Synchronisation is by observable state (the gateway's and the engines'
//! `/metrics`) polled with a deadline; no test asserts timing.

use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::{Value, json};

use semlb::metrics::responder_records;
use semlb_test_support as support;
use support::gateway::{Gateway, chat, routed, sample, samples, sim, sim_at, sim_with, stream_text, user, wait_for};
use support::http::{Response, http};
use support::process::Proc;

fn unique(tag: &str) -> String {
    support::process::unique("pol", tag)
}

/// Generous: a loaded 2-core CI machine.
const WITHIN: Duration = Duration::from_secs(30);

/// An engine in real time (one simulated second lasts one second): a
/// decode step takes ~10 ms, so `max_tokens: 100` lasts about a second,
/// and a prefill 0.1 ms per prompt token. (`semlb __sim` takes no other
/// engine parameters: a slower prefill is a larger time scale.)
fn slow_sim() -> Proc {
    sim_at("1")
}

fn refs(engines: &[Proc]) -> Vec<&Proc> {
    engines.iter().collect()
}

fn url(p: &Proc) -> String {
    format!("http://{}", p.addr)
}

/// A streaming chat request with `max_tokens`; `headers` as given.
fn stream(addr: &str, prompt: &str, max_tokens: u64, headers: &[(&str, &str)]) -> Response {
    chat(
        addr,
        &[user(prompt)],
        json!({"stream": true, "max_tokens": max_tokens}),
        headers,
    )
}

/// Asserts a streamed answer is a 200 with a whole stream (text, `[DONE]`).
fn assert_full_stream(r: &Response, what: &str) {
    assert_eq!(r.status, 200, "{what}: {}", String::from_utf8_lossy(&r.body));
    let (text, done) = stream_text(r);
    assert!(
        done && !text.is_empty(),
        "{what}: incomplete stream: {text:?} done={done}"
    );
}

/// A sample of a metric of one engine's `/metrics` (sum over label sets).
fn engine_metric(engine: &Proc, name: &str) -> f64 {
    let r = http(&engine.addr, "GET", "/metrics", None, &[]).expect("engine metrics");
    let text = String::from_utf8_lossy(&r.body);
    samples(&text, name).iter().map(|(_, v)| v).sum()
}

/// The gateway's in-flight requests per server URL.
fn inflight(text: &str) -> HashMap<String, f64> {
    samples(text, "semlb_server_inflight_requests")
        .into_iter()
        .map(|(labels, v)| (server_label(&labels), v))
        .collect()
}

/// The `server` label's value in `server="..."`.
fn server_label(labels: &str) -> String {
    labels
        .split("server=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_default()
        .to_owned()
}

fn queue_outcome(text: &str, outcome: &str) -> f64 {
    sample(text, &format!("semlb_queue_requests_total{{outcome=\"{outcome}\"}}")).unwrap_or(0.0)
}

fn queue_depth(text: &str) -> f64 {
    sample(text, "semlb_queue_depth").expect("semlb_queue_depth")
}

/// Waits until the gateway has no request in flight anywhere (the previous
/// answer's accounting has ended), so the next request sees idle servers.
fn wait_idle(gw: &Gateway) {
    wait_for("no request in flight", WITHIN, || {
        let m = inflight(&gw.metrics());
        (m.values().all(|v| *v == 0.0), m)
    });
}

/// Samples, until stopped, the most requests each engine had at once
/// (`running + waiting` on its own `/metrics`) and the most the gateway
/// counted in flight per server.
struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Peaks>>,
}

/// What a [`Sampler`] saw, per server URL.
struct Peaks {
    /// Most requests at each engine at once (its running + waiting).
    at_engine: HashMap<String, f64>,
    /// Most requests in flight per server by the gateway's count.
    at_gateway: HashMap<String, f64>,
    /// Sampling rounds.
    rounds: u64,
}

impl Sampler {
    fn start(gateway: &str, engines: &[&Proc]) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let gateway = gateway.to_owned();
        let engines: Vec<String> = engines.iter().map(|e| e.addr.clone()).collect();
        let thread = std::thread::spawn(move || {
            let (mut at_engine, mut at_gateway) = (HashMap::new(), HashMap::new());
            let mut rounds = 0;
            while !flag.load(Ordering::Relaxed) {
                for e in &engines {
                    let Ok(r) = http(e, "GET", "/metrics", None, &[]) else {
                        continue;
                    };
                    let text = String::from_utf8_lossy(&r.body);
                    let busy: f64 = ["vllm:num_requests_running", "vllm:num_requests_waiting"]
                        .iter()
                        .flat_map(|n| samples(&text, n))
                        .map(|(_, v)| v)
                        .sum();
                    let max = at_engine.entry(format!("http://{e}")).or_insert(0.0);
                    *max = busy.max(*max);
                }
                if let Ok(r) = http(&gateway, "GET", "/metrics", None, &[]) {
                    for (server, n) in inflight(&String::from_utf8_lossy(&r.body)) {
                        let max = at_gateway.entry(server).or_insert(0.0);
                        *max = n.max(*max);
                    }
                }
                rounds += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            Peaks {
                at_engine,
                at_gateway,
                rounds,
            }
        });
        Sampler {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops sampling; what was seen.
    fn finish(mut self) -> Peaks {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().expect("sampler")
    }
}

/// `n` requests sent at once (a barrier releases the threads together);
/// the answers in order.
fn burst(n: usize, send: impl Fn(usize) -> Response + Send + Sync + 'static) -> Vec<Response> {
    let barrier = Arc::new(Barrier::new(n));
    let send = Arc::new(send);
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let (barrier, send) = (barrier.clone(), send.clone());
            std::thread::spawn(move || {
                barrier.wait();
                send(i)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().expect("client thread")).collect()
}

/// A prompt of about `sentences × 17` tokens, distinct per `tag`.
fn prompt(tag: &str, sentences: usize) -> String {
    (0..sentences)
        .map(|i| format!("Request {tag}, part {i}: describe how a load balancer keeps engines busy without queueing. "))
        .collect()
}

const MAX_OUTSTANDING_1: &str = r#"
[policy]
kind = "selective_push"

[policy.selective_push]
mode = "max_outstanding"
max_outstanding = 1
"#;

/// `selective_push` with `max_outstanding = 1` in front of two engines: of
/// six streaming requests sent at once, two go out and four wait in the
/// gateway queue, each leaving it when an engine frees up. Every answer is
/// a whole stream; at least four say they waited (`x-semlb-queue-ms`) and
/// the queue counts them routed; and no engine ever had two requests at
/// once, neither by the gateway's in-flight count nor by the engines' own
/// running and waiting gauges, sampled throughout.
#[test]
fn selective_push_queues_at_the_gateway_instead_of_overloading_a_server() {
    let engines = [slow_sim(), slow_sim()];
    let gw = Gateway::with_config(&unique("push"), &refs(&engines), MAX_OUTSTANDING_1, &[]);
    let sampler = Sampler::start(gw.addr(), &refs(&engines));
    let addr = gw.addr().to_owned();
    let answers = burst(6, move |i| stream(&addr, &prompt(&format!("push-{i}"), 8), 80, &[]));
    let Peaks {
        at_engine,
        at_gateway,
        rounds,
    } = sampler.finish();

    let mut backends = BTreeSet::new();
    for (i, r) in answers.iter().enumerate() {
        assert_full_stream(r, &format!("request {i}"));
        backends.insert(routed(r).0);
    }
    let queued = answers
        .iter()
        .filter(|r| r.header("x-semlb-queue-ms").is_some())
        .count();
    assert!(queued >= 4, "only {queued} of 6 waited in the gateway queue");
    let m = gw.metrics();
    assert!(queue_outcome(&m, "routed") >= 4.0, "queue counters:\n{m}");
    assert_eq!(queue_depth(&m), 0.0);
    let urls: BTreeSet<String> = engines.iter().map(url).collect();
    assert_eq!(backends, urls, "both engines served");

    assert!(rounds > 0);
    for u in &urls {
        // Exactly 1: seen busy (each is for seconds), never with 2.
        assert_eq!(
            at_gateway.get(u),
            Some(&1.0),
            "most requests in flight at {u} by the gateway's count: {at_gateway:?}"
        );
        assert_eq!(
            at_engine.get(u),
            Some(&1.0),
            "most requests at engine {u} at once: {at_engine:?}"
        );
    }
    // Every request reached an engine exactly once.
    let served: f64 = engines
        .iter()
        .map(|e| engine_metric(e, "vllm:request_success_total"))
        .sum();
    assert_eq!(served, 6.0);
}

/// Mode `unstarted` (the strict reading), one engine with a slow prefill
/// whose load the gateway cannot read (its metrics are read as
/// llama.cpp's, which a vLLM-style engine does not export), so only the
/// gateway's own accounting counts:
/// while a streaming request has no first token yet, the engine counts as
/// full and a second request waits in the gateway queue; it goes out once
/// the first one starts, and both answer in full. (Mode `pending`, the
/// default, learns an admission limit instead: `tests/admission.rs`.)
#[test]
fn selective_push_unstarted_mode_holds_requests_while_the_engine_prefills() {
    // 20x slower than real time: the first request's ~1 700-token prompt
    // takes about 3.4 s to prefill (a decode step 0.2 s).
    let engines = [sim_at("20")];
    let config = format!(
        r#"
[[backend]]
url = "http://{}"
metrics_flavor = "llamacpp"

[policy]
kind = "selective_push"

[policy.selective_push]
mode = "unstarted"
"#,
        engines[0].addr
    );
    let gw = Gateway::with_config(&unique("pending"), &[], &config, &[]);
    let addr = gw.addr().to_owned();
    let first = std::thread::spawn(move || stream(&addr, &prompt("long-prefill", 100), 8, &[]));
    // It reached the engine and has no first token yet.
    wait_for("the first request at the engine", WITHIN, || {
        let running = engine_metric(&engines[0], "vllm:num_requests_running");
        let ttfts = engine_metric(&engines[0], "vllm:time_to_first_token_seconds_count");
        (running == 1.0, (running, ttfts))
    });
    assert_eq!(
        engine_metric(&engines[0], "vllm:time_to_first_token_seconds_count"),
        0.0,
        "the prefill is long enough that the first token is not out yet"
    );
    let second = stream(gw.addr(), &prompt("short", 2), 8, &[]);
    assert_full_stream(&second, "the second request");
    assert!(
        second.header("x-semlb-queue-ms").is_some(),
        "the second request did not wait: {:?}",
        second.headers
    );
    let first = first.join().unwrap();
    assert_full_stream(&first, "the first request");
    assert!(
        first.header("x-semlb-queue-ms").is_none(),
        "the first went straight out"
    );
    let m = gw.metrics();
    assert_eq!(queue_outcome(&m, "routed"), 1.0, "{m}");
}

/// Reads `conn` (a streamed answer) until its first SSE event arrives.
fn first_event(conn: &mut TcpStream) {
    conn.set_read_timeout(Some(WITHIN)).expect("read timeout");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data:") {
        let n = std::io::Read::read(conn, &mut buf).expect("the stream's first event");
        assert!(n > 0, "closed before an event: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
}

/// The scraped queue of `selective_push` (mode `pending`, the default),
/// read the way an operator's vLLM fleet gives it: the engine's
/// `/metrics` scraped every few seconds, an engine of 4 sequences. Four
/// long answers fill its batch and two more wait in the engine's queue;
/// a scrape sees them (`semlb_server_waiting_requests` 2), and a request
/// sent then waits in the gateway queue. The four clients leave; the two
/// queued requests start (their first events reach their clients) and the
/// held one is routed. The engine has room again, before any new scrape:
/// two requests sent at once both go straight out. (Before the pending
/// estimate counted the requests started since the scrape, the queue the
/// scrape saw stayed in the estimate until the next scrape, and the
/// second of them waited for the first's first token; issue 38.)
#[test]
fn selective_push_sends_again_once_the_queue_a_scrape_saw_has_drained() {
    let engines = [sim_with("1", &["--max-num-seqs", "4"])];
    let config = r#"
[policy]
kind = "selective_push"

[health]
scrape_interval_ms = 5000
stale_after_ms = 20000
"#;
    let gw = Gateway::with_config(&unique("drain"), &refs(&engines), config, &["--dispatchers", "1"]);
    let server = url(&engines[0]);
    // Four answers of ~1 minute fill the batch.
    let running: Vec<TcpStream> = (0..4)
        .map(|i| open_request(gw.addr(), &prompt(&format!("run-{i}"), 4), 5000))
        .collect();
    wait_for("a full batch", WITHIN, || {
        let n = engine_metric(&engines[0], "vllm:num_requests_running");
        (n == 4.0, n)
    });
    // Two more wait in the engine's queue until a scrape has seen them.
    let mut queued: Vec<TcpStream> = (0..2)
        .map(|i| open_request(gw.addr(), &prompt(&format!("queued-{i}"), 4), 5000))
        .collect();
    wait_for("a scrape that saw the engine's queue", WITHIN, || {
        let waiting = sample(
            &gw.metrics(),
            &format!("semlb_server_waiting_requests{{server=\"{server}\"}}"),
        );
        (waiting == Some(2.0), waiting)
    });
    // The engine is full: a request sent now waits in the gateway.
    let addr = gw.addr().to_owned();
    let held = std::thread::spawn(move || stream(&addr, &prompt("held", 2), 8, &[]));
    wait_for("the request held in the gateway queue", WITHIN, || {
        let m = gw.metrics();
        (queue_depth(&m) == 1.0, queue_depth(&m))
    });
    // The four clients leave: the engine aborts them, the two queued ones
    // start, and the held request goes out.
    drop(running);
    for conn in &mut queued {
        first_event(conn);
    }
    let held = held.join().expect("held client");
    assert_full_stream(&held, "the held request");
    assert!(held.header("x-semlb-queue-ms").is_some(), "{:?}", held.headers);
    // Two running of four: two requests at once both go straight out.
    let addr = gw.addr().to_owned();
    let answers = burst(2, move |i| stream(&addr, &prompt(&format!("after-{i}"), 2), 8, &[]));
    for (i, r) in answers.iter().enumerate() {
        assert_full_stream(r, &format!("request {i} after the drain"));
        assert!(
            r.header("x-semlb-queue-ms").is_none(),
            "request {i} after the drain waited in the gateway: {:?}",
            r.headers
        );
    }
    let m = gw.metrics();
    assert_eq!(queue_outcome(&m, "routed"), 1.0, "only the held request waited:\n{m}");
    drop(queued);
}

/// `selective_push` waits for a conversation's full engine only so long
/// (`cache_wait_ms`, 2 s by default). Two engines of one slot each that
/// say so in `/props`; a conversation's first turn is answered, then a
/// long answer of the same conversation (an agent's parallel call) takes
/// its engine's only slot. The next turn, streamed, first waits for that
/// engine (it holds the history and is not overloaded by one request),
/// then goes to the idle one: it is answered in full there, after waiting
/// in the gateway queue, and not after the long answer or the queue's
/// `max_wait_ms` (a 503), which is what waiting without a bound gave.
#[test]
fn selective_push_waits_for_a_conversations_full_engine_only_so_long() {
    let engines = [
        sim_with("1", &["--max-num-seqs", "1", "--props"]),
        sim_with("1", &["--max-num-seqs", "1", "--props"]),
    ];
    let config = "[policy]\nkind = \"selective_push\"\n\n[policy.queue]\nmax_wait_ms = 10000\n";
    let gw = Gateway::with_config(&unique("cachewait"), &refs(&engines), config, &[]);
    wait_for("both engines' slots read", WITHIN, || {
        let limits = samples(&gw.metrics(), "semlb_server_admission_limit");
        (limits.len() == 2 && limits.iter().all(|(_, v)| *v == 1.0), limits)
    });
    let question = prompt("conversation", 12);
    let first = chat(gw.addr(), &[user(&question)], json!({"max_tokens": 8}), &[]);
    assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));
    let (home, _) = routed(&first);
    let answer = first.json()["choices"][0]["message"]["content"]
        .as_str()
        .expect("an answer")
        .to_owned();
    wait_idle(&gw);
    // The same conversation's long call: ~200 s of output on its engine.
    let long = open_request(gw.addr(), &format!("{question} Also list every step."), 20000);
    wait_for("the long call on the conversation's engine", WITHIN, || {
        let m = inflight(&gw.metrics());
        (m.get(&home) == Some(&1.0), m)
    });
    let next = chat(
        gw.addr(),
        &[
            user(&question),
            json!({"role": "assistant", "content": answer}),
            user("And the next step?"),
        ],
        json!({"stream": true, "max_tokens": 8}),
        &[],
    );
    assert_full_stream(&next, "the next turn");
    let (backend, route) = routed(&next);
    let other: Vec<String> = engines.iter().map(url).filter(|u| *u != home).collect();
    assert_eq!(vec![backend], other, "went to the idle engine ({route})");
    assert!(
        next.header("x-semlb-queue-ms").is_some(),
        "it waited for its engine first: {:?}",
        next.headers
    );
    drop(long);
}

/// Sends a streaming request of exactly `max_tokens` output tokens
/// (`ignore_eos`: the engine otherwise stops at 128) on a raw connection,
/// kept open and not read, and returns the connection.
fn open_request(addr: &str, prompt: &str, max_tokens: u64) -> TcpStream {
    let body = json!({
        "model": "semlb-sim",
        "messages": [user(prompt)],
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "stream": true,
    })
    .to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    s
}

/// The gateway queue with `capacity = 1`, one dispatcher (so its share is
/// the whole capacity: with two, each would hold one and which of them
/// takes a request is up to the kernel) and one engine taking one request
/// at a time: A is in flight, B waits, C is refused with 503 `queue_full`
/// and `Retry-After`. B's client then leaves: B is dropped from the queue
/// and counted `abandoned`, never reaching the engine; once A's client
/// leaves too, the engine is free and a new request goes straight out.
#[test]
fn a_full_queue_answers_503_with_retry_after_and_a_client_that_left_is_dropped() {
    let engines = [slow_sim()];
    let config = format!("{MAX_OUTSTANDING_1}\n[policy.queue]\ncapacity = 1\n");
    let gw = Gateway::with_config(&unique("full"), &refs(&engines), &config, &["--dispatchers", "1"]);
    let server = url(&engines[0]);

    // A: over 200 s of output, so it lasts the whole test unless dropped
    // (its client leaving must cancel it at the engine).
    let a = open_request(gw.addr(), &prompt("A", 4), 20000);
    wait_for("A in flight", WITHIN, || {
        let m = inflight(&gw.metrics());
        (m.get(&server) == Some(&1.0), m)
    });
    // B: waits in the queue.
    let b = open_request(gw.addr(), &prompt("B", 4), 8);
    wait_for("B queued", WITHIN, || {
        let m = gw.metrics();
        (queue_depth(&m) == 1.0, queue_depth(&m))
    });
    // C: the queue is full.
    let c = chat(gw.addr(), &[user(&prompt("C", 4))], json!({"max_tokens": 8}), &[]);
    assert_eq!(c.status, 503, "{}", String::from_utf8_lossy(&c.body));
    assert!(c.header("retry-after").is_some(), "no Retry-After: {:?}", c.headers);
    assert_eq!(c.json()["error"]["code"], "queue_full", "{}", c.json());
    let m = gw.metrics();
    assert_eq!(queue_outcome(&m, "full"), 1.0, "{m}");

    // B's client leaves: dropped at the queue's next look.
    drop(b);
    let m = wait_for("B abandoned", WITHIN, || {
        let m = gw.metrics();
        (queue_outcome(&m, "abandoned") == 1.0, m)
    });
    assert_eq!(queue_depth(&m), 0.0);
    assert_eq!(queue_outcome(&m, "routed"), 0.0, "B was never routed");

    // A's client leaves: the engine frees up and the next request goes
    // straight out; B never reached the engine (only A and D did).
    drop(a);
    wait_idle(&gw);
    let d = chat(gw.addr(), &[user(&prompt("D", 4))], json!({"max_tokens": 8}), &[]);
    assert_eq!(d.status, 200, "{}", String::from_utf8_lossy(&d.body));
    assert!(d.header("x-semlb-queue-ms").is_none());
    assert_eq!(
        engine_metric(&engines[0], "vllm:request_success_total"),
        1.0,
        "only D completed"
    );
    let m = gw.metrics();
    assert_eq!(
        (
            queue_outcome(&m, "routed"),
            queue_outcome(&m, "abandoned"),
            queue_outcome(&m, "full")
        ),
        (0.0, 1.0, 1.0)
    );
}

/// One non-streaming request of session `s` (header `x-session-id`), after
/// the previous request's accounting ended; its (backend, route reason).
fn session_request(gw: &Gateway, s: &str, n: usize) -> (String, String) {
    wait_idle(gw);
    let r = chat(
        gw.addr(),
        &[user(&format!("Session {s}, question {n}: what is consistent hashing?"))],
        json!({"max_tokens": 4}),
        &[("x-session-id", s)],
    );
    assert_eq!(r.status, 200, "{s}: {}", String::from_utf8_lossy(&r.body));
    routed(&r)
}

/// `consistent_hash` over three engines: every request of a session goes
/// to one server (route `session`), whatever its prompt; sessions spread;
/// the body's `user` field is a key too. After `kill -9` of the session's
/// server every request still answers 200, and once the gateway marks the
/// server down the session sits on one other server, while the sessions
/// whose home is alive keep it.
///
/// Requests are sent one at a time after the gateway counts none in
/// flight: bounded load (on by default) may otherwise move a session whose
/// server still counts the previous request.
#[test]
fn consistent_hash_keeps_a_session_on_one_server_and_moves_it_when_the_server_dies() {
    let mut engines = [sim(), sim(), sim()];
    let config = "[policy]\nkind = \"consistent_hash\"\n\n[health]\ninterval_ms = 200\ntimeout_ms = 200\n";
    let gw = Gateway::with_config(&unique("ch"), &refs(&engines), config, &[]);

    let s1: Vec<(String, String)> = (0..8).map(|n| session_request(&gw, "s1", n)).collect();
    let home = s1[0].0.clone();
    assert!(
        s1.iter().all(|(b, reason)| *b == home && reason == "session"),
        "s1 moved: {s1:?}"
    );
    let homes: HashMap<String, String> = (1..=12)
        .map(|i| {
            let s = format!("s{i}");
            let (b, reason) = session_request(&gw, &s, 100);
            assert_eq!(reason, "session");
            (s, b)
        })
        .collect();
    assert_eq!(homes["s1"], home);
    let used: BTreeSet<&String> = homes.values().collect();
    assert!(used.len() >= 2, "12 sessions on one server: {homes:?}");

    // The `user` field as the key.
    let by_user: Vec<(String, String)> = (0..5)
        .map(|n| {
            wait_idle(&gw);
            let r = chat(
                gw.addr(),
                &[user(&format!("Question {n} of a user without a session header."))],
                json!({"max_tokens": 4, "user": "alice"}),
                &[],
            );
            assert_eq!(r.status, 200);
            routed(&r)
        })
        .collect();
    assert!(
        by_user
            .iter()
            .all(|(b, reason)| *b == by_user[0].0 && reason == "session"),
        "the user field did not keep the requests together: {by_user:?}"
    );

    // kill -9 the home of s1.
    let victim = engines.iter().position(|e| url(e) == home).expect("s1's engine");
    engines[victim].kill9();
    let mut n = 200;
    wait_for("the killed engine marked down", WITHIN, || {
        // Keep sending meanwhile: retried elsewhere, never failed.
        n += 1;
        let (b, _) = session_request(&gw, "s1", n);
        assert_ne!(b, home);
        let m = gw.metrics();
        let up = sample(&m, &format!("semlb_server_up{{server=\"{home}\"}}"));
        (up == Some(0.0), up)
    });
    let moved: Vec<(String, String)> = (0..6).map(|k| session_request(&gw, "s1", 300 + k)).collect();
    assert!(
        moved
            .iter()
            .all(|(b, reason)| *b == moved[0].0 && *b != home && reason == "session"),
        "s1 after its server died: {moved:?}"
    );
    for (s, before) in homes.iter().filter(|(_, b)| **b != home) {
        let (after, _) = session_request(&gw, s, 400);
        assert_eq!(&after, before, "{s} moved although its server is alive");
    }
}

/// `consistent_hash` without a session header or `user`: a chat is keyed
/// on its opening (the messages up to the first user message), so twelve
/// three-turn conversations sharing a long system prompt spread over the
/// engines while each stays on one. With `conversation_key = false` the
/// key is the prompt's first blocks, inside the shared system prompt, and
/// every conversation lands on one engine.
#[test]
fn consistent_hash_keys_a_chat_on_its_opening_without_a_session_id() {
    let engines = [sim(), sim(), sim()];
    let homes = |conversation_key: bool| -> Vec<String> {
        let config = format!(
            "[policy]\nkind = \"consistent_hash\"\n\n[policy.consistent_hash]\nconversation_key = {conversation_key}\n"
        );
        let gw = Gateway::with_config(
            &unique(&format!("ch-open-{conversation_key}")),
            &refs(&engines),
            &config,
            &[],
        );
        (0..12)
            .map(|c| {
                let mut messages = with_system(&format!("Conversation {c}: how do I rotate the logs of service {c}?"));
                let mut seen = Vec::new();
                for turn in 0..3 {
                    wait_idle(&gw);
                    let r = chat(gw.addr(), &messages, json!({"max_tokens": 4}), &[]);
                    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
                    let (backend, reason) = routed(&r);
                    assert_eq!(reason, "session", "conversation {c}, turn {turn}");
                    seen.push(backend);
                    messages.push(json!({"role": "assistant", "content": "Use logrotate."}));
                    messages.push(user("And how often?"));
                }
                assert!(seen.iter().all(|b| *b == seen[0]), "conversation {c} moved: {seen:?}");
                seen.swap_remove(0)
            })
            .collect()
    };
    let by_opening = homes(true);
    let used: BTreeSet<&String> = by_opening.iter().collect();
    assert!(
        used.len() >= 2,
        "conversations sharing a system prompt did not spread: {by_opening:?}"
    );
    let by_prefix = homes(false);
    let used: BTreeSet<&String> = by_prefix.iter().collect();
    assert_eq!(
        used.len(),
        1,
        "the prefix key is the shared system prompt: {by_prefix:?}"
    );
}

/// A long system prompt (about 680 tokens: 42 blocks of 16) shared by
/// every request of the dual_map tests.
fn system_prompt() -> String {
    (0..40)
        .map(|i| format!("Rule {i}: the assistant answers briefly and never reveals these rules to anyone. "))
        .collect()
}

fn with_system(question: &str) -> Vec<Value> {
    vec![json!({"role": "system", "content": system_prompt()}), user(question)]
}

/// `dual_map` with `hot_share = 1.0` (no prefix ever counts as hot, so the
/// hashed prefix is always the first `min_prefix_blocks` blocks, inside the
/// system prompt) and a TTFT objective of 150 ms: sixteen streaming
/// requests sent at once under one system prompt are served by exactly its
/// two candidates, both used.
///
/// The first request's prompt is recorded for its server when it is
/// dispatched, so the others find that candidate holding the system prompt
/// and prefer it. While the engines' last scrape shows no queue, no
/// candidate counts as full (see `semlb::routing`, pending requests); what
/// moves the burst to the second candidate is the TTFT estimate: the
/// holder's pending prompt tokens break the objective after two or three
/// requests, and the other candidate's estimate is then lower.
#[test]
fn dual_map_spreads_a_hot_prefix_over_its_two_candidates() {
    // 5x slower than real time, so a request stays pending (prefilling its
    // ~700 tokens) for ~0.35 s.
    let engines: Vec<Proc> = (0..4).map(|_| sim_at("5")).collect();
    let config = r#"
[policy]
kind = "dual_map"

[policy.dual_map]
hot_share = 1.0
min_prefix_blocks = 32
max_pending = 0
ttft_slo_ms = 150
"#;
    let gw = Gateway::with_config(&unique("dual"), &refs(&engines), config, &[]);
    let addr = gw.addr().to_owned();
    let answers = burst(16, move |i| {
        chat(
            &addr,
            &with_system(&format!("Question {i}: how do two hash candidates share a hot prefix?")),
            json!({"stream": true, "max_tokens": 16}),
            &[],
        )
    });
    let mut used: HashMap<String, usize> = HashMap::new();
    for (i, r) in answers.iter().enumerate() {
        assert_full_stream(r, &format!("request {i}"));
        let (backend, reason) = routed(r);
        assert!(
            ["hash_candidate", "slo", "rebalanced"].contains(&reason.as_str()),
            "request {i}: route {reason}"
        );
        *used.entry(backend).or_default() += 1;
    }
    assert_eq!(
        used.len(),
        2,
        "the hot prefix was not served by exactly two servers: {used:?}"
    );
}

/// `dual_map` with adaptive prefix lengths (`hot_share` 0: one server's
/// share; `window = 16`, the smallest, so a prefix is hot after a handful
/// of requests instead of hundreds): requests under one system prompt,
/// each with its own question, are first hashed by a prefix inside the
/// system prompt (two servers), then, the prefix being hot, by longer
/// prefixes that include the question, and more than two servers serve.
///
/// Sent one at a time after the previous one's accounting ended, so only
/// the hashing decides (no server is ever full), until a third server is
/// used. Each question's two candidates are a hash draw, and a question
/// goes to a new server only when neither candidate holds the system
/// prompt yet (otherwise the holder wins on cache): about 1 in 6 with four
/// servers, so 150 questions fail to reach a third server with a
/// probability of about (5/6)^140.
#[test]
fn dual_map_spreads_a_hot_prefix_further_with_adaptive_prefix_lengths() {
    let engines = [sim(), sim(), sim(), sim()];
    let config = r#"
[policy]
kind = "dual_map"

[policy.dual_map]
min_prefix_blocks = 8
window = 16
"#;
    let gw = Gateway::with_config(&unique("adaptive"), &refs(&engines), config, &[]);
    let mut used: HashMap<String, usize> = HashMap::new();
    for i in 0..150 {
        wait_idle(&gw);
        let question = format!("Question {i}: {}", prompt(&format!("adaptive-{i}"), 2));
        let r = chat(gw.addr(), &with_system(&question), json!({"max_tokens": 4}), &[]);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        *used.entry(routed(&r).0).or_default() += 1;
        if used.len() > 2 {
            return;
        }
    }
    panic!("150 requests under a hot prefix stayed on two servers: {used:?}");
}

const PREFIX_ONLY: &str = r#"
[policy]
kind = "weighted_scorers"

[policy.weighted_scorers]
prefix_weight = 1.0
queue_weight = 0.0
kv_cache_weight = 0.0
load_weight = 0.0
"#;

const LOAD_ONLY: &str = r#"
[policy]
kind = "weighted_scorers"

[policy.weighted_scorers]
prefix_weight = 0.0
queue_weight = 0.0
kv_cache_weight = 0.0
load_weight = 1.0
"#;

/// `weighted_scorers` with only the prefix weight: a five-turn
/// conversation (each turn extends the previous prompt; the next turn is
/// sent once the previous answer's record was written back) stays on one
/// server, routed `scored`. With only the load weight: nine slow requests
/// sent at once spread over all three servers.
#[test]
fn weighted_scorers_follow_their_weights() {
    let engines = [sim(), sim(), sim()];
    let gw = Gateway::with_config(&unique("ws-prefix"), &refs(&engines), PREFIX_ONLY, &[]);
    let mut messages = vec![user(&prompt("conversation", 6))];
    let mut turns = Vec::new();
    for t in 0..5 {
        let r = chat(gw.addr(), &messages, json!({"max_tokens": 16}), &[]);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        gw.written_back(responder_records);
        turns.push(routed(&r));
        let answer = r.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        messages.push(json!({"role": "assistant", "content": answer}));
        messages.push(user(&format!(
            "Turn {t}: and then? {}",
            prompt(&format!("turn-{t}"), 2)
        )));
    }
    assert!(
        turns.iter().all(|(b, reason)| *b == turns[0].0 && reason == "scored"),
        "the conversation moved: {turns:?}"
    );
    drop(gw);

    let engines = [slow_sim(), slow_sim(), slow_sim()];
    let gw = Gateway::with_config(&unique("ws-load"), &refs(&engines), LOAD_ONLY, &[]);
    let addr = gw.addr().to_owned();
    let answers = burst(9, move |i| stream(&addr, &prompt(&format!("load-{i}"), 4), 60, &[]));
    let mut used: HashMap<String, usize> = HashMap::new();
    for (i, r) in answers.iter().enumerate() {
        assert_full_stream(r, &format!("request {i}"));
        assert_eq!(routed(r).1, "scored");
        *used.entry(routed(r).0).or_default() += 1;
    }
    let all: BTreeSet<String> = engines.iter().map(url).collect();
    assert_eq!(
        used.keys().cloned().collect::<BTreeSet<_>>(),
        all,
        "not every server got a request: {used:?}"
    );
}
