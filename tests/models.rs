//! Model pools (`[[model]]`), end to end: a real `semlb serve` in front of
//! simulated engines serving different models.
//!
//! * Requests route by their `model` field to that model's engines only
//!   (the engines would answer another model's request with a 404), by
//!   name or alias (the alias rewritten to the served name), chat,
//!   completions and embeddings alike; a LoRA adapter goes to its base's
//!   engines that serve it; an unknown model gets OpenAI's 404
//!   `model_not_found` from the gateway; `/v1/models` lists the pools.
//! * Each pool tokenizes with its own tokenizer: the same prompt fits one
//!   model's context by its tokenizer and not the other's, and the gateway
//!   refuses it for the second only.
//! * A reload (SIGHUP) adds and removes pools.

use std::collections::BTreeSet;
use std::time::Duration;

use semlb_test_support as support;
use serde_json::{Value, json};
use shm_layout::EngineContext;
use support::TempDir;
use support::gateway::{Gateway, answered_by_gateway, engine_of, sim_with};
use support::http::{Response, http};
use support::process::{Proc, Stderr};

/// The bundled tokenizer with its merges taken out: every byte is a token,
/// so a text has about four times the tokens it has with the bundled one.
fn byte_tokenizer(dir: &TempDir) -> String {
    let bundled = concat!(env!("CARGO_MANIFEST_DIR"), "/tokenizer/assets/phi2-tokenizer.json");
    let mut json: Value = serde_json::from_slice(&std::fs::read(bundled).unwrap()).unwrap();
    json["model"]["merges"] = json!([]);
    let path = dir.0.join("bytes-tokenizer.json");
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
    path.display().to_string()
}

fn post(addr: &str, path: &str, body: Value) -> Response {
    http(addr, "POST", path, Some(&body), &[]).expect("request")
}

fn chat(addr: &str, model: &str, text: &str) -> Response {
    let body = json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8});
    post(addr, "/v1/chat/completions", body)
}

/// Waits until the server table knows every engine's context.
fn contexts_known(gw: &Gateway, engines: &[&Proc], tokens: u32) {
    let said = EngineContext {
        tokens,
        counts_output: true,
    };
    support::gateway::wait_for("the engines' contexts", Duration::from_secs(20), || {
        let known = engines
            .iter()
            .filter(|e| {
                let url = format!("http://{}", e.addr);
                gw.segment
                    .tables()
                    .servers
                    .servers()
                    .any(|s| s.address == url && s.engine_context == Some(said))
            })
            .count();
        (known == engines.len(), known)
    });
}

fn backend_tables(engines: &[(&str, &Proc)]) -> String {
    engines
        .iter()
        .map(|(name, p)| format!("[[backend]]\nurl = \"http://{}\"\nname = \"{name}\"\n", p.addr))
        .collect()
}

