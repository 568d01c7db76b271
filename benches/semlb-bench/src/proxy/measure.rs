//! One point of `semlb bench proxy` (workload × front × concurrency): the
//! load generator run through one front for a warm-up and a measured
//! window, the CPU time of the front, the engine and the load generator
//! read from `/proc` at the window's ends, and the figures derived from
//! them ([`Point`]).

use std::time::{Duration, Instant};

use anyhow::Result;

use super::load::{self, Plan, Tally};
use super::procs::{self, CpuList, CpuSnapshot, Interrupt};
use super::servers::Servers;
use super::workloads::Workload;
use super::{Front, ProxyArgs, WorkloadKind};
use crate::output;

/// One workload × front × concurrency.
pub(super) struct Point {
    pub(super) workload: WorkloadKind,
    pub(super) front: Front,
    pub(super) connections: usize,
    /// The measured window (answers completed in it count), s.
    pub(super) window_s: f64,
    /// Between the two CPU snapshots, s.
    cpu_window_s: f64,
    pub(super) tally: Tally,
    /// CPU seconds in the window: the front's (not for direct), the
    /// engine's, the load generator's (this process).
    pub(super) front_cpu_s: Option<f64>,
    pub(super) engine_cpu_s: f64,
    pub(super) client_cpu_s: f64,
    /// Busy seconds of the front's CPUs and of the others in the window,
    /// whoever used them (this machine may be shared).
    front_busy_s: f64,
    other_busy_s: f64,
    front_cpus: usize,
    other_cpus: usize,
}

impl Point {
    pub(super) fn req_per_s(&self) -> f64 {
        self.tally.ok() as f64 / self.window_s
    }

    pub(super) fn latency(&self, q: f64) -> f64 {
        output::quantile(&self.tally.latency_us, q)
    }

    pub(super) fn per_request_us(&self, cpu_s: f64) -> f64 {
        if self.tally.ok() == 0 {
            f64::NAN
        } else {
            cpu_s * 1e6 / self.tally.ok() as f64
        }
    }

    pub(super) fn front_cpu_us(&self) -> Option<f64> {
        self.front_cpu_s.map(|s| self.per_request_us(s))
    }

    /// The engine's and the load generator's share of the other CPUs.
    pub(super) fn other_util(&self) -> f64 {
        (self.engine_cpu_s + self.client_cpu_s) / self.cpu_window_s / self.other_cpus as f64
    }

    /// The front's share of its CPUs (0 for direct).
    pub(super) fn front_util(&self) -> f64 {
        self.front_cpu_s.unwrap_or(0.0) / self.cpu_window_s / self.front_cpus as f64
    }

    /// The share of the front's CPUs used by processes not in this run.
    pub(super) fn front_foreign(&self) -> f64 {
        (self.front_busy_s / self.cpu_window_s / self.front_cpus as f64 - self.front_util()).max(0.0)
    }

    /// The share of the other CPUs used by processes not in this run.
    pub(super) fn other_foreign(&self) -> f64 {
        (self.other_busy_s / self.cpu_window_s / self.other_cpus as f64 - self.other_util()).max(0.0)
    }
}

/// Waits until `until`, moving the bar on; an error if interrupted.
fn wait_until(
    until: Instant,
    bar: &indicatif::ProgressBar,
    base: u64,
    t0: Instant,
    interrupt: &Interrupt,
) -> Result<()> {
    loop {
        interrupt.check()?;
        let now = Instant::now();
        bar.set_position(base + (now - t0).as_secs());
        if now >= until {
            return Ok(());
        }
        std::thread::sleep((until - now).min(Duration::from_millis(100)));
    }
}

/// One point: `connections` connections of `workload` through `front`
/// for `--warmup` then `--secs` seconds, with the CPU time of every side
/// over the window; `None` when `front` is not running.
#[allow(clippy::too_many_arguments)]
pub(super) fn measure(
    args: &ProxyArgs,
    servers: &Servers,
    workload: &Workload,
    front: Front,
    connections: usize,
    front_cpus: &CpuList,
    other: &CpuList,
    bar: &indicatif::ProgressBar,
    interrupt: &Interrupt,
) -> Result<Option<Point>> {
    let Some(addr) = servers.addr(front) else {
        return Ok(None);
    };
    bar.set_message(format!("{} {} ×{connections}", workload.kind.name(), front.name()));
    let base = bar.position();
    let t0 = Instant::now();
    let from = t0 + Duration::from_secs_f64(args.warmup);
    let until = from + Duration::from_secs_f64(args.secs);
    let plan = Plan {
        addr: addr.to_owned(),
        connections,
        from,
        until,
        stream: args.stream,
    };
    let threads = load::spawn(plan, workload.requests.clone(), other, interrupt.clone());
    let me = std::process::id() as i32;
    let front_pid = servers.front_pid(front);
    let engine_pid = servers.engine.pid();
    let snapshot = || Snapshot {
        at: Instant::now(),
        front: front_pid.map(CpuSnapshot::tree),
        engine: CpuSnapshot::tree(engine_pid),
        client: CpuSnapshot::of(&[me]),
        busy: procs::cpu_busy(),
    };
    let window = wait_until(from, bar, base, t0, interrupt).and_then(|()| {
        let start = snapshot();
        wait_until(until, bar, base, t0, interrupt)?;
        Ok((start, snapshot()))
    });
    // The load threads stop at `until` (or at once when interrupted).
    let mut tally = load::join(threads);
    let (start, end) = window?;
    output::sort(&mut tally.latency_us);
    output::sort(&mut tally.ttft_us);
    bar.set_position(base + (args.warmup + args.secs).ceil() as u64);
    Ok(Some(Point {
        workload: workload.kind,
        front,
        connections,
        window_s: args.secs,
        // The snapshots are taken within a few ms of the window's ends.
        cpu_window_s: (end.at - start.at).as_secs_f64(),
        tally,
        front_cpu_s: start
            .front
            .as_ref()
            .zip(end.front.as_ref())
            .map(|(a, b)| procs::cpu_between(a, b)),
        engine_cpu_s: procs::cpu_between(&start.engine, &end.engine),
        client_cpu_s: procs::cpu_between(&start.client, &end.client),
        front_busy_s: procs::busy_between(&start.busy, &end.busy, front_cpus),
        other_busy_s: procs::busy_between(&start.busy, &end.busy, other),
        front_cpus: front_cpus.cpus().len(),
        other_cpus: other.cpus().len(),
    }))
}

/// What [`measure`] reads at each end of the window.
struct Snapshot {
    at: Instant,
    front: Option<CpuSnapshot>,
    engine: CpuSnapshot,
    client: CpuSnapshot,
    busy: std::collections::BTreeMap<usize, f64>,
}
