//! `semlb bench proxy`: what the gateway costs in front of an engine,
//! against nginx in front of the same engine.
//!
//! # Set-up
//!
//! One simulated engine, reached three ways side by side in one run:
//!
//! 1. **direct**: client → engine;
//! 2. **semlb**: client → `semlb serve` (1 dispatcher, 1 responder, a
//!    throw-away 64 MiB shm segment) → engine;
//! 3. **nginx**: client → Debian's `nginx` (a private master + 1 worker on
//!    loopback, configuration below) → engine.
//!
//! The **front** (semlb's supervisor, dispatcher and responder; nginx's
//! master and worker) runs on `--front-cpu` (default CPU 0); the engine and
//! the load generator on `--other-cpus` (default: every other CPU this
//! process may use). Affinities are set between fork and exec, so a
//! front's children inherit them; the report reads every front process's
//! `Cpus_allowed_list` back and prints it.
//!
//! The engine is `semlb-sim` when it sits next to this executable (build
//! it with `cargo build --release -p semlb -p semlb-bench -p semlb-workers`) or is given
//! with `--sim`, started with the same Qwen3 `tokenizer.json` and
//! `tokenizer_config.json` (chat template) as the gateway when the data
//! directory has them; otherwise the hidden `semlb __sim` (bundled phi-2
//! tokenizer, canonical template; said so in the output). Its time scale
//! is `--time-scale` (default 0.0001: a 2 000-token prefill is 20 µs and a
//! decode step 1 µs of real time), so it answers in well under a
//! millisecond and the fronts' costs are what differ.
//!
//! # nginx
//!
//! Started as `nginx -p DIR/ -c DIR/nginx.conf -e DIR/error.log` in a
//! fresh temporary directory (removed at the end) with this configuration
//! (`DIR`, `PORT` and `ENGINE` filled in):
//!
//! ```text
//! daemon off;
//! master_process on;
//! worker_processes 1;
//! pid DIR/nginx.pid;
//! error_log DIR/error.log warn;
//!
//! events {
//!     worker_connections 1024;
//! }
//!
//! http {
//!     access_log off;
//!     client_body_temp_path DIR/client_body;
//!     proxy_temp_path DIR/proxy;
//!     fastcgi_temp_path DIR/fastcgi;
//!     uwsgi_temp_path DIR/uwsgi;
//!     scgi_temp_path DIR/scgi;
//!     client_body_buffer_size 1m;      # request bodies stay in memory
//!     keepalive_requests 1000000;      # the default (1 000) would close
//!     keepalive_timeout 75s;           # connections during a run
//!
//!     upstream engine {
//!         server ENGINE;
//!         keepalive 64;
//!         keepalive_requests 1000000;
//!     }
//!
//!     server {
//!         listen 127.0.0.1:PORT;
//!         location / {
//!             proxy_pass http://engine;
//!             proxy_http_version 1.1;
//!             proxy_set_header Connection "";
//!             proxy_buffering off;         # as for SSE
//!         }
//!     }
//! }
//! ```
//!
//! Without nginx (`--nginx PATH` not found) its rows are skipped with a
//! message.
//!
//! # Workloads
//!
//! * **short**: `{"model":"semlb-sim","messages":[{"role":"user","content":
//!   "Say hello in one short sentence please."}],"max_tokens":16}`, the
//!   same body every time;
//! * **long**: a chat request whose one user message is ~`--prompt-tokens`
//!   (2 000) tokens of real HH-RLHF dialogue text (`<data>/prompts/…`;
//!   generated text without it), 64 different texts used in turn, each
//!   request opening with its own tag (`Request <connection>.<n>.`), so no
//!   two requests are alike; `max_tokens` 16. After warm-up the gateway's
//!   segment cache holds every line of the texts but the tagged first one,
//!   as it does for shared system prompts, documents and earlier turns;
//! * **long-unseen**: the same prompts with the tag opening every line, so
//!   no line of any request was seen before (the tokenizer's word cache
//!   still serves common words, as for any new text);
//! * **short-responses**: the short request as OpenAI's Responses API,
//!   `POST /v1/responses` with `{"model":"semlb-sim","input":"Say hello in
//!   one short sentence please.","max_output_tokens":16,"store":false}`;
//! * **short-messages**: the short request as Anthropic's Messages API,
//!   `POST /v1/messages` with `{"model":"semlb-sim","messages":[{"role":
//!   "user","content":"Say hello in one short sentence please."}],
//!   "max_tokens":16}`. Both are inference through the gateway (rendered
//!   with the chat template and routed by prefix, as chat completions);
//!   beside `short` they give the gateway's CPU per request for each API.
//!
//! Neither has `temperature` 0 or a `seed`, so both are non-deterministic
//! (`semlb::response_cache::is_deterministic`): the gateway neither looks
//! them up in its response cache nor stores them, and each answer's
//! `x-semlb-cache` header (counted in the JSON) says `bypass`. Both are
//! non-streaming by default; `--stream` adds `"stream":true` (SSE; then
//! the time to the first output event is recorded too: the first chunk of
//! chat, the first `response.output_text.delta` of Responses, the first
//! `content_block_delta` of Messages; a Responses stream is complete at
//! `response.completed`, a Messages stream at `message_stop`, chat's at
//! `data: [DONE]`). Every answer has 16 output
//! tokens (`--max-tokens`).
//!
//! # Measurement
//!
//! For each workload × `--connections` (default 1, 4, 16) × front:
//! `N` keep-alive connections in a closed loop (each sends its next request
//! as soon as the previous answer is complete) for `--warmup` seconds
//! (default 1, not recorded) then `--secs` seconds (default 5), from an
//! in-process client ([`load`]: raw HTTP/1.1 on tokio, one pinned thread
//! per other CPU). Answers completed inside the window count:
//!
//! * **req/s**: 200 answers / window;
//! * **p50 / p99**: client-side latency, request written → answer complete;
//! * **added p50 / p99**: the front's p50 / p99 minus direct's at the same
//!   workload and concurrency (what the hop costs in latency);
//! * **CPU µs/req**: user + system CPU time of every front process
//!   (`/proc/<pid>/stat` of the front's root and all its descendants) over
//!   the window, divided by the 200 answers; the engine's and the load
//!   generator's likewise, for context;
//! * **core %**, `ours+others`: that CPU time over the window per CPU (the
//!   front's on `--front-cpu`; the engine + load generator on the others),
//!   then what other processes used of the same CPUs (`/proc/stat` busy
//!   time minus ours; on a shared machine they fill what the run leaves
//!   idle): the side whose own share nears 100 % is the one that saturates;
//!   a warning is printed when others used more than 10 %;
//! * **errors**: non-200 answers, transport failures (refused or reset
//!   connections, timeouts, malformed answers, streams without
//!   `data: [DONE]`); reported, never hidden.
//!
//! The runs are interleaved (for each workload and concurrency: direct,
//! semlb, nginx), so slow drifts of the shared machine spread over the
//! three; the servers stay up for the whole run.
//!
//! # Output
//!
//! A table per workload on stdout (with `semlb/nginx`, the ratio of the two
//! fronts' CPU per request at each concurrency), `<out>/proxy.json` with
//! every figure and setting, and `<out>/proxy.svg`: per workload, the
//! fronts' CPU µs/request and added p50 latency over the concurrency.
//!
//! Every server is stopped when the report ends, on an error too; SIGINT
//! or SIGTERM stop the run and then the servers (see [`procs`]).
//!
//! | module | what it holds |
//! | --- | --- |
//! | [`workloads`] | the request mixes and their prompt text |
//! | [`procs`] | CPU sets and pinning, the servers' processes, CPU time from `/proc` |
//! | [`servers`] | the engine and the fronts of a run, and a check request through each |
//! | [`load`] | the closed-loop HTTP/1.1 load generator |
//! | [`measure`](mod@measure) | one point: a measured window and its CPU time |
//! | [`report`] | the tables, `proxy.json` and `proxy.svg` |
//! | here | the flags and the run: every point in turn |

