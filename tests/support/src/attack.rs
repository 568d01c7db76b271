//! The figures of an attack on a running gateway (issue 39): what a
//! well-behaved client got while it lasted (share answered, p50 and p99),
//! how many of the gateway's processes restarted, and the peak resident
//! memory of each. Tests assert the properties (every polite request
//! answered but 1 %, no restart, memory under a bound) and print the rest
//! for the report: latencies are measured, never asserted.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::gateway::{Gateway, chat, samples, user};

/// A well-behaved client during an attack: how many requests it asked, and
/// the latencies of those answered 200.
#[derive(Default)]
pub struct Polite {
    asked: usize,
    latencies: Vec<Duration>,
    headers: Vec<(String, String)>,
}

impl Polite {
    /// A polite client that sends `headers` (its key) with every request.
    pub fn with_headers(headers: &[(&str, &str)]) -> Polite {
        Polite {
            headers: headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Polite::default()
        }
    }

    /// Asks one chat question with `extra` fields; its status.
    pub fn ask(&mut self, gw: &Gateway, extra: Value) -> u16 {
        self.ask_at(gw.addr(), extra)
    }

    /// [`Self::ask`] of the gateway at `addr` (from a thread the
    /// [`Gateway`] cannot be shared with).
    pub fn ask_at(&mut self, addr: &str, extra: Value) -> u16 {
        let headers: Vec<(&str, &str)> = self.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let t = Instant::now();
        let r = chat(
            addr,
            &[user(&format!("a polite question number {}", self.asked))],
            extra,
            &headers,
        );
        self.asked += 1;
        if r.status == 200 {
            self.latencies.push(t.elapsed());
        }
        r.status
    }

    /// Asks one question that must be answered 200.
    pub fn served(&mut self, gw: &Gateway) {
        let status = self.ask(gw, serde_json::json!({}));
        assert_eq!(status, 200, "polite request {}", self.asked);
    }

    /// Asks questions with `extra` fields until `secs` have passed.
    pub fn ask_for(&mut self, gw: &Gateway, secs: f64, extra: Value) {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs_f64(secs) {
            self.ask(gw, extra.clone());
        }
    }

    /// How many were asked.
    pub fn asked(&self) -> usize {
        self.asked
    }

    /// How many were answered 200.
    pub fn answered(&self) -> usize {
        self.latencies.len()
    }

    /// Asserts the bar: at least one asked, and at least 99 % of
    /// them answered.
    pub fn assert_served(&self, attack: &str) {
        assert!(self.asked > 0, "{attack}: no polite request was asked");
        assert!(
            self.answered() * 100 >= self.asked * 99,
            "{attack}: {} of {} polite requests answered",
            self.answered(),
            self.asked
        );
    }

    /// The `p` quantile (0 to 1) of the answered requests' latencies.
    pub fn quantile(&self, p: f64) -> Duration {
        let mut l = self.latencies.clone();
        l.sort();
        l.get(((l.len() as f64 * p).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or_default()
    }

    /// Prints the attack's figures for the report (measured, not asserted).
    pub fn report(&self, attack: &str, gw: &Gateway) {
        eprintln!(
            "ATTACK {attack}: polite {}/{} answered, p50 {:?}, p99 {:?}, restarts {}, peak RSS KiB {}",
            self.answered(),
            self.asked,
            self.quantile(0.5),
            self.quantile(0.99),
            restarts(gw),
            peaks_kib(gw)
                .iter()
                .map(|(role, kib)| format!("{role} {kib}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}

/// The gateway's restarts, all roles (`semlb_process_restarts_total`).
pub fn restarts(gw: &Gateway) -> f64 {
    samples(&gw.metrics(), "semlb_process_restarts_total")
        .into_iter()
        .map(|(_, v)| v)
        .sum()
}

/// The peak resident memory (`VmHWM`, KiB) of each of the gateway's
/// running processes, with its role: the supervisor, the dispatchers, the
/// response processes.
pub fn peaks_kib(gw: &Gateway) -> Vec<(&'static str, u64)> {
    gw.segment
        .tables()
        .registry
        .processes()
        .filter(|p| p.state == shm_layout::ProcessState::Running)
        .filter_map(|p| Some((p.role?.name(), peak_kib(p.pid)?)))
        .collect()
}

/// The peak resident memory of the gateway's running processes of `role`.
pub fn peaks_of(gw: &Gateway, role: shm_layout::Role) -> Vec<u64> {
    peaks_kib(gw)
        .into_iter()
        .filter(|(r, _)| *r == role.name())
        .map(|(_, kib)| kib)
        .collect()
}

/// The peak resident memory (`VmHWM`) of process `pid`, KiB.
pub fn peak_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
