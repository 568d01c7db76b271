//! The engine's answer as Envoy streams it back: fed chunk by chunk to the
//! same relay the HTTP proxy's answers pass through
//! ([`crate::dispatcher::relay`]), which learns the prompt and the answer
//! on success (the completion record for the response processes), reads
//! the usage and `prompt_tokens_details.cached_tokens` of a JSON or SSE
//! answer, charges the tenant's output and fair share, and ends the
//! request's in-flight count when the answer ends, or when this is
//! dropped (Envoy cancelled the stream).

use bytes::Bytes;
use futures_util::FutureExt;
use http_body_util::BodyExt;
use tokio::sync::mpsc::UnboundedSender;

use crate::dispatcher::http::Body;

/// An answer being relayed.
pub struct Answer {
    /// The relay, as a response body.
    relay: Body,
    /// Feeds it; dropped when the answer ends.
    feed: Option<UnboundedSender<Bytes>>,
    /// The relay ended or failed (the request's deadline passed): the rest
    /// passes as it comes.
    ended: bool,
}

impl Answer {
    /// The relay `relay`, fed by `feed`.
    pub fn new(relay: Body, feed: UnboundedSender<Bytes>) -> Self {
        Self {
            relay,
            feed: Some(feed),
            ended: false,
        }
    }

    /// Passes a chunk of the answer (`end`: its last): what goes on to
    /// the client (the chunk, less the usage the gateway asked for on the
    /// client's behalf).
    pub fn pass(&mut self, chunk: Vec<u8>, end: bool) -> Vec<u8> {
        if self.ended {
            return chunk;
        }
        if !chunk.is_empty()
            && let Some(feed) = &self.feed
        {
            let _ = feed.send(Bytes::from(chunk));
        }
        if end {
            self.feed = None;
        }
        // The relay has everything it needs: it is only polled (never
        // waits), so a waker is not needed.
        let mut out = Vec::new();
        loop {
            match self.relay.frame().now_or_never() {
                Some(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        out.extend_from_slice(&data);
                    }
                }
                Some(Some(Err(e))) => {
                    tracing::debug!(error = %e, "the relay of an answer through Envoy ended early: {e}");
                    self.ended = true;
                    break;
                }
                Some(None) => {
                    self.ended = true;
                    break;
                }
                None => break,
            }
        }
        out
    }
}
