//! End-to-end tests of `semlb-sim`'s HTTP front: each test starts the
//! server in-process on `127.0.0.1:0` with a fast time scale and talks real
//! HTTP/1.1 to it (a hyper client, or a raw `TcpStream` where the bytes on
//! the wire matter). Every wait is bounded; nothing sleeps to synchronise
//! (timing-dependent checks poll with a deadline).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use semlb_test_support as support;
use semlb_tokenizer::Tokenizer;
use semlb_tokenizer::chat::ChatTemplate;
use semlb_workers::config::EngineConfig;
use semlb_workers::engine::Engine;
use semlb_workers::faults::FaultConfig;
use semlb_workers::metrics::MetricsFlavor;
use semlb_workers::server::{Sim, serve};
use serde_json::{Value, json};
use support::client::{Reply, send};
use support::sse;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const MODEL: &str = "test-model";

/// Bound on any single wait in these tests.
const PATIENCE: Duration = Duration::from_secs(20);

async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    support::client::within(what, PATIENCE, f).await
}

/// A fast engine: 100× real time.
fn fast() -> EngineConfig {
    EngineConfig {
        model_name: MODEL.into(),
        time_scale: 0.01,
        ..EngineConfig::default()
    }
}

struct Server {
    addr: SocketAddr,
    sim: Arc<Sim>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

async fn start_full(config: EngineConfig, faults: FaultConfig, flavor: MetricsFlavor) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let sim = Arc::new(Sim::new(
        Engine::start(config),
        Tokenizer::bundled(),
        ChatTemplate::canonical(),
        faults,
        flavor,
    ));
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, sim.clone(), async move {
        let _ = stopped.await;
    }));
    Server {
        addr,
        sim,
        stop: Some(stop),
        task,
    }
}

async fn start(config: EngineConfig) -> Server {
    start_full(config, FaultConfig::default(), MetricsFlavor::Vllm).await
}

async fn start_faulty(faults: FaultConfig) -> Server {
    start_full(fast(), faults, MetricsFlavor::Vllm).await
}

impl Server {
    /// Signals shutdown and waits for `serve` to return.
    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        within("graceful stop", self.task)
            .await
            .expect("serve task")
            .expect("serve");
    }
}

/// One request, read to the end within [`PATIENCE`].
async fn call(addr: SocketAddr, method: Method, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    support::client::call(addr, method, path, headers, body, PATIENCE).await
}

async fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    call(addr, Method::POST, path, &[], &body.to_string()).await
}

async fn get(addr: SocketAddr, path: &str) -> Reply {
    call(addr, Method::GET, path, &[], "").await
}

/// The streamed answer: the text, the finish reason and the usage chunk.
struct Streamed {
    text: String,
    finish_reason: String,
    usage: Option<Value>,
    chunks: usize,
}

/// Parses and checks a whole SSE answer of `object` chunks.
fn parse_stream(body: &str, chat: bool) -> Streamed {
    let events = sse::events(body);
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "the stream ends with [DONE]"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("chunk not JSON ({err}): {e}")))
        .collect();
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let id = chunks[0]["id"].as_str().expect("id").to_owned();
    let mut text = String::new();
    let mut finish_reason = None;
    let mut usage = None;
    for (i, chunk) in chunks.iter().enumerate() {
        assert_eq!(chunk["object"], object);
        assert_eq!(chunk["id"], id.as_str(), "one id per stream");
        assert_eq!(chunk["model"], MODEL);
        assert!(chunk["created"].as_u64().is_some());
        let choices = chunk["choices"].as_array().expect("choices");
        if choices.is_empty() {
            assert_eq!(i, chunks.len() - 1, "the usage chunk is the last");
            usage = Some(chunk["usage"].clone());
            continue;
        }
        assert!(finish_reason.is_none(), "no token after the finish_reason");
        let choice = &choices[0];
        assert_eq!(choice["index"], 0);
        assert!(choice["logprobs"].is_null());
        if chat {
            let delta = &choice["delta"];
            if i == 0 {
                assert_eq!(delta["role"], "assistant", "the first chat chunk carries the role");
            } else {
                assert!(delta.get("role").is_none());
            }
            text.push_str(delta["content"].as_str().expect("delta.content"));
        } else {
            text.push_str(choice["text"].as_str().expect("text"));
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            finish_reason = Some(reason.to_owned());
        }
    }
    Streamed {
        text,
        finish_reason: finish_reason.expect("a finish_reason"),
        usage,
        chunks: chunks.len(),
    }
}

/// A prompt of about `words` tokens, distinct per `tag`.
fn long_prompt(tag: &str, words: usize) -> String {
    (0..words).map(|i| format!(" {tag}{}", i % 97)).collect()
}

fn check_usage(usage: &Value, prompt_tokens: u64, completion_tokens: u64) -> u64 {
    assert_eq!(usage["prompt_tokens"], prompt_tokens, "{usage}");
    assert_eq!(usage["completion_tokens"], completion_tokens, "{usage}");
    assert_eq!(usage["total_tokens"], prompt_tokens + completion_tokens, "{usage}");
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

// ----- a small Prometheus text-format parser -----

/// Samples by name and labels, and the family types; every line is
/// checked (HELP/TYPE syntax, names, quoted labels, numeric values).
struct Scrape {
    samples: Vec<(String, BTreeMap<String, String>, f64)>,
    types: BTreeMap<String, String>,
}

impl Scrape {
    fn parse(text: &str) -> Self {
        let name_ok = |s: &str| {
            !s.is_empty()
                && !s.starts_with(|c: char| c.is_ascii_digit())
                && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        };
        let mut samples = Vec::new();
        let mut types = BTreeMap::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (family, kind) = rest.split_once(' ').expect("TYPE line");
                assert!(name_ok(family), "{line}");
                assert!(
                    ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                    "{line}"
                );
                assert!(
                    types.insert(family.to_owned(), kind.to_owned()).is_none(),
                    "second TYPE: {line}"
                );
                continue;
            }
            if let Some(rest) = line.strip_prefix("# HELP ") {
                assert!(name_ok(rest.split(' ').next().unwrap_or_default()), "{line}");
                continue;
            }
            assert!(!line.starts_with('#') && !line.is_empty(), "unexpected line {line:?}");
            let (series, value) = line.rsplit_once(' ').expect("a value");
            let value = match value {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v
                    .parse::<f64>()
                    .unwrap_or_else(|e| panic!("bad value in {line:?}: {e}")),
            };
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, rest.strip_suffix('}').expect("closing brace")),
                None => (series, ""),
            };
            assert!(name_ok(name), "{line}");
            let mut map = BTreeMap::new();
            // Label values here never contain `,` or escapes.
            for pair in labels.split(',').filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once('=').expect("label=value");
                let v = v
                    .strip_prefix('"')
                    .and_then(|v| v.strip_suffix('"'))
                    .expect("quoted label value");
                assert!(name_ok(k), "{line}");
                map.insert(k.to_owned(), v.to_owned());
            }
            // Every sample belongs to a declared family.
            let family_declared = types.keys().any(|f: &String| name.starts_with(f.as_str()));
            assert!(family_declared, "sample without TYPE: {line}");
            samples.push((name.to_owned(), map, value));
        }
        Self { samples, types }
    }

    fn value(&self, name: &str) -> f64 {
        self.samples
            .iter()
            .find(|(n, ..)| n == name)
            .unwrap_or_else(|| panic!("no sample {name}"))
            .2
    }

    fn has(&self, name: &str) -> bool {
        self.samples.iter().any(|(n, ..)| n == name)
    }
}

