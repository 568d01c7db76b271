//! The processes the supervisor starts: `semlb __child --role dispatcher`,
//! `--role responder`, and `semlb __sim` for `serve --demo`.
//!
//! A child resolves the same configuration as the supervisor (the same
//! flags are passed on), opens the segment, attaches to its registry slot
//! with the incarnation it was given, and heartbeats while it works.
//! SIGTERM makes a dispatcher stop accepting and drain, and a responder
//! drain its rings once more; both then exit 0. SIGHUP (the supervisor
//! forwards it after a reload) makes a dispatcher resolve the configuration
//! again and swap in its routing policy; responders ignore it.
//!
//! Both loops live in the library ([`semlb::dispatcher::serve`],
//! [`semlb::responder::event_loop::ResponderLoop`]); this module is their process
//! edge: the configuration, the segment and the store, the listening
//! socket, and the signals turned into their shutdown.

use std::os::fd::{FromRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use semlb::config::ModelConfig;
use semlb::config::ServeConfig;
use semlb::config::StoreKind;
use semlb::dispatcher::{self, Dispatcher, Identity};
use semlb::kv_events::subscriber::{self as kv_events, Followers};
use semlb::pools::TokenizerLoader;
use semlb::responder::event_loop::ResponderLoop;
use semlb::responder::{Responder, rings_for};
use semlb::store::RoutingStore;
use semlb::store::redis::{RedisRouting, RedisWriteBack};
use semlb::store::segments::ShmSegmentStore;
use semlb::tenancy::auth::Keys;
use shm_layout::{Membership, OpenError, SUPERVISOR_SLOT, Segment};
use tokio::signal::unix::{SignalKind, signal};

use crate::cli::{ChildArgs, ChildRole, SimArgs};
use semlb::dispatcher::reactor_watch::{self, ReactorState, ReactorWatch};

/// Threads of a dispatcher's blocking pool (tokio's default is 512).
const DISPATCHER_BLOCKING_THREADS: usize = 8;

/// The fd a dispatcher finds the listening socket on (the supervisor puts
/// it there before exec).
pub const LISTEN_FD: RawFd = 3;

/// The fd a dispatcher finds the endpoint picker's listening socket on,
/// with `[epp] listen` (the supervisor puts it there before exec).
pub const EPP_FD: RawFd = 4;

/// The endpoint picker's listening socket, when `config` has one (the
/// supervisor handed it over on [`EPP_FD`]). A file that gained
/// `[epp] listen` since the supervisor started (a dispatcher restarted
/// after a reload) has none: HTTP only until a restart.
fn epp_listener(config: &ServeConfig) -> Result<Option<std::net::TcpListener>> {
    if config.epp.listen.is_none() {
        return Ok(None);
    }
    if !is_listening_socket(EPP_FD) {
        tracing::warn!(
            "[epp] listen is set, but the supervisor was started without the endpoint picker's listener: this dispatcher serves HTTP only until the service restarts"
        );
        return Ok(None);
    }
    // SAFETY: the supervisor put the picker's listening socket on EPP_FD
    // for this process (dup2 before exec), checked just above to be one,
    // and nothing else in this process owns it.
    let listener = unsafe { std::net::TcpListener::from_raw_fd(EPP_FD) };
    listener.set_nonblocking(true)?;
    Ok(Some(listener))
}

/// Whether `fd` is an open socket that listens (`SO_ACCEPTCONN`).
fn is_listening_socket(fd: RawFd) -> bool {
    let mut accepting: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `accepting`, a
    // local of that size; on a descriptor that is not an open socket it
    // fails (EBADF, ENOTSOCK) without touching it.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&raw mut accepting).cast(),
            &raw mut len,
        )
    };
    rc == 0 && accepting != 0
}
/// How often a dispatcher heartbeats in the registry (a responder's loop
/// does so itself, as often).
const HEARTBEAT: Duration = Duration::from_millis(500);

