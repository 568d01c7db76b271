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
//!   still serves common words, as for any new text).
//!
//! Neither has `temperature` 0 or a `seed`, so both are non-deterministic
//! (`semlb::response_cache::is_deterministic`): the gateway neither looks
//! them up in its response cache nor stores them, and each answer's
//! `x-semlb-cache` header (counted in the JSON) says `bypass`. Both are
//! non-streaming by default; `--stream` adds `"stream":true` (SSE; then
//! the time to the first event is recorded too). Every answer has 16 output
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

pub mod load;
pub mod procs;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, ValueEnum};
use semlb_tokenizer::Tokenizer;
use serde_json::{Value, json};

use super::Common;
use super::dispatch_path::{PROMPTS_FILE, TOKENIZER_FILE};
use super::end_to_end::{Dialogue, read_dialogues};
use super::output::{self, Table};
use super::plot::{self, Line};
use load::{Plan, Requests, Tally};
use procs::{Address, CpuList, CpuSnapshot, EngineSpec, Gateway, Interrupt, Nginx, NginxError, Placement, Server};

/// The chat template, relative to the data directory.
pub const TEMPLATE_FILE: &str = "tokenizers/qwen3-tokenizer_config.json";
/// The model name the simulated engine serves.
const MODEL: &str = "semlb-sim";
/// The short workload's message.
const SHORT_MESSAGE: &str = "Say hello in one short sentence please.";
/// Distinct texts of the long workload (each request also has its own tag).
const LONG_TEXTS: usize = 64;

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
}

impl WorkloadKind {
    fn name(self) -> &'static str {
        match self {
            WorkloadKind::Short => "short",
            WorkloadKind::Long => "long",
            WorkloadKind::LongUnseen => "long-unseen",
        }
    }
}

// ---------------------------------------------------------------------------
// Workloads.

/// A workload's requests and what describes them.
struct Workload {
    kind: WorkloadKind,
    requests: Arc<Requests>,
    /// Request body size (the first request's), bytes.
    body_bytes: usize,
    /// Prompt tokens of the message text (client-side count; long only).
    prompt_tokens: Option<f64>,
    /// Prompt tokens the engine counted (template included), from a check.
    engine_prompt_tokens: Option<u64>,
}

/// The tokenizer and prompt text the run uses.
struct TextSource {
    tokenizer: Tokenizer,
    tokenizer_name: String,
    /// `--tokenizer` / `--chat-template` for the gateway and `semlb-sim`.
    files: Option<(PathBuf, PathBuf)>,
    dialogues: Vec<Dialogue>,
    dialogues_name: String,
}

impl TextSource {
    fn load(common: &Common) -> Result<TextSource> {
        let data = common.data_dir();
        let file = |rel: &str| data.as_ref().map(|d| d.join(rel)).filter(|p| p.is_file());
        let (tokenizer, tokenizer_name, files) = match (file(TOKENIZER_FILE), file(TEMPLATE_FILE)) {
            (Some(tok), Some(template)) => (
                Tokenizer::from_file(&tok).with_context(|| format!("cannot load the tokenizer {}", tok.display()))?,
                format!("qwen3 ({}, chat template {})", tok.display(), template.display()),
                Some((tok, template)),
            ),
            _ => (
                Tokenizer::bundled(),
                "phi-2 (bundled) and the canonical chat template (no data directory)".to_owned(),
                None,
            ),
        };
        let (dialogues, dialogues_name) = match file(PROMPTS_FILE).map(|p| (read_dialogues(&p), p)) {
            Some((Ok(d), path)) if !d.is_empty() => (d, format!("HH-RLHF ({})", path.display())),
            _ => (
                generated_dialogues(),
                "generated text (no HH-RLHF file in the data directory)".to_owned(),
            ),
        };
        Ok(TextSource {
            tokenizer,
            tokenizer_name,
            files,
            dialogues,
            dialogues_name,
        })
    }

    /// A transcript of dialogue `i`.
    fn transcript(&self, i: usize) -> String {
        let d = &self.dialogues[i % self.dialogues.len()];
        let mut s = String::new();
        for (user, answer) in &d.turns {
            s.push_str("Human: ");
            s.push_str(user);
            s.push_str("\n\nAssistant: ");
            s.push_str(answer);
            s.push_str("\n\n");
        }
        s
    }