async fn scrape(addr: SocketAddr) -> Scrape {
    let reply = get(addr, "/metrics").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.header("content-type").starts_with("text/plain; version=0.0.4"));
    Scrape::parse(reply.text())
}

// ----- shapes -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_shape() {
    let server = start(fast()).await;
    let prompt = "The quick brown fox jumps over the lazy dog";
    let prompt_tokens = server.sim.tokenizer().encode(prompt).len() as u64;
    let r = post(
        server.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 10}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.header("content-type"), "application/json");
    let ttft: f64 = r
        .header("x-semlb-sim-ttft-ms")
        .parse()
        .expect("ttft header is a number");
    assert!(ttft > 0.0);
    assert_eq!(r.header("x-semlb-sim-cached-tokens"), "0");
    let v = r.json();
    assert!(v["id"].as_str().expect("id").starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    assert!(v["created"].as_u64().expect("created") > 1_600_000_000);
    assert_eq!(v["model"], MODEL);
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 1);
    assert_eq!(choices[0]["index"], 0);
    assert!(choices[0]["logprobs"].is_null());
    assert_eq!(choices[0]["finish_reason"], "length");
    let text = choices[0]["text"].as_str().expect("text").to_owned();
    assert_eq!(
        server.sim.tokenizer().encode(&text).len(),
        10,
        "the answer re-tokenizes to its 10 tokens: {text:?}"
    );
    assert_eq!(check_usage(&v["usage"], prompt_tokens, 10), 0);

    // The same prompt as token ids (both forms) gets the same answer.
    let ids = server.sim.tokenizer().encode(prompt);
    for prompt in [json!(ids), json!([ids]), json!([prompt])] {
        let r = post(
            server.addr,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 10}),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        assert_eq!(r.json()["choices"][0]["text"], text.as_str());
    }

    // A different id per response; no max_tokens: the default length, "stop".
    let r = post(server.addr, "/v1/completions", &json!({"prompt": prompt}))
        .await
        .json();
    assert_ne!(r["id"], v["id"]);
    assert_eq!(r["usage"]["completion_tokens"], fast().default_output_tokens);
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_shape_and_output_length_rule() {
    let server = start(fast()).await;
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
    ]);
    let rendered = "<|system|>\nBe brief.\n<|user|>\nHello\nthere\n<|assistant|>\n";
    let prompt_tokens = server.sim.tokenizer().encode(rendered).len() as u64;
    let r = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": messages, "max_completion_tokens": 7}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let v = r.json();
    assert!(v["id"].as_str().expect("id").starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL);
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(choice["message"]["content"].as_str().is_some_and(|s| !s.is_empty()));
    assert!(choice["logprobs"].is_null());
    assert_eq!(choice["finish_reason"], "length");
    check_usage(&v["usage"], prompt_tokens, 7);

    // The output length rule, end to end.
    let user = json!([{"role": "user", "content": "length rule"}]);
    let cases: [(Value, Option<&str>, u64, &str); 5] = [
        (json!({"max_tokens": 500}), None, 128, "stop"),
        (json!({"max_tokens": 500, "ignore_eos": true}), None, 500, "length"),
        (json!({"max_tokens": 5}), Some("300"), 5, "length"),
        (json!({}), Some("300"), 300, "stop"),
        (json!({"max_tokens": 600, "ignore_eos": true}), Some("42"), 42, "stop"),
    ];
    for (extra, header, tokens, finish) in cases {
        let mut body = extra.clone();
        body["messages"] = user.clone();
        let headers: Vec<(&str, &str)> = header.map(|h| ("x-semlb-output-tokens", h)).into_iter().collect();
        let r = call(
            server.addr,
            Method::POST,
            "/v1/chat/completions",
            &headers,
            &body.to_string(),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        let v = r.json();
        assert_eq!(v["usage"]["completion_tokens"], tokens, "{extra} {header:?}");
        assert_eq!(v["choices"][0]["finish_reason"], finish, "{extra} {header:?}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_matches_non_streaming() {
    let server = start(fast()).await;
    for (path, chat) in [("/v1/completions", false), ("/v1/chat/completions", true)] {
        let mut body = if chat {
            json!({"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12})
        } else {
            json!({"prompt": "Once upon a time", "max_tokens": 12})
        };
        let plain = post(server.addr, path, &body).await.json();
        let plain_text = if chat {
            &plain["choices"][0]["message"]["content"]
        } else {
            &plain["choices"][0]["text"]
        };
        let plain_text = plain_text.as_str().expect("text").to_owned();

        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let r = post(server.addr, path, &body).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        assert_eq!(r.header("content-type"), "text/event-stream");
        assert!(r.header("x-semlb-sim-ttft-ms").parse::<f64>().is_ok());
        let streamed = parse_stream(r.text(), chat);
        assert_eq!(
            streamed.text, plain_text,
            "{path}: the chunks add up to the non-streaming answer"
        );
        assert_eq!(streamed.finish_reason, "length");
        // role chunk (chat) + 12 token chunks + usage chunk.
        assert_eq!(streamed.chunks, 12 + 1 + usize::from(chat), "{path}");
        let usage = streamed.usage.expect("a usage chunk with include_usage");
        for key in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            assert_eq!(usage[key], plain["usage"][key], "{path} {key}");
        }
        assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());
        for event in sse::events(r.text()).iter().filter(|e| *e != "[DONE]") {
            let chunk: Value = serde_json::from_str(event).expect("chunk");
            assert!(
                chunk.as_object().expect("object").contains_key("usage"),
                "usage: null in every chunk"
            );
        }

        // Without include_usage: no usage chunk, no usage field.
        body["stream_options"] = Value::Null;
        let r = post(server.addr, path, &body).await;
        let streamed = parse_stream(r.text(), chat);
        assert!(streamed.usage.is_none());
        assert_eq!(streamed.text, plain_text);
        assert!(!r.text().contains("\"usage\""), "{}", r.text());
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_are_sent_as_tokens_come() {
    // 500 decode steps of 8 ms at time scale 0.1: the stream lasts ~400 ms.
    // The first chunk must be on the wire while the engine is still
    // generating, and the chunks must be spread over the generation.
    let server = start(EngineConfig {
        time_scale: 0.1,
        ..fast()
    })
    .await;
    let body = json!({"prompt": "slow stream", "max_tokens": 500, "ignore_eos": true, "stream": true});
    within("stream", async {
        let response = send(server.addr, Method::POST, "/v1/completions", &[], &body.to_string()).await;
        let mut body = response.into_body();
        let mut arrivals = Vec::new();
        while let Some(frame) = body.frame().await {
            if frame.expect("frame").data_ref().is_some() {
                if arrivals.is_empty() {
                    let stats = server.sim.engine().stats();
                    assert_eq!(
                        stats.requests_finished, 0,
                        "the first chunk came only after the whole answer"
                    );
                }
                arrivals.push(Instant::now());
            }
        }
        // 500 token chunks and [DONE], one frame each.
        assert!(arrivals.len() >= 100, "{} frames", arrivals.len());
        let spread = *arrivals.last().expect("frames") - arrivals[0];
        assert!(
            spread >= Duration::from_millis(100),
            "frames arrived within {spread:?}: buffered?"
        );
    })
    .await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_and_health() {
    let server = start(fast()).await;
    let r = get(server.addr, "/health").await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.body.is_empty());
    let v = get(server.addr, "/v1/models").await.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"].as_array().map(Vec::len), Some(1));
    assert_eq!(v["data"][0]["id"], MODEL);
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["max_model_len"], fast().max_model_len);
    server.stop().await;
}

// ----- the prefix cache through the API -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_prompt_is_cached_and_faster() {
    let server = start(fast()).await;
    let body = json!({"prompt": long_prompt("cache", 2000), "max_tokens": 4});
    let cold = post(server.addr, "/v1/completions", &body).await;
    let warm = post(server.addr, "/v1/completions", &body).await;
    let prompt_tokens = cold.json()["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert!(prompt_tokens > 1500, "{prompt_tokens}");
    assert_eq!(check_usage(&cold.json()["usage"], prompt_tokens, 4), 0);
    let cached = check_usage(&warm.json()["usage"], prompt_tokens, 4);
    assert!(
        cached > 0 && cached < prompt_tokens,
        "cached {cached} of {prompt_tokens}"
    );
    assert_eq!(warm.header("x-semlb-sim-cached-tokens"), cached.to_string());
    let ttft = |r: &Reply| r.header("x-semlb-sim-ttft-ms").parse::<f64>().expect("ttft");
    assert!(
        ttft(&warm) < ttft(&cold) / 5.0,
        "warm {} ms vs cold {} ms",
        ttft(&warm),
        ttft(&cold)
    );
    assert_eq!(cold.json()["choices"][0]["text"], warm.json()["choices"][0]["text"]);

    let m = scrape(server.addr).await;
    assert_eq!(m.value("vllm:prefix_cache_hits_total"), cached as f64);
    assert_eq!(m.value("vllm:prefix_cache_queries_total"), 2.0 * prompt_tokens as f64);
    server.stop().await;
}

/// vLLM's `cache_salt`: a prompt cached under one salt is not found
/// under another or none, and is found again under the same one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_salt_keeps_prefixes_apart() {
    let server = start(fast()).await;
    let prompt = long_prompt("salt", 1000);
    let body = |salt: Option<&str>| {
        let mut b = json!({"prompt": prompt, "max_tokens": 2});
        if let Some(salt) = salt {
            b["cache_salt"] = json!(salt);
        }
        b
    };
    let cached = |r: &Reply| {
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let first = post(server.addr, "/v1/completions", &body(Some("tenant-a"))).await;
    assert_eq!(cached(&first), 0);
    for other in [Some("tenant-b"), None] {
        let r = post(server.addr, "/v1/completions", &body(other)).await;
        assert_eq!(cached(&r), 0, "{other:?} finds nothing of tenant-a's");
    }
    let again = post(server.addr, "/v1/completions", &body(Some("tenant-a"))).await;
    assert!(cached(&again) > 500, "the same salt finds it: {}", cached(&again));
    let empty = post(server.addr, "/v1/completions", &body(Some(""))).await;
    assert_eq!(empty.status, 400);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_turn_hits_the_first_turns_prompt_and_answer() {
    let server = start(fast()).await;
    let mut messages = vec![
        json!({"role": "system", "content": "You are a helpful assistant."}),
        json!({"role": "user", "content": "Write me a long poem about load balancers."}),
    ];
    let first = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 64, "ignore_eos": true}),
    )
    .await
    .json();
    let first_prompt = first["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    let answer = first["choices"][0]["message"]["content"]
        .as_str()
        .expect("answer")
        .to_owned();
    messages.push(json!({"role": "assistant", "content": answer}));
    messages.push(json!({"role": "user", "content": "Now shorter."}));
    let second = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 8}),
    )
    .await
    .json();
    let second_prompt = second["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert!(second_prompt > first_prompt + 64, "{second_prompt} vs {first_prompt}");
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached");
    assert!(
        cached > first_prompt,
        "turn 2 reuses the answer's blocks too: cached {cached}, turn 1 prompt {first_prompt}"
    );
    assert!(cached >= (first_prompt + 64) / 16 * 16 - 16, "cached {cached}");
    server.stop().await;
}

