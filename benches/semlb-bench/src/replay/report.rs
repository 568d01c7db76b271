//! What `semlb bench replay` reports: a table per workload (and engine
//! set), with the burst's and the scale-out's own figures after theirs;
//! the summary of every row against `least_load` and of `cache_aware`
//! against the best peer router; the JSON; and the plots.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use serde_json::{Value, json};

use super::chat_set::ChatSet;
use super::drive::RunResult;
use super::phases::{BurstStats, REACH, SHARE_WINDOW, ScaleOutStats};
use super::stats::{GOODPUT_ATTAINMENT, RunStats, goodput};
use super::{Arm, ReplayArgs, Setting};
use crate::end_to_end::{ms, p50_90_99};
use crate::output::{self, Table};
use crate::plot::{self, Line, Panel, Series};
use crate::workload::{MAX_MODEL_LEN, PromptForm, Workload, WorkloadKind, engine_prefill_tokens_per_s};

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
    /// The burst's own figures (`burst`).
    pub(super) burst: Option<BurstStats>,
    /// The scale-out's figures (`scale-out`).
    pub(super) scale_out: Option<ScaleOutStats>,
}

/// One policy on one workload: its sweep.
pub(super) struct PolicyReport {
    /// The row.
    pub(super) arm: Arm,
    /// In multiplier order.
    pub(super) points: Vec<Point>,
    /// Multipliers the search did not need (or could not run).
    pub(super) not_run: Vec<f64>,
    /// Why the row was not run (a peer that refuses the workload's
    /// requests or did not start); it then has no points.
    pub(super) skipped: Option<String>,
}

