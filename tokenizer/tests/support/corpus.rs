//! The conformance corpus: the strings whose token ids must equal HF's.
//!
//! Deterministic (every random choice comes from [`Rng`] with a fixed
//! seed), deduplicated across sources (a string is counted once, in the
//! first source that produced it), and named by source so a test log can
//! say what was compared.
//!
//! | source | what | needs |
//! | --- | --- | --- |
//! | `gen:*` | generated edge cases (whitespace, newlines, contractions, emoji, combining marks, scripts, code, numbers, special-token look-alikes, unusual code points, very long strings) topped up with seeded random mixes to [`GENERATED_TARGET`] | nothing |
//! | `hh-rlhf:*` | HH-RLHF helpful-base test dialogues: whole (`chosen`, `rejected`), each turn (`\n\nHuman: `/`\n\nAssistant: ` and its message), each message, each line | `prompts/hh-rlhf-helpful-base-test.jsonl` |
//! | `mooncake:json-lines` | the Mooncake conversation trace's raw JSON lines (numbers, brackets, commas) | `traces/conversation_trace.jsonl` |
//!
//! The data folder is `SEMLB_BENCH_DATA` when set (the folder `semlb bench
//! --data` takes), else `shared/data` next to the repository. Without it the
//! shared-data sources are left out with a `SKIPPED:` line and the
//! generated ones alone make [`GENERATED_TARGET`] strings.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// How many generated strings the corpus has, with or without shared data.
pub const GENERATED_TARGET: usize = 100_000;

/// The HH-RLHF file, relative to the data folder.
pub const HH_RLHF_FILE: &str = "prompts/hh-rlhf-helpful-base-test.jsonl";
/// The Mooncake trace, relative to the data folder.
pub const MOONCAKE_FILE: &str = "traces/conversation_trace.jsonl";

/// Every added token of Qwen3's tokenizer.json (ids 151643..151668).
pub const QWEN3_SPECIALS: &[&str] = &[
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
];

/// The Llama-3 special tokens the Llama-3-style variant adds (see
/// `variants::llama3_style`).
pub const LLAMA3_SPECIALS: &[&str] = &[
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
];

/// The added tokens the phi-2 and Qwen3 added-vocabulary variants add
/// (see `variants`), written into the corpus too so they are exercised.
pub const VARIANT_ADDED_TOKENS: &[&str] = &[
    "<|tool|>",
    "<mask>",
    "<|tool|>x",
    "hello",
    "[SEP]",
    "café",
    "naïve",
    " ·",
    "Å",
    "ﬁ",
];

/// One named list of strings.
pub struct Source {
    /// What the strings are (`gen:whitespace`, `hh-rlhf:lines`, ...).
    pub name: &'static str,
    /// The strings, deduplicated against all earlier sources.
    pub strings: Vec<String>,
}

/// The whole corpus.
pub struct Corpus {
    /// In the order built; generated sources first.
    pub sources: Vec<Source>,
}

impl Corpus {
    /// The corpus (built once per test binary).
    pub fn get() -> &'static Corpus {
        static CORPUS: OnceLock<Corpus> = OnceLock::new();
        CORPUS.get_or_init(Corpus::build)
    }

    /// Builds the corpus: the generated sources, then the shared-data ones
    /// that are present.
    pub fn build() -> Corpus {
        let mut b = Builder::default();
        generated(&mut b);
        if let Some(path) = data_file(HH_RLHF_FILE) {
            hh_rlhf(&mut b, &path);
        }
        if let Some(path) = data_file(MOONCAKE_FILE) {
            mooncake(&mut b, &path);
        }
        Corpus { sources: b.sources }
    }

    /// Number of strings.
    pub fn len(&self) -> usize {
        self.sources.iter().map(|s| s.strings.len()).sum()
    }

    /// Total UTF-8 bytes.
    pub fn bytes(&self) -> usize {
        self.sources.iter().flat_map(|s| &s.strings).map(String::len).sum()
    }

    /// Every `every`-th string of each source (at least one per source),
    /// for the variants that need not see all of it.
    pub fn sample(&self, every: usize) -> Corpus {
        Corpus {
            sources: self
                .sources
                .iter()
                .map(|s| Source {
                    name: s.name,
                    strings: s.strings.iter().step_by(every.max(1)).cloned().collect(),
                })
                .collect(),
        }
    }

    /// Only the sources whose name starts with `prefix`.
    pub fn only(&self, prefix: &str) -> Corpus {
        Corpus {
            sources: self
                .sources
                .iter()
                .filter(|s| s.name.starts_with(prefix))
                .map(|s| Source {
                    name: s.name,
                    strings: s.strings.clone(),
                })
                .collect(),
        }
    }

    /// One line per source (`name: N strings, B bytes`) and a total.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        for s in &self.sources {
            let bytes: usize = s.strings.iter().map(String::len).sum();
            out.push_str(&format!(
                "  {:<28} {:>7} strings {:>10} bytes\n",
                s.name,
                s.strings.len(),
                bytes
            ));
        }
        out.push_str(&format!(
            "  {:<28} {:>7} strings {:>10} bytes",
            "total",
            self.len(),
            self.bytes()
        ));
        out
    }
}

/// The data folder: `SEMLB_BENCH_DATA`, else `shared/data` next to the
/// repository.
pub fn data_dir() -> PathBuf {
    match std::env::var_os("SEMLB_BENCH_DATA") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data"),
    }
}

