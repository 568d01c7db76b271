//! `semlb bench epp`: what one decision of the endpoint picker costs
//! (`semlb serve --epp-listen`, [`semlb::dispatcher::epp`]), beside what
//! the HTTP proxy's dispatcher spends on a request.
//!
//! One simulated engine at a tiny time scale and `semlb serve` with one
//! dispatcher, one responder, a throw-away segment and the picker. Three
//! workloads: a short chat (a one-line question), a 2 000-token chat (a
//! user message of 2 000 common words, one of 64 texts in turn behind a
//! line naming the request: a new prompt every time whose lines the
//! tokenizer's segment cache holds, as for a conversation's history),
//! and the same with the request's tag opening every line (nothing
//! cached: the whole prompt tokenized).
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
//! Each at `--concurrency` requests at once (default 1 and 8): streams
//! multiplexed on one HTTP/2 connection for the picker (as Envoy does),
//! keep-alive connections for the proxy. At 1 the dispatcher sleeps and
//! wakes for every message, which the CPU per request includes.
//!
//! * **ext_proc floor**: the picker's exchange against a server that only
//!   answers ([`crate::epp_floor`], a process of its own): what gRPC,
//!   HTTP/2, tokio and the kernel cost before any of the picker's work.
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
    /// Streams (picker, on one HTTP/2 connection) or keep-alive
    /// connections (proxy) at once, one point each.
    #[arg(long, value_name = "N,…", value_delimiter = ',', default_value = "1,8")]
    pub concurrency: Vec<usize>,
}

impl EppArgs {
    /// The defaults with `common`.
    pub fn with(common: Common) -> Self {
        Self {
            common,
            requests: 1000,
            concurrency: vec![1, 8],
        }
    }
}

/// A workload's request bodies.
struct Workload {
    name: &'static str,
    /// Words of the user's message (about one token each).
    words: usize,
    /// Every line opens with the request's tag: no line was seen before,
    /// so the tokenizer's segment cache has nothing of it.
    unseen: bool,
}

const WORKLOADS: [Workload; 3] = [
    Workload {
        name: "short chat",
        words: 0,
        unseen: false,
    },
    Workload {
        name: "2 000-token chat",
        words: 2000,
        unseen: false,
    },
    Workload {
        name: "2 000-token chat, unseen lines",
        words: 2000,
        unseen: true,
    },
];

/// Texts the long requests take in turn.
const TEXTS: usize = 64;
/// Words per line of a long text.
const LINE_WORDS: usize = 50;

/// `TEXTS` texts of `words` common words (about a token each) in lines
/// of [`LINE_WORDS`].
fn texts(words: usize) -> Vec<Vec<String>> {
    const VOCABULARY: [&str; 24] = [
        "the", "engine", "holds", "a", "cache", "of", "every", "prompt", "and", "gateway", "routes", "each", "request",
        "to", "where", "its", "prefix", "is", "warm", "while", "load", "stays", "even", "today",
    ];
    let mut rng = semlb_test_support::rng::Rng::from_seed(42);
    (0..TEXTS)
        .map(|_| {
            (0..words.div_ceil(LINE_WORDS))
                .map(|_| {
                    let line: Vec<&str> = (0..LINE_WORDS)
                        .map(|_| VOCABULARY[rng.index(VOCABULARY.len())])
                        .collect();
                    line.join(" ")
                })
                .collect()
        })
        .collect()
}

/// Request `i`'s body: a one-line question, or a tag line and long text
/// `i % TEXTS` (each line behind the tag when `unseen`).
fn body(workload: &Workload, texts: &[Vec<String>], i: usize) -> String {
    let content = if workload.words == 0 {
        format!("Question {i}: what is {i} cubed?")
    } else {
        let tag = format!("Request {i} of the run.");
        let text = &texts[i % texts.len()];
        let lines: Vec<String> = text
            .iter()
            .map(|l| {
                if workload.unseen {
                    format!("{tag} {l}")
                } else {
                    l.clone()
                }
            })
            .collect();
        format!("{tag}\n{}", lines.join("\n"))
    };
    json!({"model": "semlb-sim", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}).to_string()
}

