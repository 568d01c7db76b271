//! Sending a closed-loop workload (`agents`): every session is a task that
//! starts at its scheduled time and sends its calls one after the other,
//! each the instant the previous stream ends, with the engine's answer
//! appended to the session's messages (see [`crate::workload::agents`]).
//!
//! A call's times are measured from when it is sent: in a closed loop
//! that is when the client would send it, so there is no schedule to fall
//! behind within a session. Session starts are open-loop (sent at their
//! scheduled times whatever the engines do); their lag is what the report's
//! generator lag shows.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use semlb::answer::{AnswerForm, answer_text};
use serde_json::{Value, json};

use crate::end_to_end::{Outcome, stream_request_with};
use crate::output;
use crate::workload::{SESSION_HEADER, Workload};

/// Per request: its outcome and output tokens; the real seconds from the
/// first session's start to the last completion; the start lag (ms): p99,
/// max.
pub(super) type Sent = (Vec<(Outcome, u32)>, f64, [f64; 2]);

/// One call's chat body: the session's `messages`, streamed, exactly
/// `max_tokens` tokens, never from the response cache (`temperature` 1).
fn chat_body(messages: &[Value], max_tokens: u32) -> Bytes {
    let body = json!({
        "model": "semlb-sim",
        "stream": true,
        "ignore_eos": true,
        "temperature": 1.0,
        "max_tokens": max_tokens,
        "messages": messages,
    });
    Bytes::from(serde_json::to_vec(&body).expect("JSON"))
}

/// Sends `workload`'s sessions to `addr`; `real_s` maps a trace time to
/// real seconds after the start. Calls still running `drain` after the last
/// session's start count as errors, and so do the calls a failed call
/// leaves unsent.
pub(super) async fn send(
    workload: Arc<Workload>,
    http: Client<HttpConnector, Full<Bytes>>,
    addr: String,
    real_s: impl Fn(f64) -> f64,
    drain: Duration,
    progress: indicatif::ProgressBar,
) -> Sent {
    // Each session's requests (indices into the workload), in step order.
    let mut sessions: Vec<Vec<usize>> = Vec::new();
    let mut index: HashMap<u64, usize> = HashMap::new();
    for (i, r) in workload.requests.iter().enumerate() {
        let key = r.session.unwrap_or(i as u64);
        let s = *index.entry(key).or_insert_with(|| {
            sessions.push(Vec::new());
            sessions.len() - 1
        });
        sessions[s].push(i);
    }
    let start = Instant::now() + Duration::from_millis(50);
    let mut lags = Vec::with_capacity(sessions.len());
    let mut tasks = Vec::with_capacity(sessions.len());
    let mut last_start = start;
    for calls in sessions {
        let first = &workload.requests[calls[0]];
        let due = start + Duration::from_secs_f64(real_s(first.at_s));
        tokio::time::sleep_until(due.into()).await;
        lags.push(due.elapsed().as_secs_f64() * 1e3);
        last_start = due;
        let (workload, http, addr, progress) = (workload.clone(), http.clone(), addr.clone(), progress.clone());
        tasks.push(tokio::spawn(async move {
            run_session(&workload, &calls, &http, &addr, start, &progress).await
        }));
    }
    let deadline = tokio::time::Instant::from_std(last_start) + drain;
    let mut outcomes: Vec<Option<(Outcome, u32)>> = vec![None; workload.requests.len()];
    let mut wall: f64 = 0.0;
    for t in tasks {
        let abort = t.abort_handle();
        match tokio::time::timeout_at(deadline, t).await {
            Ok(Ok(done)) => {
                for (i, outcome, tokens, finished_s) in done {
                    if outcome.ok() {
                        wall = wall.max(finished_s);
                    }
                    outcomes[i] = Some((outcome, tokens));
                }
            }
            Ok(Err(_)) | Err(_) => abort.abort(),
        }
    }
    let outcomes = outcomes
        .into_iter()
        .map(|o| {
            o.unwrap_or_else(|| {
                let error = Some("unsent or unfinished at the end of the drain time".to_owned());
                (
                    Outcome {
                        error,
                        ..Outcome::default()
                    },
                    0,
                )
            })
        })
        .collect();
    output::sort(&mut lags);
    (
        outcomes,
        wall,
        [output::quantile(&lags, 0.99), lags.last().copied().unwrap_or(0.0)],
    )
}

/// One session's calls in order; per call sent: its request index, outcome,
/// output tokens and the real seconds from `start` to its end. Stops at the
/// first failed call (the next calls would need its answer).
async fn run_session(
    workload: &Workload,
    calls: &[usize],
    http: &Client<HttpConnector, Full<Bytes>>,
    addr: &str,
    start: Instant,
    progress: &indicatif::ProgressBar,
) -> Vec<(usize, Outcome, u32, f64)> {
    let mut done = Vec::with_capacity(calls.len());
    let mut messages: Vec<Value> = Vec::new();
    let mut stream = Vec::new();
    for &i in calls {
        let r = &workload.requests[i];
        let Some(call) = &r.agent else { break };
        if messages.is_empty() {
            messages.push(json!({"role": "system", "content": workload.systems[call.system]}));
        }
        messages.push(json!({"role": "user", "content": call.message}));
        let headers: Vec<(&str, String)> = r.session.map(|s| (SESSION_HEADER, s.to_string())).into_iter().collect();
        stream.clear();
        let sent = Instant::now();
        let outcome = stream_request_with(
            http,
            addr,
            "/v1/chat/completions",
            chat_body(&messages, r.output_tokens),
            &headers,
            sent,
            Some(&mut stream),
        )
        .await;
        progress.inc(1);
        let ok = outcome.ok();
        let finished = (sent + outcome.latency).duration_since(start).as_secs_f64();
        done.push((i, outcome, r.output_tokens, finished));
        let answer = answer_text(AnswerForm::EventStream, &stream).map(|(text, _)| text);
        match answer {
            Some(text) if ok => messages.push(json!({"role": "assistant", "content": text})),
            _ => break,
        }
    }
    done
}