/// `rel` in the data folder, or `None` with a `SKIPPED:` line.
pub fn data_file(rel: &str) -> Option<PathBuf> {
    let path = data_dir().join(rel);
    if path.is_file() {
        Some(path)
    } else {
        println!(
            "SKIPPED: data file {} is absent (shared/data or SEMLB_BENCH_DATA); its strings are left out",
            path.display()
        );
        None
    }
}

/// splitmix64: small, seedable, the same on every platform.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        // splitmix64 (`semlb-test-support`'s one copy): the finaliser of
        // the state plus the increment, then the state moves on by it.
        let bits = semlb_test_support::mix(self.0);
        self.0 = self.0.wrapping_add(semlb_test_support::rng::GAMMA);
        bits
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    /// One element of `items`.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// A char uniform in `lo..=hi`, skipping the surrogate gap.
    pub fn char_in(&mut self, lo: u32, hi: u32) -> char {
        loop {
            let c = lo + self.below((hi - lo + 1) as usize) as u32;
            if let Some(c) = char::from_u32(c) {
                return c;
            }
        }
    }
}

/// Collects sources, dropping strings already seen.
#[derive(Default)]
struct Builder {
    seen: HashSet<String>,
    sources: Vec<Source>,
    generated: usize,
}

impl Builder {
    fn add(&mut self, name: &'static str, strings: impl IntoIterator<Item = String>) {
        let mut kept = Vec::new();
        for s in strings {
            if !self.seen.contains(&s) {
                self.seen.insert(s.clone());
                kept.push(s);
            }
        }
        if name.starts_with("gen:") {
            self.generated += kept.len();
        }
        match self.sources.iter_mut().find(|s| s.name == name) {
            Some(source) => source.strings.extend(kept),
            None => self.sources.push(Source { name, strings: kept }),
        }
    }
}

// ---------------------------------------------------------------------------
// Generated edge cases
// ---------------------------------------------------------------------------

/// Whitespace code points, White_Space or not, that pre-tokenizer regexes
/// (`\s`, `\S`, `[\r\n]`) and the added-vocabulary strip rules treat
/// differently.
pub const WHITESPACE: &[char] = &[
    ' ', '\t', '\n', '\r', '\u{b}', '\u{c}', '\u{85}', '\u{a0}', '\u{1680}', '\u{2000}', '\u{2003}', '\u{2007}',
    '\u{2009}', '\u{200a}', '\u{2028}', '\u{2029}', '\u{202f}', '\u{205f}', '\u{3000}',
    // Not White_Space, but space-like: ZWSP, Mongolian vowel separator, BOM, word joiner.
    '\u{200b}', '\u{180e}', '\u{feff}', '\u{2060}',
];

/// Whitespace units repeated into runs: single kinds and mixes.
const WHITESPACE_UNITS: &[&str] = &[
    " ",
    "\t",
    "\u{a0}",
    "\u{3000}",
    "\u{2028}",
    "\u{2029}",
    "\u{85}",
    "\u{b}",
    "\u{c}",
    "\u{2003}",
    "\u{202f}",
    "\u{1680}",
    "\u{200b}",
    "\r",
    "\n",
    " \t",
    "\t ",
    "  \t",
    " \u{a0}",
    "\u{a0} ",
    " \u{3000}",
    " \n",
    "\n ",
    "\t\n",
    " \r\n",
    "\r\n",
    "\n\r",
    "    \t",
    " \u{2028}",
    "\u{b}\u{c} ",
];

/// Around a run: (before, after).
const RUN_CONTEXTS: &[(&str, &str)] = &[
    ("", ""),
    ("a", "b"),
    ("", "word"),
    ("word", ""),
    ("x", "\n"),
    ("\n", "x"),
    ("1", "2"),
    ("!", "?"),
    ("", "<|endoftext|>"),
    ("<|im_end|>", ""),
    ("'", "s"),
    ("é", "中"),
    ("def f():\n", "return 1"),
    ("", "😀"),
];

fn whitespace_runs(b: &mut Builder) {
    let mut out = Vec::new();
    for unit in WHITESPACE_UNITS {
        for len in 1..=70 {
            let run: String = unit.chars().cycle().take(len).collect();
            for (before, after) in RUN_CONTEXTS {
                out.push(format!("{before}{run}{after}"));
            }
        }
    }
    // phi-2's added tokens are runs of 2..=31 spaces and 2..=9 tabs:
    // indentation, runs longer than the longest token, runs split by a tab.
    for n in 1..=70 {
        let spaces = " ".repeat(n);
        let tabs = "\t".repeat(n.min(20));
        out.push(format!("{spaces}return x;"));
        out.push(format!("if x:\n{spaces}pass\n"));
        out.push(format!("fn f() {{\n{tabs}let x = 1;\n{tabs}}}"));
        out.push(format!("a{spaces}\t{spaces}b"));
        out.push(format!("{spaces}\n{spaces}\n"));
        out.push(format!("\t{spaces}x"));
        out.push(format!("{tabs} {tabs}"));
    }
    b.add("gen:whitespace", out);
}

fn newlines(b: &mut Builder) {
    // Every string of length 1..=5 over these 7 characters (19 607 strings):
    // the `\s*[\r\n]+`, `\s+(?!\S)` and `\s+` branches in every order.
    let alphabet = ['\r', '\n', ' ', '\t', 'a', '.', '\u{a0}'];
    let mut out = Vec::new();
    every_string(&alphabet, 5, &mut out);
    let breaks = [
        "\n", "\r", "\r\n", "\n\r", "\r\r\n", "\n\n", "\r\n\r\n", "\n\n\n", " \n", "\n ", " \r\n ", "\t\r\n",
        "\u{a0}\n", "\n\u{a0}", "  \n  ", "\n\t\t", "\u{2028}", "\u{85}", "\r \n", "\n\r\n\r",
    ];
    let words = ["Hello", "world", "1", "x = 1;", "", "—", "你好", "'s", "<|im_end|>"];
    for br in breaks {
        for w1 in words {
            for w2 in words {
                out.push(format!("{w1}{br}{w2}"));
            }
        }
    }
    b.add("gen:newlines", out);
}

