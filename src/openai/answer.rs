//! The answer text of an OpenAI response, as the engine sent it: a
//! non-streaming JSON body, or an event stream.
//!
//! What a finished request teaches the prefix table is its prompt followed
//! by the answer's tokens. A dispatcher does not read the answer itself: it
//! hands the response bytes it relayed, in the [`AnswerForm`] they came in,
//! to a response process through the completion record, and the response
//! process reads the text out of them here ([`answer_text`]) and tokenizes
//! it. Only an answer too long for a record is read by the dispatcher, as it
//! passes ([`EventStreamText`]), and handed over as [`AnswerForm::Text`].
//!
//! The text is that of choice 0 (`choices[0].text` for completions,
//! `choices[0].message.content` / `delta.content` for chat). What the
//! engine reports of the request ([`Reported`]) comes with it: the
//! answer's token count (`usage.completion_tokens`) and the prompt tokens
//! it found in its prefix cache (`usage.prompt_tokens_details.cached_tokens`
//! from vLLM with `--enable-prompt-tokens-details`, SGLang and llama.cpp's
//! server; else llama.cpp's own `timings.cache_n`).
//! Parsing reads only those fields, borrowing the strings and skipping the
//! rest without building it (`Response`); should a response not have the
//! expected shape, it is read as a whole tree ([`crate::openai::body::Json`]).

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::openai::body::Json;

/// Longest SSE line or accumulated answer text kept (bytes); past it the
/// reading gives up (the answer is still relayed, only not learned from).
const MAX_ANSWER_BYTES: usize = 16 << 20;

/// Longest SSE line kept by a [bounded](EventStreamText::bounded) reading
/// (an engine's chunk is a few hundred bytes; a line without end is a
/// broken or hostile engine).
pub const MAX_BOUNDED_LINE: usize = 1 << 20;

/// How a completion record carries an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerForm {
    /// The answer's text.
    Text = 0,
    /// The non-streaming response body (JSON).
    Json = 1,
    /// The response's event stream (`data: {json}` lines).
    EventStream = 2,
}

/// The bit of a record's form byte that marks a chat answer (it will be
/// rendered as an assistant message in the conversation's next prompt).
const CHAT: u8 = 0x80;

impl AnswerForm {
    /// The form byte of a record: the form, and whether the answer is a
    /// chat answer.
    pub fn to_byte(self, chat: bool) -> u8 {
        self as u8 | if chat { CHAT } else { 0 }
    }

    /// The form and the chat mark of a record's form byte.
    pub fn from_byte(b: u8) -> Option<(Self, bool)> {
        let form = match b & !CHAT {
            0 => AnswerForm::Text,
            1 => AnswerForm::Json,
            2 => AnswerForm::EventStream,
            _ => return None,
        };
        Some((form, b & CHAT != 0))
    }
}

/// What an engine reported of a request in its answer (the usage it
/// gave), each `None` when it did not say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reported {
    /// Tokens generated (`usage.completion_tokens`).
    pub completion_tokens: Option<u64>,
    /// Prompt tokens served from the engine's prefix cache
    /// (`usage.prompt_tokens_details.cached_tokens`, else `timings.cache_n`).
    pub cached_tokens: Option<u64>,
    /// Microseconds the engine spent generating the answer after its
    /// first token (llama.cpp's `timings.predicted_ms`): what separates a
    /// non-streamed answer's time to first token from its latency.
    pub decode_us: Option<u64>,
}

impl Reported {
    /// The cached tokens as a completion record carries them (`u32`; the
    /// record's "not reported" value, `u32::MAX`, is never produced).
    pub fn cached_tokens_u32(&self) -> Option<u32> {
        self.cached_tokens.map(|n| u32::try_from(n).unwrap_or(u32::MAX - 1))
    }

    /// `later`'s figures where it has them, else these.
    fn or_later(self, later: Reported) -> Reported {
        Reported {
            completion_tokens: later.completion_tokens.or(self.completion_tokens),
            cached_tokens: later.cached_tokens.or(self.cached_tokens),
            decode_us: later.decode_us.or(self.decode_us),
        }
    }
}

