//! The peer routers `semlb bench replay` runs as rows next to semlb's
//! policies, on the same simulated engines and the same workloads: the
//! routers a user would pick instead.
//!
//! | row | package (PyPI, pinned) | started as | policy | worker added at run time with |
//! | --- | --- | --- | --- | --- |
//! | `smg` | `smg==1.13.0` (Shepherd Model Gateway) | `smg launch` | `cache_aware` (its default) | `POST /workers` `{"url": ...}` |
//! | `vllm-router` | `vllm-router==0.1.17` | `vllm-router` | `cache_aware` (its default) | `POST /add_worker?url=...` |
//! | `sglang-router` | `sglang-router==0.3.2` | `python -m sglang_router.launch_router` | `cache_aware` (its default) | `POST /workers` `{"url": ...}` |
//!
//! Each is installed by the bench into a private virtual environment,
//! `<peers dir>/<row>/venv` (default `target/bench-peers/`), with
//! `python3 -m venv` and `pip install <package>==<version>`, and reused
//! while it holds that version; when that fails (no `python3`, no network)
//! the row is skipped with one line saying why.
//!
//! Every flag but the ones that place it is the router's own default: its
//! cache threshold (0.3), balance thresholds (64 requests and 1.5×), tree
//! size, eviction interval, health checks and worker threads (a tokio
//! runtime of one thread per core, 2 here, the core budget of semlb's 2
//! dispatchers). The flags given ([`Peer::args`]): `--host 127.0.0.1
//! --port P` (a free port), `--policy cache_aware` (the default, named
//! for the record), `--prometheus-host 127.0.0.1 --prometheus-port Q` (a
//! free port instead of the shared 29000), `--log-level warn` (`warning` for
//! vllm-router: no log line per request on the shared cores) and `--worker-urls` (the engines).
//! The command line of every run is in the JSON.
//!
//! Unlike semlb's gateway, whose time-based parameters the replay scales
//! by the speedup ([`gateway_config`](super::gateway_config)), a peer's
//! timers (SMG's 180 s cache TTL and 60 s worker warm-up, eviction every
//! 60–120 s, health checks every 60 s) run in real time, so in trace time
//! they are X times longer: they are the routers' defaults, not tuned.
//!
//! What the pinned versions do with the replay's requests, found with
//! [`preflight`] (one text completion, one token-id completion and one
//! chat call through the router in front of one engine, before the peer's
//! first run):
//!
//! * every one takes a `/v1/completions` request whose `prompt` is a
//!   string, the form `mooncake`, `hh-rlhf` and `hot-prefix` are sent in
//!   by default (`--prompt-form text`, to every row alike; see
//!   [`text`](crate::workload::text)); `smg` and `sglang-router` route it
//!   on its characters.
//! * `smg` and `sglang-router` reject one whose `prompt` is an array of
//!   token ids (HTTP 400 and 422: their request type takes a string or
//!   strings), so with `--prompt-form tokens` their rows on those three
//!   workloads are not run and say so; chat calls they route on the
//!   messages' text.
//! * `vllm-router` takes token-id prompts. For chat calls it first asks
//!   every worker for `POST /v1/chat/completions/render` (vLLM's
//!   endpoint; `POST /tokenize` when that fails) and routes on the token
//!   ids it returns, as in front of real vLLM; text completions through
//!   `/v1/completions/render`.
//!
//! * the tool-calling agents (`--agents-api`, see
//!   [`agent_api`](crate::workload::agent_api)): each peer is sent the
//!   first call of a session in each API, streamed, and must answer with
//!   the engine's stream (ending `[DONE]` with a tool call,
//!   `response.completed`, `message_stop`). `smg` 1.13 passes
//!   `/v1/responses` and `/v1/messages` to the engines when started as
//!   here (HTTP workers, `smg launch --worker-urls`), but its Responses
//!   request type refuses fields it does not know (`ignore_eos`: HTTP 400
//!   `unknown field`), so Responses calls go without it, for every row
//!   alike (no peer forwards the simulator's `x-semlb-output-tokens`
//!   header, which semlb's gateway does: tried, the peers' engines
//!   generated fewer tokens than semlb's), their text answers
//!   min(`max_output_tokens`, the engine's default) long for every row.
//!   `vllm-router` 0.1.17 passes both. `sglang-router` 0.3.2 passes
//!   `/v1/responses` (a first version of the client, which sent the
//!   `function_call` item back without its `id` and `status` and the
//!   assistant's text as a `message` item of `output_text` parts, got HTTP
//!   400 `data did not match any variant of untagged enum ResponseInput`
//!   from the second call on; sent back as the SDKs send them, they pass)
//!   and has no `/v1/messages` (HTTP 404): its
//!   rows on `agents/messages` are skipped. On every API the engines see
//!   the same prompts and generate the same tokens whatever the row
//!   (their counters in the JSON say so).
//!
//! What they ask a worker for (seen with a stand-in worker that logs every
//! request, over a router's first 12 s): `smg` `GET /health`, `/v1/models`
//! (the model's name and length), `/server_info` then `/get_server_info`,
//! `/model_info` then `/get_model_info`, `/version` (with it, smg takes the
//! simulator for vLLM), and for its load monitor `/v1/loads?include=...`
//! (SGLang's load report; every 10 s) then `/loads?model=...`;
//! `sglang-router` `GET /health`, `/server_info`, `/get_server_info`,
//! `/model_info`, `/get_model_info` (the model's name comes from there);
//! `vllm-router` `GET /health` only (then every 60 s), and per chat call
//! the render above. The simulator serves all of them as vLLM and SGLang
//! do (`semlb_workers::vllm_api`, `semlb_workers::sglang_api`; a
//! deliberate hybrid, so that every peer manages it as it manages its own
//! engines), except `/loads?model=` (in neither engine) and, on the
//! engine sets without metrics, `/v1/loads` and `/metrics`: those engines
//! stand for ones that show no load, and semlb's gateway gets none there
//! either. `sglang-router` 0.3.2 sends a burst of requests that share a
//! system prompt to one engine: its least-load fallback breaks ties by
//! registry order (`min_by_key`), and the radix tree then holds the
//! shared prefix there, above its 0.3 match threshold; load overrides it
//! only past 64 requests and 1.5× (read in its source and seen with the
//! endpoints served or not). smg 1.13 breaks such ties by requests
//! processed.
//!
//! A peer reports no prediction accuracy (that column is semlb's own).

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::ValueEnum;
use serde_json::Value;
use thiserror::Error;

