//! semlb in front of real inference engines: llama.cpp's `llama-server`
//! (b11434) serving SmolLM2-135M-Instruct on CPU, built and fetched by
//! `workers/recipes/llama-cpp/get.sh`, started as the recipe and `.ci/run`
//! start it. The gateway reads the engine's own tokenizer and chat template
//! from the GGUF file (`--tokenizer <model>.gguf`).
//!
//! Shown here, as clients see it: back-to-back streamed conversations
//! return to their engine with the engine's reported `cached_tokens`
//! growing; the engines' `/metrics` and `/props` reach the server table
//! (requests running while one streams, no KV usage where llama.cpp
//! reports none, their slots as the admission limit); an engine killed
//! with SIGKILL is routed around with no failed request; a repeated
//! deterministic request is answered from the response cache
//! without the engines computing anything; a prompt longer than the
//! engine's slot context (from `/props`) is refused at the gateway with the
//! 400 the engine itself gives it; a stream whose engine is SIGKILLed
//! mid-answer completes on the other engine.
//!
//! Skipped, loudly, where the engine was not built; required in CI
//! (`SEMLB_REQUIRE_LLAMA`). The engines are slow (one thread each), so the
//! prompts are short and the counts small.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::json;

use semlb::metrics::responder_records;
use semlb_test_support as support;
use support::gateway::{Gateway, Turn, answered_by_gateway, chat, routed, sample, user, wait_for};
use support::http::http;
use support::llama::{LlamaInstall, LlamaOptions, LlamaServer};
use support::sse::stream;

fn unique(tag: &str) -> String {
    support::process::unique("llama", tag)
}

/// `n` engines and a gateway in front of them (2 dispatchers, `--tokenizer`
/// the model file), or `None` where no engine was built.
fn fleet(n: usize, tag: &str) -> Option<(Vec<LlamaServer>, Gateway)> {
    let install = LlamaInstall::find()?;
    let engines: Vec<LlamaServer> = (0..n).map(|_| LlamaServer::start(&install)).collect();
    let mut builder = Gateway::builder()
        .shm(&unique(tag))
        .args(&["--tokenizer", install.model.to_str()?]);
    for e in &engines {
        builder = builder.backend(&e.addr);
    }
    Some((engines, builder.start()))
}

/// A streamed conversation of `turns` turns, each sent the instant the
/// previous stream ended, with the key in an `api-key` header.
fn converse(addr: &str, i: usize, turns: usize) -> Vec<Turn> {
    let messages = vec![
        json!({"role": "system", "content": format!("You are assistant number {i}. Answer in one short sentence.")}),
        user(&format!("Conversation {i}: name a city.")),
    ];
    let extra = json!({"stream": true, "stream_options": {"include_usage": true}, "max_tokens": 16, "temperature": 0});
    support::gateway::converse(addr, messages, &extra, turns, |t| {
        format!("Turn {}: and another?", t + 2)
    })
}

#[test]
fn back_to_back_conversations_return_to_their_engine_with_cached_tokens_growing() {
    let Some((_engines, gw)) = fleet(2, "conv") else { return };
    let threads: Vec<_> = (0..3)
        .map(|i| {
            let addr = gw.addr().to_owned();
            std::thread::spawn(move || converse(&addr, i, 4))
        })
        .collect();
    let all: Vec<Vec<Turn>> = threads.into_iter().map(|t| t.join().expect("client")).collect();
    for turns in &all {
        assert!(
            turns.iter().all(|t| t.backend == turns[0].backend),
            "the conversation moved: {turns:?}"
        );
        // By its prefix, or by load to the same engine: the engines' two
        // slots scale cache_aware's balance threshold to one request, so
        // the conversation alone on its engine is routed by load while the
        // other engine runs both of the others (and its engine is the idle one).
        assert!(
            turns[1..]
                .iter()
                .all(|t| t.route == "prefix" || t.route == "least_load"),
            "{turns:?}"
        );
        for w in turns.windows(2) {
            assert!(
                w[1].cached_tokens > w[0].cached_tokens,
                "cached_tokens must grow: {turns:?}"
            );
        }
    }
    // The two conversations sharing an engine never find the other engine
    // two requests busier: their later turns follow their prefix.
    let by_prefix = all.iter().flat_map(|c| &c[1..]).filter(|t| t.route == "prefix").count();
    assert!(by_prefix >= 6, "{by_prefix} later turns by prefix: {all:?}");
    let homes: std::collections::HashSet<&str> = all.iter().map(|c| c[0].backend.as_str()).collect();
    assert_eq!(homes.len(), 2, "three conversations use both engines: {all:?}");
}

