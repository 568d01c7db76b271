//! Native chat-template renderers: Rust functions that write, byte for
//! byte, what minijinja renders for a few published chat templates, for the
//! inputs the gateway gives a template (messages of a `role` and a string
//! `content`, `add_generation_prompt = true`, the config's `bos_token` and
//! `eos_token`, no `tools`), in a fraction of the time.
//!
//! | family | module | published as |
//! | --- | --- | --- |
//! | ChatML | [`chatml`] | transformers' default ChatML, OpenHermes-2.5 |
//! | Llama-3 | [`llama3`] | Meta-Llama-3-8B-Instruct (current and first form) |
//! | Phi-3 | [`phi3`] | Phi-3-mini-4k/128k-instruct (current and first form) |
//! | Qwen2.5 | [`qwen2_5`] | Qwen2.5-Instruct |
//! | Qwen3 | [`qwen3`] | Qwen3 (and a later revision of its template) |
//!
//! # Recognition
//!
//! A template is rendered natively only when its source is exactly one of
//! [`KNOWN_SOURCES`]: same length in bytes and same 128-bit XXH3 hash
//! (whitespace included; a template edited by one character is rendered by
//! minijinja). XXH3 is not a cryptographic hash, but the template is the
//! operator's configuration, not request input, and an accidental collision
//! at equal length is out of reach (2^-128). The sources themselves are in
//! `tokenizer/tests/templates/` with their provenance, except Qwen3's, which
//! the tests read from `shared/data`.
//!
//! # Exactness
//!
//! Each module states the rule its template implements for these inputs,
//! including the odd ones (system messages not first, unknown roles, empty
//! content, an empty conversation, undefined special tokens), and mirrors
//! minijinja where it differs from Python Jinja (`trim` strips what Rust's
//! `str::trim` strips). Where minijinja fails, the renderer fails too
//! ([`NativeError`]). `tests/chat_native.rs` compares every renderer with
//! minijinja on real and generated conversations.

mod chatml;
mod llama3;
mod phi3;
mod qwen2_5;
mod qwen3;

use super::{ChatMessage, SpecialTokens};

/// A template that has a native renderer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NativeTemplate {
    /// Plain ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n`.
    ChatMl,
    /// Meta-Llama-3-Instruct.
    Llama3,
    /// Phi-3-mini-instruct, current form (system, user and assistant turns).
    Phi3,
    /// Phi-3-mini-instruct, first form (BOS, user and assistant turns only,
    /// the generation prompt written after each user turn).
    Phi3Original,
    /// Qwen2.5-Instruct (default system message).
    Qwen2_5,
    /// Qwen3 (reasoning stripped from earlier assistant turns).
    Qwen3,
}

/// Why a native renderer could not render: where minijinja fails.
#[derive(Debug, thiserror::Error)]
pub(super) enum NativeError {
    /// The template reads `messages[0]` of an empty conversation.
    #[error("the {template} template reads messages[0] and there are no messages (undefined value)")]
    NoMessages {
        /// Which template.
        template: &'static str,
    },
    /// The template adds `bos_token` to a string and the config defines none.
    #[error(
        "the {template} template adds bos_token to the first message and the tokenizer config defines no bos_token"
    )]
    UndefinedBosToken {
        /// Which template.
        template: &'static str,
    },
}

/// Template variables beyond the messages that a native renderer supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RenderOptions {
    /// Qwen3's `enable_thinking`: `false` ends the generation prompt with
    /// an empty think block.
    pub(super) enable_thinking: bool,
}

impl Default for RenderOptions {
    fn default() -> Self {
        Self { enable_thinking: true }
    }
}

/// A template source with a native renderer.
struct KnownSource {
    template: NativeTemplate,
    /// Length of the source in bytes.
    len: usize,
    /// `xxh3_128` of the source.
    xxh3_128: u128,
}

/// Every source rendered natively (provenance in
/// `tokenizer/tests/templates/SOURCES.md`).
const KNOWN_SOURCES: [KnownSource; 8] = [
    // tests/templates/chatml.jinja
    KnownSource {
        template: NativeTemplate::ChatMl,
        len: 196,
        xxh3_128: 0xf0a6a8278439fdb056191e205a440263,
    },
    // tests/templates/llama3.jinja
    KnownSource {
        template: NativeTemplate::Llama3,
        len: 389,
        xxh3_128: 0x09facc0e4aa943189799ad6e2dea0594,
    },
    // tests/templates/llama3-original.jinja
    KnownSource {
        template: NativeTemplate::Llama3,
        len: 348,
        xxh3_128: 0x8f20b9eda669ce10b97891b7adc1beb8,
    },
    // tests/templates/phi3.jinja
    KnownSource {
        template: NativeTemplate::Phi3,
        len: 407,
        xxh3_128: 0x0850c77e9e7c37ed82fc89c04c54ba66,
    },
    // tests/templates/phi3-original.jinja
    KnownSource {
        template: NativeTemplate::Phi3Original,
        len: 269,
        xxh3_128: 0xa2ff678db9487565551cbfd01fcc4680,
    },
    // tests/templates/qwen2.5.jinja
    KnownSource {
        template: NativeTemplate::Qwen2_5,
        len: 2507,
        xxh3_128: 0xc63bde148c12b98b639547fe4d33fa67,
    },
    // shared/data/tokenizers/qwen3-tokenizer_config.json (Qwen/Qwen3-0.6B)
    KnownSource {
        template: NativeTemplate::Qwen3,
        len: 4116,
        xxh3_128: 0x4457e3d12b367a860283f874ff58d644,
    },
    // tests/templates/qwen3-ortx.jinja
    KnownSource {
        template: NativeTemplate::Qwen3,
        len: 4168,
        xxh3_128: 0x0fab82ce8f4d5175c9e0155c80737cf2,
    },
];

