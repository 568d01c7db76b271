//! A streaming client of the gateway for the reports that drive it as
//! agents do: one request on a fresh connection, its event stream read to
//! the end, with the times to the first and last content chunks, the
//! answer's headers and the engine's usage, on the runtime those reports
//! share ([`runtime`]); and what a set of such requests came to ([`Answers`]: sent,
//! failed, TTFT quantiles, cached share), which those reports fold their
//! samples into.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;

use crate::output;

/// A streamed answer as the client saw it.
pub struct Answer {
    /// Time to the first content chunk.
    pub ttft: Duration,
    /// Time to the last content chunk.
    pub last_token: Duration,
    /// Content chunks received (one token each from a vLLM-like engine).
    pub content_chunks: u64,
    /// The answer's tokens, as the engine's usage says (0 without a usage
    /// chunk: `stream_options.include_usage` not asked for).
    pub completion_tokens: u64,
    /// The answer's headers (`x-semlb-backend`, `x-semlb-prefill`, …).
    pub headers: http::HeaderMap,
    /// The answer's text.
    pub text: String,
    /// The prompt's tokens, as the engine's usage says.
    pub prompt_tokens: u64,
    /// Those the engine found cached.
    pub cached_tokens: u64,
    /// The stream ended with `data: [DONE]`.
    pub done: bool,
    /// An error event (`data: {"error": ...}`) came.
    pub error_event: bool,
}

/// The two-thread runtime a report's streaming clients run on (panics if
/// it cannot be built).
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
}

/// POSTs `body` to `addr`'s `/v1/chat/completions` with `headers` and
/// reads the SSE stream to its end.
pub async fn stream(addr: SocketAddr, body: &Value, headers: &[(&str, &str)]) -> Result<Answer> {
    let sent = Instant::now();
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut request = http::Request::post("/v1/chat/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(Bytes::from(body.to_string())))?;
    let response = sender.send_request(request).await?;
    if response.status() != 200 {
        bail!("status {}", response.status());
    }
    let headers = response.headers().clone();
    let mut body = response.into_body();
    let (mut buf, mut text, mut ttft, mut usage) = (Vec::new(), String::new(), None, (0, 0, 0));
    let (mut last_token, mut content_chunks) = (Duration::ZERO, 0);
    let (mut done, mut error_event) = (false, false);
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else { continue };
        buf.extend_from_slice(&data);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                done |= line == "data: [DONE]";
                let Some(v) = line
                    .strip_prefix("data: ")
                    .and_then(|d| serde_json::from_str::<Value>(d).ok())
                else {
                    continue;
                };
                error_event |= v.get("error").is_some();
                if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
                    last_token = sent.elapsed();
                    ttft.get_or_insert(last_token);
                    content_chunks += 1;
                    text.push_str(t);
                }
                if let Some(p) = v["usage"]["prompt_tokens"].as_u64() {
                    usage = (
                        p,
                        v["usage"]["prompt_tokens_details"]["cached_tokens"]
                            .as_u64()
                            .unwrap_or(0),
                        v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
                    );
                }
            }
        }
    }
    Ok(Answer {
        ttft: ttft.context("no content")?,
        last_token,
        content_chunks,
        completion_tokens: usage.2,
        headers,
        text,
        prompt_tokens: usage.0,
        cached_tokens: usage.1,
        done,
        error_event,
    })
}

/// A streamed request a report kept: what [`Answers::of`] reads of it.
pub trait Sampled {
    /// Time to the first content chunk (`None`: it failed).
    fn ttft(&self) -> Option<Duration>;
    /// Its prompt tokens and, of those, the ones the engine found cached
    /// (`(0, 0)` where the report does not keep them).
    fn tokens(&self) -> (u64, u64) {
        (0, 0)
    }
}

/// What a set of streamed requests came to.
#[derive(Debug, Clone, Default)]
pub struct Answers {
    /// Requests in the set, answered or not.
    pub sent: usize,
    /// TTFTs of the answered ones, ms, ascending.
    pub ttfts_ms: Vec<f64>,
    /// Prompt tokens of the answered ones.
    pub prompt_tokens: u64,
    /// Of those, the ones the engines found cached.
    pub cached_tokens: u64,
}

impl Answers {
    /// Folds `samples`.
    pub fn of<'a, S: Sampled + 'a>(samples: impl IntoIterator<Item = &'a S>) -> Self {
        let mut out = Answers::default();
        for s in samples {
            out.sent += 1;
            if let Some(t) = s.ttft() {
                out.ttfts_ms.push(t.as_secs_f64() * 1e3);
                let (prompt, cached) = s.tokens();
                out.prompt_tokens += prompt;
                out.cached_tokens += cached;
            }
        }
        output::sort(&mut out.ttfts_ms);
        out
    }

    /// Requests answered.
    pub fn answered(&self) -> usize {
        self.ttfts_ms.len()
    }

    /// Requests not answered.
    pub fn failed(&self) -> usize {
        self.sent - self.answered()
    }

    /// TTFT at quantile `q`, ms (0 when none was answered).
    pub fn ttft_ms(&self, q: f64) -> f64 {
        output::quantile(&self.ttfts_ms, q)
    }

    /// Answered requests whose TTFT was at most `ms`.
    pub fn within_ms(&self, ms: f64) -> usize {
        self.ttfts_ms.iter().filter(|t| **t <= ms).count()
    }

    /// Cached share of the answered requests' prompt tokens (0 without
    /// prompt tokens).
    pub fn cached_share(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct S(Option<u64>, u64, u64);

    impl Sampled for S {
        fn ttft(&self) -> Option<Duration> {
            self.0.map(Duration::from_millis)
        }
        fn tokens(&self) -> (u64, u64) {
            (self.1, self.2)
        }
    }

    #[test]
    fn answers_fold_the_answered_and_count_the_failed() {
        let samples = [S(Some(30), 100, 50), S(None, 7, 7), S(Some(10), 100, 0)];
        let a = Answers::of(&samples);
        assert_eq!((a.sent, a.answered(), a.failed()), (3, 2, 1));
        assert_eq!(a.ttfts_ms, [10.0, 30.0]);
        assert_eq!((a.prompt_tokens, a.cached_tokens), (200, 50));
        assert_eq!(a.cached_share(), 0.25);
        assert_eq!(a.ttft_ms(0.5), 10.0);
        assert_eq!(a.within_ms(10.0), 1);
        let none = Answers::of(&samples[1..2]);
        assert_eq!((none.cached_share(), none.ttft_ms(0.5)), (0.0, 0.0));
    }
}