pub mod load;
mod measure;
pub mod procs;
mod report;
mod servers;
mod workloads;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, ValueEnum};

use super::Common;
use super::output;
use measure::measure;
use procs::{CpuList, Interrupt, Placement};
use report::Run;
use servers::{check, engine_spec, start_servers};
use workloads::{TextSource, Workload, build_workload};

/// The chat template, relative to the data directory.
pub const TEMPLATE_FILE: &str = "tokenizers/qwen3-tokenizer_config.json";

/// `semlb bench proxy` flags.
#[derive(Debug, Clone, Args)]
pub struct ProxyArgs {
    /// Common flags (`--out`, `--data`; the Redis ones are not used).
    #[command(flatten)]
    pub common: Common,
    /// Measured seconds per point.
    #[arg(long, value_name = "S", default_value_t = 5.0)]
    pub secs: f64,
    /// Warm-up seconds before each measured window (same connections, not recorded).
    #[arg(long, value_name = "S", default_value_t = 1.0)]
    pub warmup: f64,
    /// Concurrent keep-alive connections, one point each.
    #[arg(long, value_name = "N,…", value_delimiter = ',', default_value = "1,4,16")]
    pub connections: Vec<usize>,
    /// The workloads to run.
    #[arg(
        long,
        value_name = "W,…",
        value_enum,
        value_delimiter = ',',
        default_value = "short,long,long-unseen"
    )]
    pub workloads: Vec<WorkloadKind>,
    /// The fronts to measure (direct is needed for the added latency).
    #[arg(
        long,
        value_name = "F,…",
        value_enum,
        value_delimiter = ',',
        default_value = "direct,semlb,nginx"
    )]
    pub fronts: Vec<Front>,
    /// Stream the answers (SSE) instead of one JSON body.
    #[arg(long)]
    pub stream: bool,
    /// Prompt length of the long workload, in tokens of the tokenizer.
    #[arg(long, value_name = "TOKENS", default_value_t = 2000)]
    pub prompt_tokens: usize,
    /// `max_tokens` of every request (the engine generates that many).
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub max_tokens: u32,
    /// `--time-scale` of the simulated engine (real seconds per simulated second).
    #[arg(long, value_name = "F", default_value_t = 0.0001)]
    pub time_scale: f64,
    /// CPUs of the front (semlb's or nginx's processes).
    #[arg(long, value_name = "CPUS", default_value = "0")]
    pub front_cpu: CpuList,
    /// CPUs of the engine and the load generator [default: every other CPU
    /// this process may use].
    #[arg(long, value_name = "CPUS")]
    pub other_cpus: Option<CpuList>,
    /// The nginx binary.
    #[arg(long, value_name = "PATH", default_value = "nginx")]
    pub nginx: PathBuf,
    /// The `semlb-sim` binary [default: next to this executable, else the
    /// built-in `semlb __sim`].
    #[arg(long, value_name = "PATH")]
    pub sim: Option<PathBuf>,
}

