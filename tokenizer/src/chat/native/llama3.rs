//! Meta-Llama-3-Instruct (`tests/templates/llama3.jinja`, and
//! `llama3-original.jinja`, its first form, whose generation prompt is not
//! conditional: the same text, as the gateway always asks for it):
//!
//! ```text
//! {% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}
//! {% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}
//! ```
//!
//! Rule: every message, whatever its role, as
//! `<|start_header_id|>{role}<|end_header_id|>\n\n{trim(content)}<|eot_id|>`,
//! the first one preceded by `bos_token`; then the generation prompt
//! `<|start_header_id|>assistant<|end_header_id|>\n\n`. An empty
//! conversation is just the generation prompt (no BOS).
//!
//! `trim` is minijinja's, which is Rust's [`str::trim`]: it strips Unicode
//! `White_Space` characters at both ends. Python's `str.strip` (what
//! `transformers` renders with) also strips U+001C..U+001F, which Rust's
//! does not; we follow minijinja.
//!
//! Fails when there is a message and the config defines no `bos_token`:
//! `bos_token + content` on an undefined value is an error in minijinja (and
//! in Python Jinja).

use super::{NativeError, text_len};
use crate::chat::ChatMessage;

/// Appends the Llama-3 prompt for `messages` to `out`.
pub(super) fn render(
    messages: &[ChatMessage<'_>],
    bos_token: Option<&str>,
    out: &mut String,
) -> Result<(), NativeError> {
    if !messages.is_empty() {
        let bos_token = bos_token.ok_or(NativeError::UndefinedBosToken { template: "llama3" })?;
        out.reserve(text_len(messages, 48) + bos_token.len() + 48);
        out.push_str(bos_token);
    }
    for message in messages {
        out.push_str("<|start_header_id|>");
        out.push_str(&message.role);
        out.push_str("<|end_header_id|>\n\n");
        out.push_str(message.content.trim());
        out.push_str("<|eot_id|>");
    }
    out.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
    Ok(())
}
