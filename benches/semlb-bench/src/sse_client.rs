//! A streaming client of the gateway for the reports that drive it as
//! agents do: one request on a fresh connection, its event stream read to
//! the end, with the time to the first content chunk and the engine's
//! usage.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// A streamed answer as the client saw it.
pub struct Answer {
    /// Time to the first content chunk.
    pub ttft: Duration,
    /// The answer's text.
    pub text: String,
    /// The prompt's tokens, as the engine's usage says.
    pub prompt_tokens: u64,
    /// Those the engine found cached.
    pub cached_tokens: u64,
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
    let mut body = response.into_body();
    let (mut buf, mut text, mut ttft, mut usage) = (Vec::new(), String::new(), None, (0, 0));
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else { continue };
        buf.extend_from_slice(&data);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(v) = line
                    .strip_prefix("data: ")
                    .and_then(|d| serde_json::from_str::<Value>(d).ok())
                else {
                    continue;
                };
                if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
                    ttft.get_or_insert_with(|| sent.elapsed());
                    text.push_str(t);
                }
                if let Some(p) = v["usage"]["prompt_tokens"].as_u64() {
                    usage = (
                        p,
                        v["usage"]["prompt_tokens_details"]["cached_tokens"]
                            .as_u64()
                            .unwrap_or(0),
                    );
                }
            }
        }
    }
    Ok(Answer {
        ttft: ttft.context("no content")?,
        text,
        prompt_tokens: usage.0,
        cached_tokens: usage.1,
    })
}
