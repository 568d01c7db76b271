//! Asking engines for the usage of streamed answers the client did not ask
//! it for, and keeping it from the client.
//!
//! An engine reports the output tokens of its answer and the prompt tokens
//! it found cached in the usage of its answer ([`crate::openai::answer::Reported`],
//! `super::meter`), which a stream carries only with
//! `stream_options.include_usage`. Most streaming clients do not set it, so
//! the dispatcher sets it in the upstream body of every streamed request
//! whose output is charged to a token limit, and of every other one when
//! it may ([`crate::config::ServeConfig::stream_usage`]): added after the
//! body's opening brace when there are no `stream_options`
//! ([`with_include_usage`]), else set in the client's options, the body
//! written again ([`with_usage_option`]: a client sending
//! `{"include_usage": false}` or other options no longer hides its
//! output). The relay takes out of the
//! stream what the client did not ask for ([`UsageStrip`]): the usage chunk
//! (empty `choices`, non-null `usage`) and the `"usage":null` member that
//! OpenAI-style servers add to every other chunk. The answer the client
//! gets is then byte for byte the one the engine sends without the option
//! (vLLM, SGLang, llama.cpp's server and the simulator print those members
//! in the compact forms taken out here), while the response process reads
//! the usage from the bytes as they came.
//!
//! The member is taken out as bytes: inside a JSON string a `"` is always
//! escaped, so `,"usage":null` can only be a member of an object.

use std::sync::LazyLock;

use bytes::{Bytes, BytesMut};
use memchr::memmem::Finder;
use serde::Deserialize;
use serde::de::IgnoredAny;

/// What is added after the body's opening brace.
const INCLUDE_USAGE: &[u8] = br#""stream_options":{"include_usage":true},"#;

/// The forms of the null usage member taken out of chunks.
const NULL_USAGE: [&[u8]; 4] = [
    br#","usage":null"#,
    br#", "usage": null"#,
    br#""usage":null,"#,
    br#""usage": null, "#,
];

/// `body` (a JSON object without a `stream_options` member) with
/// `stream_options.include_usage` set; `None` if it is not an object.
pub(crate) fn with_include_usage(body: &[u8]) -> Option<Bytes> {
    let brace = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[brace] != b'{' {
        return None;
    }
    let rest = &body[brace + 1..];
    let mut out = BytesMut::with_capacity(body.len() + INCLUDE_USAGE.len());
    out.extend_from_slice(&body[..=brace]);
    // `{}`: the member without the comma that would follow it.
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let member = if empty {
        &INCLUDE_USAGE[..INCLUDE_USAGE.len() - 1]
    } else {
        INCLUDE_USAGE
    };
    out.extend_from_slice(member);
    out.extend_from_slice(rest);
    Some(out.freeze())
}

/// `body` (a JSON object with `stream_options`) with
/// `stream_options.include_usage` set to `true`, its other options kept
/// (options that are not an object are replaced); `None` if it is not an
/// object. The body is parsed and written again.
pub(crate) fn with_usage_option(body: &[u8]) -> Option<Bytes> {
    let Ok(serde_json::Value::Object(mut object)) = serde_json::from_slice::<serde_json::Value>(body) else {
        return None;
    };
    let options = object
        .entry("stream_options")
        .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
    if !options.is_object() {
        *options = serde_json::Value::Object(serde_json::Map::new());
    }
    if let Some(o) = options.as_object_mut() {
        o.insert("include_usage".into(), serde_json::Value::Bool(true));
    }
    serde_json::to_vec(&object).ok().map(Bytes::from)
}

/// The fields of a chunk that tell a usage chunk.
#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<IgnoredAny>,
    #[serde(default)]
    usage: Option<IgnoredAny>,
}

/// Longest event held back waiting for its end: past it, what has come is
/// passed on as it is (a stream without blank lines, from a broken or
/// hostile engine, is relayed in bounded memory and linear time).
const MAX_PARTIAL: usize = 1 << 20;

/// Takes the usage the client did not ask for out of an event stream, as
/// its frames pass: complete events are passed on (less the usage), a
/// partial one waits for the rest (up to a MiB: a longer one is passed on
/// as it is).
#[derive(Debug, Default)]
pub struct UsageStrip {
    /// The start of an event not yet complete.
    partial: Vec<u8>,
}