impl ProxyArgs {
    /// The defaults, with `common`.
    pub fn with(common: Common) -> Self {
        Self {
            common,
            secs: 5.0,
            warmup: 1.0,
            connections: vec![1, 4, 16],
            workloads: vec![WorkloadKind::Short, WorkloadKind::Long, WorkloadKind::LongUnseen],
            fronts: vec![Front::Direct, Front::Semlb, Front::Nginx],
            stream: false,
            prompt_tokens: 2000,
            max_tokens: 16,
            time_scale: 0.0001,
            front_cpu: CpuList::new(vec![0]),
            other_cpus: None,
            nginx: PathBuf::from("nginx"),
            sim: None,
        }
    }
}

/// What sits between the client and the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum Front {
    /// Nothing: the client talks to the engine.
    Direct,
    /// `semlb serve`.
    Semlb,
    /// nginx as a reverse proxy.
    Nginx,
}

impl Front {
    fn name(self) -> &'static str {
        match self {
            Front::Direct => "direct",
            Front::Semlb => "semlb",
            Front::Nginx => "nginx",
        }
    }
}

/// The request mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WorkloadKind {
    /// A one-line chat request.
    Short,
    /// A ~2 000-token chat prompt, different every time (64 texts in
    /// turn behind a per-request tag: after warm-up, the gateway's segment
    /// cache holds every line but the first).
    Long,
    /// The same prompts with the per-request tag opening every line, so no
    /// line was seen before: tokenization with no segment cache hit.
    LongUnseen,
    /// The short request as OpenAI's Responses API (`POST /v1/responses`).
    ShortResponses,
    /// The short request as Anthropic's Messages API (`POST /v1/messages`).
    ShortMessages,
}

impl WorkloadKind {
    fn name(self) -> &'static str {
        match self {
            WorkloadKind::Short => "short",
            WorkloadKind::Long => "long",
            WorkloadKind::LongUnseen => "long-unseen",
            WorkloadKind::ShortResponses => "short-responses",
            WorkloadKind::ShortMessages => "short-messages",
        }
    }

    /// The path its requests go to.
    fn path(self) -> &'static str {
        match self {
            WorkloadKind::ShortResponses => "/v1/responses",
            WorkloadKind::ShortMessages => "/v1/messages",
            WorkloadKind::Short | WorkloadKind::Long | WorkloadKind::LongUnseen => "/v1/chat/completions",
        }
    }
}

