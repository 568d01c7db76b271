//! Zero-downtime binary upgrade, as nginx and pingora do it.
//!
//! SIGUSR2 to the supervisor (under systemd: `systemctl kill
//! --signal=SIGUSR2 --kill-whom=main semlb`) starts the binary now
//! installed where this one was started from, with the same command line,
//! as its **successor** ([`Successor::start`]), and hands it:
//!
//! | fd | what |
//! | ---: | --- |
//! | 3 | the listening socket: the same socket, never closed, so no connection is refused |
//! | 4 | the segment's owner lock (the same open file description: both own the segment until this process exits) |
//! | 5 | a pipe on which the successor says `ready` |
//! | 6, 7 | the admin API's and the metrics listeners, if there are any |
//!
//! `SEMLB_INHERIT` names them and the segment. The successor opens the
//! segment (it must have this build's layout version: an upgrade that
//! changes the layout needs a restart, and the successor says so and exits,
//! while this supervisor serves on), keeps the backends' registrations,
//! starts its children in registry slots and completion rings the running
//! ones do not use, and writes `ready` once its dispatchers answer. Then
//! this supervisor tells systemd the successor is the main process
//! (`MAINPID=`), stops its dispatchers accepting (SIGTERM: their requests
//! in flight, streams included, finish; idle keep-alive connections get
//! their next answer with `connection: close`) and exits once its children
//! have. The successor's responders write back what the old dispatchers
//! still push (every responder drains every ring). A successor that exits
//! or is not ready within [`READY_WITHIN`] is a failed upgrade: logged,
//! killed, and this supervisor serves on.

use std::ffi::OsString;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpListener;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::fcntl::{FcntlArg, FdFlag, OFlag, fcntl};

/// Most descriptors handed to a successor (listener, owner, ready pipe,
/// admin, metrics and endpoint-picker listeners).
const MAX_MOVES: usize = 6;

/// The environment variable that makes a supervisor a successor:
/// `shm=NAME,listen=3,owner=4,ready=5[,admin=6][,metrics=7][,epp=8]`.
pub(super) const INHERIT_VAR: &str = "SEMLB_INHERIT";

/// How long a successor may take to say it is ready.
pub(super) const READY_WITHIN: Duration = Duration::from_secs(60);

/// The descriptors a successor gets, by name and number.
const LISTEN: (&str, RawFd) = ("listen", 3);
const OWNER: (&str, RawFd) = ("owner", 4);
const READY: (&str, RawFd) = ("ready", 5);
const ADMIN: (&str, RawFd) = ("admin", 6);
const METRICS: (&str, RawFd) = ("metrics", 7);
const EPP: (&str, RawFd) = ("epp", 8);

/// The path of the binary this process was started from, as it was at
/// start (once the file is replaced, `/proc/self/exe` reads "... (deleted)").
pub(super) fn installed_exe() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the semlb binary")?;
    let text = exe.to_string_lossy();
    Ok(match text.strip_suffix(" (deleted)") {
        Some(path) => PathBuf::from(path),
        None => exe,
    })
}

/// What a running supervisor hands its successor.
#[derive(Debug, Clone, Copy)]
pub(super) struct Handover<'a> {
    /// The segment's name.
    pub shm: &'a str,
    /// The dispatchers' listening socket.
    pub listener: RawFd,
    /// The owner lock's descriptor.
    pub owner: RawFd,
    /// The admin API's listener.
    pub admin: Option<RawFd>,
    /// The metrics listener.
    pub metrics: Option<RawFd>,
    /// The endpoint picker's listener (`[epp] listen`).
    pub epp: Option<RawFd>,
}

/// How a successor is doing.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Progress {
    /// Starting.
    Starting,
    /// Ready: its dispatchers answer.
    Ready,
    /// It will not take over, and why.
    Failed(String),
}

/// A successor being started.
#[derive(Debug)]
pub(super) struct Successor {
    child: Child,
    /// The read end of its ready pipe (non-blocking).
    ready: File,
    started: Instant,
}

