//! The output of `semlb bench proxy`: a table per workload on stdout (with
//! the added latency over direct and the semlb/nginx CPU ratio), the
//! settings and process placement, `<out>/proxy.json` and `<out>/proxy.svg`.

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{Value, json};

use super::measure::Point;
use super::procs::{CpuList, EngineSpec, Placement};
use super::workloads::{TextSource, Workload};
use super::{Front, ProxyArgs, WorkloadKind};
use crate::output::{self, Table};
use crate::plot::{self, Line};

/// Everything the output is made of.
pub(super) struct Run<'a> {
    pub(super) text: &'a TextSource,
    pub(super) engine: &'a EngineSpec,
    pub(super) workloads: &'a [Workload],
    pub(super) points: &'a [Point],
    pub(super) front_cpus: &'a CpuList,
    pub(super) other: &'a CpuList,
    pub(super) overlap: bool,
    /// Where each server's processes may run (`semlb`, `nginx`, `engine`).
    pub(super) placement: &'a [(&'static str, Vec<Placement>)],
    /// nginx's version and configuration, if it ran.
    pub(super) nginx: Option<(String, String)>,
    pub(super) nginx_skipped: Option<String>,
}

impl Run<'_> {
    fn point(&self, w: WorkloadKind, f: Front, c: usize) -> Option<&Point> {
        self.points
            .iter()
            .find(|p| p.workload == w && p.front == f && p.connections == c)
    }

    /// A front's p50 and p99 minus direct's, µs.
    fn added(&self, p: &Point) -> Option<(f64, f64)> {
        if p.front == Front::Direct || p.tally.ok() == 0 {
            return None;
        }
        let d = self.point(p.workload, Front::Direct, p.connections)?;
        (d.tally.ok() > 0).then(|| (p.latency(0.5) - d.latency(0.5), p.latency(0.99) - d.latency(0.99)))
    }

    /// semlb's front CPU per request over nginx's.
    fn cpu_ratio(&self, w: WorkloadKind, c: usize) -> Option<f64> {
        let s = self.point(w, Front::Semlb, c)?.front_cpu_us()?;
        let n = self.point(w, Front::Nginx, c)?.front_cpu_us()?;
        (n > 0.0 && s.is_finite()).then_some(s / n)
    }
}

/// `us` microseconds as table text: `87 µs`, `1.24 ms`, `-12 µs`.
fn time_text(us: f64) -> String {
    if !us.is_finite() {
        "-".into()
    } else if us.abs() < 1000.0 {
        format!("{us:.0} µs")
    } else {
        format!("{:.2} ms", us / 1000.0)
    }
}

/// A CPU share as `ours+others %`.
fn share(ours: f64, foreign: f64) -> String {
    format!("{:.0}+{:.0} %", 100.0 * ours, 100.0 * foreign)
}

fn quantiles(sorted: &[f64]) -> Value {
    if sorted.is_empty() {
        return Value::Null;
    }
    let mean = sorted.iter().sum::<f64>() / sorted.len() as f64;
    json!({
        "p50": output::quantile(sorted, 0.5),
        "p90": output::quantile(sorted, 0.9),
        "p99": output::quantile(sorted, 0.99),
        "max": sorted.last(),
        "mean": mean,
    })
}

fn finite(v: f64) -> Value {
    if v.is_finite() { json!(v) } else { Value::Null }
}

/// The columns of a workload's table.
const HEADER: [&str; 13] = [
    "front",
    "conns",
    "req/s",
    "p50",
    "p99",
    "added p50",
    "added p99",
    "front CPU/req",
    "semlb/nginx",
    "front core",
    "engine CPU/req",
    "other cores",
    "errors",
];