/// Runs the report.
pub fn run(args: &ProxyArgs) -> Result<()> {
    if !(args.secs > 0.0 && args.warmup >= 0.0) {
        bail!("--secs must be positive and --warmup not negative");
    }
    if args.connections.is_empty() || args.connections.contains(&0) {
        bail!("--connections must list counts of at least 1");
    }
    if args.workloads.is_empty() || args.fronts.is_empty() {
        bail!("--workloads and --fronts must name at least one each");
    }
    if !(args.time_scale.is_finite() && args.time_scale > 0.0) {
        bail!("--time-scale must be a positive number");
    }
    let finished = Arc::new(AtomicBool::new(false));
    let interrupt = Interrupt::watch(finished.clone())?;
    let allowed = CpuList::of_this_thread().context("cannot read this process's CPU affinity")?;
    let result = run_pinned(args, &allowed, &interrupt);
    // Back on every CPU it had (for `bench all`), whatever happened.
    let _ = allowed.pin_this_thread();
    finished.store(true, Ordering::Relaxed);
    result
}

fn run_pinned(args: &ProxyArgs, allowed: &CpuList, interrupt: &Interrupt) -> Result<()> {
    let front_cpus = args.front_cpu.clone();
    let other = args.other_cpus.clone().unwrap_or_else(|| allowed.without(&front_cpus));
    if other.cpus().is_empty() {
        bail!(
            "no CPU is left for the engine and the load generator (this process may use {allowed}, the front has \
             {front_cpus}); pass --other-cpus"
        );
    }
    for (flag, cpus) in [("--front-cpu", &front_cpus), ("--other-cpus", &other)] {
        if !cpus.is_subset(allowed) {
            bail!("{flag} {cpus}: this process may only use CPUs {allowed}");
        }
    }
    let overlap = !other.without(&front_cpus).cpus().eq(other.cpus());
    // This thread (the timer and /proc reader) and every thread it starts
    // from now on run on the other CPUs; the servers get theirs at exec.
    other
        .pin_this_thread()
        .with_context(|| format!("cannot pin the load generator to CPUs {other}"))?;

    let text = TextSource::load(&args.common)?;
    let mut workloads: Vec<Workload> = args.workloads.iter().map(|k| build_workload(*k, args, &text)).collect();
    let engine_spec = engine_spec(args, &text)?;
    let servers = start_servers(args, &text, &engine_spec, &front_cpus, &other, interrupt)?;
    let mut fronts: Vec<Front> = args.fronts.clone();
    fronts.sort();
    fronts.dedup();
    fronts.retain(|f| servers.addr(*f).is_some());
    if let Some(why) = &servers.nginx_skipped {
        eprintln!("semlb bench proxy: skipping the nginx rows: {why}");
    }
    // One request of each workload through each front, before measuring.
    for w in &mut workloads {
        for f in &fronts {
            let tokens = check(servers.addr(*f).expect("a live front"), w, *f).map_err(|e| {
                let tail = match f {
                    Front::Semlb => servers.gateway.as_ref().map(|g| g.server.stderr_tail()),
                    Front::Nginx => servers.nginx.as_ref().map(|n| n.server.stderr_tail()),
                    Front::Direct => Some(servers.engine.stderr_tail()),
                };
                anyhow!("{e:#}{}", tail.unwrap_or_default())
            })?;
            // Direct's answer first (fronts are sorted), else a front's.
            w.engine_prompt_tokens = w.engine_prompt_tokens.or(tokens);
        }
    }
    let placement: Vec<(&'static str, Vec<Placement>)> = fronts
        .iter()
        .filter_map(|f| servers.front_pid(*f).map(|pid| (f.name(), procs::tree_placement(pid))))
        .chain([("engine", procs::tree_placement(servers.engine.pid()))])
        .collect();

    let per_point = (args.warmup + args.secs).ceil() as u64;
    let total = per_point * (workloads.len() * args.connections.len() * fronts.len()) as u64;
    let bar = output::progress(total, "proxy");
    let mut points = Vec::new();
    for w in &workloads {
        for &c in &args.connections {
            for &f in &fronts {
                if let Some(p) = measure(args, &servers, w, f, c, &front_cpus, &other, &bar, interrupt)? {
                    points.push(p);
                }
            }
        }
    }
    bar.finish_and_clear();
    let nginx_info = servers.nginx.as_ref().map(|n| (n.version.clone(), n.config.clone()));
    let nginx_skipped = servers.nginx_skipped.clone();
    drop(servers);

    report::write(
        args,
        &Run {
            text: &text,
            engine: &engine_spec,
            workloads: &workloads,
            points: &points,
            front_cpus: &front_cpus,
            other: &other,
            overlap,
            placement: &placement,
            nginx: nginx_info,
            nginx_skipped,
        },
    )
}
