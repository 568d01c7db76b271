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
//! completion record ([`push_completion`]): the prompt chain,
//! the answer as it came (the JSON body, or the event stream) with the
//! prompt's last partial block (a response process reads the answer's text
//! out of it, tokenizes it and hashes the chain of prompt + answer:
//! [`crate::responder`], [`crate::openai::answer`]), the prompt's token count, and
//! the response body when it may be cached (then the answer is not carried
//! twice). The dispatcher neither parses nor tokenizes the answer; the
//! record is copied into this dispatcher's completion ring on the reactor,
//! without waiting (a full ring drops it, counted by the ring). Only an
//! event stream longer than [`RAW_STREAM_BYTES`] (or, when the answer may
//! be cached, than what a record and the response cache can hold) is read
//! as it passes (its text goes into the record instead, at most a record's
//! worth of it: the leading part, which the next turn reuses), and an
//! answer too large for a record is read when it ends. What a relay keeps
//! is bounded by the record size whatever the engine sends: a stream's
//! text by one record and its lines by 1 MiB, a JSON body by eight records
//! (at most 32 MiB), so a broken or hostile engine's endless answer is
//! relayed without growing the dispatcher (`tests/hostile_upstreams.rs`).
//!
//! A streamed answer whose usage the gateway asked for on the client's
//! behalf is passed through a [`UsageStrip`], which takes out what the
//! client did not ask for ([`super::stream_usage`]); the copy kept to learn from
//! has it.
//!
//! An answer whose request has token limits ([`crate::tenancy::rate_limit`]) has
//! its output reservation settled when the relay ends, however it ends,
//! with the output an [`OutputMeter`] read as the answer passed: the
//! engine's reported usage, else a token per four bytes of everything
//! generated (a stream its client left is charged what was relayed). The
//! same count goes to its tenant's and model's usage and settles its
//! fair-share charge.
//!
//! For an inference request the relay also records the gateway's latency
//! metrics ([`RelayTimer`]): TTFT when the first body frame is handed to
//! the client, the request's duration when the relay ends (body done,
//! failed, or the client gone).

mod resumption;

use std::pin::Pin;
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use memchr::memmem::{Finder, FinderRev};
use std::time::Instant;
use tokio::time::Sleep;

use shm_layout::{ServerRef, UsageCounter};

use super::Dispatcher;
use super::charge::{Reservation, Settling};
use super::http::{Body, BoxError};
use super::inflight::InflightGuard;
use super::learn::{Learn, push_completion};
use super::meter::OutputMeter;
use super::pick::{passive_failure, passive_success};
use super::resume::{Attempt, Break, Passed, Resume, ResumedHead};
use super::stream_usage::UsageStrip;
use super::tenant_usage;
use crate::dispatcher::failure::Failure;
use crate::openai::answer::{AnswerForm, EventStreamText, Reported};
use crate::pools::Pool;
use crate::tenancy::fair_share::Share;

/// Largest non-streaming answer kept to learn from (bytes), and how many
/// completion records' worth at most (the answer's text is read out of the
/// JSON, its escapes undone, then cut to a record; a body this much larger
/// than a record holds more text than a record carries, and a hostile
/// engine's endless body is not held).
const MAX_JSON_CAPTURE: usize = 32 << 20;
const JSON_CAPTURE_RECORDS: usize = 8;

/// An event stream is kept as it comes up to this many bytes (about 80
/// chat tokens); a longer one is read as it passes and only its text kept.
pub(crate) const RAW_STREAM_BYTES: usize = 16 << 10;

/// Records an inference request's TTFT (first body frame relayed) and
/// end-to-end duration (when dropped: the body ended, failed, or the client
/// left) into the dispatcher's metrics, both from the request's arrival.
#[derive(Debug)]
pub(super) struct RelayTimer {
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

