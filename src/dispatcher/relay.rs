//! Relaying an upstream answer to the client, and learning from it.
//!
//! [`Relay`] is the response body of a proxied request: it hands each
//! upstream frame to hyper as it arrives (nothing is buffered, so SSE
//! tokens reach the client as the engine emits them), keeps a copy of what
//! it needs (the JSON body, or the text of the SSE chunks), and enforces the
//! request deadline. It owns the request's [`InflightGuard`], so the
//! server's in-flight count drops exactly once, when the body ends, fails,
//! or is dropped because the client went away (dropping the upstream body
//! also cancels the upstream request).
//!
//! When a 2xx body ends normally, the [`Learn`] context becomes a
//! completion record ([`Dispatcher::push_completion`]): the prompt chain,
//! the answer as it came (the JSON body, or the event stream) with the
//! prompt's last partial block (a response process reads the answer's text
//! out of it, tokenizes it and hashes the chain of prompt + answer:
//! [`crate::responder`], [`crate::answer`]), the prompt's token count, and
//! the response body when it may be cached (then the answer is not carried
//! twice). The dispatcher neither parses nor tokenizes the answer; the
//! record is copied into this dispatcher's completion ring on the reactor,
//! without waiting (a full ring drops it, counted by the ring). Only an
//! event stream longer than [`RAW_STREAM_BYTES`] is read as it passes (its
//! text goes into the record instead), and an answer too large for a record
//! is read when it ends.
//!
//! For an inference request the relay also records the gateway's latency
//! metrics ([`RelayTimer`]): TTFT when the first body frame is handed to
//! the client, the request's duration when the relay ends (body done,
//! failed, or the client gone).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use shm_layout::{CompletionRecord, ContinuationRef, ResponseKey, ServerRef};
use std::time::Instant;

use tokio::time::Sleep;

use super::Dispatcher;
use super::http::{Body, BoxError};
use crate::answer::{AnswerForm, EventStreamText, answer_text};
use crate::blocks::BlockHasher;

/// Largest non-streaming answer kept to learn from (bytes).
const MAX_JSON_CAPTURE: usize = 32 << 20;

/// An event stream is kept as it comes up to this many bytes (about 80
/// chat tokens); a longer one is read as it passes and only its text kept.
pub(crate) const RAW_STREAM_BYTES: usize = 16 << 10;

/// Counts one request as in flight to a server in the store (the shm
/// ledger, and on Redis the published counts) while it lives, and as
/// pending until [`first_token`](Self::first_token); dropping it ends the
/// request (exactly once). Both events wake the dispatcher's gateway queue:
/// a server may have room now.
#[derive(Debug)]
pub(crate) struct InflightGuard {
    dispatcher: Arc<Dispatcher>,
    server: ServerRef,
    tokens: u64,
    started: bool,
}

impl InflightGuard {
    /// Begins a request of `tokens` prompt tokens to `server`; `None` if the
    /// registration is stale.
    pub fn begin(dispatcher: &Arc<Dispatcher>, server: ServerRef, tokens: u64) -> Option<Self> {
        dispatcher.store.begin_request(server, tokens).then(|| Self {
            dispatcher: dispatcher.clone(),
            server,
            tokens,
            started: false,
        })
    }

    /// The server this request went to.
    pub fn server(&self) -> ServerRef {
        self.server
    }

    /// The answer's first token arrived: no longer pending (once).
    pub fn first_token(&mut self) {
        if !self.started {
            self.started = true;
            self.dispatcher.store.first_token(self.server, self.tokens);
            self.dispatcher.queue.wake();
        }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.dispatcher
            .store
            .end_request(self.server, self.tokens, self.started);
        self.dispatcher.queue.wake();
    }
}

/// Records an inference request's TTFT (first body frame relayed) and
/// end-to-end duration (when dropped: the body ended, failed, or the client
/// left) into the dispatcher's metrics, both from the request's arrival.
#[derive(Debug)]
pub(crate) struct RelayTimer {
    dispatcher: Arc<Dispatcher>,
    start: Instant,
    first_frame: bool,
}

impl RelayTimer {
    /// Times a request that arrived at `start`.
    pub fn new(dispatcher: Arc<Dispatcher>, start: Instant) -> Self {
        Self {
            dispatcher,
            start,
            first_frame: false,
        }
    }

    fn frame(&mut self) {
        if !self.first_frame {
            self.first_frame = true;
            self.dispatcher
                .metrics()
                .observe_duration(crate::metrics::TTFT, self.start.elapsed());
        }
    }
}

impl Drop for RelayTimer {
    fn drop(&mut self) {
        self.dispatcher
            .metrics()
            .observe_duration(crate::metrics::DURATION, self.start.elapsed());
    }
}

/// What a finished answer teaches: everything of the request the completion
/// record needs.
#[derive(Debug)]
pub(crate) struct Learn {
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
}

/// The copy of the answer a relay keeps.
#[derive(Debug)]
enum Capture {
    /// A JSON body, whole.
    Json { buf: Vec<u8>, overflow: bool },
    /// An event stream as it came, while short.
    RawStream(Vec<u8>),
    /// A longer event stream, read as it passes.
    Stream(EventStreamText),
}

