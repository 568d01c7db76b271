//! Peer gateways across regions (SkyLB's forwarding, `semlb::peers`), end
//! to end: two gateways on one machine, each a region with its own
//! simulated engine in real time, behind `selective_push` with
//! `max_outstanding = 1` (an engine running one request is full).
//!
//! * Forwarding only when full: with region A's engine idle a request is
//!   served in A; with it busy, the next one is forwarded to B (answered
//!   by B's engine, `x-semlb-peer: b`), streamed or not, and the stream
//!   arrives intact.
//! * Never twice: a request that carries the hop header (forwarded once
//!   already) waits in the full region's queue although its peer has
//!   room; the same request without it is forwarded.
//! * Affinity: a conversation whose first turn was forwarded to B (A was
//!   full) sends its next turn, the instant the first answer ends, to B
//!   although A is idle now, while B has room; with B full it is served
//!   at home. The control, with `affinity_secs = 0`, serves the next turn
//!   at home.
//! * A reload: a region started without peers forwards nothing; after its
//!   configuration gains B and a SIGHUP, it forwards to B; after B is
//!   removed again, nothing.
//! * A dead peer: B stops while A still holds its last summary; requests
//!   to a full A are answered (after a failed forward, from A's queue),
//!   none fails.
//!
//! What A knows of B is waited for through B's own counter of the load
//! summaries it served: A polls one at a time, so once B has served two,
//! A has read the first.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use semlb_test_support as support;
use serde_json::{Value, json};
use support::TempDir;
use support::gateway::{Gateway, chat, samples, sim_at, stream_text, user, wait_for};
use support::http::http;
use support::process::{Proc, Stderr};