fn message(request: processing_request::Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..ProcessingRequest::default()
    }
}

/// A canned engine answer (JSON with usage).
const ANSWER: &str = r#"{"id":"c","object":"chat.completion","model":"semlb-sim","choices":[{"index":0,"message":{"role":"assistant","content":"Four words of answer."},"finish_reason":"length"}],"usage":{"prompt_tokens":10,"completion_tokens":4,"total_tokens":14}}"#;

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

/// `bodies` in `concurrency` nearly equal parts.
fn parts(bodies: Vec<String>, concurrency: usize) -> Vec<Vec<String>> {
    let mut out: Vec<Vec<String>> = vec![Vec::new(); concurrency.max(1)];
    let n = out.len();
    for (i, b) in bodies.into_iter().enumerate() {
        out[i % n].push(b);
    }
    out
}

/// What one run of a path is asked.
struct Run<'a> {
    /// The dispatcher's pid.
    pid: i32,
    workload: &'a Workload,
    texts: &'a [Vec<String>],
    requests: usize,
    /// Streams (picker) or connections (proxy) at once.
    concurrency: usize,
}

/// The picker's figures: `run.concurrency` streams at once on one HTTP/2
/// connection, as Envoy multiplexes them.
fn picker(addr: &str, run: &Run<'_>) -> Result<Figures> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let warmup = run.requests.min(200);
    runtime.block_on(async {
        let mut client = ExternalProcessorClient::connect(format!("http://{addr}")).await?;
        for i in 0..warmup {
            through_picker(&mut client, body(run.workload, run.texts, i)).await?;
        }
        let bodies: Vec<String> = (warmup..warmup + run.requests)
            .map(|i| body(run.workload, run.texts, i))
            .collect();
        let before = CpuSnapshot::of(&[run.pid]);
        let streams = parts(bodies, run.concurrency).into_iter().map(|part| {
            let mut client = client.clone();
            async move {
                let mut ns = Vec::with_capacity(part.len());
                for b in part {
                    ns.push(through_picker(&mut client, b).await?);
                }
                Ok::<_, anyhow::Error>(ns)
            }
        });
        let ns: Vec<f64> = futures_util::future::try_join_all(streams).await?.concat();
        let cpu = cpu_between(&before, &CpuSnapshot::of(&[run.pid]));
        let (p50_us, p99_us) = quantiles(ns);
        Ok(Figures {
            p50_us,
            p99_us,
            cpu_us: cpu * 1e6 / run.requests as f64,
            dispatch_p50_us: None,
        })
    })
}

/// One keep-alive connection's requests through the proxy: round trips
/// and dispatch times (ns).
fn proxied(addr: &str, bodies: Vec<String>) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut client = semlb_test_support::keepalive::KeepAlive::new(addr);
    let (mut ns, mut dispatch) = (Vec::with_capacity(bodies.len()), Vec::with_capacity(bodies.len()));
    for b in bodies {
        let start = Instant::now();
        let answer = client
            .post("/v1/chat/completions", &b, &[])
            .map_err(anyhow::Error::msg)?;
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
    Ok((ns, dispatch))
}

