//! Plain ChatML, as transformers' default chat template and OpenHermes-2.5
//! publish it (`tests/templates/chatml.jinja`):
//!
//! ```text
//! {% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}…
//! ```
//!
//! Rule: every message, whatever its role, as
//! `<|im_start|>{role}\n{content}<|im_end|>\n`, in order; then the
//! generation prompt `<|im_start|>assistant\n`. Content is written
//! verbatim; an empty conversation is just the generation prompt. It never
//! fails.

use super::text_len;
use crate::chat::ChatMessage;

/// Appends the ChatML prompt for `messages` to `out`.
pub(super) fn render(messages: &[ChatMessage<'_>], out: &mut String) {
    out.reserve(text_len(messages, 24) + 22);
    for message in messages {
        out.push_str("<|im_start|>");
        out.push_str(&message.role);
        out.push('\n');
        out.push_str(&message.content);
        out.push_str("<|im_end|>\n");
    }
    out.push_str("<|im_start|>assistant\n");
}
