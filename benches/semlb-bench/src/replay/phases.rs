//! The figures of the two workloads that break a router at one instant:
//! the `burst` (many new sessions on one new long prefix at once) and
//! `scale-out` (engines added while the load runs).
//!
//! Both need to know which engine answered each request, whatever the
//! front: the answer's id names it ([`Outcome::engine`]).
//!
//! * **burst** ([`BurstStats`]): of the burst's requests (the calls on its
//!   new system prompt), the TTFT, the SLO attainment (errors miss), the
//!   share the busiest engine served and how many engines served any.
//! * **scale-out** ([`ScaleOutStats`]): requests per trace second before
//!   the engines were added (answers that ended before the add) and after
//!   (the rest, to the last answer); of the requests sent after the add,
//!   the share the new engines served; and the trace seconds from the add
//!   to the end of the first window of [`SHARE_WINDOW`] consecutive
//!   requests (in send order) of which the new engines served at least
//!   [`REACH`] of their fair share, (n − 1) / n with n engines in all
//!   (with 4 engines: 3/4 × 0.75 = 56 %). The first engine is the one that
//!   answered most requests before the add; every other one is new.

use std::collections::HashMap;

use super::drive::RunResult;
use super::stats::slo_attainment;
use crate::end_to_end::Outcome;
use crate::workload::Workload;

/// Requests in the sliding window of the scale-out's time to share.
pub(super) const SHARE_WINDOW: usize = 40;

/// The share of their fair share the new engines must reach.
pub(super) const REACH: f64 = 0.75;

/// One answered request: real seconds from the start to when it was sent
/// and to when it ended, and the engine that answered.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Call<'a> {
    sent_s: f64,
    finished_s: f64,
    engine: Option<&'a str>,
}

/// The answered requests of `run`, in the workload's order (`None` for
/// the others).
fn calls(run: &RunResult) -> Vec<Option<Call<'_>>> {
    run.outcomes
        .iter()
        .zip(&run.finished_s)
        .map(|((o, _), finished)| {
            let finished_s = (*finished)?;
            o.ok().then(|| Call {
                sent_s: finished_s - o.latency.as_secs_f64(),
                finished_s,
                engine: o.engine.as_deref().or(o.backend.as_deref()),
            })
        })
        .collect()
}

/// The burst's requests on one run.
#[derive(Debug, Clone, Default)]
pub(super) struct BurstStats {
    /// Requests of the burst in the workload.
    pub(super) requests: usize,
    /// Of those, answered.
    pub(super) answered: usize,
    /// TTFT of the answered ones, trace seconds.
    pub(super) ttft_s: Vec<f64>,
    /// Share of the burst's requests with TTFT within the objective.
    pub(super) attainment: f64,
    /// Share of the answered ones the busiest engine served.
    pub(super) busiest_share: f64,
    /// Engines that served any.
    pub(super) engines: usize,
}

/// The burst's figures on `run` (`None` for a workload without a burst).
pub(super) fn burst_stats(workload: &Workload, run: &RunResult, speedup: f64, slo_s: f64) -> Option<BurstStats> {
    let burst = workload.burst_system?;
    let mine: Vec<usize> = workload
        .requests
        .iter()
        .enumerate()
        .filter(|(_, r)| r.chat.as_ref().is_some_and(|c| c.system == burst))
        .map(|(i, _)| i)
        .collect();
    let outcomes: Vec<(Outcome, u32)> = mine.iter().map(|&i| run.outcomes[i].clone()).collect();
    let answered: Vec<&Outcome> = outcomes.iter().map(|(o, _)| o).filter(|o| o.ok()).collect();
    let mut per_engine: HashMap<&str, usize> = HashMap::new();
    for o in &answered {
        *per_engine
            .entry(o.engine.as_deref().or(o.backend.as_deref()).unwrap_or("?"))
            .or_default() += 1;
    }
    let busiest = per_engine.values().copied().max().unwrap_or(0);
    Some(BurstStats {
        requests: mine.len(),
        answered: answered.len(),
        ttft_s: answered
            .iter()
            .filter_map(|o| o.ttft)
            .map(|t| t.as_secs_f64() * speedup)
            .collect(),
        attainment: slo_attainment(&outcomes, slo_s, speedup),
        busiest_share: if answered.is_empty() {
            0.0
        } else {
            busiest as f64 / answered.len() as f64
        },
        engines: per_engine.len(),
    })
}