use semlb_test_support::http::http_bytes;

use crate::workload::agent_api::{AgentsApi, Turn};

/// One peer router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum Peer {
    /// Shepherd Model Gateway (`smg`).
    Smg,
    /// vLLM's router (`vllm-router`).
    VllmRouter,
    /// SGLang's router (`sglang-router`).
    SglangRouter,
}

impl Peer {
    /// Every peer, in report order.
    pub const ALL: [Self; 3] = [Self::Smg, Self::VllmRouter, Self::SglangRouter];

    /// Its row's name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Smg => "smg",
            Self::VllmRouter => "vllm-router",
            Self::SglangRouter => "sglang-router",
        }
    }

    /// Its PyPI package and the pinned version.
    pub const fn package(self) -> (&'static str, &'static str) {
        match self {
            Self::Smg => ("smg", "1.13.0"),
            Self::VllmRouter => ("vllm-router", "0.1.17"),
            Self::SglangRouter => ("sglang-router", "0.3.2"),
        }
    }

    /// The program in the environment's `bin/` and the arguments before
    /// the router's own.
    const fn entry(self) -> (&'static str, &'static [&'static str]) {
        match self {
            Self::Smg => ("smg", &["launch"]),
            Self::VllmRouter => ("vllm-router", &[]),
            Self::SglangRouter => ("python", &["-m", "sglang_router.launch_router"]),
        }
    }

    /// The router's arguments (after [`entry`](Self::entry)'s): listening on
    /// `127.0.0.1:port`, its metrics on `127.0.0.1:metrics_port`, in front
    /// of `workers` (`http://host:port`), every routing parameter its
    /// default.
    pub fn args(self, port: u16, metrics_port: u16, workers: &[String]) -> Vec<String> {
        let mut args: Vec<String> = [
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--policy",
            "cache_aware",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            &metrics_port.to_string(),
            "--log-level",
            self.quiet_log_level(),
            "--worker-urls",
        ]
        .map(str::to_owned)
        .into();
        args.extend(workers.iter().cloned());
        args
    }

    /// Its log level without a line per request (`warn`; vllm-router
    /// spells it `warning`).
    const fn quiet_log_level(self) -> &'static str {
        match self {
            Self::VllmRouter => "warning",
            Self::Smg | Self::SglangRouter => "warn",
        }
    }

    /// The request that adds worker `url` at run time: method, path and
    /// JSON body.
    pub fn add_worker(self, url: &str) -> (&'static str, String, Option<String>) {
        match self {
            Self::Smg | Self::SglangRouter => (
                "POST",
                "/workers".to_owned(),
                Some(serde_json::json!({ "url": url }).to_string()),
            ),
            Self::VllmRouter => ("POST", format!("/add_worker?url={url}"), None),
        }
    }

    /// Where it lists its workers.
    const fn workers_path(self) -> &'static str {
        match self {
            Self::Smg | Self::SglangRouter => "/workers",
            Self::VllmRouter => "/list_workers",
        }
    }

    /// Whether its worker list (`body`, the answer to
    /// [`workers_path`](Self::workers_path)) holds every one of `urls`,
    /// each healthy and ready where it says.
    pub fn workers_ready(self, body: &str, urls: &[String]) -> bool {
        let Ok(v) = serde_json::from_str::<Value>(body) else {
            return false;
        };
        let listed: Vec<&Value> = match self {
            Self::Smg | Self::SglangRouter => v["workers"].as_array().map(|a| a.iter().collect()).unwrap_or_default(),
            Self::VllmRouter => v["urls"].as_array().map(|a| a.iter().collect()).unwrap_or_default(),
        };
        urls.iter().all(|url| {
            listed.iter().any(|w| match self {
                Self::VllmRouter => w.as_str() == Some(url),
                _ => {
                    w["url"].as_str() == Some(url)
                        && w["is_healthy"].as_bool() != Some(false)
                        && w["status"].as_str().is_none_or(|s| s == "ready")
                }
            })
        })
    }
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The peers of `--peers`: every peer without the flag, none for `none`
/// or an empty list.
pub(crate) fn parse_peers(list: Option<&[String]>) -> anyhow::Result<Vec<Peer>> {
    let Some(list) = list else {
        return Ok(Peer::ALL.to_vec());
    };
    let mut out = Vec::new();
    for item in list.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        if item == "none" {
            continue;
        }
        let peer = Peer::from_str(item, true).map_err(|_| {
            anyhow::anyhow!(
                "--peers {item}: not a peer router (one of {}, or none)",
                Peer::ALL.map(Peer::name).join(", ")
            )
        })?;
        if !out.contains(&peer) {
            out.push(peer);
        }
    }
    Ok(out)
}

