//! `semlb serve`: the supervisor.
//!
//! It resolves the configuration (file, then flags), claims the shm
//! segment ([`segment`]: created, or adopted with its tables from the
//! supervisor before, or replaced; one a live supervisor owns is refused),
//! registers the backends in the server table, binds the listener, and
//! keeps the dispatcher and response processes running ([`children`])
//! until a signal:
//!
//! * **SIGTERM**: stop accepting (children get SIGTERM and drain within the
//!   drain timeout), then SIGKILL stragglers, leave the segment for the
//!   next start (or remove it: `keep_segment = false`), exit 0.
//!   **SIGINT**: the same with a 1 s grace. A crash loop stops everything
//!   the same way and exits non-zero.
//! * **SIGUSR2**: upgrade ([`upgrade`]). The binary now installed where
//!   this one was started from is started with the same command line as
//!   the successor, handed the listening socket and the segment, and once
//!   its dispatchers answer, this supervisor tells systemd `MAINPID=` and
//!   drains as on SIGTERM, leaving the segment to it.
//! * **SIGHUP**: reload. The configuration is resolved again ([`reload`]).
//!   If it does not parse or validate, the error is logged on one line
//!   (naming the key), `STATUS=` says the reload failed, and everything
//!   keeps running as it was. Otherwise, with no connection dropped and
//!   the shared tables kept, the backends take the new list
//!   ([`backends`]), the health checks restart with the new settings, and
//!   SIGHUP is forwarded to the dispatchers, which resolve the
//!   configuration themselves (same flags) and swap their routing policy
//!   in place (one that fails to resolve keeps its policy). `--backend`
//!   flags replace the file's `[[backend]]` list at every reload too, so a
//!   gateway started with them cannot change its backends by reloading.
//!
//! With `[admin] listen` (or `--admin-listen`) the supervisor also serves
//! [`crate::supervisor::admin::http`] on that address, in its own runtime. The token is read
//! (and a world-readable token file refused) and the address bound before
//! anything starts, so a problem stops the start with one clear error.
//! Each request reaches the supervisor's loop as a command over a channel
//! and is carried out there ([`admin`]). `[admin]` itself needs a restart.
//!
//! Under systemd (`Type=notify`) it reports readiness, a status line and
//! watchdog pings ([`status`]). `--demo N` first starts N simulated engines
//! on loopback ([`sims`]) and uses them as the backends; unless given, it
//! listens on `127.0.0.1:8080` and names its segment `semlb-demo`.
//!
//! | module | concept |
//! | --- | --- |
//! | this one | start and stop: configuration, segment, listener; the loop over signals, admin commands and ticks |
//! | [`segment`] | the segment: claimed (created, adopted, replaced) at start, kept or removed at exit |
//! | [`children`] | child slots: spawn, reap, restart with backoff, crash loops, hung children, stop |
//! | [`backends`] | the registered backends: add, drain, retire; a reload's backend list |
//! | [`discovered`] | backends found at run time: the discovery source followed, each set reconciled with the server table |
//! | [`reload`] | the configuration again on SIGHUP, the settings that need a restart pinned |
//! | [`admin`] | the admin API: its HTTP side (`admin::http`, bearer token), its commands carried out on the backends and the segment, and its model pool changes (`admin::models`: checked, kept in `admin.models_file`, applied as a reload) |
//! | [`systemd`] | readiness probe, watchdog and `STATUS=` line for systemd |
//! | [`sd_notify`] | systemd's notification protocol (`READY=1`, `WATCHDOG=1`, ...) for `Type=notify` |
//! | [`metrics_listener`] | `GET /metrics` on an address of its own (`[metrics] listen`) |
//! | [`side_listener`] | the capped accept loop of the supervisor's own listeners (admin API, metrics) |
//! | [`upgrade`] | zero-downtime binary upgrade: the successor started on SIGUSR2, the sockets and segment handed over |
//! | [`sims`] | the simulated engines of `--demo` |

mod admin;
mod backends;
mod children;
mod discovered;
pub(crate) mod metrics_listener;
mod reload;
pub(crate) mod sd_notify;
mod segment;
pub(crate) mod side_listener;
mod sims;
mod systemd;
mod upgrade;

