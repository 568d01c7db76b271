//! The APIs agents speak, through the gateway as agents send them: OpenAI's
//! Responses API and Anthropic's Messages API as inference, tools in the
//! hashed prompt, stored responses and agent sessions. `semlb serve` with
//! 2 dispatchers in front of three simulated engines (real processes on
//! loopback), each turn sent the instant the previous answer ended.
//!
//! Shown here:
//! - conversations over Responses and Messages, streamed, stay on their
//!   engine, routed by prefix, with the engine's reported cached tokens
//!   growing turn by turn;
//! - agent loops of 10 turns with tool calls and results, in each of the
//!   three APIs: from the second turn every turn is a prefix hit on its
//!   engine (the tool call the engine generated is in the next prompt
//!   exactly as the template renders it);
//! - `previous_response_id` reaches the engine that stored the response,
//!   turn after turn across both dispatchers, and after a hot restart; an
//!   id no engine holds is the gateway's 404, and a request that carries
//!   its whole conversation is then sent without it;
//! - 20 agent sessions keyed by header, sent at once, stay on their
//!   engines (≥ 95 % of later turns) and spread over the engines; agents
//!   that compact their context (each step a prompt never seen past the
//!   system prompt) stay on theirs by their key alone;
//! - the context check, the response cache and the rate limits apply to
//!   both APIs, with errors in Anthropic's shape on `/v1/messages`.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use semlb_test_support as support;
use support::gateway::{Gateway, add_key, limit_tenant, routed, sim};
use support::http::{Response, http};
use support::process::Proc;
use support::redis::RedisServer;

fn unique(tag: &str) -> String {
    support::process::unique("agents", tag)
}

/// A gateway with 2 dispatchers in front of `engines`, with `config`.
fn gateway(tag: &str, engines: &[&Proc], config: &str) -> Gateway {
    Gateway::builder()
        .shm(&unique(tag))
        .backends(engines)
        .dispatchers(2)
        .config(config)
        .start()
}

/// The value of the sample `name{labels}` in a `/metrics` text (0 when
/// absent).
fn sample(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0)
}

const PATHS: [&str; 3] = ["/v1/chat/completions", "/v1/responses", "/v1/messages"];

/// A system prompt of about 300 tokens, distinct per `tag`.
fn system_prompt(tag: &str) -> String {
    (0..60).map(|i| format!(" {tag}-{}", i % 29)).collect()
}