    /// About `tokens` tokens of dialogue text starting at dialogue `start`,
    /// and its exact token count.
    /// Text for the long-unseen workload: about `tokens` tokens once a
    /// typical request tag opens every line; the count is of that form.
    fn tagged_text_of(&self, start: usize, tokens: usize) -> (String, usize) {
        let tag = load::line_tag(7, 123_456);
        let mut want = tokens;
        let mut best = (String::new(), 0);
        for _ in 0..6 {
            let (text, _) = self.text_of(start, want);
            let count = self.tokenizer.encode(&load::tag_lines(&text, "\n", &tag)).len();
            best = (text, count);
            if count.abs_diff(tokens) <= tokens / 100 {
                break;
            }
            want = (want * tokens / count.max(1)).max(1);
        }
        best
    }

    fn text_of(&self, start: usize, tokens: usize) -> (String, usize) {
        let mut text = String::new();
        let mut next = start;
        let mut count = 0;
        // Whole dialogues until there are enough tokens...
        while count < tokens {
            while text.len() < tokens * 5 + 64 {
                text.push_str(&self.transcript(next));
                next += 1;
            }
            count = self.tokenizer.encode(&text).len();
            if count < tokens {
                text.push_str(&self.transcript(next));
                next += 1;
            }
        }
        // ...then cut in proportion (on a character boundary), a few times.
        for _ in 0..6 {
            if count.abs_diff(tokens) <= tokens / 200 {
                break;
            }
            let mut cut = (text.len() as f64 * tokens as f64 / count as f64) as usize;
            while cut < text.len() && !text.is_char_boundary(cut) {
                cut += 1;
            }
            if cut >= text.len() {
                text.push_str(&self.transcript(next));
                next += 1;
            } else {
                text.truncate(cut);
            }
            count = self.tokenizer.encode(&text).len();
        }
        (text, count)
    }
}

/// Dialogues when there is no HH-RLHF file: varied sentences.
fn generated_dialogues() -> Vec<Dialogue> {
    let subjects = [
        "the garden",
        "a bicycle",
        "bread",
        "the weather",
        "a letter",
        "the library",
        "music",
    ];
    let verbs = ["improve", "explain", "fix", "plan", "choose", "describe", "clean"];
    (0..500)
        .map(|i| Dialogue {
            turns: (0..3)
                .map(|t| {
                    let s = subjects[(i + t) % subjects.len()];
                    let v = verbs[(i * 3 + t) % verbs.len()];
                    (
                        format!("How do I {v} {s}? I tried a few things already (case {i}.{t})."),
                        format!(
                            "To {v} {s}, start small: look at what works, change one thing at a time, \
                             and write down what happens. Most people find that {s} responds well \
                             to patience, and that a second attempt goes faster than the first."
                        ),
                    )
                })
                .collect(),
        })
        .collect()
}

