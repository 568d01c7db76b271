//! Conformance: semlb's token ids equal HF `tokenizers`' on every corpus
//! string, for the real tokenizers (phi-2 bundled, Qwen3 from shared data),
//! for variants synthesized from them (Llama-3-style pre-tokenizer,
//! `ignore_merges`, added-vocabulary rules), and for forms the native
//! engine must leave to HF.
//!
//! The corpus is `support/corpus.rs` (100 K generated strings, plus
//! HH-RLHF and the Mooncake trace when present). Each comparison prints
//! its counts per source.
//!
//! Every comparison first checks that the native engine tokenizes (so HF
//! is never compared with itself); to check the harness itself against HF,
//! run with `SEMLB_CONFORMANCE_ALLOW_HF=1`.

mod support;

use support::corpus::{Corpus, GENERATED_TARGET, Source};
use support::{Subject, variants};

/// Strings written for the added-vocabulary variants: the tokens next to
/// each other, to words, to spaces of every kind, in other spellings.
fn added_vocabulary_corpus() -> Corpus {
    // The variants' added tokens, then other spellings of them (decomposed,
    // compatibility forms, parts) and tokens they do not add.
    let others = [
        "cafe\u{301}",
        "nai\u{308}ve",
        "·",
        "\u{212b}",
        "A\u{30a}",
        "<|endoftext|>",
        "   ",
    ];
    let tokens: Vec<&str> = support::corpus::VARIANT_ADDED_TOKENS
        .iter()
        .copied()
        .chain(others)
        .collect();
    let glue = [
        "", " ", "  ", "\t", "\n", " \n ", "\u{a0}", "\u{3000}", "x", "_", "1", ",", "'s", "é",
    ];
    let mut strings = Vec::new();
    for &a in &tokens {
        for g in glue {
            for &b in &tokens {
                strings.push(format!("{a}{g}{b}"));
            }
            strings.push(format!("{g}{a}{g}"));
            strings.push(format!("word{g}{a}{g}word"));
            strings.push(format!("Hello {a}, say{g}{a}!"));
        }
    }
    for s in [
        "hello",
        "Hello",
        "HELLO",
        "hellow",
        "ahello",
        "hello_",
        "_hello",
        "hello1",
        "1hello",
        "héllo",
        "hello\u{301}",
        "hello-world",
        "hello.world",
        "hello中",
        "中hello",
        "(hello)",
        "hello hello hello",
        "hellohello",
    ] {
        strings.push(s.to_owned());
        strings.push(format!(" {s} "));
    }
    Corpus {
        sources: vec![Source {
            name: "gen:added-vocabulary",
            strings,
        }],
    }
}

#[test]
fn corpus_is_large_deterministic_and_covers_the_edge_cases() {
    let corpus = Corpus::get();
    println!("conformance corpus:\n{}", corpus.describe());
    let generated: usize = corpus
        .sources
        .iter()
        .filter(|s| s.name.starts_with("gen:"))
        .map(|s| s.strings.len())
        .sum();
    assert!(
        generated >= GENERATED_TARGET,
        "{generated} generated strings, fewer than {GENERATED_TARGET}"
    );
    assert!(corpus.len() >= 100_000);
    for s in &corpus.sources {
        assert!(!s.strings.is_empty(), "source {} is empty", s.name);
    }
    // Seeded: a second build is the same, string for string.
    let again = Corpus::build();
    assert_eq!(again.len(), corpus.len());
    for (a, b) in corpus.sources.iter().zip(&again.sources) {
        assert_eq!(a.name, b.name);
        assert!(a.strings == b.strings, "source {} differs between two builds", a.name);
    }
    // No string twice.
    let all: std::collections::HashSet<&str> = corpus
        .sources
        .iter()
        .flat_map(|s| &s.strings)
        .map(String::as_str)
        .collect();
    assert_eq!(all.len(), corpus.len(), "the corpus has duplicates");
    // The long ones the brief asks for.
    let longest = |pred: &dyn Fn(&str) -> bool| all.iter().filter(|s| pred(s)).map(|s| s.len()).max().unwrap_or(0);
    assert!(longest(&|_| true) >= 40_000, "a 40 KB text");
    assert!(
        longest(&|s| s.chars().all(char::is_alphabetic)) >= 10_000,
        "a 10 K-char word"
    );
    assert!(
        longest(&|s| s.bytes().all(|b| b.is_ascii_digit())) >= 5_000,
        "5 K digits"
    );
    // A few edge cases by name.
    for needle in [
        "",
        "e\u{301}",
        "\u{1100}\u{1161}\u{11a8}",
        "👨‍👩‍👧‍👦",
        "🇫🇷",
        "'ſ",
        "it’s",
        "<|im_start|>",
        "|im_start|>",
        "\u{feff}",
        "\u{10ffff}",
        "\u{d7ff}",
        "\u{e000}",
        "\u{fdd0}",
        "\u{85}",
        "\r\n\r",
        "\n\r",
    ] {
        assert!(
            all.iter().any(|s| s.contains(needle)),
            "no corpus string contains {needle:?}"
        );
    }
    for n in 1..=40 {
        assert!(
            all.iter()
                .any(|s| s.len() == n && s.bytes().all(|b| b.is_ascii_digit())),
            "no {n}-digit number"
        );
    }
}