#[test]
fn requests_go_to_their_models_engines_with_their_models_tokenizer() {
    let dir = TempDir::new("models");
    let alpha = |_| sim_with("0.01", &["--model", "alpha", "--max-model-len", "1000"]);
    let (a1, a2) = (alpha(1), alpha(2));
    let b1 = sim_with(
        "0.01",
        &["--model", "beta", "--lora", "beta-sql", "--max-model-len", "1000"],
    );
    let b2 = sim_with("0.01", &["--model", "beta", "--max-model-len", "1000"]);
    let engines = [("a1", &a1), ("a2", &a2), ("b1", &b1), ("b2", &b2)];
    let config = format!(
        "{}[health]\nscrape_interval_ms = 50\n\n\
         [[model]]\nname = \"alpha\"\naliases = [\"default\", \"fast\"]\nbackends = [\"a1\", \"a2\"]\n\n\
         [[model]]\nname = \"beta\"\nbackends = [\"b1\", \"http://{}\"]\ntokenizer = \"{}\"\n\n\
         [[model]]\nname = \"beta-sql\"\nbase = \"beta\"\nbackends = [\"b1\"]\n",
        backend_tables(&engines),
        b2.addr,
        byte_tokenizer(&dir),
    );
    let gw = Gateway::builder().tag("models").config(&config).start();
    let addr = gw.addr().to_owned();

    // Names and aliases go to their model's engines; the engines see the
    // served name (they would answer an alias 404). Each question opens
    // with its own number: with beta's byte tokenizer, questions sharing
    // their first words share their first block, and the default policy
    // rightly keeps such prompts on the engine that holds it while both
    // are idle (then b2 might never be seen).
    let mut seen: BTreeSet<(String, &str)> = BTreeSet::new();
    for i in 0..24 {
        let model = ["alpha", "default", "fast", "beta", "beta-sql"][i % 5];
        let r = chat(&addr, model, &format!("{i}: a question for {model}"));
        let engine = engine_of(&r, &engines, model);
        let served = r.json()["model"].as_str().unwrap_or_default().to_owned();
        let expected = match model {
            "beta-sql" => ("beta-sql", ["b1"].as_slice()),
            "beta" => ("beta", ["b1", "b2"].as_slice()),
            _ => ("alpha", ["a1", "a2"].as_slice()),
        };
        assert_eq!(served, expected.0, "{model}: the engine answered for {served}");
        assert!(expected.1.contains(&engine), "{model} went to {engine}");
        seen.insert((model.to_owned(), engine));
    }
    let completion = post(
        &addr,
        "/v1/completions",
        json!({"model": "fast", "prompt": "x", "max_tokens": 4}),
    );
    assert!(["a1", "a2"].contains(&engine_of(&completion, &engines, "completions")));
    // Embeddings (and other endpoints with a model) go to the pool too.
    for (model, allowed) in [("beta", ["b1", "b2"]), ("default", ["a1", "a2"])] {
        let r = post(&addr, "/v1/embeddings", json!({"model": model, "input": "embed me"}));
        assert!(allowed.contains(&engine_of(&r, &engines, "embeddings")), "{model}");
        assert_eq!(r.json()["data"][0]["embedding"].as_array().map(Vec::len), Some(16));
    }
    assert!(
        seen.iter().any(|(m, e)| m == "beta" && *e == "b2"),
        "beta's backend named by URL is used: {seen:?}"
    );

    // An unknown model: OpenAI's 404, from the gateway, on every endpoint.
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"model": "gamma", "messages": [{"role": "user", "content": "hi"}]}),
        ),
        ("/v1/completions", json!({"model": "gamma", "prompt": "hi"})),
        ("/v1/embeddings", json!({"model": "gamma", "input": "hi"})),
    ] {
        let error = answered_by_gateway(&post(&addr, path, body), 404, path);
        assert_eq!(error["error"]["code"], "model_not_found", "{path}: {error}");
        assert_eq!(error["error"]["param"], "model", "{path}");
        assert!(error["error"]["message"].as_str().unwrap().contains("gamma"), "{error}");
    }

    // /v1/models: the pools, adapters with their parent.
    let list = http(&addr, "GET", "/v1/models", None, &[]).expect("models").json();
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["alpha", "default", "fast", "beta", "beta-sql"]);
    let sql = &list["data"][4];
    assert_eq!(
        (sql["parent"].as_str(), sql["root"].as_str()),
        (Some("beta"), Some("beta"))
    );
    assert_eq!(list["data"][3]["live_servers"], 2);

    // Each pool's tokenizer: ~1 200 bytes of English are about 270 tokens
    // with the bundled tokenizer (alpha's) and 1 200 with beta's, whose
    // engines take 1 000. Once the gateway knows the contexts, it refuses
    // the prompt for beta only (the engines, with the bundled tokenizer,
    // would take it).
    contexts_known(&gw, &[&a1, &a2, &b1, &b2], 1000);
    let prompt = "The quick brown fox jumps over the lazy dog near the river bank. ".repeat(19);
    let fits = chat(&addr, "alpha", &prompt);
    engine_of(&fits, &engines, "alpha, by its tokenizer");
    for model in ["beta", "beta-sql"] {
        let error = answered_by_gateway(&chat(&addr, model, &prompt), 400, model);
        assert_eq!(error["error"]["code"], "context_length_exceeded", "{model}: {error}");
    }
}

#[test]
fn a_reload_adds_and_removes_models() {
    let dir = TempDir::new("models-reload");
    let a = sim_with("0.01", &["--model", "alpha"]);
    let b = sim_with("0.01", &["--model", "beta"]);
    let engines = [("a", &a), ("b", &b)];
    let write = |models: &str| {
        let text = format!("{}{models}", backend_tables(&engines));
        std::fs::write(dir.0.join("semlb.toml"), text).unwrap();
    };
    write("[[model]]\nname = \"alpha\"\nbackends = [\"a\"]\n");
    let config = dir.0.join("semlb.toml").display().to_string();
    let gw = Gateway::builder()
        .tag("models-reload")
        .args(&["--config", &config])
        .stderr(Stderr::CaptureEcho)
        .start();
    let addr = gw.addr().to_owned();
    assert_eq!(engine_of(&chat(&addr, "alpha", "hi"), &engines, "alpha"), "a");
    answered_by_gateway(&chat(&addr, "beta", "hi"), 404, "beta before the reload");

    // Each dispatcher says when it has the new pools.
    let reload = |models: &str, pools: usize| {
        let from = gw.proc.stderr_text().len();
        write(models);
        gw.proc.signal(nix::sys::signal::Signal::SIGHUP);
        for dispatcher in 0..2 {
            let line = format!("dispatcher {dispatcher}: {pools} model pools");
            gw.proc.wait_stderr(from, &line, Duration::from_secs(20));
        }
    };
    reload(
        "[[model]]\nname = \"alpha\"\nbackends = [\"a\"]\n[[model]]\nname = \"beta\"\naliases = [\"b\"]\nbackends = [\"b\"]\n",
        2,
    );
    for _ in 0..4 {
        assert_eq!(engine_of(&chat(&addr, "alpha", "hi"), &engines, "alpha"), "a");
        assert_eq!(engine_of(&chat(&addr, "b", "hi"), &engines, "beta by alias"), "b");
    }
    reload("[[model]]\nname = \"beta\"\nbackends = [\"b\"]\n", 1);
    answered_by_gateway(&chat(&addr, "alpha", "hi"), 404, "alpha after its removal");
    answered_by_gateway(&chat(&addr, "b", "hi"), 404, "an alias removed");
    assert_eq!(engine_of(&chat(&addr, "beta", "hi"), &engines, "beta"), "b");
}