/// The text of an answer carried as `bytes` in `form`, and what the engine
/// reported with it; `None` if the bytes are not such an answer.
pub fn answer_text(form: AnswerForm, bytes: &[u8]) -> Option<(String, Reported)> {
    match form {
        AnswerForm::Text => std::str::from_utf8(bytes)
            .ok()
            .map(|t| (t.to_owned(), Reported::default())),
        AnswerForm::Json => json_answer(bytes),
        AnswerForm::EventStream => {
            let mut stream = EventStreamText::default();
            stream.feed(bytes);
            // A stream cut short teaches what it has: its first tokens.
            stream.feed(b"\n");
            (!stream.overflow).then_some((stream.text, stream.reported))
        }
    }
}

/// The non-streaming response a whole event stream stands for (a
/// Responses or Messages stream: [`super::agent_streams`]): the JSON
/// body (`chat.completion` when `chat`, else `text_completion`) with every
/// choice's text joined, its `finish_reason`, and the stream's `usage`, so
/// a streamed answer can be cached and served again as JSON or replayed
/// as SSE. `None` when the stream cannot be stood for exactly: it did not
/// end with `data: [DONE]`, a chunk is not JSON, or a chunk carries
/// anything the body would lose (tool calls, reasoning text, log
/// probabilities): such an answer is not cached.
pub fn stream_as_response(chat: bool, stream: &[u8]) -> Option<Vec<u8>> {
    if let Some(api) = super::agent_streams::AgentStream::of(stream) {
        return api.as_response(stream);
    }
    let text = std::str::from_utf8(stream).ok()?;
    let mut head: Option<Map<String, Value>> = None;
    // index → (text, finish_reason)
    let mut choices: BTreeMap<u64, (String, Value)> = BTreeMap::new();
    let mut usage = Value::Null;
    let mut done = false;
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        let Some(data) = line.strip_prefix("data:") else {
            // Blank lines end events; comments and other fields carry no answer.
            continue;
        };
        let data = data.trim_start();
        if done {
            return None;
        }
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let Value::Object(mut chunk) = serde_json::from_str::<Value>(data).ok()? else {
            return None;
        };
        if let Some(u) = chunk.remove("usage").filter(|u| !u.is_null()) {
            usage = u;
        }
        for choice in chunk.remove("choices")?.as_array()? {
            let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
            let entry = choices.entry(index).or_insert((String::new(), Value::Null));
            let piece = if chat {
                let delta = choice.get("delta")?.as_object()?;
                let plain = delta.iter().all(|(k, v)| match k.as_str() {
                    "role" | "content" => true,
                    _ => v.is_null(),
                });
                if !plain {
                    return None;
                }
                delta.get("content").and_then(Value::as_str).unwrap_or("")
            } else {
                if choice.get("logprobs").is_some_and(|l| !l.is_null()) {
                    return None;
                }
                choice.get("text").and_then(Value::as_str).unwrap_or("")
            };
            entry.0.push_str(piece);
            if let Some(f) = choice.get("finish_reason").filter(|f| !f.is_null()) {
                entry.1 = f.clone();
            }
        }
        if head.is_none() {
            head = Some(chunk);
        }
    }
    let head = head?;
    if !done || choices.is_empty() {
        return None;
    }
    let field = |name: &str| head.get(name).cloned().unwrap_or(Value::Null);
    let choices: Vec<Value> = choices
        .into_iter()
        .map(|(index, (text, finish))| {
            if chat {
                json!({"index": index, "message": {"role": "assistant", "content": text},
                       "logprobs": null, "finish_reason": finish})
            } else {
                json!({"index": index, "text": text, "logprobs": null, "finish_reason": finish})
            }
        })
        .collect();
    let mut body = json!({
        "id": field("id"),
        "object": if chat { "chat.completion" } else { "text_completion" },
        "created": field("created"),
        "model": field("model"),
        "choices": choices,
    });
    if let Some(fingerprint) = head.get("system_fingerprint").filter(|f| !f.is_null()) {
        body["system_fingerprint"] = fingerprint.clone();
    }
    if !usage.is_null() {
        body["usage"] = usage;
    }
    serde_json::to_vec(&body).ok()
}

