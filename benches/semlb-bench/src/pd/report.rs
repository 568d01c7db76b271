//! What the samples come to ([`Figures`]: TTFT and TPOT quantiles, SLO
//! attainment, goodput, how the gateway served them), the tables the
//! report prints, its plot, and the lines that set each figure beside its
//! target (reported, never asserted).

use std::path::{Path as FsPath, PathBuf};

use anyhow::Result;
use serde_json::{Value, json};

use super::args::{PdArgs, Topology};
use super::run::{CANCELLED, Path, Sample};
use crate::end_to_end::ms;
use crate::output::{self, Table};
use crate::plot::{Line, line_svg};
use crate::sse_client::Answers;

/// The service-level objective: both must hold, in simulated time.
#[derive(Debug, Clone, Copy)]
pub(super) struct Slo {
    /// Most TTFT, ms.
    pub ttft_ms: f64,
    /// Most time per output token, ms.
    pub tpot_ms: f64,
}

impl Slo {
    pub(super) fn of(args: &PdArgs) -> Self {
        Self {
            ttft_ms: args.slo_ttft_ms,
            tpot_ms: args.slo_tpot_ms,
        }
    }

    /// Whether `s` met it (a request with one token has no TPOT to miss).
    fn met(self, s: &Sample) -> bool {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        s.ttft.is_some_and(|t| ms(t) <= self.ttft_ms) && s.tpot.is_none_or(|t| ms(t) <= self.tpot_ms)
    }
}

/// What a set of samples came to (simulated ms).
#[derive(Debug, Clone, Default)]
pub(super) struct Figures {
    /// Requests sent.
    pub sent: usize,
    /// Answered to the end.
    pub answered: usize,
    /// Cut at their deadline.
    pub cancelled: usize,
    /// Failed otherwise.
    pub failed: usize,
    /// TTFT p50 and p90.
    pub ttft_ms: [f64; 2],
    /// TPOT p50 and p90.
    pub tpot_ms: [f64; 2],
    /// Requests that met the SLO.
    pub good: usize,
    /// Answered requests served split, bypassed, by one engine alone.
    pub paths: [usize; 3],
    /// Cached share of the answered requests' prompt tokens (on a decode
    /// engine, pulled tokens count as cached).
    pub cached_share: f64,
    /// The gateway's time before sending to the answering engine, p50
    /// and p90, real µs (`x-semlb-dispatch-ns`).
    pub dispatch_us: [f64; 2],
    /// The first failure's message.
    pub first_error: Option<String>,
}

impl Figures {
    /// The figures of `samples`.
    pub(super) fn of<'a>(samples: impl IntoIterator<Item = &'a Sample>, slo: Slo) -> Self {
        let samples: Vec<&Sample> = samples.into_iter().collect();
        let answers = Answers::of(samples.iter().copied());
        // p50 and p90 of a duration of the samples that have one, in `unit`s a second.
        let quantiles = |of: fn(&Sample) -> Option<std::time::Duration>, unit: f64| {
            let mut v: Vec<f64> = samples
                .iter()
                .filter_map(|s| of(s))
                .map(|d| d.as_secs_f64() * unit)
                .collect();
            output::sort(&mut v);
            [output::quantile(&v, 0.5), output::quantile(&v, 0.9)]
        };
        let count = |p: Path| samples.iter().filter(|s| s.path == Some(p)).count();
        let cancelled = samples.iter().filter(|s| s.error.as_deref() == Some(CANCELLED)).count();
        Figures {
            sent: answers.sent,
            answered: answers.answered(),
            cancelled,
            failed: answers.failed() - cancelled,
            ttft_ms: [answers.ttft_ms(0.5), answers.ttft_ms(0.9)],
            tpot_ms: quantiles(|s| s.tpot, 1e3),
            good: samples.iter().filter(|s| slo.met(s)).count(),
            paths: [count(Path::Split), count(Path::Bypass), count(Path::Alone)],
            cached_share: answers.cached_share(),
            dispatch_us: quantiles(|s| s.dispatch, 1e6),
            first_error: samples.iter().find_map(|s| s.error.clone().filter(|e| e != CANCELLED)),
        }
    }

    /// Share of the sent requests that met the SLO.
    pub(super) fn attainment(&self) -> f64 {
        self.good as f64 / self.sent.max(1) as f64
    }

    /// Share of the answered requests served along `path` (0: split, 1:
    /// bypass, 2: alone).
    fn share(&self, path: usize) -> f64 {
        self.paths[path] as f64 / self.answered.max(1) as f64
    }

    pub(super) fn json(&self) -> Value {
        json!({
            "sent": self.sent,
            "answered": self.answered,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "first_error": self.first_error,
            "ttft_ms": {"p50": self.ttft_ms[0], "p90": self.ttft_ms[1]},
            "tpot_ms": {"p50": self.tpot_ms[0], "p90": self.tpot_ms[1]},
            "slo_met": self.good,
            "slo_attainment": self.attainment(),
            "served": {"split": self.paths[0], "bypass": self.paths[1], "alone": self.paths[2]},
            "cached_share": self.cached_share,
            "gateway_dispatch_us_real": {"p50": self.dispatch_us[0], "p90": self.dispatch_us[1]},
        })
    }
}

