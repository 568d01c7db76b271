//! Processes of the `semlb` binary (or any program that announces itself
//! the same way): a child that prints `... http://ADDR` as its first stdout
//! line (the gateway, `__sim` engines), its captured stderr, signals, and
//! stop on drop.
//!
//! [`Proc::start`], [`Proc::spawn`] and [`Proc::spawn_env`] are the tests'
//! short forms (they panic on failure); [`ProcBuilder::try_start`] is the
//! whole thing, with an [`Error`] for callers that report rather than panic
//! (the `semlb-bench` reports).

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::Error;

/// The environment variable that names the `semlb` binary explicitly
/// (otherwise [`semlb_exe`] looks next to the running executable).
pub const SEMLB_EXE_VAR: &str = "SEMLB_EXE";

/// The `semlb` binary: `$SEMLB_EXE`, else `semlb` in the running
/// executable's directory, else in its parent when that directory is
/// Cargo's `deps/` (integration tests and criterion benches run from
/// `target/<profile>/deps/`, the binaries sit in `target/<profile>/`).
pub fn semlb_exe() -> Result<PathBuf, Error> {
    if let Some(path) = std::env::var_os(SEMLB_EXE_VAR) {
        return Ok(PathBuf::from(path));
    }
    let here = std::env::current_exe().map_err(Error::CurrentExe)?;
    let dir = here.parent().map(PathBuf::from).unwrap_or_default();
    let mut tried = Vec::new();
    let mut candidates = vec![dir.join("semlb")];
    if dir.file_name().is_some_and(|n| n == "deps")
        && let Some(up) = dir.parent()
    {
        candidates.push(up.join("semlb"));
    }
    for c in candidates {
        if c.is_file() {
            return Ok(c);
        }
        tried.push(c);
    }
    Err(Error::NoSemlb { tried })
}

/// [`semlb_exe`] as text, found once; panics (with what was tried) when
/// there is none. For tests.
pub fn exe() -> &'static str {
    static EXE: OnceLock<String> = OnceLock::new();
    EXE.get_or_init(|| {
        let path = semlb_exe().unwrap_or_else(|e| panic!("{e}"));
        path.to_str().expect("a UTF-8 path to semlb").to_owned()
    })
}

/// A unique name for a test's shm segment (or namespace): `semlb-<prefix>-<tag>-<pid>-<nanos>`.
pub fn unique(prefix: &str, tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("semlb-{prefix}-{tag}-{}-{nanos}", std::process::id())
}

/// What happens to a child's stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stderr {
    /// Inherited: it goes where this process's stderr goes.
    Inherit,
    /// Collected in [`Proc::stderr_text`], each line also echoed to this
    /// process's stderr (what a test wants: the harness shows it on failure).
    CaptureEcho,
    /// Only its last `n` lines kept, for an error message
    /// ([`Proc::stderr_tail`]); nothing echoed.
    Tail(usize),
}

/// How to start a [`Proc`].
#[derive(Debug, Clone)]
pub struct ProcBuilder {
    what: String,
    program: Option<PathBuf>,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    stderr: Stderr,
    within: Duration,
}

impl ProcBuilder {
    /// A process of the `semlb` binary ([`semlb_exe`]) with `args`.
    pub fn new<S: Into<OsString>>(args: impl IntoIterator<Item = S>) -> ProcBuilder {
        ProcBuilder {
            what: "semlb".to_owned(),
            program: None,
            args: args.into_iter().map(Into::into).collect(),
            env: Vec::new(),
            stderr: Stderr::Inherit,
            within: Duration::from_secs(60),
        }
    }

    /// What it is, for messages (default `semlb`).
    pub fn what(mut self, what: impl Into<String>) -> ProcBuilder {
        self.what = what.into();
        self
    }

    /// Another program than `semlb`.
    pub fn program(mut self, program: impl Into<PathBuf>) -> ProcBuilder {
        self.program = Some(program.into());
        self
    }

    /// One more environment variable.
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> ProcBuilder {
        self.env.push((key.into(), value.into()));
        self
    }

    /// What happens to its stderr (default [`Stderr::Inherit`]).
    pub fn stderr(mut self, stderr: Stderr) -> ProcBuilder {
        self.stderr = stderr;
        self
    }