// ----- batching and metrics -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_builds_when_the_batch_is_full_and_drains() {
    // 200 decode steps of ~8 ms at time scale 0.1 ≈ 160 ms per request; two
    // at a time, six requests: the queue lasts ~320 ms.
    let server = start(EngineConfig {
        max_num_seqs: 2,
        time_scale: 0.1,
        ..fast()
    })
    .await;
    let requests: Vec<_> = (0..6)
        .map(|i| {
            let body = json!({"prompt": format!("request number {i}"), "max_tokens": 200, "ignore_eos": true});
            let addr = server.addr;
            tokio::spawn(async move { post(addr, "/v1/completions", &body).await })
        })
        .collect();
    let mut max_waiting = 0.0f64;
    let mut max_running = 0.0f64;
    while !requests.iter().all(JoinHandle::is_finished) {
        let m = scrape(server.addr).await;
        max_waiting = max_waiting.max(m.value("vllm:num_requests_waiting"));
        max_running = max_running.max(m.value("vllm:num_requests_running"));
        if max_waiting > 0.0 {
            break;
        }
    }
    assert!(max_waiting > 0.0, "the queue never showed on /metrics");
    assert!(max_running <= 2.0);
    for r in requests {
        let r = within("request", r).await.expect("task");
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.json()["usage"]["completion_tokens"], 200);
    }
    let deadline = Instant::now() + PATIENCE;
    loop {
        let m = scrape(server.addr).await;
        if m.value("vllm:num_requests_waiting") == 0.0 && m.value("vllm:num_requests_running") == 0.0 {
            assert_eq!(m.value("vllm:request_success_total"), 6.0);
            assert_eq!(m.value("vllm:kv_cache_usage_perc"), 0.0);
            break;
        }
        assert!(Instant::now() < deadline, "the queue never drained");
        tokio::task::yield_now().await;
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_counters_move() {
    let server = start(fast()).await;
    let before = scrape(server.addr).await;
    for (family, kind) in [
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:num_requests_running", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:prefix_cache_queries", "counter"),
        ("vllm:prefix_cache_hits", "counter"),
        ("vllm:prompt_tokens", "counter"),
        ("vllm:generation_tokens", "counter"),
        ("vllm:request_success", "counter"),
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:e2e_request_latency_seconds", "histogram"),
        ("vllm:cache_config_info", "gauge"),
    ] {
        assert_eq!(before.types.get(family).map(String::as_str), Some(kind), "{family}");
    }
    assert!(
        before
            .samples
            .iter()
            .all(|(_, labels, _)| labels.get("model_name").map(String::as_str) == Some(MODEL))
    );
    let info = before
        .samples
        .iter()
        .find(|(n, ..)| n == "vllm:cache_config_info")
        .expect("info");
    assert_eq!(info.1["block_size"], "16");
    assert_eq!(info.1["num_gpu_blocks"], fast().num_blocks().to_string());
    assert_eq!(before.value("vllm:request_success_total"), 0.0);
    assert!(!before.has("sglang:num_queue_reqs"));

    let r = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "count me", "max_tokens": 5}),
    )
    .await
    .json();
    let prompt_tokens = r["usage"]["prompt_tokens"].as_f64().expect("prompt_tokens");
    let after = scrape(server.addr).await;
    assert_eq!(after.value("vllm:request_success_total"), 1.0);
    assert_eq!(after.value("vllm:prompt_tokens_total"), prompt_tokens);
    assert_eq!(after.value("vllm:generation_tokens_total"), 5.0);
    assert_eq!(after.value("vllm:prefix_cache_queries_total"), prompt_tokens);
    assert_eq!(after.value("vllm:time_to_first_token_seconds_count"), 1.0);
    assert_eq!(after.value("vllm:e2e_request_latency_seconds_count"), 1.0);
    assert!(after.value("vllm:e2e_request_latency_seconds_sum") > 0.0);
    let inf = after
        .samples
        .iter()
        .find(|(n, l, _)| n == "vllm:time_to_first_token_seconds_bucket" && l["le"] == "+Inf")
        .expect("+Inf bucket");
    assert_eq!(inf.2, 1.0);
    server.stop().await;

    let server = start_full(fast(), FaultConfig::default(), MetricsFlavor::Both).await;
    let m = scrape(server.addr).await;
    for name in [
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "vllm:num_requests_waiting",
    ] {
        assert!(m.has(name), "{name}");
    }
    server.stop().await;
    let server = start_full(fast(), FaultConfig::default(), MetricsFlavor::Sglang).await;
    let m = scrape(server.addr).await;
    assert!(m.has("sglang:token_usage") && !m.has("vllm:num_requests_waiting"));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_aborts_its_request() {
    // Long answers (2000 steps of 8 ms at time scale 0.1 = 1.6 s).
    let server = start(EngineConfig {
        time_scale: 0.1,
        ..fast()
    })
    .await;
    let wait_for = |aborted: u64| {
        let sim = server.sim.clone();
        async move {
            let deadline = Instant::now() + PATIENCE;
            loop {
                let stats = sim.engine().stats();
                if stats.requests_aborted == aborted && stats.running == 0 && stats.waiting == 0 {
                    assert_eq!(stats.requests_finished, 0);
                    return;
                }
                assert!(Instant::now() < deadline, "the request was never aborted: {stats:?}");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    // Streaming: leave after the first chunk.
    let body = json!({"prompt": "a long answer", "max_tokens": 2000, "ignore_eos": true, "stream": true});
    within("first chunk", async {
        let response = send(server.addr, Method::POST, "/v1/completions", &[], &body.to_string()).await;
        let mut body = response.into_body();
        body.frame().await.expect("a first chunk").expect("frame");
        // Dropping the body and the connection task closes the socket.
    })
    .await;
    wait_for(1).await;

    // Non-streaming: leave while the engine generates.
    let body = json!({"prompt": "another long answer", "max_tokens": 2000, "ignore_eos": true});
    let mut stream = TcpStream::connect(server.addr).await.expect("connect");
    stream
        .write_all(raw_post("/v1/completions", &body).as_bytes())
        .await
        .expect("write");
    let deadline = Instant::now() + PATIENCE;
    while server.sim.engine().stats().running == 0 {
        assert!(Instant::now() < deadline, "the request never started");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    drop(stream);
    wait_for(2).await;
    server.stop().await;
}

// ----- faults -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_rate_one_fails_everything_before_the_engine() {
    let server = start_faulty(FaultConfig {
        fail_rate: 1.0,
        ..FaultConfig::default()
    })
    .await;
    for _ in 0..3 {
        for (path, body) in [
            ("/v1/completions", json!({"prompt": "x"})),
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "x"}]}),
            ),
        ] {
            let r = post(server.addr, path, &body).await;
            assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
            let v = r.json();
            assert_eq!(v["error"]["type"], "server_error");
            assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("fail-rate")));
        }
    }
    assert_eq!(get(server.addr, "/health").await.status, StatusCode::OK);
    assert_eq!(
        server.sim.engine().stats().prompt_tokens,
        0,
        "failed requests never reach the engine"
    );
    server.stop().await;
}

