//! Shared by the conformance tests (`conformance.rs`, `properties.rs`,
//! `segment_cache.rs`): the tokenizer under test next to its reference,
//! the engine checks, and the comparison that reports mismatches.
//!
//! The reference is HF `tokenizers` called directly (never through
//! [`semlb_tokenizer::Tokenizer`]), loaded from the same tokenizer.json
//! bytes, with `encode(text, add_special_tokens = false)`.
//!
//! # Native or HF
//!
//! A comparison only means something when semlb's own engine tokenizes:
//! [`Subject::require_native`] fails when HF is behind the API. Set
//! `SEMLB_CONFORMANCE_ALLOW_HF=1` to run the comparisons anyway (HF against
//! HF: this checks the harness itself, not the engine).

#![allow(dead_code)]

pub mod corpus;
pub mod variants;

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use corpus::Corpus;
use semlb_tokenizer::{Engine, Tokenizer};

/// Set to `1` to run the conformance tests with HF behind the API.
pub const ALLOW_HF_ENV: &str = "SEMLB_CONFORMANCE_ALLOW_HF";

/// Whether [`ALLOW_HF_ENV`] is set to `1`.
pub fn allow_hf() -> bool {
    std::env::var(ALLOW_HF_ENV).is_ok_and(|v| v == "1")
}

/// How many mismatches a failure shows in full.
pub const SHOWN_MISMATCHES: usize = 5;

/// A tokenizer under test and its HF reference, from the same bytes.
pub struct Subject {
    /// What it is, for the log (`phi-2`, `llama3-style`, ...).
    pub name: String,
    /// semlb's tokenizer.
    pub ours: Tokenizer,
    /// HF `tokenizers`, directly.
    pub reference: tokenizers::Tokenizer,
}

impl Subject {
    /// Both sides from the text of a tokenizer.json.
    pub fn from_json(name: &str, json: &[u8]) -> Subject {
        let ours = Tokenizer::from_json(json, name).unwrap_or_else(|e| panic!("{name}: semlb cannot load it: {e}"));
        let reference =
            tokenizers::Tokenizer::from_bytes(json).unwrap_or_else(|e| panic!("{name}: HF cannot load it: {e}"));
        Subject {
            name: name.to_owned(),
            ours,
            reference,
        }
    }

    /// Both sides from an edited tokenizer.json.
    pub fn from_value(name: &str, json: &serde_json::Value) -> Subject {
        Self::from_json(name, &serde_json::to_vec(json).expect("a JSON value serialises"))
    }

    /// The bundled phi-2 against an HF reference whose vocabulary has the
    /// ids of `Ġthe` and `,` swapped: a planted difference every harness
    /// must find (it shows the harness is not vacuous).
    pub fn planted_difference() -> Subject {
        let mut swapped = variants::phi2().clone();
        let vocab = swapped["model"]["vocab"]
            .as_object_mut()
            .expect("phi-2 has a vocabulary");
        vocab.insert("Ġthe".into(), serde_json::json!(11));
        vocab.insert(",".into(), serde_json::json!(262));
        let json = serde_json::to_vec(&swapped).expect("a JSON value serialises");
        Subject {
            name: "bundled phi-2 vs. phi-2 with two ids swapped".into(),
            ours: Tokenizer::bundled(),
            reference: tokenizers::Tokenizer::from_bytes(json).expect("HF loads the swapped vocabulary"),
        }
    }

    /// Both sides from a tokenizer.json file ([`Tokenizer::from_file`] for
    /// ours).
    pub fn from_file(name: &str, path: &Path) -> Subject {
        let ours = Tokenizer::from_file(path).unwrap_or_else(|e| panic!("{name}: semlb cannot load it: {e}"));
        let reference = tokenizers::Tokenizer::from_file(path)
            .unwrap_or_else(|e| panic!("{name}: HF cannot load {}: {e}", path.display()));
        Subject {
            name: name.to_owned(),
            ours,
            reference,
        }
    }

    /// The bundled phi-2 ([`Tokenizer::bundled`]) and HF on the same asset.
    pub fn bundled_phi2() -> Subject {
        let reference = tokenizers::Tokenizer::from_file(variants::phi2_path()).expect("HF loads the bundled phi-2");
        Subject {
            name: "phi-2 (bundled)".into(),
            ours: Tokenizer::bundled(),
            reference,
        }
    }

    /// Qwen3 from the shared tokenizer files, or `None` with a `SKIPPED:`
    /// line.
    pub fn qwen3() -> Option<Subject> {
        semlb_tokenizer::test_data::tokenizer_file("qwen3-tokenizer.json").map(|p| Subject::from_file("Qwen3", &p))
    }

