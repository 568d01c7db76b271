//! The parent's side of one point of `semlb bench scaling`: its worker
//! processes started (this binary again, `__bench-worker`), told to go
//! once all are ready, and their reports read; the pipes are the barrier.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{Context, Result, anyhow, bail};

use super::{ScalingArgs, Store, WorkerReport, parse_report};

/// Temporary file removed when dropped.
pub(super) struct TempFile(pub(super) PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Running workers, killed if still running when dropped (on errors).
struct Workers {
    children: Vec<Child>,
    stdins: Vec<ChildStdin>,
    stdouts: Vec<BufReader<ChildStdout>>,
}

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.children {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

impl Workers {
    /// The stderr of worker `i`, after it exited (for error messages).
    fn stderr_of(&mut self, i: usize) -> String {
        let c = &mut self.children[i];
        if matches!(c.try_wait(), Ok(None)) {
            let _ = c.kill();
        }
        let _ = c.wait();
        let mut s = String::new();
        if let Some(e) = c.stderr.as_mut() {
            let _ = e.read_to_string(&mut s);
        }
        s.trim().to_owned()
    }

    /// Reads worker `i`'s next stdout line.
    fn line(&mut self, i: usize, what: &str) -> Result<String> {
        let mut line = String::new();
        let n = self.stdouts[i]
            .read_line(&mut line)
            .with_context(|| format!("worker {i}: reading {what}"))?;
        if n == 0 {
            let err = self.stderr_of(i);
            bail!(
                "worker {i} exited before {what}: {}",
                if err.is_empty() { "no message" } else { &err }
            );
        }
        Ok(line)
    }
}

/// Where the workers of a point find their store.
pub(super) struct Target<'a> {
    /// The shm segment's name.
    pub(super) shm_name: &'a str,
    /// The Redis URL and namespace (`None`: no Redis).
    pub(super) redis: Option<(&'a str, &'a str)>,
}

/// Runs one point: `procs` workers on `store` for `secs`; their reports.
fn run_point(store: Store, procs: usize, secs: f64, chains: &Path, target: &Target<'_>) -> Result<Vec<WorkerReport>> {
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let mut workers = Workers {
        children: Vec::new(),
        stdins: Vec::new(),
        stdouts: Vec::new(),
    };
    for i in 0..procs {
        let mut cmd = Command::new(&exe);
        cmd.arg("__bench-worker")
            .args(["--store", store.name()])
            .arg("--chains")
            .arg(chains)
            .args(["--secs", &secs.to_string()])
            .args(["--worker", &i.to_string(), "--workers", &procs.to_string()]);
        match store {
            Store::Shm => {
                cmd.args(["--shm-name", target.shm_name]);
            }
            Store::Redis1rt | Store::RedisNaive => {
                let (url, ns) = target.redis.ok_or_else(|| anyhow!("no Redis for {}", store.name()))?;
                cmd.args(["--redis-url", url, "--namespace", ns]);
            }
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {} __bench-worker", exe.display()))?;
        workers.stdins.push(child.stdin.take().context("worker stdin")?);
        workers
            .stdouts
            .push(BufReader::new(child.stdout.take().context("worker stdout")?));
        workers.children.push(child);
    }
    for i in 0..procs {
        let line = workers.line(i, "ready")?;
        if line.trim() != "ready" {
            bail!("worker {i} said {:?} instead of ready", line.trim());
        }
    }
    for (i, stdin) in workers.stdins.iter_mut().enumerate() {
        stdin
            .write_all(b"go\n")
            .and_then(|()| stdin.flush())
            .with_context(|| format!("cannot start worker {i}"))?;
    }
    let mut reports = Vec::with_capacity(procs);
    for i in 0..procs {
        let line = workers.line(i, "its report")?;
        reports.push(parse_report(&line)?);
    }
    for i in 0..procs {
        let status = workers.children[i].wait()?;
        if !status.success() {
            let err = workers.stderr_of(i);
            bail!("worker {i} exited with {status}: {err}");
        }
    }
    Ok(reports)
}

/// Every point, store by store and process count by process count: the
/// store, the count and its workers' reports.
pub(super) fn run_points(
    args: &ScalingArgs,
    stores: &[Store],
    chains: &Path,
    target: &Target<'_>,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<(Store, usize, Vec<WorkerReport>)>> {
    let mut results: Vec<(Store, usize, Vec<WorkerReport>)> = Vec::new();
    for &store in stores {
        for &procs in &args.processes {
            bar.set_message(format!("scaling: {} ×{procs}", store.name()));
            let reports = run_point(store, procs, args.secs, chains, target)
                .with_context(|| format!("{} with {procs} processes", store.name()))?;
            results.push((store, procs, reports));
            bar.inc(1);
        }
    }
    Ok(results)
}
