//! Upstreams that attack the gateway (issue 39), against a real `semlb
//! serve` whose processes' peak memory is read from `/proc`: each attack
//! runs for a few seconds while a well-behaved client asks chat questions
//! of a healthy engine, which must be answered at least 99 % of the time,
//! with no process restarting and each process's memory growth under a
//! bound the attack would pass without the caps. The figures (share
//! answered, p50, p99, restarts, every process's peak) are printed for the
//! report, lines starting `ATTACK`.
//!
//! * A hostile KV-event publisher: after a proper ZMTP handshake it sends
//!   frames of 15 MiB, each announcing more to come, without end. The
//!   response process that subscribes refuses the message past its cap
//!   (32 MiB) and reconnects; before the caps it would hold 64 frames of up
//!   to 64 MiB.
//! * A hostile engine: its streams are 64 MiB of `data:` lines that never
//!   end an event (no blank line), its `/v1/models` lists 300 000 models
//!   and its `/metrics` is garbage. The dispatcher relays the stream in
//!   bounded memory (the usage stripper holds at most 1 MiB of an event;
//!   before, the whole stream, rescanned on every chunk), and the clients
//!   of the other model's engine are served meanwhile.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde_json::json;

use semlb_test_support as support;
use shm_layout::Role;
use support::attack::{Polite, peaks_of, restarts};
use support::gateway::{Gateway, sim_at, wait_for};

const PATIENCE: Duration = Duration::from_secs(20);
const MIB: u64 = 1 << 20;

fn unique(tag: &str) -> String {
    support::process::unique("hostup", tag)
}

/// A listener on a free loopback port, serving each connection with
/// `serve` on its own thread until the test ends.
fn serve_each(serve: impl Fn(TcpStream) + Send + Sync + 'static) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().unwrap().to_string();
    let serve = Arc::new(serve);
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let serve = serve.clone();
            std::thread::spawn(move || serve(conn));
        }
    });
    addr
}

/// What a hostile publisher did: connections accepted, bytes sent.
#[derive(Default)]
struct Sent {
    connections: AtomicU64,
    bytes: AtomicU64,
}

/// A ZMTP 3.0 PUB peer that, once `go` is set, sends 15 MiB frames with the
/// MORE flag without end; `tcp://` address.
fn hostile_publisher(go: Arc<AtomicBool>, sent: Arc<Sent>) -> String {
    let addr = serve_each(move |mut s| {
        sent.connections.fetch_add(1, Ordering::Relaxed);
        let mut greeting = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 3, 0];
        greeting.extend_from_slice(b"NULL");
        greeting.resize(64, 0);
        let ready = b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB";
        if s.write_all(&greeting).and_then(|()| s.write_all(ready)).is_err() {
            return;
        }
        // What the subscriber says (its greeting, READY, SUBSCRIBE) is read
        // away.
        let mut reader = s.try_clone().expect("clone");
        std::thread::spawn(move || {
            let mut sink = vec![0; 4096];
            while reader.read(&mut sink).is_ok_and(|n| n > 0) {}
        });
        while !go.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(10));
        }
        const MORE_LONG: u8 = 0x01 | 0x02;
        let chunk = vec![7u8; MIB as usize];
        loop {
            let head: Vec<u8> = std::iter::once(MORE_LONG).chain((15 * MIB).to_be_bytes()).collect();
            if s.write_all(&head).is_err() {
                return;
            }
            for _ in 0..15 {
                if s.write_all(&chunk).is_err() {
                    return;
                }
                sent.bytes.fetch_add(MIB, Ordering::Relaxed);
            }
        }
    });
    format!("tcp://{addr}")
}

/// The response processes' peak memory, KiB (one figure per process).
fn responders_peak(gw: &Gateway) -> Vec<u64> {
    peaks_of(gw, Role::Responder)
}

#[test]
fn a_hostile_kv_event_publisher_cannot_grow_the_response_process() {
    let engine = sim_at("0.001");
    let (go, sent) = (Arc::new(AtomicBool::new(false)), Arc::new(Sent::default()));
    let publisher = hostile_publisher(go.clone(), sent.clone());
    let config = format!(
        "[[backend]]\nurl = \"http://{}\"\nkv_events = \"{publisher}\"\n[policy]\nkind = \"cache_aware\"\n[policy.prefix]\nsource = \"precise\"\n",
        engine.addr
    );
    let gw = Gateway::builder()
        .shm(&unique("zmtp"))
        .tag("zmtp")
        .dispatchers(1)
        .config(&config)
        .start();
    wait_for("the subscriber to connect", PATIENCE, || {
        let n = sent.connections.load(Ordering::Relaxed);
        (n >= 1, n)
    });
    let before = responders_peak(&gw);
    assert!(!before.is_empty(), "no response process");
    go.store(true, Ordering::Relaxed);
    let mut polite = Polite::default();
    polite.ask_for(&gw, 6.0, json!({"max_tokens": 4}));
    // The attack took place: the subscriber read past its message cap.
    let bytes = sent.bytes.load(Ordering::Relaxed);
    assert!(bytes >= 32 * MIB, "only {bytes} bytes were sent");
    let after = responders_peak(&gw);
    polite.report(
        &format!(
            "hostile KV publisher ({} MiB in {} connections)",
            bytes / MIB,
            sent.connections.load(Ordering::Relaxed)
        ),
        &gw,
    );
    polite.assert_served("hostile KV publisher");
    assert_eq!(restarts(&gw), 0.0);
    // A 16 MiB frame cap and a 32 MiB message cap: the subscriber holds a
    // message's frames and reads the next (before the caps: 64 frames).
    for (b, a) in before.iter().zip(&after) {
        assert!(
            a.saturating_sub(*b) <= 96 << 10,
            "the response process grew from {b} KiB to {a} KiB"
        );
    }
}