/// The fields of a response or stream chunk that the answer is read from;
/// serde skips every other field without building it. One shape reads the
/// four APIs: chat and completions (`choices`), the Responses API
/// (`output` items, `response.output_text.delta` events, the response of
/// `response.completed`) and Messages (`content` blocks, `content_block_delta`
/// events, the message of `message_start`).
#[derive(Debug, Deserialize)]
struct Response<'a> {
    #[serde(borrow, default)]
    choices: Vec<Choice<'a>>,
    #[serde(default)]
    usage: Option<Usage>,
    /// llama.cpp's server's own timings.
    #[serde(default)]
    timings: Option<Timings>,
    /// An event's type (Responses and Messages streams), a Messages
    /// body's (`message`).
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    /// What a body is (`response` for a Responses body).
    #[serde(borrow, default)]
    object: Option<Cow<'a, str>>,
    /// A Responses text delta (a string), or a Messages block delta.
    #[serde(borrow, default)]
    delta: Option<Delta<'a>>,
    /// A Responses body's output items.
    #[serde(borrow, default)]
    output: Vec<Item<'a>>,
    /// A Messages body's content blocks.
    #[serde(borrow, default)]
    content: Option<Blocks<'a>>,
    /// The response a Responses event carries (`response.completed`).
    #[serde(borrow, default)]
    response: Option<Box<Response<'a>>>,
    /// The message a Messages `message_start` event carries.
    #[serde(borrow, default)]
    message: Option<Box<Response<'a>>>,
}

/// A Responses text delta, or a Messages block delta (`text_delta`'s text).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Delta<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Block {
        #[serde(borrow, default, rename = "type")]
        kind: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        text: Option<Cow<'a, str>>,
    },
    Other(serde::de::IgnoredAny),
}

/// A Messages body's `content` (a list of blocks; anything else read as
/// no text).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Blocks<'a> {
    List(#[serde(borrow)] Vec<Part<'a>>),
    Other(serde::de::IgnoredAny),
}

/// A Responses output item.
#[derive(Debug, Deserialize)]
struct Item<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<Blocks<'a>>,
}

/// A content part or block (`output_text`, `text`, ...).
#[derive(Debug, Deserialize)]
struct Part<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

impl<'a> Blocks<'a> {
    /// The text of its parts of type `kind`, joined.
    fn text_of(&self, kind: &str, out: &mut String) {
        if let Blocks::List(parts) = self {
            for part in parts.iter().filter(|p| p.kind.as_deref() == Some(kind)) {
                out.push_str(part.text.as_deref().unwrap_or_default());
            }
        }
    }
}

#[derive(Debug, Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    index: Option<u64>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    message: Option<Message<'a>>,
    #[serde(borrow, default)]
    delta: Option<Message<'a>>,
}

#[derive(Debug, Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
}

/// A `usage` object of any of the APIs.
#[derive(Debug, Deserialize)]
struct Usage {
    /// Chat and completions.
    #[serde(default)]
    completion_tokens: Option<u64>,
    /// Responses and Messages.
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptTokensDetails>,
    /// Responses.
    #[serde(default)]
    input_tokens_details: Option<PromptTokensDetails>,
    /// Messages.
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct PromptTokensDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct Timings {
    #[serde(default)]
    cache_n: Option<u64>,
    #[serde(default)]
    predicted_ms: Option<f64>,
}

/// Milliseconds as whole microseconds, if a sensible duration.
fn ms_to_us(ms: f64) -> Option<u64> {
    (ms.is_finite() && ms >= 0.0).then_some((ms * 1000.0) as u64)
}

impl<'a> Response<'a> {
    /// Whether it is an answer or chunk of any API (it has choices, or is
    /// a Responses or Messages body or event).
    fn is_answer(&self) -> bool {
        !self.choices.is_empty() || self.kind.is_some() || self.object.as_deref() == Some("response")
    }

