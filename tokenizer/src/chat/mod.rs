//! Chat messages to prompt text.
//!
//! [`ChatTemplate`] turns chat messages into prompt text, either with the
//! `chat_template` (Jinja) of a HF `tokenizer_config.json`, or with the
//! documented [canonical](ChatTemplate::canonical) template.
//!
//! # Layout
//!
//! | module | concept |
//! | --- | --- |
//! | this file | [`ChatTemplate`] (which renderer a template gets), [`ChatMessage`], [`TemplateError`], the canonical rendering |
//! | `jinja` | the template rendered with minijinja the way `transformers` renders it (`trim_blocks`, `lstrip_blocks`, Python string methods, `raise_exception`) |
//! | `native` | Rust renderers that write exactly what minijinja renders for a few published templates (Qwen3, Qwen2.5, ChatML, Llama-3, Phi-3), without its cost |
//!
//! A template gets a native renderer only when its source is byte for byte
//! one the `native` module knows; any other template, or a known one edited
//! by a single character, is rendered by minijinja.
//! [`ChatTemplate::renderer_name`] says which renderer is in use.
//!
//! # Usage
//!
//! ```
//! use semlb_tokenizer::chat::{ChatMessage, ChatTemplate};
//!
//! // transformers' default ChatML template, byte for byte: rendered natively.
//! let source = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] \
//!               + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}\
//!               {{ '<|im_start|>assistant\n' }}{% endif %}";
//! let template = ChatTemplate::from_source(source, None, None).unwrap();
//! assert_eq!(template.renderer_name(), "native chatml");
//!
//! // Messages borrow their text (from a request body, say).
//! let body = String::from("Hi!");
//! let messages = [ChatMessage::new("user", body.as_str())];
//! let mut prompt = String::new();
//! template.render_into(&messages, &mut prompt).unwrap();
//! assert_eq!(prompt, "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n");
//!
//! // Any other template is rendered by minijinja.
//! let other = ChatTemplate::from_source("{{ messages[0].content }}", None, None).unwrap();
//! assert_eq!(other.renderer_name(), "jinja");
//! assert_eq!(other.render(&messages).unwrap(), "Hi!");
//! ```
//!
//! # Prefix property
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

use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

pub mod continue_final;
mod jinja;
mod native;
mod value;

use jinja::JinjaTemplate;
use native::{NativeTemplate, RenderOptions};
pub use value::{TemplateValue, python_float_repr};

/// Why a GGUF file gives no template.
const NO_GGUF_TEMPLATE: &str = "no tokenizer.chat_template in its metadata";
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

/// One chat message, content already flattened to text. The strings are
/// borrowed (from a request body, say) or owned.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatMessage<'a> {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: Cow<'a, str>,
    /// The text.
    pub content: Cow<'a, str>,
    /// What else the engine hands the template with the message, in order:
    /// an assistant message's `tool_calls` (each `{id, type, function:
    /// {name, arguments}}`, the arguments parsed as `json.loads` parses
    /// them), a tool message's `tool_call_id` and `name`, an assistant
    /// message's `reasoning_content`. Empty for a plain message; a message
    /// with fields is rendered by minijinja (or canonically).
    pub fields: Vec<(Cow<'a, str>, TemplateValue<'a>)>,
}

impl<'a> ChatMessage<'a> {
    /// A message of `role` and `content`, borrowed or owned.
    pub fn new(role: impl Into<Cow<'a, str>>, content: impl Into<Cow<'a, str>>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            fields: Vec::new(),
        }
    }

    /// The message with field `name` set to `value` (added after the
    /// others).
    pub fn with(mut self, name: impl Into<Cow<'a, str>>, value: TemplateValue<'a>) -> Self {
        self.fields.push((name.into(), value));
        self
    }

    /// Its field `name`, if it has one.
    pub fn field(&self, name: &str) -> Option<&TemplateValue<'a>> {
        self.fields.iter().find(|(k, _)| k == name).map(|(_, v)| v)
    }

    /// The message with strings of its own.
    pub fn into_owned(self) -> ChatMessage<'static> {
        ChatMessage {
            role: Cow::Owned(self.role.into_owned()),
            content: Cow::Owned(self.content.into_owned()),
            fields: self
                .fields
                .into_iter()
                .map(|(k, v)| (Cow::Owned(k.into_owned()), v.into_owned()))
                .collect(),
        }
    }
}

