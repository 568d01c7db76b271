//! Qwen2.5-Instruct (`tests/templates/qwen2.5.jinja`), without `tools`:
//!
//! Rule:
//! 1. A system block: the first message's content if its role is `system`,
//!    else the default, `You are Qwen, created by Alibaba Cloud. You are a
//!    helpful assistant.`, as `<|im_start|>system\n{content}<|im_end|>\n`.
//! 2. Each `user` and `assistant` message, and each `system` message after
//!    the first position, as `<|im_start|>{role}\n{content}<|im_end|>\n`.
//! 3. Each `tool` message as `\n<tool_response>\n{content}\n</tool_response>`,
//!    a run of consecutive tool messages wrapped in one
//!    `<|im_start|>user` … `<|im_end|>\n` ([`push_tool_response`]).
//! 4. Messages of any other role are left out.
//! 5. The generation prompt `<|im_start|>assistant\n`.
//!
//! Fails on an empty conversation: the template reads `messages[0]['role']`,
//! an error on an undefined value in minijinja.

use super::{NativeError, text_len};
use crate::chat::ChatMessage;

/// The system message when the conversation does not start with one.
const DEFAULT_SYSTEM: &str = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

/// Appends the Qwen2.5 prompt for `messages` to `out`.
pub(super) fn render(messages: &[ChatMessage<'_>], out: &mut String) -> Result<(), NativeError> {
    let first = messages
        .first()
        .ok_or(NativeError::NoMessages { template: "qwen2.5" })?;
    out.reserve(text_len(messages, 40) + DEFAULT_SYSTEM.len() + 64);
    out.push_str("<|im_start|>system\n");
    out.push_str(if first.role == "system" {
        &first.content
    } else {
        DEFAULT_SYSTEM
    });
    out.push_str("<|im_end|>\n");
    for (index, message) in messages.iter().enumerate() {
        match &*message.role {
            "user" | "assistant" => push_turn(message, out),
            "system" if index > 0 => push_turn(message, out),
            "tool" => push_tool_response(messages, index, out),
            _ => {}
        }
    }
    out.push_str("<|im_start|>assistant\n");
    Ok(())
}

/// `<|im_start|>{role}\n{content}<|im_end|>\n`.
pub(super) fn push_turn(message: &ChatMessage<'_>, out: &mut String) {
    out.push_str("<|im_start|>");
    out.push_str(&message.role);
    out.push('\n');
    out.push_str(&message.content);
    out.push_str("<|im_end|>\n");
}

/// The tool message `messages[index]`, as Qwen2.5's and Qwen3's templates
/// both write it: `<|im_start|>user` before the first of a run of tool
/// messages, `\n<tool_response>\n{content}\n</tool_response>`, and
/// `<|im_end|>\n` after the last of the run.
pub(super) fn push_tool_response(messages: &[ChatMessage<'_>], index: usize, out: &mut String) {
    let is_tool = |i: usize| messages.get(i).is_some_and(|m| m.role == "tool");
    if index == 0 || !is_tool(index - 1) {
        out.push_str("<|im_start|>user");
    }
    out.push_str("\n<tool_response>\n");
    out.push_str(&messages[index].content);
    out.push_str("\n</tool_response>");
    if !is_tool(index + 1) {
        out.push_str("<|im_end|>\n");
    }
}
