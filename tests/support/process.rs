//! Processes of the `semlb` binary for the multi-process tests: a child
//! that prints `... http://ADDR` as its first stdout line (the gateway,
//! `__sim` engines), its captured stderr, signals, and stop on drop.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// The binary under test.
pub const EXE: &str = env!("CARGO_BIN_EXE_semlb");

/// A unique name for a test's shm segment (or namespace): `semlb-<prefix>-<tag>-<pid>-<nanos>`.
pub fn unique(prefix: &str, tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("semlb-{prefix}-{tag}-{}-{nanos}", std::process::id())
}

/// A child process that prints `... http://ADDR` as its first stdout line.
pub struct Proc {
    pub child: Child,
    pub addr: String,
    /// Its stderr (and its children's) as far as read, when captured.
    pub stderr: Option<Arc<Mutex<String>>>,
}

impl Proc {
    pub fn start(args: &[&str]) -> Proc {
        Proc::spawn(args, false)
    }

    /// Like [`Proc::start`]; with `capture_stderr`, stderr is collected in
    /// [`Proc::stderr`] (and still echoed to the test's stderr).
    pub fn spawn(args: &[&str], capture_stderr: bool) -> Proc {
        Proc::spawn_env(args, capture_stderr, &[])
    }

    /// [`Proc::spawn`] with `env` added to its environment (systemd's
    /// notification variables of the test's own environment are removed
    /// first, so only a test that sets them has them).
    pub fn spawn_env(args: &[&str], capture_stderr: bool, env: &[(&str, &str)]) -> Proc {
        let mut cmd = Command::new(EXE);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(if capture_stderr {
                Stdio::piped()
            } else {
                Stdio::inherit()
            });
        for var in ["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"] {
            cmd.env_remove(var);
        }
        cmd.envs(env.iter().copied());
        let mut child = cmd.spawn().expect("spawn semlb");
        let stderr = child.stderr.take().map(|err| {
            let text = Arc::new(Mutex::new(String::new()));
            let sink = text.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    eprintln!("{line}");
                    let mut t = sink.lock().unwrap();
                    t.push_str(&line);
                    t.push('\n');
                }
            });
            text
        });
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("first line");
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        let addr = line.trim().rsplit("http://").next().unwrap_or_default().to_owned();
        assert!(addr.contains(':'), "no address in {line:?}");
        Proc { child, addr, stderr }
    }

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

    /// The captured stderr so far (empty when not captured).
    pub fn stderr_text(&self) -> String {
        self.stderr
            .as_ref()
            .map(|t| t.lock().unwrap().clone())
            .unwrap_or_default()
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
