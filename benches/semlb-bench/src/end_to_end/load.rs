//! The load of a phase: conversations sent turn by turn (a turn's request
//! carries the history so far, and a conversation goes on only once its
//! previous turn was answered), either open-loop at scheduled arrival
//! times ([`open_loop`]) or from closed-loop clients ([`closed_loop`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use semlb_test_support::Rng;
use serde_json::json;

use super::client::{Outcome, stream_request};
use super::dialogue::Dialogue;
use super::{Arrivals, EndToEndArgs};

/// A conversation in progress.
#[derive(Debug, Clone)]
struct Conversation {
    dialogue: usize,
    /// The turn to send next.
    turn: usize,
    /// How many times the dataset was cycled before it started (keeps
    /// repeated conversations distinct).
    pass: usize,
}

/// The conversations: those waiting for their next turn, and where the
/// next new one starts.
#[derive(Debug)]
pub(super) struct Pool {
    dialogues: Arc<Vec<Dialogue>>,
    ready: VecDeque<Conversation>,
    next: usize,
}

impl Pool {
    pub(super) fn new(dialogues: Arc<Vec<Dialogue>>) -> Self {
        Self {
            dialogues,
            ready: VecDeque::new(),
            next: 0,
        }
    }

    /// The conversation to send a turn of: one whose previous turn has
    /// completed, else a new one.
    fn take(&mut self) -> Conversation {
        if let Some(c) = self.ready.pop_front() {
            return c;
        }
        let n = self.dialogues.len();
        let c = Conversation {
            dialogue: self.next % n,
            turn: 0,
            pass: self.next / n,
        };
        self.next += 1;
        c
    }

    /// `c`'s turn was answered: it may go on.
    fn answered(&mut self, mut c: Conversation) {
        c.turn += 1;
        if c.turn < self.dialogues[c.dialogue].turns.len() {
            self.ready.push_back(c);
        }
    }

    /// The request body of `c`'s current turn.
    fn body(&self, c: &Conversation, max_tokens: u32) -> Bytes {
        let d = &self.dialogues[c.dialogue];
        let mut messages = Vec::with_capacity(2 * c.turn + 1);
        for (i, (user, answer)) in d.turns[..=c.turn].iter().enumerate() {
            let user = if i == 0 && c.pass > 0 {
                format!("(session {}) {user}", c.pass)
            } else {
                user.clone()
            };
            messages.push(json!({"role": "user", "content": user}));
            if i < c.turn {
                messages.push(json!({"role": "assistant", "content": answer}));
            }
        }
        Bytes::from(
            json!({
                "model": "semlb-sim",
                "messages": messages,
                "max_tokens": max_tokens,
                "ignore_eos": true,
                "temperature": 0,
                "stream": true,
            })
            .to_string(),
        )
    }
}

/// One phase's outcomes and its duration.
#[derive(Debug, Default)]
pub(super) struct PhaseRun {
    /// Requests sent (open loop: scheduled).
    pub(super) sent: usize,
    pub(super) outcomes: Vec<Outcome>,
    /// From the first arrival to the last completion.
    pub(super) wall: Duration,
}

const CHAT: &str = "/v1/chat/completions";

/// One request before a phase, so that connections and caches exist: the
/// first turn of the first dialogue, tagged with a session no
/// conversation of the run has.
pub(super) async fn warm_up(
    http: &Client<HttpConnector, Full<Bytes>>,
    addr: &str,
    pool: &Mutex<Pool>,
    max_tokens: u32,
) -> Outcome {
    let body = pool.lock().unwrap_or_else(|e| e.into_inner()).body(
        &Conversation {
            dialogue: 0,
            turn: 0,
            pass: usize::MAX / 2,
        },
        max_tokens,
    );
    stream_request(http, addr, CHAT, body, Instant::now()).await
}

