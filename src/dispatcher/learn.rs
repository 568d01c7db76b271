//! Learning from a finished answer: the completion record a response
//! process applies (prompt chain, the answer to extend it with, the
//! response to cache), pushed into this dispatcher's completion ring
//! without waiting.

use shm_layout::{CompletionRecord, ContinuationRef, Prediction, ResponseKey, ServerRef, Timing};

use std::sync::Arc;

use super::Dispatcher;
use super::charge::Reservation;
use crate::openai::answer::{AnswerForm, answer_text};
use crate::pools::Pool;
use crate::prefix::blocks::BlockHasher;

/// What a finished answer teaches: everything of the request the completion
/// record needs.
#[derive(Debug)]
pub(super) struct Learn {
    /// The server that answered.
    pub server: ServerRef,
    /// The prompt's length in tokens.
    pub prompt_tokens: u32,
    /// The prompt's tokens after its last full block.
    pub tail: Vec<u32>,
    /// The prompt's block chain.
    pub chain: Vec<u64>,
    /// The hasher the chain was made with.
    pub hasher: BlockHasher,
    /// Where to cache the body, when it may be cached.
    pub cache_key: Option<ResponseKey>,
    /// Whether it is a chat request (its answer comes back as an assistant
    /// message in the next turn).
    pub chat: bool,
    /// What the server was expected to hold of the prompt.
    pub prediction: Prediction,
    /// How long the request took (set when its answer ends).
    pub timing: Option<Timing>,
    /// The model pool it was routed in (whose policy learns from its
    /// timing, and whose tokenizer reads its answer).
    pub pool: Option<Arc<Pool>>,
    /// The rate-limit buckets its output tokens are charged to (the relay
    /// takes them: it charges an answer also when it does not end well).
    pub output: Option<Reservation>,
    /// Its caller's tenant (for the usage counts of its output tokens).
    pub tenant: Option<Arc<str>>,
    /// Its share in the gateway queue, as charged (the relay settles it
    /// with the output tokens the answer had).
    pub share: Option<crate::tenancy::fair_share::Share>,
    /// Its completion record may be pushed (its tenant is within its
    /// share of the prefix table: `super::share`).
    pub record: bool,
    /// The engine stores the answer: its id is read as it passes and
    /// recorded for the server, with this tenant's salt
    /// ([`super::stored_response`]).
    pub stored: Option<(u64, super::stored_response::StoredId)>,
}

/// Builds the completion record of a finished answer (`answer`, in
/// `form`) and pushes it into this dispatcher's ring (never waits; a
/// full ring drops it).
pub(super) fn push_completion(dispatcher: &Dispatcher, learn: Learn, form: AnswerForm, answer: Vec<u8>) {
    let tables = dispatcher.segment().tables();
    if dispatcher.identity().ring >= tables.ring_count() {
        dispatcher.metrics().record(false);
        return;
    }
    let ring = tables.ring(dispatcher.identity().ring);
    let max = ring.max_record();
    // A cacheable answer is the response to store: carried once (a stream
    // is assembled into its JSON response by the response process).
    let whole = matches!(form, AnswerForm::Json | AnswerForm::EventStream);
    let cached = match learn.cache_key {
        Some(key) if whole && answer.len() + 8 <= tables.responses.max_value() => Some(key),
        _ => None,
    };
    let mut record = CompletionRecord {
        server: learn.server,
        prompt_tokens: learn.prompt_tokens,
        // 0: the response process counts the answer's tokens.
        output_tokens: 0,
        prompt_blocks: &learn.chain,
        full_blocks: &[],
        continuation: Some(ContinuationRef {
            root: learn.hasher.root(),
            block_size: u32::try_from(learn.hasher.block_size()).unwrap_or(u32::MAX),
            tokenizer: learn.pool.as_ref().map_or(0, |p| p.tokenization().id),
            tail: &learn.tail,
            form: form.to_byte(learn.chat),
            answer: if cached.is_some() { None } else { Some(&answer) },
        }),
        response: cached.map(|key| (key, &answer[..])),
        prediction: Some(learn.prediction),
        timing: learn.timing,
    };
    // Too large: leave out the response; then read the answer's text
    // here and carry only that, shortened if need be (its leading
    // blocks are the ones the next turn reuses); then keep only the
    // prompt's leading blocks (the ones that route the conversation).
    let text;
    if record.encoded_len() > max && record.response.is_some() {
        record.response = None;
        if let Some(c) = record.continuation.as_mut() {
            c.answer = Some(&answer);
        }
    }
    if record.encoded_len() > max && form != AnswerForm::Text {
        let (read, reported) = answer_text(form, &answer).unwrap_or_default();
        text = read;
        // The usage goes with the answer's bytes: keep what it reported.
        if let Some(p) = record.prediction.as_mut() {
            p.cached_tokens = reported.cached_tokens_u32();
        }
        if let Some(c) = record.continuation.as_mut() {
            c.form = AnswerForm::Text.to_byte(learn.chat);
            c.answer = Some(text.as_bytes());
        }
    }
    let over = record.encoded_len().saturating_sub(max);
    if over > 0
        && let Some(c) = record.continuation.as_mut()
        && let Some(answer) = c.answer
        && c.form == AnswerForm::Text.to_byte(learn.chat)
        && let Ok(text) = std::str::from_utf8(answer)
    {
        let keep = text.len().saturating_sub(over);
        c.answer = Some(&text.as_bytes()[..text.floor_char_boundary(keep)]);
    }
    if record.encoded_len() > max {
        record.continuation = None;
        let room = max.saturating_sub(record.encoded_len() - 8 * learn.chain.len()) / 8;
        record.prompt_blocks = &learn.chain[..learn.chain.len().min(room)];
    }
    let mut buf = Vec::with_capacity(record.encoded_len());
    record.encode_into(&mut buf);
    dispatcher.metrics().record(ring.push(&buf).is_ok());
}
