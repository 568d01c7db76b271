//! `semlb bench tokenizer`: the text path's own cost, HF `tokenizers`
//! against semlb's native engine, on the same files and texts.
//!
//! 1. **Per token**: texts of about 20, 2 000 and 8 000 tokens (real
//!    HH-RLHF dialogues, concatenated; generated text without the data
//!    directory) encoded by HF's `Tokenizer::encode(text, false)` and by
//!    the native engine with its word cache (steady state; no segment cache,
//!    every text is new to it) and without any cache (`encode_uncached`:
//!    every word seen for the first time). Each engine encodes every text
//!    once to warm up, then [`PerTokenArgs::rounds`] times measured; the
//!    figure is total time over total tokens. Both engines' ids are compared
//!    on every text, and the report says whether they all agree.
//! 2. **Multi-turn replay**: HH-RLHF conversations replayed turn after turn
//!    as a chat client sends them (each turn's messages are the previous
//!    turn's plus the answer and the next question), rendered with the
//!    model's chat template (Qwen3's for Qwen3, the canonical one for
//!    phi-2), and tokenized by HF, by the native engine without a segment
//!    cache, by the native engine with one (a dispatcher's default 32 MiB),
//!    and as the gateway does: that cache, and behind it the shared segment
//!    store in shared memory, which a response process primes with each
//!    answer before the next turn arrives (its work is timed apart, as it
//!    is not on the request path). Every variant starts with empty caches:
//!    µs per request, p50 and mean.
//!
//! It measures; it asserts nothing about speed.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use semlb_tokenizer::Tokenizer;
use semlb_tokenizer::chat::{ChatMessage, ChatTemplate};
use serde_json::{Value, json};

use super::Common;
use super::output::{Table, human_ns, print_table, progress, quantile, sort, write_json};
use super::plot::{Line, line_svg};

/// `semlb bench tokenizer`.
#[derive(Debug, Clone, Args)]
pub struct TokenizerArgs {
    /// Common flags.
    #[command(flatten)]
    pub common: Common,
    /// The per-token part's settings.
    #[command(flatten)]
    pub per_token: PerTokenArgs,
    /// Conversations replayed in the multi-turn part.
    #[arg(long, value_name = "N", default_value_t = 600)]
    pub conversations: usize,
}

/// The per-token part's settings.
#[derive(Debug, Clone, Args)]
pub struct PerTokenArgs {
    /// Texts per size.
    #[arg(long, value_name = "N", default_value_t = 40)]
    pub texts: usize,
    /// Measured passes over the texts.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub rounds: usize,
}

impl TokenizerArgs {
    /// The defaults, with `common`.
    pub fn with(common: Common) -> Self {
        Self {
            common,
            per_token: PerTokenArgs { texts: 40, rounds: 5 },
            conversations: 600,
        }
    }
}

/// Text sizes measured, in tokens (about).
const SIZES: [(&str, usize); 3] = [("short (~20 tokens)", 20), ("2K tokens", 2000), ("8K tokens", 8000)];

/// One tokenizer under test: its name, file and chat template.
struct Subject {
    name: &'static str,
    json: Vec<u8>,
    template: ChatTemplate,
}

