//! The request mixes of `semlb bench proxy` (`short`, `long`,
//! `long-unseen`): the chat bodies, the prompt text (HH-RLHF dialogues, or
//! generated sentences) cut to about `--prompt-tokens` tokens of the
//! tokenizer the run uses, and the [`Requests`] the load generator sends.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use semlb_tokenizer::Tokenizer;

use super::load::{self, Requests};
use super::{ProxyArgs, TEMPLATE_FILE, WorkloadKind};
use crate::Common;
use crate::dispatch_path::{PROMPTS_FILE, TOKENIZER_FILE};
use crate::end_to_end::{Dialogue, read_dialogues};

/// The model name the simulated engine serves.
const MODEL: &str = "semlb-sim";
/// The short workload's message.
const SHORT_MESSAGE: &str = "Say hello in one short sentence please.";
/// Distinct texts of the long workload (each request also has its own tag).
const LONG_TEXTS: usize = 64;

/// A workload's requests and what describes them.
pub(super) struct Workload {
    pub(super) kind: WorkloadKind,
    /// The path its requests go to.
    pub(super) path: &'static str,
    pub(super) requests: Arc<Requests>,
    /// Request body size (the first request's), bytes.
    pub(super) body_bytes: usize,
    /// Prompt tokens of the message text (client-side count; long only).
    pub(super) prompt_tokens: Option<f64>,
    /// Prompt tokens the engine counted (template included), from a check.
    pub(super) engine_prompt_tokens: Option<u64>,
}

/// The tokenizer and prompt text the run uses.
pub(super) struct TextSource {
    pub(super) tokenizer: Tokenizer,
    pub(super) tokenizer_name: String,
    /// `--tokenizer` / `--chat-template` for the gateway and `semlb-sim`.
    pub(super) files: Option<(PathBuf, PathBuf)>,
    pub(super) dialogues: Vec<Dialogue>,
    pub(super) dialogues_name: String,
}

impl TextSource {
    /// The tokenizer and chat template of the data directory (else the
    /// bundled ones) and its HH-RLHF dialogues (else generated ones).
    pub(super) fn load(common: &Common) -> Result<TextSource> {
        let data = common.data_dir();
        let file = |rel: &str| data.as_ref().map(|d| d.join(rel)).filter(|p| p.is_file());
        let (tokenizer, tokenizer_name, files) = match (file(TOKENIZER_FILE), file(TEMPLATE_FILE)) {
            (Some(tok), Some(template)) => (
                Tokenizer::from_file(&tok).with_context(|| format!("cannot load the tokenizer {}", tok.display()))?,
                format!("qwen3 ({}, chat template {})", tok.display(), template.display()),
                Some((tok, template)),
            ),
            _ => (
                Tokenizer::bundled(),
                "phi-2 (bundled) and the canonical chat template (no data directory)".to_owned(),
                None,
            ),
        };
        let (dialogues, dialogues_name) = match file(PROMPTS_FILE).map(|p| (read_dialogues(&p), p)) {
            Some((Ok(d), path)) if !d.is_empty() => (d, format!("HH-RLHF ({})", path.display())),
            _ => (
                generated_dialogues(),
                "generated text (no HH-RLHF file in the data directory)".to_owned(),
            ),
        };
        Ok(TextSource {
            tokenizer,
            tokenizer_name,
            files,
            dialogues,
            dialogues_name,
        })
    }

    /// A transcript of dialogue `i`.
    fn transcript(&self, i: usize) -> String {
        let d = &self.dialogues[i % self.dialogues.len()];
        let mut s = String::new();
        for (user, answer) in &d.turns {
            s.push_str("Human: ");
            s.push_str(user);
            s.push_str("\n\nAssistant: ");
            s.push_str(answer);
            s.push_str("\n\n");
        }
        s
    }

