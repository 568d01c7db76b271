//! Stage 2, tokenize: the routing text to token ids (a long text on the
//! blocking pool), in the tenant's own segment cache when its prefixes
//! are kept apart, and the prompt's size as the context check and the
//! limits count it.

use crate::openai::prompt::{ParsedRequest, RoutingInput};
use crate::pools::Pool;
use crate::prefix::blocks::TenantSalt;

/// Routing texts longer than this are tokenized on the blocking pool. The
/// native tokenizer takes about 25 ns per byte of new text (less for text
/// its segment cache holds), so this bounds the time one request holds the
/// reactor to about a millisecond; shorter texts cost less than the hand-off.
const BLOCKING_TOKENIZE_BYTES: usize = 48 << 10;

/// A prompt's tokens and what they count for.
pub(super) struct Tokens {
    /// The routing text's token ids (a tokens prompt's own).
    pub ids: Vec<u32>,
    /// Bytes of routing text (0 for a tokens prompt).
    pub text_bytes: usize,
    /// The tokenizer segment cache's salt (0: shared with every tenant).
    pub segment_salt: u64,
    /// Tokens one prompt holds in an engine's context (tools included).
    pub in_context: u64,
    /// Prompt tokens charged to the limits (a batch's every prompt).
    pub charged: u64,
    /// Prompts in the request (a completions batch has several).
    pub prompts: u64,
}

/// Tokenizes `parsed`'s routing text (taking a tokens prompt's ids).
pub(super) async fn tokenize(
    super::Asked { dispatcher, caller, .. }: super::Asked<'_>,
    pool: &Pool,
    parsed: &mut ParsedRequest<'_>,
) -> Tokens {
    let tokenizer = &pool.tokenization().tokenizer;
    let text_bytes = match &parsed.input {
        RoutingInput::Text(text) => text.len(),
        RoutingInput::Tokens(_) => 0,
    };
    // A tenant whose prefixes are kept apart keeps its segments apart in
    // the tokenizer's caches too: how long its prompt takes to tokenize
    // says nothing of the lines other tenants sent or were answered.
    let segment_salt = caller.filter(|c| c.isolate_prefixes).map_or(0, |c| {
        TenantSalt::new(&c.tenant, dispatcher.segment().header().seed[0]).key
    });
    let ids = match &mut parsed.input {
        RoutingInput::Text(text) if text.len() > BLOCKING_TOKENIZE_BYTES => {
            let (tokenizer, text) = (tokenizer.clone(), text.to_string());
            // Should the task fail, the request routes on load alone.
            let tokens: Vec<u32> = tokio::task::spawn_blocking(move || tokenizer.encode_salted(&text, segment_salt))
                .await
                .unwrap_or_default();
            tokens
        }
        RoutingInput::Text(text) => tokenizer.encode_salted(text, segment_salt),
        RoutingInput::Tokens(ids) => std::mem::take(ids),
    };
    dispatcher.report_segments(pool.tokenization());
    // What the prompt holds beyond the text tokenized (tools, a batch's
    // other prompts): in the context check and the limits.
    let extra = parsed.extra();
    let in_context = (ids.len() as u64).saturating_add(extra.every_prompt);
    let charged = (ids.len() as u64)
        .saturating_add(extra.every_prompt.saturating_mul(extra.prompts))
        .saturating_add(extra.other_prompts);
    Tokens {
        ids,
        text_bytes,
        segment_salt,
        in_context,
        charged,
        prompts: extra.prompts,
    }
}