/// Every string of length 1..=`max_len` over `alphabet`.
fn every_string(alphabet: &[char], max_len: usize, out: &mut Vec<String>) {
    let mut current: Vec<String> = vec![String::new()];
    for _ in 0..max_len {
        let mut next = Vec::with_capacity(current.len() * alphabet.len());
        for s in &current {
            for c in alphabet {
                let mut t = s.clone();
                t.push(*c);
                next.push(t);
            }
        }
        out.extend(next.iter().cloned());
        current = next;
    }
}

fn contractions(b: &mut Builder) {
    let mut out = Vec::new();
    // `(?i:'s|'t|'re|'ve|'m|'ll|'d)`: ſ (U+017F) and K (U+212A) case-fold to
    // s and k; ’ (U+2019) is not an apostrophe to the regex.
    let alphabet = [
        '\'', '’', 's', 'S', 'ſ', 't', 'l', 'L', 'r', 'e', 'v', 'm', 'd', ' ', 'x',
    ];
    every_string(&alphabet, 3, &mut out);
    let alphabet4 = ['\'', 's', 'S', 'ſ', 'l', 'L', ' ', 'x', '’', 'E'];
    let mut four = Vec::new();
    every_string(&alphabet4, 4, &mut four);
    out.extend(four.into_iter().filter(|s| s.chars().count() == 4));
    let words = [
        "it", "IT", "He", "we", "THEY", "you", "I", "don", "DON", "O", "rock n", "1", "", " ",
    ];
    let suffixes = [
        "'s",
        "'S",
        "'ſ",
        "'t",
        "'T",
        "'re",
        "'RE",
        "'Re",
        "'rE",
        "'ve",
        "'VE",
        "'vE",
        "'m",
        "'M",
        "'ll",
        "'LL",
        "'Ll",
        "'lL",
        "'d",
        "'D",
        "’s",
        "’ll",
        "’T",
        "'x",
        "''s",
        "'s's",
        "'sn't",
        "'",
        "' s",
        "'\u{301}s",
        "'\u{17f}\u{17f}",
        "'K",
        "'\u{212a}",
    ];
    let tails = ["", " ", ".", "s", "\n", "'", "ll"];
    for w in words {
        for s in suffixes {
            for t in tails {
                out.push(format!("{w}{s}{t}"));
            }
        }
    }
    out.push("I'm sure it's fine, isn't it? We'll see; they'd've known. You're right, I've LEARNED it's 'S'.".into());
    out.push("THAT'S IT'LL BE WE'D YOU'RE THEY'VE I'M DON'T".into());
    out.push("that’s it’ll be we’d you’re they’ve i’m don’t".into());
    b.add("gen:contractions", out);
}

const EMOJI: &[&str] = &[
    "😀",
    "👍",
    "👍🏽",
    "👍🏿",
    "👨‍👩‍👧‍👦",
    "👩🏽‍💻",
    "🧑🏻‍🤝‍🧑🏿",
    "🏳️‍🌈",
    "🏳️‍⚧️",
    "🤷‍♂️",
    "👁️‍🗨️",
    "🇫🇷",
    "🇺🇸🇬🇧",
    "🇦",
    "🇦🇧🇨",
    "🏴󠁧󠁢󠁳󠁣󠁴󠁿",
    "☺",
    "☺︎",
    "☺️",
    "❤",
    "❤️",
    "❤️‍🔥",
    "1️⃣",
    "#️⃣",
    "*️⃣",
    "🫠",
    "⚡",
    "🀄",
    "🃏",
    "\u{1f3fb}",
    "\u{fe0f}",
    "\u{fe0e}",
    "\u{200d}",
    "\u{20e3}",
    "😀\u{200d}",
    "\u{200d}😀",
    "©",
    "™",
    "↔️",
];

fn emoji(b: &mut Builder, rng: &mut Rng) {
    let mut out = Vec::new();
    let contexts: &[(&str, &str)] = &[
        ("", ""),
        ("ok", ""),
        ("", "ok"),
        (" ", " "),
        ("\n", "\n"),
        ("2", "3"),
        ("'", "s"),
        ("<|im_start|>", "<|im_end|>"),
        ("a ", "b"),
        ("  ", ""),
    ];
    for e in EMOJI {
        for (before, after) in contexts {
            for n in [1, 2, 3, 8] {
                out.push(format!("{before}{}{after}", e.repeat(n)));
            }
        }
    }
    for _ in 0..3000 {
        let n = rng.range(2, 8);
        let mut s = String::new();
        for _ in 0..n {
            s.push_str(rng.pick(EMOJI));
            if rng.below(3) == 0 {
                s.push_str(rng.pick(&[" ", "", "x", "\u{200d}", "\u{fe0f}", "\u{1f3fd}", "！"]));
            }
        }
        out.push(s);
    }
    b.add("gen:emoji", out);
}