/// Sends raw bytes and reads until the server closes the connection.
async fn raw_exchange(addr: SocketAddr, request: &str) -> String {
    within("raw exchange", async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut received = Vec::new();
        // A reset may surface as an error after some bytes: keep what came.
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => received.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8_lossy(&received).into_owned()
    })
    .await
}

fn raw_post(path: &str, body: &Value) -> String {
    let body = body.to_string();
    format!(
        "POST {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_rate_one_cuts_every_response() {
    let server = start_faulty(FaultConfig {
        reset_rate: 1.0,
        ..FaultConfig::default()
    })
    .await;
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "cut me", "max_tokens": 50, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "cut"}], "max_tokens": 50, "stream": true}),
        ),
    ] {
        let wire = raw_exchange(server.addr, &raw_post(path, &body)).await;
        assert!(wire.starts_with("HTTP/1.1 200 OK\r\n"), "{wire}");
        assert!(wire.contains("transfer-encoding: chunked"), "{wire}");
        assert_eq!(wire.matches("data: ").count(), 1, "exactly the first chunk: {wire}");
        assert!(!wire.contains("[DONE]"), "{wire}");
        assert!(!wire.ends_with("0\r\n\r\n"), "no terminating chunk: {wire}");
    }
    // Non-streaming: the head, then nothing.
    let wire = raw_exchange(
        server.addr,
        &raw_post("/v1/completions", &json!({"prompt": "cut", "max_tokens": 5})),
    )
    .await;
    assert!(wire.starts_with("HTTP/1.1 200 OK\r\n"), "{wire}");
    let (_, body) = wire.split_once("\r\n\r\n").expect("a complete head");
    assert!(!body.contains("choices") && !body.ends_with("0\r\n\r\n"), "{wire}");
    // A client sees a body error.
    let response = within(
        "head",
        send(server.addr, Method::POST, "/v1/completions", &[], r#"{"prompt":"cut"}"#),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(within("body", response.into_body().collect()).await.is_err());
    // Other routes are not cut.
    assert_eq!(get(server.addr, "/health").await.status, StatusCode::OK);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_precedes_every_response() {
    let delay = Duration::from_millis(300);
    let server = start_faulty(FaultConfig {
        delay,
        ..FaultConfig::default()
    })
    .await;
    for path in ["/health", "/metrics", "/v1/completions"] {
        let started = Instant::now();
        let r = if path == "/v1/completions" {
            post(server.addr, path, &json!({"prompt": "x", "max_tokens": 1})).await
        } else {
            get(server.addr, path).await
        };
        assert_eq!(r.status, StatusCode::OK);
        assert!(started.elapsed() >= delay, "{path} answered in {:?}", started.elapsed());
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hang_after_n_leaves_requests_unanswered() {
    let server = start_faulty(FaultConfig {
        hang_after: Some(2),
        ..FaultConfig::default()
    })
    .await;
    for _ in 0..2 {
        let r = post(server.addr, "/v1/completions", &json!({"prompt": "x", "max_tokens": 2})).await;
        assert_eq!(r.status, StatusCode::OK);
    }
    let client_timeout = Duration::from_millis(300);
    let body = json!({"prompt": "x", "max_tokens": 2}).to_string();
    let hung = tokio::time::timeout(
        client_timeout,
        send(server.addr, Method::POST, "/v1/completions", &[], &body),
    )
    .await;
    assert!(hung.is_err(), "the third request must hang");
    let hung = tokio::time::timeout(client_timeout, send(server.addr, Method::GET, "/health", &[], "")).await;
    assert!(hung.is_err(), "once hanging, every route hangs");

    // The server still reads requests; stopping it closes hung connections
    // without an answer.
    let mut stream = TcpStream::connect(server.addr).await.expect("connect");
    stream
        .write_all(b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n")
        .await
        .expect("write");
    let reader = tokio::spawn(async move {
        let mut received = Vec::new();
        let _ = stream.read_to_end(&mut received).await;
        received
    });
    server.stop().await;
    let received = within("hung connection closed", reader).await.expect("reader");
    assert!(received.is_empty(), "{}", String::from_utf8_lossy(&received));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_after_n_stops_the_server() {
    let mut server = start_faulty(FaultConfig {
        exit_after: Some(3),
        ..FaultConfig::default()
    })
    .await;
    assert_eq!(
        get(server.addr, "/health").await.status,
        StatusCode::OK,
        "health is not counted"
    );
    for i in 0..3 {
        assert!(!server.sim.exit_requested(), "fired early, after {i}");
        let r = post(
            server.addr,
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": 2, "stream": i == 1}),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK);
    }
    // serve returns by itself: no shutdown signal is sent.
    let _keep_open = server.stop.take();
    within("serve returns after --exit-after", &mut server.task)
        .await
        .expect("task")
        .expect("serve");
    assert!(server.sim.exit_requested());
    assert_eq!(server.sim.faults().completed(), 3);
    assert!(TcpStream::connect(server.addr).await.is_err(), "the listener is closed");
}

// ----- bad input -----

/// A bad request and the error it must get.
struct Case {
    path: &'static str,
    body: String,
    header: Option<(&'static str, &'static str)>,
    status: StatusCode,
    param: Option<&'static str>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openai_errors() {
    let server = start(EngineConfig {
        max_model_len: 512,
        ..fast()
    })
    .await;
    let user = |content: &str| json!([{"role": "user", "content": content}]);
    let long = long_prompt("long", 600);
    const C: &str = "/v1/completions";
    const CHAT: &str = "/v1/chat/completions";
    const BAD: StatusCode = StatusCode::BAD_REQUEST;
    const MISSING: StatusCode = StatusCode::NOT_FOUND;
    let case = |path, body: Value, status, param| Case {
        path,
        body: body.to_string(),
        header: None,
        status,
        param,
    };
    let cases = [
        Case {
            path: C,
            body: "{not json".into(),
            header: None,
            status: BAD,
            param: None,
        },
        Case {
            path: C,
            body: "[1,2]".into(),
            header: None,
            status: BAD,
            param: None,
        },
        case(C, json!({"prompt": 42}), BAD, Some("prompt")),
        case(C, json!({"prompt": "x", "max_tokens": "5"}), BAD, Some("max_tokens")),
        case(C, json!({"prompt": "x", "stream": "yes"}), BAD, Some("stream")),
        case(C, json!({"max_tokens": 5}), BAD, Some("prompt")),
        case(C, json!({"prompt": ""}), BAD, Some("prompt")),
        case(C, json!({"prompt": []}), BAD, Some("prompt")),
        case(C, json!({"prompt": ["a", "b"]}), BAD, Some("prompt")),
        case(C, json!({"prompt": "x", "model": "gpt-4"}), MISSING, Some("model")),
        case(C, json!({"prompt": "x", "n": 2}), BAD, Some("n")),
        case(C, json!({"prompt": "x", "max_tokens": 0}), BAD, Some("max_tokens")),
        case(C, json!({"prompt": "x", "max_tokens": -1}), BAD, Some("max_tokens")),
        case(C, json!({"prompt": long}), BAD, Some("prompt")),
        case(
            C,
            json!({"prompt": "x", "max_tokens": 4_000_000_000u64, "ignore_eos": true}),
            BAD,
            Some("prompt"),
        ),
        Case {
            header: Some(("x-semlb-output-tokens", "zero")),
            ..case(C, json!({"prompt": "x"}), BAD, Some("x-semlb-output-tokens"))
        },
        case(CHAT, json!({}), BAD, Some("messages")),
        case(CHAT, json!({"messages": []}), BAD, Some("messages")),
        case(CHAT, json!({"messages": "hi"}), BAD, Some("messages")),
        case(
            CHAT,
            json!({"messages": user("x"), "model": "other"}),
            MISSING,
            Some("model"),
        ),
        case(CHAT, json!({"messages": user("x"), "n": 3}), BAD, Some("n")),
        case(
            CHAT,
            // Image parts are skipped (not text); a part that is no object is refused.
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, "x"]}]}),
            BAD,
            Some("messages[0].content[1]"),
        ),
        case(CHAT, json!({"messages": user(&long)}), BAD, Some("messages")),
    ];
    for Case {
        path,
        body,
        header,
        status,
        param,
    } in cases
    {
        let headers: Vec<(&str, &str)> = header.into_iter().collect();
        let r = call(server.addr, Method::POST, path, &headers, &body).await;
        let shown: String = body.chars().take(80).collect();
        assert_eq!(r.status, status, "{path} {shown}: {}", r.text());
        let v = r.json();
        let error = &v["error"];
        assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{shown}: {v}");
        assert_eq!(error["type"], "invalid_request_error", "{shown}");
        assert!(error.as_object().is_some_and(|e| e.contains_key("code")));
        assert_eq!(error["param"].as_str(), param, "{shown}: {v}");
    }
    let r = post(server.addr, "/v1/completions", &json!({"prompt": "x", "n": 2})).await;
    assert_eq!(r.json()["error"]["message"], "n > 1 is not supported");
    let r = post(server.addr, "/v1/completions", &json!({"prompt": long})).await;
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");

    // Every truncation of a valid body is a 400, never a 5xx or a hang.
    let valid = json!({"prompt": "abc", "max_tokens": 3, "stream": false}).to_string();
    for cut in 0..valid.len() {
        let r = call(server.addr, Method::POST, "/v1/completions", &[], &valid[..cut]).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", &valid[..cut]);
    }
    // Wrong paths and methods.
    for (method, path, status) in [
        (Method::GET, "/v1/nothing", StatusCode::NOT_FOUND),
        (Method::POST, "/", StatusCode::NOT_FOUND),
        (Method::GET, "/v1/completions", StatusCode::METHOD_NOT_ALLOWED),
        (Method::PUT, "/v1/chat/completions", StatusCode::METHOD_NOT_ALLOWED),
        (Method::POST, "/metrics", StatusCode::METHOD_NOT_ALLOWED),
        (Method::DELETE, "/health", StatusCode::METHOD_NOT_ALLOWED),
    ] {
        let r = call(server.addr, method.clone(), path, &[], "").await;
        assert_eq!(r.status, status, "{method} {path}");
        assert!(r.json()["error"]["message"].as_str().is_some());
        if status == StatusCode::METHOD_NOT_ALLOWED {
            assert!(r.headers.contains_key("allow"));
        }
    }
    assert_eq!(server.sim.engine().stats().requests_finished, 0);
    server.stop().await;

    // A request larger than the whole KV cache.
    let server = start(EngineConfig {
        kv_capacity_tokens: 64,
        max_model_len: 4096,
        ..fast()
    })
    .await;
    let r = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": long_prompt("kv", 200), "max_tokens": 4}),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "prompt");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("KV blocks"))
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_on_keep_alive_connections() {
    let server = start(fast()).await;
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let addr = server.addr;
            tokio::spawn(async move {
                let stream = TcpStream::connect(addr).await.expect("connect");
                let (mut sender, connection) =
                    hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream))
                        .await
                        .expect("handshake");
                tokio::spawn(connection);
                for j in 0..3 {
                    let body = json!({"prompt": format!("client {i} request {j}"), "max_tokens": 8, "stream": j == 1});
                    let request = Request::post("/v1/completions")
                        .header("host", "test")
                        .body(Full::new(Bytes::from(body.to_string())))
                        .expect("request");
                    sender.ready().await.expect("ready");
                    let response = sender.send_request(request).await.expect("response");
                    assert_eq!(response.status(), StatusCode::OK);
                    response.into_body().collect().await.expect("body");
                }
            })
        })
        .collect();
    for task in tasks {
        within("client", task).await.expect("client task");
    }
    assert_eq!(server.sim.engine().stats().requests_finished, 48);
    server.stop().await;
}

