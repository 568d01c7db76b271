//! Streams that survive their engine (`semlb::dispatcher::resume`), with
//! real processes: an engine SIGKILLed by this test mid-answer, and the
//! simulator's own faults (`--stream-fault die|stall|error`). The client
//! reads one answer: one `id`, no error, `data: [DONE]` last, the text of
//! the uninterrupted answer (the simulator continues a text it began as a
//! deterministic model would, so the resumed answer must equal the one
//! the surviving engine gives the same request whole), and usage that
//! counts the original prompt and all the output. A stream that may not
//! be resumed ends with an error event and `data: [DONE]`, never by just
//! stopping.

use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use serde_json::{Value, json};

use semlb_test_support as support;
use support::gateway::{Gateway, user};
use support::http::http;
use support::process::{Proc, Stderr};
use support::sse::{Streamed, stream, stream_to};

fn unique(tag: &str) -> String {
    support::process::unique("resume", tag)
}

/// A simulated engine whose decode step lasts 3 ms real time (300 tokens
/// take about a second), with `extra` flags.
fn slow_sim(extra: &[&str]) -> Proc {
    support::engines::sim_with("0.3", extra)
}

/// A chat request's body: one conversation, `tokens` output tokens.
fn body(topic: &str, tokens: u32, extra: Value) -> Value {
    let mut body = json!({
        "model": "semlb-sim",
        "messages": [
            {"role": "system", "content": "You are a careful writer."},
            user(&format!("Write a long report on {topic}.")),
        ],
        "max_tokens": tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    body
}

/// The answer `engine` gives `body` whole (the uninterrupted answer).
fn reference(engine: &Proc, body: &Value) -> Streamed {
    stream(&engine.addr, body, |_| {})
}

/// A gateway over `engines` (least load), with `toml` in its config and
/// its stderr captured.
fn gateway(tag: &str, engines: &[&Proc], toml: &str) -> Gateway {
    Gateway::builder()
        .shm(&unique(tag))
        .backends(engines)
        .policy("least_load")
        .config(toml)
        .stderr(Stderr::CaptureEcho)
        .start()
}

/// The simulator's own faults: the first stream of the faulty engine
/// breaks after 40 tokens; the answer completes as the one answer the
/// other engine gives the request whole: on the other engine after a
/// death or a stall, on the same engine after an error event (it is
/// alive, and its cache holds the prompt and the text so far: the
/// continuation finds them there).
fn resumed_after(fault: &str, toml: &str) {
    let faulty = slow_sim(&[
        "--stream-fault",
        fault,
        "--stream-fault-after",
        "40",
        "--stream-fault-count",
        "1",
    ]);
    let good = slow_sim(&[]);
    let gw = gateway(fault, &[&faulty, &good], toml);
    // Sent until one lands on the faulty engine (least load: the first
    // goes to either).
    for i in 0..6 {
        let request = body(&format!("rivers {fault} {i}"), 120, json!({}));
        let got = stream(&gw.proc.addr, &request, |_| {});
        got.assert_clean();
        let whole = reference(&good, &request);
        assert_eq!(
            got.text, whole.text,
            "{fault}: the resumed text is the uninterrupted answer's"
        );
        assert_eq!(got.finish.as_deref(), Some("length"));
        assert_eq!(got.usage.as_ref().map(|u| &u["completion_tokens"]), Some(&json!(120)));
        assert_eq!(
            got.usage.as_ref().map(|u| &u["prompt_tokens"]),
            whole.usage.as_ref().map(|u| &u["prompt_tokens"]),
            "the original prompt's tokens"
        );
        if got.backend == faulty.addr {
            let on = match fault {
                "error" => "resuming it on the same engine first",
                _ => "resuming it on another engine",
            };
            let log = gw.proc.wait_stderr(0, on, Duration::from_secs(10));
            assert!(log.contains(&format!("broke ({})", resume_reason(fault))), "{log}");
            if fault != "die" {
                // The faulty engine's first request was this one: a prefix
                // cache hit there is the continuation's.
                let hits = prefix_cache_hits(&faulty);
                assert_eq!(hits > 0.0, fault == "error", "{fault}: prefix cache hits {hits}");
            }
            return;
        }
    }
    panic!("no request reached the faulty engine");
}

/// `engine`'s `vllm:prefix_cache_hits_total`: prompt tokens it found
/// cached.
fn prefix_cache_hits(engine: &Proc) -> f64 {
    let metrics = http(&engine.addr, "GET", "/metrics", None, &[]).expect("the engine's metrics");
    String::from_utf8_lossy(&metrics.body)
        .lines()
        .filter(|l| l.starts_with("vllm:prefix_cache_hits_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn resume_reason(fault: &str) -> &'static str {
    match fault {
        "die" => "cut",
        "stall" => "stall",
        _ => "error_event",
    }
}

#[test]
fn an_engine_that_dies_mid_stream_is_resumed_on_another() {
    resumed_after("die", "");
}

#[test]
fn an_error_event_mid_stream_is_resumed_on_the_same_engine_first() {
    resumed_after("error", "");
}

#[test]
fn a_stalled_stream_is_resumed_on_another_engine() {
    resumed_after("stall", "[resume]\nstall_ms = 300\n");
}

/// The test's own SIGKILL: after the client has read 50 tokens of a
/// 300-token answer, the engine streaming it is killed.
#[test]
fn an_engine_sigkilled_after_50_tokens_leaves_the_client_one_whole_answer() {
    let engines = [slow_sim(&[]), slow_sim(&[])];
    let gw = gateway("sigkill", &[&engines[0], &engines[1]], "");
    let request = body("the history of bridges", 300, json!({"ignore_eos": true}));
    let mut killed = None;
    let got = stream(&gw.proc.addr, &request, |so_far| {
        if killed.is_none() && so_far.chunks >= 50 {
            let victim = engines
                .iter()
                .find(|e| e.addr == so_far.backend)
                .expect("the backend is one of ours");
            kill(victim.pid(), Signal::SIGKILL).expect("SIGKILL");
            killed = Some((victim.addr.clone(), so_far.chunks));
        }
    });
    let (victim, at) = killed.expect("the engine was killed mid-stream");
    assert!(at < 300, "killed after {at} of 300 tokens");
    gw.proc.wait_stderr(0, "(resumption 1)", Duration::from_secs(10));
    got.assert_clean();
    let survivor = engines.iter().find(|e| e.addr != victim).unwrap();
    let whole = reference(survivor, &request);
    assert_eq!(got.text, whole.text, "the first {at} tokens and their continuation");
    assert_eq!(got.usage.as_ref().map(|u| &u["completion_tokens"]), Some(&json!(300)));
    assert_eq!(
        got.usage.as_ref().map(|u| &u["prompt_tokens"]),
        whole.usage.as_ref().map(|u| &u["prompt_tokens"])
    );
}

/// Every engine breaks every stream after 40 tokens: a 100-token answer
/// needs two resumptions (40 + 40 + 20) and completes; a 200-token one
/// runs out of them (`resume.max_attempts = 2`) and ends with an error
/// event, then `data: [DONE]`.
#[test]
fn two_resumptions_complete_an_answer_and_a_third_is_refused() {
    let engines: Vec<Proc> = (0..3)
        .map(|_| slow_sim(&["--stream-fault", "error", "--stream-fault-after", "40"]))
        .collect();
    let refs: Vec<&Proc> = engines.iter().collect();
    let gw = gateway("twice", &refs, "");
    let request = body("lighthouses", 100, json!({}));
    let got = stream(&gw.proc.addr, &request, |_| {});
    got.assert_clean();
    let whole = {
        // The uninterrupted answer, from an engine without the fault.
        let clean = slow_sim(&[]);
        reference(&clean, &request)
    };
    assert_eq!(got.text, whole.text);
    assert_eq!(got.usage.as_ref().map(|u| &u["completion_tokens"]), Some(&json!(100)));
    let log = gw.proc.wait_stderr(0, "(resumption 2)", Duration::from_secs(10));
    assert!(log.contains("(resumption 1)"), "{log}");

    let request = body("canals", 200, json!({}));
    let got = stream(&gw.proc.addr, &request, |_| {});
    assert!(got.done_last, "[DONE] ends it:\n{}", got.raw);
    assert_eq!(got.errors.len(), 1, "one error event:\n{}", got.raw);
    let message = got.errors[0]["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("resume.max_attempts"), "{message}");
    // What came before the error is the answer's beginning, 120 tokens.
    assert_eq!(got.chunks, 120, "{}", got.raw);
    // Two resumptions each, and the third break not resumed.
    let metrics = gw.metrics();
    for (outcome, n) in [("resumed", 4), ("not_resumed", 1), ("failed", 0)] {
        let line = format!("semlb_stream_resumptions_total{{reason=\"error_event\",outcome=\"{outcome}\"}} {n}");
        assert!(metrics.lines().any(|l| l == line), "{line} in:\n{metrics}");
    }
}

/// A request the gateway may not resume (a JSON schema, logprobs), or
/// with resumption off: the client's stream ends with an error event and
/// `data: [DONE]`, never just stops, and nothing is resent.
#[test]
fn a_stream_that_may_not_be_resumed_ends_with_an_error_event_and_done() {
    let faulty = slow_sim(&["--stream-fault", "error", "--stream-fault-after", "30"]);
    let gw = gateway("blocked", &[&faulty], "");
    let schema =
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}});
    for (extra, why) in [(schema, "structured output"), (json!({"logprobs": true}), "logprobs")] {
        let got = stream(&gw.proc.addr, &body("maps", 100, extra), |_| {});
        assert!(got.done_last, "{}", got.raw);
        assert_eq!(got.errors.len(), 1, "{}", got.raw);
        let message = got.errors[0]["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(why), "{message}");
        assert_eq!(got.chunks, 30, "{}", got.raw);
    }
    assert!(!gw.proc.stderr_text().contains("resuming it"), "nothing resumed");
    drop(gw);

    let faulty = slow_sim(&["--stream-fault", "error", "--stream-fault-after", "30"]);
    let other = slow_sim(&[]);
    let gw = gateway("off", &[&faulty, &other], "[resume]\nenabled = false\n");
    for i in 0..6 {
        let got = stream(&gw.proc.addr, &body(&format!("tides {i}"), 80, json!({})), |_| {});
        assert!(got.done_last, "{}", got.raw);
        if got.backend == faulty.addr {
            assert_eq!(got.errors.len(), 1, "{}", got.raw);
            let message = got.errors[0]["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains("resume.enabled"), "{message}");
            assert_eq!(got.chunks, 30, "{}", got.raw);
            return;
        }
        got.assert_clean();
    }
    panic!("no request reached the faulty engine");
}

/// A completions stream is resumed with the text so far on its prompt:
/// the client reads the faulty engine's first 40 tokens, then what an
/// engine continues that prompt and text with.
#[test]
fn a_completions_stream_is_resumed_from_its_prompt_and_text() {
    let faulty = slow_sim(&[
        "--stream-fault",
        "error",
        "--stream-fault-after",
        "40",
        "--stream-fault-count",
        "1",
    ]);
    let good = slow_sim(&[]);
    let gw = gateway("completions", &[&faulty, &good], "");
    let ask = |addr: &str, prompt: &str, tokens: u32| {
        let body = json!({"model": "semlb-sim", "prompt": prompt, "max_tokens": tokens, "stream": true,
                          "stream_options": {"include_usage": true}});
        stream_to(addr, "/v1/completions", &body, |_| {})
    };
    for i in 0..6 {
        let prompt = format!("The story of harbour {i}:");
        let got = ask(&gw.proc.addr, &prompt, 100);
        got.assert_clean();
        if got.backend != faulty.addr {
            continue;
        }
        let whole = ask(&good.addr, &prompt, 100);
        let head: String = whole
            .text
            .split(' ')
            .skip(1)
            .take(40)
            .map(|w| format!(" {w}"))
            .collect();
        let rest = ask(&good.addr, &format!("{prompt}{head}"), 60);
        assert_eq!(got.text, format!("{head}{}", rest.text));
        assert_eq!(got.usage.as_ref().map(|u| &u["completion_tokens"]), Some(&json!(100)));
        assert_eq!(
            got.usage.as_ref().map(|u| &u["prompt_tokens"]),
            whole.usage.as_ref().map(|u| &u["prompt_tokens"])
        );
        return;
    }
    panic!("no request reached the faulty engine");
}

/// The simulator continues a text it began (`continue_final_message`) as
/// a deterministic model would: the rest of the answer it gives whole.
#[test]
fn the_simulators_continuation_is_the_rest_of_its_answer() {
    let engine = slow_sim(&[]);
    let ask = |messages: Value, extra: Value| {
        let mut b = json!({"model": "semlb-sim", "messages": messages, "max_tokens": 30});
        if let (Value::Object(b), Value::Object(e)) = (&mut b, extra) {
            b.extend(e);
        }
        let r = http(&engine.addr, "POST", "/v1/chat/completions", Some(&b), &[]).expect("request");
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let conversation = json!([user("Name the rivers of Europe.")]);
    let whole = ask(conversation.clone(), json!({}));
    let text = whole["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    // The first 12 words (each a token), continued: the other 18.
    let head: String = text.split(' ').skip(1).take(12).map(|w| format!(" {w}")).collect();
    assert!(text.starts_with(&head), "{text:?} / {head:?}");
    let mut continued = conversation.as_array().unwrap().clone();
    continued.push(json!({"role": "assistant", "content": head}));
    let rest = ask(
        Value::Array(continued),
        json!({"continue_final_message": true, "add_generation_prompt": false, "max_tokens": 18}),
    );
    assert_eq!(
        format!("{head}{}", rest["choices"][0]["message"]["content"].as_str().unwrap()),
        text
    );
    assert_eq!(rest["usage"]["completion_tokens"], 18);
    // Both on: vLLM's 400.
    let mut both = json!({"model": "semlb-sim", "messages": conversation, "continue_final_message": true});
    both["add_generation_prompt"] = json!(true);
    let r = http(&engine.addr, "POST", "/v1/chat/completions", Some(&both), &[]).expect("request");
    assert_eq!(r.status, 400, "{}", r.text());
}

/// A non-streamed request whose engine is SIGKILLed while it generates
/// (the engine accepted the request and had not answered yet) is sent
/// again to the other engine: the client gets one whole answer, from the
/// survivor, and never sees the failure.
#[test]
fn a_non_streamed_request_whose_engine_dies_before_answering_is_sent_again() {
    let engines = [slow_sim(&[]), slow_sim(&[])];
    let gw = gateway("plain-kill", &[&engines[0], &engines[1]], "");
    let mut request = body(
        "the history of tunnels",
        600,
        json!({"ignore_eos": true, "stream": false}),
    );
    request.as_object_mut().unwrap().remove("stream_options");
    let addr = gw.proc.addr.clone();
    let client = std::thread::spawn(move || http(&addr, "POST", "/v1/chat/completions", Some(&request), &[]));
    let running = |e: &Proc| {
        http(&e.addr, "GET", "/metrics", None, &[]).is_ok_and(|r| {
            String::from_utf8_lossy(&r.body)
                .lines()
                .any(|l| l.starts_with("vllm:num_requests_running") && !l.ends_with(" 0") && !l.ends_with(" 0.0"))
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let victim = loop {
        if let Some(e) = engines.iter().find(|e| running(e)) {
            break e;
        }
        assert!(std::time::Instant::now() < deadline, "no engine took the request");
        std::thread::sleep(Duration::from_millis(5));
    };
    kill(victim.pid(), Signal::SIGKILL).expect("SIGKILL");
    let answer = client.join().expect("the client thread").expect("an answer");
    assert_eq!(answer.status, 200, "{}", String::from_utf8_lossy(&answer.body));
    let survivor = engines.iter().find(|e| e.addr != victim.addr).unwrap();
    assert_eq!(
        answer.header("x-semlb-backend"),
        Some(format!("http://{}", survivor.addr).as_str())
    );
    let json = answer.json();
    assert_eq!(json["usage"]["completion_tokens"], 600, "{json}");
    assert_eq!(json["choices"][0]["finish_reason"], "length", "{json}");
}

/// An engine drained through the admin API while it streams an answer:
/// the stream runs on it until the drain deadline (1 s here), then moves
/// to the other engine by resumption. The drained engine is alive all
/// along and never cuts the answer; the client reads one whole answer.
#[test]
fn a_stream_on_a_drained_engine_moves_to_another_at_the_drain_deadline() {
    let engines = [slow_sim(&[]), slow_sim(&[])];
    let gw = Gateway::builder()
        .shm(&unique("drain"))
        .backends(&[&engines[0], &engines[1]])
        .policy("least_load")
        .config("drain_timeout_secs = 1\n")
        .admin("resume-drain-token")
        .stderr(Stderr::CaptureEcho)
        .start();
    let request = body("the history of canals", 1500, json!({"ignore_eos": true}));
    let mut drained = None;
    let got = stream(&gw.proc.addr, &request, |so_far| {
        if drained.is_none() && so_far.chunks >= 50 {
            let server = gw
                .admin_servers()
                .into_iter()
                .find(|s| s["address"].as_str().is_some_and(|a| a.ends_with(&so_far.backend)))
                .expect("the answering engine is listed");
            let deleted = gw.admin("DELETE", &format!("/admin/servers/{}", server["slot"]), None);
            assert_eq!(deleted.status, 202, "{deleted:?}");
            drained = Some(so_far.backend.clone());
        }
    });
    let victim = drained.expect("the engine was drained mid-stream");
    gw.proc.wait_stderr(0, "broke (drain)", Duration::from_secs(10));
    got.assert_clean();
    let drained_engine = engines.iter().find(|e| e.addr == victim).unwrap();
    assert!(
        http(&drained_engine.addr, "GET", "/health", None, &[]).is_ok_and(|r| r.status == 200),
        "the drained engine is still alive"
    );
    let survivor = engines.iter().find(|e| e.addr != victim).unwrap();
    let whole = reference(survivor, &request);
    assert_eq!(got.text, whole.text, "the drained engine's part and its continuation");
    assert_eq!(got.usage.as_ref().map(|u| &u["completion_tokens"]), Some(&json!(1500)));
}

/// A pool's `[model.resume]` replaces the global `[resume]`: with
/// resumption off globally, the pool that turns it on has its broken
/// stream resumed.
#[test]
fn a_pools_resume_table_overrides_the_global_one() {
    let faulty = slow_sim(&["--stream-fault", "error", "--stream-fault-after", "30"]);
    let other = slow_sim(&[]);
    let toml = format!(
        "[resume]\nenabled = false\n\n[[model]]\nname = \"semlb-sim\"\nbackends = [\"http://{}\", \"http://{}\"]\n\n[model.resume]\nenabled = true\n",
        faulty.addr, other.addr
    );
    let gw = gateway("pool", &[&faulty, &other], &toml);
    for i in 0..6 {
        let got = stream(&gw.proc.addr, &body(&format!("estuaries {i}"), 80, json!({})), |_| {});
        got.assert_clean();
        assert_eq!(got.usage.as_ref().map(|u| &u["completion_tokens"]), Some(&json!(80)));
        if got.backend == faulty.addr {
            gw.proc
                .wait_stderr(0, "resuming it on another engine", Duration::from_secs(10));
            return;
        }
    }
    panic!("no request reached the faulty engine");
}
