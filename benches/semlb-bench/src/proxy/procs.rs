//! The processes of `semlb bench proxy`: CPU sets and pinning, servers
//! started on given CPUs (the engine, `semlb serve`, a private nginx), and
//! the CPU time of a process tree read from `/proc`.
//!
//! Every server is started with its CPU affinity set between fork and exec
//! (so its own children, the gateway's dispatcher and responder or nginx's
//! worker, inherit it), in a process group of its own (a Ctrl-C at the
//! terminal reaches the benchmark only, which then stops them in order) and
//! with `PR_SET_PDEATHSIG` (if the benchmark dies, SIGKILL included, each
//! server gets SIGTERM; only nginx's temporary directory is then left
//! behind). Dropping a [`Server`] sends SIGTERM, waits, then SIGKILLs
//! whatever is left of its tree.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use semlb_test_support::process::{Captured, first_line};

// ---------------------------------------------------------------------------
// CPU sets.

/// A set of CPU numbers, written as `taskset -c` does: `0`, `1-3`, `0,2-3`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuList(Vec<usize>);

impl CpuList {
    /// The CPUs, ascending, without duplicates.
    pub fn cpus(&self) -> &[usize] {
        &self.0
    }

    /// These CPUs, ascending and deduplicated.
    pub fn new(mut cpus: Vec<usize>) -> Self {
        cpus.sort_unstable();
        cpus.dedup();
        Self(cpus)
    }

    /// The CPUs this thread may run on.
    pub fn of_this_thread() -> std::io::Result<Self> {
        // SAFETY: an all-zero cpu_set_t is a valid empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid, writable cpu_set_t of the size passed.
        if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let cpus = (0..libc::CPU_SETSIZE as usize)
            // SAFETY: `cpu` is below CPU_SETSIZE, the set's capacity.
            .filter(|cpu| unsafe { libc::CPU_ISSET(*cpu, &set) })
            .collect();
        Ok(Self(cpus))
    }

    /// Those of `self` not in `other`.
    pub fn without(&self, other: &CpuList) -> CpuList {
        CpuList(self.0.iter().copied().filter(|c| !other.0.contains(c)).collect())
    }

    /// Whether every CPU of `self` is in `other`.
    pub fn is_subset(&self, other: &CpuList) -> bool {
        self.0.iter().all(|c| other.0.contains(c))
    }

    fn to_set(&self) -> libc::cpu_set_t {
        // SAFETY: an all-zero cpu_set_t is a valid empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for cpu in &self.0 {
            // SAFETY: parsing bounds every CPU below CPU_SETSIZE.
            unsafe { libc::CPU_SET(*cpu, &mut set) };
        }
        set
    }

    /// Restricts the calling thread (and the threads and processes it
    /// starts afterwards) to these CPUs.
    pub fn pin_this_thread(&self) -> std::io::Result<()> {
        let set = self.to_set();
        // SAFETY: `set` is a valid cpu_set_t of the size passed.
        if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

/// Why a CPU list does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CpuListError {
    /// No CPU at all.
    #[error("an empty CPU list")]
    Empty,
    /// A part is not `N` or `N-M`.
    #[error("{0:?} is not a CPU number or range (`0`, `1-3`, `0,2`)")]
    Syntax(String),
    /// A CPU beyond what Linux can address.
    #[error("CPU {0} is out of range (at most {max})", max = libc::CPU_SETSIZE - 1)]
    OutOfRange(usize),
}

impl FromStr for CpuList {
    type Err = CpuListError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut cpus = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let number = |t: &str| {
                t.trim()
                    .parse::<usize>()
                    .map_err(|_| CpuListError::Syntax(part.to_owned()))
            };
            let (lo, hi) = match part.split_once('-') {
                Some((a, b)) => (number(a)?, number(b)?),
                None => (number(part)?, number(part)?),
            };
            if lo > hi {
                return Err(CpuListError::Syntax(part.to_owned()));
            }
            if hi >= libc::CPU_SETSIZE as usize {
                return Err(CpuListError::OutOfRange(hi));
            }
            cpus.extend(lo..=hi);
        }
        if cpus.is_empty() {
            return Err(CpuListError::Empty);
        }
        Ok(CpuList::new(cpus))
    }
}

