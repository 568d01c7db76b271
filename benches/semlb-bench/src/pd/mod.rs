//! `semlb bench pd`: disaggregated prefill and decode against aggregated
//! serving at equal engine count (issue 41's benchmark).
//!
//! Every fleet is `--engines` simulated engines with the same parameters
//! (the simulator's defaults: an 8B model on one A100, prefill 10 K
//! tokens/s, decode step 10 ms + 0.08 ms per running sequence; KV moved
//! at 25 GB/s, 128 KiB per token) behind one `semlb serve`, started fresh
//! for every run ([`fleet`]):
//!
//! | topology | engines | gateway |
//! | --- | --- | --- |
//! | `agg` | all `--role both` | `--backend` each, policy `cache_aware` |
//! | `<P>p<D>d` | P `--role prefill`, D `--role decode` | `--prefill`, `--decode`, `--pd-protocol` |
//!
//! An aggregated engine's step lasts the prefill of the prompts it admits
//! plus the decode step, so every answer being decoded stalls while a
//! newcomer's long prompt is prefilled (interference); a P/D fleet moves
//! prefill to engines that do nothing else and pays a KV transfer.
//!
//! # Parts
//!
//! - **interference** ([`workload::interference`]): long prompts
//!   (`--prompt-tokens`, 4–8 K, each distinct) with long answers
//!   (`--output-tokens`, 256–512), Poisson arrivals at each of `--rates`
//!   for `--window-secs`, on every topology of `--topologies`. Per point:
//!   TTFT p50/p90, TPOT p50/p90, SLO attainment and goodput (requests per
//!   second with TTFT ≤ `--slo-ttft-ms` and TPOT ≤ `--slo-tpot-ms`), the
//!   share split and bypassed; then each topology's best goodput against
//!   the aggregated fleet's.
//! - **conversations** ([`workload::conversations`]): multi-turn
//!   conversations over a long document, many at once, on `agg` and on
//!   `--conv-topology` with cache-aware pairing (prefill by `cache_aware`,
//!   decode by load: semlb's defaults) and with random pairing
//!   (`--policy random`, `pd.decode_by = "policy"`): TTFT p50/p90 of the
//!   first and of later turns, and of the later turns that bypassed
//!   prefill against the aggregated fleet's later turns.
//!
//! # Time
//!
//! The engines run at `--time-scale S` (a simulated second lasts S real
//! seconds); every duration, rate and objective of the report is in
//! simulated time: the client's real durations are divided by S. S is
//! chosen so that what the gateway and the client add (a few real
//! milliseconds a request) stays small against engine times of hundreds
//! of simulated milliseconds.
//!
//! The targets of issue 41 are printed beside the figures ([`report`]);
//! nothing is asserted. The modules: [`args`] (flags), [`workload`]
//! (requests), [`fleet`] (processes), [`run`] (clients), [`report`]
//! (figures, tables, JSON, plot).

pub mod args;
mod fleet;
mod report;
mod run;
mod workload;

pub use args::PdArgs;

use anyhow::Result;
use serde_json::{Value, json};

use self::args::{Part, Topology};
use self::fleet::{Fleet, Pairing};
use self::report::{Figures, Point, Setup, Slo, Sweep};
use self::workload::Texts;
use crate::output::{print_table, progress, write_json};

