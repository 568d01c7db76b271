//! Server-sent events as OpenAI-compatible servers send them: the framing
//! checked, the `data:` payloads and the streamed text read out.

use serde_json::Value;

/// The `data:` payloads of a whole SSE body, checking its framing: every
/// event is one `data: ` line followed by a blank line.
pub fn events(body: &str) -> Vec<String> {
    assert!(body.ends_with("\n\n"), "SSE body must end with a blank line: {body:?}");
    body.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|event| {
            let data = event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {event:?}"));
            assert!(!data.contains('\n'), "one line per event: {event:?}");
            data.to_owned()
        })
        .collect()
}

/// The text of a chat or completions stream, checking that `[DONE]` ends
/// it and appears once.
pub fn text(body: &str) -> String {
    let events = events(body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1, "{body}");
    let mut text = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap_or_else(|err| panic!("chunk not JSON ({err}): {e}"));
        if let Some(c) = v["choices"].get(0) {
            text.push_str(c["text"].as_str().or(c["delta"]["content"].as_str()).unwrap_or(""));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_and_text_of_a_chat_stream() {
        let body = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n\
                    data: {\"choices\":[{\"delta\":{\"content\":\" there\"}}]}\n\n\
                    data: [DONE]\n\n";
        assert_eq!(events(body).len(), 3);
        assert_eq!(text(body), "Hi there");
    }

    #[test]
    #[should_panic(expected = "not a data event")]
    fn a_comment_line_is_not_an_event() {
        events(": keep-alive\n\ndata: [DONE]\n\n");
    }
}