impl fmt::Display for CpuList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut i = 0;
        while i < self.0.len() {
            let mut j = i;
            while j + 1 < self.0.len() && self.0[j + 1] == self.0[j] + 1 {
                j += 1;
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if j > i {
                write!(f, "{}-{}", self.0[i], self.0[j])?;
            } else {
                write!(f, "{}", self.0[i])?;
            }
            i = j + 1;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// CPU time of process trees.

/// Clock ticks per second of `/proc`'s CPU times (USER_HZ).
fn ticks_per_s() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 { ticks as f64 } else { 100.0 }
}

/// The parent of process `pid` and its user + system CPU time (all its
/// threads, those that exited included), seconds, from `/proc/<pid>/stat`.
fn stat_of(pid: i32, ticks_per_s: f64) -> Option<(i32, f64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields
    // are counted after its last ')'.
    let rest = text.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state(3) ppid(4) … utime(14) stime(15).
    let ppid = fields.get(1)?.parse().ok()?;
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((ppid, (utime + stime) / ticks_per_s))
}

/// Every live process id.
fn all_pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
                .collect()
        })
        .unwrap_or_default()
}

/// `root` and all its live descendants.
pub fn tree_pids(root: i32) -> Vec<i32> {
    let ticks = ticks_per_s();
    let parents: Vec<(i32, i32)> = all_pids()
        .into_iter()
        .filter_map(|pid| stat_of(pid, ticks).map(|(ppid, _)| (pid, ppid)))
        .collect();
    let mut out = Vec::new();
    let mut queue = VecDeque::from([root]);
    while let Some(pid) = queue.pop_front() {
        if pid == root && !parents.iter().any(|(p, _)| *p == root) {
            break;
        }
        out.push(pid);
        queue.extend(parents.iter().filter(|(_, parent)| *parent == pid).map(|(p, _)| *p));
    }
    out
}

/// The CPU time used so far by some processes, two ways: per process from
/// `/proc/<pid>/stat` (utime + stime, exited threads included, in 10 ms
/// units) and per live thread from `/proc/<pid>/task/<tid>/schedstat`
/// (nanoseconds).
#[derive(Debug, Clone, Default)]
pub struct CpuSnapshot {
    stat: BTreeMap<i32, f64>,
    threads: BTreeMap<(i32, i32), f64>,
}

impl CpuSnapshot {
    /// `root` and all its descendants.
    pub fn tree(root: i32) -> Self {
        Self::of(&tree_pids(root))
    }

    /// These processes.
    pub fn of(pids: &[i32]) -> Self {
        let ticks = ticks_per_s();
        let mut snap = CpuSnapshot::default();
        for &pid in pids {
            let Some((_, cpu)) = stat_of(pid, ticks) else {
                continue;
            };
            snap.stat.insert(pid, cpu);
            let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
                continue;
            };
            for tid in tasks
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            {
                let ns = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat"))
                    .ok()
                    .and_then(|t| t.split_whitespace().next()?.parse::<f64>().ok());
                if let Some(ns) = ns {
                    snap.threads.insert((pid, tid), ns / 1e9);
                }
            }
        }
        snap
    }
}

/// Most CPU time the per-thread sum may miss before the per-process one is
/// used instead (a thread that exited in the window: its time is only in
/// `/proc/<pid>/stat`).
const LOST_THREADS_TOLERANCE_S: f64 = 0.03;

/// CPU seconds used between two snapshots of the same processes (one that
/// appeared in between counts from 0; one that exited is lost): the
/// nanosecond per-thread sum, unless `/proc/<pid>/stat` shows more than
/// [`LOST_THREADS_TOLERANCE_S`] more (threads exited), then the latter.
pub fn cpu_between(start: &CpuSnapshot, end: &CpuSnapshot) -> f64 {
    fn delta<K: Ord>(a: &BTreeMap<K, f64>, b: &BTreeMap<K, f64>) -> f64 {
        b.iter()
            .map(|(k, v)| (v - a.get(k).copied().unwrap_or(0.0)).max(0.0))
            .sum()
    }
    let by_process = delta(&start.stat, &end.stat);
    let by_thread = delta(&start.threads, &end.threads);
    if by_process - by_thread > LOST_THREADS_TOLERANCE_S {
        by_process
    } else {
        by_thread
    }
}