    /// About `tokens` tokens of dialogue text starting at dialogue `start`,
    /// and its exact token count.
    /// Text for the long-unseen workload: about `tokens` tokens once a
    /// typical request tag opens every line; the count is of that form.
    fn tagged_text_of(&self, start: usize, tokens: usize) -> (String, usize) {
        let tag = load::line_tag(7, 123_456);
        let mut want = tokens;
        let mut best = (String::new(), 0);
        for _ in 0..6 {
            let (text, _) = self.text_of(start, want);
            let count = self.tokenizer.encode(&load::tag_lines(&text, "\n", &tag)).len();
            best = (text, count);
            if count.abs_diff(tokens) <= tokens / 100 {
                break;
            }
            want = (want * tokens / count.max(1)).max(1);
        }
        best
    }

    fn text_of(&self, start: usize, tokens: usize) -> (String, usize) {
        let mut text = String::new();
        let mut next = start;
        let mut count = 0;
        // Whole dialogues until there are enough tokens...
        while count < tokens {
            while text.len() < tokens * 5 + 64 {
                text.push_str(&self.transcript(next));
                next += 1;
            }
            count = self.tokenizer.encode(&text).len();
            if count < tokens {
                text.push_str(&self.transcript(next));
                next += 1;
            }
        }
        // ...then cut in proportion (on a character boundary), a few times.
        for _ in 0..6 {
            if count.abs_diff(tokens) <= tokens / 200 {
                break;
            }
            let mut cut = (text.len() as f64 * tokens as f64 / count as f64) as usize;
            while cut < text.len() && !text.is_char_boundary(cut) {
                cut += 1;
            }
            if cut >= text.len() {
                text.push_str(&self.transcript(next));
                next += 1;
            } else {
                text.truncate(cut);
            }
            count = self.tokenizer.encode(&text).len();
        }
        (text, count)
    }
}

/// Dialogues when there is no HH-RLHF file: varied sentences.
fn generated_dialogues() -> Vec<Dialogue> {
    let subjects = [
        "the garden",
        "a bicycle",
        "bread",
        "the weather",
        "a letter",
        "the library",
        "music",
    ];
    let verbs = ["improve", "explain", "fix", "plan", "choose", "describe", "clean"];
    (0..500)
        .map(|i| Dialogue {
            turns: (0..3)
                .map(|t| {
                    let s = subjects[(i + t) % subjects.len()];
                    let v = verbs[(i * 3 + t) % verbs.len()];
                    (
                        format!("How do I {v} {s}? I tried a few things already (case {i}.{t})."),
                        format!(
                            "To {v} {s}, start small: look at what works, change one thing at a time, \
                             and write down what happens. Most people find that {s} responds well \
                             to patience, and that a second attempt goes faster than the first."
                        ),
                    )
                })
                .collect(),
        })
        .collect()
}