/// Runs the report.
pub fn run(args: &PdArgs) -> Result<()> {
    args.validate()?;
    let texts = Texts::new();
    let mut out = serde_json::Map::new();
    out.insert(
        "time_scale".into(),
        json!({"interference": args.time_scale, "conversations": args.conv_time_scale}),
    );
    out.insert(
        "note".into(),
        json!("every duration and rate is in simulated time: real durations divided by the part's time_scale (gateway_dispatch_us_real: real time)"),
    );
    out.insert("pd_protocol".into(), json!(args.pd_protocol.name()));
    out.insert(
        "slo".into(),
        json!({"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}),
    );
    if args.parts.contains(&Part::Interference) {
        out.insert("interference".into(), interference(args, &texts)?);
    }
    if args.parts.contains(&Part::Conversations) {
        out.insert("conversations".into(), conversations(args, &texts)?);
    }
    let path = write_json(&args.common.out, "pd", &Value::Object(out))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// The interference sweep on every topology.
fn interference(args: &PdArgs, texts: &Texts) -> Result<Value> {
    let slo = Slo::of(args);
    let bar = progress((args.topologies.len() * args.rates.len()) as u64, "pd interference");
    let mut rates = args.rates.clone();
    rates.sort_by(f64::total_cmp);
    let mut sweeps = Vec::new();
    for &topology in &args.topologies {
        let mut points = Vec::new();
        for (i, &rate) in rates.iter().enumerate() {
            bar.set_message(format!("{} at {rate}/s", topology.label(args.engines)));
            let requests = workload::interference(args, rate);
            let fleet = Fleet::start(args, topology, Pairing::CacheAware, args.time_scale)?;
            let samples = run::interference(fleet.addr()?, &requests, texts, args);
            let pd_paths = json!(fleet.pd_paths());
            drop(fleet);
            let figures = Figures::of(&samples, slo);
            let collapsed = figures.attainment() < args.stop_attainment;
            points.push(Point {
                rate,
                goodput: figures.good as f64 / args.window_secs,
                figures,
                pd_paths,
            });
            bar.inc(1);
            if collapsed {
                bar.inc((rates.len() - i - 1) as u64);
                break;
            }
        }
        sweeps.push(Sweep { topology, points });
    }
    bar.finish_and_clear();
    print_table(
        &format!(
            "pd interference: {} engines; prompts of {} tokens, answers of {} tokens, Poisson arrivals for {} s a point; SLO TTFT <= {} ms and TPOT <= {} ms; {} protocol; simulated time (real / {}); a sweep stops after a point below {:.0} % in SLO",
            args.engines,
            args.prompt_tokens,
            args.output_tokens,
            args.window_secs,
            args.slo_ttft_ms,
            args.slo_tpot_ms,
            args.pd_protocol,
            args.time_scale,
            100.0 * args.stop_attainment
        ),
        &report::interference_table(args, &sweeps),
    );
    print_table(
        "pd interference: best goodput per topology",
        &report::summary_table(args, &sweeps),
    );
    if let Some(line) = report::interference_target(args, &sweeps) {
        println!("{line}");
    }
    let svg = report::plot(&args.common.out, args, &sweeps)?;
    eprintln!("wrote {}", svg.display());
    Ok(report::sweeps_json(args, &sweeps))
}

/// The conversations part: aggregated, cache-aware P/D, random P/D.
fn conversations(args: &PdArgs, texts: &Texts) -> Result<Value> {
    let slo = Slo::of(args);
    let convs = workload::conversations(args);
    let p = args.conv_topology.label(args.engines);
    let runs = [
        (
            Topology::Aggregated.label(args.engines),
            Topology::Aggregated,
            Pairing::CacheAware,
        ),
        (
            format!("{p}, cache-aware pairing"),
            args.conv_topology,
            Pairing::CacheAware,
        ),
        (format!("{p}, random pairing"), args.conv_topology, Pairing::Random),
    ];
    let bar = progress(runs.len() as u64, "pd conversations");
    let mut setups = Vec::new();
    for (name, topology, pairing) in runs {
        bar.set_message(name.clone());
        let fleet = Fleet::start(args, topology, pairing, args.conv_time_scale)?;
        let samples = run::conversations(fleet.addr()?, &convs, texts, args);
        setups.push(Setup {
            name,
            samples,
            pd_paths: json!(fleet.pd_paths()),
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    print_table(
        &format!(
            "pd conversations: {} conversations ({}/s for {} s) of {} turns over a document of {} tokens, answers of {} tokens, questions of {} tokens, think time {} s; {} engines; simulated time (real / {})",
            convs.len(),
            args.conv_rate,
            args.conv_secs,
            args.turns,
            args.doc_tokens,
            args.turn_output_tokens,
            args.question_tokens,
            args.think_secs,
            args.engines,
            args.conv_time_scale
        ),
        &report::conversations_table(&setups, slo),
    );
    let setups: [Setup; 3] = setups.try_into().map_err(|_| anyhow::anyhow!("three setups"))?;
    for line in report::conversations_targets(&setups, slo) {
        println!("{line}");
    }
    Ok(json!({
        "conversations": convs.len(),
        "turns": args.turns,
        "conv_rate": args.conv_rate,
        "doc_tokens": args.doc_tokens.to_string(),
        "turn_output_tokens": args.turn_output_tokens.to_string(),
        "setups": report::setups_json(&setups, slo),
    }))
}