/// Runs the report: per tokenizer, the per-token part and the multi-turn
/// part, then the tables and files.
pub fn run(args: &TokenizerArgs) -> Result<()> {
    let data = args.common.data_dir();
    let dialogues = dialogues(data.as_deref());
    let source = if data.is_some() {
        "HH-RLHF dialogues"
    } else {
        "generated text (no data directory)"
    };
    let subjects = subjects(data.as_deref())?;
    let mut report = json!({"source": source, "tokenizers": []});
    let mut per_token = Table::new([
        "tokenizer",
        "text",
        "tokens",
        "HF µs/token",
        "native µs/token",
        "HF / native",
        "native, no cache",
        "HF / no cache",
        "same ids",
    ]);
    let mut replay_table = Table::new([
        "tokenizer + template",
        "workload",
        "requests",
        "tokens/request",
        "HF p50 / mean",
        "native p50 / mean",
        "+ segment cache",
        "+ shared store (gateway)",
        "native / gateway",
        "HF / gateway",
        "responder µs/answer",
        "same ids",
    ]);
    let mut lines = Vec::new();
    for subject in &subjects {
        let hf = tokenizers::Tokenizer::from_bytes(&subject.json)
            .map_err(|e| anyhow::anyhow!("HF cannot load the {} tokenizer: {e}", subject.name))?;
        let loaded = Tokenizer::from_json(&subject.json, subject.name)?;
        let native = loaded.clone().with_segment_cache(0);
        let engine = native.engine().to_string();
        let sizes = per_token_rows(args, subject, &hf, &native, &dialogues, &mut per_token, &mut lines);
        let tokenizers = Tokenizers {
            hf: &hf,
            loaded: &loaded,
        };
        let replays = multi_turn_rows(args, subject, &tokenizers, &dialogues, &mut replay_table)?;
        report["tokenizers"].as_array_mut().expect("an array").push(json!({
            "tokenizer": subject.name,
            "engine": engine,
            "per_token": sizes,
            "multi_turn": replays,
        }));
    }
    print_table(
        &format!("Tokenizer cost per token ({source}; native: word cache, no segment cache)"),
        &per_token,
    );
    print_table(
        &format!("Multi-turn replay: tokenization per request ({source}, rendered with the chat template)"),
        &replay_table,
    );
    let out = &args.common.out;
    let path = write_json(out, "tokenizer", &report)?;
    let svg = out.join("tokenizer.svg");
    line_svg(
        &svg,
        "Tokenizer cost per token",
        "text size (tokens)",
        "µs per token",
        true,
        &lines,
    )?;
    println!("\nwrote {} and {}", path.display(), svg.display());
    Ok(())
}

/// The per-token part for `subject`: a row of `table` per text size, its
/// HF and native lines (µs per token over the size) added to `lines`;
/// returns the sizes' JSON.
fn per_token_rows(
    args: &TokenizerArgs,
    subject: &Subject,
    hf: &tokenizers::Tokenizer,
    native: &Tokenizer,
    dialogues: &[Vec<(String, String)>],
    table: &mut Table,
    lines: &mut Vec<Line>,
) -> Vec<Value> {
    let mut sizes = Vec::new();
    let mut hf_line = Vec::new();
    let mut native_line = Vec::new();
    for (label, target) in SIZES {
        let texts = texts_of(dialogues, hf, target, args.per_token.texts);
        let m = per_token_costs(hf, native, &texts, args.per_token.rounds, subject.name, label);
        table.row([
            subject.name.to_owned(),
            label.to_owned(),
            m.tokens.to_string(),
            format!("{:.3}", m.hf_ns / 1e3),
            format!("{:.3}", m.native_ns / 1e3),
            format!("{:.1}x", m.hf_ns / m.native_ns),
            format!("{:.3}", m.cold_ns / 1e3),
            format!("{:.1}x", m.hf_ns / m.cold_ns),
            if m.same { "yes" } else { "NO" }.to_owned(),
        ]);
        hf_line.push((target as f64, m.hf_ns / 1e3));
        native_line.push((target as f64, m.native_ns / 1e3));
        sizes.push(json!({
            "text": label, "texts": texts.len(), "tokens": m.tokens,
            "hf_ns_per_token": m.hf_ns, "native_ns_per_token": m.native_ns,
            "native_uncached_ns_per_token": m.cold_ns, "same_ids": m.same,
        }));
    }
    lines.push(Line {
        label: format!("HF, {}", subject.name),
        points: hf_line,
    });
    lines.push(Line {
        label: format!("native, {}", subject.name),
        points: native_line,
    });
    sizes
}

