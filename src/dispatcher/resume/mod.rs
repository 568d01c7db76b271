//! An answer that survives its engine: a chat completions or completions
//! stream whose engine breaks after the client got part of the answer is
//! continued on another engine of its pool, and the client reads one
//! answer.
//!
//! A stream breaks when its connection is reset or closed before its
//! `data: [DONE]`, when the engine sends an error event (vLLM streams a
//! failure as `data: {"error": ...}`), or when nothing comes for
//! `resume.stall_ms` ([`Break`]). The relay ([`super::relay`]) then asks
//! its [`Resume`] for the next attempt:
//!
//! 1. what the client has is read from the events it was given
//!    ([`sent`]; the relay gives a client whole events only, so a break
//!    never leaves it inside one): the answer's `id`, `created`, `model`
//!    and its text so far;
//! 2. the request is sent again, to an engine of the same pool that has
//!    not failed this answer (after an error event, to the same engine
//!    first, once: it is alive and its cache holds the prompt and the
//!    text so far), with that text as the assistant's last
//!    message and `continue_final_message: true`,
//!    `add_generation_prompt: false` (vLLM, SGLang), or, for completions,
//!    appended to its prompt; and its output budget less the tokens
//!    already produced ([`request`]);
//! 3. the new stream is relayed as the continuation of the first
//!    ([`splice`]): the first answer's `id`, `created` and `model` in
//!    every chunk, no second opening chunk, and usage that counts the
//!    original prompt and all the output.
//!
//! Not resumed, and ended with an OpenAI error event then `data: [DONE]`
//! (never a stream that just stops): a request with `n` above 1,
//! `logprobs`, a completions prompt that is not one text, `echo` or a
//! `suffix`, or structured output (`response_format` with a schema,
//! vLLM's `guided_*`: a grammar's state cannot be given back to an
//! engine); a tool call already under way (its arguments are not text to
//! continue); `resume.enabled = false`; the attempts used up
//! (`resume.max_attempts`), or no other engine to take it. An answer whose
//! `finish_reason` had gone is whole: its stream is ended with
//! `data: [DONE]`.

mod events;
mod request;
mod sent;
mod splice;

pub(super) use request::{Attempt, Continuation, ResumedHead, Targets};

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use shm_layout::ServerRef;

use super::Dispatcher;
use crate::config::ResumeConfig;
use crate::metrics::ResumeOutcome;
use events::WholeEvents;
use sent::Sent;
use splice::Splice;

pub(super) use crate::metrics::StreamBreak as Break;