/// Why a peer could not be installed.
#[derive(Debug, Error)]
pub(crate) enum InstallError {
    /// `python3 -m venv` failed.
    #[error("python3 -m venv {dir}: {why}")]
    Venv {
        /// The environment's directory.
        dir: String,
        /// What went wrong.
        why: String,
    },
    /// `pip install` failed.
    #[error("pip install {spec}: {why}")]
    Pip {
        /// `package==version`.
        spec: String,
        /// The last lines pip printed.
        why: String,
    },
    /// The package installed but its program is missing.
    #[error("{0} is missing after the install")]
    Missing(String),
}

/// An installed peer: its private environment.
#[derive(Debug, Clone)]
pub(crate) struct Install {
    /// Which peer.
    pub(crate) peer: Peer,
    /// The virtual environment.
    pub(super) venv: PathBuf,
    /// It was there already at the pinned version.
    pub(super) reused: bool,
}

impl Install {
    /// The program and the arguments before the router's own.
    fn program(&self) -> (PathBuf, Vec<String>) {
        let (bin, pre) = self.peer.entry();
        (
            self.venv.join("bin").join(bin),
            pre.iter().map(|s| (*s).to_owned()).collect(),
        )
    }

    /// Its whole command line in front of `workers`, ports `port` and
    /// `metrics_port`.
    pub(super) fn command(&self, port: u16, metrics_port: u16, workers: &[String]) -> Vec<String> {
        let (program, mut args) = self.program();
        args.extend(self.peer.args(port, metrics_port, workers));
        std::iter::once(program.display().to_string()).chain(args).collect()
    }
}

