//! Property tests: on random strings (0..300 chars from weighted pools of
//! the characters tokenizers get wrong), semlb's ids equal HF's, for
//! phi-2, Qwen3 and the Llama-3-style variant. A failure is shrunk to a
//! small input and printed with both id lists.
//!
//! `PROPTEST_CASES` sets the cases per tokenizer (default 20 000);
//! `PROPTEST_RNG_SEED` replays a run (each run prints its seed).
//!
//! Each test first checks that the native engine tokenizes; to run them
//! against HF (checking the harness) set `SEMLB_CONFORMANCE_ALLOW_HF=1`.

mod support;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};
use support::corpus::{LLAMA3_SPECIALS, QWEN3_SPECIALS, WHITESPACE};
use support::{Subject, variants};

/// Cases per tokenizer.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
}

/// The seed: `PROPTEST_RNG_SEED`, else a fresh one (printed).
fn seed() -> u64 {
    std::env::var("PROPTEST_RNG_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            use std::hash::{BuildHasher, RandomState};
            RandomState::new().hash_one(std::time::SystemTime::now())
        })
}

const MAX_CHARS: usize = 300;

/// One piece of a random string: a char or a short sequence, from weighted
/// pools.
fn piece() -> impl Strategy<Value = String> {
    let one = |c: char| c.to_string();
    const EMOJI: &[&str] = &[
        "👍",
        "👍🏽",
        "👨‍👩‍👧‍👦",
        "🏳️‍🌈",
        "🇫🇷",
        "☺️",
        "1️⃣",
        "\u{200d}",
        "\u{fe0f}",
        "\u{1f3fb}",
        "🤷‍♂️",
    ];
    let specials: Vec<&'static str> = QWEN3_SPECIALS
        .iter()
        .chain(LLAMA3_SPECIALS)
        .copied()
        .chain([
            "<|",
            "|>",
            "im_start",
            "im_end",
            "endoftext",
            "<",
            "|",
            ">",
            "</",
            "think",
        ])
        .collect();
    prop_oneof![
        30 => prop::char::range(' ', '~').prop_map(one),
        6 => prop::char::range('0', '9').prop_map(one),
        8 => prop::sample::select(WHITESPACE).prop_map(one),
        6 => prop::sample::select(&["\r", "\n", "\r\n", "\n\r", " \n", "\n\n"][..]).prop_map(str::to_owned),
        3 => prop::sample::select(&["  ", "    ", "\t\t", "        "][..]).prop_map(str::to_owned),
        8 => prop::sample::select(&['\'', '’', 's', 't', 'm', 'd', 'r', 'e', 'v', 'l', 'S', 'ſ', 'L', 'T'][..]).prop_map(one),
        4 => prop::char::range('\u{300}', '\u{36f}').prop_map(one),
        2 => prop::char::range('\u{1100}', '\u{11ff}').prop_map(one),
        4 => prop::char::range('\u{4e00}', '\u{9fff}').prop_map(one),
        2 => prop::char::range('\u{3040}', '\u{30ff}').prop_map(one),
        2 => prop::char::range('\u{ac00}', '\u{d7a3}').prop_map(one),
        2 => prop::char::range('\u{600}', '\u{6ff}').prop_map(one),
        2 => prop::char::range('\u{900}', '\u{97f}').prop_map(one),
        2 => prop::char::range('\u{370}', '\u{4ff}').prop_map(one),
        3 => prop::char::range('\u{1f300}', '\u{1faff}').prop_map(one),
        3 => prop::sample::select(EMOJI).prop_map(str::to_owned),
        4 => prop::sample::select(specials).prop_map(str::to_owned),
        2 => prop::sample::select(&['٣', '४', '５', '²', '½', 'Ⅻ', '①', '𝟙'][..]).prop_map(one),
        4 => any::<char>().prop_map(one),
    ]
}

/// A random string of at most [`MAX_CHARS`] chars.
fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(piece(), 0..MAX_CHARS).prop_map(|pieces| pieces.concat().chars().take(MAX_CHARS).collect())
}

