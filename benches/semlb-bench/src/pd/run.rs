//! Sends the workloads through a fleet's gateway as streaming clients
//! ([`crate::sse_client::stream`]) and keeps what each request came to
//! ([`Sample`]), converted to simulated time.
//!
//! Interference requests are open loop: each is sent at its arrival time,
//! whatever the others do, and cancelled (its connection dropped, which
//! cancels both legs at the gateway) if it has not ended `--drain-secs`
//! after the load point's last arrival: such a request has missed the SLO
//! whatever its figures would have been. A conversation's turns are sent
//! one after the other, each after the last answer and a think time; a
//! turn that takes longer than `--drain-secs` is cancelled and ends its
//! conversation.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::args::PdArgs;
use super::workload::{Conversation, Single, Texts, chat_body};
use crate::end_to_end::parse_dispatch;
use crate::sse_client::{Answer, Sampled, stream};

/// The header the simulator takes an answer's length from.
const OUTPUT_TOKENS_HEADER: &str = "x-semlb-output-tokens";

/// How the gateway served a request, from its `x-semlb-prefill` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Path {
    /// Split: a prefill engine, then the decode engine (the header names
    /// the prefill engine).
    Split,
    /// The decode engine held the prompt: prefill skipped (`bypass`).
    Bypass,
    /// One engine alone, no header: an aggregated engine, or a decode
    /// engine for another reason (a failed prefill, ...).
    Alone,
}

/// What one request came to, in simulated time.
#[derive(Debug, Clone)]
pub(super) struct Sample {
    /// Its turn in its conversation (0: the first; interference requests
    /// are all 0).
    pub turn: usize,
    /// Time to the first token (`None`: failed or cancelled).
    pub ttft: Option<Duration>,
    /// Time per output token after the first: (last token − first token)
    /// / (tokens − 1); `None` with fewer than two tokens.
    pub tpot: Option<Duration>,
    /// How the gateway served it.
    pub path: Option<Path>,
    /// Prompt tokens, as the engine's usage says.
    pub prompt_tokens: u64,
    /// Of those, the ones its (decode) engine held or pulled.
    pub cached_tokens: u64,
    /// The gateway's own time from the request to sending its first leg
    /// (`x-semlb-dispatch-ns`, its `total`: parse, tokenize, lookups,
    /// choice), real time.
    pub dispatch: Option<Duration>,
    /// Why it failed, if it did (`cancelled` when it was cut).
    pub error: Option<String>,
}

impl Sampled for Sample {
    fn ttft(&self) -> Option<Duration> {
        self.ttft
    }
    fn tokens(&self) -> (u64, u64) {
        (self.prompt_tokens, self.cached_tokens)
    }
}

/// The error of a request cut at its deadline.
pub(super) const CANCELLED: &str = "cancelled";

impl Sample {
    /// What `answer` (`None`: cancelled) of turn `turn` came to, its real
    /// durations divided by `time_scale`.
    fn of(turn: usize, answer: Option<Result<Answer>>, time_scale: f64) -> Self {
        let failed = |error: String| Sample {
            turn,
            ttft: None,
            tpot: None,
            path: None,
            prompt_tokens: 0,
            cached_tokens: 0,
            dispatch: None,
            error: Some(error),
        };
        let a = match answer {
            None => return failed(CANCELLED.to_owned()),
            Some(Err(e)) => return failed(format!("{e:#}")),
            Some(Ok(a)) => a,
        };
        let sim = |d: Duration| d.div_f64(time_scale);
        let tokens = if a.completion_tokens > 0 {
            a.completion_tokens
        } else {
            a.content_chunks
        };
        let tpot = (tokens > 1).then(|| sim(a.last_token - a.ttft).div_f64((tokens - 1) as f64));
        let header = |name: &str| a.headers.get(name).map(|v| v.to_str().unwrap_or(""));
        let dispatch = header("x-semlb-dispatch-ns")
            .and_then(parse_dispatch)
            .map(|stages| Duration::from_nanos(stages[6]));
        let path = match header("x-semlb-prefill") {
            Some("bypass") => Path::Bypass,
            Some(_) => Path::Split,
            None => Path::Alone,
        };
        Sample {
            turn,
            ttft: Some(sim(a.ttft)),
            tpot,
            path: Some(path),
            prompt_tokens: a.prompt_tokens,
            cached_tokens: a.cached_tokens,
            dispatch,
            error: None,
        }
    }
}