impl PolicyReport {
    /// The m = 1 run (else the first run; `None` for a row not run).
    fn base(&self) -> Option<&Point> {
        self.points
            .iter()
            .find(|p| p.multiplier == 1.0)
            .or_else(|| self.points.first())
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

/// A report's name: the workload's ([`Workload::name`]: with an `agents`
/// workload's API), with the engine set it ran on: `chat/no-metrics-plain`,
/// `agents/responses`.
pub(super) fn report_name(workload: &Workload, set: Option<ChatSet>) -> String {
    match set {
        Some(set) => format!("{}/{set}", workload.name()),
        None => workload.name(),
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
        report_name(&self.workload, self.set)
    }

    /// What each row's throughput is judged by: requests per second for a
    /// closed loop, else the goodput (0 below the sweep's lowest rate);
    /// `None` for a row not run.
    fn throughput(&self, p: &PolicyReport) -> Option<f64> {
        let base = p.base()?;
        Some(if self.workload.kind.closed_loop() {
            base.stats.req_per_s
        } else {
            p.goodput().unwrap_or(0.0)
        })
    }

    /// The peer row with the highest throughput, if any peer ran.
    fn best_peer(&self) -> Option<&PolicyReport> {
        self.policies
            .iter()
            .filter(|p| p.arm.is_peer())
            .filter_map(|p| Some((p, self.throughput(p)?)))
            // The first of equals.
            .fold(None, |best: Option<(&PolicyReport, f64)>, (p, t)| match best {
                Some((_, b)) if b >= t => best,
                _ => Some((p, t)),
            })
            .map(|(p, _)| p)
    }

    /// `cache_aware`'s throughput over the best peer's (`None` without
    /// either, or when the best peer served nothing).
    fn cache_aware_vs_best_peer(&self) -> Option<(f64, &str)> {
        let peer = self.best_peer()?;
        let ours = self.policies.iter().find(|p| p.arm.label == "cache_aware")?;
        let (base, ours) = (self.throughput(peer)?, self.throughput(ours)?);
        (base > 0.0).then(|| (ours / base, peer.arm.label.as_str()))
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
        "usage cached",
        "prefill CV",
        "requests CV",
        "same engine",
        "prediction",
        "errors",
    ]);
    for p in &report.policies {
        let Some(base) = p.base() else {
            let mut row = vec![format!("{} (†)", p.arm.label)];
            row.extend(std::iter::repeat_n("-".to_owned(), 14));
            table.row(row);
            continue;
        };
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
            s.reported_cached
                .map_or_else(|| "-".to_owned(), |(f, _, _)| format!("{:.1}%", f * 100.0)),
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
             instant its answer ends (a closed loop: no offered rate, req/s is the throughput); {}; {}; \
             speedup {}x (times in trace seconds); TTFT SLO {} s",
            report.name(),
            w.requests.len(),
            w.source,
            args.chat_clients,
            set.describe(),
            if w.kind == WorkloadKind::ScaleOut {
                format!("1 engine, {} once a quarter of the requests are answered", args.engines)
            } else {
                format!("{} engines", args.engines)
            },
            report.setting.speedup,
            report.setting.ttft_slo_s,
        ),
        None => format!(
            "semlb bench replay, {}: {} requests over {:.0} s ({:.2} req/s, {:.0} prompt tokens/s = {:.0} % of {} engines' \
         prefill without reuse) from {}{}; speedup {}x (times in trace seconds); TTFT SLO {} s; sweep {}{}",
            report.name(),
            w.requests.len(),
            w.span_s(),
            w.offered_rate(),
            w.offered_prompt_tokens_per_s(),
            100.0 * w.offered_prompt_tokens_per_s() / capacity,
            args.engines,
            w.source,
            match w.prompt_form() {
                Some(f) => format!("; {}", f.describe()),
                None if w.api.tools() => format!(
                    "; streamed tool-calling calls over {} ({}), the engine's tool calls sent back with their results",
                    w.api.name(),
                    w.api.path(),
                ),
                None => String::new(),
            },
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
         rate: Σ hits / Σ queries (tokens) over the engines; usage cached: Σ cached / Σ prompt tokens as the answers' usage reported them (the tool-calling agents' APIs: chat prompt_tokens_details.cached_tokens, Responses input_tokens_details.cached_tokens, Messages cache_read_input_tokens / (input_tokens + cache_read_input_tokens)); prefill CV: coefficient of variation across engines of \
         uncached prompt tokens (prefill busy time); requests CV: of requests served; same engine: of the answered requests following an answered request of their session, the share sent to the same engine; prediction: of the prompt tokens the routing predicted the chosen engine held, the share it reported cached.",
        report.setting.ttft_slo_s,
        GOODPUT_ATTAINMENT * 100.0
    );
    for p in &report.policies {
        if let Some(why) = &p.skipped {
            println!("†{}: not run: {why}", p.arm.label);
        }
    }
    print_cost_weights(report);
    print_peer_notes(report);
    print_phases(report);
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
                        "usage_cached_share": s.reported_cached.map(|(f, _, _)| f),
                        "usage_prompt_tokens": s.reported_cached.map(|(_, p, _)| p),
                        "usage_cached_tokens": s.reported_cached.map(|(_, _, c)| c),
                        "imbalance_cv_prefill_busy": s.cv_prefill,
                        "imbalance_cv_requests": s.cv_requests,
                        "same_engine_share": s.same_engine,
                        "prediction_accuracy": s.prediction,
                        "gateway": q.run.gateway.as_ref().map(|g| json!({
                            "records": g.records,
                            "predicted_tokens": g.predicted,
                            "confirmed_tokens": g.confirmed,
                            "shortfalls": g.shortfalls,
                            "demotions": g.demotions,
                            "servers_forgotten": g.forgotten,
                        })),
                        "cost_weights_at_end": q.run.gateway.as_ref()
                            .filter(|g| !g.cost_weights.is_empty())
                            .map(|g| g.cost_weights.iter().map(|(slot, w)| json!({
                                "dispatcher": slot,
                                "weight": w,
                            })).collect::<Vec<Value>>()),
                        "peer_command": q.run.command.as_ref().map(|c| c.join(" ")),
                        "burst": q.burst.as_ref().map(burst_json),
                        "scale_out": q.scale_out.as_ref().map(|so| scale_out_json(so, &q.run)),
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
                "kind": p.arm.kind_name(),
                "skipped": p.skipped,
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
        "api": w.api.name(),
        "api_path": w.api.path(),
        "engine_set": report.set.map(|s| json!({
            "name": s.name(),
            "engines_metrics": s.metrics(),
            "clients_stream": s.stream(),
        })),
        "closed_loop": w.kind.closed_loop(),
        "prompt_form": w.prompt_form().map(PromptForm::name),
        "text_fidelity": w.fidelity.as_ref().map(|f| f.json()),
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
        "best_peer": report.best_peer().map(|p| p.arm.label.clone()),
        "cache_aware_vs_best_peer": report.cache_aware_vs_best_peer().map(|(x, _)| x),
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
                .filter_map(|p| {
                    Some(Series {
                        label: p.arm.label.clone(),
                        values: p.base()?.stats.ttft_s.clone(),
                    })
                })
                .collect(),
        })
        .collect();
    plot::cdf_svg(&svg, &panels)?;
    paths.push(svg);
    for r in reports.iter().filter(|r| !r.workload.kind.closed_loop()) {
        let path = args
            .common
            .out
            .join(format!("replay-{}-slo.svg", r.workload.name().replace('/', "-")));
        let lines: Vec<Line> = r
            .policies
            .iter()
            .filter(|p| !p.points.is_empty())
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
                r.name(),
                r.setting.ttft_slo_s
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
    /// without a `least_load` row, when it served nothing, or for a row not
    /// run).
    fn relative(&self, p: &PolicyReport) -> Option<f64> {
        let least_load = self.policies.iter().find(|q| q.arm.label == "least_load")?;
        let base = self.throughput(least_load)?;
        (base > 0.0).then_some(())?;
        Some(self.throughput(p)? / base)
    }
}