/// Open loop: `rate` arrivals per second for `secs`.
pub(super) async fn open_loop(
    http: Client<HttpConnector, Full<Bytes>>,
    addr: String,
    pool: Arc<Mutex<Pool>>,
    args: EndToEndArgs,
) -> PhaseRun {
    let mut rng = Rng::from_seed(args.seed);
    let start = Instant::now();
    let mut at = 0.0f64;
    let mut tasks = Vec::new();
    loop {
        at += match args.arrivals {
            Arrivals::Poisson => -rng.unit().ln() / args.rate,
            Arrivals::Fixed => 1.0 / args.rate,
        };
        if at >= args.secs {
            break;
        }
        let due = start + Duration::from_secs_f64(at);
        tokio::time::sleep_until(due.into()).await;
        let (conversation, body) = {
            let mut p = pool.lock().unwrap_or_else(|e| e.into_inner());
            let c = p.take();
            let body = p.body(&c, args.max_tokens);
            (c, body)
        };
        let (http, addr, pool) = (http.clone(), addr.clone(), pool.clone());
        tasks.push(tokio::spawn(async move {
            let outcome = stream_request(&http, &addr, CHAT, body, due).await;
            if outcome.ok() {
                pool.lock().unwrap_or_else(|e| e.into_inner()).answered(conversation);
            }
            outcome
        }));
    }
    let sent = tasks.len();
    let mut outcomes = Vec::with_capacity(sent);
    for t in tasks {
        if let Ok(o) = t.await {
            outcomes.push(o);
        }
    }
    PhaseRun {
        sent,
        outcomes,
        wall: start.elapsed(),
    }
}

/// Closed loop: `concurrency` clients for `secs`.
pub(super) async fn closed_loop(
    http: Client<HttpConnector, Full<Bytes>>,
    addr: String,
    pool: Arc<Mutex<Pool>>,
    args: EndToEndArgs,
) -> PhaseRun {
    let start = Instant::now();
    let stop = start + Duration::from_secs_f64(args.saturation_secs);
    let clients: Vec<_> = (0..args.concurrency)
        .map(|_| {
            let (http, addr, pool) = (http.clone(), addr.clone(), pool.clone());
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                while Instant::now() < stop {
                    let (conversation, body) = {
                        let mut p = pool.lock().unwrap_or_else(|e| e.into_inner());
                        let c = p.take();
                        let body = p.body(&c, args.max_tokens);
                        (c, body)
                    };
                    let outcome = stream_request(&http, &addr, CHAT, body, Instant::now()).await;
                    if outcome.ok() {
                        pool.lock().unwrap_or_else(|e| e.into_inner()).answered(conversation);
                    }
                    outcomes.push(outcome);
                }
                outcomes
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for c in clients {
        if let Ok(o) = c.await {
            outcomes.extend(o);
        }
    }
    PhaseRun {
        sent: outcomes.len(),
        outcomes,
        wall: start.elapsed(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;
    use crate::end_to_end::dialogue::parse_dialogue;

    #[test]
    fn turns_build_on_the_history_and_conversations_continue_after_answers() {
        let d = parse_dialogue("\n\nHuman: A\n\nAssistant: B\n\nHuman: C\n\nAssistant: D");
        let mut pool = Pool::new(Arc::new(vec![d]));
        let c = pool.take();
        let first: Value = serde_json::from_slice(&pool.body(&c, 8)).unwrap();
        assert_eq!(first["messages"].as_array().unwrap().len(), 1);
        assert_eq!(first["stream"], true);
        pool.answered(c);
        let c = pool.take();
        assert_eq!(c.turn, 1);
        let second: Value = serde_json::from_slice(&pool.body(&c, 8)).unwrap();
        let m = second["messages"].as_array().unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(
            (m[1]["content"].as_str(), m[2]["content"].as_str()),
            (Some("B"), Some("C"))
        );
        pool.answered(c);
        // Finished: a new pass of the dataset, distinct from the first.
        let c = pool.take();
        assert_eq!((c.turn, c.pass), (0, 1));
        let again: Value = serde_json::from_slice(&pool.body(&c, 8)).unwrap();
        assert_ne!(again["messages"][0], first["messages"][0]);
    }

    #[test]
    fn splitmix_is_deterministic_and_unit_is_in_range() {
        let (mut a, mut b) = (Rng::from_seed(7), Rng::from_seed(7));
        for _ in 0..1000 {
            let u = a.unit();
            assert!(u > 0.0 && u <= 1.0);
            assert_eq!(u, b.unit());
        }
    }
}