/// What a chat template renders besides the messages: the request's
/// `tools` (each as the engine hands it, `{type: "function", function:
/// {name, description, parameters}}`) and its `chat_template_kwargs`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RenderInputs<'a> {
    /// `tools`, when the request has any (a template told none renders as
    /// it does without the variable).
    pub tools: Option<&'a [TemplateValue<'a>]>,
    /// Further template variables (`enable_thinking`, ...).
    pub variables: Vec<(Cow<'a, str>, TemplateValue<'a>)>,
}

/// The special tokens a chat template is given, from the tokenizer config.
#[derive(Debug, Clone, Default)]
struct SpecialTokens {
    /// `bos_token`, if the config defines one.
    bos_token: Option<String>,
    /// `eos_token`, if the config defines one.
    eos_token: Option<String>,
}

/// How a [`ChatTemplate`] renders.
#[derive(Debug, Clone)]
enum Renderer {
    /// The canonical rendering.
    Canonical,
    /// minijinja.
    Jinja(Arc<JinjaTemplate>),
    /// A native renderer; minijinja for template variables it does not
    /// support.
    Native {
        template: NativeTemplate,
        jinja: Arc<JinjaTemplate>,
    },
}

/// Turns chat messages into the prompt text.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    renderer: Renderer,
}

impl ChatTemplate {
    /// The documented canonical rendering (used when no template is given):
    /// each message as `<|{role}|>\n{content}\n`, then the generation
    /// prompt `<|assistant|>\n` (unless the variable
    /// `add_generation_prompt` is `false`). For example
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
        Self {
            renderer: Renderer::Canonical,
        }
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
        let special = SpecialTokens {
            bos_token: special("bos_token"),
            eos_token: special("eos_token"),
        };
        Self::compile(source, special).map_err(template_err)
    }

    /// The template a gateway renders with: the one in `template` (a file
    /// for [`from_file`](Self::from_file)) if given; else the GGUF model
    /// file `tokenizer`'s own, when it is one and has a template (the
    /// engine that serves the file renders with it); else
    /// [`canonical`](Self::canonical).
    pub fn resolve(template: Option<&Path>, tokenizer: Option<&Path>) -> Result<Self, TemplateError> {
        match (template, tokenizer) {
            (Some(path), _) => Self::from_file(path),
            (None, Some(path)) if crate::gguf::is_gguf_file(path) => {
                Ok(Self::gguf_template(path)?.unwrap_or_else(Self::canonical))
            }
            _ => Ok(Self::canonical()),
        }
    }

    /// The chat template of `path`: a GGUF model file's
    /// ([`from_gguf`](Self::from_gguf)), else a HF tokenizer_config.json's
    /// ([`from_tokenizer_config`](Self::from_tokenizer_config)).
    pub fn from_file(path: &Path) -> Result<Self, TemplateError> {
        if crate::gguf::is_gguf_file(path) {
            Self::from_gguf(path)
        } else {
            Self::from_tokenizer_config(path)
        }
    }

    /// The `tokenizer.chat_template` of a GGUF model file, with the
    /// `bos_token` and `eos_token` its ids name ([`crate::gguf`]).
    pub fn from_gguf(path: &Path) -> Result<Self, TemplateError> {
        Self::gguf_template(path)?.ok_or_else(|| TemplateError::Load {
            path: path.display().to_string(),
            reason: NO_GGUF_TEMPLATE.into(),
        })
    }

    /// [`from_gguf`](Self::from_gguf), with a file that has no template
    /// a value (`None`) rather than an error.
    fn gguf_template(path: &Path) -> Result<Option<Self>, TemplateError> {
        let template_err = |reason: String| TemplateError::Load {
            path: path.display().to_string(),
            reason,
        };
        let vocab = crate::gguf::GgufVocab::read_file(path).map_err(|e| template_err(e.to_string()))?;
        let Some(source) = vocab.chat_template.clone() else {
            return Ok(None);
        };
        let special = SpecialTokens {
            bos_token: vocab.token(vocab.bos_id).map(str::to_owned),
            eos_token: vocab.token(vocab.eos_id).map(str::to_owned),
        };
        Self::compile(source, special).map(Some).map_err(template_err)
    }

    /// A Jinja chat template given as text (HF conventions, as for
    /// [`from_tokenizer_config`](Self::from_tokenizer_config)), with the
    /// `bos_token` and `eos_token` it may use.
    pub fn from_source(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self, TemplateError> {
        let special = SpecialTokens {
            bos_token: bos_token.map(str::to_owned),
            eos_token: eos_token.map(str::to_owned),
        };
        Self::compile(source.to_owned(), special).map_err(|reason| TemplateError::Load {
            path: "<inline>".into(),
            reason,
        })
    }

    /// Compiles `source` with minijinja (so that a broken template fails
    /// here, and for the variables a native renderer does not support) and
    /// picks its native renderer if it has one.
    fn compile(source: String, special: SpecialTokens) -> Result<Self, String> {
        let native = NativeTemplate::recognise(&source);
        let jinja = Arc::new(JinjaTemplate::compile(source, special)?);
        let renderer = match native {
            Some(template) => Renderer::Native { template, jinja },
            None => Renderer::Jinja(jinja),
        };
        Ok(Self { renderer })
    }

    /// Which renderer turns messages into text: `canonical`, `jinja`, or
    /// `native <family>` (`native qwen3`, `native qwen2.5`, `native chatml`,
    /// `native llama3`, `native phi3`, `native phi3-original`), for the
    /// startup log.
    pub fn renderer_name(&self) -> &'static str {
        match &self.renderer {
            Renderer::Canonical => "canonical",
            Renderer::Jinja(_) => "jinja",
            Renderer::Native { template, .. } => template.renderer_name(),
        }
    }

    /// The same template rendered by minijinja even when a native renderer
    /// knows it: the reference the native renderers are compared with (tests,
    /// benchmarks). The canonical template stays canonical.
    pub fn with_jinja_renderer(&self) -> Self {
        let renderer = match &self.renderer {
            Renderer::Native { jinja, .. } => Renderer::Jinja(Arc::clone(jinja)),
            other => other.clone(),
        };
        Self { renderer }
    }

    /// The prompt text for `messages`, ending with the assistant's
    /// generation prompt.
    pub fn render(&self, messages: &[ChatMessage<'_>]) -> Result<String, TemplateError> {
        let mut out = String::new();
        self.render_into(messages, &mut out)?;
        Ok(out)
    }

    /// [`render`](Self::render), appending to `out`; on an error `out` is
    /// left as it was.
    pub fn render_into(&self, messages: &[ChatMessage<'_>], out: &mut String) -> Result<(), TemplateError> {
        self.render_with(messages, &RenderInputs::default(), out)
    }

    /// [`render_into`](Self::render_into), with the request's `tools` and
    /// template variables. A native renderer renders plain messages with
    /// no tools (and Qwen3's `enable_thinking`); anything else is rendered
    /// by minijinja, given what an engine gives the template.
    pub fn render_with(
        &self,
        messages: &[ChatMessage<'_>],
        inputs: &RenderInputs<'_>,
        out: &mut String,
    ) -> Result<(), TemplateError> {
        match &self.renderer {
            Renderer::Canonical => {
                render_canonical(messages, inputs, out);
                Ok(())
            }
            Renderer::Jinja(jinja) => {
                out.push_str(&jinja.render(messages, inputs)?);
                Ok(())
            }
            Renderer::Native { template, jinja } => {
                let plain = inputs.tools.is_none() && messages.iter().all(|m| m.fields.is_empty());
                let options = match &inputs.variables[..] {
                    _ if !plain => None,
                    [] => Some(RenderOptions::default()),
                    [(name, value)] => template.options_for(name, &value.to_template()),
                    _ => None,
                };
                let Some(options) = options else {
                    out.push_str(&jinja.render(messages, inputs)?);
                    return Ok(());
                };
                let start = out.len();
                template.render(messages, jinja.special(), options, out).map_err(|e| {
                    out.truncate(start);
                    TemplateError::Render(e.to_string())
                })
            }
        }
    }
}

/// The canonical rendering's turns.
const CANONICAL: native::Turns = native::Turns {
    before_role: "<|",
    after_role: "|>\n",
    after_content: "\n",
    generation: "<|assistant|>\n",
};

/// Appends the canonical rendering (see [`ChatTemplate::canonical`]).
fn render_canonical(messages: &[ChatMessage<'_>], inputs: &RenderInputs<'_>, out: &mut String) {
    // `add_generation_prompt = false` (a tool call's own rendering, a
    // message to continue) ends after the last turn.
    let generation = !inputs
        .variables
        .iter()
        .any(|(name, value)| name == "add_generation_prompt" && matches!(value, TemplateValue::Bool(false)));
    if generation && inputs.tools.is_none() && messages.iter().all(|m| m.fields.is_empty()) {
        return CANONICAL.render(messages, out);
    }
    if let Some(tools) = inputs.tools {
        out.push_str("<|tools|>\n");
        for tool in tools {
            out.push_str(&tool.to_json());
            out.push('\n');
        }
    }
    for message in messages {
        CANONICAL.render_turn(message, out);
        if let Some(TemplateValue::Array(calls)) = message.field("tool_calls") {
            for call in calls {
                out.push_str("<|tool_call|>\n");
                out.push_str(&call.get("function").unwrap_or(call).to_json());
                out.push('\n');
            }
        }
    }
    if generation {
        out.push_str(CANONICAL.generation);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF model file's own template is the gateway's when none is
    /// named; a file without one renders canonically (a value, not an
    /// error), though asking for its template explicitly is an error.
    #[test]
    fn a_gguf_tokenizer_gives_its_template_or_none() {
        use crate::gguf::tests::{Writer, tiny};
        let dir = std::env::temp_dir().join(format!("semlb-gguf-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.gguf");
        std::fs::write(&path, tiny("smollm").bytes()).unwrap();
        let own = ChatTemplate::resolve(None, Some(&path)).unwrap();
        assert_ne!(own.renderer_name(), "canonical", "the file's own template");
        let without = Writer::default()
            .string("tokenizer.ggml.model", "gpt2")
            .strings("tokenizer.ggml.tokens", &["a", "b"])
            .bytes();
        std::fs::write(&path, without).unwrap();
        let resolved = ChatTemplate::resolve(None, Some(&path));
        let from_gguf = ChatTemplate::from_gguf(&path);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(resolved.unwrap().renderer_name(), "canonical");
        assert!(from_gguf.is_err());
    }
    use crate::test_data;

    fn qwen3_template() -> Option<ChatTemplate> {
        test_data::tokenizer_file("qwen3-tokenizer_config.json")
            .map(|p| ChatTemplate::from_tokenizer_config(&p).expect("Qwen3 chat template loads"))
    }

    fn msg(role: &str, content: &str) -> ChatMessage<'static> {
        ChatMessage::new(role.to_owned(), content.to_owned())
    }

    /// [`ChatTemplate::render`] with one extra template variable.
    fn render_extra(
        t: &ChatTemplate,
        messages: &[ChatMessage<'_>],
        name: &str,
        value: TemplateValue<'static>,
    ) -> Result<String, TemplateError> {
        let mut out = String::new();
        let inputs = RenderInputs {
            tools: None,
            variables: vec![(Cow::Owned(name.to_owned()), value)],
        };
        t.render_with(messages, &inputs, &mut out)?;
        Ok(out)
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
        let p1_no_think = render_extra(&t, &turn1, "enable_thinking", TemplateValue::Bool(false)).unwrap();
        assert_eq!(p1_no_think, format!("{p1}<think>\n\n</think>\n\n"));
        assert!(!next(answer).starts_with(&p1_no_think));
    }

    #[test]
    fn qwen3_is_native_and_matches_jinja_with_enable_thinking() {
        let Some(native) = qwen3_template() else { return };
        assert_eq!(native.renderer_name(), "native qwen3");
        let jinja = native.with_jinja_renderer();
        assert_eq!(jinja.renderer_name(), "jinja");
        let turns = [
            msg("system", "Be brief."),
            msg("user", "Hi"),
            msg("assistant", "<think>\nhm\n</think>\n\nHello."),
            msg("user", "Again"),
        ];
        for value in [false, true] {
            let value = TemplateValue::Bool(value);
            assert_eq!(
                render_extra(&native, &turns, "enable_thinking", value.clone()).unwrap(),
                render_extra(&jinja, &turns, "enable_thinking", value).unwrap()
            );
        }
        // A variable the native renderer does not know goes to minijinja,
        // which sees it (here: a non-boolean enable_thinking is not false).
        let odd = TemplateValue::Int(0);
        assert_eq!(
            render_extra(&native, &turns, "enable_thinking", odd.clone()).unwrap(),
            render_extra(&jinja, &turns, "enable_thinking", odd).unwrap()
        );
    }

    #[test]
    fn renderer_names() {
        assert_eq!(ChatTemplate::canonical().renderer_name(), "canonical");
        assert_eq!(
            ChatTemplate::canonical().with_jinja_renderer().renderer_name(),
            "canonical"
        );
        let plain = ChatTemplate::from_source("{{ messages[0].content }}", None, None).unwrap();
        assert_eq!(plain.renderer_name(), "jinja");
        let chatml = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + \
                      '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}\
                      {% endif %}";
        let native = ChatTemplate::from_source(chatml, None, None).unwrap();
        assert_eq!(native.renderer_name(), "native chatml");
        assert_eq!(native.with_jinja_renderer().renderer_name(), "jinja");
        let edited = ChatTemplate::from_source(&chatml.replace("assistant", "assistant "), None, None).unwrap();
        assert_eq!(edited.renderer_name(), "jinja");
    }

    #[test]
    fn render_into_appends_and_leaves_out_alone_on_errors() {
        let borrowed = String::from("Hi");
        let messages = [ChatMessage::new("user", borrowed.as_str())];
        let canonical = ChatTemplate::canonical();
        let mut out = String::from("prefix:");
        canonical.render_into(&messages, &mut out).unwrap();
        assert_eq!(out, "prefix:<|user|>\nHi\n<|assistant|>\n");

        // A native renderer's error (Llama-3 without a bos_token).
        let llama3 = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = \
                      '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + \
                      '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}\
                      {{ content }}{% endfor %}{% if add_generation_prompt %}\
                      {{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
        let native = ChatTemplate::from_source(llama3, None, None).unwrap();
        assert_eq!(native.renderer_name(), "native llama3");
        let mut out = String::from("kept");
        assert!(matches!(
            native.render_into(&messages, &mut out),
            Err(TemplateError::Render(_))
        ));
        assert_eq!(out, "kept");
        assert!(native.with_jinja_renderer().render_into(&messages, &mut out).is_err());
        assert_eq!(out, "kept");
        let with_bos = ChatTemplate::from_source(llama3, Some("<|begin_of_text|>"), None).unwrap();
        with_bos.render_into(&[msg("user", " Hi \n")], &mut out).unwrap();
        assert_eq!(
            out,
            "kept<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }
}