    /// The answer's text in it (choice 0's `text`, else `message.content`,
    /// else `delta.content`; a Responses body's `output_text` parts or
    /// text delta; a Messages body's `text` blocks or `text_delta`), and
    /// what it reports; `None` if it holds no answer text.
    fn answer(&self) -> (Option<Cow<'_, str>>, Reported) {
        (self.text(), self.reported())
    }

    fn text(&self) -> Option<Cow<'_, str>> {
        let choice = self
            .choices
            .iter()
            .find(|c| c.index == Some(0))
            .or_else(|| self.choices.first());
        if let Some(c) = choice {
            return c
                .text
                .as_deref()
                .or_else(|| c.message.as_ref().and_then(|m| m.content.as_deref()))
                .or_else(|| c.delta.as_ref().and_then(|m| m.content.as_deref()))
                .map(Cow::Borrowed);
        }
        match (self.kind.as_deref(), &self.delta) {
            (Some("response.output_text.delta"), Some(Delta::Text(t))) => return Some(Cow::Borrowed(t)),
            (Some("content_block_delta"), Some(Delta::Block { kind, text }))
                if kind.as_deref() == Some("text_delta") =>
            {
                return text.as_deref().map(Cow::Borrowed);
            }
            _ => {}
        }
        match self.object.as_deref().or(self.kind.as_deref()) {
            Some("response") => {
                let mut text = String::new();
                for item in self.output.iter().filter(|i| i.kind.as_deref() == Some("message")) {
                    if let Some(content) = &item.content {
                        content.text_of("output_text", &mut text);
                    }
                }
                Some(Cow::Owned(text))
            }
            Some("message") => {
                let mut text = String::new();
                if let Some(content) = &self.content {
                    content.text_of("text", &mut text);
                }
                Some(Cow::Owned(text))
            }
            _ => None,
        }
    }

    fn reported(&self) -> Reported {
        let usage = self.usage.as_ref();
        let own = Reported {
            completion_tokens: usage.and_then(|u| u.completion_tokens.or(u.output_tokens)),
            cached_tokens: usage
                .and_then(|u| {
                    u.prompt_tokens_details
                        .as_ref()
                        .or(u.input_tokens_details.as_ref())
                        .and_then(|d| d.cached_tokens)
                        .or(u.cache_read_input_tokens)
                })
                .or_else(|| self.timings.as_ref().and_then(|t| t.cache_n)),
            decode_us: self.timings.as_ref().and_then(|t| t.predicted_ms).and_then(ms_to_us),
        };
        // What an event's response or message reports.
        let inner = self.response.as_deref().or(self.message.as_deref());
        match inner {
            Some(inner) => inner.reported().or_later(own),
            None => own,
        }
    }
}

/// The choice with index 0 (or the first one) of a response or chunk.
fn choice_zero<'a, 'j>(v: &'a Json<'j>) -> Option<&'a Json<'j>> {
    let choices = v.as_object()?.get("choices")?.as_array()?;
    choices
        .iter()
        .find(|c| c.as_object().and_then(|c| c.get("index")).and_then(Json::as_u64) == Some(0))
        .or_else(|| choices.first())
}

/// What a response or chunk read as a whole tree reports.
fn reported(v: &Json<'_>) -> Reported {
    let object = v.as_object();
    let usage = object.and_then(|o| o.get("usage")).and_then(Json::as_object);
    let timings = object.and_then(|o| o.get("timings")).and_then(Json::as_object);
    Reported {
        completion_tokens: usage.and_then(|u| u.get("completion_tokens")).and_then(Json::as_u64),
        cached_tokens: usage
            .and_then(|u| u.get("prompt_tokens_details"))
            .and_then(Json::as_object)
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Json::as_u64)
            .or_else(|| timings.and_then(|t| t.get("cache_n")).and_then(Json::as_u64)),
        decode_us: timings
            .and_then(|t| t.get("predicted_ms"))
            .and_then(Json::as_f64)
            .and_then(ms_to_us),
    }
}