    /// A body frame was handed to the client (the first one is the TTFT).
    pub(super) fn frame(&mut self) {
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

/// The copy of the answer a relay keeps.
#[derive(Debug)]
enum Capture {
    /// A JSON body, whole, while at most `limit` bytes long.
    Json { buf: Vec<u8>, overflow: bool, limit: usize },
    /// An event stream as it came, while at most `limit` bytes long; past
    /// it, its text up to `text_limit` bytes.
    RawStream {
        buf: Vec<u8>,
        limit: usize,
        text_limit: usize,
    },
    /// A longer event stream, read as it passes.
    Stream(EventStreamText),
}

impl Capture {
    fn feed(&mut self, data: &[u8]) {
        match self {
            Capture::Json { buf, overflow, limit } => {
                if !*overflow {
                    if buf.len() + data.len() > *limit {
                        *overflow = true;
                        *buf = Vec::new();
                    } else {
                        buf.extend_from_slice(data);
                    }
                }
            }
            Capture::RawStream { buf, limit, .. } if buf.len() + data.len() <= *limit => buf.extend_from_slice(data),
            Capture::RawStream { buf, text_limit, .. } => {
                let mut stream = EventStreamText::bounded(*text_limit);
                stream.feed(buf);
                stream.feed(data);
                *self = Capture::Stream(stream);
            }
            Capture::Stream(c) => c.feed(data),
        }
    }

    /// The answer, in the form it is kept in (`None` if it was too large),
    /// and what the engine reported when the stream was read as it passed
    /// (the other forms carry their report in their bytes).
    fn into_answer(self) -> Option<(AnswerForm, Vec<u8>, Reported)> {
        match self {
            Capture::Json {
                buf, overflow: false, ..
            } => Some((AnswerForm::Json, buf, Reported::default())),
            Capture::RawStream { buf, .. } => Some((AnswerForm::EventStream, buf, Reported::default())),
            Capture::Stream(c) if !c.overflow => Some((AnswerForm::Text, c.text.into_bytes(), c.reported)),
            _ => None,
        }
    }
}

/// The body a relay reads: an engine's answer as the upstream client
/// receives it, or one fed to it chunk by chunk (the endpoint picker's:
/// Envoy streams the engine's answer through it, [`super::epp`]).
#[derive(Debug)]
pub(super) enum UpstreamBody {
    /// From the upstream client.
    Engine(Incoming),
    /// Fed by [`fed`]'s sender; it ends when the sender is dropped.
    Fed(tokio::sync::mpsc::UnboundedReceiver<Bytes>),
}

/// A body that is fed: its chunks go in through the sender, which ends
/// it when dropped.
pub(super) fn fed() -> (tokio::sync::mpsc::UnboundedSender<Bytes>, UpstreamBody) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    (tx, UpstreamBody::Fed(rx))
}

impl UpstreamBody {
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self {
            UpstreamBody::Engine(body) => Pin::new(body).poll_frame(cx),
            UpstreamBody::Fed(rx) => rx.poll_recv(cx).map(|chunk| chunk.map(|c| Ok(Frame::data(c)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Engine(body) => body.is_end_stream(),
            UpstreamBody::Fed(rx) => rx.is_closed() && rx.is_empty(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Engine(body) => body.size_hint(),
            UpstreamBody::Fed(_) => SizeHint::default(),
        }
    }
}

/// What is relayed: a server's answer body, the server's base URL and the
/// request's in-flight count.
#[derive(Debug)]
pub(super) struct Upstream {
    /// The answer's body.
    pub body: UpstreamBody,
    /// The server's base URL (for the passive health check).
    pub address: String,
    /// The request's in-flight count, ended when the relay ends.
    pub guard: InflightGuard,
    /// A task that goes with the answer and ends with it (a split
    /// request's SGLang prefill leg).
    pub companion: Option<super::disagg::Companion>,
    /// A split request's decode leg: when it was sent.
    pub decode_leg: Option<Instant>,
    /// The body's first data, read before the relay began.
    pub first: Option<Bytes>,
}

/// The response body of a proxied request (see the module docs).
#[derive(Debug)]
pub(super) struct Relay {
    dispatcher: Arc<Dispatcher>,
    /// A task that ends with the answer (a split request's SGLang prefill
    /// leg): dropped with the relay. Its failure before the answer's first
    /// byte ends the answer (its decode leg waits for that partner).
    companion: Option<super::disagg::Companion>,
    /// A split request's decode leg: when it was sent (its duration is
    /// observed when the answer ends, well or not).
    decode_leg: Option<Instant>,
    /// The body's first data, read before the relay began: relayed first.
    first: Option<Bytes>,
    /// The base URL of the server answering (for the passive health check).
    address: String,
    inner: UpstreamBody,
    deadline: Pin<Box<Sleep>>,
    guard: Option<InflightGuard>,
    capture: Option<Capture>,
    learn: Option<Learn>,
    finished: bool,
    timer: Option<RelayTimer>,
    /// Takes the usage the client did not ask for out of the stream.
    strip: Option<UsageStrip>,
    /// The answer is an event stream.
    sse: bool,
    /// Its output reservation in its rate-limit buckets, until settled.
    output: Option<Reservation>,
    /// Whose output tokens are counted (tenant, model pool), until they are.
    counted: Option<Counted>,
    /// Reads the answer's output (when it is charged or counted).
    meter: Option<OutputMeter>,
    /// Its charge in the gateway queue's fair share, until settled.
    share: Option<Share>,
    /// The answer's settlement in the store, under way: its last frame
    /// (`held`) goes out when that is done.
    settling: Option<Settling>,
    held: Option<Bytes>,
    /// The record of the stored response the answer carries, waited for
    /// with the settlement at its end.
    recording: Option<Settling>,
    /// A chat stream's resumption when its engine breaks ([`super::resume`]).
    resume: Option<Box<Resume>>,
    /// The next attempt of a broken stream, until its head.
    resuming: Option<Attempt>,
    /// Why the stream broke, to be handled before anything else is read.
    broken: Option<Break>,
    /// A retired engine's stream was found unable to move
    /// ([`Resume::movable`]): it runs on where it is.
    stays: bool,
    /// Fires when a resumable stream may have sent nothing for
    /// `resume.stall_ms` (armed by its first data; when it fires early, it
    /// is set again from `last_data`: one timer per stall period, not one
    /// reset per frame).
    stall: Option<Pin<Box<Sleep>>>,
    /// When the last data came (for `stall`).
    last_data: tokio::time::Instant,
}

/// Whose output tokens an answer counts for (`super::tenant_usage`).
#[derive(Debug)]
struct Counted {
    tenant: Option<Arc<str>>,
    /// A named model pool.
    pool: Option<Arc<Pool>>,
}

/// What a relay without a [`Learn`] context (an answer forwarded as it
/// is: `super::passthrough`) charges and counts its output to.
#[derive(Debug, Default)]
pub(super) struct Metered {
    /// Its output reservation.
    pub output: Option<Reservation>,
    /// Its caller's tenant.
    pub tenant: Option<Arc<str>>,
    /// Its model pool.
    pub pool: Option<Arc<Pool>>,
    /// Its charge in the gateway queue's fair share, when routing charged
    /// it.
    pub share: Option<Share>,
}

impl Relay {
    /// Relays `upstream` until `deadline` fires; `learn` (for a 2xx
    /// inference answer) makes a completion record when it ends; `sse`
    /// tells how to read the answer; `timer` records its latency metrics;
    /// `strip_usage`: the gateway asked for the stream's usage, which the
    /// client did not; `metered`: what an answer without `learn` is
    /// charged and counted to.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dispatcher: Arc<Dispatcher>,
        upstream: Upstream,
        deadline: Pin<Box<Sleep>>,
        mut learn: Option<Learn>,
        sse: bool,
        timer: Option<RelayTimer>,
        strip_usage: bool,
        metered: Option<Metered>,
    ) -> Self {
        let (output, tenant, pool, share) = match (learn.as_mut(), metered) {
            (Some(l), _) => (l.output.take(), l.tenant.clone(), l.pool.clone(), l.share.take()),
            (None, Some(m)) => (m.output, m.tenant, m.pool, m.share),
            (None, None) => (None, None, None, None),
        };
        let pool = pool.filter(|p| p.name().is_some());
        let counted = (tenant.is_some() || pool.is_some()).then_some(Counted { tenant, pool });
        let meter = (output.is_some() || counted.is_some() || share.is_some()).then(|| OutputMeter::new(sse));
        let capture = learn.as_ref().map(|learn| {
            if sse {
                // A stream that may be cached is kept whole while it can
                // still be carried to a response process and stored (it is
                // assembled into its JSON response there); others only
                // while short.
                let limit = if learn.cache_key.is_some() {
                    dispatcher.cacheable_stream_bytes()
                } else {
                    RAW_STREAM_BYTES
                };
                Capture::RawStream {
                    buf: Vec::new(),
                    limit,
                    text_limit: dispatcher.max_record(),
                }
            } else {
                Capture::Json {
                    buf: Vec::new(),
                    overflow: false,
                    limit: MAX_JSON_CAPTURE.min(JSON_CAPTURE_RECORDS * dispatcher.max_record()),
                }
            }
        });
        let Upstream {
            body,
            address,
            guard,
            companion,
            decode_leg,
            first,
        } = upstream;
        Self {
            dispatcher,
            address,
            inner: body,
            deadline,
            guard: Some(guard),
            capture,
            learn,
            finished: false,
            timer,
            strip: (sse && strip_usage).then(UsageStrip::default),
            sse,
            output,
            counted,
            meter,
            share,
            companion,
            decode_leg,
            first,
            settling: None,
            held: None,
            recording: None,
            resume: None,
            resuming: None,
            broken: None,
            stays: false,
            stall: None,
            last_data: tokio::time::Instant::now(),
        }
    }

    /// Ends a relay that did not end well, once its guard is dealt with:
    /// charged what it relayed, nothing learned, no latency recorded.
    fn abandon(&mut self) {
        self.finished = true;
        self.decode_leg_ended();
        self.charge_output(false);
        self.learn = None;
        self.capture = None;
        self.timer = None;
    }

    /// A split request's decode leg ended: its duration.
    fn decode_leg_ended(&mut self) {
        if let Some(sent) = self.decode_leg.take() {
            self.dispatcher
                .metrics()
                .observe_duration(crate::metrics::PD_DECODE, sent.elapsed());
        }
    }

    /// Settles the answer's output reservation with the output it
    /// produced, counts that for its tenant and model, and settles its
    /// fair-share charge (once). An answer that ended well (`wait`) keeps
    /// the reservation's settlement to wait for in `settling`; any other
    /// end settles it without waiting.
    fn charge_output(&mut self, wait: bool) {
        let (reservation, counted, share) = (self.output.take(), self.counted.take(), self.share.take());
        let Some(mut meter) = self.meter.take() else {
            return;
        };
        let tokens = meter.tokens();
        if let Some(share) = share {
            self.dispatcher.queue().settle(&share, tokens);
        }
        match reservation {
            Some(reservation) if wait => {
                self.settling = Settling::both(self.settling.take(), Some(reservation.settle(tokens)));
            }
            Some(reservation) => reservation.settle_detached(tokens),
            None => {}
        }
        if tokens == 0 {
            return;
        }
        if let Some(Counted { tenant, pool }) = counted {
            tenant_usage::count(
                &self.dispatcher,
                tenant.as_deref(),
                pool.as_ref().and_then(|p| p.name()),
                &[(UsageCounter::OutputTokens, tokens)],
            );
        }
    }

    /// As a boxed response body.
    pub fn boxed(self) -> Body {
        self.boxed_unsync()
    }

    /// Ends a relay that did not end well, with the failure `failure`
    /// makes of the server's address: a cut body (the engine's), or the
    /// request's deadline passed while it still came (the client's: a long
    /// generation it asked for), as the passive health check tells apart.
    fn fail(&mut self, failure: fn(String) -> Failure) {
        self.server_failed(failure);
        self.abandon();
    }

    /// The answering server failed the answer (`failure` of its address):
    /// counted against it and its passive health, its in-flight count
    /// ended. The server, if the relay still counted one.
    fn server_failed(&mut self, failure: fn(String) -> Failure) -> Option<ServerRef> {
        let guard = self.guard.take()?;
        let server = guard.server();
        self.dispatcher.metrics().upstream(server.slot, false);
        let failure = failure(self.address.clone());
        passive_failure(&self.dispatcher, server, &self.address, &failure);
        Some(server)
    }

    /// Ends a relay whose companion leg failed (`failed`) before the
    /// answer began: not a failure of the server answering.
    fn partner_failed(&mut self, failed: &super::disagg::LegFailed) -> BoxError {
        self.guard = None;
        self.abandon();
        format!("semlb: the prefill leg failed ({})", failed.failure).into()
    }

    /// The bookkeeping of a data frame from upstream: first token, TTFT,
    /// the copy kept to learn from.
    fn passed(&mut self, data: &[u8]) {
        // The answer began: its companion handed over what it had to.
        if let Some(c) = self.companion.as_mut() {
            c.handed_over();
        }
        if let Some(t) = self.timer.as_mut() {
            t.frame();
        }
        // The first data frame carries the first token (vLLM and SGLang
        // send nothing on a stream before it).
        if let Some(g) = self.guard.as_mut() {
            g.first_token();
        }
        if let Some(capture) = self.capture.as_mut() {
            capture.feed(data);
        }
        if let Some(meter) = self.meter.as_mut() {
            meter.feed(data);
        }
        if let Some(learn) = self.learn.as_mut()
            && let Some((salt, watch)) = learn.stored.as_mut()
            && let Some(id) = watch.feed(data)
        {
            let key = crate::routing::affinity::stored_key(*salt, &id);
            let (dispatcher, server) = (self.dispatcher.clone(), learn.server);
            self.recording = Some(Settling::new(async move {
                dispatcher.store().record_affinity(server, key).await;
            }));
            learn.stored = None;
        }
    }

    fn end(&mut self) {
        self.finished = true;
        self.decode_leg_ended();
        self.timer = None;
        self.settling = self.recording.take();
        self.charge_output(true);
        // Only a 2xx inference answer (one to learn from) is evidence for
        // the tuner: an error's latency says nothing of the route.
        let inference = self.learn.is_some();
        let timing = self.guard.take().map(|g| {
            // Passive health check: answered in full.
            passive_success(&self.dispatcher, g.server());
            self.dispatcher.metrics().upstream(g.server().slot, true);
            let timing = g.timing(self.sse);
            let pool = self.learn.as_ref().and_then(|l| l.pool.as_ref());
            if let (Some(arm), Some(pool)) = (g.arm().filter(|_| inference), pool) {
                self.dispatcher
                    .observe_route(pool, arm, timing.first_byte_us.unwrap_or(timing.latency_us));
            }
            timing
        });
        let (Some(mut learn), Some(capture)) = (self.learn.take(), self.capture.take()) else {
            return;
        };
        learn.timing = timing;
        // A tenant past its share of the prefix table teaches nothing.
        if !learn.record {
            return;
        }
        if let Some(last) = learn
            .chain
            .last()
            .filter(|_| self.dispatcher.config().learn_from_reports)
        {
            self.dispatcher.store().touch_route(learn.server, *last);
        }
        if let Some((form, answer, reported)) = capture.into_answer() {
            if form == AnswerForm::Text {
                learn.prediction.cached_tokens = reported.cached_tokens_u32();
            }
            push_completion(&self.dispatcher, learn, form, answer);
        }
    }
}

/// Whether an event-stream frame ends with the stream's last event: chat
/// and completions streams end with `data: [DONE]` (OpenAI's, vLLM's and
/// SGLang's), a Responses stream with its `response.completed` (or
/// `.failed`, `.incomplete`) event, a Messages stream with `message_stop`.
/// An event split across frames is not seen here, and the stream then
/// ends at its `None` as before.
fn ends_with_done(frame: &[u8]) -> bool {
    const LAST_EVENTS: [&[u8]; 4] = [
        b"\"message_stop\"",
        b"\"response.completed\"",
        b"\"response.failed\"",
        b"\"response.incomplete\"",
    ];
    let frame = frame.trim_ascii_end();
    if frame.ends_with(b"data: [DONE]") {
        return true;
    }
    // The last event: after the last blank line, and a whole one.
    let Some(last_line) = frame.rsplit(|b| *b == b'\n').next() else {
        return false;
    };
    if !last_line.starts_with(b"data:") || !last_line.trim_ascii_end().ends_with(b"}") {
        return false;
    }
    // Searchers built once: building one costs more than searching a frame.
    static BLANK: LazyLock<FinderRev<'static>> = LazyLock::new(|| FinderRev::new(b"\n\n"));
    static TYPE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"type\""));
    static NAMES: LazyLock<[Finder<'static>; 4]> = LazyLock::new(|| LAST_EVENTS.map(Finder::new));
    let start = BLANK.rfind(frame).map_or(0, |i| i + 2);
    let event = &frame[start..];
    // Only a typed event (Responses, Messages) can be one of them: a chat
    // chunk is not searched further.
    if !event.starts_with(b"event:") && TYPE.find(event).is_none() {
        return false;
    }
    NAMES
        .iter()
        .any(|name| name.find_iter(event).any(|at| at == 0 || event[at - 1] != b'\\'))
}

impl Drop for Relay {
    /// A relay dropped before its end (the client went away) is charged
    /// what it relayed.
    fn drop(&mut self) {
        self.charge_output(false);
        // A client gone while the end waited for its settlement (or the
        // stored response's record): finished without it.
        if let Some(settling) = self.settling.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(settling);
        }
    }
}

impl HttpBody for Relay {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            // The answer's last frame waits for its settlement.
            if let Some(settling) = this.settling.as_mut() {
                if Pin::new(settling).poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.settling = None;
                return Poll::Ready(this.held.take().map(|data| Ok(Frame::data(data))));
            }
            if this.finished {
                return Poll::Ready(None);
            }
            if let Some(attempt) = this.resuming.as_mut() {
                match Pin::new(attempt).poll(cx) {
                    Poll::Pending => {
                        if this.deadline.as_mut().poll(cx).is_ready() {
                            this.resuming = None;
                            let why = "the request's deadline passed while the continuation waited for an engine";
                            let end = this.resume.as_ref().map(|r| r.attempt_failed(why)).unwrap_or_default();
                            return this.end_broken(end);
                        }
                        return Poll::Pending;
                    }
                    Poll::Ready(Ok(head)) => {
                        this.resuming = None;
                        this.resumed_on(head);
                    }
                    Poll::Ready(Err(why)) => {
                        this.resuming = None;
                        let end = this.resume.as_ref().map(|r| r.attempt_failed(&why)).unwrap_or_default();
                        return this.end_broken(end);
                    }
                }
            }
            if let Some(why) = this.broken.take() {
                match this.break_stream(why) {
                    Ok(()) => continue,
                    Err(end) => return this.end_broken(end),
                }
            }
            let polled = match this.first.take() {
                Some(data) => Poll::Ready(Some(Ok(Frame::data(data)))),
                None => this.inner.poll_frame(cx),
            };
            let frame = match polled {
                Poll::Ready(Some(Ok(frame))) => frame,
                Poll::Ready(Some(Err(_))) if this.resume.is_some() => {
                    this.broken = Some(Break::Cut);
                    continue;
                }
                Poll::Ready(Some(Err(e))) => {
                    this.fail(|address| Failure::Body { address });
                    return Poll::Ready(Some(Err(Box::new(e))));
                }
                // A chat stream that ends before its `data: [DONE]` broke.
                Poll::Ready(None) if this.resume.as_ref().is_some_and(|r| !r.done()) => {
                    this.broken = Some(Break::Cut);
                    continue;
                }
                Poll::Ready(None) => {
                    let rest = this.strip.as_mut().map(UsageStrip::finish).unwrap_or_default();
                    this.end();
                    if this.settling.is_some() {
                        this.held = (!rest.is_empty()).then_some(rest);
                        continue;
                    }
                    return Poll::Ready((!rest.is_empty()).then(|| Ok(Frame::data(rest))));
                }
                Poll::Pending => {
                    if let Some(Poll::Ready(failed)) = this.companion.as_mut().map(|c| c.poll_failed(cx)) {
                        return Poll::Ready(Some(Err(this.partner_failed(&failed))));
                    }
                    if this.deadline.as_mut().poll(cx).is_ready() {
                        this.fail(|address| Failure::Deadline { address });
                        return Poll::Ready(Some(Err("semlb: upstream request timed out".into())));
                    }
                    if this.stalled(cx) {
                        this.broken = Some(Break::Stall);
                        continue;
                    }
                    return Poll::Pending;
                }
            };
            let data = match frame.into_data() {
                Ok(data) => data,
                Err(other) => return Poll::Ready(Some(Ok(other))),
            };
            // A chat stream goes on in whole events; an error event breaks it.
            let data = match this.resume.as_mut() {
                Some(resume) => {
                    let data = match resume.pass(data) {
                        Passed::Events(data) => data,
                        Passed::Broke(data) => {
                            this.broken = Some(Break::ErrorEvent);
                            data
                        }
                    };
                    this.last_data = tokio::time::Instant::now();
                    if this.stall.is_none()
                        && let Some(stall) = resume.stall()
                    {
                        this.stall = Some(Box::pin(tokio::time::sleep_until(this.last_data + stall)));
                    }
                    if data.is_empty() {
                        continue;
                    }
                    data
                }
                None => data,
            };
            if this.retired() && !ends_with_done(&data) {
                this.broken = Some(Break::Drain);
            }
            this.passed(&data);
            // With a Content-Length, hyper stops polling once that many
            // bytes are out: the end is seen here, not as `None`. An event
            // stream ends with its `data: [DONE]` event: the answer is
            // done then, and ended before the event goes out, so that a
            // client that sends its next turn the instant it reads it
            // finds the request no longer counted in flight (ended only at
            // the `None` after it, the count lagged the client whenever
            // the dispatcher was slow to poll again, and the next turn saw
            // its own engine one request busier than it was).
            let ending = this.broken.is_none() && (this.inner.is_end_stream() || (this.sse && ends_with_done(&data)));
            let out = match this.strip.as_mut() {
                // Passed on less the usage the client did not ask for.
                Some(strip) if ending => [strip.feed(&data), strip.finish()].concat().into(),
                Some(strip) => strip.feed(&data),
                None => data,
            };
            if ending {
                this.end();
                if this.settling.is_some() {
                    this.held = Some(out);
                    continue;
                }
            }
            // A stripped frame with nothing left for the client is not sent.
            if out.is_empty() && !ending && this.strip.is_some() {
                continue;
            }
            return Poll::Ready(Some(Ok(Frame::data(out))));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished && self.settling.is_none() && self.held.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        if self.strip.is_some() || self.resume.is_some() {
            return SizeHint::default();
        }
        let hint = self.inner.size_hint();
        match &self.first {
            Some(first) => {
                let first = first.len() as u64;
                let mut ahead = SizeHint::new();
                ahead.set_lower(hint.lower() + first);
                if let Some(upper) = hint.upper() {
                    ahead.set_upper(upper + first);
                }
                ahead
            }
            None => hint,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ends_with_done;

    #[test]
    fn the_last_event_of_a_stream_is_seen_in_its_frame() {
        assert!(ends_with_done(b"data: [DONE]\n\n"));
        assert!(ends_with_done(b"data: {\"choices\":[]}\n\ndata: [DONE]\r\n\r\n"));
        assert!(!ends_with_done(b"data: {\"choices\":[]}\n\n"));
        // Split across frames: not seen here (the stream ends at `None`).
        assert!(!ends_with_done(b"data: [DO"));
        assert!(!ends_with_done(b""));
        // Responses and Messages streams end with their last event.
        assert!(ends_with_done(
            b"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{}}\n\n"
        ));
        assert!(ends_with_done(
            b"event: message_stop\ndata: {\"type\": \"message_stop\"}\n\n"
        ));
        assert!(!ends_with_done(
            b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"\\\"message_stop\\\"\"}\n\n"
        ));
        assert!(!ends_with_done(
            b"event: message_delta\ndata: {\"type\":\"message_delta\"}\n\n"
        ));
    }
}
