//! The output of `semlb bench dispatch`: the run's settings, a table of
//! the stages every store shares, a table of p50/p99 per stage and store
//! with the totals without and with tokenization, the Redis/shm ratios,
//! `<out>/dispatch.json` and `<out>/dispatch.svg` (CDFs of the totals).

use anyhow::Result;
use serde_json::{Value, json};

use super::passes::{Passes, Prepared, Stages};
use super::{DispatchArgs, Workload, cores, machine};
use crate::output::{self, Table};
use crate::plot::{self, Panel, Series};

/// p50, p99, mean, max of `v` (µs) as JSON.
fn summary(v: &[f64]) -> Value {
    let mut s = v.to_vec();
    output::sort(&mut s);
    let mean = if s.is_empty() {
        0.0
    } else {
        s.iter().sum::<f64>() / s.len() as f64
    };
    json!({
        "p50_us": output::quantile(&s, 0.5),
        "p99_us": output::quantile(&s, 0.99),
        "mean_us": mean,
        "max_us": s.last().copied().unwrap_or(0.0),
    })
}

/// The value at quantile `q` of `v`.
fn p(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    output::sort(&mut s);
    output::quantile(&s, q)
}

/// `us` µs as table text.
fn fmt_us(us: f64) -> String {
    output::human_ns(us * 1e3)
}

/// The recorded requests' means: prompt tokens, prompt blocks, prompt +
/// answer blocks.
struct Means {
    tokens: f64,
    blocks: f64,
    full_blocks: f64,
}

impl Means {
    fn of(recorded: &[Prepared]) -> Self {
        let measured = recorded.len();
        Means {
            tokens: recorded.iter().map(|r| r.tokens).sum::<usize>() as f64 / measured as f64,
            blocks: recorded.iter().map(Prepared::prompt_blocks).sum::<usize>() as f64 / measured as f64,
            full_blocks: recorded.iter().map(Prepared::full_blocks).sum::<usize>() as f64 / measured as f64,
        }
    }
}

/// A store's per-request totals (µs): without tokenization (hash + cache
/// + match + update) and with it.
struct Totals {
    no_tok: Vec<f64>,
    with_tok: Vec<f64>,
}

impl Totals {
    fn of(st: &Stages, tokenize: &[f64], hash: &[f64]) -> Self {
        let measured = tokenize.len();
        let no_tok: Vec<f64> = (0..measured)
            .map(|i| hash[i] + st.cache[i] + st.lpm[i] + st.update[i])
            .collect();
        let with_tok: Vec<f64> = (0..measured).map(|i| tokenize[i] + no_tok[i]).collect();
        Totals { no_tok, with_tok }
    }
}

/// Prints the tables and writes `<out>/dispatch.json` and
/// `<out>/dispatch.svg`; `recorded` are the requests after the warm-up.
pub(super) fn write(args: &DispatchArgs, workload: &Workload, recorded: &[Prepared], passes: Passes) -> Result<()> {
    let measured = recorded.len();
    let warmup = workload.turns.len() - measured;
    let tokenize: Vec<f64> = recorded.iter().map(|r| r.tokenize_us).collect();
    let hash: Vec<f64> = recorded.iter().map(|r| r.hash_us).collect();
    let means = Means::of(recorded);
    print_settings(args, workload, warmup, &means, &passes.redis_meta);
    print_shared_stages(&tokenize, &hash);
    let per_store = per_store(&passes.rows, &tokenize, &hash);
    let ratios = ratios(&per_store.totals);
    let report = json!({
        "report": "dispatch",
        "machine": machine(),
        "workload": {
            "prompts": workload.source,
            "synthetic": workload.synthetic,
            "tokenizer": workload.tokenizer_name,
            "requests": measured,
            "warmup": warmup,
            "block_size": args.block_size,
            "mean_prompt_tokens": means.tokens,
            "mean_prompt_blocks": means.blocks,
            "mean_full_blocks": means.full_blocks,
        },
        "redis": passes.redis_meta,
        "redis_keys_deleted": passes.deleted,
        "stages": { "tokenize": summary(&tokenize), "hash": summary(&hash) },
        "stores": per_store.json,
        "ratios_redis_over_shm": ratios,
    });
    let json_path = output::write_json(&args.common.out, "dispatch", &report)?;
    let svg_path = args.common.out.join("dispatch.svg");
    plot::cdf_svg(&svg_path, &per_store.panels)?;
    println!("wrote {} and {}", json_path.display(), svg_path.display());
    Ok(())
}

/// Prints what was replayed, with which tokenizer, on which machine and
/// Redis.
fn print_settings(args: &DispatchArgs, workload: &Workload, warmup: usize, means: &Means, redis_meta: &Value) {
    let measured = workload.turns.len() - warmup;
    let Means {
        tokens: mean_tokens,
        blocks: mean_blocks,
        full_blocks: mean_full_blocks,
    } = means;
    println!(
        "\nsemlb bench dispatch: {measured} requests (+{warmup} warm-up), dialogue turns replayed in order; \
         mean prompt {mean_tokens:.0} tokens = {mean_blocks:.1} blocks of {} (prompt + answer {mean_full_blocks:.1} blocks)",
        args.block_size
    );
    println!("prompts: {}", workload.source);
    println!("tokenizer: {}", workload.tokenizer_name);
    if workload.synthetic {
        println!(
            "NOTE: no data directory: synthetic dialogues and the bundled phi-2 tokenizer; figures are not comparable with real prompts"
        );
    }
    println!("machine: {} cores", cores());
    match redis_meta {
        Value::Null => println!("Redis: skipped (--no-redis): Redis rows and ratios left out"),
        m => println!(
            "Redis: {} {} (version {})",
            if args.common.redis_url.is_some() {
                "given"
            } else {
                "private loopback redis-server"
            },
            m["url"].as_str().unwrap_or(""),
            m["version"].as_str().unwrap_or("?")
        ),
    }
}

