//! `semlb serve`: the supervisor.
//!
//! It resolves the configuration (file, then flags), creates the shm
//! segment (a leftover of a crashed supervisor, whose creator pid is gone,
//! is removed first; a live one is refused), registers the backends in the
//! server table, binds the listener, and starts the children by re-running
//! this binary as `semlb __child`: the dispatchers inherit the listening
//! socket as fd 3, each with its own completion ring; the responders split
//! the rings among themselves. Every child gets `PR_SET_PDEATHSIG`, so it
//! dies with the supervisor.
//!
//! A child that dies is reaped (SIGCHLD), marked exited in the registry,
//! its in-flight counts reclaimed, and restarted after a backoff (100 ms
//! doubling to 5 s); a slot that needs 5 restarts within 30 s is a crash
//! loop: the supervisor stops everything and exits non-zero. A child whose
//! heartbeat is older than 10 s is hung and is killed (then restarted).
//!
//! SIGTERM: stop accepting (children get SIGTERM and drain within the
//! drain timeout), then SIGKILL stragglers, remove the segment, exit 0.
//! SIGINT: the same with a 1 s grace.
//!
//! # systemd
//!
//! Under a `Type=notify` unit (`systemd/semlb.service`) the supervisor
//! reports through [`crate::notify`]: `READY=1` once every child has
//! attached to its registry slot and a dispatcher has answered `GET
//! /health` on the listener; `STATUS=` a one-line summary (children up,
//! restarts, backends up and draining, policy, a failed reload) whenever it
//! changes and every 30 s; `WATCHDOG=1` at half of `WatchdogSec=`, but only
//! while it is healthy: every child running its current incarnation with a
//! heartbeat at most 3 s old. A child being restarted, hung or crash
//! looping stops the pings until it runs again, and a stalled supervisor
//! sends none, so systemd restarts the service when that lasts. `STOPPING=1`
//! on SIGTERM/SIGINT (and on a fatal error), before draining;
//! `RELOADING=1` and `READY=1` around a reload. Children are started without
//! `NOTIFY_SOCKET`/`WATCHDOG_*`: only the supervisor notifies.
//!
//! # Reload (SIGHUP)
//!
//! The configuration is resolved again exactly as at start (the same
//! `--config` file, the same flags over it). If it does not parse or
//! validate, the error is logged on one line (naming the key), `STATUS=`
//! says the reload failed, and everything keeps running as it was.
//! Otherwise, with no connection dropped and the shared tables kept:
//!
//! * **Backends** (by `http://host:port`): a new one is registered in the
//!   server table (`Up`, so every dispatcher routes to it at once); a
//!   removed one is set `Draining` (dispatchers route only to `Up`
//!   servers) and retired, its slot freed, once it has no request in
//!   flight or after `drain_timeout_secs`; one listed again while still
//!   draining is `Up` again; unchanged ones are not touched (their prefix
//!   entries, load and counts stay).
//! * **Routing policy** (`[policy]`, kind and parameters): the supervisor
//!   forwards SIGHUP to the dispatchers, which resolve the configuration
//!   themselves (same flags) and swap their policy in place; one that fails
//!   to resolve keeps its policy.
//! * **Needs a restart** (logged, running values kept): `listen`,
//!   `dispatchers`, `responders`, `shm_name`, `shm_size`, `tokenizer`,
//!   `chat_template`, `block_size`, `[store]`. Children are started with
//!   these pinned as flags, so a child restarted after the file changed
//!   still matches the running segment and processes.
//! * **Read when a dispatcher starts** (logged): `[limits]`,
//!   `[response_cache]`, `drain_timeout_secs`; the supervisor itself uses
//!   the new drain timeout for backends removed from then on.
//!
//! `--backend` flags replace the file's `[[backend]]` list at every reload
//! too, so a gateway started with them cannot change its backends by
//! reloading.
//!
//! # Admin API
//!
//! With `[admin] listen` (or `--admin-listen`) the supervisor also serves
//! [`crate::admin`] on that address, in its own runtime. The token is read
//! (and a world-readable token file refused) and the address bound before
//! anything starts, so a problem stops the start with one clear error. The
//! HTTP side only parses: each request reaches this loop as a command over
//! a channel (`monitor`'s `select!`), which applies it to the [`Backends`]
//! bookkeeping and the segment, exactly as a reload does (registration,
//! `Draining`, retirement once drained or after `drain_timeout_secs`), and
//! answers. Servers added through the API are not written to the file: the
//! next reload applies the file's backend list, so it drains and removes
//! an added server the file does not list (and a server the file lists is
//! from then on the file's). A drain (without removal) is kept by a reload
//! that still lists the server. `[admin]` itself needs a restart.
//!
//! `--demo N` first starts N simulated engines (`semlb __sim`) on loopback
//! and uses them as the backends; unless given, it listens on
//! `127.0.0.1:8080` and names its segment `semlb-demo`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use semlb::config::{BackendConfig, ServeConfig};
use serde_json::json;
use shm_layout::{CreateError, LayoutPlan, PlanOptions, ProcessState, Role, Segment, ServerRef, ServerState};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use crate::admin::{self, Reply};
use crate::cli::{ChildRole, LogArgs, ServeArgs};
use crate::notify::{self, Notifier};

/// The fd a dispatcher finds the listening socket on.
pub const LISTEN_FD: RawFd = 3;
const BACKOFF_START: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const CRASH_WINDOW: Duration = Duration::from_secs(30);
const CRASH_LIMIT: usize = 5;
const HUNG_AFTER_MS: u64 = 10_000;
/// A heartbeat at most this old is fresh (children beat every 500 ms).
const FRESH_HEARTBEAT_MS: u64 = 3_000;
/// A `STATUS=` line is sent when it changes, and at least this often.
const STATUS_EVERY: Duration = Duration::from_secs(30);

