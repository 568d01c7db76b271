//! Phi-3-mini-instruct, in its two published forms.
//!
//! Current form (`tests/templates/phi3.jinja`, Phi-3-mini-4k-instruct):
//!
//! ```text
//! {% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}…
//! {% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}
//! ```
//!
//! Rule ([`render`]): each `system`, `user` and `assistant` message as
//! `<|{role}|>\n{content}<|end|>\n`; messages of any other role (`tool`,
//! …) are left out; then the generation prompt `<|assistant|>\n`. It never
//! fails.
//!
//! First form (`tests/templates/phi3-original.jinja`,
//! Phi-3-mini-128k-instruct as first published):
//!
//! ```text
//! {{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}{{'<|user|>' + '\n' + message['content'] + '<|end|>' + '\n' + '<|assistant|>' + '\n'}}{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\n'}}{% endif %}{% endfor %}
//! ```
//!
//! Rule ([`render_original`]): `bos_token` (nothing when undefined), then
//! each `user` message as `<|user|>\n{content}<|end|>\n<|assistant|>\n` and
//! each `assistant` message as `{content}<|end|>\n`; every other role
//! (system included) is left out. There is no separate generation prompt:
//! the prompt ends with the last user turn's `<|assistant|>\n`. It never
//! fails.

use super::text_len;
use crate::chat::ChatMessage;

/// Appends the Phi-3 (current form) prompt for `messages` to `out`.
pub(super) fn render(messages: &[ChatMessage<'_>], out: &mut String) {
    out.reserve(text_len(messages, 12) + 14);
    for message in messages {
        let tag = match &*message.role {
            "system" => "<|system|>\n",
            "user" => "<|user|>\n",
            "assistant" => "<|assistant|>\n",
            _ => continue,
        };
        out.push_str(tag);
        out.push_str(&message.content);
        out.push_str("<|end|>\n");
    }
    out.push_str("<|assistant|>\n");
}

/// Appends the Phi-3 (first form) prompt for `messages` to `out`.
pub(super) fn render_original(messages: &[ChatMessage<'_>], bos_token: Option<&str>, out: &mut String) {
    let bos_token = bos_token.unwrap_or("");
    out.reserve(text_len(messages, 30) + bos_token.len());
    out.push_str(bos_token);
    for message in messages {
        match &*message.role {
            "user" => {
                out.push_str("<|user|>\n");
                out.push_str(&message.content);
                out.push_str("<|end|>\n<|assistant|>\n");
            }
            "assistant" => {
                out.push_str(&message.content);
                out.push_str("<|end|>\n");
            }
            _ => {}
        }
    }
}
