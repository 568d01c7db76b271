//! The requests of `semlb bench pd`, in simulated time and deterministic
//! in `--seed`, so that every topology gets the same ones.
//!
//! - **Interference** ([`interference`]): Poisson arrivals at the load
//!   point's rate over `--window-secs` ([`poisson`]); each a one-message chat whose
//!   prompt is `--prompt-tokens` tokens of text of its own (distinct from
//!   its first block on, so no prefix cache hides its prefill) and whose
//!   answer is `--output-tokens` tokens long (the simulator's
//!   `x-semlb-output-tokens` header, `max_tokens` the range's top).
//! - **Conversations** ([`conversations`]): Poisson arrivals at
//!   `--conv-rate` over `--conv-secs`; each opens with a document of
//!   `--doc-tokens` tokens of its own and has `--turns` turns, each with
//!   an answer of `--turn-output-tokens` tokens and, after the first, a
//!   question of `--question-tokens` tokens, sent after an exponential
//!   think time of mean `--think-secs`, carrying the whole conversation
//!   so far (the history the engines may hold).
//!
//! Arrivals are a Poisson process given its number of arrivals: rate ×
//! window arrival times drawn uniformly over the window, in order (the
//! order statistics of uniform draws are a Poisson process's arrival times
//! given their count). Every load point thus offers exactly its rate: an
//! unconditioned draw over a 60 s window lands up to a fifth away from it,
//! and not in the order of the rates.
//!
//! Texts are chunks of one-token words ([`TextGen`]), so a chunk of `n`
//! tokens is `n` tokens to the engines' and the gateway's tokenizer; the
//! chat template adds a few.

use serde_json::{Value, json};

use semlb_test_support::rng::{Rng, mix};

use super::args::{PdArgs, TokenRange};
use crate::workload::text::{TextGen, engine_tokenizer};

/// The texts requests are made of: chunks of words the engines'
/// tokenizer counts one token each.
#[derive(Debug, Clone)]
pub(super) struct Texts(TextGen);

impl Texts {
    /// The generator for the engines' (bundled) tokenizer.
    pub(super) fn new() -> Self {
        Self(TextGen::new(&engine_tokenizer()))
    }

    /// `tokens` tokens of text of `seed`'s own.
    pub(super) fn chunk(&self, seed: u64, tokens: usize) -> String {
        self.0.chunk(seed, tokens)
    }
}

/// One request of the interference workload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Single {
    /// Arrival, simulated seconds from the load point's start.
    pub at_s: f64,
    /// Its prompt's seed (its text is [`Texts::chunk`] of it).
    pub seed: u64,
    /// Prompt tokens (before the chat template's).
    pub prompt_tokens: usize,
    /// Answer tokens.
    pub output_tokens: usize,
}

/// A multi-turn conversation.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Conversation {
    /// Arrival of its first turn, simulated seconds from the start.
    pub at_s: f64,
    /// The seed of its texts.
    pub seed: u64,
    /// Tokens of the document it opens with.
    pub doc_tokens: usize,
    /// Answer tokens of each turn.
    pub outputs: Vec<usize>,
    /// Simulated seconds the user thinks before each turn after the first.
    pub thinks_s: Vec<f64>,
}

/// Poisson arrivals at `rate` per second over `window` seconds, given
/// their number (`rate × window`, rounded), drawn from `seed`, each made
/// into an item by `make` (given the generator and the arrival time).
fn poisson<T>(seed: u64, rate: f64, window: f64, mut make: impl FnMut(&mut Rng, f64) -> T) -> Vec<T> {
    let mut rng = Rng::from_seed(mix(seed));
    let count = (rate * window).round() as usize;
    let mut times: Vec<f64> = (0..count).map(|_| rng.unit() * window).collect();
    times.sort_by(f64::total_cmp);
    times.into_iter().map(|t| make(&mut rng, t)).collect()
}

/// An exponential draw of mean `mean`.
fn exponential(rng: &mut Rng, mean: f64) -> f64 {
    -rng.unit().ln() * mean
}

/// A uniform draw in `range`.
fn draw(rng: &mut Rng, range: TokenRange) -> usize {
    range.min + rng.index(range.max - range.min + 1)
}

