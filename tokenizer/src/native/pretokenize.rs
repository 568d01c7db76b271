//! Pre-tokenization: a text cut into the words that BPE merges within,
//! exactly where HF's regex pre-tokenizers (run by Oniguruma) cut it.
//!
//! Three regexes cover the byte-level BPE models we serve. Each is an
//! alternation tried in order at the current position (Oniguruma is a
//! backtracking engine: the first alternative that matches wins, with
//! greedy quantifiers), and every character is matched by some
//! alternative, so the words tile the text. Instead of running the regex,
//! [`words`] walks the text once and decides each alternative by hand from
//! the character classes of [`super::unicode_classes`]:
//!
//! | dialect | regex (HF `tokenizer.json`) | used by |
//! | --- | --- | --- |
//! | [`Dialect::Gpt2`] | [`GPT2_PATTERN`] (ByteLevel's built-in, `use_regex: true`) | GPT-2, Phi-2, CodeGen |
//! | [`Dialect::Qwen2`] | [`QWEN2_PATTERN`] (a `Split` before ByteLevel) | Qwen2, Qwen2.5, Qwen3 |
//! | [`Dialect::Llama3`] | [`LLAMA3_PATTERN`] (a `Split` before ByteLevel) | Llama 3.x (cl100k's pattern) |
//!
//! The backtracking cases, spelled out (`S` = `\s`, `L` = `\p{L}`, `N` =
//! `\p{N}`, `O` = none of them):
//! * `\s+(?!\S)`: the whitespace run `[i, j)` when it reaches the end of
//!   the text, else the run without its last character if that leaves at
//!   least one, else no match (then `\s+` takes the single character).
//! * `\s*[\r\n]+` (Qwen2, Llama 3): the run up to and including its last
//!   CR or LF, if it has one.
//! * `[^\r\n\p{L}\p{N}]?\p{L}+` (Qwen2, Llama 3): one character that is
//!   not CR, LF, L or N is taken before a letter run only if a letter
//!   follows it.
//! * `(?i:'s|...)`: case-insensitive as Oniguruma folds: besides ASCII
//!   case, `ſ` (U+017F) matches `s` (checked against Oniguruma for every
//!   code point in the tests).

use super::unicode_classes::{LETTER, NUMBER, SPACE, class_of};

/// GPT-2's pre-tokenizer regex (HF's ByteLevel with `use_regex: true`).
pub(crate) const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The Qwen2 family's pre-tokenizer regex (single digits).
pub(crate) const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's pre-tokenizer regex (up to three digits).
pub(crate) const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Which pre-tokenizer regex a tokenizer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// [`GPT2_PATTERN`].
    Gpt2,
    /// [`QWEN2_PATTERN`].
    Qwen2,
    /// [`LLAMA3_PATTERN`].
    Llama3,
}

impl Dialect {
    /// The dialect whose `Split` regex is `pattern`, if one is.
    pub(crate) fn of_split_pattern(pattern: &str) -> Option<Dialect> {
        [Dialect::Qwen2, Dialect::Llama3]
            .into_iter()
            .find(|d| d.pattern() == pattern)
    }

    /// The name shown to users.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Dialect::Gpt2 => "gpt2",
            Dialect::Qwen2 => "qwen2",
            Dialect::Llama3 => "llama3",
        }
    }

    /// The regex this dialect reproduces.
    pub(crate) fn pattern(self) -> &'static str {
        match self {
            Dialect::Gpt2 => GPT2_PATTERN,
            Dialect::Qwen2 => QWEN2_PATTERN,
            Dialect::Llama3 => LLAMA3_PATTERN,
        }
    }

    /// Whether `text` may be cut at byte `at` (with `at` after a `\n` and
    /// before a non-whitespace character) without changing its words: the
    /// words of `text[..at]` and of `text[at..]`, one after the other, are
    /// the words of `text`. No word contains both a `\n` and the
    /// non-whitespace character after it, and the regexes look no further
    /// than one character past a whitespace run; what remains is the end of
    /// the first part, where `\s+(?!\S)` would take a whole whitespace run:
    /// * Qwen2 and Llama 3 try `\s*[\r\n]+` first, which ends a run at its
    ///   last CR/LF either way, so every such cut is exact;
    /// * GPT-2 has no such alternative: a run of two or more whitespace
    ///   characters before the cut would end differently, so the `\n` must
    ///   be the whole run (the character before it is not whitespace).
    ///
    /// `before` is the character before the `\n`, if any.
    pub(crate) fn cut_after_newline_is_exact(self, before: Option<char>) -> bool {
        match self {
            Dialect::Qwen2 | Dialect::Llama3 => true,
            Dialect::Gpt2 => before.is_none_or(|c| class_of(c) & SPACE == 0),
        }
    }
}