impl NativeTemplate {
    /// The native renderer of `source`, if it is exactly a known template.
    pub(super) fn recognise(source: &str) -> Option<Self> {
        let candidates = KNOWN_SOURCES.iter().filter(|known| known.len == source.len());
        let mut candidates = candidates.peekable();
        candidates.peek()?;
        let hash = xxhash_rust::xxh3::xxh3_128(source.as_bytes());
        candidates
            .find(|known| known.xxh3_128 == hash)
            .map(|known| known.template)
    }

    /// The renderer's name, as `renderer_name` reports it.
    pub(super) fn renderer_name(self) -> &'static str {
        match self {
            NativeTemplate::ChatMl => "native chatml",
            NativeTemplate::Llama3 => "native llama3",
            NativeTemplate::Phi3 => "native phi3",
            NativeTemplate::Phi3Original => "native phi3-original",
            NativeTemplate::Qwen2_5 => "native qwen2.5",
            NativeTemplate::Qwen3 => "native qwen3",
        }
    }

    /// The options for one extra template variable, if this renderer
    /// supports it with that value (else minijinja renders).
    pub(super) fn options_for(self, name: &str, value: &minijinja::Value) -> Option<RenderOptions> {
        match (self, name, value.kind()) {
            (NativeTemplate::Qwen3, "enable_thinking", minijinja::value::ValueKind::Bool) => Some(RenderOptions {
                enable_thinking: value.is_true(),
            }),
            _ => None,
        }
    }

    /// Appends the prompt for `messages` to `out`, or fails where minijinja
    /// fails (then `out` may hold part of the prompt).
    pub(super) fn render(
        self,
        messages: &[ChatMessage<'_>],
        special: &SpecialTokens,
        options: RenderOptions,
        out: &mut String,
    ) -> Result<(), NativeError> {
        match self {
            NativeTemplate::ChatMl => {
                chatml::render(messages, out);
                Ok(())
            }
            NativeTemplate::Llama3 => llama3::render(messages, special.bos_token.as_deref(), out),
            NativeTemplate::Phi3 => {
                phi3::render(messages, out);
                Ok(())
            }
            NativeTemplate::Phi3Original => {
                phi3::render_original(messages, special.bos_token.as_deref(), out);
                Ok(())
            }
            NativeTemplate::Qwen2_5 => qwen2_5::render(messages, out),
            NativeTemplate::Qwen3 => qwen3::render(messages, options.enable_thinking, out),
        }
    }
}

/// A template that writes every message, whatever its role, as
/// `{before_role}{role}{after_role}{content}{after_content}`, in order,
/// then `generation`: ChatML and the canonical rendering.
pub(super) struct Turns {
    pub before_role: &'static str,
    pub after_role: &'static str,
    pub after_content: &'static str,
    pub generation: &'static str,
}

impl Turns {
    /// Appends the prompt for `messages` to `out`.
    pub(super) fn render(&self, messages: &[ChatMessage<'_>], out: &mut String) {
        let marks = self.before_role.len() + self.after_role.len() + self.after_content.len();
        out.reserve(text_len(messages, marks) + self.generation.len());
        for message in messages {
            self.render_turn(message, out);
        }
        out.push_str(self.generation);
    }

    /// Appends one message's turn.
    pub(super) fn render_turn(&self, message: &ChatMessage<'_>, out: &mut String) {
        out.push_str(self.before_role);
        out.push_str(&message.role);
        out.push_str(self.after_role);
        out.push_str(&message.content);
        out.push_str(self.after_content);
    }
}

/// Bytes of the roles and contents of `messages`: with a per-message
/// allowance, what a renderer reserves before writing.
pub(super) fn text_len(messages: &[ChatMessage<'_>], per_message: usize) -> usize {
    messages
        .iter()
        .map(|m| m.role.len() + m.content.len() + per_message)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_only_the_exact_sources() {
        let chatml = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + \
                      '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}\
                      {% endif %}";
        assert_eq!(NativeTemplate::recognise(chatml), Some(NativeTemplate::ChatMl));
        // The same template with `\n` escapes instead of newlines renders the
        // same text, but it is not the known source.
        assert_eq!(NativeTemplate::recognise(&chatml.replace('\n', "\\n")), None);
        assert_eq!(NativeTemplate::recognise(&format!("{chatml}\n")), None);
        assert_eq!(
            NativeTemplate::recognise(&chatml.replacen("message", "messagE", 1)),
            None
        );
        assert_eq!(NativeTemplate::recognise(""), None);
    }

    #[test]
    fn only_qwen3_takes_enable_thinking_and_only_as_a_boolean() {
        let off = minijinja::Value::from(false);
        assert_eq!(
            NativeTemplate::Qwen3.options_for("enable_thinking", &off),
            Some(RenderOptions { enable_thinking: false })
        );
        assert_eq!(
            NativeTemplate::Qwen3.options_for("enable_thinking", &minijinja::Value::from(true)),
            Some(RenderOptions { enable_thinking: true })
        );
        assert_eq!(
            NativeTemplate::Qwen3.options_for("enable_thinking", &minijinja::Value::from(0)),
            None
        );
        assert_eq!(NativeTemplate::Qwen3.options_for("tools", &off), None);
        assert_eq!(NativeTemplate::Qwen2_5.options_for("enable_thinking", &off), None);
    }
}