impl UsageStrip {
    /// What of `data` (the stream's next bytes) goes to the client now.
    pub fn feed(&mut self, data: &[u8]) -> Bytes {
        let mut out = BytesMut::with_capacity(data.len() + self.partial.len());
        if self.partial.is_empty() {
            // The usual case: a frame of whole events.
            let end = last_event_end(data, 0).unwrap_or(0);
            emit(&data[..end], &mut out);
            self.partial.extend_from_slice(&data[end..]);
        } else {
            // Only the new bytes (and the two before them, which may
            // start a blank line) can end an event.
            let from = self.partial.len().saturating_sub(2);
            self.partial.extend_from_slice(data);
            if let Some(end) = last_event_end(&self.partial, from) {
                let complete: Vec<u8> = self.partial.drain(..end).collect();
                emit(&complete, &mut out);
            }
        }
        if self.partial.len() > MAX_PARTIAL {
            strip_null_usage(&std::mem::take(&mut self.partial), &mut out);
        }
        out.freeze()
    }

    /// What is left when the stream ends (an event without its blank line).
    pub fn finish(&mut self) -> Bytes {
        let rest = std::mem::take(&mut self.partial);
        let mut out = BytesMut::with_capacity(rest.len());
        if !is_usage_chunk(&rest) {
            strip_null_usage(&rest, &mut out);
        }
        out.freeze()
    }
}

/// Appends the complete events of `events` to `out`, less the usage.
fn emit(events: &[u8], out: &mut BytesMut) {
    for event in split_events(events) {
        if !is_usage_chunk(event) {
            strip_null_usage(event, out);
        }
    }
}

/// Whether `buf[i]` is the last byte of an event (the `\n` of its blank
/// line, after `\n` or `\n\r`).
fn ends_event(buf: &[u8], i: usize) -> bool {
    buf[i] == b'\n' && i >= 1 && (buf[i - 1] == b'\n' || (i >= 2 && buf[i - 1] == b'\r' && buf[i - 2] == b'\n'))
}

/// The end (after its blank line) of the last complete event in `buf`
/// whose blank line ends at or after `from`.
fn last_event_end(buf: &[u8], from: usize) -> Option<usize> {
    (from.max(1)..buf.len())
        .rev()
        .find(|&i| ends_event(buf, i))
        .map(|i| i + 1)
}

/// The events of `buf` (each with its blank line), which ends at an
/// event's end.
fn split_events(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= buf.len() {
            return None;
        }
        let from = start;
        let end = (from + 1..buf.len())
            .find(|&i| ends_event(buf, i))
            .map_or(buf.len(), |i| i + 1);
        start = end;
        Some(&buf[from..end])
    })
}

/// Whether `event` is a usage chunk: a `data:` line whose JSON has empty
/// `choices` and a non-null `usage`.
fn is_usage_chunk(event: &[u8]) -> bool {
    // Token chunks carry choices: only an event with an empty list is parsed.
    static EMPTY: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"choices\":[]"));
    static EMPTY_SPACED: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"choices\": []"));
    if EMPTY.find(event).is_none() && EMPTY_SPACED.find(event).is_none() {
        return false;
    }
    event.split(|b| *b == b'\n').any(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        line.strip_prefix(b"data:")
            .map(<[u8]>::trim_ascii)
            .and_then(|json| serde_json::from_slice::<Chunk>(json).ok())
            .is_some_and(|c| c.choices.is_empty() && c.usage.is_some())
    })
}

