//! Rendering chat messages into a prompt with Qwen3's chat template:
//! minijinja (the template as `transformers` renders it) against the
//! native renderer that reproduces it byte for byte.
//!
//! * `short`: one user message, "Say hello in one short sentence please.";
//! * `long`: a multi-turn conversation of about 2 000 tokens, real HH-RLHF
//!   dialogues (`shared/data/prompts`) joined turn after turn, or generated
//!   turns when `shared` is absent.
//!
//! The template is Qwen3's `tokenizer_config.json` from `shared/data`, or,
//! when absent, the Qwen3 template revision kept in `tests/templates`.
//! `cargo bench -p semlb-tokenizer --bench chat`. It prints figures; it
//! asserts nothing (beyond both renderers giving the same prompt).
//!
//! Figures (medians; 2 shared cores, Qwen3 template and HH-RLHF from
//! `shared`, 2026-11-23): short (16 tokens): Jinja 4.6 µs, native 36 ns
//! (`render_into` a reused buffer: 22 ns), ~125x; long (53 messages, 2 105
//! tokens): Jinja 92 µs, native 2.2 µs (`render_into`: 1.6 µs), ~40x.

#[path = "../tests/chat_support/mod.rs"]
mod support;

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use semlb_tokenizer::chat::{ChatMessage, ChatTemplate};
use semlb_tokenizer::{Tokenizer, test_data};

/// Roughly 4 characters a token: the long conversation's content size.
const LONG_CHARS: usize = 7_000;

fn qwen3_template() -> ChatTemplate {
    match test_data::tokenizer_file("qwen3-tokenizer_config.json") {
        Some(path) => ChatTemplate::from_tokenizer_config(&path).expect("Qwen3 chat template loads"),
        None => ChatTemplate::from_source(&support::template_source("qwen3-ortx.jinja"), None, Some("<|im_end|>"))
            .expect("the Qwen3 template revision loads"),
    }
}

/// Turns of real dialogues, one after the other, until about
/// [`LONG_CHARS`] of content, ending with a user turn.
fn long_conversation() -> Vec<ChatMessage<'static>> {
    let turns: Vec<support::Turn> = match support::hh_rlhf_dialogues() {
        Some(dialogues) => dialogues.into_iter().flatten().collect(),
        None => (0..200)
            .flat_map(|i| {
                [
                    (
                        "user".to_owned(),
                        format!("Question {i}: how do caches, routing and batching interact?"),
                    ),
                    ("assistant".to_owned(), "An answer that goes on and on. ".repeat(8)),
                ]
            })
            .collect(),
    };
    let mut messages = Vec::new();
    let mut chars = 0;
    for (role, content) in turns {
        // Consecutive dialogues can put two user turns in a row: keep the
        // conversation alternating.
        if messages.last().is_some_and(|m: &ChatMessage| m.role == role) {
            continue;
        }
        let done = chars >= LONG_CHARS && role == "user";
        chars += content.len();
        messages.push(ChatMessage::new(role, content));
        if done {
            break;
        }
    }
    messages
}

fn render(c: &mut Criterion) {
    let native = qwen3_template();
    let jinja = native.with_jinja_renderer();
    let short = vec![ChatMessage::new("user", "Say hello in one short sentence please.")];
    let long = long_conversation();

    let tokenizer = test_data::tokenizer_file("qwen3-tokenizer.json")
        .map(|p| Tokenizer::from_file(&p).expect("Qwen3 tokenizer loads"))
        .unwrap_or_else(Tokenizer::bundled);
    for (name, messages) in [("short", &short), ("long", &long)] {
        let prompt = native.render(messages).expect("renders");
        assert_eq!(
            prompt,
            jinja.render(messages).expect("renders"),
            "native and Jinja differ"
        );
        eprintln!(
            "{name}: {} messages, {} bytes, {} tokens; renderers: {} / {}",
            messages.len(),
            prompt.len(),
            tokenizer.encode(&prompt).len(),
            native.renderer_name(),
            jinja.renderer_name()
        );
    }

    let mut group = c.benchmark_group("chat_render_qwen3");
    for (name, messages) in [("short", &short), ("long", &long)] {
        group.bench_function(format!("jinja/{name}"), |b| {
            b.iter(|| jinja.render(black_box(messages)))
        });
        group.bench_function(format!("native/{name}"), |b| {
            b.iter(|| native.render(black_box(messages)))
        });
        let mut out = String::new();
        group.bench_function(format!("native_into/{name}"), |b| {
            b.iter(|| {
                out.clear();
                native.render_into(black_box(messages), &mut out)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, render);
criterion_main!(benches);
