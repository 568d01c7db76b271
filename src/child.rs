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

use std::os::fd::FromRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use semlb::config::ServeConfig;
use semlb::dispatcher::{self, Dispatcher, Identity};
use semlb::responder::{Responder, rings_for};
use semlb::segment_store::ShmSegmentStore;
use semlb::store::redis::{RedisRouting, RedisWriteBack};
use semlb::store::{RoutingStore, StoreKind};
use semlb_tokenizer::Tokenizer;
use semlb_tokenizer::chat::ChatTemplate;
use shm_layout::{OpenError, Segment};
use tokio::signal::unix::{SignalKind, signal};

use crate::cli::{ChildArgs, ChildRole, SimArgs};
use crate::supervisor::LISTEN_FD;

const HEARTBEAT: Duration = Duration::from_millis(500);

/// Runs a child role to completion.
pub fn run(args: &ChildArgs) -> Result<()> {
    let config = ServeConfig::resolve(args.serve.config.as_deref(), args.serve.overrides())?;
    let segment = Arc::new(open_segment(&config.shm_name)?);
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

/// The gateway's tokenizer: the configured `tokenizer.json`, else the
/// bundled one, with a segment cache of `segment_cache_bytes` (0: none).
pub(crate) fn load_tokenizer(config: &ServeConfig, segment_cache_bytes: u64) -> Result<Tokenizer> {
    let tokenizer = match &config.tokenizer {
        Some(path) => Tokenizer::from_file(path)?,
        None => Tokenizer::bundled(),
    };
    Ok(tokenizer.with_segment_cache(usize::try_from(segment_cache_bytes).unwrap_or(usize::MAX)))
}

fn run_dispatcher(segment: Arc<Segment>, args: &ChildArgs, config: ServeConfig) -> Result<()> {
    let tokenizer = load_tokenizer(&config, config.segment_cache_size.bytes())?
        .with_shared_segments(Arc::new(ShmSegmentStore::new(segment.clone())));
    let template = match &config.chat_template {
        Some(path) => ChatTemplate::from_tokenizer_config(path)?,
        None => ChatTemplate::canonical(),
    };
    let identity = Identity {
        slot: args.slot,
        incarnation: args.incarnation,
        ring: args.index,
    };
    segment
        .tables()
        .ring(identity.ring)
        .set_owner(identity.slot, identity.incarnation);
    // SAFETY: the supervisor put the listening socket on LISTEN_FD for this
    // process (dup2 before exec) and nothing else in this process owns it.
    let std_listener = unsafe { std::net::TcpListener::from_raw_fd(LISTEN_FD) };
    std_listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(std_listener)?;
        let heartbeat_segment = segment.clone();
        let (slot, incarnation) = (identity.slot, identity.incarnation);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(HEARTBEAT);
            loop {
                tick.tick().await;
                let s = &heartbeat_segment;
                s.tables().registry.heartbeat(slot, incarnation, s.clock().now_ms());
            }
        });
        let mut term = signal(SignalKind::terminate())?;
        // Ignored until here (the supervisor starts children with SIGHUP
        // ignored, so an early one cannot kill this process).
        let hup = signal(SignalKind::hangup())?;
        let policy = config.policy.clone();
        let store: Option<Arc<dyn RoutingStore>> = match config.store.kind {
            StoreKind::Shm => None,
            StoreKind::Redis => Some(RedisRouting::start(
                segment.clone(),
                identity.slot,
                &config.store.redis,
                format!("dispatcher {}", identity.ring),
            )?),
        };
        let mut dispatcher = Dispatcher::new(segment, identity, Arc::new(config), tokenizer, template);
        if let Some(store) = store {
            dispatcher = dispatcher.with_store(store);
        }
        let dispatcher = Arc::new(dispatcher);
        tokio::spawn(reload_policy_on_hup(
            hup,
            dispatcher.clone(),
            args.serve.clone(),
            policy,
        ));
        dispatcher::serve(listener, dispatcher, async move {
            term.recv().await;
        })
        .await?;
        Ok(())
    })
}