/// Real duration of `secs` simulated seconds.
fn real(secs: f64, time_scale: f64) -> Duration {
    Duration::from_secs_f64(secs * time_scale)
}

/// Streams `body` with an answer of `tokens` tokens, cancelled at
/// `deadline`.
async fn send(addr: SocketAddr, body: &Value, tokens: usize, deadline: Instant) -> Option<Result<Answer>> {
    let tokens = tokens.to_string();
    tokio::time::timeout_at(deadline, stream(addr, body, &[(OUTPUT_TOKENS_HEADER, &tokens)]))
        .await
        .ok()
}

/// Sends `requests` (one load point) to the gateway at `addr`, each at
/// its arrival time; every request's sample, in arrival order.
pub(super) fn interference(addr: SocketAddr, requests: &[Single], texts: &Texts, args: &PdArgs) -> Vec<Sample> {
    let runtime = crate::sse_client::runtime();
    let scale = args.time_scale;
    let max_tokens = args.output_tokens.max;
    runtime.block_on(async {
        let start = Instant::now();
        let deadline = start + real(args.window_secs + args.drain_secs, scale);
        let tasks: Vec<_> = requests
            .iter()
            .map(|r| {
                let (r, texts) = (*r, texts.clone());
                tokio::spawn(async move {
                    tokio::time::sleep_until(start + real(r.at_s, scale)).await;
                    let body = chat_body(&r.messages(&texts), max_tokens);
                    Sample::of(0, send(addr, &body, r.output_tokens, deadline).await, scale)
                })
            })
            .collect();
        let mut samples = Vec::with_capacity(tasks.len());
        for t in tasks {
            samples.push(t.await.unwrap_or_else(|e| Sample::of(0, Some(Err(e.into())), scale)));
        }
        samples
    })
}

/// Runs `conversations` through the gateway at `addr`, each from its
/// arrival time, turn after turn; every turn's sample.
pub(super) fn conversations(
    addr: SocketAddr,
    conversations: &[Conversation],
    texts: &Texts,
    args: &PdArgs,
) -> Vec<Sample> {
    let runtime = crate::sse_client::runtime();
    let samples = Arc::new(Mutex::new(Vec::new()));
    let (scale, turn_limit) = (args.conv_time_scale, real(args.drain_secs, args.conv_time_scale));
    let (max_tokens, question_tokens) = (args.turn_output_tokens.max, args.question_tokens);
    runtime.block_on(async {
        let start = Instant::now();
        let tasks: Vec<_> = conversations
            .iter()
            .map(|c| {
                let (c, texts, samples) = (c.clone(), texts.clone(), samples.clone());
                tokio::spawn(async move {
                    tokio::time::sleep_until(start + real(c.at_s, scale)).await;
                    let mut messages = vec![c.opening(&texts)];
                    for (turn, output) in c.outputs.iter().enumerate() {
                        if turn > 0 {
                            tokio::time::sleep(real(c.thinks_s[turn - 1], scale)).await;
                            messages.push(c.question(&texts, turn, question_tokens));
                        }
                        let body = chat_body(&messages, max_tokens);
                        let answer = send(addr, &body, *output, Instant::now() + turn_limit).await;
                        let text = answer.as_ref().and_then(|a| a.as_ref().ok()).map(|a| a.text.clone());
                        let sample = Sample::of(turn, answer, scale);
                        samples.lock().unwrap_or_else(|p| p.into_inner()).push(sample);
                        let Some(text) = text else { break };
                        messages.push(json!({"role": "assistant", "content": text}));
                    }
                })
            })
            .collect();
        for t in tasks {
            let _ = t.await;
        }
    });
    samples.lock().unwrap_or_else(|p| p.into_inner()).clone()
}