/// Combining marks and decomposed sequences, many of which NFC changes.
const COMBINING: &[&str] = &[
    "e\u{301}",
    "E\u{301}",
    "a\u{300}",
    "o\u{308}",
    "n\u{303}",
    "c\u{327}",
    "u\u{308}\u{301}",
    "a\u{30a}",
    "\u{212b}",
    "\u{2126}",
    "\u{212a}",
    "\u{1100}\u{1161}",
    "\u{1100}\u{1161}\u{11a8}",
    "\u{1112}\u{1161}\u{11ab}\u{1100}\u{1173}\u{11af}",
    "\u{ac00}\u{11a8}",
    "\u{1100}",
    "\u{1161}\u{11a8}",
    "e\u{323}\u{302}",
    "e\u{302}\u{323}",
    "a\u{301}\u{323}",
    "a\u{323}\u{301}",
    "o\u{31b}\u{323}",
    "o\u{323}\u{31b}",
    "Vie\u{323}\u{302}t Nam",
    "Tie\u{302}\u{301}ng Vie\u{323}\u{302}t",
    "\u{301}",
    " \u{301}",
    "\u{301}\u{301}\u{301}",
    "\u{300}a",
    "a\u{35c}b",
    "\u{958}",
    "\u{915}\u{93c}",
    "\u{f900}",
    "\u{2fa1d}",
    "\u{340}",
    "\u{344}",
    "\u{1e9b}\u{323}",
    "\u{fb01}",
    "\u{e01}\u{e49}\u{e33}",
    "\u{5d1}\u{5bc}\u{5b8}",
    "\u{627}\u{644}\u{644}\u{651}\u{64e}\u{647}",
    "\u{3099}",
    "\u{304b}\u{3099}",
    "\u{30cf}\u{309a}",
    "\u{ff76}\u{ff9e}",
    "i\u{307}",
    "\u{130}",
    "\u{3a3}\u{3c3}\u{3c2}",
    "\u{1f76}",
    "\u{3b1}\u{313}\u{301}\u{345}",
    "Z\u{351}\u{34b}\u{33e}\u{306}a\u{36b}\u{357}l\u{35b}g\u{31f}o\u{32d}",
];

fn combining(b: &mut Builder, rng: &mut Rng) {
    let mut out = Vec::new();
    let contexts: &[(&str, &str)] = &[
        ("", ""),
        ("caf", ""),
        ("", "s"),
        (" ", ""),
        ("", " "),
        ("'", ""),
        ("1", "2"),
        ("<|im_start|>", ""),
        ("", "<|im_end|>"),
        ("\n", "\n"),
        ("中", "文"),
        ("x", "\u{301}"),
    ];
    for c in COMBINING {
        for (before, after) in contexts {
            out.push(format!("{before}{c}{after}"));
            out.push(format!("{before}{c}{c}{after}"));
        }
    }
    for _ in 0..3000 {
        let mut s = String::new();
        for _ in 0..rng.range(1, 6) {
            match rng.below(4) {
                0 => s.push_str(rng.pick(COMBINING)),
                1 => s.push(rng.char_in(0x300, 0x36f)),
                2 => s.push(rng.char_in(0x61, 0x7a)),
                _ => s.push(rng.char_in(0x1100, 0x11ff)),
            }
        }
        out.push(s);
    }
    b.add("gen:combining", out);
}

/// Sentences in many scripts (written for these tests).
const SCRIPTS: &[&str] = &[
    "负载均衡器把请求发送到缓存命中率最高的服务器。",
    "今天天气很好，我们去公园散步吧！",
    "東京の天気は晴れです。明日は雨が降るかもしれません。",
    "カタカナとひらがなを混ぜた文章、そして漢字も。",
    "ｶﾀｶﾅ ﾊﾝｶｸ ﾃｷｽﾄ",
    "서울의 날씨는 맑고 따뜻합니다. 내일은 비가 올 것 같아요.",
    "한국어 문장과 English 단어가 섞여 있습니다.",
    "مرحبا بالعالم، هذه جملة عربية للاختبار.",
    "اَلْعَرَبِيَّةُ لُغَةٌ جَمِيلَةٌ",
    "שלום עולם, זה משפט בעברית.",
    "שָׁלוֹם עוֹלָם",
    "नमस्ते दुनिया, यह एक हिंदी वाक्य है।",
    "क्षत्रिय श्री द्वारा",
    "สวัสดีครับ นี่คือประโยคภาษาไทยที่ไม่มีช่องว่างระหว่างคำ",
    "Καλημέρα κόσμε, αυτή είναι μια ελληνική πρόταση. ΣΟΦΟΣ σοφος",
    "Привет, мир! Это предложение на русском языке.",
    "Ёжик в тумане съел щи.",
    "გამარჯობა მსოფლიო",
    "Բարև աշխարհ",
    "வணக்கம் உலகம்",
    "ওহে বিশ্ব",
    "ሰላም ልዑል",
    "Xin chào thế giới, đây là câu tiếng Việt.",
    "Zażółć gęślą jaźń. Příliš žluťoučký kůň.",
    "Ça va? Où est l'hôpital? Straße, Maß, ß, ẞ.",
    "Türkçe: İstanbul, ığdır, IĞDIR.",
    "ᚠᛇᚻ᛫ᛒᛦᚦ",
    "𝐇𝐞𝐥𝐥𝐨 𝕎𝕠𝕣𝕝𝕕 𝔄𝔅",
    "ʻOkina and Hawaiʻi, Māori, Ōtautahi",
    "ⓐⓑⓒ ⒜⒝ ㈜ ㎏ ℃ №",
];

