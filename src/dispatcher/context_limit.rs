//! The gateway's context-length check: a request that no live engine can
//! take is answered with the engines' own 400 instead of being forwarded.
//!
//! The health checker stores each engine's context in the server table
//! ([`crate::health::engine_info`]): vLLM's and SGLang's `max_model_len`,
//! which prompt **and** requested output must fit together, or llama.cpp's
//! slot context, which the prompt alone must stay below (llama.cpp stops
//! generating at its end and ignores `max_tokens` here). The dispatcher
//! knows the prompt's token count once it has tokenized it, so a prompt no
//! engine can take costs the engines nothing (a 16 MiB prompt forwarded
//! today makes an engine tokenize it only to refuse it, and slows its
//! `/metrics` meanwhile).
//!
//! The gateway refuses only when it is sure: every live (`Up`) server has
//! said its context and none fits the request. A server that did not say
//! (an engine that reports neither, or one not yet asked) lets every
//! request through, as does an empty fleet (routing then answers 503).
//! Heterogeneous fleets route as before: the check asks only whether some
//! engine can take the request.

use serde_json::{Value, json};
use shm_layout::{EngineContext, MemberKey, ServerState, ServerTable};

/// A request no live engine can take: the largest context among them, and
/// what the request needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextExceeded {
    /// The largest live engine's context.
    pub context: EngineContext,
    /// The prompt's tokens (the gateway's count).
    pub prompt_tokens: u64,
    /// The output the request asked for (`max_completion_tokens`,
    /// `max_tokens`), if it did.
    pub output_tokens: Option<u64>,
}

impl ContextExceeded {
    /// The OpenAI-style error body (`context_length_exceeded`, the code
    /// OpenAI gives; vLLM's message), `param` naming the prompt's field
    /// (`messages`, `prompt`).
    pub fn body(&self, param: &'static str) -> Value {
        let max = self.context.tokens;
        let prompt = self.prompt_tokens;
        let message = match self.output_tokens.filter(|_| self.context.counts_output) {
            Some(output) => format!(
                "This model's maximum context length is {max} tokens. However, you requested {} tokens ({prompt} in the {param}, {output} in the completion). Please reduce the length of the {param} or completion.",
                prompt.saturating_add(output)
            ),
            None => format!(
                "This model's maximum context length is {max} tokens. However, your {param} resulted in {prompt} tokens. Please reduce the length of the {param}."
            ),
        };
        json!({
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": "context_length_exceeded",
            }
        })
    }
}

/// Whether an engine of `context` takes a prompt of `prompt` tokens with
/// `output` tokens asked for (at least one token of output either way).
pub fn fits(context: EngineContext, prompt: u64, output: Option<u64>) -> bool {
    let needed = if context.counts_output {
        prompt.saturating_add(output.unwrap_or(1).max(1))
    } else {
        prompt.saturating_add(1)
    };
    needed <= u64::from(context.tokens)
}

/// The largest context of the live servers of `servers` that `serves`
/// admits, when every one of them has said its own (`None` otherwise, or
/// with none live): the most output one answer can have is this less its
/// prompt.
pub fn largest(servers: &ServerTable<'_>, serves: impl Fn(Option<MemberKey>) -> bool) -> Option<EngineContext> {
    let mut largest: Option<EngineContext> = None;
    for context in live_contexts(servers, serves) {
        let context = context?;
        if largest.is_none_or(|l| context.tokens > l.tokens) {
            largest = Some(context);
        }
    }
    largest
}

/// The context of each live (`Up`) server of `servers` that `serves`
/// admits (`None` for one that has not said its own).
fn live_contexts<'t>(
    servers: &'t ServerTable<'_>,
    serves: impl Fn(Option<MemberKey>) -> bool + 't,
) -> impl Iterator<Item = Option<EngineContext>> + 't {
    (0..servers.capacity() as u16).filter_map(move |slot| {
        let (server, ServerState::Up) = servers.current(slot)? else {
            return None;
        };
        serves(servers.membership(slot)).then(|| servers.engine_context(server))
    })
}