/// One child slot the supervisor keeps filled.
#[derive(Debug)]
struct Slot {
    role: ChildRole,
    slot: u16,
    index: usize,
    incarnation: u32,
    pid: Option<Pid>,
    restart_at: Option<Instant>,
    backoff: Duration,
    restarts: VecDeque<Instant>,
}

/// Runs the gateway until SIGTERM/SIGINT (or a crash loop).
pub fn run(args: &ServeArgs) -> Result<()> {
    let mut args = args.clone();
    let mut sims = Vec::new();
    if args.demo.is_some() {
        // A demo listens on loopback and uses its own segment, so it never
        // collides with (or exposes) a real gateway on the same host.
        args.listen
            .get_or_insert(std::net::SocketAddr::from(([127, 0, 0, 1], 8080)));
        args.shm_name.get_or_insert_with(|| "semlb-demo".to_owned());
    }
    if let Some(n) = args.demo {
        for _ in 0..n {
            let (child, url) = start_sim(args.demo_time_scale, &args.log)?;
            tracing::info!(engine = %url, pid = child.id(), "demo engine {url} (pid {})", child.id());
            args.backends.push(url);
            sims.push(child);
        }
    }
    let result = supervise(&args);
    for mut sim in sims {
        let _ = kill(Pid::from_raw(sim.id() as i32), Signal::SIGTERM);
        let _ = sim.wait();
    }
    result
}

fn supervise(args: &ServeArgs) -> Result<()> {
    let notify = Notifier::from_env();
    let config = ServeConfig::resolve(args.config.as_deref(), args.overrides())?;
    // Load what every dispatcher will load, so a bad file is one clear error
    // here rather than a crash loop of children, and say which engine runs.
    let tokenizer = crate::child::load_tokenizer(&config, 0)?;
    tracing::info!(
        tokenizer = %config.tokenizer.as_deref().map_or("bundled phi-2".into(), |p| p.display().to_string()),
        engine = %tokenizer.engine(),
        "tokenizer: {}",
        tokenizer.engine()
    );
    drop(tokenizer);
    if let Some(path) = &config.chat_template {
        let template = semlb_tokenizer::chat::ChatTemplate::from_tokenizer_config(path)?;
        let renderer = template.renderer_name();
        tracing::info!(renderer, "chat template {}: {renderer} renderer", path.display());
    }
    // The admin API's token and address, before anything starts.
    let admin = match config.admin.listen {
        Some(addr) => {
            let token = config
                .admin
                .read_token()?
                .context("the admin API needs a bearer token (admin.token or admin.token_file)")?;
            let listener = admin::bind(addr).with_context(|| format!("cannot listen on {addr} for the admin API"))?;
            Some((listener, token))
        }
        None => None,
    };
    let plan = LayoutPlan::new(
        config.shm_size.0,
        PlanOptions {
            max_response_fraction: config.response_cache.max_value_fraction,
        },
    )?;
    let segment = create_segment(&config.shm_name, &plan)?;
    let name = segment.name().unwrap_or_default().to_owned();
    let result = (|| {
        let tables = segment.tables();
        let clock = segment.clock();
        let mut backends = Backends::default();
        for backend in &config.backends {
            backends.register(&segment, backend)?;
        }
        let me = tables.registry.claim(0, Role::Supervisor, clock.now_ms());
        tables.registry.attach(0, me, std::process::id(), clock.now_ms());
        let listener =
            TcpListener::bind(config.listen).with_context(|| format!("cannot listen on {}", config.listen))?;
        let addr = listener.local_addr()?;
        println!("semlb listening on http://{addr}");
        tracing::info!(
            shm = %name,
            "shm segment {name} ({}), {} dispatchers, {} responders, {} backends, policy {}",
            config.shm_size,
            config.dispatchers,
            config.responders,
            config.backends.len(),
            config.policy.kind
        );
        if config.store.kind == semlb::store::StoreKind::Redis {
            let r = &config.store.redis;
            let reachable = redis::Client::open(r.url.as_str())
                .and_then(|c| c.get_connection_with_timeout(r.timeout()))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
            match reachable {
                Ok(_) => tracing::info!(
                    "routing state in Redis at {} (namespace {}, lookup {:?})",
                    r.url,
                    r.namespace,
                    r.lookup
                ),
                Err(e) => tracing::warn!(
                    "routing state in Redis at {} (namespace {}, lookup {:?}): not reachable now ({e}); routing on load only until it is",
                    r.url,
                    r.namespace,
                    r.lookup
                ),
            }
        }
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let mut supervisor = Supervisor::new(&segment, config, args, &listener, backends, &notify);
        supervisor.admin_listener = admin;
        runtime.block_on(supervisor.monitor())
    })();
    if let Err(e) = &result {
        notify.stopping(&format!("failed: {e:#}"));
    }
    drop(segment);
    let _ = Segment::remove(&name);
    result
}

/// Creates the segment, replacing the leftover of a supervisor that died.
fn create_segment(name: &str, plan: &LayoutPlan) -> Result<Segment> {
    match Segment::create(name, plan) {
        Ok(s) => Ok(s),
        Err(CreateError::AlreadyExists { name: path }) => {
            let creator = Segment::open(name).map(|s| s.header().creator_pid).ok();
            if let Some(pid) = creator.filter(|pid| *pid != 0 && kill(Pid::from_raw(*pid as i32), None).is_ok()) {
                bail!(
                    "shm segment {path} is in use by a running semlb supervisor (pid {pid}); stop it first or pick another --shm-name"
                );
            }
            tracing::warn!(shm = %path, "removing the leftover shm segment {path} of a supervisor that is gone");
            Segment::remove(name)?;
            Ok(Segment::create(name, plan)?)
        }
        Err(e) => Err(e.into()),
    }
}

