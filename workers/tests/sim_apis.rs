//! End-to-end tests of `semlb-sim`'s conversational APIs beyond chat
//! completions: `POST /v1/responses` (OpenAI's Responses API, with
//! `previous_response_id`) and `POST /v1/messages` (Anthropic's Messages
//! API), and tool calls through all three. Each test starts the server
//! in-process on `127.0.0.1:0` at 100× speed and talks real HTTP/1.1 to
//! it. What is checked: the JSON and event shapes, streamed answers adding
//! up to the whole ones, later turns (text and tool-calling loops) served
//! from the prefix cache, stored responses continued, and the error
//! shapes of each API.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, StatusCode};
use semlb_test_support as support;
use semlb_tokenizer::Tokenizer;
use semlb_tokenizer::chat::ChatTemplate;
use semlb_workers::config::EngineConfig;
use semlb_workers::engine::Engine;
use semlb_workers::faults::FaultConfig;
use semlb_workers::metrics::MetricsFlavor;
use semlb_workers::server::{Sim, serve};
use serde_json::{Value, json};
use support::client::Reply;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const MODEL: &str = "test-model";
const BLOCK: u64 = 16;

/// Bound on any single wait in these tests.
const PATIENCE: Duration = Duration::from_secs(20);

struct Server {
    addr: SocketAddr,
    sim: Arc<Sim>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

async fn start_with(faults: FaultConfig) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let config = EngineConfig {
        model_name: MODEL.into(),
        time_scale: 0.01,
        ..EngineConfig::default()
    };
    let sim = Arc::new(Sim::new(
        Engine::start(config),
        Tokenizer::bundled(),
        ChatTemplate::canonical(),
        faults,
        MetricsFlavor::Vllm,
    ));
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, sim.clone(), async move {
        let _ = stopped.await;
    }));
    Server {
        addr,
        sim,
        stop: Some(stop),
        task,
    }
}

async fn start() -> Server {
    start_with(FaultConfig::default()).await
}

impl Server {
    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        support::client::within("graceful stop", PATIENCE, self.task)
            .await
            .expect("serve task")
            .expect("serve");
    }
}

async fn call(addr: SocketAddr, method: Method, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    support::client::call(addr, method, path, headers, body, PATIENCE).await
}

async fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    call(addr, Method::POST, path, &[], &body.to_string()).await
}

/// A 200 answer as JSON.
async fn ok(addr: SocketAddr, path: &str, body: &Value) -> Value {
    let r = post(addr, path, body).await;
    assert_eq!(r.status, StatusCode::OK, "{path}: {}", String::from_utf8_lossy(&r.body));
    r.json()
}

/// The named events of an SSE body: `event: NAME\ndata: JSON\n\n` each,
/// the data's `type` the event's name.
fn named_events(reply: &Reply) -> Vec<(String, Value)> {
    assert_eq!(reply.status, StatusCode::OK, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(
        reply.headers.get("content-type").and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    let body = std::str::from_utf8(&reply.body).expect("UTF-8");
    assert!(body.ends_with("\n\n"), "{body}");
    assert!(!body.contains("[DONE]"), "no data: [DONE] in named-event streams");
    body.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|event| {
            let (name, data) = event
                .strip_prefix("event: ")
                .and_then(|rest| rest.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("not a named event: {event:?}"));
            let data: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("not JSON ({e}): {data}"));
            assert_eq!(data["type"], name, "{event}");
            (name.to_owned(), data)
        })
        .collect()
}

fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(n, _)| n.as_str()).collect()
}

/// A long system prompt, so that turns span many blocks.
fn system_prompt(tag: &str) -> String {
    (0..60).map(|i| format!(" {tag}{}", i % 31)).collect()
}

fn weather_tool_chat() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}])
}

