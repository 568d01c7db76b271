//! What `semlb bench replay` reports: a table per workload (and engine
//! set), the summary of every policy against `least_load`, the JSON, and
//! the plots.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use serde_json::{Value, json};

use super::chat_set::ChatSet;
use super::drive::RunResult;
use super::stats::{GOODPUT_ATTAINMENT, RunStats, goodput};
use super::{Arm, ReplayArgs, Setting};
use crate::end_to_end::{ms, p50_90_99};
use crate::output::{self, Table};
use crate::plot::{self, Line, Panel, Series};
use crate::workload::{MAX_MODEL_LEN, Workload, WorkloadKind, engine_prefill_tokens_per_s};

/// Below this share of `least_load`'s throughput a policy is flagged in
/// the summary: the bar for a policy that is safe to pick.
pub(super) const SAFE_SHARE: f64 = 0.9;

/// One run of a sweep.
pub(super) struct Point {
    /// Its rate multiplier.
    pub(super) multiplier: f64,
    /// Requests per trace second offered (`None` for a closed loop, which
    /// has no offered rate).
    pub(super) offered: Option<f64>,
    /// What was measured.
    pub(super) run: RunResult,
    /// Its figures.
    pub(super) stats: RunStats,
}

/// One policy on one workload: its sweep.
pub(super) struct PolicyReport {
    /// The row.
    pub(super) arm: Arm,
    /// In multiplier order.
    pub(super) points: Vec<Point>,
    /// Multipliers the search did not need.
    pub(super) not_run: Vec<f64>,
}

impl PolicyReport {
    /// The m = 1 run.
    fn base(&self) -> &Point {
        self.points
            .iter()
            .find(|p| p.multiplier == 1.0)
            .unwrap_or(&self.points[0])
    }

    /// The highest offered rate with enough attainment (`None` below the
    /// lowest, and for a closed loop, which has no offered rate).
    fn goodput(&self) -> Option<f64> {
        goodput(
            &self
                .points
                .iter()
                .filter_map(|p| Some((p.offered?, p.stats.attainment)))
                .collect::<Vec<_>>(),
        )
    }
}

/// A report's name: the workload's, with the engine set it ran on:
/// `chat/no-metrics-plain`.
pub(super) fn report_name(kind: WorkloadKind, set: Option<ChatSet>) -> String {
    match set {
        Some(set) => format!("{kind}/{set}"),
        None => kind.to_string(),
    }
}

/// One workload's results.
pub(super) struct WorkloadReport {
    /// The workload.
    pub(super) workload: Arc<Workload>,
    /// The engine set a `chat` workload ran on.
    pub(super) set: Option<ChatSet>,
    /// How it was run.
    pub(super) setting: Setting,
    /// The gateway configuration every run got (before the row's own).
    pub(super) config: String,
    /// One per row.
    pub(super) policies: Vec<PolicyReport>,
}

impl WorkloadReport {
    /// The workload's name, with its engine set ([`report_name`]).
    fn name(&self) -> String {
        report_name(self.workload.kind, self.set)
    }

    /// What each row's throughput is judged by: requests per second for a
    /// closed loop, else the goodput (0 below the sweep's lowest rate).
    fn throughput(&self, p: &PolicyReport) -> f64 {
        if self.workload.kind.closed_loop() {
            p.base().stats.req_per_s
        } else {
            p.goodput().unwrap_or(0.0)
        }
    }
}

/// `m` as a multiplier label: `×1.5`.
fn times(m: f64) -> String {
    format!("×{m}")
}