impl Capture {
    fn feed(&mut self, data: &[u8]) {
        match self {
            Capture::Json { buf, overflow } => {
                if !*overflow {
                    if buf.len() + data.len() > MAX_JSON_CAPTURE {
                        *overflow = true;
                        *buf = Vec::new();
                    } else {
                        buf.extend_from_slice(data);
                    }
                }
            }
            Capture::RawStream(buf) if buf.len() + data.len() <= RAW_STREAM_BYTES => buf.extend_from_slice(data),
            Capture::RawStream(buf) => {
                let mut stream = EventStreamText::default();
                stream.feed(buf);
                stream.feed(data);
                *self = Capture::Stream(stream);
            }
            Capture::Stream(c) => c.feed(data),
        }
    }

    /// The answer, in the form it is kept in (`None` if it was too large).
    fn into_answer(self) -> Option<(AnswerForm, Vec<u8>)> {
        match self {
            Capture::Json { buf, overflow: false } => Some((AnswerForm::Json, buf)),
            Capture::RawStream(buf) => Some((AnswerForm::EventStream, buf)),
            Capture::Stream(c) if !c.overflow => Some((AnswerForm::Text, c.text.into_bytes())),
            _ => None,
        }
    }
}

/// The response body of a proxied request (see the module docs).
#[derive(Debug)]
pub(crate) struct Relay {
    inner: Incoming,
    deadline: Pin<Box<Sleep>>,
    guard: Option<InflightGuard>,
    capture: Option<Capture>,
    learn: Option<(Arc<Dispatcher>, Learn)>,
    finished: bool,
    timer: Option<RelayTimer>,
}

impl Relay {
    /// Relays `inner` until `deadline` fires; `learn` (for a 2xx inference
    /// answer) makes a completion record when it ends; `sse` tells how to
    /// read the answer; `timer` records its latency metrics.
    pub fn new(
        inner: Incoming,
        deadline: Pin<Box<Sleep>>,
        guard: InflightGuard,
        learn: Option<(Arc<Dispatcher>, Learn)>,
        sse: bool,
        timer: Option<RelayTimer>,
    ) -> Self {
        let capture = learn.as_ref().map(|_| {
            if sse {
                Capture::RawStream(Vec::new())
            } else {
                Capture::Json {
                    buf: Vec::new(),
                    overflow: false,
                }
            }
        });
        Self {
            inner,
            deadline,
            guard: Some(guard),
            capture,
            learn,
            finished: false,
            timer,
        }
    }

    /// As a boxed response body.
    pub fn boxed(self) -> Body {
        self.boxed_unsync()
    }

    fn fail(&mut self) {
        self.finished = true;
        if let Some(g) = self.guard.take() {
            g.dispatcher.metrics().upstream(g.server.slot, false);
            // Passive health check: the body was cut or timed out.
            let address = g
                .dispatcher
                .segment
                .tables()
                .servers
                .get(g.server.slot)
                .map(|i| i.address);
            let address = address.as_deref().unwrap_or("?");
            g.dispatcher
                .passive_failure(g.server, address, "the answer's body failed");
        }
        self.learn = None;
        self.capture = None;
        self.timer = None;
    }

    fn end(&mut self) {
        self.finished = true;
        self.timer = None;
        if let Some(g) = self.guard.take() {
            // Passive health check: answered in full.
            g.dispatcher.passive_success(g.server);
            g.dispatcher.metrics().upstream(g.server.slot, true);
        }
        let (Some((dispatcher, learn)), Some(capture)) = (self.learn.take(), self.capture.take()) else {
            return;
        };
        if let Some((form, answer)) = capture.into_answer() {
            dispatcher.push_completion(learn, form, answer);
        }
    }
}

impl HttpBody for Relay {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.finished {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if frame.is_data() {
                    if let Some(t) = this.timer.as_mut() {
                        t.frame();
                    }
                    // The first data frame carries the first token (vLLM
                    // and SGLang send nothing on a stream before it).
                    if let Some(g) = this.guard.as_mut() {
                        g.first_token();
                    }
                }
                if let (Some(capture), Some(data)) = (this.capture.as_mut(), frame.data_ref()) {
                    capture.feed(data);
                }
                // With a Content-Length, hyper stops polling once that many
                // bytes are out: the end is seen here, not as `None`.
                if this.inner.is_end_stream() {
                    this.end();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.fail();
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(None) => {
                this.end();
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.deadline.as_mut().poll(cx).is_ready() {
                    this.fail();
                    return Poll::Ready(Some(Err("semlb: upstream request timed out".into())));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Dispatcher {
    /// Builds the completion record of a finished answer (`answer`, in
    /// `form`) and pushes it into this dispatcher's ring (never waits; a
    /// full ring drops it).
    pub(crate) fn push_completion(&self, learn: Learn, form: AnswerForm, answer: Vec<u8>) {
        let tables = self.segment.tables();
        if self.identity.ring >= tables.ring_count() {
            self.metrics().record(false);
            return;
        }
        let ring = tables.ring(self.identity.ring);
        let max = ring.max_record();
        // A cacheable JSON answer is the response to store: carried once.
        let cached = match learn.cache_key {
            Some(key) if form == AnswerForm::Json && answer.len() + 8 <= tables.responses.max_value() => Some(key),
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
                tail: &learn.tail,
                form: form.to_byte(learn.chat),
                answer: if cached.is_some() { None } else { Some(&answer) },
            }),
            response: cached.map(|key| (key, &answer[..])),
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
            text = answer_text(form, &answer).map(|(t, _)| t).unwrap_or_default();
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
        self.metrics().record(ring.push(&buf).is_ok());
    }
}