    /// Every vocabulary token (added tokens left out) as text, alone and
    /// after a space, when it decodes to whole characters: source
    /// `vocab:tokens`.
    pub fn vocabulary_corpus(&self) -> Corpus {
        let mut ids: Vec<u32> = self.reference.get_vocab(false).into_values().collect();
        ids.sort_unstable();
        let mut strings = Vec::with_capacity(2 * ids.len());
        let mut seen = std::collections::HashSet::new();
        for id in ids {
            let Ok(text) = self.reference.decode(&[id], false) else {
                continue;
            };
            if text.is_empty() || text.contains('\u{fffd}') {
                continue;
            }
            let spaced = format!(" {text}");
            for s in [text, spaced] {
                if seen.insert(s.clone()) {
                    strings.push(s);
                }
            }
        }
        Corpus {
            sources: vec![corpus::Source {
                name: "vocab:tokens",
                strings,
            }],
        }
    }

    /// HF's ids for `text`, or HF's error.
    pub fn reference_ids(&self, text: &str) -> Result<Vec<u32>, String> {
        self.reference
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// Asserts that semlb's own engine, with this pre-tokenizer dialect,
    /// tokenizes (see the module docs for `SEMLB_CONFORMANCE_ALLOW_HF`).
    pub fn require_native(&self, dialect: &str) {
        match self.ours.engine() {
            Engine::Native { dialect: found } => assert_eq!(
                *found, dialect,
                "{}: the native engine took it with the {found} dialect, expected {dialect}",
                self.name
            ),
            Engine::Hf { reason } if allow_hf() => println!(
                "NOTE: {}: HF is behind the API ({reason}); {ALLOW_HF_ENV}=1, so this compares HF with HF (a check of the harness, not of the engine)",
                self.name
            ),
            Engine::Hf { reason } => panic!(
                "{}: the native engine ({dialect} dialect) must take this tokenizer, but HF is behind the API: {reason}. \
                 (Set {ALLOW_HF_ENV}=1 to run the comparison against HF anyway.)",
                self.name
            ),
        }
    }

    /// Asserts that HF tokenizes, with a reason given.
    pub fn require_hf(&self) {
        match self.ours.engine() {
            Engine::Hf { reason } => {
                assert!(!reason.trim().is_empty(), "{}: HF engine without a reason", self.name);
                println!("{}: HF, as it must be ({reason})", self.name);
            }
            native => panic!(
                "{}: the native engine must not take this tokenizer (HF must), but the engine is {native}",
                self.name
            ),
        }
    }

    /// Compares ours with HF on one string: `None` when equal.
    pub fn check(&self, source: &str, text: &str) -> Option<Mismatch> {
        let ours = self.ours.encode(text);
        let reference = self.reference_ids(text);
        (!agree(&ours, &reference)).then(|| Mismatch {
            source: source.to_owned(),
            index: 0,
            text: text.to_owned(),
            ours,
            reference,
        })
    }

    /// Compares ours with HF on every string of `corpus` (on all cores),
    /// and prints what was compared.
    pub fn compare(&self, corpus: &Corpus) -> Report {
        let items: Vec<(usize, usize)> = corpus
            .sources
            .iter()
            .enumerate()
            .flat_map(|(s, source)| (0..source.strings.len()).map(move |i| (s, i)))
            .collect();
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).min(8);
        let partials: Vec<Partial> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let items = &items;
                    scope.spawn(move || {
                        let mut partial = Partial::new(corpus.sources.len());
                        // Interleaved, so the long strings spread over the threads.
                        for &(s, i) in items.iter().skip(t).step_by(threads) {
                            let source = &corpus.sources[s];
                            partial.add(self, s, i, source.name, &source.strings[i]);
                        }
                        partial
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a comparison thread panicked"))
                .collect()
        });
        let mut report = Report {
            subject: self.name.clone(),
            engine: self.ours.engine().to_string(),
            sources: corpus
                .sources
                .iter()
                .map(|s| SourceCount {
                    name: s.name.to_owned(),
                    ..SourceCount::default()
                })
                .collect(),
            mismatches: Vec::new(),
        };
        let mut mismatches: Vec<(usize, Mismatch)> = Vec::new();
        for partial in partials {
            for (total, part) in report.sources.iter_mut().zip(&partial.counts) {
                total.strings += part.strings;
                total.bytes += part.bytes;
                total.ids += part.ids;
                total.mismatches += part.mismatches;
                total.reference_errors += part.reference_errors;
                total.ours_time += part.ours_time;
                total.reference_time += part.reference_time;
            }
            mismatches.extend(partial.mismatches);
        }
        mismatches.sort_by_key(|(s, m)| (*s, m.index));
        report.mismatches = mismatches.into_iter().map(|(_, m)| m).take(SHOWN_MISMATCHES).collect();
        report.print();
        report
    }

