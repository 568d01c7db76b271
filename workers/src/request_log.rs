//! The inference requests a simulator received, for tests to read back
//! (`GET /sim/requests`): the last [`CAPACITY`] of them, in arrival order,
//! each with its path, its body as received, its `x-request-id`, which
//! leg of disaggregated serving it was, and how it ended.
//!
//! A request is [`RequestLog::record`]ed once its body is read; the
//! returned [`Recorded`] handle travels with the response and says how it
//! ended: [`Recorded::complete`] when the answer went out whole,
//! [`Recorded::fail`] when the answer was an error (or was cut on
//! purpose), and, if the handle is dropped without either (the client
//! went away and hyper dropped the response), `aborted`.
//!
//! ```json
//! {"requests": [{"seq": 1, "path": "/v1/completions", "request_id": "r-1",
//!   "leg": "prefill", "body": {"prompt": "...", "max_tokens": 1},
//!   "outcome": "completed", "status": 200, "reason": null}]}
//! ```
//!
//! `outcome` is `running` until the request ends, then `completed`,
//! `aborted` or `failed` (with `status`, if an answer was sent, and
//! `reason`). A body that is not JSON is kept as a string, and a body
//! over [`MAX_KEPT_BODY`] bytes as the string `<N bytes, not kept>`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use serde::Serialize;
use serde_json::Value;

/// Requests kept: older ones are forgotten.
pub const CAPACITY: usize = 256;

/// Largest body kept (so that 256 huge prompts cannot hold gigabytes).
pub const MAX_KEPT_BODY: usize = 1 << 20;

/// Which leg of disaggregated serving a request was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LegKind {
    /// A plain request (no handoff).
    Plain,
    /// The prefill leg of a P/D pair.
    Prefill,
    /// The decode leg of a P/D pair.
    Decode,
}

/// How a request ended (so far).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// Not ended yet.
    Running,
    /// Answered in full.
    Completed,
    /// The client went away first.
    Aborted,
    /// Answered with an error, or cut.
    Failed,
}

/// One request as `/sim/requests` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Entry {
    /// Arrival number, from 1.
    pub seq: u64,
    /// The request path.
    pub path: String,
    /// Its `x-request-id` header, if any.
    pub request_id: Option<String>,
    /// Its leg.
    pub leg: LegKind,
    /// Its body as received (a string if it is not JSON).
    pub body: Value,
    /// How it ended.
    pub outcome: Outcome,
    /// The status answered, once known.
    pub status: Option<u16>,
    /// Why it failed (or was aborted), if it did.
    pub reason: Option<String>,
}

#[derive(Debug, Default)]
struct Log {
    next_seq: u64,
    entries: VecDeque<Entry>,
}

/// The last [`CAPACITY`] inference requests (share it behind an [`Arc`]).
#[derive(Debug, Default)]
pub struct RequestLog {
    log: Mutex<Log>,
}

impl RequestLog {
    /// An empty log.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn lock(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a request (a plain leg until [`Recorded::leg`] says
    /// otherwise); the handle says how it ends.
    pub fn record(self: &Arc<Self>, path: &str, request_id: Option<String>, body: &Bytes) -> Recorded {
        let body = if body.len() > MAX_KEPT_BODY {
            Value::String(format!("<{} bytes, not kept>", body.len()))
        } else {
            serde_json::from_slice(body).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into()))
        };
        let mut log = self.lock();
        log.next_seq += 1;
        let seq = log.next_seq;
        if log.entries.len() == CAPACITY {
            log.entries.pop_front();
        }
        log.entries.push_back(Entry {
            seq,
            path: path.to_owned(),
            request_id,
            leg: LegKind::Plain,
            body,
            outcome: Outcome::Running,
            status: None,
            reason: None,
        });
        Recorded {
            log: Arc::clone(self),
            seq,
            ended: false,
        }
    }

    /// The requests kept, oldest first.
    pub fn entries(&self) -> Vec<Entry> {
        self.lock().entries.iter().cloned().collect()
    }

    /// `GET /sim/requests`'s body.
    pub fn body(&self) -> Bytes {
        #[derive(Serialize)]
        struct Body<'a> {
            requests: &'a VecDeque<Entry>,
        }
        let log = self.lock();
        Bytes::from(serde_json::to_vec(&Body { requests: &log.entries }).unwrap_or_default())
    }

    fn update(&self, seq: u64, f: impl FnOnce(&mut Entry)) {
        let mut log = self.lock();
        // Entries are in seq order; a forgotten one is not found.
        if let Some(first) = log.entries.front().map(|e| e.seq)
            && let Some(entry) = seq
                .checked_sub(first)
                .and_then(|i| log.entries.get_mut(usize::try_from(i).ok()?))
        {
            f(entry);
        }
    }
}

