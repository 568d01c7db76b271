//! Added tokens (special tokens such as `<|im_start|>`, and tokens added
//! on top of the model's vocabulary): found in the text before anything
//! else, as HF's `AddedVocabulary` finds them.
//!
//! HF's rules, reproduced here (`tokenizer/added_vocabulary.rs`):
//! * **Ids**: a token's id is its id in the model's vocabulary if it has
//!   one, else the next id from the vocabulary's size up, in the file's
//!   order; the `id` written in the file is not used. Empty tokens and
//!   exact duplicates are skipped.
//! * **Two passes**: tokens with `normalized: false` are matched on the raw
//!   text first; the text between them is normalized, and tokens with
//!   `normalized: true` are matched on that (as normalized themselves).
//! * **Matching**: Aho-Corasick, leftmost-longest, non-overlapping, over
//!   the special tokens (first occurrence of each) then the other tokens.
//!   A match of a `single_word` token is dropped unless it is not preceded
//!   or followed by a word character (`\w`); `lstrip` takes the whitespace
//!   before it (not what an earlier match already took) and `rstrip` the
//!   whitespace after it into the token. The flags used are those of the
//!   token last registered under the matched id.

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use regex::Regex;

/// One added token as `tokenizer.json` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Deserialize)]
pub(crate) struct AddedTokenSpec {
    /// Its text.
    pub content: String,
    /// Match only as a whole word.
    #[serde(default)]
    pub single_word: bool,
    /// Take the whitespace on its left.
    #[serde(default)]
    pub lstrip: bool,
    /// Take the whitespace on its right.
    #[serde(default)]
    pub rstrip: bool,
    /// Match on the normalized text (else on the raw text).
    #[serde(default = "yes")]
    pub normalized: bool,
    /// A special token.
    #[serde(default)]
    pub special: bool,
}

fn yes() -> bool {
    true
}

