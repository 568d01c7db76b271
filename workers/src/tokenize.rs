//! The real tokenizer (HF `tokenizers`, a tokenizer.json), chat rendering,
//! and the deterministic output tokens the simulator "generates".
//!
//! # Tokenizer
//!
//! [`Tokenizer`] wraps a HuggingFace `tokenizers::Tokenizer` loaded from a
//! `tokenizer.json` ([`Tokenizer::from_file`]) or the one bundled in the
//! binary ([`Tokenizer::bundled`]: Microsoft Phi-2's, which is the GPT-2
//! vocabulary; see `workers/assets/README.md`). [`Tokenizer::encode`] adds
//! no special tokens (no BOS, no post-processor template), but special
//! tokens written in the text, such as Qwen's `<|im_start|>`, are still
//! recognised as the added tokens they are, as a real server does with a
//! rendered chat prompt.
//!
//! # Chat rendering
//!
//! [`ChatTemplate`] turns chat messages into prompt text, either with the
//! `chat_template` (Jinja) of a HF `tokenizer_config.json`, rendered with
//! minijinja the way `transformers` renders it (`trim_blocks`,
//! `lstrip_blocks`, Python string methods, `raise_exception`), or with the
//! documented [canonical](ChatTemplate::canonical) template.
//!
//! What matters for prefix-aware routing is that a conversation's next
//! prompt *extends* the previous one: the prompt of turn N+1 starts with
//! the prompt of turn N followed by the answer, so the KV cache built for
//! turn N is reused. The canonical template guarantees this exactly:
//!
//! ```text
//! render(msgs) + answer + "\n" + rest == render(msgs + [assistant: answer, user: ...])
//! ```
//!
//! Qwen3's template (tested below with the real `tokenizer_config.json`)
//! has the property up to the end of the previous generation prompt, and
//! for answers without a `<think>` block the answer follows verbatim too
//! (then `<|im_end|>\n`). An assistant message with a
//! `<think>…</think>` block is re-rendered *without* it in later turns, so
//! the reasoning tokens a server generated are never reused; and with
//! `enable_thinking=false` the generation prompt ends with an empty
//! `<think>\n\n</think>\n\n` block that later turns do not repeat, so the
//! shared prefix ends at `<|im_start|>assistant\n`.
//!
//! # Output tokens
//!
//! [`OutputVocab`] is the set of words the simulator "generates": common
//! English words that are exactly one token with a leading space and decode
//! back to themselves, so a generated answer re-tokenizes to the very ids
//! that were generated when a client sends it back in the next turn.

use std::path::Path;
use std::sync::{Arc, OnceLock};

/// Why a tokenizer or chat template could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// The tokenizer file could not be read or parsed.
    #[error("cannot load tokenizer {path}: {reason}")]
    Load {
        /// Where from.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// The tokenizer_config.json has no usable chat template.
    #[error("cannot load chat template from {path}: {reason}")]
    Template {
        /// Where from.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// Rendering the chat template failed for these messages.
    #[error("cannot render the chat messages: {0}")]
    Render(String),
}

/// The bundled tokenizer.json (Microsoft Phi-2, GPT-2 vocabulary).
const BUNDLED_JSON: &[u8] = include_bytes!("../assets/phi2-tokenizer.json");

/// A loaded tokenizer. Cheap to clone (the model is shared).
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
}

impl Tokenizer {
    /// Loads a tokenizer.json.
    pub fn from_file(path: &Path) -> Result<Self, TokenizeError> {
        let load_err = |reason: String| TokenizeError::Load {
            path: path.display().to_string(),
            reason,
        };
        let bytes = std::fs::read(path).map_err(|e| load_err(e.to_string()))?;
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| load_err(e.to_string()))?;
        Ok(Self { inner: Arc::new(inner) })
    }

    /// The tokenizer bundled in the binary (Microsoft Phi-2's, the GPT-2
    /// vocabulary; `workers/assets/phi2-tokenizer.json`). Parsed once per
    /// process; later calls share it.
    pub fn bundled() -> Self {
        static BUNDLED: OnceLock<Tokenizer> = OnceLock::new();
        BUNDLED
            .get_or_init(|| {
                let inner = tokenizers::Tokenizer::from_bytes(BUNDLED_JSON)
                    .expect("the bundled tokenizer.json is valid (checked by the tests)");
                Self { inner: Arc::new(inner) }
            })
            .clone()
    }

    /// Token ids of `text` (no special tokens added; special tokens written
    /// in the text are recognised).
    ///
    /// Byte-level BPE tokenizers such as the bundled one encode any text;
    /// should a tokenizer fail on some text, the result is empty.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.inner
            .encode(text, false)
            .map(|encoding| encoding.get_ids().to_vec())
            .unwrap_or_default()
    }

    /// Text of `ids` (special tokens kept). Ids outside the vocabulary are
    /// left out; should decoding fail altogether, the result is empty.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }

    /// Number of token ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// One chat message, content already flattened to text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The text.
    pub content: String,
}