fn scripts(b: &mut Builder, rng: &mut Rng) {
    let mut out = Vec::new();
    let words: Vec<&str> = SCRIPTS.iter().flat_map(|s| s.split(' ')).collect();
    for s in SCRIPTS {
        out.push((*s).to_owned());
        out.push(format!(" {s}"));
        out.push(format!("{s}\n"));
        out.push(format!("Translate: {s}"));
        out.push(format!("<|im_start|>user\n{s}<|im_end|>"));
        for w in s.split(' ') {
            out.push(w.to_owned());
            out.push(format!(" {w}"));
        }
        // Every prefix by chars: cuts inside clusters and words.
        let chars: Vec<char> = s.chars().collect();
        for n in 1..chars.len() {
            out.push(chars[..n].iter().collect());
        }
    }
    for _ in 0..4000 {
        let n = rng.range(2, 10);
        let mut s = String::new();
        for i in 0..n {
            if i > 0 {
                s.push_str(rng.pick(&[" ", " ", "", ", ", "\n", "  ", "\u{3000}", "、"]));
            }
            s.push_str(rng.pick(&words));
        }
        out.push(s);
    }
    b.add("gen:scripts", out);
}

const CODE: &[&str] = &[
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * 2).collect();\n    println!(\"{:?}\", v);\n}\n",
    "impl<'a> Iterator for Tokens<'a> {\n    type Item = &'a str;\n    fn next(&mut self) -> Option<Self::Item> {\n        self.inner.next().map(|(s, _)| s)\n    }\n}\n",
    "#[derive(Debug, Clone)]\npub struct Config { pub port: u16, pub hosts: Vec<String> }\n",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])\n",
    "class Router:\n\tdef __init__(self, workers):\n\t\tself.workers = workers\n\n\tdef route(self, ids):\n\t\treturn hash(tuple(ids)) % len(self.workers)\n",
    "{\"model\": \"qwen3\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi!\\n\"}], \"stream\": true, \"max_tokens\": 128, \"temperature\": 0.7}",
    "[\n  {\"id\": 1, \"tags\": [\"a\", \"b\"], \"ok\": null},\n  {\"id\": 2, \"score\": -1.5e-3}\n]",
    "<!DOCTYPE html>\n<html lang=\"en\">\n<head><meta charset=\"utf-8\"><title>Test &amp; page</title></head>\n<body>\n  <p class=\"x\">Hello&nbsp;<b>world</b>!</p>\n  <!-- comment -->\n</body>\n</html>\n",
    "<script>const x = a => a ?? b?.c; console.log(`t=${x}`);</script>",
    "#!/bin/sh\nset -eu\nfor f in *.json; do\n  jq '.items[] | select(.n > 3)' \"$f\" >> out.txt 2>&1\ndone\n",
    "SELECT u.id, COUNT(*) AS n FROM users u JOIN orders o ON o.user_id = u.id WHERE o.total >= 100 GROUP BY u.id HAVING n > 2;",
    "int main(int argc, char **argv) {\r\n\tif (argc < 2) {\r\n\t\treturn 1;\r\n\t}\r\n\treturn 0;\r\n}\r\n",
    "key: value\nlist:\n  - one\n  - two: 2\n    three: [3, 4]\n",
    "| col a | col b |\n|-------|------:|\n| 1     |  2.50 |\n",
    "^(?:[a-z0-9!#$%&'*+/=?^_`{|}~-]+)@(?:\\[?[0-9]{1,3}\\.){3}$",
    "x+=1;y-=2;z*=3;w/=4;a<<=1;b>>=2;c&&d||!e;f!==g;h<=>i;j->k;l::m;n=>o;",
    "    return self._cache.get(key, default)  # TODO(alice): evict on TTL\n",
];

fn code(b: &mut Builder) {
    let mut out = Vec::new();
    for c in CODE {
        out.push((*c).to_owned());
        out.push(c.replace("    ", "\t"));
        out.push(c.replace("    ", "  "));
        out.push(c.replace("    ", "        "));
        out.push(c.replace('\n', "\r\n"));
        out.push(c.replace('\t', "    "));
        out.push(format!("```\n{c}```"));
        for line in c.lines() {
            out.push(line.to_owned());
            out.push(format!("{line}\n"));
        }
    }
    out.push(CODE.concat());
    b.add("gen:code", out);
}

/// Digit sets: ASCII and others that are `\p{N}`.
const DIGIT_ZEROS: &[u32] = &[
    0x30, 0x660, 0x6f0, 0x966, 0x9e6, 0xe50, 0xff10, 0x1d7ce, 0x1d7ec, 0x1040, 0x17e0,
];