/// The head and body of one HTTP/1.1 request read from `s` (its
/// `content-length` body), or `None` when the peer closed.
fn read_request(s: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte).ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let length = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0; length];
    s.read_exact(&mut body).ok()?;
    Some((head, body))
}

/// An engine that answers every completion with `stream_mib` MiB of SSE
/// `data:` lines and never a blank line, lists 300 000 models, and serves
/// garbage metrics; each answer closes its connection.
fn hostile_engine(stream_mib: u64, streams: Arc<AtomicU64>) -> String {
    serve_each(move |mut s| {
        let Some((head, _)) = read_request(&mut s) else {
            return;
        };
        let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
        let fixed = |s: &mut TcpStream, body: &[u8], kind: &str| {
            let _ = s.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                )
                .as_bytes(),
            );
            let _ = s.write_all(body);
        };
        match path.as_str() {
            "/v1/models" => {
                let data: Vec<_> = (0..300_000)
                    .map(|i| json!({"id": format!("evil-{i}"), "object": "model", "max_model_len": u64::MAX}))
                    .collect();
                fixed(
                    &mut s,
                    json!({"object": "list", "data": data}).to_string().as_bytes(),
                    "application/json",
                );
            }
            "/metrics" => fixed(
                &mut s,
                &b"vllm:num_requests_running{\"\n# TYPE\n\xff\xfe 1e999999\n".repeat(10_000),
                "text/plain",
            ),
            p if p.starts_with("/v1/") => {
                streams.fetch_add(1, Ordering::Relaxed);
                if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
                    .is_err()
                {
                    return;
                }
                let line = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"xxxxxxxxxxxxxxxx\"}}]}\n";
                let chunk = line.repeat(4096 / line.len());
                let mut written = 0;
                while written < stream_mib * MIB {
                    if s.write_all(&chunk).is_err() {
                        return;
                    }
                    written += chunk.len() as u64;
                }
            }
            _ => fixed(&mut s, b"{}", "application/json"),
        }
    })
}

#[test]
fn a_hostile_engine_cannot_grow_a_dispatcher() {
    const STREAM_MIB: u64 = 64;
    let good = sim_at("0.001");
    let streams = Arc::new(AtomicU64::new(0));
    let evil = hostile_engine(STREAM_MIB, streams.clone());
    let config = format!(
        "[[backend]]\nurl = \"http://{evil}\"\nname = \"evil\"\n[[backend]]\nurl = \"http://{}\"\nname = \"good\"\n\
         [[model]]\nname = \"evil-model\"\nbackends = [\"evil\"]\n[[model]]\nname = \"semlb-sim\"\nbackends = [\"good\"]\n\
         [health]\nscrape_interval_ms = 50\n",
        good.addr
    );
    let gw = Gateway::builder()
        .shm(&unique("sse"))
        .tag("sse")
        .dispatchers(1)
        .config(&config)
        .start();
    let mut polite = Polite::default();
    polite.served(&gw);
    let before = peaks_of(&gw, Role::Dispatcher);
    let stop = Arc::new(AtomicBool::new(false));
    let attackers: Vec<_> = (0..2)
        .map(|i| {
            let (addr, stop) = (gw.addr().to_owned(), stop.clone());
            std::thread::spawn(move || {
                let mut longest = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let body = json!({
                        "model": "evil-model",
                        "messages": [{"role": "user", "content": format!("attack {i}")}],
                        "stream": i == 0,
                    });
                    // A cut answer is an error reading it: its length is
                    // what came.
                    let mut s = TcpStream::connect(&addr).expect("connect");
                    let request = support::http::request_bytes(
                        &addr,
                        "POST",
                        "/v1/chat/completions",
                        Some(body.to_string().as_bytes()),
                        &[],
                    );
                    s.write_all(&request).expect("write");
                    let mut buf = vec![0; 1 << 16];
                    let mut got = 0u64;
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        got += n as u64;
                    }
                    longest = longest.max(got);
                }
                longest
            })
        })
        .collect();
    polite.ask_for(&gw, 8.0, json!({"max_tokens": 4}));
    stop.store(true, Ordering::Relaxed);
    let longest: Vec<u64> = attackers.into_iter().map(|a| a.join().expect("attacker")).collect();
    let after = peaks_of(&gw, Role::Dispatcher);
    polite.report(
        &format!(
            "hostile engine ({} streams of {STREAM_MIB} MiB without a blank line, longest relayed {:?} MiB)",
            streams.load(Ordering::Relaxed),
            longest.iter().map(|b| b / MIB).collect::<Vec<_>>()
        ),
        &gw,
    );
    // The attack took place: a hostile stream reached a client whole.
    assert!(
        longest.iter().any(|b| *b >= STREAM_MIB * MIB),
        "the hostile streams were not relayed: {longest:?} bytes"
    );
    polite.assert_served("hostile engine");
    assert_eq!(restarts(&gw), 0.0);
    for (b, a) in before.iter().zip(&after) {
        assert!(
            a.saturating_sub(*b) <= 48 << 10,
            "a dispatcher grew from {b} KiB to {a} KiB relaying {STREAM_MIB} MiB streams"
        );
    }
}