/// The backends registered in the server table: the configured ones, and
/// the removed ones still draining.
#[derive(Debug, Default)]
struct Backends {
    /// Configured backends, by address (`http://host:port`).
    live: Vec<(String, ServerRef)>,
    /// Removed backends finishing their requests: address, registration,
    /// when they are retired even with requests in flight.
    draining: Vec<(String, ServerRef, Instant)>,
    /// The server-table id of the next registration (ids are never reused).
    next_id: u64,
    /// Names (`name`, else `host:port`) by address, live and draining.
    names: HashMap<String, String>,
    /// Addresses of live backends added through the admin API and not (or
    /// not yet) listed in the configuration.
    from_admin: HashSet<String>,
}

impl Backends {
    /// Registers `backend` in the server table (state `Up`: dispatchers
    /// route to it at once) and counts it as configured.
    fn register(&mut self, segment: &Segment, backend: &BackendConfig) -> Result<ServerRef> {
        let address = backend_address(backend)?;
        let server = segment
            .tables()
            .servers
            .register(self.next_id, &address, segment.clock().now_ms())
            .with_context(|| format!("registering backend {}", backend.url))?;
        self.next_id += 1;
        self.names.insert(address.clone(), backend.display_name());
        self.live.push((address, server));
        Ok(server)
    }

    /// The live backend in server-table slot `slot`.
    fn live_in(&self, slot: u16) -> Option<usize> {
        self.live.iter().position(|(_, s)| s.slot == slot)
    }

    /// Moves live backend `i` to the draining list (state `Draining`), to be
    /// retired once drained or at `until`.
    fn start_draining(&mut self, segment: &Segment, i: usize, until: Instant) -> (String, ServerRef) {
        let (address, server) = self.live.remove(i);
        segment.tables().servers.set_state(server, ServerState::Draining);
        self.from_admin.remove(&address);
        self.draining.push((address.clone(), server, until));
        (address, server)
    }
}

/// How a backend is named in the server table: `http://host:port`.
fn backend_address(backend: &BackendConfig) -> Result<String> {
    let url = backend
        .parsed_url()
        .map_err(|e| anyhow!("backend {}: {e}", backend.url))?;
    Ok(format!("http://{}", url.authority()))
}

/// The supervisor's state while it runs the children.
struct Supervisor<'a> {
    segment: &'a Segment,
    /// The configuration in force (the last one reloaded).
    config: ServeConfig,
    /// The command line, for resolving the configuration again.
    args: &'a ServeArgs,
    /// The flags children are started with: the command line with the
    /// settings that need a restart pinned to the running values.
    child_args: Vec<OsString>,
    listener: &'a TcpListener,
    slots: Vec<Slot>,
    backends: Backends,
    notify: &'a Notifier,
    /// Children restarted since the start.
    restarts: u64,
    /// The last reload's error, while no later reload succeeded.
    reload_error: Option<String>,
    /// Health checks and load scraping of the backends ([`semlb::health`]),
    /// restarted with the new configuration by a reload.
    health: Option<tokio::task::JoinHandle<()>>,
    /// The admin API's listener and token until `monitor` starts serving it.
    admin_listener: Option<(TcpListener, String)>,
}

/// How a stop was asked for.
enum Stop {
    /// SIGTERM: drain.
    Term,
    /// SIGINT: a short grace.
    Int,
}

impl<'a> Supervisor<'a> {
    fn new(
        segment: &'a Segment,
        config: ServeConfig,
        args: &'a ServeArgs,
        listener: &'a TcpListener,
        backends: Backends,
        notify: &'a Notifier,
    ) -> Self {
        let slots: Vec<Slot> = (0..config.dispatchers)
            .map(|i| (ChildRole::Dispatcher, i))
            .chain((0..config.responders).map(|j| (ChildRole::Responder, j)))
            .enumerate()
            .map(|(k, (role, index))| Slot {
                role,
                slot: k as u16 + 1,
                index,
                incarnation: 0,
                pid: None,
                restart_at: Some(Instant::now()),
                backoff: BACKOFF_START,
                restarts: VecDeque::new(),
            })
            .collect();
        let child_args = pinned_args(args, &config).to_args();
        Self {
            segment,
            config,
            args,
            child_args,
            listener,
            slots,
            backends,
            notify,
            restarts: 0,
            reload_error: None,
            health: None,
            admin_listener: None,
        }
    }