/// `--metrics-flavor none`: `/metrics` answers 404 with an OpenAI-style
/// error, as an engine started without metrics does; the API still works,
/// and the simulator's own `/sim/metrics` still shows its counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_can_be_hidden() {
    let server = start_full(fast(), FaultConfig::default(), MetricsFlavor::None).await;
    let reply = get(server.addr, "/metrics").await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);
    assert_eq!(reply.json()["error"]["code"], "not_found", "{:?}", reply.body);
    assert_eq!(get(server.addr, "/v1/models").await.status, StatusCode::OK);
    let own = get(server.addr, "/sim/metrics").await;
    assert_eq!(own.status, StatusCode::OK);
    assert!(own.text().contains("vllm:prefix_cache_queries_total"), "{}", own.text());
    server.stop().await;
}

/// `GET /props`: answered as `llama-server` does (its slots are the batch
/// size, each with the model's context) with the llama.cpp flavour, 404
/// with the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn props_say_the_slots_as_llama_cpp_does() {
    let config = EngineConfig {
        max_num_seqs: 3,
        ..fast()
    };
    let llama = start_full(config.clone(), FaultConfig::default(), MetricsFlavor::Llamacpp).await;
    let props = get(llama.addr, "/props").await;
    assert_eq!(props.status, StatusCode::OK);
    let v = props.json();
    assert_eq!(v["total_slots"], 3);
    assert_eq!(v["default_generation_settings"]["n_ctx"], config.max_model_len);
    assert_eq!(v["model_path"], MODEL);
    assert_eq!(
        call(llama.addr, Method::POST, "/props", &[], "{}").await.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    llama.stop().await;
    let vllm = start(config).await;
    let reply = get(vllm.addr, "/props").await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);
    assert_eq!(reply.json()["error"]["code"], "not_found", "{:?}", reply.body);
    vllm.stop().await;
}

