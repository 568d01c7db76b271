//! The figures of a run: per phase, completed requests per second and the
//! TTFT, latency and dispatch-time distributions ([`PhaseStats`]), per
//! store both phases ([`StoreRun`]); and the quantile and millisecond
//! helpers the replay report uses too.

use serde_json::{Value, json};

use super::client::Outcome;
use super::load::PhaseRun;
use crate::output;

/// The figures of one phase.
#[derive(Debug, Clone, Default)]
pub(super) struct PhaseStats {
    pub(super) sent: usize,
    pub(super) ok: usize,
    pub(super) errors: usize,
    pub(super) req_per_s: f64,
    pub(super) ttft_ms: Vec<f64>,
    pub(super) latency_ms: Vec<f64>,
    pub(super) dispatch_us: Vec<f64>,
    /// Response-cache lookup + prefix match and policy (µs).
    pub(super) store_us: Vec<f64>,
    pub(super) first_error: Option<String>,
}

impl PhaseStats {
    pub(super) fn of(run: &PhaseRun) -> Self {
        let ok: Vec<&Outcome> = run.outcomes.iter().filter(|o| o.ok()).collect();
        let stage = |i: usize| -> Vec<f64> {
            ok.iter()
                .filter_map(|o| o.dispatch)
                .map(|d| d[i] as f64 / 1e3)
                .collect()
        };
        Self {
            sent: run.sent,
            ok: ok.len(),
            errors: run.sent - ok.len(),
            req_per_s: ok.len() as f64 / run.wall.as_secs_f64().max(1e-9),
            ttft_ms: ok
                .iter()
                .filter_map(|o| o.ttft)
                .map(|d| d.as_secs_f64() * 1e3)
                .collect(),
            latency_ms: ok.iter().map(|o| o.latency.as_secs_f64() * 1e3).collect(),
            dispatch_us: stage(6),
            store_us: ok
                .iter()
                .filter_map(|o| o.dispatch)
                .map(|d| (d[4] + d[5]) as f64 / 1e3)
                .collect(),
            first_error: run.outcomes.iter().find_map(|o| o.error.clone()),
        }
    }

    /// The table figures, in the table's column order after the store column.
    pub(super) fn figures(&self) -> Vec<f64> {
        let t = p50_90_99(&self.ttft_ms);
        let l = p50_90_99(&self.latency_ms);
        let d = p50_90_99(&self.dispatch_us);
        let s = p50_90_99(&self.store_us);
        vec![
            self.req_per_s,
            t[0],
            t[1],
            t[2],
            l[0],
            l[1],
            l[2],
            d[0],
            d[2],
            s[0],
            self.errors as f64,
        ]
    }

    pub(super) fn json(&self) -> Value {
        let q = |v: &[f64]| {
            let [p50, p90, p99] = p50_90_99(v);
            json!({"p50": p50, "p90": p90, "p99": p99})
        };
        json!({
            "sent": self.sent,
            "completed": self.ok,
            "errors": self.errors,
            "first_error": self.first_error,
            "requests_per_s": self.req_per_s,
            "ttft_ms": q(&self.ttft_ms),
            "latency_ms": q(&self.latency_ms),
            "dispatch_total_us": q(&self.dispatch_us),
            "dispatch_cache_route_us": q(&self.store_us),
        })
    }
}

/// Both phases on one store.
pub(super) struct StoreRun {
    pub(super) name: &'static str,
    pub(super) fixed: PhaseStats,
    pub(super) saturation: Option<PhaseStats>,
}

/// Values at p50, p90, p99 of `values` (in their unit).
pub(crate) fn p50_90_99(values: &[f64]) -> [f64; 3] {
    let mut v = values.to_vec();
    output::sort(&mut v);
    [0.5, 0.9, 0.99].map(|q| output::quantile(&v, q))
}

/// `ms` milliseconds as table text.
pub(crate) fn ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}