/// Runs a child role to completion.
pub fn run(args: &ChildArgs) -> Result<()> {
    let config = ServeConfig::resolve(args.serve.config.as_deref(), args.serve.overrides())?;
    let segment = Arc::new(open_segment(&config.shm_name)?);
    // Held until this process exits: a supervisor starting after this
    // one's adopts the segment only once every member is gone.
    let _membership =
        Membership::join(&config.shm_name).with_context(|| format!("joining shm segment {}", config.shm_name))?;
    let tables = segment.tables();
    let clock = segment.clock();
    if !tables
        .registry
        .attach(args.slot, args.incarnation, std::process::id(), clock.now_ms())
    {
        bail!(
            "registry slot {} incarnation {} is not mine to attach",
            args.slot,
            args.incarnation
        );
    }
    match args.role {
        ChildRole::Dispatcher => run_dispatcher(segment, args, config),
        ChildRole::Responder => run_responder(&segment, args, &config),
    }
}

/// Opens the segment, waiting briefly if the supervisor is still creating it.
fn open_segment(name: &str) -> Result<Segment> {
    for _ in 0..50 {
        match Segment::open(name) {
            Err(OpenError::NotReady { .. }) => std::thread::sleep(Duration::from_millis(20)),
            other => return other.with_context(|| format!("opening shm segment {name}")),
        }
    }
    bail!("shm segment {name} did not become ready")
}

fn run_dispatcher(segment: Arc<Segment>, args: &ChildArgs, config: ServeConfig) -> Result<()> {
    let loader = TokenizerLoader::new(
        &config,
        usize::try_from(config.segment_cache_size.bytes()).unwrap_or(usize::MAX),
        Some(Arc::new(ShmSegmentStore::new(segment.clone()))),
    );
    let identity = Identity {
        slot: args.slot,
        incarnation: args.incarnation,
        ring: args.index,
    };
    segment
        .tables()
        .ring(identity.ring)
        .set_owner(identity.slot, identity.incarnation);
    anyhow::ensure!(
        is_listening_socket(LISTEN_FD),
        "fd {LISTEN_FD} is not a listening socket: a dispatcher is started by the supervisor, which hands it the listener"
    );
    // SAFETY: the supervisor put the listening socket on LISTEN_FD for this
    // process (dup2 before exec), checked just above to be one, and nothing
    // else in this process owns it.
    let std_listener = unsafe { std::net::TcpListener::from_raw_fd(LISTEN_FD) };
    std_listener.set_nonblocking(true)?;
    let epp = epp_listener(&config)?;
    let watch = Arc::new(ReactorWatch::new(segment.clock().now_ms()));
    spawn_heartbeat(segment.clone(), identity.slot, identity.incarnation, watch.clone())?;
    // The blocking pool takes the work that grows with a request (parsing a
    // large body, tokenizing a long prompt): bounded, so a flood of such
    // requests queues for its threads instead of starting hundreds.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(DISPATCHER_BLOCKING_THREADS)
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(std_listener)?;
        let pulse_segment = segment.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(reactor_watch::PULSE);
            loop {
                tick.tick().await;
                watch.pulse(pulse_segment.clock().now_ms());
            }
        });
        let mut term = signal(SignalKind::terminate())?;
        // Ignored until here (the supervisor starts children with SIGHUP
        // ignored, so an early one cannot kill this process).
        let hup = signal(SignalKind::hangup())?;
        let running = (config.models.clone(), config.policy.clone());
        let store: Option<Arc<dyn RoutingStore>> = match config.store.kind {
            StoreKind::Shm => None,
            StoreKind::Redis => Some(RedisRouting::start(
                segment.clone(),
                identity.slot,
                &config.store.redis,
                format!("dispatcher {}", identity.ring),
            )?),
        };
        let keys = config.auth.keys_file.as_deref().map(Keys::load).transpose()?;
        let peering = dispatcher::Peering::of(&config)?;
        let metrics_token = config.metrics.read_token()?;
        let registry_segment = segment.clone();
        let mut dispatcher = Dispatcher::new(segment, identity, Arc::new(config), loader)?.with_peering(peering);
        dispatcher.set_keys(keys);
        dispatcher.set_metrics_token(metrics_token);
        if let Some(store) = store {
            dispatcher = dispatcher.with_store(store);
        }
        let dispatcher = Arc::new(dispatcher);
        tokio::spawn(reload_models_on_hup(
            hup,
            registry_segment,
            dispatcher.clone(),
            args.serve.clone(),
            running,
        ));
        // SIGTERM stops both fronts: the HTTP one and the endpoint picker.
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            term.recv().await;
            stop_tx.send_replace(true);
        });
        let stopped = |mut stop: tokio::sync::watch::Receiver<bool>| async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        let epp: Option<tokio::task::JoinHandle<()>> = match epp {
            #[cfg(feature = "epp")]
            Some(l) => {
                let listener = tokio::net::TcpListener::from_std(l)?;
                let serving = dispatcher::epp::serve(listener, dispatcher.clone(), stopped(stop_rx.clone()));
                Some(tokio::spawn(async move {
                    if let Err(e) = serving.await {
                        tracing::warn!(error = %e, "the endpoint picker stopped with an error: {e}");
                    }
                }))
            }
            #[cfg(not(feature = "epp"))]
            Some(_) => anyhow::bail!("epp.listen is set, but this semlb was built without its `epp` feature"),
            None => None,
        };
        dispatcher::serve(listener, dispatcher, stopped(stop_rx)).await?;
        if let Some(epp) = epp {
            let _ = epp.await;
        }
        Ok(())
    })
}