/// `v` as a percentage.
fn pct(v: f64) -> String {
    format!("{:.1} %", 100.0 * v)
}

/// One load point of one topology.
#[derive(Debug, Clone)]
pub(super) struct Point {
    /// Offered requests per simulated second.
    pub rate: f64,
    /// Its figures.
    pub figures: Figures,
    /// Requests meeting the SLO per simulated second of arrivals.
    pub goodput: f64,
    /// The gateway's `semlb_pd_requests_total` by path.
    pub pd_paths: Value,
}

/// The sweep of one topology.
#[derive(Debug, Clone)]
pub(super) struct Sweep {
    pub topology: Topology,
    pub points: Vec<Point>,
}

impl Sweep {
    /// The point of highest goodput.
    fn best(&self) -> Option<&Point> {
        self.points.iter().max_by(|a, b| a.goodput.total_cmp(&b.goodput))
    }

    /// The highest offered rate at which at least 90 % met the SLO.
    fn capacity(&self) -> Option<f64> {
        self.points
            .iter()
            .filter(|p| p.figures.attainment() >= 0.9)
            .map(|p| p.rate)
            .max_by(f64::total_cmp)
    }
}

/// The interference table: a row per topology and load point.
pub(super) fn interference_table(args: &PdArgs, sweeps: &[Sweep]) -> Table {
    let mut t = Table::new([
        "topology",
        "offered/s",
        "sent",
        "cut",
        "failed",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "TPOT p50 ms",
        "TPOT p90 ms",
        "SLO att.",
        "goodput/s",
        "split",
        "bypass",
        "gateway µs p90",
    ]);
    for s in sweeps {
        for p in &s.points {
            let f = &p.figures;
            t.row([
                s.topology.label(args.engines),
                format!("{:.1}", p.rate),
                f.sent.to_string(),
                f.cancelled.to_string(),
                f.failed.to_string(),
                ms(f.ttft_ms[0]),
                ms(f.ttft_ms[1]),
                ms(f.tpot_ms[0]),
                ms(f.tpot_ms[1]),
                pct(f.attainment()),
                format!("{:.2}", p.goodput),
                pct(f.share(0)),
                pct(f.share(1)),
                format!("{:.0}", f.dispatch_us[1]),
            ]);
        }
    }
    t
}