/// The multi-turn part for `subject`: a row of `table` per workload (chat,
/// and agents: the same dialogues behind long shared system prompts);
/// returns the workloads' JSON.
fn multi_turn_rows(
    args: &TokenizerArgs,
    subject: &Subject,
    tokenizers: &Tokenizers<'_>,
    dialogues: &[Vec<(String, String)>],
    table: &mut Table,
) -> Result<Vec<Value>> {
    // Agents: the same dialogues behind long shared system prompts.
    let system_prompts = texts_of(&dialogues[dialogues.len() / 2..], tokenizers.hf, 2000, 4);
    let mut replays = Vec::new();
    for (workload, systems) in [
        ("chat", &[][..]),
        ("agent: 2K-token system prompt", &system_prompts[..]),
    ] {
        let r = replay(
            &subject.template,
            tokenizers,
            dialogues,
            args.conversations,
            systems,
            subject.name,
        )?;
        table.row([
            format!("{} + {}", subject.name, subject.template.renderer_name()),
            workload.to_owned(),
            r.requests.to_string(),
            format!("{:.0}", r.tokens as f64 / r.requests.max(1) as f64),
            format!("{} / {}", human_ns(r.hf.0), human_ns(r.hf.1)),
            format!("{} / {}", human_ns(r.native.0), human_ns(r.native.1)),
            format!("{} / {}", human_ns(r.cached.0), human_ns(r.cached.1)),
            format!("{} / {}", human_ns(r.gateway.0), human_ns(r.gateway.1)),
            format!("{:.1}x", r.native.1 / r.gateway.1),
            format!("{:.1}x", r.hf.1 / r.gateway.1),
            format!("{:.2}", r.priming_ns / 1e3),
            if r.same { "yes" } else { "NO" }.to_owned(),
        ]);
        replays.push(json!({
            "workload": workload,
            "template": subject.template.renderer_name(),
            "requests": r.requests,
            "tokens": r.tokens,
            "hf_ns": {"p50": r.hf.0, "mean": r.hf.1},
            "native_ns": {"p50": r.native.0, "mean": r.native.1},
            "segment_cache_ns": {"p50": r.cached.0, "mean": r.cached.1},
            "segment_cache": r.cached_stats,
            "gateway_ns": {"p50": r.gateway.0, "mean": r.gateway.1},
            "gateway_segment_cache": r.gateway_stats,
            "responder_priming_ns_per_answer": r.priming_ns,
            "same_ids": r.same,
        }));
    }
    Ok(replays)
}

/// The tokenizers measured: phi-2 (bundled, or the data directory's) and
/// Qwen3 when the data directory has it.
fn subjects(data: Option<&Path>) -> Result<Vec<Subject>> {
    let mut out = vec![Subject {
        name: "phi-2",
        json: semlb_tokenizer::BUNDLED_JSON.to_vec(),
        template: ChatTemplate::canonical(),
    }];
    if let Some(dir) = data.map(|d| d.join("tokenizers"))
        && dir.join("qwen3-tokenizer.json").is_file()
    {
        let json = std::fs::read(dir.join("qwen3-tokenizer.json")).context("reading the Qwen3 tokenizer")?;
        let template = ChatTemplate::from_tokenizer_config(&dir.join("qwen3-tokenizer_config.json"))?;
        out.push(Subject {
            name: "Qwen3",
            json,
            template,
        });
    }
    Ok(out)
}

/// Dialogues as `(role, text)` turns: HH-RLHF's, else generated ones.
fn dialogues(data: Option<&Path>) -> Vec<Vec<(String, String)>> {
    let file = data.map(|d| d.join("prompts/hh-rlhf-helpful-base-test.jsonl"));
    if let Some(text) = file.and_then(|f| std::fs::read_to_string(f).ok()) {
        let parsed: Vec<Vec<(String, String)>> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| v["chosen"].as_str().map(split_dialogue))
            .filter(|d| !d.is_empty())
            .collect();
        if !parsed.is_empty() {
            return parsed;
        }
    }
    (0..400)
        .map(|i| {
            (0..4)
                .flat_map(|t| {
                    [
                        ("user".to_owned(), format!("Question {t} of conversation {i}: how do caches, queues and routers work together in serving?")),
                        ("assistant".to_owned(), "They work together because each one ".repeat(3 + (i + t) % 7) + "and that is why."),
                    ]
                })
                .collect()
        })
        .collect()
}