/// The last `n` lines of `text`, joined with ` | `.
fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// The version of `package` installed in `venv` (`pip show`), if any.
fn installed_version(venv: &Path, package: &str) -> Option<String> {
    let out = Command::new(venv.join("bin").join("python"))
        .args(["-m", "pip", "show", "--disable-pip-version-check", package])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("Version:").map(|v| v.trim().to_owned()))
}

/// `peer` in `<root>/<name>/venv`, installed at its pinned version unless
/// it is there already.
pub(crate) fn install(peer: Peer, root: &Path) -> Result<Install, InstallError> {
    let (package, version) = peer.package();
    let venv = root.join(peer.name()).join("venv");
    let reused =
        venv.join("bin").join("python").is_file() && installed_version(&venv, package).as_deref() == Some(version);
    if !reused {
        if !venv.join("bin").join("python").is_file() {
            let out = Command::new("python3")
                .args(["-m", "venv"])
                .arg(&venv)
                .stdin(Stdio::null())
                .output()
                .map_err(|e| InstallError::Venv {
                    dir: venv.display().to_string(),
                    why: e.to_string(),
                })?;
            if !out.status.success() {
                return Err(InstallError::Venv {
                    dir: venv.display().to_string(),
                    why: last_lines(&String::from_utf8_lossy(&out.stderr), 2),
                });
            }
        }
        let spec = format!("{package}=={version}");
        let out = Command::new(venv.join("bin").join("python"))
            .args(["-m", "pip", "install", "--disable-pip-version-check", "--quiet", &spec])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| InstallError::Pip {
                spec: spec.clone(),
                why: e.to_string(),
            })?;
        if !out.status.success() {
            return Err(InstallError::Pip {
                spec,
                why: last_lines(&String::from_utf8_lossy(&out.stderr), 2),
            });
        }
    }
    let install = Install { peer, venv, reused };
    let (program, _) = install.program();
    if !program.is_file() {
        return Err(InstallError::Missing(program.display().to_string()));
    }
    Ok(install)
}

/// A free loopback port (bound and released: another process may take it
/// first, in which case the peer fails to start and is started again).
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Why a peer did not start.
#[derive(Debug, Error)]
pub(crate) enum StartError {
    /// Its process could not be spawned.
    #[error("cannot run {program}: {why}")]
    Spawn {
        /// The program.
        program: String,
        /// What went wrong.
        why: String,
    },
    /// It exited or did not list its workers in time.
    #[error("{peer} did not become ready ({why}); its log: {log}")]
    NotReady {
        /// Which peer.
        peer: Peer,
        /// What was seen.
        why: String,
        /// Its log's last lines.
        log: String,
    },
}

/// A running peer router, in a process group of its own: SIGTERM to the
/// group (then SIGKILL) when dropped.
pub(crate) struct PeerProc {
    child: Child,
    /// Which peer.
    pub(super) peer: Peer,
    /// Where it listens (`127.0.0.1:port`).
    pub(crate) addr: String,
    /// Its command line.
    pub(super) command: Vec<String>,
    /// Its stdout and stderr.
    log: PathBuf,
}

/// How long a peer may take to list its workers.
const READY_WITHIN: Duration = Duration::from_secs(60);

