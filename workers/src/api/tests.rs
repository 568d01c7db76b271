//! The API's unit tests: prompt forms, parameter checks, chat messages
//! (tools, tool calls, reasoning), Responses and Messages requests, the
//! output-length rule and override header, response, chunk, event and
//! error shapes.

use http::StatusCode;
use serde_json::Value;

use super::*;
use crate::engine::Usage;

fn completion(body: &str) -> Result<CompletionRequest, ApiError> {
    CompletionRequest::parse(body.as_bytes())
}

fn chat(body: &str) -> Result<ChatRequest, ApiError> {
    ChatRequest::parse(body.as_bytes())
}

fn err_param(r: Result<impl std::fmt::Debug, ApiError>) -> (StatusCode, Option<String>, String) {
    let e = r.expect_err("should be refused");
    (e.status, e.param, e.message)
}

#[test]
fn prompt_forms() {
    assert_eq!(
        completion(r#"{"prompt":"hi"}"#).unwrap().prompt,
        Prompt::Text("hi".into())
    );
    assert_eq!(
        completion(r#"{"prompt":["hi"]}"#).unwrap().prompt,
        Prompt::Text("hi".into())
    );
    assert_eq!(
        completion(r#"{"prompt":[1,2,3]}"#).unwrap().prompt,
        Prompt::Tokens(vec![1, 2, 3])
    );
    assert_eq!(
        completion(r#"{"prompt":[[4,5]]}"#).unwrap().prompt,
        Prompt::Tokens(vec![4, 5])
    );
    for bad in [
        r#"{"prompt":""}"#,
        r#"{"prompt":[]}"#,
        r#"{"prompt":[""]}"#,
        r#"{"prompt":[[]]}"#,
        r#"{"prompt":["a","b"]}"#,
        r#"{"prompt":[[1],[2]]}"#,
        r#"{"prompt":[-1]}"#,
        r#"{"prompt":[1.5]}"#,
        r#"{"prompt":[4294967296]}"#,
        r#"{"prompt":5}"#,
        r#"{"prompt":{"a":1}}"#,
        r#"{"prompt":[1,"a"]}"#,
        r#"{"prompt":[true]}"#,
        r#"{"prompt":null}"#,
        r#"{}"#,
    ] {
        let (status, param, _) = err_param(completion(bad));
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(param.as_deref(), Some("prompt"), "{bad}");
    }
}

#[test]
fn malformed_bodies_are_400() {
    for bad in ["", "{", "[1]", "\"x\"", "null", "{\"prompt\":\"a\",}"] {
        assert_eq!(err_param(completion(bad)).0, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(err_param(chat(bad)).0, StatusCode::BAD_REQUEST, "{bad}");
    }
}

#[test]
fn parameters_are_checked_and_unknown_fields_ignored() {
    let r = completion(
        r#"{"model":"m","prompt":"x","max_tokens":7,"stream":true,"stream_options":{"include_usage":true},
            "ignore_eos":true,"temperature":0.7,"top_p":1,"n":1,"user":"u","stop":["a"],"whatever":{"x":[1]}}"#,
    )
    .unwrap();
    assert_eq!(r.model.as_deref(), Some("m"));
    assert_eq!(
        r.params,
        GenParams {
            max_tokens: Some(7),
            stream: true,
            include_usage: true,
            ignore_eos: true,
            cache_salt: None,
        }
    );
    assert_eq!(
        completion(r#"{"prompt":"x","max_tokens":null}"#)
            .unwrap()
            .params
            .max_tokens,
        None
    );
    assert_eq!(
        completion(r#"{"prompt":"x","max_tokens":1e30}"#)
            .map(|_| ())
            .unwrap_err()
            .param
            .as_deref(),
        Some("max_tokens")
    );
    assert_eq!(
        completion(r#"{"prompt":"x","max_tokens":99999999999}"#)
            .unwrap()
            .params
            .max_tokens,
        Some(u32::MAX)
    );
    for (bad, param) in [
        (r#"{"prompt":"x","max_tokens":0}"#, "max_tokens"),
        (r#"{"prompt":"x","max_tokens":-3}"#, "max_tokens"),
        (r#"{"prompt":"x","max_tokens":"5"}"#, "max_tokens"),
        (r#"{"prompt":"x","max_tokens":2.5}"#, "max_tokens"),
        (r#"{"prompt":"x","stream":"yes"}"#, "stream"),
        (r#"{"prompt":"x","stream_options":true}"#, "stream_options"),
        (
            r#"{"prompt":"x","stream_options":{"include_usage":1}}"#,
            "stream_options.include_usage",
        ),
        (r#"{"prompt":"x","n":2}"#, "n"),
        (r#"{"prompt":"x","n":0}"#, "n"),
        (r#"{"prompt":"x","best_of":3}"#, "best_of"),
        (r#"{"prompt":"x","temperature":"hot"}"#, "temperature"),
        (r#"{"prompt":"x","model":3}"#, "model"),
        (r#"{"prompt":"x","echo":true}"#, "echo"),
        (r#"{"prompt":"x","stop":[1]}"#, "stop"),
        (r#"{"prompt":"x","ignore_eos":"no"}"#, "ignore_eos"),
    ] {
        let (status, p, msg) = err_param(completion(bad));
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(p.as_deref(), Some(param), "{bad}: {msg}");
    }
    assert_eq!(
        err_param(completion(r#"{"prompt":"x","n":2}"#)).2,
        "n > 1 is not supported"
    );
}

#[test]
fn chat_messages() {
    let r = chat(
        r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
            {"role":"assistant","content":null,"tool_calls":[]}],"max_tokens":5,"max_completion_tokens":9}"#,
    )
    .unwrap();
    let msgs: Vec<(&str, &str)> = r
        .conversation
        .messages
        .iter()
        .map(|m| (m.role.as_ref(), m.content.as_ref()))
        .collect();
    assert_eq!(msgs, [("system", "s"), ("user", "a\nb"), ("assistant", "")]);
    assert_eq!(r.params.max_tokens, Some(9));
    for (bad, param) in [
        (r#"{}"#, "messages"),
        (r#"{"messages":[]}"#, "messages"),
        (r#"{"messages":"hi"}"#, "messages"),
        (r#"{"messages":["hi"]}"#, "messages[0]"),
        (r#"{"messages":[{"content":"hi"}]}"#, "messages[0].role"),
        (r#"{"messages":[{"role":1,"content":"hi"}]}"#, "messages[0].role"),
        (r#"{"messages":[{"role":"user","content":5}]}"#, "messages[0].content"),
        (
            r#"{"messages":[{"role":"user","content":["hi"]}]}"#,
            "messages[0].content[0]",
        ),
        (
            r#"{"messages":[{"role":"user","content":[{"text":"hi"}]}]}"#,
            "messages[0].content[0]",
        ),
        (
            r#"{"messages":[{"role":"assistant","tool_calls":[{"function":{}}]}]}"#,
            "messages[0].tool_calls[0].function.name",
        ),
        (
            r#"{"messages":[{"role":"assistant","tool_calls":{}}]}"#,
            "messages[0].tool_calls",
        ),
        (
            r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]}"#,
            "tools[0]",
        ),
        (r#"{"messages":[{"role":"user","content":"x"}],"tools":{}}"#, "tools"),
        (
            r#"{"messages":[{"role":"user","content":"x"}],"tool_choice":3}"#,
            "tool_choice",
        ),
        (
            r#"{"messages":[{"role":"user","content":[{"type":"text"}]}]}"#,
            "messages[0].content[0]",
        ),
        (
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":3}]}]}"#,
            "messages[0].content[0].text",
        ),
        (
            r#"{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":0}"#,
            "max_completion_tokens",
        ),
        (r#"{"messages":[{"role":"user","content":"x"}],"n":5}"#, "n"),
    ] {
        let (status, p, msg) = err_param(chat(bad));
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(p.as_deref(), Some(param), "{bad}: {msg}");
    }
}

#[test]
fn output_length_rule() {
    let p = |max_tokens, ignore_eos| GenParams {
        max_tokens,
        ignore_eos,
        ..GenParams::default()
    };
    use FinishReason::*;
    // Override wins, capped by max_tokens.
    assert_eq!(output_length(&p(None, false), Some(300), 128), (300, Stop));
    assert_eq!(output_length(&p(Some(50), false), Some(300), 128), (50, Length));
    assert_eq!(output_length(&p(Some(500), true), Some(300), 128), (300, Stop));
    // ignore_eos with max_tokens: exactly max_tokens.
    assert_eq!(output_length(&p(Some(500), true), None, 128), (500, Length));
    // Otherwise min(max_tokens, default).
    assert_eq!(output_length(&p(Some(500), false), None, 128), (128, Stop));
    assert_eq!(output_length(&p(Some(20), false), None, 128), (20, Length));
    assert_eq!(output_length(&p(Some(128), false), None, 128), (128, Length));
    assert_eq!(output_length(&p(None, true), None, 128), (128, Stop));
    assert_eq!(output_length(&p(None, false), None, 128), (128, Stop));
}

#[test]
fn output_override_header() {
    assert_eq!(parse_output_override(b"42").unwrap(), 42);
    assert_eq!(parse_output_override(b" 7 ").unwrap(), 7);
    for bad in [&b"0"[..], b"-1", b"x", b"", b"99999999999", b"\xff"] {
        assert_eq!(
            parse_output_override(bad).unwrap_err().param.as_deref(),
            Some(OUTPUT_TOKENS_HEADER)
        );
    }
}

#[test]
fn response_shapes() {
    let usage = Usage {
        prompt_tokens: 10,
        completion_tokens: 3,
        cached_tokens: 8,
    };
    let meta = |endpoint| ResponseMeta {
        endpoint,
        id: "x-1".into(),
        created: 5,
        model: "m".into(),
    };
    let v = serde_json::to_value(CompletionResponse::new(
        &meta(Endpoint::Completions),
        "abc".into(),
        FinishReason::Length,
        usage,
    ))
    .unwrap();
    assert_eq!(
        v,
        serde_json::json!({"id":"x-1","object":"text_completion","created":5,"model":"m",
            "choices":[{"index":0,"text":"abc","logprobs":null,"finish_reason":"length"}],
            "usage":{"prompt_tokens":10,"completion_tokens":3,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":8}}})
    );
    let v = serde_json::to_value(CompletionResponse::new(
        &meta(Endpoint::Chat),
        "abc".into(),
        FinishReason::Stop,
        usage,
    ))
    .unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(
        v["choices"][0]["message"],
        serde_json::json!({"role":"assistant","content":"abc"})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["choices"][0].get("text").is_none());

    let sse = Chunk::chat_role(&meta(Endpoint::Chat), false).to_sse();
    let s = std::str::from_utf8(&sse).unwrap();
    assert!(s.starts_with("data: {") && s.ends_with("}\n\n"));
    let v: Value = serde_json::from_str(&s[6..]).unwrap();
    assert_eq!(v["object"], "chat.completion.chunk");
    assert_eq!(
        v["choices"][0]["delta"],
        serde_json::json!({"role":"assistant","content":""})
    );
    assert!(v.get("usage").is_none());

    let c = Chunk::token(
        &meta(Endpoint::Completions),
        " a".into(),
        Some(FinishReason::Stop),
        true,
    );
    let v = serde_json::to_value(&c).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], " a");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"], Value::Null);
    assert!(v.as_object().unwrap().contains_key("usage"));

    let v = serde_json::to_value(Chunk::usage(&meta(Endpoint::Chat), usage)).unwrap();
    assert_eq!(v["choices"], serde_json::json!([]));
    assert_eq!(v["usage"]["total_tokens"], 13);
}

#[test]
fn error_body_shape() {
    let e = ApiError::bad_request("nope", Some("prompt")).with_code("context_length_exceeded");
    let v: Value = serde_json::from_slice(&e.body()).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"error":{"message":"nope","type":"invalid_request_error","param":"prompt","code":"context_length_exceeded"}})
    );
    let v: Value = serde_json::from_slice(&ApiError::model_not_found("x").body()).unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
}