/// Splits `"\n\nHuman: …\n\nAssistant: …"` into (role, text) turns.
fn split_dialogue(text: &str) -> Vec<(String, String)> {
    let mut turns = Vec::new();
    for part in text.split("\n\nHuman: ").skip(1) {
        let mut pieces = part.splitn(2, "\n\nAssistant: ");
        turns.push(("user".to_owned(), pieces.next().unwrap_or_default().to_owned()));
        if let Some(answer) = pieces.next() {
            turns.push(("assistant".to_owned(), answer.to_owned()));
        }
    }
    turns
}

/// `count` texts of about `target` tokens (by `hf`'s count), from the
/// dialogues' text.
fn texts_of(
    dialogues: &[Vec<(String, String)>],
    hf: &tokenizers::Tokenizer,
    target: usize,
    count: usize,
) -> Vec<String> {
    let flat: Vec<&str> = dialogues.iter().flatten().map(|(_, t)| t.as_str()).collect();
    let count_tokens = |t: &str| hf.encode(t, false).map_or(0, |e| e.len());
    let mut out = Vec::with_capacity(count);
    let mut next = 0usize;
    while out.len() < count {
        let mut text = String::new();
        while count_tokens(&text) < target {
            let piece = flat[next % flat.len()];
            next += 1;
            if target <= 32 {
                // A short text: one sentence-sized piece.
                text = piece.chars().take(100).collect();
                break;
            }
            text.push_str(piece);
            text.push('\n');
        }
        out.push(text);
    }
    out
}

/// What one size class cost.
struct PerToken {
    tokens: usize,
    hf_ns: f64,
    native_ns: f64,
    cold_ns: f64,
    same: bool,
}

fn per_token_costs(
    hf: &tokenizers::Tokenizer,
    native: &Tokenizer,
    texts: &[String],
    rounds: usize,
    name: &str,
    label: &str,
) -> PerToken {
    let bar = progress((3 * rounds + 1) as u64, &format!("{name} {label}"));
    let mut same = true;
    let mut tokens = 0;
    for t in texts {
        let theirs = hf
            .encode(t.as_str(), false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default();
        let ours = native.encode(t);
        same &= theirs == ours && native.encode_uncached(t) == ours;
        tokens += ours.len();
    }
    bar.inc(1);
    let time = |f: &dyn Fn(&str)| {
        let mut total = 0.0;
        for _ in 0..rounds {
            let start = Instant::now();
            for t in texts {
                f(t);
            }
            total += start.elapsed().as_nanos() as f64;
            bar.inc(1);
        }
        total / (rounds * tokens.max(1)) as f64
    };
    let hf_ns = time(&|t| {
        std::hint::black_box(hf.encode(t, false).ok());
    });
    let native_ns = time(&|t| {
        std::hint::black_box(native.encode(t));
    });
    let cold_ns = time(&|t| {
        std::hint::black_box(native.encode_uncached(t));
    });
    bar.finish_and_clear();
    PerToken {
        tokens,
        hf_ns,
        native_ns,
        cold_ns,
        same,
    }
}

/// What the multi-turn replay cost: (p50, mean) ns per request for each
/// variant.
struct Replay {
    requests: usize,
    tokens: usize,
    hf: (f64, f64),
    native: (f64, f64),
    cached: (f64, f64),
    cached_stats: String,
    gateway: (f64, f64),
    gateway_stats: String,
    /// The response process's priming, per answer.
    priming_ns: f64,
    same: bool,
}

/// The tokenizers a replay compares.
struct Tokenizers<'a> {
    hf: &'a tokenizers::Tokenizer,
    /// The loaded model (each variant gets fresh caches of it).
    loaded: &'a Tokenizer,
}

/// One request of the replay: its prompt, and the answer that follows it
/// in the dialogue (what the engine "answered").
struct Turn {
    prompt: String,
    answer: Option<String>,
}