    /// Keeps the children running until SIGTERM/SIGINT or a crash loop,
    /// then stops them.
    async fn monitor(mut self) -> Result<()> {
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let mut hup = signal(SignalKind::hangup())?;
        let mut chld = signal(SignalKind::child())?;
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        let probe_addr = probe_address(self.listener.local_addr()?);
        self.restart_health()?;
        // Admin requests reach this loop as commands; the sender is kept
        // here too, so `recv` never ends without an admin API.
        let (admin_tx, mut admin_rx) = mpsc::channel::<admin::Command>(16);
        let admin_task = match self.admin_listener.take() {
            Some((listener, token)) => {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                tracing::info!("admin API on http://{}", listener.local_addr()?);
                Some(tokio::spawn(admin::serve(listener, token, admin_tx.clone())))
            }
            None => None,
        };
        let mut ready = false;
        let mut last_ping: Option<Instant> = None;
        let mut last_status = (String::new(), Instant::now());
        let outcome: Result<Stop> = loop {
            tokio::select! {
                _ = term.recv() => break Ok(Stop::Term),
                _ = int.recv() => break Ok(Stop::Int),
                _ = hup.recv() => {
                    if ready {
                        self.notify.reloading();
                    }
                    self.reload();
                    if ready {
                        self.notify.ready(&self.status_line());
                    }
                }
                Some((request, reply)) = admin_rx.recv() => {
                    let answer = self.admin_request(request);
                    let _ = reply.send(answer);
                }
                _ = chld.recv() => {}
                _ = tick.tick() => {}
            }
            self.reap();
            self.kill_hung();
            if let Some(e) = self.start_due() {
                break Err(e);
            }
            self.retire_drained();
            if !ready && self.children_up() && probe(probe_addr).await {
                ready = true;
                let status = self.status_line();
                tracing::info!("ready: {status}");
                self.notify.ready(&status);
                last_status = (status, Instant::now());
            }
            if !ready {
                continue;
            }
            if let Some(interval) = self.notify.watchdog_interval()
                && last_ping.is_none_or(|t| t.elapsed() >= interval / 2)
                && self.healthy()
            {
                self.notify.watchdog();
                last_ping = Some(Instant::now());
            }
            let status = self.status_line();
            if status != last_status.0 || last_status.1.elapsed() >= STATUS_EVERY {
                self.notify.status(&status);
                last_status = (status, Instant::now());
            }
        };
        if let Some(task) = admin_task {
            task.abort();
        }
        drop(admin_tx);
        let grace = match &outcome {
            Ok(Stop::Term) => {
                self.notify.stopping("stopping: draining the requests in flight");
                self.config.drain_timeout() + Duration::from_secs(2)
            }
            Ok(Stop::Int) => {
                self.notify.stopping("stopping (SIGINT)");
                Duration::from_secs(1)
            }
            Err(e) => {
                self.notify.stopping(&format!("stopping: {e}"));
                Duration::from_secs(1)
            }
        };
        stop_children(&mut self.slots, grace).await;
        outcome.map(|_| ())
    }