fn cached_header(reply: &Reply) -> u64 {
    reply
        .headers
        .get("x-semlb-sim-cached-tokens")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .expect("x-semlb-sim-cached-tokens")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_answer_whole_and_streamed() {
    let server = start().await;
    let body = json!({"model": MODEL, "instructions": "Be brief.", "input": "Say something.", "max_output_tokens": 6});
    let r = post(server.addr, "/v1/responses", &body).await;
    assert_eq!(r.status, StatusCode::OK);
    let first_cached = cached_header(&r);
    let v = r.json();
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("resp_")), "{v}");
    assert_eq!(v["object"], "response");
    assert_eq!(v["model"], MODEL);
    assert_eq!(v["status"], "incomplete", "cut at max_output_tokens");
    assert_eq!(v["store"], true);
    assert_eq!(v["instructions"], "Be brief.");
    assert!(v["created_at"].as_u64().is_some());
    let item = &v["output"][0];
    assert_eq!(item["type"], "message");
    assert_eq!(item["role"], "assistant");
    assert!(item["id"].as_str().is_some_and(|id| id.starts_with("msg_")));
    let text = item["content"][0]["text"].as_str().expect("text").to_owned();
    assert_eq!(text.split_whitespace().count(), 6);
    let usage = &v["usage"];
    assert_eq!(usage["output_tokens"], 6);
    let input = usage["input_tokens"].as_u64().expect("input_tokens");
    assert_eq!(usage["total_tokens"], input + 6);
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], first_cached);

    // The same request streamed: the same words, now from the cache.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = named_events(&post(server.addr, "/v1/responses", &streamed).await);
    let kinds = names(&events);
    assert_eq!(
        kinds[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ]
    );
    assert_eq!(
        kinds[kinds.len() - 4..],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    for (i, (_, data)) in events.iter().enumerate() {
        assert_eq!(data["sequence_number"], i);
    }
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().expect("delta"))
        .collect();
    assert_eq!(deltas, text);
    let done = &events.last().expect("events").1["response"];
    assert_eq!(done["output"][0]["content"][0]["text"], text.as_str());
    assert!(done["usage"]["input_tokens_details"]["cached_tokens"].as_u64() > Some(0));
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_answer_whole_and_streamed() {
    let server = start().await;
    let body = json!({"model": MODEL, "max_tokens": 7, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say something."}]}]});
    let headers = [("x-api-key", "k"), ("anthropic-version", "2023-06-01")];
    let r = call(server.addr, Method::POST, "/v1/messages", &headers, &body.to_string()).await;
    assert_eq!(r.status, StatusCode::OK);
    let v = r.json();
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("msg_")), "{v}");
    assert_eq!(
        (v["type"].as_str(), v["role"].as_str()),
        (Some("message"), Some("assistant"))
    );
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(v["stop_sequence"], Value::Null);
    assert_eq!(v["content"][0]["type"], "text");
    let text = v["content"][0]["text"].as_str().expect("text").to_owned();
    assert_eq!(v["usage"]["output_tokens"], 7);
    assert_eq!(v["usage"]["cache_read_input_tokens"], 0);
    let prompt = v["usage"]["input_tokens"].as_u64().expect("input_tokens");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = named_events(&post(server.addr, "/v1/messages", &streamed).await);
    let kinds = names(&events);
    assert_eq!(kinds[..3], ["message_start", "content_block_start", "ping"]);
    assert_eq!(
        kinds[kinds.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    let start = &events[0].1["message"];
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["usage"]["output_tokens"], 1);
    // A repeat: all whole blocks from the cache, input_tokens the rest.
    let cached = start["usage"]["cache_read_input_tokens"].as_u64().expect("cached");
    assert_eq!(cached, (prompt - 1) / BLOCK * BLOCK);
    assert_eq!(start["usage"]["input_tokens"], prompt - cached);
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| {
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().expect("text")
        })
        .collect();
    assert_eq!(deltas, text);
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
    assert_eq!(delta["usage"]["output_tokens"], 7);
    server.stop().await;
}

/// The tokens of the whole blocks of a turn of `tokens` (prompt and
/// output) that the engine caches: all but the last output token have
/// their KV computed, as in vLLM.
fn whole_blocks(tokens: u64) -> u64 {
    (tokens - 1) / BLOCK * BLOCK
}

/// The cached tokens of an answer of each API.
fn cached_of(path: &str, v: &Value) -> u64 {
    let cached = match path {
        "/v1/chat/completions" => &v["usage"]["prompt_tokens_details"]["cached_tokens"],
        "/v1/responses" => &v["usage"]["input_tokens_details"]["cached_tokens"],
        _ => &v["usage"]["cache_read_input_tokens"],
    };
    cached.as_u64().expect("cached tokens")
}