/// Why a request's stream may not be resumed, if it may not (see the
/// module docs): `body` is its parsed body, a chat completions one or
/// (`completions`) a completions one.
pub(super) fn blocked(body: &crate::openai::body::Object<'_>, completions: bool) -> Option<&'static str> {
    use crate::openai::body::Json;
    let number = |key: &str| body.get(key).and_then(Json::as_u64);
    if number("n").is_some_and(|n| n > 1) || number("best_of").is_some_and(|n| n > 1) {
        return Some("it asks for more than one choice (n)");
    }
    let logprobs = body
        .get("logprobs")
        .is_some_and(|v| v.as_bool() == Some(true) || v.as_u64().is_some());
    if logprobs || number("top_logprobs").is_some_and(|n| n > 0) {
        return Some("it asks for logprobs");
    }
    if completions {
        if body.get("prompt").is_none_or(|p| p.as_str().is_none()) {
            return Some("its prompt is not one text (token ids, or several prompts)");
        }
        if body.get("echo").and_then(Json::as_bool) == Some(true) {
            return Some("it asks for its prompt echoed");
        }
        if body.get("suffix").is_some_and(|v| !matches!(v, Json::Null)) {
            return Some("it has a suffix");
        }
    }
    let schema = body
        .get("response_format")
        .and_then(Json::as_object)
        .and_then(|f| f.get("type"))
        .and_then(Json::as_str)
        .is_some_and(|t| t != "text");
    let guided = [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    ]
    .iter()
    .any(|key| body.get(key).is_some_and(|v| !matches!(v, Json::Null)));
    if schema || guided {
        return Some("it asks for structured output (a grammar's state cannot be restored)");
    }
    None
}

/// What a chat stream's answer does when its engine breaks (see the
/// module docs).
pub(super) struct Resume {
    dispatcher: Arc<Dispatcher>,
    request: Continuation,
    /// Why it may not be resumed, if it may not.
    blocked: Option<&'static str>,
    whole: WholeEvents,
    sent: Sent,
    /// Rewrites the current attempt's events, after a resumption.
    splice: Option<Splice>,
    /// Resumptions so far.
    resumed: u32,
    /// Engines that failed this answer.
    failed: Vec<ServerRef>,
    /// Its pool's `[resume]` settings.
    config: ResumeConfig,
    /// `data: [DONE]` went to the client.
    done: bool,
    /// Why it broke last.
    last: Option<Break>,
    /// The engine of an error event was asked again (once an answer).
    asked_again: bool,
}

/// What became of a frame from the engine.
pub(super) enum Passed {
    /// Whole events for the client (none, while an event is incomplete).
    Events(Bytes),
    /// These events, then the engine's error event (kept from the client).
    Broke(Bytes),
}

impl std::fmt::Debug for Resume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resume")
            .field("blocked", &self.blocked)
            .field("resumed", &self.resumed)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl Resume {
    /// The resumption of an answer to `request` (`blocked`: why it may not
    /// be resumed).
    pub(super) fn new(dispatcher: Arc<Dispatcher>, request: Continuation, blocked: Option<&'static str>) -> Self {
        let global = &dispatcher.config().resume;
        let config = *request.pool.as_ref().map_or(global, |p| p.resume(global));
        let blocked = blocked.or((!config.enabled).then_some("resume.enabled is false"));
        Self {
            config,
            dispatcher,
            request,
            blocked,
            whole: WholeEvents::default(),
            sent: Sent::default(),
            splice: None,
            resumed: 0,
            failed: Vec::new(),
            done: false,
            last: None,
            asked_again: false,
        }
    }

    /// How long the stream may send nothing before it is broken.
    pub(super) fn stall(&self) -> Option<Duration> {
        self.config.stall()
    }

    /// `data: [DONE]` went to the client: the answer is over.
    pub(super) fn done(&self) -> bool {
        self.done
    }

    /// A frame from the engine, as the client is to get it.
    pub(super) fn pass(&mut self, data: Bytes) -> Passed {
        let whole = self.whole.feed(data);
        if whole.is_empty() {
            return Passed::Events(whole);
        }
        let (events, broke) = match error_at(&whole) {
            Some(at) => (whole.slice(..at), true),
            None => (whole, false),
        };
        let events = match &self.splice {
            Some(splice) => splice.rewrite(&events),
            None => events,
        };
        if events.trim_ascii_end().ends_with(b"data: [DONE]") {
            self.done = true;
        }
        if self.blocked.is_none() && !self.whole.overflow {
            self.sent.push(&events);
        }
        if broke {
            Passed::Broke(events)
        } else {
            Passed::Events(events)
        }
    }

    /// Whether the stream could move now if its engine stopped serving it
    /// (a drain): it may be resumed, is resumable as far as it went, has
    /// no tool call under way, has attempts left and has not finished. A
    /// stream that may not stays on its engine, which is still alive.
    pub(super) fn movable(&self) -> bool {
        let (summary, refusal) = self.assess();
        refusal.is_none() && summary.is_some_and(|s| !s.finished)
    }

    /// What the client has (`None` when it is not known: the stream may
    /// not be resumed, or its events outgrew the copy), and why the
    /// answer may not go on elsewhere, if it may not.
    fn assess(&self) -> (Option<sent::Summary>, Option<&'static str>) {
        let known = !self.sent.overflow && !self.whole.overflow;
        let summary = (self.blocked.is_none() && known).then(|| self.sent.summary());
        let refusal = match (&summary, self.blocked) {
            (_, Some(reason)) => Some(reason),
            (None, None) => Some("the answer is too long to resume"),
            (Some(s), None) if s.tool_call => Some("a tool call was under way"),
            (Some(_), None) if self.resumed >= self.config.max_attempts => {
                Some("its resumptions are used up (resume.max_attempts)")
            }
            _ => None,
        };
        (summary, refusal)
    }

    /// The stream broke (`why`) on `server`: the next attempt, under way
    /// until `deadline`, or the events that end the client's stream.
    pub(super) fn broke(
        &mut self,
        server: ServerRef,
        why: Break,
        deadline: tokio::time::Instant,
    ) -> Result<Attempt, Bytes> {
        self.whole.clear();
        // An engine that streamed an error event is alive, and its cache
        // holds the prompt and the text so far: asked first, once an
        // answer; any other break rules it out.
        let first = (why == Break::ErrorEvent && !self.asked_again).then_some(server);
        if first.is_some() {
            self.asked_again = true;
        } else {
            self.failed.push(server);
        }
        self.last = Some(why);
        let count = |outcome| self.dispatcher.metrics().stream_break(why, outcome);
        let (summary, not_resumed) = self.assess();
        if summary.as_ref().is_some_and(|s| s.finished) {
            // The client has the whole answer: only the stream's end is missing.
            count(ResumeOutcome::Whole);
            return Err(Bytes::from_static(b"data: [DONE]\n\n"));
        }
        if let Some(reason) = not_resumed {
            count(ResumeOutcome::NotResumed);
            tracing::warn!(
                reason = why.name(),
                resumed = self.resumed,
                "a stream broke ({}) after its first byte and is not resumed: {reason}",
                why.name()
            );
            return Err(error_end(&format!(
                "the inference server's stream broke ({}) and the answer could not be resumed: {reason}",
                why.name()
            )));
        }
        let summary = summary.unwrap_or_default();
        let carried = match &self.request.pool {
            Some(pool) => pool.tokenization().tokenizer.encode(&summary.text).len() as u64,
            None => u64::from(summary.chunks),
        };
        let Some(body) =
            request::continuation_body(&self.request.body, &summary.text, carried, self.request.completions)
        else {
            count(ResumeOutcome::NotResumed);
            return Err(error_end(
                "the inference server's stream broke and its request cannot be continued",
            ));
        };
        self.resumed += 1;
        tracing::info!(
            reason = why.name(),
            attempt = self.resumed,
            carried_tokens = carried,
            "a stream broke ({}) after {carried} tokens: resuming it on {} (resumption {})",
            why.name(),
            if first.is_some() {
                "the same engine first"
            } else {
                "another engine"
            },
            self.resumed
        );
        self.splice = Some(Splice::new(&summary, carried));
        Ok((self.request.send)(
            self.dispatcher.clone(),
            &self.request,
            body,
            Targets {
                first,
                exclude: self.failed.clone(),
                prompt_tokens: self.request.prompt_tokens + carried,
            },
            deadline,
        ))
    }

    /// The next attempt's head came: the answer goes on.
    pub(super) fn resumed(&self) {
        if let Some(last) = self.last {
            self.dispatcher.metrics().stream_break(last, ResumeOutcome::Resumed);
        }
    }

    /// The next attempt failed before its head (`why`): the events that
    /// end the client's stream.
    pub(super) fn attempt_failed(&self, why: &str) -> Bytes {
        if let Some(last) = self.last {
            self.dispatcher.metrics().stream_break(last, ResumeOutcome::Failed);
        }
        tracing::warn!(resumed = self.resumed, "a broken stream could not be resumed: {why}");
        error_end(&format!(
            "the inference server's stream broke and no engine could resume it: {why}"
        ))
    }
}

/// Where the first error event of `data` (whole events) begins.
fn error_at(data: &Bytes) -> Option<usize> {
    if !events::may_hold_error(data) {
        return None;
    }
    let base = data.as_ptr() as usize;
    events::split(data)
        .find(|line| events::is_error(line))
        .map(|line| line.as_ptr() as usize - base)
}

/// An OpenAI error event with `message`, then `data: [DONE]`: how a
/// stream that cannot go on ends (the `openai` client raises the error).
fn error_end(message: &str) -> Bytes {
    let error = serde_json::json!({"error": {
        "message": message,
        "type": "server_error",
        "param": null,
        "code": "stream_broken",
    }});
    Bytes::from(format!("data: {error}\n\ndata: [DONE]\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::body::Json;

    fn why(body: &str, completions: bool) -> Option<&'static str> {
        let json = Json::parse(body.as_bytes()).unwrap();
        blocked(json.as_object().unwrap(), completions)
    }

    #[test]
    fn what_may_not_be_resumed_is_told_from_the_body() {
        assert_eq!(why(r#"{"messages":[],"stream":true,"n":1}"#, false), None);
        assert!(why(r#"{"n":2}"#, false).unwrap().contains("more than one"));
        assert!(why(r#"{"best_of":3}"#, true).unwrap().contains("more than one"));
        assert!(why(r#"{"logprobs":true}"#, false).unwrap().contains("logprobs"));
        assert!(why(r#"{"top_logprobs":2}"#, false).unwrap().contains("logprobs"));
        assert!(
            why(r#"{"prompt":"x","logprobs":1}"#, true)
                .unwrap()
                .contains("logprobs")
        );
        assert_eq!(why(r#"{"logprobs":false}"#, false), None);
        let schema = r#"{"response_format":{"type":"json_schema","json_schema":{}}}"#;
        assert!(why(schema, false).unwrap().contains("structured output"));
        assert_eq!(why(r#"{"response_format":{"type":"text"}}"#, false), None);
        assert!(
            why(r#"{"guided_regex":"a+"}"#, false)
                .unwrap()
                .contains("structured output")
        );
        assert_eq!(why(r#"{"guided_regex":null}"#, false), None);
        // Completions: one text prompt, no echo, no suffix.
        assert_eq!(why(r#"{"prompt":"Once"}"#, true), None);
        assert!(why(r#"{"prompt":[1,2,3]}"#, true).unwrap().contains("not one text"));
        assert!(why(r#"{"prompt":["a","b"]}"#, true).unwrap().contains("not one text"));
        assert!(why(r#"{"prompt":"a","echo":true}"#, true).unwrap().contains("echoed"));
        assert!(why(r#"{"prompt":"a","suffix":"z"}"#, true).unwrap().contains("suffix"));
    }
}