/// Prints a table per workload and the run's settings, and writes
/// `<out>/proxy.json` and `<out>/proxy.svg`.
pub(super) fn write(args: &ProxyArgs, run: &Run) -> Result<()> {
    let mut workloads_json = serde_json::Map::new();
    for w in run.workloads {
        workloads_json.insert(w.kind.name().to_owned(), workload_table(args, run, w));
    }
    print_settings(args, run);
    print_warnings(run);
    let value = json!({
        "report": "proxy",
        "settings": {
            "secs": args.secs,
            "warmup_secs": args.warmup,
            "connections": args.connections,
            "stream": args.stream,
            "max_tokens": args.max_tokens,
            "prompt_tokens": args.prompt_tokens,
            "time_scale": args.time_scale,
            "front_cpus": run.front_cpus.to_string(),
            "other_cpus": run.other.to_string(),
        },
        "engine": run.engine.description,
        "tokenizer": run.text.tokenizer_name,
        "prompt_text": run.text.dialogues_name,
        "gateway": "semlb serve --dispatchers 1 --responders 1 --shm-size 64MiB",
        "nginx": match &run.nginx {
            Some((version, config)) => json!({"version": version, "config": config}),
            None => json!({"skipped": run.nginx_skipped}),
        },
        "process_affinity": placement_json(run),
        "workloads": workloads_json,
    });
    let json_path = output::write_json(&args.common.out, "proxy", &value)?;
    let svg_path = args.common.out.join("proxy.svg");
    write_svg(&svg_path, args, run)?;
    println!("wrote {} and {}", json_path.display(), svg_path.display());
    Ok(())
}

/// Prints workload `w`'s table, a row per point, and returns its JSON.
fn workload_table(args: &ProxyArgs, run: &Run, w: &Workload) -> Value {
    let mut table = Table::new(HEADER);
    let mut points_json = Vec::new();
    let mut ratios = serde_json::Map::new();
    for &c in &args.connections {
        if let Some(r) = run.cpu_ratio(w.kind, c) {
            ratios.insert(c.to_string(), json!(r));
        }
        for p in run.points.iter().filter(|p| p.workload == w.kind && p.connections == c) {
            let added = run.added(p);
            let ratio = (p.front == Front::Semlb).then(|| run.cpu_ratio(w.kind, c)).flatten();
            table.row(point_row(p, added, ratio));
            points_json.push(point_json(args, p, added, ratio));
        }
    }
    output::print_table(&workload_title(args, run, w), &table);
    json!({
        "path": w.path,
        "body_bytes": w.body_bytes,
        "prompt_tokens": w.prompt_tokens,
        "engine_prompt_tokens": w.engine_prompt_tokens,
        "points": points_json,
        "semlb_over_nginx_cpu": ratios,
    })
}

/// Point `p`'s row: `added` its p50 and p99 over direct's, `ratio`
/// semlb's front CPU over nginx's (on semlb's row).
fn point_row(p: &Point, added: Option<(f64, f64)>, ratio: Option<f64>) -> Vec<String> {
    vec![
        p.front.name().to_owned(),
        p.connections.to_string(),
        format!("{:.0}", p.req_per_s()),
        time_text(p.latency(0.5)),
        time_text(p.latency(0.99)),
        added.map_or_else(String::new, |a| time_text(a.0)),
        added.map_or_else(String::new, |a| time_text(a.1)),
        p.front_cpu_us().map_or_else(String::new, time_text),
        ratio.map_or_else(String::new, |r| format!("{r:.2}x")),
        if p.front == Front::Direct {
            String::new()
        } else {
            share(p.front_util(), p.front_foreign())
        },
        time_text(p.per_request_us(p.engine_cpu_s)),
        share(p.other_util(), p.other_foreign()),
        p.tally.errors().to_string(),
    ]
}