fn numbers(b: &mut Builder, rng: &mut Rng) {
    let mut out = Vec::new();
    for len in 1..=40 {
        let mut variants = vec!["9".repeat(len), format!("1{}", "0".repeat(len - 1))];
        for _ in 0..12 {
            variants.push((0..len).map(|_| char::from(b'0' + rng.below(10) as u8)).collect());
        }
        for digits in variants {
            out.push(digits.clone());
            out.push(format!(" {digits}"));
            out.push(format!("-{digits}"));
            out.push(format!("+{digits}.5"));
            out.push(format!("{digits}e-7"));
            out.push(format!("{digits}E+10"));
            out.push(format!("x{digits}y"));
            out.push(format!("v{digits}"));
            out.push(format!("{digits}th"));
            out.push(format!("${digits}.00"));
            out.push(format!("{digits}%"));
            out.push(with_separators(&digits, ",", 3));
            out.push(with_separators(&digits, "\u{a0}", 3));
            out.push(with_separators(&digits, "_", 3));
            out.push(with_separators(&digits, " ", 3));
            out.push(with_separators(&digits, ".", 3) + ",50");
            out.push(format!("0.{digits}"));
            out.push(format!("{digits}.{digits}"));
            for zero in DIGIT_ZEROS {
                out.push(
                    digits
                        .chars()
                        .map(|d| char::from_u32(zero + (d as u32 - 0x30)).unwrap())
                        .collect(),
                );
            }
            out.push(digits.chars().map(superscript).collect());
        }
    }
    let extras = [
        "ⅠⅡⅢⅣⅤⅥⅦⅧⅨⅩⅪⅫ",
        "ⅰⅱⅲⅳ",
        "Chapter Ⅻ",
        "①②③⑳",
        "½ ⅓ ¼ ¾ ⅞",
        "3½",
        "x² + y³ = z⁴",
        "H₂O CO₂",
        "10⁻⁹",
        "1st 2nd 3rd 4th",
        "2024-11-21T20:06:33.123Z",
        "192.168.0.1:8080",
        "+1 (555) 010-9999",
        "0xDEADBEEF 0b1010 0o777 1_000_000u64",
        "3.14159265358979323846264338327950288419716939937510",
        "-0.0 +inf NaN 1e308 5e-324",
        "١٢٣٤٥ و ۱۲۳۴۵",
        "१२३ ४५६",
        "１２３４５６７８９０",
        "𝟏𝟐𝟑 𝟙𝟚𝟛",
        "〇一二三",
        "٣.١٤",
    ];
    for e in extras {
        out.push(e.to_owned());
        out.push(format!("Value: {e}."));
    }
    b.add("gen:numbers", out);
}

fn with_separators(digits: &str, sep: &str, group: usize) -> String {
    let chars: Vec<char> = digits.chars().collect();
    let mut out = String::new();
    for (i, c) in chars.iter().enumerate() {
        if i > 0 && (chars.len() - i).is_multiple_of(group) {
            out.push_str(sep);
        }
        out.push(*c);
    }
    out
}

fn superscript(d: char) -> char {
    match d {
        '1' => '¹',
        '2' => '²',
        '3' => '³',
        _ => char::from_u32(0x2070 + (d as u32 - 0x30)).unwrap(),
    }
}

/// Pieces of special tokens: unfinished, reversed, nested.
const SPECIAL_FRAGMENTS: &[&str] = &[
    "<|",
    "|>",
    "<|im_start",
    "im_start|>",
    "|im_start|>",
    "<|im_start|",
    "<|endoftext",
    "endoftext|>",
    "<|endoftext|",
    "<think",
    "think>",
    "</think",
    "</",
    "<|<|",
    "|>|>",
    "<<|im_start|>>",
    "<|<|im_start|>|>",
    "<|im_start<|im_start|>|>",
    "<|im_start|><|im_end|>",
    "<|im_start|><|im_start|>",
    "<|im_start|>user\n",
    "<|IM_START|>",
    "<| im_start |>",
    "<|im_start|>\u{301}",
    "<|endoftext|><|endoftext|><|endoftext|>",
    "foo<|endoftext|>bar",
    "<think></think>",
    "<think>\n\n</think>\n\n",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "</tool_call></tool_call>",
    "<tool_call",
    "tool_call>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<|start_header_id|",
    "<|user|>",
    "<|assistant|>",
    "<s>",
    "</s>",
    "[INST]",
];

fn specials(b: &mut Builder) {
    let mut out = Vec::new();
    let prefixes = [
        "",
        " ",
        "  ",
        "\n",
        "\t",
        "a",
        "word",
        "1",
        "'",
        "\u{a0}",
        "\u{3000}",
        "é",
        "中",
        "<",
        "|",
        "<|endoftext|>",
        "   ",
    ];
    let suffixes = [
        "", " ", "  ", "\n", "\n\n", " \n", "a", "word", "1", "'s", "\u{a0}", "\u{301}", ">", "|>", "   x",
    ];
    let all = QWEN3_SPECIALS
        .iter()
        .chain(LLAMA3_SPECIALS)
        .chain(VARIANT_ADDED_TOKENS)
        .chain(SPECIAL_FRAGMENTS);
    for s in all {
        for p in prefixes {
            for q in suffixes {
                out.push(format!("{p}{s}{q}"));
            }
        }
    }
    b.add("gen:specials", out);
}

/// Unusual code points.
const UNUSUAL: &[char] = &[
    '\u{fffd}',
    '\u{fffe}',
    '\u{ffff}',
    '\u{fdd0}',
    '\u{fdef}',
    '\u{1fffe}',
    '\u{10fffe}',
    '\u{10ffff}',
    '\u{10fffd}',
    '\u{e000}',
    '\u{f8ff}',
    '\u{f0000}',
    '\u{d7ff}',
    '\u{feff}',
    '\u{200b}',
    '\u{200c}',
    '\u{200d}',
    '\u{2060}',
    '\u{ad}',
    '\u{34f}',
    '\u{202e}',
    '\u{2066}',
    '\u{e0001}',
    '\u{e007f}',
    '\u{1d173}',
    '\0',
    '\u{1}',
    '\u{7}',
    '\u{8}',
    '\u{1b}',
    '\u{1f}',
    '\u{7f}',
    '\u{80}',
    '\u{81}',
    '\u{8d}',
    '\u{9f}',
    '\u{ffef}',
    '\u{fff9}',
    '\u{fffc}',
    '\u{e0100}',
    '\u{1f000}',
    '\u{20000}',
    '\u{2a6df}',
    '\u{30000}',
    '\u{e0e0}',
    '\u{0600}',
    '\u{061c}',
];

