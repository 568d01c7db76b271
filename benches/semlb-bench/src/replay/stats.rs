//! The figures of a replay run: latencies in trace time, SLO attainment,
//! the engines' prefix hits and load imbalance, and the goodput of a rate
//! sweep.

use super::counters::EngineCounters;
use super::drive::RunResult;
use crate::end_to_end::Outcome;

/// Attainment a rate must reach to count towards goodput.
pub(super) const GOODPUT_ATTAINMENT: f64 = 0.9;

/// Population coefficient of variation (std / mean); 0 for fewer than two
/// values or a zero mean.
pub(super) fn coefficient_of_variation(values: &[f64]) -> f64 {
    if values.len() < 2 {
        return 0.0;
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if mean == 0.0 {
        return 0.0;
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    var.sqrt() / mean
}

/// The share of `outcomes` (every request sent; errors are misses) whose
/// TTFT, in trace seconds (real × `speedup`), is at most `slo_s`.
pub(super) fn slo_attainment(outcomes: &[(Outcome, u32)], slo_s: f64, speedup: f64) -> f64 {
    if outcomes.is_empty() {
        return 0.0;
    }
    let met = outcomes
        .iter()
        .filter(|(o, _)| o.ok() && o.ttft.is_some_and(|t| t.as_secs_f64() * speedup <= slo_s))
        .count();
    met as f64 / outcomes.len() as f64
}

/// The highest offered rate among `points` (`(rate, attainment)`) whose
/// attainment reaches [`GOODPUT_ATTAINMENT`]; `None` when none does.
pub(super) fn goodput(points: &[(f64, f64)]) -> Option<f64> {
    points
        .iter()
        .filter(|(_, a)| *a >= GOODPUT_ATTAINMENT)
        .map(|(r, _)| *r)
        .max_by(f64::total_cmp)
}

/// Of the answered requests that follow an answered request of their
/// session, the share that went to the same engine (`None` when no
/// request does). The engine is the one named by the answer's id
/// ([`Outcome::engine`]), else `x-semlb-backend`.
fn same_engine(outcomes: &[(Outcome, u32)], sessions: &[Option<u64>]) -> Option<f64> {
    let mut previous: std::collections::HashMap<u64, &str> = std::collections::HashMap::new();
    let (mut same, mut pairs) = (0usize, 0usize);
    for ((o, _), session) in outcomes.iter().zip(sessions) {
        let engine = o.engine.as_deref().or(o.backend.as_deref());
        let (Some(session), Some(backend), true) = (session, engine, o.ok()) else {
            continue;
        };
        if let Some(before) = previous.insert(*session, backend) {
            pairs += 1;
            same += usize::from(before == backend);
        }
    }
    (pairs > 0).then(|| same as f64 / pairs as f64)
}

/// Σ cached / Σ prompt tokens over the answered requests whose usage was
/// read, with the two sums; `None` without any.
fn reported_cached(outcomes: &[(Outcome, u32)]) -> Option<(f64, u64, u64)> {
    let (prompt, cached) = outcomes
        .iter()
        .filter(|(o, _)| o.ok())
        .filter_map(|(o, _)| o.usage)
        .fold((0, 0), |(p, c), (dp, dc)| (p + dp, c + dc));
    (prompt > 0).then(|| (cached as f64 / prompt as f64, prompt, cached))
}

/// The figures of a [`RunResult`], in trace time.
#[derive(Debug, Default)]
pub(super) struct RunStats {
    pub(super) ok: usize,
    pub(super) errors: usize,
    pub(super) req_per_s: f64,
    pub(super) out_tok_per_s: f64,
    pub(super) ttft_s: Vec<f64>,
    pub(super) latency_s: Vec<f64>,
    pub(super) attainment: f64,
    pub(super) hit_rate: f64,
    pub(super) cv_prefill: f64,
    pub(super) cv_requests: f64,
    /// Of the answered requests of a session after its first, the share
    /// sent to the engine that answered the session's previous request
    /// (`None` without sessions).
    pub(super) same_engine: Option<f64>,
    /// Prompt tokens the engines reported cached / those the routing
    /// predicted they held (`None` when nothing was predicted).
    pub(super) prediction: Option<f64>,
    /// Of the prompt tokens the answered requests' usage reported, the
    /// share it reported cached, with the two sums (`None` when no answer
    /// was read for its usage: only the tool-calling agents are).
    pub(super) reported_cached: Option<(f64, u64, u64)>,
    pub(super) first_error: Option<String>,
}

impl RunStats {
    /// The figures of `run` at `speedup` with a TTFT objective of `slo_s`
    /// trace seconds.
    /// `sessions`: each request's session, in the outcomes' order.
    pub(super) fn of(run: &RunResult, sessions: &[Option<u64>], speedup: f64, slo_s: f64) -> Self {
        let ok: Vec<&(Outcome, u32)> = run.outcomes.iter().filter(|(o, _)| o.ok()).collect();
        let trace_s = run.wall_s * speedup;
        let (hits, queries) = run
            .engines
            .iter()
            .fold((0.0, 0.0), |(h, q), e| (h + e.hits, q + e.queries));
        Self {
            ok: ok.len(),
            errors: run.outcomes.len() - ok.len(),
            req_per_s: ok.len() as f64 / trace_s.max(1e-9),
            out_tok_per_s: ok.iter().map(|(_, n)| f64::from(*n)).sum::<f64>() / trace_s.max(1e-9),
            ttft_s: ok
                .iter()
                .filter_map(|(o, _)| o.ttft)
                .map(|d| d.as_secs_f64() * speedup)
                .collect(),
            latency_s: ok.iter().map(|(o, _)| o.latency.as_secs_f64() * speedup).collect(),
            attainment: slo_attainment(&run.outcomes, slo_s, speedup),
            hit_rate: if queries > 0.0 { hits / queries } else { 0.0 },
            cv_prefill: coefficient_of_variation(&run.engines.iter().map(EngineCounters::uncached).collect::<Vec<_>>()),
            cv_requests: coefficient_of_variation(&run.engines.iter().map(|e| e.requests).collect::<Vec<_>>()),
            same_engine: same_engine(&run.outcomes, sessions),
            prediction: run.gateway.as_ref().and_then(|g| g.accuracy()),
            reported_cached: reported_cached(&run.outcomes),
            first_error: run.outcomes.iter().find_map(|(o, _)| o.error.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn coefficient_of_variation_is_std_over_mean() {
        assert_eq!(coefficient_of_variation(&[5.0, 5.0, 5.0]), 0.0);
        assert!((coefficient_of_variation(&[1.0, 3.0]) - 0.5).abs() < 1e-12);
        assert!((coefficient_of_variation(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]) - 0.4).abs() < 1e-12);
        assert_eq!(coefficient_of_variation(&[3.0]), 0.0);
        assert_eq!(coefficient_of_variation(&[0.0, 0.0]), 0.0);
    }

    #[test]
    fn attainment_counts_errors_as_misses_in_trace_time() {
        let ok = |ms: u64| Outcome {
            status: 200,
            done: true,
            ttft: Some(Duration::from_millis(ms)),
            ..Outcome::default()
        };
        let failed = Outcome {
            error: Some("HTTP 503".into()),
            ..Outcome::default()
        };
        let outcomes = [(ok(40), 1), (ok(60), 1), (ok(50), 1), (failed, 0)];
        // At speedup 20, 50 ms real is 1 trace second.
        assert_eq!(slo_attainment(&outcomes, 1.0, 20.0), 0.5);
        assert_eq!(slo_attainment(&outcomes, 2.0, 20.0), 0.75);
        assert_eq!(slo_attainment(&[], 2.0, 20.0), 0.0);
    }

    #[test]
    fn same_engine_follows_each_session_in_order() {
        let on = |backend: &str| {
            (
                Outcome {
                    status: 200,
                    done: true,
                    backend: Some(backend.into()),
                    ..Outcome::default()
                },
                1,
            )
        };
        let outcomes = [on("a"), on("b"), on("a"), on("b"), on("c"), on("x")];
        let sessions = [Some(1), Some(2), Some(1), Some(2), Some(1), None];
        // Session 1: a, a, c (1 of 2 stayed); session 2: b, b (1 of 1).
        assert_eq!(same_engine(&outcomes, &sessions), Some(2.0 / 3.0));
        assert_eq!(same_engine(&outcomes[..2], &sessions[..2]), None);
    }

    #[test]
    fn reported_cached_tokens_sum_over_the_answered() {
        let with = |usage, status| {
            (
                Outcome {
                    status,
                    done: true,
                    usage,
                    ..Outcome::default()
                },
                1,
            )
        };
        let outcomes = [
            with(Some((100, 50)), 200),
            with(Some((300, 250)), 200),
            with(None, 200),
            with(Some((1000, 0)), 500),
        ];
        assert_eq!(reported_cached(&outcomes), Some((0.75, 400, 300)));
        assert_eq!(reported_cached(&outcomes[2..]), None);
    }

    #[test]
    fn goodput_is_the_highest_rate_meeting_the_objective() {
        assert_eq!(goodput(&[(1.0, 0.99), (2.0, 0.95), (3.0, 0.5)]), Some(2.0));
        assert_eq!(goodput(&[(2.0, 0.9), (1.0, 1.0)]), Some(2.0));
        assert_eq!(goodput(&[(1.0, 0.89)]), None);
        assert_eq!(goodput(&[]), None);
    }
}