    /// [`compare`](Self::compare), then fails on any mismatch (showing the
    /// first few).
    pub fn assert_conforms(&self, corpus: &Corpus) -> Report {
        let report = self.compare(corpus);
        report.assert_no_mismatch(&self.reference);
        report
    }
}

/// One thread's share of a comparison.
struct Partial {
    counts: Vec<SourceCount>,
    mismatches: Vec<(usize, Mismatch)>,
}

impl Partial {
    fn new(sources: usize) -> Partial {
        Partial {
            counts: vec![SourceCount::default(); sources],
            mismatches: Vec::new(),
        }
    }

    fn add(&mut self, subject: &Subject, s: usize, i: usize, name: &str, text: &str) {
        let started = Instant::now();
        let ours = subject.ours.encode(text);
        let between = Instant::now();
        let reference = subject.reference_ids(text);
        let count = &mut self.counts[s];
        count.ours_time += between - started;
        count.reference_time += between.elapsed();
        count.strings += 1;
        count.bytes += text.len();
        count.ids += reference.as_ref().map_or(0, Vec::len);
        count.reference_errors += usize::from(reference.is_err());
        if !agree(&ours, &reference) {
            count.mismatches += 1;
            if self.mismatches.len() < SHOWN_MISMATCHES {
                let m = Mismatch {
                    source: name.to_owned(),
                    index: i,
                    text: text.to_owned(),
                    ours,
                    reference,
                };
                self.mismatches.push((s, m));
            }
        }
    }
}

/// Whether our ids are HF's: equal, or none when HF fails (the API's
/// contract: a text the tokenizer fails on gives no ids).
fn agree(ours: &[u32], reference: &Result<Vec<u32>, String>) -> bool {
    match reference {
        Ok(ids) => ids == ours,
        Err(_) => ours.is_empty(),
    }
}

/// What was compared for one source.
#[derive(Debug, Clone, Default)]
pub struct SourceCount {
    /// The source's name.
    pub name: String,
    /// Strings compared.
    pub strings: usize,
    /// Their UTF-8 bytes.
    pub bytes: usize,
    /// HF's ids for them.
    pub ids: usize,
    /// Strings whose ids differ.
    pub mismatches: usize,
    /// Strings HF failed on (ours must then give no ids).
    pub reference_errors: usize,
    /// Time spent in our `encode` (summed over threads; printed, never asserted).
    pub ours_time: Duration,
    /// Time spent in HF's `encode` (likewise).
    pub reference_time: Duration,
}

/// The outcome of a comparison.
pub struct Report {
    /// The subject's name.
    pub subject: String,
    /// Which engine was behind the API.
    pub engine: String,
    /// Per source.
    pub sources: Vec<SourceCount>,
    /// The first few mismatches, in corpus order.
    pub mismatches: Vec<Mismatch>,
}

impl Report {
    /// Strings compared.
    pub fn strings(&self) -> usize {
        self.sources.iter().map(|s| s.strings).sum()
    }

    /// Strings whose ids differ.
    pub fn mismatch_count(&self) -> usize {
        self.sources.iter().map(|s| s.mismatches).sum()
    }

    /// Prints one line per source and a total.
    pub fn print(&self) {
        let mut out = format!("conformance {} [{}]:\n", self.subject, self.engine);
        for s in &self.sources {
            let _ = writeln!(
                out,
                "  {:<28} {:>7} strings {:>10} bytes {:>9} ids {:>5} mismatches   (ours {:.2} s, HF {:.2} s)",
                s.name,
                s.strings,
                s.bytes,
                s.ids,
                s.mismatches,
                s.ours_time.as_secs_f64(),
                s.reference_time.as_secs_f64()
            );
        }
        let errors: usize = self.sources.iter().map(|s| s.reference_errors).sum();
        let _ = write!(
            out,
            "  {:<28} {:>7} strings {:>10} bytes {:>9} ids {:>5} mismatches   (ours {:.2} s, HF {:.2} s; {errors} strings HF failed on)",
            "total",
            self.strings(),
            self.sources.iter().map(|s| s.bytes).sum::<usize>(),
            self.sources.iter().map(|s| s.ids).sum::<usize>(),
            self.mismatch_count(),
            self.sources.iter().map(|s| s.ours_time.as_secs_f64()).sum::<f64>(),
            self.sources.iter().map(|s| s.reference_time.as_secs_f64()).sum::<f64>(),
        );
        println!("{out}");
    }