fn unusual(b: &mut Builder) {
    let mut out = Vec::new();
    let contexts: &[(&str, &str)] = &[
        ("", ""),
        ("a", "b"),
        (" ", ""),
        ("", " "),
        ("1", "2"),
        ("'", "s"),
        ("word", "word"),
        ("<|im_start|>", "<|im_end|>"),
        ("\n", "\n"),
        ("e", "\u{301}"),
        ("中", ""),
    ];
    let chars = UNUSUAL
        .iter()
        .chain(WHITESPACE)
        .copied()
        .chain((0u32..0x20).chain(0x7f..0xa0).filter_map(char::from_u32));
    for c in chars {
        for (before, after) in contexts {
            out.push(format!("{before}{c}{after}"));
            out.push(format!("{before}{c}{c}{c}{after}"));
        }
    }
    out.push(UNUSUAL.iter().collect());
    out.push("\u{feff}Hello".into());
    out.push("Hello\u{fffd}\u{fffd}world".into());
    b.add("gen:unusual-code-points", out);
}

fn long(b: &mut Builder, rng: &mut Rng) {
    let mut out = Vec::new();
    // A 40 KB text: prose, code, numbers and scripts in paragraphs.
    let mut text = String::new();
    let pieces: Vec<&str> = SCRIPTS.iter().chain(CODE).copied().collect();
    while text.len() < 40_000 {
        text.push_str(rng.pick(&pieces));
        text.push_str(rng.pick(&[" ", "\n", "\n\n", "  ", ". "]));
        text.push_str(&rng.next_u64().to_string());
        text.push(' ');
    }
    out.push(text);
    // A 10 K-char single word, in ASCII and in other scripts.
    out.push((0..10_000).map(|_| rng.char_in(0x61, 0x7a)).collect());
    out.push("a".repeat(10_000));
    out.push("ab".repeat(5_000));
    out.push((0..10_000).map(|_| rng.char_in(0x4e00, 0x9fff)).collect());
    out.push((0..10_000).map(|_| rng.char_in(0x430, 0x44f)).collect());
    out.push(format!("the{}s", "e\u{301}".repeat(3_000)));
    // 5 K digits.
    out.push((0..5_000).map(|_| char::from(b'0' + rng.below(10) as u8)).collect());
    out.push("7".repeat(5_000));
    out.push(
        (0..5_000)
            .map(|_| char::from_u32(0x660 + rng.below(10) as u32).unwrap())
            .collect(),
    );
    // Long runs of whitespace, newlines, punctuation, emoji, marks.
    out.push(" ".repeat(10_000));
    out.push(format!("x{}y", " ".repeat(10_000)));
    out.push("\t".repeat(5_000));
    out.push("\n".repeat(5_000));
    out.push("\r\n".repeat(3_000));
    out.push(" \n".repeat(3_000));
    out.push("\u{a0}".repeat(5_000));
    out.push("!?.,;:-".repeat(1_500));
    out.push("👨‍👩‍👧‍👦".repeat(1_000));
    out.push(format!("a{}", "\u{301}".repeat(5_000)));
    out.push("<|im_start|>".repeat(2_000));
    out.push("<|im_start|>user\nHi<|im_end|>\n".repeat(1_000));
    out.push("'s".repeat(5_000));
    out.push("'ll ".repeat(2_500));
    b.add("gen:long", out);
}

/// Small pieces of every kind, for the random mixes.
fn fragments(rng: &mut Rng) -> Vec<String> {
    let mut f: Vec<String> = Vec::new();
    f.extend(EMOJI.iter().map(|s| s.to_string()));
    f.extend(COMBINING.iter().map(|s| s.to_string()));
    f.extend(QWEN3_SPECIALS.iter().map(|s| s.to_string()));
    f.extend(LLAMA3_SPECIALS.iter().map(|s| s.to_string()));
    f.extend(VARIANT_ADDED_TOKENS.iter().map(|s| s.to_string()));
    f.extend(SPECIAL_FRAGMENTS.iter().map(|s| s.to_string()));
    f.extend(UNUSUAL.iter().map(|c| c.to_string()));
    f.extend(WHITESPACE.iter().map(|c| c.to_string()));
    f.extend(WHITESPACE_UNITS.iter().map(|s| s.to_string()));
    for s in SCRIPTS.iter().chain(CODE) {
        f.extend(s.split(' ').map(str::to_owned));
    }
    for w in [
        "the", " the", "The", " quick", "brown", "fox", "'s", "'S", "'ll", "'LL", "’s", "ſ", "don't", "I'm", "we'RE",
        " ", "  ", "   ", "\t", "\t\t", "\n", "\r\n", "\n\n", ".", ",", "!", "?", "...", "—", "(", ")", "{", "}", "[",
        "]", "\"", "'", "`", "#", "@", "$", "%", "^", "&", "*", "-", "_", "=", "+", "/", "\\", "|", "<", ">", "~",
    ] {
        f.push(w.to_owned());
    }
    for _ in 0..200 {
        let len = rng.range(1, 12);
        f.push((0..len).map(|_| char::from(b'0' + rng.below(10) as u8)).collect());
    }
    f
}

/// How many random mixes there are at least.
const RANDOM_MIXES: usize = 15_000;