/// Prints `report`'s table and notes.
pub(super) fn print_report(args: &ReplayArgs, report: &WorkloadReport, multipliers: &[f64]) {
    let w = &report.workload;
    let lowest = multipliers[0] * w.offered_rate();
    let mut table = Table::new([
        "policy",
        "req/s",
        "TTFT p50 s",
        "p90",
        "p99",
        "SLO att.",
        "goodput req/s",
        "attainment by rate",
        "prefix hit rate",
        "prefill CV",
        "requests CV",
        "same engine",
        "prediction",
        "errors",
    ]);
    for p in &report.policies {
        let base = p.base();
        let s = &base.stats;
        let t = p50_90_99(&s.ttft_s);
        table.row([
            p.arm.label.clone(),
            format!("{:.2}", s.req_per_s),
            ms(t[0]),
            ms(t[1]),
            ms(t[2]),
            format!("{:.1}%", s.attainment * 100.0),
            match p.goodput() {
                _ if w.kind.closed_loop() => "closed loop".to_owned(),
                Some(g) => format!("{g:.2}"),
                None => format!("< {lowest:.2}"),
            },
            p.points
                .iter()
                .map(|q| format!("{}:{:.0}%", times(q.multiplier), q.stats.attainment * 100.0))
                .collect::<Vec<_>>()
                .join(" "),
            format!("{:.1}%", s.hit_rate * 100.0),
            format!("{:.3}", s.cv_prefill),
            format!("{:.3}", s.cv_requests),
            s.same_engine
                .map_or_else(|| "-".to_owned(), |f| format!("{:.1}%", f * 100.0)),
            s.prediction
                .map_or_else(|| "-".to_owned(), |f| format!("{:.1}%", f * 100.0)),
            s.errors.to_string(),
        ]);
    }
    let capacity = engine_prefill_tokens_per_s() * args.engines as f64;
    let title = match report.set {
        Some(set) => format!(
            "semlb bench replay, {}: {} requests from {}, sent by {} clients each sending its next request the \
             instant its answer ends (a closed loop: no offered rate, req/s is the throughput); {}; {} engines; \
             speedup {}x (times in trace seconds); TTFT SLO {} s",
            report.name(),
            w.requests.len(),
            w.source,
            args.chat_clients,
            set.describe(),
            args.engines,
            report.setting.speedup,
            report.setting.ttft_slo_s,
        ),
        None => format!(
            "semlb bench replay, {}: {} requests over {:.0} s ({:.2} req/s, {:.0} prompt tokens/s = {:.0} % of {} engines' \
         prefill without reuse) from {}; speedup {}x (times in trace seconds); TTFT SLO {} s; sweep {}{}",
            w.kind,
            w.requests.len(),
            w.span_s(),
            w.offered_rate(),
            w.offered_prompt_tokens_per_s(),
            100.0 * w.offered_prompt_tokens_per_s() / capacity,
            args.engines,
            w.source,
            report.setting.speedup,
            report.setting.ttft_slo_s,
            multipliers.iter().map(|m| times(*m)).collect::<Vec<_>>().join(","),
            if w.truncated > 0 {
                format!("; {} prompts truncated to fit {MAX_MODEL_LEN} tokens", w.truncated)
            } else {
                String::new()
            }
        ),
    };
    output::print_table(&title, &table);
    println!(
        "req/s, TTFT, SLO attainment, prefix hit rate and CVs from the ×1 run. SLO att.: share of all requests with \
         TTFT <= {} s (errors miss); goodput: highest offered rate (req/s) with >= {:.0}% attainment; prefix hit \
         rate: Σ hits / Σ queries (tokens) over the engines; prefill CV: coefficient of variation across engines of \
         uncached prompt tokens (prefill busy time); requests CV: of requests served; same engine: of the answered requests following an answered request of their session, the share sent to the same engine; prediction: of the prompt tokens the routing predicted the chosen engine held, the share it reported cached.",
        report.setting.ttft_slo_s,
        GOODPUT_ATTAINMENT * 100.0
    );
    for p in &report.policies {
        for q in &p.points {
            let at = format!("{} {}", p.arm.label, times(q.multiplier));
            if let Some(e) = &q.stats.first_error {
                println!("{at}: {} errors, first: {e}", q.stats.errors);
            }
            if q.run.lag_ms[0] > 50.0 {
                println!(
                    "{at}: the load generator fell behind its schedule (p99 {:.0} ms, max {:.0} ms real): \
                     this machine, not only the engines, limited the run",
                    q.run.lag_ms[0], q.run.lag_ms[1]
                );
            }
        }
    }
}

/// The JSON of `report`.
pub(super) fn report_json(report: &WorkloadReport, multipliers: &[f64]) -> Value {
    let w = &report.workload;
    let open_loop = !w.kind.closed_loop();
    let policies: Vec<Value> = report
        .policies
        .iter()
        .map(|p| {
            let runs: Vec<Value> = p
                .points
                .iter()
                .map(|q| {
                    let s = &q.stats;
                    let t = p50_90_99(&s.ttft_s);
                    let l = p50_90_99(&s.latency_s);
                    json!({
                        "multiplier": q.multiplier,
                        "offered_requests_per_s": q.offered,
                        "slo_attainment": s.attainment,
                        "completed": s.ok,
                        "errors": s.errors,
                        "first_error": s.first_error,
                        "requests_per_s": s.req_per_s,
                        "output_tokens_per_s": s.out_tok_per_s,
                        "ttft_s": {"p50": t[0], "p90": t[1], "p99": t[2]},
                        "latency_s": {"p50": l[0], "p90": l[1], "p99": l[2]},
                        "prefix_cache_hit_rate": s.hit_rate,
                        "imbalance_cv_prefill_busy": s.cv_prefill,
                        "imbalance_cv_requests": s.cv_requests,
                        "same_engine_share": s.same_engine,
                        "prediction_accuracy": s.prediction,
                        "gateway": {
                            "records": q.run.gateway.records,
                            "predicted_tokens": q.run.gateway.predicted,
                            "confirmed_tokens": q.run.gateway.confirmed,
                            "shortfalls": q.run.gateway.shortfalls,
                            "demotions": q.run.gateway.demotions,
                            "servers_forgotten": q.run.gateway.forgotten,
                        },
                        "wall_s": q.run.wall_s,
                        "generator_lag_ms": {"p99": q.run.lag_ms[0], "max": q.run.lag_ms[1]},
                        "engines": q.run.engines.iter().map(|e| json!({
                            "requests": e.requests,
                            "prompt_tokens": e.prompt_tokens,
                            "prefix_cache_hits": e.hits,
                            "prefix_cache_queries": e.queries,
                            "uncached_prompt_tokens": e.uncached(),
                            "generation_tokens": e.generation_tokens,
                        })).collect::<Vec<Value>>(),
                    })
                })
                .collect();
            let goodput = p.goodput();
            let closed = w.kind.closed_loop();
            json!({
                "policy": p.arm.label,
                "kind": p.arm.kind.name(),
                "goodput_requests_per_s": if closed { None } else { Some(goodput.unwrap_or(0.0)) },
                "goodput_below_lowest_rate": !closed && goodput.is_none(),
                "throughput_vs_least_load": report.relative(p),
                "not_run": p.not_run,
                "runs": runs,
            })
        })
        .collect();
    json!({
        "workload": w.kind.name(),
        "engine_set": report.set.map(|s| json!({
            "name": s.name(),
            "engines_metrics": s.metrics(),
            "clients_stream": s.stream(),
        })),
        "closed_loop": w.kind.closed_loop(),
        "source": w.source,
        "requests": w.requests.len(),
        "sessions": w.has_sessions(),
        "span_s": open_loop.then(|| w.span_s()),
        "offered_requests_per_s": open_loop.then(|| w.offered_rate()),
        "offered_prompt_tokens_per_s": open_loop.then(|| w.offered_prompt_tokens_per_s()),
        "truncated_prompts": w.truncated,
        "speedup": report.setting.speedup,
        "engine_time_scale": 1.0 / report.setting.speedup,
        "ttft_slo_s": report.setting.ttft_slo_s,
        "sweep": multipliers,
        "gateway_config": report.config,
        "policies": policies,
    })
}