/// Busy seconds of every CPU so far (all but idle and iowait, from
/// `/proc/stat`), indexed by CPU number.
pub fn cpu_busy() -> BTreeMap<usize, f64> {
    let ticks = ticks_per_s();
    let Ok(text) = std::fs::read_to_string("/proc/stat") else {
        return BTreeMap::new();
    };
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let cpu: usize = f.next()?.strip_prefix("cpu")?.parse().ok()?;
            let v: Vec<f64> = f.filter_map(|x| x.parse().ok()).collect();
            // user nice system idle iowait irq softirq steal (guest time is
            // already in user).
            let busy = v.iter().take(8).sum::<f64>() - v.get(3)? - v.get(4).copied().unwrap_or(0.0);
            Some((cpu, busy / ticks))
        })
        .collect()
}

/// Busy seconds of `cpus` between two [`cpu_busy`] readings.
pub fn busy_between(start: &BTreeMap<usize, f64>, end: &BTreeMap<usize, f64>, cpus: &CpuList) -> f64 {
    cpus.cpus()
        .iter()
        .map(|c| (end.get(c).copied().unwrap_or(0.0) - start.get(c).copied().unwrap_or(0.0)).max(0.0))
        .sum()
}

/// Where the kernel lets one process run.
#[derive(Debug, Clone)]
pub struct Placement {
    /// Its id.
    pub pid: i32,
    /// Its command name.
    pub name: String,
    /// Its `Cpus_allowed_list`.
    pub cpus_allowed: String,
}

