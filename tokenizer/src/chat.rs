//! Chat messages to prompt text.
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

use std::path::Path;
use std::sync::Arc;

/// Why a chat template could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The tokenizer_config.json has no usable chat template.
    #[error("cannot load chat template from {path}: {reason}")]
    Load {
        /// Where from.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// Rendering the chat template failed for these messages.
    #[error("cannot render the chat messages: {0}")]
    Render(String),
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
    pub fn from_tokenizer_config(path: &Path) -> Result<Self, TemplateError> {
        let template_err = |reason: String| TemplateError::Load {
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
    pub fn from_source(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self, TemplateError> {
        Self::compile(
            source.to_owned(),
            bos_token.map(str::to_owned),
            eos_token.map(str::to_owned),
        )
        .map_err(|reason| TemplateError::Load {
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
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, TemplateError> {
        self.render_with(messages, None)
    }

    /// [`render`](Self::render), with one extra template variable (such as
    /// `enable_thinking`) for the tests.
    fn render_with(
        &self,
        messages: &[ChatMessage],
        extra: Option<(&str, minijinja::Value)>,
    ) -> Result<String, TemplateError> {
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
            .map_err(|e| TemplateError::Render(format!("{e:#}")))?;
        template
            .render(&vars)
            .map_err(|e| TemplateError::Render(format!("{e:#}")))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data;

    fn qwen3_template() -> Option<ChatTemplate> {
        test_data::tokenizer_file("qwen3-tokenizer_config.json")
            .map(|p| ChatTemplate::from_tokenizer_config(&p).expect("Qwen3 chat template loads"))
    }

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn canonical_renders_the_documented_form() {
        let t = ChatTemplate::canonical();
        let out = t.render(&[msg("system", "Be brief."), msg("user", "Hi")]).unwrap();
        assert_eq!(out, "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n");
        assert_eq!(t.render(&[]).unwrap(), "<|assistant|>\n");
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
            Err(TemplateError::Render(reason)) => assert!(reason.contains("only user messages"), "{reason}"),
            other => panic!("expected a Render error, got {other:?}"),
        }
        assert!(matches!(
            ChatTemplate::from_source("{% if %}", None, None),
            Err(TemplateError::Load { .. })
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
            Err(TemplateError::Load { .. })
        ));
        let no_default = write(
            "nodefault.json",
            serde_json::json!({"chat_template": [{"name": "x", "template": ""}]}),
        );
        assert!(matches!(
            ChatTemplate::from_tokenizer_config(&no_default),
            Err(TemplateError::Load { .. })
        ));
        let missing = dir.join("missing.json");
        assert!(matches!(
            ChatTemplate::from_tokenizer_config(&missing),
            Err(TemplateError::Load { .. })
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
}