// ----- the endpoints routers ask a worker for (vLLM's and SGLang's) -----

/// vLLM's `/tokenize`, `/detokenize` and render routes answer the ids the
/// engine itself computes for the same body (its usage counts them), in
/// vLLM's shapes, and every bad request is the simulator's 4xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_tokenization_gives_the_engines_own_ids() {
    let server = start(fast()).await;
    let messages = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three rivers."}
    ]);
    // vllm-router's /tokenize body for a chat call.
    let r = post(
        server.addr,
        "/tokenize",
        &json!({"model": MODEL, "continue_final_message": false, "messages": messages}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.header("content-type"), "application/json");
    let t = r.json();
    let tokens: Vec<u64> = t["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert_eq!(t["count"], tokens.len());
    assert_eq!(t["max_model_len"], fast().max_model_len);
    assert_eq!(t["token_strs"], Value::Null);
    let chat = json!({"model": MODEL, "messages": messages, "max_tokens": 4, "stream": false});
    let used = post(server.addr, "/v1/chat/completions", &chat).await.json();
    assert_eq!(used["usage"]["prompt_tokens"], tokens.len(), "the engine's count");
    // Render: vLLM's GenerateRequest with the same ids.
    let r = post(server.addr, "/v1/chat/completions/render", &chat).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let g = r.json();
    assert_eq!(g["token_ids"], json!(tokens));
    assert!(g["request_id"].as_str().is_some_and(|id| id.starts_with("chatcmpl-")));
    assert_eq!(g["model"], MODEL);
    assert_eq!(g["sampling_params"]["max_tokens"], 4);
    assert_eq!(g["stream"], false);
    assert_eq!(g["features"], Value::Null);

    // A text prompt: the ids of a /v1/completions text prompt.
    let text = "Rivers: the Nile, the Amazon and the Yangtze.";
    let r = post(
        server.addr,
        "/tokenize",
        &json!({"prompt": text, "add_special_tokens": true, "return_token_strs": true}),
    )
    .await
    .json();
    assert_eq!(r["tokens"], json!(server.sim.tokenizer().encode(text)));
    let strs: Vec<&str> = r["token_strs"]
        .as_array()
        .expect("strs")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(strs.concat(), text);
    let count = r["count"].as_u64().expect("count");
    let used = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": text, "max_tokens": 1}),
    )
    .await
    .json();
    assert_eq!(used["usage"]["prompt_tokens"], count);
    let d = post(server.addr, "/detokenize", &json!({"tokens": r["tokens"]})).await;
    assert_eq!(d.status, StatusCode::OK, "{}", d.text());
    assert_eq!(d.json(), json!({"prompt": text}));
    let g = post(server.addr, "/v1/completions/render", &json!({"prompt": text}))
        .await
        .json();
    assert_eq!(g[0]["token_ids"], r["tokens"]);
    assert!(g[0]["request_id"].as_str().is_some_and(|id| id.starts_with("cmpl-")));
    assert_eq!(
        g[0]["sampling_params"]["max_tokens"],
        u64::from(fast().max_model_len) - count
    );
    let v = get(server.addr, "/version").await;
    assert_eq!(v.status, StatusCode::OK);
    assert!(v.json()["version"].as_str().is_some_and(|s| !s.is_empty()));

    // Errors: the model, the body, the options the simulator lacks, the
    // context, the vocabulary; never a 5xx, never an engine request.
    let finished = server.sim.engine().stats().requests_finished;
    let vocab = server.sim.tokenizer().vocab_size();
    let user = json!([{"role": "user", "content": "hi"}]);
    for (path, body, status, param) in [
        (
            "/tokenize",
            json!({"model": "nope", "prompt": "x"}),
            StatusCode::NOT_FOUND,
            Some("model"),
        ),
        (
            "/tokenize",
            json!({"model": "nope", "messages": user}),
            StatusCode::NOT_FOUND,
            Some("model"),
        ),
        (
            "/detokenize",
            json!({"model": "nope", "tokens": [1]}),
            StatusCode::NOT_FOUND,
            Some("model"),
        ),
        (
            "/v1/chat/completions/render",
            json!({"model": "nope", "messages": user}),
            StatusCode::NOT_FOUND,
            Some("model"),
        ),
        ("/tokenize", json!({}), StatusCode::BAD_REQUEST, Some("prompt")),
        (
            "/tokenize",
            json!({"prompt": [1, 2]}),
            StatusCode::BAD_REQUEST,
            Some("prompt"),
        ),
        (
            "/tokenize",
            json!({"messages": []}),
            StatusCode::BAD_REQUEST,
            Some("messages"),
        ),
        (
            "/tokenize",
            json!({"messages": user, "add_generation_prompt": false}),
            StatusCode::BAD_REQUEST,
            Some("add_generation_prompt"),
        ),
        (
            "/detokenize",
            json!({"tokens": [vocab]}),
            StatusCode::BAD_REQUEST,
            Some("tokens"),
        ),
        (
            "/detokenize",
            json!({"tokens": "1 2"}),
            StatusCode::BAD_REQUEST,
            Some("tokens"),
        ),
        (
            "/v1/chat/completions/render",
            json!({"messages": "hi"}),
            StatusCode::BAD_REQUEST,
            Some("messages"),
        ),
        (
            "/v1/chat/completions/render",
            json!({"messages": user, "max_tokens": fast().max_model_len}),
            StatusCode::BAD_REQUEST,
            Some("messages"),
        ),
        (
            "/v1/chat/completions/render",
            json!({"messages": user, "priority": "high"}),
            StatusCode::BAD_REQUEST,
            Some("priority"),
        ),
        (
            "/v1/completions/render",
            json!({"prompt": ""}),
            StatusCode::BAD_REQUEST,
            Some("prompt"),
        ),
    ] {
        let r = post(server.addr, path, &body).await;
        assert_eq!(r.status, status, "{path} {body}: {}", r.text());
        let error = &r.json()["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{path} {body}"
        );
        assert_eq!(error["param"].as_str(), param, "{path} {body}");
    }
    let r = post(
        server.addr,
        "/v1/chat/completions/render",
        &json!({"messages": user, "max_tokens": fast().max_model_len}),
    )
    .await;
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    let valid = json!({"model": MODEL, "messages": user}).to_string();
    for path in ["/tokenize", "/v1/chat/completions/render"] {
        for cut in 0..valid.len() {
            let r = call(server.addr, Method::POST, path, &[], &valid[..cut]).await;
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path} {:?}", &valid[..cut]);
        }
        let r = call(server.addr, Method::GET, path, &[], "").await;
        assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{path}");
        assert_eq!(r.header("allow"), "POST");
    }
    assert_eq!(server.sim.engine().stats().requests_finished, finished);
    server.stop().await;
}

