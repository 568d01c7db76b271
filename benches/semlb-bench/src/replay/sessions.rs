//! Sending a workload of chat sessions (`agents`, `chat`): each session
//! sends its calls one after the other, each the instant the previous
//! answer ends, with the engine's answer appended to the session's
//! messages (see [`crate::workload::agents`], [`crate::workload::chat`]).
//!
//! Sessions start one of two ways:
//!
//! * **Scheduled** (`agents`): every session is a task that starts at its
//!   scheduled time, open-loop, whatever the engines do; the start lag is
//!   what the report's generator lag shows.
//! * **Clients** (`chat`): a fixed number of clients take sessions in
//!   order, each starting the next the instant its last ends, so the
//!   requests in flight stay at the number of clients (a closed loop).
//!
//! An `agents` workload with a tool-calling API (`--agents-api
//! chat-tools|responses|messages`, [`crate::workload::agent_api`]) sends
//! each call with the tools and the whole conversation in that API, the
//! engine's answer (a tool call or text) added to it, then the call's
//! message as the tool call's result or as the next user message; each
//! outcome keeps the usage its answer reported (prompt and cached tokens).
//!
//! A call's times are measured from when it is sent: in a closed loop
//! that is when the client would send it, so there is no schedule to fall
//! behind within a session. Answers are streamed or not (`stream`); one
//! that is not is read whole, its TTFT being its latency.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use semlb::openai::answer::{AnswerForm, answer_text};
use serde_json::{Value, json};
use tokio::sync::Notify;

use crate::end_to_end::{Outcome, request_with};
use crate::output;
use crate::workload::agent_api::{Reading, Turn};
use crate::workload::{SESSION_HEADER, Workload};

/// What a workload's sending did.
#[derive(Debug)]
pub(super) struct Sent {
    /// Per request, in the workload's order: its outcome and output tokens.
    pub(super) outcomes: Vec<(Outcome, u32)>,
    /// Real seconds from the start to the last completion.
    pub(super) wall_s: f64,
    /// The start lag (ms): p99, max.
    pub(super) lag_ms: [f64; 2],
    /// Per request: real seconds from `t0` to its end (`None`: never sent).
    pub(super) finished_s: Vec<Option<f64>>,
    /// The instant times are measured from.
    pub(super) t0: Instant,
}

/// How sessions start.
#[derive(Debug, Clone, Copy)]
pub(super) enum Start {
    /// Each at its scheduled time.
    Scheduled,
    /// This many clients, each starting the next session when its last
    /// ends.
    Clients(usize),
}

/// Where and how calls are sent.
#[derive(Clone)]
pub(super) struct Sender {
    /// The pooled client.
    pub(super) http: Client<HttpConnector, Full<Bytes>>,
    /// The gateway's address.
    pub(super) addr: String,
    /// Whether answers are streamed.
    pub(super) stream: bool,
    /// Advanced once per call answered.
    pub(super) progress: indicatif::ProgressBar,
    /// Pin each session to one of this many engine slots: its calls carry
    /// llama.cpp's `id_slot` = the session's number modulo it.
    pub(super) pin_slots: Option<u32>,
    /// Counts the calls answered (for a run that acts once some are).
    pub(super) answered: Option<Arc<AtomicUsize>>,
}

/// Per call sent: its request index, outcome, output tokens and the real
/// seconds from the start to its end.
type Done = Vec<(usize, Outcome, u32, f64)>;

/// One call's chat body: the session's `messages`, streamed or not, exactly
/// `max_tokens` tokens, never from the response cache (`temperature` 1),
/// in engine slot `id_slot` if given.
fn chat_body(messages: &[Value], max_tokens: u32, stream: bool, id_slot: Option<u32>) -> Bytes {
    let mut body = json!({
        "model": "semlb-sim",
        "stream": stream,
        "ignore_eos": true,
        "temperature": 1.0,
        "max_tokens": max_tokens,
        "messages": messages,
    });
    if let Some(slot) = id_slot {
        body["id_slot"] = slot.into();
    }
    Bytes::from(serde_json::to_vec(&body).expect("JSON"))
}

