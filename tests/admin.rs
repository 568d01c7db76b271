//! The admin API of `semlb serve`, against real processes: a supervisor
//! with its dispatchers and responder in front of simulated engines
//! (`semlb __sim`), driven over real HTTP.
//!
//! Shown here: every request needs the bearer token (401 and
//! `WWW-Authenticate: Bearer` without it or with another); the server list;
//! a backend added at run time gets requests; a drained one finishes its
//! request in flight and gets no new ones, and a deleted one leaves the
//! list once that request is done; flushing empties the prefix table and
//! the response cache (a repeated deterministic request is a `miss` again);
//! bad JSON, a bad URL, a duplicate, an unknown or malformed slot and a
//! wrong method get 4xx answers with error bodies; `[admin]` is validated
//! at start (no token, a token file its group or others can read); at most
//! 16 admin connections are served at once, further ones closed.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use semlb_test_support as support;

use support::TempDir;
use support::gateway::{Gateway, sim_at};
use support::http::Response;
use support::process::{Proc, exe};

const TOKEN: &str = "test-admin-token-0123456789";

fn unique(tag: &str) -> String {
    support::process::unique("admin", tag)
}

/// A token file with `mode` in `dir`.
fn token_file(dir: &TempDir, token: &str, mode: u32) -> String {
    let path = dir.0.join("admin.token");
    std::fs::write(&path, format!("{token}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path.display().to_string()
}

/// A gateway with the admin API (token [`TOKEN`]) on a free loopback
/// port, one dispatcher.
fn gateway(backends: &[&Proc], extra: &[&str]) -> Gateway {
    Gateway::builder()
        .tag("admin")
        .dispatchers(1)
        .admin(TOKEN)
        .backends(backends)
        .args(extra)
        .start()
}

/// One HTTP/1.1 request with `Connection: close`, the body as text.
fn http(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> Result<Response, String> {
    support::http::http_bytes(addr, method, path, body.map(str::as_bytes), headers)
}

/// A chat completion; `extra` is merged into the body.
fn chat(gateway: &str, text: &str, extra: Value) -> Response {
    let mut body = json!({
        "model": "semlb-sim",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
    });
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    http(gateway, "POST", "/v1/chat/completions", Some(&body.to_string()), &[]).expect("chat request")
}

fn until(within: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

#[test]
fn every_request_needs_the_bearer_token() {
    let engine = sim_at("0.01");
    let gw = gateway(&[&engine], &[]);
    for headers in [
        vec![],
        vec![("Authorization", "Bearer wrong-token-0123456789")],
        vec![("Authorization", "Basic dGVzdDp0ZXN0")],
        vec![("Authorization", TOKEN)],
    ] {
        for (method, path) in [
            ("GET", "/admin/servers"),
            ("POST", "/admin/flush/prefixes"),
            ("GET", "/nope"),
        ] {
            let r = http(gw.admin_addr(), method, path, None, &headers).unwrap();
            assert_eq!(r.status, 401, "{method} {path} with {headers:?}: {r:?}");
            assert!(
                r.header("www-authenticate").is_some_and(|v| v.starts_with("Bearer")),
                "{r:?}"
            );
            assert!(r.error_message().contains("Bearer"), "{r:?}");
            assert_eq!(r.json()["error"]["code"], "invalid_api_key");
        }
    }
    // With the token: the list of servers.
    let servers = gw.admin_servers();
    assert_eq!(servers.len(), 1, "{servers:?}");
    let s = &servers[0];
    assert_eq!(s["address"], format!("http://{}", engine.addr));
    assert_eq!(s["state"], "up");
    assert_eq!(s["managed"], "config");
    assert_eq!(s["slot"], 0);
    assert!(s["generation"].as_u64().is_some() && s["inflight_requests"] == 0, "{s}");
    assert!(
        s["load"].get("kv_usage").is_some() && s["load"].get("age_ms").is_some(),
        "{s}"
    );
    // The scraper fills in the load within a couple of scrape intervals.
    until(Duration::from_secs(10), "the load to be scraped", || {
        gw.admin_servers()[0]["load"]["age_ms"].is_u64()
    });
}

#[test]
fn bad_input_gets_4xx_with_error_bodies() {
    let engine = sim_at("0.01");
    let gw = gateway(&[&engine], &[]);
    let cases: &[(&str, &str, Option<&str>, u16, &str)] = &[
        ("POST", "/admin/servers", Some("{not json"), 400, "must be JSON"),
        ("POST", "/admin/servers", None, 400, "must be JSON"),
        (
            "POST",
            "/admin/servers",
            Some(r#"{"name": "x"}"#),
            400,
            "missing field `url`",
        ),
        (
            "POST",
            "/admin/servers",
            Some(r#"{"url": "http://127.0.0.1:1", "priority": 2}"#),
            400,
            "unknown field `priority`",
        ),
        (
            "POST",
            "/admin/servers",
            Some(r#"{"url": "http://127.0.0.1:1", "weight": 1001}"#),
            400,
            "must be 1 to 1000",
        ),
        (
            "POST",
            "/admin/servers",
            Some(r#"{"url": "https://a:1"}"#),
            400,
            "scheme must be http",
        ),
        (
            "POST",
            "/admin/servers",
            Some(r#"{"url": "http://a"}"#),
            400,
            "port is missing",
        ),
        (
            "POST",
            "/admin/servers",
            Some(r#"{"url": "http://a:1/v1"}"#),
            400,
            "must not have a path",
        ),
        (
            "POST",
            "/admin/servers",
            Some(r#"{"url": "http://a:1", "name": "bad name"}"#),
            400,
            "letters, digits",
        ),
        (
            "POST",
            "/admin/servers/99/drain",
            None,
            404,
            "no server is registered in slot 99",
        ),
        ("POST", "/admin/servers/99/undrain", None, 404, "slot 99"),
        ("DELETE", "/admin/servers/99", None, 404, "slot 99"),
        ("DELETE", "/admin/servers/first", None, 400, "not a server slot"),
        ("DELETE", "/admin/servers/-1", None, 400, "not a server slot"),
        ("GET", "/admin/flush/prefixes", None, 405, "use POST"),
        ("PUT", "/admin/servers", None, 405, "GET or POST"),
        ("GET", "/admin/nothing", None, 404, "no admin route"),
    ];
    for (method, path, body, status, message) in cases {
        let r = gw.admin(method, path, *body);
        assert_eq!(r.status, *status, "{method} {path} {body:?}: {r:?}");
        let m = r.error_message();
        assert!(m.contains(message), "{method} {path} {body:?}: {m:?} lacks {message:?}");
    }
    // Already registered: 409, by address (as written, or normalized).
    let existing = format!(r#"{{"url": "HTTP://{}/"}}"#, engine.addr);
    let r = gw.admin("POST", "/admin/servers", Some(&existing));
    assert_eq!(r.status, 409, "{r:?}");
    assert!(r.error_message().contains("already registered, in slot 0"), "{r:?}");
    // A name another backend has: 409.
    let r = gw.admin(
        "POST",
        "/admin/servers",
        Some(&format!(
            r#"{{"url": "http://127.0.0.1:1", "name": "{}"}}"#,
            engine.addr
        )),
    );
    assert_eq!(r.status, 409, "{r:?}");
    assert!(r.error_message().contains("is taken by"), "{r:?}");
    assert_eq!(gw.admin_servers().len(), 1, "nothing was added");
}

#[test]
fn an_added_server_gets_requests_then_drains_and_leaves() {
    let fast = sim_at("0.01");
    // A real-speed engine: 400 tokens take about 4 s.
    let slow = sim_at("1");
    let gw = gateway(&[&fast], &["--policy", "round_robin"]);
    let slow_address = format!("http://{}", slow.addr);
    let fast_address = format!("http://{}", fast.addr);

    let added = gw.admin(
        "POST",
        "/admin/servers",
        Some(&json!({"url": slow_address, "name": "slow-engine"}).to_string()),
    );
    assert_eq!(added.status, 201, "{added:?}");
    let slot = added.json()["slot"].as_u64().expect("a slot");
    assert_eq!(added.json()["state"], "up");
    let listed = gw.admin_server(&slow_address).expect("listed");
    assert_eq!(listed["name"], "slow-engine");
    assert_eq!(listed["managed"], "admin");
    assert_eq!(listed["slot"], slot);
    let again = gw.admin(
        "POST",
        "/admin/servers",
        Some(&json!({"url": slow_address}).to_string()),
    );
    assert_eq!(again.status, 409, "{again:?}");

    // Round robin over both: the added engine gets requests at once.
    let mut last = String::new();
    let mut got_slow = false;
    for i in 0..4 {
        let r = chat(&gw.proc.addr, &format!("hello {i}"), json!({"max_tokens": 2}));
        assert_eq!(r.status, 200, "{r:?}");
        last = r.header("x-semlb-backend").unwrap_or_default().to_owned();
        got_slow |= last == slow_address;
    }
    assert!(got_slow, "the added server got no request");
    if last == slow_address {
        // The next one goes to the fast engine; then the slow one is next.
        let r = chat(&gw.proc.addr, "one more", json!({"max_tokens": 2}));
        assert_eq!(r.header("x-semlb-backend"), Some(fast_address.as_str()));
    }

    // A long request to the slow engine, in flight while it drains.
    let addr = gw.proc.addr.clone();
    let long = std::thread::spawn(move || {
        chat(
            &addr,
            "Write a long story.",
            json!({"max_tokens": 400, "temperature": 0.8}),
        )
    });
    until(Duration::from_secs(10), "the long request to be in flight", || {
        gw.admin_server(&slow_address)
            .is_some_and(|s| s["inflight_requests"].as_u64() > Some(0))
    });
    let drained = gw.admin("POST", &format!("/admin/servers/{slot}/drain"), None);
    assert_eq!(drained.status, 200, "{drained:?}");
    assert_eq!(drained.json()["state"], "draining");
    assert_eq!(gw.admin_server(&slow_address).unwrap()["state"], "draining");
    for i in 0..4 {
        let r = chat(&gw.proc.addr, &format!("while draining {i}"), json!({"max_tokens": 2}));
        assert_eq!(r.header("x-semlb-backend"), Some(fast_address.as_str()), "{r:?}");
    }
    // Deleting it while its request runs: accepted, it leaves once done.
    let deleted = gw.admin("DELETE", &format!("/admin/servers/{slot}"), None);
    assert_eq!(deleted.status, 202, "{deleted:?}");
    assert_eq!(deleted.json()["removed"], false);
    assert!(deleted.json()["inflight_requests"].as_u64() > Some(0), "{deleted:?}");
    assert_eq!(gw.admin_server(&slow_address).unwrap()["managed"], "removing");
    let answer = long.join().unwrap();
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.header("x-semlb-backend"), Some(slow_address.as_str()));
    until(Duration::from_secs(10), "the deleted server to leave", || {
        gw.admin_server(&slow_address).is_none()
    });
    assert_eq!(
        gw.admin("DELETE", &format!("/admin/servers/{slot}"), None).status,
        404,
        "gone"
    );

    // Added again, drained, taken back, and deleted when idle: removed at once.
    let added = gw.admin(
        "POST",
        "/admin/servers",
        Some(&json!({"url": slow_address}).to_string()),
    );
    assert_eq!(added.status, 201, "{added:?}");
    let slot = added.json()["slot"].as_u64().unwrap();
    let r = gw.admin("POST", &format!("/admin/servers/{slot}/drain"), None);
    assert_eq!(r.json()["state"], "draining");
    let r = gw.admin("POST", &format!("/admin/servers/{slot}/undrain"), None);
    assert_eq!((r.status, r.json()["state"].clone()), (200, json!("up")), "{r:?}");
    let r = gw.admin("DELETE", &format!("/admin/servers/{slot}"), None);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["removed"], true);
    assert!(gw.admin_server(&slow_address).is_none());
    assert!(gw.proc.stderr_text().contains("admin: backend"), "changes are logged");
}

#[test]
fn flushes_empty_the_prefix_table_and_the_response_cache() {
    let engine = sim_at("0.01");
    let gw = gateway(&[&engine], &[]);
    let segment = shm_layout::Segment::open(&gw.shm).expect("segment");
    let deterministic = json!({"temperature": 0});
    let question = "What is the capital of France? Answer briefly, in one sentence please.";
    for i in 0..5 {
        let r = chat(
            &gw.proc.addr,
            &format!("{question} (variant {i})"),
            deterministic.clone(),
        );
        assert_eq!(r.status, 200, "{r:?}");
    }
    until(Duration::from_secs(10), "a cached answer", || {
        chat(&gw.proc.addr, question, deterministic.clone()).header("x-semlb-cache") == Some("hit")
    });
    until(Duration::from_secs(10), "the prefixes to be written back", || {
        segment.tables().prefix.occupancy() > 0
    });
    // Let the last write-backs land.
    let settled = || {
        let t = segment.tables();
        (0..t.ring_count()).all(|i| t.ring(i).stats().used == 0)
    };
    until(Duration::from_secs(10), "the rings to drain", settled);
    let tables = gw.admin("GET", "/admin/tables", None).json();
    let before = tables["prefix"]["entries"].as_u64().unwrap();
    assert_eq!(before, segment.tables().prefix.occupancy());
    assert!(tables["responses"]["entries"].as_u64() >= Some(1), "{tables}");

    let r = gw.admin("POST", "/admin/flush/prefixes", None);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["removed"].as_u64(), Some(before));
    assert_eq!(segment.tables().prefix.occupancy(), 0);
    assert_eq!(gw.admin("GET", "/admin/tables", None).json()["prefix"]["entries"], 0);
    // The cached answer is still there: only the prefixes went.
    assert_eq!(
        chat(&gw.proc.addr, question, deterministic.clone()).header("x-semlb-cache"),
        Some("hit")
    );

    let r = gw.admin("POST", "/admin/flush/responses", None);
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.json()["removed"].as_u64() >= Some(1), "{r:?}");
    assert_eq!(segment.tables().responses.index_occupancy(), 0);
    // Erased, not only unlinked: the log holds no record at all.
    assert_eq!(
        segment.tables().responses.occupied_bytes(),
        0,
        "the cached answers' bytes were erased"
    );
    let again = chat(&gw.proc.addr, question, deterministic.clone());
    assert_eq!(again.status, 200);
    assert_eq!(again.header("x-semlb-cache"), Some("miss"), "flushed");
    // And it is cached again afterwards.
    until(Duration::from_secs(10), "the answer to be cached again", || {
        chat(&gw.proc.addr, question, deterministic.clone()).header("x-semlb-cache") == Some("hit")
    });
}

/// `semlb serve` with `args`, expected to refuse to start: its stderr.
fn refused(args: &[&str]) -> String {
    let out = Command::new(exe())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run semlb");
    assert!(!out.status.success(), "{args:?} started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn the_admin_table_is_validated_at_start() {
    let dir = TempDir::new("config");
    let shm = unique("refused");
    let base = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--shm-name",
        &shm,
        "--backend",
        "http://127.0.0.1:1",
        "--admin-listen",
        "127.0.0.1:0",
    ];
    let err = refused(&base);
    assert!(
        err.contains("admin.listen") && err.contains("needs a bearer token"),
        "{err}"
    );

    let readable = token_file(&dir, TOKEN, 0o644);
    let err = refused(&[&base[..], &["--admin-token-file", &readable]].concat());
    assert!(
        err.contains("admin.token_file") && err.contains("readable by every user"),
        "{err}"
    );
    let group = token_file(&dir, TOKEN, 0o640);
    let err = refused(&[&base[..], &["--admin-token-file", &group]].concat());
    assert!(
        err.contains("admin.token_file") && err.contains("readable by its group"),
        "{err}"
    );

    let config = dir.0.join("semlb.toml");
    std::fs::write(&config, "[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"short\"\n").unwrap();
    let config_arg = config.display().to_string();
    let err = refused(&[&base[..7], &["--config", &config_arg]].concat());
    assert!(err.contains("admin.token") && err.contains("16 to 4096"), "{err}");
    assert!(!err.contains("short"), "the token is not echoed: {err}");
    assert!(shm_layout::Segment::open(&shm).is_err(), "nothing was started");
}

#[test]
fn admin_connections_beyond_the_cap_are_closed() {
    use std::io::Read;
    let engines = [sim_at("0.01")];
    let gw = gateway(&[&engines[0]], &[]);
    let addr = gw.admin_addr().to_owned();
    // Sixteen idle connections: the cap.
    let held: Vec<std::net::TcpStream> = (0..16)
        .map(|_| std::net::TcpStream::connect(&addr).expect("connect"))
        .collect();
    // The supervisor has taken all sixteen once a request on a seventeenth
    // is closed unanswered; until then it may still be accepting them.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut extra = std::net::TcpStream::connect(&addr).expect("connect");
        extra.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = std::io::Write::write_all(&mut extra, b"GET /admin/servers HTTP/1.1\r\nhost: a\r\n\r\n");
        let mut answer = Vec::new();
        let _ = extra.read_to_end(&mut answer);
        if answer.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "a 17th connection was still served");
    }
    drop(held);
    // Once they are gone, the API answers again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = http(
            &addr,
            "GET",
            "/admin/servers",
            None,
            &[("authorization", &format!("Bearer {TOKEN}"))],
        );
        if r.as_ref().is_ok_and(|r| r.status == 200) {
            break;
        }
        assert!(Instant::now() < deadline, "{:?}", r.map(|r| r.status));
        std::thread::sleep(Duration::from_millis(20));
    }
}
