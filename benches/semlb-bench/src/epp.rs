//! `semlb bench epp`: what one decision of the endpoint picker costs
//! (`semlb serve --epp-listen`, [`semlb::dispatcher::epp`]), beside what
//! the HTTP proxy's dispatcher spends on a request.
//!
//! One simulated engine at a tiny time scale and `semlb serve` with one
//! dispatcher, one responder, a throw-away segment and the picker. Two
//! workloads: a short chat (a one-line question) and a 2 000-token chat
//! (a user message of about 2 000 tokens); every request's text is new
//! (words drawn from a seeded generator), so each decision tokenizes
//! and hashes its whole prompt.
//!
//! * **picker**: a client from Envoy's own protos plays Envoy, one stream
//!   at a time on one HTTP/2 connection: the request's headers and body
//!   (one chunk, `end_of_stream`), until the picker's answers to both
//!   arrive (the **round trip**, p50 and p99); then a canned engine
//!   answer (JSON, with usage) streamed back through the picker, so that
//!   the request ends, is learned and charged, as behind a real Envoy.
//! * **proxy**: the same requests as HTTP to the dispatcher on one
//!   keep-alive connection (the engine answers them).
//!
//! **CPU per request** is the dispatcher process's user + system CPU over
//! the run (`/proc`), divided by the requests: for the picker the whole
//! exchange (decision and the relayed answer), for the proxy the whole
//! proxied request (read, decision, upstream request, relayed answer).
//! The proxy row also gives the dispatcher's own dispatch time
//! (`x-semlb-dispatch-ns` p50: arrival to the request going upstream).
//! Nothing is pinned to a core here (see `semlb bench proxy` for that).
//! A benchmark measures; it asserts nothing about speed.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, body_mutation, processing_request, processing_response,
};
use semlb::dispatcher::epp::header_list;
use serde_json::json;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use crate::Common;
use crate::output::{Table, print_table, quantile, sort, write_json};
use crate::proxy::procs::{CpuSnapshot, cpu_between};

/// `semlb bench epp`.
#[derive(Debug, Clone, Args)]
pub struct EppArgs {
    /// Flags every report takes.
    #[command(flatten)]
    pub common: Common,
    /// Measured requests per workload and path (after up to 200 warm-up
    /// requests).
    #[arg(long, default_value_t = 1000)]
    pub requests: usize,
}

impl EppArgs {
    /// The defaults with `common`.
    pub fn with(common: Common) -> Self {
        Self { common, requests: 1000 }
    }
}

/// A workload's request bodies.
struct Workload {
    name: &'static str,
    words: usize,
}

const WORKLOADS: [Workload; 2] = [
    Workload {
        name: "short chat",
        words: 12,
    },
    Workload {
        name: "2 000-token chat",
        words: 1500,
    },
];

/// A chat body whose user text is `words` words drawn from `rng`.
fn body(rng: &mut semlb_test_support::rng::Rng, words: usize) -> String {
    const VOCABULARY: [&str; 16] = [
        "engine", "prefix", "cache", "token", "gateway", "request", "answer", "block", "segment", "policy", "load",
        "server", "route", "prompt", "table", "stream",
    ];
    let text: Vec<String> = (0..words)
        .map(|_| format!("{}{}", VOCABULARY[rng.index(VOCABULARY.len())], rng.below(100)))
        .collect();
    json!({"model": "semlb-sim", "max_tokens": 4, "messages": [{"role": "user", "content": text.join(" ")}]})
        .to_string()
}

fn message(request: processing_request::Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..ProcessingRequest::default()
    }
}

/// A canned engine answer (JSON with usage).
const ANSWER: &str = r#"{"id":"c","object":"chat.completion","model":"semlb-sim","choices":[{"index":0,"message":{"role":"assistant","content":"Four words of answer."},"finish_reason":"length"}],"usage":{"prompt_tokens":10,"completion_tokens":4,"total_tokens":14,"prompt_tokens_details":{"cached_tokens":0}}}"#;