    /// Reaps whatever died, and schedules its restart.
    fn reap(&mut self) {
        let tables = self.segment.tables();
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, _) | WaitStatus::Signaled(pid, _, _)) => {
                    if let Some(s) = self.slots.iter_mut().find(|s| s.pid == Some(pid)) {
                        tracing::warn!(child = ?s.role, index = s.index, pid = pid.as_raw(), "{:?} {} (pid {pid}) exited", s.role, s.index);
                        tables.registry.mark_exited(s.slot, s.incarnation);
                        tables.servers.reclaim_process(s.slot);
                        s.pid = None;
                        s.restart_at = Some(Instant::now() + s.backoff);
                        s.backoff = (s.backoff * 2).min(BACKOFF_MAX);
                    }
                }
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(_) => {}
            }
        }
    }

    /// Kills hung children (their exit is reaped next round).
    fn kill_hung(&self) {
        let tables = self.segment.tables();
        let now_ms = self.segment.clock().now_ms();
        for s in self.slots.iter().filter(|s| s.pid.is_some()) {
            if let Some(info) = tables.registry.get(s.slot)
                && info.incarnation == s.incarnation
                && info.state == ProcessState::Running
                && now_ms.saturating_sub(info.heartbeat_ms) > HUNG_AFTER_MS
            {
                tracing::warn!(
                    child = ?s.role,
                    index = s.index,
                    "{:?} {} missed its heartbeats for {} ms; killing it",
                    s.role,
                    s.index,
                    now_ms - info.heartbeat_ms
                );
                let _ = kill(s.pid.expect("filtered"), Signal::SIGKILL);
            }
        }
    }

    /// (Re)starts the children that are due; a crash loop is an error.
    fn start_due(&mut self) -> Option<anyhow::Error> {
        let tables = self.segment.tables();
        let clock = self.segment.clock();
        for s in self.slots.iter_mut() {
            let due = s.pid.is_none() && s.restart_at.is_some_and(|t| t <= Instant::now());
            if !due {
                continue;
            }
            let started = Instant::now();
            if s.incarnation > 0 {
                s.restarts.push_back(started);
                while s.restarts.front().is_some_and(|t| started - *t > CRASH_WINDOW) {
                    s.restarts.pop_front();
                }
                if s.restarts.len() >= CRASH_LIMIT {
                    return Some(anyhow!(
                        "{:?} {} crashed {CRASH_LIMIT} times within {CRASH_WINDOW:?}: crash loop, stopping",
                        s.role,
                        s.index
                    ));
                }
                tracing::info!(child = ?s.role, index = s.index, "restarting {:?} {}", s.role, s.index);
                self.restarts += 1;
            }
            let role = match s.role {
                ChildRole::Dispatcher => Role::Dispatcher,
                ChildRole::Responder => Role::Responder,
            };
            s.incarnation = tables.registry.claim(s.slot, role, clock.now_ms());
            let fd = (s.role == ChildRole::Dispatcher).then(|| self.listener.as_raw_fd());
            match spawn_child(s, fd, &self.child_args) {
                Ok(pid) => {
                    s.pid = Some(pid);
                    s.restart_at = None;
                }
                Err(e) => {
                    tracing::error!(child = ?s.role, index = s.index, error = %e, "cannot start {:?} {}: {e}", s.role, s.index);
                    tables.registry.mark_exited(s.slot, s.incarnation);
                    s.restart_at = Some(Instant::now() + s.backoff);
                    s.backoff = (s.backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
        // A child that stayed up a while earns a fresh backoff.
        for s in self.slots.iter_mut() {
            if s.pid.is_some() && s.restarts.back().is_none_or(|t| t.elapsed() > CRASH_WINDOW) {
                s.backoff = BACKOFF_START;
            }
        }
        None
    }

    /// Whether every child runs its current incarnation and has attached
    /// to its registry slot (and `fresh`: heartbeated within
    /// [`FRESH_HEARTBEAT_MS`]).
    fn all_running(&self, fresh: bool) -> bool {
        let tables = self.segment.tables();
        let now_ms = self.segment.clock().now_ms();
        self.slots.iter().all(|s| {
            s.pid.is_some()
                && tables.registry.get(s.slot).is_some_and(|info| {
                    info.incarnation == s.incarnation
                        && info.state == ProcessState::Running
                        && (!fresh || now_ms.saturating_sub(info.heartbeat_ms) <= FRESH_HEARTBEAT_MS)
                })
        })
    }

    /// Up: every child attached (the dispatchers then share the listener).
    fn children_up(&self) -> bool {
        self.all_running(false)
    }

    /// Healthy, for the watchdog: every child attached with a fresh
    /// heartbeat. A child being restarted, hung or in a crash loop makes
    /// the supervisor unhealthy until it runs again.
    fn healthy(&self) -> bool {
        self.all_running(true)
    }

    /// One line for `systemctl status`.
    fn status_line(&self) -> String {
        let tables = self.segment.tables();
        let now_ms = self.segment.clock().now_ms();
        let count = |role: ChildRole| {
            let of_role = self.slots.iter().filter(|s| s.role == role);
            let up = of_role
                .clone()
                .filter(|s| {
                    s.pid.is_some()
                        && tables.registry.get(s.slot).is_some_and(|i| {
                            i.incarnation == s.incarnation
                                && i.state == ProcessState::Running
                                && now_ms.saturating_sub(i.heartbeat_ms) <= FRESH_HEARTBEAT_MS
                        })
                })
                .count();
            (up, of_role.count())
        };
        let (d_up, d) = count(ChildRole::Dispatcher);
        let (r_up, r) = count(ChildRole::Responder);
        let servers_up = self
            .backends
            .live
            .iter()
            .filter(|(_, server)| {
                tables
                    .servers
                    .current(server.slot)
                    .is_some_and(|(s, state)| s == *server && state == ServerState::Up)
            })
            .count();
        let mut line = format!(
            "{d_up}/{d} dispatchers, {r_up}/{r} responders up, {} restarts; backends {servers_up}/{} up",
            self.restarts,
            self.backends.live.len()
        );
        if !self.backends.draining.is_empty() {
            line.push_str(&format!(", {} draining", self.backends.draining.len()));
        }
        line.push_str(&format!("; policy {}", self.config.policy.kind));
        if let Some(e) = &self.reload_error {
            line.push_str(&format!("; last reload failed: {e}"));
        }
        line
    }

    /// SIGHUP: resolves the configuration again and applies what can change
    /// while running (see the module docs); a configuration that does not
    /// resolve is logged and the running one kept.
    fn reload(&mut self) {
        let new = match self.reloaded_config() {
            Ok(new) => new,
            Err(e) => {
                tracing::warn!(error = %e, "reload rejected, keeping the running configuration: {e}");
                self.reload_error = Some(e);
                return;
            }
        };
        self.reload_error = None;
        // Backends: removed ones drain, added ones register, returning ones
        // (still draining) are Up again; the others are not touched.
        let servers = self.segment.tables().servers;
        let mut wanted = Vec::new();
        for backend in &new.backends {
            match backend_address(backend) {
                Ok(a) if !wanted.iter().any(|(w, _)| *w == a) => wanted.push((a, backend)),
                Ok(_) => {}
                Err(e) => tracing::error!("reload: {e:#}"),
            }
        }
        let (mut added, mut removed) = (0, 0);
        let until = Instant::now() + new.drain_timeout();
        while let Some(i) = self
            .backends
            .live
            .iter()
            .position(|(a, _)| !wanted.iter().any(|(w, _)| w == a))
        {
            let (address, _) = self.backends.start_draining(self.segment, i, until);
            tracing::info!(backend = %address, "reload: backend {address} removed; draining it");
            removed += 1;
        }
        for (address, backend) in wanted {
            // Listed in the file: the file's from now on, under its name.
            self.backends.from_admin.remove(&address);
            self.backends.names.insert(address.clone(), backend.display_name());
            if self.backends.live.iter().any(|(a, _)| *a == address) {
                continue;
            }
            added += 1;
            if let Some(i) = self.backends.draining.iter().position(|(a, _, _)| *a == address)
                && servers.set_state(self.backends.draining[i].1, ServerState::Up)
            {
                let (address, server, _) = self.backends.draining.remove(i);
                tracing::info!(backend = %address, "reload: backend {address} added again (it was still draining)");
                self.backends.live.push((address, server));
                continue;
            }
            match self.backends.register(self.segment, backend) {
                Ok(_) => tracing::info!(backend = %address, "reload: backend {address} added"),
                Err(e) => {
                    added -= 1;
                    tracing::error!(backend = %address, "reload: cannot add backend {address}: {e:#}");
                }
            }
        }
        // The dispatchers resolve the configuration again themselves (with
        // the same flags) and take its routing policy.
        for s in self.slots.iter().filter(|s| s.role == ChildRole::Dispatcher) {
            if let Some(pid) = s.pid {
                let _ = kill(pid, Signal::SIGHUP);
            }
        }
        tracing::info!(
            added,
            removed,
            "reloaded: {added} backends added, {removed} removed, {} configured; policy {}",
            self.backends.live.len(),
            new.policy.kind
        );
        self.config = new;
        // The checker takes the new [health] settings and metrics flavors;
        // its state lives in the server table, so nothing is lost.
        if let Err(e) = self.restart_health() {
            tracing::error!("reload: cannot restart the health checks: {e:#}");
        }
    }

    /// (Re)starts the health checks and load scraping with the running
    /// configuration, on a mapping of the segment of their own.
    fn restart_health(&mut self) -> Result<()> {
        if let Some(old) = self.health.take() {
            old.abort();
        }
        let segment = Segment::open(&self.config.shm_name).context("opening the segment for the health checks")?;
        self.health = Some(semlb::health::spawn(
            std::sync::Arc::new(segment),
            std::sync::Arc::new(self.config.clone()),
        ));
        Ok(())
    }

    /// The configuration file and the command line again, with the settings
    /// that need a restart kept at their running values (each change of
    /// one is logged). The error is one line, naming the key.
    fn reloaded_config(&self) -> Result<ServeConfig, String> {
        let one_line = |e: &dyn std::fmt::Display| {
            e.to_string()
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join(" ")
        };
        let mut new =
            ServeConfig::resolve(self.args.config.as_deref(), self.args.overrides()).map_err(|e| one_line(&e))?;
        let old = &self.config;
        let mut kept = Vec::new();
        macro_rules! keep {
            ($($field:ident).+) => {
                if new.$($field).+ != old.$($field).+ {
                    kept.push(stringify!($($field).+).replace(' ', ""));
                    new.$($field).+ = old.$($field).+.clone();
                }
            };
        }
        keep!(listen);
        keep!(dispatchers);
        keep!(responders);
        keep!(shm_name);
        keep!(shm_size);
        keep!(tokenizer);
        keep!(chat_template);
        keep!(block_size);
        keep!(store);
        keep!(admin);
        if !kept.is_empty() {
            tracing::warn!(
                "reload: {} changed; that needs a restart (systemctl restart semlb): keeping the running values",
                kept.join(", ")
            );
        }
        let mut at_start = Vec::new();
        if new.limits != old.limits {
            at_start.push("limits");
        }
        if new.response_cache != old.response_cache {
            at_start.push("response_cache");
        }
        if new.drain_timeout_secs != old.drain_timeout_secs {
            at_start.push("drain_timeout_secs");
        }
        if !at_start.is_empty() {
            tracing::warn!(
                "reload: {} changed; dispatchers read that when they start: restart the service to apply it to all",
                at_start.join(", ")
            );
        }
        new.validate().map_err(|e| one_line(&e))?;
        Ok(new)
    }

    /// Retires the removed backends whose requests have finished, or whose
    /// drain timeout has passed.
    fn retire_drained(&mut self) {
        let servers = self.segment.tables().servers;
        let now = Instant::now();
        let names = &mut self.backends.names;
        self.backends.draining.retain(|(address, server, until)| {
            let (inflight, _) = servers.inflight(*server);
            if inflight > 0 && now < *until {
                return true;
            }
            servers.retire(*server);
            names.remove(address);
            if inflight > 0 {
                tracing::warn!(
                    backend = %address,
                    inflight,
                    "backend {address} removed after the drain timeout with {inflight} requests in flight"
                );
            } else {
                tracing::info!(backend = %address, "backend {address} drained and removed");
            }
            false
        });
    }
}

impl Supervisor<'_> {
    /// Carries out one admin API request ([`crate::admin`]) and answers it.
    fn admin_request(&mut self, request: admin::Request) -> Reply {
        use admin::Request as R;
        match request {
            R::ListServers => self.admin_list(),
            R::AddServer(backend) => self.admin_add(&backend),
            R::Drain(slot) => self.admin_drain(slot, true),
            R::Undrain(slot) => self.admin_drain(slot, false),
            R::Remove(slot) => self.admin_remove(slot),
            R::Tables => self.admin_tables(),
            R::FlushPrefixes | R::FlushResponses => self.admin_flush(matches!(request, R::FlushPrefixes)),
        }
    }

    /// `GET /admin/servers`.
    fn admin_list(&self) -> Reply {
        let now_ms = self.segment.clock().now_ms();
        let servers: Vec<_> = self
            .segment
            .tables()
            .servers
            .servers()
            .map(|info| {
                let managed = if self.backends.draining.iter().any(|(_, s, _)| *s == info.server) {
                    "removing"
                } else if self.backends.from_admin.contains(&info.address) {
                    "admin"
                } else {
                    "config"
                };
                let name = self.backends.names.get(&info.address).map(String::as_str);
                admin::server_json(&info, now_ms, name, managed)
            })
            .collect();
        Reply::new(http::StatusCode::OK, json!({ "servers": servers }))
    }

    /// `POST /admin/servers`: validated like a `[[backend]]`, registered
    /// like a reload registers one.
    fn admin_add(&mut self, backend: &BackendConfig) -> Reply {
        use http::StatusCode as S;
        let address = match backend.parsed_url() {
            Ok(url) => format!("http://{}", url.authority()),
            Err(reason) => {
                return Reply::error(
                    S::BAD_REQUEST,
                    format!("url {:?}: {reason}", backend.url),
                    "invalid_url",
                );
            }
        };
        if let Err(reason) = backend.check_name() {
            let name = backend.name.as_deref().unwrap_or_default();
            return Reply::error(S::BAD_REQUEST, format!("name {name:?}: {reason}"), "invalid_name");
        }
        if let Some((_, server)) = self.backends.live.iter().find(|(a, _)| *a == address) {
            return Reply::error(
                S::CONFLICT,
                format!("{address} is already registered, in slot {}", server.slot),
                "already_registered",
            );
        }
        let name = backend.display_name();
        let taken = self
            .backends
            .live
            .iter()
            .find(|(a, _)| self.backends.names.get(a) == Some(&name));
        if let Some((other, _)) = taken {
            return Reply::error(
                S::CONFLICT,
                format!("the name {name:?} is taken by {other}; names must be unique"),
                "name_taken",
            );
        }
        let servers = self.segment.tables().servers;
        let again = self.backends.draining.iter().position(|(a, _, _)| *a == address);
        let server = match again {
            // Being removed: it takes requests again, as after a reload
            // that lists it again.
            Some(i) if servers.set_state(self.backends.draining[i].1, ServerState::Up) => {
                let (address, server, _) = self.backends.draining.remove(i);
                self.backends.names.insert(address.clone(), name.clone());
                self.backends.live.push((address, server));
                server
            }
            _ => match self.backends.register(self.segment, backend) {
                Ok(server) => server,
                Err(e) => return Reply::error(S::CONFLICT, format!("cannot add {address}: {e:#}"), "table_full"),
            },
        };
        self.backends.from_admin.insert(address.clone());
        tracing::info!(backend = %address, slot = server.slot, "admin: backend {address} ({name}) added in slot {}", server.slot);
        Reply::new(
            S::CREATED,
            json!({
                "slot": server.slot,
                "generation": server.generation,
                "address": address,
                "name": name,
                "state": "up",
            }),
        )
    }

    /// `POST /admin/servers/{slot}/drain` (`drain`) and `.../undrain`.
    fn admin_drain(&mut self, slot: u16, drain: bool) -> Reply {
        use http::StatusCode as S;
        let servers = self.segment.tables().servers;
        if let Some((address, server, _)) = self.backends.draining.iter().find(|(_, s, _)| s.slot == slot) {
            return if drain {
                let (inflight, _) = servers.inflight(*server);
                Reply::new(
                    S::OK,
                    json!({"slot": slot, "address": address, "state": "draining", "removing": true, "inflight_requests": inflight}),
                )
            } else {
                Reply::error(
                    S::CONFLICT,
                    format!("{address} is being removed; add it again with POST /admin/servers"),
                    "removing",
                )
            };
        }
        let Some(i) = self.backends.live_in(slot) else {
            return Reply::unknown_slot(slot);
        };
        let (address, server) = self.backends.live[i].clone();
        let state = if drain {
            servers.set_state(server, ServerState::Draining);
            tracing::info!(backend = %address, "admin: backend {address} draining");
            ServerState::Draining
        } else {
            // Only a drained server is set Up; a down one stays to the
            // health checks.
            if servers.transition(server, ServerState::Draining, ServerState::Up) {
                tracing::info!(backend = %address, "admin: backend {address} takes requests again");
            }
            servers.current(slot).map_or(ServerState::Up, |(_, state)| state)
        };
        let (inflight, _) = servers.inflight(server);
        Reply::new(
            S::OK,
            json!({"slot": slot, "address": address, "state": state.name(), "removing": false, "inflight_requests": inflight}),
        )
    }

    /// `DELETE /admin/servers/{slot}`: drain, then retire once drained.
    fn admin_remove(&mut self, slot: u16) -> Reply {
        use http::StatusCode as S;
        if let Some(i) = self.backends.live_in(slot) {
            let until = Instant::now() + self.config.drain_timeout();
            let (address, _) = self.backends.start_draining(self.segment, i, until);
            tracing::info!(backend = %address, "admin: backend {address} removed; draining it");
            self.retire_drained();
            if !self.backends.draining.iter().any(|(_, s, _)| s.slot == slot) {
                return Reply::new(S::OK, json!({"slot": slot, "address": address, "removed": true}));
            }
        }
        let servers = self.segment.tables().servers;
        let Some((address, server, until)) = self.backends.draining.iter().find(|(_, s, _)| s.slot == slot) else {
            return Reply::unknown_slot(slot);
        };
        let (inflight, _) = servers.inflight(*server);
        Reply::new(
            S::ACCEPTED,
            json!({
                "slot": slot,
                "address": address,
                "removed": false,
                "state": "draining",
                "inflight_requests": inflight,
                "removed_within_ms": until.saturating_duration_since(Instant::now()).as_millis() as u64,
            }),
        )
    }

    /// `GET /admin/tables`.
    fn admin_tables(&self) -> Reply {
        let tables = self.segment.tables();
        let stats = tables.responses.stats();
        Reply::new(
            http::StatusCode::OK,
            json!({
                "store": self.config.store.kind.to_string(),
                "prefix": {"entries": tables.prefix.occupancy(), "capacity": tables.prefix.capacity()},
                "responses": {
                    "entries": tables.responses.index_occupancy(),
                    "capacity": tables.responses.index_capacity(),
                    "log_bytes": stats.capacity,
                    "records_written": stats.records,
                },
            }),
        )
    }

    /// `POST /admin/flush/prefixes` (`prefixes`) and `.../responses`.
    fn admin_flush(&self, prefixes: bool) -> Reply {
        let what = if prefixes { "prefix table" } else { "response cache" };
        if self.config.store.kind == semlb::store::StoreKind::Redis {
            return Reply::error(
                http::StatusCode::CONFLICT,
                format!(
                    "the {what} is in Redis (store.kind = \"redis\"), not in this host's segment; flush it in Redis"
                ),
                "redis_store",
            );
        }
        let tables = self.segment.tables();
        let removed = if prefixes {
            tables.prefix.clear()
        } else {
            tables.responses.clear()
        };
        tracing::info!(removed, "admin: {what} flushed ({removed} entries removed)");
        Reply::new(
            http::StatusCode::OK,
            json!({ "flushed": if prefixes { "prefixes" } else { "responses" }, "removed": removed }),
        )
    }
}

/// `args` with the settings that need a restart set to `config`'s values,
/// so that a child (re)started after the file changed uses the running
/// segment, process counts, tokenizer and store.
fn pinned_args(args: &ServeArgs, config: &ServeConfig) -> ServeArgs {
    let mut pinned = args.clone();
    pinned.listen = Some(config.listen);
    pinned.dispatchers = Some(config.dispatchers);
    pinned.responders = Some(config.responders);
    pinned.shm_name = Some(config.shm_name.clone());
    pinned.shm_size = Some(config.shm_size);
    pinned.block_size = Some(config.block_size);
    if config.tokenizer.is_some() {
        pinned.tokenizer.clone_from(&config.tokenizer);
    }
    if config.chat_template.is_some() {
        pinned.chat_template.clone_from(&config.chat_template);
    }
    pinned.store = Some(config.store.kind);
    pinned.redis_url = Some(config.store.redis.url.clone());
    pinned.redis_namespace = Some(config.store.redis.namespace.clone());
    pinned.redis_lookup = Some(config.store.redis.lookup);
    pinned
}

/// Where the supervisor asks its own listener for `/health`: the listening
/// address, loopback for a wildcard one.
fn probe_address(listening: SocketAddr) -> SocketAddr {
    let ip = match listening.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, listening.port())
}

/// Whether a dispatcher answers `GET /health` on `addr` (any HTTP status:
/// 503 only says no backend is up) within a second.
async fn probe(addr: SocketAddr) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: semlb\r\nConnection: close\r\n\r\n")
            .await?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await?;
        Ok::<bool, std::io::Error>(head.starts_with(b"HTTP/1.1 "))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), attempt).await,
        Ok(Ok(true))
    )
}