/// Checks a request of `prompt` tokens asking for `output` against the
/// live servers of `servers` that `serves` (a model pool's members, by
/// server id) admits (see the [module docs](self)).
pub fn check(
    servers: &ServerTable<'_>,
    serves: impl Fn(Option<MemberKey>) -> bool,
    prompt: u64,
    output: Option<u64>,
) -> Result<(), ContextExceeded> {
    let mut largest: Option<EngineContext> = None;
    for context in live_contexts(servers, serves) {
        let Some(context) = context else {
            return Ok(());
        };
        if fits(context, prompt, output) {
            return Ok(());
        }
        if largest.is_none_or(|l| context.tokens > l.tokens) {
            largest = Some(context);
        }
    }
    match largest {
        None => Ok(()),
        Some(context) => Err(ContextExceeded {
            context,
            prompt_tokens: prompt,
            output_tokens: output,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shm_layout::{LayoutPlan, Segment};

    const LLAMA: EngineContext = EngineContext {
        tokens: 4096,
        counts_output: false,
    };
    const VLLM: EngineContext = EngineContext {
        tokens: 8192,
        counts_output: true,
    };

    #[test]
    fn a_prompt_fits_below_the_context_and_output_counts_where_the_engine_counts_it() {
        // llama.cpp: the prompt must leave a token; max_tokens is not checked.
        assert!(fits(LLAMA, 4095, None) && fits(LLAMA, 4095, Some(10_000)));
        assert!(!fits(LLAMA, 4096, None));
        // vLLM: prompt plus requested output.
        assert!(fits(VLLM, 8191, None) && !fits(VLLM, 8192, None));
        assert!(fits(VLLM, 8000, Some(192)) && !fits(VLLM, 8000, Some(193)));
        assert!(!fits(VLLM, u64::MAX, Some(u64::MAX)), "no overflow");
    }

    #[test]
    fn refused_only_when_every_live_server_said_and_none_fits() {
        let segment = Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap());
        let servers = &segment.tables().servers;
        assert_eq!(
            check(servers, |_| true, 1 << 30, None),
            Ok(()),
            "no server: routing answers"
        );
        let a = servers.register(1, "http://a", 0).unwrap();
        let b = servers.register(2, "http://b", 0).unwrap();
        assert!(servers.set_engine_context(a, Some(LLAMA)));
        assert_eq!(check(servers, |_| true, 5000, None), Ok(()), "b has not said");
        assert!(servers.set_engine_context(b, Some(VLLM)));
        assert_eq!(check(servers, |_| true, 5000, Some(100)), Ok(()), "b takes it");
        let only_a = |key: Option<MemberKey>| key.is_some_and(|k| k.id == 1);
        assert!(check(servers, only_a, 5000, Some(100)).is_err(), "a's pool: a cannot");
        let refused = check(servers, |_| true, 8100, Some(100)).unwrap_err();
        assert_eq!(
            refused,
            ContextExceeded {
                context: VLLM,
                prompt_tokens: 8100,
                output_tokens: Some(100)
            },
            "the largest context is named"
        );
        // A server that is not up does not count either way.
        assert!(servers.set_state(b, ServerState::Down));
        assert!(check(servers, |_| true, 5000, None).is_err(), "only a, which cannot");
        assert!(servers.set_engine_context(a, None));
        assert_eq!(check(servers, |_| true, 5000, None), Ok(()), "a no longer says");
    }

    #[test]
    fn the_error_is_openais_context_length_exceeded() {
        let with_output = ContextExceeded {
            context: VLLM,
            prompt_tokens: 8100,
            output_tokens: Some(100),
        };
        assert_eq!(
            with_output.body("messages"),
            json!({"error": {
                "message": "This model's maximum context length is 8192 tokens. However, you requested 8200 tokens (8100 in the messages, 100 in the completion). Please reduce the length of the messages or completion.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }})
        );
        let llama = ContextExceeded {
            context: LLAMA,
            prompt_tokens: 5000,
            output_tokens: Some(100),
        };
        assert_eq!(
            llama.body("prompt")["error"]["message"],
            "This model's maximum context length is 4096 tokens. However, your prompt resulted in 5000 tokens. Please reduce the length of the prompt."
        );
    }
}
