//! Client authentication, end to end: keys made with `semlb keys`, a real
//! `semlb serve` with `[auth] keys_file`, clients sending their keys the
//! ways SDKs do.
//!
//! * No key: 401 `missing_api_key` with `WWW-Authenticate`; an unknown
//!   key: 401 `invalid_api_key`; both from the gateway, on every `/v1`
//!   route (`/health` stays open).
//! * A key works in `Authorization: Bearer`, `api-key` and `x-api-key`; a
//!   model it may not use: 403 `model_not_allowed`; `/v1/models` lists
//!   only what it may use.
//! * The key's tenant is the response cache's tenant: two keys of one
//!   tenant share cached answers, another tenant's key does not.
//! * `semlb keys revoke` and a reload shut a key out; the file holds no key.

use std::time::Duration;

use semlb::metrics::responder_records;
use semlb_test_support as support;
use serde_json::json;
use support::TempDir;
use support::gateway::{Gateway, add_key, answered_by_gateway, sim_with};
use support::http::{Response, http};
use support::process::{Proc, Stderr, assert_ok, run as semlb};

fn chat(addr: &str, model: &str, headers: &[(&str, &str)]) -> Response {
    let body = json!({
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    });
    http(addr, "POST", "/v1/chat/completions", Some(&body), headers).expect("request")
}

#[test]
fn keys_let_callers_in_to_their_models_and_name_their_tenant() {
    let dir = TempDir::new("keys");
    let keys_file = dir.0.join("keys.toml").display().to_string();
    let (alice, _) = add_key(&keys_file, "alice", &["alpha"]);
    let (bob, bob_id) = add_key(&keys_file, "bob", &[]);
    let (bob2, _) = add_key(&keys_file, "bob", &[]);
    let text = std::fs::read_to_string(&keys_file).unwrap();
    for key in [&alice, &bob, &bob2] {
        assert!(!text.contains(&key["sk-semlb-".len()..]), "a key in the file:\n{text}");
    }
    let listed = assert_ok(&semlb(&["keys", "--file", &keys_file, "list"]));
    assert!(
        listed.contains(&bob_id) && listed.contains("alice") && !listed.contains(&alice),
        "{listed}"
    );

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
        "[[model]]\nname = \"alpha\"\nbackends = [\"a\"]\n[[model]]\nname = \"beta\"\nbackends = [\"b\"]\n[auth]\nkeys_file = \"{keys_file}\"\ndebug_headers = true\n"
    ));
    let config_path = dir.0.join("semlb.toml");
    std::fs::write(&config_path, &config).unwrap();
    let config_arg = config_path.display().to_string();
    let gw = Gateway::builder()
        .tag("keys")
        .args(&["--config", &config_arg])
        .stderr(Stderr::CaptureEcho)
        .start();
    let addr = gw.addr().to_owned();

    // Shut out: no key, a wrong key, two different keys.
    let error = answered_by_gateway(&chat(&addr, "alpha", &[]), 401, "no key");
    assert_eq!(error["error"]["code"], "missing_api_key");
    let r = chat(&addr, "alpha", &[]);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    for headers in [
        vec![("Authorization", "Bearer sk-semlb-0000")],
        vec![("api-key", alice.as_str()), ("x-api-key", bob.as_str())],
    ] {
        let error = answered_by_gateway(&chat(&addr, "alpha", &headers), 401, "a wrong key");
        assert_eq!(error["error"]["code"], "invalid_api_key");
    }
    let models = http(&addr, "GET", "/v1/models", None, &[]).unwrap();
    assert_eq!(models.status, 401, "/v1/models needs a key too");
    assert_eq!(http(&addr, "GET", "/health", None, &[]).unwrap().status, 200);

    // Let in, in every header, to the models it may use.
    let bearer = format!("Bearer {alice}");
    for header in [
        ("Authorization", bearer.as_str()),
        ("api-key", &alice),
        ("x-api-key", &alice),
    ] {
        let r = chat(&addr, "alpha", &[header]);
        assert_eq!(r.status, 200, "{header:?}: {}", String::from_utf8_lossy(&r.body));
    }
    let error = answered_by_gateway(&chat(&addr, "beta", &[("api-key", &alice)]), 403, "alice on beta");
    assert_eq!(error["error"]["code"], "model_not_allowed");
    let embed = http(
        &addr,
        "POST",
        "/v1/embeddings",
        Some(&json!({"model": "beta", "input": "x"})),
        &[("api-key", &alice)],
    )
    .unwrap();
    assert_eq!(embed.status, 403, "other endpoints too");
    assert_eq!(chat(&addr, "beta", &[("api-key", &bob)]).status, 200);
    let listed = http(&addr, "GET", "/v1/models", None, &[("api-key", &alice)])
        .unwrap()
        .json();
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["alpha"], "alice sees her models only");

    // The tenant names the cache: alice's answers (first request above,
    // written back now) are hers; bob's two keys share his.
    gw.written_back(responder_records);
    assert_eq!(
        chat(&addr, "alpha", &[("api-key", &alice)]).header("x-semlb-cache"),
        Some("hit")
    );
    let first = chat(&addr, "alpha", &[("api-key", &bob)]);
    assert_eq!(first.header("x-semlb-cache"), Some("miss"), "not alice's answer");
    gw.written_back(responder_records);
    let other_key = chat(&addr, "alpha", &[("x-api-key", &bob2)]);
    assert_eq!(
        other_key.header("x-semlb-cache"),
        Some("hit"),
        "bob's other key, bob's tenant"
    );

    // Revoked and reloaded: shut out, while the others stay in.
    assert_ok(&semlb(&["keys", "--file", &keys_file, "revoke", &bob_id]));
    let from = gw.proc.stderr_text().len();
    gw.proc.signal(nix::sys::signal::Signal::SIGHUP);
    for dispatcher in 0..2 {
        gw.proc.wait_stderr(
            from,
            &format!("dispatcher {dispatcher}: 2 API keys"),
            Duration::from_secs(20),
        );
    }
    let error = answered_by_gateway(&chat(&addr, "beta", &[("api-key", &bob)]), 401, "revoked");
    assert_eq!(error["error"]["code"], "invalid_api_key");
    assert_eq!(chat(&addr, "beta", &[("api-key", &bob2)]).status, 200);
    assert_eq!(chat(&addr, "alpha", &[("api-key", &alice)]).status, 200);
}

/// `semlb keys add` run twenty times at once on one file (operators and
/// scripts do): every key is in the file afterwards (each change holds the
/// file's lock for its read-modify-write; before, concurrent writes lost
/// keys).
#[test]
fn concurrent_key_changes_lose_nothing() {
    let dir = TempDir::new("keys-race");
    let file = dir.0.join("keys.toml").display().to_string();
    let children: Vec<std::process::Child> = (0..20)
        .map(|i| {
            std::process::Command::new(support::process::semlb_exe().unwrap())
                .args(["keys", "--file", &file, "add", "--tenant", &format!("t{i}")])
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("semlb keys add")
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let listed = assert_ok(&semlb(&["keys", "--file", &file, "list"]));
    for i in 0..20 {
        assert!(
            listed.contains(&format!("t{i} ")) || listed.contains(&format!("t{i}\n")),
            "t{i} lost:\n{listed}"
        );
    }
}