/// Point `p`'s JSON (`added` and `ratio` as for [`point_row`]).
fn point_json(args: &ProxyArgs, p: &Point, added: Option<(f64, f64)>, ratio: Option<f64>) -> Value {
    json!({
        "front": p.front.name(),
        "connections": p.connections,
        "window_s": p.window_s,
        "requests": p.tally.ok(),
        "requests_per_s": p.req_per_s(),
        "latency_us": quantiles(&p.tally.latency_us),
        "ttft_us": if args.stream { quantiles(&p.tally.ttft_us) } else { Value::Null },
        "added_latency_us": added.map(|(a50, a99)| json!({"p50": a50, "p99": a99})),
        "cpu_us_per_request": {
            "front": p.front_cpu_us().map(finite),
            "engine": finite(p.per_request_us(p.engine_cpu_s)),
            "load_generator": finite(p.per_request_us(p.client_cpu_s)),
        },
        "cpu_seconds": {
            "front": p.front_cpu_s,
            "engine": p.engine_cpu_s,
            "load_generator": p.client_cpu_s,
        },
        "utilisation": {
            "front_cpus": {"front": p.front_util(), "foreign": p.front_foreign()},
            "other_cpus": {"engine_and_load_generator": p.other_util(), "foreign": p.other_foreign()},
        },
        "semlb_over_nginx_cpu": ratio,
        "errors": {
            "total": p.tally.errors(),
            "non_200": p.tally.statuses.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "transport": p.tally.transport_errors,
            "first": p.tally.first_error,
        },
        "x_semlb_cache": p.tally.cache,
        "reconnects": p.tally.reconnects,
    })
}

/// The title of workload `w`'s table: what its requests are.
fn workload_title(args: &ProxyArgs, run: &Run, w: &Workload) -> String {
    match w.kind {
        WorkloadKind::Short => format!(
            "semlb bench proxy: short chat requests ({} B body, max_tokens {}{})",
            w.body_bytes,
            args.max_tokens,
            if args.stream { ", SSE" } else { "" }
        ),
        WorkloadKind::ShortResponses | WorkloadKind::ShortMessages => format!(
            "semlb bench proxy: short {} requests (POST {}, {} B body, max tokens {}{})",
            if w.kind == WorkloadKind::ShortResponses {
                "Responses API"
            } else {
                "Messages API"
            },
            w.path,
            w.body_bytes,
            args.max_tokens,
            if args.stream { ", SSE" } else { "" }
        ),
        WorkloadKind::Long | WorkloadKind::LongUnseen => format!(
            "semlb bench proxy: {} (~{:.0} tokens of {}, {} B body, max_tokens {}{})",
            if w.kind == WorkloadKind::Long {
                "long chat prompts, 64 texts in turn behind a per-request tag"
            } else {
                "long chat prompts never seen before (the per-request tag opens every line)"
            },
            w.prompt_tokens.unwrap_or(0.0),
            run.text.dialogues_name,
            w.body_bytes,
            args.max_tokens,
            if args.stream { ", SSE" } else { "" }
        ),
    }
}

/// Prints the CPUs, the engine, the tokenizer, where each server's
/// processes ran, and why nginx was skipped.
fn print_settings(args: &ProxyArgs, run: &Run) {
    println!(
        "core columns: this run's share + other processes' share of the CPUs (front: {}, other: {})",
        run.front_cpus, run.other
    );
    println!(
        "front on CPU {}, engine and load generator on CPU {}{}; {} s measured after {} s of warm-up per row",
        run.front_cpus,
        run.other,
        if run.overlap { " (overlapping the front's!)" } else { "" },
        args.secs,
        args.warmup
    );
    println!("engine: {}", run.engine.description);
    println!("tokenizer: {}", run.text.tokenizer_name);
    if run.text.files.is_none() {
        println!("NOTE: no data directory: bundled tokenizer, canonical template, generated prompt text");
    }
    for (what, procs) in run.placement {
        let list: Vec<String> = procs
            .iter()
            .map(|p| format!("{}[{}] on {}", p.name, p.pid, p.cpus_allowed))
            .collect();
        println!("{what} processes: {}", list.join(", "));
    }
    if let Some(why) = &run.nginx_skipped {
        println!("nginx skipped: {why}");
    }
}