/// Starts the dispatcher's heartbeat thread: it beats in the registry
/// every [`HEARTBEAT`] while the reactor pulses `watch`, warns once per
/// episode when the reactor lags, and stops beating while it is stuck
/// ([`semlb::dispatcher::reactor_watch`]).
fn spawn_heartbeat(segment: Arc<Segment>, slot: u16, incarnation: u32, watch: Arc<ReactorWatch>) -> Result<()> {
    std::thread::Builder::new()
        .name("heartbeat".into())
        .spawn(move || {
            let mut warned = false;
            loop {
                std::thread::sleep(HEARTBEAT);
                let now = segment.clock().now_ms();
                let state = watch.state(now);
                match state {
                    ReactorState::Running => warned = false,
                    ReactorState::Lagging(lag) | ReactorState::Stuck(lag) if !warned => {
                        warned = true;
                        tracing::warn!(
                            lag_ms = lag,
                            "the reactor has not run for {lag} ms (requests that keep it busy?); the process is restarted if it stays stuck for {} s",
                            reactor_watch::STUCK_AFTER_MS / 1000
                        );
                    }
                    _ => {}
                }
                if !matches!(state, ReactorState::Stuck(_)) {
                    segment.tables().registry.heartbeat(slot, incarnation, now);
                }
            }
        })?;
    Ok(())
}

/// On SIGHUP (forwarded by the supervisor's reload), resolves the
/// configuration again with the same flags and, if its model pools or
/// routing policy changed, rebuilds the pools (new tokenizers loaded on the
/// blocking pool; unchanged pools keep their policies), and reads the keys
/// file again. A configuration that does not resolve, tokenizers that do
/// not load and a keys file that does not read keep what runs. Also
/// checks once at start, for a reload signalled before the handler was
/// installed.
///
/// Each time, it first reads the configuration revision the supervisor
/// published (in its registry slot, 0), and once it runs what it resolved
/// after that, publishes the same revision in its own slot: the admin API
/// answers a pool change when every dispatcher has (a pool that failed to
/// build publishes nothing, and the admin API says so).
async fn reload_models_on_hup(
    mut hup: tokio::signal::unix::Signal,
    segment: Arc<Segment>,
    dispatcher: Arc<Dispatcher>,
    serve: crate::cli::ServeArgs,
    mut running: (Vec<ModelConfig>, semlb::routing::PolicyConfig),
) {
    let identity = dispatcher.identity();
    let ring = identity.ring;
    let registry = segment.tables().registry;
    let mut first = true;
    loop {
        let wanted = registry.get(SUPERVISOR_SLOT).map_or(0, |p| p.revision);
        match ServeConfig::resolve(serve.config.as_deref(), serve.overrides()) {
            Ok(new) => {
                let mut runs_it = true;
                if (&new.models, &new.policy) != (&running.0, &running.1) {
                    let wanted_pools = (new.models.clone(), new.policy.clone());
                    let (models, kind) = (new.models.len(), new.policy.kind);
                    let d = dispatcher.clone();
                    let config = new.clone();
                    match tokio::task::spawn_blocking(move || d.set_models(&config)).await {
                        Ok(Ok(())) => {
                            tracing::info!(dispatcher = ring, models, policy = %kind, "dispatcher {ring}: {models} model pools, routing policy now {kind}");
                            running = wanted_pools;
                        }
                        Ok(Err(e)) => {
                            runs_it = false;
                            tracing::warn!(dispatcher = ring, error = %e, "dispatcher {ring}: keeping the running model pools: {e}")
                        }
                        Err(e) => {
                            runs_it = false;
                            tracing::warn!(dispatcher = ring, error = %e, "dispatcher {ring}: reloading the model pools failed: {e}")
                        }
                    }
                }
                // The keys file may change without the configuration: read
                // it at every reload (at start it was read already).
                if !first {
                    reload_keys(&dispatcher, &new, ring);
                    reload_peering(&dispatcher, &new, ring);
                }
                if runs_it {
                    registry.publish_revision(identity.slot, identity.incarnation, wanted);
                }
            }
            Err(e) => tracing::warn!(
                dispatcher = ring,
                error = %e,
                "dispatcher {ring}: configuration rejected, keeping the running model pools, policy and keys: {e}"
            ),
        }
        first = false;
        if hup.recv().await.is_none() {
            return;
        }
    }
}