/// Writes `<out>/replay.svg` and one attainment chart per workload; returns
/// the paths.
pub(super) fn write_plots(args: &ReplayArgs, reports: &[WorkloadReport]) -> Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    let svg = args.common.out.join("replay.svg");
    let panels: Vec<Panel> = reports
        .iter()
        .map(|r| Panel {
            title: format!("{}: TTFT per routing policy (×1)", r.name()),
            x_label: "seconds (trace time)".into(),
            log_x: true,
            series: r
                .policies
                .iter()
                .map(|p| Series {
                    label: p.arm.label.clone(),
                    values: p.base().stats.ttft_s.clone(),
                })
                .collect(),
        })
        .collect();
    plot::cdf_svg(&svg, &panels)?;
    paths.push(svg);
    for r in reports.iter().filter(|r| !r.workload.kind.closed_loop()) {
        let path = args.common.out.join(format!("replay-{}-slo.svg", r.workload.kind));
        let lines: Vec<Line> = r
            .policies
            .iter()
            .map(|p| Line {
                label: p.arm.label.clone(),
                points: p
                    .points
                    .iter()
                    .filter_map(|q| Some((q.offered?, q.stats.attainment * 100.0)))
                    .collect(),
            })
            .collect();
        plot::line_svg(
            &path,
            &format!(
                "{}: share of requests with TTFT <= {} s",
                r.workload.kind, r.setting.ttft_slo_s
            ),
            "offered requests per trace second",
            "SLO attainment %",
            false,
            &lines,
        )?;
        paths.push(path);
    }
    Ok(paths)
}

impl WorkloadReport {
    /// `p`'s throughput over `least_load`'s on this workload (`None`
    /// without a `least_load` row, or when it served nothing).
    fn relative(&self, p: &PolicyReport) -> Option<f64> {
        let least_load = self.policies.iter().find(|q| q.arm.label == "least_load")?;
        let base = self.throughput(least_load);
        (base > 0.0).then(|| self.throughput(p) / base)
    }
}

/// Prints the summary: per workload, every row's throughput (req/s of a
/// closed loop, else goodput) as a share of `least_load`'s, the best
/// marked `*` and those under [`SAFE_SHARE`] marked `!`.
pub(super) fn print_summary(reports: &[WorkloadReport]) {
    let Some(first) = reports.first() else { return };
    let labels: Vec<&str> = first.policies.iter().map(|p| p.arm.label.as_str()).collect();
    let mut table = Table::new(std::iter::once("workload").chain(labels.iter().copied()));
    for r in reports {
        let best = r.policies.iter().map(|p| r.throughput(p)).fold(0.0, f64::max);
        let cells = labels.iter().map(|label| {
            let Some(p) = r.policies.iter().find(|p| p.arm.label == *label) else {
                return "-".to_owned();
            };
            let mark = if best > 0.0 && r.throughput(p) >= best {
                "*"
            } else if r.relative(p).is_some_and(|x| x < SAFE_SHARE) {
                "!"
            } else {
                ""
            };
            r.relative(p)
                .map_or_else(|| "-".to_owned(), |x| format!("{:.0}%{mark}", x * 100.0))
        });
        table.row(std::iter::once(r.name()).chain(cells));
    }
    output::print_table(
        "semlb bench replay: each policy's throughput as a share of least_load's on the same engines (req/s for a \
         closed loop, goodput otherwise)",
        &table,
    );
    println!(
        "*: the best on the workload; !: under {:.0} % of least_load's",
        SAFE_SHARE * 100.0
    );
}