/// The HTTP proxy's figures: `run.concurrency` keep-alive connections.
fn proxy(addr: &str, run: &Run<'_>) -> Result<Figures> {
    // Request numbers of their own: no prompt repeats the picker's.
    let first = 1_000_000;
    let warmup = run.requests.min(200);
    let warm: Vec<String> = (first..first + warmup)
        .map(|i| body(run.workload, run.texts, i))
        .collect();
    proxied(addr, warm)?;
    let bodies: Vec<String> = (first + warmup..first + warmup + run.requests)
        .map(|i| body(run.workload, run.texts, i))
        .collect();
    let before = CpuSnapshot::of(&[run.pid]);
    let results: Vec<Result<(Vec<f64>, Vec<f64>)>> = std::thread::scope(|scope| {
        let threads: Vec<_> = parts(bodies, run.concurrency)
            .into_iter()
            .map(|part| scope.spawn(move || proxied(addr, part)))
            .collect();
        threads
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a client thread panicked")))
            })
            .collect()
    });
    let cpu = cpu_between(&before, &CpuSnapshot::of(&[run.pid]));
    let (mut ns, mut dispatch) = (Vec::new(), Vec::new());
    for r in results {
        let (n, d) = r?;
        ns.extend(n);
        dispatch.extend(d);
    }
    let (p50_us, p99_us) = quantiles(ns);
    let dispatch_p50_us = (!dispatch.is_empty()).then(|| quantiles(dispatch).0);
    Ok(Figures {
        p50_us,
        p99_us,
        cpu_us: cpu * 1e6 / run.requests as f64,
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

/// The ext_proc floor's process ([`crate::epp_floor`]), killed when
/// dropped.
struct Floor {
    child: std::process::Child,
    addr: String,
}

impl Floor {
    fn start() -> Result<Self> {
        use std::io::BufRead;
        let exe = std::env::current_exe().context("cannot find this executable")?;
        let mut child = std::process::Command::new(exe)
            .arg("__null-ext-proc")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .context("starting the ext_proc floor")?;
        let stdout = child.stdout.take().context("the floor's stdout")?;
        let mut addr = String::new();
        std::io::BufReader::new(stdout).read_line(&mut addr)?;
        let addr = addr.trim().to_owned();
        if addr.is_empty() {
            let _ = child.kill();
            bail!("the ext_proc floor printed no address");
        }
        Ok(Self { child, addr })
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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
    let floor = Floor::start()?;
    let mut table = Table::new([
        "workload",
        "at once",
        "path",
        "round trip p50",
        "p99",
        "dispatch p50",
        "dispatcher CPU / request",
    ]);
    let mut rows = Vec::new();
    let long = texts(2000);
    for workload in &WORKLOADS {
        for &concurrency in &args.concurrency {
            let run = Run {
                pid,
                workload,
                texts: &long,
                requests: args.requests,
                concurrency,
            };
            let p = picker(&picker_addr, &run)?;
            let h = proxy(gw.addr(), &run)?;
            let n = picker(
                &floor.addr,
                &Run {
                    pid: floor.pid(),
                    ..run
                },
            )?;
            for (path, f) in [
                ("picker (ext_proc)", &p),
                ("HTTP proxy", &h),
                ("ext_proc floor (answers only)", &n),
            ] {
                table.row([
                    workload.name.to_owned(),
                    concurrency.to_string(),
                    path.to_owned(),
                    format!("{:.1} µs", f.p50_us),
                    format!("{:.1} µs", f.p99_us),
                    f.dispatch_p50_us.map_or("-".to_owned(), |d| format!("{d:.1} µs")),
                    format!("{:.1} µs", f.cpu_us),
                ]);
                rows.push(json!({
                    "workload": workload.name,
                    "concurrency": concurrency,
                    "path": path,
                    "round_trip_p50_us": f.p50_us,
                    "round_trip_p99_us": f.p99_us,
                    "dispatch_p50_us": f.dispatch_p50_us,
                    "cpu_us_per_request": f.cpu_us,
                }));
            }
            eprintln!(
                "{} at {concurrency}: the picker's CPU per decision is {:.2} of the proxy's per request",
                workload.name,
                p.cpu_us / h.cpu_us
            );
        }
    }
    print_table(
        &format!("endpoint picker vs HTTP proxy ({} requests each)", args.requests),
        &table,
    );
    let out: PathBuf = args.common.out.clone();
    write_json(&out, "epp", &json!({"requests": args.requests, "rows": rows}))?;
    Ok(())
}