/// The comparison finds and shows a difference (it is not vacuous): a
/// reference whose vocabulary has two ids swapped must disagree.
#[test]
fn harness_reports_mismatches() {
    let subject = Subject::planted_difference();
    let corpus = Corpus {
        sources: vec![Source {
            name: "test",
            strings: vec![
                "no difference here".into(),
                "in the end, the".into(),
                "x".repeat(3000) + " the",
                "unchanged again".into(),
            ],
        }],
    };
    let report = subject.compare(&corpus);
    assert_eq!(report.strings(), 4);
    assert_eq!(report.mismatch_count(), 2);
    let first = &report.mismatches[0];
    assert_eq!(first.text, "in the end, the");
    assert_eq!(first.first_difference(), 1, "`in` is equal, ` the` differs");
    let shown = first.describe(&subject.reference);
    assert!(shown.contains("first difference at id #1"), "{shown}");
    assert!(shown.contains("\"in the end, the\""), "{shown}");
    let long = report.mismatches[1].describe(&subject.reference);
    assert!(
        long.contains("of 3004)"),
        "a long text is shown around the difference: {long}"
    );
    println!("(a panic message from assert_no_mismatch follows: expected, it is what is being tested)");
    let failure = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        report.assert_no_mismatch(&subject.reference);
    }));
    assert!(failure.is_err(), "assert_no_mismatch must fail on mismatches");
    // HF failing on a text counts as agreement only if ours is empty.
    let m = subject.check("test", "").map(|m| m.describe(&subject.reference));
    assert!(m.is_none(), "the empty string agrees: {m:?}");
}

#[test]
fn phi2_bundled_matches_hf_on_the_corpus() {
    let subject = Subject::bundled_phi2();
    subject.require_native("gpt2");
    subject.assert_conforms(Corpus::get());
    subject.assert_conforms(&subject.vocabulary_corpus());
}

#[test]
fn qwen3_matches_hf_on_the_corpus() {
    let Some(subject) = Subject::qwen3() else { return };
    subject.require_native("qwen2");
    subject.assert_conforms(Corpus::get());
    subject.assert_conforms(&subject.vocabulary_corpus());
}

#[test]
fn llama3_style_matches_hf_on_the_corpus() {
    let Some(qwen3) = variants::qwen3() else { return };
    let subject = Subject::from_value("llama3-style (Qwen3 vocabulary)", &variants::llama3_style(qwen3));
    subject.require_native("llama3");
    // The post-processor is live (HF adds the BOS when asked to), and
    // `encode` must not add it.
    let bos = variants::llama3_bos_id(qwen3);
    let with_bos = subject.reference.encode("Hello world", true).unwrap();
    assert_eq!(
        with_bos.get_ids()[0],
        bos,
        "the variant's template adds <|begin_of_text|>"
    );
    assert_eq!(
        subject.ours.encode("Hello world"),
        &with_bos.get_ids()[1..],
        "encode adds no BOS"
    );
    assert_eq!(subject.ours.encode("<|begin_of_text|>"), [bos]);
    subject.assert_conforms(Corpus::get());
    subject.assert_conforms(&subject.vocabulary_corpus());
}

/// `ignore_merges` where it decides the ids: the first merges pruned (see
/// `variants::ignore_merges`), in the gpt2 and llama3 dialects.
#[test]
fn ignore_merges_with_pruned_merges_matches_hf() {
    let subject = Subject::from_value(
        "phi-2 + ignore_merges, first 8 merges pruned",
        &variants::ignore_merges(variants::phi2(), 8),
    );
    subject.require_native("gpt2");
    subject.assert_conforms(&Corpus::get().sample(2));
    subject.assert_conforms(&subject.vocabulary_corpus());

    let Some(qwen3) = variants::qwen3() else { return };
    let subject = Subject::from_value(
        "llama3-style + first 8 merges pruned",
        &variants::ignore_merges(&variants::llama3_style(qwen3), 8),
    );
    subject.require_native("llama3");
    subject.assert_conforms(&Corpus::get().sample(4));
}

#[test]
fn phi2_with_added_vocabulary_rules_matches_hf() {
    let json = variants::phi2_added_vocabulary(variants::phi2());
    let subject = Subject::from_value("phi-2 + lstrip/rstrip/single_word/normalized added tokens", &json);
    subject.require_native("gpt2");
    subject.assert_conforms(&added_vocabulary_corpus());
    subject.assert_conforms(&Corpus::get().only("gen:").sample(2));
}

