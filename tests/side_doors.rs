//! No side door to the engines (issue 39, findings 1 and 2), end to end: a
//! real `semlb serve` in front of simulated engines, requests sent as raw
//! HTTP the way a hostile client would.
//!
//! * A path with a percent-encoded `/`, `\`, `.` or control character, a
//!   `.` or `..` segment, `//` or a backslash gets 400 `invalid_path` from
//!   the gateway (uvicorn, which serves vLLM and SGLang, decodes `%2F`:
//!   `/v1/chat%2Fcompletions` used to be forwarded and run there, unmetered).
//! * Only the engines' known `/v1` endpoints are forwarded; any other
//!   `/v1/...` path gets 404 from the gateway, a wrong method 405.
//! * With keys, a passthrough body that names no model, or that serde_json
//!   refuses while Python takes it (`NaN`, a byte-order mark), gets 400: an
//!   authenticated caller never falls back to "any server" (it used to
//!   reach any engine of any pool, past the models its key may use).
//! * What is forwarded is charged: an embeddings request counts its
//!   estimated prompt tokens (a token per 4 bytes of body) to its model.
//! * An authenticated caller gets no `x-semlb-*` header (the gateway's
//!   diagnostics name engines' addresses and tell whether another tenant
//!   sent the same prefix; the simulated engine's own `x-semlb-sim-*` are
//!   withheld alike) unless `auth.debug_headers` is set: routed, streamed,
//!   cached, refused and passthrough answers alike.
//! * What the gateway does not tokenize still counts: a chat's `tools`
//!   in the context check, a completions batch's every prompt in the
//!   limits.

use semlb::metrics::responder_records;
use semlb_test_support as support;
use serde_json::json;
use support::TempDir;
use support::gateway::{Gateway, add_key, answered_by_gateway, engine_of, sim, sim_with};
use support::http::{Response, http, http_bytes};
use support::process::{Proc, Stderr};

