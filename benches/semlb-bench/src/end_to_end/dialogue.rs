//! The conversations the e2e load is made of: HH-RLHF dialogues split
//! into (user, assistant) turns, read from `<data>/prompts/` or made up
//! when the file is absent. Shared with the replay's `hh-rlhf` workload
//! and the proxy report.

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::Value;

use crate::Common;
use crate::dispatch_path::PROMPTS_FILE;

/// A dialogue's user turns and the dataset's answers to them (shared with
/// the replay's `hh-rlhf` workload).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Dialogue {
    /// `(user, assistant)` pairs; the last answer may be empty.
    pub(crate) turns: Vec<(String, String)>,
}

/// Splits an HH-RLHF transcript (`\n\nHuman: …\n\nAssistant: …`) into turns.
pub(crate) fn parse_dialogue(text: &str) -> Dialogue {
    let mut turns: Vec<(String, String)> = Vec::new();
    for part in text.split("\n\nHuman:").map(str::trim).filter(|p| !p.is_empty()) {
        let (user, answer) = part.split_once("\n\nAssistant:").unwrap_or((part, ""));
        // A later "Assistant:" inside the same human part stays in the answer.
        turns.push((user.trim().to_owned(), answer.trim().to_owned()));
    }
    turns.retain(|(u, _)| !u.is_empty());
    Dialogue { turns }
}

/// The dialogues of `<data>/prompts/hh-rlhf-helpful-base-test.jsonl`, or a
/// synthetic set; the second value says which.
pub(super) fn load_dialogues(common: &Common) -> (Vec<Dialogue>, String) {
    let path = common.data_dir().map(|d| d.join(PROMPTS_FILE));
    if let Some(path) = &path
        && let Ok(dialogues) = read_dialogues(path)
        && !dialogues.is_empty()
    {
        return (dialogues, path.display().to_string());
    }
    let synthetic = (0..500)
        .map(|i| Dialogue {
            turns: (0..3)
                .map(|t| {
                    (
                        format!(
                            "Conversation {i}, question {t}: {}",
                            "tell me more about it. ".repeat(8 + t * 3)
                        ),
                        "Here is an answer that goes on for a while. ".repeat(10),
                    )
                })
                .collect(),
        })
        .collect();
    (synthetic, "synthetic (no HH-RLHF file found)".into())
}

/// The dialogues (with at least one turn) of an HH-RLHF JSONL file: the
/// `chosen` transcript of every line that has one.
pub(crate) fn read_dialogues(path: &Path) -> Result<Vec<Dialogue>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["chosen"].as_str().map(parse_dialogue))
        .filter(|d| !d.turns.is_empty())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dialogues_split_into_turns() {
        let d = parse_dialogue("\n\nHuman: Hi?\n\nAssistant: Hello.\n\nHuman: How are you?\n\nAssistant: Fine.");
        assert_eq!(
            d.turns,
            vec![
                ("Hi?".to_owned(), "Hello.".to_owned()),
                ("How are you?".to_owned(), "Fine.".to_owned())
            ]
        );
        assert_eq!(parse_dialogue("\n\nHuman: Only a question").turns.len(), 1);
    }
}