/// Prompt and output tokens of an answer of each API.
fn tokens_of(path: &str, v: &Value) -> (u64, u64) {
    let u = &v["usage"];
    let n = |f: &str| u[f].as_u64().unwrap_or_else(|| panic!("{f} in {u}"));
    match path {
        "/v1/chat/completions" => (n("prompt_tokens"), n("completion_tokens")),
        "/v1/responses" => (n("input_tokens"), n("output_tokens")),
        _ => (n("input_tokens") + n("cache_read_input_tokens"), n("output_tokens")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_turn_hits_the_cache_in_each_api() {
    let server = start().await;
    for path in ["/v1/chat/completions", "/v1/responses", "/v1/messages"] {
        let system = system_prompt(&path[4..8]);
        let turn = |history: Vec<Value>| match path {
            "/v1/chat/completions" => {
                let mut messages = vec![json!({"role": "system", "content": system})];
                messages.extend(history);
                json!({"messages": messages, "max_tokens": 40})
            }
            "/v1/responses" => json!({"instructions": system, "input": history, "max_output_tokens": 40}),
            _ => json!({"system": system, "messages": history, "max_tokens": 40}),
        };
        let question = json!({"role": "user", "content": "Tell me about rivers."});
        let first = ok(server.addr, path, &turn(vec![question.clone()])).await;
        let answer = match path {
            "/v1/chat/completions" => first["choices"][0]["message"]["content"].clone(),
            "/v1/responses" => first["output"][0]["content"][0]["text"].clone(),
            _ => first["content"][0]["text"].clone(),
        };
        let history = vec![
            question,
            json!({"role": "assistant", "content": answer}),
            json!({"role": "user", "content": "And lakes?"}),
        ];
        let second = ok(server.addr, path, &turn(history)).await;
        let (prompt, output) = tokens_of(path, &first);
        let cached = cached_of(path, &second);
        // The whole blocks of turn 1's prompt and answer.
        assert!(
            cached >= whole_blocks(prompt + output),
            "{path}: {cached} of {prompt} + {output}"
        );
    }
    server.stop().await;
}

/// A JSON string literal.
fn quoted(v: &Value) -> String {
    v.to_string()
}

/// One turn of a tool-calling loop in `path`'s API: the request of
/// `history` (each item as JSON text: a `serde_json::Value` would sort the
/// keys, and the order of a tool call's keys is what the template renders),
/// and whether the answer is a call (then what to send back).
async fn tool_turn(addr: SocketAddr, path: &str, history: &[String], system: &str) -> (Value, Option<Vec<String>>) {
    let (history, system) = (history.join(","), quoted(&json!(system)));
    let body = match path {
        "/v1/chat/completions" => format!(
            r#"{{"messages":[{{"role":"system","content":{system}}},{history}],"tools":{}}}"#,
            weather_tool_chat()
        ),
        "/v1/responses" => format!(
            r#"{{"instructions":{system},"input":[{history}],"tools":[{{"type":"function","name":"get_weather",
                "parameters":{{"type":"object","properties":{{"city":{{}},"unit":{{}}}}}}}}]}}"#
        ),
        _ => format!(
            r#"{{"system":{system},"messages":[{history}],"max_tokens":1000,"tools":[{{"name":"get_weather",
                "input_schema":{{"type":"object","properties":{{"city":{{}},"unit":{{}}}}}}}}]}}"#
        ),
    };
    let r = call(addr, Method::POST, path, &[], &body).await;
    assert_eq!(r.status, StatusCode::OK, "{path}: {}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    let city = |arguments: &Value| {
        let arguments: Value = match arguments {
            Value::String(s) => serde_json::from_str(s).expect("arguments JSON"),
            other => other.clone(),
        };
        let keys: Vec<&String> = arguments.as_object().expect("arguments object").keys().collect();
        assert_eq!(keys, ["city"], "the first property");
    };
    let sent_back = match path {
        "/v1/chat/completions" => {
            let message = &v["choices"][0]["message"];
            (v["choices"][0]["finish_reason"] == "tool_calls").then(|| {
                assert_eq!(message["content"], Value::Null);
                let call = &message["tool_calls"][0];
                let (id, function) = (quoted(&call["id"]), &call["function"]);
                assert_eq!(function["name"], "get_weather");
                city(&function["arguments"]);
                let (name, arguments) = (quoted(&function["name"]), quoted(&function["arguments"]));
                vec![
                    format!(
                        r#"{{"role":"assistant","content":null,"tool_calls":[{{"id":{id},"type":"function",
                            "function":{{"name":{name},"arguments":{arguments}}}}}]}}"#
                    ),
                    format!(r#"{{"role":"tool","tool_call_id":{id},"content":"Sunny."}}"#),
                ]
            })
        }
        "/v1/responses" => {
            let item = &v["output"][0];
            (item["type"] == "function_call").then(|| {
                assert_eq!(item["name"], "get_weather");
                city(&item["arguments"]);
                vec![
                    json!({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                        "arguments": item["arguments"]})
                    .to_string(),
                    json!({"type": "function_call_output", "call_id": item["call_id"], "output": "Sunny."}).to_string(),
                ]
            })
        }
        _ => {
            let block = &v["content"][0];
            (v["stop_reason"] == "tool_use").then(|| {
                assert_eq!(block["type"], "tool_use");
                city(&block["input"]);
                vec![
                    json!({"role": "assistant", "content": [block]}).to_string(),
                    json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"],
                        "content": "Sunny."}]})
                    .to_string(),
                ]
            })
        }
    };
    (v, sent_back)
}