/// The JSON of a chat body, split around its message text.
fn chat_parts(max_tokens: u32, stream: bool) -> (String, String) {
    let head = format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":""#);
    let stream = if stream { r#","stream":true"# } else { "" };
    let tail = format!(r#""}}],"max_tokens":{max_tokens}{stream}}}"#);
    (head, tail)
}

fn build_workload(kind: WorkloadKind, args: &ProxyArgs, text: &TextSource) -> Workload {
    let (head, tail) = chat_parts(args.max_tokens, args.stream);
    let (requests, prompt_tokens) = match kind {
        WorkloadKind::Short => (
            Requests::Fixed(Requests::http(format!("{head}{SHORT_MESSAGE}{tail}").as_bytes())),
            None,
        ),
        WorkloadKind::Long | WorkloadKind::LongUnseen => {
            let step = (text.dialogues.len() / LONG_TEXTS).max(1);
            let (texts, counts): (Vec<String>, Vec<usize>) = (0..LONG_TEXTS)
                .map(|i| {
                    let (t, n) = match kind {
                        WorkloadKind::LongUnseen => text.tagged_text_of(i * step, args.prompt_tokens),
                        _ => text.text_of(i * step, args.prompt_tokens),
                    };
                    let escaped = serde_json::to_string(&t).expect("a string serialises");
                    (escaped[1..escaped.len() - 1].to_owned(), n)
                })
                .unzip();
            let mean = counts.iter().sum::<usize>() as f64 / counts.len() as f64;
            let every_line = kind == WorkloadKind::LongUnseen;
            let requests = Requests::Tagged {
                head,
                texts,
                tail,
                every_line,
            };
            (requests, Some(mean))
        }
    };
    let body_bytes = requests.body(0, 0).len();
    Workload {
        kind,
        requests: Arc::new(requests),
        body_bytes,
        prompt_tokens,
        engine_prompt_tokens: None,
    }
}

// ---------------------------------------------------------------------------
// Points.

/// One workload × front × concurrency.
struct Point {
    workload: WorkloadKind,
    front: Front,
    connections: usize,
    /// The measured window (answers completed in it count), s.
    window_s: f64,
    /// Between the two CPU snapshots, s.
    cpu_window_s: f64,
    tally: Tally,
    /// CPU seconds in the window: the front's (not for direct), the
    /// engine's, the load generator's (this process).
    front_cpu_s: Option<f64>,
    engine_cpu_s: f64,
    client_cpu_s: f64,
    /// Busy seconds of the front's CPUs and of the others in the window,
    /// whoever used them (this machine may be shared).
    front_busy_s: f64,
    other_busy_s: f64,
    front_cpus: usize,
    other_cpus: usize,
}

impl Point {
    fn req_per_s(&self) -> f64 {
        self.tally.ok() as f64 / self.window_s
    }

    fn latency(&self, q: f64) -> f64 {
        output::quantile(&self.tally.latency_us, q)
    }

    fn per_request_us(&self, cpu_s: f64) -> f64 {
        if self.tally.ok() == 0 {
            f64::NAN
        } else {
            cpu_s * 1e6 / self.tally.ok() as f64
        }
    }

    fn front_cpu_us(&self) -> Option<f64> {
        self.front_cpu_s.map(|s| self.per_request_us(s))
    }

    /// The engine's and the load generator's share of the other CPUs.
    fn other_util(&self) -> f64 {
        (self.engine_cpu_s + self.client_cpu_s) / self.cpu_window_s / self.other_cpus as f64
    }

    /// The front's share of its CPUs (0 for direct).
    fn front_util(&self) -> f64 {
        self.front_cpu_s.unwrap_or(0.0) / self.cpu_window_s / self.front_cpus as f64
    }

    /// The share of the front's CPUs used by processes not in this run.
    fn front_foreign(&self) -> f64 {
        (self.front_busy_s / self.cpu_window_s / self.front_cpus as f64 - self.front_util()).max(0.0)
    }

    /// The share of the other CPUs used by processes not in this run.
    fn other_foreign(&self) -> f64 {
        (self.other_busy_s / self.cpu_window_s / self.other_cpus as f64 - self.other_util()).max(0.0)
    }
}

/// The servers of the run.
struct Servers {
    engine: Server,
    gateway: Option<Gateway>,
    nginx: Option<Nginx>,
    nginx_skipped: Option<String>,
}

impl Servers {
    fn addr(&self, front: Front) -> Option<&str> {
        match front {
            Front::Direct => Some(&self.engine.addr),
            Front::Semlb => self.gateway.as_ref().map(|g| g.server.addr.as_str()),
            Front::Nginx => self.nginx.as_ref().map(|n| n.server.addr.as_str()),
        }
    }

    fn front_pid(&self, front: Front) -> Option<i32> {
        match front {
            Front::Direct => None,
            Front::Semlb => self.gateway.as_ref().map(|g| g.server.pid()),
            Front::Nginx => self.nginx.as_ref().map(|n| n.server.pid()),
        }
    }
}

/// The engine to run: `--sim`, `semlb-sim` next to this executable, or
/// `semlb __sim`.
fn engine_spec(args: &ProxyArgs, text: &TextSource) -> Result<EngineSpec> {
    let here = std::env::current_exe().context("cannot find the current executable")?;
    let sibling = here.with_file_name("semlb-sim");
    let exe = crate::semlb_exe()?;
    let sim = args.sim.clone().or_else(|| sibling.is_file().then_some(sibling));
    let scale = args.time_scale.to_string();
    Ok(match sim {
        Some(program) => {
            let mut a: Vec<String> = ["--listen", "127.0.0.1:0", "--time-scale", &scale]
                .map(str::to_owned)
                .into();
            let tokenizer = match &text.files {
                Some((tok, template)) => {
                    a.extend([
                        "--tokenizer".into(),
                        tok.display().to_string(),
                        "--chat-template".into(),
                        template.display().to_string(),
                    ]);
                    "the gateway's tokenizer and chat template"
                }
                None => "the bundled phi-2 tokenizer and the canonical template",
            };
            EngineSpec {
                description: format!("{} (time scale {scale}; {tokenizer})", program.display()),
                program,
                args: a,
            }
        }
        None => EngineSpec {
            description: format!(
                "semlb __sim (time scale {scale}; bundled phi-2 tokenizer, canonical template: no semlb-sim next to \
                 {}; `cargo build --release -p semlb-workers` or --sim PATH gives the engine the gateway's tokenizer)",
                here.display()
            ),
            args: ["__sim", "--listen", "127.0.0.1:0", "--time-scale", &scale]
                .map(str::to_owned)
                .into(),
            program: exe,
        },
    })
}

fn start_servers(
    args: &ProxyArgs,
    text: &TextSource,
    engine: &EngineSpec,
    front: &CpuList,
    other: &CpuList,
    interrupt: &Interrupt,
) -> Result<Servers> {
    let engine = Server::start(
        "the simulated engine",
        &engine.program,
        &engine.args,
        other,
        Address::Printed,
        Duration::from_secs(60),
        interrupt,
    )?;
    let gateway = if args.fronts.contains(&Front::Semlb) {
        let extra: Vec<String> = match &text.files {
            Some((tok, template)) => vec![
                "--tokenizer".into(),
                tok.display().to_string(),
                "--chat-template".into(),
                template.display().to_string(),
            ],
            None => Vec::new(),
        };
        Some(Gateway::start(&engine.addr, &extra, front, interrupt)?)
    } else {
        None
    };
    let (nginx, nginx_skipped) = if args.fronts.contains(&Front::Nginx) {
        match Nginx::start(&args.nginx, &engine.addr, front, interrupt) {
            Ok(n) => (Some(n), None),
            Err(NginxError::NotInstalled(why)) => (None, Some(why)),
            Err(NginxError::Other(e)) => return Err(e.context("starting nginx")),
        }
    } else {
        (None, None)
    };
    Ok(Servers {
        engine,
        gateway,
        nginx,
        nginx_skipped,
    })
}

/// One request of `workload` through `addr` on a fresh connection: the
/// engine's prompt token count, or an error with the answer.
fn check(addr: &str, workload: &Workload, front: Front) -> Result<Option<u64>> {
    use std::io::{Read, Write};
    // A connection number no load connection has.
    let body = workload.requests.body(1_000_000, 0);
    let mut s = std::net::TcpStream::connect(addr).with_context(|| format!("{}: cannot connect", front.name()))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    s.write_all(&body)?;
    let mut answer = Vec::new();
    s.read_to_end(&mut answer)
        .with_context(|| format!("{}: reading the answer", front.name()))?;
    let text = String::from_utf8_lossy(&answer);
    if !text.starts_with("HTTP/1.1 200") && !text.starts_with("HTTP/1.0 200") {
        bail!(
            "{} answered a {} request with {}",
            front.name(),
            workload.kind.name(),
            text.chars().take(600).collect::<String>()
        );
    }
    // `"prompt_tokens":N` in the JSON body, or in the stream's last events.
    Ok(text
        .rsplit_once("\"prompt_tokens\":")
        .and_then(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()))
}

/// Waits until `until`, moving the bar on; an error if interrupted.
fn wait_until(
    until: Instant,
    bar: &indicatif::ProgressBar,
    base: u64,
    t0: Instant,
    interrupt: &Interrupt,
) -> Result<()> {
    loop {
        interrupt.check()?;
        let now = Instant::now();
        bar.set_position(base + (now - t0).as_secs());
        if now >= until {
            return Ok(());
        }
        std::thread::sleep((until - now).min(Duration::from_millis(100)));
    }
}

#[allow(clippy::too_many_arguments)]
fn measure(
    args: &ProxyArgs,
    servers: &Servers,
    workload: &Workload,
    front: Front,
    connections: usize,
    front_cpus: &CpuList,
    other: &CpuList,
    bar: &indicatif::ProgressBar,
    interrupt: &Interrupt,
) -> Result<Option<Point>> {
    let Some(addr) = servers.addr(front) else {
        return Ok(None);
    };
    bar.set_message(format!("{} {} ×{connections}", workload.kind.name(), front.name()));
    let base = bar.position();
    let t0 = Instant::now();
    let from = t0 + Duration::from_secs_f64(args.warmup);
    let until = from + Duration::from_secs_f64(args.secs);
    let plan = Plan {
        addr: addr.to_owned(),
        connections,
        from,
        until,
        stream: args.stream,
    };
    let threads = load::spawn(plan, workload.requests.clone(), other, interrupt.clone());
    let me = std::process::id() as i32;
    let front_pid = servers.front_pid(front);
    let engine_pid = servers.engine.pid();
    let snapshot = || Snapshot {
        at: Instant::now(),
        front: front_pid.map(CpuSnapshot::tree),
        engine: CpuSnapshot::tree(engine_pid),
        client: CpuSnapshot::of(&[me]),
        busy: procs::cpu_busy(),
    };
    let window = wait_until(from, bar, base, t0, interrupt).and_then(|()| {
        let start = snapshot();
        wait_until(until, bar, base, t0, interrupt)?;
        Ok((start, snapshot()))
    });
    // The load threads stop at `until` (or at once when interrupted).
    let mut tally = load::join(threads);
    let (start, end) = window?;
    output::sort(&mut tally.latency_us);
    output::sort(&mut tally.ttft_us);
    bar.set_position(base + (args.warmup + args.secs).ceil() as u64);
    Ok(Some(Point {
        workload: workload.kind,
        front,
        connections,
        window_s: args.secs,
        // The snapshots are taken within a few ms of the window's ends.
        cpu_window_s: (end.at - start.at).as_secs_f64(),
        tally,
        front_cpu_s: start
            .front
            .as_ref()
            .zip(end.front.as_ref())
            .map(|(a, b)| procs::cpu_between(a, b)),
        engine_cpu_s: procs::cpu_between(&start.engine, &end.engine),
        client_cpu_s: procs::cpu_between(&start.client, &end.client),
        front_busy_s: procs::busy_between(&start.busy, &end.busy, front_cpus),
        other_busy_s: procs::busy_between(&start.busy, &end.busy, other),
        front_cpus: front_cpus.cpus().len(),
        other_cpus: other.cpus().len(),
    }))
}

/// What [`measure`] reads at each end of the window.
struct Snapshot {
    at: Instant,
    front: Option<CpuSnapshot>,
    engine: CpuSnapshot,
    client: CpuSnapshot,
    busy: std::collections::BTreeMap<usize, f64>,
}

// ---------------------------------------------------------------------------
// The report.

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

    report(
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

/// Everything the output is made of.
struct Run<'a> {
    text: &'a TextSource,
    engine: &'a EngineSpec,
    workloads: &'a [Workload],
    points: &'a [Point],
    front_cpus: &'a CpuList,
    other: &'a CpuList,
    overlap: bool,
    /// Where each server's processes may run (`semlb`, `nginx`, `engine`).
    placement: &'a [(&'static str, Vec<Placement>)],
    /// nginx's version and configuration, if it ran.
    nginx: Option<(String, String)>,
    nginx_skipped: Option<String>,
}

