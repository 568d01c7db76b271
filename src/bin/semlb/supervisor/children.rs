//! The child processes the supervisor keeps running: one slot per
//! dispatcher and responder, each filled by re-running this binary as
//! `semlb __child` ([`Children`]).
//!
//! The dispatchers inherit the listening socket as fd [`LISTEN_FD`] (and
//! the endpoint picker's, with `[epp] listen`, as fd [`EPP_FD`]), each
//! with its own completion ring; the responders split the rings among
//! themselves. Every child gets `PR_SET_PDEATHSIG`, so it dies with the
//! supervisor, and starts without `NOTIFY_SOCKET`/`WATCHDOG_*`: only the
//! supervisor notifies systemd.
//!
//! A child that dies is reaped (SIGCHLD), marked exited in the registry,
//! its in-flight counts reclaimed, and restarted after a backoff (100 ms
//! doubling to 5 s); a slot that needs 5 restarts within 30 s is a crash
//! loop. While another child of its role serves, a crash-looping slot is
//! parked for [`PARK`] and then tried again (a dispatcher killed for its
//! memory by a hostile client's requests must not take the gateway down
//! with it); when none does (every dispatcher, or every responder, crash
//! loops: a bad binary or configuration), the crash loop is an error that
//! stops the supervisor. A child whose heartbeat is older than 10 s is
//! hung and is killed (then restarted).

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::net::TcpListener;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use shm_layout::{ProcessState, Role, Segment};

use crate::child::{EPP_FD, LISTEN_FD};
use crate::cli::ChildRole;
use crate::supervisor::sd_notify;

const BACKOFF_START: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const CRASH_WINDOW: Duration = Duration::from_secs(30);
const CRASH_LIMIT: usize = 5;
/// How long a crash-looping slot waits while its siblings serve.
const PARK: Duration = Duration::from_secs(60);
const HUNG_AFTER_MS: u64 = 10_000;
/// A heartbeat at most this old is fresh (children beat every 500 ms).
const FRESH_HEARTBEAT_MS: u64 = 3_000;

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
    /// Parked after a crash loop while its siblings serve (until
    /// `restart_at`).
    parked: bool,
}

/// The children of one supervisor: their registry slots (1 onwards: the
/// dispatchers, then the responders), processes, restarts and backoffs.
#[derive(Debug)]
pub(super) struct Children<'a> {
    segment: &'a Segment,
    /// The listening socket the dispatchers inherit.
    listener: &'a TcpListener,
    /// The endpoint picker's listening socket they inherit too, if any.
    epp: Option<RawFd>,
    /// The flags children are started with (after `__child --role ...`).
    args: Vec<OsString>,
    /// Environment variables children get (a Redis password).
    env: Vec<(OsString, OsString)>,
    slots: Vec<Slot>,
    /// Children restarted since the start.
    restarts: u64,
}

impl<'a> Children<'a> {
    /// `dispatchers` and `responders` slots, none started yet (all due at
    /// once), placed by [`place`]; children are started with the flags
    /// `args`.
    pub(super) fn new(
        segment: &'a Segment,
        listener: &'a TcpListener,
        dispatchers: usize,
        responders: usize,
        args: Vec<OsString>,
        env: Vec<(OsString, OsString)>,
    ) -> Result<Self> {
        let slots = place(segment, dispatchers, responders)?
            .into_iter()
            .map(|(role, slot, index)| Slot {
                role,
                slot,
                index,
                incarnation: 0,
                pid: None,
                restart_at: Some(Instant::now()),
                backoff: BACKOFF_START,
                restarts: VecDeque::new(),
                parked: false,
            })
            .collect();
        Ok(Self {
            segment,
            listener,
            epp: None,
            args,
            env,
            slots,
            restarts: 0,
        })
    }

    /// The same children, whose dispatchers also inherit the endpoint
    /// picker's listening socket `epp` (`None`: no picker).
    pub(super) fn with_epp(mut self, epp: Option<RawFd>) -> Self {
        self.epp = epp;
        self
    }

