//! The e2e report's output: a table on stdout (each phase per store, and
//! the redis/shm ratios), `<out>/e2e.json` with every figure and setting,
//! and `<out>/e2e.svg` (CDFs of the fixed-rate phase, shm vs redis).

use std::path::Path;

use anyhow::Result;
use serde_json::json;

use super::stats::{PhaseStats, StoreRun, ms};
use super::{Arrivals, EndToEndArgs};
use crate::output::{self, Table};
use crate::plot::{self, Panel, Series};

const HEADER: [&str; 12] = [
    "store",
    "req/s",
    "TTFT p50 ms",
    "p90",
    "p99",
    "latency p50 ms",
    "p90",
    "p99",
    "dispatch p50 µs",
    "p99",
    "cache+route p50 µs",
    "errors",
];

fn row(name: &str, f: &[f64]) -> Vec<String> {
    let mut out = vec![name.to_owned()];
    for (i, v) in f.iter().enumerate() {
        out.push(match i {
            0 => format!("{v:.1}"),
            10 => format!("{v:.0}"),
            _ => ms(*v),
        });
    }
    out
}

/// Prints the table of `runs` and writes `<out>/e2e.json` and
/// `<out>/e2e.svg`; `source` names the dialogues.
pub(super) fn write(args: &EndToEndArgs, source: &str, runs: &[StoreRun]) -> Result<()> {
    // Table and JSON.
    let mut table = Table::new(HEADER);
    let mut phases_json = serde_json::Map::new();
    let phase_rows = |table: &mut Table, title: &str, pick: &dyn Fn(&StoreRun) -> Option<&PhaseStats>| {
        let rows: Vec<(&str, Vec<f64>)> = runs
            .iter()
            .filter_map(|r| pick(r).map(|p| (r.name, p.figures())))
            .collect();
        for (name, f) in &rows {
            table.row(row(&format!("{title} {name}"), f));
        }
        if let [(_, shm), (_, redis)] = rows.as_slice() {
            let ratios: Vec<f64> = shm.iter().zip(redis).map(|(s, r)| ratio(*r, *s)).collect();
            let mut cells = vec![format!("{title} redis/shm")];
            cells.extend(ratios.iter().take(10).map(|r| format!("{r:.2}x")));
            cells.push(String::new());
            table.row(cells);
            Some(ratios)
        } else {
            None
        }
    };
    let fixed_ratios = phase_rows(&mut table, "fixed", &|r| Some(&r.fixed));
    let saturation_ratios = phase_rows(&mut table, "saturation", &|r| r.saturation.as_ref());
    for r in runs {
        phases_json.insert(
            r.name.to_owned(),
            json!({
                "fixed_rate": r.fixed.json(),
                "saturation": r.saturation.as_ref().map(PhaseStats::json),
            }),
        );
    }
    let ratio_json = |ratios: Option<Vec<f64>>| {
        ratios.map(|r| {
            let names = [
                "requests_per_s",
                "ttft_p50",
                "ttft_p90",
                "ttft_p99",
                "latency_p50",
                "latency_p90",
                "latency_p99",
                "dispatch_p50",
                "dispatch_p99",
                "cache_route_p50",
            ];
            names
                .iter()
                .zip(r)
                .map(|(n, v)| ((*n).to_owned(), json!(v)))
                .collect::<serde_json::Map<_, _>>()
        })
    };
    let title = format!(
        "semlb bench e2e: gateway ({} dispatchers) in front of {} simulated engines (time scale {}), \
         streaming chat turns of {} ({} output tokens); fixed: {} {} req/s for {} s; saturation: {} clients for {} s",
        args.dispatchers,
        args.engines,
        args.time_scale,
        source,
        args.max_tokens,
        match args.arrivals {
            Arrivals::Poisson => "Poisson",
            Arrivals::Fixed => "fixed-interval",
        },
        args.rate,
        args.secs,
        args.concurrency,
        args.saturation_secs
    );
    output::print_table(&title, &table);
    for r in runs {
        for (phase, p) in [("fixed", Some(&r.fixed)), ("saturation", r.saturation.as_ref())] {
            if let Some(p) = p
                && let Some(e) = &p.first_error
            {
                println!("{} {phase}: {} errors, first: {e}", r.name, p.errors);
            }
        }
    }
    if args.common.no_redis {
        println!("(redis skipped: --no-redis)");
    }
    let value = json!({
        "report": "e2e",
        "engines": args.engines,
        "dispatchers": args.dispatchers,
        "time_scale": args.time_scale,
        "max_tokens": args.max_tokens,
        "workload": source,
        "fixed_rate": {"rate": args.rate, "secs": args.secs, "arrivals": format!("{:?}", args.arrivals).to_lowercase()},
        "saturation": {"concurrency": args.concurrency, "secs": args.saturation_secs},
        "stores": phases_json,
        "ratios_redis_over_shm": {
            "fixed_rate": ratio_json(fixed_ratios),
            "saturation": ratio_json(saturation_ratios),
        },
    });
    let json_path = output::write_json(&args.common.out, "e2e", &value)?;
    let svg_path = args.common.out.join("e2e.svg");
    write_svg(&svg_path, runs)?;
    println!("wrote {} and {}", json_path.display(), svg_path.display());
    Ok(())
}

fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 { f64::NAN } else { a / b }
}

fn write_svg(path: &Path, runs: &[StoreRun]) -> Result<()> {
    let panel = |title: &str, x_label: &str, pick: &dyn Fn(&PhaseStats) -> &Vec<f64>| Panel {
        title: title.to_owned(),
        x_label: x_label.to_owned(),
        log_x: true,
        series: runs
            .iter()
            .map(|r| Series {
                label: r.name.to_owned(),
                values: pick(&r.fixed).clone(),
            })
            .collect(),
    };
    plot::cdf_svg(
        path,
        &[
            panel("TTFT (fixed rate)", "ms", &|p| &p.ttft_ms),
            panel("end-to-end latency (fixed rate)", "ms", &|p| &p.latency_ms),
            panel("dispatch time (fixed rate)", "µs", &|p| &p.dispatch_us),
        ],
    )
}