/// The summary of the sweep: each topology's best goodput against the
/// aggregated fleet's, and its SLO capacity.
pub(super) fn summary_table(args: &PdArgs, sweeps: &[Sweep]) -> Table {
    let aggregated = sweeps
        .iter()
        .find(|s| s.topology == Topology::Aggregated)
        .and_then(Sweep::best)
        .map(|p| p.goodput);
    let mut t = Table::new([
        "topology",
        "best goodput/s",
        "at offered/s",
        "vs aggregated",
        "highest offered/s with ≥ 90 % in SLO",
    ]);
    for s in sweeps {
        let Some(best) = s.best() else { continue };
        t.row([
            s.topology.label(args.engines),
            format!("{:.2}", best.goodput),
            format!("{:.1}", best.rate),
            aggregated
                .filter(|a| *a > 0.0)
                .map_or("-".into(), |a| format!("{:.2}x", best.goodput / a)),
            s.capacity().map_or("none".into(), |c| format!("{c:.1}")),
        ]);
    }
    t
}

/// The target line of the interference part.
pub(super) fn interference_target(args: &PdArgs, sweeps: &[Sweep]) -> Option<String> {
    let agg = sweeps.iter().find(|s| s.topology == Topology::Aggregated)?.best()?;
    let (topology, best) = sweeps
        .iter()
        .filter(|s| s.topology != Topology::Aggregated)
        .filter_map(|s| Some((s.topology, s.best()?)))
        .max_by(|a, b| a.1.goodput.total_cmp(&b.1.goodput))?;
    let ratio = best.goodput / agg.goodput.max(1e-9);
    Some(format!(
        "target: P/D goodput >= 1.3x aggregated at equal engine count: best P/D {} {:.2}/s against {:.2}/s: {ratio:.2}x ({})",
        topology.label(args.engines),
        best.goodput,
        agg.goodput,
        if ratio >= 1.3 { "met" } else { "missed" }
    ))
}

