//! The gateway end to end, with real processes on loopback.
//!
//! 1. **Dispatch overhead** for ~2 000-token chat prompts: the time from a
//!    request's headers arriving at a dispatcher to the request being handed
//!    to the upstream client, split by stage, as each dispatcher reports it
//!    in `x-semlb-dispatch-ns` (read, parse, tokenize, hash, cache, route).
//!    200 distinct conversations (real HH-RLHF dialogues when ../shared
//!    holds them), one request at a time, bundled phi-2 tokenizer.
//! 2. **Proxy throughput**: closed-loop clients (keep-alive HTTP/1.1) sending
//!    short non-streaming completions for a fixed time, straight to one
//!    simulated engine and through the gateway to that same engine; the
//!    ratio is the gateway's cost on the request rate.
//!
//! `cargo bench --bench gateway` (`SEMLB_GATEWAY_SECS`, default 5, per
//! throughput point). It prints figures; it asserts nothing.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use semlb_test_support::gateway::{Gateway, sim_at};
use serde_json::json;

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/data");

/// A minimal keep-alive HTTP/1.1 client (Content-Length or chunked bodies).
struct Conn {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Conn {
    fn new(addr: &str) -> Conn {
        let s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        Conn {
            r: BufReader::new(s.try_clone().unwrap()),
            w: s,
        }
    }

    fn post(&mut self, path: &str, body: &str) -> (u16, Vec<(String, String)>, Vec<u8>) {
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.w.write_all(req.as_bytes()).unwrap();
        let mut line = String::new();
        self.r.read_line(&mut line).unwrap();
        let status = line.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let mut headers = Vec::new();
        loop {
            line.clear();
            self.r.read_line(&mut line).unwrap();
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
            }
        }
        let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
        let mut body = Vec::new();
        if let Some(len) = get("content-length").and_then(|l| l.parse::<usize>().ok()) {
            body.resize(len, 0);
            self.r.read_exact(&mut body).unwrap();
        } else if get("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
            loop {
                line.clear();
                self.r.read_line(&mut line).unwrap();
                let size = usize::from_str_radix(line.trim(), 16).unwrap();
                let mut chunk = vec![0; size + 2];
                self.r.read_exact(&mut chunk).unwrap();
                if size == 0 {
                    break;
                }
                body.extend_from_slice(&chunk[..size]);
            }
        }
        (status, headers, body)
    }
}

fn dialogues() -> Vec<String> {
    std::fs::read_to_string(format!("{SHARED}/prompts/hh-rlhf-helpful-base-test.jsonl"))
        .ok()
        .map(|s| {
            s.lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter_map(|v| v["chosen"].as_str().map(str::to_owned))
                .collect()
        })
        .filter(|d: &Vec<String>| !d.is_empty())
        .unwrap_or_else(|| {
            (0..64)
                .map(|i| format!("Human: question {i}? Assistant: {}", "an answer ".repeat(60)))
                .collect()
        })
}

/// CPU time (user + system, ms) of the dispatcher processes of segment `shm`.
fn dispatcher_cpu_ms(shm: &str) -> f64 {
    let tick = 100.0; // USER_HZ on Linux
    let mut total = 0.0;
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if !(cmd.contains("__child") && cmd.contains("dispatcher") && cmd.contains(shm)) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
        let (utime, stime): (f64, f64) = (fields[11].parse().unwrap_or(0.0), fields[12].parse().unwrap_or(0.0));
        total += (utime + stime) / tick * 1000.0;
    }
    total
}

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn throughput(addr: &str, clients: usize, secs: f64) -> f64 {
    let stop = Instant::now() + Duration::from_secs_f64(secs);
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            let addr = addr.to_owned();
            std::thread::spawn(move || {
                let mut conn = Conn::new(&addr);
                let mut n = 0u64;
                while Instant::now() < stop {
                    let body = json!({"model": "semlb-sim", "prompt": format!("client {c} request {n}: say something short"), "max_tokens": 4, "temperature": 0.7}).to_string();
                    let (status, _, _) = conn.post("/v1/completions", &body);
                    assert_eq!(status, 200);
                    n += 1;
                }
                n
            })
        })
        .collect();
    let total: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    total as f64 / secs
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` probes benches; nothing to list
    }
    let secs: f64 = std::env::var("SEMLB_GATEWAY_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    let engine = sim_at("0.0001");
    let gateway = Gateway::builder().shm_size("64MiB").backends(&[&engine]).start();
    let shm = gateway.shm.clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Conn::new(gateway.addr())
        .post(
            "/v1/completions",
            r#"{"model":"semlb-sim","prompt":"warm up","max_tokens":1}"#,
        )
        .0
        != 200
    {
        assert!(Instant::now() < deadline, "gateway not ready");
    }

    // 1. Dispatch overhead, 2k-token prompts.
    let d = dialogues();
    let mut conn = Conn::new(gateway.addr());
    let stages = ["read", "parse", "tokenize", "hash", "cache", "route", "total"];
    let mut samples: Vec<Vec<u64>> = vec![Vec::new(); stages.len()];
    let mut next = 0;
    let cpu_before = dispatcher_cpu_ms(&shm);
    for c in 0..200 {
        let mut text = format!("Conversation {c}.");
        while text.len() < 8_500 {
            text.push_str(&d[next % d.len()]);
            next += 1;
        }
        let body = json!({"model": "semlb-sim", "max_tokens": 1, "temperature": 0.7,
            "messages": [{"role": "user", "content": text}]})
        .to_string();
        let (status, headers, resp) = conn.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
        let timing = headers
            .iter()
            .find(|(k, _)| k == "x-semlb-dispatch-ns")
            .map(|(_, v)| v.clone())
            .unwrap();
        for (i, part) in timing.split(',').enumerate() {
            samples[i].push(part.split('=').nth(1).unwrap().parse().unwrap());
        }
        if c == 0 {
            let v: serde_json::Value = serde_json::from_slice(&resp).unwrap();
            println!(
                "dispatch overhead: prompts of ~{} tokens (first: {})",
                v["usage"]["prompt_tokens"], v["usage"]["prompt_tokens"]
            );
        }
    }
    // Let the last records be built (they are after the answers), then read
    // the dispatchers' CPU: what each 2k-token request costs them in all.
    std::thread::sleep(Duration::from_millis(300));
    println!(
        "dispatcher CPU per request: {:.2} ms",
        (dispatcher_cpu_ms(&shm) - cpu_before) / 200.0
    );
    println!("{:<10} {:>12}", "stage", "median µs");
    for (name, s) in stages.iter().zip(samples.iter_mut()) {
        println!("{name:<10} {:>12.1}", median(s) as f64 / 1000.0);
    }

    // 2. Proxy throughput.
    for clients in [1usize, 8, 32] {
        let direct = throughput(&engine.addr, clients, secs);
        let through = throughput(gateway.addr(), clients, secs);
        println!(
            "throughput, {clients:>2} clients: direct {direct:>8.0} req/s, through the gateway {through:>8.0} req/s, ratio {:.2}",
            through / direct
        );
    }
    drop(gateway);
}