/// What a message looks like to a Jinja template.
#[derive(serde::Serialize)]
struct TemplateMessage<'a> {
    role: &'a str,
    content: &'a str,
}

/// Name of the one template in a compiled environment.
const TEMPLATE_NAME: &str = "chat_template";

/// A compiled Jinja chat template and the special tokens it is given.
#[derive(Debug)]
struct Compiled {
    env: minijinja::Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

/// Turns chat messages into the prompt text.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    compiled: Option<Arc<Compiled>>,
}

impl ChatTemplate {
    /// The documented canonical rendering (used when no template is given):
    /// each message as `<|{role}|>\n{content}\n`, then the generation
    /// prompt `<|assistant|>\n`. For example
    ///
    /// ```text
    /// <|system|>
    /// Be brief.
    /// <|user|>
    /// Hi
    /// <|assistant|>
    /// ```
    ///
    /// (with a final newline). Turn N+1's prompt extends turn N's prompt
    /// and answer exactly: `render(msgs) + answer + "\n" + render([user])`
    /// equals `render(msgs + [assistant: answer, user])`.
    pub fn canonical() -> Self {
        Self { compiled: None }
    }

    /// The `chat_template` of a HF tokenizer_config.json: a string, or a
    /// list of `{name, template}` of which the one named `default` is used.
    /// The config's `bos_token` and `eos_token` (strings or
    /// `{content: ...}` objects), when present, are passed to the template.
    pub fn from_tokenizer_config(path: &Path) -> Result<Self, TokenizeError> {
        let template_err = |reason: String| TokenizeError::Template {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| template_err(e.to_string()))?;
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| template_err(format!("not JSON: {e}")))?;
        let source = match config.get("chat_template") {
            Some(serde_json::Value::String(source)) => source.clone(),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|entry| entry.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|entry| entry.get("template"))
                .and_then(|t| t.as_str())
                .ok_or_else(|| template_err("chat_template is a list with no template named \"default\"".into()))?
                .to_owned(),
            Some(_) => return Err(template_err("chat_template is neither a string nor a list".into())),
            None => return Err(template_err("no chat_template".into())),
        };
        let special = |key: &str| match config.get(key) {
            Some(serde_json::Value::String(token)) => Some(token.clone()),
            Some(serde_json::Value::Object(token)) => token.get("content").and_then(|c| c.as_str()).map(str::to_owned),
            _ => None,
        };
        Self::compile(source, special("bos_token"), special("eos_token")).map_err(template_err)
    }

    /// A Jinja chat template given as text (HF conventions, as for
    /// [`from_tokenizer_config`](Self::from_tokenizer_config)), with the
    /// `bos_token` and `eos_token` it may use.
    pub fn from_source(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self, TokenizeError> {
        Self::compile(
            source.to_owned(),
            bos_token.map(str::to_owned),
            eos_token.map(str::to_owned),
        )
        .map_err(|reason| TokenizeError::Template {
            path: "<inline>".into(),
            reason,
        })
    }

    /// Compiles `source` in an environment set up like `transformers`'.
    fn compile(source: String, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self, String> {
        let mut env = minijinja::Environment::new();
        // transformers renders chat templates with trim_blocks and
        // lstrip_blocks, and with Python's string methods available.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| format!("the template does not compile: {e:#}"))?;
        Ok(Self {
            compiled: Some(Arc::new(Compiled {
                env,
                bos_token,
                eos_token,
            })),
        })
    }

    /// The prompt text for `messages`, ending with the assistant's
    /// generation prompt.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, TokenizeError> {
        self.render_with(messages, None)
    }

    /// [`render`](Self::render), with one extra template variable (such as
    /// `enable_thinking`) for the tests.
    fn render_with(
        &self,
        messages: &[ChatMessage],
        extra: Option<(&str, minijinja::Value)>,
    ) -> Result<String, TokenizeError> {
        let Some(compiled) = &self.compiled else {
            return Ok(render_canonical(messages));
        };
        let messages: Vec<TemplateMessage<'_>> = messages
            .iter()
            .map(|m| TemplateMessage {
                role: &m.role,
                content: &m.content,
            })
            .collect();
        let mut vars = std::collections::BTreeMap::new();
        vars.insert("messages", minijinja::Value::from_serialize(&messages));
        vars.insert("add_generation_prompt", minijinja::Value::from(true));
        if let Some(bos) = &compiled.bos_token {
            vars.insert("bos_token", minijinja::Value::from(bos.as_str()));
        }
        if let Some(eos) = &compiled.eos_token {
            vars.insert("eos_token", minijinja::Value::from(eos.as_str()));
        }
        if let Some((name, value)) = extra {
            vars.insert(name, value);
        }
        let template = compiled
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TokenizeError::Render(format!("{e:#}")))?;
        template
            .render(&vars)
            .map_err(|e| TokenizeError::Render(format!("{e:#}")))
    }
}

