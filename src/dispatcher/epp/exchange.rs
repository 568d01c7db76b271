//! The message order of one ext_proc stream (one HTTP request through
//! Envoy, in `FULL_DUPLEX_STREAMED` body mode as the Gateway API Inference
//! Extension runs its picker): each direction is answered headers, then
//! body, then trailers.
//!
//! | Envoy sends | the picker answers |
//! | --- | --- |
//! | request headers | nothing yet; with `end_of_stream` (no body) the pick, then the headers' answer |
//! | a request body chunk | nothing: buffered, until the last one (`end_of_stream`); past `limits.max_body_bytes`, an immediate 413; past the dispatcher's `limits.max_inflight_body_bytes`, an immediate 503 |
//! | the last chunk | the pick: the headers' answer (destination, `clear_route_cache`, dynamic metadata), then the body as streamed body responses; or an immediate response |
//! | request trailers | (the pick, if the body did not end before) the trailers' answer |
//! | response headers | the headers' answer; the answer's relay begins |
//! | a response body chunk | the chunk, as streamed body response, once the relay saw it |
//! | response trailers | the trailers' answer |
//!
//! The pick waits for the whole body: its prompt is what is routed.

use std::sync::Arc;

use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse, processing_request};
use http::StatusCode;
use http_body_util::BodyExt;
use tonic::Status;

use super::answer::Answer;
use super::pick::{Decision, Routed, decide};
use super::wire::{self, Head};
use crate::dispatcher::Dispatcher;
use crate::dispatcher::concurrency::Counted;
use crate::dispatcher::http::{Body, BodyPermit, body_too_large};
use crate::dispatcher::proxy::Picked;
use crate::metrics::EndpointLabel;

/// Where the exchange is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the request's headers.
    RequestHeaders,
    /// Buffering the request's body.
    RequestBody,
    /// Routed: waiting for the engine's answer.
    Upstream,
    /// Relaying the engine's answer.
    ResponseBody,
    /// Answered (the answer ended, or an immediate response was sent).
    Done,
}

/// One stream's exchange.
pub struct Exchange<'d> {
    dispatcher: &'d Arc<Dispatcher>,
    phase: Phase,
    /// The request's `semlb_requests_total` label (counted with the
    /// status of its answer, the engine's or the gateway's).
    label: EndpointLabel,
    head: Option<Head>,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    /// The buffered body's place in the dispatcher's budget of bodies in
    /// flight (`limits.max_inflight_body_bytes`), until the pick.
    permit: Option<BodyPermit>,
    /// The request routed, until its answer's headers come.
    picked: Option<Picked<'d>>,
    /// Its tenant's place among its requests in flight, until the end.
    counted: Option<Counted>,
    answer: Option<Answer>,
}

impl<'d> Exchange<'d> {
    /// A new exchange for `dispatcher`.
    pub fn new(dispatcher: &'d Arc<Dispatcher>) -> Self {
        Self {
            dispatcher,
            phase: Phase::RequestHeaders,
            label: EndpointLabel::Other,
            head: None,
            subset: None,
            body: Vec::new(),
            permit: None,
            picked: None,
            counted: None,
            answer: None,
        }
    }

    /// Whether it is over: the stream may close.
    pub fn done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// The answers to Envoy's next message, in order; a message out of
    /// the protocol's order is Envoy's mistake: a gRPC error.
    pub async fn handle(&mut self, message: ProcessingRequest) -> Result<Vec<ProcessingResponse>, Status> {
        use processing_request::Request;
        let Some(request) = message.request else {
            return Ok(Vec::new());
        };
        match (self.phase, request) {
            (Phase::RequestHeaders, Request::RequestHeaders(h)) => {
                let head = wire::read_head(h.headers.as_ref());
                self.label = EndpointLabel::of_path(head.path.split('?').next().unwrap_or(""));
                self.head = Some(head);
                self.subset = wire::subset_hint(message.metadata_context.as_ref());
                if h.end_of_stream {
                    return Ok(self.route(false, true).await);
                }
                self.phase = Phase::RequestBody;
                Ok(Vec::new())
            }
            (Phase::RequestBody, Request::RequestBody(b)) => {
                // At most `limits.max_body_bytes` buffered, as the HTTP
                // front reads.
                let max = usize::try_from(self.dispatcher.config().limits.max_body_bytes.0).unwrap_or(usize::MAX);
                if self.body.len().saturating_add(b.body.len()) > max {
                    self.phase = Phase::Done;
                    self.body = Vec::new();
                    self.dispatcher.metrics().request(self.label, 413);
                    return Ok(vec![immediate(body_too_large(max)).await]);
                }
                let budget = self.dispatcher.body_budget();
                if !budget.hold(&mut self.permit, (self.body.len() + b.body.len()) as u64) {
                    self.phase = Phase::Done;
                    self.body = Vec::new();
                    self.dispatcher.metrics().request(self.label, 503);
                    return Ok(vec![immediate(budget.busy()).await]);
                }
                self.body.extend_from_slice(&b.body);
                if b.end_of_stream {
                    return Ok(self.route(true, true).await);
                }
                Ok(Vec::new())
            }
            (Phase::RequestBody, Request::RequestTrailers(_)) => {
                let mut out = self.route(true, false).await;
                if !self.done() {
                    out.push(wire::trailers(true));
                }
                Ok(out)
            }
            (Phase::Upstream, Request::RequestTrailers(_)) => Ok(vec![wire::trailers(true)]),
            (Phase::Upstream, Request::ResponseHeaders(h)) => {
                let head = wire::read_head(h.headers.as_ref());
                let prefill = self.begin_answer(head);
                if h.end_of_stream {
                    self.pass(Vec::new(), true);
                }
                self.phase = if h.end_of_stream {
                    Phase::Done
                } else {
                    Phase::ResponseBody
                };
                Ok(vec![wire::response_headers(prefill.as_ref())])
            }
            (Phase::ResponseBody, Request::ResponseBody(b)) => {
                let out = self.pass(b.body, b.end_of_stream);
                if b.end_of_stream {
                    self.phase = Phase::Done;
                }
                Ok(wire::streamed_body(false, &out, b.end_of_stream))
            }
            (Phase::ResponseBody, Request::ResponseTrailers(_)) => {
                // Trailers end the body.
                let rest = self.pass(Vec::new(), true);
                self.phase = Phase::Done;
                let mut out = Vec::new();
                if !rest.is_empty() {
                    out.extend(wire::streamed_body(false, &rest, false));
                }
                out.push(wire::trailers(false));
                Ok(out)
            }
            (phase, request) => Err(Status::failed_precondition(format!(
                "ext_proc message out of order: {} while the picker expects {phase:?}",
                message_name(&request)
            ))),
        }
    }

