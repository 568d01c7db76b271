//! Asking engines for the usage of streamed answers the client did not ask
//! it for, and keeping it from the client.
//!
//! An engine reports the prompt tokens it found cached in the usage of its
//! answer ([`crate::answer::Reported`]), which a stream carries only with
//! `stream_options.include_usage`. Most streaming clients do not set it, so
//! a dispatcher that may ([`crate::config::ServeConfig::stream_usage`])
//! adds it to the upstream body of a streamed request that has no
//! `stream_options` ([`with_include_usage`]), and the relay takes out of the
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

use bytes::{Bytes, BytesMut};
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

/// `body` (a JSON object) with `stream_options.include_usage` set, when it
/// has no `stream_options` member (`has_options`); `None` if nothing is to
/// be changed.
pub(crate) fn with_include_usage(body: &[u8], has_options: bool) -> Option<Bytes> {
    if has_options {
        return None;
    }
    let brace = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[brace] != b'{' {
        return None;
    }
    let mut out = BytesMut::with_capacity(body.len() + INCLUDE_USAGE.len());
    out.extend_from_slice(&body[..=brace]);
    out.extend_from_slice(INCLUDE_USAGE);
    out.extend_from_slice(&body[brace + 1..]);
    Some(out.freeze())
}

/// The fields of a chunk that tell a usage chunk.
#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<IgnoredAny>,
    #[serde(default)]
    usage: Option<IgnoredAny>,
}

/// Takes the usage the client did not ask for out of an event stream, as
/// its frames pass: complete events are passed on (less the usage), a
/// partial one waits for the rest.
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
            let end = last_event_end(data).unwrap_or(0);
            emit(&data[..end], &mut out);
            self.partial.extend_from_slice(&data[end..]);
        } else {
            self.partial.extend_from_slice(data);
            if let Some(end) = last_event_end(&self.partial) {
                let complete: Vec<u8> = self.partial.drain(..end).collect();
                emit(&complete, &mut out);
            }
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

/// The end (after its blank line) of the last complete event in `buf`.
fn last_event_end(buf: &[u8]) -> Option<usize> {
    (1..buf.len()).rev().find(|&i| ends_event(buf, i)).map(|i| i + 1)
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
    if find(event, b"\"choices\":[]").is_none() && find(event, b"\"choices\": []").is_none() {
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

/// Where `needle` first occurs in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(hay, needle)
}

/// Appends `event` to `out` without its null usage members: each
/// `"usage"` found is checked against the [`NULL_USAGE`] forms that hold it.
fn strip_null_usage(event: &[u8], out: &mut BytesMut) {
    let mut rest = event;
    let mut from = 0;
    while let Some(found) = find(&rest[from..], b"\"usage\"").map(|at| from + at) {
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
        let out = with_include_usage(body, false).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["model"], "m");
        assert!(with_include_usage(body, true).is_none());
        assert!(with_include_usage(b"[1]", false).is_none());
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
}