/// `workload`'s sessions: each one's request indices, in step order, in
/// the order of their first request.
fn sessions_of(workload: &Workload) -> Vec<Vec<usize>> {
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
    sessions
}

/// Sends `workload`'s sessions through `sender`, started as `start` says;
/// `real_s` maps a trace time to real seconds after the start. Calls
/// still running `drain` after the last session started count as errors,
/// and so do the calls a failed call leaves unsent.
pub(super) async fn send(
    workload: Arc<Workload>,
    sender: Sender,
    start: Start,
    real_s: impl Fn(f64) -> f64,
    drain: Duration,
) -> Sent {
    let sessions = sessions_of(&workload);
    let t0 = Instant::now() + Duration::from_millis(50);
    let mut finished_s = vec![None; workload.requests.len()];
    let (done, lags) = match start {
        Start::Scheduled => scheduled(&workload, sessions, &sender, t0, real_s, drain).await,
        Start::Clients(n) => (clients(&workload, sessions, &sender, t0, n, drain).await, Vec::new()),
    };
    let mut outcomes: Vec<Option<(Outcome, u32)>> = vec![None; workload.requests.len()];
    let mut wall: f64 = 0.0;
    for (i, outcome, tokens, finished) in done.into_iter().flatten() {
        if outcome.ok() {
            wall = wall.max(finished);
        }
        outcomes[i] = Some((outcome, tokens));
        finished_s[i] = Some(finished);
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
    let mut lags = lags;
    output::sort(&mut lags);
    Sent {
        outcomes,
        wall_s: wall,
        lag_ms: [output::quantile(&lags, 0.99), lags.last().copied().unwrap_or(0.0)],
        finished_s,
        t0,
    }
}

/// Every session a task of its own, started at its scheduled time; what
/// each did, and the start lags (ms).
async fn scheduled(
    workload: &Arc<Workload>,
    sessions: Vec<Vec<usize>>,
    sender: &Sender,
    t0: Instant,
    real_s: impl Fn(f64) -> f64,
    drain: Duration,
) -> (Vec<Done>, Vec<f64>) {
    let mut lags = Vec::with_capacity(sessions.len());
    let mut tasks = Vec::with_capacity(sessions.len());
    let mut last_start = t0;
    for calls in sessions {
        let first = &workload.requests[calls[0]];
        let due = t0 + Duration::from_secs_f64(real_s(first.at_s));
        tokio::time::sleep_until(due.into()).await;
        lags.push(due.elapsed().as_secs_f64() * 1e3);
        last_start = due;
        let (workload, sender) = (workload.clone(), sender.clone());
        tasks.push(tokio::spawn(async move {
            run_session(&workload, &calls, &sender, t0).await
        }));
    }
    let deadline = tokio::time::Instant::from_std(last_start) + drain;
    let mut done = Vec::with_capacity(tasks.len());
    for t in tasks {
        let abort = t.abort_handle();
        match tokio::time::timeout_at(deadline, t).await {
            Ok(Ok(d)) => done.push(d),
            Ok(Err(_)) | Err(_) => abort.abort(),
        }
    }
    (done, lags)
}

/// `n` clients taking `sessions` in order, each the instant its last one
/// ends; what each did.
async fn clients(
    workload: &Arc<Workload>,
    sessions: Vec<Vec<usize>>,
    sender: &Sender,
    t0: Instant,
    n: usize,
    drain: Duration,
) -> Vec<Done> {
    let sessions = Arc::new(sessions);
    let next = Arc::new(AtomicUsize::new(0));
    let all_taken = Arc::new(Notify::new());
    tokio::time::sleep_until(t0.into()).await;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n.max(1) {
        let (workload, sessions, next, all_taken, sender) = (
            workload.clone(),
            sessions.clone(),
            next.clone(),
            all_taken.clone(),
            sender.clone(),
        );
        tasks.spawn(async move {
            let mut done = Vec::new();
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k + 1 >= sessions.len() {
                    all_taken.notify_one();
                }
                let Some(calls) = sessions.get(k) else { break };
                done.extend(run_session(&workload, calls, &sender, t0).await);
            }
            done
        });
    }
    let mut done = Vec::with_capacity(n);
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            joined = tasks.join_next() => match joined {
                Some(Ok(d)) => done.push(d),
                Some(Err(_)) => {}
                None => break,
            },
            () = all_taken.notified(), if deadline.is_none() => {
                deadline = Some(tokio::time::Instant::now() + drain);
            }
            () = tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)), if deadline.is_some() => {
                tasks.abort_all();
                break;
            }
        }
    }
    done
}

