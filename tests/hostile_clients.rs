//! Clients that misbehave, against a real `semlb serve` (its dispatchers and
//! supervisor as processes) in front of `semlb __sim` engines, with
//! `limits.client_timeout_secs = 1`: every attack is loopback only and
//! bounded, and during each a well-behaved client keeps being answered and
//! no process restarts.
//!
//! * A client that stops reading a stream mid-way: its connection is closed
//!   within the client timeout, which ends the upstream request and
//!   releases the engine's in-flight count (a phantom count would make the
//!   engine look full to the holding policies for ever).
//! * Slowloris: connections sending their headers a byte at a time are
//!   closed after the client timeout.
//! * A body that stops coming: 408 within the client timeout.
//! * More connections than `limits.max_connections`: the extra one gets a
//!   503 `too_many_connections` and is closed; the others are served.
//! * A flood of requests whose `max_tokens` outlives the request deadline
//!   (2 s here), eight clients without pause for 6 s, streamed and not:
//!   each ends at its deadline (504, or its stream cut), no engine is
//!   ejected for it, and a polite client is served at least 99 % of the
//!   time.
//! * Huge bodies, three clients without pause for 8 s (15 MB each: 480 000
//!   one-byte messages, a 15 MB prompt, 2.4 million token ids): each gets
//!   its 4xx (`array_above_max_length`, `prompt_too_large`,
//!   `context_length_exceeded`) and none reaches the engine, while a polite
//!   client is served at least 99 % of the time.
//!
//! * Bodies held at once: past `limits.max_inflight_body_bytes` a body
//!   gets 503 `server_busy` with `Retry-After` (a stalled 900 KiB body
//!   holds a 1 MiB budget), and its share comes back when it ends;
//!   `limits.max_connections_per_ip` closes one address's extra
//!   connection with a 503.
//!
//! Every wait polls a condition with a deadline.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use semlb_test_support as support;
use support::attack::{Polite, restarts};
use support::gateway::{Gateway, answered_by_gateway, chat, sample, sim_at, user, wait_for};

const PATIENCE: Duration = Duration::from_secs(20);

fn unique(tag: &str) -> String {
    support::process::unique("hostile", tag)
}

/// A gateway with a one-second client timeout and `extra` configuration,
/// in front of one fast engine.
fn gateway(tag: &str, extra: &str) -> (support::process::Proc, Gateway) {
    let engine = sim_at("0.001");
    let config = format!("[limits]\nclient_timeout_secs = 1\n{extra}");
    let gw = Gateway::builder()
        .shm(&unique(tag))
        .tag(tag)
        .dispatchers(1)
        .config(&config)
        .backends(&[&engine])
        .start();
    (engine, gw)
}

/// A raw connection to the gateway with `request` written.
fn raw(gw: &Gateway, request: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(gw.addr()).expect("connect");
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    s.write_all(request).expect("write");
    s
}

/// Whether the peer closed `s` (a read of 0, or a reset), reading away
/// whatever it sent first.
fn closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return false;
            }
            Err(_) => return true,
        }
    }
}

#[test]
fn a_client_that_stops_reading_a_stream_releases_its_engine() {
    let (engine, gw) = gateway("stall", "");
    let inflight = |gw: &Gateway| {
        sample(
            &gw.metrics(),
            &format!("semlb_server_inflight_requests{{server=\"http://{}\"}}", engine.addr),
        )
    };
    // A stream of 30 000 tokens (megabytes of SSE), of which it reads the head.
    let body = json!({
        "model": "semlb-sim",
        "messages": [user("Tell a story that never ends.")],
        "stream": true,
        "max_tokens": 30000,
        "ignore_eos": true,
    })
    .to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut reader = raw(&gw, request.as_bytes());
    let mut head = [0u8; 64];
    reader.read_exact(&mut head).expect("the answer starts");
    assert!(head.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&head));
    wait_for("the stream counted in flight", PATIENCE, || {
        let n = inflight(&gw);
        (n == Some(1.0), n)
    });
    // It reads no more, and keeps its connection open: the gateway closes
    // it within the client timeout, and the engine's count goes back to 0.
    let since = Instant::now();
    wait_for("the engine released", PATIENCE, || {
        let n = inflight(&gw);
        (n == Some(0.0), n)
    });
    let released_after = since.elapsed();
    assert!(closed(&mut reader), "the gateway closed the connection");
    // Served meanwhile and after, and nothing restarted.
    let mut polite = Polite::default();
    for _ in 0..5 {
        polite.served(&gw);
    }
    assert_eq!(restarts(&gw), 0.0);
    eprintln!("released after {released_after:?}");
    polite.report("stopped reading", &gw);
}

