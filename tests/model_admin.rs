//! Model pools changed through the admin API (`/admin/models`), end to
//! end: a real `semlb serve` with two dispatchers in front of simulated
//! engines that each serve one model (and answer any other model 404).
//!
//! * A pool added, replaced or removed through the API routes the very
//!   next request, on every dispatcher (the answer comes once every
//!   dispatcher runs the change); a URL a pool names becomes a backend.
//! * Bad bodies and impossible changes get OpenAI-style 4xx answers and
//!   change nothing.
//! * The changes outlive a SIGKILLed dispatcher, a reload of an edited
//!   configuration file, and a restart of the service; they are kept in
//!   `admin.models_file` (mode 0600), never in the configuration file.

use std::time::Duration;

use nix::sys::signal::Signal;
use semlb_test_support as support;
use serde_json::{Value, json};
use shm_layout::{ProcessState, Role};
use support::TempDir;
use support::gateway::{Gateway, answered_by_gateway, chat, sim_with, stream_text, user, wait_for};
use support::http::{Response, http};
use support::process::{Proc, Stderr};

const TOKEN: &str = "model-admin-token-0123456789";

/// A streamed chat to `model`, as most clients send it: the engine that
/// answered (`x-semlb-backend`), asserting a 200 whose stream ends.
fn streamed_to(addr: &str, model: &str, engines: &[(&str, &Proc)]) -> String {
    let r = chat(
        addr,
        &[user(&format!("hello {model}"))],
        json!({"model": model, "stream": true, "max_tokens": 4}),
        &[],
    );
    assert_eq!(r.status, 200, "{model}: {}", String::from_utf8_lossy(&r.body));
    assert!(stream_text(&r).1, "{model}: the stream ends with [DONE]");
    let backend = r.header("x-semlb-backend").expect("x-semlb-backend");
    let engine = engines
        .iter()
        .find(|(_, p)| backend.ends_with(&p.addr))
        .map(|(n, _)| (*n).to_owned());
    engine.unwrap_or_else(|| panic!("{model}: answered by {backend}, no engine of the test"))
}

/// The gateway's 404 for `model`.
fn not_found(addr: &str, model: &str) {
    let r = chat(addr, &[user("hi")], json!({"model": model, "max_tokens": 4}), &[]);
    let error = answered_by_gateway(&r, 404, model);
    assert_eq!(error["error"]["code"], "model_not_found", "{model}: {error}");
}

