//! The id of a response the engine stores (a Responses API answer with
//! `store` on), read from the answer as it passes the relay, so that a
//! later request with `previous_response_id` reaches that engine
//! ([`crate::routing::affinity`]).
//!
//! The id is recorded the moment it is seen: in a stream, from its first
//! event (`response.created`, before any output); in a JSON body, from its
//! head. An agent sends its next turn the instant the answer ends, and by
//! then the id is in the table. The id is the first `"id"` member whose
//! string value starts with `resp` (vLLM's, SGLang's, llama.cpp's and
//! OpenAI's `resp_…`; output items' ids start otherwise), within the
//! answer's first [`HEAD_BYTES`].

use memchr::memmem;

/// Bytes of an answer searched for its id.
const HEAD_BYTES: usize = 16 << 10;

/// Looks for a stored response's id in an answer's first bytes.
#[derive(Debug, Default)]
pub(super) struct StoredId {
    head: Vec<u8>,
    /// Searched past this many bytes of `head` already.
    searched: usize,
    /// Found, or given up.
    done: bool,
}

impl StoredId {
    /// Feeds the answer's next bytes; the id, the first time it is seen.
    pub fn feed(&mut self, data: &[u8]) -> Option<String> {
        if self.done {
            return None;
        }
        let room = HEAD_BYTES.saturating_sub(self.head.len());
        self.head.extend_from_slice(&data[..data.len().min(room)]);
        // A member cut at the frame's end is searched again with the rest.
        let from = self.searched.saturating_sub(64);
        let found = find_id(&self.head[from..]);
        self.searched = self.head.len();
        if found.is_some() || self.head.len() >= HEAD_BYTES {
            self.done = true;
            self.head = Vec::new();
        }
        found
    }
}

/// The first `"id": "resp…"` member's value in `bytes`.
fn find_id(bytes: &[u8]) -> Option<String> {
    for at in memmem::find_iter(bytes, b"\"id\"") {
        let rest = bytes[at + 4..].trim_ascii_start();
        let Some(rest) = rest.strip_prefix(b":") else { continue };
        let Some(rest) = rest.trim_ascii_start().strip_prefix(b"\"") else {
            continue;
        };
        let Some(end) = rest.iter().position(|b| *b == b'"' || *b == b'\\') else {
            continue;
        };
        if rest[end] == b'"' && rest.starts_with(b"resp") {
            return std::str::from_utf8(&rest[..end]).ok().map(str::to_owned);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_is_found_in_a_stream_or_a_body_cut_anywhere() {
        let stream = concat!(
            "event: response.created\n",
            "data: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\": \"resp_7f3a\",\"object\":\"response\"}}\n\n",
        );
        for cut in 1..stream.len() {
            let mut s = StoredId::default();
            let first = s.feed(&stream.as_bytes()[..cut]);
            let second = s.feed(&stream.as_bytes()[cut..]);
            assert_eq!(first.or(second).as_deref(), Some("resp_7f3a"), "cut at {cut}");
            assert_eq!(s.feed(stream.as_bytes()), None, "once");
        }
        let body = br#"{"output":[{"id":"msg_1","type":"message"}],"id":"resp_9"}"#;
        assert_eq!(StoredId::default().feed(body).as_deref(), Some("resp_9"));
        assert_eq!(StoredId::default().feed(br#"{"id":"chatcmpl-1"}"#), None);
        let mut long = StoredId::default();
        assert_eq!(long.feed(&vec![b' '; HEAD_BYTES + 10]), None);
        assert_eq!(long.feed(br#"{"id":"resp_late"}"#), None, "past the head");
    }
}