/// The token both regions use, one file each.
const TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// A private token file in `dir`.
fn token_file(dir: &TempDir, name: &str) -> String {
    let path = dir.0.join(name);
    std::fs::write(&path, format!("{TOKEN}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path.display().to_string()
}

const HOLDING: &str =
    "[policy]\nkind = \"selective_push\"\n[policy.selective_push]\nmode = \"max_outstanding\"\nmax_outstanding = 1\n";

/// Region `region`'s gateway in front of `engine`, serving its load with
/// the token, with `peers` (`(url, region)`) polled every `poll_ms`.
fn region(
    dir: &TempDir,
    region: &str,
    engine: &Proc,
    peers: &[(&str, &str)],
    poll_ms: u64,
    max_age_ms: u64,
) -> Gateway {
    region_with(dir, region, engine, peers, poll_ms, max_age_ms, "")
}

/// [`region`] with more `[peering]` keys (`peering`: TOML lines).
fn region_with(
    dir: &TempDir,
    region: &str,
    engine: &Proc,
    peers: &[(&str, &str)],
    poll_ms: u64,
    max_age_ms: u64,
    peering: &str,
) -> Gateway {
    Gateway::builder()
        .tag(region)
        .dispatchers(1)
        .backends(&[engine])
        .config(&region_toml(dir, region, peers, poll_ms, max_age_ms, peering))
        .start()
}

/// Region `region`'s configuration: [`region_with`]'s.
fn region_toml(
    dir: &TempDir,
    region: &str,
    peers: &[(&str, &str)],
    poll_ms: u64,
    max_age_ms: u64,
    peering: &str,
) -> String {
    let mut config = format!(
        "{HOLDING}[peering]\nregion = \"{region}\"\ntoken_file = \"{}\"\npoll_ms = {poll_ms}\nmax_age_ms = {max_age_ms}\nforward_after_ms = 0\n{peering}",
        token_file(dir, &format!("{region}.token"))
    );
    for (url, name) in peers {
        config.push_str(&format!(
            "[[peer]]\nurl = \"http://{url}\"\nregion = \"{name}\"\ntoken_file = \"{}\"\n",
            token_file(dir, &format!("{region}-to-{name}.token"))
        ));
    }
    config
}

/// Region A polling region B, each in front of its own engine.
struct Regions {
    a: Gateway,
    b: Gateway,
    engine_a: Proc,
    engine_b: Proc,
    _dir: TempDir,
}

/// [`Regions`] (`a_peering`: more `[peering]` lines for A), once A has
/// read B's load.
fn a_polling_b(tag: &str, a_peering: &str) -> Regions {
    let dir = TempDir::new(tag);
    let (engine_a, engine_b) = (sim_at("1"), sim_at("1"));
    let b = region(&dir, "b", &engine_b, &[], 50, 2000);
    let a = region_with(&dir, "a", &engine_a, &[(b.addr(), "b")], 50, 2000, a_peering);
    polled(&b);
    Regions {
        a,
        b,
        engine_a,
        engine_b,
        _dir: dir,
    }
}

/// A metric of `gw`, summed over its series.
fn counter(gw: &Gateway, name: &str) -> f64 {
    samples(&gw.metrics(), name).iter().map(|(_, v)| v).sum()
}

/// Waits until `peer` has served two more load summaries (so the gateway
/// polling it has read one taken from now on).
fn polled(peer: &Gateway) {
    let served = counter(peer, "semlb_peer_load_served_total");
    wait_for("a peer's load summary to be read", Duration::from_secs(20), || {
        let n = counter(peer, "semlb_peer_load_served_total");
        (n >= served + 2.0, n)
    });
}

/// Keeps `gw`'s one engine busy with a long request (from another
/// thread) until the returned handle is joined; returns once the gateway
/// counts it in flight.
fn occupy(gw: &Gateway, tokens: u64) -> std::thread::JoinHandle<u16> {
    let addr = gw.addr().to_owned();
    let handle = std::thread::spawn(move || {
        chat(
            &addr,
            &[user("Write a long story about a lighthouse keeper.")],
            json!({"max_tokens": tokens, "ignore_eos": true}),
            &[],
        )
        .status
    });
    wait_for("the long request in flight", Duration::from_secs(20), || {
        let n = counter(gw, "semlb_server_inflight_requests");
        (n >= 1.0, n)
    });
    handle
}

fn ask(addr: &str, text: &str, stream: bool, headers: &[(&str, &str)]) -> support::http::Response {
    chat(
        addr,
        &[user(text)],
        json!({"max_tokens": 8, "stream": stream, "temperature": 0}),
        headers,
    )
}

#[test]
fn a_full_region_forwards_to_its_peer_once_and_streams_intact() {
    let r = a_polling_b("peers", "");
    let (a, b, engine_a, engine_b) = (&r.a, &r.b, &r.engine_a, &r.engine_b);
    // The summary is for peers only.
    let load = |token: &str| {
        http(
            b.addr(),
            "GET",
            "/semlb/peer/load",
            None,
            &[("x-semlb-peer-token", token)],
        )
        .unwrap()
    };
    assert_eq!(load("not-the-token").status, 401);
    let summary = load(TOKEN).json();
    assert_eq!(
        (summary["region"].as_str(), summary["servers"].as_u64()),
        (Some("b"), Some(1)),
        "{summary}"
    );

    // A's engine idle: served at home.
    let r = ask(a.addr(), "Hello from region A.", false, &[]);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("x-semlb-peer"), None, "an idle region serves its own");
    assert_eq!(
        r.header("x-semlb-backend"),
        Some(format!("http://{}", engine_a.addr).as_str())
    );

    // A's engine busy: forwarded to B, JSON and SSE.
    let long = occupy(a, 400);
    let r = ask(a.addr(), "Region A is full: who answers?", false, &[]);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("x-semlb-peer"), Some("b"), "forwarded to the peer");
    assert_eq!(
        r.header("x-semlb-backend"),
        Some(format!("http://{}", engine_b.addr).as_str())
    );
    assert!(
        !r.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty()
    );
    // Again, once B has stored the answer (what is tested is that B's
    // word on its cache reaches the client, not how soon B stores it): B
    // answers from its response cache, and the client hears so.
    b.written_back(semlb::metrics::responder_records);
    let again = ask(a.addr(), "Region A is full: who answers?", false, &[]);
    assert_eq!(again.header("x-semlb-peer"), Some("b"), "{:?}", again.headers);
    assert_eq!(
        (again.header("x-semlb-cache"), again.header("x-semlb-backend")),
        (Some("hit"), Some("cache"))
    );
    assert_eq!(again.json()["choices"], r.json()["choices"]);
    // (Another prompt: the first is in B's response cache now.)
    let r = ask(a.addr(), "Region A is still full: who streams?", true, &[]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-semlb-peer"), Some("b"));
    assert_eq!(
        r.header("x-semlb-backend"),
        Some(format!("http://{}", engine_b.addr).as_str())
    );
    assert!(r.header("content-type").unwrap_or("").starts_with("text/event-stream"));
    let (streamed, done) = stream_text(&r);
    assert!(done, "the relayed stream ends with [DONE]");
    let chunks = String::from_utf8_lossy(&r.body).matches("data: ").count();
    assert!(
        chunks >= 8 && !streamed.is_empty(),
        "one chunk per token, relayed: {chunks}"
    );
    assert!(counter(a, "semlb_peer_forwarded_total") >= 2.0);
    assert!(counter(b, "semlb_peer_received_total") >= 2.0);
    assert_eq!(long.join().unwrap(), 200);
}

#[test]
fn a_forwarded_request_is_never_forwarded_again() {
    let dir = TempDir::new("peers-hop");
    let (engine_a, engine_b) = (sim_at("1"), sim_at("1"));
    let a = region(&dir, "a", &engine_a, &[], 50, 2000);
    let b = region(&dir, "b", &engine_b, &[(a.addr(), "a")], 50, 2000);
    polled(&a);
    let long = occupy(&b, 300);
    // Its one engine runs one request: full for its policy, so B tells its
    // peers it has no free server.
    let load = http(
        b.addr(),
        "GET",
        "/semlb/peer/load",
        None,
        &[("x-semlb-peer-token", TOKEN)],
    )
    .unwrap();
    assert_eq!(load.json()["free"], 0, "{}", load.json());
    // As A would forward it: B is full and A has room, yet B keeps it.
    let r = ask(b.addr(), "Forwarded once already.", false, &[("x-semlb-hop", "a")]);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("x-semlb-peer"), None, "not forwarded a second time");
    assert_eq!(
        r.header("x-semlb-backend"),
        Some(format!("http://{}", engine_b.addr).as_str())
    );
    assert!(r.header("x-semlb-queue-ms").is_some(), "it waited in B's queue");
    assert_eq!(counter(&b, "semlb_peer_forwarded_total"), 0.0);
    // The control: such a request from a client is forwarded (another
    // prompt: the first is in B's response cache now).
    let long2 = occupy(&b, 300);
    let r = ask(b.addr(), "Straight from a client.", false, &[]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-semlb-peer"), Some("a"));
    for h in [long, long2] {
        assert_eq!(h.join().unwrap(), 200);
    }
}

#[test]
fn a_dead_peer_costs_no_failed_request() {
    let dir = TempDir::new("peers-dead");
    let (engine_a, engine_b) = (sim_at("1"), sim_at("1"));
    let b = region(&dir, "b", &engine_b, &[], 50, 2000);
    // A polls rarely and trusts a summary for long: after B dies, A still
    // believes it has room.
    let a = region(&dir, "a", &engine_a, &[(b.addr(), "b")], 5_000, 60_000);
    wait_for("A's first poll", Duration::from_secs(20), || {
        let n = counter(&b, "semlb_peer_load_served_total");
        (n >= 1.0, n)
    });
    drop(b);
    let long = occupy(&a, 100);
    let answers: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let addr = a.addr();
                s.spawn(move || {
                    let r = ask(addr, &format!("Client {i} while the peer is dead."), i % 2 == 0, &[]);
                    json!({"status": r.status, "peer": r.header("x-semlb-peer"), "body": String::from_utf8_lossy(&r.body)})
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for answer in &answers {
        assert_eq!(answer["status"], 200, "{answer}");
        assert_eq!(answer["peer"], Value::Null, "{answer}");
    }
    assert!(
        counter(&a, "semlb_peer_forward_failures_total") >= 1.0,
        "the dead peer was tried, and the request fell back to the local queue"
    );
    assert_eq!(long.join().unwrap(), 200);
}

/// The first turn of a conversation, long enough to span several blocks.
const OPENING: &str = "I keep a lighthouse on a rocky island far to the north. Every night I climb the \
     spiral stairs, trim the wick, polish the great lens and watch the ships pass through the \
     strait. Last winter a storm broke two of the windows and the supply boat did not come for \
     three weeks. Tell me how to prepare the station for the next winter.";

/// Turn 1 of a conversation through `a` while its engine is busy
/// (forwarded to its peer), then turn 2 the instant turn 1's answer ends,
/// streamed as agents do, with `a`'s engine idle by then: the peer region
/// that answered turn 2 (`None`: served at home) and turn 1's.
fn two_turns(a: &Gateway, topic: &str) -> (Option<String>, Option<String>) {
    let long = occupy(a, 40);
    let first = vec![user(&format!("{OPENING} ({topic})"))];
    let r1 = chat(a.addr(), &first, json!({"max_tokens": 16, "stream": true}), &[]);
    assert_eq!(r1.status, 200, "{}", String::from_utf8_lossy(&r1.body));
    let (answer, done) = stream_text(&r1);
    assert!(done);
    assert_eq!(long.join().unwrap(), 200);
    wait_for("the region's engine idle again", Duration::from_secs(20), || {
        let n = counter(a, "semlb_server_inflight_requests");
        (n == 0.0, n)
    });
    let mut second = first.clone();
    second.push(json!({"role": "assistant", "content": answer}));
    second.push(user("And what should I stock in the pantry?"));
    let r2 = chat(a.addr(), &second, json!({"max_tokens": 8, "stream": true}), &[]);
    assert_eq!(r2.status, 200, "{}", String::from_utf8_lossy(&r2.body));
    assert!(stream_text(&r2).1);
    (
        r2.header("x-semlb-peer").map(str::to_owned),
        r1.header("x-semlb-peer").map(str::to_owned),
    )
}

#[test]
fn a_conversation_forwarded_to_a_peer_keeps_going_there_while_warm() {
    let r = a_polling_b("peers-affinity", "");
    let (a, b) = (&r.a, &r.b);
    let (second, first) = two_turns(a, "one");
    assert_eq!(first.as_deref(), Some("b"), "turn 1 found A full");
    assert_eq!(
        second.as_deref(),
        Some("b"),
        "turn 2 follows its prefix to B, A idle or not"
    );

    // B full (and A has read so): the conversation's next turn is served
    // at home.
    let long_b = occupy(b, 400);
    polled(b);
    let mut third = vec![user(&format!("{OPENING} (one)"))];
    third.push(json!({"role": "assistant", "content": "Board the windows."}));
    third.push(user("And the pantry?"));
    let r = chat(a.addr(), &third, json!({"max_tokens": 8, "stream": true}), &[]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-semlb-peer"), None, "its peer is full: served at home");
    assert_eq!(long_b.join().unwrap(), 200);
}

#[test]
fn without_affinity_a_forwarded_conversation_comes_home() {
    let r = a_polling_b("peers-no-affinity", "affinity_secs = 0\n");
    let (second, first) = two_turns(&r.a, "two");
    assert_eq!(first.as_deref(), Some("b"), "turn 1 found A full");
    assert_eq!(second, None, "A idle serves turn 2 itself");
}

#[test]
fn a_reload_adds_and_removes_a_peer() {
    let dir = TempDir::new("peers-reload");
    let (engine_a, engine_b) = (sim_at("1"), sim_at("1"));
    let b = region(&dir, "b", &engine_b, &[], 50, 2000);
    let path = dir.0.join("a.toml");
    let write = |peers: &[(&str, &str)]| std::fs::write(&path, region_toml(&dir, "a", peers, 50, 2000, "")).unwrap();
    write(&[]);
    let a = Gateway::builder()
        .tag("a")
        .dispatchers(1)
        .backends(&[&engine_a])
        .args(&["--config", &path.display().to_string()])
        .stderr(Stderr::CaptureEcho)
        .start();
    let reload = |peers: &[(&str, &str)]| {
        let from = a.proc.stderr_text().len();
        write(peers);
        a.proc.signal(nix::sys::signal::Signal::SIGHUP);
        a.proc.wait_stderr(
            from,
            &format!("dispatcher 0: {} peer gateways", peers.len()),
            Duration::from_secs(20),
        );
    };
    let full_region_asks = |text: &str| {
        let long = occupy(&a, 60);
        let r = ask(a.addr(), text, false, &[]);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(long.join().unwrap(), 200);
        r.header("x-semlb-peer").map(str::to_owned)
    };
    assert_eq!(full_region_asks("No peer yet."), None, "no peer: it waits at home");

    reload(&[(b.addr(), "b")]);
    polled(&b);
    assert_eq!(full_region_asks("A peer now.").as_deref(), Some("b"));

    reload(&[]);
    assert_eq!(full_region_asks("The peer is gone again."), None);
}

/// Issue 39, finding 5: peers over mutual TLS, and the tenant forwarded
/// with the gateway's credential instead of the client's key.
///
/// Region B serves HTTPS and asks every client for a certificate of the
/// peers' CA; it has no key for tenant `acme`, only its tenant rules. A
/// reaches B as an `https://` peer with that CA and a client certificate;
/// acme's key is known to A alone. With A's engine busy, acme's request
/// through A is forwarded to B and served there as acme (B counts it for
/// acme), though acme's key would get a 401 at B: the key never left A.
/// B refuses plain HTTP, a client without a certificate, a certificate of
/// another CA, and a request naming a tenant without the peering token;
/// a gateway that checks B against another CA never reads B's load.
#[test]
fn peers_talk_over_mutual_tls_and_forward_the_tenant_not_its_key() {
    use support::tls::{self, TlsClient};
    let dir = TempDir::new("peers-tls");
    let ca = tls::ca(&dir.0, "peers-ca");
    let b_cert = tls::signed(&dir.0, &ca, "gw-b");
    let a_cert = tls::signed(&dir.0, &ca, "gw-a");
    let other_ca = tls::ca(&dir.0, "other-ca");
    let rogue = tls::signed(&dir.0, &other_ca, "rogue");
    let keys_a = dir.0.join("keys-a.toml").display().to_string();
    let keys_b = dir.0.join("keys-b.toml").display().to_string();
    let acme_key = support::gateway::add_key(&keys_a, "acme", &[]).0;
    support::gateway::add_key(&keys_b, "someone-else", &[]);
    support::gateway::limit_tenant(&keys_b, "acme", &["--requests-per-minute", "1000"]);
    let (engine_a, engine_b) = (sim_at("1"), sim_at("1"));
    let as_a = TlsClient {
        ca: ca.cert.clone(),
        identity: Some(a_cert.clone()),
    };
    let b = Gateway::builder()
        .tag("b-tls")
        .dispatchers(1)
        .backends(&[&engine_b])
        .config(&format!(
            "{}[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nclient_ca_file = \"{}\"\n[auth]\nkeys_file = \"{keys_b}\"\n",
            region_toml(&dir, "b", &[], 50, 2000, ""),
            b_cert.cert.display(),
            b_cert.key.display(),
            ca.cert.display()
        ))
        .tls(as_a.clone())
        .start();

    // What B refuses at its door.
    assert!(
        http(b.addr(), "GET", "/health", None, &[]).is_ok_and(|r| r.status != 200)
            || http(b.addr(), "GET", "/health", None, &[]).is_err(),
        "plain HTTP is not served"
    );
    let without_cert = TlsClient {
        ca: ca.cert.clone(),
        identity: None,
    };
    assert!(
        without_cert.request(b.addr(), "GET", "/health", None, &[]).is_err(),
        "no client certificate"
    );
    let from_rogue = TlsClient {
        ca: ca.cert.clone(),
        identity: Some(rogue),
    };
    assert!(
        from_rogue.request(b.addr(), "GET", "/health", None, &[]).is_err(),
        "another CA's certificate"
    );
    let forged = b
        .request(
            "POST",
            "/v1/chat/completions",
            Some(&json!({"model": "semlb-sim", "messages": [user("hi")], "max_tokens": 2})),
            &[
                ("x-semlb-hop", "a"),
                ("x-semlb-peer-tenant", "acme"),
                ("x-semlb-peer-token", "guess"),
            ],
        )
        .unwrap();
    assert_eq!(forged.status, 401, "{}", String::from_utf8_lossy(&forged.body));
    assert_eq!(forged.json()["error"]["code"], "invalid_peer_token");
    let direct = b
        .request(
            "POST",
            "/v1/chat/completions",
            Some(&json!({"model": "semlb-sim", "messages": [user("hi")], "max_tokens": 2})),
            &[("authorization", &format!("Bearer {acme_key}"))],
        )
        .unwrap();
    assert_eq!(direct.status, 401, "B does not know acme's key");

    // A gateway that checks B's certificate against another CA never
    // reads B's load.
    let peer_table = |ca_file: &std::path::Path| {
        format!(
            "[[peer]]\nurl = \"https://{}\"\nregion = \"b\"\ntoken_file = \"{}\"\nca_file = \"{}\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
            b.addr(),
            token_file(&dir, "to-b.token"),
            ca_file.display(),
            a_cert.cert.display(),
            a_cert.key.display()
        )
    };
    let wrong = Gateway::builder()
        .tag("c-tls")
        .dispatchers(1)
        .backends(&[&engine_a])
        .stderr(Stderr::CaptureEcho)
        .config(&format!(
            "{HOLDING}[peering]\nregion = \"c\"\npoll_ms = 50\nmax_age_ms = 2000\n{}",
            peer_table(&other_ca.cert)
        ))
        .start();
    let why = wait_for("the wrong CA's poll to fail", Duration::from_secs(20), || {
        let text = wrong.proc.stderr_text();
        let line = text
            .lines()
            .find(|l| l.contains("its load is unknown"))
            .map(str::to_owned);
        (line.is_some(), line)
    });
    eprintln!("with another CA: {why:?}");
    assert!(
        why.unwrap().to_lowercase().contains("certificate"),
        "the reason names the certificate"
    );
    assert_eq!(counter(&b, "semlb_peer_load_served_total"), 0.0, "B served no summary");
    drop(wrong);

    // A: B as an https peer with the right CA and a client certificate.
    let a = Gateway::builder()
        .tag("a-tls")
        .dispatchers(1)
        .backends(&[&engine_a])
        .config(&format!(
            "{HOLDING}[peering]\nregion = \"a\"\npoll_ms = 50\nmax_age_ms = 2000\nforward_after_ms = 0\n{}[auth]\nkeys_file = \"{keys_a}\"\ndebug_headers = true\n",
            peer_table(&ca.cert)
        ))
        .start();
    polled(&b);
    let long = {
        let (addr, key) = (a.addr().to_owned(), acme_key.clone());
        let handle = std::thread::spawn(move || {
            chat(
                &addr,
                &[user("Write a long story about a lighthouse keeper.")],
                json!({"max_tokens": 400, "ignore_eos": true}),
                &[("api-key", &key)],
            )
            .status
        });
        wait_for("the long request in flight", Duration::from_secs(20), || {
            let n = counter(&a, "semlb_server_inflight_requests");
            (n >= 1.0, n)
        });
        handle
    };
    let r = ask(
        a.addr(),
        "Region A is full: who answers acme?",
        true,
        &[("x-api-key", &acme_key)],
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("x-semlb-peer"), Some("b"), "forwarded to B over TLS");
    let (text, done) = stream_text(&r);
    assert!(done && !text.is_empty());
    let acme_at_b = support::gateway::sample(&b.metrics(), "semlb_tenant_requests_total{tenant=\"acme\"}");
    assert_eq!(acme_at_b, Some(1.0), "B served it as acme");
    assert_eq!(
        support::gateway::sample(
            &b.metrics(),
            "semlb_requests_total{endpoint=\"chat_completions\",code=\"4xx\"}"
        ),
        Some(2.0),
        "only the forged and the direct requests were refused at B"
    );
    assert_eq!(long.join().unwrap(), 200);
}