/// An admin answer's status and error code, asserting an OpenAI-style body.
fn refused(r: &Response) -> (u16, String) {
    let body = r.json();
    assert!(
        body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    (r.status, body["error"]["code"].as_str().unwrap_or_default().to_owned())
}

/// Asserts a change was answered `status` once both dispatchers ran it.
fn applied(r: &Response, status: u16) -> Value {
    let body = r.json();
    assert_eq!(r.status, status, "{body}");
    assert_eq!(body["applied"], true, "{body}");
    assert_eq!(body["dispatchers"], json!({"applied": 2, "running": 2}), "{body}");
    body
}

/// The `/v1/models` ids.
fn listed(addr: &str) -> Vec<String> {
    let list = http(addr, "GET", "/v1/models", None, &[]).expect("models").json();
    list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn pools_change_through_the_admin_api_and_outlive_crashes_reloads_and_restarts() {
    let dir = TempDir::new("model-admin");
    let a = sim_with("0.01", &["--model", "alpha"]);
    let b = sim_with("0.01", &["--model", "beta", "--lora", "beta-sql"]);
    let c = sim_with("0.01", &["--model", "org/gamma-7b"]);
    let engines = [("a", &a), ("b", &b), ("c", &c)];
    let models_file = dir.0.join("state").join("models.toml");
    std::fs::create_dir_all(models_file.parent().unwrap()).unwrap();
    let config_path = dir.0.join("semlb.toml");
    let write_config = |alpha_aliases: &str| {
        let text = format!(
            "[[backend]]\nurl = \"http://{}\"\nname = \"a\"\n\n[[backend]]\nurl = \"http://{}\"\nname = \"b\"\n\n\
             [admin]\nmodels_file = \"state/models.toml\"\n\n\
             [[model]]\nname = \"alpha\"\naliases = [{alpha_aliases}]\nbackends = [\"a\"]\n",
            a.addr, b.addr
        );
        std::fs::write(&config_path, text).unwrap();
    };
    write_config("");
    let config = config_path.display().to_string();
    let shm = support::process::unique("gw", "model-admin");
    let start = || {
        Gateway::builder()
            .tag("model-admin")
            .shm(&shm)
            .admin(TOKEN)
            .args(&["--config", &config])
            .stderr(Stderr::CaptureEcho)
            .start()
    };
    let gw = start();
    let addr = gw.addr().to_owned();
    not_found(&addr, "beta");

    // Added: the next request, on whichever dispatcher, routes by it.
    let added = gw.admin(
        "POST",
        "/admin/models",
        Some(r#"{"name": "beta", "aliases": ["b"], "backends": ["b"]}"#),
    );
    let body = applied(&added, 201);
    assert_eq!(
        (body["name"].as_str(), body["source"].as_str()),
        (Some("beta"), Some("admin"))
    );
    for _ in 0..6 {
        assert_eq!(streamed_to(&addr, "b", &engines), "b", "beta by its alias");
    }
    assert_eq!(listed(&addr), ["alpha", "beta", "b"]);

    // An adapter of it; a pool on an engine the file does not list, named
    // with a '/' (percent-encoded in the path), by URL.
    applied(
        &gw.admin(
            "PUT",
            "/admin/models/beta-sql",
            Some(r#"{"base": "beta", "backends": ["b"]}"#),
        ),
        201,
    );
    let gamma = format!(r#"{{"backends": ["http://{}"]}}"#, c.addr);
    applied(&gw.admin("PUT", "/admin/models/org%2Fgamma-7b", Some(&gamma)), 201);
    for _ in 0..4 {
        assert_eq!(streamed_to(&addr, "beta-sql", &engines), "b");
        assert_eq!(streamed_to(&addr, "org/gamma-7b", &engines), "c");
        assert_eq!(
            streamed_to(&addr, "alpha", &engines),
            "a",
            "the file's pool is untouched"
        );
    }
    assert!(
        gw.admin_server(&format!("http://{}", c.addr)).is_some(),
        "a URL a pool names is a backend"
    );
    let one = gw.admin("GET", "/admin/models/org/gamma-7b", None);
    assert_eq!(
        (one.status, one.json()["source"].as_str()),
        (200, Some("admin")),
        "{one:?}"
    );

    // Replaced whole: the alias goes, a new one comes.
    applied(
        &gw.admin(
            "PUT",
            "/admin/models/beta",
            Some(r#"{"aliases": ["bb"], "backends": ["b"]}"#),
        ),
        200,
    );
    not_found(&addr, "b");
    assert_eq!(streamed_to(&addr, "bb", &engines), "b");

    // Refused, with nothing changed.
    let refusals: [(&str, &str, &str, (u16, &str)); 11] = [
        (
            "POST",
            "/admin/models",
            r#"{"name": "beta", "backends": ["b"]}"#,
            (409, "model_exists"),
        ),
        (
            "POST",
            "/admin/models",
            r#"{"name": "x", "aliases": ["alpha"], "backends": ["a"]}"#,
            (409, "model_exists"),
        ),
        (
            "POST",
            "/admin/models",
            r#"{"name": "x", "backends": ["nope"]}"#,
            (400, "invalid_model"),
        ),
        (
            "POST",
            "/admin/models",
            r#"{"name": "x", "backends": ["a"], "colour": 1}"#,
            (400, "invalid_model"),
        ),
        (
            "POST",
            "/admin/models",
            r#"{"name": "x", "backends": ["a"], "tokenizer": "t.json"}"#,
            (400, "invalid_model"),
        ),
        (
            "POST",
            "/admin/models",
            r#"{"name": "x", "backends": ["a"], "tokenizer": "/nonexistent/t.json"}"#,
            (400, "invalid_model"),
        ),
        (
            "POST",
            "/admin/models",
            r#"{"name": "x", "base": "beta", "backends": ["a"]}"#,
            (400, "invalid_model"),
        ),
        ("POST", "/admin/models", "{not json", (400, "invalid_json")),
        (
            "PUT",
            "/admin/models/x",
            r#"{"name": "y", "backends": ["a"]}"#,
            (400, "invalid_model"),
        ),
        ("DELETE", "/admin/models/beta", "", (409, "model_in_use")),
        ("DELETE", "/admin/models/nope", "", (404, "model_not_found")),
    ];
    for (method, path, body, want) in refusals {
        let r = gw.admin(method, path, (!body.is_empty()).then_some(body));
        let (status, code) = refused(&r);
        assert_eq!((status, code.as_str()), want, "{method} {path} {body}");
    }
    not_found(&addr, "x");

    // A dispatcher killed: the one started in its place has the changes.
    let dispatcher = gw
        .segment
        .tables()
        .registry
        .processes()
        .find(|p| p.role == Some(Role::Dispatcher) && p.state == ProcessState::Running)
        .expect("a dispatcher");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(dispatcher.pid as i32), Signal::SIGKILL).unwrap();
    wait_for("the dispatcher restarted", Duration::from_secs(20), || {
        let registry = gw.segment.tables().registry;
        let again = registry.get(dispatcher.slot).filter(|p| p.pid != dispatcher.pid);
        let running = registry
            .processes()
            .filter(|p| p.role == Some(Role::Dispatcher) && p.state == ProcessState::Running)
            .count();
        (again.is_some() && running == 2, running)
    });
    for _ in 0..8 {
        assert_eq!(streamed_to(&addr, "org/gamma-7b", &engines), "c");
    }

    // A reload of an edited configuration file keeps them.
    let from = gw.proc.stderr_text().len();
    write_config("\"fast\"");
    gw.proc.signal(Signal::SIGHUP);
    for dispatcher in 0..2 {
        gw.proc.wait_stderr(
            from,
            &format!("dispatcher {dispatcher}: 4 model pools"),
            Duration::from_secs(20),
        );
    }
    for _ in 0..4 {
        assert_eq!(streamed_to(&addr, "fast", &engines), "a");
        assert_eq!(streamed_to(&addr, "bb", &engines), "b");
        assert_eq!(streamed_to(&addr, "org/gamma-7b", &engines), "c");
    }

    // A file's pool removed through the API stays removed.
    applied(&gw.admin("DELETE", "/admin/models/beta-sql", None), 200);
    applied(&gw.admin("DELETE", "/admin/models/alpha", None), 200);
    not_found(&addr, "beta-sql");
    not_found(&addr, "fast");
    let kept = std::fs::read_to_string(&models_file).unwrap();
    assert!(kept.contains("removed = [\"alpha\"]"), "{kept}");
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(&models_file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the kept changes are private");
    assert!(
        !std::fs::read_to_string(&config_path).unwrap().contains("gamma"),
        "the configuration file is never written"
    );

    // A restart of the service keeps them too.
    assert_eq!(gw.stop_keeping_segment(), Some(0), "a graceful stop");
    let gw = start();
    let addr = gw.addr().to_owned();
    assert_eq!(streamed_to(&addr, "bb", &engines), "b");
    assert_eq!(streamed_to(&addr, "org/gamma-7b", &engines), "c");
    not_found(&addr, "alpha");
    let list = gw.admin("GET", "/admin/models", None).json();
    let sources: Vec<(String, String)> = list["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap().to_owned(),
                m["source"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        sources,
        [
            ("beta".to_owned(), "admin".to_owned()),
            ("org/gamma-7b".into(), "admin".into())
        ]
    );

    // The pool that named an engine by URL removed: so is the backend.
    applied(&gw.admin("DELETE", "/admin/models/org/gamma-7b", None), 200);
    not_found(&addr, "org/gamma-7b");
    let url = format!("http://{}", c.addr);
    wait_for("the unnamed backend removed", Duration::from_secs(20), || {
        let gone = gw.admin_server(&url).is_none();
        (gone, gone)
    });
}

#[test]
fn without_a_models_file_or_pools_the_api_refuses_to_change_them() {
    let a = sim_with("0.01", &["--model", "alpha"]);
    let gw = Gateway::builder()
        .tag("model-admin-none")
        .admin(TOKEN)
        .config(&format!(
            "[[backend]]\nurl = \"http://{}\"\nname = \"a\"\n\n[[model]]\nname = \"alpha\"\nbackends = [\"a\"]\n",
            a.addr
        ))
        .start();
    let r = gw.admin("POST", "/admin/models", Some(r#"{"name": "beta", "backends": ["a"]}"#));
    assert_eq!(refused(&r), (409, "models_file_unset".to_owned()));
    let listed = gw.admin("GET", "/admin/models", None).json();
    assert_eq!(listed["models"][0]["name"], "alpha", "{listed}");
    drop(gw);

    // The implicit pool (no [[model]]): adding one would 404 every other name.
    let dir = TempDir::new("model-admin-implicit");
    let gw = Gateway::builder()
        .tag("model-admin-implicit")
        .admin(TOKEN)
        .backends(&[&a])
        .config(&format!(
            "[admin]\nmodels_file = \"{}\"\n",
            dir.0.join("models.toml").display()
        ))
        .start();
    let r = gw.admin("POST", "/admin/models", Some(r#"{"name": "beta", "backends": ["a"]}"#));
    assert_eq!(refused(&r), (409, "implicit_pool".to_owned()));
    let ok = chat(
        gw.addr(),
        &[user("hi")],
        json!({"model": "alpha", "max_tokens": 4}),
        &[],
    );
    assert_eq!(ok.status, 200);
    assert!(!dir.0.join("models.toml").exists(), "nothing written");
}