/// Lets in the keys of `config`'s keys file from now on (none: everyone);
/// a file that does not read keeps the running keys.
fn reload_keys(dispatcher: &Dispatcher, config: &ServeConfig, ring: usize) {
    match config.auth.keys_file.as_deref().map(Keys::load).transpose() {
        Ok(keys) => {
            let count = keys.as_ref().map(Keys::len);
            dispatcher.set_keys(keys);
            match count {
                Some(n) => tracing::info!(dispatcher = ring, keys = n, "dispatcher {ring}: {n} API keys"),
                None => tracing::info!(dispatcher = ring, "dispatcher {ring}: no client authentication"),
            }
        }
        Err(e) => tracing::warn!(dispatcher = ring, error = %e, "dispatcher {ring}: keeping the running API keys: {e}"),
    }
    match config.metrics.read_token() {
        Ok(token) => dispatcher.set_metrics_token(token),
        Err(e) => {
            tracing::warn!(dispatcher = ring, error = %e, "dispatcher {ring}: keeping the running metrics token: {e}")
        }
    }
}

/// Applies `config`'s `[peering]` and `[[peer]]` (their token files read
/// again, so a rotated token is taken) when they changed; a token file
/// that does not read keeps what runs.
fn reload_peering(dispatcher: &Arc<Dispatcher>, config: &ServeConfig, ring: usize) {
    match dispatcher::Peering::of(config) {
        Ok(peering) => {
            let n = peering.peer_count();
            if dispatcher.set_peering(peering) {
                tracing::info!(dispatcher = ring, peers = n, "dispatcher {ring}: {n} peer gateways");
            }
        }
        Err(e) => {
            tracing::warn!(dispatcher = ring, error = %e, "dispatcher {ring}: keeping the running peer gateways: {e}")
        }
    }
}

/// A response process: its responder ([`semlb::responder`]) over its rings,
/// run by the library's loop ([`ResponderLoop`]) until SIGTERM/SIGINT set
/// [`STOP`].
fn run_responder(segment: &Arc<Segment>, args: &ChildArgs, config: &ServeConfig) -> Result<()> {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        stop_on(sig).context("installing signal handlers")?;
    }
    let tables = segment.tables();
    // Every ring, not only those of this supervisor's dispatchers: after an
    // upgrade, what the old dispatchers still push is written back here.
    let rings: Vec<usize> = rings_for(args.index, config.responders, tables.ring_count()).collect();
    // Answers are new text: no local segment cache (the word cache stays);
    // their segments go to the shared store for the next turn. The global
    // tokenizer now; a pool's own when a record first names it, from the
    // configuration as it is then (a reload may have added the pool).
    let mut loader = TokenizerLoader::new(config, 0, Some(Arc::new(ShmSegmentStore::new(segment.clone()))));
    let global = loader.global()?;
    let responder = match config.store.kind {
        StoreKind::Shm => Responder::new(tables, global.tokenizer),
        StoreKind::Redis => Responder::with_sink(
            tables,
            Box::new(RedisWriteBack::new(
                segment.clone(),
                &config.store.redis,
                config.response_cache.ttl(),
                format!("responder {}", args.index),
            )),
            global.tokenizer,
        ),
    };
    // The engines' KV cache events this process follows, on a thread of
    // its own (the ring loop below never waits on a socket).
    let serve = args.serve.clone();
    let followers = Followers {
        segment: segment.clone(),
        slot: args.slot,
        index: args.index,
        responders: config.responders,
        resolve: Box::new(move || ServeConfig::resolve(serve.config.as_deref(), serve.overrides()).ok()),
    };
    let events = std::thread::Builder::new()
        .name("kv-events".into())
        .spawn(move || kv_events::run(followers, &STOP))
        .context("starting the KV events thread")?;
    let serve = args.serve.clone();
    let responder = responder
        .forgetting(config.learn_from_reports)
        .with_chat_template(global.template)
        .with_model_tokenizers(Box::new(move |id| {
            let config = ServeConfig::resolve(serve.config.as_deref(), serve.overrides()).ok()?;
            loader.by_id(&config, id)
        }));
    ResponderLoop::new(segment, responder, rings, args.slot, args.incarnation).run(&STOP);
    match events.join() {
        Ok(result) => result.context("the KV events thread")?,
        Err(_) => anyhow::bail!("the KV events thread panicked"),
    }
    Ok(())
}