/// One session's calls in order. Stops at the first failed call (the next
/// calls would need its answer).
async fn run_session(workload: &Workload, calls: &[usize], sender: &Sender, t0: Instant) -> Done {
    if workload.api.tools() {
        return run_tool_session(workload, calls, sender, t0).await;
    }
    let mut done = Vec::with_capacity(calls.len());
    let mut messages: Vec<Value> = Vec::new();
    let mut answer = Vec::new();
    let form = if sender.stream {
        AnswerForm::EventStream
    } else {
        AnswerForm::Json
    };
    let id_slot = sender.pin_slots.filter(|n| *n > 0).map(|n| {
        let session = calls.first().and_then(|&i| workload.requests[i].session).unwrap_or(0);
        (session % u64::from(n)) as u32
    });
    for &i in calls {
        let r = &workload.requests[i];
        let Some(call) = &r.chat else { break };
        if messages.is_empty() {
            messages.push(json!({"role": "system", "content": workload.systems[call.system]}));
        }
        messages.push(json!({"role": "user", "content": call.message}));
        let headers: Vec<(&str, String)> = r
            .session
            .filter(|_| workload.kind.sends_session_ids())
            .map(|s| (SESSION_HEADER, s.to_string()))
            .into_iter()
            .collect();
        answer.clear();
        let sent = Instant::now();
        let outcome = request_with(
            &sender.http,
            &sender.addr,
            "/v1/chat/completions",
            chat_body(&messages, r.output_tokens, sender.stream, id_slot),
            &headers,
            sent,
            Some(&mut answer),
        )
        .await;
        sender.progress.inc(1);
        if let Some(answered) = &sender.answered {
            answered.fetch_add(1, Ordering::Relaxed);
        }
        let ok = outcome.ok();
        let finished = (sent + outcome.latency).duration_since(t0).as_secs_f64();
        done.push((i, outcome, r.output_tokens, finished));
        match answer_text(form, &answer).map(|(text, _)| text) {
            Some(text) if ok => messages.push(json!({"role": "assistant", "content": text})),
            _ => break,
        }
    }
    done
}

/// The turn a call of a tool-calling session adds after `previous` (the
/// engine's last answer; `None` for the first call): the result of the
/// engine's tool call, else a user message; its text is the call's
/// message either way.
fn next_turn(previous: Option<&Turn>, message: &str) -> Turn {
    match previous {
        Some(Turn::Call { id, .. }) => Turn::Result {
            id: id.clone(),
            output: message.to_owned(),
        },
        _ => Turn::User(message.to_owned()),
    }
}