    /// How long it may take to print its address (default 60 s).
    pub fn within(mut self, within: Duration) -> ProcBuilder {
        self.within = within;
        self
    }

    /// Starts it (systemd's notification variables of this process's own
    /// environment removed first, so only a caller that sets them passes
    /// them) and waits for its address line.
    pub fn try_start(self) -> Result<Proc, Error> {
        let program = match self.program {
            Some(p) => p,
            None => semlb_exe()?,
        };
        let mut cmd = Command::new(&program);
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(if self.stderr == Stderr::Inherit {
                Stdio::inherit()
            } else {
                Stdio::piped()
            });
        for var in ["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"] {
            cmd.env_remove(var);
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        let mut child = cmd.spawn().map_err(|source| Error::Spawn {
            what: format!("{} ({})", self.what, program.display()),
            source,
        })?;
        let stderr = child.stderr.take().map(|err| match self.stderr {
            Stderr::Tail(n) => Captured::read(err, false, Some(n)),
            _ => Captured::read(err, true, None),
        });
        let Some(out) = child.stdout.take() else {
            unreachable!("stdout is piped")
        };
        let rx = first_line(out);
        let mut proc = Proc {
            child,
            what: self.what,
            addr: String::new(),
            line: String::new(),
            stderr,
        };
        let line = match rx.recv_timeout(self.within) {
            Ok(Ok(line)) => line,
            Ok(Err(e)) => {
                return Err(Error::NoAddress {
                    what: proc.what.clone(),
                    why: format!("reading its stdout: {e}"),
                    stderr: proc.stderr_tail(),
                });
            }
            Err(_) => {
                return Err(Error::NoAddress {
                    what: proc.what.clone(),
                    why: format!("no address line within {:?}", self.within),
                    stderr: proc.stderr_tail(),
                });
            }
        };
        proc.line = line.trim().to_owned();
        match line.trim().rsplit_once("http://") {
            Some((_, addr)) if addr.contains(':') => proc.addr = addr.to_owned(),
            _ => {
                // Give its stderr reader a moment to collect why it exited.
                let _ = proc.wait_exit(Duration::from_millis(500));
                std::thread::sleep(Duration::from_millis(50));
                return Err(Error::NoAddress {
                    what: proc.what.clone(),
                    why: format!("no address in its first line {line:?}"),
                    stderr: proc.stderr_tail(),
                });
            }
        }
        Ok(proc)
    }

    /// [`ProcBuilder::try_start`], panicking on failure. For tests.
    pub fn start(self) -> Proc {
        self.try_start().unwrap_or_else(|e| panic!("{e}"))
    }
}

/// The lines a child writes to a pipe (its stderr), collected by a thread
/// of their own.
#[derive(Debug, Clone)]
pub struct Captured(Arc<Mutex<VecDeque<String>>>);

impl Captured {
    /// Reads `pipe` line by line until it closes, keeping the last `keep`
    /// lines (all with `None`) and, with `echo`, writing each to this
    /// process's stderr too.
    pub fn read(pipe: impl Read + Send + 'static, echo: bool, keep: Option<usize>) -> Captured {
        let lines = Arc::new(Mutex::new(VecDeque::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if echo {
                    eprintln!("{line}");
                }
                let mut t = sink.lock().unwrap_or_else(|e| e.into_inner());
                if keep.is_some_and(|n| t.len() >= n) {
                    t.pop_front();
                }
                t.push_back(line);
            }
        });
        Captured(lines)
    }

    /// The lines so far, a line feed after each.
    pub fn text(&self) -> String {
        let lines = self.0.lock().unwrap_or_else(|e| e.into_inner());
        lines.iter().flat_map(|l| [l.as_str(), "\n"]).collect()
    }

    /// The lines so far as `:\n  …` text to append to an error message
    /// (empty when there are none).
    pub fn tail(&self) -> String {
        let text = self.text();
        if text.is_empty() {
            String::new()
        } else {
            format!(":\n  {}", text.trim_end().replace('\n', "\n  "))
        }
    }
}

/// The first line `pipe` (a child's stdout) gives, sent when read; the rest
/// is drained, so the child never writes into a closed pipe.
pub fn first_line(pipe: impl Read + Send + 'static) -> Receiver<std::io::Result<String>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut out = BufReader::new(pipe);
        let mut line = String::new();
        let _ = tx.send(out.read_line(&mut line).map(|_| line));
        let _ = std::io::copy(&mut out, &mut std::io::sink());
    });
    rx
}