use std::io::Write as _;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use semlb::config::ServeConfig;
use shm_layout::{Role, SUPERVISOR_SLOT, Segment};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use self::backends::Backends;
use self::children::Children;
use self::discovered::Discovery;
use self::systemd::Reports;
use self::upgrade::{Progress, Successor};
use crate::cli::{ChildRole, ServeArgs};
use crate::supervisor::sd_notify::Notifier;
use semlb::store::redis::credentials;

/// Runs the gateway until SIGTERM/SIGINT (or a crash loop).
pub fn run(args: &ServeArgs) -> Result<()> {
    let mut args = args.clone();
    let mut engines = Vec::new();
    if args.demo.is_some() {
        // A demo listens on loopback and uses its own segment, so it never
        // collides with (or exposes) a real gateway on the same host.
        args.listen.get_or_insert(SocketAddr::from(([127, 0, 0, 1], 8080)));
        args.shm_name.get_or_insert_with(|| "semlb-demo".to_owned());
    }
    if let Some(n) = args.demo {
        for _ in 0..n {
            let (child, url) = sims::start_sim(args.demo_time_scale, &args.log)?;
            tracing::info!(engine = %url, pid = child.id(), "demo engine {url} (pid {})", child.id());
            args.backends.push(url);
            engines.push(child);
        }
    }
    let result = supervise(&args);
    for mut engine in engines {
        let _ = kill(Pid::from_raw(engine.id() as i32), Signal::SIGTERM);
        let _ = engine.wait();
    }
    result
}

fn supervise(args: &ServeArgs) -> Result<()> {
    let notify = Notifier::from_env();
    // Started by a supervisor handing over to this one (an upgrade)?
    let inherited = upgrade::Inherited::from_env()?;
    let mut config = ServeConfig::resolve(args.config.as_deref(), args.overrides())?;
    if let Some(i) = &inherited {
        // A successor keeps the segment it is handed, whatever the file
        // now says (a new shm_name needs a restart).
        config.shm_name.clone_from(&i.shm);
    }
    check_before_start(&config)?;
    let mut inherited_epp = None;
    let (mut inherited_listener, ready_pipe, mut inherited_admin, mut inherited_metrics, inherited_owner) =
        match inherited {
            Some(mut i) => {
                inherited_epp = i.epp.take();
                (Some(i.listener), i.ready, i.admin, i.metrics, Some((i.shm, i.owner)))
            }
            None => (None, None, None, None, None),
        };
    // The admin API's token and address, before anything starts.
    let admin = match config.admin.listen {
        Some(addr) => {
            let token = config
                .admin
                .read_token(args.config.as_deref())?
                .context("the admin API needs a bearer token (admin.token or admin.token_file)")?;
            if !addr.ip().is_loopback() {
                tracing::warn!(
                    admin = %addr,
                    "the admin API listens on {addr}, not a loopback address: anyone who can reach it may try its token; keep it on loopback or a management network"
                );
            }
            let listener = match inherited_admin.take() {
                Some(listener) => listener,
                None => crate::supervisor::side_listener::bind(addr)
                    .with_context(|| format!("cannot listen on {addr} for the admin API"))?,
            };
            Some((listener, token))
        }
        None => None,
    };
    let metrics = match (config.metrics.listen, inherited_metrics.take()) {
        (Some(_), Some(listener)) => Some(listener),
        (Some(addr), None) => Some(
            crate::supervisor::side_listener::bind(addr)
                .with_context(|| format!("cannot listen on {addr} for the metrics"))?,
        ),
        (None, _) => None,
    };
    if config.epp.listen.is_some() && !cfg!(feature = "epp") {
        anyhow::bail!("epp.listen is set, but this semlb was built without its `epp` feature");
    }
    // The endpoint picker's listener: the dispatchers inherit it beside
    // the HTTP one (a successor keeps its predecessor's).
    let epp = match (config.epp.listen, inherited_epp.take()) {
        (Some(_), Some(listener)) => Some(listener),
        (Some(addr), None) => {
            Some(TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr} for the endpoint picker"))?)
        }
        (None, _) => None,
    };
    let owned = match inherited_owner {
        Some((shm, owner)) => segment::inherit(&shm, owner)?,
        None => segment::claim(&config)?,
    };
    // A demo's engines are new at every start: nothing to keep.
    let keep_at_start = config.keep_segment && args.demo.is_none();
    let segment = &owned.segment;
    let name = segment.name().unwrap_or_default().to_owned();
    let result = (|| {
        let tables = segment.tables();
        let clock = segment.clock();
        let mut backends = if owned.adopted {
            Backends::adopt(segment)
        } else {
            Backends::new(segment)
        };
        for backend in &config.backends {
            backends.configure(backend)?;
        }
        backends.settle(config.drain_timeout(), config.discovery.is_on());
        let me = tables.registry.claim(SUPERVISOR_SLOT, Role::Supervisor, clock.now_ms());
        tables
            .registry
            .attach(SUPERVISOR_SLOT, me, std::process::id(), clock.now_ms());
        let listener = match inherited_listener.take() {
            Some(listener) => listener,
            None => TcpListener::bind(config.listen).with_context(|| format!("cannot listen on {}", config.listen))?,
        };
        let addr = listener.local_addr()?;
        // Not println!: a successor's stdout may be a pipe nobody reads any more.
        // One line, the HTTP address last (what scripts and tests read).
        let picker = match &epp {
            Some(epp) => format!("grpc://{} (endpoint picker) and on ", epp.local_addr()?),
            None => String::new(),
        };
        let _ = writeln!(std::io::stdout(), "semlb listening on {picker}http://{addr}");
        tracing::info!(
            shm = %name,
            "shm segment {name} ({}), {} dispatchers, {} responders, {} backends, policy {}",
            config.shm_size,
            config.dispatchers,
            config.responders,
            config.backends.len(),
            config.policy.kind
        );
        if config.store.kind == semlb::config::StoreKind::Redis {
            log_redis_reachability(&config)?;
        }
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let handover = Handover {
            owner: owned.owner_fd(),
            admin: admin.as_ref().map(|(l, _)| l.as_raw_fd()),
            metrics: metrics.as_ref().map(AsRawFd::as_raw_fd),
            epp: epp.as_ref().map(AsRawFd::as_raw_fd),
            ready: ready_pipe,
        };
        let supervisor = Supervisor::new(segment, config, args, &listener, backends, &notify, handover)?;
        runtime.block_on(supervisor.monitor(admin, metrics))
    })();
    if let Err(e) = &result {
        notify.stopping(&format!("failed: {e:#}"));
    }
    // Whether to keep the segment, as the last reload (or an upgrade) said.
    let keep = result.as_ref().map_or(keep_at_start, |keep| *keep);
    owned.release(keep);
    result.map(|_| ())
}