#[test]
fn qwen3_with_normalized_added_tokens_matches_hf() {
    let Some(qwen3) = variants::qwen3() else { return };
    let json = variants::qwen3_normalized_added(qwen3);
    let subject = Subject::from_value("Qwen3 + normalized added tokens", &json);
    subject.require_native("qwen2");
    subject.assert_conforms(&added_vocabulary_corpus());
    subject.assert_conforms(&Corpus::get().only("gen:").sample(4));
}

/// HF behaviour the variants rely on, checked on HF itself (so a variant
/// that stops exercising what it claims is noticed), and written down for
/// the engine. Independent of the engine.
#[test]
fn variants_exercise_what_they_claim() {
    let tokens = |subject: &Subject, text: &str| -> Vec<String> {
        let ids = subject.reference_ids(text).unwrap();
        ids.iter()
            .map(|&id| subject.reference.id_to_token(id).unwrap())
            .collect()
    };

    // ignore_merges decides the ids of many strings once merges are pruned.
    let on = Subject::from_value("ignore_merges", &variants::ignore_merges(variants::phi2(), 8));
    let off = Subject::from_value("pruned merges", &variants::pruned_merges(variants::phi2(), 8));
    let sample = Corpus::get().only("gen:").sample(20);
    let strings: Vec<&String> = sample.sources.iter().flat_map(|s| &s.strings).collect();
    let changed = strings
        .iter()
        .filter(|s| on.reference_ids(s) != off.reference_ids(s))
        .count();
    println!(
        "ignore_merges changes HF's ids of {changed} of {} sampled strings",
        strings.len()
    );
    assert!(
        changed * 20 > strings.len(),
        "ignore_merges should matter for over 5 % of them"
    );
    assert_eq!(tokens(&on, " the"), ["Ġthe"], "a whole pre-token in the vocabulary");
    assert_ne!(
        tokens(&off, " the"),
        ["Ġthe"],
        "BPE cannot build it without the pruned merges"
    );

    // Added-vocabulary rules (see variants::phi2_added_vocabulary).
    let added = Subject::from_value(
        "phi-2 + added vocabulary",
        &variants::phi2_added_vocabulary(variants::phi2()),
    );
    assert_eq!(
        added.reference.token_to_id("<|tool|>"),
        Some(50295),
        "numbered after the last added token"
    );
    assert_eq!(
        added.reference.token_to_id("hello"),
        Some(31373),
        "a vocabulary token keeps its id"
    );
    // lstrip and rstrip take the spaces around `<|tool|>` into the token.
    assert_eq!(tokens(&added, "a  <|tool|>  b"), ["a", "<|tool|>", "b"]);
    // Leftmost-longest among the non-normalized tokens.
    assert_eq!(tokens(&added, "x<|tool|>xy"), ["x", "<|tool|>x", "y"]);
    // A space before an added token is a token of its own (it is cut off
    // from the word after it).
    assert_eq!(tokens(&added, "say hello"), ["say", "Ġ", "hello"]);
    // single_word: inside a word, `naïve` is not the added token; with
    // lstrip and rstrip it takes the spaces around it.
    assert_eq!(tokens(&added, "  naïve  "), ["naïve"]);
    assert_eq!(tokens(&added, "xnaïve"), ["x", "na", "Ã¯ve"]);
    // HF quirk: `[SEP]` (normalized, rstrip) takes the two spaces after it,
    // and phi-2's two-space token (normalized too, same pass) still
    // matches them: the spaces are emitted twice.
    assert_eq!(tokens(&added, "[SEP]  a"), ["[SEP]", "  ", "a"]);
    // A normalized token starting with a space loses to a longer
    // leftmost match (phi-2's two-space token).
    assert_eq!(tokens(&added, "a ·b"), ["a", " ·", "b"]);
    assert_eq!(tokens(&added, "a  ·b"), ["a", "  ", "Â·", "b"]);

    // truncation and padding in the tokenizer.json apply to
    // `encode(.., add_special_tokens = false)` too.
    let either = variants::either_engine(variants::phi2());
    let case = |needle: &str| {
        let (name, json) = either
            .iter()
            .find(|(name, _)| name.contains(needle))
            .unwrap_or_else(|| panic!("no case {needle:?}"));
        Subject::from_value(name, json)
    };
    let long = "The quick brown fox jumps over the lazy dog, again and again.";
    assert_eq!(case("truncation").reference_ids(long).unwrap().len(), 7);
    let padded = case("padding").reference_ids("Hi").unwrap();
    assert_eq!(
        padded,
        [
            17250, 50256, 50256, 50256, 50256, 50256, 50256, 50256, 50256, 50256, 50256, 50256
        ]
    );

    // HF does not use the ids written in added_tokens.
    let subject = case("JSON ids");
    assert_eq!(subject.reference.token_to_id("<|tool|>"), Some(50295));
    assert_eq!(subject.reference.token_to_id("<mask>"), Some(50296));

    // Normalized added tokens match after NFC (Qwen3 only).
    if let Some(qwen3) = variants::qwen3() {
        let q = Subject::from_value("Qwen3 + normalized added", &variants::qwen3_normalized_added(qwen3));
        let cafe = q.reference.token_to_id("café").unwrap();
        assert_eq!(
            q.reference_ids("cafe\u{301}").unwrap(),
            [cafe],
            "NFC, then the added token"
        );
        let angstrom = q.reference.token_to_id("Å").unwrap();
        assert_eq!(
            q.reference_ids("\u{212b}").unwrap(),
            [angstrom],
            "U+212B is U+00C5 after NFC"
        );
        let naive = q.reference.token_to_id("naïve").unwrap();
        assert_eq!(q.reference_ids("naïve").unwrap(), [naive]);
        assert!(
            !q.reference_ids("nai\u{308}ve").unwrap().contains(&naive),
            "a normalized: false token is matched before NFC"
        );
    }
}