/// On SIGHUP (forwarded by the supervisor's reload), resolves the
/// configuration again with the same flags and switches to its routing
/// policy if that changed; a configuration that does not resolve keeps the
/// running policy. Also checks once at start, for a reload signalled
/// before the handler was installed.
async fn reload_policy_on_hup(
    mut hup: tokio::signal::unix::Signal,
    dispatcher: Arc<Dispatcher>,
    serve: crate::cli::ServeArgs,
    mut policy: semlb::routing::PolicyConfig,
) {
    let ring = dispatcher.identity().ring;
    let reload = |policy: &mut semlb::routing::PolicyConfig| match ServeConfig::resolve(
        serve.config.as_deref(),
        serve.overrides(),
    ) {
        Ok(new) if new.policy != *policy => {
            dispatcher.set_policy(&new.policy);
            tracing::info!(dispatcher = ring, policy = %new.policy.kind, "dispatcher {ring}: routing policy now {}", new.policy.kind);
            *policy = new.policy;
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(
            dispatcher = ring,
            error = %e,
            "dispatcher {ring}: configuration rejected, keeping policy {}: {e}",
            policy.kind
        ),
    };
    reload(&mut policy);
    while hup.recv().await.is_some() {
        reload(&mut policy);
    }
}

fn run_responder(segment: &Arc<Segment>, args: &ChildArgs, config: &ServeConfig) -> Result<()> {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        stop_on(sig).context("installing signal handlers")?;
    }
    let tables = segment.tables();
    let clock = segment.clock();
    let rings: Vec<usize> = rings_for(args.index, config.responders, config.dispatchers).collect();
    // Answers are new text: no local segment cache (the word cache stays);
    // their segments go to the shared store for the next turn.
    let tokenizer = load_tokenizer(config, 0)?.with_shared_segments(Arc::new(ShmSegmentStore::new(segment.clone())));
    let responder = match config.store.kind {
        StoreKind::Shm => Responder::new(tables, tokenizer),
        StoreKind::Redis => Responder::with_sink(
            tables,
            Box::new(RedisWriteBack::new(
                &config.store.redis,
                config.response_cache.ttl(),
                format!("responder {}", args.index),
            )),
            tokenizer,
        ),
    };
    let mut responder = match &config.chat_template {
        Some(path) => responder.with_chat_template(ChatTemplate::from_tokenizer_config(path)?),
        None => responder.with_chat_template(ChatTemplate::canonical()),
    };
    let mut idle = MIN_POLL;
    let mut last_beat = 0u64;
    // Its counters go to its registry slot's stats block (`/metrics`).
    let metrics = semlb::metrics::Metrics::new(tables.stats, args.slot);
    let mut counted = responder.stats();
    loop {
        let stopping = STOP.load(Ordering::Relaxed);
        let now_ms = clock.now_ms();
        let stamp = clock.stamp();
        let applied: usize = rings
            .iter()
            .map(|r| responder.drain(*r, stamp, now_ms, |slot, inc| tables.registry.is_alive(slot, inc)))
            .sum();
        let now = responder.stats();
        metrics.responder(&counted, &now);
        counted = now;
        if now_ms >= last_beat + HEARTBEAT.as_millis() as u64 {
            tables.registry.heartbeat(args.slot, args.incarnation, now_ms);
            last_beat = now_ms;
        }
        if stopping {
            return Ok(());
        }
        idle = next_poll(idle, applied);
        std::thread::sleep(idle);
    }
}

/// How long a responder sleeps after a look that found `applied` records,
/// having slept `idle` before it. No cross-process wake-up exists for ring
/// pushes (one would cost the dispatcher a system call per request), so a
/// responder polls, off the request path. A wake-up costs about as much as
/// applying a record, so while records keep coming the sleep is sized for
/// [`POLL_BATCH`] records per look, within [`MIN_POLL`] and [`MAX_BUSY_POLL`]
/// (the longest a record waits to be written under load); with none, it
/// backs off to [`MAX_IDLE_POLL`].
fn next_poll(idle: Duration, applied: usize) -> Duration {
    if applied == 0 {
        return (idle * 2).clamp(MIN_POLL, MAX_IDLE_POLL);
    }
    let scaled = idle.as_secs_f64() * POLL_BATCH as f64 / applied as f64;
    Duration::from_secs_f64(scaled).clamp(MIN_POLL, MAX_BUSY_POLL)
}

/// Records a look at the rings should find under load.
const POLL_BATCH: usize = 16;
/// The shortest sleep between looks.
const MIN_POLL: Duration = Duration::from_micros(50);
/// The longest sleep while records keep coming.
const MAX_BUSY_POLL: Duration = Duration::from_millis(2);
/// The longest sleep when nothing comes.
const MAX_IDLE_POLL: Duration = Duration::from_millis(5);

/// Set by SIGTERM/SIGINT in a responder.
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
    use semlb_workers::engine::Engine;
    use semlb_workers::faults::FaultConfig;
    use semlb_workers::metrics::MetricsFlavor;
    use semlb_workers::server::{Sim, serve};
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let config = EngineConfig {
            model_name: args.model.clone(),
            time_scale: args.time_scale,
            ..EngineConfig::default()
        };
        config.validate().map_err(anyhow::Error::msg)?;
        let engine = Engine::start(config);
        let sim = Sim::new(
            engine,
            Tokenizer::bundled(),
            ChatTemplate::canonical(),
            FaultConfig::default(),
            MetricsFlavor::Vllm,
        );
        let listener = tokio::net::TcpListener::bind(args.listen).await?;
        println!("semlb-sim listening on http://{}", listener.local_addr()?);
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
mod tests {
    use super::*;

    #[test]
    fn the_poll_adapts_to_the_record_rate() {
        let us = Duration::from_micros;
        // Busy: sized for a batch per look, within the bounds.
        assert_eq!(next_poll(us(250), 4), us(1000));
        assert_eq!(next_poll(us(600), 16), us(600));
        assert_eq!(next_poll(us(600), 96), us(100));
        assert_eq!(next_poll(us(1500), 1), MAX_BUSY_POLL);
        assert_eq!(next_poll(us(60), 1000), MIN_POLL);
        // Idle: back off, up to the idle bound.
        assert_eq!(next_poll(us(1000), 0), us(2000));
        assert_eq!(next_poll(MAX_IDLE_POLL, 0), MAX_IDLE_POLL);
        // A steady rate settles: 13 records per ms.
        let mut idle = MIN_POLL;
        for _ in 0..20 {
            let applied = (idle.as_secs_f64() * 13_000.0).round() as usize;
            idle = next_poll(idle, applied);
        }
        let per_look = idle.as_secs_f64() * 13_000.0;
        assert!(
            (12.0..=20.0).contains(&per_look),
            "{idle:?}: {per_look} records per look"
        );
    }
}