/// SIGTERM to every child, then SIGKILL after `grace`; reaps them all.
async fn stop_children(slots: &mut [Slot], grace: Duration) {
    for s in slots.iter() {
        if let Some(pid) = s.pid {
            let _ = kill(pid, Signal::SIGTERM);
        }
    }
    let deadline = Instant::now() + grace;
    let mut pending: HashMap<Pid, ()> = slots.iter().filter_map(|s| s.pid).map(|p| (p, ())).collect();
    while !pending.is_empty() {
        if let Ok(WaitStatus::Exited(pid, _) | WaitStatus::Signaled(pid, _, _)) =
            waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG))
        {
            pending.remove(&pid);
            continue;
        }
        if Instant::now() >= deadline {
            for pid in pending.keys() {
                let _ = kill(*pid, Signal::SIGKILL);
            }
            for pid in pending.keys() {
                let _ = waitpid(*pid, None);
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for s in slots.iter_mut() {
        s.pid = None;
    }
}

fn spawn_child(s: &Slot, listen_fd: Option<RawFd>, serve_args: &[OsString]) -> std::io::Result<Pid> {
    let exe = std::env::current_exe()?;
    let role = match s.role {
        ChildRole::Dispatcher => "dispatcher",
        ChildRole::Responder => "responder",
    };
    let mut cmd = Command::new(exe);
    cmd.arg("__child")
        .args([
            "--role",
            role,
            "--slot",
            &s.slot.to_string(),
            "--incarnation",
            &s.incarnation.to_string(),
        ])
        .args(["--index", &s.index.to_string()])
        .args(serve_args)
        .stdin(Stdio::null());
    for var in notify::ENV_VARS {
        // Only the supervisor talks to systemd.
        cmd.env_remove(var);
    }
    let supervisor = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls (signal, prctl, getppid, dup2, fcntl,
    // _exit).
    unsafe {
        cmd.pre_exec(move || {
            // Ignored across exec until a dispatcher installs its reload
            // handler, so a forwarded SIGHUP never kills a starting child.
            if libc::signal(libc::SIGHUP, libc::SIG_IGN) == libc::SIG_ERR {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != supervisor {
                // The supervisor died between fork and prctl.
                libc::_exit(1);
            }
            if let Some(fd) = listen_fd {
                if fd != LISTEN_FD && libc::dup2(fd, LISTEN_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let flags = libc::fcntl(LISTEN_FD, libc::F_GETFD);
                if flags < 0 || libc::fcntl(LISTEN_FD, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    Ok(Pid::from_raw(child.id() as i32))
}

/// Starts `semlb __sim` and returns it with its base URL.
fn start_sim(time_scale: f64, log: &LogArgs) -> Result<(Child, String)> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "__sim",
        "--listen",
        "127.0.0.1:0",
        "--time-scale",
        &time_scale.to_string(),
    ])
    .args(log.to_args())
    .stdin(Stdio::null())
    .stdout(Stdio::piped());
    for var in notify::ENV_VARS {
        cmd.env_remove(var);
    }
    // SAFETY: only prctl, an async-signal-safe call, runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0);
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting a demo engine")?;
    let mut line = String::new();
    let mut out = BufReader::new(child.stdout.take().expect("piped"));
    out.read_line(&mut line)?;
    // Keep draining its stdout so the engine never writes into a closed pipe.
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    let url = line
        .trim()
        .rsplit(' ')
        .next()
        .filter(|u| u.starts_with("http://"))
        .map(str::to_owned);
    match url {
        Some(url) => Ok((child, url)),
        None => {
            let _ = child.kill();
            bail!("the demo engine did not start (it printed {line:?})")
        }
    }
}