/// Loads and checks what every child will load, so that a bad file is one
/// clear error here rather than a crash loop of children, and says which
/// engine runs: the global tokenizer and template, then every model pool's
/// (each file once), the TLS files, the metrics token and the keys.
fn check_before_start(config: &ServeConfig) -> Result<()> {
    let mut loader = semlb::pools::TokenizerLoader::new(config, 0, None);
    let global = loader.global()?;
    tracing::info!(
        tokenizer = %global.name,
        engine = %global.tokenizer.engine(),
        "tokenizer: {}",
        global.tokenizer.engine()
    );
    let renderer = global.template.renderer_name();
    let source = match (&config.chat_template, &config.tokenizer) {
        (Some(path), _) => path.display().to_string(),
        (None, Some(path)) if renderer != "canonical" => format!("{} (the model file's own)", path.display()),
        _ => "none given".into(),
    };
    tracing::info!(renderer, "chat template {source}: {renderer} renderer");
    let pools = semlb::pools::ModelPools::build(config, &mut loader, None)?;
    if !pools.is_implicit() {
        let names: Vec<&str> = pools.pools().iter().filter_map(|p| p.name()).collect();
        tracing::info!(models = names.len(), "model pools: {}", names.join(", "));
    }
    drop((pools, loader, global));
    // The listener's certificate, key and client CA, and the https
    // peers' files, read and checked before any child starts.
    if let Some(tls) = &config.tls {
        semlb::tls::server_config(tls)?;
        tracing::info!(
            mutual = tls.client_ca_file.is_some(),
            "TLS on the listener: {}",
            tls.cert_file.display()
        );
    }
    for peer in &config.peers {
        if let Some(tls) = peer.tls() {
            semlb::tls::client_config(&tls)?;
        }
    }
    config.metrics.read_token()?;
    if let Some(path) = &config.auth.keys_file {
        let keys = semlb::tenancy::auth::Keys::load(path)?;
        tracing::info!(
            keys = keys.len(),
            "client authentication: {} API keys from {}",
            keys.len(),
            path.display()
        );
    }
    Ok(())
}