#[test]
fn slowloris_connections_are_closed_and_others_served() {
    let (_engine, gw) = gateway("slowloris", "");
    // 200 connections that send their request line and then a header byte
    // every 100 ms.
    let mut slow: Vec<TcpStream> = (0..200)
        .map(|_| raw(&gw, b"POST /v1/chat/completions HTTP/1.1\r\nx"))
        .collect();
    for s in &slow {
        s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
    }
    let deadline = Instant::now() + PATIENCE;
    let mut polite = Polite::default();
    let mut open = slow.len();
    while open > 0 {
        assert!(Instant::now() < deadline, "{open} slow connections still open");
        for s in &mut slow {
            let _ = s.write_all(b"x");
        }
        polite.served(&gw);
        open = slow.iter_mut().map(|s| !closed(s)).filter(|o| *o).count();
        std::thread::sleep(Duration::from_millis(100));
    }
    // Each round of the loop served one polite request with the slow
    // connections still open.
    assert!(polite.asked() >= 1);
    assert_eq!(restarts(&gw), 0.0);
    polite.report("slowloris (200 connections)", &gw);
}

#[test]
fn a_body_that_stops_coming_gets_408() {
    let (_engine, gw) = gateway("body", "");
    let since = Instant::now();
    let mut s = raw(
        &gw,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"model\":",
    );
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"code\":\"request_timeout\""), "{answer}");
    assert!(since.elapsed() < PATIENCE);
    Polite::default().served(&gw);
}

#[test]
fn connections_over_the_cap_get_503_and_the_others_are_served() {
    let (_engine, gw) = gateway("cap", "max_connections = 4\n");
    // Four keep-alive connections, each with a request answered: the cap.
    let body = json!({"model": "semlb-sim", "prompt": "hello", "max_tokens": 2}).to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut held: Vec<TcpStream> = Vec::new();
    for _ in 0..4 {
        let mut s = raw(&gw, request.as_bytes());
        let mut head = [0u8; 12];
        s.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"HTTP/1.1 200");
        held.push(s);
    }
    let mut extra = raw(&gw, request.as_bytes());
    let mut answer = String::new();
    let _ = extra.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("too_many_connections"), "{answer}");
    // Once they go, others are served again.
    drop(held);
    let status = wait_for("a connection served again", PATIENCE, || {
        let r = support::http::http(
            gw.addr(),
            "POST",
            "/v1/completions",
            Some(&json!({"model": "semlb-sim", "prompt": "again", "max_tokens": 2})),
            &[],
        );
        (r.as_ref().is_ok_and(|r| r.status == 200), r.map(|r| r.status))
    });
    assert_eq!(status, Ok(200));
    assert_eq!(restarts(&gw), 0.0);
}