/// Appends `event` to `out` without its null usage members: each
/// `"usage"` found is checked against the [`NULL_USAGE`] forms that hold it.
fn strip_null_usage(event: &[u8], out: &mut BytesMut) {
    let mut rest = event;
    let mut from = 0;
    static USAGE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"usage\""));
    while let Some(found) = USAGE.find(&rest[from..]).map(|at| from + at) {
        let member = NULL_USAGE.iter().find_map(|form| {
            let lead = form.iter().position(|b| *b == b'"')?;
            let start = found.checked_sub(lead)?;
            rest.get(start..start + form.len())
                .filter(|s| s == form)
                .map(|_| (start, form.len()))
        });
        match member {
            Some((start, len)) => {
                out.extend_from_slice(&rest[..start]);
                rest = &rest[start + len..];
                from = 0;
            }
            None => from = found + 1,
        }
    }
    out.extend_from_slice(rest);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn include_usage_is_added_only_where_no_options_are() {
        let body = br#"  {"model":"m","stream":true}"#;
        let out = with_include_usage(body).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["model"], "m");
        assert!(with_include_usage(b"[1]").is_none());
        // An empty object stays JSON (fuzz target body_rewrite).
        let empty: serde_json::Value = serde_json::from_slice(&with_include_usage(b" { } ").unwrap()).unwrap();
        assert_eq!(empty, serde_json::json!({"stream_options": {"include_usage": true}}));
        // The client's own options: set, the others kept.
        for (options, expected) in [
            (
                r#"{"include_usage":false,"continuous_usage_stats":true}"#,
                r#"{"include_usage":true,"continuous_usage_stats":true}"#,
            ),
            (r#"{}"#, r#"{"include_usage":true}"#),
            (r#"null"#, r#"{"include_usage":true}"#),
        ] {
            let body = format!(r#"{{"model":"m","stream":true,"stream_options":{options}}}"#);
            let out: serde_json::Value = serde_json::from_slice(&with_usage_option(body.as_bytes()).unwrap()).unwrap();
            let expected: serde_json::Value = serde_json::from_str(expected).unwrap();
            assert_eq!(out["stream_options"], expected, "{options}");
            assert_eq!(out["model"], "m");
        }
        assert!(with_usage_option(b"[1]").is_none());
    }

    const WITH_USAGE: &str = concat!(
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" \\\",\\\"usage\\\":null there\"},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
        "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n",
        "data: [DONE]\n\n",
    );
    const WITHOUT: &str = concat!(
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" \\\",\\\"usage\\\":null there\"},\"finish_reason\":\"stop\"}]}\n\n",
        "data: [DONE]\n\n",
    );

    #[test]
    fn the_stream_is_what_the_engine_sends_without_the_option_however_it_is_cut() {
        for split in [1, 2, 5, 17, 64, WITH_USAGE.len()] {
            let mut strip = UsageStrip::default();
            let mut out = Vec::new();
            for piece in WITH_USAGE.as_bytes().chunks(split) {
                out.extend_from_slice(&strip.feed(piece));
            }
            out.extend_from_slice(&strip.finish());
            assert_eq!(String::from_utf8(out).unwrap(), WITHOUT, "split {split}");
        }
        // A stream cut before its blank line keeps its last event.
        let mut strip = UsageStrip::default();
        let mut out = strip
            .feed(b"data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}")
            .to_vec();
        out.extend_from_slice(&strip.finish());
        assert_eq!(
            out,
            b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}"
        );
        // CRLF events and the spaced forms.
        let mut strip = UsageStrip::default();
        let crlf = "data: {\"choices\": [{\"text\": \"x\"}], \"usage\": null}\r\n\r\ndata: {\"choices\": [], \"usage\": {\"prompt_tokens\": 1}}\r\n\r\n";
        assert_eq!(
            &strip.feed(crlf.as_bytes())[..],
            b"data: {\"choices\": [{\"text\": \"x\"}]}\r\n\r\n"
        );
    }

    #[test]
    fn a_stream_without_blank_lines_is_passed_on_in_bounded_memory() {
        // 64 MiB in 4 KiB frames, never a blank line: held back at most
        // MAX_PARTIAL, everything passed on, in linear time (quadratic
        // rescanning took minutes here).
        let frame = vec![b'x'; 4096];
        let mut strip = UsageStrip::default();
        let mut passed = 0;
        for _ in 0..(64 << 20) / frame.len() {
            passed += strip.feed(&frame).len();
            assert!(strip.partial.len() <= MAX_PARTIAL + frame.len());
        }
        passed += strip.finish().len();
        assert_eq!(passed, 64 << 20);
    }
}