/// The answer text of a non-streaming response body and what it reports.
pub fn json_answer(body: &[u8]) -> Option<(String, Reported)> {
    if let Ok(response) = serde_json::from_slice::<Response<'_>>(body)
        && response.is_answer()
    {
        let (text, tokens) = response.answer();
        return Some((text.unwrap_or_default().into_owned(), tokens));
    }
    let v = Json::parse(body).ok()?;
    let choice = choice_zero(&v)?.as_object()?;
    let text = choice
        .get("text")
        .and_then(Json::as_str)
        .or_else(|| {
            choice
                .get("message")
                .and_then(Json::as_object)
                .and_then(|m| m.get("content"))
                .and_then(Json::as_str)
        })
        .unwrap_or_default()
        .to_owned();
    Some((text, reported(&v)))
}

/// The answer text of an event stream, read as it passes, event line by
/// event line (`data: {json}`).
#[derive(Debug)]
pub struct EventStreamText {
    line: Vec<u8>,
    /// Text of choice 0 so far.
    pub text: String,
    /// What the chunks reported (the last figures given).
    pub reported: Reported,
    /// Whether `data: [DONE]` was seen.
    pub done: bool,
    /// Whether a line grew past its limit, or (unbounded reading) the text
    /// past [`MAX_ANSWER_BYTES`]: the text is void.
    pub overflow: bool,
    /// Whether the text stopped at its bound ([`Self::bounded`]): it holds
    /// the answer's leading part.
    pub truncated: bool,
    /// Longest line kept.
    line_limit: usize,
    /// Most text kept.
    text_limit: usize,
    /// Whether text past `text_limit` is a truncation rather than an
    /// overflow.
    keep_leading: bool,
}

impl Default for EventStreamText {
    /// Reads the whole answer (lines and text up to [`MAX_ANSWER_BYTES`]).
    fn default() -> Self {
        Self {
            line: Vec::new(),
            text: String::new(),
            reported: Reported::default(),
            done: false,
            overflow: false,
            truncated: false,
            line_limit: MAX_ANSWER_BYTES,
            text_limit: MAX_ANSWER_BYTES,
            keep_leading: false,
        }
    }
}

impl EventStreamText {
    /// Keeps at most `text_limit` bytes of the text (its leading part, cut
    /// at a character boundary: [`Self::truncated`]) and lines of at most
    /// [`MAX_BOUNDED_LINE`]: what a relay keeps of a stream it only learns
    /// from, which a hostile engine cannot grow.
    pub fn bounded(text_limit: usize) -> Self {
        Self {
            line_limit: MAX_BOUNDED_LINE,
            text_limit: text_limit.min(MAX_ANSWER_BYTES),
            keep_leading: true,
            ..Self::default()
        }
    }

    /// Feeds the next bytes of the stream.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while !self.overflow && !bytes.is_empty() {
            match memchr_newline(bytes) {
                Some(i) => {
                    if self.line.is_empty() {
                        self.event_line(&bytes[..i]);
                    } else {
                        self.line.extend_from_slice(&bytes[..i]);
                        let line = std::mem::take(&mut self.line);
                        self.event_line(&line);
                        self.line = line;
                        self.line.clear();
                    }
                    bytes = &bytes[i + 1..];
                }
                None => {
                    self.line.extend_from_slice(bytes);
                    if self.line.len() > self.line_limit {
                        self.overflow = true;
                    }
                    return;
                }
            }
        }
    }

    fn event_line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            self.done = true;
            return;
        }
        if let Ok(chunk) = serde_json::from_slice::<Response<'_>>(data) {
            let (piece, tokens) = chunk.answer();
            self.add(piece.as_deref(), tokens);
            return;
        }
        let Ok(chunk) = Json::parse(data) else {
            return;
        };
        if let Some(choice) = choice_zero(&chunk).and_then(Json::as_object) {
            let piece = choice.get("text").and_then(Json::as_str).or_else(|| {
                choice
                    .get("delta")
                    .and_then(Json::as_object)
                    .and_then(|d| d.get("content"))
                    .and_then(Json::as_str)
            });
            self.add(piece, Reported::default());
        }
        self.reported = self.reported.or_later(reported(&chunk));
    }

    fn add(&mut self, piece: Option<&str>, reported: Reported) {
        if let Some(piece) = piece
            && !self.truncated
        {
            if self.text.len() + piece.len() <= self.text_limit {
                self.text.push_str(piece);
            } else if self.keep_leading {
                let room = self.text_limit - self.text.len();
                self.text.push_str(&piece[..piece.floor_char_boundary(room)]);
                self.truncated = true;
            } else {
                self.overflow = true;
            }
        }
        self.reported = self.reported.or_later(reported);
    }
}