impl Run<'_> {
    fn point(&self, w: WorkloadKind, f: Front, c: usize) -> Option<&Point> {
        self.points
            .iter()
            .find(|p| p.workload == w && p.front == f && p.connections == c)
    }

    /// A front's p50 and p99 minus direct's, µs.
    fn added(&self, p: &Point) -> Option<(f64, f64)> {
        if p.front == Front::Direct || p.tally.ok() == 0 {
            return None;
        }
        let d = self.point(p.workload, Front::Direct, p.connections)?;
        (d.tally.ok() > 0).then(|| (p.latency(0.5) - d.latency(0.5), p.latency(0.99) - d.latency(0.99)))
    }

    /// semlb's front CPU per request over nginx's.
    fn cpu_ratio(&self, w: WorkloadKind, c: usize) -> Option<f64> {
        let s = self.point(w, Front::Semlb, c)?.front_cpu_us()?;
        let n = self.point(w, Front::Nginx, c)?.front_cpu_us()?;
        (n > 0.0 && s.is_finite()).then_some(s / n)
    }
}

/// `us` microseconds as table text: `87 µs`, `1.24 ms`, `-12 µs`.
fn time_text(us: f64) -> String {
    if !us.is_finite() {
        "-".into()
    } else if us.abs() < 1000.0 {
        format!("{us:.0} µs")
    } else {
        format!("{:.2} ms", us / 1000.0)
    }
}