    /// Panics, showing the first mismatches, if there is any.
    pub fn assert_no_mismatch(&self, reference: &tokenizers::Tokenizer) {
        if self.mismatch_count() == 0 {
            return;
        }
        let mut msg = format!(
            "{}: {} of {} strings get other ids than HF's; the first {}:\n",
            self.subject,
            self.mismatch_count(),
            self.strings(),
            self.mismatches.len()
        );
        for (n, m) in self.mismatches.iter().enumerate() {
            let _ = writeln!(msg, "--- mismatch {} ---\n{}", n + 1, m.describe(reference));
        }
        panic!("{msg}");
    }
}

/// One string whose ids differ.
#[derive(Debug, Clone)]
pub struct Mismatch {
    /// Its source.
    pub source: String,
    /// Its index in the source.
    pub index: usize,
    /// The string.
    pub text: String,
    /// semlb's ids.
    pub ours: Vec<u32>,
    /// HF's ids, or HF's error.
    pub reference: Result<Vec<u32>, String>,
}

impl Mismatch {
    /// The first position where the id lists differ.
    pub fn first_difference(&self) -> usize {
        let empty = Vec::new();
        let reference = self.reference.as_ref().unwrap_or(&empty);
        self.ours
            .iter()
            .zip(reference)
            .position(|(a, b)| a != b)
            .unwrap_or(self.ours.len().min(reference.len()))
    }

    /// The string (escaped; around the difference if it is long), both id
    /// lists (around the difference if long), the first differing position
    /// and the tokens there.
    pub fn describe(&self, reference_tokenizer: &tokenizers::Tokenizer) -> String {
        let pos = self.first_difference();
        let mut out = format!(
            "source {} #{}: {} bytes, {} chars\n",
            self.source,
            self.index,
            self.text.len(),
            self.text.chars().count()
        );
        // Where in the text HF's token at `pos` starts.
        let byte_at = reference_tokenizer
            .encode(self.text.as_str(), false)
            .ok()
            .and_then(|e| e.get_offsets().get(pos).map(|o| o.0))
            .unwrap_or(0);
        let _ = writeln!(out, "text:       {}", escaped_excerpt(&self.text, byte_at));
        let _ = writeln!(out, "first difference at id #{pos} (text byte {byte_at})");
        let _ = writeln!(out, "ours:       {}", ids_excerpt(&self.ours, pos));
        match &self.reference {
            Ok(ids) => {
                let _ = writeln!(out, "reference:  {}", ids_excerpt(ids, pos));
                let tokens = |ids: &[u32]| -> Vec<String> {
                    ids.iter()
                        .skip(pos)
                        .take(4)
                        .map(|&id| {
                            reference_tokenizer
                                .id_to_token(id)
                                .unwrap_or_else(|| format!("<{id}?>"))
                        })
                        .collect()
                };
                let _ = write!(
                    out,
                    "tokens from there: ours {:?}, reference {:?}",
                    tokens(&self.ours),
                    tokens(ids)
                );
            }
            Err(e) => {
                let _ = write!(out, "reference:  HF failed ({e}); ours must be empty");
            }
        }
        out
    }
}

/// `text` escaped with `{:?}`; for long texts only about 120 chars around
/// byte `at`.
pub fn escaped_excerpt(text: &str, at: usize) -> String {
    const SHOW: usize = 240;
    if text.len() <= SHOW {
        return format!("{text:?}");
    }
    let mut start = at.saturating_sub(SHOW / 2).min(text.len());
    while !text.is_char_boundary(start) {
        start -= 1;
    }
    let mut end = (start + SHOW).min(text.len());
    while !text.is_char_boundary(end) {
        end += 1;
    }
    format!("…{:?}… (bytes {start}..{end} of {})", &text[start..end], text.len())
}

/// `ids`, or for long lists about 20 ids around `pos`.
pub fn ids_excerpt(ids: &[u32], pos: usize) -> String {
    const SHOW: usize = 24;
    if ids.len() <= SHOW {
        return format!("{ids:?} ({} ids)", ids.len());
    }
    let start = pos.saturating_sub(SHOW / 2).min(ids.len());
    let end = (start + SHOW).min(ids.len());
    format!("…{:?}… (ids {start}..{end} of {})", &ids[start..end], ids.len())
}