/// SGLang's `/model_info`, `/server_info` (and their `/get_` names) and
/// `/v1/loads` describe the engine; the load report follows a request in
/// flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_info_describes_the_engine() {
    let server = start(EngineConfig {
        time_scale: 0.1,
        ..fast()
    })
    .await;
    for path in ["/model_info", "/get_model_info"] {
        let r = get(server.addr, path).await;
        assert_eq!(r.status, StatusCode::OK, "{path}");
        assert_eq!(r.header("content-type"), "application/json");
        let v = r.json();
        assert_eq!(v["model_path"], MODEL, "{path}");
        assert_eq!(v["tokenizer_path"], MODEL, "{path}");
        assert_eq!(v["is_generation"], true, "{path}");
    }
    for path in ["/server_info", "/get_server_info"] {
        let v = get(server.addr, path).await.json();
        assert_eq!(v["served_model_name"], MODEL, "{path}");
        assert_eq!(v["model_path"], MODEL, "{path}");
        assert_eq!(v["dp_size"], 1, "{path}");
        assert_eq!(v["context_length"], fast().max_model_len, "{path}");
        assert_eq!(v["max_running_requests"], fast().max_num_seqs, "{path}");
        assert_eq!(v["page_size"], fast().block_size, "{path}");
    }
    let idle = get(server.addr, "/v1/loads?include=core,disagg,queues,memory")
        .await
        .json();
    assert_eq!(idle["dp_rank_count"], 1);
    assert_eq!(idle["loads"][0]["num_running_reqs"], 0);
    let capacity = fast().kv_capacity_tokens / u64::from(fast().block_size) * u64::from(fast().block_size);
    assert_eq!(idle["loads"][0]["max_total_num_tokens"], capacity);
    // 300 decode steps of ~1 ms (time scale 0.1): one request in flight.
    let addr = server.addr;
    let running = tokio::spawn(async move {
        let body = json!({"prompt": "a long answer", "max_tokens": 300, "ignore_eos": true});
        post(addr, "/v1/completions", &body).await
    });
    let deadline = Instant::now() + PATIENCE;
    loop {
        let v = get(server.addr, "/v1/loads").await.json();
        if v["loads"][0]["num_running_reqs"] == 1 {
            assert!(v["loads"][0]["num_used_tokens"].as_u64().is_some_and(|n| n > 0));
            assert!(v["loads"][0]["token_usage"].as_f64().is_some_and(|u| u > 0.0));
            break;
        }
        assert!(!running.is_finished(), "the request never showed on /v1/loads");
        assert!(Instant::now() < deadline, "the request never showed on /v1/loads");
        tokio::task::yield_now().await;
    }
    assert_eq!(within("request", running).await.expect("task").status, StatusCode::OK);
    assert_eq!(get(server.addr, "/v1/loads?dp_rank=1").await.json()["loads"], json!([]));
    for (method, path, status) in [
        (Method::GET, "/v1/loads?include=everything", StatusCode::BAD_REQUEST),
        (Method::GET, "/v1/loads?dp_rank=first", StatusCode::BAD_REQUEST),
        (Method::POST, "/server_info", StatusCode::METHOD_NOT_ALLOWED),
        (Method::POST, "/get_model_info", StatusCode::METHOD_NOT_ALLOWED),
        (Method::DELETE, "/version", StatusCode::METHOD_NOT_ALLOWED),
    ] {
        let r = call(server.addr, method.clone(), path, &[], "").await;
        assert_eq!(r.status, status, "{method} {path}");
        assert!(r.json()["error"]["message"].as_str().is_some());
    }
    server.stop().await;

    // An engine that reports no load reports none on /v1/loads either.
    for flavor in [MetricsFlavor::None, MetricsFlavor::Llamacpp] {
        let server = start_full(fast(), FaultConfig::default(), flavor).await;
        assert_eq!(get(server.addr, "/v1/loads").await.status, StatusCode::NOT_FOUND);
        let info = get(server.addr, "/server_info").await.json();
        assert_eq!(info["enable_metrics"], flavor != MetricsFlavor::None);
        server.stop().await;
    }
}