/// Warns of rows where other processes used the pinned CPUs, of errors,
/// and of answers from the response cache.
fn print_warnings(run: &Run) {
    let busiest = run
        .points
        .iter()
        .map(|p| {
            let front = if p.front == Front::Direct {
                0.0
            } else {
                p.front_foreign()
            };
            front.max(p.other_foreign())
        })
        .fold(0.0, f64::max);
    if busiest > 0.1 {
        println!(
            "WARNING: other processes used up to {:.0} % of the pinned CPUs during a row (the `+` parts of the core \
             columns): this machine is shared, and those rows measure the contention too",
            100.0 * busiest
        );
    }
    for p in run.points {
        if p.tally.errors() > 0 {
            println!(
                "{} {} ×{}: {} errors, first: {}",
                p.workload.name(),
                p.front.name(),
                p.connections,
                p.tally.errors(),
                p.tally.first_error.as_deref().unwrap_or("?")
            );
        }
        if let Some(hits) = p.tally.cache.get("hit") {
            println!(
                "{} {} ×{}: {hits} answers came from the response cache (expected none)",
                p.workload.name(),
                p.front.name(),
                p.connections
            );
        }
    }
}

/// Where each server's processes could run, as JSON.
fn placement_json(run: &Run) -> serde_json::Map<String, Value> {
    run.placement
        .iter()
        .map(|(what, procs)| {
            (
                (*what).to_owned(),
                procs
                    .iter()
                    .map(|p| json!({"pid": p.pid, "name": p.name, "cpus_allowed": p.cpus_allowed}))
                    .collect(),
            )
        })
        .collect()
}

/// Per workload, two line charts over the concurrency: the fronts' CPU
/// µs/request (log scale) and their added p50 latency; drawn with
/// [`plot::line_svg`] one by one and laid out two per row in one SVG.
fn write_svg(path: &Path, args: &ProxyArgs, run: &Run) -> Result<()> {
    let fronts = [Front::Semlb, Front::Nginx];
    // (title, y label, log y, lines)
    let mut panels: Vec<(String, &str, bool, Vec<Line>)> = Vec::new();
    for w in run.workloads {
        let lines = |pick: &dyn Fn(&Point) -> Option<f64>| -> Vec<Line> {
            fronts
                .iter()
                .map(|f| Line {
                    label: f.name().to_owned(),
                    points: args
                        .connections
                        .iter()
                        .filter_map(|c| run.point(w.kind, *f, *c))
                        .filter_map(|p| pick(p).map(|v| (p.connections as f64, v)))
                        .collect(),
                })
                .filter(|l| !l.points.is_empty())
                .collect()
        };
        panels.push((
            format!("{}: front CPU per request", w.kind.name()),
            "CPU µs / request",
            true,
            lines(&|p| p.front_cpu_us()),
        ));
        panels.push((
            format!("{}: added p50 latency", w.kind.name()),
            "µs over direct",
            false,
            lines(&|p| run.added(p).map(|a| a.0)),
        ));
    }
    let (w, h) = (640, 440);
    let rows = panels.len().div_ceil(2);
    let mut svg = format!(
        "<svg width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" xmlns=\"http://www.w3.org/2000/svg\">\n",
        w * 2,
        h * rows
    );
    for (i, (title, y_label, log_y, lines)) in panels.iter().enumerate() {
        let part = path.with_extension(format!("part{i}.svg"));
        plot::line_svg(&part, title, "connections", y_label, *log_y, lines)?;
        let text = std::fs::read_to_string(&part).with_context(|| format!("cannot read {}", part.display()))?;
        let _ = std::fs::remove_file(&part);
        let body = text.trim_start().strip_prefix("<?xml").map_or(text.as_str(), |rest| {
            rest.split_once("?>").map_or(rest, |(_, after)| after)
        });
        let placed = body.trim_start().replacen(
            "<svg ",
            &format!("<svg x=\"{}\" y=\"{}\" ", (i % 2) * w, (i / 2) * h),
            1,
        );
        svg.push_str(&placed);
        svg.push('\n');
    }
    svg.push_str("</svg>\n");
    std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_read_well() {
        assert_eq!(time_text(87.4), "87 µs");
        assert_eq!(time_text(-12.0), "-12 µs");
        assert_eq!(time_text(1240.0), "1.24 ms");
        assert_eq!(time_text(f64::NAN), "-");
    }
}
