//! Conversations for the chat-template tests and benches, shared by
//! `tests/chat_native.rs` and `benches/chat.rs` (which includes this file
//! with `#[path]`).
//!
//! * [`hh_rlhf_dialogues`]: the real multi-turn dialogues of Anthropic's
//!   HH-RLHF test split (`shared/data/prompts`, see `shared/data/SOURCES.md`),
//!   split into `(role, content)` turns; `None` (and a `SKIPPED` line) when
//!   the file is absent.
//! * [`Rng`]: a small seeded generator (splitmix64) for generated
//!   conversations, so a failing case is the same on every run.
//! * [`template_source`]: the exact chat-template sources kept in
//!   `tests/templates/` (see `tests/templates/SOURCES.md`).

#![allow(dead_code)] // each including crate uses a part

use std::path::{Path, PathBuf};

/// One turn of a dialogue: role and content.
pub type Turn = (String, String);

/// The HH-RLHF file name in the prompts folder.
const HH_RLHF_FILE: &str = "hh-rlhf-helpful-base-test.jsonl";

/// The folder of prompt files: `SEMLB_PROMPTS_DIR`, else `shared/data/prompts`
/// next to the workspace.
pub fn prompts_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("SEMLB_PROMPTS_DIR") {
        return Some(PathBuf::from(dir));
    }
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/prompts");
    shared.is_dir().then_some(shared)
}

/// The HH-RLHF dialogues (the `chosen` text of each line) as turns, or
/// `None` and a `SKIPPED` line on stdout when the file is absent.
pub fn hh_rlhf_dialogues() -> Option<Vec<Vec<Turn>>> {
    let path = prompts_dir().map(|d| d.join(HH_RLHF_FILE)).filter(|p| p.is_file());
    let Some(path) = path else {
        println!("SKIPPED: prompt file {HH_RLHF_FILE} is absent (shared/data/prompts or SEMLB_PROMPTS_DIR)");
        return None;
    };
    let text = std::fs::read_to_string(&path).expect("the HH-RLHF file reads");
    let dialogues = text
        .lines()
        .map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).expect("an HH-RLHF line is JSON");
            let chosen = record["chosen"].as_str().expect("an HH-RLHF line has a chosen text");
            split_dialogue(chosen)
        })
        .collect();
    Some(dialogues)
}

/// Splits `"\n\nHuman: …\n\nAssistant: …"` into `user` / `assistant`
/// turns, the content verbatim (spaces and newlines kept).
pub fn split_dialogue(text: &str) -> Vec<Turn> {
    const MARKERS: [(&str, &str); 2] = [("\n\nHuman: ", "user"), ("\n\nAssistant: ", "assistant")];
    let next_marker = |from: usize| {
        MARKERS
            .iter()
            .filter_map(|&(marker, role)| text[from..].find(marker).map(|at| (from + at, marker.len(), role)))
            .min_by_key(|&(at, _, _)| at)
    };
    let mut turns = Vec::new();
    let mut current = next_marker(0);
    while let Some((at, marker_len, role)) = current {
        let start = at + marker_len;
        current = next_marker(start);
        let end = current.map_or(text.len(), |(next_at, _, _)| next_at);
        turns.push((role.to_owned(), text[start..end].to_owned()));
    }
    turns
}

/// The exact source of a template kept in `tests/templates/`.
pub fn template_source(file: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/templates").join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// A seeded splitmix64 generator.
pub struct Rng(u64);

impl Rng {
    /// A generator that always yields the same sequence for `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        // splitmix64 (`semlb-test-support`'s one copy): the finaliser of
        // the state plus the increment, then the state moves on by it.
        let bits = semlb_test_support::mix(self.0);
        self.0 = self.0.wrapping_add(semlb_test_support::rng::GAMMA);
        bits
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// One element of `items`.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}