/// The canonical rendering (see [`ChatTemplate::canonical`]).
fn render_canonical(messages: &[ChatMessage]) -> String {
    let len = messages
        .iter()
        .map(|m| m.role.len() + m.content.len() + 6)
        .sum::<usize>()
        + 14;
    let mut out = String::with_capacity(len);
    for message in messages {
        out.push_str("<|");
        out.push_str(&message.role);
        out.push_str("|>\n");
        out.push_str(&message.content);
        out.push('\n');
    }
    out.push_str("<|assistant|>\n");
    out
}

/// Candidate output words: common English words, lowercase letters only.
/// [`OutputVocab::new`] keeps those that are one token with a leading space.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he",
    "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were", "their",
    "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no",
    "she", "other", "its", "may", "these", "what", "them", "than", "some", "him", "time", "into", "only", "do", "out",
    "could", "first", "new", "two", "any", "our", "about", "also", "over", "then", "most", "like", "made", "after",
    "such", "many", "before", "must", "through", "back", "years", "where", "much", "your", "way", "well", "down",
    "should", "because", "each", "just", "those", "people", "how", "too", "little", "state", "good", "very", "make",
    "world", "still", "own", "see", "men", "work", "long", "get", "here", "between", "both", "life", "being", "under",
    "never", "day", "same", "another", "know", "while", "last", "might", "us", "great", "old", "year", "off", "come",
    "since", "against", "go", "came", "right", "used", "take", "three", "small", "large", "next", "early", "water",
    "house", "number", "part", "place", "case", "point", "group", "problem", "fact", "hand", "high", "home", "light",
    "night", "open", "order", "city", "name", "line", "play", "power", "story", "system", "game", "form", "book",
    "idea", "head", "face", "school", "family", "question", "word", "side", "area", "road", "land", "river", "music",
    "table", "tree", "stone", "green", "blue", "red", "white", "black", "cold", "warm", "quick", "slow", "simple",
    "clear", "short", "young", "happy", "real", "true", "free", "full", "strong", "wide", "deep", "close",
];

/// The words the simulator "generates": single tokens, so generated ids
/// re-tokenize to themselves when a client sends the answer back.
#[derive(Debug, Clone)]
pub struct OutputVocab {
    words: Vec<u32>,
}

impl OutputVocab {
    /// Picks the vocabulary for `tokenizer`: the built-in common words for
    /// which `encode(" " + word)` is exactly one token that decodes back to
    /// `" " + word`. Should no word qualify (an exotic tokenizer), the
    /// single lowercase letters that are one token each are used, and as a
    /// last resort the first token of `"a"`.
    pub fn new(tokenizer: &Tokenizer) -> Self {
        let single = |text: &str| match tokenizer.encode(text).as_slice() {
            &[id] if tokenizer.decode(&[id]) == text => Some(id),
            _ => None,
        };
        let mut words: Vec<u32> = WORDS.iter().filter_map(|word| single(&format!(" {word}"))).collect();
        if words.is_empty() {
            words = ('a'..='z').filter_map(|c| single(&c.to_string())).collect();
        }
        if words.is_empty() {
            words.push(tokenizer.encode("a").first().copied().unwrap_or(0));
        }
        words.sort_unstable();
        words.dedup();
        Self { words }
    }

    /// `n` output token ids, a deterministic function of `seed` (each drawn
    /// uniformly from [`ids`](Self::ids) with splitmix64).
    pub fn generate(&self, seed: u64, n: usize) -> Vec<u32> {
        let mut state = seed;
        let len = self.words.len() as u128;
        (0..n)
            .map(|_| {
                let index = (u128::from(splitmix64(&mut state)) * len) >> 64;
                self.words[index as usize]
            })
            .collect()
    }