/// A child process that printed `... http://ADDR` as its first stdout line;
/// SIGTERM (then SIGKILL) when dropped.
pub struct Proc {
    /// The child.
    pub child: Child,
    what: String,
    /// The address it printed (`host:port`).
    pub addr: String,
    /// The whole line it printed first (a simulator's names its KV event
    /// endpoints there too).
    pub line: String,
    /// Its stderr lines (and its children's) as far as read, when captured.
    stderr: Option<Captured>,
}

impl Proc {
    /// `semlb <args>`, stderr inherited.
    pub fn start(args: &[&str]) -> Proc {
        Proc::spawn(args, false)
    }

    /// Like [`Proc::start`]; with `capture_stderr`, stderr is collected in
    /// [`Proc::stderr_text`] (and still echoed to the test's stderr).
    pub fn spawn(args: &[&str], capture_stderr: bool) -> Proc {
        Proc::spawn_env(args, capture_stderr, &[])
    }

    /// [`Proc::spawn`] with `env` added to its environment (systemd's
    /// notification variables of the test's own environment are removed
    /// first, so only a test that sets them has them).
    pub fn spawn_env(args: &[&str], capture_stderr: bool, env: &[(&str, &str)]) -> Proc {
        let mut b = ProcBuilder::new(args.iter().copied()).stderr(if capture_stderr {
            Stderr::CaptureEcho
        } else {
            Stderr::Inherit
        });
        for (k, v) in env {
            b = b.env(k, v);
        }
        b.start()
    }

    /// Its pid.
    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    /// Sends `sig`.
    pub fn signal(&self, sig: Signal) {
        kill(self.pid(), sig).expect("signal");
    }

    /// Waits (bounded) until its captured stderr contains `needle` after
    /// byte `from`; the whole text.
    pub fn wait_stderr(&self, from: usize, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let text = self.stderr_text();
            if text.get(from..).is_some_and(|t| t.contains(needle)) {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "no {needle:?} in the log after byte {from}:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The captured stderr so far, a line feed after each line (empty when
    /// not captured).
    pub fn stderr_text(&self) -> String {
        self.stderr.as_ref().map(Captured::text).unwrap_or_default()
    }

    /// The captured stderr's last lines as `:\n  …` text to append to an
    /// error message (empty when nothing was captured).
    pub fn stderr_tail(&self) -> String {
        self.stderr.as_ref().map(Captured::tail).unwrap_or_default()
    }

    /// True while it runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Its exit status, waiting at most `within`; `None` if still running.
    pub fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM and wait (bounded), SIGKILL if needed; the exit status. A
    /// process that already exited (and was reaped) is not signalled again.
    pub fn stop(&mut self) -> Option<i32> {
        if let Ok(Some(status)) = self.child.try_wait() {
            return status.code();
        }
        // A stopped process (a test froze it) must run to handle SIGTERM.
        let _ = kill(self.pid(), Signal::SIGCONT);
        let _ = kill(self.pid(), Signal::SIGTERM);
        if let Some(status) = self.wait_exit(Duration::from_secs(20)) {
            return status.code();
        }
        eprintln!("{} did not stop on SIGTERM; killing it", self.what);
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }

    /// `kill -9`, then reap it.
    pub fn kill9(&mut self) {
        kill(self.pid(), Signal::SIGKILL).expect("SIGKILL");
        self.child.wait().expect("reaped");
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.stop();
        }
    }
}

/// Runs `semlb <args>` to its end (`SEMLB_SHM_NAME` and `SEMLB_SHM_SIZE` of
/// this process's environment removed, so only the arguments count).
pub fn run(args: &[&str]) -> Output {
    Command::new(exe())
        .args(args)
        .env_remove("SEMLB_SHM_NAME")
        .env_remove("SEMLB_SHM_SIZE")
        .output()
        .expect("run the semlb binary")
}

/// A finished command's stdout, as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A finished command's stderr, as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts that the command succeeded (else shows its status and both
/// outputs); its stdout.
#[track_caller]
pub fn assert_ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        stdout(o),
        stderr(o)
    );
    stdout(o)
}