/// A summary cell: `p`'s share of `least_load`'s throughput, marked `*`
/// for the best row, `!` under [`SAFE_SHARE`], `^` for the best peer.
fn summary_cell(r: &WorkloadReport, p: &PolicyReport, best: f64, best_peer: Option<&str>) -> String {
    let Some(x) = r.relative(p) else {
        return if p.skipped.is_some() {
            "†".to_owned()
        } else {
            "-".to_owned()
        };
    };
    let mut mark = String::new();
    if best > 0.0 && r.throughput(p).is_some_and(|t| t >= best) {
        mark.push('*');
    } else if x < SAFE_SHARE {
        mark.push('!');
    }
    if best_peer == Some(p.arm.label.as_str()) {
        mark.push('^');
    }
    format!("{:.0}%{mark}", x * 100.0)
}

/// Prints the summary: per workload, every row's throughput (req/s of a
/// closed loop, else goodput) as a share of `least_load`'s, the best
/// marked `*`, those under [`SAFE_SHARE`] `!` and the best peer `^`; and
/// `cache_aware`'s throughput as a share of the best peer's.
pub(super) fn print_summary(reports: &[WorkloadReport]) {
    let Some(first) = reports.first() else { return };
    let labels: Vec<&str> = first.policies.iter().map(|p| p.arm.label.as_str()).collect();
    let mut table = Table::new(
        std::iter::once("workload")
            .chain(labels.iter().copied())
            .chain(["cache_aware / best peer"]),
    );
    for r in reports {
        let best = r.policies.iter().filter_map(|p| r.throughput(p)).fold(0.0, f64::max);
        let best_peer = r.best_peer().map(|p| p.arm.label.as_str());
        let cells = labels
            .iter()
            .map(|label| match r.policies.iter().find(|p| p.arm.label == *label) {
                Some(p) => summary_cell(r, p, best, best_peer),
                None => "-".to_owned(),
            });
        let versus = r
            .cache_aware_vs_best_peer()
            .map_or_else(|| "-".to_owned(), |(x, peer)| format!("{:.0}% of {peer}", x * 100.0));
        table.row(std::iter::once(r.name()).chain(cells).chain([versus]));
    }
    output::print_table(
        "semlb bench replay: each row's throughput as a share of least_load's on the same engines (req/s for a \
         closed loop, goodput otherwise), and cache_aware's as a share of the best peer router's",
        &table,
    );
    println!(
        "*: the best on the workload; !: under {:.0} % of least_load's; ^: the best peer router; †: not run (see \
         the workload's table)",
        SAFE_SHARE * 100.0
    );
}

/// The weights `cost` left in `run`, as `0.0625, 0.25` (one per
/// dispatcher; `None` without any).
fn cost_weights(run: &RunResult) -> Option<String> {
    let g = run.gateway.as_ref().filter(|g| !g.cost_weights.is_empty())?;
    Some(
        g.cost_weights
            .iter()
            .map(|(_, w)| format!("{w}"))
            .collect::<Vec<_>>()
            .join(", "),
    )
}

/// Prints the weight λ each row of `cost` (and its fixed-weight variants)
/// ended each run with, per dispatcher.
fn print_cost_weights(report: &WorkloadReport) {
    let lines: Vec<String> = report
        .policies
        .iter()
        .filter_map(|p| {
            let runs: Vec<String> = p
                .points
                .iter()
                .filter_map(|q| Some(format!("{} {}", times(q.multiplier), cost_weights(&q.run)?)))
                .collect();
            (!runs.is_empty()).then(|| format!("{}: {}", p.arm.label, runs.join("; ")))
        })
        .collect();
    if !lines.is_empty() {
        println!(
            "weight: the cost policy's λ at the end of each run, per dispatcher (semlb_cost_weight; tuning starts \
             from {}): {}",
            semlb::routing::cost::INITIAL_WEIGHT,
            lines.join(" | ")
        );
    }
}