/// One request through the picker as Envoy sends it; the round trip of the
/// decision (headers and body in, both answers out), nanoseconds.
async fn through_picker(client: &mut ExternalProcessorClient<Channel>, body: String) -> Result<f64> {
    let (tx, rx) = mpsc::channel::<ProcessingRequest>(8);
    let outbound = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let start = Instant::now();
    let mut inbound = client.process(outbound).await?.into_inner();
    let head = header_list(&[
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("content-type", "application/json"),
    ]);
    tx.send(message(processing_request::Request::RequestHeaders(HttpHeaders {
        headers: Some(head),
        ..HttpHeaders::default()
    })))
    .await?;
    tx.send(message(processing_request::Request::RequestBody(HttpBody {
        body: body.into_bytes(),
        end_of_stream: true,
        ..HttpBody::default()
    })))
    .await?;
    loop {
        let answer = inbound.message().await?.context("the picker ended the stream")?;
        match answer.response {
            Some(processing_response::Response::RequestHeaders(_)) => {}
            Some(processing_response::Response::RequestBody(b)) => {
                let end = matches!(
                    b.response.and_then(|c| c.body_mutation).and_then(|m| m.mutation),
                    Some(body_mutation::Mutation::StreamedResponse(s)) if s.end_of_stream
                );
                if end {
                    break;
                }
            }
            other => bail!("the picker answered {other:?}"),
        }
    }
    let round_trip = start.elapsed().as_nanos() as f64;
    let response = header_list(&[(":status", "200"), ("content-type", "application/json")]);
    tx.send(message(processing_request::Request::ResponseHeaders(HttpHeaders {
        headers: Some(response),
        ..HttpHeaders::default()
    })))
    .await?;
    tx.send(message(processing_request::Request::ResponseBody(HttpBody {
        body: ANSWER.as_bytes().to_vec(),
        end_of_stream: true,
        ..HttpBody::default()
    })))
    .await?;
    // The response headers' answer, then the body's.
    for _ in 0..2 {
        inbound.message().await?.context("the picker ended the stream early")?;
    }
    Ok(round_trip)
}

/// One path's figures.
struct Figures {
    p50_us: f64,
    p99_us: f64,
    cpu_us: f64,
    dispatch_p50_us: Option<f64>,
}

fn quantiles(mut ns: Vec<f64>) -> (f64, f64) {
    sort(&mut ns);
    (quantile(&ns, 0.5) / 1e3, quantile(&ns, 0.99) / 1e3)
}

/// The picker's figures on `workload`.
fn picker(addr: &str, pid: i32, workload: &Workload, requests: usize) -> Result<Figures> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut rng = semlb_test_support::rng::Rng::from_seed(7 + workload.words as u64);
    runtime.block_on(async {
        let mut client = ExternalProcessorClient::connect(format!("http://{addr}")).await?;
        for _ in 0..requests.min(200) {
            through_picker(&mut client, body(&mut rng, workload.words)).await?;
        }
        let bodies: Vec<String> = (0..requests).map(|_| body(&mut rng, workload.words)).collect();
        let before = CpuSnapshot::of(&[pid]);
        let mut ns = Vec::with_capacity(requests);
        for b in bodies {
            ns.push(through_picker(&mut client, b).await?);
        }
        let cpu = cpu_between(&before, &CpuSnapshot::of(&[pid]));
        let (p50_us, p99_us) = quantiles(ns);
        Ok(Figures {
            p50_us,
            p99_us,
            cpu_us: cpu * 1e6 / requests as f64,
            dispatch_p50_us: None,
        })
    })
}