/// A responder's shutdown: set by SIGTERM/SIGINT.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// Makes `sig` set [`STOP`] (an atomic store is async-signal-safe).
fn stop_on(sig: libc::c_int) -> std::io::Result<()> {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe;
    // the sigaction struct is fully initialised before use.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_stop as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(sig, &action, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// `semlb __sim`: a simulated engine with default parameters.
pub fn run_sim(args: &SimArgs) -> Result<()> {
    use semlb_workers::config::EngineConfig;
    use semlb_workers::faults::FaultConfig;
    use semlb_workers::pd::Pd;
    use semlb_workers::server::{Sim, serve};
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let defaults = EngineConfig::default();
        let config = EngineConfig {
            model_name: args.model.clone(),
            lora_adapters: args.lora_adapters.clone(),
            time_scale: args.time_scale,
            kv_capacity_tokens: args.kv_capacity_tokens.unwrap_or(defaults.kv_capacity_tokens),
            block_size: args.block_size.unwrap_or(defaults.block_size),
            max_num_seqs: args.max_num_seqs.unwrap_or(defaults.max_num_seqs),
            max_model_len: args.max_model_len.unwrap_or(defaults.max_model_len),
            ..defaults
        };
        config.validate().map_err(anyhow::Error::msg)?;
        let time_scale = config.time_scale;
        let listener = tokio::net::TcpListener::bind(args.listen).await?;
        let addr = listener.local_addr()?;
        let pd = Pd::start(args.pd.clone(), addr.ip(), time_scale).await?;
        let bootstrap = pd.describe();
        let faults = FaultConfig {
            stream_fault: args.stream_faults.fault(),
            ..FaultConfig::default()
        };
        let mut sim = Sim::bundled(config, faults).with_pd(pd);
        let published =
            semlb_workers::kv_events::publish(args.kv_events_config.as_deref(), || sim.engine().kv_events())
                .await
                .map_err(|e| anyhow::anyhow!("--kv-events-config: {e}"))?;
        if args.no_metrics {
            sim = sim.with_metrics_flavor(semlb_workers::metrics::MetricsFlavor::None);
        }
        let sim = sim.with_props(args.props);
        let events = published.as_ref().map(|b| b.describe()).unwrap_or_default();
        println!("semlb-sim {events}{bootstrap}listening on http://{addr}");
        use std::io::Write;
        std::io::stdout().flush()?;
        let mut term = signal(SignalKind::terminate())?;
        serve(listener, Arc::new(sim), async move {
            term.recv().await;
        })
        .await?;
        Ok(())
    })
}

#[cfg(test)]
mod listen_fd_tests {
    use std::os::fd::AsRawFd;

    use super::is_listening_socket;

    #[test]
    fn only_a_listening_socket_passes() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(is_listening_socket(listener.as_raw_fd()));
        let stream = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        assert!(!is_listening_socket(stream.as_raw_fd()), "a connected socket");
        let file = std::fs::File::open("/dev/null").unwrap();
        assert!(!is_listening_socket(file.as_raw_fd()), "a file");
        assert!(!is_listening_socket(-1), "no descriptor");
    }
}