#[test]
fn encoded_separators_dot_segments_and_unknown_v1_paths_never_reach_an_engine() {
    let engine = sim();
    let gw = Gateway::builder()
        .tag("side-doors-paths")
        .backends(&[&engine])
        .stderr(Stderr::CaptureEcho)
        .start();
    let addr = gw.addr().to_owned();
    let chat =
        json!({"model": "semlb-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).to_string();

    for path in [
        "/v1/chat%2Fcompletions",
        "/v1/chat%2fcompletions",
        "/v1/%2e%2e/v1/chat/completions",
        "/v1/%2E/chat/completions",
        "/v1/chat%5Ccompletions",
        "/v1/chat/completions%00",
        "/v1/chat%252Fcompletions",
        "/v1/./chat/completions",
        "/v1/../v1/chat/completions",
        "/v1/embeddings/..",
        "/v1//chat/completions",
        "/v1/chat\\completions",
        "/v1/chat/completions%",
        "/v1/chat/completions%2",
        "/health/..",
    ] {
        let r = http_bytes(&addr, "POST", path, Some(chat.as_bytes()), &[]).expect(path);
        let error = answered_by_gateway(&r, 400, path);
        assert_eq!(error["error"]["code"], "invalid_path", "{path}: {error}");
        assert_eq!(error["error"]["type"], "invalid_request_error", "{path}: {error}");
    }

    // Paths the engines may serve but the gateway does not forward.
    for (method, path) in [
        ("POST", "/v1/fine_tuning/jobs"),
        ("GET", "/v1/files"),
        ("DELETE", "/v1/models/sim"),
        ("POST", "/v1/chat/completions/"),
        ("POST", "/v1/load_lora_adapter"),
    ] {
        let r = http_bytes(&addr, method, path, Some(chat.as_bytes()), &[]).expect(path);
        let error = answered_by_gateway(&r, 404, path);
        assert_eq!(error["error"]["code"], "unknown_url", "{method} {path}: {error}");
    }
    let r = http(&addr, "GET", "/v1/embeddings", None, &[]).unwrap();
    answered_by_gateway(&r, 405, "GET /v1/embeddings");
    assert_eq!(r.header("allow"), Some("POST"));

    // What is on the list still works, and an ordinary chat is untouched.
    let r = http(
        &addr,
        "POST",
        "/v1/embeddings",
        Some(&json!({"model": "semlb-sim", "input": "embed me"})),
        &[],
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.header("x-semlb-backend").is_some());
    let r = http_bytes(&addr, "POST", "/v1/chat/completions", Some(chat.as_bytes()), &[]).unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

#[test]
fn an_authenticated_caller_never_falls_back_to_any_server() {
    let dir = TempDir::new("side-doors-keys");
    let keys_file = dir.0.join("keys.toml").display().to_string();
    let (alice, _) = add_key(&keys_file, "alice", &["alpha"]);
    let a = sim_with("0.01", &["--model", "alpha"]);
    let b = sim_with("0.01", &["--model", "beta"]);
    let engines: [(&str, &Proc); 2] = [("a", &a), ("b", &b)];
    let mut config = String::new();
    for (name, p) in engines {
        config.push_str(&format!(
            "[[backend]]\nurl = \"http://{}\"\nname = \"{name}\"\n",
            p.addr
        ));
    }
    config.push_str(&format!(
        "[[model]]\nname = \"alpha\"\nbackends = [\"a\"]\n[[model]]\nname = \"beta\"\nbackends = [\"b\"]\n\
         [auth]\nkeys_file = \"{keys_file}\"\ndebug_headers = true\n"
    ));
    let gw = Gateway::builder()
        .tag("side-doors-keys")
        .config(&config)
        .stderr(Stderr::CaptureEcho)
        .start();
    let addr = gw.addr().to_owned();
    let key: [(&str, &str); 1] = [("x-api-key", &alice)];
    let embed = |body: &[u8]| http_bytes(&addr, "POST", "/v1/embeddings", Some(body), &key).unwrap();

    // Her model: its engine. Another model: 403.
    let r = embed(br#"{"model": "alpha", "input": "x"}"#);
    assert_eq!(engine_of(&r, &engines, "alpha"), "a");
    let error = answered_by_gateway(&embed(br#"{"model": "beta", "input": "x"}"#), 403, "beta");
    assert_eq!(error["error"]["code"], "model_not_allowed");

    // No model, or a body only Python would read: 400, from the gateway.
    for (what, body) in [
        ("no model", br#"{"input": "x"}"#.to_vec()),
        (
            "a model that is not a string",
            br#"{"model": ["beta"], "input": "x"}"#.to_vec(),
        ),
        ("NaN", br#"{"model": "beta", "input": "x", "dimensions": NaN}"#.to_vec()),
        (
            "a byte-order mark",
            [b"\xef\xbb\xbf".as_slice(), br#"{"model": "beta", "input": "x"}"#].concat(),
        ),
        (
            "UTF-16",
            "{\"model\": \"beta\"}"
                .encode_utf16()
                .flat_map(u16::to_le_bytes)
                .collect(),
        ),
        ("an array", br#"[{"model": "beta", "input": "x"}]"#.to_vec()),
    ] {
        let r = embed(&body);
        let error = answered_by_gateway(&r, 400, what);
        assert_eq!(error["error"]["type"], "invalid_request_error", "{what}: {error}");
    }
    // The same holds for every forwarded endpoint, e.g. Messages.
    let r = http_bytes(&addr, "POST", "/v1/messages", Some(br#"{"max_tokens": 4}"#), &key).unwrap();
    answered_by_gateway(&r, 400, "a Messages body without a model");
}

#[test]
fn a_forwarded_request_is_charged_its_estimated_prompt_tokens() {
    let engine = sim_with("0.01", &["--model", "small"]);
    let config = format!(
        "[[backend]]\nurl = \"http://{}\"\nname = \"e\"\n[[model]]\nname = \"small\"\nbackends = [\"e\"]\n\
         tokens_per_minute = 600\n",
        engine.addr
    );
    let gw = Gateway::builder()
        .tag("side-doors-charge")
        .config(&config)
        .stderr(Stderr::CaptureEcho)
        .start();
    let addr = gw.addr().to_owned();
    let body = br#"{"model": "small", "input": "a text of a few words to embed, and then some more of them"}"#;
    let r = http_bytes(&addr, "POST", "/v1/embeddings", Some(body), &[]).unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    // A token per 4 bytes of body, charged before it is forwarded.
    let estimate = body.len().div_ceil(4) as i64;
    let left: i64 = r.header("x-ratelimit-remaining-tokens").unwrap().parse().unwrap();
    assert!(
        (600 - estimate..=600 - estimate + 1).contains(&left),
        "{left} tokens left after a {}-byte body (estimate {estimate})",
        body.len()
    );
}

/// The `x-semlb-*` answer headers `r` carries.
fn diagnostics(r: &Response) -> Vec<String> {
    r.headers
        .iter()
        .map(|(k, _)| k.to_ascii_lowercase())
        .filter(|k| k.starts_with("x-semlb-"))
        .collect()
}

#[test]
fn an_authenticated_caller_sees_no_diagnostic_header_unless_the_operator_allows_it() {
    let dir = TempDir::new("keys-debug");
    let keys_file = dir.0.join("keys.toml").display().to_string();
    let (alice, _) = add_key(&keys_file, "alice", &[]);
    let engine = sim_with("0.01", &["--model", "alpha"]);
    for debug in [false, true] {
        let gw = Gateway::builder()
            .tag("keys-debug")
            .backends(&[&engine])
            .config(&format!(
                "[auth]\nkeys_file = \"{keys_file}\"\ndebug_headers = {debug}\n"
            ))
            .stderr(Stderr::CaptureEcho)
            .start();
        let addr = gw.addr().to_owned();
        let key = [("Authorization", format!("Bearer {alice}"))];
        let key: Vec<(&str, &str)> = key.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let question = json!({
            "model": "alpha",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8,
            "temperature": 0,
        });
        let chat = || http(&addr, "POST", "/v1/chat/completions", Some(&question), &key).unwrap();
        // A routed answer, a streamed one, the cached repeat of the first
        // (once written back), a 4xx of the gateway's and a passthrough.
        let first = chat();
        assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));
        let mut streamed_body = json!({
            "model": "alpha",
            "messages": [{"role": "user", "content": "Stream it."}],
            "max_tokens": 8,
            "stream": true,
        });
        let streamed = http(&addr, "POST", "/v1/chat/completions", Some(&streamed_body), &key).unwrap();
        assert_eq!(streamed.status, 200);
        // Both answers written back (the first is what the repeat finds).
        gw.written_back(responder_records);
        gw.written_back(responder_records);
        let cached = chat();
        streamed_body["messages"] = json!("not a list");
        let refused = http(&addr, "POST", "/v1/chat/completions", Some(&streamed_body), &key).unwrap();
        assert_eq!(refused.status, 400);
        let embedded = http(
            &addr,
            "POST",
            "/v1/embeddings",
            Some(&json!({"model": "alpha", "input": "x"})),
            &key,
        )
        .unwrap();
        assert_eq!(embedded.status, 200);
        for (what, r) in [
            ("routed", &first),
            ("streamed", &streamed),
            ("cached", &cached),
            ("refused", &refused),
            ("embeddings", &embedded),
        ] {
            let seen = diagnostics(r);
            if debug {
                if what != "refused" {
                    assert!(seen.contains(&"x-semlb-backend".to_owned()), "{what}: {seen:?}");
                }
            } else {
                assert!(seen.is_empty(), "{what}: {seen:?} without debug_headers");
            }
        }
        if debug {
            assert_eq!(cached.header("x-semlb-cache"), Some("hit"), "the repeat was cached");
        }
    }
}

/// The prompt parts the gateway does not tokenize are counted (issue 39,
/// medium finding): a chat whose `tools` take an engine's context past
/// its end gets the engines' 400 from the gateway (it used to pass the
/// context check on its messages alone), and a completions batch is
/// charged for every prompt in it and reserves output for each (it used
/// to be charged for the first prompt alone).
#[test]
fn tools_and_batches_count_in_the_context_check_and_the_limits() {
    let engine = sim_with("0.01", &["--max-model-len", "600"]);
    let gw = Gateway::builder()
        .tag("side-doors-extra")
        .config(&format!(
            "[[backend]]\nurl = \"http://{}\"\nname = \"e\"\n[[model]]\nname = \"semlb-sim\"\nbackends = [\"e\"]\ntokens_per_minute = 100000\n",
            engine.addr
        ))
        .start();
    let tool = json!({"type": "function", "function": {
        "name": "lookup",
        "description": "Looks up a record. ".repeat(60),
        "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}
    }});
    let chat = |tools: serde_json::Value| {
        let body = json!({
            "model": "semlb-sim",
            "messages": [{"role": "user", "content": "Find record 7."}],
            "tools": tools,
            "max_tokens": 8,
        });
        http(gw.addr(), "POST", "/v1/chat/completions", Some(&body), &[]).unwrap()
    };
    // One tool (~300 tokens) fits in 600; three (~900) do not.
    let one = chat(json!([tool]));
    assert_eq!(one.status, 200, "{}", String::from_utf8_lossy(&one.body));
    let three = chat(json!([tool, tool, tool]));
    let error = answered_by_gateway(&three, 400, "tools past the context");
    assert_eq!(error["error"]["code"], "context_length_exceeded", "{error}");

    // A batch of three prompts of ~100 tokens each, 8 output tokens each:
    // every prompt and every answer's reservation is taken.
    let remaining = |r: &Response| -> u64 { r.header("x-ratelimit-remaining-tokens").unwrap().parse().unwrap() };
    let text = "word ".repeat(100);
    let single = json!({"model": "semlb-sim", "prompt": text, "max_tokens": 8, "temperature": 0.5});
    let r = http(gw.addr(), "POST", "/v1/completions", Some(&single), &[]).unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let before = remaining(&r);
    let batch = json!({"model": "semlb-sim", "prompt": [text, text, text], "max_tokens": 8, "temperature": 0.5});
    let r = http(gw.addr(), "POST", "/v1/completions", Some(&batch), &[]).unwrap();
    // (The simulator, unlike vLLM, answers a batch with its own 400; the
    // gateway let it in, and its headers say what that took.)
    assert!(
        r.status == 200 || r.status == 400,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let taken = before as i64 - remaining(&r) as i64;
    // The single request's 8 reserved come back (its answer had at most 8),
    // the batch takes 3 prompts (~300 tokens) and 24 reserved.
    assert!(
        taken >= 250,
        "the batch took {taken} tokens: its other prompts were not charged"
    );
}

/// `/metrics` names tenants, their live usage and the engines' addresses:
/// with `[auth]` it is not served to clients on the gateway's address
/// (issue 39, medium finding). Without a metrics token it answers 404 to
/// everyone, a valid API key included; with `metrics.token_file`, 401
/// without the token and 200 with it.
#[test]
fn metrics_are_not_for_clients_when_auth_is_on() {
    let dir = TempDir::new("side-doors-metrics");
    let keys = dir.0.join("keys.toml").display().to_string();
    let key = add_key(&keys, "tenant-a", &[]).0;
    let engine = sim();
    // An empty [metrics]: no token (the test harness adds one otherwise).
    let closed = Gateway::builder()
        .tag("side-doors-metrics-closed")
        .backends(&[&engine])
        .config(&format!("[auth]\nkeys_file = \"{keys}\"\n[metrics]\n"))
        .start();
    for headers in [vec![], vec![("authorization", format!("Bearer {key}"))]] {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = http(closed.addr(), "GET", "/metrics", None, &headers).unwrap();
        let error = answered_by_gateway(&r, 404, "metrics with [auth] and no token");
        assert!(!String::from_utf8_lossy(&r.body).contains("semlb_tenant"), "{error}");
    }
    drop(closed);
    // With a token (the harness's): 401 without it, 200 with it.
    let open = Gateway::builder()
        .tag("side-doors-metrics-token")
        .backends(&[&engine])
        .config(&format!("[auth]\nkeys_file = \"{keys}\"\n"))
        .start();
    let r = http(
        open.addr(),
        "GET",
        "/metrics",
        None,
        &[("authorization", &format!("Bearer {key}"))],
    )
    .unwrap();
    let error = answered_by_gateway(&r, 401, "an API key is not the metrics token");
    assert_eq!(error["error"]["code"], "invalid_metrics_token");
    assert!(open.metrics().contains("semlb_requests_total"), "the token scrapes");
}

/// The side doors under a flood (the issue's figures for findings 1 and
/// 2): two clients without pause for 6 s send encoded paths, dot-segments,
/// unknown endpoints and bodies that name no model or that only Python
/// reads, with a key for one model; each gets its 4xx from the gateway,
/// and the engines see only the polite client's chats (their completed
/// requests are exactly the polite ones answered), which are answered at
/// least 99 % of the time.
#[test]
fn a_flood_at_the_side_doors_reaches_no_engine_while_a_polite_client_is_served() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use support::attack::{Polite, restarts};
    let dir = TempDir::new("side-doors-flood");
    let keys_file = dir.0.join("keys.toml").display().to_string();
    let (mallory, _) = add_key(&keys_file, "mallory", &["alpha"]);
    let (polite_key, _) = add_key(&keys_file, "polite", &["semlb-sim"]);
    let a = sim_with("0.001", &["--model", "alpha"]);
    let b = sim_with("0.001", &["--model", "semlb-sim"]);
    let config = format!(
        "[[backend]]\nurl = \"http://{}\"\nname = \"a\"\n[[backend]]\nurl = \"http://{}\"\nname = \"b\"\n\
         [[model]]\nname = \"alpha\"\nbackends = [\"a\"]\n[[model]]\nname = \"semlb-sim\"\nbackends = [\"b\"]\n\
         [auth]\nkeys_file = \"{keys_file}\"\n",
        a.addr, b.addr
    );
    let gw = Gateway::builder()
        .tag("side-doors-flood")
        .dispatchers(2)
        .config(&config)
        .start();
    let chat = json!({"model": "semlb-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        .to_string()
        .into_bytes();
    let attacks: Vec<(&str, &str, Vec<u8>, u16)> = vec![
        ("POST", "/v1/chat%2Fcompletions", chat.clone(), 400),
        ("POST", "/v1/%2e%2e/v1/chat/completions", chat.clone(), 400),
        ("POST", "/v1//chat/completions", chat.clone(), 400),
        ("POST", "/v1/load_lora_adapter", chat.clone(), 404),
        ("POST", "/v1/embeddings", br#"{"input": "x"}"#.to_vec(), 400),
        (
            "POST",
            "/v1/embeddings",
            br#"{"model": "semlb-sim", "input": NaN}"#.to_vec(),
            400,
        ),
        ("POST", "/v1/messages", br#"{"max_tokens": 4096}"#.to_vec(), 400),
        (
            "POST",
            "/v1/embeddings",
            br#"{"model": "semlb-sim", "input": "x"}"#.to_vec(),
            403,
        ),
    ];
    let attacks = Arc::new(attacks);
    let stop = Arc::new(AtomicBool::new(false));
    let flood: Vec<_> = (0..2)
        .map(|i| {
            let (addr, stop, attacks, key) = (gw.addr().to_owned(), stop.clone(), attacks.clone(), mallory.clone());
            std::thread::spawn(move || {
                let mut sent = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let (method, path, body, status) = &attacks[(sent + i) % attacks.len()];
                    let r = http_bytes(&addr, method, path, Some(body), &[("api-key", &key)]).expect(path);
                    answered_by_gateway(&r, *status, path);
                    sent += 1;
                }
                sent
            })
        })
        .collect();
    let bearer = format!("Bearer {polite_key}");
    let mut polite = Polite::with_headers(&[("authorization", &bearer)]);
    polite.ask_for(&gw, 6.0, json!({"max_tokens": 4}));
    stop.store(true, Ordering::Relaxed);
    let sent: usize = flood.into_iter().map(|t| t.join().expect("attacker")).sum();
    let served = support::gateway::engine_counter(&[&a, &b], "vllm:request_success_total");
    polite.report(&format!("side doors ({sent} requests from 2 clients)"), &gw);
    assert!(sent >= attacks.len(), "{sent} attacks sent");
    assert_eq!(
        served as usize,
        polite.answered(),
        "the engines saw only the polite chats"
    );
    polite.assert_served("side doors");
    assert_eq!(restarts(&gw), 0.0);
}