#[test]
fn huge_bodies_get_their_4xx_while_a_polite_client_is_served() {
    let engine = sim_at("0.001");
    let gw = Gateway::builder()
        .shm(&unique("huge"))
        .tag("huge")
        .dispatchers(2)
        .config("[health]\nscrape_interval_ms = 50\n")
        .backends(&[&engine])
        .start();
    // The engine's context is known: a prompt over it is refused at the gateway.
    wait_for("the engine's context read", PATIENCE, || {
        let known = gw
            .segment
            .tables()
            .servers
            .servers()
            .any(|s| s.engine_context.is_some());
        (known, known)
    });
    let messages = format!(
        r#"{{"model":"semlb-sim","messages":[{}]}}"#,
        vec![r#"{"role":"user","content":"x"}"#; 480_000].join(",")
    );
    let prompt = format!(
        r#"{{"model":"semlb-sim","prompt":"{}"}}"#,
        "lorem ipsum ".repeat(1_250_000)
    );
    let ids = format!(
        r#"{{"model":"semlb-sim","prompt":[{}]}}"#,
        vec!["12345"; 2_400_000].join(",")
    );
    let stop = Arc::new(AtomicBool::new(false));
    let attackers: Vec<_> = [
        ("/v1/chat/completions", messages, 400, "array_above_max_length"),
        ("/v1/completions", prompt, 413, "prompt_too_large"),
        ("/v1/completions", ids, 400, "context_length_exceeded"),
    ]
    .into_iter()
    .map(|(path, body, status, code)| {
        assert!(body.len() > 12 << 20 && body.len() < 16 << 20, "{}", body.len());
        let (addr, stop) = (gw.addr().to_owned(), stop.clone());
        std::thread::spawn(move || {
            let mut sent = 0;
            while !stop.load(Ordering::Relaxed) {
                let r = support::http::http_bytes(&addr, "POST", path, Some(body.as_bytes()), &[])
                    .unwrap_or_else(|e| panic!("{path} ({code}): {e}"));
                let error = answered_by_gateway(&r, status, path);
                assert_eq!(error["error"]["code"], code, "{path}: {error}");
                sent += 1;
            }
            sent
        })
    })
    .collect();
    let started = Instant::now();
    let mut polite = Polite::default();
    while started.elapsed() < Duration::from_secs(8) {
        polite.ask(&gw, json!({}));
    }
    let (asked, answered) = (polite.asked(), polite.answered());
    stop.store(true, Ordering::Relaxed);
    let sent: Vec<usize> = attackers.into_iter().map(|a| a.join().expect("attacker")).collect();
    assert!(sent.iter().all(|n| *n > 0), "{sent:?}");
    assert!(
        answered * 100 >= asked * 99,
        "{answered} of {asked} polite requests answered"
    );
    assert_eq!(restarts(&gw), 0.0);
    eprintln!("huge bodies: {sent:?} sent");
    polite.report("huge bodies (16 MiB, 3 clients)", &gw);
}

#[test]
fn a_flood_of_generations_outliving_their_deadline_ejects_no_engine() {
    // A decode step of ~1 ms: 30 000 tokens would take half a minute.
    let engines = [sim_at("0.05"), sim_at("0.05")];
    let gw = Gateway::builder()
        .shm(&unique("flood"))
        .tag("flood")
        .dispatchers(2)
        .config("[limits]\nrequest_timeout_secs = 2\n")
        .backends(&[&engines[0], &engines[1]])
        .start();
    let stop = Arc::new(AtomicBool::new(false));
    let flood: Vec<_> = (0..8)
        .map(|i| {
            let (addr, stop) = (gw.addr().to_owned(), stop.clone());
            std::thread::spawn(move || {
                let mut ended = 0;
                while !stop.load(Ordering::Relaxed) {
                    let body = json!({
                        "model": "semlb-sim",
                        "messages": [user(&format!("flood {i}.{ended}: write forever"))],
                        "max_tokens": 30000,
                        "ignore_eos": true,
                        "stream": i % 2 == 0,
                    });
                    // A cut stream is an error reading the body: fine.
                    let r = support::http::http(&addr, "POST", "/v1/chat/completions", Some(&body), &[]);
                    if let Ok(r) = r {
                        assert!(
                            r.status == 200 || r.status == 504,
                            "{}: {}",
                            r.status,
                            String::from_utf8_lossy(&r.body)
                        );
                    }
                    ended += 1;
                }
                ended
            })
        })
        .collect();
    let started = Instant::now();
    let mut polite = Polite::default();
    while started.elapsed() < Duration::from_secs(6) {
        polite.ask(&gw, json!({"max_tokens": 4}));
    }
    let (asked, answered) = (polite.asked(), polite.answered());
    stop.store(true, Ordering::Relaxed);
    let ended: usize = flood.into_iter().map(|t| t.join().expect("flood client")).sum();
    assert!(ended >= 8, "{ended} flood requests ended");
    assert!(
        answered * 100 >= asked * 99,
        "{answered} of {asked} polite requests answered"
    );
    let up = sample(
        &gw.metrics(),
        &format!("semlb_server_up{{server=\"http://{}\"}}", engines[0].addr),
    );
    assert_eq!(up, Some(1.0), "not ejected");
    assert_eq!(restarts(&gw), 0.0);
    eprintln!("flood: {ended} requests ended at their deadline");
    polite.report("deadline flood (8 clients)", &gw);
}

/// Bodies held at once are bounded (issue 39: 4 096 connections × a
/// 16 MiB body × the JSON tree's amplification could grow a dispatcher
/// without bound): with `max_inflight_body_bytes` = 1 MiB, one client
/// that sends 900 KiB of a body and stalls holds its share; another
/// client's 500 KiB body gets 503 `server_busy` with `Retry-After` at
/// once, while a small request is still served; once the stalled body
/// times out (408), the large one passes. One address's connections are
/// capped with `max_connections_per_ip` = 3: a fourth idle connection
/// gets 503 `too_many_connections` and is closed, and a slot comes back
/// when one closes.
#[test]
fn bodies_in_flight_and_connections_per_address_are_bounded() {
    let (_engine, gw) = gateway(
        "body-budget",
        "max_body_bytes = \"1MiB\"\nmax_inflight_body_bytes = \"1MiB\"\nmax_connections_per_ip = 3\n",
    );
    let big_body = |kib: usize| {
        let text = "x".repeat(kib << 10);
        json!({"model": "semlb-sim", "prompt": text, "max_tokens": 1}).to_string()
    };
    // The stalled client: 900 KiB declared, most of it sent, never the rest.
    let stalled_body = big_body(900);
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        stalled_body.len()
    );
    let mut stalled = raw(&gw, head.as_bytes());
    stalled.write_all(&stalled_body.as_bytes()[..800 << 10]).unwrap();
    let large = big_body(500);
    let refused = wait_for("the budget to be held", PATIENCE, || {
        let r = support::http::http_bytes(gw.addr(), "POST", "/v1/completions", Some(large.as_bytes()), &[]).unwrap();
        (r.status == 503, r)
    });
    let error = answered_by_gateway(&refused, 503, "a body past the budget");
    assert_eq!(error["error"]["code"], "server_busy", "{error}");
    assert_eq!(refused.header("retry-after"), Some("1"));
    let mut polite = Polite::default();
    polite.served(&gw);
    // The stalled body ends (408 after the client timeout): its share
    // comes back.
    let mut answer = String::new();
    let _ = stalled.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    let r = support::http::http_bytes(gw.addr(), "POST", "/v1/completions", Some(large.as_bytes()), &[]).unwrap();
    assert_ne!(
        r.status,
        503,
        "the budget was given back: {}",
        String::from_utf8_lossy(&r.body)
    );

    // Connections per address (all of this test's are from 127.0.0.1).
    let idle: Vec<TcpStream> = (0..3).map(|_| raw(&gw, b"")).collect();
    let mut fourth = raw(&gw, b"");
    let mut answer = String::new();
    let _ = fourth.read_to_string(&mut answer);
    assert!(
        answer.starts_with("HTTP/1.1 503") && answer.contains("too_many_connections"),
        "{answer}"
    );
    drop(idle);
    wait_for("a place given back", PATIENCE, || {
        let r = chat(gw.addr(), &[user("back")], json!({"max_tokens": 1}), &[]);
        (r.status == 200, r.status)
    });
    assert_eq!(restarts(&gw), 0.0);
}