/// Prints what the peer rows of `report` need to be read with: which
/// requests they took, and how they were started.
fn print_peer_notes(report: &WorkloadReport) {
    let peers: Vec<&PolicyReport> = report.policies.iter().filter(|p| p.arm.is_peer()).collect();
    if peers.is_empty() {
        return;
    }
    let form = report.workload.prompt_form();
    let kind = match form {
        Some(PromptForm::Text) => "/v1/completions with the prompt as text",
        Some(PromptForm::Tokens) => "/v1/completions with the prompt as an array of token ids",
        None => report.workload.api.path(),
    };
    println!(
        "peer routers ({}): each with its own defaults (cache_aware), sent {kind}; no prediction column (semlb's \
         own counter).",
        peers
            .iter()
            .map(|p| p.arm.label.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    if form == Some(PromptForm::Tokens) && peers.iter().any(|p| p.base().is_some()) {
        println!(
            "  token-id prompts: semlb routes on the ids' 16-token blocks; a peer that takes them routes on what its \
             version derives from an id array (see the replay module docs for what the pinned versions do)"
        );
    }
    if let Some(p) = peers.iter().find_map(|p| p.base()?.run.command.as_ref()) {
        println!("  e.g. {}", p.join(" "));
    }
}

/// Prints the burst's and the scale-out's own figures of `report`'s rows.
fn print_phases(report: &WorkloadReport) {
    let rows: Vec<(&PolicyReport, &Point)> = report.policies.iter().filter_map(|p| Some((p, p.base()?))).collect();
    if rows.iter().any(|(_, q)| q.burst.is_some()) {
        let mut table = Table::new([
            "policy",
            "burst requests",
            "answered",
            "TTFT p50 s",
            "p90",
            "p99",
            "SLO att.",
            "busiest engine",
            "engines used",
        ]);
        for (p, q) in &rows {
            let Some(b) = &q.burst else { continue };
            let t = p50_90_99(&b.ttft_s);
            table.row([
                p.arm.label.clone(),
                b.requests.to_string(),
                b.answered.to_string(),
                ms(t[0]),
                ms(t[1]),
                ms(t[2]),
                format!("{:.1}%", b.attainment * 100.0),
                format!("{:.1}%", b.busiest_share * 100.0),
                b.engines.to_string(),
            ]);
        }
        output::print_table(
            &format!(
                "{}: the burst's own requests (its new system prompt), ×1",
                report.name()
            ),
            &table,
        );
        println!(
            "busiest engine: of the burst's answered requests, the share the engine that served most of them served \
             (1/engines: spread evenly; 100%: all on one)."
        );
    }
    if rows.iter().any(|(_, q)| q.scale_out.is_some()) {
        let mut table = Table::new([
            "policy",
            "added at s",
            "engines added",
            "req/s before",
            "req/s after",
            "new engines' share after",
            "time to share s",
        ]);
        let mut fair = 0.0;
        for (p, q) in &rows {
            let Some(so) = &q.scale_out else { continue };
            fair = so.fair_share;
            table.row([
                p.arm.label.clone(),
                so.at_s.map_or_else(|| "never".to_owned(), |t| format!("{t:.1}")),
                format!("{}/{}", so.added.0, so.added.1),
                format!("{:.2}", so.before_req_per_s),
                format!("{:.2}", so.after_req_per_s),
                so.new_share
                    .map_or_else(|| "-".to_owned(), |x| format!("{:.1}%", x * 100.0)),
                so.time_to_share_s
                    .map_or_else(|| "never".to_owned(), |t| format!("{t:.1}")),
            ]);
        }
        output::print_table(
            &format!("{}: from one engine to more, added at run time, ×1", report.name()),
            &table,
        );
        println!(
            "added at: trace seconds after the start, once a quarter of the requests were answered; req/s before / \
             after: answers that ended before / after it per trace second; new engines' share: of the requests sent \
             after it; time to share: trace seconds from it until {SHARE_WINDOW} consecutive requests gave the new \
             engines {:.0} % of their fair share ({:.1} %).",
            REACH * 100.0,
            REACH * fair * 100.0
        );
        for (p, q) in &rows {
            if let Some(e) = q.scale_out.as_ref().and_then(|so| so.add_error.as_ref()) {
                println!("{}: an add failed: {e}", p.arm.label);
            }
        }
    }
}

/// The JSON of a burst's figures.
fn burst_json(b: &BurstStats) -> Value {
    let t = p50_90_99(&b.ttft_s);
    json!({
        "requests": b.requests,
        "answered": b.answered,
        "ttft_s": {"p50": t[0], "p90": t[1], "p99": t[2]},
        "slo_attainment": b.attainment,
        "busiest_engine_share": b.busiest_share,
        "engines_used": b.engines,
    })
}

/// The JSON of a scale-out's figures and adds.
fn scale_out_json(so: &ScaleOutStats, run: &RunResult) -> Value {
    json!({
        "added_at_s": so.at_s,
        "added": so.added.0,
        "asked": so.added.1,
        "adds": run.scale_out.as_ref().map(|s| s.added.iter().map(|a| json!({
            "engine": a.url,
            "status": a.answer.as_ref().ok(),
            "error": a.answer.as_ref().err(),
            "ms": a.ms,
        })).collect::<Vec<Value>>()),
        "requests_per_s_before": so.before_req_per_s,
        "requests_per_s_after": so.after_req_per_s,
        "new_engines_share_after": so.new_share,
        "fair_share": so.fair_share,
        "reach": REACH,
        "window_requests": SHARE_WINDOW,
        "time_to_share_s": so.time_to_share_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::peers::Peer;
    use crate::workload::Workload;
    use semlb::routing::PolicyKind;

    /// A row that served `req_per_s` at ×1 (`None`: not run).
    fn row(arm: Arm, req_per_s: Option<f64>) -> PolicyReport {
        let points = req_per_s
            .map(|r| Point {
                multiplier: 1.0,
                offered: None,
                run: RunResult {
                    outcomes: Vec::new(),
                    finished_s: Vec::new(),
                    wall_s: 1.0,
                    engines: Vec::new(),
                    gateway: None,
                    lag_ms: [0.0; 2],
                    command: None,
                    scale_out: None,
                },
                stats: RunStats {
                    req_per_s: r,
                    ..RunStats::default()
                },
                burst: None,
                scale_out: None,
            })
            .into_iter()
            .collect();
        PolicyReport {
            skipped: req_per_s.is_none().then(|| "refuses token-id prompts".to_owned()),
            arm,
            points,
            not_run: Vec::new(),
        }
    }

    fn policy(kind: PolicyKind) -> Arm {
        Arm::of(
            kind,
            &super::super::ReplayArgs::with(crate::Common {
                out: PathBuf::from("x"),
                redis_url: None,
                redis_server: PathBuf::from("redis-server"),
                no_redis: true,
                data: None,
            }),
        )
        .remove(0)
    }

    #[test]
    fn the_summary_marks_the_best_peer_and_compares_cache_aware_with_it() {
        let report = WorkloadReport {
            workload: Arc::new(Workload::new(WorkloadKind::Chat, Vec::new(), String::new(), 0)),
            set: Some(ChatSet::Stream),
            setting: Setting {
                speedup: 10.0,
                duration_s: 0.0,
                ttft_slo_s: 1.0,
            },
            config: String::new(),
            policies: vec![
                row(policy(PolicyKind::CacheAware), Some(30.0)),
                row(policy(PolicyKind::LeastLoad), Some(25.0)),
                row(Arm::peer(Peer::Smg), Some(28.0)),
                row(Arm::peer(Peer::VllmRouter), Some(20.0)),
                row(Arm::peer(Peer::SglangRouter), None),
            ],
        };
        let p = |i: usize| &report.policies[i];
        assert_eq!(report.best_peer().map(|p| p.arm.label.as_str()), Some("smg"));
        let (x, peer) = report.cache_aware_vs_best_peer().unwrap();
        assert!((x - 30.0 / 28.0).abs() < 1e-12 && peer == "smg");
        assert!((report.relative(p(0)).unwrap() - 1.2).abs() < 1e-12);
        assert_eq!(report.relative(p(4)), None);
        let cell = |i| summary_cell(&report, p(i), 30.0, Some("smg"));
        assert_eq!(cell(0), "120%*");
        assert_eq!(cell(1), "100%");
        assert_eq!(cell(2), "112%^");
        assert_eq!(cell(3), "80%!");
        assert_eq!(cell(4), "†");
        // Equal peers: the first is the best.
        let mut tied = report;
        tied.policies[3] = row(Arm::peer(Peer::VllmRouter), Some(28.0));
        assert_eq!(tied.best_peer().map(|p| p.arm.label.as_str()), Some("smg"));
    }
}