/// Says where the routing state is kept in Redis, and whether Redis
/// answers now (it need not: routing falls back on load until it does).
fn log_redis_reachability(config: &ServeConfig) -> Result<()> {
    let r = &config.store.redis;
    // Credentials and certificates that cannot be read stop the start.
    let client = credentials::client(r)?;
    let url = credentials::redacted(&r.url);
    let reachable = client
        .get_connection_with_timeout(r.connect_timeout())
        .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
    match reachable {
        Ok(_) => tracing::info!(
            "routing state in Redis at {url} (namespace {}, lookup {:?})",
            r.namespace,
            r.lookup
        ),
        Err(e) => tracing::warn!(
            "routing state in Redis at {url} (namespace {}, lookup {:?}): not reachable now ({e}); routing on load only until it is",
            r.namespace,
            r.lookup
        ),
    }
    Ok(())
}

/// The supervisor's state while it runs the children.
struct Supervisor<'a> {
    segment: &'a Segment,
    /// The configuration in force (the last one reloaded).
    config: ServeConfig,
    /// The command line, for resolving the configuration again.
    args: &'a ServeArgs,
    /// Where a dispatcher answers the readiness probe.
    probe_addr: SocketAddr,
    children: Children<'a>,
    backends: Backends<'a>,
    reports: Reports<'a>,
    /// The last reload's error, while no later reload succeeded.
    reload_error: Option<String>,
    /// Health checks and load scraping of the backends ([`semlb::health`]),
    /// restarted with the new configuration by a reload.
    health: Option<tokio::task::JoinHandle<()>>,
    /// Whether the segment is left for the next start at exit
    /// (`keep_segment`, as the last reload set it; always after an
    /// upgrade handed it over).
    keep_segment: bool,
    /// What an upgrade hands over, and this supervisor's own handover.
    handover: Handover,
    /// The binary an upgrade starts (where this one was started from).
    exe: std::path::PathBuf,
    /// The successor an upgrade is starting.
    successor: Option<Successor>,
    /// This supervisor's incarnation in its registry slot.
    incarnation: u32,
    /// The configuration revision applied last (published in the
    /// registry: [`Supervisor::publish_revision`]).
    revision: u64,
    /// Backends found at run time ([`discovered`]).
    discovery: Discovery,
    /// A configuration was applied since discovery last reconciled.
    rediscover_due: bool,
}

/// The descriptors an upgrade hands over besides the listener, and the
/// pipe this supervisor says ready on if it is a successor itself.
struct Handover {
    /// The owner lock's descriptor.
    owner: RawFd,
    /// The admin API's listener.
    admin: Option<RawFd>,
    /// The metrics listener.
    metrics: Option<RawFd>,
    /// The endpoint picker's listener (the dispatchers inherit it).
    epp: Option<RawFd>,
    /// Where to say ready to the supervisor that started this one.
    ready: Option<std::fs::File>,
}

/// How a stop was asked for.
enum Stop {
    /// SIGTERM: drain.
    Term,
    /// SIGINT: a short grace.
    Int,
    /// An upgrade's successor (this pid) is ready: hand over and drain.
    Upgrade(u32),
}

impl<'a> Supervisor<'a> {
    fn new(
        segment: &'a Segment,
        config: ServeConfig,
        args: &'a ServeArgs,
        listener: &'a TcpListener,
        backends: Backends<'a>,
        notify: &'a Notifier,
        handover: Handover,
    ) -> Result<Self> {
        // The flags children are started with: the command line with the
        // settings that need a restart pinned to the running values.
        let child_args = reload::pinned_args(args, &config).to_args();
        let child_env = match config.store.kind {
            semlb::config::StoreKind::Redis => semlb::store::redis::credentials::password(&config.store.redis)?
                .map(|p| (credentials::PASSWORD_VAR.into(), p.into()))
                .into_iter()
                .collect(),
            semlb::config::StoreKind::Shm => Vec::new(),
        };
        let children = Children::new(
            segment,
            listener,
            config.dispatchers,
            config.responders,
            child_args,
            child_env,
        )?
        .with_epp(handover.epp);
        // The listener is bound and its address was printed already.
        let probe_addr = systemd::probe_address(listener.local_addr().unwrap_or(config.listen));
        let keep_segment = config.keep_segment && args.demo.is_none();
        let incarnation = segment
            .tables()
            .registry
            .get(SUPERVISOR_SLOT)
            .map_or(0, |p| p.incarnation);
        let mut supervisor = Self {
            segment,
            config,
            args,
            probe_addr,
            children,
            backends,
            reports: Reports::new(notify),
            reload_error: None,
            health: None,
            keep_segment,
            handover,
            exe: upgrade::installed_exe()?,
            successor: None,
            incarnation,
            revision: 0,
            discovery: Discovery::default(),
            rediscover_due: false,
        };
        supervisor.publish_revision();
        Ok(supervisor)
    }