/// A CPU share as `ours+others %`.
fn share(ours: f64, foreign: f64) -> String {
    format!("{:.0}+{:.0} %", 100.0 * ours, 100.0 * foreign)
}

fn quantiles(sorted: &[f64]) -> Value {
    if sorted.is_empty() {
        return Value::Null;
    }
    let mean = sorted.iter().sum::<f64>() / sorted.len() as f64;
    json!({
        "p50": output::quantile(sorted, 0.5),
        "p90": output::quantile(sorted, 0.9),
        "p99": output::quantile(sorted, 0.99),
        "max": sorted.last(),
        "mean": mean,
    })
}

fn finite(v: f64) -> Value {
    if v.is_finite() { json!(v) } else { Value::Null }
}

fn report(args: &ProxyArgs, run: &Run) -> Result<()> {
    let header = [
        "front",
        "conns",
        "req/s",
        "p50",
        "p99",
        "added p50",
        "added p99",
        "front CPU/req",
        "semlb/nginx",
        "front core",
        "engine CPU/req",
        "other cores",
        "errors",
    ];
    let mut workloads_json = serde_json::Map::new();
    for w in run.workloads {
        let mut table = Table::new(header);
        let mut points_json = Vec::new();
        let mut ratios = serde_json::Map::new();
        for &c in &args.connections {
            if let Some(r) = run.cpu_ratio(w.kind, c) {
                ratios.insert(c.to_string(), json!(r));
            }
            for p in run.points.iter().filter(|p| p.workload == w.kind && p.connections == c) {
                let added = run.added(p);
                let ratio = (p.front == Front::Semlb).then(|| run.cpu_ratio(w.kind, c)).flatten();
                table.row([
                    p.front.name().to_owned(),
                    c.to_string(),
                    format!("{:.0}", p.req_per_s()),
                    time_text(p.latency(0.5)),
                    time_text(p.latency(0.99)),
                    added.map_or_else(String::new, |a| time_text(a.0)),
                    added.map_or_else(String::new, |a| time_text(a.1)),
                    p.front_cpu_us().map_or_else(String::new, time_text),
                    ratio.map_or_else(String::new, |r| format!("{r:.2}x")),
                    if p.front == Front::Direct {
                        String::new()
                    } else {
                        share(p.front_util(), p.front_foreign())
                    },
                    time_text(p.per_request_us(p.engine_cpu_s)),
                    share(p.other_util(), p.other_foreign()),
                    p.tally.errors().to_string(),
                ]);
                points_json.push(json!({
                    "front": p.front.name(),
                    "connections": c,
                    "window_s": p.window_s,
                    "requests": p.tally.ok(),
                    "requests_per_s": p.req_per_s(),
                    "latency_us": quantiles(&p.tally.latency_us),
                    "ttft_us": if args.stream { quantiles(&p.tally.ttft_us) } else { Value::Null },
                    "added_latency_us": added.map(|(a50, a99)| json!({"p50": a50, "p99": a99})),
                    "cpu_us_per_request": {
                        "front": p.front_cpu_us().map(finite),
                        "engine": finite(p.per_request_us(p.engine_cpu_s)),
                        "load_generator": finite(p.per_request_us(p.client_cpu_s)),
                    },
                    "cpu_seconds": {
                        "front": p.front_cpu_s,
                        "engine": p.engine_cpu_s,
                        "load_generator": p.client_cpu_s,
                    },
                    "utilisation": {
                        "front_cpus": {"front": p.front_util(), "foreign": p.front_foreign()},
                        "other_cpus": {"engine_and_load_generator": p.other_util(), "foreign": p.other_foreign()},
                    },
                    "semlb_over_nginx_cpu": ratio,
                    "errors": {
                        "total": p.tally.errors(),
                        "non_200": p.tally.statuses.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
                        "transport": p.tally.transport_errors,
                        "first": p.tally.first_error,
                    },
                    "x_semlb_cache": p.tally.cache,
                    "reconnects": p.tally.reconnects,
                }));
            }
        }
        let title = match w.kind {
            WorkloadKind::Short => format!(
                "semlb bench proxy: short chat requests ({} B body, max_tokens {}{})",
                w.body_bytes,
                args.max_tokens,
                if args.stream { ", SSE" } else { "" }
            ),
            WorkloadKind::Long | WorkloadKind::LongUnseen => format!(
                "semlb bench proxy: {} (~{:.0} tokens of {}, {} B body, max_tokens {}{})",
                if w.kind == WorkloadKind::Long {
                    "long chat prompts, 64 texts in turn behind a per-request tag"
                } else {
                    "long chat prompts never seen before (the per-request tag opens every line)"
                },
                w.prompt_tokens.unwrap_or(0.0),
                run.text.dialogues_name,
                w.body_bytes,
                args.max_tokens,
                if args.stream { ", SSE" } else { "" }
            ),
        };
        output::print_table(&title, &table);
        workloads_json.insert(
            w.kind.name().to_owned(),
            json!({
                "body_bytes": w.body_bytes,
                "prompt_tokens": w.prompt_tokens,
                "engine_prompt_tokens": w.engine_prompt_tokens,
                "points": points_json,
                "semlb_over_nginx_cpu": ratios,
            }),
        );
    }
    println!(
        "core columns: this run's share + other processes' share of the CPUs (front: {}, other: {})",
        run.front_cpus, run.other
    );
    println!(
        "front on CPU {}, engine and load generator on CPU {}{}; {} s measured after {} s of warm-up per row",
        run.front_cpus,
        run.other,
        if run.overlap { " (overlapping the front's!)" } else { "" },
        args.secs,
        args.warmup
    );
    println!("engine: {}", run.engine.description);
    println!("tokenizer: {}", run.text.tokenizer_name);
    if run.text.files.is_none() {
        println!("NOTE: no data directory: bundled tokenizer, canonical template, generated prompt text");
    }
    for (what, procs) in run.placement {
        let list: Vec<String> = procs
            .iter()
            .map(|p| format!("{}[{}] on {}", p.name, p.pid, p.cpus_allowed))
            .collect();
        println!("{what} processes: {}", list.join(", "));
    }
    if let Some(why) = &run.nginx_skipped {
        println!("nginx skipped: {why}");
    }
    let busiest = run
        .points
        .iter()
        .map(|p| {
            let front = if p.front == Front::Direct {
                0.0
            } else {
                p.front_foreign()
            };
            front.max(p.other_foreign())
        })
        .fold(0.0, f64::max);
    if busiest > 0.1 {
        println!(
            "WARNING: other processes used up to {:.0} % of the pinned CPUs during a row (the `+` parts of the core \
             columns): this machine is shared, and those rows measure the contention too",
            100.0 * busiest
        );
    }
    for p in run.points {
        if p.tally.errors() > 0 {
            println!(
                "{} {} ×{}: {} errors, first: {}",
                p.workload.name(),
                p.front.name(),
                p.connections,
                p.tally.errors(),
                p.tally.first_error.as_deref().unwrap_or("?")
            );
        }
        if let Some(hits) = p.tally.cache.get("hit") {
            println!(
                "{} {} ×{}: {hits} answers came from the response cache (expected none)",
                p.workload.name(),
                p.front.name(),
                p.connections
            );
        }
    }

    let placement_json: serde_json::Map<String, Value> = run
        .placement
        .iter()
        .map(|(what, procs)| {
            (
                (*what).to_owned(),
                procs
                    .iter()
                    .map(|p| json!({"pid": p.pid, "name": p.name, "cpus_allowed": p.cpus_allowed}))
                    .collect(),
            )
        })
        .collect();
    let value = json!({
        "report": "proxy",
        "settings": {
            "secs": args.secs,
            "warmup_secs": args.warmup,
            "connections": args.connections,
            "stream": args.stream,
            "max_tokens": args.max_tokens,
            "prompt_tokens": args.prompt_tokens,
            "time_scale": args.time_scale,
            "front_cpus": run.front_cpus.to_string(),
            "other_cpus": run.other.to_string(),
        },
        "engine": run.engine.description,
        "tokenizer": run.text.tokenizer_name,
        "prompt_text": run.text.dialogues_name,
        "gateway": "semlb serve --dispatchers 1 --responders 1 --shm-size 64MiB",
        "nginx": match &run.nginx {
            Some((version, config)) => json!({"version": version, "config": config}),
            None => json!({"skipped": run.nginx_skipped}),
        },
        "process_affinity": placement_json,
        "workloads": workloads_json,
    });
    let json_path = output::write_json(&args.common.out, "proxy", &value)?;
    let svg_path = args.common.out.join("proxy.svg");
    write_svg(&svg_path, args, run)?;
    println!("wrote {} and {}", json_path.display(), svg_path.display());
    Ok(())
}