fn memchr_newline(bytes: &[u8]) -> Option<usize> {
    bytes.iter().position(|b| *b == b'\n')
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" Hello\"}}]}\r\n\r\n",
        ": comment\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" w\\u00f6rld\"},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n",
        "data: [DONE]\n\n"
    );

    fn reported(completion_tokens: Option<u64>, cached_tokens: Option<u64>) -> Reported {
        Reported {
            completion_tokens,
            cached_tokens,
            decode_us: None,
        }
    }

    /// The Responses API's and Anthropic Messages' bodies and streams give
    /// their answer text and usage (output tokens, cached prompt tokens);
    /// reasoning and tool-call deltas are not answer text.
    #[test]
    fn responses_and_messages_answers_are_read() {
        let responses_body = r#"{"id":"resp_1","object":"response","output":[{"type":"reasoning","content":[{"type":"reasoning_text","text":"hmm"}]},{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Hi "},{"type":"output_text","text":"there"}]},{"type":"function_call","name":"f","arguments":"{}"}],"usage":{"input_tokens":40,"output_tokens":7,"input_tokens_details":{"cached_tokens":32}}}"#;
        assert_eq!(
            answer_text(AnswerForm::Json, responses_body.as_bytes()),
            Some(("Hi there".to_owned(), reported(Some(7), Some(32))))
        );
        let responses_stream = concat!(
            "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"object\":\"response\",\"output\":[],\"usage\":null}}\n\n",
            "event: response.reasoning_text.delta\ndata: {\"type\":\"response.reasoning_text.delta\",\"delta\":\"think\"}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hel\"}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"lo\"}\n\n",
            "event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"delta\":\"{}\"}\n\n",
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"object\":\"response\",\"usage\":{\"input_tokens\":9,\"output_tokens\":2,\"input_tokens_details\":{\"cached_tokens\":8}}}}\n\n",
        );
        assert_eq!(
            answer_text(AnswerForm::EventStream, responses_stream.as_bytes()),
            Some(("Hello".to_owned(), reported(Some(2), Some(8))))
        );
        let messages_body = r#"{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"thinking","thinking":"x"},{"type":"text","text":"Bonjour"},{"type":"tool_use","id":"t","name":"f","input":{}}],"usage":{"input_tokens":3,"cache_read_input_tokens":64,"output_tokens":5}}"#;
        assert_eq!(
            answer_text(AnswerForm::Json, messages_body.as_bytes()),
            Some(("Bonjour".to_owned(), reported(Some(5), Some(64))))
        );
        let messages_stream = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"type\":\"message\",\"content\":[],\"usage\":{\"input_tokens\":3,\"cache_read_input_tokens\":64,\"output_tokens\":1}}}\n\n",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Bon\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{}\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"jour\"}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":5}}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        assert_eq!(
            answer_text(AnswerForm::EventStream, messages_stream.as_bytes()),
            Some(("Bonjour".to_owned(), reported(Some(5), Some(64))))
        );
    }

    #[test]
    fn a_stream_is_read_across_split_chunks() {
        for split in [1, 3, 7, 50, STREAM.len()] {
            let mut c = EventStreamText::default();
            for piece in STREAM.as_bytes().chunks(split) {
                c.feed(piece);
            }
            assert_eq!(c.text, " Hello wörld", "split {split}");
            assert_eq!(c.reported, reported(Some(2), Some(32)));
            assert!(c.done && !c.overflow);
        }
    }

    #[test]
    fn every_form_gives_the_text() {
        assert_eq!(
            answer_text(AnswerForm::EventStream, STREAM.as_bytes()),
            Some((" Hello wörld".to_owned(), reported(Some(2), Some(32))))
        );
        // A stream cut after its second event still gives what it has.
        let cut = &STREAM[..STREAM.find(": comment").unwrap() - 2];
        assert_eq!(
            answer_text(AnswerForm::EventStream, cut.as_bytes()),
            Some((" Hello".to_owned(), Reported::default()))
        );
        let chat = br#"{"choices":[{"index":0,"message":{"role":"assistant","content":" hi there"}}],"usage":{"completion_tokens":2}}"#;
        assert_eq!(
            answer_text(AnswerForm::Json, chat),
            Some((" hi there".to_owned(), reported(Some(2), None)))
        );
        // llama.cpp's server: its own timings when usage has no details.
        let llama = br#"{"choices":[{"index":0,"message":{"content":"x"}}],"usage":{"completion_tokens":1},"timings":{"cache_n":33}}"#;
        assert_eq!(
            answer_text(AnswerForm::Json, llama),
            Some(("x".to_owned(), reported(Some(1), Some(33))))
        );
        // llama.cpp's timings: the decode time separates TTFT from latency
        // (both parsers: the typed one, and the tree for odd bodies).
        let timed = br#"{"choices":[{"index":0,"message":{"content":"x"}}],"timings":{"cache_n":3,"prompt_ms":12.5,"predicted_ms":250.25}}"#;
        let odd =
            br#"{"choices":[{"index":"0","message":{"content":"x"}}],"timings":{"cache_n":3,"predicted_ms":250.25}}"#;
        for body in [&timed[..], &odd[..]] {
            let (_, r) = answer_text(AnswerForm::Json, body).unwrap();
            assert_eq!((r.cached_tokens, r.decode_us), (Some(3), Some(250_250)));
        }
        let both = br#"{"choices":[{"index":0,"message":{"content":"x"}}],"usage":{"prompt_tokens_details":{"cached_tokens":16}},"timings":{"cache_n":33}}"#;
        assert_eq!(
            answer_text(AnswerForm::Json, both),
            Some(("x".to_owned(), reported(None, Some(16))))
        );
        let completion = br#"{"choices":[{"index":1,"text":"b"},{"index":0,"text":" a"}]}"#;
        assert_eq!(
            answer_text(AnswerForm::Json, completion),
            Some((" a".to_owned(), Reported::default()))
        );
        assert_eq!(answer_text(AnswerForm::Json, b"not json"), None);
        // Another shape than expected (a string index): read as a tree.
        let odd = br#"{"choices":[{"index":"0","text":" odd","logprobs":{"x":[1,2]}}],"usage":{"completion_tokens":"n","prompt_tokens_details":{"cached_tokens":48}}}"#;
        assert_eq!(
            answer_text(AnswerForm::Json, odd),
            Some((" odd".to_owned(), reported(None, Some(48))))
        );
        let odd_stream = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":7}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"ok\"}}]}\n\n";
        assert_eq!(
            answer_text(AnswerForm::EventStream, odd_stream),
            Some(("ok".to_owned(), Reported::default()))
        );
        assert_eq!(
            answer_text(AnswerForm::Text, " t".as_bytes()),
            Some((" t".to_owned(), Reported::default()))
        );
        assert_eq!(answer_text(AnswerForm::Text, &[0xff]), None);
        for form in [AnswerForm::Text, AnswerForm::Json, AnswerForm::EventStream] {
            for chat in [false, true] {
                assert_eq!(AnswerForm::from_byte(form.to_byte(chat)), Some((form, chat)));
            }
        }
        assert_eq!(AnswerForm::from_byte(3), None);
        assert_eq!(AnswerForm::from_byte(0x83), None);
    }

    #[test]
    fn a_whole_chat_stream_stands_for_its_json_response() {
        let stream = concat!(
            "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",",
            "\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
            "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",",
            "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Par\"},\"finish_reason\":null}]}\n\n",
            "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",",
            "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"is\"},\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",\"choices\":[],",
            "\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7}}\n\n",
            "data: [DONE]\n\n"
        );
        let body: serde_json::Value =
            serde_json::from_slice(&stream_as_response(true, stream.as_bytes()).unwrap()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "id": "c1", "object": "chat.completion", "created": 7, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris"},
                             "logprobs": null, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
            })
        );
        // The text a response process reads is the same either way.
        let from_json = answer_text(AnswerForm::Json, &serde_json::to_vec(&body).unwrap()).unwrap();
        assert_eq!(
            from_json,
            answer_text(AnswerForm::EventStream, stream.as_bytes()).unwrap()
        );
    }

    #[test]
    fn completion_streams_join_each_choice() {
        let stream = concat!(
            "data: {\"id\":\"t\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"a\",\"logprobs\":null,\"finish_reason\":null},",
            "{\"index\":1,\"text\":\"x\",\"logprobs\":null,\"finish_reason\":null}]}\n\n",
            "data: {\"id\":\"t\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"b\",\"logprobs\":null,\"finish_reason\":\"length\"},",
            "{\"index\":1,\"text\":\"y\",\"logprobs\":null,\"finish_reason\":\"stop\"}]}\n\n",
            "data: [DONE]\n\n"
        );
        let body: serde_json::Value =
            serde_json::from_slice(&stream_as_response(false, stream.as_bytes()).unwrap()).unwrap();
        assert_eq!(body["object"], "text_completion");
        assert_eq!(body["choices"][0]["text"], "ab");
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        assert_eq!(body["choices"][1]["text"], "xy");
        assert_eq!(body["choices"][1]["finish_reason"], "stop");
        assert!(body.get("usage").is_none());
    }

    #[test]
    fn streams_a_json_body_cannot_stand_for_are_not_assembled() {
        let chunk = |delta: &str| {
            format!(
                "data: {{\"id\":\"c\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":null}}]}}\n\n"
            )
        };
        let plain = chunk(r#"{"content":"hi"}"#);
        assert!(stream_as_response(true, format!("{plain}data: [DONE]\n\n").as_bytes()).is_some());
        // Cut short: no [DONE].
        assert_eq!(stream_as_response(true, plain.as_bytes()), None);
        // Tool calls or reasoning text would be lost in the body.
        let tools = chunk(r#"{"tool_calls":[{"index":0,"function":{"name":"f","arguments":"{}"}}]}"#);
        assert_eq!(
            stream_as_response(true, format!("{tools}data: [DONE]\n\n").as_bytes()),
            None
        );
        let reasoning = chunk(r#"{"reasoning_content":"hmm"}"#);
        assert_eq!(
            stream_as_response(true, format!("{reasoning}data: [DONE]\n\n").as_bytes()),
            None
        );
        // Not JSON, or something after [DONE].
        assert_eq!(stream_as_response(true, b"data: {oops\n\ndata: [DONE]\n\n"), None);
        assert_eq!(
            stream_as_response(true, format!("{plain}data: [DONE]\n\n{plain}").as_bytes()),
            None
        );
    }

    #[test]
    fn a_bounded_reading_keeps_the_leading_text_and_refuses_an_endless_line() {
        let chunk = |t: &str| format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{t}\"}}}}]}}\n\n");
        // 10 bytes of room: "héllo" (6 bytes) whole, then "wörld" cut at
        // a character boundary (4 bytes: "wö" is 3, "wör" 4).
        let mut text = EventStreamText::bounded(10);
        for t in ["héllo", "wörld", "more"] {
            text.feed(chunk(t).as_bytes());
        }
        text.feed(b"data: [DONE]\n\n");
        assert_eq!(text.text, "héllowör");
        assert!(text.truncated && !text.overflow && text.done);
        // A line without end past MAX_BOUNDED_LINE voids the text (the
        // unbounded reading holds up to MAX_ANSWER_BYTES of it).
        let mut text = EventStreamText::bounded(10);
        let frame = vec![b'x'; 64 << 10];
        for _ in 0..(MAX_BOUNDED_LINE / frame.len() + 2) {
            text.feed(&frame);
        }
        assert!(text.overflow);
        assert!(text.line.len() <= MAX_BOUNDED_LINE + frame.len());
        let mut whole = EventStreamText::default();
        whole.feed(chunk(&"y".repeat(100)).as_bytes());
        assert_eq!(whole.text.len(), 100, "unbounded");
    }
}