/// Runs the property "ours == HF" on `cases` random strings; returns the
/// shrunk failing input and its report, if any.
fn run(subject: &Subject, cases: u32, seed: u64) -> Result<usize, (String, String)> {
    let config = Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let bytes = std::sync::atomic::AtomicUsize::new(0);
    let outcome = runner.run(&text(), |s| {
        bytes.fetch_add(s.len(), std::sync::atomic::Ordering::Relaxed);
        match subject.check("proptest", &s) {
            None => Ok(()),
            Some(m) => Err(TestCaseError::fail(m.describe(&subject.reference))),
        }
    });
    match outcome {
        Ok(()) => Ok(bytes.into_inner()),
        Err(TestError::Fail(reason, input)) => Err((input, reason.to_string())),
        Err(TestError::Abort(reason)) => panic!("{}: proptest aborted: {reason}", subject.name),
    }
}

/// The property for one tokenizer, with its report.
fn check(subject: &Subject) {
    let (cases, seed) = (cases(), seed());
    match run(subject, cases, seed) {
        Ok(bytes) => println!(
            "proptest {} [{}]: {cases} random strings ({bytes} bytes, seed {seed}): ids equal HF's",
            subject.name,
            subject.ours.engine()
        ),
        Err((input, report)) => panic!(
            "{}: ids differ from HF's; smallest failing input found {input:?} (seed {seed}; PROPTEST_RNG_SEED={seed} replays)\n{report}",
            subject.name
        ),
    }
}

#[test]
fn phi2_random_strings_match_hf() {
    let subject = Subject::bundled_phi2();
    subject.require_native("gpt2");
    check(&subject);
}

#[test]
fn qwen3_random_strings_match_hf() {
    let Some(subject) = Subject::qwen3() else { return };
    subject.require_native("qwen2");
    check(&subject);
}

#[test]
fn llama3_style_random_strings_match_hf() {
    let Some(qwen3) = variants::qwen3() else { return };
    let subject = Subject::from_value("llama3-style (Qwen3 vocabulary)", &variants::llama3_style(qwen3));
    subject.require_native("llama3");
    check(&subject);
}

/// The property finds a planted difference and shrinks it: a reference
/// with the ids of `Ġthe` and `,` swapped fails on a string of a few chars.
#[test]
fn property_finds_and_shrinks_a_planted_difference() {
    let subject = Subject::planted_difference();
    let (input, report) = run(&subject, 2_000, 42).expect_err("the planted difference is found");
    println!("shrunk to {input:?}:\n{report}");
    assert!(input.chars().count() <= 4, "shrunk to a short string, got {input:?}");
    assert!(input.contains(',') || input.contains(" the"), "{input:?}");
    assert!(report.contains("first difference at id #"), "{report}");
}

/// The strings are what the pools promise: lengths up to the limit, all
/// pools drawn from.
#[test]
fn random_strings_cover_the_pools() {
    let mut runner = TestRunner::new(Config {
        rng_seed: RngSeed::Fixed(7),
        ..Config::default()
    });
    let strategy = text();
    let (mut longest, mut total) = (0, 0);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..2_000 {
        let s = strategy.new_tree(&mut runner).unwrap().current();
        let n = s.chars().count();
        assert!(n <= MAX_CHARS);
        longest = longest.max(n);
        total += n;
        for c in s.chars() {
            let pool = match c {
                ' '..='~' => "ascii",
                '\u{300}'..='\u{36f}' => "combining",
                '\u{4e00}'..='\u{9fff}' => "cjk",
                '\u{1f300}'..='\u{1faff}' => "emoji",
                '\u{200d}' => "zwj",
                c if c.is_whitespace() => "whitespace",
                'ſ' | '’' => "apostrophes",
                _ => "other",
            };
            seen.insert(pool);
        }
    }
    println!("2000 random strings: {total} chars, longest {longest}, pools {seen:?}");
    assert!(longest >= 250, "long strings are generated");
    assert_eq!(seen.len(), 8, "every pool is drawn from: {seen:?}");
}