/// The interference requests of the load point `rate` (requests per
/// simulated second).
pub(super) fn interference(args: &PdArgs, rate: f64) -> Vec<Single> {
    poisson(args.seed ^ rate.to_bits(), rate, args.window_secs, |rng, at_s| Single {
        at_s,
        seed: rng.next(),
        prompt_tokens: draw(rng, args.prompt_tokens),
        output_tokens: draw(rng, args.output_tokens),
    })
}

/// The conversations of the conversations part.
pub(super) fn conversations(args: &PdArgs) -> Vec<Conversation> {
    poisson(args.seed ^ 0xc0_5e55, args.conv_rate, args.conv_secs, |rng, at_s| {
        Conversation {
            at_s,
            seed: rng.next(),
            doc_tokens: draw(rng, args.doc_tokens),
            outputs: (0..args.turns).map(|_| draw(rng, args.turn_output_tokens)).collect(),
            thinks_s: (1..args.turns).map(|_| exponential(rng, args.think_secs)).collect(),
        }
    })
}

/// A streamed chat request of `messages` whose answer may run to
/// `max_tokens` (its length is the `x-semlb-output-tokens` header's).
pub(super) fn chat_body(messages: &[Value], max_tokens: usize) -> Value {
    json!({
        "model": "semlb-sim",
        "messages": messages,
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": max_tokens,
        "temperature": 0.8,
    })
}

impl Single {
    /// Its one user message.
    pub(super) fn messages(&self, texts: &Texts) -> Vec<Value> {
        vec![json!({"role": "user", "content": texts.chunk(self.seed, self.prompt_tokens)})]
    }
}

impl Conversation {
    /// Its opening message: the document and the request.
    pub(super) fn opening(&self, texts: &Texts) -> Value {
        let document = texts.chunk(self.seed, self.doc_tokens);
        json!({"role": "user", "content": format!("{document}Summarise this document.")})
    }

    /// The question of turn `turn` (≥ 1).
    pub(super) fn question(&self, texts: &Texts, turn: usize, tokens: usize) -> Value {
        json!({"role": "user", "content": texts.chunk(mix(self.seed ^ turn as u64), tokens)})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: PdArgs,
    }

    fn args(extra: &[&str]) -> PdArgs {
        Cli::parse_from(std::iter::once("pd").chain(extra.iter().copied())).args
    }

    #[test]
    fn interference_is_poisson_at_the_rate_and_in_the_ranges() {
        let a = args(&["--window-secs", "1000"]);
        let reqs = interference(&a, 4.0);
        assert_eq!(reqs.len(), 4000);
        assert!(reqs.windows(2).all(|w| w[0].at_s <= w[1].at_s));
        assert!(reqs.iter().all(|r| (0.0..1000.0).contains(&r.at_s)));
        // Poisson: exponential gaps, mean 1/4 s, as many above the mean as
        // e^-1 of them.
        let above = reqs.windows(2).filter(|w| w[1].at_s - w[0].at_s > 0.25).count();
        assert!((1300..1650).contains(&above), "{above}");
        assert!(reqs.iter().all(|r| (4096..=8192).contains(&r.prompt_tokens)));
        assert!(reqs.iter().all(|r| (256..=512).contains(&r.output_tokens)));
        // The same requests for every topology; others for another seed.
        assert_eq!(reqs, interference(&a, 4.0));
        assert_ne!(reqs[..10], interference(&args(&["--seed", "1"]), 4.0)[..10]);
    }

    #[test]
    fn conversations_have_their_turns() {
        let a = args(&["--turns", "3"]);
        let convs = conversations(&a);
        assert!(!convs.is_empty());
        for c in &convs {
            assert_eq!((c.outputs.len(), c.thinks_s.len()), (3, 2));
            assert!((2048..=4096).contains(&c.doc_tokens));
        }
    }

    #[test]
    fn prompts_are_as_long_as_asked_and_distinct_from_their_start() {
        let texts = Texts::new();
        let tok = engine_tokenizer();
        let (a, b) = (texts.chunk(1, 4096), texts.chunk(2, 4096));
        assert_eq!(tok.encode(&a).len(), 4096);
        assert_ne!(tok.encode(&a)[..16], tok.encode(&b)[..16]);
    }
}
