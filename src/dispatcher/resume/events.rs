//! A chat stream cut into whole events: what a client may be given of it
//! ([`WholeEvents`]), and which events report a failure ([`is_error`]).

use std::sync::LazyLock;

use bytes::{Bytes, BytesMut};
use memchr::memmem::{Finder, FinderRev};

/// The longest event held back whole: past it the stream is passed on as
/// it comes (an engine whose event never ends is not buffered), and it
/// is no longer known where the client stands ([`WholeEvents::overflow`]).
const MAX_EVENT_BYTES: usize = 1 << 20;

/// Cuts an event stream at its events' ends (`\n\n`): a frame's whole
/// events go on at once, a trailing partial event waits for the rest, so
/// a stream that breaks leaves its client between two events, never
/// inside one.
#[derive(Debug, Default)]
pub(super) struct WholeEvents {
    partial: BytesMut,
    /// An event grew past [`MAX_EVENT_BYTES`]: everything is passed on as
    /// it comes from then on.
    pub(super) overflow: bool,
}

impl WholeEvents {
    /// The whole events `data` completes (with what waited before it).
    pub(super) fn feed(&mut self, data: Bytes) -> Bytes {
        if self.overflow {
            return data;
        }
        let end = end_of_last_event(&data);
        if self.partial.is_empty() {
            let mut data = data;
            let rest = data.split_off(end);
            self.partial.extend_from_slice(&rest);
            return data;
        }
        self.partial.extend_from_slice(&data);
        match end_of_last_event(&self.partial) {
            0 if self.partial.len() > MAX_EVENT_BYTES => {
                self.overflow = true;
                self.partial.split().freeze()
            }
            0 => Bytes::new(),
            end => self.partial.split_to(end).freeze(),
        }
    }

    /// Drops what waited (the stream broke inside that event).
    pub(super) fn clear(&mut self) {
        self.partial.clear();
    }
}

/// The length of `data`'s whole events (0: none ends in it).
fn end_of_last_event(data: &[u8]) -> usize {
    // An engine's frame is most often whole events: no search then.
    if data.ends_with(b"\n\n") {
        return data.len();
    }
    static LF: LazyLock<FinderRev<'static>> = LazyLock::new(|| FinderRev::new(b"\n\n"));
    static CRLF: LazyLock<FinderRev<'static>> = LazyLock::new(|| FinderRev::new(b"\r\n\r\n"));
    let lf = LF.rfind(data).map_or(0, |i| i + 2);
    let crlf = CRLF.rfind(data).map_or(0, |i| i + 4);
    lf.max(crlf)
}

/// The events of `data` (whole events), each without its blank line.
pub(super) fn split(data: &[u8]) -> impl Iterator<Item = &[u8]> {
    data.split(|b| *b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
        .filter(|line| !line.is_empty())
}

/// The JSON of a `data:` line (`None`: another field, or `[DONE]`).
pub(super) fn data_json(line: &[u8]) -> Option<&[u8]> {
    let data = line.strip_prefix(b"data:")?.trim_ascii_start();
    (data != b"[DONE]").then_some(data)
}

/// Whether the `data:` line `line` is an engine's error event: vLLM's
/// `{"error": {...}}` (and its older `{"object": "error", ...}`), as it
/// streams a failure after the answer began.
pub(super) fn is_error(line: &[u8]) -> bool {
    let Some(json) = data_json(line) else {
        return false;
    };
    if !may_hold_error(json) {
        return false;
    }
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(json) else {
        return false;
    };
    value.get("error").is_some_and(|e| !e.is_null()) || value.get("object").and_then(|o| o.as_str()) == Some("error")
}

/// Whether `data` may hold an error event (a cheap scan first).
pub(super) fn may_hold_error(data: &[u8]) -> bool {
    static ERROR: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"error"));
    ERROR.find(data).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_event_waits_for_its_end() {
        let mut whole = WholeEvents::default();
        assert_eq!(
            whole.feed(Bytes::from_static(b"data: 1\n\ndata: 2")),
            &b"data: 1\n\n"[..]
        );
        assert_eq!(whole.feed(Bytes::from_static(b"2\n")), &b""[..]);
        assert_eq!(
            whole.feed(Bytes::from_static(b"\ndata: 3\n\n")),
            &b"data: 22\n\ndata: 3\n\n"[..]
        );
        assert_eq!(
            whole.feed(Bytes::from_static(b"data: 4\r\n\r\n")),
            &b"data: 4\r\n\r\n"[..]
        );
        assert_eq!(whole.feed(Bytes::from_static(b"data: 5")), &b""[..]);
        whole.clear();
        assert_eq!(whole.feed(Bytes::from_static(b"data: 6\n\n")), &b"data: 6\n\n"[..]);
        // An event that never ends is not held: past the bound it goes on.
        let line = Bytes::from(vec![b'x'; 64 << 10]);
        let held: usize = (0..16).map(|_| whole.feed(line.clone()).len()).sum();
        assert_eq!(held, 0);
        assert_eq!(whole.feed(line.clone()).len(), 17 * line.len());
        assert!(whole.overflow);
        assert_eq!(whole.feed(line.clone()).len(), line.len());
    }

    #[test]
    fn error_events_are_told_from_chunks() {
        assert!(is_error(br#"data: {"error":{"message":"x","code":500}}"#));
        assert!(is_error(br#"data: {"object":"error","message":"x","code":500}"#));
        // A chunk whose text says "error" is a chunk.
        assert!(!is_error(
            br#"data: {"id":"c","choices":[{"delta":{"content":"an error"}}]}"#
        ));
        assert!(!is_error(b"data: [DONE]"));
        assert!(!is_error(b"event: error"));
        let events: Vec<&[u8]> = split(b"data: a\n\ndata: b\r\n\r\n").collect();
        assert_eq!(events, [&b"data: a"[..], &b"data: b"[..]]);
    }
}
