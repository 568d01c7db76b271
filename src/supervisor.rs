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
//! `--demo N` first starts N simulated engines (`semlb __sim`) on loopback
//! and uses them as the backends; unless given, it listens on
//! `127.0.0.1:8080` and names its segment `semlb-demo`.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use semlb::config::ServeConfig;
use shm_layout::{CreateError, LayoutPlan, PlanOptions, ProcessState, Role, Segment};
use tokio::signal::unix::{SignalKind, signal};

use crate::cli::{ChildRole, ServeArgs};

/// The fd a dispatcher finds the listening socket on.
pub const LISTEN_FD: RawFd = 3;
const BACKOFF_START: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const CRASH_WINDOW: Duration = Duration::from_secs(30);
const CRASH_LIMIT: usize = 5;
const HUNG_AFTER_MS: u64 = 10_000;

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
            let (child, url) = start_sim(args.demo_time_scale)?;
            eprintln!("semlb: demo engine {url} (pid {})", child.id());
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
    let config = ServeConfig::resolve(args.config.as_deref(), args.overrides())?;
    // Load what every dispatcher will load, so a bad file is one clear error
    // here rather than a crash loop of children.
    if let Some(path) = &config.tokenizer {
        semlb_workers::tokenize::Tokenizer::from_file(path)?;
    }
    if let Some(path) = &config.chat_template {
        semlb_workers::tokenize::ChatTemplate::from_tokenizer_config(path)?;
    }
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
        for (i, backend) in config.backends.iter().enumerate() {
            let url = backend
                .parsed_url()
                .map_err(|e| anyhow!("backend {}: {e}", backend.url))?;
            tables
                .servers
                .register(i as u64, &format!("http://{}", url.authority()), clock.now_ms())
                .with_context(|| format!("registering backend {}", backend.url))?;
        }
        let me = tables.registry.claim(0, Role::Supervisor, clock.now_ms());
        tables.registry.attach(0, me, std::process::id(), clock.now_ms());
        let listener =
            TcpListener::bind(config.listen).with_context(|| format!("cannot listen on {}", config.listen))?;
        let addr = listener.local_addr()?;
        println!("semlb listening on http://{addr}");
        eprintln!(
            "semlb: shm segment {name} ({}), {} dispatchers, {} responders, {} backends, policy {}",
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
            eprintln!(
                "semlb: routing state in Redis at {} (namespace {}, lookup {:?}){}",
                r.url,
                r.namespace,
                r.lookup,
                match reachable {
                    Ok(_) => String::new(),
                    Err(e) => format!(": not reachable now ({e}); routing on load only until it is"),
                }
            );
        }
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        runtime.block_on(monitor(&segment, &config, args, &listener))
    })();
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
            eprintln!("semlb: removing the leftover shm segment {path} of a supervisor that is gone");
            Segment::remove(name)?;
            Ok(Segment::create(name, plan)?)
        }
        Err(e) => Err(e.into()),
    }
}

async fn monitor(segment: &Segment, config: &ServeConfig, args: &ServeArgs, listener: &TcpListener) -> Result<()> {
    let tables = segment.tables();
    let clock = segment.clock();
    let mut slots: Vec<Slot> = (0..config.dispatchers)
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
    let child_args = args.to_args();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut chld = signal(SignalKind::child())?;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let outcome: Result<Duration> = loop {
        tokio::select! {
            _ = term.recv() => break Ok(config.drain_timeout() + Duration::from_secs(2)),
            _ = int.recv() => break Ok(Duration::from_secs(1)),
            _ = chld.recv() => {}
            _ = tick.tick() => {}
        }
        // Reap whatever died.
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, _) | WaitStatus::Signaled(pid, _, _)) => {
                    if let Some(s) = slots.iter_mut().find(|s| s.pid == Some(pid)) {
                        eprintln!("semlb: {:?} {} (pid {pid}) exited", s.role, s.index);
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
        // Kill hung children (their exit is reaped above, next round).
        let now_ms = clock.now_ms();
        for s in slots.iter().filter(|s| s.pid.is_some()) {
            if let Some(info) = tables.registry.get(s.slot)
                && info.incarnation == s.incarnation
                && info.state == ProcessState::Running
                && now_ms.saturating_sub(info.heartbeat_ms) > HUNG_AFTER_MS
            {
                eprintln!(
                    "semlb: {:?} {} missed its heartbeats for {} ms; killing it",
                    s.role,
                    s.index,
                    now_ms - info.heartbeat_ms
                );
                let _ = kill(s.pid.expect("filtered"), Signal::SIGKILL);
            }
        }
        // (Re)start what is due.
        let mut failure = None;
        for s in slots.iter_mut() {
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
                    failure = Some(anyhow!(
                        "{:?} {} crashed {CRASH_LIMIT} times within {CRASH_WINDOW:?}: crash loop, stopping",
                        s.role,
                        s.index
                    ));
                    break;
                }
            }
            if s.incarnation > 0 {
                eprintln!("semlb: restarting {:?} {}", s.role, s.index);
            }
            let role = match s.role {
                ChildRole::Dispatcher => Role::Dispatcher,
                ChildRole::Responder => Role::Responder,
            };
            s.incarnation = tables.registry.claim(s.slot, role, clock.now_ms());
            let fd = (s.role == ChildRole::Dispatcher).then(|| listener.as_raw_fd());
            match spawn_child(s, fd, &child_args) {
                Ok(pid) => {
                    s.pid = Some(pid);
                    s.restart_at = None;
                }
                Err(e) => {
                    eprintln!("semlb: cannot start {:?} {}: {e}", s.role, s.index);
                    tables.registry.mark_exited(s.slot, s.incarnation);
                    s.restart_at = Some(Instant::now() + s.backoff);
                    s.backoff = (s.backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
        // A child that stayed up a while earns a fresh backoff.
        for s in slots.iter_mut() {
            if s.pid.is_some() && s.restarts.back().is_none_or(|t| t.elapsed() > CRASH_WINDOW) {
                s.backoff = BACKOFF_START;
            }
        }
        if let Some(e) = failure {
            break Err(e);
        }
    };
    let grace = match &outcome {
        Ok(grace) => *grace,
        Err(_) => Duration::from_secs(1),
    };
    stop_children(&mut slots, grace).await;
    outcome.map(|_| ())
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
    let supervisor = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls (prctl, getppid, dup2, fcntl, _exit).
    unsafe {
        cmd.pre_exec(move || {
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
fn start_sim(time_scale: f64) -> Result<(Child, String)> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "__sim",
        "--listen",
        "127.0.0.1:0",
        "--time-scale",
        &time_scale.to_string(),
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::piped());
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
