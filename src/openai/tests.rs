//! The three conversational APIs against each other: one agent
//! conversation (a tool call, its result, an answer, a new question) sent
//! as a chat completion, as a Responses request and as an Anthropic
//! Messages request renders to the same prompt, with the canonical template
//! and with Qwen2.5's (which renders tools and tool calls), so a session
//! finds its blocks whichever API it speaks.

use semlb_tokenizer::chat::ChatTemplate;

use super::prompt::{Endpoint, RequestLimits, RoutingInput, parse};

const CHAT: &str = r#"{"model":"m","tools":[{"type":"function","function":{"name":"get_weather","description":"Weather of a city.","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}],
 "messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Weather in Paris?"},
  {"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
  {"role":"tool","tool_call_id":"call_1","content":"18C"},
  {"role":"assistant","content":"It is 18C."},{"role":"user","content":"And Rome?"}]}"#;

const RESPONSES: &str = r#"{"model":"m","instructions":"Be brief.","tools":[{"type":"function","name":"get_weather","description":"Weather of a city.","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}},{"type":"web_search"}],
 "input":[{"role":"user","content":"Weather in Paris?"},
  {"type":"function_call","call_id":"call_1","name":"get_weather","arguments":"{\"city\":\"Paris\"}"},
  {"type":"function_call_output","call_id":"call_1","output":"18C"},
  {"type":"message","role":"assistant","content":[{"type":"output_text","text":"It is 18C."}]},
  {"role":"user","content":[{"type":"input_text","text":"And Rome?"}]}]}"#;

const MESSAGES: &str = r#"{"model":"m","max_tokens":64,"system":[{"type":"text","text":"Be brief."}],"tools":[{"name":"get_weather","description":"Weather of a city.","input_schema":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}],
 "messages":[{"role":"user","content":"Weather in Paris?"},
  {"role":"assistant","content":[{"type":"tool_use","id":"call_1","name":"get_weather","input":{"city":"Paris"}}]},
  {"role":"user","content":[{"type":"tool_result","tool_use_id":"call_1","content":[{"type":"text","text":"18C"}]}]},
  {"role":"assistant","content":[{"type":"text","text":"It is 18C."}]},
  {"role":"user","content":"And Rome?"}]}"#;

fn text(endpoint: Endpoint, body: &str, template: &ChatTemplate) -> String {
    let parsed = parse(endpoint, body.as_bytes(), template, &RequestLimits::default()).unwrap();
    match parsed.input {
        RoutingInput::Text(t) => t.into_owned(),
        RoutingInput::Tokens(_) => panic!("text"),
    }
}

#[test]
fn one_conversation_renders_alike_through_every_api() {
    let qwen = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tokenizer/tests/templates/qwen2.5.jinja"
    ))
    .unwrap();
    for template in [
        ChatTemplate::canonical(),
        ChatTemplate::from_source(&qwen, None, None).unwrap(),
    ] {
        let chat = text(Endpoint::ChatCompletions, CHAT, &template);
        // The call's arguments as json.dumps writes the parsed object.
        assert!(
            chat.contains(r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#),
            "{chat}"
        );
        assert!(chat.contains("18C") && chat.contains("Weather of a city."), "{chat}");
        assert_eq!(
            text(Endpoint::Responses, RESPONSES, &template),
            chat,
            "{}",
            template.renderer_name()
        );
        assert_eq!(
            text(Endpoint::Messages, MESSAGES, &template),
            chat,
            "{}",
            template.renderer_name()
        );
    }
}

#[test]
fn the_earlier_answer_counts_its_tool_calls() {
    let template = ChatTemplate::canonical();
    let call_only = CHAT.replace(
        r#",
  {"role":"assistant","content":"It is 18C."},{"role":"user","content":"And Rome?"}"#,
        "",
    );
    let parsed = parse(
        Endpoint::ChatCompletions,
        call_only.as_bytes(),
        &template,
        &RequestLimits::default(),
    )
    .unwrap();
    assert_eq!(
        parsed.earlier_answer_bytes,
        r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#.len()
    );
}

#[test]
fn malformed_agent_requests_are_400s_naming_the_field() {
    let template = ChatTemplate::canonical();
    let refused = |endpoint, body: &str| {
        parse(endpoint, body.as_bytes(), &template, &RequestLimits::default())
            .err()
            .map(|e| (e.status.as_u16(), e.param, e.message))
    };
    let cases = [
        (Endpoint::Responses, r#"{"model":"m"}"#, "input"),
        (Endpoint::Responses, r#"{"model":"m","input":[]}"#, "input"),
        (
            Endpoint::Responses,
            r#"{"model":"m","input":[{"type":"function_call","name":"f"}]}"#,
            "input",
        ),
        (
            Endpoint::Responses,
            r#"{"model":"m","input":"x","instructions":7}"#,
            "instructions",
        ),
        (
            Endpoint::Responses,
            r#"{"model":"m","input":"x","max_output_tokens":0}"#,
            "max_output_tokens",
        ),
        (
            Endpoint::Responses,
            r#"{"model":"m","input":[{"role":"robot","content":"x"}]}"#,
            "input",
        ),
        (
            Endpoint::Messages,
            r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
            "max_tokens",
        ),
        (
            Endpoint::Messages,
            r#"{"model":"m","max_tokens":5,"messages":[]}"#,
            "messages",
        ),
        (
            Endpoint::Messages,
            r#"{"model":"m","max_tokens":5,"messages":[{"role":"system","content":"x"}]}"#,
            "messages",
        ),
        (
            Endpoint::Messages,
            r#"{"model":"m","max_tokens":5,"system":5,"messages":[{"role":"user","content":"x"}]}"#,
            "system",
        ),
        (
            Endpoint::Messages,
            r#"{"model":"m","max_tokens":5,"tools":[{"input_schema":{}}],"messages":[{"role":"user","content":"x"}]}"#,
            "tools",
        ),
        (
            Endpoint::ChatCompletions,
            r#"{"model":"m","tools":[{"type":"function"}],"messages":[{"role":"user","content":"x"}]}"#,
            "tools",
        ),
        (
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"assistant","tool_calls":[{"function":{}}]}]}"#,
            "messages",
        ),
    ];
    for (endpoint, body, param) in cases {
        let Some((status, got, message)) = refused(endpoint, body) else {
            panic!("{body} was taken")
        };
        assert_eq!((status, got), (400, Some(param)), "{body}: {message}");
    }
}