/// The text of a text answer of `path`'s API.
fn text_of(path: &str, v: &Value) -> Value {
    match path {
        "/v1/chat/completions" => v["choices"][0]["message"]["content"].clone(),
        "/v1/responses" => v["output"][0]["content"][0]["text"].clone(),
        _ => v["content"][0]["text"].clone(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calling_loops_hit_the_cache_in_each_api() {
    let server = start().await;
    for path in ["/v1/chat/completions", "/v1/responses", "/v1/messages"] {
        let system = system_prompt(&path[4..8]);
        let mut history = vec![json!({"role": "user", "content": "What is the weather in Paris?"}).to_string()];
        let mut previous: Option<(u64, u64)> = None;
        let mut cached_seen = Vec::new();
        for turn in 0..5 {
            let (v, sent_back) = tool_turn(server.addr, path, &history, &system).await;
            assert_eq!(
                sent_back.is_some(),
                turn % 2 == 0,
                "{path} turn {turn}: a call, then text: {v}"
            );
            let cached = cached_of(path, &v);
            if let Some((prompt, output)) = previous {
                // Every whole block of the previous prompt and its output
                // (the call as the template renders it) is a hit.
                assert!(
                    cached >= whole_blocks(prompt + output),
                    "{path} turn {turn}: {cached} cached of {prompt} + {output}"
                );
            }
            cached_seen.push(cached);
            previous = Some(tokens_of(path, &v));
            match sent_back {
                Some(items) => history.extend(items),
                None => {
                    history.push(json!({"role": "assistant", "content": text_of(path, &v)}).to_string());
                    history.push(json!({"role": "user", "content": "And in Rome?"}).to_string());
                }
            }
        }
        assert!(
            cached_seen.windows(2).skip(1).all(|w| w[1] > w[0]) && cached_seen[1] > 0,
            "{path}: cached tokens grow from the second turn: {cached_seen:?}"
        );
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_tool_calls_in_each_api() {
    let server = start().await;
    let question = json!([{"role": "user", "content": "Weather in Oslo?"}]);
    // Chat: the first delta names the call, the others add up to its arguments.
    let chat = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": question, "tools": weather_tool_chat(), "stream": true}),
    )
    .await;
    let events = support::sse::events(std::str::from_utf8(&chat.body).expect("UTF-8"));
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let head = &chunks[1]["choices"][0]["delta"]["tool_calls"][0];
    assert_eq!(
        (head["type"].as_str(), head["function"]["name"].as_str()),
        (Some("function"), Some("get_weather"))
    );
    assert!(head["id"].as_str().is_some_and(|id| id.starts_with("call_")));
    let arguments: String = chunks[1..]
        .iter()
        .map(|c| {
            c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                .as_str()
                .expect("arguments")
        })
        .collect();
    assert!(serde_json::from_str::<Value>(&arguments).expect("JSON")["city"].is_string());
    assert_eq!(
        chunks.last().expect("chunks")["choices"][0]["finish_reason"],
        "tool_calls"
    );

    // Responses: a function_call item, its arguments in deltas.
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": {"properties": {"city": {}}}}]);
    let reply = post(
        server.addr,
        "/v1/responses",
        &json!({"input": question, "tools": tools, "stream": true}),
    )
    .await;
    let events = named_events(&reply);
    assert_eq!(events[2].1["item"]["type"], "function_call");
    assert_eq!(events[2].1["item"]["arguments"], "");
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.function_call_arguments.delta")
        .map(|(_, d)| d["delta"].as_str().expect("delta"))
        .collect();
    let done = &events.last().expect("events").1["response"];
    assert_eq!(done["output"][0]["arguments"], deltas.as_str());
    assert_eq!(done["status"], "completed");

    // Messages: a tool_use block, its input in input_json_delta pieces.
    let tools = json!([{"name": "get_weather", "input_schema": {"properties": {"city": {}}}}]);
    let reply = post(
        server.addr,
        "/v1/messages",
        &json!({"messages": question, "tools": tools, "max_tokens": 500, "stream": true}),
    )
    .await;
    let events = named_events(&reply);
    let block = &events[1].1["content_block"];
    assert_eq!(
        (block["type"].as_str(), block["input"].clone()),
        (Some("tool_use"), json!({}))
    );
    let partial: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["partial_json"].as_str().expect("partial_json"))
        .collect();
    assert!(serde_json::from_str::<Value>(&partial).expect("JSON")["city"].is_string());
    assert_eq!(events[events.len() - 2].1["delta"]["stop_reason"], "tool_use");

    // tool_choice none: text.
    let v = ok(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": question, "tools": weather_tool_chat(), "tool_choice": "none", "max_tokens": 3}),
    )
    .await;
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // A call that does not fit in max_tokens is not made.
    let v = ok(
        server.addr,
        "/v1/messages",
        &json!({"messages": question, "tools": tools, "max_tokens": 2}),
    )
    .await;
    assert_eq!(
        (v["content"][0]["type"].as_str(), v["stop_reason"].as_str()),
        (Some("text"), Some("max_tokens"))
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previous_response_id_continues_a_stored_conversation() {
    let server = start().await;
    let system = system_prompt("prev");
    let first = ok(
        server.addr,
        "/v1/responses",
        &json!({"instructions": system, "input": "Tell me about rivers.", "max_output_tokens": 30}),
    )
    .await;
    let id = first["id"].as_str().expect("id");
    let second = ok(
        server.addr,
        "/v1/responses",
        &json!({"instructions": system, "previous_response_id": id, "input": "And lakes?", "max_output_tokens": 30,
            "stream": false}),
    )
    .await;
    assert_eq!(second["previous_response_id"], id);
    let (prompt, output) = tokens_of("/v1/responses", &first);
    let (prompt2, _) = tokens_of("/v1/responses", &second);
    assert!(
        prompt2 > prompt + output,
        "the stored conversation and answer are in the prompt"
    );
    let cached = cached_of("/v1/responses", &second);
    assert!(
        cached >= whole_blocks(prompt + output),
        "{cached} of {prompt} + {output}"
    );

    // A streamed response is stored too, and continued.
    let reply = post(
        server.addr,
        "/v1/responses",
        &json!({"instructions": system, "previous_response_id": second["id"], "input": "And seas?", "stream": true,
            "max_output_tokens": 5}),
    )
    .await;
    let third = named_events(&reply).pop().expect("events").1["response"].clone();
    let fourth = ok(
        server.addr,
        "/v1/responses",
        &json!({"instructions": system, "previous_response_id": third["id"], "input": "Thanks.", "max_output_tokens": 5}),
    )
    .await;
    assert!(cached_of("/v1/responses", &fourth) > cached);

    // Not stored: not found later; unknown ids: 404 in OpenAI's shape.
    let unstored = ok(
        server.addr,
        "/v1/responses",
        &json!({"input": "x", "store": false, "max_output_tokens": 2}),
    )
    .await;
    assert_eq!(unstored["store"], false);
    for missing in [unstored["id"].as_str().expect("id"), "resp_nope"] {
        let r = post(
            server.addr,
            "/v1/responses",
            &json!({"input": "x", "previous_response_id": missing}),
        )
        .await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        assert_eq!(
            r.json(),
            json!({"error": {"message": format!("Response with id '{missing}' not found."),
                "type": "invalid_request_error", "param": "previous_response_id", "code": "response_not_found"}})
        );
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_in_each_apis_shape() {
    let server = start().await;
    let user = json!([{"role": "user", "content": "x"}]);
    // Anthropic's shape on /v1/messages.
    for (body, status, kind) in [
        (
            json!({"messages": user}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
        (
            json!({"max_tokens": 5}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
        (
            json!({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
        (
            json!({"model": "claude-x", "max_tokens": 5, "messages": user}),
            StatusCode::NOT_FOUND,
            "not_found_error",
        ),
    ] {
        let r = post(server.addr, "/v1/messages", &body).await;
        assert_eq!(r.status, status, "{body}");
        let v = r.json();
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], kind, "{v}");
        assert!(v["error"]["message"].is_string());
    }
    let r = call(server.addr, Method::POST, "/v1/messages", &[], "{not json").await;
    assert_eq!(
        (r.status, r.json()["error"]["type"].clone()),
        (StatusCode::BAD_REQUEST, json!("invalid_request_error"))
    );
    let r = call(server.addr, Method::GET, "/v1/messages", &[], "").await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.json()["type"], "error");
    // Too long for the context: 400 before the engine.
    let r = call(
        server.addr,
        Method::POST,
        "/v1/messages",
        &[("x-semlb-output-tokens", "1000000")],
        &json!({"max_tokens": 1_000_000, "messages": user}).to_string(),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");

    // OpenAI's shape on /v1/responses.
    for (body, status, param) in [
        (json!({}), StatusCode::BAD_REQUEST, "input"),
        (
            json!({"input": [{"role": "robot", "content": "x"}]}),
            StatusCode::BAD_REQUEST,
            "input[0].role",
        ),
        (
            json!({"input": "x", "max_output_tokens": 0}),
            StatusCode::BAD_REQUEST,
            "max_output_tokens",
        ),
        (json!({"input": "x", "model": "gpt-x"}), StatusCode::NOT_FOUND, "model"),
    ] {
        let r = post(server.addr, "/v1/responses", &body).await;
        assert_eq!(r.status, status, "{body}");
        assert_eq!(r.json()["error"]["param"], param, "{body}");
    }
    let r = call(
        server.addr,
        Method::POST,
        "/v1/responses",
        &[("x-semlb-output-tokens", "1000000")],
        &json!({"input": "x"}).to_string(),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    assert_eq!(
        server.sim.engine().stats().prompt_tokens,
        0,
        "no bad request reaches the engine"
    );
    server.stop().await;

    // Injected failures keep each API's shape.
    let server = start_with(FaultConfig {
        fail_rate: 1.0,
        ..FaultConfig::default()
    })
    .await;
    let r = post(server.addr, "/v1/messages", &json!({"max_tokens": 5, "messages": user})).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(r.json()["error"]["type"], "api_error");
    let r = post(server.addr, "/v1/responses", &json!({"input": "x"})).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(r.json()["error"]["type"], "server_error");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_new_endpoints_are_logged_and_counted() {
    let server = start().await;
    ok(
        server.addr,
        "/v1/responses",
        &json!({"input": "x", "max_output_tokens": 2}),
    )
    .await;
    ok(
        server.addr,
        "/v1/messages",
        &json!({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    let log = call(server.addr, Method::GET, "/sim/requests", &[], "").await.json();
    let seen: Vec<(String, String)> = log["requests"]
        .as_array()
        .expect("requests")
        .iter()
        .map(|r| {
            (
                r["path"].as_str().unwrap_or_default().to_owned(),
                r["outcome"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("/v1/responses".to_owned(), "completed".to_owned()),
            ("/v1/messages".to_owned(), "completed".to_owned())
        ]
    );
    let stats = server.sim.engine().stats();
    assert_eq!((stats.requests_finished, stats.generation_tokens), (2, 4));
    let metrics = call(server.addr, Method::GET, "/metrics", &[], "").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.lines()
            .any(|l| l.starts_with("vllm:request_success_total") && l.ends_with(" 2.0")),
        "{text}"
    );
    server.stop().await;
}