/// A scale-out run's figures, in trace time.
#[derive(Debug, Clone, Default)]
pub(super) struct ScaleOutStats {
    /// When the engines were added, trace seconds from the start (`None`:
    /// the run ended first).
    pub(super) at_s: Option<f64>,
    /// Engines added / asked to add.
    pub(super) added: (usize, usize),
    /// The first add that failed: the engine and why.
    pub(super) add_error: Option<String>,
    /// Requests per trace second before the add.
    pub(super) before_req_per_s: f64,
    /// Requests per trace second after it.
    pub(super) after_req_per_s: f64,
    /// Of the requests sent after the add, the share the new engines served.
    pub(super) new_share: Option<f64>,
    /// The new engines' fair share, (n − 1) / n.
    pub(super) fair_share: f64,
    /// Trace seconds from the add until [`SHARE_WINDOW`] consecutive
    /// requests gave the new engines [`REACH`] of their fair share (`None`:
    /// never).
    pub(super) time_to_share_s: Option<f64>,
}

/// Real seconds from `at_s` to the send time of the request that ends the
/// first window of `window` consecutive entries of `calls` (`(sent_s,
/// served by a new engine)`, in send order, all sent after `at_s`) of
/// which at least `share` went to new engines; `None` if no window does.
pub(super) fn time_to_share(calls: &[(f64, bool)], at_s: f64, window: usize, share: f64) -> Option<f64> {
    if window == 0 || calls.len() < window {
        return None;
    }
    let need = (share * window as f64).ceil() as usize;
    let mut new = calls[..window].iter().filter(|(_, n)| *n).count();
    if new >= need {
        return Some(calls[window - 1].0 - at_s);
    }
    for end in window..calls.len() {
        new += usize::from(calls[end].1);
        new -= usize::from(calls[end - window].1);
        if new >= need {
            return Some(calls[end].0 - at_s);
        }
    }
    None
}

