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

fn responses(body: &str) -> Result<ResponsesRequest, ApiError> {
    ResponsesRequest::parse(body.as_bytes())
}

fn messages(body: &str) -> Result<MessagesRequest, ApiError> {
    MessagesRequest::parse(body.as_bytes())
}

/// Each message as `role: content {fields as JSON}`, to compare in one go.
fn show(conversation: &Conversation) -> Vec<String> {
    conversation
        .messages
        .iter()
        .map(|m| {
            let fields: Vec<String> = m.fields.iter().map(|(k, v)| format!("{k}={}", v.to_json())).collect();
            format!("{}: {} {}", m.role, m.content, fields.join(" "))
                .trim_end()
                .to_owned()
        })
        .collect()
}

fn tools_json(conversation: &Conversation) -> Vec<String> {
    conversation.tools.iter().flatten().map(|t| t.to_json()).collect()
}

#[test]
fn chat_tools_tool_calls_and_reasoning() {
    let r = chat(
        r#"{"messages":[
            {"role":"user","content":[{"type":"input_text","text":"a"},{"type":"image_url","image_url":{}},{"type":"refusal","refusal":"x","text":"b"}],"name":"ann"},
            {"role":"assistant","content":null,"reasoning_content":"hm","tool_calls":[
                {"id":"c1","type":"function","function":{"name":"f","arguments":"{\"z\": 1, \"a\": [2.5]}"}},
                {"id":"c2","type":"function","function":{"name":"g","arguments":"not json"}},
                {"id":"c3","type":"function","function":{"name":"h","arguments":{"y":true,"b":null}}}]},
            {"role":"tool","tool_call_id":"c1","content":"42"}],
          "tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"z":{},"a":{}}}}},
                   {"type":"function","function":{"name":"g","description":"G","strict":true}}],
          "tool_choice":"auto"}"#,
    )
    .unwrap();
    let c = &r.conversation;
    assert_eq!(
        show(c),
        [
            r#"user: a\nb name="ann""#.replace("\\n", "\n"),
            r#"assistant:  tool_calls=[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"z": 1, "a": [2.5]}}}, {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {}}}, {"id": "c3", "type": "function", "function": {"name": "h", "arguments": {"y": true, "b": null}}}] reasoning="hm" reasoning_content="hm""#.into(),
            r#"tool: 42 tool_call_id="c1""#.into(),
        ]
    );
    assert_eq!(
        tools_json(c),
        [
            r#"{"type": "function", "function": {"name": "f", "description": null, "parameters": {"type": "object", "properties": {"z": {}, "a": {}}}}}"#,
            r#"{"type": "function", "function": {"name": "g", "description": "G", "parameters": null, "strict": true}}"#,
        ]
    );
    // After a tool result the answer is text.
    assert_eq!(c.tool_to_call(), None);
    let ask = |extra: &str| {
        chat(&format!(
            r#"{{"messages":[{{"role":"user","content":"x"}}],"tools":[{{"type":"function","function":{{"name":"f"}}}},{{"type":"function","function":{{"name":"g"}}}}]{extra}}}"#
        ))
        .unwrap()
        .conversation
    };
    let name = |c: &Conversation| {
        c.tool_to_call()
            .and_then(|f| f.get("name"))
            .and_then(Ordered::as_str)
            .map(str::to_owned)
    };
    assert_eq!(name(&ask("")).as_deref(), Some("f"));
    assert_eq!(name(&ask(r#","tool_choice":"required""#)).as_deref(), Some("f"));
    assert_eq!(name(&ask(r#","tool_choice":"none""#)), None);
    assert_eq!(
        name(&ask(r#","tool_choice":{"type":"function","function":{"name":"g"}}"#)).as_deref(),
        Some("g")
    );
}

#[test]
fn responses_requests() {
    let r = responses(r#"{"model":"m","input":"hi","max_output_tokens":9,"store":false,"stream":true}"#).unwrap();
    assert_eq!(r.model.as_deref(), Some("m"));
    assert_eq!(
        (r.params.max_tokens, r.params.stream, r.echo.store),
        (Some(9), true, false)
    );
    assert_eq!(show(&r.messages(Vec::new())), ["user: hi"]);

    let r = responses(
        r#"{"instructions":"be brief","input":[
            {"role":"user","content":"q"},
            {"type":"reasoning","summary":[{"type":"summary_text","text":"think"}]},
            {"type":"message","role":"assistant","content":[{"type":"output_text","text":"let me look"}]},
            {"type":"function_call","call_id":"call_1","name":"f","arguments":"{\"b\":1,\"a\":2}"},
            {"type":"function_call_output","call_id":"call_1","output":[{"type":"input_text","text":"r1"},{"type":"input_text","text":"r2"}]},
            {"type":"web_search_call","id":"ws"},
            {"type":"function_call","call_id":"call_2","name":"f","arguments":"[]"}],
          "tools":[{"type":"function","name":"f","description":"F","parameters":{"type":"object","properties":{"b":{},"a":{}}},"strict":false},
                   {"type":"web_search_preview"}],
          "tool_choice":{"type":"function","name":"f"}}"#,
    )
    .unwrap();
    let history = vec![
        semlb_tokenizer::chat::ChatMessage::new("system", "old instructions"),
        semlb_tokenizer::chat::ChatMessage::new("user", "before"),
    ];
    let c = r.messages(history);
    assert_eq!(
        show(&c),
        [
            "system: be brief",
            "user: before",
            "user: q",
            r#"assistant: let me look reasoning="think" reasoning_content="think" tool_calls=[{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"b": 1, "a": 2}}}]"#,
            "tool: r1\nr2 tool_call_id=\"call_1\"",
            r#"assistant:  tool_calls=[{"id": "call_2", "type": "function", "function": {"name": "f", "arguments": []}}]"#,
        ]
    );
    assert_eq!(
        tools_json(&c),
        [
            r#"{"type": "function", "function": {"name": "f", "description": "F", "parameters": {"type": "object", "properties": {"b": {}, "a": {}}}, "strict": false}}"#
        ]
    );
    assert_eq!(c.tool_choice, ToolChoice::Named("f".into()));
    assert_eq!(r.echo.instructions.as_deref(), Some("be brief"));
    for (bad, param) in [
        (r#"{}"#, "input"),
        (r#"{"input":[]}"#, "input"),
        (r#"{"input":5}"#, "input"),
        (r#"{"input":["x"]}"#, "input[0]"),
        (r#"{"input":[{"content":"x"}]}"#, "input[0].type"),
        (r#"{"input":[{"role":"robot","content":"x"}]}"#, "input[0].role"),
        (r#"{"input":[{"role":"user"}]}"#, "input[0].content"),
        (r#"{"input":[{"type":"function_call","name":"f"}]}"#, "input[0].call_id"),
        (
            r#"{"input":[{"type":"function_call_output","call_id":"c","output":3}]}"#,
            "input[0].output",
        ),
        (r#"{"input":"x","tools":[{"type":"function"}]}"#, "tools[0].name"),
        (r#"{"input":"x","max_output_tokens":0}"#, "max_output_tokens"),
        (r#"{"input":"x","previous_response_id":7}"#, "previous_response_id"),
        (r#"{"input":"x","store":"yes"}"#, "store"),
    ] {
        let (status, p, msg) = err_param(responses(bad));
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(p.as_deref(), Some(param), "{bad}: {msg}");
    }
}

#[test]
fn messages_requests() {
    let r = messages(
        r#"{"model":"m","max_tokens":50,"stream":true,"metadata":{"user_id":"u"},"stop_sequences":["x"],"temperature":0.5,
          "system":[{"type":"text","text":"x-anthropic-billing-header: cc"},{"type":"text","text":"Be "},{"type":"text","text":"kind."}],
          "messages":[
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"image","source":{}},{"type":"text","text":"b"}]},
            {"role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":"s"},{"type":"text","text":"ok"},
                {"type":"tool_use","id":"toolu_1","name":"f","input":{"z":1,"a":2}}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":[{"type":"text","text":"r1"},{"type":"text","text":"r2"}]},{"type":"text","text":"thanks"}]},
            {"role":"assistant","content":"sure"},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_2","content":"only"}]}],
          "tools":[{"name":"f","description":"F","input_schema":{"properties":{"z":{}}}},{"type":"web_search_20250305","name":"web_search"}],
          "tool_choice":{"type":"tool","name":"f"}}"#,
    )
    .unwrap();
    assert_eq!((r.params.max_tokens, r.params.stream), (Some(50), true));
    let c = &r.conversation;
    assert_eq!(
        show(c),
        [
            "system: Be kind.",
            "user: a\nb",
            r#"assistant: ok reasoning="hm" reasoning_content="hm" tool_calls=[{"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": {"z": 1, "a": 2}}}]"#,
            "tool: r1\nr2 tool_call_id=\"toolu_1\"",
            "user: thanks",
            "assistant: sure",
            "tool: only tool_call_id=\"toolu_2\"",
        ]
    );
    assert_eq!(
        tools_json(c),
        [
            r#"{"type": "function", "function": {"name": "f", "description": "F", "parameters": {"type": "object", "properties": {"z": {}}}}}"#
        ]
    );
    assert_eq!(c.tool_choice, ToolChoice::Named("f".into()));
    let none = messages(
        r#"{"max_tokens":5,"messages":[{"role":"user","content":"x"}],"tools":[{"name":"f","input_schema":{}}],"tool_choice":{"type":"none"}}"#,
    )
    .unwrap();
    assert_eq!(none.conversation.tool_to_call(), None);
    for (bad, param) in [
        (r#"{"messages":[{"role":"user","content":"x"}]}"#, "max_tokens"),
        (
            r#"{"max_tokens":0,"messages":[{"role":"user","content":"x"}]}"#,
            "max_tokens",
        ),
        (r#"{"max_tokens":5}"#, "messages"),
        (r#"{"max_tokens":5,"messages":[]}"#, "messages"),
        (
            r#"{"max_tokens":5,"messages":[{"role":"system","content":"x"}]}"#,
            "messages[0].role",
        ),
        (
            r#"{"max_tokens":5,"messages":[{"role":"user"}]}"#,
            "messages[0].content",
        ),
        (
            r#"{"max_tokens":5,"messages":[{"role":"user","content":[{"text":"x"}]}]}"#,
            "messages[0].content[0].type",
        ),
        (
            r#"{"max_tokens":5,"messages":[{"role":"assistant","content":[{"type":"tool_use","name":"f"}]}]}"#,
            "messages[0].content[0].id",
        ),
        (
            r#"{"max_tokens":5,"system":[{"type":"image"}],"messages":[{"role":"user","content":"x"}]}"#,
            "system[0]",
        ),
        (
            r#"{"max_tokens":5,"messages":[{"role":"user","content":"x"}],"tools":[{"input_schema":{}}]}"#,
            "tools[0].name",
        ),
    ] {
        let (status, p, msg) = err_param(messages(bad));
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(p.as_deref(), Some(param), "{bad}: {msg}");
    }
}

fn weather_call(id: &str) -> ToolCall {
    let function =
        Ordered::parse(r#"{"name":"get_weather","parameters":{"properties":{"city":{},"unit":{}}}}"#).unwrap();
    ToolCall::to(&function, id.into(), "paris")
}

fn meta(endpoint: Endpoint, id: &str) -> ResponseMeta {
    ResponseMeta {
        endpoint,
        id: id.into(),
        created: 5,
        model: "m".into(),
    }
}

const USAGE: Usage = Usage {
    prompt_tokens: 10,
    completion_tokens: 3,
    cached_tokens: 8,
};

fn spec(endpoint: Endpoint, id: &str, call: Option<ToolCall>, finish: FinishReason) -> AnswerSpec {
    AnswerSpec {
        meta: meta(endpoint, id),
        finish,
        call,
        include_usage: false,
        expected: 3,
        echo: None,
    }
}

/// The events a writer streams for tokens `texts`, as (event name, data).
fn stream_events(spec: &AnswerSpec, texts: &[&str]) -> Vec<(Option<String>, Value)> {
    let mut writer = spec.writer(10, 8);
    let mut out = std::collections::VecDeque::new();
    writer.start(&mut out);
    for (i, text) in texts.iter().enumerate() {
        writer.token(i as u32, text, &mut out);
    }
    writer.end(USAGE, &mut out);
    out.iter()
        .map(|event| {
            let event = std::str::from_utf8(event).unwrap();
            let (name, data) = match event.strip_prefix("event: ") {
                Some(rest) => {
                    let (name, data) = rest.split_once('\n').unwrap();
                    (Some(name.to_owned()), data)
                }
                None => (None, event),
            };
            let data = data.strip_prefix("data: ").unwrap().trim_end();
            (name, serde_json::from_str(data).unwrap_or(Value::String(data.into())))
        })
        .collect()
}

#[test]
fn chat_tool_call_answers() {
    let call = weather_call("call_1");
    let v: Value = serde_json::from_slice(
        &spec(
            Endpoint::Chat,
            "chatcmpl-1",
            Some(call.clone()),
            FinishReason::ToolCalls,
        )
        .body(String::new(), USAGE),
    )
    .unwrap();
    assert_eq!(
        v["choices"][0]["message"],
        serde_json::json!({"role":"assistant","content":null,"tool_calls":[
            {"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"paris\"}"}}]})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    let events = stream_events(
        &spec(Endpoint::Chat, "chatcmpl-1", Some(call), FinishReason::ToolCalls),
        &["a", "b", "c"],
    );
    let deltas: Vec<&Value> = events[1..events.len() - 1]
        .iter()
        .map(|(_, v)| &v["choices"][0]["delta"]["tool_calls"][0])
        .collect();
    assert_eq!(deltas[0]["id"], "call_1");
    assert_eq!(deltas[0]["function"]["name"], "get_weather");
    let arguments: String = deltas
        .iter()
        .map(|d| d["function"]["arguments"].as_str().unwrap())
        .collect();
    assert_eq!(arguments, r#"{"city": "paris"}"#);
    assert_eq!(events[events.len() - 2].1["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(events.last().unwrap().1, Value::String("[DONE]".into()));
}

#[test]
fn responses_answers() {
    let text = spec(Endpoint::Responses, "resp_ab", None, FinishReason::Stop);
    // OpenAI's member order: the id first (a gateway reads it from the head).
    let body = text.body(" a b c".into(), USAGE);
    assert!(body.starts_with(br#"{"id":"resp_ab","object":"response","created_at":5,"status":"completed""#));
    let mut writer = text.writer(10, 8);
    let mut head = std::collections::VecDeque::new();
    writer.start(&mut head);
    assert!(head[0].starts_with(
        b"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_ab\""
    ));
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        (v["object"].as_str(), v["status"].as_str()),
        (Some("response"), Some("completed"))
    );
    assert_eq!(
        v["output"],
        serde_json::json!([{"type":"message","id":"msg_ab","status":"completed","role":"assistant",
            "content":[{"type":"output_text","text":" a b c","annotations":[],"logprobs":[]}]}])
    );
    assert_eq!(
        v["usage"],
        serde_json::json!({"input_tokens":10,"input_tokens_details":{"cached_tokens":8,"cache_write_tokens":0},"output_tokens":3,
            "output_tokens_details":{"reasoning_tokens":0},"total_tokens":13})
    );
    let cut = spec(Endpoint::Responses, "resp_ab", None, FinishReason::Length);
    let v: Value = serde_json::from_slice(&cut.body("x".into(), USAGE)).unwrap();
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");

    let events = stream_events(&text, &[" a", " b", " c"]);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"].as_str(), name.as_deref());
        assert_eq!(data["sequence_number"], i);
    }
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    assert_eq!(events[7].1["text"], " a b c");
    assert_eq!(events[10].1["response"]["output"][0]["content"][0]["text"], " a b c");

    let call = spec(
        Endpoint::Responses,
        "resp_ab",
        Some(weather_call("call_ab")),
        FinishReason::ToolCalls,
    );
    let v: Value = serde_json::from_slice(&call.body(String::new(), USAGE)).unwrap();
    assert_eq!(
        v["output"],
        serde_json::json!([{"type":"function_call","id":"fc_ab","call_id":"call_ab","name":"get_weather",
            "arguments":"{\"city\": \"paris\"}","status":"completed"}])
    );
    let events = stream_events(&call, &["x", "y", "z"]);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
    assert_eq!(names[2], "response.output_item.added");
    assert_eq!(events[2].1["item"]["arguments"], "");
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n.as_deref() == Some("response.function_call_arguments.delta"))
        .map(|(_, v)| v["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, r#"{"city": "paris"}"#);
    assert_eq!(
        names[names.len() - 3..],
        [
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
}

#[test]
fn messages_answers() {
    let text = spec(Endpoint::Messages, "msg_ab", None, FinishReason::Stop);
    let v: Value = serde_json::from_slice(&text.body(" a b".into(), USAGE)).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"id":"msg_ab","type":"message","role":"assistant","model":"m",
            "content":[{"type":"text","text":" a b"}],"stop_reason":"end_turn","stop_sequence":null,
            "usage":{"input_tokens":2,"output_tokens":3,"cache_read_input_tokens":8,"cache_creation_input_tokens":0}})
    );
    let max = spec(Endpoint::Messages, "msg_ab", None, FinishReason::Length);
    let v: Value = serde_json::from_slice(&max.body(String::new(), USAGE)).unwrap();
    assert_eq!(v["stop_reason"], "max_tokens");
    // The tool_use block's input keeps its keys' order.
    let function = Ordered::parse(r#"{"name":"f","parameters":{"properties":{"zeta":{}}}}"#).unwrap();
    let call = spec(
        Endpoint::Messages,
        "msg_ab",
        Some(ToolCall::to(&function, "toolu_ab".into(), "w")),
        FinishReason::ToolCalls,
    );
    let body = call.body(String::new(), USAGE);
    let s = std::str::from_utf8(&body).unwrap();
    assert!(
        s.contains(r#""content":[{"type":"tool_use","id":"toolu_ab","name":"f","input":{"zeta":"w"}}],"stop_reason":"tool_use""#),
        "{s}"
    );

    let events = stream_events(&text, &[" a", " b", " c"]);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    for (name, data) in &events {
        assert_eq!(data["type"].as_str(), name.as_deref());
    }
    assert_eq!(
        events[0].1["message"]["usage"],
        serde_json::json!({"input_tokens":2,"output_tokens":1,"cache_read_input_tokens":8,"cache_creation_input_tokens":0})
    );
    assert_eq!(events[0].1["message"]["content"], serde_json::json!([]));
    assert_eq!(
        events[1].1["content_block"],
        serde_json::json!({"type":"text","text":""})
    );
    assert_eq!(
        events[3].1["delta"],
        serde_json::json!({"type":"text_delta","text":" a"})
    );
    assert_eq!(events[7].1["delta"]["stop_reason"], "end_turn");
    assert_eq!(events[7].1["usage"]["output_tokens"], 3);

    let events = stream_events(&call, &["x", "y", "z"]);
    assert_eq!(
        events[1].1["content_block"],
        serde_json::json!({"type":"tool_use","id":"toolu_ab","name":"f","input":{}})
    );
    let partial: String = events
        .iter()
        .filter(|(n, _)| n.as_deref() == Some("content_block_delta"))
        .map(|(_, v)| v["delta"]["partial_json"].as_str().unwrap())
        .collect();
    assert_eq!(partial, r#"{"zeta": "w"}"#);
    assert_eq!(events[events.len() - 2].1["delta"]["stop_reason"], "tool_use");
}

#[test]
fn anthropic_and_responses_error_bodies() {
    let v: Value = serde_json::from_slice(
        &ApiError::bad_request("nope", Some("max_tokens"))
            .in_anthropic_format()
            .body(),
    )
    .unwrap();
    assert_eq!(
        v,
        serde_json::json!({"type":"error","error":{"type":"invalid_request_error","message":"nope"}})
    );
    let v: Value = serde_json::from_slice(&ApiError::model_not_found("x").in_anthropic_format().body()).unwrap();
    assert_eq!(v["error"]["type"], "not_found_error");
    let e = ApiError::server_error(StatusCode::INTERNAL_SERVER_ERROR, "boom").in_anthropic_format();
    let v: Value = serde_json::from_slice(&e.body()).unwrap();
    assert_eq!(v["error"]["type"], "api_error");
    let v: Value = serde_json::from_slice(&ApiError::response_not_found("resp_x").body()).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"error":{"message":"Response with id 'resp_x' not found.","type":"invalid_request_error",
            "param":"previous_response_id","code":"response_not_found"}})
    );
    assert_eq!(ApiError::response_not_found("resp_x").status, StatusCode::NOT_FOUND);
}