    /// The token ids that can be generated, sorted.
    pub fn ids(&self) -> &[u32] {
        &self.words
    }
}

/// The splitmix64 generator: advances `state` and returns the next value.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// A file of `/work/shared/data/tokenizers/`, found from the crate.
    fn shared_tokenizer_file(name: &str) -> Option<PathBuf> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/data/tokenizers")
            .join(name);
        if path.is_file() {
            Some(path)
        } else {
            println!("skipped: {} is absent (it lives only in shared/data)", path.display());
            None
        }
    }

    fn qwen3() -> Option<Tokenizer> {
        shared_tokenizer_file("qwen3-tokenizer.json").map(|p| Tokenizer::from_file(&p).expect("Qwen3 tokenizer loads"))
    }

    fn qwen3_template() -> Option<ChatTemplate> {
        shared_tokenizer_file("qwen3-tokenizer_config.json")
            .map(|p| ChatTemplate::from_tokenizer_config(&p).expect("Qwen3 chat template loads"))
    }

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn bundled_phi2_gives_the_gpt2_ids() {
        let tok = Tokenizer::bundled();
        assert_eq!(tok.vocab_size(), 50295);
        assert_eq!(tok.encode("Hello, world!"), [15496, 11, 995, 0]);
        assert_eq!(
            tok.encode("The quick brown fox jumps over the lazy dog."),
            [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]
        );
        assert_eq!(
            tok.encode("KV cache aware routing for LLM inference servers."),
            [42, 53, 12940, 3910, 28166, 329, 27140, 44, 32278, 9597, 13]
        );
        assert_eq!(tok.decode(&[15496, 11, 995, 0]), "Hello, world!");
        // The special token written in the text is recognised, not spelled out.
        assert_eq!(tok.encode("<|endoftext|>"), [50256]);
        assert_eq!(tok.decode(&[50256]), "<|endoftext|>");
        assert_eq!(tok.encode(""), Vec::<u32>::new());
    }

    #[test]
    fn bundled_is_shared() {
        assert!(Arc::ptr_eq(&Tokenizer::bundled().inner, &Tokenizer::bundled().inner));
    }

    #[test]
    fn from_file_loads_the_same_phi2_and_reports_errors() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/phi2-tokenizer.json");
        let tok = Tokenizer::from_file(&path).unwrap();
        assert_eq!(tok.encode("Hello, world!"), [15496, 11, 995, 0]);

        let missing = Path::new("/nonexistent/tokenizer.json");
        match Tokenizer::from_file(missing) {
            Err(TokenizeError::Load { path, reason }) => {
                assert_eq!(path, "/nonexistent/tokenizer.json");
                assert!(!reason.is_empty());
            }
            other => panic!("expected a Load error, got {other:?}"),
        }
        let dir = std::env::temp_dir().join(format!("semlb-tokenize-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("tokenizer.json");
        std::fs::write(&bad, "{\"not\": \"a tokenizer\"}").unwrap();
        assert!(matches!(Tokenizer::from_file(&bad), Err(TokenizeError::Load { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn qwen3_gives_the_documented_ids() {
        let Some(tok) = qwen3() else { return };
        assert_eq!(tok.vocab_size(), 151669);
        assert_eq!(tok.encode("Hello, world!"), [9707, 11, 1879, 0]);
        assert_eq!(
            tok.encode("The quick brown fox jumps over the lazy dog."),
            [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
        );
        assert_eq!(tok.encode("你好，世界！"), [108386, 3837, 99489, 6313]);
        let chat = "<|im_start|>user\nHi<|im_end|>\n";
        assert_eq!(tok.encode(chat), [151644, 872, 198, 13048, 151645, 198]);
        assert_eq!(tok.decode(&[151644, 872, 198, 13048, 151645, 198]), chat);
    }

    #[test]
    fn canonical_renders_the_documented_form() {
        let t = ChatTemplate::canonical();
        let out = t.render(&[msg("system", "Be brief."), msg("user", "Hi")]).unwrap();
        assert_eq!(out, "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n");
        assert_eq!(t.render(&[]).unwrap(), "<|assistant|>\n");
    }

    #[test]
    fn canonical_next_turn_extends_prompt_and_answer_exactly() {
        let t = ChatTemplate::canonical();
        let turn1 = vec![msg("system", "You are helpful."), msg("user", "Name three rivers.")];
        let answer = " the river water and";
        let mut turn2 = turn1.clone();
        turn2.push(msg("assistant", answer));
        turn2.push(msg("user", "And three lakes?"));
        let rest = t.render(&[msg("user", "And three lakes?")]).unwrap();
        let p1 = t.render(&turn1).unwrap();
        let p2 = t.render(&turn2).unwrap();
        assert_eq!(format!("{p1}{answer}\n{rest}"), p2);

        // And at the token level, with generated words as the answer: the
        // ids of turn 1's prompt and answer are a prefix of turn 2's ids.
        let tok = Tokenizer::bundled();
        let vocab = OutputVocab::new(&tok);
        let generated = vocab.generate(7, 40);
        let answer = tok.decode(&generated);
        let mut turn2 = turn1.clone();
        turn2.push(msg("assistant", &answer));
        turn2.push(msg("user", "More?"));
        let mut expect = tok.encode(&p1);
        expect.extend_from_slice(&generated);
        let ids2 = tok.encode(&t.render(&turn2).unwrap());
        assert_eq!(ids2[..expect.len()], expect[..]);
    }

    #[test]
    fn jinja_template_from_source_and_errors() {
        let src = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content.strip() }}\n{% endfor %}\
                   {% if add_generation_prompt %}[assistant]{% endif %}";
        let t = ChatTemplate::from_source(src, Some("<s>"), None).unwrap();
        assert_eq!(t.render(&[msg("user", "  hi  ")]).unwrap(), "<s>[user]hi\n[assistant]");

        let raising = "{{ raise_exception('only user messages') }}";
        let t = ChatTemplate::from_source(raising, None, None).unwrap();
        match t.render(&[msg("user", "hi")]) {
            Err(TokenizeError::Render(reason)) => assert!(reason.contains("only user messages"), "{reason}"),
            other => panic!("expected a Render error, got {other:?}"),
        }
        assert!(matches!(
            ChatTemplate::from_source("{% if %}", None, None),
            Err(TokenizeError::Template { .. })
        ));
    }

    #[test]
    fn tokenizer_config_variants() {
        let dir = std::env::temp_dir().join(format!("semlb-template-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, json: serde_json::Value| {
            let path = dir.join(name);
            std::fs::write(&path, json.to_string()).unwrap();
            path
        };
        let listed = write(
            "listed.json",
            serde_json::json!({
                "bos_token": {"content": "<s>", "lstrip": false},
                "eos_token": "</s>",
                "chat_template": [
                    {"name": "tool_use", "template": "tools"},
                    {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"},
                ],
            }),
        );
        let t = ChatTemplate::from_tokenizer_config(&listed).unwrap();
        assert_eq!(t.render(&[msg("user", "x")]).unwrap(), "<s>x</s>");

        let none = write("none.json", serde_json::json!({"eos_token": "</s>"}));
        assert!(matches!(
            ChatTemplate::from_tokenizer_config(&none),
            Err(TokenizeError::Template { .. })
        ));
        let no_default = write(
            "nodefault.json",
            serde_json::json!({"chat_template": [{"name": "x", "template": ""}]}),
        );
        assert!(matches!(
            ChatTemplate::from_tokenizer_config(&no_default),
            Err(TokenizeError::Template { .. })
        ));
        let missing = dir.join("missing.json");
        assert!(matches!(
            ChatTemplate::from_tokenizer_config(&missing),
            Err(TokenizeError::Template { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn qwen3_template_renders_chatml() {
        let Some(t) = qwen3_template() else { return };
        let out = t
            .render(&[msg("system", "You are a helpful assistant."), msg("user", "Hi")])
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        // Without a system message there is no system block.
        assert_eq!(
            t.render(&[msg("user", "Hi")]).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    /// The finding for Qwen3's template: the next turn extends the previous
    /// prompt and a plain answer exactly; a `<think>` block is dropped from
    /// earlier assistant turns; `enable_thinking=false` adds an empty think
    /// block to the generation prompt that later turns do not repeat.
    #[test]
    fn qwen3_template_prefix_property() {
        let Some(t) = qwen3_template() else { return };
        let turn1 = vec![
            msg("system", "You are a helpful assistant."),
            msg("user", "Name three rivers."),
        ];
        let p1 = t.render(&turn1).unwrap();
        let next = |answer: &str| {
            let mut turn2 = turn1.clone();
            turn2.push(msg("assistant", answer));
            turn2.push(msg("user", "And three lakes?"));
            t.render(&turn2).unwrap()
        };
        let rest = "<|im_end|>\n<|im_start|>user\nAnd three lakes?<|im_end|>\n<|im_start|>assistant\n";

        // A plain answer: exactly prompt + answer + <|im_end|>\n + the new turn.
        let answer = " the river water and";
        assert_eq!(next(answer), format!("{p1}{answer}{rest}"));

        // An answer with a reasoning block: the prompt is still a prefix, but
        // the reasoning is not re-rendered, so only the final text follows.
        let p2 = next("<think>\nLet me think.\n</think>\n\nNile, Amazon, Yangtze.");
        assert_eq!(p2, format!("{p1}Nile, Amazon, Yangtze.{rest}"));

        // enable_thinking=false: turn 1's generation prompt ends with an empty
        // think block that turn 2 does not contain; the shared prefix stops
        // at `<|im_start|>assistant\n`.
        let p1_no_think = t
            .render_with(&turn1, Some(("enable_thinking", minijinja::Value::from(false))))
            .unwrap();
        assert_eq!(p1_no_think, format!("{p1}<think>\n\n</think>\n\n"));
        assert!(!next(answer).starts_with(&p1_no_think));
    }

    /// The token-level version with the real Qwen3 tokenizer: turn 1's
    /// prompt ids followed by the generated ids are a prefix of turn 2's ids.
    #[test]
    fn qwen3_next_turn_reuses_prompt_and_generated_ids() {
        let (Some(t), Some(tok)) = (qwen3_template(), qwen3()) else {
            return;
        };
        let vocab = OutputVocab::new(&tok);
        let turn1 = vec![
            msg("system", "You are a helpful assistant."),
            msg("user", "Name three rivers."),
        ];
        let p1 = t.render(&turn1).unwrap();
        for seed in 0..20 {
            let generated = vocab.generate(seed, 64);
            let mut turn2 = turn1.clone();
            turn2.push(msg("assistant", &tok.decode(&generated)));
            turn2.push(msg("user", "And three lakes?"));
            let ids2 = tok.encode(&t.render(&turn2).unwrap());
            let mut expect = tok.encode(&p1);
            expect.extend_from_slice(&generated);
            expect.push(151645); // <|im_end|>
            assert_eq!(ids2[..expect.len()], expect[..], "seed {seed}");
        }
    }

    fn check_vocab(tok: &Tokenizer) {
        let vocab = OutputVocab::new(tok);
        assert!(vocab.ids().len() >= 150, "only {} words qualify", vocab.ids().len());
        assert_eq!(vocab.generate(42, 100), vocab.generate(42, 100));
        assert_ne!(vocab.generate(42, 100), vocab.generate(43, 100));
        assert_eq!(vocab.generate(5, 0), Vec::<u32>::new());
        // A longer draw is an extension of a shorter one.
        assert_eq!(vocab.generate(9, 300)[..10], vocab.generate(9, 10)[..]);
        for seed in 0..50 {
            let ids = vocab.generate(seed, 200);
            assert!(ids.iter().all(|id| vocab.ids().contains(id)));
            let text = tok.decode(&ids);
            assert!(text.starts_with(' '));
            assert_eq!(tok.encode(&text), ids, "seed {seed}: {text:?}");
        }
        // Draws spread over the vocabulary.
        let drawn: std::collections::HashSet<u32> = vocab.generate(1, 5000).into_iter().collect();
        assert!(
            drawn.len() * 10 >= vocab.ids().len() * 9,
            "{} of {}",
            drawn.len(),
            vocab.ids().len()
        );
    }

    #[test]
    fn output_vocab_round_trips_bundled() {
        check_vocab(&Tokenizer::bundled());
    }

    #[test]
    fn output_vocab_round_trips_qwen3() {
        let Some(tok) = qwen3() else { return };
        check_vocab(&tok);
    }

    #[test]
    fn output_vocab_words_are_single_tokens() {
        let tok = Tokenizer::bundled();
        let vocab = OutputVocab::new(&tok);
        assert!(vocab.ids().contains(&262)); // " the"
        assert!(WORDS.len() >= 200);
        assert!(
            WORDS
                .iter()
                .all(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase()))
        );
    }

    #[test]
    fn splitmix64_known_values() {
        // Reference values of splitmix64 seeded with 0.
        let mut state = 0;
        assert_eq!(splitmix64(&mut state), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(&mut state), 0x6E78_9E6A_A1B9_65F4);
    }
}
