//! Qwen3 (`shared/data/tokenizers/qwen3-tokenizer_config.json`, as
//! published with Qwen/Qwen3-0.6B, and `tests/templates/qwen3-ortx.jinja`, a
//! later revision that also accepts non-string content: the same text for
//! string content), without `tools`:
//!
//! Rule:
//! 1. If the first message is `system`: `<|im_start|>system\n{content}<|im_end|>\n`.
//! 2. The *last query* is the last `user` message whose content is not
//!    wrapped in `<tool_response>` … `</tool_response>` (both at once); if
//!    there is none, the last message.
//! 3. Each `user` message, and each `system` message after the first
//!    position, as `<|im_start|>{role}\n{content}<|im_end|>\n`.
//! 4. Each `assistant` message: if its content contains `</think>`, the
//!    answer is what follows the last `</think>` with leading newlines
//!    removed, and the reasoning is what precedes the first `</think>`,
//!    trailing newlines removed, after its last `<think>`, leading newlines
//!    removed; without `</think>` the answer is the content and the
//!    reasoning is empty. After the last query, and if the message is the
//!    last one or its reasoning is not empty:
//!    `<|im_start|>assistant\n<think>\n{reasoning stripped of newlines}\n</think>\n\n{answer without leading newlines}`;
//!    otherwise `<|im_start|>assistant\n{answer}` (earlier turns lose their
//!    reasoning). Then `<|im_end|>\n`.
//! 5. Each `tool` message as in Qwen2.5 ([`super::qwen2_5::push_tool_response`]).
//! 6. Messages of any other role are left out.
//! 7. The generation prompt `<|im_start|>assistant\n`, followed by
//!    `<think>\n\n</think>\n\n` when `enable_thinking` is `false`.
//!
//! "Newlines" are `\n` only (`strip('\n')`), and the splits are Python's
//! `str.split`, which minijinja-contrib implements with Rust's `str::split`.
//!
//! Fails on an empty conversation: the template reads `messages[0].role`,
//! an error on an undefined value in minijinja.

use super::qwen2_5::{push_tool_response, push_turn};
use super::{NativeError, text_len};
use crate::chat::ChatMessage;

/// Appends the Qwen3 prompt for `messages` to `out`.
pub(super) fn render(messages: &[ChatMessage<'_>], enable_thinking: bool, out: &mut String) -> Result<(), NativeError> {
    let first = messages.first().ok_or(NativeError::NoMessages { template: "qwen3" })?;
    out.reserve(text_len(messages, 40) + 48);
    if first.role == "system" {
        push_turn(first, out);
    }
    let last_index = messages.len() - 1;
    let last_query = messages
        .iter()
        .rposition(|m| m.role == "user" && !is_tool_response(&m.content))
        .unwrap_or(last_index);
    for (index, message) in messages.iter().enumerate() {
        match &*message.role {
            "user" => push_turn(message, out),
            "system" if index > 0 => push_turn(message, out),
            "assistant" => {
                let (reasoning, answer) = split_reasoning(&message.content);
                out.push_str("<|im_start|>assistant\n");
                if index > last_query && (index == last_index || !reasoning.is_empty()) {
                    out.push_str("<think>\n");
                    out.push_str(reasoning.trim_matches('\n'));
                    out.push_str("\n</think>\n\n");
                    out.push_str(answer.trim_start_matches('\n'));
                } else {
                    out.push_str(answer);
                }
                out.push_str("<|im_end|>\n");
            }
            "tool" => push_tool_response(messages, index, out),
            _ => {}
        }
    }
    out.push_str("<|im_start|>assistant\n");
    if !enable_thinking {
        out.push_str("<think>\n\n</think>\n\n");
    }
    Ok(())
}

/// A user message that is a tool's answer, not a query.
fn is_tool_response(content: &str) -> bool {
    content.starts_with("<tool_response>") && content.ends_with("</tool_response>")
}

/// `(reasoning, answer)` of an assistant message, as the template splits
/// it (step 4 of the rule).
fn split_reasoning(content: &str) -> (&str, &str) {
    const END: &str = "</think>";
    let Some((before_first_end, after_first_end)) = content.split_once(END) else {
        return ("", content);
    };
    let after_last_end = after_first_end
        .rsplit_once(END)
        .map_or(after_first_end, |(_, after)| after);
    let before = before_first_end.trim_end_matches('\n');
    let reasoning = before.rsplit_once("<think>").map_or(before, |(_, after)| after);
    (
        reasoning.trim_start_matches('\n'),
        after_last_end.trim_start_matches('\n'),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_reasoning_follows_the_template() {
        assert_eq!(split_reasoning("plain"), ("", "plain"));
        assert_eq!(split_reasoning("<think>\nwhy\n</think>\n\nanswer"), ("why", "answer"));
        // Reasoning: before the first </think>, after the last <think>;
        // answer: after the last </think>.
        assert_eq!(
            split_reasoning("a<think>b<think>\n\nc\n</think>d</think>\ne"),
            ("c", "e")
        );
        assert_eq!(split_reasoning("</think>"), ("", ""));
        assert_eq!(split_reasoning("no open</think>x"), ("no open", "x"));
    }
}