/// Calls `word` with each word of `text`, in order; the words tile `text`.
pub(crate) fn words<'a>(dialect: Dialect, text: &'a str, mut word: impl FnMut(&'a str)) {
    let scanner = Scanner { text: text.as_bytes() };
    let mut at = 0;
    while at < text.len() {
        let end = match dialect {
            Dialect::Gpt2 => scanner.gpt2_word(at),
            Dialect::Qwen2 => scanner.cl100k_word(at, 1),
            Dialect::Llama3 => scanner.cl100k_word(at, 3),
        };
        debug_assert!(end > at && text.is_char_boundary(end));
        word(&text[at..end]);
        at = end;
    }
}

/// `\r` and `\n` (as a class bit next to the Unicode ones).
const CR_LF: u8 = 8;

/// The class byte of every ASCII character, CR and LF marked.
static ASCII: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut b = 0;
    while b < 128 {
        let c = b as u8;
        t[b] = if c.is_ascii_alphabetic() {
            LETTER
        } else if c.is_ascii_digit() {
            NUMBER
        } else if matches!(c, b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' ') {
            SPACE | if c == b'\r' || c == b'\n' { CR_LF } else { 0 }
        } else {
            0
        };
        b += 1;
    }
    t
};

/// A class byte with no Unicode bit: neither whitespace, letter nor number.
#[inline]
fn is_other(class: u8) -> bool {
    class & (LETTER | NUMBER | SPACE) == 0
}

/// Walks a UTF-8 text by character.
struct Scanner<'a> {
    text: &'a [u8],
}

impl Scanner<'_> {
    /// The class byte of the character at `at` (< len) and where it ends.
    #[inline]
    fn at(&self, at: usize) -> (u8, usize) {
        let b = self.text[at];
        if b < 0x80 {
            return (ASCII[usize::from(b)], at + 1);
        }
        let (c, len) = decode(&self.text[at..]);
        (class_of(c), at + len)
    }

    /// The class byte of the character at `at`, or `None` at the end.
    #[inline]
    fn peek(&self, at: usize) -> Option<u8> {
        (at < self.text.len()).then(|| self.at(at).0)
    }

    /// The end of the run of characters from `at` whose class satisfies
    /// `keep`.
    #[inline]
    fn run(&self, mut at: usize, keep: impl Fn(u8) -> bool) -> usize {
        while at < self.text.len() {
            let (class, next) = self.at(at);
            if !keep(class) {
                break;
            }
            at = next;
        }
        at
    }

    /// The end of a contraction (`'s 't 're 've 'm 'll 'd`) at `at`, if one
    /// starts there; `fold` matches case-insensitively as Oniguruma does.
    fn contraction(&self, at: usize, fold: bool) -> Option<usize> {
        let t = self.text;
        if t.get(at) != Some(&b'\'') {
            return None;
        }
        // Compares the character at `i` with the ASCII letter `want`; the
        // result is where it ends.
        let letter = |i: usize, want: u8| -> Option<usize> {
            let b = *t.get(i)?;
            if b == want || (fold && b.is_ascii() && b.to_ascii_lowercase() == want) {
                Some(i + 1)
            } else if fold && want == b's' && t[i..].starts_with("ſ".as_bytes()) {
                Some(i + 2)
            } else {
                None
            }
        };
        let first = at + 1;
        for single in [b's', b't', b'm', b'd'] {
            if let Some(end) = letter(first, single) {
                return Some(end);
            }
        }
        for (a, b) in [(b'r', b'e'), (b'v', b'e'), (b'l', b'l')] {
            if let Some(end) = letter(first, a).and_then(|i| letter(i, b)) {
                return Some(end);
            }
        }
        None
    }

    /// `\s+(?!\S)|\s+` at a whitespace character `at`.
    fn space_run(&self, at: usize) -> usize {
        let mut last_start = at;
        let mut end = at;
        let mut chars = 0usize;
        while end < self.text.len() {
            let (class, next) = self.at(end);
            if class & SPACE == 0 {
                break;
            }
            last_start = end;
            end = next;
            chars += 1;
        }
        if end == self.text.len() || chars < 2 {
            end
        } else {
            last_start
        }
    }

    /// The word of [`GPT2_PATTERN`] at `at`.
    fn gpt2_word(&self, at: usize) -> usize {
        if let Some(end) = self.contraction(at, false) {
            return end;
        }
        let (class, next) = self.at(at);
        // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: the optional space
        // first (then the class of what follows decides).
        let (start, class) = match self.peek(next) {
            Some(following) if self.text[at] == b' ' && (following & SPACE == 0) => (next, following),
            _ => (at, class),
        };
        if class & LETTER != 0 {
            self.run(start, |c| c & LETTER != 0)
        } else if class & NUMBER != 0 {
            self.run(start, |c| c & NUMBER != 0)
        } else if is_other(class) {
            self.run(start, is_other)
        } else {
            self.space_run(at)
        }
    }

    /// The word of [`QWEN2_PATTERN`] (`digits` = 1) or [`LLAMA3_PATTERN`]
    /// (`digits` = 3) at `at`.
    fn cl100k_word(&self, at: usize, digits: usize) -> usize {
        if let Some(end) = self.contraction(at, true) {
            return end;
        }
        let (class, next) = self.at(at);
        let following = self.peek(next);
        // `[^\r\n\p{L}\p{N}]?\p{L}+`
        if class & LETTER != 0 {
            return self.run(next, |c| c & LETTER != 0);
        }
        if class & (CR_LF | NUMBER) == 0 && following.is_some_and(|f| f & LETTER != 0) {
            return self.run(next, |c| c & LETTER != 0);
        }
        // `\p{N}` / `\p{N}{1,3}`
        if class & NUMBER != 0 {
            let mut end = next;
            for _ in 1..digits {
                match self.peek(end) {
                    Some(c) if c & NUMBER != 0 => end = self.at(end).1,
                    _ => break,
                }
            }
            return end;
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        let other_start = if is_other(class) {
            Some(at)
        } else if self.text[at] == b' ' && following.is_some_and(is_other) {
            Some(next)
        } else {
            None
        };
        if let Some(start) = other_start {
            let end = self.run(start, is_other);
            return self.run(end, |c| c & CR_LF != 0);
        }
        // Whitespace from here. `\s*[\r\n]+`: up to the run's last CR/LF.
        let mut end = at;
        let mut last_newline = None;
        while end < self.text.len() {
            let (class, next) = self.at(end);
            if class & SPACE == 0 {
                break;
            }
            if class & CR_LF != 0 {
                last_newline = Some(next);
            }
            end = next;
        }
        match last_newline {
            Some(end) => end,
            None => self.space_run(at),
        }
    }
}