    /// The pick, with the body buffered (`with_body`), which ended with
    /// its last chunk (`end`) or with trailers: the answers to send.
    async fn route(&mut self, with_body: bool, end: bool) -> Vec<ProcessingResponse> {
        let head = self.head.take().unwrap_or_default();
        let body = with_body.then(|| Bytes::from(std::mem::take(&mut self.body)));
        // Handed on: the budget's place goes with the pick.
        let _permit = self.permit.take();
        // Boxed: the stages' state is large, and the exchange's future is
        // moved (into its task) before it runs.
        match Box::pin(decide(self.dispatcher, head, body, self.subset.as_deref())).await {
            Decision::Answer(response) => {
                self.phase = Phase::Done;
                self.dispatcher
                    .metrics()
                    .request(self.label, response.status().as_u16());
                vec![immediate(response).await]
            }
            Decision::Routed(routed) => {
                let Routed {
                    picked,
                    endpoints,
                    body,
                    counted,
                } = *routed;
                let mut out = vec![wire::routed_headers(&endpoints, body.as_ref().map(Bytes::len))];
                if with_body {
                    out.extend(wire::streamed_body(true, &body.unwrap_or_default(), end));
                }
                self.picked = Some(picked);
                self.counted = counted;
                self.phase = Phase::Upstream;
                out
            }
        }
    }

    /// The engine's answer head came: its relay begins. Returns the
    /// prefill engine of a split request (the HTTP front's
    /// `x-semlb-prefill`), for the client's answer.
    fn begin_answer(&mut self, head: Head) -> Option<http::HeaderValue> {
        let picked = self.picked.take()?;
        let status = head
            .status
            .and_then(|s| StatusCode::from_u16(s).ok())
            .unwrap_or(StatusCode::OK);
        self.dispatcher.metrics().request(self.label, status.as_u16());
        let (response, feed) = picked.answer(status, head.headers);
        let prefill = response.headers().get(crate::dispatcher::http::PREFILL_HEADER).cloned();
        self.answer = Some(Answer::new(response.into_body(), feed));
        prefill
    }

    /// Passes an answer chunk through its relay.
    fn pass(&mut self, chunk: Vec<u8>, end: bool) -> Vec<u8> {
        match self.answer.as_mut() {
            Some(answer) => answer.pass(chunk, end),
            None => chunk,
        }
    }
}

/// The gateway's answer as an immediate response.
async fn immediate(response: http::Response<Body>) -> ProcessingResponse {
    let (parts, body) = response.into_parts();
    // The gateway's own answers are whole (errors, cached answers).
    let body = body.collect().await.map(|c| c.to_bytes().to_vec()).unwrap_or_default();
    wire::immediate(parts.status.as_u16(), &parts.headers, body)
}

/// A message's name, for the error of one out of order.
fn message_name(request: &processing_request::Request) -> &'static str {
    use processing_request::Request;
    match request {
        Request::RequestHeaders(_) => "request_headers",
        Request::ResponseHeaders(_) => "response_headers",
        Request::RequestBody(_) => "request_body",
        Request::ResponseBody(_) => "response_body",
        Request::RequestTrailers(_) => "request_trailers",
        Request::ResponseTrailers(_) => "response_trailers",
    }
}