    /// Takes a new configuration revision and publishes it in the
    /// supervisor's registry slot, before the dispatchers are told to
    /// reload: a segment-clock millisecond, so a later supervisor's (after
    /// an upgrade or a restart) is larger too.
    fn publish_revision(&mut self) -> u64 {
        self.revision = (self.revision + 1).max(self.segment.clock().now_ms());
        self.segment
            .tables()
            .registry
            .publish_revision(SUPERVISOR_SLOT, self.incarnation, self.revision);
        self.revision
    }

    /// Keeps the children running until SIGTERM/SIGINT or a crash loop,
    /// then stops them. `admin` is the admin API's listener and token,
    /// `metrics` the metrics listener.
    /// Returns whether to keep the segment at exit.
    async fn monitor(mut self, admin: Option<(TcpListener, String)>, metrics: Option<TcpListener>) -> Result<bool> {
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let mut hup = signal(SignalKind::hangup())?;
        let mut chld = signal(SignalKind::child())?;
        let mut usr2 = signal(SignalKind::user_defined2())?;
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        self.restart_health()?;
        self.discovery = Discovery::start(&self.config.discovery).await?;
        // Admin requests reach this loop as commands; the sender is kept
        // here too, so `recv` never ends without an admin API.
        let (admin_tx, mut admin_rx) = mpsc::channel::<admin::http::Command>(16);
        // The admin API's table scans and the metrics listener read the
        // segment on blocking threads, through a mapping of their own.
        let side =
            Arc::new(Segment::open(&self.config.shm_name).context("opening the segment for the side listeners")?);
        let metrics_task = match metrics {
            Some(listener) => {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                tracing::info!("metrics on http://{}/metrics", listener.local_addr()?);
                Some(tokio::spawn(crate::supervisor::metrics_listener::serve(
                    listener,
                    side.clone(),
                    self.config.health.stale_after_ms,
                )))
            }
            None => None,
        };
        let admin_task = match admin {
            Some((listener, token)) => {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                tracing::info!("admin API on http://{}", listener.local_addr()?);
                Some(tokio::spawn(admin::http::serve(
                    listener,
                    token,
                    admin_tx.clone(),
                    side.clone(),
                )))
            }
            None => None,
        };
        let outcome: Result<Stop> = loop {
            tokio::select! {
                _ = term.recv() => break Ok(Stop::Term),
                _ = int.recv() => break Ok(Stop::Int),
                _ = hup.recv() => {
                    self.reports.reloading();
                    self.reload();
                    self.reports.reloaded(&self.status_line());
                }
                Some((request, reply)) = admin_rx.recv() => {
                    if admin::is_scan(&request) {
                        let (side, store) = (side.clone(), self.config.store.kind);
                        tokio::task::spawn_blocking(move || reply.send(admin::scan(request, &side, store)));
                    } else if let admin::http::Request::Models(request) = request {
                        let answer = self.answer_model_request(request).await;
                        let _ = reply.send(answer);
                    } else {
                        let answer = admin::answer(request, self.segment, &mut self.backends, &self.config);
                        let _ = reply.send(answer);
                    }
                }
                () = self.discovery.changed() => self.follow_discovery(),
                _ = usr2.recv() => self.begin_upgrade(),
                _ = chld.recv() => {}
                _ = tick.tick() => {}
            }
            if std::mem::take(&mut self.rediscover_due) {
                self.rediscover().await;
            }
            if let Some(successor) = &mut self.successor {
                match successor.progress() {
                    Progress::Starting => {}
                    Progress::Ready => break Ok(Stop::Upgrade(successor.pid())),
                    Progress::Failed(why) => {
                        tracing::error!("upgrade failed: the new supervisor {why}; serving on");
                        self.successor = None;
                    }
                }
            }
            self.children.reap();
            self.children.kill_hung();
            if let Err(e) = self.children.start_due() {
                break Err(e);
            }
            self.backends.retire_drained();
            if !self.reports.is_ready() && self.children.up() && systemd::probe(self.probe_addr).await {
                self.reports.ready(self.status_line());
                upgrade::say_ready(&mut self.handover.ready);
            }
            if self.reports.is_ready() {
                let status = self.status_line();
                let children = &self.children;
                self.reports.tick(|| children.healthy(), status);
            }
        };
        for task in [admin_task, metrics_task].into_iter().flatten() {
            task.abort();
        }
        drop(admin_tx);
        let grace = match &outcome {
            Ok(Stop::Term) => {
                self.reports.stopping("stopping: draining the requests in flight");
                self.config.drain_timeout() + Duration::from_secs(2)
            }
            Ok(Stop::Int) => {
                self.reports.stopping("stopping (SIGINT)");
                Duration::from_secs(1)
            }
            Ok(Stop::Upgrade(pid)) => {
                tracing::info!(
                    successor = pid,
                    "upgrade: the new supervisor (pid {pid}) is ready; handing over and draining"
                );
                self.reports.handed_over(*pid);
                // The successor uses the segment.
                self.keep_segment = true;
                self.config.drain_timeout() + Duration::from_secs(2)
            }
            Err(e) => {
                self.reports.stopping(&format!("stopping: {e}"));
                Duration::from_secs(1)
            }
        };
        self.children.stop(grace).await;
        outcome.map(|_| self.keep_segment)
    }