/// The JSON of a chat body, split around its message text.
fn chat_parts(max_tokens: u32, stream: bool) -> (String, String) {
    let head = format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":""#);
    let stream = if stream { r#","stream":true"# } else { "" };
    let tail = format!(r#""}}],"max_tokens":{max_tokens}{stream}}}"#);
    (head, tail)
}

/// The short request's body in the Responses or Messages API.
fn api_body(kind: WorkloadKind, max_tokens: u32, stream: bool) -> String {
    let mut body = match kind {
        WorkloadKind::ShortResponses => serde_json::json!({
            "model": MODEL, "input": SHORT_MESSAGE, "max_output_tokens": max_tokens, "store": false,
        }),
        _ => serde_json::json!({
            "model": MODEL, "messages": [{"role": "user", "content": SHORT_MESSAGE}], "max_tokens": max_tokens,
        }),
    };
    if stream {
        body["stream"] = true.into();
    }
    body.to_string()
}

/// The requests of workload `kind` (with `--prompt-tokens`, `--max-tokens`
/// and `--stream` from `args`) on the text of `text`.
pub(super) fn build_workload(kind: WorkloadKind, args: &ProxyArgs, text: &TextSource) -> Workload {
    let (head, tail) = chat_parts(args.max_tokens, args.stream);
    let (requests, prompt_tokens) = match kind {
        WorkloadKind::Short => (
            Requests::Fixed(Requests::http(format!("{head}{SHORT_MESSAGE}{tail}").as_bytes())),
            None,
        ),
        WorkloadKind::ShortResponses | WorkloadKind::ShortMessages => (
            Requests::Fixed(Requests::http_to(
                kind.path(),
                api_body(kind, args.max_tokens, args.stream).as_bytes(),
            )),
            None,
        ),
        WorkloadKind::Long | WorkloadKind::LongUnseen => {
            let step = (text.dialogues.len() / LONG_TEXTS).max(1);
            let (texts, counts): (Vec<String>, Vec<usize>) = (0..LONG_TEXTS)
                .map(|i| {
                    let (t, n) = match kind {
                        WorkloadKind::LongUnseen => text.tagged_text_of(i * step, args.prompt_tokens),
                        _ => text.text_of(i * step, args.prompt_tokens),
                    };
                    let escaped = serde_json::to_string(&t).expect("a string serialises");
                    (escaped[1..escaped.len() - 1].to_owned(), n)
                })
                .unzip();
            let mean = counts.iter().sum::<usize>() as f64 / counts.len() as f64;
            let every_line = kind == WorkloadKind::LongUnseen;
            let requests = Requests::Tagged {
                head,
                texts,
                tail,
                every_line,
            };
            (requests, Some(mean))
        }
    };
    let body_bytes = requests.body(0, 0).len();
    Workload {
        kind,
        path: kind.path(),
        requests: Arc::new(requests),
        body_bytes,
        prompt_tokens,
        engine_prompt_tokens: None,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn chat_bodies_are_the_documented_json() {
        let (head, tail) = chat_parts(16, false);
        let v: Value = serde_json::from_str(&format!("{head}{SHORT_MESSAGE}{tail}")).unwrap();
        assert_eq!(
            v,
            json!({"model": MODEL, "messages": [{"role": "user", "content": SHORT_MESSAGE}], "max_tokens": 16})
        );
        let text = format!("{head}{SHORT_MESSAGE}{tail}");
        let body = semlb::openai::body::Json::parse(text.as_bytes()).unwrap();
        assert!(
            !semlb::response_cache::is_deterministic(body.as_object().unwrap()),
            "the requests must bypass the response cache"
        );
        let (head, tail) = chat_parts(4, true);
        let v: Value = serde_json::from_str(&format!("{head}x{tail}")).unwrap();
        assert_eq!(v["stream"], true);
    }

    #[test]
    fn api_bodies_are_the_documented_json() {
        let r: Value = serde_json::from_str(&api_body(WorkloadKind::ShortResponses, 16, false)).unwrap();
        assert_eq!(
            r,
            json!({"model": MODEL, "input": SHORT_MESSAGE, "max_output_tokens": 16, "store": false})
        );
        let m: Value = serde_json::from_str(&api_body(WorkloadKind::ShortMessages, 16, true)).unwrap();
        assert_eq!(
            m,
            json!({"model": MODEL, "messages": [{"role": "user", "content": SHORT_MESSAGE}], "max_tokens": 16,
                   "stream": true})
        );
    }

    #[test]
    fn long_prompts_have_about_the_asked_tokens_and_differ() {
        let text = TextSource {
            tokenizer: Tokenizer::bundled(),
            tokenizer_name: String::new(),
            files: None,
            dialogues: generated_dialogues(),
            dialogues_name: String::new(),
        };
        let (a, n) = text.text_of(0, 500);
        assert!(n.abs_diff(500) <= 10, "{n} tokens");
        assert_eq!(text.tokenizer.encode(&a).len(), n);
        let (b, _) = text.text_of(10, 500);
        assert_ne!(a, b);
    }
}