/// A scale-out run's figures (`None` for a run without a scale-out):
/// `engines` in all at the end, times × `speedup`.
pub(super) fn scale_out_stats(run: &RunResult, engines: usize, speedup: f64) -> Option<ScaleOutStats> {
    let scale_out = run.scale_out.as_ref()?;
    let added_ok = scale_out
        .added
        .iter()
        .filter(|a| a.answer.as_ref().is_ok_and(|s| (200..300).contains(s)))
        .count();
    let add_error = scale_out.added.iter().find_map(|a| match &a.answer {
        Ok(s) if (200..300).contains(s) => None,
        Ok(s) => Some(format!("{}: HTTP {s}", a.url)),
        Err(e) => Some(format!("{}: {e}", a.url)),
    });
    let fair_share = (engines.saturating_sub(1)) as f64 / engines.max(1) as f64;
    let mut stats = ScaleOutStats {
        added: (added_ok, scale_out.added.len()),
        add_error,
        fair_share,
        ..ScaleOutStats::default()
    };
    let Some(at) = scale_out.at_s else {
        return Some(stats);
    };
    stats.at_s = Some(at * speedup);
    let calls: Vec<Call> = calls(run).into_iter().flatten().collect();
    let before: Vec<&Call> = calls.iter().filter(|c| c.finished_s <= at).collect();
    stats.before_req_per_s = before.len() as f64 / (at * speedup).max(1e-9);
    let after = calls.len() - before.len();
    stats.after_req_per_s = after as f64 / ((run.wall_s - at) * speedup).max(1e-9);
    // The first engine: the one that answered most before the add.
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for c in &before {
        if let Some(e) = c.engine {
            *counts.entry(e).or_default() += 1;
        }
    }
    let Some(first) = counts.into_iter().max_by_key(|(_, n)| *n).map(|(e, _)| e) else {
        return Some(stats);
    };
    let mut later: Vec<(f64, bool)> = calls
        .iter()
        .filter(|c| c.sent_s >= at)
        .map(|c| (c.sent_s, c.engine.is_some_and(|e| e != first)))
        .collect();
    later.sort_by(|a, b| a.0.total_cmp(&b.0));
    if !later.is_empty() {
        stats.new_share = Some(later.iter().filter(|(_, n)| *n).count() as f64 / later.len() as f64);
    }
    stats.time_to_share_s = time_to_share(&later, at, SHARE_WINDOW, REACH * fair_share).map(|s| s * speedup);
    Some(stats)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::replay::drive::{Added, ScaleOut};

    #[test]
    fn the_time_to_share_ends_at_the_first_window_that_reaches_it() {
        // Sent every 0.1 s after an add at 10 s; new engines take every
        // request from the 20th on.
        let calls: Vec<(f64, bool)> = (0..100).map(|i| (10.0 + 0.1 * i as f64, i >= 20)).collect();
        // 56.25 % of a window of 40 is 23 requests: the window ending at
        // request 42 holds 23 new ones (20..=42).
        let t = time_to_share(&calls, 10.0, 40, 0.5625).unwrap();
        assert!((t - 4.2).abs() < 1e-9, "{t}");
        assert_eq!(time_to_share(&calls, 10.0, 40, 0.0), Some(calls[39].0 - 10.0));
        assert_eq!(time_to_share(&calls[..30], 10.0, 40, 0.5), None);
        let never: Vec<(f64, bool)> = (0..100).map(|i| (f64::from(i), i % 3 == 0)).collect();
        assert_eq!(time_to_share(&never, 0.0, 40, 0.5), None);
    }

    /// A run whose request i was sent at `sent[i]` (real s), took 0.5 s and
    /// was answered by `engine[i]`.
    fn run(sent: &[f64], engine: &[&str], at_s: Option<f64>) -> RunResult {
        let outcomes = engine
            .iter()
            .map(|e| {
                (
                    Outcome {
                        status: 200,
                        done: true,
                        ttft: Some(Duration::from_millis(100)),
                        latency: Duration::from_millis(500),
                        engine: Some((*e).to_owned()),
                        ..Outcome::default()
                    },
                    10,
                )
            })
            .collect();
        let finished_s: Vec<Option<f64>> = sent.iter().map(|s| Some(s + 0.5)).collect();
        RunResult {
            outcomes,
            wall_s: finished_s.iter().flatten().copied().fold(0.0, f64::max),
            finished_s,
            engines: Vec::new(),
            gateway: None,
            lag_ms: [0.0; 2],
            command: None,
            scale_out: Some(ScaleOut {
                at_s,
                added: vec![
                    Added {
                        url: "http://b".into(),
                        answer: Ok(201),
                        ms: 1.0,
                    },
                    Added {
                        url: "http://c".into(),
                        answer: Ok(409),
                        ms: 1.0,
                    },
                ],
            }),
        }
    }

    #[test]
    fn scale_out_figures_split_at_the_add() {
        // 20 requests on engine a over 0..10 s, the add at 10 s, then 60
        // requests alternating a, b, c over 10..40 s.
        let mut sent: Vec<f64> = (0..20).map(|i| f64::from(i) * 0.5).collect();
        let mut engine: Vec<&str> = vec!["a"; 20];
        for i in 0..60 {
            sent.push(10.0 + f64::from(i) * 0.5);
            engine.push(["a", "b", "c"][i as usize % 3]);
        }
        let s = scale_out_stats(&run(&sent, &engine, Some(10.0)), 3, 2.0).unwrap();
        assert_eq!(s.at_s, Some(20.0));
        assert_eq!(s.added, (1, 2));
        assert_eq!(s.add_error.as_deref(), Some("http://c: HTTP 409"));
        // The 20 answers before the add all end by 10 s: 20 in 20 trace s.
        assert!((s.before_req_per_s - 1.0).abs() < 1e-9, "{}", s.before_req_per_s);
        assert!((s.fair_share - 2.0 / 3.0).abs() < 1e-12);
        assert!((s.new_share.unwrap() - 2.0 / 3.0).abs() < 1e-9);
        // 2/3 × 0.75 = 50 %: the first window of 40 after the add already
        // has 26 new: it ends with the 40th, sent at 29.5 s, 19.5 real s
        // after the add, 39 trace s.
        assert!((s.time_to_share_s.unwrap() - 39.0).abs() < 1e-9);
        // Without an add, no split.
        let none = scale_out_stats(&run(&sent, &engine, None), 3, 2.0).unwrap();
        assert_eq!((none.at_s, none.new_share), (None, None));
    }
}