    /// The listening socket's descriptor (an upgrade hands it over).
    pub(super) fn listener_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }

    /// Children restarted since the start.
    pub(super) fn restarts(&self) -> u64 {
        self.restarts
    }

    /// Reaps whatever died, and schedules its restart.
    pub(super) fn reap(&mut self) {
        let tables = self.segment.tables();
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, _) | WaitStatus::Signaled(pid, _, _)) => {
                    if let Some(s) = self.slots.iter_mut().find(|s| s.pid == Some(pid)) {
                        tracing::warn!(child = ?s.role, index = s.index, pid = pid.as_raw(), "{:?} {} (pid {pid}) exited", s.role, s.index);
                        tables.registry.mark_exited(s.slot, s.incarnation);
                        let r = tables.servers.reclaim_process(s.slot);
                        // Its tenants' requests in flight died with it.
                        let slot = s.slot;
                        tables.usage.zero(
                            shm_layout::UsageKind::Gauge,
                            shm_layout::UsageCounter::Requests,
                            |name| semlb::dispatcher::concurrency::gauge_of(slot, name),
                        );
                        if r.requests > 0 || r.interrupted > 0 {
                            tracing::info!(
                                requests = r.requests,
                                interrupted = r.interrupted,
                                "took back the in-flight counts of {:?} {}",
                                s.role,
                                s.index
                            );
                        }
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
    pub(super) fn kill_hung(&self) {
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
    pub(super) fn start_due(&mut self) -> Result<()> {
        let tables = self.segment.tables();
        let clock = self.segment.clock();
        // Children of each role running now (a crash loop with none of its
        // role left is the service's failure, else the slot's).
        let serving =
            |role: ChildRole, slots: &[Slot]| slots.iter().filter(|s| s.role == role && s.pid.is_some()).count();
        let serving = [ChildRole::Dispatcher, ChildRole::Responder].map(|r| (r, serving(r, &self.slots)));
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
                    let siblings = serving.iter().find(|(r, _)| *r == s.role).map_or(0, |(_, n)| *n);
                    if siblings == 0 {
                        bail!(
                            "{:?} {} crashed {CRASH_LIMIT} times within {CRASH_WINDOW:?} and no other {:?} serves: crash loop, stopping",
                            s.role,
                            s.index,
                            s.role
                        );
                    }
                    tracing::error!(
                        child = ?s.role,
                        index = s.index,
                        serving = siblings,
                        "{:?} {} crashed {CRASH_LIMIT} times within {CRASH_WINDOW:?}: crash loop, parked for {PARK:?} while {siblings} other(s) serve",
                        s.role,
                        s.index
                    );
                    s.restarts.clear();
                    s.restart_at = Some(started + PARK);
                    s.parked = true;
                    continue;
                }
                tracing::info!(child = ?s.role, index = s.index, "restarting {:?} {}", s.role, s.index);
                self.restarts += 1;
            }
            let role = match s.role {
                ChildRole::Dispatcher => Role::Dispatcher,
                ChildRole::Responder => Role::Responder,
            };
            s.incarnation = tables.registry.claim(s.slot, role, clock.now_ms());
            let fds = (s.role == ChildRole::Dispatcher).then(|| (self.listener.as_raw_fd(), self.epp));
            match spawn(s, fds, &self.args, &self.env) {
                Ok(pid) => {
                    s.pid = Some(pid);
                    s.restart_at = None;
                    s.parked = false;
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
        Ok(())
    }

    /// Whether child `s` runs its current incarnation and has attached to
    /// its registry slot (and `fresh`: heartbeated within
    /// [`FRESH_HEARTBEAT_MS`] of `now_ms`).
    fn running(&self, s: &Slot, fresh: bool, now_ms: u64) -> bool {
        s.pid.is_some()
            && self.segment.tables().registry.get(s.slot).is_some_and(|info| {
                info.incarnation == s.incarnation
                    && info.state == ProcessState::Running
                    && (!fresh || now_ms.saturating_sub(info.heartbeat_ms) <= FRESH_HEARTBEAT_MS)
            })
    }

    /// Up: every child attached (the dispatchers then share the listener).
    pub(super) fn up(&self) -> bool {
        let now_ms = self.segment.clock().now_ms();
        self.slots.iter().all(|s| self.running(s, false, now_ms))
    }

    /// Healthy, for the watchdog: every child attached with a fresh
    /// heartbeat, but for slots parked after a crash loop while a sibling
    /// of their role serves (the service serves; systemd must not kill it
    /// for one bad slot). A child being restarted or hung makes the
    /// supervisor unhealthy until it runs again.
    pub(super) fn healthy(&self) -> bool {
        let now_ms = self.segment.clock().now_ms();
        let fresh = |s: &Slot| self.running(s, true, now_ms);
        self.slots.iter().all(|s| s.parked || fresh(s))
            && [ChildRole::Dispatcher, ChildRole::Responder]
                .iter()
                .all(|role| self.slots.iter().any(|s| s.role == *role && fresh(s)))
    }

    /// The children of `role` that are up with a fresh heartbeat, and how
    /// many there are.
    pub(super) fn count(&self, role: ChildRole) -> (usize, usize) {
        let now_ms = self.segment.clock().now_ms();
        let of_role = self.slots.iter().filter(|s| s.role == role);
        let up = of_role.clone().filter(|s| self.running(s, true, now_ms)).count();
        (up, of_role.count())
    }

    /// Sends `signal` to every running dispatcher.
    pub(super) fn signal_dispatchers(&self, signal: Signal) {
        for s in self.slots.iter().filter(|s| s.role == ChildRole::Dispatcher) {
            if let Some(pid) = s.pid {
                let _ = kill(pid, signal);
            }
        }
    }

    /// SIGTERM to every child, then SIGKILL after `grace`; reaps them all.
    pub(super) async fn stop(&mut self, grace: Duration) {
        for s in self.slots.iter() {
            if let Some(pid) = s.pid {
                let _ = kill(pid, Signal::SIGTERM);
            }
        }
        let deadline = Instant::now() + grace;
        let mut pending: HashMap<Pid, ()> = self.slots.iter().filter_map(|s| s.pid).map(|p| (p, ())).collect();
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
        for s in self.slots.iter_mut() {
            s.pid = None;
        }
    }
}

/// Where the children go: `(role, registry slot, index)` for `dispatchers`
/// dispatchers (index: the completion ring each produces into) and
/// `responders` responders. Slots and rings that live processes hold are
/// left alone (during an upgrade, the children of the supervisor handing
/// over: [`super::upgrade`]), and every dispatcher's slot has a ledger bit
/// (slot mod 64) of its own among the live dispatchers, as the server
/// table's crash-safe in-flight accounting needs. With nothing live: the
/// dispatchers in slots 1.., rings 0.., then the responders.
fn place(segment: &Segment, dispatchers: usize, responders: usize) -> Result<Vec<(ChildRole, u16, usize)>> {
    let t = segment.tables();
    let live: Vec<_> = t
        .registry
        .processes()
        .filter(|p| p.slot != 0 && matches!(p.state, ProcessState::Starting | ProcessState::Running))
        .collect();
    let mut taken_bits: u64 = live
        .iter()
        .filter(|p| p.role == Some(Role::Dispatcher))
        .fold(0, |bits, p| bits | 1 << (p.slot % 64));
    let mut taken_slots: Vec<u16> = live.iter().map(|p| p.slot).collect();
    let mut free_rings = (0..t.ring_count()).filter(|&r| {
        let (slot, incarnation) = t.ring(r).owner();
        !live.iter().any(|p| p.slot == slot && p.incarnation == incarnation)
    });
    let mut placed = Vec::with_capacity(dispatchers + responders);
    let capacity = t.registry.capacity() as u16;
    for _ in 0..dispatchers {
        let slot = (1..capacity).find(|s| !taken_slots.contains(s) && taken_bits & (1 << (s % 64)) == 0);
        let (Some(slot), Some(ring)) = (slot, free_rings.next()) else {
            bail!(
                "no room for {dispatchers} dispatchers next to the {} processes still running on the segment \
                 (the dispatchers of two supervisors share 64 completion rings and ledger bits)",
                live.len()
            );
        };
        taken_bits |= 1 << (slot % 64);
        taken_slots.push(slot);
        placed.push((ChildRole::Dispatcher, slot, ring));
    }
    for index in 0..responders {
        let Some(slot) = (1..capacity).find(|s| !taken_slots.contains(s)) else {
            bail!("no registry slot left for responder {index}");
        };
        taken_slots.push(slot);
        placed.push((ChildRole::Responder, slot, index));
    }
    Ok(placed)
}

/// Starts the child of slot `s`: `semlb __child` with `serve_args` and
/// `env`, and
/// for a dispatcher the listening socket `listen_fds.0` on [`LISTEN_FD`]
/// and the endpoint picker's, `listen_fds.1`, on [`EPP_FD`].
fn spawn(
    s: &Slot,
    listen_fds: Option<(RawFd, Option<RawFd>)>,
    serve_args: &[OsString],
    env: &[(OsString, OsString)],
) -> std::io::Result<Pid> {
    // The running binary itself, even once an upgrade replaced the file
    // (the path would then name the new one); named as it was started.
    let exe = std::path::Path::new("/proc/self/exe");
    let name = std::env::args_os().next().unwrap_or_else(|| "semlb".into());
    let role = match s.role {
        ChildRole::Dispatcher => "dispatcher",
        ChildRole::Responder => "responder",
    };
    let mut cmd = Command::new(exe);
    cmd.arg0(name)
        .arg("__child")
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
    for var in sd_notify::ENV_VARS {
        // Only the supervisor talks to systemd.
        cmd.env_remove(var);
    }
    cmd.env_remove(super::upgrade::INHERIT_VAR);
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    let supervisor = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls (signal, prctl, getppid, dup2, fcntl,
    // close, _exit) on descriptors captured by value.
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
            if let Some((fd, epp)) = listen_fds {
                // The picker's socket first out of the way of both
                // targets (the HTTP one may land on its number).
                let parked = match epp {
                    Some(epp) => {
                        let parked = libc::fcntl(epp, libc::F_DUPFD_CLOEXEC, 64);
                        if parked < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        Some(parked)
                    }
                    None => None,
                };
                inherit_as(fd, LISTEN_FD)?;
                if let Some(parked) = parked {
                    inherit_as(parked, EPP_FD)?;
                    libc::close(parked);
                }
            }
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    Ok(Pid::from_raw(child.id() as i32))
}

/// Puts `fd` on `target` in a forked child before exec, open across the
/// exec. Only async-signal-safe calls (dup2, fcntl).
fn inherit_as(fd: RawFd, target: RawFd) -> std::io::Result<()> {
    // SAFETY: dup2 and fcntl on plain descriptor numbers; they touch no
    // memory of this process.
    unsafe {
        if fd != target && libc::dup2(fd, target) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let flags = libc::fcntl(target, libc::F_GETFD);
        if flags < 0 || libc::fcntl(target, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