#[test]
fn the_engines_metrics_reach_the_server_table() {
    let Some((engines, gw)) = fleet(2, "metrics") else {
        return;
    };
    let series = |name: &str, e: &LlamaServer| format!("{name}{{server=\"http://{}\"}}", e.addr);
    // Both scraped: their request gauges appear; llama.cpp has no KV-usage
    // gauge, and none is made up.
    let metrics = wait_for("both engines scraped", Duration::from_secs(20), || {
        let m = gw.metrics();
        (
            engines
                .iter()
                .all(|e| sample(&m, &series("semlb_server_running_requests", e)).is_some()),
            m,
        )
    });
    for e in &engines {
        assert_eq!(
            sample(&metrics, &series("semlb_server_kv_cache_usage_ratio", e)),
            None,
            "{metrics}"
        );
    }
    // Their `/props` said how many requests each runs at once (`-np`):
    // that is the admission limit, not a learned one.
    let slots = f64::from(LlamaOptions::default().slots);
    wait_for("both engines' slots read", Duration::from_secs(20), || {
        let m = gw.metrics();
        let limits: Vec<Option<f64>> = engines
            .iter()
            .map(|e| sample(&m, &series("semlb_server_admission_limit", e)))
            .collect();
        (limits.iter().all(|l| *l == Some(slots)), limits)
    });
    // A long answer streams: the engine it runs on reports it running.
    let addr = gw.addr().to_owned();
    let long = std::thread::spawn(move || {
        chat(
            &addr,
            &[user("Write a long story about a lighthouse keeper.")],
            json!({"stream": true, "max_tokens": 400, "ignore_eos": true}),
            &[],
        )
    });
    let running = wait_for("a running request scraped", Duration::from_secs(30), || {
        let m = gw.metrics();
        let running: f64 = engines
            .iter()
            .filter_map(|e| sample(&m, &series("semlb_server_running_requests", e)))
            .sum();
        (running >= 1.0, running)
    });
    let r = long.join().expect("client");
    assert_eq!(r.status, 200);
    assert!(running >= 1.0);
}

#[test]
fn an_engine_killed_mid_run_is_routed_around() {
    let Some((mut engines, gw)) = fleet(2, "kill") else {
        return;
    };
    let ask = |i: usize| {
        let r = chat(
            gw.addr(),
            &[user(&format!("Question {i}: what is {i} plus {i}?"))],
            json!({"max_tokens": 8}),
            &[],
        );
        (r.status, routed(&r).0, String::from_utf8_lossy(&r.body).into_owned())
    };
    let before: Vec<_> = (0..4).map(ask).collect();
    assert!(before.iter().all(|(s, _, _)| *s == 200), "{before:?}");
    let dead = format!("http://{}", engines[0].addr);
    engines[0].kill();
    let after: Vec<_> = (4..12).map(ask).collect();
    for (status, backend, body) in &after {
        assert_eq!(*status, 200, "a request after the kill failed: {body}");
        assert_ne!(backend, &dead, "answered by the dead engine?");
    }
}