/// Seeded random mixes: [`RANDOM_MIXES`], or more until the generated
/// sources hold [`GENERATED_TARGET`] strings.
fn random_mixes(b: &mut Builder, rng: &mut Rng) {
    let fragments = fragments(rng);
    let mut out = Vec::new();
    let mut attempts = 0usize;
    while out.len() < RANDOM_MIXES || b.generated + out.len() < GENERATED_TARGET {
        attempts += 1;
        assert!(attempts < 10 * GENERATED_TARGET, "the random mixes keep repeating");
        let mut s = String::new();
        match rng.below(4) {
            // Fragments glued together.
            0 | 1 => {
                for _ in 0..rng.range(1, 16) {
                    s.push_str(&fragments[rng.below(fragments.len())]);
                }
            }
            // Fragments with a separator.
            2 => {
                let sep = rng
                    .pick(&[" ", "  ", "\n", "\t", "", "\u{a0}", "\r\n", "'"])
                    .to_string();
                for i in 0..rng.range(2, 12) {
                    if i > 0 {
                        s.push_str(&sep);
                    }
                    s.push_str(&fragments[rng.below(fragments.len())]);
                }
            }
            // Random code points from pools.
            _ => {
                for _ in 0..rng.range(1, 60) {
                    s.push(random_char(rng));
                }
            }
        }
        if b.seen.insert(s.clone()) {
            out.push(s);
        }
    }
    // Already deduplicated above.
    b.generated += out.len();
    b.sources.push(Source {
        name: "gen:random-mixes",
        strings: out,
    });
}

/// A code point from weighted pools.
fn random_char(rng: &mut Rng) -> char {
    match rng.below(20) {
        0..=5 => rng.char_in(0x20, 0x7e),
        6 => rng.pick(WHITESPACE),
        7 => rng.pick(&['\'', '’', 's', 't', 'm', 'd', 'r', 'e', 'v', 'l', 'S', 'ſ']),
        8 => rng.char_in(0x300, 0x36f),
        9 => rng.char_in(0x4e00, 0x9fff),
        10 => rng.char_in(0x3040, 0x30ff),
        11 => rng.char_in(0xac00, 0xd7a3),
        12 => rng.char_in(0x1f300, 0x1faff),
        13 => rng.pick(&['\u{200d}', '\u{fe0f}', '\u{1f3fb}', '\u{1f1e6}', '\u{1f1eb}']),
        14 => rng.char_in(0x600, 0x6ff),
        15 => rng.char_in(0x900, 0x97f),
        16 => rng.char_in(0x370, 0x4ff),
        17 => rng.pick(UNUSUAL),
        18 => rng.char_in(0x80, 0x2fff),
        _ => rng.char_in(0, 0x10ffff),
    }
}

/// All generated sources, in a fixed order.
fn generated(b: &mut Builder) {
    let mut rng = Rng(0x5e31_b0c0_ffee_2026);
    b.add("gen:empty", [String::new()]);
    whitespace_runs(b);
    newlines(b);
    contractions(b);
    emoji(b, &mut rng);
    combining(b, &mut rng);
    scripts(b, &mut rng);
    code(b);
    numbers(b, &mut rng);
    specials(b);
    unusual(b);
    long(b, &mut rng);
    random_mixes(b, &mut rng);
}

// ---------------------------------------------------------------------------
// Shared data
// ---------------------------------------------------------------------------

/// One message of an HH-RLHF dialogue.
#[derive(Debug, Clone)]
pub struct Message {
    /// `user` or `assistant`.
    pub role: &'static str,
    /// The text after `Human:` / `Assistant:` (one leading space removed).
    pub content: String,
}

/// The `chosen` and `rejected` transcripts of an HH-RLHF JSONL file.
pub fn hh_rlhf_transcripts(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let mut out = Vec::new();
    for line in text.lines() {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{}: a line is not JSON: {e}", path.display()));
        for key in ["chosen", "rejected"] {
            if let Some(s) = value[key].as_str() {
                out.push(s.to_owned());
            }
        }
    }
    out
}

/// The messages of one transcript (`\n\nHuman: …\n\nAssistant: …`), in order.
pub fn split_transcript(text: &str) -> Vec<Message> {
    const MARKERS: [(&str, &str); 2] = [("\n\nHuman:", "user"), ("\n\nAssistant:", "assistant")];
    let mut marks: Vec<(usize, usize, &'static str)> = Vec::new();
    for (marker, role) in MARKERS {
        for (at, _) in text.match_indices(marker) {
            marks.push((at, at + marker.len(), role));
        }
    }
    marks.sort();
    let mut out = Vec::new();
    for (i, &(_, start, role)) in marks.iter().enumerate() {
        let end = marks.get(i + 1).map_or(text.len(), |m| m.0);
        let content = &text[start..end];
        let content = content.strip_prefix(' ').unwrap_or(content);
        out.push(Message {
            role,
            content: content.to_owned(),
        });
    }
    out
}

fn hh_rlhf(b: &mut Builder, path: &Path) {
    let transcripts = hh_rlhf_transcripts(path);
    let mut turns = Vec::new();
    let mut messages = Vec::new();
    let mut lines = Vec::new();
    for t in &transcripts {
        let split = split_transcript(t);
        for m in &split {
            let label = if m.role == "user" { "Human" } else { "Assistant" };
            turns.push(format!("\n\n{label}: {}", m.content));
            messages.push(m.content.clone());
        }
        lines.extend(t.split('\n').filter(|l| !l.is_empty()).map(str::to_owned));
    }
    b.add("hh-rlhf:dialogues", transcripts);
    b.add("hh-rlhf:turns", turns);
    b.add("hh-rlhf:messages", messages);
    b.add("hh-rlhf:lines", lines);
}

fn mooncake(b: &mut Builder, path: &Path) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    b.add("mooncake:json-lines", text.lines().map(str::to_owned));
}