    /// SIGUSR2: starts the successor ([`upgrade`]), unless one is starting.
    fn begin_upgrade(&mut self) {
        if self.successor.is_some() {
            tracing::warn!("upgrade: a new supervisor is starting already");
            return;
        }
        if self.args.demo.is_some() {
            tracing::warn!("upgrade: not for --demo (its engines are this process's); restart it instead");
            return;
        }
        let handover = upgrade::Handover {
            shm: &self.config.shm_name,
            listener: self.children.listener_fd(),
            owner: self.handover.owner,
            admin: self.handover.admin,
            metrics: self.handover.metrics,
            epp: self.handover.epp,
        };
        match Successor::start(&self.exe, handover) {
            Ok(successor) => {
                tracing::info!(
                    successor = successor.pid(),
                    "upgrade: started {} (pid {}); handing over once it is ready",
                    self.exe.display(),
                    successor.pid()
                );
                self.successor = Some(successor);
            }
            Err(e) => tracing::error!("upgrade failed: {e:#}; serving on"),
        }
    }

    /// One line for `systemctl status`.
    fn status_line(&self) -> String {
        systemd::status_line(
            self.children.count(ChildRole::Dispatcher),
            self.children.count(ChildRole::Responder),
            self.children.restarts(),
            self.backends.counts(),
            self.config.policy.kind,
            self.reload_error.as_deref(),
        )
    }

    /// SIGHUP: resolves the configuration again and applies what can change
    /// while running (see the module docs); a configuration that does not
    /// resolve is logged and the running one kept.
    fn reload(&mut self) {
        match reload::reloaded_config(self.args, &self.config, None) {
            Ok(new) => {
                self.apply(new);
            }
            Err(e) => {
                tracing::warn!(error = %e, "reload rejected, keeping the running configuration: {e}");
                self.reload_error = Some(e);
            }
        }
    }

    /// Puts a reloaded configuration in force (see the module docs) and
    /// returns its revision: the backends take its list, the dispatchers
    /// are told to resolve the configuration again, the health checks
    /// restart with it.
    fn apply(&mut self, new: ServeConfig) -> u64 {
        self.reload_error = None;
        self.rediscover_due = true;
        let (added, removed) = self.backends.apply(&new.backends, new.drain_timeout());
        // The dispatchers resolve the configuration again themselves (with
        // the same flags) and take its routing policy and pools; each says
        // in the registry when it runs this revision.
        let revision = self.publish_revision();
        self.children.signal_dispatchers(Signal::SIGHUP);
        tracing::info!(
            added,
            removed,
            "reloaded: {added} backends added, {removed} removed, {} configured; policy {}",
            self.backends.counts().live,
            new.policy.kind
        );
        if self.args.demo.is_none() {
            self.keep_segment = new.keep_segment;
        }
        self.config = new;
        // The checker takes the new [health] settings and metrics flavors;
        // its state lives in the server table, so nothing is lost.
        if let Err(e) = self.restart_health() {
            tracing::error!("reload: cannot restart the health checks: {e:#}");
        }
        revision
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
}