/// The character at the start of `bytes` (valid UTF-8, not ASCII) and its
/// length.
#[inline]
fn decode(bytes: &[u8]) -> (char, usize) {
    let b0 = u32::from(bytes[0]);
    let cont = |i: usize| u32::from(bytes[i] & 0x3f);
    let (cp, len) = if b0 < 0xE0 {
        (((b0 & 0x1f) << 6) | cont(1), 2)
    } else if b0 < 0xF0 {
        (((b0 & 0x0f) << 12) | (cont(1) << 6) | cont(2), 3)
    } else {
        (((b0 & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3), 4)
    };
    // The bytes come from a `str`, so they are valid UTF-8.
    (char::from_u32(cp).unwrap_or('\u{FFFD}'), len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tokenizers::utils::SysRegex;

    const DIALECTS: [Dialect; 3] = [Dialect::Gpt2, Dialect::Qwen2, Dialect::Llama3];

    fn ours(dialect: Dialect, text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        words(dialect, text, |w| out.push(w));
        out
    }

    /// What Oniguruma's `find_iter` cuts (HF's `Split` with `Isolated`,
    /// gaps included, which these regexes never leave).
    fn oniguruma<'a>(re: &SysRegex, text: &'a str) -> Vec<&'a str> {
        let mut out = Vec::new();
        let mut prev = 0;
        for (start, end) in re.find_iter(text) {
            if start > prev {
                out.push(&text[prev..start]);
            }
            out.push(&text[start..end]);
            prev = end;
        }
        if prev < text.len() {
            out.push(&text[prev..]);
        }
        out
    }

    fn regexes() -> Vec<(Dialect, SysRegex)> {
        DIALECTS
            .iter()
            .map(|d| (*d, SysRegex::new(d.pattern()).unwrap()))
            .collect()
    }

    fn check(res: &[(Dialect, SysRegex)], text: &str) {
        for (dialect, re) in res {
            assert_eq!(ours(*dialect, text), oniguruma(re, text), "{dialect:?} on {text:?}");
        }
    }

    #[test]
    fn known_cuts() {
        let res = regexes();
        for text in [
            "",
            "Hello, world!",
            "I'm here, they'll go; it's DON'T 'S 'Re 'ſ 'ß",
            "  leading and trailing  ",
            "a  \n\n  b\r\n\tc \t\nd",
            "x \ny",
            "x\r\ny",
            "1234567 12,345.67 ١٢٣",
            "(hello) [World] {x}",
            "你好，世界！ 日本語のテキスト",
            "émoji 👍🏽 👨‍👩‍👧 🇫🇷",
            "\u{3000}\u{a0}x\u{85}y\u{2028}",
            "e\u{301}\u{302} ' '' ''' 's",
            "<|im_start|>user\nHi<|im_end|>\n",
        ] {
            check(&res, text);
        }
    }

    /// Every code point, in contexts that exercise each alternative.
    #[test]
    fn every_code_point_in_context() {
        let res = regexes();
        let mut text = String::new();
        let mut buf = [0u8; 4];
        for cp in (0u32..=0x10FFFF).step_by(1) {
            let Some(c) = char::from_u32(cp) else { continue };
            let c: &str = c.encode_utf8(&mut buf);
            // Few enough regex runs: one text per 64 code points, each in
            // several contexts.
            for context in ["a{}b", " {} ", "'{}", "{}\n", "1{}2", "{}{} x"] {
                text.push_str(&context.replace("{}", c));
            }
            if cp % 64 == 63 {
                check(&res, &text);
                text.clear();
            }
        }
        check(&res, &text);
    }

    #[test]
    fn contraction_folds_match_oniguruma() {
        // Which characters Oniguruma matches case-insensitively with the
        // contraction letters: ASCII case and `ſ` only.
        let res = regexes();
        let mut buf = [0u8; 4];
        for cp in 0u32..=0x10FFFF {
            let Some(c) = char::from_u32(cp) else { continue };
            if !(c.is_ascii_alphabetic() || cp > 0x7f) {
                continue;
            }
            let c: &str = c.encode_utf8(&mut buf);
            let mut text = String::new();
            for context in ["'{}", "'{}e", "'l{}", "'{}l"] {
                text.push_str(&context.replace("{}", c));
                text.push(' ');
            }
            if cp < 0x80 || cp == 0x17f || cp % 97 == 0 {
                check(&res, &text);
            }
        }
    }

    #[test]
    fn newline_cut_rule_is_exact() {
        for dialect in DIALECTS {
            for (a, b) in [
                ("x\n", "y"),
                ("x \n", "y"),
                ("x\r\n", "y"),
                ("\n", "y"),
                ("x \t\n", "(y"),
            ] {
                let before = a[..a.len() - 1].chars().last();
                if dialect.cut_after_newline_is_exact(before) {
                    let whole = format!("{a}{b}");
                    let mut parts = ours(dialect, a);
                    parts.extend(ours(dialect, b));
                    assert_eq!(parts, ours(dialect, &whole), "{dialect:?} {a:?}|{b:?}");
                }
            }
        }
        assert!(!Dialect::Gpt2.cut_after_newline_is_exact(Some(' ')));
        assert!(Dialect::Gpt2.cut_after_newline_is_exact(Some('x')));
        assert!(Dialect::Qwen2.cut_after_newline_is_exact(Some(' ')));
    }

    fn interesting_char() -> impl Strategy<Value = char> {
        prop_oneof![
            4 => prop::sample::select(vec![
                'a', 'Z', 's', 'S', 't', 'm', 'd', 'r', 'e', 'v', 'l', 'L', 'ſ', '\'', ' ', ' ', '\t', '\n', '\r',
                '\u{0b}', '\u{0c}', '\u{85}', '\u{a0}', '\u{3000}', '\u{2028}', '0', '7', '٣', '½', '.', ',', '!',
                '(', '<', '|', '>', '_', '-', '\u{301}', '\u{200d}', '你', '😀', '\u{fffd}', 'é', 'ß',
            ]),
            1 => any::<char>(),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

        #[test]
        fn words_match_oniguruma(chars in prop::collection::vec(interesting_char(), 0..40)) {
            let text: String = chars.into_iter().collect();
            check(&regexes(), &text);
        }

        #[test]
        fn newline_cuts_are_exact(a in prop::collection::vec(interesting_char(), 0..20),
                                  b in prop::collection::vec(interesting_char(), 1..20)) {
            let a: String = a.into_iter().chain(['\n']).collect();
            let b: String = b.into_iter().collect();
            let first = b.chars().next().unwrap();
            prop_assume!(class_of(first) & SPACE == 0);
            for dialect in DIALECTS {
                let before = a[..a.len() - 1].chars().last();
                if dialect.cut_after_newline_is_exact(before) {
                    let whole = format!("{a}{b}");
                    let mut parts = ours(dialect, &a);
                    parts.extend(ours(dialect, &b));
                    prop_assert_eq!(parts, ours(dialect, &whole));
                }
            }
        }
    }
}
