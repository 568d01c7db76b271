//! Server-sent-event answers: [`SseStream`] turns the engine's events
//! into server-sent events as they come, through the answer's
//! [`EventWriter`] (OpenAI's chunks and `data: [DONE]`, the Responses
//! API's or Anthropic's named events), runs the answer's finishing hook
//! (a Responses answer is stored then), and says how the stream ended to
//! the request log.

use std::collections::VecDeque;

use bytes::Bytes;
use hyper::body::Frame;
use semlb_tokenizer::Tokenizer;

use super::{BoxError, Completion, reset_error};
use crate::api::{AnswerSpec, EventWriter};
use crate::engine::{EngineStream, Event, Usage};
use crate::faults::{StreamFault, StreamFaultKind};
use crate::request_log::Recorded;

/// The state of one SSE response: the engine's events turned into chunks.
pub(super) struct SseStream {
    /// The engine's events; `None` when every chunk is queued already.
    events: Option<EngineStream>,
    tokenizer: Tokenizer,
    /// Turns tokens into events.
    writer: Box<dyn EventWriter>,
    /// Runs when the engine has finished the answer.
    on_finish: Option<OnFinish>,
    /// Output tokens turned into events so far.
    tokens: u32,
    /// Chunks ready to send.
    pending: VecDeque<Bytes>,
    /// Chunks sent.
    emitted: u32,
    /// Cut the stream after the first chunk.
    reset: bool,
    /// Break it once this many tokens are out (`--stream-fault`).
    fault: Option<StreamFault>,
    /// Nothing more to send after `pending`.
    done: bool,
    /// How it ends, for the request log (dropped unended: aborted).
    recorded: Option<Recorded>,
    _completion: Completion,
}

/// What runs once the engine has finished an answer, before its last
/// events go out (storing a Responses answer).
pub(super) type OnFinish = Box<dyn FnOnce() + Send>;

/// What a stream says besides its tokens.
pub(super) struct StreamSpec {
    /// The answer: its API, id, finish reason, tool call, length.
    pub(super) answer: AnswerSpec,
    pub(super) tokenizer: Tokenizer,
    /// Prompt tokens, and those served from the cache (Anthropic's
    /// `message_start` tells them).
    pub(super) prompt_tokens: u32,
    pub(super) cached_tokens: u32,
    /// Cut the stream after the first chunk (`--reset-rate`).
    pub(super) reset: bool,
    /// Break the stream mid-way (`--stream-fault`).
    pub(super) fault: Option<StreamFault>,
    /// Runs when the engine has finished the answer.
    pub(super) on_finish: Option<OnFinish>,
}

impl SseStream {
    /// A stream of `events`, its first token `first` already read.
    pub(super) fn start(
        spec: StreamSpec,
        events: EngineStream,
        first: u32,
        recorded: Recorded,
        completion: Completion,
    ) -> Self {
        let mut stream = Self::new(spec, Some(events), recorded, completion);
        stream.push_token(first);
        stream
    }

    /// A stream of an answer that is over: its `tokens` and `usage`.
    pub(super) fn finished(
        spec: StreamSpec,
        tokens: &[u32],
        usage: Usage,
        recorded: Recorded,
        completion: Completion,
    ) -> Self {
        let mut stream = Self::new(spec, None, recorded, completion);
        for &id in tokens {
            stream.push_token(id);
        }
        stream.push_end(usage);
        stream
    }

    fn new(spec: StreamSpec, events: Option<EngineStream>, recorded: Recorded, completion: Completion) -> Self {
        let mut stream = Self {
            events,
            writer: spec.answer.writer(spec.prompt_tokens, spec.cached_tokens),
            on_finish: spec.on_finish,
            tokenizer: spec.tokenizer,
            tokens: 0,
            pending: VecDeque::new(),
            emitted: 0,
            reset: spec.reset,
            fault: spec.fault,
            done: false,
            recorded: Some(recorded),
            _completion: completion,
        };
        stream.writer.start(&mut stream.pending);
        stream
    }

    fn push_token(&mut self, id: u32) {
        let text = self.tokenizer.decode(&[id]);
        self.writer.token(self.tokens, &text, &mut self.pending);
        self.tokens += 1;
    }

    fn push_end(&mut self, usage: Usage) {
        if let Some(on_finish) = self.on_finish.take() {
            on_finish();
        }
        self.writer.end(usage, &mut self.pending);
        self.done = true;
    }

    /// Tells the request log how the stream ended.
    fn end(&mut self, failure: Option<&str>) {
        if let Some(recorded) = self.recorded.take() {
            match failure {
                None => recorded.complete(200),
                Some(reason) => recorded.fail(Some(200), reason),
            }
        }
    }

    /// Breaks the stream as `--stream-fault` asks, once the chunks of its
    /// tokens so far are out: the process dies, the stream stalls for
    /// good, or its error event is queued as its end.
    async fn break_stream(&mut self, kind: StreamFaultKind) {
        match kind {
            StreamFaultKind::Die => {
                // Give hyper a moment to write the chunks already handed
                // to it, as a process killed mid-answer has sent them.
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                eprintln!(
                    "semlb-sim: killing itself mid-stream after {} tokens (--stream-fault die)",
                    self.tokens
                );
                // SAFETY: `kill` with this process's own id and a valid
                // signal number has no memory effects; SIGKILL ends the
                // process here.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            }
            StreamFaultKind::Stall => std::future::pending::<()>().await,
            StreamFaultKind::Error => {
                let message = format!(
                    "engine failure after {} tokens (semlb-sim --stream-fault error)",
                    self.tokens
                );
                self.writer.error(&message, &mut self.pending);
                self.done = true;
                self.end(Some("failed on purpose (--stream-fault error)"));
            }
        }
    }

    /// The next body frame (the `unfold` step).
    pub(super) async fn next_frame(mut self) -> Option<(Result<Frame<Bytes>, BoxError>, Self)> {
        loop {
            if self.reset && self.emitted >= 1 {
                if self.done && self.pending.is_empty() {
                    return None;
                }
                // Let hyper flush the first chunk, then abort the connection.
                tokio::task::yield_now().await;
                self.done = true;
                self.pending.clear();
                self.end(Some("cut on purpose (--reset-rate)"));
                return Some((Err(reset_error()), self));
            }
            if let Some(chunk) = self.pending.pop_front() {
                self.emitted += 1;
                return Some((Ok(Frame::data(chunk)), self));
            }
            if let Some(fault) = self.fault.filter(|f| !self.done && self.tokens >= f.after) {
                self.fault = None;
                self.break_stream(fault.kind).await;
                continue;
            }
            if self.done {
                self.end(None);
                return None;
            }
            let event = match &mut self.events {
                Some(events) => events.next().await,
                None => None,
            };
            match event {
                Some(Event::Token { id }) | Some(Event::FirstToken { id, .. }) => self.push_token(id),
                Some(Event::Finished { usage }) => self.push_end(usage),
                // The engine dropped the request: abort rather than end
                // the stream as if it were complete.
                None => {
                    self.done = true;
                    self.end(Some("the engine dropped the request"));
                    return Some((Err("semlb-sim: the engine dropped the request".into()), self));
                }
            }
        }
    }
}
