//! One answer, whichever API it is for ([`AnswerSpec`]): its JSON body
//! when it is whole, and the [`EventWriter`] that streams it.

use bytes::Bytes;

use super::messages_out::{MessagesAnswer, MessagesWriter};
use super::responses_out::{ResponsesAnswer, ResponsesWriter};
use super::stream::{ChunkWriter, EventWriter};
use super::{CompletionResponse, Endpoint, FinishReason, ResponseMeta, ResponsesEcho, ToolCall};
use crate::engine::Usage;

/// What an answer is, besides its tokens.
#[derive(Debug, Clone)]
pub struct AnswerSpec {
    /// Its endpoint, id, creation time and model.
    pub meta: ResponseMeta,
    /// Why it ends.
    pub finish: FinishReason,
    /// The tool call it is, if it is one.
    pub call: Option<ToolCall>,
    /// `stream_options.include_usage` (completions and chat).
    pub include_usage: bool,
    /// Output tokens.
    pub expected: u32,
    /// What a Responses answer repeats of its request.
    pub echo: Option<ResponsesEcho>,
}

impl AnswerSpec {
    fn responses(&self) -> ResponsesAnswer {
        ResponsesAnswer {
            meta: self.meta.clone(),
            echo: self.echo.clone().unwrap_or_default(),
            call: self.call.clone(),
            finish: self.finish,
        }
    }

    fn messages(&self) -> MessagesAnswer {
        MessagesAnswer {
            meta: self.meta.clone(),
            call: self.call.clone(),
            finish: self.finish,
        }
    }

    /// The whole answer of `text` (the tokens' text; a call's answer
    /// shows the call instead) as JSON.
    pub fn body(&self, text: String, usage: Usage) -> Bytes {
        match self.meta.endpoint {
            Endpoint::Completions | Endpoint::Chat => {
                let answer = match &self.call {
                    Some(call) => CompletionResponse::tool_call(&self.meta, call, usage),
                    None => CompletionResponse::new(&self.meta, text, self.finish, usage),
                };
                Bytes::from(serde_json::to_vec(&answer).unwrap_or_default())
            }
            Endpoint::Responses => self.responses().body(&text, usage),
            Endpoint::Messages => self.messages().body(&text, usage),
        }
    }

    /// The events of the answer streamed, for a prompt of `prompt_tokens`
    /// of which `cached_tokens` were served from the cache.
    pub fn writer(&self, prompt_tokens: u32, cached_tokens: u32) -> Box<dyn EventWriter> {
        match self.meta.endpoint {
            Endpoint::Completions | Endpoint::Chat => Box::new(ChunkWriter {
                meta: self.meta.clone(),
                include_usage: self.include_usage,
                finish: self.finish,
                call: self.call.clone(),
                expected: self.expected,
            }),
            Endpoint::Responses => Box::new(ResponsesWriter::new(self.responses(), self.expected)),
            Endpoint::Messages => Box::new(MessagesWriter::new(
                self.messages(),
                self.expected,
                prompt_tokens,
                cached_tokens,
            )),
        }
    }
}
