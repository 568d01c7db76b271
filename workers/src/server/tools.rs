//! The tool call a conversation is answered with, and its output tokens.
//!
//! A request with tools whose last message is not a tool result (and
//! whose tool choice is not `none`) is answered with one call to its
//! first tool, or to the one its tool choice names ([`api::ToolCall`]).
//! The call's output tokens are what the chat template renders for that
//! assistant turn: `render(messages + [assistant with the call])` without
//! the generation prompt, minus the prompt `render(messages)` it starts
//! with. So the next turn's prompt, in which the template renders the call
//! the client sends back, extends this prompt and its output, and the
//! blocks the engine cached for both are hits. When the rendering does
//! not start with the prompt (a template that rewrites earlier turns), or
//! adds nothing, the output is the call's JSON text.

use semlb_tokenizer::chat::{RenderInputs, TemplateValue};

use super::Sim;
use super::tokens::Chat;
use crate::api::{self, Endpoint, ToolCall};

/// The call `chat` is answered with, if any, and its output tokens. `seed`
/// is the prompt's, `meta` the answer's.
pub(super) fn tool_answer(sim: &Sim, chat: &Chat, seed: u64, meta: &api::ResponseMeta) -> Option<(ToolCall, Vec<u32>)> {
    let function = chat.conversation.tool_to_call()?;
    let prefix = match meta.endpoint {
        Endpoint::Messages => "toolu_",
        _ => "call_",
    };
    let word_id = sim.vocab().generate(seed ^ 0x746f_6f6c, 1);
    let word = sim.tokenizer().decode(&word_id);
    let call = ToolCall::to(function, format!("{prefix}{}", meta.id_hex()), word.trim());
    let text = call_text(sim, chat, &call);
    let mut tokens = sim.tokenizer().encode(&text);
    if tokens.is_empty() {
        tokens = sim.tokenizer().encode(&call.json_text());
    }
    Some((call, tokens))
}

/// The text the template renders for the assistant turn that is `call`
/// (see the module docs).
fn call_text(sim: &Sim, chat: &Chat, call: &ToolCall) -> String {
    let mut messages = chat.conversation.messages.clone();
    messages.push(call.message());
    let inputs = RenderInputs {
        tools: chat.conversation.tools.as_deref(),
        variables: vec![("add_generation_prompt".into(), TemplateValue::Bool(false))],
    };
    let mut full = String::new();
    if sim.template().render_with(&messages, &inputs, &mut full).is_ok()
        && let Some(rest) = full.strip_prefix(chat.text.as_str())
        && !rest.is_empty()
    {
        return rest.to_owned();
    }
    call.json_text()
}
