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

use super::Turns;
use crate::chat::ChatMessage;

/// Appends the ChatML prompt for `messages` to `out`.
pub(super) fn render(messages: &[ChatMessage<'_>], out: &mut String) {
    Turns {
        before_role: "<|im_start|>",
        after_role: "\n",
        after_content: "<|im_end|>\n",
        generation: "<|im_start|>assistant\n",
    }
    .render(messages, out);
}