/// Forms the native engine must not claim: HF tokenizes them, with a
/// reason, and the ids are HF's.
#[test]
fn forms_the_native_engine_must_leave_to_hf() {
    let corpus = Corpus::get().only("gen:").sample(25);
    for (name, json) in variants::must_fall_back(variants::phi2()) {
        let subject = Subject::from_value(name, &json);
        subject.require_hf();
        subject.assert_conforms(&corpus);
    }
    // Dropout makes HF's own ids random: HF must tokenize, and the ids
    // still spell the text.
    let subject = Subject::from_value("phi-2 + BPE dropout", &variants::with_dropout(variants::phi2()));
    subject.require_hf();
    for text in [
        "Hello, world! The quick brown fox.",
        "naïve café 你好 👍🏽",
        "  indented\n\tcode();",
    ] {
        let ids = subject.ours.encode(text);
        assert_eq!(subject.ours.decode(&ids), text, "dropout ids decode to the text");
    }
}

/// Forms either engine may take: whichever does, the ids are HF's.
#[test]
fn forms_either_engine_may_take_give_hf_ids() {
    let corpus = Corpus::get().only("gen:").sample(25);
    for (name, json) in variants::either_engine(variants::phi2()) {
        let subject = Subject::from_value(name, &json);
        println!("{name}: {}", subject.ours.engine());
        subject.assert_conforms(&corpus);
    }
}

/// Writes the corpus for `tests/python/check_tokenize.py --corpus`: one
/// JSON object `{"source": ..., "text": ...}` per line, to the file
/// `SEMLB_CORPUS_OUT` names (else to a temporary file, removed after), and
/// checks that it reads back string for string:
/// `SEMLB_CORPUS_OUT=corpus.jsonl cargo test -p semlb-tokenizer --test conformance export_corpus`.
#[test]
fn export_corpus_for_the_python_checker() {
    use std::io::{BufRead, Write};
    let (path, keep) = match std::env::var_os("SEMLB_CORPUS_OUT") {
        Some(p) => (std::path::PathBuf::from(p), true),
        None => (
            std::env::temp_dir().join(format!("semlb-conformance-corpus-{}.jsonl", std::process::id())),
            false,
        ),
    };
    let corpus = Corpus::get();
    let mut out = std::io::BufWriter::new(std::fs::File::create(&path).expect("the corpus file can be created"));
    for source in &corpus.sources {
        for text in &source.strings {
            writeln!(out, "{}", serde_json::json!({"source": source.name, "text": text})).unwrap();
        }
    }
    out.flush().unwrap();
    drop(out);
    let reader = std::io::BufReader::new(std::fs::File::open(&path).unwrap());
    let mut expected = corpus
        .sources
        .iter()
        .flat_map(|s| s.strings.iter().map(move |t| (s.name, t)));
    let mut lines = 0;
    for line in reader.lines() {
        let value: serde_json::Value = serde_json::from_str(&line.unwrap()).expect("a line is JSON");
        let (name, text) = expected.next().expect("no more lines than strings");
        assert_eq!(value["source"], *name);
        assert_eq!(value["text"].as_str(), Some(text.as_str()));
        lines += 1;
    }
    assert_eq!(lines, corpus.len());
    if keep {
        println!("wrote {lines} strings to {}:\n{}", path.display(), corpus.describe());
    } else {
        std::fs::remove_file(&path).unwrap();
        println!("{lines} strings written and read back (set SEMLB_CORPUS_OUT to keep the file)");
    }
}