/// A stream whose engine is SIGKILLed mid-answer completes on the other
/// engine: the client reads one answer (one `id`, no error event,
/// `data: [DONE]` last) that begins with what the killed engine sent, and
/// the gateway logs the resumption. llama.cpp continues the assistant's
/// last message (its assistant prefill; it does not read
/// `continue_final_message`).
#[test]
fn a_stream_whose_engine_is_killed_completes_on_the_other() {
    let Some(install) = LlamaInstall::find() else {
        return;
    };
    let mut engines: Vec<LlamaServer> = (0..2).map(|_| LlamaServer::start(&install)).collect();
    let gw = Gateway::builder()
        .shm(&unique("resume"))
        .args(&["--tokenizer", install.model.to_str().expect("a UTF-8 path")])
        .backend(&engines[0].addr)
        .backend(&engines[1].addr)
        .stderr(support::process::Stderr::CaptureEcho)
        .start();
    let body = json!({
        "model": "semlb-sim",
        "messages": [user("Write a long story about a lighthouse keeper and the sea.")],
        "max_tokens": 96,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let mut killed = None;
    let got = stream(gw.addr(), &body, |so_far| {
        if killed.is_none() && so_far.chunks >= 12 {
            let victim = engines
                .iter_mut()
                .find(|e| e.addr == so_far.backend)
                .expect("one of ours");
            victim.kill();
            killed = Some((so_far.text.clone(), so_far.chunks));
        }
    });
    let (before, at) = killed.expect("killed mid-stream");
    got.assert_clean();
    assert!(got.text.starts_with(&before), "{:?} / {before:?}", got.text);
    assert!(got.chunks > at, "the answer went on after the kill: {}", got.raw);
    gw.proc.wait_stderr(0, "(resumption 1)", Duration::from_secs(30));
}

#[test]
fn a_repeated_deterministic_request_comes_from_the_response_cache() {
    let Some((engines, gw)) = fleet(2, "cache") else { return };
    let msgs = [user("What is the capital of France? Answer in one word.")];
    let det = json!({"temperature": 0, "max_tokens": 8});
    let key = [("api-key", "team-a")];
    let first = chat(gw.addr(), &msgs, det.clone(), &key);
    assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));
    assert_eq!(first.header("x-semlb-cache"), Some("miss"));
    gw.written_back(responder_records);
    let work = || -> HashMap<String, f64> {
        engines
            .iter()
            .map(|e| {
                let m = http(&e.addr, "GET", "/metrics", None, &[]).expect("engine metrics");
                let m = String::from_utf8_lossy(&m.body).into_owned();
                let n = ["llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total"]
                    .iter()
                    .filter_map(|s| sample(&m, s))
                    .sum();
                (e.addr.clone(), n)
            })
            .collect()
    };
    let before = work();
    let hit = chat(gw.addr(), &msgs, det.clone(), &key);
    assert_eq!(hit.header("x-semlb-cache"), Some("hit"));
    assert_eq!(
        hit.json()["choices"],
        first.json()["choices"],
        "the cached body is the first answer"
    );
    assert_eq!(work(), before, "the engines computed nothing for the hit");
    // Another tenant's key: not served from the first tenant's entry.
    let other = chat(gw.addr(), &msgs, det, &[("api-key", "team-b")]);
    assert_eq!(other.status, 200);
    assert_eq!(other.header("x-semlb-cache"), Some("miss"));
}

#[test]
fn a_prompt_longer_than_the_engines_context_is_refused_at_the_gateway() {
    let Some((engines, gw)) = fleet(1, "context") else {
        return;
    };
    let engine = &engines[0].addr;
    let props = http(engine, "GET", "/props", None, &[]).expect("/props");
    let props: serde_json::Value = serde_json::from_slice(&props.body).expect("JSON");
    let n_ctx = props["default_generation_settings"]["n_ctx"].as_u64().expect("n_ctx") as u32;
    // llama.cpp refuses a prompt that fills its slot's context, whatever
    // max_tokens asks: a prompt-only limit.
    let said = shm_layout::EngineContext {
        tokens: n_ctx,
        counts_output: false,
    };
    let url = format!("http://{engine}");
    wait_for("the engine's context read", Duration::from_secs(20), || {
        let known = gw
            .segment
            .tables()
            .servers
            .servers()
            .find(|s| s.address == url)
            .and_then(|s| s.engine_context);
        (known == Some(said), known)
    });
    let long = [user(&"word ".repeat(n_ctx as usize + 200))];
    let refused = chat(gw.addr(), &long, json!({"max_tokens": 8}), &[]);
    let error = answered_by_gateway(&refused, 400, "a prompt over the context");
    assert_eq!(error["error"]["code"], "context_length_exceeded", "{error}");
    // The engine agrees: the same request sent to it directly is refused.
    let direct = chat(engine, &long, json!({"max_tokens": 8}), &[]);
    assert_eq!(direct.status, 400, "{}", String::from_utf8_lossy(&direct.body));
    // A prompt well inside the context is served.
    let short = chat(gw.addr(), &[user("Say hi.")], json!({"max_tokens": 4}), &[]);
    assert_eq!(short.status, 200, "{}", String::from_utf8_lossy(&short.body));
}