/// The [`Placement`] of every process of `root`'s tree.
pub fn tree_placement(root: i32) -> Vec<Placement> {
    tree_pids(root)
        .iter()
        .filter_map(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let field = |name: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .map(|v| v.trim().to_owned())
            };
            Some(Placement {
                pid: *pid,
                name: field("Name:")?,
                cpus_allowed: field("Cpus_allowed_list:")?,
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Interruption.

/// Set when the user interrupts the run (SIGINT or SIGTERM): every wait and
/// load loop checks it and the run unwinds, stopping the servers.
#[derive(Debug, Clone, Default)]
pub struct Interrupt(Arc<AtomicBool>);

impl Interrupt {
    /// Whether the run was interrupted.
    pub fn raised(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// An error if the run was interrupted.
    pub fn check(&self) -> Result<()> {
        if self.raised() {
            bail!("interrupted");
        }
        Ok(())
    }

    /// Watches SIGINT and SIGTERM from now on: the first one raises the
    /// flag (or exits at once if `finished` is set), a second one exits
    /// at once with status 130 (the servers then get SIGTERM from the
    /// kernel, `PR_SET_PDEATHSIG`).
    pub fn watch(finished: Arc<AtomicBool>) -> Result<Interrupt> {
        use tokio::signal::unix::{SignalKind, signal};
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let (mut int, mut term) = {
            let _guard = runtime.enter();
            (signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?)
        };
        let flag = Interrupt::default();
        let raised = flag.clone();
        std::thread::spawn(move || {
            runtime.block_on(async move {
                for round in 0.. {
                    tokio::select! {
                        _ = int.recv() => {}
                        _ = term.recv() => {}
                    }
                    if round > 0 || finished.load(Ordering::Relaxed) {
                        std::process::exit(130);
                    }
                    eprintln!("\nsemlb bench proxy: interrupted; stopping the servers (again to exit at once)");
                    raised.0.store(true, Ordering::Relaxed);
                }
            });
        });
        Ok(flag)
    }
}

// ---------------------------------------------------------------------------
// Servers.

/// A server process started on given CPUs; stopped (with its whole tree)
/// when dropped.
pub struct Server {
    child: Child,
    what: String,
    stderr: Captured,
    /// `host:port` it serves on.
    pub addr: String,
}

/// How a [`Server`] tells where it listens.
pub enum Address {
    /// It prints `… http://HOST:PORT` as its first stdout line.
    Printed,
    /// It was told; ready once it accepts TCP connections there.
    Known(String),
}

impl Server {
    /// Starts `program args` on `cpus` and waits (at most `within`) until
    /// it serves.
    pub fn start(
        what: &str,
        program: &Path,
        args: &[String],
        cpus: &CpuList,
        address: Address,
        within: Duration,
        interrupt: &Interrupt,
    ) -> Result<Server> {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env_remove("SEMLB_CONFIG")
            .stdin(Stdio::null())
            .stdout(match address {
                Address::Printed => Stdio::piped(),
                Address::Known(_) => Stdio::null(),
            })
            .stderr(Stdio::piped())
            .process_group(0);
        let set = cpus.to_set();
        // SAFETY: the closure runs in the forked child before exec and only
        // makes async-signal-safe system calls (sched_setaffinity, prctl).
        unsafe {
            cmd.pre_exec(move || {
                if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start {what} ({})", program.display()))?;
        let stderr = Captured::read(child.stderr.take().context("no stderr")?, false, Some(40));
        let printed = child.stdout.take().map(first_line);
        let mut server = Server {
            child,
            what: what.to_owned(),
            stderr,
            addr: match &address {
                Address::Known(addr) => addr.clone(),
                Address::Printed => String::new(),
            },
        };
        let deadline = Instant::now() + within;
        if let Some(rx) = printed {
            let line = loop {
                interrupt.check()?;
                match rx.recv_timeout(Duration::from_millis(50)) {
                    Ok(Ok(line)) => break line,
                    Ok(Err(e)) => bail!("{what}: reading its stdout: {e}"),
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                        bail!("{what} exited before it printed its address{}", server.stderr_tail())
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) if Instant::now() > deadline => {
                        bail!("{what} printed no address within {within:?}{}", server.stderr_tail())
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                }
            };
            match line.trim().rsplit_once("http://") {
                Some((_, addr)) if addr.contains(':') => server.addr = addr.trim_end_matches('/').to_owned(),
                _ => {
                    std::thread::sleep(Duration::from_millis(200));
                    bail!("{what} did not start (stdout {line:?}){}", server.stderr_tail());
                }
            }
        }
        loop {
            interrupt.check()?;
            if TcpStream::connect(&server.addr).is_ok() {
                return Ok(server);
            }
            if !server.running() {
                std::thread::sleep(Duration::from_millis(100));
                bail!("{what} exited at start{}", server.stderr_tail());
            }
            if Instant::now() > deadline {
                bail!(
                    "{what} did not accept connections on {} within {within:?}{}",
                    server.addr,
                    server.stderr_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Its process id (the root of its tree).
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The last lines of its stderr, as `: …` text for an error message.
    pub fn stderr_tail(&self) -> String {
        self.stderr.tail()
    }

    /// True while it runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM, up to 20 s for it to exit, then SIGKILL for whatever is
    /// left of its tree.
    pub fn stop(&mut self) {
        let tree = tree_pids(self.pid());
        if self.running() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), nix::sys::signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(20);
            while self.running() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if self.running() {
                eprintln!("semlb bench proxy: {} did not stop on SIGTERM; killing it", self.what);
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
        // Its children, should any have outlived it (they are not ours to
        // reap; a pid reused by an unrelated process within these few
        // milliseconds is not a realistic risk on a benchmark machine).
        for pid in tree.into_iter().filter(|p| *p != self.pid()) {
            if Path::new(&format!("/proc/{pid}")).exists() {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `GET http://addr{path}` on a fresh connection: the status code.
pub fn http_get_status(addr: &str, path: &str) -> Result<u16> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    let _ = s.take(64 * 1024).read_to_string(&mut text);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("no HTTP status from {addr}{path}"))
}

// ---------------------------------------------------------------------------
// The fronts' servers.

/// The simulated engine: which program, with which tokenizer.
#[derive(Debug, Clone)]
pub struct EngineSpec {
    /// `semlb-sim`, or the `semlb` binary (then `__sim` comes first in `args`).
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// What it is, for the output.
    pub description: String,
}

/// A running `semlb serve`; its shm segment is removed when dropped.
pub struct Gateway {
    /// The supervisor (the root of the dispatcher and responder).
    pub server: Server,
    shm: String,
}

impl Gateway {
    /// Starts `semlb serve` with one dispatcher and one responder in front
    /// of `engine` on `cpus`, with `extra` flags (tokenizer, template), and
    /// waits until `/health` answers 200.
    pub fn start(engine: &str, extra: &[String], cpus: &CpuList, interrupt: &Interrupt) -> Result<Gateway> {
        let exe = crate::semlb_exe()?;
        let shm = super::super::end_to_end::unique_name("proxy");
        let args = semlb_test_support::gateway::Gateway::builder()
            .shm_size("64MiB")
            .dispatchers(1)
            .backend(engine)
            .args(extra)
            .serve_args(&shm);
        let server = match Server::start(
            "the gateway (semlb serve)",
            &exe,
            &args,
            cpus,
            Address::Printed,
            Duration::from_secs(60),
            interrupt,
        ) {
            Ok(s) => s,
            Err(e) => {
                let _ = shm_layout::Segment::remove(&shm);
                return Err(e);
            }
        };
        let mut gateway = Gateway { server, shm };
        let deadline = Instant::now() + Duration::from_secs(60);
        while http_get_status(&gateway.server.addr, "/health").ok() != Some(200) {
            interrupt.check()?;
            if !gateway.server.running() {
                bail!("the gateway exited before it was ready{}", gateway.server.stderr_tail());
            }
            if Instant::now() > deadline {
                bail!(
                    "the gateway did not become ready within 60 s{}",
                    gateway.server.stderr_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(gateway)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.server.stop();
        let _ = shm_layout::Segment::remove(&self.shm);
    }
}

/// A private nginx on loopback (see the module docs of
/// [`super`] for its configuration); its directory is removed when dropped.
pub struct Nginx {
    /// The master process (the worker is its child).
    pub server: Server,
    /// Its `nginx.conf`, as written.
    pub config: String,
    /// `nginx -v`'s answer.
    pub version: String,
    dir: PathBuf,
}

/// Why a private nginx did not start.
#[derive(Debug)]
pub enum NginxError {
    /// The binary is not there (its rows are skipped).
    NotInstalled(String),
    /// Anything else.
    Other(anyhow::Error),
}

/// The `nginx.conf` of the benchmark: everything under `dir`, listening on
/// `127.0.0.1:port`, proxying to `engine` over a keep-alive pool.
pub fn nginx_config(dir: &Path, port: u16, engine: &str) -> String {
    let d = dir.display();
    format!(
        "\
# semlb bench proxy: a private nginx on loopback (generated, removed after the run)
daemon off;
master_process on;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;

events {{
    worker_connections 1024;
}}

http {{
    access_log off;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    # Request bodies stay in memory (a 2 000-token prompt is ~9 KB).
    client_body_buffer_size 1m;
    # No connection is closed during a run (the default closes each
    # keep-alive connection after 1 000 requests).
    keepalive_requests 1000000;
    keepalive_timeout 75s;

    upstream engine {{
        server {engine};
        keepalive 64;
        keepalive_requests 1000000;
    }}

    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_buffering off;
        }}
    }}
}}
"
    )
}

impl Nginx {
    /// Starts `binary` master + one worker on `cpus` in front of `engine`.
    pub fn start(binary: &Path, engine: &str, cpus: &CpuList, interrupt: &Interrupt) -> Result<Nginx, NginxError> {
        let version = match Command::new(binary).arg("-v").output() {
            Ok(out) => String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(NginxError::NotInstalled(format!(
                    "{} not found (install Debian's nginx, or pass --nginx PATH)",
                    binary.display()
                )));
            }
            Err(e) => {
                return Err(NginxError::Other(
                    anyhow::Error::new(e).context(format!("cannot run {} -v", binary.display())),
                ));
            }
        };
        let dir = std::env::temp_dir().join(super::super::end_to_end::unique_name("nginx"));
        let started = (|| {
            std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
            let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let config = nginx_config(&dir, port, engine);
            let conf = dir.join("nginx.conf");
            std::fs::write(&conf, &config).with_context(|| format!("cannot write {}", conf.display()))?;
            let d = dir.display().to_string();
            let args = vec![
                "-p".into(),
                format!("{d}/"),
                "-c".into(),
                conf.display().to_string(),
                "-e".into(),
                format!("{d}/error.log"),
            ];
            let server = Server::start(
                "nginx",
                binary,
                &args,
                cpus,
                Address::Known(format!("127.0.0.1:{port}")),
                Duration::from_secs(10),
                interrupt,
            )
            .map_err(|e| {
                let log = std::fs::read_to_string(dir.join("error.log")).unwrap_or_default();
                e.context(format!("nginx's error log: {}", log.trim()))
            })?;
            Ok::<_, anyhow::Error>((server, config))
        })();
        match started {
            Ok((server, config)) => Ok(Nginx {
                server,
                config,
                version,
                dir,
            }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(NginxError::Other(e))
            }
        }
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        self.server.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_print_as_taskset_does() {
        let l: CpuList = "0,2-4, 7".parse().unwrap();
        assert_eq!(l.cpus(), &[0, 2, 3, 4, 7]);
        assert_eq!(l.to_string(), "0,2-4,7");
        assert_eq!("3,1,1".parse::<CpuList>().unwrap().to_string(), "1,3");
        assert_eq!("".parse::<CpuList>(), Err(CpuListError::Empty));
        assert!(matches!("a".parse::<CpuList>(), Err(CpuListError::Syntax(_))));
        assert!(matches!("3-1".parse::<CpuList>(), Err(CpuListError::Syntax(_))));
        assert!(matches!("99999".parse::<CpuList>(), Err(CpuListError::OutOfRange(_))));
        let all: CpuList = "0-3".parse().unwrap();
        assert_eq!(all.without(&"1".parse().unwrap()).to_string(), "0,2-3");
        assert!(CpuList::new(vec![1]).is_subset(&all));
        assert!(!CpuList::new(vec![5]).is_subset(&all));
    }

    #[test]
    fn this_process_has_a_cpu_tree_and_affinity() {
        let me = std::process::id() as i32;
        let cpu = CpuSnapshot::tree(me);
        assert_eq!(tree_pids(me).first(), Some(&me));
        assert!(cpu_between(&cpu, &cpu) == 0.0);
        let spin = Instant::now();
        while spin.elapsed() < Duration::from_millis(50) {
            std::hint::black_box(0);
        }
        let used = cpu_between(&cpu, &CpuSnapshot::of(&[me]));
        assert!(used > 0.02, "{used} s");
        let busy = cpu_busy();
        assert!(!busy.is_empty() && busy.values().all(|b| *b >= 0.0));
        let placement = tree_placement(me);
        assert!(placement.iter().any(|p| p.pid == me && !p.cpus_allowed.is_empty()));
        assert!(!CpuList::of_this_thread().unwrap().cpus().is_empty());
    }

    #[test]
    fn the_nginx_configuration_keeps_connections_and_streams() {
        let c = nginx_config(Path::new("/tmp/x"), 8081, "127.0.0.1:9000");
        for needle in [
            "daemon off;",
            "master_process on;",
            "worker_processes 1;",
            "pid /tmp/x/nginx.pid;",
            "access_log off;",
            "server 127.0.0.1:9000;",
            "keepalive 64;",
            "listen 127.0.0.1:8081;",
            "proxy_http_version 1.1;",
            "proxy_set_header Connection \"\";",
            "proxy_buffering off;",
        ] {
            assert!(c.contains(needle), "{needle:?} missing:\n{c}");
        }
    }
}