/// Per workload, two line charts over the concurrency: the fronts' CPU
/// µs/request (log scale) and their added p50 latency; drawn with
/// [`plot::line_svg`] one by one and laid out two per row in one SVG.
fn write_svg(path: &Path, args: &ProxyArgs, run: &Run) -> Result<()> {
    let fronts = [Front::Semlb, Front::Nginx];
    // (title, y label, log y, lines)
    let mut panels: Vec<(String, &str, bool, Vec<Line>)> = Vec::new();
    for w in run.workloads {
        let lines = |pick: &dyn Fn(&Point) -> Option<f64>| -> Vec<Line> {
            fronts
                .iter()
                .map(|f| Line {
                    label: f.name().to_owned(),
                    points: args
                        .connections
                        .iter()
                        .filter_map(|c| run.point(w.kind, *f, *c))
                        .filter_map(|p| pick(p).map(|v| (p.connections as f64, v)))
                        .collect(),
                })
                .filter(|l| !l.points.is_empty())
                .collect()
        };
        panels.push((
            format!("{}: front CPU per request", w.kind.name()),
            "CPU µs / request",
            true,
            lines(&|p| p.front_cpu_us()),
        ));
        panels.push((
            format!("{}: added p50 latency", w.kind.name()),
            "µs over direct",
            false,
            lines(&|p| run.added(p).map(|a| a.0)),
        ));
    }
    let (w, h) = (640, 440);
    let rows = panels.len().div_ceil(2);
    let mut svg = format!(
        "<svg width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" xmlns=\"http://www.w3.org/2000/svg\">\n",
        w * 2,
        h * rows
    );
    for (i, (title, y_label, log_y, lines)) in panels.iter().enumerate() {
        let part = path.with_extension(format!("part{i}.svg"));
        plot::line_svg(&part, title, "connections", y_label, *log_y, lines)?;
        let text = std::fs::read_to_string(&part).with_context(|| format!("cannot read {}", part.display()))?;
        let _ = std::fs::remove_file(&part);
        let body = text.trim_start().strip_prefix("<?xml").map_or(text.as_str(), |rest| {
            rest.split_once("?>").map_or(rest, |(_, after)| after)
        });
        let placed = body.trim_start().replacen(
            "<svg ",
            &format!("<svg x=\"{}\" y=\"{}\" ", (i % 2) * w, (i / 2) * h),
            1,
        );
        svg.push_str(&placed);
        svg.push('\n');
    }
    svg.push_str("</svg>\n");
    std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_bodies_are_the_documented_json() {
        let (head, tail) = chat_parts(16, false);
        let v: Value = serde_json::from_str(&format!("{head}{SHORT_MESSAGE}{tail}")).unwrap();
        assert_eq!(
            v,
            json!({"model": MODEL, "messages": [{"role": "user", "content": SHORT_MESSAGE}], "max_tokens": 16})
        );
        let text = format!("{head}{SHORT_MESSAGE}{tail}");
        let body = semlb::body::Json::parse(text.as_bytes()).unwrap();
        assert!(
            !semlb::response_cache::is_deterministic(body.as_object().unwrap()),
            "the requests must bypass the response cache"
        );
        let (head, tail) = chat_parts(4, true);
        let v: Value = serde_json::from_str(&format!("{head}x{tail}")).unwrap();
        assert_eq!(v["stream"], true);
    }

    #[test]
    fn long_prompts_have_about_the_asked_tokens_and_differ() {
        let text = TextSource {
            tokenizer: Tokenizer::bundled(),
            tokenizer_name: String::new(),
            files: None,
            dialogues: generated_dialogues(),
            dialogues_name: String::new(),
        };
        let (a, n) = text.text_of(0, 500);
        assert!(n.abs_diff(500) <= 10, "{n} tokens");
        assert_eq!(text.tokenizer.encode(&a).len(), n);
        let (b, _) = text.text_of(10, 500);
        assert_ne!(a, b);
    }

    #[test]
    fn times_read_well() {
        assert_eq!(time_text(87.4), "87 µs");
        assert_eq!(time_text(-12.0), "-12 µs");
        assert_eq!(time_text(1240.0), "1.24 ms");
        assert_eq!(time_text(f64::NAN), "-");
    }
}