/// The HTTP proxy's figures on `workload`.
fn proxy(addr: &str, pid: i32, workload: &Workload, requests: usize) -> Result<Figures> {
    let mut rng = semlb_test_support::rng::Rng::from_seed(11 + workload.words as u64);
    let mut client = semlb_test_support::keepalive::KeepAlive::new(addr);
    let path = "/v1/chat/completions";
    for _ in 0..requests.min(200) {
        client
            .post(path, &body(&mut rng, workload.words), &[])
            .map_err(anyhow::Error::msg)?;
    }
    let bodies: Vec<String> = (0..requests).map(|_| body(&mut rng, workload.words)).collect();
    let before = CpuSnapshot::of(&[pid]);
    let (mut ns, mut dispatch) = (Vec::with_capacity(requests), Vec::with_capacity(requests));
    for b in bodies {
        let start = Instant::now();
        let answer = client.post(path, &b, &[]).map_err(anyhow::Error::msg)?;
        ns.push(start.elapsed().as_nanos() as f64);
        if answer.status != 200 {
            bail!("the proxy answered {}", answer.status);
        }
        if let Some(d) = answer
            .headers
            .get("x-semlb-dispatch-ns")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.split(',')
                    .find_map(|part| part.strip_prefix("total="))?
                    .parse::<f64>()
                    .ok()
            })
        {
            dispatch.push(d);
        }
    }
    let cpu = cpu_between(&before, &CpuSnapshot::of(&[pid]));
    let (p50_us, p99_us) = quantiles(ns);
    let dispatch_p50_us = (!dispatch.is_empty()).then(|| quantiles(dispatch).0);
    Ok(Figures {
        p50_us,
        p99_us,
        cpu_us: cpu * 1e6 / requests as f64,
        dispatch_p50_us,
    })
}

/// The gateway's one dispatcher's pid, from its segment's registry.
fn dispatcher_pid(shm: &str) -> Result<i32> {
    let segment = shm_layout::Segment::open(shm)?;
    let pid = segment
        .tables()
        .registry
        .processes()
        .find(|p| p.role == Some(shm_layout::Role::Dispatcher) && p.state == shm_layout::ProcessState::Running)
        .map(|p| p.pid)
        .context("no dispatcher running")?;
    Ok(pid as i32)
}

/// Runs the report.
pub fn run(args: &EppArgs) -> Result<()> {
    use semlb_test_support::gateway::{Gateway, sim_at};
    let engine = sim_at("0.0001");
    let shm = semlb_test_support::process::unique("bench", "epp");
    let gw = Gateway::builder()
        .shm(&shm)
        .tag("bench-epp")
        .dispatchers(1)
        .backends(&[&engine])
        .args(&["--epp-listen", "127.0.0.1:0", "--log-level", "warn"])
        .start();
    let line = gw.proc.line.clone();
    let picker_addr = line
        .split_once("grpc://")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .context("the gateway printed no picker address")?
        .to_owned();
    let pid = dispatcher_pid(&shm)?;
    let mut table = Table::new([
        "workload",
        "path",
        "round trip p50",
        "p99",
        "dispatch p50",
        "dispatcher CPU / request",
    ]);
    let mut rows = Vec::new();
    for workload in &WORKLOADS {
        let p = picker(&picker_addr, pid, workload, args.requests)?;
        let h = proxy(gw.addr(), pid, workload, args.requests)?;
        for (path, f) in [("picker (ext_proc)", &p), ("HTTP proxy", &h)] {
            table.row([
                workload.name.to_owned(),
                path.to_owned(),
                format!("{:.1} µs", f.p50_us),
                format!("{:.1} µs", f.p99_us),
                f.dispatch_p50_us.map_or("-".to_owned(), |d| format!("{d:.1} µs")),
                format!("{:.1} µs", f.cpu_us),
            ]);
            rows.push(json!({
                "workload": workload.name,
                "path": path,
                "round_trip_p50_us": f.p50_us,
                "round_trip_p99_us": f.p99_us,
                "dispatch_p50_us": f.dispatch_p50_us,
                "cpu_us_per_request": f.cpu_us,
            }));
        }
        eprintln!(
            "{}: the picker's CPU per decision is {:.2} of the proxy's per request",
            workload.name,
            p.cpu_us / h.cpu_us
        );
    }
    print_table(
        &format!("endpoint picker vs HTTP proxy ({} requests each)", args.requests),
        &table,
    );
    let out: PathBuf = args.common.out.clone();
    write_json(&out, "epp", &json!({"requests": args.requests, "rows": rows}))?;
    Ok(())
}