/// One recorded request: says how it ended. Dropped without
/// [`complete`](Self::complete) or [`fail`](Self::fail), the request is
/// `aborted` (the client went away).
#[derive(Debug)]
pub struct Recorded {
    log: Arc<RequestLog>,
    seq: u64,
    ended: bool,
}

impl Recorded {
    /// Names its leg.
    pub fn leg(&self, leg: LegKind) {
        self.log.update(self.seq, |e| e.leg = leg);
    }

    /// It was answered in full with `status`.
    pub fn complete(mut self, status: u16) {
        self.end(Outcome::Completed, Some(status), None);
    }

    /// It was answered with an error (`status`, if an answer went out) or
    /// cut, for `reason`.
    pub fn fail(mut self, status: Option<u16>, reason: impl Into<String>) {
        self.end(Outcome::Failed, status, Some(reason.into()));
    }

    fn end(&mut self, outcome: Outcome, status: Option<u16>, reason: Option<String>) {
        self.ended = true;
        self.log.update(self.seq, |e| {
            e.outcome = outcome;
            e.status = status;
            e.reason = reason;
        });
    }
}

impl Drop for Recorded {
    fn drop(&mut self) {
        if !self.ended {
            self.end(Outcome::Aborted, None, Some("the client went away".into()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_say_how_each_request_ended() {
        let log = RequestLog::new();
        let a = log.record(
            "/v1/completions",
            Some("r-1".into()),
            &Bytes::from_static(b"{\"prompt\":\"x\"}"),
        );
        let b = log.record("/v1/chat/completions", None, &Bytes::from_static(b"not json"));
        let c = log.record("/v1/completions", None, &Bytes::new());
        let d = log.record("/v1/completions", None, &Bytes::from(vec![b' '; MAX_KEPT_BODY + 1]));
        a.leg(LegKind::Prefill);
        a.complete(200);
        b.fail(Some(400), "bad body");
        drop(c);
        let entries = log.entries();
        assert_eq!(entries.len(), 4);
        assert_eq!(entries[0].seq, 1);
        assert_eq!(entries[0].body, serde_json::json!({"prompt": "x"}));
        assert_eq!(entries[0].request_id.as_deref(), Some("r-1"));
        assert_eq!(
            (entries[0].leg, entries[0].outcome, entries[0].status),
            (LegKind::Prefill, Outcome::Completed, Some(200))
        );
        assert_eq!(entries[1].body, Value::String("not json".into()));
        assert_eq!(
            (entries[1].outcome, entries[1].reason.as_deref()),
            (Outcome::Failed, Some("bad body"))
        );
        assert_eq!(entries[2].outcome, Outcome::Aborted);
        assert_eq!(entries[3].outcome, Outcome::Running);
        assert_eq!(
            entries[3].body,
            Value::String(format!("<{} bytes, not kept>", MAX_KEPT_BODY + 1))
        );
        drop(d);
        let body: Value = serde_json::from_slice(&log.body()).unwrap();
        assert_eq!(body["requests"][3]["outcome"], "aborted");
        assert_eq!(body["requests"][0]["leg"], "prefill");
    }

    #[test]
    fn only_the_last_requests_are_kept() {
        let log = RequestLog::new();
        let first = log.record("/a", None, &Bytes::new());
        for _ in 0..CAPACITY {
            log.record("/b", None, &Bytes::new()).complete(200);
        }
        // The first one was forgotten: ending it changes nothing.
        first.complete(200);
        let entries = log.entries();
        assert_eq!(entries.len(), CAPACITY);
        assert_eq!(entries[0].seq, 2);
        assert!(entries.iter().all(|e| e.path == "/b"));
    }
}