/// The body of a turn of `path`'s API over `history` (that API's items).
fn body(path: &str, system: &str, history: &[Value], tools: bool, stream: bool) -> Value {
    let mut b = match path {
        "/v1/chat/completions" => {
            let mut messages = vec![json!({"role": "system", "content": system})];
            messages.extend(history.iter().cloned());
            json!({"messages": messages, "max_tokens": 48, "stream_options": {"include_usage": true}})
        }
        "/v1/responses" => json!({"instructions": system, "input": history, "max_output_tokens": 48, "store": false}),
        _ => json!({"system": system, "messages": history, "max_tokens": 48}),
    };
    b["model"] = json!("semlb-sim");
    b["stream"] = json!(stream);
    if tools {
        b["tools"] = match path {
            "/v1/chat/completions" => json!([{"type": "function", "function": {"name": "search_code",
                "description": "Searches the repository.", "parameters": {"type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]}}}]),
            "/v1/responses" => {
                json!([{"type": "function", "name": "search_code", "description": "Searches the repository.",
                "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"]}}])
            }
            _ => json!([{"name": "search_code", "description": "Searches the repository.", "input_schema":
                {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"]}}]),
        };
    }
    b
}

/// What a client read of one answer.
#[derive(Debug, Clone)]
struct Answer {
    backend: String,
    route: String,
    /// The engine's cached prompt tokens, as the API reports them.
    cached: u64,
    /// The answer as the next turn's items (an assistant message, or a
    /// tool call and its result).
    items: Vec<Value>,
    /// It was a tool call.
    called: bool,
}

/// The events of an event stream, as JSON data.
fn events(r: &Response) -> Vec<Value> {
    r.text()
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}

/// The whole answer a stream of `path`'s API stands for (the last
/// `response.completed`'s response; a Messages stream's text and usage).
fn streamed_whole(path: &str, r: &Response) -> Value {
    let events = events(r);
    match path {
        "/v1/responses" => {
            let done = events.iter().rev().find(|e| e["type"] == "response.completed");
            done.expect("response.completed ends the stream")["response"].clone()
        }
        "/v1/messages" => {
            assert_eq!(events.last().map(|e| e["type"].clone()), Some(json!("message_stop")));
            let start = &events[0]["message"];
            let text: String = events
                .iter()
                .filter(|e| e["type"] == "content_block_delta" && e["delta"]["type"] == "text_delta")
                .filter_map(|e| e["delta"]["text"].as_str())
                .collect();
            json!({"content": [{"type": "text", "text": text}], "usage": start["usage"], "stop_reason": "end_turn"})
        }
        _ => {
            let text: String = events
                .iter()
                .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
                .collect();
            let usage = events.iter().rev().find(|e| e["usage"].is_object()).expect("usage")["usage"].clone();
            json!({"choices": [{"message": {"content": text}, "finish_reason": "stop"}], "usage": usage})
        }
    }
}

/// One turn of `path`'s API through the gateway at `addr`.
fn turn(addr: &str, path: &str, body: &Value, headers: &[(&str, &str)]) -> Answer {
    let r = http(addr, "POST", path, Some(body), headers).expect("request");
    assert_eq!(r.status, 200, "{path}: {}", r.text());
    let (backend, route) = routed(&r);
    let v = if body["stream"] == json!(true) {
        streamed_whole(path, &r)
    } else {
        r.json()
    };
    let (cached, items, called) = read_answer(path, &v);
    Answer {
        backend,
        route,
        cached,
        items,
        called,
    }
}

/// The cached tokens of an answer of `path`'s API, and the items that
/// answer becomes in the next turn.
fn read_answer(path: &str, v: &Value) -> (u64, Vec<Value>, bool) {
    let result = "3 matches in src/.";
    match path {
        "/v1/chat/completions" => {
            let message = &v["choices"][0]["message"];
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .expect("cached_tokens");
            match message["tool_calls"].as_array().filter(|c| !c.is_empty()) {
                Some(calls) => (
                    cached,
                    vec![
                        json!({"role": "assistant", "content": null, "tool_calls": calls}),
                        json!({"role": "tool", "tool_call_id": calls[0]["id"], "content": result}),
                    ],
                    true,
                ),
                None => (
                    cached,
                    vec![json!({"role": "assistant", "content": message["content"]})],
                    false,
                ),
            }
        }
        "/v1/responses" => {
            let cached = v["usage"]["input_tokens_details"]["cached_tokens"]
                .as_u64()
                .expect("cached_tokens");
            let item = &v["output"][0];
            if item["type"] == "function_call" {
                let call = json!({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                    "arguments": item["arguments"]});
                let output = json!({"type": "function_call_output", "call_id": item["call_id"], "output": result});
                (cached, vec![call, output], true)
            } else {
                let text = item["content"][0]["text"].clone();
                (cached, vec![json!({"role": "assistant", "content": text})], false)
            }
        }
        _ => {
            let cached = v["usage"]["cache_read_input_tokens"]
                .as_u64()
                .expect("cache_read_input_tokens");
            let block = &v["content"][0];
            if block["type"] == "tool_use" {
                let result = json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"],
                    "content": result}]});
                (
                    cached,
                    vec![json!({"role": "assistant", "content": [block]}), result],
                    true,
                )
            } else {
                (
                    cached,
                    vec![json!({"role": "assistant", "content": block["text"]})],
                    false,
                )
            }
        }
    }
}

/// A conversation of `turns` turns of `path`'s API (with tools, the
/// engine calls one every other turn), each sent the instant the previous
/// answer ended; after a text answer the user asks again.
fn converse(addr: &str, path: &str, tag: &str, turns: usize, tools: bool, stream: bool) -> Vec<Answer> {
    let system = system_prompt(tag);
    let mut history = vec![json!({"role": "user", "content": format!("Find where {tag} is defined.")})];
    let key = format!("Bearer agent-{tag}");
    (0..turns)
        .map(|t| {
            let a = turn(
                addr,
                path,
                &body(path, &system, &history, tools, stream),
                &[("authorization", &key)],
            );
            history.extend(a.items.iter().cloned());
            if !a.called {
                history.push(json!({"role": "user", "content": format!("Now turn {t}: and its callers?")}));
            }
            a
        })
        .collect()
}

/// Every turn after the first on the first turn's engine, routed by
/// prefix, with its cached tokens above the previous turn's.
fn assert_stays_and_hits(what: &str, turns: &[Answer]) {
    for (i, w) in turns.windows(2).enumerate() {
        assert_eq!(
            w[1].backend,
            turns[0].backend,
            "{what}: turn {} moved: {turns:#?}",
            i + 2
        );
        assert_eq!(w[1].route, "prefix", "{what}: turn {} by prefix: {turns:#?}", i + 2);
        assert!(
            w[1].cached > w[0].cached,
            "{what}: turn {}'s cached tokens grow: {turns:#?}",
            i + 2
        );
    }
}

#[test]
fn conversations_over_responses_and_messages_stay_on_their_engine() {
    let engines = [sim(), sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let gw = gateway("conv", &refs, "");
    let mut homes = BTreeSet::new();
    for path in ["/v1/responses", "/v1/messages"] {
        for i in 0..3 {
            let turns = converse(gw.addr(), path, &format!("c{i}{}", &path[4..7]), 4, false, true);
            assert_stays_and_hits(&format!("{path} #{i}"), &turns);
            homes.insert(turns[0].backend.clone());
        }
    }
    assert!(homes.len() > 1, "conversations spread: {homes:?}");
}

#[test]
fn agent_loops_with_tool_calls_hit_their_prefix_every_turn() {
    let engines = [sim(), sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let gw = gateway("tools", &refs, "");
    for path in PATHS {
        let turns = converse(gw.addr(), path, &format!("tool{}", &path[4..7]), 10, true, false);
        let calls = turns.iter().filter(|a| a.called).count();
        assert_eq!(calls, 5, "{path}: a tool call every other turn: {turns:#?}");
        assert_stays_and_hits(path, &turns);
    }
}

/// A Responses turn continuing `previous` (stored), with one new message.
fn continued(addr: &str, chain: usize, previous: Option<&str>, text: &str) -> Response {
    let mut b = json!({"model": "semlb-sim", "input": [{"role": "user", "content": text}], "max_output_tokens": 24,
        "instructions": system_prompt(&format!("chain{chain}"))});
    if let Some(id) = previous {
        b["previous_response_id"] = json!(id);
    }
    http(addr, "POST", "/v1/responses", Some(&b), &[]).expect("request")
}

#[test]
fn a_stored_response_is_continued_on_the_engine_that_stored_it() {
    let engines = [sim(), sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let shm = unique("stored");
    let start = || Gateway::builder().shm(&shm).backends(&refs).dispatchers(2).start();
    let gw = start();
    // Several chains at once, so the engines share the load and a chain
    // continued anywhere but on its engine would be answered 404.
    let mut chains: Vec<(String, String)> = (0..4)
        .map(|i| {
            let r = continued(gw.addr(), i, None, &format!("Chain {i}: begin."));
            assert_eq!(r.status, 200, "{}", r.text());
            (r.json()["id"].as_str().unwrap().to_owned(), routed(&r).0)
        })
        .collect();
    let engines_used: BTreeSet<&String> = chains.iter().map(|(_, e)| e).collect();
    assert!(engines_used.len() > 1, "the chains spread: {chains:?}");
    let mut continue_all = |gw: &Gateway, rounds: usize| {
        for round in 0..rounds {
            for (i, (id, engine)) in chains.iter_mut().enumerate() {
                let r = continued(gw.addr(), i, Some(id), &format!("Chain {i}, step {round}: go on."));
                assert_eq!(r.status, 200, "chain {i} step {round}: {}", r.text());
                let (backend, route) = routed(&r);
                assert_eq!(
                    (&backend, route.as_str()),
                    (&*engine, "stored_response"),
                    "chain {i} step {round}"
                );
                *id = r.json()["id"].as_str().unwrap().to_owned();
            }
        }
    };
    // Each request on a new connection, spread over the two dispatchers
    // by the kernel (SO_REUSEPORT): a chain's steps are recorded by one
    // dispatcher and continued by either.
    continue_all(&gw, 5);

    // An id no engine holds: the gateway's 404, in OpenAI's shape.
    let r = continued(gw.addr(), 0, Some("resp_unknown"), "Hello?");
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "response_not_found");
    // One that carries its whole conversation is sent without it.
    let whole = json!({"model": "semlb-sim", "previous_response_id": "resp_unknown", "max_output_tokens": 8,
        "input": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": "Again?"}]});
    let r = http(gw.addr(), "POST", "/v1/responses", Some(&whole), &[]).expect("request");
    assert_eq!(r.status, 200, "a whole conversation is answered: {}", r.text());
    // What `semlb status` and /metrics show of it: 20 continued, 2 not
    // found (the 404 and the whole conversation sent without the id).
    let m = gw.metrics();
    let stored = |outcome: &str| {
        sample(
            &m,
            &format!("semlb_affinity_routes_total{{kind=\"stored_response\",outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!((stored("continued"), stored("not_found")), (20, 2), "{m}");
    let responses = |code: &str| {
        sample(
            &m,
            &format!("semlb_requests_total{{endpoint=\"responses\",code=\"{code}\"}}"),
        )
    };
    assert_eq!((responses("200"), responses("404")), (25, 1), "{m}");

    // After a hot restart the table is the segment's: the chains go on.
    assert_eq!(gw.stop_keeping_segment(), Some(0));
    let gw = start();
    continue_all(&gw, 2);
}

/// Stored responses with the routing state in Redis, across two gateways
/// (two hosts) on one Redis: chains begun through one are continued
/// through either in turn, each step sent the instant the previous answer
/// ended, and every step reaches the engine that stored its previous
/// response (the record is in Redis before the answer's end reaches the
/// client: a continuation through the other host finds it).
#[test]
fn a_stored_response_is_continued_through_another_host_on_one_redis() {
    let Some(redis) = RedisServer::start() else { return };
    let engines = [sim(), sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let host = |tag: &str| {
        Gateway::builder()
            .shm(&unique(tag))
            .backends(&refs)
            .dispatchers(2)
            .redis(&redis.url(), "stored")
            .start()
    };
    let hosts = [host("stored-a"), host("stored-b")];
    let mut chains: Vec<(String, String)> = (0..4)
        .map(|i| {
            let r = continued(hosts[0].addr(), 10 + i, None, &format!("Chain {i}: begin."));
            assert_eq!(r.status, 200, "{}", r.text());
            (r.json()["id"].as_str().unwrap().to_owned(), routed(&r).0)
        })
        .collect();
    let engines_used: BTreeSet<&String> = chains.iter().map(|(_, e)| e).collect();
    assert!(engines_used.len() > 1, "the chains spread: {chains:?}");
    for step in 0..6 {
        for (i, (id, engine)) in chains.iter_mut().enumerate() {
            let gw = &hosts[(step + i) % 2];
            let r = continued(gw.addr(), 10 + i, Some(id), &format!("Chain {i}, step {step}: go on."));
            assert_eq!(r.status, 200, "chain {i} step {step}: {}", r.text());
            let (backend, route) = routed(&r);
            assert_eq!(
                (&backend, route.as_str()),
                (&*engine, "stored_response"),
                "chain {i} step {step}"
            );
            *id = r.json()["id"].as_str().unwrap().to_owned();
        }
    }
}

/// The engine of each turn of a session `s` of agent sessions over
/// Messages, streamed, keyed by `x-session-id`; `task` is its first user
/// message.
fn session_turn(addr: &str, s: usize, history: &mut Vec<Value>, t: usize) -> String {
    let b = body("/v1/messages", &system_prompt("shared"), history, true, true);
    let session = format!("session-{s}");
    let a = turn(
        addr,
        "/v1/messages",
        &b,
        &[("x-session-id", &session), ("x-api-key", "k")],
    );
    history.extend(a.items.iter().cloned());
    if !a.called {
        history.push(json!({"role": "user", "content": format!("Step {t} done; next.")}));
    }
    a.backend
}

/// Of sessions' later turns, how many stayed on the session's first engine,
/// of how many; and how many sessions began on each engine.
fn stayed(sessions: &[Vec<String>]) -> (usize, usize, BTreeMap<&String, usize>) {
    let later = sessions.iter().map(|s| s.len() - 1).sum::<usize>();
    let stayed = sessions
        .iter()
        .map(|s| s[1..].iter().filter(|b| **b == s[0]).count())
        .sum::<usize>();
    let mut per_engine: BTreeMap<&String, usize> = BTreeMap::new();
    for s in sessions {
        *per_engine.entry(&s[0]).or_default() += 1;
    }
    (stayed, later, per_engine)
}

#[test]
fn agent_sessions_keyed_by_header_stay_on_their_engines() {
    let engines = [sim(), sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let gw = gateway("sessions", &refs, "");
    // 20 agents at once, one system prompt and tools, each its own task,
    // each step sent the instant the last ended.
    let threads: Vec<_> = (0..20)
        .map(|s| {
            let addr = gw.addr().to_owned();
            std::thread::spawn(move || {
                let mut history = vec![json!({"role": "user", "content": format!("Task {s}: refactor module {s}.")})];
                (0..6)
                    .map(|t| session_turn(&addr, s, &mut history, t))
                    .collect::<Vec<String>>()
            })
        })
        .collect();
    let sessions: Vec<Vec<String>> = threads.into_iter().map(|t| t.join().expect("session")).collect();
    let (kept, later, per_engine) = stayed(&sessions);
    assert!(
        kept * 100 >= later * 95,
        "{kept} of {later} later turns stayed: {sessions:?}"
    );
    assert!(per_engine.len() > 1, "sessions spread over the engines: {per_engine:?}");

    // Agents that compact their context: each step sends a summary never
    // seen before, so no engine holds anything of it past the shared
    // system prompt and only the key tells where the session is. One
    // request at a time, so load never moves them either.
    let mut sessions: Vec<Vec<String>> = vec![Vec::new(); 20];
    for t in 0..4 {
        for (s, engines) in sessions.iter_mut().enumerate() {
            let mut history =
                vec![json!({"role": "user", "content": format!("Summary {t} of session {s}: {}", "x".repeat(t + s))})];
            engines.push(session_turn(gw.addr(), 100 + s, &mut history, t));
        }
    }
    let (kept, later, per_engine) = stayed(&sessions);
    assert_eq!(kept, later, "by key alone: {sessions:?}");
    assert!(per_engine.len() > 1, "spread: {per_engine:?}");
    // What `semlb status` and /metrics show: 40 sessions begun, every
    // later turn of the 200 kept or moved, and 200 Messages answered.
    let m = gw.metrics();
    let session = |outcome: &str| {
        sample(
            &m,
            &format!("semlb_affinity_routes_total{{kind=\"session\",outcome=\"{outcome}\"}}"),
        )
    };
    let (kept, moved, new) = (session("kept"), session("moved"), session("new"));
    assert_eq!((new, kept + moved), (40, 160), "{m}");
    assert!(kept * 100 >= 160 * 95, "{kept} kept, {moved} moved");
    let answered = sample(&m, "semlb_requests_total{endpoint=\"messages\",code=\"200\"}");
    assert_eq!(answered, 200, "{m}");
}

#[test]
fn limits_context_and_cache_apply_to_both_apis() {
    let engine = sim();
    let dir = support::TempDir::new("agents-limits");
    let file = dir.0.join("keys.toml").display().to_string();
    let key = add_key(&file, "agent", &[]).0;
    limit_tenant(&file, "agent", &["--tokens-per-minute", "3000"]);
    let gw = gateway(
        "limits",
        &[&engine],
        &format!("[auth]\nkeys_file = \"{file}\"\ndebug_headers = true\n"),
    );
    let bearer = format!("Bearer {key}");
    let x_api_key = key.clone();
    // The context check: a prompt longer than the engine's context.
    let long: String = "word ".repeat(40_000);
    let big = json!({"model": "semlb-sim", "max_tokens": 10, "messages": [{"role": "user", "content": long}]});
    let r = http(
        gw.addr(),
        "POST",
        "/v1/messages",
        Some(&big),
        &[("x-api-key", &x_api_key)],
    )
    .unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["type"], "error", "Anthropic's shape: {}", r.text());
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    let big = json!({"model": "semlb-sim", "max_output_tokens": 10, "input": long});
    let r = http(
        gw.addr(),
        "POST",
        "/v1/responses",
        Some(&big),
        &[("authorization", &bearer)],
    )
    .unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded", "{}", r.text());
    // The response cache: a deterministic repeat, non-streamed.
    for (path, b) in [
        (
            "/v1/responses",
            json!({"model": "semlb-sim", "input": "Name a prime.", "temperature": 0, "max_output_tokens": 8}),
        ),
        (
            "/v1/messages",
            json!({"model": "semlb-sim", "messages": [{"role": "user", "content": "Name a prime."}],
            "temperature": 0, "max_tokens": 8}),
        ),
    ] {
        let first = http(gw.addr(), "POST", path, Some(&b), &[("authorization", &bearer)]).unwrap();
        assert_eq!(
            (first.status, first.header("x-semlb-cache")),
            (200, Some("miss")),
            "{path}: {}",
            first.text()
        );
        let again = support::gateway::wait_for(path, std::time::Duration::from_secs(10), || {
            let r = http(gw.addr(), "POST", path, Some(&b), &[("authorization", &bearer)]).unwrap();
            (r.header("x-semlb-cache") == Some("hit"), r)
        });
        // An answer stored (the first, or a repeat sent before the first
        // was written back): the same text.
        let text = |v: Value| match path {
            "/v1/responses" => v["output"][0]["content"][0]["text"].clone(),
            _ => v["content"][0]["text"].clone(),
        };
        assert_eq!(text(again.json()), text(first.json()), "{path}: a stored answer");
        // A client that streams the same request gets the stored answer as
        // its API's events.
        let mut streamed = b.clone();
        streamed["stream"] = json!(true);
        let r = http(gw.addr(), "POST", path, Some(&streamed), &[("authorization", &bearer)]).unwrap();
        assert_eq!(
            (r.status, r.header("x-semlb-cache")),
            (200, Some("hit")),
            "{path}: {}",
            r.text()
        );
        assert_eq!(text(streamed_whole(path, &r)), text(first.json()), "{path}: replayed");
    }
    // The tenant's token bucket: spent by large prompts, then 429 in each
    // API's shape.
    let spend =
        json!({"model": "semlb-sim", "max_tokens": 10, "messages": [{"role": "user", "content": "word ".repeat(300)}]});
    let refused = (0..20)
        .map(|_| {
            http(
                gw.addr(),
                "POST",
                "/v1/messages",
                Some(&spend),
                &[("x-api-key", &x_api_key)],
            )
            .unwrap()
        })
        .find(|r| r.status == 429)
        .expect("the bucket runs out");
    assert_eq!(refused.json()["type"], "error", "{}", refused.text());
    assert_eq!(refused.json()["error"]["type"], "rate_limit_error");
}