/// The sweep as JSON.
pub(super) fn sweeps_json(args: &PdArgs, sweeps: &[Sweep]) -> Value {
    let topologies: Vec<Value> = sweeps
        .iter()
        .map(|s| {
            json!({
                "topology": s.topology.to_string(),
                "label": s.topology.label(args.engines),
                "best_goodput_per_s": s.best().map(|p| p.goodput),
                "slo_capacity_per_s": s.capacity(),
                "points": s.points.iter().map(|p| json!({
                    "offered_per_s": p.rate,
                    "goodput_per_s": p.goodput,
                    "figures": p.figures.json(),
                    "gateway_pd_requests_total": p.pd_paths,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "prompt_tokens": args.prompt_tokens.to_string(),
        "output_tokens": args.output_tokens.to_string(),
        "window_secs": args.window_secs,
        "drain_secs": args.drain_secs,
        "topologies": topologies,
    })
}

/// Goodput over offered load, one line per topology, as `<out>/pd.svg`.
pub(super) fn plot(dir: &FsPath, args: &PdArgs, sweeps: &[Sweep]) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("pd.svg");
    let lines: Vec<Line> = sweeps
        .iter()
        .map(|s| Line {
            label: s.topology.label(args.engines),
            points: s.points.iter().map(|p| (p.rate, p.goodput)).collect(),
        })
        .collect();
    line_svg(
        &path,
        &format!(
            "goodput: TTFT <= {} ms and TPOT <= {} ms (simulated)",
            args.slo_ttft_ms, args.slo_tpot_ms
        ),
        "offered requests per simulated second",
        "requests in SLO per simulated second",
        false,
        &lines,
    )?;
    Ok(path)
}

/// One setup of the conversations part and its samples.
#[derive(Debug, Clone)]
pub(super) struct Setup {
    /// Its name in the table.
    pub name: String,
    /// Every turn.
    pub samples: Vec<Sample>,
    /// The gateway's `semlb_pd_requests_total` by path.
    pub pd_paths: Value,
}

impl Setup {
    fn figures(&self, later: bool, slo: Slo) -> Figures {
        Figures::of(self.samples.iter().filter(|s| (s.turn > 0) == later), slo)
    }

    fn later_bypassed(&self, slo: Slo) -> Figures {
        Figures::of(
            self.samples
                .iter()
                .filter(|s| s.turn > 0 && s.path == Some(Path::Bypass)),
            slo,
        )
    }
}

/// The conversations table: first turns and later turns per setup.
pub(super) fn conversations_table(setups: &[Setup], slo: Slo) -> Table {
    let mut t = Table::new([
        "setup",
        "turns",
        "sent",
        "failed",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "TPOT p50 ms",
        "split",
        "bypass",
        "cached share",
        "gateway µs p50",
    ]);
    for s in setups {
        let groups = [
            ("1", s.figures(false, slo)),
            ("≥ 2", s.figures(true, slo)),
            ("all", Figures::of(&s.samples, slo)),
        ];
        for (turns, f) in groups {
            t.row([
                s.name.clone(),
                turns.to_owned(),
                f.sent.to_string(),
                (f.failed + f.cancelled).to_string(),
                ms(f.ttft_ms[0]),
                ms(f.ttft_ms[1]),
                ms(f.tpot_ms[0]),
                pct(f.share(0)),
                pct(f.share(1)),
                pct(f.cached_share),
                format!("{:.0}", f.dispatch_us[0]),
            ]);
        }
    }
    t
}

/// The target lines of the conversations part: `[aggregated, cache-aware
/// P/D, random P/D]`.
pub(super) fn conversations_targets(setups: &[Setup; 3], slo: Slo) -> Vec<String> {
    let [agg, aware, random] = setups;
    let (a, r) = (Figures::of(&aware.samples, slo), Figures::of(&random.samples, slo));
    let (al, rl) = (aware.figures(true, slo), random.figures(true, slo));
    let mut lines = vec![format!(
        "target: cache-aware pairing lowers TTFT p90 against random: all turns {} against {} ms ({}), later turns {} against {} ms; p50 all turns {} against {} ms, later turns {} against {} ms",
        ms(a.ttft_ms[1]),
        ms(r.ttft_ms[1]),
        if a.ttft_ms[1] < r.ttft_ms[1] { "met" } else { "missed" },
        ms(al.ttft_ms[1]),
        ms(rl.ttft_ms[1]),
        ms(a.ttft_ms[0]),
        ms(r.ttft_ms[0]),
        ms(al.ttft_ms[0]),
        ms(rl.ttft_ms[0]),
    )];
    let (g, b) = (agg.figures(true, slo), aware.later_bypassed(slo));
    if b.answered == 0 {
        lines.push(
            "target: bypassed later turns within 10 % of aggregated TTFT: no later turn bypassed prefill (with --pd-protocol sglang none does: an SGLang decode engine has no prefill path)".to_owned(),
        );
        return lines;
    }
    let ratio = |i: usize| b.ttft_ms[i] / g.ttft_ms[i].max(1e-9);
    lines.push(format!(
        "target: bypassed later turns within 10 % of aggregated TTFT: {} bypassed turns of {} later ones, p50 {} against {} ms ({:.2}x), p90 {} against {} ms ({:.2}x) ({})",
        b.answered,
        aware.figures(true, slo).sent,
        ms(b.ttft_ms[0]),
        ms(g.ttft_ms[0]),
        ratio(0),
        ms(b.ttft_ms[1]),
        ms(g.ttft_ms[1]),
        ratio(1),
        if ratio(0) <= 1.1 && ratio(1) <= 1.1 {
            "met"
        } else {
            "missed"
        }
    ));
    lines
}

/// The conversations part as JSON.
pub(super) fn setups_json(setups: &[Setup], slo: Slo) -> Value {
    let mut out = serde_json::Map::new();
    for s in setups {
        out.insert(
            s.name.clone(),
            json!({
                "first_turns": s.figures(false, slo).json(),
                "later_turns": s.figures(true, slo).json(),
                "later_turns_bypassed": s.later_bypassed(slo).json(),
                "all_turns": Figures::of(&s.samples, slo).json(),
                "gateway_pd_requests_total": s.pd_paths,
            }),
        );
    }
    Value::Object(out)
}