/// Replays `conversations` dialogues, each behind one of `system_prompts`
/// (in turn; none if empty), with fresh caches for every variant.
fn replay(
    template: &ChatTemplate,
    t: &Tokenizers<'_>,
    dialogues: &[Vec<(String, String)>],
    conversations: usize,
    system_prompts: &[String],
    name: &str,
) -> Result<Replay> {
    let uncached = t.loaded.clone().with_segment_cache(0);
    let cached = t.loaded.clone().with_segment_cache(32 << 20);
    // Every turn's prompt, in the order a gateway sees them.
    let mut turns: Vec<Turn> = Vec::new();
    for (i, d) in dialogues.iter().take(conversations).enumerate() {
        let mut messages: Vec<ChatMessage<'_>> = Vec::new();
        if !system_prompts.is_empty() {
            messages.push(ChatMessage::new(
                "system",
                system_prompts[i % system_prompts.len()].as_str(),
            ));
        }
        for (role, text) in d {
            if role == "assistant"
                && let Some(last) = turns.last_mut()
                && last.answer.is_none()
            {
                last.answer = Some(text.clone());
            }
            messages.push(ChatMessage::new(role.as_str(), text.as_str()));
            if role == "user"
                && let Ok(prompt) = template.render(&messages)
            {
                turns.push(Turn { prompt, answer: None });
            }
        }
    }
    let bar = progress(5, &format!("{name} multi-turn"));
    let mut same = true;
    let mut tokens = 0;
    let check = t.loaded.clone().with_segment_cache(32 << 20);
    let mut reference = Vec::with_capacity(turns.len());
    for turn in &turns {
        let theirs =
            t.hf.encode(turn.prompt.as_str(), false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default();
        same &= check.encode(&turn.prompt) == theirs;
        tokens += theirs.len();
        reference.push(theirs);
    }
    bar.inc(1);
    let summarize = |mut ns: Vec<f64>| {
        let mean = ns.iter().sum::<f64>() / ns.len().max(1) as f64;
        sort(&mut ns);
        (quantile(&ns, 0.5), mean)
    };
    let measure = |f: &dyn Fn(&str)| {
        let ns: Vec<f64> = turns
            .iter()
            .map(|turn| {
                let start = Instant::now();
                f(&turn.prompt);
                start.elapsed().as_nanos() as f64
            })
            .collect();
        bar.inc(1);
        summarize(ns)
    };
    let hf_cost = measure(&|p| {
        std::hint::black_box(t.hf.encode(p, false).ok());
    });
    let native_cost = measure(&|p| {
        std::hint::black_box(uncached.encode(p));
    });
    let cached_cost = measure(&|p| {
        std::hint::black_box(cached.encode(p));
    });
    // The gateway: a dispatcher (its cache, then the store) and a response
    // process priming the store with each answer, as `Responder` does.
    let segment = std::sync::Arc::new(shm_layout::Segment::heap(&shm_layout::LayoutPlan::for_size(64 << 20)?));
    let store = std::sync::Arc::new(semlb::store::segments::ShmSegmentStore::new(segment));
    let dispatcher = t
        .loaded
        .clone()
        .with_segment_cache(32 << 20)
        .with_shared_segments(store.clone());
    let responder = t.loaded.clone().with_segment_cache(0).with_shared_segments(store);
    let mut ns = Vec::with_capacity(turns.len());
    let (mut priming, mut answers) = (0.0, 0usize);
    let mut scratch = Vec::new();
    for (turn, theirs) in turns.iter().zip(&reference) {
        let start = Instant::now();
        let ids = dispatcher.encode(&turn.prompt);
        ns.push(start.elapsed().as_nanos() as f64);
        same &= ids == *theirs;
        if let Some(answer) = &turn.answer {
            let start = Instant::now();
            scratch.clear();
            responder.encode_into(answer, &mut scratch);
            let framed = [
                ChatMessage::new("user", "."),
                ChatMessage::new("assistant", answer.as_str()),
                ChatMessage::new("user", "."),
            ];
            if let Ok(rendered) = template.render(&framed) {
                responder.encode_into(&rendered, &mut scratch);
            }
            priming += start.elapsed().as_nanos() as f64;
            answers += 1;
        }
    }
    let gateway_cost = summarize(ns);
    bar.finish_and_clear();
    Ok(Replay {
        requests: turns.len(),
        tokens,
        hf: hf_cost,
        native: native_cost,
        cached: cached_cost,
        cached_stats: format!("{:?}", cached.segment_cache_stats()),
        gateway: gateway_cost,
        gateway_stats: format!("{:?}", dispatcher.segment_cache_stats()),
        priming_ns: priming / answers.max(1) as f64,
        same,
    })
}