/// Prints the stages done once for every store: tokenize and hash.
fn print_shared_stages(tokenize: &[f64], hash: &[f64]) {
    let mut common_table = Table::new(["stage (every store)", "p50", "p99"]);
    common_table.row([
        "tokenize".to_owned(),
        fmt_us(p(tokenize, 0.5)),
        fmt_us(p(tokenize, 0.99)),
    ]);
    common_table.row(["hash".to_owned(), fmt_us(p(hash, 0.5)), fmt_us(p(hash, 0.99))]);
    output::print_table("Stages before the tables", &common_table);
}

/// What [`per_store`] returns.
struct PerStore {
    /// Each store's JSON.
    json: Vec<Value>,
    /// Each store's name and its totals' p50 and p99 without tokenization,
    /// then with it.
    totals: Vec<(String, [f64; 4])>,
    /// The CDF panels of the totals without and with tokenization.
    panels: [Panel; 2],
}

/// Prints the table of stages and totals per store.
fn per_store(rows: &[(&str, Stages)], tokenize: &[f64], hash: &[f64]) -> PerStore {
    let measured = tokenize.len();
    let mut table = Table::new([
        "store",
        "cache p50",
        "cache p99",
        "match p50",
        "match p99",
        "update p50",
        "update p99",
        "total p50",
        "total p99",
        "+tok p50",
        "+tok p99",
        "RT/req",
    ]);
    let mut json_stores = Vec::new();
    let mut totals = Vec::new();
    let mut panels = [
        Panel {
            title: "dispatch without tokenization".into(),
            x_label: "µs per request (hash + cache + match + update)".into(),
            log_x: true,
            series: Vec::new(),
        },
        Panel {
            title: "dispatch with tokenization".into(),
            x_label: "µs per request (tokenize + the above)".into(),
            log_x: true,
            series: Vec::new(),
        },
    ];
    for (name, st) in rows {
        let Totals { no_tok, with_tok } = Totals::of(st, tokenize, hash);
        let rt = st.round_trips as f64 / measured as f64;
        let fused = |v: String| if st.fused { "(in match)".to_owned() } else { v };
        table.row([
            name.to_string(),
            fused(fmt_us(p(&st.cache, 0.5))),
            fused(fmt_us(p(&st.cache, 0.99))),
            fmt_us(p(&st.lpm, 0.5)),
            fmt_us(p(&st.lpm, 0.99)),
            fmt_us(p(&st.update, 0.5)),
            fmt_us(p(&st.update, 0.99)),
            fmt_us(p(&no_tok, 0.5)),
            fmt_us(p(&no_tok, 0.99)),
            fmt_us(p(&with_tok, 0.5)),
            fmt_us(p(&with_tok, 0.99)),
            if *name == "shm" { "0".into() } else { format!("{rt:.1}") },
        ]);
        json_stores.push(json!({
            "store": name,
            "cache": summary(&st.cache),
            "match": summary(&st.lpm),
            "update": summary(&st.update),
            "total_without_tokenization": summary(&no_tok),
            "total_with_tokenization": summary(&with_tok),
            "round_trips_per_request": rt,
        }));
        totals.push((
            name.to_string(),
            [p(&no_tok, 0.5), p(&no_tok, 0.99), p(&with_tok, 0.5), p(&with_tok, 0.99)],
        ));
        panels[0].series.push(Series {
            label: name.to_string(),
            values: no_tok,
        });
        panels[1].series.push(Series {
            label: name.to_string(),
            values: with_tok,
        });
    }
    output::print_table(
        "Per store (total = hash + cache + match + update; +tok adds tokenization; RT = Redis round trips;\n\
         redis-pipelined: cache and match in one pipeline, as `semlb serve --store redis` does)",
        &table,
    );
    PerStore {
        json: json_stores,
        totals,
        panels,
    }
}

/// Prints the Redis/shm ratios of the totals' quantiles (shm is the first
/// of `totals`; none with shm alone) and returns them as JSON.
fn ratios(totals: &[(String, [f64; 4])]) -> Vec<Value> {
    let mut ratios = Vec::new();
    if totals.len() > 1 {
        let shm = totals[0].1;
        let mut rt = Table::new(["Redis / shm", "total p50", "total p99", "+tok p50", "+tok p99"]);
        for (name, t) in &totals[1..] {
            let r: Vec<f64> = (0..4).map(|i| if shm[i] > 0.0 { t[i] / shm[i] } else { 0.0 }).collect();
            rt.row([
                name.clone(),
                format!("{:.1}x", r[0]),
                format!("{:.1}x", r[1]),
                format!("{:.2}x", r[2]),
                format!("{:.2}x", r[3]),
            ]);
            ratios.push(json!({
                "store": name,
                "without_tokenization_p50": r[0],
                "without_tokenization_p99": r[1],
                "with_tokenization_p50": r[2],
                "with_tokenization_p99": r[3],
            }));
        }
        output::print_table("Latency ratios, Redis over shm", &rt);
    }
    ratios
}