impl Successor {
    /// Starts `exe` with this process's command line as the successor,
    /// handing it `handover`.
    pub(super) fn start(exe: &Path, handover: Handover<'_>) -> Result<Self> {
        let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).context("pipe2")?;
        // The successor blocks on nothing: only its end is made blocking.
        let flags = OFlag::from_bits_truncate(fcntl(&write, FcntlArg::F_GETFL)?);
        fcntl(&write, FcntlArg::F_SETFL(flags & !OFlag::O_NONBLOCK))?;
        let mut fds: Vec<((&str, RawFd), RawFd)> = vec![
            (LISTEN, handover.listener),
            (OWNER, handover.owner),
            (READY, write.as_raw_fd()),
        ];
        fds.extend(handover.admin.map(|fd| (ADMIN, fd)));
        fds.extend(handover.metrics.map(|fd| (METRICS, fd)));
        fds.extend(handover.epp.map(|fd| (EPP, fd)));
        let names = std::iter::once(format!("shm={}", handover.shm))
            .chain(fds.iter().map(|((name, target), _)| format!("{name}={target}")))
            .collect::<Vec<_>>()
            .join(",");
        let moves: Vec<(RawFd, RawFd)> = fds.iter().map(|((_, target), source)| (*source, *target)).collect();
        // The child's copy of `moves` is parked in a fixed array (nothing
        // may allocate between fork and exec): checked here, in the parent.
        anyhow::ensure!(
            moves.len() <= MAX_MOVES,
            "{} descriptors to hand over, at most {MAX_MOVES}",
            moves.len()
        );
        let args: Vec<OsString> = std::env::args_os().skip(1).collect();
        let mut cmd = Command::new(exe);
        cmd.args(&args).env(INHERIT_VAR, names).stdin(Stdio::null());
        // systemd's WATCHDOG_PID names this process; without it the
        // successor pings as the main process it becomes.
        cmd.env_remove("WATCHDOG_PID");
        // SAFETY: the closure runs in the forked child before exec and only
        // makes async-signal-safe system calls (fcntl, dup2) on the
        // descriptors captured by value; `moves` is read, not allocated.
        unsafe {
            cmd.pre_exec(move || {
                // First out of the way of every target number, then onto
                // the targets (dup2 leaves the copy open across exec).
                let mut parked = [0 as RawFd; MAX_MOVES];
                for (i, (source, _)) in moves.iter().enumerate() {
                    parked[i] = libc::fcntl(*source, libc::F_DUPFD_CLOEXEC, 64);
                    if parked[i] < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                for (i, (_, target)) in moves.iter().enumerate() {
                    if libc::dup2(parked[i], *target) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let child = cmd.spawn().with_context(|| format!("starting {}", exe.display()))?;
        drop(write);
        Ok(Self {
            child,
            ready: File::from(read),
            started: Instant::now(),
        })
    }

    /// The successor's pid.
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it said ready, failed, or is still starting. A failed one
    /// is killed and reaped.
    pub(super) fn progress(&mut self) -> Progress {
        let mut said = [0u8; 16];
        let failed = match self.ready.read(&mut said) {
            Ok(n) if n > 0 && said[..n].starts_with(b"ready") => return Progress::Ready,
            Ok(0) => "it exited (or closed its ready pipe) before it was ready".to_owned(),
            Ok(_) => "it said something other than ready".to_owned(),
            Err(e) if e.kind() == ErrorKind::WouldBlock && self.started.elapsed() < READY_WITHIN => {
                return Progress::Starting;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => format!("it was not ready within {READY_WITHIN:?}"),
            Err(e) => format!("reading its ready pipe: {e}"),
        };
        let _ = self.child.kill();
        let status = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
        Progress::Failed(format!("{failed} ({status})"))
    }
}

/// What a successor inherited from the supervisor it takes over from.
#[derive(Debug)]
pub(super) struct Inherited {
    /// The segment's name.
    pub shm: String,
    /// The dispatchers' listening socket.
    pub listener: TcpListener,
    /// The descriptor holding the segment's owner lock.
    pub owner: OwnedFd,
    /// Where to say ready ([`say_ready`]).
    pub ready: Option<File>,
    /// The admin API's listener, if the old supervisor had one.
    pub admin: Option<TcpListener>,
    /// The metrics listener, if the old supervisor had one.
    pub metrics: Option<TcpListener>,
    /// The endpoint picker's listener, if the old supervisor had one.
    pub epp: Option<TcpListener>,
}

impl Inherited {
    /// What this process inherited, if it was started as a successor
    /// ([`INHERIT_VAR`]).
    pub(super) fn from_env() -> Result<Option<Self>> {
        let Some(value) = std::env::var_os(INHERIT_VAR) else {
            return Ok(None);
        };
        let value = value.into_string().ok().context("SEMLB_INHERIT is not UTF-8")?;
        let mut shm = None;
        let mut fds = Vec::new();
        for part in value.split(',') {
            let (name, v) = part.split_once('=').context("SEMLB_INHERIT: expected name=value")?;
            if name == "shm" {
                shm = Some(v.to_owned());
                continue;
            }
            let known = [LISTEN, OWNER, READY, ADMIN, METRICS, EPP];
            let Some(&(_, fd)) = known.iter().find(|(n, fd)| *n == name && v == fd.to_string()) else {
                bail!("SEMLB_INHERIT: unexpected {part}");
            };
            // Kept from this process's own children from now on.
            fcntl(
                // SAFETY: only borrowed for the call; the number was checked
                // against the ones a supervisor hands over.
                unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) },
                FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC),
            )
            .with_context(|| format!("SEMLB_INHERIT names fd {fd}, which is not open"))?;
            // SAFETY: the supervisor that started this process put the
            // descriptor there for it (dup2 before exec) and nothing else in
            // this process owns it; it is taken exactly once (the names are
            // checked to be distinct below).
            fds.push((name, unsafe { OwnedFd::from_raw_fd(fd) }));
        }
        let mut take = |wanted: &str| fds.iter().position(|(n, _)| *n == wanted).map(|i| fds.swap_remove(i).1);
        let listener = take(LISTEN.0).context("SEMLB_INHERIT has no listening socket")?;
        let owner = take(OWNER.0).context("SEMLB_INHERIT has no owner lock")?;
        let ready = take(READY.0).map(File::from);
        let admin = take(ADMIN.0).map(TcpListener::from);
        let metrics = take(METRICS.0).map(TcpListener::from);
        let epp = take(EPP.0).map(TcpListener::from);
        if let Some((name, _)) = fds.first() {
            bail!("SEMLB_INHERIT names {name} twice");
        }
        Ok(Some(Self {
            shm: shm.context("SEMLB_INHERIT names no segment")?,
            listener: TcpListener::from(listener),
            owner,
            ready,
            admin,
            metrics,
            epp,
        }))
    }
}

/// Tells the supervisor handing over that this one is ready (once).
pub(super) fn say_ready(pipe: &mut Option<File>) {
    if let Some(mut pipe) = pipe.take() {
        let _ = pipe.write_all(b"ready\n");
    }
}