/// One tool-calling session's calls in order, in `workload.api`
/// ([`crate::workload::agent_api`]): every call carries the tools and the
/// whole conversation; the engine's answer (a tool call or text) is added
/// to it, then the call's message as that call's result or as the next
/// user message. Each outcome carries the usage its answer reported.
/// Stops at the first failed call or an answer it cannot read.
async fn run_tool_session(workload: &Workload, calls: &[usize], sender: &Sender, t0: Instant) -> Done {
    let api = workload.api;
    let mut done = Vec::with_capacity(calls.len());
    let mut turns: Vec<Turn> = Vec::new();
    let mut answer = Vec::new();
    let mut system = "";
    for &i in calls {
        let r = &workload.requests[i];
        let Some(call) = &r.chat else { break };
        if turns.is_empty() {
            system = &workload.systems[call.system];
        }
        let turn = next_turn(turns.last(), &call.message);
        turns.push(turn);
        let headers: Vec<(&str, String)> = r
            .session
            .filter(|_| workload.kind.sends_session_ids())
            .map(|s| (SESSION_HEADER, s.to_string()))
            .into_iter()
            .collect();
        let body =
            Bytes::from(serde_json::to_vec(&api.body(system, &turns, r.output_tokens, sender.stream)).expect("JSON"));
        answer.clear();
        let sent = Instant::now();
        let mut outcome = request_with(
            &sender.http,
            &sender.addr,
            api.path(),
            body,
            &headers,
            sent,
            Some(&mut answer),
        )
        .await;
        sender.progress.inc(1);
        if let Some(answered) = &sender.answered {
            answered.fetch_add(1, Ordering::Relaxed);
        }
        let reading = if outcome.ok() {
            api.read(&answer, sender.stream)
        } else {
            Reading::default()
        };
        outcome.usage = reading.usage;
        if outcome.ok() && reading.turn.is_none() {
            outcome.error = Some(format!(
                "an answer the client cannot read as a {} answer: {}",
                api.name(),
                String::from_utf8_lossy(&answer[..answer.len().min(300)])
            ));
        }
        let ok = outcome.ok();
        let finished = (sent + outcome.latency).duration_since(t0).as_secs_f64();
        done.push((i, outcome, r.output_tokens, finished));
        match reading.turn {
            Some(turn) if ok => turns.push(turn),
            _ => break,
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::chat::{self, ChatParams};

    #[test]
    fn sessions_keep_their_calls_in_order() {
        let w = chat::build(&ChatParams {
            conversations: 30,
            max_output: 64,
            seed: 1,
            shape: chat::ChatShape::default(),
        });
        let sessions = sessions_of(&w);
        assert_eq!(sessions.len(), 30);
        assert_eq!(sessions.iter().map(Vec::len).sum::<usize>(), w.requests.len());
        for calls in &sessions {
            let steps: Vec<u32> = calls
                .iter()
                .map(|i| w.requests[*i].chat.as_ref().unwrap().step)
                .collect();
            assert_eq!(steps, (0..calls.len() as u32).collect::<Vec<_>>());
        }
        let body: Value =
            serde_json::from_slice(&chat_body(&[json!({"role": "user", "content": "hi"})], 7, false, None)).unwrap();
        assert_eq!(
            (body["stream"].as_bool(), body["max_tokens"].as_u64()),
            (Some(false), Some(7))
        );
        assert!(body.get("id_slot").is_none());
        let pinned: Value = serde_json::from_slice(&chat_body(&[], 7, true, Some(1))).unwrap();
        assert_eq!(pinned["id_slot"], 1);
    }

    #[test]
    fn a_tool_call_is_answered_with_its_result_and_text_with_a_user_message() {
        assert_eq!(next_turn(None, "Task 1"), Turn::User("Task 1".into()));
        let call = Turn::Call {
            id: "call_7".into(),
            item: None,
            name: "run_query".into(),
            arguments: "{}".into(),
        };
        assert_eq!(
            next_turn(Some(&call), "Tool result 0"),
            Turn::Result {
                id: "call_7".into(),
                output: "Tool result 0".into()
            }
        );
        assert_eq!(
            next_turn(Some(&Turn::Assistant("ok".into())), "Tool result 1"),
            Turn::User("Tool result 1".into())
        );
    }
}