impl PeerProc {
    /// Starts `install` in front of `workers` (`http://host:port`) and
    /// waits until it answers `/health` and lists every worker as ready;
    /// tries three times (a port taken in between).
    pub(crate) fn start(install: &Install, workers: &[String]) -> Result<PeerProc, StartError> {
        let mut last = None;
        for _ in 0..3 {
            match Self::try_start(install, workers) {
                Ok(p) => return Ok(p),
                Err(e @ StartError::Spawn { .. }) => return Err(e),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("tried"))
    }

    fn try_start(install: &Install, workers: &[String]) -> Result<PeerProc, StartError> {
        let spawn_error = |why: String| StartError::Spawn {
            program: install.program().0.display().to_string(),
            why,
        };
        let (port, metrics_port) = (
            free_port().map_err(|e| spawn_error(e.to_string()))?,
            free_port().map_err(|e| spawn_error(e.to_string()))?,
        );
        let command = install.command(port, metrics_port, workers);
        let log = std::env::temp_dir().join(format!(
            "{}.log",
            crate::end_to_end::unique_name(&format!("peer-{}", install.peer))
        ));
        let file = File::create(&log).map_err(|e| spawn_error(format!("{}: {e}", log.display())))?;
        let err_file = file.try_clone().map_err(|e| spawn_error(e.to_string()))?;
        let child = Command::new(&command[0])
            .args(&command[1..])
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err_file)
            .env("NO_COLOR", "1")
            .process_group(0)
            .spawn()
            .map_err(|e| spawn_error(e.to_string()))?;
        let mut proc = PeerProc {
            child,
            peer: install.peer,
            addr: format!("127.0.0.1:{port}"),
            command,
            log,
        };
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if let Ok(Some(status)) = proc.child.try_wait() {
                return Err(proc.not_ready(format!("exited with {status}")));
            }
            let seen = match http_bytes(&proc.addr, "GET", proc.peer.workers_path(), None, &[]) {
                Ok(r) if r.status == 200 => {
                    let body = String::from_utf8_lossy(&r.body).into_owned();
                    let healthy = http_bytes(&proc.addr, "GET", "/health", None, &[]).is_ok_and(|h| h.status == 200);
                    if healthy && proc.peer.workers_ready(&body, workers) {
                        return Ok(proc);
                    }
                    format!("workers: {}", body.chars().take(300).collect::<String>())
                }
                Ok(r) => format!("{} answered {}", proc.peer.workers_path(), r.status),
                Err(e) => e,
            };
            if Instant::now() >= deadline {
                return Err(proc.not_ready(format!("not ready within {READY_WITHIN:?}: {seen}")));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A [`StartError::NotReady`] with `why` and the log's tail.
    fn not_ready(&self, why: String) -> StartError {
        StartError::NotReady {
            peer: self.peer,
            why,
            log: self.log_tail(),
        }
    }

    /// The last lines of its log.
    pub(super) fn log_tail(&self) -> String {
        last_lines(&std::fs::read_to_string(&self.log).unwrap_or_default(), 4)
    }
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        use nix::sys::signal::{Signal, killpg};
        use nix::unistd::Pid;
        let group = Pid::from_raw(self.child.id() as i32);
        let _ = killpg(group, Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Whatever of the group is left (the router's own children too).
        let _ = killpg(group, Signal::SIGKILL);
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// What a peer does with the replay's kinds of request, from
/// [`preflight`].
#[derive(Debug, Clone)]
pub(super) struct Support {
    /// A streamed `/v1/completions` with a text `prompt`: `Err` with the
    /// answer when it is refused.
    pub(super) text: Result<(), String>,
    /// A streamed `/v1/completions` with a token-id `prompt`: `Err` with
    /// the answer when it is refused.
    pub(super) token_ids: Result<(), String>,
    /// A `/v1/chat/completions` call.
    pub(super) chat: Result<(), String>,
    /// A streamed `/v1/chat/completions` call with tools, answered with
    /// the engine's tool call.
    pub(super) chat_tools: Result<(), String>,
    /// A streamed `POST /v1/responses` call with tools, answered with the
    /// engine's events (ending `response.completed`).
    pub(super) responses: Result<(), String>,
    /// A streamed `POST /v1/messages` call with tools, answered with the
    /// engine's events (ending `message_stop`).
    pub(super) messages: Result<(), String>,
    /// The command line it was started with.
    pub(super) command: Vec<String>,
}

/// One request's verdict: `Ok` for a 200 that was answered in full.
fn verdict(r: Result<semlb_test_support::http::Response, String>) -> Result<(), String> {
    match r {
        Ok(r) if r.status == 200 => Ok(()),
        Ok(r) => Err(format!(
            "HTTP {}: {}",
            r.status,
            String::from_utf8_lossy(&r.body).chars().take(200).collect::<String>()
        )),
        Err(e) => Err(e),
    }
}

/// Starts `install` in front of `engine` (`http://host:port`) and sends
/// one text completion, one token-id completion, one chat call, and the
/// tool-calling agents' first call over chat completions, the Responses
/// API and the Messages API through it.
pub(super) fn preflight(install: &Install, engine: &str) -> Result<Support, StartError> {
    let proc = PeerProc::start(install, &[engine.to_owned()])?;
    // A text completion, as the completions workloads send them by default.
    let completion = serde_json::json!({
        "model": "semlb-sim",
        "stream": true,
        "ignore_eos": true,
        "temperature": 1.0,
        "max_tokens": 1,
        "prompt": "the cache of the engine\n",
    })
    .to_string();
    let text = verdict(http_bytes(
        &proc.addr,
        "POST",
        "/v1/completions",
        Some(completion.as_bytes()),
        &[],
    ));
    // A token-id completion, as the token-id workloads send them (built
    // here: `drive` uses this module, so this one does not use `drive`).
    let completion = bytes::Bytes::from(
        serde_json::json!({
            "model": "semlb-sim",
            "stream": true,
            "ignore_eos": true,
            "temperature": 1.0,
            "max_tokens": 1,
            "prompt": [1, 2, 3, 4],
        })
        .to_string(),
    );
    let token_ids = verdict(http_bytes(
        &proc.addr,
        "POST",
        "/v1/completions",
        Some(&completion),
        &[],
    ));
    let chat = serde_json::json!({
        "model": "semlb-sim",
        "messages": [{"role": "user", "content": "Hello!"}],
        "max_tokens": 1,
        "temperature": 1.0,
    })
    .to_string();
    let chat = verdict(http_bytes(
        &proc.addr,
        "POST",
        "/v1/chat/completions",
        Some(chat.as_bytes()),
        &[],
    ));
    // The tool-calling agents' first call in each API, streamed: the
    // engine answers it with a tool call.
    let agent = |api: AgentsApi, ends: &str| {
        let body = api
            .body("You are an agent.", &[Turn::User("Find the cache.".into())], 64, true)
            .to_string();
        let answer = http_bytes(&proc.addr, "POST", api.path(), Some(body.as_bytes()), &[]);
        let whole = |r: &semlb_test_support::http::Response| {
            let text = String::from_utf8_lossy(&r.body);
            // The engine's answer, passed on: its events to the last.
            text.contains(ends) && (ends != "[DONE]" || text.contains("tool_calls"))
        };
        match answer {
            Ok(r) if r.status == 200 && !whole(&r) => Err(format!(
                "HTTP 200 but not the engine's streamed tool call (no {ends}): {}",
                String::from_utf8_lossy(&r.body).chars().take(200).collect::<String>()
            )),
            other => verdict(other),
        }
    };
    let chat_tools = agent(AgentsApi::ChatTools, "[DONE]");
    let responses = agent(AgentsApi::Responses, "response.completed");
    let messages = agent(AgentsApi::Messages, "message_stop");
    Ok(Support {
        text,
        token_ids,
        chat,
        chat_tools,
        responses,
        messages,
        command: proc.command.clone(),
    })
}

/// A peer that can run: its install and what it takes; or why not.
pub(super) type Ready = Result<(Install, Support), String>;

/// The peers of a replay: each installed and checked, or why not.
#[derive(Debug, Default)]
pub(super) struct Peers {
    /// In `--peers` order: the peer and whether it can run.
    pub(super) rows: Vec<(Peer, Ready)>,
}

impl Peers {
    /// The installed, working peers' support, by peer.
    pub(super) fn ready(&self) -> HashMap<Peer, (Install, Support)> {
        self.rows
            .iter()
            .filter_map(|(p, r)| r.as_ref().ok().map(|(i, s)| (*p, (i.clone(), s.clone()))))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_name_the_default_policy_and_every_worker() {
        let workers = ["http://127.0.0.1:1".to_owned(), "http://127.0.0.1:2".to_owned()];
        let install = |peer| Install {
            peer,
            venv: PathBuf::from("/p/venv"),
            reused: true,
        };
        assert_eq!(
            install(Peer::Smg).command(30, 31, &workers).join(" "),
            "/p/venv/bin/smg launch --host 127.0.0.1 --port 30 --policy cache_aware --prometheus-host 127.0.0.1 \
             --prometheus-port 31 --log-level warn --worker-urls http://127.0.0.1:1 http://127.0.0.1:2"
        );
        assert!(
            install(Peer::SglangRouter)
                .command(30, 31, &workers)
                .join(" ")
                .starts_with(
                    "/p/venv/bin/python -m sglang_router.launch_router --host 127.0.0.1 --port 30 --policy cache_aware "
                )
        );
        let vllm = install(Peer::VllmRouter).command(30, 31, &workers);
        assert_eq!(vllm[0], "/p/venv/bin/vllm-router");
        assert_eq!(
            &vllm[vllm.len() - 3..],
            ["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"]
        );
        // Only placement flags: no threshold of the routers is set.
        for peer in Peer::ALL {
            let args = peer.args(1, 2, &[]);
            assert!(
                args.iter().all(|a| !a.contains("threshold") && !a.contains("thread")),
                "{args:?}"
            );
        }
    }

    #[test]
    fn workers_are_added_with_each_routers_own_api() {
        let url = "http://127.0.0.1:9";
        assert_eq!(
            Peer::Smg.add_worker(url),
            (
                "POST",
                "/workers".to_owned(),
                Some(r#"{"url":"http://127.0.0.1:9"}"#.to_owned())
            )
        );
        assert_eq!(Peer::SglangRouter.add_worker(url).1, "/workers");
        assert_eq!(
            Peer::VllmRouter.add_worker(url),
            ("POST", "/add_worker?url=http://127.0.0.1:9".to_owned(), None)
        );
    }

    #[test]
    fn worker_lists_are_ready_when_every_worker_is() {
        let urls = ["http://a:1".to_owned(), "http://b:2".to_owned()];
        let smg = r#"{"workers":[{"url":"http://a:1","is_healthy":true,"status":"ready"},
                                 {"url":"http://b:2","is_healthy":true,"status":"ready"}],"total":2}"#;
        assert!(Peer::Smg.workers_ready(smg, &urls));
        assert!(!Peer::Smg.workers_ready(&smg.replace(r#""status":"ready"}]"#, r#""status":"pending"}]"#), &urls));
        assert!(!Peer::Smg.workers_ready(&smg.replace("true", "false"), &urls));
        // sglang-router 0.3.2 has no status field.
        let sglang = r#"{"workers":[{"url":"http://a:1","is_healthy":true},{"url":"http://b:2","is_healthy":true}]}"#;
        assert!(Peer::SglangRouter.workers_ready(sglang, &urls));
        assert!(!Peer::SglangRouter.workers_ready(sglang, &["http://c:3".to_owned()]));
        assert!(Peer::VllmRouter.workers_ready(r#"{"urls":["http://b:2","http://a:1"]}"#, &urls));
        assert!(!Peer::VllmRouter.workers_ready(r#"{"urls":["http://a:1"]}"#, &urls));
        assert!(!Peer::VllmRouter.workers_ready("not json", &urls));
    }

    #[test]
    fn the_peers_flag_takes_names_none_and_nothing() {
        assert_eq!(parse_peers(None).unwrap(), Peer::ALL);
        let list = |s: &[&str]| s.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        assert_eq!(parse_peers(Some(&list(&["none"]))).unwrap(), []);
        assert_eq!(parse_peers(Some(&list(&[""]))).unwrap(), []);
        assert_eq!(
            parse_peers(Some(&list(&["sglang-router", "smg", "smg"]))).unwrap(),
            [Peer::SglangRouter, Peer::Smg]
        );
        assert!(parse_peers(Some(&list(&["nginx"]))).is_err());
        assert_eq!(Peer::VllmRouter.package(), ("vllm-router", "0.1.17"));
    }
}