/// A piece of text after the added tokens are found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece<'a> {
    /// Text to tokenize further.
    Text(&'a str),
    /// An added token: its id and the text it took.
    Added(u32, &'a str),
}

/// The matching rules of one id.
#[derive(Debug, Clone, Copy, Default)]
struct Rules {
    single_word: bool,
    lstrip: bool,
    rstrip: bool,
}

/// The tokens of one pass.
#[derive(Debug)]
struct Matcher {
    automaton: AhoCorasick,
    ids: Vec<u32>,
}

/// The added tokens of a tokenizer.
#[derive(Debug)]
pub(crate) struct AddedVocabulary {
    raw: Option<Matcher>,
    normalized: Option<Matcher>,
    rules: hashbrown::HashMap<u32, Rules>,
    /// Whether a normalized-pass token could take text across a cut after
    /// a newline (it contains one, or takes the whitespace on its left).
    normalized_spans_newlines: bool,
    /// Distinct contents (for the vocabulary size).
    contents: hashbrown::HashMap<String, u32>,
    word_start: Regex,
    word_end: Regex,
    space_start: Regex,
    space_end: Regex,
}

impl AddedVocabulary {
    /// The added vocabulary of `tokens` over a model vocabulary
    /// (`model_id`: a content's id in it; `model_len`: its size), with
    /// `normalize` applied to the patterns of normalized tokens.
    pub(crate) fn new(
        tokens: &[AddedTokenSpec],
        model_id: impl Fn(&str) -> Option<u32>,
        model_len: usize,
        normalize: impl Fn(&str) -> String,
    ) -> Self {
        // Special tokens in order of first appearance.
        let mut specials: Vec<&AddedTokenSpec> = Vec::new();
        for t in tokens {
            if t.special && !t.content.is_empty() && !specials.iter().any(|s| s.content == t.content) {
                specials.push(t);
            }
        }
        let mut contents: hashbrown::HashMap<String, u32> = hashbrown::HashMap::new();
        let mut by_id: hashbrown::HashMap<u32, &AddedTokenSpec> = hashbrown::HashMap::new();
        let mut others: Vec<&AddedTokenSpec> = Vec::new();
        let mut seen: Vec<&AddedTokenSpec> = Vec::new();
        let mut next_id = model_len as u32;
        for t in tokens {
            if t.content.is_empty() || seen.contains(&t) {
                continue;
            }
            let id = contents
                .get(&t.content)
                .copied()
                .or_else(|| model_id(&t.content))
                .unwrap_or_else(|| {
                    next_id += 1;
                    next_id - 1
                });
            contents.insert(t.content.clone(), id);
            by_id.insert(id, t);
            if !specials.iter().any(|s| s.content == t.content) {
                others.push(t);
            }
            seen.push(t);
        }
        let (mut raw, mut normalized) = (Vec::new(), Vec::new());
        for t in specials.iter().chain(&others) {
            let id = contents[&t.content];
            if t.normalized {
                normalized.push((normalize(&t.content), id));
            } else {
                raw.push((t.content.clone(), id));
            }
        }
        let rules = by_id
            .iter()
            .map(|(id, t)| {
                let r = Rules {
                    single_word: t.single_word,
                    lstrip: t.lstrip,
                    rstrip: t.rstrip,
                };
                (*id, r)
            })
            .collect::<hashbrown::HashMap<_, _>>();
        let normalized_spans_newlines = specials
            .iter()
            .chain(&others)
            .filter(|t| t.normalized)
            .any(|t| t.lstrip || t.content.contains(['\n', '\r']));
        let regex = |re: &str| Regex::new(re).expect("a valid constant regex");
        Self {
            raw: matcher(raw),
            normalized: matcher(normalized),
            rules,
            normalized_spans_newlines,
            contents,
            word_start: regex(r"^\w"),
            word_end: regex(r"\w$"),
            space_start: regex(r"^\s*"),
            space_end: regex(r"\s*$"),
        }
    }

    /// Whether the normalized pass can match across a cut after a newline
    /// (then texts must not be cut there).
    pub(crate) fn normalized_spans_newlines(&self) -> bool {
        self.normalized_spans_newlines
    }

    /// Added contents and their ids.
    pub(crate) fn contents(&self) -> impl Iterator<Item = (&str, u32)> {
        self.contents.iter().map(|(c, id)| (c.as_str(), *id))
    }

    /// Calls `piece` with the raw text's pieces (first pass).
    pub(crate) fn split_raw<'a>(&self, text: &'a str, piece: impl FnMut(Piece<'a>)) {
        self.split(self.raw.as_ref(), text, piece);
    }

    /// Calls `piece` with a normalized text's pieces (second pass).
    pub(crate) fn split_normalized<'a>(&self, text: &'a str, piece: impl FnMut(Piece<'a>)) {
        self.split(self.normalized.as_ref(), text, piece);
    }

    fn split<'a>(&self, matcher: Option<&Matcher>, text: &'a str, mut piece: impl FnMut(Piece<'a>)) {
        let Some(matcher) = matcher else {
            if !text.is_empty() {
                piece(Piece::Text(text));
            }
            return;
        };
        let mut taken = 0;
        for m in matcher.automaton.find_iter(text) {
            let (mut start, mut stop) = (m.start(), m.end());
            let id = matcher.ids[m.pattern().as_usize()];
            let rules = self.rules.get(&id).copied().unwrap_or_default();
            if rules.single_word {
                let start_ok = start == 0 || !self.word_end.is_match(&text[..start]);
                let stop_ok = stop == text.len() || !self.word_start.is_match(&text[stop..]);
                if !(start_ok && stop_ok) {
                    continue;
                }
            }
            if rules.lstrip {
                let new_start = self.space_end.find(&text[..start]).map_or(start, |m| m.start());
                start = new_start.max(taken);
            }
            if rules.rstrip {
                stop += self.space_start.find(&text[stop..]).map_or(0, |m| m.end());
            }
            if taken < start {
                piece(Piece::Text(&text[taken..start]));
            }
            piece(Piece::Added(id, &text[start..stop]));
            taken = stop;
        }
        if taken < text.len() {
            piece(Piece::Text(&text[taken..]));
        }
    }
}

/// The leftmost-longest automaton of `patterns`, if there are any.
fn matcher(patterns: Vec<(String, u32)>) -> Option<Matcher> {
    if patterns.is_empty() {
        return None;
    }
    let automaton = AhoCorasickBuilder::new()
        .match_kind(MatchKind::LeftmostLongest)
        .build(patterns.iter().map(|(p, _)| p))
        .ok()?;
    Some(Matcher {
        automaton,
        ids: patterns.into_iter().map(|(_, id)| id).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(content: &str, special: bool, normalized: bool) -> AddedTokenSpec {
        AddedTokenSpec {
            content: content.into(),
            single_word: false,
            lstrip: false,
            rstrip: false,
            normalized,
            special,
        }
    }

    fn pieces<'a>(v: &AddedVocabulary, text: &'a str) -> Vec<Piece<'a>> {
        let mut out = Vec::new();
        v.split_raw(text, |p| out.push(p));
        out
    }

    #[test]
    fn ids_follow_hf_and_longest_match_wins() {
        let tokens = [
            token("<|a|>", true, false),
            token("<|a|>x", true, false),
            token("known", false, false),
            token("<|a|>", true, false), // duplicate: skipped
        ];
        let model = |c: &str| (c == "known").then_some(7);
        let v = AddedVocabulary::new(&tokens, model, 100, str::to_owned);
        assert_eq!(
            pieces(&v, "q<|a|>xz<|a|> known"),
            [
                Piece::Text("q"),
                Piece::Added(101, "<|a|>x"),
                Piece::Text("z"),
                Piece::Added(100, "<|a|>"),
                Piece::Text(" "),
                Piece::Added(7, "known")
            ]
        );
        assert_eq!(pieces(&v, ""), []);
        assert_eq!(v.contents().count(), 3);
    }

    #[test]
    fn strip_and_single_word_rules() {
        let mut t = token("<m>", true, false);
        t.lstrip = true;
        t.rstrip = true;
        let mut w = token("cat", false, false);
        w.single_word = true;
        let v = AddedVocabulary::new(&[t, w], |_| None, 10, str::to_owned);
        assert_eq!(
            pieces(&v, "a  <m>  b"),
            [Piece::Text("a"), Piece::Added(10, "  <m>  "), Piece::Text("b")]
        );
        assert_eq!(pieces(&v, "cats cat"), [Piece::Text("cats "), Piece::Added(11, "cat")]);
    }
}
